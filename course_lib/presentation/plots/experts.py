"""Figures for mixture of experts (notebook 08): the load on each expert and on each EP rank, and the share of
the work dropped as the capacity factor shrinks."""

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from .readable import plural, settle

RANK_COLORS = ("tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")
DROPPED_COLOR = "tab:red"
LABEL_BOX = dict(boxstyle="round,pad=0.1", facecolor="white", edgecolor="none", alpha=0.85)
OFF_THE_TOP = 1.5     # a capacity line this many times above the busiest expert would squash every bar: say it


def expert_load(routing, *, title: str | None = None):
    """Two panels from one :class:`course_lib.expert_parallel.Routing` (T·k assignments, E experts, capacity C, ep ranks).

    Left, a bar per expert of the assignments it was asked for: the part that fits in its C slots in the colour
    of the EP rank that holds it, the part over C (dropped) in red; C dashed, the even share T·k/E dotted.
    Right, a bar per EP rank of the assignments its experts compute, and dashed the rows they compute anyway:
    (E/ep)·C slots, empty ones included, since every buffer is padded to C. The legend, under both, names them.
    """
    requested, kept, capacity, ep = (routing.requested_per_expert, routing.kept_per_expert, routing.capacity,
                                     routing.ep)
    num_experts, experts_per_rank = len(requested), len(requested) // routing.ep
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 4.0),
                                      gridspec_kw={"width_ratios": [max(num_experts, 4), max(ep, 2) + 1]})
    even = sum(requested) / num_experts
    _draw_expert_panel(left, requested, kept, capacity, experts_per_rank, even)
    slots = experts_per_rank * capacity        # rows each rank computes: C per expert, empty slots included
    _draw_rank_panel(right, routing.tokens_per_rank, slots, experts_per_rank)
    for ax in (left, right):
        ax.tick_params(axis="y", labelsize=7)
    legend_rows = _add_legend(fig, routing, slots, even)
    fig.suptitle(title or f"{sum(requested):,} assignments to {num_experts} experts of {capacity:,} slots: "
                          f"{routing.dropped:,} dropped", fontsize=10, x=0.02, ha="left")
    settle(fig, left, right, tight_layout_rect=(0, (0.25 + 0.2 * legend_rows) / fig.get_figheight(), 1, 1))
    return fig


def _draw_expert_panel(left, requested: list, kept: list, capacity: int, experts_per_rank: int, even: float) -> None:
    """The left panel: a bar per expert of the assignments it was asked for, kept (its rank's colour) under
    dropped (red); the capacity C dashed (or said in words when it is far above every bar), the even share
    T·k/E dotted."""
    num_experts = len(requested)
    for i in range(num_experts):
        left.bar(i, kept[i], color=_rank_color(i // experts_per_rank), width=0.7)
        if requested[i] > kept[i]:
            left.bar(i, requested[i] - kept[i], bottom=kept[i], color=DROPPED_COLOR, width=0.7)
        left.annotate(f"{requested[i]:,}", (i, requested[i]), xytext=(0, 2), textcoords="offset points",
                      ha="center", fontsize=7, bbox=LABEL_BOX, zorder=4)   # over the lines, not crossed by them
    busiest = max(max(requested), 1)
    left.axhline(even, ls=":", color="0.35", lw=1.2)
    if capacity <= OFF_THE_TOP * busiest:
        left.axhline(capacity, ls="--", color="black", lw=1)
        top = max(busiest, capacity)
    else:
        left.text(0.01, 0.97, f"capacity C = {capacity:,}: far above every bar", transform=left.transAxes,
                  fontsize=7, va="top")
        top = busiest
    left.set(xlim=(-0.6, num_experts - 0.4), ylim=(0, top * 1.2))
    left.set_xticks(range(num_experts), [str(i) for i in range(num_experts)], fontsize=7)
    left.set_xlabel("expert", fontsize=8)
    left.set_ylabel("assignments (token, expert)", fontsize=8)
    left.set_title(f"{plural(num_experts, 'expert')}, {sum(requested):,} assignments", fontsize=9)


def _draw_rank_panel(right, per_rank: list, slots: int, experts_per_rank: int) -> None:
    """The right panel: a bar per EP rank of the assignments its experts compute, and dashed the ``slots`` =
    (E/ep)·C rows they compute anyway."""
    ep = len(per_rank)
    for r, tokens in enumerate(per_rank):
        right.bar(r, tokens, color=_rank_color(r), width=0.6)
        right.annotate(f"{tokens:,}", (r, tokens), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7,
                       bbox=LABEL_BOX, zorder=4)
    right.axhline(slots, ls="--", color="black", lw=1)
    right.set(xlim=(-0.6, ep - 0.4), ylim=(0, max(max(per_rank), slots, 1) * 1.2))
    right.set_xticks(range(ep), [f"rank {r}" for r in range(ep)], fontsize=7)
    right.set_ylabel("assignments its experts compute", fontsize=8)
    right.set_title(f"{plural(ep, 'EP rank')}, {plural(experts_per_rank, 'expert')} each", fontsize=9)


def _add_legend(fig, routing, slots: int, even: float) -> int:
    """Name every rank's colour, the dropped part, the slots and the even share under both panels; make the
    figure taller to hold it, and return the rows of legend it made room for."""
    ep, capacity = routing.ep, routing.capacity
    # every rank named (up to 8, as many as the colours), in rows of four under both panels, inside the figure
    handles = [Rectangle((0, 0), 1, 1, color=_rank_color(r)) for r in range(ep)]
    names = [f"kept, on rank {r}" for r in range(ep)]
    if routing.dropped:
        handles.append(Rectangle((0, 0), 1, 1, color=DROPPED_COLOR))
        names.append(f"dropped: {routing.dropped:,}")
    handles += [Line2D([], [], ls="--", color="black", lw=1), Line2D([], [], ls=":", color="0.35", lw=1.2)]
    names += [f"slots: C = {capacity:,} per expert, {slots:,} per rank (computed, full or empty)",
              f"even share: {even:,.1f} per expert"]
    columns = 4
    legend_rows = -(-len(names) // columns) + 1          # the long line labels may take a row of their own
    fig.set_figheight(fig.get_figheight() + 0.2 * legend_rows)
    fig.legend(handles, names, fontsize=7, loc="lower center", ncol=columns, frameon=False)
    return legend_rows


def _rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def dropped_share(rows: list[dict], *, imbalance: float | None = None,
                  title: str = "assignments dropped as the capacity shrinks"):
    """The share of the T·k assignments dropped at each capacity factor (``rows`` as feed_forward.drops_by_capacity
    returns them), beside what perfectly even routing would drop, max(0, 1 − factor); with ``imbalance`` (the
    busiest expert's load / the mean), a line where the factor reaches it: from there on nothing is dropped."""
    factors = [row["capacity_factor"] for row in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(factors, [100 * row["dropped_share"] for row in rows], "o-", color=DROPPED_COLOR, lw=2,
            label="measured: this router on these tokens")
    ax.plot(factors, [100 * max(0.0, 1 - f) for f in factors], "--", color="0.4", lw=1,
            label="perfectly even routing: 1 − factor")
    for row in rows:
        ax.annotate(f"{row['dropped']:,}", (row["capacity_factor"], 100 * row["dropped_share"]), xytext=(4, 3),
                    textcoords="offset points", fontsize=7)
    if imbalance is not None:
        ax.axvline(imbalance, ls=":", color="black", lw=1)
        ax.annotate(f"factor = imbalance {imbalance:.2f}:\nnothing dropped from here", (imbalance, 50),
                    xytext=(4, 0), textcoords="offset points", fontsize=7, va="center")
    ax.set(xlabel="capacity factor (slots per expert / even share)", ylabel="% of assignments dropped",
           ylim=(0, 100), title=title)
    ax.title.set_fontsize(10)
    fig.legend(fontsize=7, loc="lower center", ncol=2, frameon=False)
    settle(fig, ax, tight_layout_rect=(0, 0.3 / fig.get_figheight(), 1, 1))   # room for the legend
    return fig
