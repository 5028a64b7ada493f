"""Tensor-parallel runs (notebook 04, lab tensor_parallel): a forward + backward of a widened model, whole on
one rank against split over TP ranks, timed."""

from __future__ import annotations

import statistics
from contextlib import nullcontext
from time import perf_counter

import torch
import torch.nn as nn

from ..comm import Comm
from ..data import SyntheticTokens
from ..model import build, loss_fn, preset, widened
from ..runtime.launch import launch
from ..tensor_parallel import apply_tp


def tp_speed_config(hidden: int, num_layers: int = 2):
    """The tiny model made wider, in its own proportions (model.widened)."""
    return preset("tiny", num_layers=num_layers, **widened(hidden))



def _tp_vs_one_rank(rank, world_size, hiddens, num_layers, batch_size, seq_len, repeats):
    torch.set_num_threads(1)     # one core per rank, as one GPU per rank: "one rank" is one device
    comm, rows = Comm(), []
    for hidden in hiddens:
        config = tp_speed_config(hidden, num_layers)
        inputs, targets = SyntheticTokens(config.vocab_size, seq_len, seed=0).batch(0, batch_size)
        whole = build(config, seed=0) if rank == 0 else None
        split = apply_tp(build(config, seed=0), comm)
        one_rank_runs, tp_runs = [], []
        for i in range(1 + repeats):   # round 0 warms up; one-rank and TP runs alternate, so both meet the same
            if rank == 0:              # neighbours (on a shared laptop they only ever add time: keep the fastest)
                one_rank_runs.append(step_seconds(whole, inputs, targets, repeats=1, warmup=0))
            comm.barrier()             # the other ranks wait (asleep) while rank 0 runs the whole model alone
            tp_runs.append(step_seconds(split, inputs, targets, comm, repeats=1, warmup=0))
        fastest = lambda runs: min(runs[1:], key=lambda r: r["seconds"]) if runs else None  # noqa: E731
        rows.append({"hidden": hidden, "one_rank": fastest(one_rank_runs), "tp": fastest(tp_runs)})
    return rows



def measure_tp_speed(hiddens, tp: int, *, num_layers: int = 2, batch_size: int = 4, seq_len: int = 64,
                     repeats: int = 5) -> list[dict]:
    """For each width: the fastest of ``repeats`` forward + backward passes of the whole model on one rank, and
    of the same model split over ``tp`` ranks (its slowest rank, and that rank's seconds inside all-reduces)."""
    per_rank = launch(_tp_vs_one_rank, tp, hiddens=list(hiddens), num_layers=num_layers, batch_size=batch_size,
                      seq_len=seq_len, repeats=repeats)
    rows = []
    for i, hidden in enumerate(hiddens):
        slowest = max((ranks[i]["tp"] for ranks in per_rank), key=lambda t: t["seconds"])
        rows.append({"hidden": hidden, "tp": tp, "one_rank_s": per_rank[0][i]["one_rank"]["seconds"],
                     "tp_s": slowest["seconds"], "comm_s": slowest["comm_seconds"]})
    return rows


def step_seconds(model: nn.Module, inputs, targets, comm: Comm | None = None, *, repeats: int = 5,
                 warmup: int = 2) -> dict:
    """The median time of one forward + backward of ``model``, and of that, the seconds spent inside
    ``comm``'s collectives (waiting for the slowest rank included: TP pays for that too). On GPUs NCCL
    collectives return before they finish, so there only ``seconds`` is meaningful."""


    sync = torch.cuda.synchronize if inputs.is_cuda else (lambda: None)   # GPU kernels run asynchronously
    runs = []
    for i in range(warmup + repeats):
        if comm is not None:
            comm.barrier()                      # start together, so no rank's wait is counted as work
        with comm.trace() if comm is not None else nullcontext() as log:
            start = perf_counter()
            loss_fn(model(inputs), targets).backward()
            sync()
            seconds = perf_counter() - start
        model.zero_grad(set_to_none=True)
        if i >= warmup:
            runs.append((seconds, sum(r.seconds for r in log.records) if log is not None else 0.0))
    seconds, comm_seconds = statistics.median_high(runs)   # by seconds: the upper middle run
    return {"seconds": seconds, "comm_seconds": comm_seconds, "compute_seconds": seconds - comm_seconds}
