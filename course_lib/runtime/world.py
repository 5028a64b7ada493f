"""A persistent world of N ranks that a notebook steps through, cell by cell.

``launch`` starts fresh processes for one function. To *watch* data parallelism you want the ranks to stay:
build the model on every rank in one cell, run forward in the next, look at each rank's gradients before and
after the all-reduce in a third. ``World`` keeps N worker processes (the same machinery as ``launch``) and gives
each rank a namespace that lives between cells:

    world = World(4)
    world.exec("x = torch.full((2,), float(rank))")     # runs on every rank; `rank`, `world_size`,
    world.exec("dist.all_reduce(x)")                    # `dist` and `torch` are predefined
    world.pull("x")                                     # [tensor([6., 6.]), tensor([6., 6.]), ...]

The ``%%ranks`` cell magic (``magics.py``) is a thin layer over this class.

Faults. A rank that raises keeps its variables, and so does the world. Its peers may be stuck in a
collective waiting for it; then the failed rank leaves the process group, which makes every peer's pending
collective fail within milliseconds, and all ranks join a fresh group ("generation"): the world *recovers*,
variables kept, but objects built on the old group (DDP wrappers, subgroups, device meshes) must be made
again. A rank that still does not answer is interrupted (SIGINT); failing that, the world *restarts*: new
processes, variables lost. A rank whose process died (the out-of-memory killer sends SIGKILL) is started again
and every rank joins a fresh group: the dead rank's variables are lost, the others keep theirs. Each time the
result says which happened.
"""

from __future__ import annotations

import ast
import io
import linecache
import os
import signal
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .arguments import check_number, check_sendable
from .processes import is_stopped, kill_group
from .rank_process import destroy_group, init_group
from .tracebacks import PLUMBING_FILES
from .workers import DEFAULT_TIMEOUT, FORM_TIMEOUT, Interrupted, RankError, RankTimeout, WorkerGroup, sigint_ignored

PLUMBING_FILES.add(__file__)  # a rank's traceback starts in the learner's cell, not in _run_cell

GRACE = 1.0  # seconds to wait for the other ranks after one failed, before deciding they are stuck
# Seconds a rank has to answer once freed (interrupted, or its collective failed). Waiting ends as soon as it
# answers (~10 ms when quiet), so this only bounds how long a rank that never answers delays the restart; a
# busy 2-core machine can take seconds to run a rank's signal handler.
RESPONSE_TIMEOUT = 5.0
# What became of the world after a cell, in words (CellOutcome.world is the key).
AFTERWARDS = {"ok": "they kept their variables and are ready for the next cell", "recovered": "the world recovered",
              "restarted": "the world restarted"}


@dataclass
class RankResult:
    """What one rank's part of a cell produced."""
    rank: int
    value: str | None = None                          # repr of the cell's last expression, if any
    displays: list = field(default_factory=list)      # rich outputs (mime bundles) from display()/figures
    error: RankError | None = None


@dataclass
class CellOutcome:
    """Every rank's result, and what the world had to do afterwards: "ok", "recovered" or "restarted"."""
    results: list[RankResult]
    world: str = "ok"
    note: str = ""
    timeout: RankTimeout | None = None

    @property
    def error(self) -> RankError | None:
        """The error to report: a timeout, or the earliest error of any rank (the one that caused the others)."""
        errors = [r.error for r in self.results if r.error is not None]
        return self.timeout or min(errors, key=lambda e: e.when, default=None)


class World:
    """``world_size`` persistent ranks with per-rank namespaces. See the module docstring."""

    def __init__(self, world_size: int, *, backend: str | None = None):
        self.world_size, self._backend_choice = world_size, backend
        self._start()

    def _start(self):
        self.group = WorkerGroup(self.world_size, backend=self._backend_choice, exit_after_error=False)
        self.generation = 0

    @property
    def backend(self) -> str:
        return self.group.backend

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # -------------------------------------------------------------------------------------------- cells

    def exec(self, code: str, *, ranks: list[int] | None = None, timeout: float = DEFAULT_TIMEOUT,
             filename: str = "<ranks>", on_output=None, on_tick=None) -> CellOutcome:
        """Run ``code`` on ``ranks`` (default: all) in their namespaces; the last expression's repr is kept.

        ``on_output(rank, stream, line)`` receives printed lines as they come; ``on_tick()`` is called every
        fraction of a second while the ranks work (to redraw, say). Rich outputs (``display(x)``,
        matplotlib figures) are kept from the lowest rank that ran. Never hangs: see the module docstring.
        """
        ranks = self.group.select(ranks)
        check_number("timeout", timeout, above=0)
        compile(code, filename, "exec")  # a syntax error is the notebook's, before any rank runs anything
        revived = self._revive_the_dead()
        relay = self.group.on_output
        self.group.on_output, self.group.on_tick = on_output or relay, on_tick
        try:
            self.group.submit(_run_cell, dict(code=code, filename=filename, display_rank=min(ranks)), ranks)
            outcome = self._finish(ranks, timeout)
        finally:
            self.group.on_output, self.group.on_tick = relay, None
        if revived:   # said first: it happened before this cell ran
            outcome.note = revived + (f"; then {outcome.note}" if outcome.note else "")
            if outcome.world == "ok":
                outcome.world = "recovered"
        return outcome

    def run(self, fn, *, ranks: list[int] | None = None, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list:
        """Run ``fn(rank, world_size, **kwargs)`` on the live ranks (their processes and group are kept)."""
        ranks = self.group.select(ranks)
        check_number("timeout", timeout, above=0)
        revived = self._revive_the_dead()
        if revived:
            print(f"The world recovered: {revived}.", file=sys.stderr)
        self.group.submit(fn, kwargs, ranks)
        outcome = self._finish(ranks, timeout)
        if outcome.error:
            raise outcome.error
        return [r.value for r in outcome.results]

    def pull(self, name: str, *, ranks: list[int] | None = None) -> list:
        """Each rank's value of the variable ``name``, in rank order."""
        return self.run(_get_variable, ranks=ranks, name=name)

    def push(self, *, ranks: list[int] | None = None, **values) -> None:
        """Set variables on every rank (or on ``ranks``): ``world.push(lr=0.1, batch=x)``. A value that cannot
        travel (a lock, an open file) is a TypeError naming it, before anything is sent."""
        check_sendable(values)
        self.run(_set_variables, ranks=ranks, values=values)

    def status(self) -> dict:
        """Which ranks are alive, their process ids, the backend and group generation."""
        return {"world_size": self.world_size, "backend": self.backend, "generation": self.generation,
                "alive": self.group.alive(), "pids": [p.pid for p in self.group.procs],
                "devices": ["cuda:%d" % r if self.backend == "nccl" else "cpu" for r in range(self.world_size)]}

    def stop(self) -> None:
        """Stop every rank; nothing is left running."""
        self.group.close()

    # ------------------------------------------------------------------------------- waiting, and faults

    def _revive_the_dead(self) -> str:
        """Before a cell: start again the ranks whose process died since the last one (SIGKILL from the
        out-of-memory killer, a segfault in a library, a kill -9), in a fresh process group with the others.
        Returns what happened, in words ("" if every rank was alive)."""
        dead = self.group.dead()
        if not dead:
            return ""
        how = "; ".join(f"rank {r}: {self.group.exit_description(r)}" for r in dead)
        gone = self._rejoin(restart=dead)
        if gone:
            self._restart_all()
            return (f"ranks {dead} had died ({how}); the process group could not be rebuilt, so all "
                    f"{self.world_size} ranks were restarted: their variables are lost")
        return (f"ranks {dead} had died ({how}) and were started again; all ranks joined a new process group "
                f"(generation {self.generation}): ranks {dead} lost their variables, the others kept theirs, but "
                "objects built on the old group (DDP wrappers, subgroups, device meshes) must be made again")

    def _restart_all(self) -> None:
        self.group.close()
        self._start()

    def _finish(self, ranks: list[int], timeout: float) -> CellOutcome:
        """Collect the replies of ``ranks``; on a failure, an interrupt or a timeout, make the world usable."""
        replies, interrupted, timeout_error = {}, False, None
        failed = lambda: any(reply[0] == "error" for reply in replies.values())  # noqa: E731
        try:
            replies = self.group.collect(ranks, timeout=timeout, stop_at_error=True)
            if failed():  # give the others a moment: are they done, or stuck waiting for the failed rank?
                replies.update(self.group.collect(self._missing(ranks, replies), timeout=GRACE, stop_at_error=False))
        except KeyboardInterrupt:  # the stop button: interrupt the ranks too
            interrupted = True
        with sigint_ignored():  # a second press must not leave the world half repaired
            stuck = self._missing(ranks, replies)
            if stuck and not interrupted and not failed():  # nobody failed, yet some never finished
                timeout_error = RankTimeout(stuck, timeout, self.group.stacks_of(stuck))
            outcome = self._repair(ranks, replies, interrupt_first=bool(stuck) and not failed())
        outcome.timeout = timeout_error
        if interrupted:
            raise Interrupted(f"the ranks were interrupted; {AFTERWARDS[outcome.world]}"
                              + (f": {outcome.note}" if outcome.note else ""))
        return outcome

    def _repair(self, ranks, replies, interrupt_first: bool) -> CellOutcome:
        """Free the ranks that have not answered, each step only if the previous ones did not free them all:
        interrupt them (SIGINT); make every idle rank leave the group, so that collectives waiting for it fail;
        interrupt again; restart the world. Then rebuild the process group if it was broken."""
        def wait_for_stuck(seconds):
            replies.update(self.group.collect(self._missing(ranks, replies), timeout=seconds, stop_at_error=False))

        def interrupt_stuck(seconds):
            for r in self._missing(ranks, replies):
                os.kill(self.group.procs[r].pid, signal.SIGINT)
            wait_for_stuck(seconds)

        note, left_group = "", False
        # A paused rank (SIGSTOP, Ctrl-Z) answers no signal and never will: end it at once, like a rank that died.
        # Its peers waiting for it in a collective then fail fast (its sockets close) and keep their variables.
        paused = [r for r in self._missing(ranks, replies) if is_stopped(self.group.procs[r].pid)]
        for r in paused:
            kill_group(self.group.procs[r])
        if paused:
            wait_for_stuck(GRACE)
        if interrupt_first and self._missing(ranks, replies):
            interrupt_stuck(GRACE)   # a Python loop answers at once; a rank inside a collective does not
        stuck, gone_from_group = self._missing(ranks, replies), []
        while True:  # a rank freed by the first leavers may have left others waiting for it: repeat
            idle = [r for r in range(self.world_size)
                    if r not in self._missing(ranks, replies) + gone_from_group + self.group.dead()]
            if not self._missing(ranks, replies) or not idle:
                break
            self.group.submit(_leave_group, None, idle)
            self.group.collect(idle, timeout=GRACE, stop_at_error=False)
            gone_from_group += idle
            wait_for_stuck(GRACE)   # the next round frees those still waiting for a rank freed in this one
        if gone_from_group:
            left_group = True
            note = (f"ranks {stuck} were stuck in a collective; the other ranks left the process group "
                    "so that it failed on every rank (a tensor that a failed collective was writing may hold "
                    "a partial result)")
        if self._missing(ranks, replies):
            if interrupt_first:   # interrupted already: on a busy machine the signal can take seconds to act
                wait_for_stuck(RESPONSE_TIMEOUT)
            else:
                interrupt_stuck(RESPONSE_TIMEOUT)
        gone, dead = self._missing(ranks, replies), self.group.dead()
        if not gone and (dead or left_group or any(_is_group_failure(reply) for reply in replies.values())):
            gone = self._rejoin(restart=dead)
            kept = f"ranks {dead} died and were started again (their variables are lost); " if dead else ""
            if gone:
                note = (note + "; " if note else "") + "the process group could not be rebuilt"
            else:
                note = (note + "; " if note else "") + kept + (
                    f"all ranks joined a new process group (generation {self.generation}): "
                    + ("the others kept their variables" if dead else "variables are kept")
                    + ", but objects built on the old group (DDP wrappers, subgroups, device meshes) must be made again")
            world = "recovered"
        else:
            world = "ok"
        if gone:
            self._restart_all()
            return CellOutcome(self._results(ranks, replies), "restarted", (note + "; " if note else "") +
                               f"ranks {gone} did not respond, so all {self.world_size} ranks were restarted: "
                               "their variables are lost")
        self.group.mark_idle()
        return CellOutcome(self._results(ranks, replies), world, note)

    def _rejoin(self, restart: list[int] = ()) -> list[int]:
        """Every rank joins a fresh process group, those in ``restart`` as fresh processes; returns the ranks
        that could not."""
        everyone = list(range(self.world_size))
        self.generation += 1
        self.group.restart_ranks(list(restart), self.generation)
        self.group.submit(_rejoin_group, dict(backend=self.backend, store_port=self.group.store_port,
                                              generation=self.generation, store_key=self.group.store_key),
                          [r for r in everyone if r not in restart])
        rejoined = self.group.collect(everyone, timeout=FORM_TIMEOUT, stop_at_error=False)
        return [r for r in everyone if rejoined.get(r, ("error",))[0] != "ok"]

    @staticmethod
    def _missing(ranks, replies) -> list[int]:
        return [r for r in ranks if r not in replies]

    @staticmethod
    def _results(ranks, replies) -> list[RankResult]:
        results = []
        for r in ranks:
            kind, *payload = replies.get(r, ("missing",))
            if kind == "ok":
                value = payload[0]
                if isinstance(value, dict) and value.get("_cell"):
                    results.append(RankResult(r, value["value"], value["displays"]))
                else:
                    results.append(RankResult(r, value))
            elif kind == "error":
                results.append(RankResult(r, error=payload[0]))
            else:
                results.append(RankResult(r, error=RankError(r, "did not finish", when=float("inf"))))
        return results


def _is_group_failure(reply) -> bool:
    """A collective that failed because a peer left: the group is broken and must be rebuilt."""
    if reply[0] != "error":
        return False
    text = str(reply[1])
    return any(sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                         "NCCL communicator was aborted", "has been destroyed", "not been initialized"))


# ----------------------------------------------------------------------------------- inside a worker

_NAMESPACE: dict = {}   # this worker process's variables, kept between cells (one world per process)
_DISPLAYS: list = []    # rich outputs of the cell being run


def _display(*objects) -> None:
    """``display(x)`` inside a rank: formatted here, shown in the notebook (from the display rank)."""
    from IPython.core.formatters import DisplayFormatter

    for obj in objects:
        data, metadata = DisplayFormatter().format(obj)
        _DISPLAYS.append((data, metadata))


def _namespace(rank, world_size) -> dict:
    """This rank's variables, with the predefined names filled in on first use."""
    if "rank" not in _NAMESPACE:
        _NAMESPACE.update(__name__="__ranks__", rank=rank, world_size=world_size, dist=dist, torch=torch,
                          display=_display)
    return _NAMESPACE


def _run_cell(rank, world_size, code, filename, display_rank):
    _namespace(rank, world_size)
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)  # for tracebacks
    tree = ast.parse(code, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    _DISPLAYS.clear()
    exec(compile(tree, filename, "exec"), _NAMESPACE)
    value = eval(compile(ast.Expression(last.value), filename, "eval"), _NAMESPACE) if last else None
    show = rank == display_rank
    figures = _figures_as_png(keep=show)
    return {"_cell": True, "value": None if value is None else repr(value),
            "displays": (_DISPLAYS + figures) if show else []}


def _figures_as_png(keep: bool) -> list:
    """Open matplotlib figures, as PNG mime bundles (like the inline backend); closed either way."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return []
    bundles = []
    for number in plt.get_fignums() if keep else []:
        buffer = io.BytesIO()
        plt.figure(number).savefig(buffer, format="png", bbox_inches="tight")
        bundles.append(({"image/png": buffer.getvalue(), "text/plain": f"<Figure {number}>"}, {}))
    plt.close("all")
    return bundles


def _get_variable(rank, world_size, name):
    if name not in _NAMESPACE:
        raise NameError(f"rank {rank} has no variable {name!r}")
    return _NAMESPACE[name]


def _set_variables(rank, world_size, values):
    _namespace(rank, world_size).update(values)


def _leave_group(rank, world_size):
    """Close this rank's connections so that peers blocked in a collective with it fail at once."""
    destroy_group()


def _rejoin_group(rank, world_size, backend, store_port, generation, store_key):
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass  # the old group may be half broken; we only need it gone
    init_group(rank, world_size, backend, store_port, generation, store_key)
    dist.barrier()  # prove the new group works before saying so
    _NAMESPACE["dist"] = dist
