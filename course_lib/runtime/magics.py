"""``%%ranks``: run a notebook cell on every rank of a persistent :class:`~course_lib.runtime.world.World`.

    %load_ext course_lib
    %ranks start 4                  # 4 worker processes in one gloo group (--backend nccl on GPUs)

    %%ranks
    x = torch.full((2,), float(rank))      # rank, world_size, dist and torch are predefined
    dist.all_reduce(x)
    x                                      # each rank's last expression is shown under its rank

    %%ranks --only 0                # some ranks only (--only 0,2); --timeout 30 to wait longer or less
    %ranks pull x                   # notebook variable x = [rank 0's x, rank 1's x, ...]
    %ranks push lr batch            # send notebook variables to every rank, same names
    %ranks status                   # alive? pids, backend, process-group generation
    %ranks stop

Under ``make lab`` the magics are there from the kernel's start (and after a restart); ``%load_ext course_lib``
is then harmless. ``%ranks start`` says "started" once every rank has joined the process group, and refuses a
world far beyond the machine (see ``workers.max_local_ranks``).

Output is grouped by rank and updated live while the cell runs. Figures and ``display(...)`` come from the
lowest rank that ran the cell. An error shows that rank's traceback with the cell's lines; the world then
stays usable and says whether it had to recover (new process group, variables kept) or restart.
"""

from __future__ import annotations

import argparse
import collections
import shlex
import time
import traceback

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display, update_display

from .arguments import integer, real
from .launch import DEFAULT_TIMEOUT
from .tracebacks import name_cells
from .workers import TICK_SECONDS, check_world_fits, choose_backend
from .world import World


def load_ipython_extension(ipython):
    """Add ``%ranks`` and ``%%ranks`` to ``ipython``, once. Kernels that ``make lab`` starts load this module
    as an extension (``--ext=course_lib.runtime.magics``, in ``.jupyter/kernels/python3/kernel.json``), so the magics
    survive a kernel restart; a notebook's ``%load_ext course_lib`` then keeps them, and any running world."""
    if "RanksMagics" not in ipython.magics_manager.registry:
        ipython.register_magics(RanksMagics)


class CellSyntaxError(Exception):
    """A syntax error in a ``%%ranks`` cell, shown as IPython shows one in any cell: the cell, the line and a
    caret, without the frames of the magic that compiled it. No rank ran anything."""

    def __init__(self, error: SyntaxError):
        super().__init__(str(error))
        self.error = error

    def _render_traceback_(self):
        return name_cells("".join(traceback.format_exception_only(self.error))).splitlines()


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"%ranks: {message}\n{self.format_usage()}")


def _rank_list(text: str) -> list[int]:
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        ranks = []
    if not ranks:
        raise argparse.ArgumentTypeError(f"--only {text!r}: give rank numbers separated by commas, e.g. 0,2")
    return ranks


class GroupedOutput:
    """Lines printed by each rank, shown as one block per rank and redrawn as they arrive. Each redraw sends the
    whole block to the notebook, so a block shows a rank's last SHOWN_LINES lines, each cut at SHOWN_CHARS
    characters: a redraw costs the same at the 300,000th line as at the 300th (whole, 300k lines sent 138 MB)."""

    SHOWN_LINES, SHOWN_CHARS = 1000, 10_000

    def __init__(self, ranks: list[int], refresh_seconds: float = TICK_SECONDS):
        self.lines = {r: collections.deque(maxlen=self.SHOWN_LINES) for r in ranks}
        self.counts = dict.fromkeys(ranks, 0)
        self.display_id, self.refresh_seconds, self.last_draw, self.stale = None, refresh_seconds, 0.0, False

    def add(self, rank: int, stream: str, line: str) -> None:
        text = line.rstrip("\n")
        if len(text) > self.SHOWN_CHARS:
            line = f"{text[:self.SHOWN_CHARS]}… ({len(text) - self.SHOWN_CHARS:,} more characters)\n"
        self.lines.setdefault(rank, collections.deque(maxlen=self.SHOWN_LINES)).append(line)
        self.counts[rank] = self.counts.get(rank, 0) + 1
        self.stale = True
        self.tick()

    def tick(self) -> None:
        """Redraw if lines arrived since the last drawing, at most every ``refresh_seconds``."""
        if self.stale and time.monotonic() - self.last_draw > self.refresh_seconds:
            self.draw()

    def text(self) -> str:
        def hidden(r):
            earlier = self.counts.get(r, 0) - len(self.lines[r])
            return f"… {earlier:,} earlier lines not shown (the last {self.SHOWN_LINES:,} are)\n" if earlier else ""
        blocks = [f"── rank {r} ──\n" + hidden(r) + "".join(lines) for r, lines in self.lines.items() if lines]
        return "".join(block if block.endswith("\n") else block + "\n" for block in blocks)

    def draw(self) -> None:
        bundle = {"text/plain": self.text().rstrip("\n")}
        if not bundle["text/plain"]:
            return
        if self.display_id is None:
            self.display_id = display(bundle, raw=True, display_id=True).display_id
        else:
            update_display(bundle, raw=True, display_id=self.display_id)
        self.last_draw, self.stale = time.monotonic(), False


@magics_class
class RanksMagics(Magics):
    """The ``%ranks`` line magic and ``%%ranks`` cell magic. Holds this notebook's one world."""

    def __init__(self, shell):
        super().__init__(shell)
        self.world: World | None = None

    @line_cell_magic
    def ranks(self, line: str, cell: str | None = None):
        if cell is not None:
            return self._run_cell(line, cell)
        words = shlex.split(line)
        command, args = (words[0], words[1:]) if words else ("status", [])
        commands = {"start": self._start, "stop": self._stop, "status": self._status,
                    "pull": self._pull, "push": self._push}
        if command not in commands:
            raise UsageError(f"%ranks {command}: unknown; use one of {', '.join(commands)} (or %%ranks as a cell magic)")
        return commands[command](args)

    def _need_world(self) -> World:
        if self.world is None:
            raise UsageError("no ranks are running: start them first with %ranks start 4")
        return self.world

    def _start(self, args):
        parser = _Parser(prog="%ranks start")
        parser.add_argument("world_size", type=integer(1))
        parser.add_argument("--backend", choices=["gloo", "nccl"])
        options = parser.parse_args(args)
        try:   # the new world's rules, checked before the running world (and its variables) is stopped
            choose_backend(options.backend, options.world_size)
            check_world_fits(options.world_size)
        except ValueError as err:
            kept = " (the running world is kept)" if self.world is not None else ""
            raise UsageError(f"%ranks start: {str(err).rstrip('.')}{kept}")
        if self.world is not None:
            self.world.stop()
            self.world = None
        try:
            self.world = World(options.world_size, backend=options.backend)
        except ValueError as err:
            raise UsageError(f"%ranks start: {err}")
        print(f"{options.world_size} ranks started ({self.world.backend}); run code on them with %%ranks")

    def _stop(self, args):
        if self.world is not None:
            self.world.stop()
            self.world = None
            print("all ranks stopped")

    def _status(self, args):
        if self.world is None:
            print("no ranks are running (%ranks start 4 starts four)")
            return
        status = self.world.status()
        print(f"{status['world_size']} ranks, backend {status['backend']}, "
              f"process group generation {status['generation']}")
        for rank, (alive, pid, device) in enumerate(zip(status["alive"], status["pids"], status["devices"])):
            print(f"  rank {rank}: {'alive' if alive else 'DEAD'}  pid {pid}  {device}")

    def _pull(self, names):
        if not names:
            raise UsageError("%ranks pull NAME [NAME ...]: name the rank variables to fetch")
        world = self._need_world()
        for name in names:
            values = world.pull(name)
            self.shell.user_ns[name] = values
            print(f"{name} = list of {len(values)} values, one per rank")

    def _push(self, names):
        if not names:
            raise UsageError("%ranks push NAME [NAME ...]: name the notebook variables to send")
        missing = [name for name in names if name not in self.shell.user_ns]
        if missing:
            raise UsageError(f"%ranks push: the notebook has no variable {', '.join(missing)}")
        try:
            self._need_world().push(**{name: self.shell.user_ns[name] for name in names})
        except TypeError as error:
            raise UsageError(f"%ranks push: {error}") from None
        print(f"sent {', '.join(names)} to all {self.world.world_size} ranks")

    def _run_cell(self, line: str, cell: str):
        parser = _Parser(prog="%%ranks")
        parser.add_argument("--only", type=_rank_list, help="ranks to run on, e.g. 0 or 0,2")
        parser.add_argument("--timeout", type=real(above=0), default=DEFAULT_TIMEOUT, help="seconds")
        options = parser.parse_args(shlex.split(line))
        world = self._need_world()
        ranks = options.only if options.only is not None else list(range(world.world_size))
        # Register the cell's lines under IPython's own name for it ("Cell In[7]"); the leading newline
        # stands for the %%ranks line, so line numbers in a rank's traceback match the cell on screen.
        code = "\n" + cell
        filename = self.shell.compile.cache(code, self.shell.execution_count - 1)  # already counted up
        output = GroupedOutput(ranks)
        try:
            outcome = world.exec(code, ranks=ranks, timeout=options.timeout, filename=filename,
                                 on_output=output.add, on_tick=output.tick)
        except SyntaxError as err:
            raise CellSyntaxError(err) from None
        except ValueError as err:
            raise UsageError(f"%%ranks: {err}")
        for result in outcome.results:
            if result.value is not None:
                output.add(result.rank, "stdout", f"Out: {result.value}\n")
        output.draw()
        for result in outcome.results:
            for data, metadata in result.displays:
                display(data, metadata=metadata, raw=True)
        if outcome.world != "ok":
            print(f"The world {outcome.world}: {outcome.note}.")
        if outcome.error is not None:
            raise outcome.error
