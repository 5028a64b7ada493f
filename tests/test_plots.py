"""course_lib.presentation.plots: every figure drawn from small inputs of the shape the notebooks and explorers pass (built
with the course's own functions where that is cheap), and checked for what it should show: the number of
panels, one bar or line per item of the input, the given titles and labels, the capacity and prediction
lines when asked, highlights, and no public function left untested."""

import inspect
import math
import re
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pytest
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from course_lib.ledger import zero_state_bytes
from course_lib.mesh import Mesh
from course_lib.pipeline_parallel import simulate
from course_lib.presentation import plots
from course_lib.presentation.plots.readable import amount, byte_unit, keep_texts_inside, plural, unit_label
from course_lib.runs.ddp import phase_seconds
from course_lib.zero import wire_bytes_per_step

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


# ---- 02 · data parallelism ----------------------------------------------------------------------------

def ring_snapshots(p: int) -> list[list]:
    """What ddp.ring_all_reduce records on each of ``p`` ranks when rank r starts with 2**r everywhere, one
    element per chunk: (phase, step, [each chunk's first element]) after every step."""
    chunks = [[2.0**r] * p for r in range(p)]
    snapshots = [[] for _ in range(p)]
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(p - 1):
            before = [list(c) for c in chunks]
            for r in range(p):
                left = before[(r - 1) % p]
                if phase == "reduce-scatter":
                    chunks[r][(r - s - 1) % p] += left[(r - s - 1) % p]
                else:
                    chunks[r][(r - s) % p] = left[(r - s) % p]
                snapshots[r].append((phase, s, list(chunks[r])))
    assert chunks == [[2.0**p - 1] * p] * p       # every rank ends with the sum in every chunk
    return snapshots


def test_ring_all_reduce_steps_draws_a_grid_per_step_and_outlines_what_arrived():
    p = 3
    fig = plots.ring_all_reduce_steps(ring_snapshots(p))
    steps = 1 + 2 * (p - 1)
    assert len(fig.axes) == 6                                  # 5 pictures on 2 rows of 3, the last one blank
    assert [ax.get_title() for ax in fig.axes[:steps]] == ["start: rank r holds g_r", "reduce-scatter 1/2",
                                                          "reduce-scatter 2/2", "all-gather 1/2", "all-gather 2/2"]
    assert not fig.axes[-1].axison
    assert len(fig.axes[0].patches) == p * p                    # the start: nothing arrived yet
    for ax in fig.axes[1:steps]:
        arrived = [patch for patch in ax.patches if not patch.get_fill()]
        assert len(ax.patches) == p * p + p and len(arrived) == p    # one chunk arrives on every rank per step
    assert sorted(texts(fig.axes[0])) == sorted(str(r) for r in range(p) for _ in range(p))
    assert texts(fig.axes[steps - 1]) == ["Σ"] * p * p          # the end: every chunk holds every rank's data
    assert texts(fig.axes[2]).count("Σ") == p                  # after the reduce-scatter: one full chunk per rank
    assert "the 3 chunks" in fig._suptitle.get_text()


@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_all_reduce_labels_fit_in_their_cells_and_the_title_in_the_figure(p):
    fig = plots.ring_all_reduce_steps(ring_snapshots(p))
    fig.canvas.draw()
    for ax in fig.axes[:1 + 2 * (p - 1)]:
        cells = [patch for patch in ax.patches if patch.get_fill()]
        for text, cell in zip(ax.texts, cells):                    # one label per cell, drawn in the same order
            box, room = text.get_window_extent(), cell.get_window_extent()
            assert room.x0 < box.x0 and box.x1 < room.x1 and room.y0 < box.y0 and box.y1 < room.y1, text.get_text()
        assert min(t.get_fontsize() for t in ax.texts) >= 7
    assert outside_figure(fig) == []


def test_replica_drift_draws_one_line_per_setup_from_step_one():
    curves = {"no sync": [0.01, 0.02, 0.05], "all-reduce": [0.0, 0.0, 0.0]}
    fig = plots.replica_drift(curves, title="drift")
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == list(curves)
    assert list(ax.get_lines()[0].get_xdata()) == [1, 2, 3] and list(ax.get_lines()[1].get_ydata()) == [0.0] * 3
    assert ax.get_title() == "drift" and ax.get_xlabel() == "optimizer step"


def step_record(start, compute, exposed, optimizer, bucket_log=None):
    """A record of ddp.train_step: when each phase ended, and the all-reduces issued in the step."""
    record = {"start": start, "backward": start + compute, "synced": start + compute + exposed,
              "end": start + compute + exposed + optimizer}
    if bucket_log is not None:
        record["bucket_log"] = bucket_log
    return record


def test_step_time_split_stacks_the_phases_of_each_setup_and_dims_the_others():
    rows = {"naive": phase_seconds([[step_record(0, 0.010, 0.004, 0.001)] * 3] * 2),
            "64 KiB": phase_seconds([[step_record(0, 0.010, 0.001, 0.001)] * 3] * 2)}
    assert set(rows["naive"]) == {"compute", "exposed communication", "optimizer", "step"}
    fig = plots.step_time_split(rows, highlight="64 KiB", title="2 ranks")
    ax = fig.axes[0]
    assert len(bars(ax)) == 2 * 3                                   # "step" is the total, not a phase
    assert [t.get_text() for t in ax.get_yticklabels()] == ["64 KiB", "naive"]      # first row on top
    alphas = [b.get_alpha() for b in bars(ax)]
    assert alphas == [1.0] * 3 + [0.45] * 3                         # the highlighted row in full colour
    assert sorted(texts(ax)) == ["12.0 ms", "15.0 ms"] and ax.get_title() == "2 ranks"


def test_ddp_timeline_draws_three_phases_and_each_all_reduce_per_rank():
    buckets = [{"bucket": 0, "bytes": 1024, "issued": 1.004, "done": 1.006},
               {"bucket": 1, "bytes": 1024, "issued": 1.008}]              # still in flight: no "done"
    steps_by_rank = [step_record(1.000, 0.010, 0.002, 0.001, buckets), step_record(1.001, 0.010, 0.001, 0.001)]
    fig = plots.ddp_timeline(steps_by_rank, title="step 1")
    ax = fig.axes[0]
    assert len(bars(ax)) == 2 * 3 + 2                   # compute, exposed, optimizer per rank; rank 0's buckets
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert min(b.get_x() for b in bars(ax)) == 0.0       # ms from the first rank's start
    orange = [b for b in bars(ax) if matplotlib.colors.to_hex(b.get_facecolor()) == matplotlib.colors.to_hex("tab:orange")]
    assert [b.get_x() for b in orange] == pytest.approx([4.0, 8.0])
    assert orange[0].get_width() == pytest.approx(2.0) and orange[1].get_width() > 0   # an unfinished one still shows
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["compute", "exposed communication", "optimizer", "all-reduce of one bucket (issued → done)"]
    assert ax.get_title() == "step 1"


def test_pack_rows_shares_a_row_between_all_reduces_that_follow_each_other():
    from course_lib.presentation.plots.ddp import pack_rows
    assert pack_rows([(0, 1), (1, 2), (2, 3)]) == [0, 0, 0]          # one after the other: one row
    assert pack_rows([(0, 5), (1, 2), (3, 4), (4.5, 6)]) == [0, 1, 1, 1]
    assert pack_rows([(0, 5), (1, 6), (2, 7)]) == [0, 1, 2]          # all in flight at once: a row each
    assert pack_rows([]) == []


def many_buckets(start: float, count: int, *, each: float, spacing: float) -> list[dict]:
    """``count`` all-reduces issued ``spacing`` s apart, each taking ``each`` s (overlapping when each > spacing)."""
    return [{"bucket": i, "bytes": 256, "issued": start + i * spacing, "done": start + i * spacing + each}
            for i in range(count)]


@pytest.mark.parametrize(("each", "spacing"), [(0.0002, 0.0003), (0.008, 0.0002)])   # naive in a row; queued
def test_ddp_timeline_draws_every_bar_at_least_a_few_pixels_wide_and_tall(each, spacing):
    steps_by_rank = [step_record(0.0, 0.015, 0.012, 0.0001, many_buckets(0.008, 39, each=each, spacing=spacing))
                     for _ in range(4)]
    fig = plots.ddp_timeline(steps_by_rank, title="step 3 of 25 MiB (torch's default): compute and all-reduces on "
                                                  "every rank")
    ax = fig.axes[0]
    fig.canvas.draw()
    assert len(bars(ax)) == 4 * (3 + 39)
    for bar in bars(ax):
        box = bar.get_window_extent()
        assert box.width >= 3.9 and box.height >= 3.5           # no 1-pixel lines: the optimizer's 0.1 ms too
    assert outside_figure(fig) == []                             # the long title wraps to the axes' width
    assert ax.title.get_window_extent().x1 <= ax.get_window_extent().x1 + 1


def test_bubble_curves_draw_the_formula_and_the_measured_dots_for_each_depth():
    measured = {2: {1: 0.50, 4: 0.21}, 4: {4: 0.44, 8: 0.28}}
    fig = plots.bubble_curves(measured, max_microbatches=16, title="the bubble")
    ax = fig.axes[0]
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["p = 2: (p−1)/(m+p−1)", "p = 2: measured",
                                                     "p = 4: (p−1)/(m+p−1)", "p = 4: measured"]
    assert len(lines[0].get_xdata()) == 16 and lines[0].get_ydata()[0] == pytest.approx(50.0)
    assert list(lines[3].get_xdata()) == [4, 8] and list(lines[3].get_ydata()) == pytest.approx([44.0, 28.0])
    assert ax.get_xscale() == "log" and ax.get_ylim() == (0, 100) and ax.get_title() == "the bubble"


# ---- 03 · ZeRO and FSDP ------------------------------------------------------------------------------

def test_zero_per_rank_bars_draw_a_panel_per_ranks_and_stage_with_the_formula():
    params = 1000
    measured = {n: {s: [zero_state_bytes(params, s, n) for _ in range(n)] for s in range(4)} for n in (1, 4)}
    predicted = {n: {s: zero_state_bytes(params, s, n)["total"] for s in range(4)} for n in (1, 4)}
    fig = plots.zero_per_rank_bars(measured, predicted, unit=("B", 1), title="tiny")
    assert len(fig.axes) == 2 * 4
    for ax, (n, s) in zip(fig.axes, [(n, s) for n in (1, 4) for s in range(4)]):
        assert ax.get_title() == f"{NAMES[s]}, {n} rank" + ("s" if n > 1 else "")      # "1 rank", "4 ranks"
        assert len(bars(ax)) == 3 * n and len(lines_at(ax, y=predicted[n][s])) == 1
        assert max(b.get_y() + b.get_height() for b in bars(ax)) == pytest.approx(predicted[n][s])
        assert [t.get_text() for t in ax.get_xticklabels()] == [f"r{r}" for r in range(n)]
        assert spilled(ax) == []                                  # "formula …" stays under the frame's top
    assert fig.axes[0].get_ylabel() == "B per rank" and fig._suptitle.get_text() == "tiny"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["weights", "grads", "optimizer"]


def notebook_03_wire():
    """Notebook 03's 4-rank run: the traced bytes per op (the formula, op by op) and gloo's count per stage."""
    grad_bytes = 328_832                                            # Ψ of the tiny model in bf16
    traced = {NAMES[s]: wire_bytes_per_step(grad_bytes, s, 4) for s in range(4)}
    counted = {NAMES[0]: 505_344, NAMES[1]: 758_016, NAMES[2]: 758_016, NAMES[3]: 1_010_688}
    return traced, counted


def written_ratios(ax) -> tuple[list[str], list[str]]:
    """The ratios written on the bars and beside the diamonds, first row first."""
    diamonds = {line.get_ydata()[0]: line.get_xdata()[0] for line in ax.get_lines() if line.get_marker() == "D"}
    on_bars, beside_diamonds = {}, {}
    for text in ax.texts:
        x, y = text.xy
        (beside_diamonds if diamonds.get(y) == x else on_bars)[y] = text.get_text()
    return ([on_bars[y] for y in sorted(on_bars, reverse=True)],
            [beside_diamonds[y] for y in sorted(beside_diamonds, reverse=True)])


def test_zero_wire_bytes_write_each_ratio_on_the_quantity_it_is_the_ratio_of():
    traced, counted = notebook_03_wire()
    fig = plots.zero_wire_bytes(traced, counted=counted, title="4 ranks")
    ax = fig.axes[0]
    assert len(bars(ax)) == 1 + 2 + 2 + 2
    assert [t.get_text() for t in ax.get_yticklabels()] == list(traced)[::-1]
    on_bars, beside_diamonds = written_ratios(ax)
    traced_total = [sum(ops.values()) for ops in traced.values()]
    assert on_bars == [f"{t / traced_total[0]:.2f}×" for t in traced_total] == ["1.00×", "1.00×", "1.00×", "1.50×"]
    counts = list(counted.values())                                 # the table printed above the chart in 03
    assert beside_diamonds == [f"{c / counts[0]:.2f}×" for c in counts] == ["1.00×", "1.50×", "1.50×", "2.00×"]
    assert spilled(ax) == []
    for text in ax.texts:                                           # a ratio on a bar lies on its bar's end
        x, y = text.xy
        if text.get_text() in on_bars and x not in {line.get_xdata()[0] for line in ax.get_lines()}:
            end = max(b.get_x() + b.get_width() for b in bars(ax) if b.get_y() < y < b.get_y() + b.get_height())
            assert x == pytest.approx(end) and text.get_window_extent().x1 <= ax.transData.transform((end, y))[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sorted(legend) == sorted(["all-reduce", "reduce-scatter", "all-gather", "counted by the kernel (gloo)"])
    assert ax.get_title() == "4 ranks" and "in the bar, traced; beside ◆, counted" in ax.get_xlabel()


def test_zero_wire_bytes_without_a_count_write_the_traced_ratio_after_each_bar():
    traced, counted = notebook_03_wire()
    ax = plots.zero_wire_bytes(traced).axes[0]
    assert [line for line in ax.get_lines() if line.get_marker() == "D"] == []
    assert written_ratios(ax) == (["1.00×", "1.00×", "1.00×", "1.50×"], [])
    ax = plots.zero_wire_bytes(traced, counted={**counted, NAMES[1]: None}).axes[0]     # a stage not counted
    assert len([line for line in ax.get_lines() if line.get_marker() == "D"]) == 3
    assert written_ratios(ax)[1] == ["1.00×", "1.50×", "2.00×"]


def zero_step(units=("layers.0", "layers.1"), shard=100, block=400):
    """ZeroDataParallel.memory_trace of one ZeRO-3 step on one rank: each unit gathered forward, then backward."""
    events, t, held = [], 10.0, shard

    def record(event, unit, weights, grads):
        nonlocal t
        t += 0.001
        events.append({"time": t, "event": event, "unit": unit, "weights": weights, "grads": grads})

    for unit in units:
        record("gather (forward)", unit, held + block, 0)
        record("free (forward)", unit, held, 0)
    for unit in units[::-1]:
        record("gather (backward)", unit, held + block, 0)
        record("gradients ready", unit, held + block, block)
        record("reduce gradients", unit, held, shard)
    record("step", None, held, shard)
    return events


def test_zero_memory_trace_draws_weights_and_grads_over_the_step_with_each_gather_named():
    timeline = zero_step()
    fig = plots.zero_memory_trace(timeline, shard_bytes=100, unit=("B", 1), title="ZeRO-3, rank 0")
    weights, grads = fig.axes
    assert weights.get_title() == "ZeRO-3, rank 0" and grads.get_xlabel() == "milliseconds since the step began"
    (step,) = [line for line in weights.get_lines() if line.get_drawstyle() == "steps-post"]
    assert list(step.get_ydata()) == [e["weights"] for e in timeline]
    assert len(lines_at(weights, y=100)) == len(lines_at(grads, y=100)) == 1
    gathers = [t for t in texts(weights) if t.startswith("layers.")]
    assert gathers == ["layers.0", "layers.1", "layers.1", "layers.0"]          # forward order, then backward
    assert {"forward", "backward", "this rank's shard only"} <= set(texts(weights))
    assert weights.get_ylabel() == "weights, B" and grads.get_ylabel() == "grads, B"


def test_zero_memory_trace_without_a_shard_or_a_backward_draws_no_guides():
    forward_only = [{**e, "grads": 100} for e in zero_step() if e["event"].endswith("(forward)")]
    fig = plots.zero_memory_trace(forward_only, unit=("B", 1))
    weights, _ = fig.axes
    assert "forward" not in texts(weights) and lines_at(weights, y=100) == []


def test_zero_explorer_figure_draws_state_and_traffic_per_stage_with_the_chosen_one_in_full_colour():
    params = int(7.1e9)
    memory = {NAMES[s]: zero_state_bytes(params, s, 8) for s in range(4)}
    wire = {NAMES[s]: sum(wire_bytes_per_step(2 * params, s, 8).values()) for s in range(4)}
    fig = plots.zero_explorer_figure(memory, wire, highlight="ZeRO-1", capacity_bytes=24 * GIB,
                                     capacity_label="24 GiB (RTX 4090)", title="7.1B, 8 ranks")
    state, traffic = fig.axes
    assert len(bars(state)) == 4 * 3 and len(bars(traffic)) == 4
    assert [t.get_text() for t in state.get_yticklabels()] == list(memory)[::-1]
    full = [t.get_text() for t, b in zip(state.get_yticklabels(), bars(traffic)) if b.get_alpha() == 1.0]
    assert full == ["ZeRO-1"]
    assert len(lines_at(state, x=24)) == 1 and "24 GiB (RTX 4090)" in texts(state)
    over = [t.get_text() for t in state.texts if t.get_color() == "tab:red"]
    assert sorted(over) == sorted(f"{row['total'] / GIB:,.1f}" for row in memory.values() if row["total"] > 24 * GIB)
    assert len(over) == 3                               # on a 24 GiB card only ZeRO-3 fits (13.2 GiB)
    assert state.get_xlabel() == "GiB of training state per rank" and traffic.get_xlabel() == "GiB each rank sends per step"
    assert fig._suptitle.get_text() == "7.1B, 8 ranks"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["weights", "grads", "optimizer"]
    assert spilled(state) == spilled(traffic) == []


def test_zero_explorer_figure_picks_units_that_show_a_tiny_models_numbers():
    params = 164_416                                    # the course's tiny model
    memory = {NAMES[s]: zero_state_bytes(params, s, 8) for s in range(4)}
    wire = {NAMES[s]: sum(wire_bytes_per_step(2 * params, s, 8).values()) for s in range(4)}
    fig = plots.zero_explorer_figure(memory, wire, highlight="ZeRO-3", capacity_bytes=80 * GIB,
                                     capacity_label="80 GiB (A100 80GB)")
    state, traffic = fig.axes
    assert state.get_xlabel() == "MiB of training state per rank" and traffic.get_xlabel() == "KiB each rank sends per step"
    numbers = [t for t in texts(state) + texts(traffic) if re.fullmatch(r"[\d,.]+", t)]
    assert len(numbers) == 8 and not any(float(n.replace(",", "")) == 0 for n in numbers)   # no "0.0" anywhere
    assert numbers[:4] == [f"{memory[name]['total'] / 2**20:.2g}" if memory[name]["total"] < 2**20
                           else f"{memory[name]['total'] / 2**20:,.1f}" for name in list(memory)[::-1]]
    assert max(b.get_x() + b.get_width() for b in bars(state)) > 0.5 * state.get_xlim()[1]   # not squashed by the card
    assert "80 GiB (A100 80GB): far to the right, everything fits" in texts(state)
    one_rank = plots.zero_explorer_figure({n: zero_state_bytes(params, s, 1) for s, n in NAMES.items()},
                                          {n: 0.0 for n in NAMES.values()}, highlight="ZeRO-1")
    assert "one rank: nothing to send" in texts(one_rank.axes[1]) and "0" in texts(one_rank.axes[1])


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
    called = set(re.findall(r"plots\.(\w+)\(", Path(__file__).read_text()))
    assert len(public) >= 17 and public - called == set()


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
