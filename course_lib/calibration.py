"""This machine as the cost model's hardware: its rates measured on the kernels that define them, so that
cost.step_time can predict the course's own live runs, and be checked against them (benchmarks/cost_model.py).

The GPU catalogue (course_lib.hardware) takes its figures from spec sheets and kernel benchmarks. Here each one
is measured, by every rank at once as the runs will run (2 ranks on 2 cores: one core each), on kernels and on
a degenerate model, never on the runs the model then predicts:

    matmul     torch.mm in the run's dtype, a weight's three GEMMs (forward, and backward's two with a transposed
               operand, as autograd runs nn.Linear's) on every shape of a grid, m, n, k each 16 to 1,024: the rate
               of each shape is what kernel_times charges all three, 3·2mnk / (their seconds - a launch each);
               step_time reads a shape between the grid's points (hardware.grid_rate). A CPU's rate is no smooth
               curve of the shape: it peaks where the operands fit its caches, and need not rise beyond.
               For the attention's fit and for describe(), peak and x_half of rate = peak · f(m)·f(n)·f(k),
               f(x) = x / (x + x_half), fitted by least squares on log(rate)
    attention  torch's SDPA, causal, forward + backward, 64 tokens, head dims 8 to 128: its rate as a share of
               that peak, × h_d / (h_d + half) (attention_share, attention_half_dim; FLOPs as kernel_times counts
               a causal kernel's, half the square, as FlashAttention does)
    memory     c = a + b on 4M elements: 3 elements moved per element (hbm_bytes_per_s, at share 1)
    Adam       torch.optim.Adam's step on 4M parameters in one tensor, and zeroing their gradient: its bytes a
               parameter at that bandwidth (GPU.optimizer_bytes_per_param; torch's Adam on a CPU runs tensor by
               tensor, some 18 passes over memory, where a GPU's fused one makes 4)
    launch     c = a + b on one element: the least an op takes. On a CPU an op's dispatch runs before its work,
               so the two add (GPU.launch_adds), where a GPU queues kernels ahead and takes the longer
    per layer  a training step of the course's runner (runs.mesh.train_3d, each rank alone, a run's threads) on the
               width-8 model of 3 layers less one of 1 layer, halved, 4 tokens, less what kernel_times says the
               layer's kernels take (its elementwise ops as model.py dispatches them, GPU.eager_elementwise:
               this machine runs the course's model op by op) and what one more layer adds to Adam's step (its
               loop over the layer's tensors, measured apart on the bare model): the framework's own work per
               layer and micro-batch, and per layer once a step
    per step   the 1-layer step less its kernels (layer, head, optimizer) and the per-layer work: the
               framework's own work once a step (the loss, the embedding, the executor, zeroing)
    gloo       course_lib.comm.Comm's all-reduce, all-gather, reduce-scatter and pipeline exchange of 1 to 4M
               elements, each call after 2 ms of matmuls as a run makes them: α and β of α + wire bytes / β by
               least squares for each (GPU.collective_links: gloo's reduce-scatter costs more per wire byte than
               its all-reduce), on every axis of this machine

    measured = launch(measure, 2)[0]; cpu = as_gpu(measured)   # or, in one call: calibrate(2)
    step_time(Job(..., dtype="fp32", gpu=cpu, gpus_per_node=2))

A kernel's or a collective's figure is the mean of its repeats (_seconds says why); a step's, the median of steps;
calibrate() takes the median of each figure over five rounds of all this (one round's figures move by up to half).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .comm import Comm, wire_bytes
from .cost import step_time
from .hardware import GPU, Link, fit_matmul_curve, matmul_rate
from .kernel_times import head_operations, layer_operations, optimizer_operation
from .model import build, loss_fn, preset
from .runs.mesh import train_3d, train_3d_job
from .runtime.arguments import check_whole
from .runtime.launch import launch
from .runtime.workers import threads_per_rank

MATMUL_SIZES = (16, 64, 256, 1024)
ATTENTION_HEAD_DIMS = (8, 16, 32, 64, 128)
COLLECTIVE_SIZES = tuple(4**i for i in range(12))     # 1 to 4M elements
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send")   # send: a pipeline's exchange
DEGENERATE = dict(hidden=8, num_heads=2, num_kv_heads=1, intermediate=8, vocab_size=8, max_seq_len=4)
DTYPE_BYTES = {torch.float32: 4, torch.float64: 8}


def _seconds(work, repeats: int = 15, warmup: int = 3) -> float:
    """The mean time of ``work()`` over ``repeats`` runs, after ``warmup`` runs. The mean, not the median: a step
    is the sum of many such calls, so it takes about the sum of their means, and here the means carry what a
    median leaves out (a small gloo all-reduce's median is 0.6 ms, its mean 1.3-2 ms: one call in several waits
    milliseconds for a thread to be woken on a virtual CPU)."""
    for _ in range(warmup):
        work()
    start = time.perf_counter()
    for _ in range(repeats):
        work()
    return (time.perf_counter() - start) / repeats


def measure(rank: int, world_size: int, *, dtype=torch.float32) -> dict:
    """A worker for ``launch``: every measurement of the module docstring on this rank, as plain numbers."""
    comm = Comm()
    one = torch.ones(1, dtype=dtype)
    comm.barrier()                                      # each phase starts on every rank at once
    launch_s = _seconds(lambda: torch.add(one, one), repeats=200)
    matmuls = []
    for m in MATMUL_SIZES:
        for k in MATMUL_SIZES:
            for n in MATMUL_SIZES:
                matmuls += _gemms(m, k, n, dtype)
    big = [torch.randn(4 * 2**20, dtype=dtype) for _ in range(3)]
    comm.barrier()
    stream_s = _seconds(lambda: torch.add(big[0], big[1], out=big[2]), repeats=7)
    comm.barrier()
    adam_s = _adam_seconds(big[0].numel(), dtype)
    collectives = {op: _collective_seconds(comm, op, world_size, dtype) for op in COLLECTIVES}
    comm.barrier()
    attention = _attention(dtype)
    comm.barrier()
    steps = _degenerate_steps(dtype)
    return {"dtype_bytes": DTYPE_BYTES[dtype], "launch_s": launch_s, "matmuls": matmuls,
            "stream_bytes_per_s": 3 * big[0].nbytes / stream_s, "adam_s_per_param": adam_s / big[0].numel(),
            "attention": attention, "steps": steps,
            "collectives": collectives, "world_size": world_size}


def _collective_seconds(comm: Comm, op: str, world_size: int, dtype) -> list[tuple[float, float]]:
    """(wire bytes, seconds) of ``op`` through course_lib.comm.Comm, as the runs call it, on 1 to 4M elements a
    rank (an all-gather's output, a reduce-scatter's input); "send": each rank sends its neighbour as many and
    receives as many from the other side at once, the pipeline's exchange."""
    points = []
    for numel in COLLECTIVE_SIZES:
        part = torch.ones(max(numel // world_size, 1), dtype=dtype)
        whole = torch.ones(part.numel() * world_size, dtype=dtype)
        received = torch.empty_like(whole)
        run = {"all_reduce": lambda: comm.all_reduce(whole),
               "all_gather": lambda: comm.all_gather(whole, part),
               "reduce_scatter": lambda: comm.reduce_scatter(part, whole),
               "send": lambda: [work.wait() for work in comm.exchange(
                   sends=[(whole, (comm.rank + 1) % world_size)], recvs=[(received, (comm.rank - 1) % world_size)])],
               }[op]
        wire = whole.nbytes if op == "send" else wire_bytes(op, whole.nbytes, world_size)
        comm.barrier()
        points.append((wire, _seconds_after_compute(run, comm)))
    return points


def _seconds_after_compute(work, comm: Comm, repeats: int = 30, warmup: int = 3, compute_s: float = 2e-3) -> float:
    """The mean time of ``work()``, each call after about ``compute_s`` of matmuls, as a run calls its collectives
    between layers: here a collective issued after computing takes up to twice one issued back to back (gloo's
    threads, idle meanwhile, are slow to wake on a virtual CPU). The same matmuls on every rank, not the same
    time: a rank that computed slower arrives later, and the others wait for it inside ``work()``, as in a run."""
    a = torch.randn(128, 128)
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    matmuls = max(1, round(compute_s / ((time.perf_counter() - start) / 10)))
    matmuls = torch.tensor([matmuls])
    comm.all_reduce(matmuls, op=dist.ReduceOp.MAX)                  # the same count on every rank
    times = []
    for _ in range(warmup + repeats):
        for _ in range(int(matmuls)):
            a @ a
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.mean(times[warmup:])


def _gemms(m: int, k: int, n: int, dtype) -> list[tuple[int, int, int, float]]:
    """A weight's three GEMMs as kernel_times counts them, each (m, n, k, seconds) of an [m, k] × [k, n]: forward
    [m, k] × [k, n], the input's gradient [m, n] × [n, k] and the weight's [n, m] × [m, k], as autograd runs an
    nn.Linear's (its weight stored [n, k]; the transposes are views, not copies)."""
    x, w, dy = (torch.randn(rows, cols, dtype=dtype) for rows, cols in ((m, k), (n, k), (m, n)))
    return [(m, n, k, _seconds(lambda: torch.mm(x, w.t()), repeats=7)),
            (m, k, n, _seconds(lambda: torch.mm(dy, w), repeats=7)),
            (n, k, m, _seconds(lambda: torch.mm(dy.t(), x), repeats=7))]


def _adam_seconds(numel: int, dtype) -> float:
    """torch.optim.Adam's step on one flat tensor of ``numel`` (as a ZeRO unit's), and zeroing its gradient."""
    weight = torch.nn.Parameter(torch.randn(numel, dtype=dtype))
    weight.grad = torch.randn(numel, dtype=dtype)
    optimizer = torch.optim.Adam([weight], lr=1e-3)

    def step():
        optimizer.step()
        weight.grad.zero_()
    return _seconds(step, repeats=5, warmup=2)


def _attention(dtype) -> list[dict]:
    """Causal SDPA forward + backward on [1, 8 heads, 64 tokens, h_d] for each head dim: shape and seconds."""
    runs = []
    for head_dim in ATTENTION_HEAD_DIMS:
        q, k, v = (torch.randn(1, 8, 64, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))

        def run():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        runs.append({"heads": 8, "seq_len": 64, "head_dim": head_dim, "seconds": _seconds(run, repeats=9)})
    return runs


def _degenerate_steps(dtype, repeats: int = 31) -> dict:
    """Training steps of the width-8 model with 1 and with 2 layers on 4 tokens, alternated so that both meet the
    same machine: each one's median forward + backward seconds, and its Adam step's (with zero_grad)."""
    models = {layers: build(preset("tiny", num_layers=layers, **DEGENERATE), dtype=dtype) for layers in (1, 2)}
    optimizers = {layers: torch.optim.Adam(model.parameters(), lr=1e-3) for layers, model in models.items()}
    tokens = torch.randint(0, 8, (1, 4))
    times = {layers: {"forward_backward_s": [], "update_s": []} for layers in models}
    for repeat in range(repeats + 3):
        for layers, model in models.items():
            start = time.perf_counter()
            loss_fn(model(tokens), tokens).backward()
            middle = time.perf_counter()
            optimizers[layers].step()
            optimizers[layers].zero_grad()
            if repeat >= 3:                              # the first three warm up
                times[layers]["forward_backward_s"].append(middle - start)
                times[layers]["update_s"].append(time.perf_counter() - middle)
    return {layers: {part: statistics.median(values) for part, values in parts.items()}
            for layers, parts in times.items()}


def _fit_matmul(matmuls, launch_s: float) -> tuple[float, float]:
    """(peak, x_half) of rate = peak · f(m)·f(n)·f(k) that fit the measured rates best in log space."""
    peak, half, _ = fit_matmul_curve((m, n, k, 2 * m * n * k / max(seconds - launch_s, 1e-9))
                                     for m, n, k, seconds in matmuls)
    return peak, half


def _matmul_grid(matmuls, launch_s: float) -> tuple:
    """((m, n, k, rate), ...): each weight's three GEMMs (_gemms, in threes) as kernel_times.matmul charges them,
    one rate for all three, 3 · 2mnk / their seconds (less a launch each: a CPU adds it, GPU.launch_adds)."""
    grid = []
    for first in range(0, len(matmuls), 3):
        m, n, k, _ = matmuls[first]
        work = sum(max(seconds - launch_s, 1e-9) for *_, seconds in matmuls[first:first + 3])
        grid.append((m, n, k, 3 * 2 * m * n * k / work))
    return tuple(grid)


def _fit_attention(runs: list[dict], peak: float, half: float, launch_s: float) -> tuple[float, float]:
    """(share, head-dim half) of rate = share · peak · f(s) · h_d / (h_d + half) that fit the measured SDPA runs
    best in log space; FLOPs as kernel_times counts a causal kernel's: 3.5 × forward's, half the square."""
    points = []
    for run in runs:
        s, heads, h_d = run["seq_len"], run["heads"], run["head_dim"]
        flops = 3.5 * 4 * heads * s * s * h_d * 0.5
        points.append((h_d, flops / max(run["seconds"] - 3 * launch_s, 1e-9) / (peak * s / (s + half))))

    def error(head_half: float) -> tuple[float, float]:
        logs = [math.log(share) - math.log(h_d / (h_d + head_half)) for h_d, share in points]
        mean = sum(logs) / len(logs)
        return sum((x - mean) ** 2 for x in logs), math.exp(mean)
    (_, share), head_half = min((error(h), h) for h in (2 ** (i / 4) for i in range(41)))
    return share, head_half


def _fit_link(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(α, β) of seconds = α + wire bytes / β over the measured all-reduces, by least squares on the relative
    error (weights 1/seconds²: a 4-byte call counts as much as a 16 MB one)."""
    weights = [1 / y**2 for _, y in points]
    total = sum(weights)
    mean_x = sum(w * x for w, (x, _) in zip(weights, points)) / total
    mean_y = sum(w * y for w, (_, y) in zip(weights, points)) / total
    slope = (sum(w * (x - mean_x) * (y - mean_y) for w, (x, y) in zip(weights, points))
             / sum(w * (x - mean_x) ** 2 for w, (x, _) in zip(weights, points)))
    return max(mean_y - slope * mean_x, 0.0), 1 / slope


def as_gpu(measured: dict, name: str = "this machine (measured)") -> GPU:
    """The measurements as a hardware.GPU that cost.step_time takes: shares of 1 where the rate is measured."""
    launch_s, e = measured["launch_s"], measured["dtype_bytes"]
    peak, half = _fit_matmul(measured["matmuls"], launch_s)
    grid = _matmul_grid(measured["matmuls"], launch_s)
    attention_share, attention_half = _fit_attention(measured["attention"], peak, half, launch_s)
    links = {}
    for op, points in measured["collectives"].items():
        alpha, beta = _fit_link(points)
        links[op] = Link(f"gloo's {op} on this machine (measured)", beta, alpha,
                         f"course_lib.calibration: Comm's {op} of 1 to 4M elements, α + wire bytes / β fitted")
    link = links["all_reduce"]
    source = f"course_lib.calibration on this machine, {measured['world_size']} ranks at once"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu = GPU(name, peak, memory, measured["stream_bytes_per_s"], link, link, source, matmul_share=1.0,
              attention_share=attention_share, matmul_half_dim=half, attention_half_dim=attention_half,
              hbm_share=1.0, launch_s=launch_s, launch_adds=True, matmul_grid=grid, nccl_rings=False,
              eager_elementwise=True,
              optimizer_bytes_per_param=measured["adam_s_per_param"] * measured["stream_bytes_per_s"],
              collective_links=tuple(links.items()))
    return _with_overheads(gpu, measured, e)


def runner_steps(rank: int, world_size: int, *, dtype=torch.float32, threads: int = 1, rounds: int = 2,
                 steps: int = 12) -> dict[int, float]:
    """A worker for ``launch``: the course's own runner (runs.mesh.train_3d: parallelize, the pipeline executor, the
    optimizer) on the width-8 model of 1 and of 3 layers, 4 tokens, on ``threads`` threads (what each rank of the
    runs gets): each one's median step, over ``rounds`` runs of each, alternated so that both meet the same
    machine. On every rank at once, each alone: a rank leaves the world's group for a one-rank group of its own,
    so that its work is measured beside the other ranks' work, as in a run (here that costs 10-20% more than
    alone on the machine), with no collective between them."""
    if world_size > 1:
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(threads)
    seconds = {1: [], 3: []}
    for _ in range(rounds):
        for layers, times in seconds.items():
            times += train_3d(0, 1, steps=steps, batch_size=1, seq_len=4, num_microbatches=1, dtype=dtype,
                              return_params=False, num_layers=layers, **DEGENERATE)["step_seconds"][2:]
    return {layers: statistics.median(times) for layers, times in seconds.items()}


def _with_overheads(gpu: GPU, measured: dict, e: int) -> GPU:
    """The framework's work per layer and per step: the degenerate steps (the course's runner's, where measured,
    else the bare model's), less what kernel_times counts for their kernels."""
    config = preset("tiny", num_layers=1, **DEGENERATE)
    kernels = dict(micro_batch_size=1, seq_len=4, bytes_per_element=e)
    layer_kernels = sum(op.seconds for op in layer_operations(config, gpu, **kernels))
    head_kernels = sum(op.seconds for op in head_operations(config, gpu, **kernels))
    optimizer = optimizer_operation(gpu, sum(p.numel() for p in build(config).parameters()), e).seconds
    bare = measured["steps"]
    per_layer_update = max(bare[2]["update_s"] - bare[1]["update_s"], 0.0)     # Adam's loop over one more layer
    steps = measured.get("runner_steps") or {n: bare[n]["forward_backward_s"] + bare[n]["update_s"] for n in (1, 2)}
    few, many = sorted(steps)                                                    # layers
    per_layer = max((steps[many] - steps[few]) / (many - few) - layer_kernels - per_layer_update, 0.0)
    per_step = steps[few] - few * (layer_kernels + per_layer + per_layer_update) - head_kernels - optimizer
    return replace(gpu, layer_overhead_s=per_layer, layer_update_overhead_s=per_layer_update,
                   step_overhead_s=max(per_step, 0.0))


def calibrate(world_size: int = 2, *, dtype=torch.float32, rounds: int = 5, between=None) -> GPU:
    """This machine measured by ``world_size`` ranks at once (rank 0's figures, and the course's runner's own
    work, the ranks' mean; each the median of ``rounds`` rounds, a few seconds each: this machine's figures move
    by half from one round to the next), as a hardware.GPU.
    ``between()``, if given, runs after each round: a benchmark's own runs, so that both meet the same machine."""
    check_whole("world_size", world_size)                             # before anything starts
    check_whole("rounds", rounds)
    threads = threads_per_rank(world_size)                             # as each rank of the runs gets
    measurements = []
    for _ in range(rounds):
        measured = launch(measure, world_size, dtype=dtype)[0]
        runner = launch(runner_steps, world_size, dtype=dtype, threads=threads)
        measured["runner_steps"] = {layers: statistics.mean(rank[layers] for rank in runner) for layers in runner[0]}
        measurements.append(measured)
        if between is not None:
            between()
    measured = _median_of(measurements)
    return as_gpu(measured)


def check_live_runs(runs: dict[str, dict], *, world_size: int = 2, batch_size: int = 8, seq_len: int = 64,
                    steps: int = 8, rounds: int = 3) -> tuple[GPU, list[dict]]:
    """cost.step_time on this machine against its own live runs, which it never saw. ``runs``: a name -> train_3d's
    keywords (a layout: dp, tp, pp, zero_stage, num_microbatches, 1 unless given; anything else changes the tiny
    model, e.g. hidden=640), each priced as the Job train_3d runs (runs.mesh.train_3d_job), in fp32 on gloo, with
    no overlap (the course's wrappers wait for each collective) and the pipeline's sends asynchronous (its
    executor waits for a stage's input, never for its own sends: step_time's pipeline_sends="async"). Each run is
    measured after each calibration round (the median of its steps after the first, on its slowest rank), so that
    a slow spell of a shared machine meets both; its figure is the median over rounds. Returns the calibrated
    machine and, per run, its "run", "predicted_s", "measured_s", "ratio" (predicted / measured),
    "measured_rounds_s" (each round's figure: how steady the machine was), and the part of the step spent in
    collectives, "predicted_collectives_s" (step_time's tp_s + dp_s) and "measured_collectives_s" (train_3d's
    collective_seconds, the ranks' mean of their medians, the median over rounds)."""
    check_whole("steps", steps, low=2)                           # the first step is a warm-up, left out
    runs = {name: {"num_microbatches": 1, **keywords} for name, keywords in runs.items()}
    jobs = {name: train_3d_job(world_size, batch_size=batch_size, seq_len=seq_len, **keywords)
            for name, keywords in runs.items()}                # every run's rules checked before anything starts
    measured, collectives = {name: [] for name in runs}, {name: [] for name in runs}

    def run_each():
        for name, keywords in runs.items():
            results = launch(train_3d, world_size, steps=steps, batch_size=batch_size, seq_len=seq_len,
                             dtype=torch.float32, return_params=False, timeout=600, **keywords)
            measured[name].append(max(statistics.median(result["step_seconds"][1:]) for result in results))
            collectives[name].append(statistics.mean(statistics.median(result["collective_seconds"][1:])
                                                     for result in results))
    machine = calibrate(world_size, rounds=rounds, between=run_each)
    rows = []
    for name, job in jobs.items():
        job = job.replace(dtype="fp32", gpu=machine, gpus_per_node=world_size)
        step = step_time(job, pipeline_sends="async")
        real = statistics.median(measured[name])
        rows.append({"run": name, "predicted_s": step.total_s, "measured_s": real, "ratio": step.total_s / real,
                     "measured_rounds_s": tuple(measured[name]), "predicted_collectives_s": step.tp_s + step.dp_s,
                     "measured_collectives_s": statistics.median(collectives[name])})
    return machine, rows


def _median_of(rounds: list[dict]) -> dict:
    """measure()'s figures, each the median of its value over ``rounds`` (a list of measure()'s results)."""
    def median(values):
        first = values[0]
        if isinstance(first, dict):
            return {key: median([value[key] for value in values]) for key in first}
        if isinstance(first, (list, tuple)):
            return type(first)(median(list(column)) for column in zip(*values))
        if isinstance(first, float):
            return statistics.median(values)
        return first                                    # a count or a shape: the same in every round
    return median(rounds)


def describe(gpu: GPU) -> str:
    """The measured figures in one paragraph, for a benchmark's or a notebook's output."""
    return (f"matmul peak {gpu.peak_flops / 1e9:.1f} GFLOP/s (x_half {gpu.matmul_half_dim:.0f}; a 512² GEMM: "
            f"{matmul_rate(gpu, 512, 512, 512) / 1e9:.1f}), attention at {gpu.attention_share:.0%} of it (head-dim "
            f"half {gpu.attention_half_dim:.0f}), memory {gpu.hbm_bytes_per_s / 1e9:.1f} GB/s (Adam: "
            f"{gpu.optimizer_bytes_per_param:.0f} bytes a parameter), an op {gpu.launch_s * 1e6:.1f} µs, per layer "
            f"{gpu.layer_overhead_s * 1e3:.2f} ms (and {gpu.layer_update_overhead_s * 1e3:.2f} ms a step), per step "
            f"{gpu.step_overhead_s * 1e3:.2f} ms, gloo all-reduce α "
            f"{gpu.nvlink.alpha_s * 1e6:.0f} µs, β {gpu.nvlink.bytes_per_s / 1e9:.2f} GB/s")
