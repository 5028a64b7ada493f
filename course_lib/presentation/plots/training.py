"""Figures for the training step and its memory (notebooks 00 and 01): loss curves, memory stacks."""

import math

import matplotlib.pyplot as plt

from .readable import amount, byte_unit, settle, unit_label

# tab10 without its red and green, which mark the guessing loss and the floor
CURVE_COLORS = ("tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")


def loss_curves(curves: dict[str, list[float]], *, highlight: str | None = None, floor: float | None = None,
                vocab_size: int | None = None, title: str = "training loss"):
    """One line per curve (label → losses), each in its own colour (in the order given, so a curve keeps its
    colour as more are added) and named in the legend; ``highlight`` drawn thick and on top, the others thin."""
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    colors = CURVE_COLORS
    for i, (label, losses) in enumerate(curves.items()):
        bold = highlight is None or label == highlight
        ax.plot(losses, label=label, lw=2.4 if bold else 1.2, color=colors[i % len(colors)], alpha=1.0 if bold else 0.75,
                zorder=3 if bold else 2)
    if vocab_size:
        ax.axhline(math.log(vocab_size), ls=":", color="tab:red", lw=1)
        ax.annotate(f"guessing: ln {vocab_size} = {math.log(vocab_size):.2f}", (0, math.log(vocab_size)),
                    xytext=(4, 4), textcoords="offset points", color="tab:red", fontsize=8, zorder=4,
                    bbox=dict(boxstyle="round,pad=0.1", facecolor="white", edgecolor="none", alpha=0.8))
    if floor is not None:
        ax.axhline(floor, ls=":", color="tab:green", lw=1)
    ax.set(xlabel="step", ylabel="loss (nats per token)", title=title, ylim=(0, None))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    settle(fig, ax)
    return fig


MEMORY_COLORS = {"weights": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green",
                 "activations": "tab:red", "reserve": "tab:gray"}   # reserve: kept free (course_lib.recipes)


def memory_bars(rows: dict[str, dict[str, int]], *, capacity_bytes: int | None = None,
                capacity_label: str = "GPU memory", title: str = "training memory per GPU"):
    """One horizontal stacked bar per row (label → {part: bytes}), in the unit that suits the largest total
    (:func:`byte_unit`), with a dashed capacity line named inside the frame.

    Parts are drawn in the order weights, grads, optimizer, activations (those present); a row's total is
    written at its end, red when it does not fit under ``capacity_bytes``. A card more than
    ``FAR_CAPACITY`` times the largest total would squash every bar to nothing: it is named in words instead.
    """
    labels = list(rows)[::-1]                              # first row on top
    totals = [sum(rows[label].get(part, 0) for part in MEMORY_COLORS) for label in labels]
    unit, scale = byte_unit(max(totals))
    fig, ax = plt.subplots(figsize=(7.6, 1.1 + 0.55 * len(rows)))
    for y, label in enumerate(labels):
        left = 0.0
        for part, color in MEMORY_COLORS.items():
            if part in rows[label]:
                width = rows[label][part] / scale
                ax.barh(y, width, left=left, color=color, height=0.6, label=part if y == 0 else None)
                left += width
        fits = capacity_bytes is None or totals[y] <= capacity_bytes
        ax.annotate(f"{amount(left)} {unit}", (left, y), xytext=(4, 0), textcoords="offset points", va="center",
                    fontsize=8, color="black" if fits else "tab:red")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set(xlabel=unit_label(unit, scale), xlim=(0, max(totals) / scale * 1.15), ylim=(-0.5, len(labels) - 0.5))
    if capacity_bytes is not None:
        capacity_line(ax, capacity_bytes, capacity_label, max(totals), unit, scale, top=len(labels) - 0.5)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    settle(fig, ax)
    return fig


FAR_CAPACITY = 4


def capacity_line(ax, capacity_bytes: int, label: str, largest_bytes: int, unit: str, scale: int, *, top: float):
    """A card's capacity on a horizontal bar chart whose rows end at y = ``top``: a dashed line with its name
    just inside the frame, beside the line on the side with more room; or, when the card is more than
    ``FAR_CAPACITY`` times the largest bar, a note at the top right, so the bars keep their size."""
    ax.set_ylim(ax.get_ylim()[0], top + 0.45)              # a strip above the top bar for the name
    if capacity_bytes > FAR_CAPACITY * largest_bytes:
        card_unit, card_scale = byte_unit(capacity_bytes)
        size = "" if card_unit in label else f" ({amount(capacity_bytes / card_scale)} {card_unit})"
        ax.annotate(f"{label}{size}: far to the right, everything fits",
                    (1, 1), xycoords="axes fraction", xytext=(-4, -4), textcoords="offset points", ha="right",
                    va="top", fontsize=8)
        return
    x = capacity_bytes / scale
    ax.axvline(x, ls="--", color="black", lw=1)
    ax.set_xlim(0, max(ax.get_xlim()[1], x * 1.1))
    left_of_line = x > sum(ax.get_xlim()) / 2
    ax.annotate(label, (x, top + 0.45), xytext=(-4 if left_of_line else 4, -3), textcoords="offset points",
                ha="right" if left_of_line else "left", va="top", fontsize=8)


def predicted_vs_measured(panels: dict[str, tuple[list, list, list]], *, ylabel: str = "KiB (2**10 bytes)",
                          scale: float = 2**10, title: str | None = None):
    """One panel per swept quantity (name → (x values, predicted, measured)): the prediction as a line,
    the measurements as dots on it."""
    fig, axes = plt.subplots(1, len(panels), figsize=(2.6 * len(panels), 2.8), sharey=False, squeeze=False)
    axes = axes[0]                                   # one row; an array even for one panel
    for ax, (name, (xs, predicted, measured)) in zip(axes, panels.items()):
        ax.plot(xs, [p / scale for p in predicted], "-", color="0.6", lw=2, label="predicted")
        ax.plot(xs, [m / scale for m in measured], "o", color="tab:red", ms=5, label="measured")
        ax.set(xlabel=name, ylim=(0, None))
        ax.tick_params(labelsize=8)
    axes[0].set_ylabel(ylabel)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
