"""Incidents that run and converge, only worse: a gradient that is wrong by a factor somewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checkpoint import tp_placement
from ...clip import counted_parameters, global_norm, naive_norm
from ...comm import Comm
from ...data import shard
from ...mesh import Mesh
from ...model import loss_fn
from ...tensor_parallel import apply_tp
from .common import BATCH_SIZE, LR, STEPS, average_gradients, flat, reference, sgd_step, tiny

IGNORE = -100           # cross_entropy's ignore_index: a padding position that is no target
MAX_NORM = 0.5          # the tiny model's gradient norm is ~2: clipped every step


def pad(targets: torch.Tensor, step: int) -> torch.Tensor:
    """Sequences of different lengths: row i of step ``step`` keeps its first 2 + (5i + 3·step) mod 14 targets,
    the rest are padding (IGNORE)."""
    padded = targets.clone()
    for row in range(len(padded)):
        padded[row, 2 + (5 * row + 3 * step) % (padded.shape[1] - 2):] = IGNORE
    return padded


def mean_per_micro_batch(logits, targets, *, real_tokens, world_size: int, accumulation: int):
    """The bug (it shipped in a widely used trainer until 2024): each micro-batch's loss the mean over its own
    real tokens, divided by the number of micro-batches. A token of a short micro-batch weighs more than one of a
    long one, so the accumulated step is not the big-batch step."""
    return loss_fn(logits, targets) / accumulation


def mean_over_the_batch(logits, targets, *, real_tokens, world_size: int, accumulation: int):
    """The fix: the token losses summed and divided by the real tokens of the whole global batch, times
    world_size, which the gradients' average over the ranks divides back out."""
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    return loss * world_size / real_tokens


def token_mean(rank: int, world_size: int, *, fixed: bool = False, accumulation: int = 2, loss_of=None) -> dict:
    """Data parallelism with ``accumulation`` micro-batches a step, on padded sequences (``pad``), each
    micro-batch's loss from ``loss_of`` (default: mean_per_micro_batch, or mean_over_the_batch if ``fixed``)."""
    loss_of = loss_of or (mean_over_the_batch if fixed else mean_per_micro_batch)
    model, optimizer, data = tiny()
    comm = Comm()
    losses = []
    for step in range(STEPS):
        inputs, targets = data.batch(step, BATCH_SIZE)
        targets = pad(targets, step)
        real_tokens = (targets != IGNORE).sum()          # the global batch's: every rank knows it
        inputs, targets = shard(inputs, rank, world_size), shard(targets, rank, world_size)
        optimizer.zero_grad()
        total = 0.0
        for micro_inputs, micro_targets in zip(inputs.chunk(accumulation), targets.chunk(accumulation)):
            loss = loss_of(model(micro_inputs), micro_targets, real_tokens=real_tokens, world_size=world_size,
                           accumulation=accumulation)
            loss.backward()
            total += loss.item()
        average_gradients(model, comm)
        optimizer.step()
        losses.append(total)
    return {"weights": flat(model), "losses": losses}


def token_mean_reference() -> torch.Tensor:
    """One process on each whole padded batch, the loss a mean over its real tokens (cross_entropy ignores the
    padding): the weights token_mean must reach."""
    return flat(reference(mask=pad))


def tp_norm(rank: int, world_size: int, *, fixed: bool = False) -> dict:
    """Tensor parallelism over world_size ranks (every rank the same batch), gradients clipped to MAX_NORM.

    The bug: the norm adds every rank's squares of every gradient it holds, so the weights every TP rank holds
    whole (norms, embedding, head) count world_size times; the norm is too big and the clip too strong. The fix:
    each element counted by one rank (clip.counted_parameters: a replica on tp rank 0 only)."""
    comm = Comm()
    whole, _, data = tiny()
    model = apply_tp(whole, comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)       # on the split weights
    counted = [p for _, p in counted_parameters(model, Mesh(tp=world_size), rank)]
    norms = []

    def clip(m):
        norm = global_norm([p.grad for p in counted], comm) if fixed else naive_norm(m, comm)
        norms.append(norm.item())
        for param in m.parameters():
            param.grad *= torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)   # torch's clip_grad_norm_ coefficient

    losses = [sgd_step(model, optimizer, *data.batch(step, BATCH_SIZE), clip) for step in range(STEPS)]
    split = tp_placement(model)
    return {"norms": norms, "losses": losses,     # the weights every TP rank holds whole, to compare by name
            "replicated": {name: p.detach().clone() for name, p in model.named_parameters() if not split[name][2]}}


def tp_norm_reference() -> dict:
    """One process clipping with torch's clip_grad_norm_ (MAX_NORM): its norms and its weights by name."""
    norms = []

    def clip(model):
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
    model = reference(sync=clip)
    return {"norms": norms, "weights": {name: p.detach() for name, p in model.named_parameters()}}
