"""Check a GPU box in one command: the machine, its collectives' bandwidth, and every lab, each checked.

    make gpu-check                                  # or: python labs/check_gpu.py
    python labs/check_gpu.py --labs ddp zero        # only some labs
    python labs/check_gpu.py --out /tmp/check       # results elsewhere (default: labs/results)

1. The machine: GPUs (name, memory), driver, torch, CUDA, NCCL, and how the GPUs are linked (nvidia-smi topo -m).
2. Bus bandwidth of all-reduce, all-gather and reduce-scatter, as nccl-tests measure it, 1 MiB to 1 GiB over
   every GPU (one rank per GPU, NCCL): per size, the mean time of 20 back-to-back ops after 5 warm-up ones
   (the slowest rank's), algbw = bytes / time, busbw = algbw × the ring factor (course_lib/comm.py).
3. Every lab, started by torchrun on as many GPUs as it can use (one rank per GPU), at a size that shows its
   effect and for a few steps, then checked from the JSON it wrote: against one process (parity), against the
   formula (bytes, bubbles, state), against torch's own (weights, and the step-time ratio, shown as info: a
   wall-clock figure is never a verdict). A lab that needs more GPUs than the box has is skipped, and says why.
It prints one table (lab, what was checked, predicted, measured, verdict) and writes, into --out: each lab's
JSON and PNG, check_gpu.json (everything above), bandwidth.png, summary.md (one page, naming the machine) and
logs/<lab>.log (each lab's whole output). Exit status 1 when a check fails or a lab does not finish.

Without a GPU it says so in one line and runs the same checks as a CPU smoke run (gloo, 2 ranks, tiny sizes,
labelled so everywhere), which is how CI exercises this script (tests/test_gpu_check.py): about 40 s on 2 cores.
"""

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common import RESULTS, cpu_model
from course_lib import device, launch
from course_lib.comm import BUS_FACTOR, Comm, CostModel

LABS_DIR = Path(__file__).resolve().parent
REPO = LABS_DIR.parent
OPS = ("all_reduce", "all_gather", "reduce_scatter")
GPU_SIZES = [2**k for k in range(20, 31, 2)]       # 1 MiB, 4 MiB, ..., 1 GiB: latency-bound to bandwidth-bound
CPU_SIZES = [2**12, 2**16, 2**20]
LAB_TIMEOUT = 180                                   # seconds; a lab that hangs is stopped and reported
LOSS_TOLERANCE = 1e-3      # |loss - one process's|, float32: sums in another order, grown by Adam (~1e-5 seen)
# |w - torch DDP's w| after the lab's 20 Adam steps of lr 1e-3 (each moves a weight by up to lr): float32 sums in
# another order, 6e-7 at 4 ranks here; under bf16 autocast one weight rounded the other way feeds back, 1.2e-4
WEIGHT_TOLERANCE = {"fp32": 1e-4, "bf16": 1e-3}
BF16_TOLERANCE = 2**-6     # |w - torch's w|, bf16 weights below 2: two bf16 steps (the lab: about one)
BUBBLE_TOLERANCE = 0.06    # |measured - formula| bubble, as notebook 05 asserts on a busy machine
STATE_TOLERANCE = 0.05     # torch's own state bytes within 5% of the formula


@dataclass
class Lab:
    min_ranks: int          # fewer GPUs than this: skipped, with `needs` as the reason
    needs: str
    gpu_flags: object       # a function: ranks used -> the lab's flags on GPUs
    cpu_flags: str          # its flags in the CPU smoke run


# The size on GPUs that shows each lab's effect. A lab compares with one process only below 5M parameters, so
# the labs whose claim is parity stay below it, in fp32 (their tolerance is float32 rounding); the others grow to
# where bytes and memory are large, in the labs' default precision on GPUs (bf16 autocast; ZeRO: bf16 weights).
LABS = {
    # replicas stay identical and equal one process (whose reference runs on rank 0's CPU: keep it small)
    "training_step": Lab(1, "", lambda n: f"--hidden 128 --global-batch {4 * n} --seq-len 64 --steps 20 --dtype fp32",
                         "--steps 5 --dtype fp32"),
    # 100M parameters, 400 MB of gradients a step: naive, bucketed and torch's DDP apart
    "ddp": Lab(1, "", lambda n: "--hidden 1024 --layers 8 --per-rank-batch 8 --seq-len 256 --bucket-mb 25 --steps 20",
               "--steps 4"),
    # the same 100M parameters in bf16: 1.6 GB of state, then its share per rank at each stage
    "zero": Lab(1, "", lambda n: "--hidden 1024 --layers 8 --per-rank-batch 4 --seq-len 256 --steps 8", "--steps 3"),
    # 8 × 512 tokens through 3M parameters split n ways: parity with one device, the 4 all-reduces per layer
    "tensor_parallel": Lab(2, "TP splits every layer over 2 or more ranks",
                           lambda n: "--hidden 256 --batch-size 8 --seq-len 512 --steps 20 --dtype fp32",
                           "--steps 5 --dtype fp32"),
    # one stage per GPU, the bubble from m = 1 to 32 micro-batches
    "pipeline_parallel": Lab(2, "a pipeline has 2 or more stages",
                             lambda n: "--microbatches 1 8 32 --op-ms 20 --steps 2 --real --dtype fp32",
                             "--microbatches 1 4 --steps 2 --real --dtype fp32"),
    # dp = n / 4 replicas of a tp 2 × pp 2 grid
    "parallel_3d": Lab(4, "tp 2 × pp 2 (× dp)",
                       lambda n: f"--tp 2 --pp 2 --hidden 512 --layers 8 --seq-len 128 --batch-size {16 * (n // 4)} "
                                 "--microbatches 4 --steps 5", "--tp 2 --pp 2 --steps 3"),
}


def ranks_for(name: str, gpus: int) -> int:
    """How many ranks a lab runs on ``gpus`` GPUs (0 = on CPU): all of them, as far as the lab can split itself."""
    if gpus == 0:
        return 4 if name == "parallel_3d" else 2     # gloo ranks are cheap: 3D needs its two 2-wide axes
    if name == "tensor_parallel":                    # TP must divide the 16 key/value heads of width 256
        return max(d for d in (1, 2, 4, 8, 16) if d <= gpus)
    if name == "parallel_3d":
        return 4 * (gpus // 4)
    return gpus


def skip_reason(name: str, gpus: int) -> str | None:
    """Why a lab cannot run on ``gpus`` GPUs, or None when it can (always on CPU: gloo ranks)."""
    lab = LABS[name]
    if ranks_for(name, gpus) < lab.min_ranks:
        return f"needs {lab.min_ranks} GPUs ({lab.needs}), found {gpus}"
    return None


@dataclass
class Check:
    lab: str
    what: str
    predicted: str
    measured: str
    verdict: str            # ok, FAIL, info (a figure, no verdict), n/a, skipped


# ------------------------------------------------------------------------------------------------- machine


def describe_machine() -> dict:
    """GPUs, driver, torch, CUDA, NCCL and topology when there are GPUs; the CPU and memory always."""
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    cpu, memory = cpu_model(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    machine = {"cpu": cpu, "cpu_cores": os.cpu_count(), "memory_bytes": memory, "torch": torch.__version__,
               "cuda": torch.version.cuda, "python": platform.python_version(),
               "gpus": [{"name": g.name, "memory_bytes": g.total_memory} for g in gpus]}
    if gpus:
        version = torch.cuda.nccl.version()
        machine["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        names = Counter(f"{g.name} ({g.total_memory / 2**30:.0f} GiB)" for g in gpus)
        machine["name"] = " + ".join(f"{count} × {name}" for name, count in names.items())
    else:
        machine["name"] = f"{cpu}, {os.cpu_count()} cores, {memory / 2**30:.0f} GiB, no GPU"
    if gpus and shutil.which("nvidia-smi"):
        smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        machine["driver"] = subprocess.run(smi, capture_output=True, text=True).stdout.strip().splitlines()[0]
        machine["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
    return machine


# ------------------------------------------------------------------------------------------------ bandwidth


ISSUE = {"all_reduce": lambda comm, full, part: comm.all_reduce(full),     # full: n bytes, part: n/p
         "all_gather": lambda comm, full, part: comm.all_gather(full, part),
         "reduce_scatter": lambda comm, full, part: comm.reduce_scatter(part, full)}


def op_seconds(rank, world_size, *, sizes, iterations, warmup):
    """nccl-tests' loop on this rank: per op and size, the mean seconds of ``iterations`` back-to-back ops.
    GPU ops only enqueue work, so the clock stops after the device has caught up (cuda synchronize)."""
    warnings.filterwarnings("ignore", category=FutureWarning)   # gloo's notice on reduce_scatter/all_gather
    comm, dev = Comm(), device()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    seconds = {}
    for op in OPS:
        for nbytes in sizes:
            full = torch.zeros(nbytes // 4 // world_size * world_size, device=dev)   # float32, p equal parts
            part = torch.zeros(full.numel() // world_size, device=dev)
            for _ in range(warmup):
                ISSUE[op](comm, full, part)
            sync()
            comm.barrier()
            start = time.perf_counter()
            for _ in range(iterations):
                ISSUE[op](comm, full, part)
            sync()
            seconds[op, full.nbytes] = (time.perf_counter() - start) / iterations
            del full, part
    return seconds


def measure_bandwidth(ranks: int, backend: str, sizes: list[int]) -> list[dict]:
    """Rows of op, bytes, seconds (the slowest rank's), algbw and busbw (bytes/s), as nccl-tests print them."""
    iterations, warmup = (20, 5) if backend == "nccl" else (5, 2)
    per_rank = launch(op_seconds, ranks, backend=backend, timeout=LAB_TIMEOUT, sizes=sizes, iterations=iterations,
                      warmup=warmup)
    rows = []
    for op, nbytes in per_rank[0]:
        seconds = max(ranks_seconds[op, nbytes] for ranks_seconds in per_rank)
        rows.append({"op": op, "bytes": nbytes, "seconds": seconds, "algbw": nbytes / seconds,
                     "busbw": nbytes / seconds * BUS_FACTOR[op](ranks)})
    return rows


def bandwidth_table(rows: list[dict], ranks: int) -> str:
    fit = CostModel.fit([r for r in rows if r["op"] == "all_reduce"], ranks)
    lines = [f"{'size':>10}" + "".join(f"{op + ' busbw':>22}" for op in OPS)]
    for nbytes in sorted({r["bytes"] for r in rows}):
        cells = {r["op"]: r["busbw"] for r in rows if r["bytes"] == nbytes}
        lines.append(f"{size(nbytes):>10}" + "".join(f"{cells[op] / 1e9:>16.3g} GB/s" for op in OPS))
    # A time that did not grow with size (tiny messages on a busy CPU) fits a slope of 0 or less: β is then
    # "infinite" (CostModel caps it at 1e30 B/s), a number no link has; 1 PB/s is beyond any link.
    beta = (f"{fit.beta / 1e9:.2f} GB/s per rank" if fit.beta < 1e15 else
            "not measurable (the time did not grow with the message size: sizes too small, or a busy machine)")
    lines.append(f"all_reduce fitted to time = α + wire bytes / β (comm.CostModel): α = {fit.alpha * 1e6:.0f} µs, "
                 f"β = {beta}")
    return "\n".join(lines)


def plot_bandwidth(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for op in OPS:
        points = [(r["bytes"], r["busbw"] / 1e9) for r in rows if r["op"] == op]
        ax.plot(*zip(*points), "o-", label=op)
    ax.set(xscale="log", xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------ labs


def run_lab(name: str, ranks: int, backend: str, flags: list, out: Path) -> tuple[list, int | None, float]:
    """torchrun the lab; return the command (as one would type it), its exit status (None: stopped after
    LAB_TIMEOUT) and seconds. Its whole output goes to out/logs/<lab>.log."""
    command = ["torchrun", "--standalone", "--nproc-per-node", str(ranks), os.path.relpath(LABS_DIR / f"{name}.py"),
               "--backend", backend, "--out", str(out), *flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").unlink(missing_ok=True)        # a stale JSON must not pass for this run's
    start = time.perf_counter()
    with open(out / "logs" / f"{name}.log", "w") as log:
        print(" ".join(command), file=log, flush=True)
        # torchrun is torch.distributed.run of this Python; in its own session, so that a hung lab is stopped
        # as a whole (torchrun passes SIGTERM on to its ranks)
        process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *command[1:]], stdout=log,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = process.wait(timeout=LAB_TIMEOUT)
        except subprocess.TimeoutExpired:
            code = None
            stop(process)
        except BaseException:             # Ctrl-C here: the lab is in another session, stop it too
            stop(process)
            raise
    return command, code, time.perf_counter() - start


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the lab's session (torchrun and its ranks); SIGKILL if it is still there a minute later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=60)
            return


def verdict(ok: bool) -> str:
    return "ok" if ok else "FAIL"


def size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:.0f} B"


def exact(predicted: float, measured: float) -> bool:
    return math.isclose(predicted, measured, rel_tol=1e-9, abs_tol=1e-9)


def not_in_lab(what: str, where: str = "") -> tuple:
    return what, "—", "not measured by this lab" + (f" ({where})" if where else ""), "n/a"


def check_training_step(r: dict) -> list[tuple]:
    checks = [("replicas identical after training, max |Δw|", "0", f"{r['replica_spread']:.1e}",
               verdict(r["replica_spread"] == 0))]
    if r.get("single_process_losses"):
        gap = max(abs(a - b) for a, b in zip(r["losses"], r["single_process_losses"]))
        checks.append(("loss vs 1 process on the whole batch, every step", f"≤ {LOSS_TOLERANCE:g}", f"{gap:.1e}",
                       verdict(gap <= LOSS_TOLERANCE)))
    return checks + [not_in_lab("against torch's own", "torch's DDP: lab ddp")]


def check_ddp(r: dict) -> list[tuple]:
    rows = {row["kind"]: row for row in r["rows"]}
    checks = [(f"{kind}: bytes each rank sends per step, traced", f"{rows[kind]['predicted_wire_bytes']:,.0f}",
               f"{rows[kind]['wire_bytes']:,.0f}", verdict(exact(rows[kind]["predicted_wire_bytes"],
                                                                  rows[kind]["wire_bytes"])))
              for kind in ("naive", "bucketed")]
    spreads = [rows[kind]["replica_spread"] for kind in rows]
    checks.append((f"replicas identical ({', '.join(rows)}), max |Δw|", "0", " / ".join(f"{s:.1e}" for s in spreads),
                   verdict(max(spreads) == 0)))
    gaps = [rows[kind]["max_diff_vs_torch"] for kind in ("naive", "bucketed")]
    dtype = r.get("dtype") or "fp32"
    checks.append((f"weights vs torch's DDP (naive, bucketed; {dtype}), max |Δw|", f"≤ {WEIGHT_TOLERANCE[dtype]:g}",
                   " / ".join(f"{g:.1e}" for g in gaps), verdict(max(gaps) <= WEIGHT_TOLERANCE[dtype])))
    checks.append(("step time, bucketed / torch's DDP", "≤ 1.3 (goal)",
                   f"{rows['bucketed']['step_ms'] / rows['torch']['step_ms']:.2f}", "info"))
    return checks + [not_in_lab("loss vs 1 process", "lab training_step")]


def check_zero(r: dict) -> list[tuple]:
    runs = r["runs"]
    ours = [runs[f"ours {stage}"] for stage in range(4)]
    same = all(rank[k] == v for run in ours for rank in run["state_per_rank"] for k, v in run["predicted_state"].items())
    checks = [("ours, stages 0/1/2/3: state per rank (storage) vs ledger",
               " / ".join(size(run["predicted_state"]["total"]) for run in ours),
               " / ".join(size(max(rank["total"] for rank in run["state_per_rank"])) for run in ours), verdict(same)),
              ("ours, stages 0/1/2/3: bytes sent per rank per step, traced",
               " / ".join(size(run["predicted_wire_bytes"]) for run in ours),
               " / ".join(size(run["wire_bytes"]) for run in ours),
               verdict(all(exact(run["predicted_wire_bytes"], run["wire_bytes"]) for run in ours)))]
    peaks = [run.get("max_memory_allocated") for run in ours]
    if all(p and None not in p for p in peaks):      # on GPUs: the peak falls with the stage, as the state does
        checks.append(("ours, stages 0/1/2/3: peak CUDA memory per rank ≥ state",
                       " / ".join(size(run["predicted_state"]["total"]) for run in ours),
                       " / ".join(size(max(p)) for p in peaks),
                       verdict(all(min(p) >= (1 - STATE_TOLERANCE) * run["predicted_state"]["total"]
                                   for p, run in zip(peaks, ours)))))
    for theirs, stage in (("zero_redundancy", 1), ("fully_shard", 3)):
        run = runs[f"{theirs} {stage}"]
        largest, predicted = max(rank["total"] for rank in run["state_per_rank"]), run["predicted_state"]["total"]
        checks += [(f"{theirs}: state per rank vs ledger (stage {stage})", size(predicted), size(largest),
                    verdict(abs(largest - predicted) <= STATE_TOLERANCE * predicted)),
                   (f"{theirs}: weights vs ours at stage {stage}, max |Δw|", f"≤ {BF16_TOLERANCE:g}",
                    f"{run['max_weight_gap_vs_ours']:.1e}", verdict(run["max_weight_gap_vs_ours"] <= BF16_TOLERANCE)),
                   (f"step time, ours stage {stage} / {theirs}", "≤ 1.3 (goal)",
                    f"{runs[f'ours {stage}']['step_seconds'] / run['step_seconds']:.2f}", "info")]
    return checks + [not_in_lab("loss vs 1 process")]


def check_tensor_parallel(r: dict) -> list[tuple]:
    predicted = r["predicted"]
    count = predicted["forward_all_reduces"] + predicted["backward_all_reduces"]
    checks = [("all-reduces per step (4 per layer), traced", str(count), str(r["all_reduces_per_step"]),
               verdict(count == r["all_reduces_per_step"])),
              ("all-reduce bytes per step, traced", f"{predicted['payload_bytes']:,}", f"{r['payload_bytes_per_step']:,}",
               verdict(predicted["payload_bytes"] == r["payload_bytes_per_step"]))]
    if r.get("max_loss_gap") is not None:
        checks.append(("loss vs the whole model on one device, every step", f"≤ {LOSS_TOLERANCE:g}",
                       f"{r['max_loss_gap']:.1e}", verdict(r["max_loss_gap"] <= LOSS_TOLERANCE)))
    checks.append((f"step time, one device / TP = {r['tp']}", "—", f"{r['speedup_vs_one_device']:.2f}×", "info"))
    return checks + [not_in_lab("against torch's DTensor", "benchmarks/tp.py")]


def check_pipeline_parallel(r: dict) -> list[tuple]:
    p, checks = r["stages"], []
    for schedule in ("gpipe", "1f1b"):
        rows = [row for row in r["rows"] if row["schedule"] == schedule]
        ms = ", ".join(str(row["num_microbatches"]) for row in rows)
        worst = max(abs(row["measured"] - row["formula"]) for row in rows)
        checks.append((f"{schedule}: bubble (p-1)/(m+p-1), m = {ms}",
                       " / ".join(f"{row['formula']:.1%}" for row in rows),
                       " / ".join(f"{row['measured']:.1%}" for row in rows), verdict(worst <= BUBBLE_TOLERANCE)))
        # micro-batches whose activations a stage holds at once: all m in GPipe, at most p - stage in 1F1B
        expected = [[m if schedule == "gpipe" else min(m, p - s) for s in range(p)]
                    for m in (row["num_microbatches"] for row in rows)]
        checks.append((f"{schedule}: micro-batches in flight, stage 0, m = {ms}",
                       " / ".join(str(e[0]) for e in expected), " / ".join(str(row["peak_in_flight"][0]) for row in rows),
                       verdict(expected == [row["peak_in_flight"] for row in rows])))
    if r.get("single_process_loss") is not None:
        gap = max(abs(row["loss"] - r["single_process_loss"]) for row in r["rows"])
        checks.append(("loss vs 1 process, every schedule and m", f"≤ {LOSS_TOLERANCE:g}", f"{gap:.1e}",
                       verdict(gap <= LOSS_TOLERANCE)))
    real = [row for row in r["rows"] if "real_step_s" in row]
    if real:
        checks.append((f"real step, {real[-1]['schedule']}, m = {real[-1]['num_microbatches']}", "—",
                       f"{real[-1]['real_step_s'] * 1e3:.1f} ms", "info"))
    return checks + [not_in_lab("against torch.distributed.pipelining", "benchmarks/pp.py")]


def check_parallel_3d(r: dict) -> list[tuple]:
    ranks, checks = r["ranks"], []
    for axis in ("tp", "pp", "dp"):
        checks.append((f"bytes sent per step on the {axis} axis, every rank (sum shown)",
                       f"{sum(x['predicted_sent_bytes'][axis] for x in ranks):,.0f}",
                       f"{sum(x['sent_bytes'][axis] for x in ranks):,.0f}",
                       verdict(all(exact(x["predicted_sent_bytes"][axis], x["sent_bytes"][axis]) for x in ranks))))
    checks.append(("weight bytes held, every rank (largest shown)", size(4 * max(x["params_held"] for x in ranks)),
                   size(max(x["state_bytes"]["weights"] for x in ranks)),
                   verdict(all(x["state_bytes"]["weights"] == 4 * x["params_held"] for x in ranks))))
    return checks + [not_in_lab("loss vs 1 process", "tests/test_mesh.py, float64"), not_in_lab("against torch's own")]


def memory_check(record: dict) -> tuple:
    """The ledger's training state against torch.cuda.max_memory_allocated, rank by rank. The peak holds the state
    and, on top, activations, buckets and other transient tensors, so the claim is peak ≥ state (within 5%); the
    ratio shows how much comes on top."""
    what = "peak CUDA memory per rank ≥ ledger's state"
    peaks, states = record.get("max_memory_allocated"), record.get("predicted_state_bytes")
    if peaks is None or states is None:
        return not_in_lab(what)
    if None in peaks:
        return what, "—", "not measured on a CPU (no CUDA allocator)", "n/a"
    ratios = [peak / state for peak, state in zip(peaks, states)]
    return (what, f"{size(max(states))} (largest)", f"{size(max(peaks))}, {min(ratios):.2f}–{max(ratios):.2f}× state",
            verdict(min(ratios) >= 1 - STATE_TOLERANCE))


CHECKS = {"training_step": check_training_step, "ddp": check_ddp, "zero": check_zero,
          "tensor_parallel": check_tensor_parallel, "pipeline_parallel": check_pipeline_parallel,
          "parallel_3d": check_parallel_3d}


def lab_checks(name: str, out: Path) -> list[Check]:
    """The checks of one lab's JSON; one FAIL row if it cannot be read (a lab changed its format, say)."""
    try:
        record = json.loads((out / f"{name}.json").read_text())
        rows = CHECKS[name](record) + [memory_check(record)]
    except Exception as error:      # any error here is this lab's failed check, reported as such
        rows = [("results readable", f"{name}.json", f"{type(error).__name__}: {error}", "FAIL")]
    return [Check(name, *row) for row in rows]


# --------------------------------------------------------------------------------------------------- reports


def checks_table(checks: list[Check]) -> str:
    """The checks with a number (n/a rows are listed by not_measured)."""
    header = Check("lab", "what was checked", "predicted", "measured", "verdict")
    rows = [header] + [c for c in checks if c.verdict != "n/a"]
    widths = [max(len(getattr(c, f)) for c in rows) for f in ("lab", "what", "predicted", "measured")]
    return "\n".join(f"{c.lab:<{widths[0]}}  {c.what:<{widths[1]}}  {c.predicted:>{widths[2]}}  "
                     f"{c.measured:>{widths[3]}}  {c.verdict}" for c in rows)


def not_measured(checks: list[Check]) -> list[str]:
    """One line per thing not measured, naming the labs and why."""
    labs = {}
    for c in checks:
        if c.verdict == "n/a":
            labs.setdefault((c.what, c.measured), []).append(c.lab)
    return [f"{what}: {', '.join(names)}: {why}" for (what, why), names in labs.items()]


def summary(report: dict) -> str:
    """One page of Markdown: what ran where, the bandwidth, and every check."""
    machine, checks = report["machine"], [Check(**c) for c in report["checks"]]
    lines = [f"# {report['run']}: {machine['name']}", "",
             f"`python labs/check_gpu.py`, {report['date']}, {report['seconds']:.0f} s. torch {machine['torch']}, "
             f"CUDA {machine['cuda'] or '—'}, NCCL {machine.get('nccl', '—')}, driver {machine.get('driver', '—')}; "
             f"{machine['cpu']}, {machine['cpu_cores']} cores, {machine['memory_bytes'] / 2**30:.0f} GiB."]
    if report["run"] == "CPU smoke run":
        lines += ["", "**CPU smoke run**: no GPU on this machine; gloo ranks on the CPU, tiny sizes. Nothing here is a "
                  "GPU result: run `make gpu-check` on a GPU box for that."]
    if machine.get("topology"):
        lines += ["", "## Links between GPUs (`nvidia-smi topo -m`)", "", "```", machine["topology"].rstrip(), "```"]
    if report["bandwidth"]:
        lines += ["", f"## Bus bandwidth, {report['bandwidth_ranks']} ranks (nccl-tests' busbw)", "", "```",
                  bandwidth_table(report["bandwidth"], report["bandwidth_ranks"]), "```", "", "![](bandwidth.png)"]
    lines += ["", "## Labs", "", "| lab | ranks | precision | seconds | status |", "|---|---|---|---|---|"]
    lines += [f"| {lab['lab']} | {lab['ranks'] or '—'} | {lab['dtype'] or '—'} | {lab['seconds']:.0f} | {lab['status']} |"
              for lab in report["labs"]]
    lines += ["", "## Checks", "", "| lab | what was checked | predicted | measured | verdict |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(text.replace("|", "\\|") for text in (c.lab, c.what, c.predicted, c.measured, c.verdict))
              + " |" for c in checks if c.verdict != "n/a"]
    counts = Counter(c.verdict for c in checks)
    lines += ["", "Verdicts: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + ". Each lab's JSON, PNG and log "
              "(logs/) are beside this file.", ""]
    lines += ["Not measured:", ""] + [f"- {line}" for line in not_measured(checks)]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labs", nargs="+", choices=list(LABS), default=list(LABS), help="default: every lab")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go")
    args = parser.parse_args()
    start, gpus = time.perf_counter(), torch.cuda.device_count()
    run, backend = ("GPU check", "nccl") if gpus else ("CPU smoke run", "gloo")
    if not gpus:
        print("No GPU found (torch.cuda.device_count() is 0): running the same checks as a CPU smoke run "
              "(gloo, 2 ranks, tiny sizes); none of its figures is a GPU result.")
    machine = describe_machine()
    print(f"{run} on {machine['name']}: torch {machine['torch']}, CUDA {machine['cuda'] or '—'}, "
          f"NCCL {machine.get('nccl', '—')}, driver {machine.get('driver', '—')}")
    if machine.get("topology"):
        print(machine["topology"].rstrip())
    args.out.mkdir(parents=True, exist_ok=True)

    bandwidth_ranks = gpus if gpus else 2
    bandwidth = []
    if bandwidth_ranks >= 2:
        print(f"\nbus bandwidth, {bandwidth_ranks} ranks ({backend}), as nccl-tests measure it:")
        bandwidth = measure_bandwidth(bandwidth_ranks, backend, GPU_SIZES if gpus else CPU_SIZES)
        print(bandwidth_table(bandwidth, bandwidth_ranks))
        plot_bandwidth(bandwidth, f"{run}, {machine['name']}: {bandwidth_ranks} ranks, {backend}",
                       args.out / "bandwidth.png")
    else:
        print("\n1 GPU: no link between GPUs to measure (busbw is 0 at 1 rank); bandwidth skipped")

    labs, checks = [], []
    for i, name in enumerate(args.labs, 1):
        lab, ranks, why = LABS[name], ranks_for(name, gpus), skip_reason(name, gpus)
        if why:
            print(f"[{i}/{len(args.labs)}] {name}: skipped: {why}")
            labs.append({"lab": name, "ranks": 0, "dtype": None, "seconds": 0.0, "status": f"skipped: {why}",
                         "command": None})
            checks.append(Check(name, "lab ran", f"{lab.min_ranks} GPUs", f"{gpus} GPUs", "skipped"))
            continue
        flags = lab.gpu_flags(ranks) if gpus else lab.cpu_flags
        command, code, seconds = run_lab(name, ranks, backend, flags.split(), args.out)
        status = "ran" if code == 0 else f"stopped after {LAB_TIMEOUT} s" if code is None else f"failed (exit {code})"
        print(f"[{i}/{len(args.labs)}] {name}: {ranks} ranks, {seconds:.1f} s, {status}: {' '.join(command)}")
        record = args.out / f"{name}.json"
        dtype = json.loads(record.read_text()).get("dtype") if code == 0 and record.exists() else None
        labs.append({"lab": name, "ranks": ranks, "dtype": dtype, "seconds": seconds, "status": status,
                     "command": " ".join(command)})
        if code == 0:
            checks += lab_checks(name, args.out)
        else:
            log = args.out / "logs" / f"{name}.log"
            print("\n".join(log.read_text().splitlines()[-15:]))
            checks.append(Check(name, "lab ran", "exit 0", status, "FAIL"))

    title = f"{run} on {machine['name']}"
    print(f"\n{title}\n{checks_table(checks)}")
    report = {"run": run, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine,
              "seconds": time.perf_counter() - start, "bandwidth_ranks": bandwidth_ranks, "bandwidth": bandwidth,
              "labs": labs, "checks": [asdict(c) for c in checks]}
    (args.out / "check_gpu.json").write_text(json.dumps(report, indent=1))
    (args.out / "summary.md").write_text(summary(report))
    print("\n".join(["not measured:"] + not_measured(checks)))
    failed = [c for c in checks if c.verdict == "FAIL"]
    print(f"{len(failed)} of {len(checks)} checks failed; {report['seconds']:.0f} s; wrote {args.out / 'summary.md'}, "
          "check_gpu.json, bandwidth.png and each lab's JSON and PNG")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
