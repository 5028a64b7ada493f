"""What the runtime asks of the operating system: the loopback rendezvous store, process groups killed whole,
how a process ended in words, a cleanup that Ctrl-C cannot cut short, and a child started without re-importing
the notebook's ``__main__``. ``workers.py`` uses these; nothing here knows about ranks or tasks."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import types

import torch.distributed as dist

from .rank_process import LOOPBACK


def loopback_store() -> dist.TCPStore:
    """The rendezvous store, listening on 127.0.0.1 only.

    TCPStore's server listens on every interface whatever host it is given (``ss -ltn`` shows ``*:PORT``;
    torch 2.13, libuv and legacy backends alike), so anyone on the network could read and write the keys
    that wire the ranks together. So we bind the socket to loopback ourselves (port 0: the OS picks a free
    port, no two notebooks collide) and hand it to the store, which owns the descriptor from then on (it
    closes it when it is destroyed; hence ``detach``, or Python would close it a second time).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port = sock.getsockname()[1]
        return dist.TCPStore(LOOPBACK, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach())


@contextlib.contextmanager
def main_module_hidden():
    """multiprocessing re-imports the parent's ``__main__`` in each child so that pickled names resolve.
    We ship code by value, so skip it: faster, and it works from ``python -c``, stdin, or a script
    without an ``if __name__ == "__main__"`` guard."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def is_stopped(pid: int) -> bool:
    """Whether ``pid`` is paused (SIGSTOP, Ctrl-Z: state T or t in /proc/PID/stat); False where that is not
    there. A paused process runs no signal handler, so it cannot say where it was."""
    try:
        with open(f"/proc/{pid}/stat") as status:
            stat = status.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] in "Tt"


def describe_exit(code) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        # SIGKILL cannot be caught: a kill -9, the kernel's out-of-memory killer, or the rank killing itself
        hint = " (a kill -9 or the out-of-memory killer)" if name == "SIGKILL" else ""
        return f"{code}, killed by {name}{hint}"
    return str(code)


def kill_group(proc) -> None:
    """SIGKILL to the process group that the worker ``proc`` (a multiprocessing Process) leads (it called setpgrp):
    the worker and every process it started that did not leave the group. The group outlives its leader while any
    member lives. With the group gone, the worker alone, and only while it has not been reaped: once joined, its
    pid is free, and another process may already have it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left in the group
        if proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def sigint_ignored():
    """Ctrl-C (Jupyter's stop button) is ignored inside the block: for cleanups that must not be cut short."""
    try:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals are not ours to change
        old = None
    try:
        yield
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
