"""Interactive figures (plotly), where hovering or zooming helps; course_lib.presentation.plots draws the static ones.

A plotly figure shows in JupyterLab through plotly's own renderer (the ``jupyterlab-plotly`` extension that
comes with the plotly package): ``show(fig)`` sends the figure as data (a few KiB), never the 5 MB of
plotly.js that the "notebook" renderer would embed in every saved notebook.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

RENDERER = "plotly_mimetype"
PIPELINE_COLORS = {"F": "#1f77b4", "B": "#2ca02c", "W": "#ff7f0e"}   # matplotlib's tab:blue, green, orange


# The legend stands right of the plot, top-aligned, one entry a line: plotly widens the right margin to fit it,
# so it never covers a bar or a label, however many entries it has (a horizontal legend above the plot wraps
# into the title and the top rows as entries are added).
LEGEND_BESIDE = dict(orientation="v", x=1.02, xanchor="left", y=1, yanchor="top")


def show(fig: go.Figure) -> None:
    fig.show(renderer=RENDERER)


def pipeline_gantt(timeline, *, title: str | None = None) -> go.Figure:
    """The Gantt chart of a pipeline_parallel.Timeline, to explore: one row per stage (stage 0 on top), a bar
    per forward (blue), backward (green) and weight-gradient op W (orange, where backward is split: zero
    bubble) labelled with its micro-batch; with several chunks per rank (interleaved) one trace per chunk,
    later chunks lighter, labelled micro-batch with the chunk as subscript. Each stage's idle fraction at the
    end of its row. Hover a bar for its stage, micro-batch, chunk, start, end and duration; drag to zoom into
    the fill, the steady state or the drain."""
    split = any(e.kind == "W" for e in timeline.events)           # then B is the input gradient only
    names = {"F": "forward", "B": "input grad (B)" if split else "backward", "W": "weight grads (W)"}
    t0 = min(e.start for e in timeline.events)
    span = timeline.makespan * 1e3
    stages = [f"stage {s}" for s in range(timeline.num_stages)]
    num_chunks = 1 + max(e.chunk for e in timeline.events)
    fig = go.Figure()
    for kind, name in names.items():
        for chunk in range(num_chunks):
            events = [e for e in timeline.events if e.kind == kind and e.chunk == chunk]
            if not events:
                continue
            where = "" if num_chunks == 1 else f", chunk {chunk} (virtual stage %{{customdata[4]}})"
            fig.add_bar(
                name=name if num_chunks == 1 else f"{name}, chunk {chunk}", orientation="h",
                marker_color=PIPELINE_COLORS[kind], marker_opacity=1 - 0.45 * chunk / max(num_chunks - 1, 1),
                marker_line_color="white", y=[stages[e.rank] for e in events],
                base=[(e.start - t0) * 1e3 for e in events], x=[(e.end - e.start) * 1e3 for e in events],
                text=[str(e.microbatch) if num_chunks == 1 else f"{e.microbatch}<sub>{chunk}</sub>" for e in events],
                textposition="inside", insidetextanchor="middle",
                customdata=[[e.rank, e.microbatch, (e.start - t0) * 1e3, (e.end - t0) * 1e3,
                             chunk * timeline.num_stages + e.rank] for e in events],
                hovertemplate=(f"{name} of micro-batch %{{customdata[1]}} on stage %{{customdata[0]}}{where}<br>"
                               "%{customdata[2]:.1f} → %{customdata[3]:.1f} ms (%{x:.1f} ms)<extra></extra>"))
    for stage, label in enumerate(stages):
        fig.add_annotation(x=span, y=label, text=f"idle {timeline.idle_fraction(stage):.0%}", showarrow=False,
                           xanchor="left", xshift=6, font_size=11)
    fig.update_yaxes(categoryorder="array", categoryarray=stages[::-1])
    fig.update_xaxes(title_text="time (ms)", range=[0, span * 1.16])    # room for the idle fractions
    fig.update_layout(barmode="overlay", bargap=0.3, template="plotly_white", height=120 + 32 * len(stages),
                      margin=dict(l=10, r=10, t=40, b=10), legend=LEGEND_BESIDE,
                      title=title or f"p = {timeline.num_stages} stages, m = {timeline.num_microbatches} "
                                     f"micro-batches: bubble {timeline.bubble:.1%}")
    return fig


MEMORY_COLORS = {"weights": "#1f77b4", "grads": "#ff7f0e", "optimizer": "#2ca02c", "state": "#17becf",
                 "activations": "#d62728",
                 "reserve": "#7f7f7f"}   # matplotlib's tab colours, as in plots.memory_bars


def memory_stacks(rows: dict[str, dict[str, int]], *, capacity_bytes: int | None = None,
                  capacity_label: str = "GPU memory", title: str = "training memory per GPU") -> go.Figure:
    """One horizontal stacked bar per row (label → {part: bytes}), in GiB, first row on top, with a dashed line
    at ``capacity_bytes``. Hover a segment for its part's exact bytes and its share of the row; a ``total`` key
    in a row is ignored (the bar's end is the total)."""
    labels = list(rows)
    parts = [part for part in MEMORY_COLORS if any(part in row for row in rows.values())]
    parts += [part for row in rows.values() for part in row if part not in parts and part != "total"]
    fig = go.Figure()
    for part in parts:
        values = [rows[label].get(part, 0) for label in labels]
        totals = [sum(v for k, v in rows[label].items() if k != "total") or 1 for label in labels]
        fig.add_bar(name=part, orientation="h", y=labels, x=[v / 2**30 for v in values],
                    marker_color=MEMORY_COLORS.get(part), customdata=[[v, v / t] for v, t in zip(values, totals)],
                    hovertemplate=f"{part}: %{{x:.2f}} GiB (%{{customdata[0]:,}} bytes, %{{customdata[1]:.0%}} of "
                                  "the row)<extra>%{y}</extra>")
    if capacity_bytes is not None:   # the card's name above the frame, where no bar can be under it
        fig.add_vline(x=capacity_bytes / 2**30, line_dash="dash", line_color="black")
        fig.add_annotation(x=capacity_bytes / 2**30, y=1, yref="paper", yanchor="bottom", xanchor="center",
                           text=f"{capacity_label}: {capacity_bytes / 2**30:.0f} GiB", showarrow=False, font_size=11)
    totals = [sum(v for k, v in rows[label].items() if k != "total") / 2**30 for label in labels]
    fig.update_xaxes(range=[0, max(totals + [capacity_bytes / 2**30 if capacity_bytes else 0]) * 1.08])
    fig.update_yaxes(categoryorder="array", categoryarray=labels[::-1])
    fig.update_xaxes(title_text="GiB (2**30 bytes)")
    fig.update_layout(barmode="stack", template="plotly_white", height=150 + 40 * len(labels), title=title,
                      margin=dict(l=10, r=10, t=80, b=10), legend=LEGEND_BESIDE)
    return fig


STEP_COLORS = {"compute": "#1f77b4", "tp": "#ff7f0e", "pp": "#9467bd", "dp": "#2ca02c",
               "bubble": "#7f7f7f", "optimizer": "#8c564b"}   # matplotlib's tab colours; the bubble grey, like the reserve: time nobody uses


def step_time_breakdown(rows: dict[str, dict[str, float]], *, title: str = "where one training step's time goes"
                        ) -> go.Figure:
    """One horizontal stacked bar per row (label → {term: seconds}, e.g. cost.StepTime.breakdown()), first row on
    top: compute, tp, pp, dp, bubble, optimizer, then any other term. Hover a segment for its seconds and its share of the
    step; each bar's total is written at its end."""
    labels = list(rows)
    terms = [term for term in STEP_COLORS if any(term in row for row in rows.values())]
    terms += [term for row in rows.values() for term in row if term not in terms]
    totals = [sum(rows[label].values()) for label in labels]
    fig = go.Figure()
    for term in terms:
        seconds = [rows[label].get(term, 0.0) for label in labels]
        fig.add_bar(name=term, orientation="h", y=labels, x=seconds, marker_color=STEP_COLORS.get(term),
                    customdata=[[s / t if t else 0.0] for s, t in zip(seconds, totals)],
                    hovertemplate=f"{term}: %{{x:.3g}} s (%{{customdata[0]:.1%}} of the step)<extra>%{{y}}</extra>")
    for label, total in zip(labels, totals):
        fig.add_annotation(x=total, y=label, text=f"{total:.3g} s", showarrow=False, xanchor="left", xshift=4,
                           font_size=11)
    fig.update_yaxes(categoryorder="array", categoryarray=labels[::-1])
    fig.update_xaxes(title_text="seconds per step", range=[0, max(totals, default=1) * 1.15])
    fig.update_layout(barmode="stack", template="plotly_white", height=140 + 40 * len(labels), title=title,
                      margin=dict(l=10, r=10, t=60, b=10), legend=LEGEND_BESIDE)
    return fig


BOUND_COLORS = {"compute": "#1f77b4", "memory": "#d62728", "launch": "#7f7f7f"}


def roofline_chart(operations, gpu, *, title: str = "each operation of one layer on the roofline") -> go.Figure:
    """The roofline of ``gpu`` (hardware.GPU) on log-log axes, FLOPs per byte against TFLOP/s: the spec-sheet roof
    min(peak, intensity × HBM bandwidth) in black, and what kernels reach (a large GEMM's share of the peak,
    the achievable share of HBM) dashed. Each operation (kernel_times.Operation) is a marker at its intensity and
    the FLOP/s it achieves in the model, coloured by what bounds it (compute, memory, launch). Hover a marker for
    its name, FLOPs, bytes and time. The legend sits above the plot, off the data."""
    peak, bandwidth = gpu.peak_flops / 1e12, gpu.hbm_bytes_per_s / 1e12
    finite = [op.intensity for op in operations if op.bytes and op.flops]
    low, high = min(finite + [1.0]) / 2, max(finite + [4 * gpu.ridge_point]) * 2
    xs = [low * (high / low) ** (i / 200) for i in range(201)]
    fig = go.Figure()
    fig.add_scatter(x=xs, y=[min(peak, x * bandwidth) for x in xs], mode="lines", line_color="black",
                    name="spec-sheet roof", hovertemplate="%{x:.3g} FLOPs/byte: %{y:.3g} TFLOP/s<extra>roof</extra>")
    fig.add_scatter(x=xs, y=[min(gpu.matmul_share * peak, x * gpu.hbm_share * bandwidth) for x in xs], mode="lines",
                    line=dict(color="grey", dash="dash"), name="what kernels reach",
                    hovertemplate="%{x:.3g} FLOPs/byte: %{y:.3g} TFLOP/s<extra>reachable</extra>")
    for bound, color in BOUND_COLORS.items():
        ops = [op for op in operations if op.bound == bound and op.flops and op.bytes]
        if not ops:
            continue
        fig.add_scatter(
            x=[op.intensity for op in ops], y=[op.flops / op.seconds / 1e12 for op in ops], mode="markers",
            marker=dict(color=color, size=11, line=dict(color="white", width=1)), name=f"{bound}-bound",
            customdata=[[op.name, op.flops, op.bytes, op.seconds * 1e3] for op in ops],
            hovertemplate="<b>%{customdata[0]}</b><br>%{x:.3g} FLOPs/byte, %{y:.3g} TFLOP/s<br>"
                          "%{customdata[1]:.3g} FLOPs, %{customdata[2]:.3g} bytes<br>%{customdata[3]:.3g} ms"
                          f"<extra>{bound}-bound</extra>")
    fig.add_vline(x=gpu.ridge_point, line=dict(color="grey", dash="dot", width=1))
    fig.update_xaxes(type="log", title_text="arithmetic intensity (FLOPs per byte of HBM traffic)")
    fig.update_yaxes(type="log", title_text="TFLOP/s", range=[-3, 0.05 + math.log10(peak)])
    fig.update_layout(template="plotly_white", height=420, title=dict(text=title, y=0.97),
                      margin=dict(l=10, r=10, t=90, b=10),
                      legend=dict(orientation="h", y=1.0, yanchor="bottom", x=0, xanchor="left"))
    return fig
