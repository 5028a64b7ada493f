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
