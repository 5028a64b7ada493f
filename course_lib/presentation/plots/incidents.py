"""Notebook 11's figures: every rank's profiler trace as one timeline, computation and communication apart; the
gradients' magnitudes against fp16's smallest numbers."""

import matplotlib.pyplot as plt
import torch

from ...traces import intervals


def trace_timeline(traces: list[dict], title: str = "one DDP step, from each rank's torch.profiler trace", ax=None):
    """Two rows per rank: the ops of its main thread (compute) and the backend's transfers (communication), in ms
    from the first op of any rank; on ``ax`` if given (a new figure otherwise). Returns the figure."""
    spans = [intervals(trace) for trace in traces]
    start = min(compute[0][0] for _, compute in spans)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.9 + 0.8 * len(traces)))
    figure, axes = ax.figure, ax
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


def gradient_magnitudes(gradients: dict[str, torch.Tensor], title: str = "step 0's gradient entries, by size"):
    """A histogram of log2 |g| per gradient (label → a vector; zeros counted in a bar of their own at the left),
    with fp16's smallest normal (2^-14) and smallest subnormal (2^-24) marked: what lies left of the subnormal's
    half rounds to zero in fp16. Returns the figure."""
    figure, axes = plt.subplots(figsize=(8, 3.2))
    low = -40
    bins = list(range(low - 1, 4))
    for label, gradient in gradients.items():
        exponents = torch.where(gradient == 0, torch.full_like(gradient, low - 0.5),
                                gradient.abs().clamp_min(2.0 ** low).log2()).double()
        axes.hist(exponents.numpy(), bins=bins, alpha=0.6, label=label)
    for exponent, name in ((-14, "fp16's smallest normal"), (-24, "smallest subnormal")):
        axes.axvline(exponent, color="black", ls=":", lw=1)
        axes.annotate(name, (exponent, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                      textcoords="offset points", fontsize=8)
    axes.set_xticks([low - 0.5, *range(low + 5, 4, 5)], ["exactly 0", *(f"2^{e}" for e in range(low + 5, 4, 5))])
    axes.set(xlabel="|gradient| (log scale)", ylabel="entries", title=title)
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure
