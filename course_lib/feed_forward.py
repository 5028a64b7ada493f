"""The block's feed-forward layers: the SwiGLU MLP, and a mixture of experts (混合专家) built from it.

MLP (SwiGLU) = down_proj(silu(gate_proj(x)) * up_proj(x)): a dense block's feed-forward layer.

A mixture of experts (MoE, 混合专家) replaces a block's one MLP with E MLPs, the *experts* (each a SwiGLU MLP,
MLP above), and a *router* that sends every token to k of them. Parameters grow E-fold, the
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

course_lib.model builds a block's MLP or MoE from here; spreading the experts over ranks (expert parallelism,
all-to-all) is course_lib.expert_parallel's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden, config.intermediate, bias=False)
        self.up_proj = nn.Linear(config.hidden, config.intermediate, bias=False)
        self.down_proj = nn.Linear(config.intermediate, config.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))



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


class MoE(nn.Module):
    """A mixture of ``config.num_experts`` SwiGLU experts, ``config.top_k`` per token; a drop-in for ``MLP``.

    After each forward: ``aux_loss`` (the load-balancing loss, with its gradient) and ``last_routing`` (a
    :class:`Routing`). ``capacity_factor=None`` drops nothing; ``apply_ep`` spreads the experts over ranks.
    """

    def __init__(self, config, capacity_factor: float | None = None, normalize: bool = True):
        super().__init__()
        if not 1 <= config.top_k <= config.num_experts:
            raise ValueError(f"top_k={config.top_k} must be between 1 and num_experts={config.num_experts}")
        self.num_experts, self.top_k = config.num_experts, config.top_k
        self.capacity_factor, self.normalize = capacity_factor, normalize
        self.router = nn.Linear(config.hidden, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config) for _ in range(config.num_experts))
        self.comm = None                # set by expert_parallel.apply_ep: then self.experts holds this rank's experts
        self.first_expert = 0           # only, the global numbers first_expert, first_expert + 1, ...,
        self.exchange = None            # and this callable (experts.ExpertExchange) runs them for every rank
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
        if self.exchange is None:
            return torch.stack([expert(rows) for expert, rows in zip(self.experts, buffer)])
        return self.exchange(self.experts, buffer)


def total_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the load-balancing losses of every MoE in ``model`` from its last forward."""
    return sum(module.aux_loss for module in model.modules() if isinstance(module, MoE))



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
