"""course_lib.presentation.plots: every figure drawn from small inputs of the shape the notebooks and explorers pass (built
with the course's own functions where that is cheap), and checked for what it should show: the number of
panels, one bar or line per item of the input, the given titles and labels, the capacity and prediction
lines when asked, highlights, and no public function left untested (here or in the test_plots_*.py beside
this file: tests/test_plots_data_parallel.py for notebooks 02 and 03, tests/test_plots_experts.py for 08)."""

import inspect
import math
import re
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from course_lib.ledger import zero_state_bytes
from course_lib.mesh import Mesh
from course_lib.pipeline_parallel import simulate
from course_lib.presentation import plots
from course_lib.presentation.plots.readable import amount, byte_unit, keep_texts_inside, plural, unit_label

matplotlib.use("Agg")   # no window, on any machine
GIB = 2**30
NAMES = plots.ZERO_STAGE_NAMES


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def texts(ax) -> list[str]:
    """Every text and annotation drawn in ``ax``."""
    return [t.get_text() for t in ax.texts]


def bars(ax) -> list[Rectangle]:
    """The bars of ``ax`` (bar/barh rectangles; legend handles are not in ax.patches)."""
    return [p for p in ax.patches if isinstance(p, Rectangle)]


def spilled(ax) -> list[str]:
    """The texts drawn in ``ax`` that reach outside its frame (in display pixels, after drawing)."""
    ax.figure.canvas.draw()
    frame = ax.get_window_extent()
    outside = []
    for text in ax.texts:
        box = text.get_window_extent()
        if box.x0 < frame.x0 - 0.5 or box.x1 > frame.x1 + 0.5 or box.y0 < frame.y0 - 0.5 or box.y1 > frame.y1 + 0.5:
            outside.append(text.get_text())
    return outside


def outside_figure(fig) -> list[str]:
    """Titles of ``fig`` (its own and its axes') that reach outside the figure."""
    fig.canvas.draw()
    titles = [fig._suptitle] if fig._suptitle is not None else []
    titles += [t for ax in fig.axes for t in (ax.title, ax._left_title) if t.get_text()]
    return [t.get_text() for t in titles if t.get_window_extent().x0 < -0.5
            or t.get_window_extent().x1 > fig.bbox.width + 0.5]


def lines_at(ax, *, x=None, y=None) -> list[Line2D]:
    """Straight lines across ``ax`` (axvline at ``x``, axhline at ``y``)."""
    found = []
    for line in ax.get_lines():
        xs, ys = line.get_xdata(), line.get_ydata()
        if x is not None and len(xs) == 2 and all(math.isclose(v, x) for v in xs):
            found.append(line)
        if y is not None and len(ys) == 2 and all(math.isclose(v, y) for v in ys):
            found.append(line)
    return found


# ---- 00 · the training step -------------------------------------------------------------------------

def test_loss_curves_draw_one_line_per_curve_the_highlight_bold_and_the_guessing_line():
    curves = {"lr=0.01": [4.8, 3.0, 1.5, 0.9], "lr=0.1": [4.8, 4.0, 4.5, 4.3], "lr=0.001": [4.8, 4.6, 4.4, 4.2]}
    fig = plots.loss_curves(curves, highlight="lr=0.01", vocab_size=128, floor=0.5, title="tiny model, 4 steps")
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    ax = fig.axes[0]
    drawn = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert list(drawn) == list(curves)
    assert drawn["lr=0.01"].get_linewidth() > drawn["lr=0.1"].get_linewidth() == drawn["lr=0.001"].get_linewidth()
    assert list(drawn["lr=0.1"].get_ydata()) == curves["lr=0.1"]
    assert len(lines_at(ax, y=math.log(128))) == 1 and len(lines_at(ax, y=0.5)) == 1
    assert "guessing: ln 128 = 4.85" in texts(ax) and spilled(ax) == []
    assert ax.get_title() == "tiny model, 4 steps" and ax.get_ylim()[0] == 0
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(curves)


def test_loss_curves_give_every_explored_curve_its_own_colour_and_none_the_guides_colours():
    curves = {f"lr={lr:g}": [4.8, 4.0 - k * 0.1] for k, lr in enumerate((1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3))}
    fig = plots.loss_curves(curves, highlight="lr=0.01", vocab_size=128)
    ax = fig.axes[0]
    drawn = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    colors = [matplotlib.colors.to_hex(line.get_color()) for line in drawn]
    assert len(set(colors)) == len(curves) == 8                          # none grey-on-grey: each its own
    guides = {matplotlib.colors.to_hex(c) for c in ("tab:red", "tab:green")}   # the guessing line, the floor
    assert guides.isdisjoint(colors)
    widths = {line.get_label(): line.get_linewidth() for line in drawn}
    assert widths.pop("lr=0.01") > max(widths.values())                 # the highlight still stands out
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == list(curves)
    assert [matplotlib.colors.to_hex(h.get_color()) for h in legend.legend_handles] == colors
    # the same curve keeps its colour when more are explored
    first_two = plots.loss_curves(dict(list(curves.items())[:2])).axes[0].get_lines()[:2]
    assert [matplotlib.colors.to_hex(line.get_color()) for line in first_two] == colors[:2]


def test_loss_curves_without_a_highlight_draw_every_curve_bold_and_no_guides():
    fig = plots.loss_curves({"a": [2.0, 1.0], "b": [3.0, 2.0]})
    ax = fig.axes[0]
    assert [line.get_linewidth() for line in ax.get_lines()] == [2.4, 2.4]
    assert texts(ax) == [] and ax.get_title() == "training loss"


# ---- 01 · the memory ledger ---------------------------------------------------------------------------

def test_memory_bars_stack_each_part_and_mark_the_card():
    rows = {NAMES[s]: zero_state_bytes(int(7.1e9), s, 8) for s in range(4)}   # as notebook 03 (with "total")
    card = 80 * GIB
    fig = plots.memory_bars(rows, capacity_bytes=card, capacity_label="80 GiB card", title="7.1B on 8 cards")
    ax = fig.axes[0]
    assert len(bars(ax)) == 4 * 3                    # weights, grads, optimizer per row; "total" is not a part
    assert [t.get_text() for t in ax.get_yticklabels()] == list(rows)[::-1]          # the first row on top
    assert len(lines_at(ax, x=card / GIB)) == 1 and "80 GiB card" in texts(ax)
    totals = {t.get_text(): t.get_color() for t in ax.texts if t.get_text().endswith(" GiB")}
    assert totals == {f"{row['total'] / GIB:,.1f} GiB": "black" if row["total"] <= card else "tab:red"
                      for row in rows.values()}
    assert list(totals.values()).count("tab:red") == 1              # 105.8 GiB: DDP does not fit, ZeRO does
    assert ax.get_title() == "7.1B on 8 cards" and ax.get_xlim()[1] > 105.8
    assert ax.get_xlabel() == "GiB (2**30 bytes)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["weights", "grads", "optimizer"]


def test_memory_bars_name_the_card_inside_the_frame_above_the_bars():
    rows = {"course model": {"weights": 2 * GIB, "grads": 2 * GIB, "optimizer": 12 * GIB, "activations": 8.1 * GIB},
            "GPT-3 formula": {"weights": 2 * GIB, "grads": 2 * GIB, "optimizer": 12 * GIB, "activations": 30 * GIB}}
    for card, label in ((80 * GIB, "80 GiB card"), (24 * GIB, "24 GiB (RTX 4090)")):   # line right, line left
        ax = plots.memory_bars(rows, capacity_bytes=card, capacity_label=label).axes[0]
        (name,) = [t for t in ax.texts if t.get_text() == label]
        assert spilled(ax) == [] and name.get_fontsize() >= 8
        top_bar = max(b.get_y() + b.get_height() for b in bars(ax))
        assert name.get_window_extent().y0 >= ax.transData.transform((0, top_bar))[1]   # over no bar


def test_memory_bars_pick_the_unit_from_the_data_and_name_a_far_card_in_words():
    tiny = {"tiny model": {"weights": 657_664, "grads": 657_664, "optimizer": 1_315_328}}
    ax = plots.memory_bars(tiny, capacity_bytes=80 * GIB, capacity_label="80 GiB (A100 80GB)").axes[0]
    assert ax.get_xlabel() == "MiB (2**20 bytes)" and "2.5 MiB" in texts(ax)
    assert lines_at(ax, x=80 * 1024) == [] and ax.get_xlim()[1] < 4          # the bars keep their size
    assert "80 GiB (A100 80GB): far to the right, everything fits" in texts(ax) and spilled(ax) == []
    ax = plots.memory_bars(tiny, capacity_bytes=80 * GIB, capacity_label="the card").axes[0]
    assert "the card (80.0 GiB): far to the right, everything fits" in texts(ax)


def test_memory_bars_without_a_card_draw_no_capacity_line_and_every_total_in_black():
    rows = {"fp32": {"weights": 4 * GIB, "grads": 4 * GIB, "optimizer": 8 * GIB, "activations": 2 * GIB},
            "weights only": {"weights": GIB}}
    fig = plots.memory_bars(rows)
    ax = fig.axes[0]
    assert len(bars(ax)) == 4 + 1 and ax.get_lines() == []
    assert {t.get_text(): t.get_color() for t in ax.texts} == {"18.0 GiB": "black", "1.0 GiB": "black"}
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["weights"]    # labels come from the bottom row


def test_predicted_vs_measured_draws_one_panel_per_quantity_with_the_prediction_and_the_dots():
    panels = {"batch size": ([1, 2, 4], [1024, 2048, 4096], [1024, 2048, 4096]),
              "sequence length": ([8, 16], [512, 1024], [512, 1000])}
    fig = plots.predicted_vs_measured(panels, title="activation bytes")
    assert len(fig.axes) == 2
    for ax, (name, (xs, predicted, measured)) in zip(fig.axes, panels.items()):
        line, dots = ax.get_lines()
        assert ax.get_xlabel() == name and list(line.get_xdata()) == xs
        assert list(line.get_ydata()) == [p / 1024 for p in predicted] and list(dots.get_ydata()) == [
            m / 1024 for m in measured]
        assert line.get_linestyle() == "-" and dots.get_marker() == "o"
    assert fig.axes[0].get_ylabel() == "KiB (2**10 bytes)" and fig._suptitle.get_text() == "activation bytes"


# ---- 05 · pipeline parallelism ------------------------------------------------------------------------

def test_pipeline_gantt_draws_a_bar_per_op_and_a_row_per_stage():
    timeline = simulate("1f1b", 3, 4, 0.010, 0.020)
    fig = plots.pipeline_gantt(timeline)
    assert len(fig.axes) == 1
    ax = fig.axes[0]
    assert len(bars(ax)) == 3 + 2 * 3 * 4            # an idle background per stage, then every F and B
    colors = [matplotlib.colors.to_hex(p.get_facecolor()[:3]) for p in bars(ax)[3:]]
    assert colors.count(matplotlib.colors.to_hex("tab:blue")) == colors.count(matplotlib.colors.to_hex("tab:green"))
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1", "stage 2"]
    assert sorted(t for t in texts(ax) if t.startswith("idle")) == sorted(
        f"idle {timeline.idle_fraction(r):.0%}" for r in range(3))
    assert sorted(t for t in texts(ax) if t.isdigit()) == sorted(str(k) for k in range(4) for _ in range(6))
    assert ax.get_title(loc="left") == f"p = 3 stages, m = 4 micro-batches: bubble {timeline.bubble:.1%}"
    assert ax.get_xlabel() == "time (ms)" and ax.get_xlim()[1] > timeline.makespan * 1e3


def test_pipeline_gantt_adds_the_in_flight_panel_and_draws_into_a_given_axes():
    timeline = simulate("gpipe", 2, 3, 0.001, 0.001)
    fig = plots.pipeline_gantt(timeline, title="GPipe", in_flight=True)
    top, low = fig.axes
    assert top.get_title(loc="left") == "GPipe" and len(low.get_lines()) == 2      # one step line per stage
    assert max(low.get_lines()[0].get_ydata()) == 3 == timeline.peak_in_flight(0)    # GPipe holds all m
    assert low.get_xlabel() == "time (ms)" and top.get_xlabel() == ""
    host, ax = plt.subplots()
    assert plots.pipeline_gantt(timeline, ax=ax) is host and len(bars(ax)) == 2 + 2 * 2 * 3


# ---- 04 · tensor parallelism --------------------------------------------------------------------------

def test_a_single_panel_and_a_picture_with_too_many_ranks():
    assert len(plots.predicted_vs_measured({"batch size": ([1, 2], [10, 20], [10, 20])}).axes) == 1
    with pytest.raises(ValueError, match="world_size=5: the picture has a colour for 1 to 4 ranks"):
        plots.matmul_split(5)


@pytest.mark.parametrize("world_size", [2, 4])
def test_matmul_split_draws_each_ranks_blocks_both_ways(world_size):
    fig = plots.matmul_split(world_size)
    by_columns, by_rows = fig.axes
    assert len(by_columns.patches) == 1 + 2 * world_size     # X whole, then W_i and Y_i per rank
    assert len(by_rows.patches) == 3 * world_size            # X_i, W_i and a partial Y per rank
    assert {f"W{i}" for i in range(world_size)} <= set(texts(by_columns)) & set(texts(by_rows))
    assert "concatenate" in by_columns.get_title() and "all-reduce" in by_rows.get_title()


def tp_rows():
    """Rows of measure_tp_speed: two widths on TP=2 and TP=4, the narrow one slower than one rank."""
    return [{"hidden": 64, "tp": 2, "one_rank_s": 0.002, "tp_s": 0.004, "comm_s": 0.002},
            {"hidden": 128, "tp": 2, "one_rank_s": 0.010, "tp_s": 0.008, "comm_s": 0.003},
            {"hidden": 64, "tp": 4, "one_rank_s": 0.003, "tp_s": 0.009, "comm_s": 0.006},
            {"hidden": 128, "tp": 4, "one_rank_s": 0.011, "tp_s": 0.012, "comm_s": 0.007}]


def test_tp_speed_draws_one_rank_and_each_tp_degree_with_ratios():
    fig = plots.tp_speed(tp_rows(), highlight=(128, 2), title="TP on this CPU")
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert labels == ["1 rank, whole model", "TP=2: step", "TP=2: of it, all-reduce", "TP=4: step",
                      "TP=4: of it, all-reduce"]
    one_rank = ax.get_lines()[0]
    assert list(one_rank.get_xdata()) == [64, 128] and list(one_rank.get_ydata()) == [2.0, 10.0]  # the fastest
    assert len(lines_at(ax, x=128)) == 1                                                           # the highlight
    ratios = {t.get_text(): t.get_color() for t in ax.texts}
    assert ratios == {"2.0× slower": "tab:red", "1.2× faster": "tab:green", "3.0× slower": "tab:red",
                      "1.1× slower": "tab:red"}
    assert ax.get_title() == "TP on this CPU" and ax.get_xscale() == ax.get_yscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "128"]


@pytest.mark.parametrize(("tp_s", "one_rank_s", "words"), [(0.0101, 0.0100, "same speed"), (0.0096, 0.0100, "same speed"),
                                                           (0.0106, 0.0100, "1.1× slower"), (0.0050, 0.0100, "2.0× faster")])
def test_tp_speed_says_same_speed_when_the_ratio_rounds_to_one(tp_s, one_rank_s, words):
    row = {"hidden": 256, "tp": 2, "one_rank_s": one_rank_s, "tp_s": tp_s, "comm_s": 0.001}
    assert texts(plots.tp_speed([row]).axes[0]) == [words]


def test_speed_words_name_the_faster_side_and_say_same_speed_near_one():
    assert plots.speed_words(0.0124, 0.0053) == ("2.3× slower", "tab:red")
    assert plots.speed_words(0.0785, 0.1231) == ("1.6× faster", "tab:green")
    assert plots.speed_words(0.0330, 0.0320)[0] == plots.speed_words(0.0320, 0.0330)[0] == "same speed"


def test_tp_speed_words_are_readable_inside_the_frame_and_over_the_lines():
    rows = tp_rows() + [{"hidden": 1024, "tp": 2, "one_rank_s": 0.40, "tp_s": 0.41, "comm_s": 0.03}]
    ax = plots.tp_speed(rows).axes[0]
    assert spilled(ax) == []                                    # the first and last points' words included
    for text in ax.texts:
        assert text.get_fontsize() >= 8
        assert text.get_zorder() > max(line.get_zorder() for line in ax.get_lines())     # drawn over every line
        assert text.get_bbox_patch().get_facecolor()[:3] == (1.0, 1.0, 1.0)             # on a white card
        point_y = ax.transData.transform(text.xy)[1]
        box = text.get_window_extent()
        faster = text.get_text().endswith("faster")     # below a faster point, above a slower one (or the same:
        assert (box.y1 < point_y) if faster else (box.y0 > point_y)           # 0.41 s against 0.40 s here)


# ---- 06 · 3D parallelism ------------------------------------------------------------------------------

def test_mesh_layout_draws_a_box_per_rank_in_its_node_and_a_bracket_per_tp_group():
    mesh = Mesh(dp=2, tp=2, pp=2)
    fig = plots.mesh_layout(mesh, gpus_per_node=4, title="dp 2 × tp 2 × pp 2")
    ax = fig.axes[0]
    assert len(ax.patches) == mesh.size and len(ax.get_lines()) == len(mesh.groups("tp")) == 4
    shown = texts(ax)
    assert [f"rank {r}" for r in range(8)] == [t for t in shown if t.startswith("rank")]
    assert {"node 0", "node 1"} <= set(shown) and "pp0 dp0 tp1" in shown
    assert ax.get_title() == "dp 2 × tp 2 × pp 2"
    stages = {matplotlib.colors.to_hex(p.get_facecolor()[:3]) for p in ax.patches}
    assert len(stages) == mesh.pp                                            # colour = pipeline stage
    assert plots.mesh_layout(Mesh(dp=4)).axes[0].get_lines() == []           # TP=1: no bracket


def test_bytes_per_axis_draws_a_group_per_rank_with_the_prediction_as_ticks():
    measured = [{"tp": 2048, "pp": 1024, "dp": 4096}, {"tp": 2048, "pp": 512, "dp": 4096}]
    predicted = [dict(m) for m in measured]
    fig = plots.bytes_per_axis(measured, predicted, title="2 ranks")
    ax = fig.axes[0]
    assert len(bars(ax)) == 3 * 2 and len(ax.collections) == 3              # 3 axes × 2 ranks; a tick per axis
    assert sorted(b.get_height() for b in bars(ax)) == [0.5, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["rank 0", "rank 1"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sorted(legend) == ["dp (measured)", "pp (measured)", "predicted", "tp (measured)"]
    assert ax.get_title() == "2 ranks"


def test_one_of_anything_is_singular_in_titles():
    assert plots.mesh_layout(Mesh(dp=2), gpus_per_node=1).axes[0].get_title().startswith(
        "dp 2 × tp 1 × pp 1 on nodes of 1 GPU (")
    assert "nodes of 4 GPUs" in plots.mesh_layout(Mesh(dp=2)).axes[0].get_title()
    one = plots.pipeline_gantt(simulate("gpipe", 1, 1, 0.01, 0.02)).axes[0].get_title(loc="left")
    assert one == "p = 1 stage, m = 1 micro-batch: bubble 0.0%"
    assert plural(1, "rank") == "1 rank" and plural(2, "rank") == "2 ranks"
    assert plural(3, "micro-batch", "micro-batches") == "3 micro-batches"


def test_byte_unit_and_amount_show_every_number():
    assert [byte_unit(n) for n in (0, 1023, 1024, 2.5 * 2**20, 80 * GIB, 2**41)] == [
        ("B", 1), ("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)]
    assert [amount(v) for v in (0, 0.0312, 0.86, 1, 13.24, 1536.0)] == ["0", "0.031", "0.86", "1.0", "13.2", "1,536.0"]
    assert unit_label("GiB", 2**30) == "GiB (2**30 bytes)" and unit_label("B", 1) == "bytes"


@pytest.mark.parametrize("scale", ["linear", "log"])
def test_keep_texts_inside_widens_the_limits_until_every_label_is_in_the_frame(scale):
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([1, 10], [1, 10])
    ax.set(xscale=scale, yscale=scale, xlim=(1, 10), ylim=(1, 10))
    ax.annotate("beside the last point", (10, 10), xytext=(4, 4), textcoords="offset points")
    ax.annotate("before the first", (1, 1), xytext=(-4, -4), textcoords="offset points", ha="right", va="top")
    assert len(spilled(ax)) == 2
    keep_texts_inside(ax)
    assert spilled(ax) == []
    low, high = ax.get_xlim()
    assert low < 1 and high > 10                                    # the data still shows, moved inwards
    ax.annotate("a label far too long to fit in this small frame whatever the limits", (10, 1))
    keep_texts_inside(ax)
    grown = ax.xaxis.get_transform().transform([*ax.get_xlim()])
    assert grown[1] - grown[0] <= 4.01 * (ax.xaxis.get_transform().transform([high])[0]
                                          - ax.xaxis.get_transform().transform([low])[0])   # not squashed to nothing


def test_every_public_function_of_plots_is_tested_here():
    public = {name for name in plots.__all__ if inspect.isfunction(getattr(plots, name))}
    called = {name for path in Path(__file__).parent.glob("test_plots*.py")     # this file and its siblings
              for name in re.findall(r"plots\.(\w+)\(", path.read_text())}
    assert len(public) >= 17 and public - called == set()


def test_trace_timeline_draws_two_rows_per_rank_from_the_traces_intervals():
    from test_traces import HAND_MADE
    fig = plots.trace_timeline([HAND_MADE, HAND_MADE])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0 compute", "rank 0 communication",
                                                            "rank 1 compute", "rank 1 communication"]
    bars = [collection.get_paths() for collection in ax.collections]
    assert [len(paths) for paths in bars] == [2, 2, 2, 2]            # 2 compute spans, 2 transfers, per rank
    plt.close(fig)


def test_gradient_magnitudes_counts_every_entry_with_zeros_apart_and_marks_fp16_s_limits():
    gradient = torch.tensor([0.0, 0.0, 2.0**-30, 2.0**-20, 2.0**-10, 0.5])
    fig = plots.gradient_magnitudes({"a": gradient, "b": gradient[2:]})
    ax = fig.axes[0]
    heights = [[patch.get_height() for patch in container] for container in ax.containers]
    assert [sum(h) for h in heights] == [6, 4] and heights[0][0] == 2 and heights[1][0] == 0   # zeros: first bar
    assert sorted(line.get_xdata()[0] for line in ax.lines) == [-24, -14]
    plt.close(fig)


# ---- 08 · mixture of experts (tests/test_plots_experts.py checks them in full) --------------------------

def test_the_expert_figures_draw_a_routing_and_the_drops_by_capacity():
    from course_lib.feed_forward import Routing
    routing = Routing(capacity=5, requested_per_expert=[8, 2, 4, 6, 3, 5, 1, 3],
                      kept_per_expert=[5, 2, 4, 5, 3, 5, 1, 3], ep=2)
    left, right = plots.expert_load(routing).axes
    assert len(bars(left)) == 8 + 2 and [b.get_height() for b in bars(right)] == [16, 12]
    rows = [{"capacity_factor": f, "capacity": c, "dropped": d, "dropped_share": d / 32}
            for f, c, d in [(0.5, 2, 16), (1.0, 4, 6), (2.0, 8, 0)]]
    measured = plots.dropped_share(rows, imbalance=2.0).axes[0].get_lines()[0]
    assert list(measured.get_ydata()) == [50.0, 18.75, 0.0]


# ---- 10 · checkpoints and failures ------------------------------------------------------------------

def test_the_waste_plot_draws_the_total_its_two_terms_and_youngs_optimum_at_its_minimum():
    from course_lib import failures

    fig = plots.checkpoint_waste(8.0, 2e5, 600, step_s=10.0)
    ax = fig.axes[0]
    total, writing, redoing, optimum = ax.lines[:4]
    best = failures.young_interval(8.0, 2e5) / 60
    assert optimum.get_xdata()[0] == pytest.approx(best)
    assert min(total.get_ydata()) >= optimum.get_ydata()[0] - 1e-9     # nothing on the curve lies below it
    assert "Young: every 30 min" in " ".join(t.get_text() for t in ax.texts)      # sqrt(2·8·2e5) s = 29.8 min
