"""Notebook 11's figure: every rank's profiler trace as one timeline, computation and communication apart."""

import matplotlib.pyplot as plt

from ...traces import intervals


def trace_timeline(traces: list[dict], title: str = "one DDP step, from each rank's torch.profiler trace"):
    """Two rows per rank: the ops of its main thread (compute) and the backend's transfers (communication), in ms
    from the first op of any rank. Returns the figure."""
    spans = [intervals(trace) for trace in traces]
    start = min(compute[0][0] for _, compute in spans)
    figure, axes = plt.subplots(figsize=(10, 0.9 + 0.8 * len(traces)))
    labels = []
    for rank, (communication, compute) in enumerate(spans):
        for row, (what, bars, color) in enumerate((("compute", compute, "tab:blue"),
                                                   ("communication", communication, "tab:orange"))):
            y = 2 * (len(traces) - 1 - rank) + (1 - row)
            axes.broken_barh([((s - start) * 1e3, (e - s) * 1e3) for s, e in bars], (y + 0.1, 0.8), color=color)
            labels.append((y + 0.5, f"rank {rank} {what}"))
    axes.set_yticks([y for y, _ in labels], [label for _, label in labels])
    axes.set_xlabel("ms from the step's first op")
    axes.set_title(title)
    figure.tight_layout()
    return figure
