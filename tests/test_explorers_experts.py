"""course_lib.explorers.experts (notebook 08): the mixture-of-experts panel starts at its defaults, runs the real
layer at once and redraws for every control: the routing it shows is the layer's own (capacity, drops,
imbalance), ep only regroups the experts, more alike tokens load the experts less evenly, and the bytes it
prints are the all-to-all formula's."""

import matplotlib
import matplotlib.pyplot as plt
import pytest
import test_explorers
import torch
from test_explorers import assert_says_what_it_is, every_option, values

from course_lib import explorers
from course_lib.experts import all_to_all_bytes
from course_lib.explorers.experts import NUM_TOKENS, alike_tokens
from course_lib.model import preset
from course_lib.moe import MoE, capacity

matplotlib.use("Agg")   # no window, on any machine
drawn = test_explorers.drawn   # the fixture: every figure a panel draws through course_lib.plots, in order


def test_moe_explorer_starts_at_its_defaults_and_shows_the_layers_own_routing(drawn, capsys):
    panel = explorers.moe_explorer()
    assert values(panel.controls) == {"top_k": 2, "capacity_factor": 1.25, "ep": 4, "skew": 0.5}
    routing = panel.routing
    assert routing.capacity == capacity(NUM_TOKENS, 8, 2, 1.25) == 80 and routing.ep == 4
    assert sum(routing.requested_per_expert) == NUM_TOKENS * 2
    assert routing.kept_per_expert == [min(n, 80) for n in routing.requested_per_expert]

    torch.manual_seed(0)                                             # the same layer, run here on the same tokens
    moe = MoE(preset("tiny", num_experts=8, top_k=2), capacity_factor=1.25)
    with torch.no_grad():
        moe(alike_tokens(NUM_TOKENS, 64, 0.5))
    assert moe.last_routing.requested_per_expert == routing.requested_per_expert
    assert panel.aux_loss == pytest.approx(moe.aux_loss.item(), abs=1e-6)
    assert panel.wire_bytes == all_to_all_bytes(NUM_TOKENS, 64, 8, 2, 1.25, 4) == 3 / 4 * 8 * 80 * 64 * 4

    (drawing,) = drawn
    assert drawing.name == "expert_load" and drawing.args[0] is routing
    assert drawing.title == (f"top-2, capacity factor 1.25, tokens alike 0.5: {routing.dropped} of 512 "
                             "assignments dropped")
    shown = capsys.readouterr().out
    assert "C = ceil(1.25 × 256 × 2 / 8) = 80 slots per expert" in shown
    assert f"dropped {routing.dropped} of 512 assignments" in shown and "120.0 KiB per rank" in shown
    assert_says_what_it_is(panel, panel._repr_mimebundle_())


def test_moe_explorer_redraws_for_each_control_and_ep_only_regroups_the_experts(drawn, capsys):
    panel = explorers.moe_explorer()
    requested = panel.routing.requested_per_expert
    panel.controls["ep"].value = 8
    assert panel.routing.requested_per_expert == requested and len(panel.routing.tokens_per_rank) == 8
    assert panel.wire_bytes == 7 / 8 * 8 * 80 * 64 * 4 and len(drawn) == 2
    panel.controls["ep"].value = 1
    assert panel.wire_bytes == 0 and "one rank holds every expert: no all-to-all" in capsys.readouterr().out

    panel.controls["capacity_factor"].value = 0.5                     # 32 slots: at most 256 of 512 kept
    routing = panel.routing
    assert routing.capacity == 32 and routing.dropped == sum(n - min(n, 32) for n in routing.requested_per_expert)
    assert routing.dropped >= 512 - 8 * 32
    panel.controls["top_k"].value = 4
    assert sum(panel.routing.requested_per_expert) == 1024 and drawn[-1].title.startswith("top-4, capacity factor 0.5")
    assert len(drawn) == 5 and plt.get_fignums() == []


def test_more_alike_tokens_load_the_experts_less_evenly_and_capacity_at_the_imbalance_drops_nothing(drawn):
    panel = explorers.moe_explorer(capacity_factor=3.0, ep=2)
    imbalance, loss = {}, {}
    for skew in (0.0, 0.25, 0.5, 1.0):
        panel.controls["skew"].value = skew
        imbalance[skew], loss[skew] = panel.routing.imbalance, panel.aux_loss
    assert list(imbalance.values()) == sorted(imbalance.values()) and imbalance[1.0] > 2 * imbalance[0.0]
    assert list(loss.values()) == sorted(loss.values()) and loss[0.0] < 1.01 < loss[1.0]
    for skew in (0.0, 0.25, 0.5):                                     # all below 3: a factor of 3 drops nothing
        panel.controls["skew"].value = skew
        assert imbalance[skew] < 3 and panel.routing.dropped == 0


def test_moe_explorer_draws_every_setting_of_every_control(drawn):
    every_option(explorers.moe_explorer(), drawn)
    assert len(drawn) == 1 + 3 + 7 + 4 + 4 and plt.get_fignums() == []     # the start, then every option once


def test_alike_tokens_share_one_direction_of_the_asked_length():
    same, alike = alike_tokens(4096, 64, 0.0), alike_tokens(4096, 64, 1.0)
    shared = (alike - same).mean(dim=0)                               # the same seed: only the shared part differs
    assert shared.norm().item() == pytest.approx(8.0, rel=1e-5)       # skew · √hidden = 1 × 8
    assert torch.allclose(alike - same, shared.expand_as(alike), atol=1e-5)
