"""What a lab measured, and where: the one way a notebook shows ``labs/results/``.

    print(describe("ddp"))

Each lab (``labs/*.py``) writes ``labs/results/<lab>.json``, with the backend, the device ("cuda" or "cpu") and
the machine it ran on (labs/common.py). ``describe`` reads that file and labels it by what the file itself says:

* device "cuda": **GPU results from** the machine named in the file;
* anything else: a **CPU smoke run** (gloo, tiny sizes) on the machine named, with a line saying what a GPU
  box would show and how to get it (``make gpu-check``);
* no file: **no lab results yet**, and the commands that make one.

Below that come the GPU results of ``make gpu-check``: on a GPU box it writes into ``labs/results/gpu-<machine>/``
(labs/check_gpu.py), and each such folder that holds this lab, run on "cuda", is shown the same way, under its
folder's name. The course commits the folders of the machines it ran on (one H200 so far); a lab run by hand
writes ``labs/results/<lab>.json`` beside them, and ``make gpu-check`` on a box of the same kind rewrites that
machine's folder (git shows it changed).

Notebook cells never read ``labs/results/`` themselves (tests/test_lab_results.py checks every notebook), so
no cell can present a CPU run as a GPU result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

RESULTS = Path(__file__).resolve().parents[2] / "labs" / "results"     # the repository's labs/results
GPU_FOLDERS = "gpu-*"       # labs/results/gpu-<machine>/: a GPU box's make gpu-check (the course commits them)
GPU_CHECK = "make gpu-check"


class Lab(NamedTuple):
    command: str        # the lab on this CPU
    on_gpus: str        # what a GPU box would show that a CPU smoke run cannot


LABS = {
    "training_step": Lab("python labs/training_step.py --world-size 2",
                         "the same identical replicas and loss curve at a GPU-sized model, averaged by NCCL"),
    "ddp": Lab("python labs/ddp.py --world-size 2",
               "how much of the all-reduce NCCL hides behind backward at a GPU-sized model, the GPU computing "
               "while the network moves bytes"),
    "zero": Lab("python labs/zero.py --world-size 4",
                "each stage's state per rank against the ledger at a GPU-sized model, with "
                "torch.cuda.max_memory_allocated beside it"),
    "tensor_parallel": Lab("python labs/tensor_parallel.py --world-size 2",
                           "whether splitting the matmuls over NVLink beats one GPU, and from which width on "
                           "(run it at --hidden 1024 and 4096 to see the crossing)"),
    "pipeline_parallel": Lab("python labs/pipeline_parallel.py --world-size 4 --real",
                             "real-compute bubbles beside (p-1)/(m+p-1), one GPU per stage, no two stages sharing "
                             "a core"),
    "parallel_3d": Lab("python labs/parallel_3d.py --world-size 8 --tp 2 --pp 2",
                       "the same bytes per axis, timed over NVLink (tp) and between GPUs (pp, dp)"),
    "checkpoint": Lab("python labs/checkpoint.py --world-size 4",
                      "a rank killed under torchrun --max-restarts on NCCL, the job resumed and resharded from a "
                      "checkpoint on real storage, equal to one process"),
    "profiling": Lab("python labs/profiling.py --world-size 2",
                     "the NCCL kernels of a DDP, FSDP and TP step on each GPU's stream, on one timeline, and NCCL's "
                     "flight recorder naming a hang's mismatched collective"),
}


def load(name: str, folder: Path = RESULTS) -> dict | None:
    """The JSON lab ``name`` last wrote into ``folder``, or None if it has not run."""
    if name not in LABS:
        raise ValueError(f"no lab named {name!r}: the labs are {', '.join(LABS)}")
    path = Path(folder) / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def label(name: str, record: dict | None) -> str:
    """The first line: whose results these are, by what the file says about where it ran."""
    lab = LABS[name]
    if record is None:
        return (f"no lab results yet: run `{lab.command}` here (CPU, a smoke run), or `{GPU_CHECK}` on a GPU box "
                f"(`labs/{name}.py` under torchrun)")
    machine = record.get("machine") or "an unrecorded machine (an older lab wrote this file: run it again)"
    if record.get("device") == "cuda":
        return (f"GPU results from {machine} ({record.get('backend')}, {record.get('dtype')}, "
                f"{ranks(record.get('world_size'))}, {record.get('date', 'undated')}):")
    return (f"CPU smoke run ({record.get('backend', 'gloo')}, tiny sizes) on {machine}: a GPU box would show "
            f"{lab.on_gpus}; get it with `{GPU_CHECK}`.")


def describe(name: str, folder: Path = RESULTS) -> str:
    """Lab ``name``'s last results in ``folder`` as text: label(...) and then a few lines of its numbers; then
    those of every GPU run in ``folder``/gpu-*/ (module docstring)."""
    record = load(name, folder)
    lines = [label(name, record)] + (_numbers(name, record, Path(folder), "labs/results") if record else [])
    for committed in sorted(Path(folder).glob(GPU_FOLDERS)):
        gpu_record = load(name, committed)
        if gpu_record is not None and gpu_record.get("device") == "cuda":
            where = f"labs/results/{committed.name}"
            lines += ["", f"`make gpu-check` ({where}): {label(name, gpu_record)}"]
            lines += _numbers(name, gpu_record, committed, where)
    return "\n".join(lines)


def _numbers(name: str, record: dict, folder: Path, where: str) -> list[str]:
    """A few lines of a record's numbers, and its figure's path as the reader would type it."""
    try:
        lines = SUMMARIES[name](record) + _memory_lines(record)
    except (KeyError, TypeError):
        lines = ["  (this file is from an older version of the lab: run it again for its numbers)"]
    if (folder / f"{name}.png").exists():
        lines.append(f"  figure: {where}/{name}.png")
    return lines


def ranks(count) -> str:
    """"1 rank", "8 ranks"."""
    return f"{count} rank{'' if count == 1 else 's'}"


def _memory_lines(record: dict) -> list[str]:
    """Peak GPU memory per rank beside the ledger's state, when a GPU measured it (None on a CPU)."""
    peaks, predicted = record.get("max_memory_allocated"), record.get("predicted_state_bytes")
    if not peaks or None in peaks:
        return []
    gib = 2**30
    line = f"  peak GPU memory per rank (max_memory_allocated): {max(peaks) / gib:.2f} GiB at most"
    if predicted:
        line += f"; the ledger's training state: {max(predicted) / gib:.2f} GiB at most"
    return [line]


def _training_step(r: dict) -> list[str]:
    losses = r["losses"]
    return [f"  {ranks(r['world_size'])}, {r['params']:,} parameters: loss {losses[0]:.4f} → {losses[-1]:.4f}, "
            f"replica spread {r['replica_spread']:.1e}"]


def _ddp(r: dict) -> list[str]:
    lines = [f"  {ranks(r['world_size'])}, {r['params']:,} parameters, {r['bucket_mb']} MiB buckets"]
    for row in r["rows"]:
        lines.append(f"  {row['kind']:>9}: step {row['step_ms']:7.2f} ms = compute {row['compute_ms']:7.2f} + exposed "
                     f"communication {row['exposed_ms']:6.2f} + optimizer {row['optimizer_ms']:5.2f}; "
                     f"{row['wire_bytes']:,.0f} wire bytes per step per rank")
    return lines


def _zero(r: dict) -> list[str]:
    lines = [f"  {ranks(r['world_size'])}, {r['params']:,} parameters:"]
    for key, run in r["runs"].items():
        largest = max(state["total"] for state in run["state_per_rank"])
        lines.append(f"  {key:>18}: {largest / 2**20:9.3f} MiB of state per rank (formula "
                     f"{run['predicted_state']['total'] / 2**20:9.3f}), step {run['step_seconds'] * 1e3:7.1f} ms")
    return lines


def _tensor_parallel(r: dict) -> list[str]:
    config = r["config"]
    return [f"  TP={r['tp']}, hidden {config['hidden']}, {config['num_layers']} layers: "
            f"{r['all_reduces_per_step']} all-reduces per step (predicted {4 * config['num_layers']}), "
            f"{r['payload_bytes_per_step']:,} bytes (predicted {r['predicted']['payload_bytes']:,}); "
            f"step {r['step_seconds'] * 1e3:.1f} ms vs {r['one_device_step_seconds'] * 1e3:.1f} ms on one device"]


def _pipeline_parallel(r: dict) -> list[str]:
    return [f"  {row['schedule']:>5}, m = {row['num_microbatches']:>3}: bubble {row['measured']:6.1%} "
            f"(formula {row['formula']:6.1%})" for row in r["rows"]]


def _parallel_3d(r: dict) -> list[str]:
    mesh = r["mesh"]
    return [f"  dp {mesh['dp']} × tp {mesh['tp']} × pp {mesh['pp']}, hidden {r['config']['hidden']}: traced bytes "
            f"= formula on every rank; median step {r['median_step_seconds'] * 1e3:.1f} ms"]


SUMMARIES = {"training_step": _training_step, "ddp": _ddp, "zero": _zero, "tensor_parallel": _tensor_parallel,
             "pipeline_parallel": _pipeline_parallel, "parallel_3d": _parallel_3d}
