"""course_lib.interactive: the plotly figures hold one bar per op, with what a learner reads on hover."""

import plotly.graph_objects as go
import pytest

from course_lib import interactive
from course_lib.pipeline_parallel import simulate


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
    from course_lib.cost import step_time
    from course_lib.mesh import Mesh
    from course_lib.model import preset
    steps = {f"pp {p}": step_time(preset("llama2-70b"), Mesh(dp=8 // p, tp=8, pp=p), gpu="H100 SXM", seq_len=4096,
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
    from course_lib.model import preset
    from course_lib.operations import layer_operations
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
