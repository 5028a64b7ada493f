"""Check a GPU box in one command: the machine, its collectives' bandwidth, and every lab, each checked.

    make gpu-check                                  # or: python labs/check_gpu.py
    python labs/check_gpu.py --labs ddp zero        # only some labs (--no-kernels: without the kernel rates)
    python labs/check_gpu.py --out /tmp/check       # results elsewhere (default: labs/results/gpu-<N>x-<GPU>)

1. The machine: GPUs (name, memory), driver, torch, CUDA, NCCL, and how the GPUs are linked (nvidia-smi topo -m).
2. Bus bandwidth of all-reduce, all-gather and reduce-scatter, as nccl-tests measure it, 1 MiB to 1 GiB over
   every GPU (one rank per GPU, NCCL): per size, the mean time of 20 back-to-back ops after 5 warm-up ones
   (the slowest rank's), algbw = bytes / time, busbw = algbw × the ring factor (course_lib/comm.py).
3. Kernel rates (labs/kernel_rates.py, one process on GPU 0): matmul by shape, attention by backend (and as plain
   PyTorch writes it), sequence and head dim, memory-bound ops and a launch, measured beside the step-time
   model's constants for that GPU.
4. Every lab, started by torchrun on as many GPUs as it can use (one rank per GPU), at a size that shows its
   effect and for a few steps, then checked from the JSON it wrote: against one process (parity), against the
   formula (bytes, bubbles, state), against torch's own (weights, and the step-time ratio, shown as info: a
   wall-clock figure is never a verdict). A lab that needs more GPUs than the box has is skipped, and says why.
It prints one table (lab, what was checked, predicted, measured, verdict) and writes, into --out: each lab's
JSON and PNG, check_gpu.json (everything above), bandwidth.png, summary.md (one page, naming the machine) and
logs/<lab>.log (each lab's whole output). Exit status 1 when a check fails or a lab does not finish. On a GPU
box --out is labs/results/gpu-<N>x-<GPU name>/ unless given: commit that folder, and the notebooks show its
results beside the learner's own (course_lib.presentation.lab_results); tests/test_gpu_check.py checks it with
the checks of the day (labs/results/gpu-1x-nvidia-h200/: one H200, 2026-12-04).

Without a GPU it says so in one line and runs the same checks as a CPU smoke run (gloo, 2 ranks, tiny sizes,
labelled so everywhere), which is how CI exercises this script (tests/test_gpu_check.py): about 60 s on 2 cores.
"""

import argparse
import contextlib
import json
import os
import platform
import re
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
from lab_checks import KERNELS, Check, lab_checks, size

from common import RESULTS, cpu_model
from course_lib import device, launch
from course_lib.comm import BUS_FACTOR, Comm, CostModel
from course_lib.runtime.arguments import writable_folder
from course_lib.runtime.files import write_atomically

LABS_DIR = Path(__file__).resolve().parent
REPO = LABS_DIR.parent
OPS = ("all_reduce", "all_gather", "reduce_scatter")
GPU_SIZES = [2**k for k in range(20, 31, 2)]       # 1 MiB, 4 MiB, ..., 1 GiB: latency-bound to bandwidth-bound
CPU_SIZES = [2**12, 2**16, 2**20]
LAB_TIMEOUT = 180                                   # seconds; a lab that hangs is stopped and reported


@dataclass
class Lab:
    min_ranks: int          # fewer GPUs than this: skipped, with `needs` as the reason
    needs: str
    gpu_flags: object       # a function: ranks used -> the lab's flags on GPUs
    cpu_flags: str          # its flags in the CPU smoke run
    torchrun: bool = True   # False: the lab starts its own ranks (launch), as it must to stop a hung one


# The size on GPUs that shows each lab's effect. A lab compares with one process only below 5M parameters, so
# the labs whose claim is parity stay below it, in fp32 (their tolerance is float32 rounding); the others grow to
# where bytes and memory are large, in the labs' default precision on GPUs (bf16 autocast; ZeRO: bf16 weights).
LABS = {
    # replicas stay identical and equal one process (whose reference runs on rank 0's CPU: keep it small). At the
    # lab's default lr 1e-2 Adam grows float32 rounding into a different trajectory within 20 steps (a 7e-2 loss
    # gap on one H200 against the CPU; fp32 against fp64 on the CPU alone, the same); at 1e-3 it stays below 1e-6
    # on the CPU and was 3.3e-6 on the H200
    "training_step": Lab(1, "", lambda n: f"--hidden 128 --global-batch-size {4 * n} --seq-len 64 --steps 20 "
                         "--lr 1e-3 --dtype fp32",
                         "--steps 5 --dtype fp32"),
    # 100M parameters, 400 MB of gradients a step: naive, bucketed and torch's DDP apart
    "ddp": Lab(1, "", lambda n: "--hidden 1024 --layers 8 --micro-batch-size 8 --seq-len 256 --bucket-mb 25 --steps 20",
               "--steps 4"),
    # the same 100M parameters in bf16: 1.6 GB of state, then its share per rank at each stage
    "zero": Lab(1, "", lambda n: "--hidden 1024 --layers 8 --micro-batch-size 4 --seq-len 256 --steps 8", "--steps 3"),
    # 8 × 512 tokens through 3M parameters split n ways: parity with one device, the 4 all-reduces per layer
    "tensor_parallel": Lab(2, "TP splits every layer over 2 or more ranks",
                           lambda n: "--hidden 256 --global-batch-size 8 --seq-len 512 --steps 20 --dtype fp32",
                           "--steps 5 --dtype fp32"),
    # one stage per GPU, the bubble from m = 1 to 32 micro-batches
    "pipeline_parallel": Lab(2, "a pipeline has 2 or more stages",
                             lambda n: "--num-microbatches 1 8 32 --op-ms 20 --steps 2 --real --dtype fp32",
                             "--num-microbatches 1 4 --steps 2 --real --dtype fp32"),
    # dp = n / 4 replicas of a tp 2 × pp 2 grid
    "parallel_3d": Lab(4, "tp 2 × pp 2 (× dp)",
                       lambda n: f"--tp 2 --pp 2 --hidden 512 --layers 8 --seq-len 128 --global-batch-size {16 * (n // 4)} "
                                 "--num-microbatches 4 --steps 5", "--tp 2 --pp 2 --steps 3"),
    # save in one layout (8 GPUs: dp 2 × tp 2 × pp 2, ZeRO-1), resume in another on NCCL, float64 parity
    "checkpoint": Lab(1, "", lambda n: "--no-kill --steps 8", "--no-kill --steps 6 --every 2 --kill-at 3"),
    # one step of DDP, FSDP and TP profiled on every GPU, merged; then a hang read by the flight recorder
    "profiling": Lab(2, "a timeline of ranks and a hang between them need 2 or more",
                     lambda n: f"--hidden 1024 --layers 8 --seq-len 256 --global-batch-size {4 * n} --steps 2",
                     "--steps 1", torchrun=False),
}


def ranks_for(name: str, gpus: int) -> int:
    """How many ranks a lab runs on ``gpus`` GPUs (0 = on CPU): all of them, as far as the lab can split itself."""
    if gpus == 0:
        return 4 if name == "parallel_3d" else 2     # gloo ranks are cheap: 3D needs its two 2-wide axes
    if name in ("tensor_parallel", "profiling"):     # TP must divide the model's key/value heads
        return max(d for d in (1, 2, 4, 8, 16) if d <= gpus)
    if name == "parallel_3d":
        return 4 * (gpus // 4)
    if name == "checkpoint":                         # its layouts: 8, 4, 2 or 1 ranks
        return max(d for d in (1, 2, 4, 8) if d <= gpus)
    return gpus


def gpu_folder(gpus: int, device_name: str) -> str:
    """The folder a GPU box's results go in, named by its machine: "gpu-8x-nvidia-h100-80gb-hbm3"."""
    return f"gpu-{gpus}x-" + re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def skip_reason(name: str, gpus: int) -> str | None:
    """Why a lab cannot run on ``gpus`` GPUs, or None when it can (always on CPU: gloo ranks)."""
    lab = LABS[name]
    if ranks_for(name, gpus) < lab.min_ranks:
        return f"needs {lab.min_ranks} GPUs ({lab.needs}), found {gpus}"
    return None



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
        topology = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
        machine["topology"] = re.sub(r"\x1b\[[0-9;]*m", "", topology)    # its header is underlined for a terminal
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
    """torchrun the lab (or run it with python, for a lab that starts its own ranks); return the command (as one
    would type it), its exit status (None: stopped after LAB_TIMEOUT) and seconds. Its whole output goes to
    out/logs/<lab>.log."""
    script = os.path.relpath(LABS_DIR / f"{name}.py")
    if name == KERNELS:
        command = ["python", script, "--out", str(out), *flags]
    else:
        starter = ["torchrun", "--standalone", "--nproc-per-node", str(ranks), script]
        if not LABS[name].torchrun:
            starter = ["python", script, "--world-size", str(ranks)]
        command = [*starter, "--backend", backend, "--out", str(out), *flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").unlink(missing_ok=True)        # a stale JSON must not pass for this run's
    start = time.perf_counter()
    with open(out / "logs" / f"{name}.log", "w") as log:
        print(" ".join(command), file=log, flush=True)
        # torchrun is torch.distributed.run of this Python; in its own session, so that a hung lab is stopped
        # as a whole (torchrun passes SIGTERM on to its ranks)
        runner = [sys.executable, "-m", "torch.distributed.run"] if command[0] == "torchrun" else [sys.executable]
        process = subprocess.Popen([*runner, *command[1:]], stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
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


def summary(report: dict, kernel_rows: list | None = None) -> str:
    """One page of Markdown: what ran where, the bandwidth, every check, and the kernel rates (``kernel_rows``,
    labs/kernel_rates.py's rows) when they were measured."""
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
    if kernel_rows:
        from kernel_rates import table  # here, not at the top: it needs torch.nn.attention's newer backends
        lines += ["", "## Kernel rates beside the step-time model's constants (`labs/kernel_rates.py`)", "", "```",
                  table(kernel_rows), "```", "", "![](kernel_rates.png)"]
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
    parser.add_argument("--no-kernels", dest="kernels", action="store_false",
                        help="leave out the kernel rates (labs/kernel_rates.py)")
    parser.add_argument("--out", type=writable_folder,
                        help="where the results go (a folder; default: on GPUs labs/results/gpu-<N>x-<GPU name>, "
                             "which the notebooks show and git keeps; on a CPU labs/results)")
    args = parser.parse_args()
    start, gpus = time.perf_counter(), torch.cuda.device_count()
    if args.out is None:
        args.out = RESULTS / gpu_folder(gpus, torch.cuda.get_device_name(0)) if gpus else RESULTS
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
    names = ([KERNELS] if args.kernels else []) + args.labs
    for i, name in enumerate(names, 1):
        ranks, why = (1, None) if name == KERNELS else (ranks_for(name, gpus), skip_reason(name, gpus))
        if why:
            print(f"[{i}/{len(names)}] {name}: skipped: {why}")
            labs.append({"lab": name, "ranks": 0, "dtype": None, "seconds": 0.0, "status": f"skipped: {why}",
                         "command": None})
            checks.append(Check(name, "lab ran", f"{LABS[name].min_ranks} GPUs", f"{gpus} GPUs", "skipped"))
            continue
        flags = "" if name == KERNELS else LABS[name].gpu_flags(ranks) if gpus else LABS[name].cpu_flags
        command, code, seconds = run_lab(name, ranks, backend, flags.split(), args.out)
        status = "ran" if code == 0 else f"stopped after {LAB_TIMEOUT} s" if code is None else f"failed (exit {code})"
        print(f"[{i}/{len(names)}] {name}: {ranks} rank{'s' * (ranks > 1)}, {seconds:.1f} s, {status}: "
              f"{' '.join(command)}")
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
    write_atomically(args.out / "check_gpu.json", lambda partial: partial.write_text(json.dumps(report, indent=1)))
    kernel_record = args.out / f"{KERNELS}.json"
    ran = any(lab["lab"] == KERNELS and lab["status"] == "ran" for lab in labs)
    kernel_rows = json.loads(kernel_record.read_text())["rows"] if ran and kernel_record.exists() else None
    write_atomically(args.out / "summary.md", lambda partial: partial.write_text(summary(report, kernel_rows)))
    print("\n".join(["not measured:"] + not_measured(checks)))
    failed = [c for c in checks if c.verdict == "FAIL"]
    print(f"{len(failed)} of {len(checks)} checks failed; {report['seconds']:.0f} s; wrote {args.out / 'summary.md'}, "
          "check_gpu.json, bandwidth.png and each lab's JSON and PNG")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
