"""Run one Python function on N processes, each a rank of a real ``torch.distributed`` group.

    results = launch(fn, world_size=4, lr=0.1)     # fn(rank, world_size, lr=0.1) on 4 processes
    results[2]                                     # what rank 2 returned

This is the one place in the course where a process group is made. How it works:

* **Starting ranks fast.** Workers come from a *forkserver*: a helper process that imports torch once
  and then forks a fresh worker per rank on request. A warm 4-rank start takes ~0.1 s instead of ~6 s
  for ``spawn``, where every rank imports torch again. (Plain ``fork`` would be faster still, but it
  hangs children once the notebook has used torch's thread pool, and cannot follow CUDA.)
* **Functions from notebook cells.** ``pickle`` sends a function by name, and a rank cannot import a
  name defined in a notebook cell. ``cloudpickle`` sends the function's code instead; the cell's source
  lines travel with it, so a rank's traceback shows the lines of your cell.
* **Rendezvous.** This process hosts a ``TCPStore`` on a free port chosen by the OS (port 0); the ranks
  connect to it to find each other. No fixed ``MASTER_PORT``, so two notebooks never collide. The store,
  and gloo's connections between the ranks, listen on loopback only: a world started here can be joined
  from this machine, not from the network. (Under torchrun, the rendezvous is torchrun's.)
* **Output.** Each rank's file descriptors 1 and 2 are pipes read by this process, so everything a rank
  prints (Python, C++ warnings, crash dumps) shows up here, line by line, prefixed ``[rank r]``.
* **Faults.** A rank that raises sends its traceback and exits; peers blocked in a collective with it
  then fail too, so the *earliest* error is the cause and is raised here as :class:`RankError`. On a
  timeout every unfinished rank first prints its stack (``faulthandler``), so the error shows where it
  hung. Afterwards every worker is killed (each is the leader of its own process group, so anything it
  started dies with it); if this process dies, ``PR_SET_PDEATHSIG`` takes the workers with it. The stop
  button stops every rank and says so in one line (:class:`~course_lib.runtime.tracebacks.Interrupted`).
* **Forming the group.** ``fn`` is sent only once every rank has said that it joined the process group; a
  group that does not form within a minute is reported as exactly that, naming the ranks that never came,
  and a wait of more than a few seconds shows a line that counts them. A world far beyond the machine (more
  than 8 ranks per CPU core, say) is refused before any process starts.
* **torchrun.** When ``RANK`` and ``WORLD_SIZE`` are set (torchrun, or a nested call inside a rank),
  :func:`launch` runs ``fn`` right here on the existing group instead, so one script serves the
  notebook, the command line and a GPU cluster.

:class:`WorkerGroup` is the reusable part: N live ranks that run task after task.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import socket
import sys
from typing import Callable

import torch
import torch.distributed as dist

from .arguments import check_number, check_sendable
from .rank_process import destroy_group
from .workers import (
    DEFAULT_TIMEOUT,
    GroupNotFormed,
    Interrupted,
    RankError,
    RankTimeout,
    WorkerGroup,
    choose_backend,
)

__all__ = ["launch", "device", "RankError", "RankTimeout", "GroupNotFormed", "WorkerGroup", "DEFAULT_TIMEOUT"]


def launch(fn: Callable, world_size: int, *, backend: str | None = None,
           timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` ranks; return their results in rank order.

    ``backend``: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank); by default NCCL when there are
    enough GPUs, else gloo. ``timeout``: seconds before unfinished ranks are stopped with
    :class:`RankTimeout`. Raises :class:`RankError` naming the first rank that failed, ValueError for a
    world far beyond this machine (``workers.max_local_ranks``: at most 8 ranks per CPU core, 250 MiB of
    memory per rank, 128 ranks), :class:`GroupNotFormed` if the ranks do not all join the group in time.
    """
    check_number("timeout", timeout, above=0)   # seconds; refused before any process starts
    if _under_torchrun():
        return _run_in_place(fn, world_size, backend, timeout, kwargs)
    check_sendable(kwargs, fn)   # a lock or an open file is named here, before any process starts
    try:
        with WorkerGroup(world_size, backend=backend, exit_after_error=True) as group:
            return group.run(fn, kwargs, timeout=timeout)
    except Interrupted:
        raise
    except KeyboardInterrupt:  # the stop button; leaving the `with` has killed every rank already
        raise Interrupted(f"launch() was interrupted: its {world_size} ranks were stopped") from None


def device() -> torch.device:
    """The device this rank should compute on: ``cuda:LOCAL_RANK`` under NCCL, otherwise the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


_uncaught = []   # an exception that ended the script (under torchrun): the exit status must say so


def _leave_cleanly() -> None:
    """Under torchrun, at exit: leave the group while Python still runs, flush, and end the process here.

    Left to interpreter shutdown, the C++ side of a gloo rank aborted about one run in four on this machine
    ("terminate called without an active exception", which torchrun reports as a failed rank), even with the
    group destroyed first. Nothing after this point needs to run: the script is done, its output flushed.
    """
    destroy_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if _uncaught else 0)


def _note_uncaught(hook):
    def noting(*exc_info):
        _uncaught.append(exc_info[0])
        hook(*exc_info)
    return noting


_NODES: list[str] = []   # under torchrun: the host name of every rank, in rank order (check_same_command)


def nodes() -> list[str]:
    """The machines this world runs on, each once: from every rank under torchrun, else this one."""
    return list(dict.fromkeys(_NODES)) or [socket.gethostname()]


def check_same_command(rank: int, world_size: int) -> list[str]:
    """Every rank's command line, compared through the group's store before any work: a ValueError naming the
    ranks (and their machines) whose arguments differ from rank 0's. Returns each rank's host name.

    torchrun starts each node's ranks with that node's command line; nodes started with different arguments
    (--hidden 1024 on one, 2048 on the other) would otherwise build different models, call different
    collectives and hang until the group's timeout. The check costs one small key per rank.
    """
    store = dist.distributed_c10d._get_default_store()
    mine = {"argv": sys.argv[1:], "host": socket.gethostname()}
    store.set(f"course_lib/command/{rank}", json.dumps(mine))
    every = [json.loads(store.get(f"course_lib/command/{r}")) for r in range(world_size)]  # get waits for the key
    differ = [r for r, theirs in enumerate(every) if theirs["argv"] != every[0]["argv"]]
    if differ:
        hosts = sorted({every[r]["host"] for r in differ})
        example = every[differ[0]]
        raise ValueError(f"ranks {differ} (on {', '.join(hosts)}) were started with the arguments {example['argv']}, "
                         f"rank 0 (on {every[0]['host']}) with {every[0]['argv']}: run the same command on every node")
    return [entry["host"] for entry in every]


def _run_in_place(fn, world_size, backend, timeout, kwargs) -> list:
    """Under torchrun this process *is* one rank: join (or reuse) its group and run ``fn`` here."""
    rank, env_world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != env_world_size:
        raise ValueError(f"launch(world_size={world_size}) but torchrun started WORLD_SIZE={env_world_size} "
                         "ranks: pass the same number (e.g. world_size=int(os.environ['WORLD_SIZE']))")
    if not dist.is_initialized():
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        backend = choose_backend(backend, local_world_size)
        # NCCL: bound to this rank's GPU, so that a barrier issued first on a group knows its device (unbound, torch
        # guesses it from the global rank, wrong across nodes that run fewer ranks than they have GPUs)
        gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if backend == "nccl" else None
        if gpu is not None:
            torch.cuda.set_device(gpu)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout), device_id=gpu)  # env://
        sys.excepthook = _note_uncaught(sys.excepthook)
        atexit.register(_leave_cleanly)
        _NODES[:] = check_same_command(rank, world_size)
    value = fn(rank, world_size, **kwargs)
    values = [None] * world_size
    dist.all_gather_object(values, value)  # every rank gets the full list, as in a notebook
    return values
