"""Expert parallelism (专家并行): a mixture of experts (course_lib.feed_forward) whose experts live on different ranks,
tokens sent to them and back with all-to-all.

Expert parallelism over an EP group of ep ranks (``apply_ep``): rank r keeps experts [r·E/ep, (r+1)·E/ep)
(E % ep == 0) and its own tokens. Everything else, the router included, is replicated, as in data
parallelism, and its gradients are summed over the group like DDP's. The buffer [E, C, d] is ordered by expert,
so it is already ep equal chunks, chunk j for rank j's experts:

    dispatch   all_to_all(buffer)      chunk i received = rank i's tokens for my experts: [ep, E/ep, C, d]
    experts    each of my experts runs once on its ep·C rows, from every rank at once
    combine    all_to_all(outputs)     back to the tokens' own ranks, in expert order: [E, C, d]

Every buffer is padded to C slots per expert (GShard's choice). The alternative, exchanging counts first and
then sending only the real rows with all_to_all_single's split sizes (dropless MoE, as in Megatron), sends
fewer bytes but costs a second collective and shapes known only at run time. With padding the bytes are known
in advance; a rank keeps its own chunk and sends the other ep-1:

    bytes sent per rank, per all-to-all  =  (ep-1)/ep · E · C · d · bytes_per_value
    per MoE layer and step: 4 all-to-alls (dispatch and combine forward; their gradients travel back the same
    way in backward, since an all-to-all's gradient is an all-to-all)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .comm import Comm, wire_bytes
from .feed_forward import MoE, capacity

# The MoE layer itself lives with the model (course_lib.feed_forward); notebook 08 imports these from here.
from .feed_forward import Routing as Routing
from .feed_forward import drops_by_capacity as drops_by_capacity


class AllToAll(torch.autograd.Function):
    """all_to_all forward, all_to_all of the gradient backward. An all-to-all only moves chunks (rank r's chunk j
    becomes rank j's chunk r), and doing it twice puts every chunk back: its gradient is the same exchange."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_to_all(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.comm), None


def _all_to_all(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    x = x.contiguous()
    received = torch.empty_like(x)
    comm.all_to_all(received, x)
    return received


class ExpertExchange:
    """What apply_ep puts in an MoE: its experts run for every rank of ``comm``, tokens dispatched and combined
    with all-to-all (module docstring)."""

    def __init__(self, comm: Comm):
        self.comm = comm

    def __call__(self, experts: nn.ModuleList, buffer: torch.Tensor) -> torch.Tensor:
        """[E, C, d] of this rank's tokens -> their outputs, each expert run once on the rows of all ep ranks."""
        ep, mine = self.comm.size, len(experts)
        _, slots_per_expert, hidden = buffer.shape
        received = AllToAll.apply(buffer, self.comm).view(ep, mine, slots_per_expert, hidden)
        # One call per expert over the rows of all ep ranks: [ep, C, d] -> [ep·C, d] and back.
        outputs = torch.stack([expert(received[:, i].reshape(-1, hidden)).view(ep, slots_per_expert, hidden)
                               for i, expert in enumerate(experts)], dim=1)     # [ep, mine, C, d]
        return AllToAll.apply(outputs, self.comm).view(buffer.shape)


# -------------------------------------------------------------------------------- expert parallelism


def check_ep_divisible(num_experts: int, ep: int) -> None:
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} cannot split over ep={ep}: every rank holds num_experts/ep "
                         f"whole experts ({num_experts} % {ep} = {num_experts % ep})")


def apply_ep(model: nn.Module, comm: Comm) -> nn.Module:
    """Expert parallelism over ``comm``'s group, in place: every MoE in ``model`` (or ``model`` itself) keeps
    only this rank's num_experts/ep experts and sends tokens to the others with all-to-all."""
    for moe in [module for module in model.modules() if isinstance(module, MoE)]:
        check_ep_divisible(moe.num_experts, comm.size)
        mine = moe.num_experts // comm.size
        moe.first_expert = comm.rank * mine
        moe.experts = nn.ModuleList(list(moe.experts)[moe.first_expert:moe.first_expert + mine])
        moe.comm, moe.exchange = comm, ExpertExchange(comm)
    return model


def all_to_all_bytes(tokens: int, hidden: int, num_experts: int, top_k: int, capacity_factor: float | None,
                     ep: int, bytes_per_value: int = 4) -> float:
    """Bytes one rank sends in ONE all-to-all of one MoE layer: (ep-1)/ep · E · C · d · bytes_per_value, for
    ``tokens`` tokens on this rank. A forward makes two (dispatch, combine); forward and backward make four."""
    check_ep_divisible(num_experts, ep)
    buffer_bytes = num_experts * capacity(tokens, num_experts, top_k, capacity_factor) * hidden * bytes_per_value
    return wire_bytes("all_to_all", buffer_bytes, ep)
