"""course_lib.plots: every figure drawn from small inputs of the shape the notebooks and explorers pass (built
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

from course_lib import plots
from course_lib.ledger import zero_state_bytes
from course_lib.mesh import Mesh
from course_lib.pipeline_parallel import simulate
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
    assert "guessing: ln 128 = 4.85" in texts(ax)
    assert ax.get_title() == "tiny model, 4 steps" and ax.get_ylim()[0] == 0
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(curves)


def test_loss_curves_without_a_highlight_draw_every_curve_bold_and_no_guides():
    fig = plots.loss_curves({"a": [2.0, 1.0], "b": [3.0, 2.0]})
    ax = fig.axes[0]
    assert [line.get_linewidth() for line in ax.get_lines()] == [2.2, 2.2]
    assert texts(ax) == [] and ax.get_title() == "training loss"


# ---- 01 · the memory ledger ---------------------------------------------------------------------------

def test_memory_bars_stack_each_part_and_mark_the_card():
    rows = {NAMES[s]: zero_state_bytes(int(7.1e9), s, 8) for s in range(4)}   # as notebook 03 (with "total")
    card = 80 * GIB
    fig = plots.memory_bars(rows, capacity_bytes=card, capacity_label="80 GiB card", title="7.1B on 8 cards")
    ax = fig.axes[0]
    assert len(bars(ax)) == 4 * 3                    # weights, grads, optimizer per row; "total" is not a part
    assert [t.get_text() for t in ax.get_yticklabels()] == list(rows)[::-1]          # the first row on top
    assert len(lines_at(ax, x=card / GIB)) == 1 and "80 GiB card " in texts(ax)
    totals = {t.get_text(): t.get_color() for t in ax.texts if t.get_text().endswith(" GiB")}
    assert totals == {f"{row['total'] / GIB:,.1f} GiB": "black" if row["total"] <= card else "tab:red"
                      for row in rows.values()}
    assert list(totals.values()).count("tab:red") == 1              # 105.8 GiB: DDP does not fit, ZeRO does
    assert ax.get_title() == "7.1B on 8 cards" and ax.get_xlim()[1] > 105.8
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["weights", "grads", "optimizer"]


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
    assert ratios == {"2.0×": "tab:red", "0.8×": "tab:green", "3.0×": "tab:red", "1.1×": "tab:red"}
    assert ax.get_title() == "TP on this CPU" and ax.get_xscale() == ax.get_yscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "128"]


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
    assert min(b.get_width() for b in bars(ax)) == pytest.approx(0.02)     # an unfinished one still shows
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["compute", "exposed communication", "optimizer", "all-reduce of one bucket (issued → done)"]
    assert ax.get_title() == "step 1"


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
    measured = {n: {s: [zero_state_bytes(params, s, n) for _ in range(n)] for s in range(4)} for n in (2, 4)}
    predicted = {n: {s: zero_state_bytes(params, s, n)["total"] for s in range(4)} for n in (2, 4)}
    fig = plots.zero_per_rank_bars(measured, predicted, unit=("B", 1), title="tiny")
    assert len(fig.axes) == 2 * 4
    for ax, (n, s) in zip(fig.axes, [(n, s) for n in (2, 4) for s in range(4)]):
        assert ax.get_title() == f"{NAMES[s]}, {n} ranks"
        assert len(bars(ax)) == 3 * n and len(lines_at(ax, y=predicted[n][s])) == 1
        assert max(b.get_y() + b.get_height() for b in bars(ax)) == pytest.approx(predicted[n][s])
        assert [t.get_text() for t in ax.get_xticklabels()] == [f"r{r}" for r in range(n)]
    assert fig.axes[0].get_ylabel() == "B per rank" and fig._suptitle.get_text() == "tiny"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["weights", "grads", "optimizer"]


def test_zero_wire_bytes_stack_the_collectives_and_write_the_ratio_to_the_first():
    grad_bytes = 4096
    rows = {NAMES[s]: wire_bytes_per_step(grad_bytes, s, 4) for s in range(4)}
    counted = {NAMES[0]: 6500, NAMES[1]: None, NAMES[2]: 6400, NAMES[3]: 9800}
    fig = plots.zero_wire_bytes(rows, counted=counted, title="4 ranks")
    ax = fig.axes[0]
    assert len(bars(ax)) == 1 + 2 + 2 + 2
    assert [t.get_text() for t in ax.get_yticklabels()] == list(rows)[::-1]
    assert sorted(texts(ax)) == sorted(["1.00×", "1.00×", "1.00×", "1.50×"])      # ZeRO-3 sends 1.5× DDP
    assert len([line for line in ax.get_lines() if line.get_marker() == "D"]) == 3
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sorted(legend) == sorted(["all-reduce", "reduce-scatter", "all-gather", "counted by the kernel (gloo)"])
    assert ax.get_title() == "4 ranks"
    assert [line for line in plots.zero_wire_bytes(rows).axes[0].get_lines() if line.get_marker() == "D"] == []


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
    assert fig._suptitle.get_text() == "7.1B, 8 ranks"


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


def test_every_public_function_of_plots_is_tested_here():
    public = {name for name, obj in vars(plots).items() if not name.startswith("_") and inspect.isfunction(obj)
              and obj.__module__ == plots.__name__}
    called = set(re.findall(r"plots\.(\w+)\(", Path(__file__).read_text()))
    assert len(public) >= 17 and public - called == set()
