"""Incidents where data-parallel replicas are not what they should be: different weights, or the same data."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from ...comm import Comm
from ...data import shard
from ...ddp import broadcast_parameters
from ...model import loss_fn
from ...zero import ZeroDataParallel
from .common import BATCH_SIZE, LR, STEPS, average_gradients, checksums, flat, sgd_step, tiny

MOMENTUM = 0.9           # the optimizer state a resume must restore: SGD's momentum buffer


def unsynced_init(rank: int, world_size: int, *, fixed: bool = False) -> dict:
    """Data parallelism whose replicas were built each from its own seed ("every rank its own randomness").

    The bug: nothing makes the replicas equal at the start; they get the same averaged gradient every step and
    stay apart forever. The fix: broadcast rank 0's weights before the first step (what DDP's constructor does)."""
    model, optimizer, data = tiny(seed=rank)
    comm = Comm()
    if fixed:
        broadcast_parameters(model, comm)
    losses = []
    for step in range(STEPS):
        inputs, targets = (shard(t, rank, world_size) for t in data.batch(step, BATCH_SIZE))
        losses.append(sgd_step(model, optimizer, inputs, targets, lambda m: average_gradients(m, comm)))
    return {"checksums": checksums(model, comm), "losses": losses, "weights": flat(model)}


def same_batch(rank: int, world_size: int, *, fixed: bool = False) -> dict:
    """Data parallelism where every rank asks the loader for "a batch of BATCH_SIZE / world_size rows".

    The bug: every rank gets the same first rows, so the world trains on a world_size-th of the data, each step
    averaging identical gradients; the replicas agree and the run is simply worse. The fix: each rank its own
    slice of the step's global batch (data.shard)."""
    model, optimizer, data = tiny()
    comm = Comm()
    losses = []
    for step in range(STEPS):
        if fixed:
            inputs, targets = (shard(t, rank, world_size) for t in data.batch(step, BATCH_SIZE))
        else:                                  # the first rows of the step's batch, on every rank
            inputs, targets = (t[:BATCH_SIZE // world_size] for t in data.batch(step, BATCH_SIZE))
        losses.append(sgd_step(model, optimizer, inputs, targets, lambda m: average_gradients(m, comm)))
    return {"checksums": checksums(model, comm), "losses": losses, "weights": flat(model)}


def _save(state, path: Path) -> None:
    """torch.save to a temporary name, then renamed: a killed save leaves no cut file under the real name."""
    partial = path.with_name(f".{path.name}.partial")
    torch.save(state, partial)
    os.replace(partial, path)


def zero_resume(rank: int, world_size: int, *, root: str, fixed: bool = False, steps_before: int = 2) -> dict:
    """ZeRO-1 (SGD with momentum, each rank the momentum of its shard) trained ``steps_before`` steps, saved
    under ``root`` (each rank its optimizer shard, rank 0 the weights), restarted from there and trained to STEPS.

    The bug: the resume loads the optimizer state as a replicated optimizer's would be loaded, on rank 0 and
    broadcast, so every rank takes rank 0's shard of the momentum: the shapes match, nothing fails, the run just
    goes elsewhere. The fix: each rank loads its own shard's file. Returns the weights at the end."""
    folder = Path(root)
    _, _, data = tiny()

    def trained(model, steps) -> list[float]:
        losses = []
        for step in steps:
            inputs, targets = (shard(t, rank, world_size) for t in data.batch(step, BATCH_SIZE))
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            model.step()
            losses.append(loss.item())
        return losses

    def zero(module):
        return ZeroDataParallel(module, Comm(), zero_stage=1, optimizer_class=torch.optim.SGD, lr=LR,
                                momentum=MOMENTUM)

    model = zero(tiny()[0])
    losses = trained(model, range(steps_before))
    _save(model.optimizer.state_dict(), folder / f"optimizer_rank{rank}.pt")
    if rank == 0:
        _save(model.module.state_dict(), folder / "weights.pt")
    dist.barrier()
    restarted = tiny()[0]                               # a new process would start here
    restarted.load_state_dict(torch.load(folder / "weights.pt"))
    model = zero(restarted)
    if fixed:
        state = torch.load(folder / f"optimizer_rank{rank}.pt")
    else:
        loaded = [torch.load(folder / "optimizer_rank0.pt") if rank == 0 else None]
        dist.broadcast_object_list(loaded, src=0)
        state = loaded[0]
    model.optimizer.load_state_dict(state)
    losses += trained(model, range(steps_before, STEPS))
    return {"losses": losses, "weights": model.full_parameters()}
