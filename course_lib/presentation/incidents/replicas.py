"""Incidents where replicas are not what they should be: different weights, the same data, different dropout."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ...checkpoint import tp_placement
from ...comm import Comm
from ...data import shard
from ...ddp import broadcast_parameters
from ...model import loss_fn
from ...runtime.files import write_atomically
from ...tensor_parallel import apply_tp
from ...zero import ZeroDataParallel
from .common import (
    BATCH_SIZE,
    LR,
    STEPS,
    average_gradients,
    checksums,
    flat,
    reference,
    sgd_step,
    tiny,
)

MOMENTUM = 0.9           # the optimizer state a resume must restore: SGD's momentum buffer
DROPOUT, SEED = 0.1, 1234    # GPT-2's residual dropout; the job's seed


def unsynced_init(rank: int, world_size: int, *, fixed: bool = False, sync=None) -> dict:
    """Data parallelism whose replicas were built each from its own seed ("every rank its own randomness").

    The bug: nothing makes the replicas equal at the start; they get the same averaged gradient every step and
    stay apart forever. The fix, ``sync(model, comm)`` before the first step (default: nothing, or
    ddp.broadcast_parameters if ``fixed``): rank 0's weights on every rank, what DDP's constructor does."""
    sync = sync or (broadcast_parameters if fixed else None)
    model, optimizer, data = tiny(seed=rank)
    comm = Comm()
    if sync is not None:
        sync(model, comm)
    losses = []
    for step in range(STEPS):
        inputs, targets = (shard(t, rank, world_size) for t in data.batch(step, BATCH_SIZE))
        losses.append(sgd_step(model, optimizer, inputs, targets, lambda m: average_gradients(m, comm)))
    return {"checksums": checksums(model, comm), "losses": losses, "weights": flat(model)}


def rows_as_written(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The bug: "a batch of len(batch) / world_size rows", the same first rows on every rank."""
    return batch[:len(batch) // world_size]


def same_batch(rank: int, world_size: int, *, fixed: bool = False, rows_of=None) -> dict:
    """Data parallelism where each rank takes ``rows_of(batch, rank, world_size)`` of every step's global batch
    (default: rows_as_written, the bug, or data.shard, this rank's own slice, if ``fixed``).

    With the bug the world trains on a world_size-th of the data, each step averaging identical gradients; the
    replicas agree and the run is simply worse."""
    rows_of = rows_of or (shard if fixed else rows_as_written)
    model, optimizer, data = tiny()
    comm = Comm()
    losses = []
    for step in range(STEPS):
        inputs, targets = (rows_of(t, rank, world_size) for t in data.batch(step, BATCH_SIZE))
        losses.append(sgd_step(model, optimizer, inputs, targets, lambda m: average_gradients(m, comm)))
    return {"checksums": checksums(model, comm), "losses": losses, "weights": flat(model)}


def optimizer_file(folder: Path, rank: int) -> Path:
    """Where rank ``rank`` saves its optimizer shard."""
    return Path(folder) / f"optimizer_rank{rank}.pt"


def rank_0_s_state(folder: Path, rank: int) -> dict:
    """The bug: the optimizer state loaded as a replicated optimizer's would be, on rank 0 and broadcast, so
    every rank takes rank 0's shard. The shapes match, nothing fails."""
    loaded = [torch.load(optimizer_file(folder, 0)) if rank == 0 else None]
    dist.broadcast_object_list(loaded, src=0)
    return loaded[0]


def own_state(folder: Path, rank: int) -> dict:
    """The fix: each rank loads the shard it saved."""
    return torch.load(optimizer_file(folder, rank))


def zero_resume(rank: int, world_size: int, *, root: str, fixed: bool = False, steps_before: int = 2,
                load=None) -> dict:
    """ZeRO-1 (SGD with momentum, each rank the momentum of its shard) trained ``steps_before`` steps, saved
    under ``root`` (each rank its optimizer shard, rank 0 the weights), restarted from there, its optimizer state
    from ``load(folder, rank)`` (default: rank_0_s_state, the bug, or own_state if ``fixed``), and trained to
    STEPS. With the bug the momentum is another rank's and the run goes elsewhere. Returns the weights at the
    end."""
    load = load or (own_state if fixed else rank_0_s_state)
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
    write_atomically(optimizer_file(folder, rank), lambda partial: torch.save(model.optimizer.state_dict(), partial))
    if rank == 0:
        write_atomically(folder / "weights.pt", lambda partial: torch.save(model.module.state_dict(), partial))
    dist.barrier()
    restarted = tiny()[0]                               # a new process would start here
    restarted.load_state_dict(torch.load(folder / "weights.pt"))
    model = zero(restarted)
    model.optimizer.load_state_dict(load(folder, rank))
    losses += trained(model, range(steps_before, STEPS))
    return {"losses": losses, "weights": model.full_parameters()}


def residual_dropout(model, seed: int) -> None:
    """Dropout (rate DROPOUT) on what each block's attention and MLP add to the residual stream (GPT-2's
    resid_pdrop), its masks drawn from a generator seeded with ``seed``, one draw per sublayer in the order the
    forward runs them. Under TP the hook sees the row layer's output after its all-reduce: a tensor every TP
    rank holds whole."""
    generator = torch.Generator().manual_seed(seed)

    def drop(module, args, output):
        kept = torch.rand(output.shape, generator=generator, dtype=output.dtype) >= DROPOUT
        return output * kept / (1 - DROPOUT)
    for layer in model.layers:
        layer.attn.register_forward_hook(drop)
        layer.mlp.register_forward_hook(drop)


def tp_dropout(rank: int, world_size: int, *, fixed: bool = False) -> dict:
    """Tensor parallelism over world_size ranks (every rank the same batch), with residual dropout.

    The bug: the dropout generator seeded with SEED + rank, "each rank its own randomness" (right across
    data-parallel ranks, which should see different noise). TP ranks then drop different units of activations
    they must agree on, so their copies of the weights TP does not split (norms, embedding, head) get different
    gradients and drift apart, and no rank trains the model the single process would. The fix: one seed for the
    TP group. Megatron-LM seeds its default generator the same on every TP rank and keeps a second one,
    offset by the TP rank, for dropout inside the split region (attention probabilities)."""
    comm = Comm()
    whole, _, data = tiny()
    model = apply_tp(whole, comm)
    residual_dropout(model, SEED if fixed else SEED + rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = [sgd_step(model, optimizer, *data.batch(step, BATCH_SIZE)) for step in range(STEPS)]
    replicated = [name for name, (_, _, split) in tp_placement(model).items() if not split]
    return {"losses": losses, "checksums": checksums(model, comm, replicated),
            "replicated": {name: p.detach().clone() for name, p in model.named_parameters() if name in replicated}}


def tp_dropout_reference() -> dict:
    """One process with the same dropout (seed SEED): its weights by name, which tp_dropout's replicated weights
    must equal."""
    model = reference(prepare=lambda m: residual_dropout(m, SEED))
    return {name: p.detach() for name, p in model.named_parameters()}
