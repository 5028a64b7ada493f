"""Expert parallelism (专家并行): a mixture-of-experts MLP whose experts live on different ranks, tokens sent to
them and back with all-to-all.

A mixture of experts (MoE, 混合专家) replaces a block's one MLP with E MLPs, the *experts* (each a SwiGLU MLP,
course_lib.model's ``MLP``), and a *router* that sends every token to k of them. Parameters grow E-fold, the
work per token only k-fold: Mixtral 8x7B holds 46.7e9 parameters and uses 12.9e9 of them per token.

For T tokens x_t (the rows of [T, d]) and E experts:

    router     p_t = softmax(W_r·x_t)          W_r: [E, d]; p_t,i = how much token t wants expert i
    top-k      e_t,1 .. e_t,k = the k largest p_t,i;   w_t,j = p_t,e_tj / Σ_j' p_t,e_tj'
               (the k chosen probabilities renormalised to sum to 1, as Mixtral; normalize=False keeps p)
    capacity   C = ceil(capacity_factor · T · k / E)   slots per expert. capacity_factor = 1 is exactly enough
               if the router spreads the T·k assignments evenly; None means C = T, and nothing is ever dropped
               (top-k picks k different experts, so no expert can be asked for more than T slots)
    dispatch   the T·k assignments, every token's first choice before any second choice, each take the next
               free slot of their expert; an assignment that finds its expert's C slots full is *dropped*.
               buffer[i, c] = the token in slot c of expert i, zeros in empty slots           [E, C, d]
    experts    out[i] = expert_i(buffer[i])   (an empty slot stays 0: SwiGLU without biases maps 0 to 0)
    combine    y_t = Σ_j w_t,j · out[e_t,j, slot of (t, j)]   over the assignments that were kept

A dropped assignment adds nothing to y_t (the other weights are not renormalised). A token dropped by all of
its k experts gets y_t = 0, so the block's residual, x + mlp(norm(x)), carries it through unchanged.

Load-balancing loss (Switch Transformer eq. 4, GShard): a router left alone sends most tokens to a few experts.

    f_i = (assignments to expert i, before dropping) / (T·k)     the share of the work expert i is given
    P_i = (1/T) Σ_t p_t,i                                        the router's mean probability for expert i
    loss = E · Σ_i f_i · P_i

It is 1 when routing is even (f_i = P_i = 1/E) and grows as the router favours the experts it already fills.
f counts (no gradient); the gradient flows through P and lowers the probability of busy experts. Training adds
α·loss (α = 0.01 in the Switch paper; 0.02 in Mixtral's released configuration, ``router_aux_loss_coef`` of
its Hugging Face config.json, which the Mixtral paper does not state) to the language-model loss:
``total_aux_loss(model)``.

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

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .comm import Comm, wire_bytes
from .model import MLP, ModelConfig

# ------------------------------------------------------------------------------------------ routing


def capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Slots per expert: ceil(capacity_factor · tokens · top_k / num_experts); None means ``tokens`` (no drops)."""
    if capacity_factor is None:
        return tokens
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None: no token dropped)")
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


class Assignments(NamedTuple):
    """Where the router sent each of T tokens; [T, k] tensors hold one entry per (token, choice)."""
    probs: torch.Tensor      # [T, E] router probabilities p_t,i
    weights: torch.Tensor    # [T, k] combine weights w_t,j
    experts: torch.Tensor    # [T, k] chosen experts e_t,j
    slots: torch.Tensor      # [T, k] row of the [E·C, d] buffer: expert · C + position in its queue
    kept: torch.Tensor       # [T, k] False where the expert was full (dropped)
    requested: torch.Tensor  # [E] assignments each expert was asked for, before dropping


def route(logits: torch.Tensor, top_k: int, slots_per_expert: int, normalize: bool = True) -> Assignments:
    """Top-k routing of router ``logits`` [T, E] into experts of ``slots_per_expert`` slots each."""
    num_tokens, num_experts = logits.shape
    # Softmax in at least float32: in bf16 (8 significant bits) close probabilities tie, and the top-k would
    # pick among them by chance (float64 stays float64).
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    # Queue position of each assignment in its expert, first choices first: order them choice by choice, and
    # count how many earlier assignments went to the same expert (a running sum of one-hot rows).
    one_hot = F.one_hot(experts.t().reshape(-1), num_experts)            # [k·T, E]
    position = ((one_hot.cumsum(dim=0) - 1) * one_hot).sum(dim=-1)      # [k·T]
    position = position.view(top_k, num_tokens).t()                     # back to [T, k]
    return Assignments(probs, weights, experts, slots=experts * slots_per_expert + position,
                       kept=position < slots_per_expert, requested=one_hot.sum(dim=0))


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """E · Σ_i f_i · P_i from router ``probs`` [T, E] and chosen ``experts`` [T, k] (module docstring)."""
    num_experts = probs.shape[-1]
    share = F.one_hot(experts, num_experts).sum(dim=(0, 1)).to(probs.dtype) / experts.numel()   # f_i
    return num_experts * (share * probs.mean(dim=0)).sum()


@dataclass
class Routing:
    """What the router did with this rank's tokens in the last forward (``MoE.last_routing``)."""
    capacity: int                     # slots per expert, C
    requested_per_expert: list[int]   # assignments each expert was asked for (sums to T·k)
    kept_per_expert: list[int]        # min(requested, C): what it computed
    ep: int = 1                       # experts are spread over this many ranks, E/ep each

    @property
    def dropped(self) -> int:
        """Assignments (token, expert) dropped because the expert was full."""
        return sum(self.requested_per_expert) - sum(self.kept_per_expert)

    @property
    def tokens_per_rank(self) -> list[int]:
        """Kept assignments each EP rank's experts received from these tokens."""
        per_rank = len(self.kept_per_expert) // self.ep
        return [sum(self.kept_per_expert[r * per_rank:(r + 1) * per_rank]) for r in range(self.ep)]

    @property
    def imbalance(self) -> float:
        """Busiest expert's requests / the mean: 1.0 is even. A capacity_factor of at least this drops nothing."""
        requested = self.requested_per_expert
        return max(requested) * len(requested) / sum(requested)

    @staticmethod
    def total(routings: list[Routing]) -> Routing:
        """Several ranks' routings (what launch returns) added up: the group's load on each expert. Its
        capacity is then an expert's slots over the whole group (ep·C, the rows the expert computes)."""
        requested = [sum(counts) for counts in zip(*(r.requested_per_expert for r in routings))]
        kept = [sum(counts) for counts in zip(*(r.kept_per_expert for r in routings))]
        return Routing(sum(r.capacity for r in routings), requested, kept, routings[0].ep)


# ------------------------------------------------------------------------------------------ the layer


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


class MoE(nn.Module):
    """A mixture of ``config.num_experts`` SwiGLU experts, ``config.top_k`` per token; a drop-in for ``MLP``.

    After each forward: ``aux_loss`` (the load-balancing loss, with its gradient) and ``last_routing`` (a
    :class:`Routing`). ``capacity_factor=None`` drops nothing; ``apply_ep`` spreads the experts over ranks.
    """

    def __init__(self, config: ModelConfig, capacity_factor: float | None = None, normalize: bool = True):
        super().__init__()
        if not 1 <= config.top_k <= config.num_experts:
            raise ValueError(f"top_k={config.top_k} must be between 1 and num_experts={config.num_experts}")
        self.num_experts, self.top_k = config.num_experts, config.top_k
        self.capacity_factor, self.normalize = capacity_factor, normalize
        self.router = nn.Linear(config.hidden, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config) for _ in range(config.num_experts))
        self.comm: Comm | None = None   # set by apply_ep: then self.experts holds this rank's experts only,
        self.first_expert = 0           # the global numbers first_expert, first_expert + 1, ...
        self.aux_loss: torch.Tensor | None = None
        self.last_routing: Routing | None = None

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])                                   # [T, d]
        num_tokens, hidden = tokens.shape
        slots_per_expert = capacity(num_tokens, self.num_experts, self.top_k, self.capacity_factor)
        assigned = route(self.router(tokens), self.top_k, slots_per_expert, self.normalize)
        self.aux_loss = load_balancing_loss(assigned.probs, assigned.experts)

        # Dispatch: add each (token, choice) into its slot of the zero buffer. A dropped one is multiplied by 0 and
        # added to row 0 instead of being left out: every shape is then fixed before the router runs, so the
        # layer also runs on meta tensors (which have no values to select rows with).
        kept = assigned.kept.flatten()                                                 # [T·k], token by token
        keep = kept.to(x.dtype)[:, None]
        slots = torch.where(kept, assigned.slots.flatten(), 0)
        token_of = torch.arange(num_tokens, device=x.device).repeat_interleave(self.top_k)
        buffer = tokens.new_zeros(self.num_experts * slots_per_expert, hidden)
        buffer = buffer.index_add(0, slots, tokens[token_of] * keep)
        out = self._run_experts(buffer.view(self.num_experts, slots_per_expert, hidden))

        # Combine: each token sums its experts' outputs, weighted by the router (and by 0 where dropped).
        weights = assigned.weights.flatten().to(x.dtype)[:, None] * keep
        rows = out.reshape(-1, hidden)[slots] * weights
        y = tokens.new_zeros(num_tokens, hidden).index_add(0, token_of, rows)

        if not x.is_meta:   # counts need values; a meta tensor has none
            requested = assigned.requested.tolist()
            self.last_routing = Routing(slots_per_expert, requested, [min(n, slots_per_expert) for n in requested],
                                        ep=self.comm.size if self.comm else 1)
        return y.view(x.shape)

    def _run_experts(self, buffer: torch.Tensor) -> torch.Tensor:
        """Every expert on its slots: [E, C, d] -> [E, C, d], here or, under EP, on the ranks that hold them."""
        if self.comm is None:
            return torch.stack([expert(rows) for expert, rows in zip(self.experts, buffer)])
        ep, mine = self.comm.size, len(self.experts)
        _, slots_per_expert, hidden = buffer.shape
        received = AllToAll.apply(buffer, self.comm).view(ep, mine, slots_per_expert, hidden)
        # One call per expert over the rows of all ep ranks: [ep, C, d] -> [ep·C, d] and back.
        outputs = torch.stack([expert(received[:, i].reshape(-1, hidden)).view(ep, slots_per_expert, hidden)
                               for i, expert in enumerate(self.experts)], dim=1)     # [ep, mine, C, d]
        return AllToAll.apply(outputs, self.comm).view(buffer.shape)


def total_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the load-balancing losses of every MoE in ``model`` from its last forward."""
    return sum(module.aux_loss for module in model.modules() if isinstance(module, MoE))


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
        moe.comm = comm
    return model


def all_to_all_bytes(tokens: int, hidden: int, num_experts: int, top_k: int, capacity_factor: float | None,
                     ep: int, bytes_per_value: int = 4) -> float:
    """Bytes one rank sends in ONE all-to-all of one MoE layer: (ep-1)/ep · E · C · d · bytes_per_value, for
    ``tokens`` tokens on this rank. A forward makes two (dispatch, combine); forward and backward make four."""
    check_ep_divisible(num_experts, ep)
    buffer_bytes = num_experts * capacity(tokens, num_experts, top_k, capacity_factor) * hidden * bytes_per_value
    return wire_bytes("all_to_all", buffer_bytes, ep)


def drops_by_capacity(moe: MoE, x: torch.Tensor, capacity_factors=(0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)) -> list[dict]:
    """One forward of ``moe`` on ``x`` (no gradient) per capacity factor: the capacity C, the assignments
    dropped, and their share of the T·k. Rows for a figure of drops against the capacity factor."""
    saved, rows = moe.capacity_factor, []
    try:
        for factor in capacity_factors:
            moe.capacity_factor = factor
            with torch.no_grad():
                moe(x)
            routing = moe.last_routing
            rows.append({"capacity_factor": factor, "capacity": routing.capacity, "dropped": routing.dropped,
                         "dropped_share": routing.dropped / sum(routing.requested_per_expert)})
    finally:
        moe.capacity_factor = saved
    return rows
