"""Figures the notebooks share (matplotlib: static PNGs that read well on GitHub and in CI)."""

import math

import matplotlib.pyplot as plt


def loss_curves(curves: dict[str, list[float]], *, highlight: str | None = None, floor: float | None = None,
                vocab_size: int | None = None, title: str = "training loss"):
    """One line per curve (label → losses); ``highlight`` drawn bold, the others grey."""
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    for label, losses in curves.items():
        bold = highlight is None or label == highlight
        ax.plot(losses, label=label, lw=2.2 if bold else 1.0, color=None if bold else "0.75", zorder=3 if bold else 2)
    if vocab_size:
        ax.axhline(math.log(vocab_size), ls=":", color="tab:red", lw=1)
        ax.annotate(f"guessing: ln {vocab_size} = {math.log(vocab_size):.2f}", (0, math.log(vocab_size)),
                    xytext=(4, 4), textcoords="offset points", color="tab:red", fontsize=8)
    if floor is not None:
        ax.axhline(floor, ls=":", color="tab:green", lw=1)
    ax.set(xlabel="step", ylabel="loss (nats per token)", title=title, ylim=(0, None))
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig
