"""course_lib.presentation.plots.experts (notebook 08): the load on each expert and each EP rank drawn from a Routing (kept
bars in their rank's colour, dropped parts in red, the capacity and even-share lines, the rows each rank
computes), and the dropped share against the capacity factor, every label inside its frame."""

import matplotlib
import matplotlib.pyplot as plt
import pytest
import torch
from matplotlib.colors import to_hex
from test_plots import bars, lines_at, outside_figure, spilled

from course_lib.feed_forward import MoE, Routing, drops_by_capacity
from course_lib.model import preset
from course_lib.presentation import plots
from course_lib.presentation.plots.experts import DROPPED_COLOR, RANK_COLORS

matplotlib.use("Agg")   # no window, on any machine

# 32 assignments to 8 experts of 5 slots on 2 ranks: experts 0 and 3 are over capacity (3 + 1 dropped)
ROUTING = Routing(capacity=5, requested_per_expert=[8, 2, 4, 6, 3, 5, 1, 3],
                  kept_per_expert=[5, 2, 4, 5, 3, 5, 1, 3], ep=2)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def legend_texts(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_expert_load_draws_kept_and_dropped_parts_per_expert_and_the_work_per_rank():
    fig = plots.expert_load(ROUTING, title="tiny layer, top-2")
    left, right = fig.axes
    drawn = bars(left)
    assert len(drawn) == 8 + 2                                            # a kept bar each, a red top on 0 and 3
    red = [b for b in drawn if to_hex(b.get_facecolor()) == to_hex(DROPPED_COLOR)]
    assert [(b.get_x() + b.get_width() / 2, b.get_y(), b.get_height()) for b in red] == [(0, 5, 3), (3, 5, 1)]
    kept = [b for b in drawn if b not in red]
    assert [b.get_height() for b in kept] == ROUTING.kept_per_expert
    colors = [to_hex(b.get_facecolor()) for b in kept]
    assert colors == [to_hex(RANK_COLORS[0])] * 4 + [to_hex(RANK_COLORS[1])] * 4       # experts 0-3 on rank 0
    assert len(lines_at(left, y=5)) == 1 and len(lines_at(left, y=32 / 8)) == 1       # capacity, even share
    assert [t.get_text() for t in left.texts] == [str(n) for n in ROUTING.requested_per_expert]

    assert [b.get_height() for b in bars(right)] == ROUTING.tokens_per_rank == [16, 12]
    assert len(lines_at(right, y=4 * 5)) == 1                              # 4 experts × 5 slots, full or empty
    assert [t.get_text() for t in right.get_xticklabels()] == ["rank 0", "rank 1"]
    assert legend_texts(fig) == ["kept, on rank 0", "kept, on rank 1", "dropped: 4",
                                 "slots: C = 5 per expert, 20 per rank (computed, full or empty)",
                                 "even share: 4.0 per expert"]
    assert fig._suptitle.get_text() == "tiny layer, top-2"
    assert right.get_title() == "2 EP ranks, 4 experts each"
    assert spilled(left) == [] and spilled(right) == [] and outside_figure(fig) == []


def test_expert_load_names_a_capacity_far_above_the_bars_instead_of_squashing_them():
    roomy = Routing(capacity=32, requested_per_expert=[8, 2, 4, 6, 3, 5, 1, 3],
                    kept_per_expert=[8, 2, 4, 6, 3, 5, 1, 3], ep=1)
    fig = plots.expert_load(roomy)
    left, right = fig.axes
    assert lines_at(left, y=32) == [] and left.get_ylim()[1] < 32                      # no line off the top
    assert "capacity C = 32: far above every bar" in [t.get_text() for t in left.texts]
    assert not any(text.startswith("dropped") for text in legend_texts(fig))          # nothing dropped
    assert len(lines_at(right, y=8 * 32)) == 1 and right.get_title() == "1 EP rank, 8 experts each"
    assert fig._suptitle.get_text() == "32 assignments to 8 experts of 32 slots: 0 dropped"


def legend_clear_of_the_data(fig) -> bool:
    """Every legend of ``fig`` lies inside the figure and overlaps none of its axes (in display pixels)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for legend in fig.legends:
        box = legend.get_window_extent(renderer)
        if box.x0 < -0.5 or box.y0 < -0.5 or box.x1 > fig.bbox.width + 0.5 or box.y1 > fig.bbox.height + 0.5:
            return False
        if any(box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes):
            return False
    return True


def test_expert_load_at_ep_8_names_every_rank_in_a_legend_clear_of_the_data():
    one_each = Routing(capacity=5, requested_per_expert=ROUTING.requested_per_expert,
                       kept_per_expert=ROUTING.kept_per_expert, ep=8)
    fig = plots.expert_load(one_each)
    assert len(bars(fig.axes[1])) == 8 and legend_texts(fig)[:8] == [f"kept, on rank {r}" for r in range(8)]
    assert len({to_hex(b.get_facecolor()) for b in bars(fig.axes[1])}) == 8           # a colour per rank
    assert legend_clear_of_the_data(fig) and legend_clear_of_the_data(plots.expert_load(ROUTING))


def test_expert_load_value_labels_sit_over_the_capacity_line_on_a_white_box():
    on_the_line = Routing(capacity=5, requested_per_expert=[5, 5, 5, 5, 4, 4, 4, 4],
                          kept_per_expert=[5, 5, 5, 5, 4, 4, 4, 4], ep=2)
    left = plots.expert_load(on_the_line).axes[0]
    (capacity,) = lines_at(left, y=5)
    for label in left.texts[:8]:
        assert label.get_bbox_patch().get_facecolor()[:3] == (1.0, 1.0, 1.0)
        assert label.get_zorder() > capacity.get_zorder()


def test_dropped_share_draws_the_measured_share_the_even_routing_line_and_the_imbalance():
    torch.manual_seed(0)
    moe = MoE(preset("tiny", num_experts=8, top_k=2))
    x = torch.randn(64, 64)
    rows = drops_by_capacity(moe, x, capacity_factors=(0.25, 0.5, 1.0, 2.0))
    imbalance = moe.last_routing.imbalance
    fig = plots.dropped_share(rows, imbalance=imbalance, title="64 tokens")
    (ax,) = fig.axes
    measured, even = ax.get_lines()[:2]
    assert list(measured.get_xdata()) == [0.25, 0.5, 1.0, 2.0]
    assert list(measured.get_ydata()) == [100 * row["dropped_share"] for row in rows]
    assert list(even.get_ydata()) == [75.0, 50.0, 0.0, 0.0]
    assert len(lines_at(ax, x=imbalance)) == 1
    assert f"factor = imbalance {imbalance:.2f}:\nnothing dropped from here" in [t.get_text() for t in ax.texts]
    assert [t.get_text() for t in ax.texts][:4] == [f"{row['dropped']:,}" for row in rows]
    assert legend_texts(fig) == ["measured: this router on these tokens", "perfectly even routing: 1 − factor"]
    assert ax.get_title() == "64 tokens" and spilled(ax) == []
    assert lines_at(plots.dropped_share(rows).axes[0], x=imbalance) == []             # no imbalance: no line
