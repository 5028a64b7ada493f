"""Figures for pipeline parallelism (notebook 05): the Gantt chart of a schedule, the bubble."""


import matplotlib.colors
import matplotlib.pyplot as plt

from ...pipeline_parallel import bubble_fraction
from .readable import plural

PIPELINE_COLORS = {"F": "tab:blue", "B": "tab:green", "W": "tab:orange"}


def op_names(timeline) -> dict[str, str]:
    """What each kind of op is called in a legend: B is only the input gradient when W ops are there."""
    split = any(e.kind == "W" for e in timeline.events)
    return {"F": "forward", "B": "input grad (B)" if split else "backward", "W": "weight grads (W)"}


def op_shade(kind: str, chunk: int, num_chunks: int):
    """The op's colour, lighter for later chunks (chunk 0 full, the last mixed halfway with white)."""
    mix = 0.5 * chunk / (num_chunks - 1) if num_chunks > 1 else 0.0
    return tuple(c + (1 - c) * mix for c in matplotlib.colors.to_rgb(PIPELINE_COLORS[kind]))


def pipeline_gantt(timeline, *, title: str | None = None, ax=None, in_flight: bool = False):
    """A Gantt chart of a pipeline_parallel.Timeline: one row per rank (stage 0 on top), a bar per forward
    (blue), backward (green) and, where backward is split (zero bubble), weight-gradient op W (orange), labelled
    with its micro-batch; with several chunks per rank (interleaved) later chunks are lighter and the label is
    micro-batch with the chunk as subscript (3₁: micro-batch 3, chunk 1). Idle time light grey, each rank's
    measured idle fraction on the right. ``in_flight``: a second panel with what each rank holds over time."""
    rows = 2 if in_flight else 1
    if ax is None:
        fig, axes = plt.subplots(rows, 1, figsize=(8.0, 0.45 * timeline.num_stages + 1.3 + 1.6 * (rows - 1)),
                                 sharex=True, squeeze=False, gridspec_kw={"height_ratios": [1.4, 1][:rows]})
        ax = axes[0, 0]
    else:
        fig, axes = ax.figure, None
    t0 = min(e.start for e in timeline.events)
    span = timeline.makespan * 1e3
    num_chunks = 1 + max(e.chunk for e in timeline.events)
    for rank in range(timeline.num_stages):
        ax.barh(rank, span, left=0, height=0.7, color="0.93", lw=0)     # idle unless an op covers it
        ax.annotate(f"idle {timeline.idle_fraction(rank):.0%}", (span, rank), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=8)
    for e in timeline.events:
        start, width = (e.start - t0) * 1e3, (e.end - e.start) * 1e3
        ax.barh(e.rank, width, left=start, height=0.7, color=op_shade(e.kind, e.chunk, num_chunks), alpha=0.85,
                edgecolor="white", lw=0.5)
        if width > span / (60 if num_chunks == 1 else 40):      # room for the label (wider with a subscript)
            label = str(e.microbatch) if num_chunks == 1 else f"${e.microbatch}_{{{e.chunk}}}$"
            ax.text(start + width / 2, e.rank, label, ha="center", va="center", fontsize=7,
                    color="white" if e.chunk == 0 else "black")
    ax.set_yticks(range(timeline.num_stages), [f"stage {r}" for r in range(timeline.num_stages)], fontsize=8)
    ax.set_ylim(timeline.num_stages - 0.5, -0.5)
    ax.set_xlim(0, span * 1.14)   # room for the idle fractions
    names = op_names(timeline)
    kinds = [kind for kind in PIPELINE_COLORS if any(e.kind == kind for e in timeline.events)]
    shown = [(kind, c) for kind in kinds for c in range(num_chunks)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=op_shade(kind, c, num_chunks), alpha=0.85) for kind, c in shown]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="0.93"))
    labels = [names[kind] if num_chunks == 1 else f"{names[kind]}, chunk {c}" for kind, c in shown]
    ax.legend(handles, labels + ["idle"], fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(title or f"p = {plural(timeline.num_stages, 'stage')}, m = "
                          f"{plural(timeline.num_microbatches, 'micro-batch', 'micro-batches')}: bubble {timeline.bubble:.1%}",
                 fontsize=10, loc="left")
    if in_flight and axes is not None:
        low = axes[1, 0]
        for rank, samples in sorted(timeline.in_flight.items()):
            low.step([(t - t0) * 1e3 for t, _, _ in samples], [count for _, count, _ in samples], where="post",
                     label=f"stage {rank}")
        low.set(ylabel="micro-batches\nin flight" if num_chunks == 1 else "chunk-micro-\nbatches in flight",
                ylim=(0, None))
        low.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    (axes[-1, 0] if axes is not None else ax).set_xlabel("time (ms)")
    fig.tight_layout()
    return fig


def bubble_curves(measured: dict[int, dict[int, float]], *, max_microbatches: int = 64, title: str | None = None):
    """The bubble (p-1)/(m+p-1) against m for each p of ``measured`` (p → {m: measured bubble}), as a line,
    with the measured bubbles as dots on it; m on a log axis."""

    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    ms = [m for m in range(1, max_microbatches + 1)]
    for i, (p, points) in enumerate(sorted(measured.items())):
        color = f"C{i}"
        ax.plot(ms, [100 * bubble_fraction(p, m) for m in ms], "-", color=color, lw=1.5, alpha=0.7,
                label=f"p = {p}: (p−1)/(m+p−1)")
        ax.plot(list(points), [100 * b for b in points.values()], "o", color=color, ms=6,
                markeredgecolor="black", label=f"p = {p}: measured")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="micro-batches m", ylabel="bubble (%)", ylim=(0, 100))
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
