"""Mixture of experts and expert parallelism: the layer against a token-by-token sum over its chosen experts,
capacity and dropping, the load-balancing loss, EP over 2 and 4 ranks against one process (output, loss,
gradients), the all-to-all bytes against the formula, and the MoE preset counted exactly."""

import types

import pytest
import torch

from course_lib import launch
from course_lib.comm import Comm
from course_lib.expert_parallel import all_to_all_bytes, apply_ep
from course_lib.feed_forward import (
    MoE,
    Routing,
    capacity,
    drops_by_capacity,
    load_balancing_loss,
    route,
    total_aux_loss,
)
from course_lib.ledger import active_params_per_token
from course_lib.model import build, count_params, loss_fn, preset

pytestmark = pytest.mark.ranks   # run apart with: pytest -m ranks

# float64: the split changes only which rows a matmul sees at once and the order of the router gradient's sum
# over ranks, so both sides agree to rounding (~1e-15); a wrong slot, weight or expert is off by > 1e-3.
F64 = dict(rtol=0, atol=1e-9)
CONFIG = preset("tiny", num_experts=8, top_k=2)   # hidden 64, intermediate 128: 8 SwiGLU experts, 2 per token


def moe_and_tokens(seed=0, tokens=(2, 16), capacity_factor=None):
    torch.manual_seed(seed)
    moe = MoE(CONFIG, capacity_factor=capacity_factor).double()
    return moe, torch.randn(*tokens, CONFIG.hidden, dtype=torch.float64)


def one_by_one(moe, x, kept=None):
    """y_t = Σ_j w_t,j · expert_e_t,j(x_t), token by token, choice by choice (only ``kept`` ones if given)."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, experts = moe.router(tokens).softmax(-1).topk(moe.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    y = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(moe.top_k):
            if kept is None or kept[t, j]:
                y[t] += weights[t, j] * moe.experts[experts[t, j]](tokens[t])
    return y.view(x.shape)


# ---- the layer, in one process ------------------------------------------------------------------------

def test_moe_is_the_weighted_sum_of_each_tokens_chosen_experts():
    moe, x = moe_and_tokens()
    y = moe(x)
    assert torch.allclose(y, one_by_one(moe, x), **F64)
    routing = moe.last_routing
    assert routing.capacity == 32 and routing.dropped == 0                     # capacity None: C = T, no drops
    assert sum(routing.requested_per_expert) == 32 * 2 == sum(routing.tokens_per_rank)


def test_capacity_is_the_ceiling_of_factor_tokens_k_over_experts():
    assert capacity(64, 8, 2, 1.0) == 16 and capacity(64, 8, 2, 0.5) == 8
    assert capacity(10, 8, 2, 1.0) == 3                                          # 2.5 slots round up
    assert capacity(10, 8, 2, None) == 10
    with pytest.raises(ValueError, match="capacity_factor=0 must be > 0"):
        capacity(10, 8, 2, 0)


def test_first_choices_take_slots_first_and_a_token_dropped_everywhere_outputs_zero():
    # 4 tokens, 2 experts, k = 1, all want expert 0; 2 slots: tokens 0 and 1 get them, 2 and 3 are dropped.
    logits = torch.tensor([[2.0, 0.0]] * 4, dtype=torch.float64)
    assigned = route(logits, top_k=1, slots_per_expert=2)
    assert assigned.kept.flatten().tolist() == [True, True, False, False]
    assert assigned.requested.tolist() == [4, 0]
    # k = 2: every first choice (expert 0) is queued before any second choice (expert 1).
    logits = torch.tensor([[2.0, 0.0, -1.0]] * 3, dtype=torch.float64)
    assigned = route(logits, top_k=2, slots_per_expert=2)
    assert assigned.experts.tolist() == [[0, 1]] * 3
    assert assigned.kept.tolist() == [[True, True], [True, True], [False, False]]
    assert assigned.slots[:2].tolist() == [[0, 2 + 0], [1, 2 + 1]]                # expert · C + position
    # In the layer: a dropped choice adds nothing, and a token dropped by both of its experts gets exactly 0.
    moe, x = moe_and_tokens(capacity_factor=0.5)
    y = moe(x)
    tokens = x.reshape(-1, CONFIG.hidden)
    kept = route(moe.router(tokens), 2, moe.last_routing.capacity).kept
    assert moe.last_routing.dropped == (~kept).sum().item() > 0
    assert torch.allclose(y, one_by_one(moe, x, kept), **F64)
    assert (y.reshape(-1, CONFIG.hidden)[~kept.any(dim=1)] == 0).all()


def test_drops_grow_as_capacity_shrinks_and_vanish_when_it_is_large():
    moe, x = moe_and_tokens()
    rows = drops_by_capacity(moe, x, capacity_factors=(0.25, 0.5, 1.0, 2.0, 4.0))
    dropped = [row["dropped"] for row in rows]
    assert dropped == sorted(dropped, reverse=True)                              # never more room, more drops
    assert dropped[1] > 0 and dropped[-1] == 0                                   # 0.5 drops; 4 = E/k is C = T
    assert [row["capacity"] for row in rows] == [2, 4, 8, 16, 32]
    assert moe.capacity_factor is None                                           # the layer is left as it was
    routing = moe.last_routing
    assert routing.kept_per_expert == [min(n, 32) for n in routing.requested_per_expert]
    assert routing.imbalance == max(routing.requested_per_expert) / (64 / 8) > 1
    one_slot_short = (max(routing.requested_per_expert) - 1) / (64 / 8)    # C = the busiest expert's load - 1
    at, below = drops_by_capacity(moe, x, capacity_factors=(routing.imbalance, one_slot_short))
    assert at["dropped"] == 0 and below["dropped"] >= 1


def test_load_balancing_loss_is_one_when_even_and_e_when_one_expert_takes_all():
    num_experts, tokens = 4, 8
    even_probs = torch.full((tokens, num_experts), 1 / num_experts, dtype=torch.float64)
    even_choice = torch.arange(tokens).remainder(num_experts)[:, None]
    assert load_balancing_loss(even_probs, even_choice).item() == pytest.approx(1.0, abs=1e-15)
    all_to_one = torch.zeros((tokens, num_experts), dtype=torch.float64)
    all_to_one[:, 0] = 1.0
    assert load_balancing_loss(all_to_one, torch.zeros(tokens, 1, dtype=torch.long)).item() == num_experts
    # by hand: f = (3/4, 1/4), P = (0.6, 0.4) -> 2 · (0.45 + 0.1) = 1.1
    probs = torch.tensor([[0.6, 0.4]] * 4, dtype=torch.float64)
    assert load_balancing_loss(probs, torch.tensor([[0], [0], [0], [1]])).item() == pytest.approx(1.1, abs=1e-15)


def test_moe_blocks_in_the_gpt_train_and_their_losses_sum():
    model = build(preset("tiny", num_experts=4, top_k=2), seed=0, dtype=torch.float64)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = loss_fn(model(tokens), tokens) + 0.01 * total_aux_loss(model)
    loss.backward()
    moes = [layer.mlp for layer in model.layers]
    assert total_aux_loss(model).item() == pytest.approx(sum(m.aux_loss.item() for m in moes), abs=1e-15)
    assert all(m.router.weight.grad.abs().sum() > 0 for m in moes)
    assert all(sum(m.last_routing.requested_per_expert) == 2 * 16 * 2 for m in moes)


def test_expert_parallel_needs_whole_experts_per_rank():
    moe, _ = moe_and_tokens()
    with pytest.raises(ValueError, match=r"^num_experts=8 cannot split over ep=3: every rank holds num_experts/ep "
                                         r"whole experts \(8 % 3 = 2\)$"):
        apply_ep(moe, types.SimpleNamespace(size=3, rank=0))
    with pytest.raises(ValueError, match="num_experts=8 cannot split over ep=3"):
        all_to_all_bytes(16, 64, 8, 2, None, ep=3)


# ---- expert parallelism over ranks --------------------------------------------------------------------

def ep_against_one_process(rank, world_size, tokens_per_rank=(2, 8)):
    """Every rank builds the same whole MoE as the reference and runs it on every rank's tokens; then the EP
    layer (this rank's experts only) runs on this rank's tokens. Returns the largest differences."""
    def tokens_and_probe(r):
        generator = torch.Generator().manual_seed(100 + r)
        x = torch.randn(*tokens_per_rank, CONFIG.hidden, dtype=torch.float64, generator=generator)
        return x.requires_grad_(), torch.randn(x.shape, dtype=torch.float64, generator=generator)

    reference, _ = moe_and_tokens()
    objective, reference_out = 0.0, {}
    for r in range(world_size):     # one process, every rank's tokens: the experts' gradients sum over ranks
        x, probe = tokens_and_probe(r)
        y = reference(x)
        objective = objective + (y * probe).sum() + 0.01 * reference.aux_loss
        reference_out[r] = (x, y.detach(), reference.aux_loss.detach())
    objective.backward()

    comm = Comm()
    moe = apply_ep(moe_and_tokens()[0], comm)
    x, probe = tokens_and_probe(rank)
    with comm.trace() as log:
        y = moe(x)
        ((y * probe).sum() + 0.01 * moe.aux_loss).backward()
    comm.all_reduce(moe.router.weight.grad)     # the replicated router: its gradient summed over ranks, as DDP
    ref_x, ref_y, ref_loss = reference_out[rank]
    worst = {"output": (y - ref_y).abs().max().item(), "aux loss": abs(moe.aux_loss.item() - ref_loss.item()),
             "input grad": (x.grad - ref_x.grad).abs().max().item(),
             "router grad": (moe.router.weight.grad - reference.router.weight.grad).abs().max().item()}
    for i, expert in enumerate(moe.experts):
        theirs = dict(reference.experts[moe.first_expert + i].named_parameters())
        for name, param in expert.named_parameters():
            worst[f"expert {moe.first_expert + i} {name}"] = (param.grad - theirs[name].grad).abs().max().item()

    # The bytes with a capacity that is not the whole batch: ceil(1.25 · 16 · 2 / 8) = 5 slots per expert.
    moe.capacity_factor = 1.25
    with comm.trace() as capped:
        moe(x).sum().backward()
    traced = {"uncapped": [(r.op, r.payload_bytes, r.wire_bytes) for r in log.records],
              "capped": [(r.op, r.payload_bytes, r.wire_bytes) for r in capped.records]}
    return worst, len(moe.experts), traced, moe.last_routing


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_matches_one_process_and_sends_the_predicted_bytes(ep):
    results = launch(ep_against_one_process, ep)
    tokens, d, experts, k = 2 * 8, CONFIG.hidden, 8, 2
    for worst, local_experts, traced, routing in results:
        assert local_experts == experts // ep
        assert len(worst) == 4 + local_experts * 3                                 # every local expert compared
        assert max(worst.values()) <= F64["atol"], worst
        for name, factor in [("uncapped", None), ("capped", 1.25)]:
            slots = capacity(tokens, experts, k, factor)
            payload = experts * slots * d * 8                                       # the [E, C, d] float64 buffer
            predicted = all_to_all_bytes(tokens, d, experts, k, factor, ep, bytes_per_value=8)
            assert predicted == (ep - 1) / ep * payload
            # dispatch and combine forward, their gradients backward: 4 all-to-alls, nothing else
            assert traced[name] == [("all_to_all", payload, predicted)] * 4
        assert routing.capacity == 5 and len(routing.tokens_per_rank) == ep
    group = Routing.total([routing for *_, routing in results])
    assert sum(group.requested_per_expert) == ep * tokens * k and group.capacity == ep * 5


# ---- the MoE preset -----------------------------------------------------------------------------------

def test_mixtral_total_and_active_parameters_match_the_published_figures():
    config = preset("mixtral-8x7b")
    total, active = count_params(config), active_params_per_token(config)
    assert total == 46_702_792_704                       # published: 46.7B
    assert active == 12_879_925_248                      # published: 12.9B per token (2 of 8 experts)
    assert total - active == 32 * 6 * 3 * 4096 * 14336   # the 6 experts a token skips, in every layer
    assert active_params_per_token(preset("llama2-7b")) == count_params(preset("llama2-7b"))   # dense: all


def test_moe_layer_runs_on_meta_tensors():
    """Drops change no shape (a dropped choice is added × 0), so a MoE model traces on meta, as big models do."""
    model = build(preset("mixtral-8x7b", num_layers=1), device="meta")
    logits = model(torch.zeros(1, 8, dtype=torch.long, device="meta"))
    assert logits.shape == (1, 8, 32000) and logits.is_meta and model.layers[0].mlp.last_routing is None
