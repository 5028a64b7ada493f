"""The machinery under ``launch`` and ``World``: N worker processes that run task after task.

The parent (the notebook's kernel) keeps, per rank, a duplex pipe for tasks and replies and two byte pipes
that carry the rank's file descriptors 1 and 2. A task is a cloudpickled ``(fn, kwargs, cell sources)``; a
reply is ``("ok", value)`` or ``("error", when, summary, traceback)``. ``launch.py`` explains the choices
(forkserver, cloudpickle, the store on port 0, faults); this module is how they are done.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import secrets
import signal
import sys
import time
from typing import Callable

import cloudpickle
import torch
import torch.multiprocessing as mp

from .arguments import check_sendable
from .processes import describe_exit, is_stopped, kill_group, loopback_store, main_module_hidden, sigint_ignored
from .rank_process import arrival_key, worker_main
from .tracebacks import (
    PLUMBING_FILES,
    GroupNotFormed,
    Interrupted,
    RankError,
    RankTimeout,
    WaitLine,
    dumps,
    interactive_sources,
    name_cells,
    user_frames,
)

PLUMBING_FILES.add(__file__)  # a rank's traceback starts in the learner's code, not in the worker loop

TICK_SECONDS = 0.2      # how often a waiting notebook looks up, e.g. to redraw grouped output
DEFAULT_TIMEOUT = 120.0  # seconds; a course cell runs in well under a minute, so a longer wait is a hang
FORM_TIMEOUT = 60.0      # seconds for every rank to join the process group (~0.1 s for 8 ranks when quiet)

# How many ranks one machine may start (see max_local_ranks).
RANKS_PER_CORE = 8            # 8 ranks on 2 cores already run each step several times slower than 2 would
RANK_MEMORY = 250 * 2**20     # bytes: torch in a rank is ~230 MiB resident (~10 MiB its own until it computes)
MAX_LOCAL_RANKS = 128         # the notebook holds 5 open files per rank; a common limit is 1,024 per process


def max_local_ranks(cpus: int, memory_bytes: int) -> int:
    """The most ranks this module starts on one machine:

        min(RANKS_PER_CORE × cpus,  memory_bytes / RANK_MEMORY,  MAX_LOCAL_RANKS),  and at least 1

    = min(8 × cores, memory / 250 MiB, 128). Beyond it a world does not fail cleanly, it crawls: 1,000 ranks on
    2 cores took 25 s to start and minutes to form a group (if at all). A larger world belongs under torchrun,
    across machines.
    """
    return max(1, min(RANKS_PER_CORE * cpus, memory_bytes // RANK_MEMORY, MAX_LOCAL_RANKS))


def check_world_fits(world_size: int, cpus: int | None = None, memory_bytes: int | None = None) -> None:
    """A ValueError, before any process starts, for a world far beyond this machine (see max_local_ranks).
    ``cpus`` and ``memory_bytes`` default to this machine's (usable cores, physical memory)."""
    cpus = cpus or len(os.sched_getaffinity(0))
    memory_bytes = memory_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = max_local_ranks(cpus, memory_bytes)
    if world_size > limit:
        raise ValueError(
            f"world_size={world_size} is more than this machine can run: it has {cpus} CPU cores and "
            f"{memory_bytes / 2**30:.1f} GiB of memory, enough for {limit} ranks (the least of "
            f"{RANKS_PER_CORE} ranks per core: {RANKS_PER_CORE * cpus}; one rank per {RANK_MEMORY >> 20} MiB: "
            f"{memory_bytes // RANK_MEMORY}; and {MAX_LOCAL_RANKS}). A larger world runs under torchrun, "
            "across machines; any one rank of it runs here on a fake group (course_lib.virtual).")


def threads_per_rank(world_size: int) -> int:
    """The torch threads each of ``world_size`` local ranks gets: this machine's usable cores shared out, at least
    one (8 ranks on 2 cores each with 2 threads crawl 14-27x slower)."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)


def choose_backend(backend: str | None, ranks_per_node: int) -> str:
    """gloo on CPU, NCCL when every local rank can have a GPU of its own; an explicit choice wins."""
    gpus = torch.cuda.device_count()   # 0 without CUDA
    if backend is None:
        return "nccl" if gpus >= ranks_per_node else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPUs)")
    if backend == "nccl" and gpus < ranks_per_node:
        raise ValueError(f"backend='nccl' needs one GPU per rank: {ranks_per_node} ranks, {gpus} GPUs visible")
    return backend


def _context():
    """The forkserver context, with torch imported once in the server (set before it first starts)."""
    ctx = mp.get_context("forkserver")
    # torch._dynamo too: building any nn.Embedding imports it, ~2 s that every rank would pay again
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "cloudpickle", __name__,
                                "course_lib.runtime.forkserver_exit"])   # it ends at once when told to stop
    return ctx


class WorkerGroup:
    """``world_size`` worker processes in one process group, ready to run functions.

    ``run(fn, kwargs)`` runs ``fn(rank, world_size, **kwargs)`` on every rank (or on ``ranks``) and
    returns the results in rank order. ``on_output(rank, stream, text)`` receives each complete line a
    rank prints (default: write it here with a ``[rank r]`` prefix). ``close()`` kills every worker.
    With ``exit_after_error`` a rank that raised exits (its peers then fail fast instead of waiting in a
    collective); otherwise it keeps its state and waits for the next task.
    """

    def __init__(self, world_size: int, *, backend: str | None = None, exit_after_error: bool = True,
                 on_output: Callable[[int, str, str], None] | None = None, form_timeout: float = FORM_TIMEOUT):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size={world_size!r}: it must be a whole number of ranks, at least 1")
        self.world_size = world_size
        self.backend = choose_backend(backend, world_size)
        check_world_fits(world_size)
        self.on_output = on_output or _print_with_prefix
        self.on_tick: Callable[[], None] | None = None  # called at least every TICK_SECONDS while waiting
        self._partial: dict[tuple[int, str], list[bytes]] = {}   # a line's pieces until its newline
        # The rendezvous: this process hosts the store, on a free port the OS picks, on loopback only.
        self._store = loopback_store()
        self.store_port = self._store.port
        self.store_key = secrets.token_hex(16)   # every key of this world starts with it (init_group)
        self._threads = threads_per_rank(world_size)
        self._exit_after_error = exit_after_error
        self._ctx = _context()
        # Only this process holds the write end: when it dies, every rank reads EOF and ends (rank_process).
        self._notebook_alive, self._alive_w = self._ctx.Pipe(duplex=False)
        self.procs, self.conns, self._outputs = [None] * world_size, [None] * world_size, {}
        self._busy = True  # until the group has formed: close() kills at once
        self._sent_sources: set[str] = set()  # notebook cells whose lines the workers already have
        self._released = False
        line = WaitLine()
        try:
            for rank in range(world_size):
                self._start_rank(rank)
                if rank == 0:  # its start includes the forkserver's first (~3 s, importing torch): not counted,
                    line = WaitLine()  # as no line could be updated while it lasts
                line.show(f"starting the ranks' processes: {rank + 1} of {world_size}")
            self._wait_until_formed(form_timeout, line)
        except KeyboardInterrupt:
            line.end()
            self.__exit__()
            raise Interrupted("starting the ranks was interrupted; every rank process was stopped") from None
        except BaseException:  # a rank that failed to join, a group that did not form: no process may outlive it
            line.end()
            self.__exit__()
            raise
        line.end(f"the process group of {world_size} ranks formed")
        self._busy = False

    def _start_rank(self, rank: int, generation: int = 0) -> None:
        """Start the process of ``rank``; it will join the group (of ``generation``) through the store."""
        conn, child_conn = self._ctx.Pipe()
        out_r, out_w = self._ctx.Pipe(duplex=False)  # used as raw byte pipes for fd 1 and fd 2
        err_r, err_w = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=worker_main, name=f"course_lib rank {rank}", daemon=True, args=(
            rank, self.world_size, self.backend, self.store_port, self._threads, self._exit_after_error, child_conn,
            out_w, err_w, self._notebook_alive, generation, self.store_key))
        with main_module_hidden():
            proc.start()
        for end in (child_conn, out_w, err_w):  # the worker holds these now
            end.close()
        for stream, reader in (("stdout", out_r), ("stderr", err_r)):
            os.set_blocking(reader.fileno(), False)
            self._outputs[reader.fileno()] = (rank, stream, reader)
        self.procs[rank], self.conns[rank] = proc, conn

    def dead(self) -> list[int]:
        """The ranks whose process has ended (killed by the out-of-memory killer, say)."""
        return [r for r, alive in enumerate(self.alive()) if not alive]

    def exit_description(self, rank: int) -> str:
        """How the process of ``rank`` ended, e.g. "exit code -9, killed by SIGKILL (a kill -9 or the out-of-memory killer)"."""
        self.procs[rank].join(timeout=1)
        return f"exit code {describe_exit(self.procs[rank].exitcode)}"

    def restart_ranks(self, ranks: list[int], generation: int) -> None:
        """Replace the processes of ``ranks`` (ended, or to be ended) with fresh ones that join the process group
        of ``generation``; the caller has the other ranks join it too, then collects everyone's reply (a fresh
        rank says ("ok", "joined"))."""
        for r in ranks:
            self._end_rank(r)
            self._start_rank(r, generation)
        self._sent_sources.clear()  # the fresh ranks have none of the notebook's cells: send them all again

    def _end_rank(self, rank: int) -> None:
        """Kill the process of ``rank`` and everything it started; close what connected us to it."""
        self.conns[rank].close()
        proc = self.procs[rank]
        kill_group(proc)
        proc.join(timeout=5)
        kill_group(proc)  # anything its last moments started
        self._pump_output()  # its last words (a reader at EOF is dropped there)
        for fd, (r, _, reader) in list(self._outputs.items()):
            if r == rank:
                reader.close()
                del self._outputs[fd]

    def _wait_until_formed(self, timeout: float, line: WaitLine) -> None:
        """Wait until every rank says "joined" (after init_process_group and a barrier). Raises the RankError
        of a rank that could not join, or GroupNotFormed after ``timeout`` seconds."""
        everyone, joined = list(range(self.world_size)), {}
        deadline = time.monotonic() + timeout
        while len(joined) < self.world_size and time.monotonic() < deadline:
            waiting = [r for r in everyone if r not in joined]
            joined.update(self.collect(waiting, timeout=min(1.0, deadline - time.monotonic()), stop_at_error=True))
            errors = [reply[1] for reply in joined.values() if reply[0] == "error"]
            if errors:
                raise min(errors, key=lambda err: err.when)
            line.show(f"forming the process group: {len(self._arrived())} of {self.world_size} ranks arrived")
        missing = [r for r in everyone if r not in joined]
        if missing:
            arrived = self._arrived()
            raise GroupNotFormed(timeout, [r for r in missing if r not in arrived], [r for r in missing if r in arrived])

    def _arrived(self) -> list[int]:
        """The ranks that reached the rendezvous (they set their key in the store before joining the group)."""
        return [r for r in range(self.world_size) if self._store.check([arrival_key(r, 0, self.store_key)])]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        """close(), then let go of every process handle and pipe at once: the group ends here (launch's, or one
        that never formed). Left to the garbage collector, a failed launch's traceback kept 2 pipes per rank and
        one more open until it ran (5 for 2 ranks, measured). Safe to call twice."""
        if self._released:
            return
        self.close()
        for proc in self.procs:
            if proc is not None and proc.exitcode is not None:
                proc.close()   # its sentinel and its pipe to the forkserver
        self._notebook_alive.close()
        self._released = True

    def alive(self) -> list[bool]:
        return [False] * self.world_size if self._released else [p.is_alive() for p in self.procs]

    def run(self, fn: Callable, kwargs: dict | None = None, *, timeout: float = DEFAULT_TIMEOUT,
            ranks: list[int] | None = None) -> list:
        """Run ``fn`` on ``ranks`` (default: all) and return their results, in rank order.

        Raises the earliest :class:`RankError` as soon as a rank fails, or :class:`RankTimeout`.
        """
        ranks = self.select(ranks)
        self.submit(fn, kwargs, ranks)
        replies = self.collect(ranks, timeout=timeout, stop_at_error=True)
        hung = [r for r in ranks if r not in replies]
        errors = [reply[1] for reply in replies.values() if reply[0] == "error"]
        if errors:
            raise min(errors, key=lambda err: err.when)  # the earliest error is the cause
        if hung:
            raise RankTimeout(hung, timeout, self.stacks_of(hung))
        self._busy = False
        return [replies[r][1] for r in ranks]

    def mark_idle(self) -> None:
        """Every rank waits for work again (after a caller such as World repaired a failed task itself), so
        close() may let them finish cleanly instead of killing them."""
        self._busy = False

    def select(self, ranks: list[int] | None) -> list[int]:
        """``ranks`` sorted, each once (default: every rank); a ValueError for ranks this group does not have."""
        ranks = list(range(self.world_size)) if ranks is None else sorted(set(ranks))
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"ranks {bad} do not exist: this world has ranks 0..{self.world_size - 1}")
        return ranks

    def submit(self, fn: Callable, kwargs: dict | None, ranks: list[int]) -> None:
        """Send ``fn(rank, world_size, **kwargs)`` to ``ranks``; ``collect`` gathers the replies."""
        sources = {name: entry for name, entry in interactive_sources().items() if name not in self._sent_sources}
        try:
            task = dumps((fn, kwargs or {}, sources))
        except Exception:
            check_sendable(kwargs or {}, fn)   # a TypeError naming what could not be sent
            raise
        self._sent_sources.update(sources)   # only once they are on their way
        self._busy = True
        for r in ranks:
            try:
                self.conns[r].send_bytes(task)
            except OSError:  # BrokenPipeError: the rank's process has ended; its reply will say how (_receive)
                pass

    def collect(self, ranks: list[int], *, timeout: float, stop_at_error: bool) -> dict:
        """Wait for the replies of ``ranks``, relaying their output meanwhile.

        Returns {rank: ("ok", value) or ("error", RankError)} for the ranks that replied: all of them,
        or fewer if ``timeout`` ran out or (with ``stop_at_error``) once a rank failed.
        """
        replies = {}
        failed = lambda: any(reply[0] == "error" for reply in replies.values())  # noqa: E731
        deadline = time.monotonic() + timeout
        try:
            while len(replies) < len(ranks) and not (stop_at_error and failed()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                waiting = [r for r in ranks if r not in replies]
                ready = multiprocessing.connection.wait(
                    [self.conns[r] for r in waiting] + [self.procs[r].sentinel for r in waiting]
                    + [reader for _, _, reader in self._outputs.values()], timeout=min(left, TICK_SECONDS))
                self._pump_output()
                if self.on_tick is not None:
                    self.on_tick()
                for r in waiting:
                    if self.conns[r] in ready or self.procs[r].sentinel in ready:
                        replies[r] = self._receive(r)
            if stop_at_error and failed():
                time.sleep(0.05)  # peers that were waiting on the failed rank report (or die) too
                for r in ranks:
                    if r not in replies and (self.conns[r].poll() or not self.procs[r].is_alive()):
                        replies[r] = self._receive(r)
        finally:
            self._pump_output()
            self._flush_partial_lines()
        return replies

    def _receive(self, rank):
        """Read the reply of ``rank``: ("ok", value), or ("error", RankError) (``.when`` it happened)."""
        try:
            kind, *payload = cloudpickle.loads(self.conns[rank].recv_bytes())
        except (EOFError, OSError):  # the process is gone without a word
            self.procs[rank].join(timeout=1)
            code = describe_exit(self.procs[rank].exitcode)
            # A silent death comes before the errors it causes in its peers: rank it first (time 0).
            return "error", RankError(rank, f"the process died (exit code {code}) without reporting an error", when=0.0)
        except Exception as error:  # the reply came, but cannot be rebuilt here (a class this process lacks)
            return "error", RankError(rank, f"its reply could not be read here: {type(error).__name__}: {error}")
        if kind == "ok":
            return "ok", payload[0]
        when, summary, tb = payload
        return "error", RankError(rank, summary, name_cells(tb), when)

    def stacks_of(self, ranks: list[int]) -> dict[int, str]:
        """Ask each hung rank to print its Python stack (faulthandler on SIGUSR1) and collect the text."""
        captured = {r: [] for r in ranks}
        relay = self.on_output
        self.on_output = lambda r, stream, line: captured[r].append(line) if r in captured else relay(r, stream, line)
        try:
            for r in ranks:
                if self.procs[r].is_alive():
                    os.kill(self.procs[r].pid, signal.SIGUSR1)
            end = time.monotonic() + 0.5
            while time.monotonic() < end:
                multiprocessing.connection.wait([o[2] for o in self._outputs.values()], timeout=0.05)
                self._pump_output()
            self._flush_partial_lines()
        finally:
            self.on_output = relay
        stacks = {r: name_cells(user_frames("".join(lines))) for r, lines in captured.items()}
        for r in ranks:
            if is_stopped(self.procs[r].pid):
                stacks[r] = (f"(stopped: its process {self.procs[r].pid} was paused, by SIGSTOP or Ctrl-Z, so it could "
                             f"not say where it was; kill -CONT {self.procs[r].pid} resumes it)")
        return stacks

    def _pump_output(self):
        """Move whatever the ranks printed into ``on_output``, one complete line at a time."""
        for fd, (rank, stream, _) in list(self._outputs.items()):
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # BlockingIOError included
                    break
                if not chunk:  # the rank closed its end: it has exited
                    del self._outputs[fd]
                    break
                # A line's pieces are kept as a list and joined once, when its newline comes: adding each 64 KiB
                # chunk to a growing string copied an 80 MB line ~1,250 times (62 s). Bytes until then, so that a
                # character split between two chunks decodes whole.
                parts = self._partial.setdefault((rank, stream), [])
                if b"\n" not in chunk:
                    parts.append(chunk)
                    continue
                first, *lines, rest = chunk.split(b"\n")
                for line in [b"".join([*parts, first]), *lines]:
                    self.on_output(rank, stream, line.decode(errors="replace") + "\n")
                self._partial[(rank, stream)] = [rest] if rest else []

    def _flush_partial_lines(self):
        for (rank, stream), parts in list(self._partial.items()):
            if parts:
                self.on_output(rank, stream, b"".join(parts).decode(errors="replace") + "\n")
        self._partial.clear()

    def close(self):
        """Stop every worker and everything it started (its whole process group, whether the worker itself is
        still running or not), and the store; safe to call twice."""
        if self._released:
            return
        with sigint_ignored():  # a second press of Jupyter's stop button must not leave orphans
            started = [proc for proc in self.procs if proc is not None]
            for conn in self.conns:
                if conn is not None:
                    conn.close()  # a worker waiting for a task sees EOF and exits by itself
            end = time.monotonic() + (0.0 if self._busy else 1.0)  # a busy one (error, interrupt) is killed
            for proc in started:
                proc.join(timeout=max(0.0, end - time.monotonic()))
            for proc in started:
                kill_group(proc)  # a rank that ended leaves what it started running: `sleep 300`, say
                proc.join(timeout=5)  # bounded: a cleanup must never be what hangs
            self._alive_w.close()  # any rank still there now reads EOF and ends itself with its group
            for _, _, reader in self._outputs.values():
                reader.close()
            self._outputs.clear()
            self._store = None  # its server stops listening as the last reference goes


def _print_with_prefix(rank: int, stream: str, line: str) -> None:
    (sys.stderr if stream == "stderr" else sys.stdout).write(f"[rank {rank}] {line}")
