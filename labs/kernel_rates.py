"""Lab: this device's kernel rates, measured, beside the constants the step-time model (course_lib.cost) uses.

    python labs/kernel_rates.py                 # a GPU: training-sized kernels; a CPU: tiny ones (a smoke run)
    python labs/kernel_rates.py --out /tmp/k    # results elsewhere (default: labs/results)

The model times every kernel of a step from constants that cite published benchmarks and, for the memory-bound
ops, this lab's run on one H200 (course_lib.hardware, course_lib.kernel_times). On a GPU of its catalogue (A100,
H100, H200) this lab measures the same kernels and puts each measured rate beside the model's:

* matmul, bf16, by shape (M, N, K): 2·M·N·K FLOPs over the time, against hardware.matmul_rate
  (matmul_share × peak × f(M)·f(N)·f(K)); and the curve's share and half-dimension fitted on this device's GEMMs
  of step shapes (hardware.fit_matmul_curve), beside the model's;
* matmul in fp32 on a GPU, TF32 off as PyTorch leaves it (a few large shapes), against matmul_rate on the fp32 peak
  (hardware.GPU.for_dtype: the model's fp32 jobs, at the 16-bit GEMMs' share, for want of an fp32 benchmark);
* attention, torch's scaled_dot_product_attention forward + backward on each backend (flash, memory-efficient,
  cuDNN), causal or not, by sequence length and head dim, in FlashAttention's own benchmark setting (16k tokens a
  batch, hidden 2,048) and with its FLOP count (3.5 × forward's 4·b·s²·heads·head_dim, half of it causal),
  against kernel_times.attention_rate (FLASH_TFLOPS: FlashAttention-2's and -3's published figures, and
  xformers' memory-efficient kernel's in FlashAttention-2's A100 figure); and standard attention as plain
  PyTorch writes it (FlashAttention's benchmark's attention_pytorch, up to 8k tokens: the scores' square must
  fit), against kernel_times.standard_attention (the model's primitives, matmul and elementwise, on standard
  attention's own passes);
* memory-bound ops (copy, residual add, RMSNorm, SwiGLU's product, cross-entropy over the logits, fused Adam),
  the bytes they must move over the time, against hbm_share × the datasheet's HBM bandwidth × the op's
  kernel_times.STREAM_SHARE (which one H200's run of this lab gave: on another GPU it checks they carry over);
* a kernel launch: the time per tiny op in a long stream of them, against hardware.KERNEL_LAUNCH_S.

Each time is the median of --repeats runs after warm-ups (CUDA events on a GPU). A ratio measured/model above
1 means the model's constant is slower than this device runs that kernel alone; the model's shares are meant to
sit a little low (sustained training runs at lower clocks than a short benchmark: hardware.GEMM_SOURCES).
Before timing, each attention backend is checked against the math backend in float64 on the same inputs (or, for
bf16-only kernels, within bf16's rounding): a wrong kernel must not pass as a fast one.

On a CPU, or a GPU the catalogue does not hold, the model has no constants for it: the rates are measured and
shown, the model's column says "—". Writes kernel_rates.json and kernel_rates.png into --out.
"""

import argparse
import json
import math
import re
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import RESULTS, machine
from course_lib.hardware import GPUS, KERNEL_LAUNCH_S, fit_matmul_curve, matmul_rate
from course_lib.kernel_times import FAMILIES, STREAM_SHARE, attention_rate, standard_attention
from course_lib.runtime.arguments import integer, writable_folder
from course_lib.runtime.files import write_atomically

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
# The model's kernel for each backend: torch's flash backend is FlashAttention-2, its memory-efficient backend
# xformers' kernel; cuDNN's fused attention on Hopper is compared with FlashAttention-3 (the model's "flash3"),
# elsewhere with FlashAttention-2. (The committed H200 run, made before the model had "efficient", recorded its
# memory-efficient rows against "flash".)
MODEL_KERNEL = {"flash": "flash", "efficient": "efficient", "cudnn": "flash3"}

# Sizes. GPU: operands several times the L2 (50-60 MB), each kernel well past its launch. CPU: a smoke run.
GPU_SIZES = {
    # squares, then the shapes of a step: 16k tokens × hidden, and one small dimension (a TP shard, a small batch)
    "matmul": [(n, n, n) for n in (1024, 2048, 4096, 8192, 16384)]
    + [(16384, d, d) for d in (768, 1024, 1536, 2048, 4096, 8192)]
    + [(16384, 4 * d, d) for d in (768, 2048, 4096)]
    + [(16384, 128, 4096), (16384, 512, 4096), (128, 4096, 4096), (512, 4096, 4096), (16384, 4096, 128)],
    "matmul_fp32": [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 4096), (16384, 14336, 4096)],
    "attention_seq": (512, 2048, 8192, 16384), "attention_head_dim": (64, 128), "attention_tokens": 16384,
    "attention_hidden": 2048, "elements": 16384 * 8192, "vocab": 32768, "adam_params": 64 * 2**20,
}
CPU_SIZES = {"matmul": [(n, n, n) for n in (64, 128, 256)] + [(256, 64, 256)],
             "attention_seq": (64, 128), "attention_head_dim": (64,), "attention_tokens": 256,
             "attention_hidden": 128, "elements": 2**20, "vocab": 1024, "adam_params": 2**18}


def catalogue_gpu(device_name: str):
    """The catalogue's GPU (hardware.GPUS) for a device name torch reports, or None: "NVIDIA H200" -> H200 SXM,
    "NVIDIA H100 80GB HBM3" -> H100 SXM, "NVIDIA A100-SXM4-80GB" -> A100 80GB. A PCIe or NVL part, or a GH200, has
    another clock and bandwidth than the SXM one the catalogue describes: None."""
    name = device_name.upper()
    if "PCIE" in name or "NVL" in name:
        return None
    for family, key in (("H200", "H200 SXM"), ("H100", "H100 SXM"), ("A100", "A100 80GB")):
        if re.search(rf"\b{family}\b", name):        # a whole word: a GH200 superchip is no H200 SXM
            return GPUS["A100 40GB" if family == "A100" and "40GB" in name else key]
    return None


def seconds(work, dev: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``work()``: CUDA events around each run on a GPU (the device's own clock), the wall clock
    on a CPU."""
    for _ in range(warmup):
        work()
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_shape(m: int, n: int, k: int) -> bool:
    """A GEMM of a training step: thousands of tokens (m ≥ 4,096) by weights at least 512 wide. The smaller ones
    measured here are latency- or tile-bound (a TP shard's sliver, a tiny batch), which the curve does not claim."""
    return m >= 4096 and min(n, k) >= 512


def matmul_fit(rows: list[dict], gpu) -> dict | None:
    """hardware.fit_matmul_curve on this device's GEMMs of step shapes: the share of the peak and half-dimension
    that describe it best, beside the model's (None without a catalogue GPU or with fewer than 3 such shapes)."""
    points = [(*row["shape"], row["measured"] * 1e12) for row in rows if row["kind"] == "matmul"
              and step_shape(*row["shape"])]
    if gpu is None or len(points) < 3:
        return None
    rate, half, rms = fit_matmul_curve(points)
    model_logs = [math.log(measured / matmul_rate(gpu, m, n, k)) for m, n, k, measured in points]
    return {"shapes": len(points), "share": rate / gpu.peak_flops, "half_dim": half, "rms_log_error": rms,
            "model_share": gpu.matmul_share, "model_half_dim": gpu.matmul_half_dim,
            "model_rms_log_error": math.sqrt(sum(x * x for x in model_logs) / len(model_logs))}


def measure_matmuls(sizes, dev, dtype, gpu, repeats, kind: str = "matmul") -> list[dict]:
    rows = []
    for m, n, k in sizes:
        a, b = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype)
        out = torch.empty(m, n, device=dev, dtype=dtype)
        rate = 2 * m * n * k / seconds(lambda: torch.mm(a, b, out=out), dev, repeats)
        rows.append({"kind": kind, "name": f"{kind} {m}×{n}×{k}", "shape": [m, n, k], "unit": "TFLOP/s",
                     "measured": rate / 1e12, "model": matmul_rate(gpu, m, n, k) / 1e12 if gpu else None})
    return rows


def attention_inputs(batch, heads, seq_len, head_dim, dev, dtype, seed=0):
    generator = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(batch, heads, seq_len, head_dim, device=dev, dtype=dtype, generator=generator)
            for _ in range(4)]                                   # q, k, v and the output's gradient


def attention_pass(backend, q, k, v, grad_out, causal):
    """Forward and backward through one SDPA backend: (output, dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(BACKENDS[backend]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def check_attention(backend, dev, dtype) -> dict:
    """The backend's output and gradients against the math backend in float64 on the same small inputs: the
    largest |difference| relative to the largest |value| of each tensor, and the bound it must stay under
    (float32 rounding, or bf16's for a bf16 kernel)."""
    inputs = attention_inputs(2, 4, 256, 64, dev, dtype)
    try:
        got = attention_pass(backend, *inputs, causal=True)
    except RuntimeError as error:                   # "No available kernel": not built for this device or dtype
        return {"backend": backend, "available": False, "why": str(error).splitlines()[0][:200]}
    want = attention_pass("math", *(t.double() for t in inputs), causal=True)
    gap = max(((g.double() - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))
    return {"backend": backend, "available": True, "max_relative_diff": gap,
            "bound": 2e-2 if dtype == torch.bfloat16 else 1e-4}


def standard_attention_pass(q, k, v, grad_out, causal):
    """Standard attention as FlashAttention's benchmark scripts write it (attention_pytorch, dropout 0): the
    scaled scores by one batched GEMM, a causal mask added, softmax, the values' GEMM; then backward."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    batch, heads, seq_len, head_dim = q.shape
    scores = torch.baddbmm(torch.empty(batch * heads, seq_len, seq_len, device=q.device, dtype=q.dtype),
                           q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2), beta=0, alpha=head_dim**-0.5)
    if causal:
        scores = scores + torch.triu(torch.full((seq_len, seq_len), -10000.0, device=q.device), 1).to(q.dtype)
    out = torch.bmm(torch.softmax(scores, dim=-1), v.flatten(0, 1)).view_as(q)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def measure_attention(sizes, dev, dtype, gpu, repeats, backends) -> list[dict]:
    """Each SDPA backend in ``backends``, and "standard" (standard_attention_pass: up to 8k tokens, where its
    s×s scores, several times over, still fit), forward + backward at FlashAttention's FLOP count."""
    rows, hidden, tokens = [], sizes["attention_hidden"], sizes["attention_tokens"]
    for backend in backends:
        for head_dim in sizes["attention_head_dim"]:
            for seq_len in (s for s in sizes["attention_seq"] if backend != "standard" or s <= 8192):
                for causal in (True, False):
                    batch, heads = max(1, tokens // seq_len), hidden // head_dim
                    inputs = attention_inputs(batch, heads, seq_len, head_dim, dev, dtype)
                    flops = 3.5 * 4 * batch * heads * seq_len**2 * head_dim * (0.5 if causal else 1)
                    try:
                        time_s = seconds(lambda: standard_attention_pass(*inputs, causal) if backend == "standard"
                                         else attention_pass(backend, *inputs, causal), dev, repeats)
                    except RuntimeError as error:   # a shape a backend does not take; out of memory on a smaller GPU
                        print(f"{backend} s={seq_len} hd={head_dim}: not measured ({str(error).splitlines()[0][:120]})")
                        if isinstance(error, torch.OutOfMemoryError):
                            torch.cuda.empty_cache()
                        continue
                    row = {"kind": f"attention {backend}", "name": f"{backend} {'causal' if causal else 'full'} "
                           f"s={seq_len} hd={head_dim}", "seq_len": seq_len, "head_dim": head_dim, "causal": causal,
                           "unit": "TFLOP/s", "measured": flops / time_s / 1e12, "model_kernel": None, "model": None}
                    if gpu and backend == "standard":
                        model_s = sum(op.seconds for op in standard_attention(
                            gpu, batch * heads, seq_len, head_dim, torch.finfo(dtype).bits // 8, causal))
                        row["model"] = flops / model_s / 1e12
                    elif gpu:
                        model_kernel = MODEL_KERNEL[backend]
                        if model_kernel == "flash3" and FAMILIES.get(gpu.name.split()[0]) != "H100":
                            model_kernel = "flash"                      # FlashAttention-3 runs on Hopper only
                        row["model_kernel"] = model_kernel
                        row["model"] = attention_rate(gpu, model_kernel, seq_len, head_dim, causal) / 1e12
                    rows.append(row)
    return rows


def measure_memory_bound(sizes, dev, dtype, gpu, repeats) -> list[dict]:
    """Memory-bound ops, each with the bytes it must move (read once, written once): achieved GB/s."""
    n, e, vocab = sizes["elements"], torch.finfo(dtype).bits // 8, sizes["vocab"]
    width = 8192 if n % 8192 == 0 and n >= 8192 * 16 else 256
    x, y, out = (torch.randn(n // width, width, device=dev, dtype=dtype) for _ in range(3))
    weight = torch.ones(width, device=dev, dtype=dtype)
    x_grad = x.detach().clone().requires_grad_()
    tokens = n // vocab
    logits = torch.randn(tokens, vocab, device=dev, dtype=dtype, requires_grad=True)
    targets = torch.randint(vocab, (tokens,), device=dev)

    def norm_both_ways():
        x_grad.grad = None                      # else backward adds into it: one more read and write
        F.rms_norm(x_grad, (width,), weight).backward(y)

    def cross_entropy():
        logits.grad = None
        F.cross_entropy(logits, targets).backward()

    params = [torch.randn(sizes["adam_params"], device=dev, requires_grad=True)]
    params[0].grad = torch.randn_like(params[0])
    fused = dev.type == "cuda"                 # one fused kernel on a GPU; the foreach loop on a CPU
    adam = torch.optim.Adam(params, lr=1e-6, fused=fused, foreach=None if fused else True)
    ops = [  # name, work, bytes it must move, the model's operation (its kernel_times.STREAM_SHARE)
        ("copy", lambda: out.copy_(x), 2 * n * e, "copy"),
        ("residual add", lambda: torch.add(x, y, out=out), 3 * n * e, "residual add ×2"),
        ("RMSNorm forward", lambda: F.rms_norm(x, (width,), weight), 2 * n * e, "RMSNorm ×2"),
        ("RMSNorm forward + backward", norm_both_ways, (2 + 3) * n * e, "RMSNorm ×2"),
        ("SwiGLU product silu(gate)·up, eager", lambda: F.silu(x) * y, 3 * n * e, "SwiGLU products"),
        ("cross-entropy forward + backward", cross_entropy, 3 * tokens * vocab * e, "loss (softmax cross-entropy)"),
        ("Adam step (fp32: p, g, m, v read; p, m, v written)", adam.step, 28 * sizes["adam_params"],
         "optimizer (Adam)"),
    ]
    if dev.type == "cuda":          # what a framework's fused kernel reaches: the same ops compiled into one each
        swiglu = torch.compile(lambda gate, up: F.silu(gate) * up)
        norm = torch.compile(lambda t: F.rms_norm(t, (width,), weight))
        ops += [("SwiGLU product, torch.compile (one fused kernel)", lambda: swiglu(x, y), 3 * n * e,
                 "SwiGLU products"),
                ("RMSNorm forward, torch.compile", lambda: norm(x), 2 * n * e, "RMSNorm ×2")]
    copy_rate = gpu.hbm_share * gpu.hbm_bytes_per_s / 1e9 if gpu else None
    rows = []
    for name, work, nbytes, operation in ops:
        try:
            rate = nbytes / seconds(work, dev, repeats) / 1e9
        except Exception as error:      # a compiler missing on this machine, say: the other rows still count
            print(f"{name}: not measured ({type(error).__name__}: {str(error).splitlines()[0][:120]})")
            continue
        rows.append({"kind": "memory-bound", "name": name, "bytes": nbytes, "unit": "GB/s", "measured": rate,
                     "model": copy_rate and copy_rate * STREAM_SHARE.get(operation, 1.0)})
    return rows


def measure_launch(dev, gpu, count: int = 2000) -> dict:
    """Seconds per op in a stream of ``count`` tiny adds: the launch cost that bounds a tiny kernel."""
    x = torch.zeros(1, device=dev)

    def stream():
        for _ in range(count):
            x.add_(1)
    per_op = seconds(stream, dev, repeats=3, warmup=1) / count
    return {"kind": "launch", "name": "one tiny op in a stream", "unit": "µs", "measured": per_op * 1e6,
            "model": KERNEL_LAUNCH_S * 1e6 if gpu else None}


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["model"]] or rows
    values = [r["measured"] / r["model"] if r["model"] else r["measured"] for r in shown]
    fig, ax = plt.subplots(figsize=(8, max(3, 0.18 * len(shown))))
    ax.barh(range(len(shown)), values, color=["C0" if "matmul" in r["kind"] else "C1" if "attention" in r["kind"]
                                              else "C2" for r in shown])
    ax.set_yticks(range(len(shown)), [r["name"] for r in shown], fontsize=6)
    ax.invert_yaxis()
    if shown[0]["model"]:
        ax.axvline(1.0, color="k", lw=1)
    ax.set(xlabel="measured / model" if shown[0]["model"] else "measured rate", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows: list[dict]) -> str:
    lines = [f"{'kernel':<58} {'measured':>12} {'model':>12} {'measured/model':>15}"]
    for r in rows:
        model = f"{r['model']:.4g}" if r["model"] else "—"
        ratio = f"{r['measured'] / r['model']:.2f}" if r["model"] else "—"
        lines.append(f"{r['name']:<58} {r['measured']:>8.4g} {r['unit']:<7} {model:>8} {ratio:>15}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=writable_folder, default=RESULTS, help="where the JSON and PNG go (a folder)")
    parser.add_argument("--repeats", type=integer(1), default=10, help="timed runs per kernel (the median is kept)")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    dtype, sizes = (torch.bfloat16, GPU_SIZES) if on_gpu else (torch.float32, CPU_SIZES)
    device_name = torch.cuda.get_device_name(0) if on_gpu else machine("gloo", 1)   # "AMD EPYC 7B13 (2 cores)"
    gpu = catalogue_gpu(device_name) if on_gpu else None
    print(f"kernel rates on {device_name} ({dtype}); the model's constants: {gpu.name if gpu else 'none for it'}")
    start = time.perf_counter()
    checks = [check_attention(name, dev, dtype) for name in ("flash", "efficient", "cudnn")]
    usable = [c["backend"] for c in checks if c["available"]]
    rows = measure_matmuls(sizes["matmul"], dev, dtype, gpu, args.repeats)
    if on_gpu:                              # a CPU's rows are fp32 already
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")          # TF32 off: PyTorch's default, said here
        try:
            rows += measure_matmuls(sizes["matmul_fp32"], dev, torch.float32, gpu and gpu.for_dtype("fp32"),
                                    args.repeats, kind="matmul fp32")
        finally:
            torch.set_float32_matmul_precision(precision)
    rows += measure_attention(sizes, dev, dtype, gpu, args.repeats, usable + ["standard"])
    rows += measure_memory_bound(sizes, dev, dtype, gpu, args.repeats)
    rows.append(measure_launch(dev, gpu))
    print(table(rows))
    fit = matmul_fit(rows, gpu)
    if fit:
        print(f"GEMMs of step shapes ({fit['shapes']}), fitted: {fit['share']:.2f} of the peak, half-dimension "
              f"{fit['half_dim']:.0f} (rms {fit['rms_log_error']:.3f} in log); the model's: {fit['model_share']:.2f}, "
              f"{fit['model_half_dim']:.0f} (rms {fit['model_rms_log_error']:.3f})")
    for c in checks:
        found = (f"max |Δ| / max |value| {c['max_relative_diff']:.1e} (bound {c['bound']:g})" if c["available"]
                 else f"not available here ({c['why']})")
        print(f"attention {c['backend']} vs math in float64: {found}")
    record = {"device_name": device_name, "model_gpu": gpu.name if gpu else None, "dtype": "bf16" if on_gpu else "fp32",
              "torch": torch.__version__, "cuda": torch.version.cuda, "repeats": args.repeats,
              "attention_checks": checks, "rows": rows, "matmul_fit": fit, "seconds": time.perf_counter() - start,
              "date": time.strftime("%Y-%m-%d", time.gmtime())}
    write_atomically(args.out / "kernel_rates.json", lambda partial: partial.write_text(json.dumps(record, indent=1)))
    plot(rows, f"{device_name}: kernel rates" + (f" vs the model's {gpu.name}" if gpu else ""),
         args.out / "kernel_rates.png")
    print(f"{record['seconds']:.0f} s; wrote {args.out / 'kernel_rates.json'} and kernel_rates.png")


if __name__ == "__main__":
    main()
