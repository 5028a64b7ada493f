"""course_lib.presentation.interactive: the plotly figures hold one bar per op, with what a learner reads on hover."""

import plotly.graph_objects as go
import pytest

from conftest import costed
from course_lib.pipeline_parallel import simulate
from course_lib.presentation import interactive


def test_the_pipeline_gantt_has_a_bar_per_op_and_says_what_each_was():
    timeline = simulate("1f1b", 4, 8, 0.010, 0.020)
    fig = interactive.pipeline_gantt(timeline)
    assert isinstance(fig, go.Figure) and [t.name for t in fig.data] == ["forward", "backward"]
    forward, backward = fig.data
    assert len(forward.x) == len(backward.x) == 4 * 8                       # m ops of each kind on p stages
    assert sorted(set(forward.y)) == [f"stage {s}" for s in range(4)]
    assert max(b + w for b, w in zip(backward.base, backward.x)) == pytest.approx(timeline.makespan * 1e3)
    assert "micro-batch %{customdata[1]} on stage %{customdata[0]}" in backward.hovertemplate
    assert [a.text for a in fig.layout.annotations] == [f"idle {f:.0%}" for f in timeline.idle_fractions]
    assert f"bubble {timeline.bubble:.1%}" in fig.layout.title.text


def test_figures_are_sent_as_data_not_with_plotly_js():
    assert interactive.RENDERER == "plotly_mimetype"


def test_memory_stacks_have_a_segment_per_part_with_exact_bytes_on_hover():
    from course_lib.ledger import zero_state_bytes
    rows = {f"ZeRO-{s}": zero_state_bytes(7.1e9, s, world_size=8) for s in (0, 1, 2, 3)}
    fig = interactive.memory_stacks(rows, capacity_bytes=80 * 2**30, capacity_label="80 GiB card")
    assert [t.name for t in fig.data] == ["weights", "grads", "optimizer"]      # "total" is the bar's end
    for label, row in rows.items():
        ends = sum(t.x[list(t.y).index(label)] for t in fig.data)
        assert ends == pytest.approx(row["total"] / 2**30)
    assert fig.data[2].customdata[0][0] == rows["ZeRO-0"]["optimizer"]          # exact bytes for the hover
    assert list(fig.layout.yaxis.categoryarray) == list(rows)[::-1]             # first row on top
    assert fig.layout.shapes[0].x0 == 80 and "80 GiB card" in fig.layout.annotations[0].text


def test_step_time_breakdown_stacks_each_term_with_its_share_on_hover():
    from course_lib.mesh import Mesh
    from course_lib.model import preset
    steps = {f"pp {p}": costed(preset("llama2-70b"), Mesh(dp=8 // p, tp=8, pp=p), gpu="H100 SXM", seq_len=4096,
                                  micro_batch_size=1, num_microbatches=8) for p in (1, 8)}
    rows = {label: step.breakdown() for label, step in steps.items()}
    fig = interactive.step_time_breakdown(rows)
    assert [t.name for t in fig.data] == ["compute", "tp", "pp", "dp", "bubble", "optimizer"]
    for label, step in steps.items():
        at = list(fig.data[0].y).index(label)
        assert sum(t.x[at] for t in fig.data) == pytest.approx(step.total_s)            # the bar ends at the step
        assert sum(t.customdata[at][0] for t in fig.data) == pytest.approx(1.0)         # shares of the step
    bubble = fig.data[4]
    assert bubble.x[0] == 0 and bubble.customdata[1][0] == pytest.approx(steps["pp 8"].bubble_s / steps["pp 8"].total_s)
    assert "of the step" in bubble.hovertemplate
    assert list(fig.layout.yaxis.categoryarray) == list(rows)[::-1]                     # first row on top
    assert [a.text for a in fig.layout.annotations] == [f"{s.total_s:.3g} s" for s in steps.values()]
    extra = interactive.step_time_breakdown({"a": {"compute": 1.0, "data loading": 0.5}})
    assert [t.name for t in extra.data] == ["compute", "data loading"]                  # any other term after


def test_roofline_chart_places_each_operation_with_its_bound_and_keeps_the_legend_off_the_data():
    from course_lib.hardware import find_gpu
    from course_lib.kernel_times import layer_operations
    from course_lib.model import preset
    gpu = find_gpu("H100 SXM")
    ops = layer_operations(preset("llama2-70b"), gpu, micro_batch_size=1, seq_len=4096, tp=8)
    fig = interactive.roofline_chart(ops, gpu)
    markers = [t for t in fig.data if t.mode == "markers"]
    assert sum(len(t.x) for t in markers) == len(ops)
    assert {t.name for t in markers} == {"compute-bound", "memory-bound"}
    placed = {row[0]: (x, y) for t in markers for row, x, y in zip(t.customdata, t.x, t.y)}
    q = next(op for op in ops if op.name == "q_proj")
    assert placed["q_proj"] == pytest.approx((q.intensity, q.flops / q.seconds / 1e12))
    assert all(y <= gpu.peak_flops / 1e12 for _, y in placed.values())                 # nothing above the roof
    assert fig.layout.legend.y >= 1 and fig.layout.legend.yanchor == "bottom"           # above the plot area


# ---- every plotly figure reads: the legend beside the plot, labels inside the axes, none over a bar ---------

PLOT_WIDTH_PX = 700 - 20 - 160     # plotly's default width, less the margins and the legend beside the plot


def legend_beside_the_plot(fig: go.Figure) -> bool:
    """The legend sits wholly outside the plotting area: right of it, above it or under it."""
    legend = fig.layout.legend
    x, y = (legend.x if legend.x is not None else 1.02), (legend.y if legend.y is not None else 1)
    return ((x >= 1 and legend.xanchor == "left") or (y >= 1 and legend.yanchor == "bottom")
            or (y <= 0 and legend.yanchor == "top"))


def labels_past_the_axis(fig: go.Figure) -> list[str]:
    """Labels written at a data x (the ends of bars) that would run past the x axis' range: text width
    estimated at 0.6 of the font size per character, on a plot PLOT_WIDTH_PX wide."""
    low, high = fig.layout.xaxis.range
    per_px = (high - low) / PLOT_WIDTH_PX
    past = []
    for note in fig.layout.annotations:
        if note.xref not in (None, "x") or note.yref == "paper":
            continue
        width_px = 0.6 * (note.font.size or 12) * len(note.text) + (note.xshift or 0)
        if note.xanchor == "left" and note.x + width_px * per_px > high:
            past.append(note.text)
    return past


def figures():
    from course_lib.ledger import zero_state_bytes
    from course_lib.mesh import Mesh
    from course_lib.model import preset
    steps = {f"pp {p}": costed(preset("llama2-70b"), Mesh(dp=8 // p, tp=8, pp=p), gpu="H100 SXM", seq_len=4096,
                                  micro_batch_size=1, num_microbatches=8).breakdown() for p in (1, 2, 8)}
    return {"1f1b": interactive.pipeline_gantt(simulate("1f1b", 4, 8, 0.010, 0.020)),
            "interleaved": interactive.pipeline_gantt(simulate("interleaved", 4, 8, 0.010, 0.020, num_chunks=2)),
            "zb-h1": interactive.pipeline_gantt(simulate("zb-h1", 4, 8, 0.010, 0.020)),
            "memory": interactive.memory_stacks({f"ZeRO-{s}": zero_state_bytes(7.1e9, s, world_size=8)
                                                 for s in (0, 1, 2, 3)}, capacity_bytes=80 * 2**30,
                                                capacity_label="A100 80GB"),
            "step time": interactive.step_time_breakdown(steps)}


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb-h1", "memory", "step time"])
def test_every_plotly_figure_keeps_its_legend_and_labels_off_the_data(name):
    fig = figures()[name]
    assert legend_beside_the_plot(fig), fig.layout.legend
    assert labels_past_the_axis(fig) == []
    for note in fig.layout.annotations:                  # a label at the frame's top sits above it, not on a bar
        if note.yref == "paper":
            assert note.y >= 1 and note.yanchor == "bottom" and fig.layout.margin.t >= 60, note.text


def test_the_card_s_name_stands_above_the_bars_beside_its_line():
    fig = figures()["memory"]
    (line,) = fig.layout.shapes
    (label,) = [a for a in fig.layout.annotations if "A100" in a.text]
    assert label.x == line.x0 == 80 and label.yref == "paper" and label.y == 1
    assert fig.layout.xaxis.range[1] > 80                 # the line and its label inside the axis
