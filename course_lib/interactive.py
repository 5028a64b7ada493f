"""Interactive figures (plotly), where hovering or zooming helps; course_lib.plots draws the static ones.

A plotly figure shows in JupyterLab through plotly's own renderer (the ``jupyterlab-plotly`` extension that
comes with the plotly package): ``show(fig)`` sends the figure as data (a few KiB), never the 5 MB of
plotly.js that the "notebook" renderer would embed in every saved notebook.
"""

from __future__ import annotations

import plotly.graph_objects as go

RENDERER = "plotly_mimetype"
PIPELINE_COLORS = {"F": "#1f77b4", "B": "#2ca02c"}   # matplotlib's tab:blue and tab:green, as in plots


def show(fig: go.Figure) -> None:
    fig.show(renderer=RENDERER)


def pipeline_gantt(timeline, *, title: str | None = None) -> go.Figure:
    """The Gantt chart of a pipeline_parallel.Timeline, to explore: one row per stage (stage 0 on top), a bar
    per forward (blue) and backward (green) labelled with its micro-batch, each stage's idle fraction at the
    end of its row. Hover a bar for its stage, micro-batch, start, end and duration; drag to zoom into the
    fill, the steady state or the drain."""
    t0 = min(e.start for e in timeline.events)
    span = timeline.makespan * 1e3
    stages = [f"stage {s}" for s in range(timeline.num_stages)]
    fig = go.Figure()
    for kind, name in (("F", "forward"), ("B", "backward")):
        events = [e for e in timeline.events if e.kind == kind]
        fig.add_bar(
            name=name, orientation="h", marker_color=PIPELINE_COLORS[kind], marker_line_color="white",
            y=[stages[e.rank] for e in events], base=[(e.start - t0) * 1e3 for e in events],
            x=[(e.end - e.start) * 1e3 for e in events], text=[str(e.microbatch) for e in events],
            textposition="inside", insidetextanchor="middle",
            customdata=[[e.rank, e.microbatch, (e.start - t0) * 1e3, (e.end - t0) * 1e3] for e in events],
            hovertemplate=(f"{name} of micro-batch %{{customdata[1]}} on stage %{{customdata[0]}}<br>"
                           "%{customdata[2]:.1f} → %{customdata[3]:.1f} ms (%{x:.1f} ms)<extra></extra>"))
    for stage, label in enumerate(stages):
        fig.add_annotation(x=span, y=label, text=f"idle {timeline.idle_fraction(stage):.0%}", showarrow=False,
                           xanchor="left", xshift=6, font_size=11)
    fig.update_yaxes(categoryorder="array", categoryarray=stages[::-1])
    fig.update_xaxes(title_text="time (ms)", range=[0, span * 1.12])
    fig.update_layout(barmode="overlay", bargap=0.3, template="plotly_white", height=120 + 32 * len(stages),
                      margin=dict(l=10, r=10, t=40, b=10), legend=dict(orientation="h", y=1.02, x=1, xanchor="right"),
                      title=title or f"p = {timeline.num_stages} stages, m = {timeline.num_microbatches} "
                                     f"micro-batches: bubble {timeline.bubble:.1%}")
    return fig
