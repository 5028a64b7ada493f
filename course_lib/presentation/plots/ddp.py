"""Figures for data parallelism (notebook 02): the ring all-reduce, replica drift, where a step's time goes."""


import matplotlib.patches as patches
import matplotlib.pyplot as plt

from .readable import settle, widen_thin_bars

CELL_INCHES = 0.42      # one chunk of one rank in the ring picture


def ring_all_reduce_steps(snapshots_by_rank: list[list], *, title: str = "ring all-reduce, step by step"):
    """One picture per step of ``ddp.ring_all_reduce``: a rank × chunk grid whose cells say whose data each
    chunk holds. Rank r must start with 2**r in every element, so a chunk's value is the set of ranks summed
    into it, written as bits. Cells that changed in the step (received from the left neighbour) are outlined.

    The font is sized to the cell: the longest label, p-1 ranks joined by "+" (2p-3 characters), must fit
    in a cell of ``CELL_INCHES`` with room to spare (a digit is about 0.6 of the font size wide)."""
    p = len(snapshots_by_rank)
    states = [[[2.0**r] * p for r in range(p)]]                # before: every rank holds only its own data
    labels = ["start: rank r holds g_r"]
    for i, (phase, step, _) in enumerate(snapshots_by_rank[0]):
        states.append([snapshots_by_rank[r][i][2] for r in range(p)])
        labels.append(f"{phase} {step + 1}/{p - 1}")
    cols = max(2, min(p, 4))
    rows = -(-len(states) // cols)
    panel = max(2.0, CELL_INCHES * p + 0.8)                    # the grid, the rank labels on its left
    fig, axes = plt.subplots(rows, cols, figsize=(panel * cols, (panel - 0.2) * rows + 0.6), squeeze=False)
    for ax in axes.flat[len(states):]:
        ax.axis("off")
    longest = max(1, 2 * p - 3)                                # "0+1+2" for p = 4
    fontsize = min(9.0, 0.8 * CELL_INCHES * 72 / (0.6 * longest))
    cmap = plt.get_cmap("Blues")
    for k, (ax, state, label) in enumerate(zip(axes.flat, states, labels)):
        for r in range(p):
            for c in range(p):
                members = [q for q in range(p) if int(state[r][c]) >> q & 1]
                ax.add_patch(patches.Rectangle((c, p - 1 - r), 1, 1, facecolor=cmap(0.15 + 0.75 * len(members) / p),
                                               edgecolor="white", lw=1))
                text = "Σ" if len(members) == p else "+".join(map(str, members))
                ax.text(c + 0.5, p - 0.5 - r, text, ha="center", va="center", fontsize=fontsize,
                        color="white" if len(members) > p / 2 else "black")
                if k and state[r][c] != states[k - 1][r][c]:   # arrived this step from rank r-1
                    ax.add_patch(patches.Rectangle((c + 0.04, p - 0.96 - r), 0.92, 0.92, fill=False,
                                                   edgecolor="tab:red", lw=2))
        ax.set(xlim=(0, p), ylim=(0, p), aspect="equal", title=label)
        ax.title.set_fontsize(9)
        ax.set_xticks([c + 0.5 for c in range(p)], [f"c{c}" for c in range(p)], fontsize=8)
        ax.set_yticks([p - 0.5 - r for r in range(p)], [f"rank {r}" for r in range(p)], fontsize=8)
        ax.tick_params(length=0)
    fig.suptitle(f"{title}: rows are ranks, columns the {p} chunks; a red box arrived from the rank above "
                 "(rank 0 from the last)", fontsize=9)
    settle(fig, *axes.flat[:len(states)])
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
    settle(fig, ax)
    return fig


PHASE_INCHES = 0.3      # the compute / communication / optimizer bar of one rank
ROW_INCHES = 0.12       # one row of all-reduces, when there are few; never thinner than MIN_ROW_INCHES
MIN_ROW_INCHES = 0.05


def pack_rows(spans: list[tuple[float, float]]) -> list[int]:
    """A row for each (begin, end) span, in order: the first row whose last span ended by ``begin``. Spans that
    follow each other share a row; spans in flight at the same time get a row each."""
    row_ends, rows = [], []
    for begin, end in spans:
        row = next((i for i, last_end in enumerate(row_ends) if last_end <= begin), len(row_ends))
        row_ends[row:row + 1] = [end]
        rows.append(row)
    return rows


def ddp_timeline(steps_by_rank: list[dict], *, title: str = "one training step, per rank"):
    """Per rank, one step (records of ``ddp.train_step`` with a "bucket_log" of all-reduces): a bar of compute
    (forward + backward), the wait for communication, and the optimizer; below it, each all-reduce from when
    it was issued to when it finished, all-reduces in flight at the same time on rows of their own. Times in
    ms from the first rank's start (one clock per machine). Every bar is drawn at least a few pixels wide and
    tall: a 0.2 ms all-reduce is still a bar."""
    t0 = min(step["start"] for step in steps_by_rank)
    ms = lambda t: (t - t0) * 1e3                                          # noqa: E731
    spans = [[(ms(e["issued"]), ms(e.get("done", e["issued"]))) for e in step.get("bucket_log") or []]
             for step in steps_by_rank]
    rows = [pack_rows(mine) for mine in spans]
    num_rows = max((max(mine) + 1 for mine in rows if mine), default=0)
    row = max(MIN_ROW_INCHES, min(ROW_INCHES, 0.5 / max(1, num_rows)))
    gap = 0.08                                                    # between a rank's phases and its all-reduces
    block = PHASE_INCHES + gap + num_rows * row + 0.25            # one rank, in inches (y runs downwards)
    fig, ax = plt.subplots(figsize=(7.6, 1.0 + block * len(steps_by_rank)))
    drawn = []
    for r, step in enumerate(steps_by_rank):
        top = -r * block
        phases = [("compute", step["start"], step["backward"]), ("exposed communication", step["backward"],
                  step["synced"]), ("optimizer", step["synced"], step["end"])]
        for phase, begin, end in phases:
            if end > begin:                                       # a phase that took no time is not drawn
                drawn += ax.barh(top - PHASE_INCHES / 2, ms(end) - ms(begin), left=ms(begin), height=PHASE_INCHES,
                                 color=DDP_PHASE_COLORS[phase], label=phase if r == 0 else None)
        for i, ((begin, end), k) in enumerate(zip(spans[r], rows[r])):
            drawn += ax.barh(top - PHASE_INCHES - gap - row * (k + 0.5), end - begin, left=begin, height=row * 0.8,
                             color="tab:orange", edgecolor="white", lw=0.4,
                             label="all-reduce of one bucket (issued → done)" if r == 0 and i == 0 else None)
    ax.set_yticks([-r * block - PHASE_INCHES / 2 for r in range(len(steps_by_rank))],
                  [f"rank {r}" for r in range(len(steps_by_rank))], fontsize=8)
    ax.set_ylim(-len(steps_by_rank) * block + 0.15, 0.1)
    ax.set(xlabel="milliseconds since the step began", title=title)
    ax.title.set_fontsize(10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    settle(fig, ax)
    widen_thin_bars(ax, drawn, min_px=4)
    return fig
