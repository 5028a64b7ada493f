"""Failure runs (notebook 10, tests): a collective that one rank never joins, ended by the process group's timeout,
and the rank named by torch's monitored_barrier."""

from __future__ import annotations

import datetime
import re
import time

import torch
import torch.distributed as dist

from ..runtime.arguments import check_number, check_whole


def hung_collective(rank: int, world_size: int, *, missing_rank: int, timeout_s: float = 2.0) -> dict:
    """For ``launch``: every rank but ``missing_rank`` enters an all-reduce on a group made with
    ``dist.new_group(..., timeout=timeout_s)`` (gloo honours it per operation); ``missing_rank`` is busy elsewhere
    for 2·timeout_s. The waiting ranks get gloo's timeout error after timeout_s; then each calls
    ``dist.monitored_barrier`` on a fresh group (a timed-out group is dead): rank 0 reports which ranks did not
    arrive. Returns, per rank, the seconds it waited, the error it got and monitored_barrier's verdict. (Give
    launch a timeout above 2·timeout_s, or it ends the demonstration first, naming the ranks.)"""
    check_whole("missing_rank", missing_rank, low=0)
    if missing_rank >= world_size:
        raise ValueError(f"missing_rank={missing_rank} is not a rank of this world: its ranks are 0..{world_size - 1}")
    check_number("timeout_s", timeout_s, above=0)
    timeout = datetime.timedelta(seconds=timeout_s)
    group = dist.new_group(list(range(world_size)), timeout=timeout)
    spare = dist.new_group(list(range(world_size)), timeout=timeout)
    found = {"rank": rank, "waited_s": None, "error": None, "barrier": None}
    if rank == missing_rank:
        time.sleep(2 * timeout_s)                  # stuck elsewhere: in a data loader, a slow disk, a dead GPU
        return found
    start = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(4), group=group)
    except RuntimeError as error:
        found["error"] = re.sub(r"^\[[^\]]*\]\s*", "", str(error).splitlines()[0])   # without gloo's "[file.cc:78]"
    found["waited_s"] = time.perf_counter() - start
    try:
        dist.monitored_barrier(group=spare, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as error:
        found["barrier"] = str(error).splitlines()[0]
    return found
