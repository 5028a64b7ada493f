"""Global gradient-norm clipping (梯度裁剪) when the gradients live on many ranks.

One process clips by the norm of all the model's gradients together (torch.nn.utils.clip_grad_norm_):

    ‖g‖ = sqrt(Σ over every parameter element g²)      coef = min(1, max_norm / (‖g‖ + 1e-6))      g ← coef·g

Split over ranks, each rank holds some elements of g, and some elements sit on several ranks:

    TP    a split weight's elements are on one tp rank each; norms (and here embedding and head) on all tp ranks
    PP    each stage its own layers: disjoint
    DP    plain DDP: every dp rank holds every element; ZeRO-1/2/3: each element's averaged gradient on its owner
    EP    an expert on one rank of its EP group; the router and the rest of the layer on all of them

The global norm is one all-reduce of one number: each rank adds up the squares of the elements it *counts*, every
element counted by exactly one rank, and the world sums them. Counting a replicated element on every rank that
holds it is the classic silent bug: with tp = 4 the norms' squares count 4 times, the norm comes out too big, the
clip too strong, and nothing fails; the loss is just a little worse. Megatron-LM filters the same way
(param_is_not_tensor_parallel_duplicate). Who counts is who writes in a checkpoint (course_lib.checkpoint): a
replica's tp rank 0, dp rank 0 without ZeRO, the owner with it; an expert's first replica, a shared weight's dp
rank 0. torch's own clip_grad_norm_ on DTensor parameters does the same from each DTensor's placements: a
Shard(d) placement sums the squares over that mesh dimension, a Replicate one does not.

Squares are summed in float64 whatever the gradients' dtype (a bf16 sum of thousands of squares loses digits);
the norm is the 2-norm (an inf-norm would take a max instead of a sum: not needed here).
"""

from __future__ import annotations

import torch

from .checkpoint import shard_pieces, tp_placement
from .comm import Comm


def global_norm(counted: list[torch.Tensor], comm: Comm) -> torch.Tensor:
    """sqrt of the sum over the ranks of ``comm`` of each rank's Σ g² over ``counted`` (the elements it counts)."""
    device = counted[0].device if counted else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad in counted:
        total += grad.detach().double().pow(2).sum()
    comm.all_reduce(total)
    return total.sqrt()


def clip_(grads: list[torch.Tensor], counted: list[torch.Tensor], comm: Comm, max_norm: float) -> torch.Tensor:
    """Scale every gradient this rank holds (``grads``, replicas included) by torch's coefficient
    min(1, max_norm / (norm + 1e-6)) of the global norm of ``counted``; return the norm."""
    norm = global_norm(counted, comm)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coef.to(grad.dtype))
    return norm


def zero_counted(data_parallel, mesh, rank: int) -> list[torch.Tensor]:
    """The gradient elements this rank counts in a ZeroDataParallel (any stage) over TP and PP pieces: views of
    its flat gradient shards, the boxes a checkpoint would have it write."""
    grads = [unit.shard.grad for unit in data_parallel.units]
    pieces = shard_pieces(data_parallel, mesh, rank, {"grad": grads})["grad"]
    return [view for piece in pieces.values() if piece.writes for view in piece.views().values()]


def clip_zero_(data_parallel, mesh, rank: int, max_norm: float, comm: Comm | None = None) -> torch.Tensor:
    """Clip a ZeroDataParallel's averaged gradients (after finish_gradient_sync, before step) by the global norm
    over every rank of ``comm`` (default: the world); return the norm."""
    grads = [unit.shard.grad for unit in data_parallel.units]
    return clip_(grads, zero_counted(data_parallel, mesh, rank), comm or Comm(), max_norm)


def counted_parameters(module: torch.nn.Module, mesh, rank: int) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters of ``module`` (this rank's piece, not ZeRO-sharded) whose gradients this rank counts: a
    TP-split one on every tp rank, a TP replica on tp rank 0; an expert (a module under an MoE's ``experts``,
    expert_parallel.apply_ep) on the first of its expert-dp replicas, anything else on dp rank 0 (and cp rank 0)."""
    place = mesh._place(rank)
    placement = tp_placement(module)
    counted = []
    for name, param in module.named_parameters():
        tp_ok = placement[name][2] or place["tp"] == 0
        copies_ok = place["ep_group"] == 0 if ".experts." in f".{name}" else place["dp"] == 0 and place["cp"] == 0
        if tp_ok and copies_ok:
            counted.append((name, param))
    return counted


def naive_norm(module: torch.nn.Module, comm: Comm) -> torch.Tensor:
    """The bad smell: every rank's squares of everything it holds, summed over the ranks: replicas count as many
    times as there are copies."""
    return global_norm([p.grad for p in module.parameters()], comm)
