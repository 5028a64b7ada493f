"""Data-parallel training runs (notebook 02, lab ddp, tests, benchmarks): our DDPs or torch's, timed per phase."""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.nn as nn
from torch.nn.utils import parameters_to_vector

from ..comm import Comm, bytes_written
from ..data import SyntheticTokens, micro_batches
from ..ddp import BucketedDDP, NaiveDDP
from ..model import build, loss_fn, preset
from ..runtime.launch import device
from ..units import MiB

DDP_KINDS = ("none", "naive", "bucketed", "torch")


def wrap(model: nn.Module, kind: str, comm: Comm, bucket_bytes: int = 25 * MiB) -> nn.Module:
    """``model`` made data-parallel: "none" (no sync at all: replicas drift), "naive", "bucketed" or "torch"."""
    if kind == "none":
        return model
    if kind == "naive":
        return NaiveDDP(model, comm)
    if kind == "bucketed":
        return BucketedDDP(model, comm, bucket_bytes)
    if kind == "torch":
        first = next(model.parameters())
        device_ids = [first.device.index] if first.is_cuda else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, process_group=comm.group,
                                                   bucket_cap_mb=bucket_bytes / MiB)
    raise ValueError(f"kind={kind!r}: choose one of {', '.join(DDP_KINDS)}")


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches) -> dict:
    """One optimizer step over this rank's micro-batches, syncing gradients only after the last one.

    Returns this rank's loss and when each phase ended (time.perf_counter()): "start"; "backward" (the last
    backward returned); "synced" (gradients averaged; torch's DDP waits inside backward); "end" (updated).
    """
    now = _clock(next(model.parameters()).device)
    times = {"start": now()}
    optimizer.zero_grad()
    loss_sum = 0.0
    for i, (inputs, targets) in enumerate(batches):
        inner = i < len(batches) - 1
        with model.no_sync() if inner and hasattr(model, "no_sync") else contextlib.nullcontext():
            loss = loss_fn(model(inputs), targets) / len(batches)   # so the summed gradient is the mean
            loss.backward()
        loss_sum += loss.item()
    times["backward"] = now()
    if hasattr(model, "finish_gradient_sync"):
        model.finish_gradient_sync()
    times["synced"] = now()
    optimizer.step()
    times["end"] = now()
    return {"loss": loss_sum, **times}


def _clock(dev: torch.device):
    """perf_counter, after the GPU's compute stream has caught up (NCCL's own stream is not waited for)."""
    if dev.type == "cuda":
        return lambda: (torch.cuda.current_stream(dev).synchronize(), time.perf_counter())[1]
    return time.perf_counter


def replica_spread(model: nn.Module, comm: Comm) -> float:
    """The largest difference between this rank's weights and any other rank's: 0.0 for identical replicas."""
    mine = parameters_to_vector(model.parameters()).detach()
    everyone = torch.empty(comm.size * mine.numel(), dtype=mine.dtype, device=mine.device)
    comm.all_gather(everyone, mine)
    return (everyone.view(comm.size, -1) - mine).abs().max().item()


def run_data_parallel(rank: int, world_size: int, *, kind: str = "bucketed", steps: int = 3,
                      micro_batch_size: int = 4, accumulation_steps: int = 1, bucket_bytes: int = 25 * MiB,
                      lr: float = 1e-2, optimizer: str = "adam", seq_len: int = 32, config=None, seed: int = 0,
                      bucket_log: bool = False, spread: bool = False, dtype=None) -> dict:
    """A worker for ``launch``: train ``config`` (default: the tiny model, in ``dtype``, float32 by default)
    data-parallel as ``kind``, with ``optimizer`` "adam" (as course_lib.train) or "sgd" (whose update is
    linear in the gradient).

    Returns {"steps": one dict per step (train_step's times and loss, plus "wire_bytes" and "all_reduces"
    traced through the Comm, "bytes_written" by this process, "bucket_log" (when each bucket's all-reduce was issued and done) if asked,
    "spread" between replicas if asked), "params": the final weights, flattened, "grad_bytes"}.
    """
    optimizers = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}
    if optimizer not in optimizers:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {', '.join(optimizers)}")
    comm, dev = Comm(), device()
    config = config or preset("tiny")
    model = build(config, seed=seed, device=dev, dtype=dtype)
    parallel = wrap(model, kind, comm, bucket_bytes)
    update = optimizers[optimizer](model.parameters(), lr=lr)
    data = SyntheticTokens(config.vocab_size, seq_len, seed=seed)
    records = []
    for step in range(steps):
        batches = [(x.to(dev), y.to(dev)) for x, y in
                   micro_batches(data, step, micro_batch_size, rank, world_size, accumulation_steps)]
        if bucket_log and hasattr(parallel, "bucket_log"):   # ours; torch's DDP keeps no log
            parallel.bucket_log = []
        with comm.trace() as log:
            written = bytes_written()
            record = train_step(parallel, update, batches)
            record["bytes_written"] = None if written is None else bytes_written() - written
        totals = log.summary().get("all_reduce")
        record.update(wire_bytes=log.wire_bytes, all_reduces=totals.count if totals else 0)
        if bucket_log:
            record["bucket_log"] = getattr(parallel, "bucket_log", None) or []
        if spread:
            record["spread"] = replica_spread(model, comm)
        records.append(record)
    return {"steps": records, "params": parameters_to_vector(model.parameters()).detach().cpu(),
            "grad_bytes": sum(p.nbytes for p in model.parameters())}


def phase_seconds(steps_by_rank: list[list[dict]], skip: int = 1) -> dict[str, float]:
    """Median seconds of each phase of a step, over every rank's steps but the first ``skip`` (warm-up)."""
    records = [s for steps in steps_by_rank for s in steps[skip:]] or [s for steps in steps_by_rank for s in steps]
    median = statistics.median_high   # the upper middle value: a real step's time, not an average of two
    return {"compute": median([s["backward"] - s["start"] for s in records]),
            "exposed communication": median([s["synced"] - s["backward"] for s in records]),
            "optimizer": median([s["end"] - s["synced"] for s in records]),
            "step": median([s["end"] - s["start"] for s in records])}
