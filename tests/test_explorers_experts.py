"""course_lib.presentation.explorers.experts (notebook 08): the mixture-of-experts panel starts at its defaults, runs the real
layer at once and redraws for every control: the routing it shows is the layer's own (capacity, drops,
imbalance), ep only regroups the experts, more alike tokens load the experts less evenly, and the bytes it
prints are the all-to-all formula's."""

import matplotlib
import matplotlib.pyplot as plt
import pytest
import test_explorers
import torch
from test_explorers import assert_says_what_it_is, every_option, values

from course_lib.expert_parallel import all_to_all_bytes
from course_lib.feed_forward import MoE, capacity
from course_lib.model import preset
from course_lib.presentation import explorers
from course_lib.presentation.explorers.experts import NUM_TOKENS, alike_tokens

matplotlib.use("Agg")   # no window, on any machine
drawn = test_explorers.drawn   # the fixture: every figure a panel draws through course_lib.presentation.plots, in order


def test_moe_explorer_starts_at_its_defaults_and_shows_the_layers_own_routing_rank_by_rank(drawn, capsys):
    """256 tokens are the EP group's (part 4's meaning): each of the 4 ranks routes its 64, with C = 20 slots per
    expert for them; the group's load is their total, and each rank sends one all-to-all of its 64 tokens."""
    panel = explorers.moe_explorer()
    assert values(panel.controls) == {"top_k": 2, "capacity_factor": 1.25, "ep": 4, "skew": 0.5}
    torch.manual_seed(0)                                             # the same layer, run here on each rank's tokens
    moe = MoE(preset("tiny", num_experts=8, top_k=2), capacity_factor=1.25)
    tokens = alike_tokens(NUM_TOKENS, 64, 0.5)
    for r, routing in enumerate(panel.rank_routings):
        with torch.no_grad():
            moe(tokens[64 * r:64 * (r + 1)])
        assert routing.capacity == capacity(64, 8, 2, 1.25) == 20
        assert routing.requested_per_expert == moe.last_routing.requested_per_expert
        assert routing.kept_per_expert == [min(n, 20) for n in routing.requested_per_expert]
    group = panel.routing
    assert group.capacity == 4 * 20 and group.ep == 4 and sum(group.requested_per_expert) == NUM_TOKENS * 2
    assert group.kept_per_expert == [sum(r.kept_per_expert[e] for r in panel.rank_routings) for e in range(8)]
    with torch.no_grad():
        moe(tokens)
    assert panel.aux_loss == pytest.approx(moe.aux_loss.item(), abs=1e-6)      # the group's, over all 256
    assert panel.wire_bytes == all_to_all_bytes(64, 64, 8, 2, 1.25, 4) == 3 / 4 * 8 * 20 * 64 * 4

    (drawing,) = drawn
    assert drawing.name == "expert_load" and drawing.args[0] is group
    assert drawing.title == (f"top-2, capacity factor 1.25, tokens alike 0.5: {group.dropped} of 512 "
                             "assignments dropped")
    shown = capsys.readouterr().out
    assert "256 tokens in the EP group, 64 on each of its 4 ranks" in shown
    assert "C = ceil(1.25 × 64 × 2 / 8) = 20 slots per expert for each rank's tokens, 80 per expert over" in shown
    assert f"dropped {group.dropped} of 512 assignments" in shown and "30.0 KiB per rank" in shown
    assert_says_what_it_is(panel, panel._repr_mimebundle_())


def test_moe_explorer_redraws_for_each_control_and_ep_changes_the_capacity_not_the_router(drawn, capsys):
    panel = explorers.moe_explorer()
    requested = panel.routing.requested_per_expert
    panel.controls["ep"].value = 8                                    # 32 tokens a rank, C = 10 for them
    assert panel.routing.requested_per_expert == requested and len(panel.routing.tokens_per_rank) == 8
    assert panel.rank_routings[0].capacity == 10 and panel.routing.capacity == 80
    assert panel.wire_bytes == 7 / 8 * 8 * 10 * 64 * 4 and len(drawn) == 2
    panel.controls["ep"].value = 1                                    # one rank routes all 256: C = 80
    assert panel.routing.capacity == 80 and panel.routing.requested_per_expert == requested
    assert panel.wire_bytes == 0 and "one rank holds every expert: no all-to-all" in capsys.readouterr().out

    panel.controls["capacity_factor"].value = 0.5                     # 32 slots: at most 256 of 512 kept
    routing = panel.routing
    assert routing.capacity == 32 and routing.dropped == sum(n - min(n, 32) for n in routing.requested_per_expert)
    assert routing.dropped >= 512 - 8 * 32
    panel.controls["top_k"].value = 4
    assert sum(panel.routing.requested_per_expert) == 1024 and drawn[-1].title.startswith("top-4, capacity factor 0.5")
    assert len(drawn) == 5 and plt.get_fignums() == []


def test_more_alike_tokens_load_the_experts_less_evenly_and_capacity_at_the_busiest_rank_drops_nothing(drawn):
    panel = explorers.moe_explorer(capacity_factor=3.0, ep=2)
    imbalance, loss = {}, {}
    for skew in (0.0, 0.25, 0.5, 1.0):
        panel.controls["skew"].value = skew
        imbalance[skew], loss[skew] = panel.routing.imbalance, panel.aux_loss
        busiest = max(r.imbalance for r in panel.rank_routings)
        if busiest <= 3.0:                                            # room even for the busiest rank's busiest
            assert panel.routing.dropped == 0, skew
    assert list(imbalance.values()) == sorted(imbalance.values()) and imbalance[1.0] > 2 * imbalance[0.0]
    assert list(loss.values()) == sorted(loss.values()) and loss[0.0] < 1.01 < loss[1.0]


def test_moe_explorer_draws_every_setting_of_every_control(drawn):
    every_option(explorers.moe_explorer(), drawn)
    assert len(drawn) == 1 + 3 + 7 + 4 + 4 and plt.get_fignums() == []     # the start, then every option once


def test_alike_tokens_share_one_direction_of_the_asked_length():
    same, alike = alike_tokens(4096, 64, 0.0), alike_tokens(4096, 64, 1.0)
    shared = (alike - same).mean(dim=0)                               # the same seed: only the shared part differs
    assert shared.norm().item() == pytest.approx(8.0, rel=1e-5)       # skew · √hidden = 1 × 8
    assert torch.allclose(alike - same, shared.expand_as(alike), atol=1e-5)
