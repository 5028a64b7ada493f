"""Why a published run is out of the step-time model's reach, from what the table itself shows.

course_lib.published.compare_published marks each row more than 5 points off with one of these, or with nothing:

    ran on another GPU    the source ran on a card the catalogue does not hold (PublishedRun.ran_on): on that card,
                          as far as its source describes it, the model lands within 5 points
    above the ceiling     the source reports more than the model's kernels alone would reach, with no
                          communication, bubble or optimizer (kernel_ceiling): only faster kernels reach it, and
                          best_kernels_ceiling says how near the fastest GEMMs ever measured on its GPU it ran
    out of line           the run's siblings in its own source (the same model and GPU at another GPU count or
                          sequence length) report it further from them than the model moves it
    out of order          its source reports it below a run that does the same work per GPU over more GPUs, which
                          can only add communication: at that run's figure it would be within 5 points

A row off by more than 5 points with none of these is the model's own miss.
"""

from __future__ import annotations

import dataclasses
import statistics

from .cost import StepTime, step_time
from .hardware import find_gpu
from .kernel_times import FAMILIES


def why_off(run, row: dict, runs: list, rows: list[dict]) -> str:
    """The first of the reasons above that holds for a row (one of compare_published's, beside the others) more than
    5 points off; "" for a row within 5 points, or for the model's own miss."""
    if abs(row["points"]) <= 5:
        return ""
    return ((ran_on_why(run, row) if run.ran_on else "")
            or (above_ceiling_why(row) if row["above_ceiling"] else out_of_line(run, row, runs, rows)
                or out_of_order(run, row, runs, rows)))


def ran_on_why(run, row: dict) -> str:
    """A run (published.PublishedRun) priced on the catalogue's GPU that ran on another (its ran_on): within 5 points
    on the GPU it ran on, or ""."""
    if abs(row["on_its_gpu"] - row["theirs"]) > 0.05:
        return ""
    return (f"ran on another GPU, {run.ran_on.name}: on it the model gives {100 * row['on_its_gpu']:.1f}% "
            f"({100 * (row['on_its_gpu'] - row['theirs']):+.1f} points)")


def kernel_ceiling(run, step: StepTime) -> float:
    """The run's metric if its step were its kernels alone: no communication, bubble or optimizer."""
    return getattr(step, run.metric) * step.total_s / step.compute_s


def best_kernels_ceiling(run) -> float:
    """kernel_ceiling with no matmul slower than its GPU's best measured rate, whatever the shape (a shape factor
    of 1; one that waits on memory still does). For the catalogue's GPUs: their attention has its own benchmarks
    (kernel_times.FLASH_TFLOPS), where another GPU's would take matmul_half_dim too, and a measured GEMM grid
    (calibration) would ignore the share."""
    gpu = find_gpu(run.gpu)
    if gpu.matmul_grid or gpu.name.split()[0] not in FAMILIES:
        raise ValueError(f"best_kernels_ceiling: {gpu.name} is not one of the catalogue's GPUs (hardware.GPUS)")
    best = dataclasses.replace(gpu, matmul_share=gpu.best_matmul_share, matmul_half_dim=0.0)
    return kernel_ceiling(run, step_time(run.job.replace(gpu=best), **run.assumptions))


def above_ceiling_why(row: dict) -> str:
    """Why a run above its kernel ceiling is out of the model's reach, and how near the best kernels it ran."""
    ceiling, best = 100 * row["ceiling"], 100 * row["best_ceiling"]
    if row["theirs"] > row["best_ceiling"]:
        return (f"above its kernel ceiling ({ceiling:.1f}%) and even the {best:.1f}% of every matmul at the best "
                "rate measured on its GPU: its other kernels (attention, say) ran faster than the model's")
    return (f"above its kernel ceiling ({ceiling:.1f}%): its matmuls ran faster than the model's share; "
            f"{row['theirs'] / row['best_ceiling']:.0%} of the {best:.1f}% with every matmul at the best rate "
            "measured on its GPU")


def out_of_line(run, row: dict, runs: list, rows: list[dict]) -> str:
    """Where a run's own source moves against the model: its siblings (the same model on the same GPU type, at
    another GPU count or another sequence length, never both) report a median figure the run is N points from,
    while the model puts it M points from theirs; more than 5 points apart, the source changes something between
    them that the model does not (or the row is the table's own outlier). "" otherwise, or without siblings."""
    def model(config):                             # the model's shape; its max_seq_len follows the row's sequence
        return dataclasses.replace(config, max_seq_len=1)

    def differs(other):
        return (model(other.config) == model(run.config) and other.gpu == run.gpu and other is not run
                and (other.mesh.size == run.mesh.size) != (other.layout["seq_len"] == run.layout["seq_len"]))
    siblings = [(other, sibling) for other, sibling in zip(runs, rows) if differs(other)]
    if not siblings:
        return ""
    theirs = 100 * (row["theirs"] - statistics.median(sibling["theirs"] for _, sibling in siblings))
    ours = 100 * (row["ours"] - statistics.median(sibling["ours"] for _, sibling in siblings))
    if abs(theirs - ours) <= 5:
        return ""

    def span(values, unit):
        low, high = min(values), max(values)
        return f"{low:,}{unit}" if low == high else f"{low:,} to {high:,}{unit}"
    gpus = {other.mesh.size for other, _ in siblings if other.mesh.size != run.mesh.size}
    seq_lens = {other.layout["seq_len"] for other, _ in siblings if other.layout["seq_len"] != run.layout["seq_len"]}
    varied = ", ".join(([span(gpus, " GPUs")] if gpus else []) + ([span(seq_lens, " tokens")] if seq_lens else []))
    count = "its sibling" if len(siblings) == 1 else f"the median of its {len(siblings)} siblings"
    return (f"out of line with its source: {theirs:+.1f} points from {count} ({varied}), "
            f"where the model moves {ours:+.1f}")


def wider_runs(run, runs: list) -> list[int]:
    """The indices of the runs in ``runs`` that do ``run``'s work per GPU over more GPUs: the same model, GPU and
    layout (sequence, micro-batch, sharding, recomputation), only more data-parallel ranks, at a global batch no
    larger. Per token such a run runs the same kernels and no less of the optimizer's step (its shard over its
    tokens), with only more communication (and, with a pipeline, no more micro-batches to fill it), so any model
    whose step grows with communication and idle time, ours included, puts it no higher."""
    def rest(other):                                # the layout but for the micro-batches a step accumulates
        return {key: value for key, value in other.layout.items() if key != "num_microbatches"}

    def batch(other):                               # sequences per step, over the micro-batch all of them share
        return other.mesh.dp * other.layout.get("num_microbatches", 1)
    return [index for index, other in enumerate(runs)
            if other.config == run.config and other.gpu == run.gpu and other.ran_on == run.ran_on
            and other.metric == run.metric
            and rest(other) == rest(run) and other.mesh.dp > run.mesh.dp
            and dataclasses.replace(other.mesh, dp=run.mesh.dp) == run.mesh and batch(other) <= batch(run)]


def out_of_order(run, row: dict, runs: list, rows: list[dict]) -> str:
    """A run its own source reports below one of its wider_runs: where that run's figure would bring this row within
    5 points, that is the row's reason; "" otherwise. (9 such pairs among the 229 published runs, 2 reported the
    other way round: MPT-760m on 8 H100 by 3.0 points, MPT-70b on 64 H100 by 0.8.)"""
    above = [index for index in wider_runs(run, runs) if rows[index]["theirs"] > row["theirs"]]
    if not above:
        return ""
    index = max(above, key=lambda index: rows[index]["theirs"])
    other, sibling = runs[index], rows[index]
    if abs(row["ours"] - sibling["theirs"]) > 0.05:
        return ""
    return (f"out of order in its source: {100 * (row['theirs'] - sibling['theirs']):+.1f} points from the same "
            f"run on {other.mesh.size:,} GPUs ({100 * sibling['theirs']:.1f}%), which only adds communication, where "
            f"the model moves {100 * (row['ours'] - sibling['ours']):+.1f}; at that run's figure it would be "
            f"{100 * (row['ours'] - sibling['theirs']):+.1f} points off")
