"""Figures the notebooks share (matplotlib: static PNGs that read well on GitHub and in CI)."""

import math

import matplotlib.patches as patches
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from .pipeline_parallel import bubble_fraction


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


# ---- 01 · the memory ledger ---------------------------------------------------------------------------

MEMORY_COLORS = {"weights": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green",
                 "activations": "tab:red"}


def memory_bars(rows: dict[str, dict[str, int]], *, capacity_bytes: int | None = None,
                capacity_label: str = "GPU memory", title: str = "training memory per GPU"):
    """One horizontal stacked bar per row (label → {part: bytes}), in GiB, with a dashed capacity line.

    Parts are drawn in the order weights, grads, optimizer, activations (those present); a row's total is
    written at its end, red when it does not fit under ``capacity_bytes``.
    """
    gib = 2**30
    fig, ax = plt.subplots(figsize=(7.6, 1.1 + 0.55 * len(rows)))
    labels = list(rows)[::-1]                              # first row on top
    totals = [sum(rows[label].get(part, 0) for part in MEMORY_COLORS) / gib for label in labels]
    for y, label in enumerate(labels):
        left = 0.0
        for part, color in MEMORY_COLORS.items():
            if part in rows[label]:
                width = rows[label][part] / gib
                ax.barh(y, width, left=left, color=color, height=0.6, label=part if y == 0 else None)
                left += width
        fits = capacity_bytes is None or left * gib <= capacity_bytes
        ax.annotate(f"{left:,.1f} GiB", (left, y), xytext=(4, 0), textcoords="offset points", va="center",
                    fontsize=8, color="black" if fits else "tab:red")
    top = len(labels) - 0.15                               # room above the top bar for the capacity label
    right = max(totals + [capacity_bytes / gib if capacity_bytes else 0]) * 1.22   # room for the totals
    if capacity_bytes is not None:
        ax.axvline(capacity_bytes / gib, ls="--", color="black", lw=1)
        ax.annotate(f"{capacity_label} ", (capacity_bytes / gib, top), va="top", ha="right", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set(xlabel="GiB (2**30 bytes)", xlim=(0, right), ylim=(-0.5, top))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    return fig


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


# ---- 05 · pipeline parallelism ------------------------------------------------------------------------

PIPELINE_COLORS = {"F": "tab:blue", "B": "tab:green"}


def pipeline_gantt(timeline, *, title: str | None = None, ax=None, in_flight: bool = False):
    """A Gantt chart of a pipeline_parallel.Timeline: one row per rank (stage 0 on top), a bar per forward
    (blue) and backward (green) labelled with its micro-batch, idle time light grey, each rank's measured idle
    fraction on the right. ``in_flight``: a second panel with the micro-batches each rank holds over time."""
    rows = 2 if in_flight else 1
    if ax is None:
        fig, axes = plt.subplots(rows, 1, figsize=(8.0, 0.45 * timeline.num_stages + 1.3 + 1.6 * (rows - 1)),
                                 sharex=True, squeeze=False, gridspec_kw={"height_ratios": [1.4, 1][:rows]})
        ax = axes[0, 0]
    else:
        fig, axes = ax.figure, None
    t0 = min(e.start for e in timeline.events)
    span = timeline.makespan * 1e3
    for rank in range(timeline.num_stages):
        ax.barh(rank, span, left=0, height=0.7, color="0.93", lw=0)     # idle unless an op covers it
        ax.annotate(f"idle {timeline.idle_fraction(rank):.0%}", (span, rank), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=8)
    for e in timeline.events:
        start, width = (e.start - t0) * 1e3, (e.end - e.start) * 1e3
        ax.barh(e.rank, width, left=start, height=0.7, color=PIPELINE_COLORS[e.kind], alpha=0.85,
                edgecolor="white", lw=0.5)
        if width > span / 60:
            ax.text(start + width / 2, e.rank, str(e.microbatch), ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_yticks(range(timeline.num_stages), [f"stage {r}" for r in range(timeline.num_stages)], fontsize=8)
    ax.set_ylim(timeline.num_stages - 0.5, -0.5)
    ax.set_xlim(0, span * 1.14)   # room for the idle fractions
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.85) for c in PIPELINE_COLORS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="0.93"))
    ax.legend(handles, ["forward", "backward", "idle"], fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              frameon=False)
    ax.set_title(title or f"p = {timeline.num_stages} stages, m = {timeline.num_microbatches} micro-batches: "
                          f"bubble {timeline.bubble:.1%}", fontsize=10, loc="left")
    if in_flight and axes is not None:
        low = axes[1, 0]
        for rank, samples in sorted(timeline.in_flight.items()):
            low.step([(t - t0) * 1e3 for t, _, _ in samples], [count for _, count, _ in samples], where="post",
                     label=f"stage {rank}")
        low.set(ylabel="micro-batches\nin flight", ylim=(0, None))
        low.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    (axes[-1, 0] if axes is not None else ax).set_xlabel("time (ms)")
    fig.tight_layout()
    return fig


# ---- 04 · tensor parallelism --------------------------------------------------------------------------

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


def tp_speed(rows: list[dict], *, highlight: tuple | None = None, title: str | None = None):
    """Measured step time (forward + backward) against model width: one rank, and TP over p ranks with the
    part spent in all-reduces shaded. ``rows``: dicts with hidden, tp, one_rank_s, tp_s, comm_s."""
    fig, ax = plt.subplots(figsize=(6.6, 3.4))
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
            ratio = t / one_rank
            ax.annotate(f"{ratio:.1f}×", (h, t * 1e3), xytext=(4, 4), textcoords="offset points", fontsize=7,
                        color="tab:red" if ratio > 1 else "tab:green")
    if highlight is not None:
        ax.axvline(highlight[0], color="0.7", lw=6, alpha=0.4, zorder=0)
    ax.set(xscale="log", yscale="log", xlabel="hidden size (model width)", ylabel="ms per forward + backward")
    bottom, top = ax.get_ylim()
    ax.set_ylim(bottom, top * 1.6)    # room for the ratio labels above the highest point
    ax.set_xticks(widths, [str(h) for h in widths])
    ax.minorticks_off()
    ax.set_title(title or "TP vs one rank, measured (ratio TP / 1 rank: red = TP slower)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


# ---- 02 · data parallelism ----------------------------------------------------------------------------

def ring_all_reduce_steps(snapshots_by_rank: list[list], *, title: str = "ring all-reduce, step by step"):
    """One picture per step of ``ddp.ring_all_reduce``: a rank × chunk grid whose cells say whose data each
    chunk holds. Rank r must start with 2**r in every element, so a chunk's value is the set of ranks summed
    into it, written as bits. Cells that changed in the step (received from the left neighbour) are outlined."""
    p = len(snapshots_by_rank)
    states = [[[2.0**r] * p for r in range(p)]]                # before: every rank holds only its own data
    labels = ["start: rank r holds g_r"]
    for i, (phase, step, _) in enumerate(snapshots_by_rank[0]):
        states.append([snapshots_by_rank[r][i][2] for r in range(p)])
        labels.append(f"{phase} {step + 1}/{p - 1}")
    cols = max(2, p)
    rows = -(-len(states) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.1 * cols, 2.1 * rows), squeeze=False)
    for ax in axes.flat[len(states):]:
        ax.axis("off")
    cmap = plt.get_cmap("Blues")
    for k, (ax, state, label) in enumerate(zip(axes.flat, states, labels)):
        for r in range(p):
            for c in range(p):
                members = [q for q in range(p) if int(state[r][c]) >> q & 1]
                ax.add_patch(patches.Rectangle((c, p - 1 - r), 1, 1, facecolor=cmap(0.15 + 0.75 * len(members) / p),
                                               edgecolor="white", lw=1))
                text = "Σ" if len(members) == p else "+".join(map(str, members))
                ax.text(c + 0.5, p - 0.5 - r, text, ha="center", va="center", fontsize=8 if p <= 4 else 6,
                        color="white" if len(members) > p / 2 else "black")
                if k and state[r][c] != states[k - 1][r][c]:   # arrived this step from rank r-1
                    ax.add_patch(patches.Rectangle((c + 0.04, p - 0.96 - r), 0.92, 0.92, fill=False,
                                                   edgecolor="tab:red", lw=2))
        ax.set(xlim=(0, p), ylim=(0, p), aspect="equal", title=label)
        ax.title.set_fontsize(9)
        ax.set_xticks([c + 0.5 for c in range(p)], [f"c{c}" for c in range(p)], fontsize=7)
        ax.set_yticks([p - 0.5 - r for r in range(p)], [f"rank {r}" for r in range(p)], fontsize=7)
        ax.tick_params(length=0)
    fig.suptitle(f"{title}: rows are ranks, columns the {p} chunks; a red box arrived from the rank above "
                 "(rank 0 from the last)", fontsize=9)
    fig.tight_layout()
    return fig


def replica_drift(curves: dict[str, list[float]], *, title: str = "how far apart are the replicas?"):
    """Largest weight difference between ranks after each step, one line per setup."""
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    for label, spreads in curves.items():
        ax.plot(range(1, len(spreads) + 1), spreads, "o-", ms=4, label=label)
    ax.set(xlabel="optimizer step", ylabel="max |w_rank0 − w_rank1|", title=title, ylim=(0, None))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


DDP_PHASE_COLORS = {"compute": "tab:blue", "exposed communication": "tab:red", "optimizer": "tab:green"}


def step_time_split(rows: dict[str, dict[str, float]], *, highlight: str | None = None,
                    title: str = "where a step's time goes"):
    """One horizontal stacked bar per setup (label → {phase: seconds}), in milliseconds."""
    fig, ax = plt.subplots(figsize=(6.4, 0.9 + 0.42 * len(rows)))
    labels = list(rows)[::-1]
    for y, label in enumerate(labels):
        left = 0.0
        for phase, color in DDP_PHASE_COLORS.items():
            width = rows[label].get(phase, 0.0) * 1e3
            ax.barh(y, width, left=left, color=color, height=0.6, label=phase if y == 0 else None,
                    alpha=1.0 if highlight in (None, label) else 0.45)
            left += width
        ax.annotate(f"{left:.1f} ms", (left, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set(xlabel="milliseconds per step (median)", title=title)
    ax.title.set_fontsize(10)
    ax.margins(x=0.15)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def ddp_timeline(steps_by_rank: list[dict], *, title: str = "one training step, per rank"):
    """Per rank, two lanes of one step (records of ``ddp.train_step`` with a "bucket_log" of all-reduces):
    compute (forward + backward), the wait for communication, and the optimizer; below, each all-reduce from
    when it was issued to when it finished. Times in ms from the first rank's start (one clock per machine)."""
    t0 = min(step["start"] for step in steps_by_rank)
    ms = lambda t: (t - t0) * 1e3                                          # noqa: E731
    fig, ax = plt.subplots(figsize=(7.6, 0.8 + 1.0 * len(steps_by_rank)))
    for r, step in enumerate(steps_by_rank):
        y = -r
        phases = [("compute", step["start"], step["backward"]), ("exposed communication", step["backward"],
                  step["synced"]), ("optimizer", step["synced"], step["end"])]
        for phase, begin, end in phases:
            ax.barh(y + 0.18, ms(end) - ms(begin), left=ms(begin), height=0.32, color=DDP_PHASE_COLORS[phase],
                    label=phase if r == 0 else None)
        entries = step.get("bucket_log") or []
        lane = 0.4 / max(1, len(entries))             # one thin row per all-reduce, the first on top
        for i, entry in enumerate(entries):
            done = entry.get("done", entry["issued"])
            ax.barh(y - 0.03 - lane * (i + 0.5), max(ms(done) - ms(entry["issued"]), 0.02), left=ms(entry["issued"]),
                    height=lane * 0.8, color="tab:orange",
                    label="all-reduce of one bucket (issued → done)" if r == 0 and i == 0 else None)
    ax.set_yticks([-r for r in range(len(steps_by_rank))], [f"rank {r}" for r in range(len(steps_by_rank))],
                  fontsize=8)
    ax.set(xlabel="milliseconds since the step began", title=title)
    ax.title.set_fontsize(10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
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


# ---- 03 · ZeRO and FSDP ------------------------------------------------------------------------------

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
            ax.set_title(f"{ZERO_STAGE_NAMES[stage]}, {ranks} ranks", fontsize=8)
        axes[i, 0].set_ylabel(f"{name} per rank", fontsize=8)
    fig.legend(fontsize=8, loc="lower center", ncol=3, frameon=False)
    fig.suptitle(title or "training state per rank, measured (bars) and predicted (line)", fontsize=10, x=0.02,
                 ha="left")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def zero_wire_bytes(rows: dict[str, dict[str, float]], *, counted: dict[str, float] | None = None,
                    unit: tuple[str, int] = ("KiB", 2**10), title: str = "bytes each rank sends per step"):
    """A horizontal bar per setup (label → {op: bytes}), stacked by collective, with its ratio to the first
    row written at the end; ``counted`` (label → bytes) adds the kernel's count as a black diamond."""
    name, scale = unit
    labels = list(rows)
    base = sum(rows[labels[0]].values())
    fig, ax = plt.subplots(figsize=(7.2, 0.9 + 0.45 * len(labels)))
    for y, label in enumerate(labels[::-1]):
        left = 0.0
        for op, color in WIRE_COLORS.items():
            width = rows[label].get(op, 0.0) / scale
            if width:
                ax.barh(y, width, left=left, color=color, height=0.6, label=op.replace("_", "-"))
                left += width
        end = left
        if counted and counted.get(label) is not None:
            ax.plot(counted[label] / scale, y, "D", color="black", ms=5, label="counted by the kernel (gloo)")
            end = max(end, counted[label] / scale)
        ax.annotate(f"{left * scale / base:.2f}×", (end, y), xytext=(6, 0), textcoords="offset points",
                    va="center", fontsize=8)
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_yticks(range(len(labels)), labels[::-1], fontsize=8)
    ax.set(xlabel=f"{name} per rank per step")
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.12)
    fig.tight_layout()
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
    """Two panels for the ZeRO explorer: per-rank training state by stage (stacked, GiB) against a card's
    capacity, and bytes each rank sends per step by stage (GiB); ``highlight`` in full colour."""
    gib = 2**30
    labels = list(memory)[::-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 0.9 + 0.5 * len(labels)),
                                      gridspec_kw={"width_ratios": [3, 2]})
    for y, label in enumerate(labels):
        alpha, x = (1.0 if label == highlight else 0.35), 0.0
        for part in ("weights", "grads", "optimizer"):
            width = memory[label][part] / gib
            left.barh(y, width, left=x, color=MEMORY_COLORS[part], height=0.6, alpha=alpha,
                      label=part if y == 0 else None)
            x += width
        fits = capacity_bytes is None or x * gib <= capacity_bytes
        left.annotate(f"{x:,.1f}", (x, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8,
                      color="black" if fits else "tab:red")
        right.barh(y, wire[label] / gib, color="tab:purple", height=0.6, alpha=alpha)
        right.annotate(f"{wire[label] / gib:,.1f}", (wire[label] / gib, y), xytext=(3, 0),
                       textcoords="offset points", va="center", fontsize=8)
    if capacity_bytes is not None:
        left.axvline(capacity_bytes / gib, ls="--", color="black", lw=1)
        left.annotate(capacity_label, (capacity_bytes / gib, len(labels) - 0.45), ha="right", fontsize=7)
    left.set_yticks(range(len(labels)), labels, fontsize=8)
    right.set_yticks(range(len(labels)), [""] * len(labels))
    left.set(xlabel="GiB of training state per rank", ylim=(-0.5, len(labels) - 0.2))
    right.set(xlabel="GiB each rank sends per step", ylim=(-0.5, len(labels) - 0.2))
    left.margins(x=0.15)
    right.margins(x=0.2)
    left.legend(fontsize=7, loc="lower right", frameon=False)
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout()
    return fig


def mesh_layout(mesh, *, gpus_per_node: int = 4, title: str | None = None):
    """The ranks of a dp × tp × pp mesh as GPUs in nodes: one row per node, colour = pipeline stage, each box
    labelled with its rank and (pp, dp, tp); a bracket under each TP group."""
    colors = plt.get_cmap("tab10").colors
    num_nodes = math.ceil(mesh.size / gpus_per_node)
    fig, ax = plt.subplots(figsize=(1.45 * gpus_per_node + 0.6, 1.15 * num_nodes + 0.5))
    for rank in range(mesh.size):
        c = mesh.coords(rank)
        node, x = divmod(rank, gpus_per_node)
        y = num_nodes - 1 - node
        ax.add_patch(plt.Rectangle((x + 0.06, y + 0.22), 0.88, 0.7, color=colors[c["pp"] % 10], alpha=0.35))
        ax.text(x + 0.5, y + 0.66, f"rank {rank}", ha="center", fontsize=9, weight="bold")
        ax.text(x + 0.5, y + 0.36, f"pp{c['pp']} dp{c['dp']} tp{c['tp']}", ha="center", fontsize=8)
    for group in mesh.groups("tp"):   # a TP group is consecutive ranks: a bracket under them
        if len(group) > 1:
            node, first = divmod(group[0], gpus_per_node)
            y = num_nodes - 1 - node + 0.14
            ax.plot([first + 0.1, first + len(group) - 0.1], [y, y], color="black", lw=2)
    for node in range(num_nodes):
        ax.text(-0.08, num_nodes - 1 - node + 0.55, f"node {node}", ha="right", va="center", fontsize=9)
    ax.set(xlim=(-1.0, gpus_per_node), ylim=(0, num_nodes), xticks=[], yticks=[])
    ax.set_frame_on(False)
    ax.set_title(title or f"dp {mesh.dp} × tp {mesh.tp} × pp {mesh.pp} on nodes of {gpus_per_node} GPUs "
                          "(colour: stage; bar: a TP group)", fontsize=10)
    fig.tight_layout()
    return fig


def bytes_per_axis(measured: list[dict], predicted: list[dict], *, title: str = "bytes each rank sends in one step"):
    """Grouped bars, one group per rank, one bar per axis (tp, pp, dp): measured, with the prediction as a tick."""
    colors = {"tp": "tab:red", "pp": "tab:blue", "dp": "tab:green"}
    fig, ax = plt.subplots(figsize=(8, 3))
    width = 0.26
    for i, axis in enumerate(colors):
        xs = [r + (i - 1) * width for r in range(len(measured))]
        ax.bar(xs, [m[axis] / 2**10 for m in measured], width, color=colors[axis], label=f"{axis} (measured)")
        ax.scatter(xs, [p[axis] / 2**10 for p in predicted], marker="_", s=180, color="black",
                   label="predicted" if i == 0 else None, zorder=3)
    ax.set_xticks(range(len(measured)), [f"rank {r}" for r in range(len(measured))], fontsize=8)
    ax.set(ylabel="KiB (2**10 bytes)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig
