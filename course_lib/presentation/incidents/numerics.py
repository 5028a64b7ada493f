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
from .common import BATCH_SIZE, LR, STEPS, average_gradients, flat, flat_gradients, reference, sgd_step, tiny

IGNORE = -100           # cross_entropy's ignore_index: a padding position that is no target
MAX_NORM = 0.5          # the tiny model's gradient norm is ~2: clipped every step
GLOBAL_TOKENS = 2**20   # fp16_loss_scale's job: a step of 2^20 tokens (8,192 micro-batches like the one it runs)
FP16_STEPS, ADAM_LR = 10, 1e-2
LOSS_SCALE = 2.0**16    # GradScaler's default starting scale


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


def unscaled_step(loss, optimizer, scaler, sync) -> None:
    """The bug: the step as written for bfloat16, which has float32's 8 exponent bits and needs no scaling:
    backward on the loss itself. In fp16 most of its gradients round to zero."""
    loss.backward()
    sync()
    optimizer.step()


def scaled_step(loss, optimizer, scaler, sync) -> None:
    """The fix: torch.amp.GradScaler multiplies the loss by its scale before backward, and ``scaler.step``
    divides the fp32 gradients back before the update (it skips a step whose gradients overflowed, and
    ``update`` then halves the scale)."""
    scaler.scale(loss).backward()
    sync()
    scaler.step(optimizer)
    scaler.update()


def fp16_loss_scale(rank: int, world_size: int, *, fixed: bool = False, steps: int = FP16_STEPS,
                    step_of=None) -> dict:
    """Data parallelism in fp16 mixed precision (fp32 weights and Adam, forward and backward under
    torch.autocast(float16)), each micro-batch's loss its tokens' summed loss over the step's GLOBAL_TOKENS, as
    mean_over_the_batch does. The job accumulates 8,192 such micro-batches a step; this runs the first one of
    each step, because what goes wrong happens inside one micro-batch's backward, before anything is added up.

    Each step ends with ``step_of(loss, optimizer, scaler, sync)`` (default: unscaled_step, the bug, or
    scaled_step if ``fixed``), ``sync()`` averaging the gradients over the ranks. The loss is ~1e-7 of a mean
    and so is every gradient the backward computes: in fp16 (smallest normal 6.1e-5, smallest subnormal 6.0e-8)
    most of them round to zero or to a few bits, and the weights they belong to stop learning. Returns the
    losses (as means per token) and step 0's gradient as the optimizer saw it, in float32."""
    step_of = step_of or (scaled_step if fixed else unscaled_step)
    model, _, data = tiny()
    model.float()                           # fp32 weights, as mixed precision keeps them
    optimizer = torch.optim.Adam(model.parameters(), lr=ADAM_LR)   # Adam: a scaled gradient takes the same step
    scaler = torch.amp.GradScaler("cpu", init_scale=LOSS_SCALE)
    comm = Comm()
    seen = []                               # the gradients as the optimizer's first step sees them

    def record_first(optimizer, args, kwargs):
        if not seen:
            seen.append(flat_gradients(model))
    optimizer.register_step_pre_hook(record_first)
    losses = []
    for step in range(steps):
        inputs, targets = (shard(t, rank, world_size) for t in data.batch(step, BATCH_SIZE))
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(inputs)
        loss = mean_over_the_batch(logits.float(), targets, real_tokens=GLOBAL_TOKENS, world_size=world_size,
                                   accumulation=1)
        step_of(loss, optimizer, scaler, lambda: average_gradients(model, comm))
        logged = loss.detach().reshape(1)
        comm.all_reduce(logged)             # the global batch's loss, as one process logs it
        losses.append(logged.item() * GLOBAL_TOKENS / (world_size * world_size * targets.numel()))
    return {"losses": losses, "gradient": seen[0] if seen else None}


def fp16_reference(steps: int = FP16_STEPS) -> dict:
    """fp16_loss_scale's run in one process in float64 (no autocast): its losses and step 0's gradient."""
    model, _, data = tiny()
    optimizer = torch.optim.Adam(model.parameters(), lr=ADAM_LR)
    losses, first_gradient = [], None
    for step in range(steps):
        inputs, targets = data.batch(step, BATCH_SIZE)
        optimizer.zero_grad()
        loss = mean_over_the_batch(model(inputs), targets, real_tokens=GLOBAL_TOKENS, world_size=1, accumulation=1)
        loss.backward()
        if first_gradient is None:
            first_gradient = flat_gradients(model)
        optimizer.step()
        losses.append(loss.item() * GLOBAL_TOKENS / targets.numel())
    return {"losses": losses, "gradient": first_gradient}


def flushed(gradient: torch.Tensor, expected: torch.Tensor) -> float:
    """The share of the gradient's entries that are exactly zero where ``expected`` (float64) is not."""
    alive = expected != 0
    return ((gradient == 0) & alive).sum().item() / alive.sum().item()
