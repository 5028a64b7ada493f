"""Figures for ZeRO and FSDP (notebook 03): bytes per rank, bytes on the wire, memory over a step."""


import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from .readable import amount, byte_unit, plural, settle
from .training import MEMORY_COLORS, capacity_line

ZERO_STAGE_NAMES = {0: "stage 0 (DDP)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}

WIRE_COLORS = {"all_reduce": "tab:purple", "reduce_scatter": "tab:olive", "all_gather": "tab:cyan"}


def zero_per_rank_bars(measured: dict[int, dict[int, list[dict]]], predicted: dict[int, dict[int, int]], *,
                       unit: tuple[str, int] = ("KiB", 2**10), title: str | None = None):
    """Per-rank training state, one panel per (ranks, stage): a stacked bar per rank (weights, grads,
    optimizer) from ``measured[ranks][stage]`` (one dict per rank), and the formula's total
    ``predicted[ranks][stage]`` as a dashed line. Rows: numbers of ranks; columns: stages."""
    name, scale = unit
    rows = sorted(measured)
    fig, axes = plt.subplots(len(rows), 4, figsize=(9.6, 1.0 + 2.0 * len(rows)), sharey=True, squeeze=False)
    for i, ranks in enumerate(rows):
        for stage, ax in enumerate(axes[i]):
            per_rank = measured[ranks][stage]
            for r, state in enumerate(per_rank):
                bottom = 0.0
                for part in ("weights", "grads", "optimizer"):
                    height = state[part] / scale
                    ax.bar(r, height, bottom=bottom, color=MEMORY_COLORS[part], width=0.7,
                           label=part if (i, stage, r) == (0, 0, 0) else None)
                    bottom += height
            line = predicted[ranks][stage] / scale
            ax.axhline(line, ls="--", color="black", lw=1)
            ax.annotate(f"formula {line:,.0f}", (len(per_rank) - 0.5, line), xytext=(0, 3),
                        textcoords="offset points", ha="right", fontsize=7)
            ax.set_xticks(range(len(per_rank)), [f"r{r}" for r in range(len(per_rank))], fontsize=7)
            ax.tick_params(axis="y", labelsize=7)
            ax.set_xlim(-0.6, len(per_rank) - 0.4)
            ax.set_title(f"{ZERO_STAGE_NAMES[stage]}, {plural(ranks, 'rank')}", fontsize=8)
        axes[i, 0].set_ylabel(f"{name} per rank", fontsize=8)
    highest = max(max(predicted[n].values()) for n in rows) / scale
    axes[0, 0].set_ylim(0, highest * 1.2)              # shared by every panel: room for "formula" above the line
    fig.legend(fontsize=8, loc="lower center", ncol=3, frameon=False)
    fig.suptitle(title or "training state per rank, measured (bars) and predicted (line)", fontsize=10, x=0.02,
                 ha="left")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def zero_wire_bytes(rows: dict[str, dict[str, float]], *, counted: dict[str, float] | None = None,
                    unit: tuple[str, int] = ("KiB", 2**10), title: str = "bytes each rank sends per step"):
    """A horizontal bar per setup (label → {op: bytes}), stacked by collective, with its ratio to the first
    row written in the bar's end; ``counted`` (label → bytes) adds the kernel's count as a black diamond, with
    ITS ratio to the first row's count beside it. Each ratio is the ratio of what it is written on: on gloo
    the two differ (its reduce-scatter sends what an all-reduce sends)."""
    name, scale = unit
    labels = list(rows)
    traced_base = sum(rows[labels[0]].values())
    counted = {label: count for label, count in (counted or {}).items() if count is not None}
    counted_base = counted.get(labels[0])
    fig, ax = plt.subplots(figsize=(8.4, 1.0 + 0.45 * len(labels)))
    card = dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.85)
    for y, label in enumerate(labels[::-1]):
        left = 0.0
        for op, color in WIRE_COLORS.items():
            width = rows[label].get(op, 0.0) / scale
            if width:
                ax.barh(y, width, left=left, color=color, height=0.6, label=op.replace("_", "-"))
                left += width
        traced = f"{left * scale / traced_base:.2f}×"
        if label not in counted:                        # only the traced bytes: the ratio after the bar
            ax.annotate(traced, (left, y), xytext=(5, 0), textcoords="offset points", va="center", fontsize=8)
            continue
        ax.annotate(traced, (left, y), xytext=(-3, 0), textcoords="offset points", ha="right", va="center",
                    fontsize=8, bbox=card, zorder=4)
        ax.plot(counted[label] / scale, y, "D", color="black", ms=5, label="counted by the kernel (gloo)")
        if counted_base:
            ax.annotate(f"{counted[label] / counted_base:.2f}×", (counted[label] / scale, y), xytext=(6, 0),
                        textcoords="offset points", va="center", fontsize=8, weight="bold")
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_yticks(range(len(labels)), labels[::-1], fontsize=8)
    ratios = f"; × {labels[0]}: in the bar, traced; beside ◆, counted" if counted else f", × {labels[0]}"
    ax.set_xlabel(f"{name} per rank per step{ratios}", fontsize=9)
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.08)
    settle(fig, ax)
    return fig


def zero_memory_trace(trace: list[dict], *, shard_bytes: int | None = None,
                      unit: tuple[str, int] = ("KiB", 2**10), title: str = "one ZeRO-3 step on one rank"):
    """Weights (top) and gradients (bottom) one rank holds over a step (ZeroDataParallel.memory_trace: bytes
    counted at every gather, free and reduce), as steps in time; each gather is labelled with its unit."""
    name, scale = unit
    t0 = trace[0]["time"]
    ms = [(e["time"] - t0) * 1e3 for e in trace]
    fig, axes = plt.subplots(2, 1, figsize=(8.0, 4.4), sharex=True)
    backward = next((t for t, e in zip(ms, trace) if e["event"] == "gather (backward)"), None)
    for ax, part in zip(axes, ("weights", "grads")):
        values = [e[part] / scale for e in trace]
        ax.step(ms, values, where="post", color=MEMORY_COLORS[part], lw=1.8)
        top = max(values)
        if shard_bytes is not None:
            ax.axhline(shard_bytes / scale, ls=":", color="0.4", lw=1)
            ax.annotate("this rank's shard only", (ms[-1], shard_bytes / scale), xytext=(0, -10),
                        textcoords="offset points", ha="right", fontsize=7, color="0.3")
        if backward is not None:
            ax.axvspan(0, backward, color="tab:blue", alpha=0.05)
            ax.axvspan(backward, ms[-1], color="tab:green", alpha=0.05)
        ax.set(ylabel=f"{part}, {name}", ylim=(0, max(top, 1e-9) * 1.3))   # (an all-zero series: still a range)
        ax.yaxis.label.set_fontsize(8)
        ax.tick_params(labelsize=8)
    for t, e in zip(ms, trace):
        if e["event"].startswith("gather"):
            axes[0].annotate(e["unit"], (t, e["weights"] / scale), xytext=(1, 2), textcoords="offset points",
                             fontsize=6, rotation=90, va="bottom")
    if backward is not None:
        axes[0].annotate("forward", (0, 0), xytext=(2, 3), textcoords="offset points", fontsize=8, color="tab:blue")
        axes[0].annotate("backward", (backward, 0), xytext=(2, 3), textcoords="offset points", fontsize=8,
                         color="tab:green")
    axes[1].set_xlabel("milliseconds since the step began")
    axes[0].set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def zero_explorer_figure(memory: dict[str, dict[str, int]], wire: dict[str, float], *, highlight: str,
                         capacity_bytes: int | None = None, capacity_label: str = "GPU memory", title: str = ""):
    """Two panels for the ZeRO explorer: per-rank training state by stage (stacked) against a card's
    capacity, and bytes each rank sends per step by stage; ``highlight`` in full colour. Each panel picks its
    unit from its largest number (:func:`byte_unit`): a tiny model reads in KiB or MiB, Llama in GiB."""
    labels = list(memory)[::-1]
    state_bytes = {label: sum(memory[label][part] for part in ("weights", "grads", "optimizer")) for label in labels}
    state_unit, state_scale = byte_unit(max(state_bytes.values()))
    wire_unit, wire_scale = byte_unit(max(max(wire.values()), 1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 1.2 + 0.5 * len(labels)),
                                      gridspec_kw={"width_ratios": [3, 2]})
    for y, label in enumerate(labels):
        alpha, x = (1.0 if label == highlight else 0.35), 0.0
        for part in ("weights", "grads", "optimizer"):
            width = memory[label][part] / state_scale
            left.barh(y, width, left=x, color=MEMORY_COLORS[part], height=0.6, alpha=alpha)
            x += width
        fits = capacity_bytes is None or state_bytes[label] <= capacity_bytes
        left.annotate(amount(x), (x, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8,
                      color="black" if fits else "tab:red")
        sent = wire[label] / wire_scale
        right.barh(y, sent, color="tab:purple", height=0.6, alpha=alpha)
        right.annotate(amount(sent), (sent, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    left.set(xlim=(0, max(state_bytes.values()) / state_scale * 1.15), ylim=(-0.5, len(labels) - 0.5))
    if capacity_bytes is not None:
        capacity_line(left, capacity_bytes, capacity_label, max(state_bytes.values()), state_unit, state_scale,
                      top=len(labels) - 0.5)
    right.set(xlim=(0, max(wire.values()) / wire_scale * 1.2 or 1), ylim=left.get_ylim())
    if not any(wire.values()):                          # one rank: no one to send to
        right.text(0.5, 0.5, "one rank: nothing to send", transform=right.transAxes, ha="center", fontsize=9)
    left.set_yticks(range(len(labels)), labels, fontsize=8)
    right.set_yticks(range(len(labels)), [""] * len(labels))
    left.set_xlabel(f"{state_unit} of training state per rank")
    right.set_xlabel(f"{wire_unit} each rank sends per step")
    fig.legend([Rectangle((0, 0), 1, 1, color=MEMORY_COLORS[part]) for part in ("weights", "grads", "optimizer")],
               ["weights", "grads", "optimizer"], fontsize=8, loc="lower left", ncol=3, frameon=False)
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    settle(fig, left, right, tight_layout_rect=(0, 0.3 / fig.get_figheight(), 1, 1))   # room for the legend
    return fig
