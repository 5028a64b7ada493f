"""Figures for tensor parallelism (notebook 04): how a matmul splits, and when TP pays."""


import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from .readable import settle

RANK_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red")


def matmul_split(world_size: int = 2):
    """Y = X·W split two ways over ``world_size`` ranks, one colour per rank: by columns of W (each rank
    makes whole columns of Y: concatenate) and by rows of W (each rank makes a partial Y: sum them)."""

    if not 1 <= world_size <= len(RANK_COLORS):
        raise ValueError(f"world_size={world_size}: the picture has a colour for 1 to {len(RANK_COLORS)} ranks")
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 2.9))
    p, colors = world_size, RANK_COLORS

    def block(ax, x, y, w, h, color="0.85", label=None, hatch=None):
        ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", lw=0.8, alpha=0.85, hatch=hatch))
        if label:
            ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=8)

    # by columns: X (4 × 3) · W (3 × 4) = Y (4 × 4), W and Y cut into p strips of columns
    ax = axes[0]
    block(ax, 0, 0, 3, 4, label="X\n(whole,\nevery rank)")
    ax.text(3.5, 2, "·", fontsize=16, ha="center", va="center")
    for i in range(p):
        block(ax, 4 + i * 4 / p, 0.5, 4 / p, 3, colors[i], f"W{i}")
        block(ax, 10 + i * 4 / p, 0, 4 / p, 4, colors[i], f"Y{i}\n=XW{i}" if p <= 2 else f"Y{i}")
    ax.text(9, 2, "=", fontsize=14, ha="center", va="center")
    ax.set_title("by columns: rank i keeps columns W_i → Y = [Y0 | Y1 | …] (concatenate)", fontsize=9)
    # by rows: X cut into p strips of columns (features), W into p strips of rows; each product is a whole-size
    # partial Y, and the partials add up
    ax = axes[1]
    for i in range(p):
        block(ax, i * 3 / p, 0, 3 / p, 4, colors[i], f"X{i}")
        block(ax, 4, 3.5 - (i + 1) * 3 / p, 3, 3 / p, colors[i], f"W{i}")
    ax.text(3.5, 2, "·", fontsize=16, ha="center", va="center")
    ax.text(7.6, 2, "=", fontsize=14, ha="center", va="center")
    for i in range(p):
        block(ax, 8.2 + i * 0.35, -0.1 * i, 4, 4, colors[i])
    terms = [f"X{i}W{i}" for i in range(p)]
    total = " +\n".join(" + ".join(terms[i:i + 2]) for i in range(0, p, 2))
    ax.text(10.2 + (p - 1) * 0.35, 2 - 0.1 * (p - 1), f"Y =\n{total}\n(rank i: term i,\nfull size)", ha="center",
            va="center", fontsize=7)
    ax.set_title("by rows: rank i keeps rows W_i, reads X_i → Y = Σ X_i W_i (all-reduce)", fontsize=9)
    for ax in axes:
        ax.set(xlim=(-0.3, 14.6), ylim=(-0.6, 4.3), aspect="equal")
        ax.axis("off")
    fig.tight_layout()
    return fig


def speed_words(tp_seconds: float, one_rank_seconds: float) -> tuple[str, str]:
    """How TP's step time compares with one rank's, in words and a colour: "2.3× slower" (red), "1.6× faster"
    (green), or "same speed" (grey) when the ratio of the longer time to the shorter rounds to 1.0."""
    ratio = max(tp_seconds, one_rank_seconds) / min(tp_seconds, one_rank_seconds)
    if f"{ratio:.1f}" == "1.0":
        return "same speed", "0.35"
    return (f"{ratio:.1f}× slower", "tab:red") if tp_seconds > one_rank_seconds else (f"{ratio:.1f}× faster",
                                                                                      "tab:green")


def tp_speed(rows: list[dict], *, highlight: tuple | None = None, title: str | None = None):
    """Measured step time (forward + backward) against model width: one rank, and TP over p ranks with the
    part spent in all-reduces shaded; beside each TP point, its speed against the one-rank run measured with
    it (:func:`speed_words`). ``rows``: dicts with hidden, tp, one_rank_s, tp_s, comm_s."""
    fig, ax = plt.subplots(figsize=(6.6, 3.6))
    one = {}                                  # width → one rank's time (the fastest, if measured more than once)
    for r in rows:
        one[r["hidden"]] = min(one.get(r["hidden"], float("inf")), r["one_rank_s"])
    widths = sorted(one)
    ax.plot(widths, [one[h] * 1e3 for h in widths], "o-", color="black", lw=2, label="1 rank, whole model")
    for k, tp in enumerate(sorted({r["tp"] for r in rows})):
        mine = sorted((r["hidden"], r["tp_s"], r["comm_s"], r["one_rank_s"]) for r in rows if r["tp"] == tp)
        xs = [h for h, *_ in mine]
        color = RANK_COLORS[(k + 1) % len(RANK_COLORS)]
        ax.plot(xs, [t * 1e3 for _, t, _, _ in mine], "s-", color=color, lw=2, label=f"TP={tp}: step")
        ax.plot(xs, [c * 1e3 for _, _, c, _ in mine], "s:", color=color, lw=1, label=f"TP={tp}: of it, all-reduce")
        for h, t, _, one_rank in mine:       # against the one-rank run measured beside it
            words, word_color = speed_words(t, one_rank)
            # on the side away from the one-rank point (above when TP is slower, below when faster), on a
            # white card drawn over the lines, so no line crosses the words
            above = t >= one_rank
            ax.annotate(words, (h, t * 1e3), xytext=(0, 8 if above else -8), textcoords="offset points",
                        ha="center", va="bottom" if above else "top", fontsize=8.5, color=word_color, zorder=5,
                        bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.85))
    if highlight is not None:
        ax.axvline(highlight[0], color="0.7", lw=6, alpha=0.4, zorder=0)
    ax.set(xscale="log", yscale="log", xlabel="hidden size (model width)", ylabel="ms per forward + backward")
    ax.set_xticks(widths, [str(h) for h in widths])
    ax.minorticks_off()
    ax.set_title(title or "TP against one rank, measured: the words say how fast TP's step is", fontsize=10)
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    settle(fig, ax)
    return fig
