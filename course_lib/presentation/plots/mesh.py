"""Figures for the 3D mesh (notebook 06): which GPU holds which coordinates, bytes per axis."""

import math

import matplotlib.pyplot as plt

from .readable import plural


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
    ax.set_title(title or f"dp {mesh.dp} × tp {mesh.tp} × pp {mesh.pp} on nodes of {plural(gpus_per_node, 'GPU')} "
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
