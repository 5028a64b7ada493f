"""Profiled runs (notebook 11, tests, benchmarks/profile_trace.py): a bucketed DDP step under torch.profiler on
every rank, its trace written beside the course's own clock readings of the same step."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import torch

from ..comm import Comm
from ..data import SyntheticTokens, shard
from ..ddp import BucketedDDP
from ..model import build, loss_fn, preset, widened
from ..traces import union
from ..units import MiB


def profiled_ddp_step(rank: int, world_size: int, *, folder: str, hidden: int = 256, bucket_bytes: int = 4 * MiB,
                      batch_size: int = 16, seq_len: int = 32, warmup: int = 2) -> dict:
    """For ``launch``: the course's BucketedDDP on the tiny model widened to ``hidden``; after ``warmup`` steps,
    one step under torch.profiler, its Chrome trace written to ``folder``/rank<r>.json. Returns the trace's path
    and the course's own measurement of the same step: when backward ended and when every bucket's all-reduce had
    been waited for (perf_counter seconds), the buckets' issue and finish times (BucketedDDP.bucket_log) and the
    communication exposed after backward by those times (exposed_after)."""
    config = preset("tiny", **widened(hidden))
    model = BucketedDDP(build(config, seed=0), Comm(), bucket_bytes=bucket_bytes)
    data = SyntheticTokens(config.vocab_size, seq_len)
    inputs, targets = (shard(t, rank, world_size) for t in data.batch(0, batch_size))
    for _ in range(warmup):
        loss_fn(model(inputs), targets).backward()
        model.finish_gradient_sync()
    model.bucket_log = []
    with kineto_quiet(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        start = time.perf_counter()
        loss_fn(model(inputs), targets).backward()
        backward_end = time.perf_counter()
        model.finish_gradient_sync()
        synced = time.perf_counter()
    path = Path(folder) / f"rank{rank}.json"
    profiler.export_chrome_trace(str(path))
    return {"trace": str(path), "start": start, "backward_end": backward_end, "synced": synced,
            "buckets": model.bucket_log, "exposed_s": exposed_after(model.bucket_log, backward_end)}


@contextlib.contextmanager
def kineto_quiet():
    """The profiler's C++ side (kineto) writes a "profiler_start"/"profiler_stop" line to file descriptor 2 whatever
    its log level; point fd 2 at /dev/null for the profiled step only (Python exceptions still propagate)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def exposed_after(buckets: list[dict], backward_end: float) -> float:
    """The course's own clock on exposed communication: how long the buckets' all-reduces ran (issued to done,
    as BucketedDDP records them) after backward had ended, their union."""
    spans = [(max(entry["issued"], backward_end), entry["done"]) for entry in buckets if entry["done"] > backward_end]
    return sum(end - start for start, end in union(spans))
