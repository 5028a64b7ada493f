"""A small catalogue of GPUs and the links between them, each figure with its source.

Every number in the first table is a spec-sheet figure, not a measurement: what the vendor promises. Real
kernels reach less: a matmul reaches a share of the dense peak that depends on its shape (the curve below,
from published GEMM benchmarks), FlashAttention a smaller one. course_lib.kernel_times times every operation of a
step with these. The links are priced at their rated speed: across nodes nccl-tests' bus bandwidth comes within
~5% of it (link_for's sources); inside a node NCCL reaches less of NVLink's, which the model does not take off.

    GPU          dense bf16 peak   memory    HBM bandwidth   NVLink per GPU, each way   network per GPU
    A100 40GB      312 TFLOP/s     40 GiB     1,555 GB/s      300 GB/s (NVLink 3)       200 Gb/s HDR IB
    A100 80GB      312 TFLOP/s     80 GiB     2,039 GB/s      300 GB/s (NVLink 3)       200 Gb/s HDR IB
    H100 SXM       989 TFLOP/s     80 GiB     3,350 GB/s      450 GB/s (NVLink 4)       400 Gb/s NDR IB
    H200 SXM       989 TFLOP/s    141 GiB     4,800 GB/s      450 GB/s (NVLink 4)       400 Gb/s NDR IB

"Dense" means without 2:4 structured sparsity: NVIDIA's headline Tensor Core figures are often the sparse
ones, twice these. A job in fp32 runs on the CUDA cores instead (GPU.for_dtype: TF32 is off by default): 19.5
TFLOP/s on an A100, 67 on an H100 or H200. NVLink is quoted by NVIDIA as the total of both directions (600 and
900 GB/s); one GPU sends at half of it. A network card's rate is in bits: 400 Gb/s = 50 GB/s each way. One card
per GPU is the DGX layout (8 GPUs, 8 compute NICs per node), and Llama 3's cluster's (400 Gb/s per GPU).

Latency is not on any spec sheet. A collective's comes from NCCL's own model of its rings (ring_latency: a
base, then a hop per step of the ring, so it grows with the group). A point-to-point send's (a Link's alpha_s)
is an assumption of the right order, stated as such: nccl-tests report times of order 10 µs for tiny messages
inside one NVSwitch node; the Llama 3 paper (section 3.3.3) gives "latency up to tens of microseconds" across
its multi-hop network.

Memory is in GiB, as nvidia-smi and course_lib.units count it: the A100 80GB holds 81,920 MiB = 80 GiB, so
the "GB" of the GPU names are GiB. (The H100's driver shows a little less, 81,559 MiB: some of it is reserved.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .comm import CostModel
from .runtime.arguments import is_number
from .units import GiB

GB = 10**9                     # bandwidths are decimal: 1 GB/s = 10**9 bytes per second
TERA = 10**12

A100_DATASHEET = ("NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/"
                  "pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): BF16 Tensor Core 312 TFLOPS (624 with "
                  "sparsity), FP32 19.5; 40GB HBM2 1,555 GB/s, 80GB HBM2e 2,039 GB/s (SXM); NVLink 600 GB/s")
H100_DATASHEET = ("NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100/): H100 SXM BF16 Tensor "
                  "Core 1,979 TFLOPS with sparsity = 989 dense, FP32 67; 80GB HBM3, 3.35 TB/s; NVLink 900 GB/s")
H200_DATASHEET = ("NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200/): H200 SXM BF16 Tensor "
                  "Core 1,979 TFLOPS with sparsity = 989 dense, FP32 67; 141GB HBM3e, 4.8 TB/s; NVLink 900 GB/s")


# ----------------------------------------------------------------------------- what kernels reach
#
# A matmul [M, K] × [K, N] runs at  rate = matmul_share · peak · f(M) · f(N) · f(K),  f(x) = x / (x + x_half):
# a large GEMM reaches matmul_share of the peak; a dimension of x_half elements halves that (the tile edge of
# cuBLAS's large Tensor Core kernels is 128 or 256: a dimension smaller than a tile leaves most of each tile, and
# with it of each SM, idle), 4·x_half costs a fifth, 16·x_half 6%. The curve is a stated smoothing of published
# benchmark figures (GEMM_SOURCES), fitted to no measurement: it ignores wave quantization (a last partial wave of
# tiles) and alignment, which make real curves saw-toothed by up to ~10% around it.
MATMUL_HALF_DIM = 128
# Measured on one H200 (labs/kernel_rates.py, labs/results/gpu-1x-nvidia-h200; tests/test_cost.py holds the
# bands): the GEMMs of a training step (16k tokens × 2k-16k) ran 0.85-1.3 × this curve (8192³: 1.2, the share
# sits low on purpose); small ones ran below it (128×4096×4096: 0.35, 1024³: 0.2), too few tiles for 132 SMs.
# Fitted on its GEMMs of step shapes alone (fit_matmul_curve; labs/kernel_rates.matmul_fit), the H200 gives a share
# of 0.78 with x_half 304, about half the curve's rms error: steeper for a small dimension. Not taken: on the
# published runs it does worse (for H100 and H200: 202 of 225 within 5 points, against 208), and one H200 says
# nothing of the A100.
# A memory-bound kernel streams at most ~85% of the spec-sheet HBM bandwidth (STREAM-style copy benchmarks on
# A100 and H100 reach 80-90% of it: refresh, page switches and the write turnaround cost the rest).
HBM_SHARE = 0.85
# On one H200 (as above) a copy streamed 0.97 and a residual add 1.03 × 0.85 × 4.8 TB/s; ops that do more than
# stream ran slower: torch's RMSNorm 0.60 (compiled 0.66), SwiGLU's product 0.60 (compiled 0.80), fused Adam
# 0.73, cross-entropy 0.35: kernel_times.STREAM_SHARE times each of those ops at its own share.
# A kernel costs at least its launch: the CPU enqueues one every few microseconds (CUDA Graphs exist to avoid
# this). Each operation of course_lib.kernel_times takes at least  kernels × KERNEL_LAUNCH_S.
KERNEL_LAUNCH_S = 5e-6   # a launch overlaps the GPU's work on the one before; an eager PyTorch op took 9.5 µs of
                         # host time on the H200 box measured here (labs/results/gpu-1x-nvidia-h200; 8.8-11.9 over
                         # 4 runs), the floor of a chain of small ops that wait on the host: not taken (an open
                         # question; the published runs are large enough that no op sits on its launch floor)

@dataclass(frozen=True)
class Link:
    """One GPU's connection to its peers: bytes it can send per second (each direction) and a latency."""
    name: str
    bytes_per_s: float        # per GPU, one direction: the β of comm.CostModel
    alpha_s: float            # seconds per send whatever its size (an assumption: the module docstring); a
                              # catalogue GPU's collectives take ring_latency's instead
    source: str

    def cost_model(self) -> CostModel:
        """comm.CostModel(alpha, beta): time = alpha + wire bytes / beta, with wire bytes as comm.wire_bytes."""
        return CostModel(alpha=self.alpha_s, beta=self.bytes_per_s)


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float         # dense bf16 Tensor Core peak, FLOP/s
    memory_bytes: int
    hbm_bytes_per_s: float
    nvlink: Link              # to the other GPUs of its node
    network: Link             # to GPUs in other nodes (its own NIC)
    source: str
    matmul_share: float = 0.8        # share of the peak a large bf16 GEMM reaches (GEMM_SOURCES)
    attention_share: float = 0.55    # FlashAttention's share of the peak, forward + backward, on a GPU that
                                     # kernel_times.FLASH_TFLOPS has no benchmark of (GEMM_SOURCES)
    # The fastest GEMM a search over shapes finds on this GPU, as a share of the peak (MAMF_SOURCE): more than any
    # matmul of a training step reaches for long. course_lib.published's "best kernels" ceiling; 1: no such figure
    best_matmul_share: float = 1.0
    matmul_half_dim: float = MATMUL_HALF_DIM   # a GEMM dimension this small halves its rate (matmul_rate)
    attention_half_dim: float = 0.0            # a head dim this small halves attention's rate (0: no such loss)
    hbm_share: float = HBM_SHARE               # of hbm_bytes_per_s, what a memory-bound kernel streams
    launch_s: float = KERNEL_LAUNCH_S          # the least one kernel (one op) takes
    # A GPU queues kernels ahead of the CPU that launches them, so a kernel takes the longer of its work and its
    # launch; a CPU runs each op's dispatch before its work, so there they add (course_lib.calibration).
    launch_adds: bool = False
    # What the framework spends around the kernels, beyond each op's launch: per layer and micro-batch (forward +
    # backward: module calls, autograd's bookkeeping, hooks), per layer and step (the optimizer's loop over its
    # tensors) and per step (the loss, the embedding, zeroing). 0 on a GPU, which runs ahead of it; measured on
    # the CPU (course_lib.calibration).
    layer_overhead_s: float = 0.0
    layer_update_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    # A collective's latency: NCCL's ring model (ring_latency), or, False, the link's alpha_s (a measured machine's)
    nccl_rings: bool = True
    # A measured machine that runs the course's own model op by op (eager PyTorch): its memory-bound ops as model.py
    # dispatches them (course_lib.eager_traffic), where the catalogue's GPUs run the frameworks' fused kernels
    eager_elementwise: bool = False
    # A measured machine's Adam step, as bytes per parameter at hbm_bytes_per_s (course_lib.calibration: torch's
    # per-tensor Adam makes some 18 passes where a fused one makes 4); 0: the fused count (optimizer_operation)
    optimizer_bytes_per_param: float = 0.0
    # A measured machine's collectives, each with its own α and β: ((op, Link), ...) (course_lib.calibration:
    # gloo's reduce-scatter costs more per wire byte than its all-reduce); (): the node's links serve every op
    collective_links: tuple = ()
    # A measured machine's GEMM rates by shape (course_lib.calibration): ((m, n, k, FLOP/s), ...) on a grid, read
    # by matmul_rate in place of the curve. Empty for the catalogue's GPUs, whose curve cites its sources.
    matmul_grid: tuple = ()
    # The FP32 peak without Tensor Cores (the datasheet's), where fp32 jobs run (for_dtype); 0: none given (step_time
    # refuses an fp32 job on it, unless its GEMMs were measured: a measured machine runs fp32 at its own rates)
    fp32_flops: float = 0.0

    def for_dtype(self, dtype: str) -> GPU:
        """The GPU as the kernels of a job in ``dtype`` see it. In fp32, at fp32_flops in place of the 16-bit peak:
        PyTorch leaves TF32 off for fp32 matmuls (torch.backends.cuda.matmul.allow_tf32 is False by default since
        1.12), and neither torchtitan, Megatron-LM nor DeepSpeed turns it on. The shares stay the 16-bit kernels'
        (no fp32 benchmark is cited here): a GEMM at matmul_share of the FP32 peak, and attention, which has no
        FlashAttention kernel in fp32 (SDPA falls back to its memory-efficient one), at the share of it that
        FlashAttention reaches of the 16-bit peak. MFU stays against peak_flops: how much of the card the job uses."""
        return replace(self, peak_flops=self.fp32_flops) if dtype == "fp32" and self.fp32_flops else self

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte of HBM traffic at which compute and memory take equal time: peak / bandwidth. A kernel
        that does fewer FLOPs per byte it moves waits on memory (the roofline's slanted part)."""
        return self.peak_flops / self.hbm_bytes_per_s


NVLINK_ALPHA_S = 10e-6        # assumed: order of nccl-tests' small-message all-reduce time in one NVSwitch node
NETWORK_ALPHA_S = 20e-6       # assumed: "up to tens of microseconds" across a multi-hop network (Llama 3, 3.3.3)

LINKS = {
    "NVLink 3": Link("NVLink 3 (A100)", 300 * GB, NVLINK_ALPHA_S,
                     A100_DATASHEET + "; 600 GB/s is both directions: 300 GB/s each way"),
    "NVLink 4": Link("NVLink 4 (H100, H200)", 450 * GB, NVLINK_ALPHA_S,
                     H100_DATASHEET + "; 900 GB/s is both directions: 450 GB/s each way"),
    "IB HDR 200": Link("InfiniBand HDR, 200 Gb/s per GPU", 200 * GB / 8, NETWORK_ALPHA_S,
                       "NVIDIA DGX A100 user guide: 8 x ConnectX-6 200 Gb/s HDR InfiniBand compute ports, one per "
                       "GPU (also Selene, Narayanan et al. 2021 section 5: 8 x 200 Gbps HDR per node)"),
    "IB NDR 400": Link("InfiniBand NDR, 400 Gb/s per GPU", 400 * GB / 8, NETWORK_ALPHA_S,
                       "NVIDIA DGX H100/H200 user guide: 8 x ConnectX-7 400 Gb/s NDR ports, one per GPU (Llama 3 "
                       "paper section 3.3.1: 400 Gbps between GPUs, RoCE and InfiniBand alike)"),
}

# Shares of the dense peak (GEMM_SOURCES below): a large bf16 GEMM, and FlashAttention-2 forward + backward.
# The H200 is an H100 with more and faster HBM: the same Tensor Cores and clocks, so the same shares.
A100_MATMUL_SHARE, A100_ATTENTION_SHARE = 0.75, 0.55
H100_MATMUL_SHARE, H100_ATTENTION_SHARE = 0.67, 0.35
# The best a GEMM has been measured to reach, in a search over many shapes (MAMF_SOURCE): 271.2 of the A100's
# 312 TFLOP/s, 794.5 of the H100's 989 (the H200 "the same"; one H200 measured here ran 8192³ at 768).
A100_BEST_MATMUL_SHARE, H100_BEST_MATMUL_SHARE = 271.2 / 312, 794.5 / 989
MAMF_SOURCE = ("Bekman, 'Machine Learning Engineering Open Book', compute/accelerator/README.md, 'Maximum Achievable "
               "Matmul FLOPS comparison table' (github.com/stas00/ml-engineering; mamf-finder.py, a search over GEMM "
               "shapes, mean of 100 runs each): bf16, A100 SXM 271.2 TFLOP/s (86.9%, best shape 1024x10240x5120, "
               "torch 2.6.0+cu126), H100 SXM 794.5 (80.3%, 2048x2048x13312, torch 2.7.0+cu126, 'H200 is the "
               "same'). A short burst at boost clock on one GPU: the ceiling of what any matmul reaches")

GPUS = {
    "A100 40GB": GPU("A100 40GB (SXM)", 312 * TERA, 40 * GiB, 1555 * GB, LINKS["NVLink 3"], LINKS["IB HDR 200"],
                     A100_DATASHEET, A100_MATMUL_SHARE, A100_ATTENTION_SHARE,
                     best_matmul_share=A100_BEST_MATMUL_SHARE, fp32_flops=19.5 * TERA),
    "A100 80GB": GPU("A100 80GB (SXM)", 312 * TERA, 80 * GiB, 2039 * GB, LINKS["NVLink 3"], LINKS["IB HDR 200"],
                     A100_DATASHEET, A100_MATMUL_SHARE, A100_ATTENTION_SHARE,
                     best_matmul_share=A100_BEST_MATMUL_SHARE, fp32_flops=19.5 * TERA),
    "H100 SXM": GPU("H100 SXM 80GB", 989 * TERA, 80 * GiB, 3350 * GB, LINKS["NVLink 4"], LINKS["IB NDR 400"],
                    H100_DATASHEET, H100_MATMUL_SHARE, H100_ATTENTION_SHARE,
                    best_matmul_share=H100_BEST_MATMUL_SHARE, fp32_flops=67 * TERA),
    # The datasheet's "141GB" is read as GiB like the other names; nvidia-smi is reported to show 143,771 MiB
    # (140.4 GiB) on an H200: not checked here.
    "H200 SXM": GPU("H200 SXM 141GB", 989 * TERA, 141 * GiB, 4800 * GB, LINKS["NVLink 4"], LINKS["IB NDR 400"],
                    H200_DATASHEET, H100_MATMUL_SHARE, H100_ATTENTION_SHARE,
                    best_matmul_share=H100_BEST_MATMUL_SHARE, fp32_flops=67 * TERA),
}


def _positive(value) -> bool:
    return is_number(value) and value > 0


def find_gpu(name_or_gpu) -> GPU:
    """A GPU of the catalogue by its key ("H100 SXM"), or a GPU given as it is (for one of your own)."""
    if isinstance(name_or_gpu, GPU):
        gpu = name_or_gpu
        # attention_share is against a fitted matmul peak (course_lib.calibration), which attention may pass
        rates = {"peak_flops": gpu.peak_flops, "hbm_bytes_per_s": gpu.hbm_bytes_per_s, "memory_bytes": gpu.memory_bytes,
                 "nvlink.bytes_per_s": gpu.nvlink.bytes_per_s, "network.bytes_per_s": gpu.network.bytes_per_s,
                 "attention_share": gpu.attention_share}
        shares = {"matmul_share": gpu.matmul_share, "hbm_share": gpu.hbm_share}
        # what a kernel or a step costs on top of its work, and the shape that halves a rate: 0 or more
        costs = {name: getattr(gpu, name) for name in ("matmul_half_dim", "attention_half_dim", "launch_s",
                                                       "layer_overhead_s", "layer_update_overhead_s", "step_overhead_s",
                                                       "optimizer_bytes_per_param", "fp32_flops")}
        bad = [f"{name}={value!r}" for name, value in rates.items() if not _positive(value)]
        bad += [f"{name}={value!r}" for name, value in shares.items() if not (_positive(value) and value <= 1)]
        bad += [f"{name}={value!r}" for name, value in costs.items() if not (is_number(value) and value >= 0)]
        if bad:
            raise ValueError(f"GPU {gpu.name!r}: {', '.join(bad)}: rates and sizes are positive numbers, "
                             "matmul_share and hbm_share in (0, 1], overheads and half dims 0 or more")
        return gpu
    if name_or_gpu not in GPUS:
        raise ValueError(f"unknown GPU {name_or_gpu!r}; the catalogue has {', '.join(GPUS)} "
                         "(or pass a hardware.GPU of your own)")
    return GPUS[name_or_gpu]


GEMM_SOURCES = (
    "large bf16 GEMMs: cuBLAS reaches ~70-85% of the A100's 312 TFLOP/s (NVIDIA's 'Matrix Multiplication "
    "Background User's Guide', docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication; "
    "Anthony et al. 2024, 'The Case for Co-Designing Model Architectures with Hardware', arXiv:2401.14489: GEMM "
    "throughput against the hidden size, low for small and unaligned dimensions) and ~65-75% of the H100 SXM's 989 "
    "(NVIDIA's blog 'New cuBLAS 12.0 Features and Matrix Multiplication Performance on NVIDIA Hopper GPUs', 2023: "
    "about 3x the A100 for large BF16 GEMMs, under the 3.2x of the peaks); FlashAttention-2 forward + backward "
    "reaches 50-73% of the A100's peak (Dao 2023, arXiv:2307.08691) and ~35% of the H100's (Shah et al. 2024, "
    "FlashAttention-3, arXiv:2407.08608, which lifts it to 75%). The shares used, 0.75 (A100) and 0.67 (H100), sit "
    "in those ranges, nearer their low ends: sustained training runs at lower clocks than a short benchmark, and "
    "below the best any shape reaches (MAMF_SOURCE: 0.87 and 0.80). They were checked against the published runs "
    "of course_lib.published, not set per run")


def dimension_factor(x: float, half_dim: float = MATMUL_HALF_DIM) -> float:
    """f(x) = x / (x + half_dim): the share of a large GEMM's rate left by one dimension of size x."""
    return x / (x + half_dim)


def fit_matmul_curve(points) -> tuple[float, float, float]:
    """(rate, half_dim, rms) of  rate · f(m)·f(n)·f(k)  that fit measured GEMMs ((m, n, k, FLOP/s), ...) best by
    least squares on the logarithm: half_dim searched from 1 to 1,024 in steps of 2^(1/4), the rate then the
    geometric mean of each point's rate over its shape factors; rms is what is left, in natural log units (0.1:
    about 10% off). How a measured device (labs/kernel_rates.py, course_lib.calibration) is put on the curve."""
    points = [(m, n, k, rate) for m, n, k, rate in points]
    if not points or min(min(point) for point in points) <= 0:
        raise ValueError(f"fit_matmul_curve: {len(points)} points; it needs some, each dimension and rate > 0")

    def fit(half: float) -> tuple[float, float, float]:
        logs = [math.log(rate) - sum(math.log(dimension_factor(x, half)) for x in (m, n, k))
                for m, n, k, rate in points]
        mean = sum(logs) / len(logs)
        return math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs)), math.exp(mean), half
    rms, rate, half = min(fit(2 ** (i / 4)) for i in range(41))
    return rate, half, rms


def matmul_rate(gpu: GPU, m: float, n: float, k: float) -> float:
    """FLOP/s a [m, k] × [k, n] matmul reaches on ``gpu``: matmul_share · peak · f(m)·f(n)·f(k) (see above), or,
    on a machine whose GEMMs were measured on a grid of shapes (gpu.matmul_grid), the grid read between its
    points (grid_rate)."""
    if min(m, n, k) <= 0 or not all(map(math.isfinite, (m, n, k))):
        raise ValueError(f"matmul shape m={m}, n={n}, k={k}: every dimension must be > 0")
    if gpu.matmul_grid:
        return grid_rate(gpu.matmul_grid, m, n, k)
    f = [dimension_factor(x, gpu.matmul_half_dim) for x in (m, n, k)]
    return gpu.matmul_share * gpu.peak_flops * f[0] * f[1] * f[2]


def grid_rate(grid: tuple, m: float, n: float, k: float) -> float:
    """The rate of shape (m, n, k) from rates measured on a full grid of shapes ((m, n, k, rate), ...): linear
    in log2 of each dimension between the grid's points (trilinear), the edge's value beyond them. A CPU's GEMM
    rate is no smooth curve (it is fastest where the operands fit its caches, slower beyond), so a measured
    machine is read off its own measurements."""
    rates = {(gm, gn, gk): rate for gm, gn, gk, rate in grid}
    axes = [sorted({key[i] for key in rates}) for i in range(3)]

    def around(axis, x):
        """(low, high, weight of high) for x on one axis, clamped to its ends."""
        x = min(max(x, axis[0]), axis[-1])
        high = next(i for i, point in enumerate(axis) if point >= x)
        if high == 0:
            return axis[0], axis[0], 0.0
        low = axis[high - 1]
        return low, axis[high], math.log2(x / low) / math.log2(axis[high] / low)
    corners = [around(axis, x) for axis, x in zip(axes, (m, n, k))]
    total = 0.0
    for pick in range(8):
        weight, key = 1.0, []
        for i, (low, high, w) in enumerate(corners):
            upper = pick >> i & 1
            weight *= w if upper else 1 - w
            key.append(high if upper else low)
        total += weight * rates[tuple(key)] if weight else 0.0
    return total


# NCCL's own latency model of its ring collectives, Simple protocol (nccl src/graph/tuning.cc, ncclTopoTuneModel,
# at commit b6475625: baseLat and hwLat): 8.4 µs to start, then every step of the ring costs a hop, 3.4 µs over
# NVLink and 14 µs across the network. A ring all-gather or reduce-scatter over N ranks takes N - 1 steps, an
# all-reduce 2(N - 1); on n > 1 nodes, n - 1 of them (an all-reduce: 2n) cross the network. So latency grows
# with the ring: 32 µs for an all-gather over one node of 8, 0.30 ms over 64 GPUs on 8 nodes, 2.4 ms over 512.
NCCL_RING_BASE_S, NCCL_NVLINK_HOP_S, NCCL_NETWORK_HOP_S = 8.4e-6, 3.4e-6, 14e-6
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def ring_latency(op: str, ranks: int, nodes: int = 1) -> float:
    """Seconds of latency of one ring collective ``op`` over ``ranks`` GPUs on ``nodes`` nodes, by NCCL's model.
    An all-to-all (grouped sends to each peer, not a ring) is priced as an all-gather's ranks - 1 steps."""
    if op not in COLLECTIVES:
        raise ValueError(f"op={op!r}: one of {', '.join(COLLECTIVES)}")
    if ranks <= 1:
        return 0.0
    steps = 2 * (ranks - 1) if op == "all_reduce" else ranks - 1
    across = 0 if nodes <= 1 else min(steps, 2 * nodes if op == "all_reduce" else nodes - 1)
    return NCCL_RING_BASE_S + (steps - across) * NCCL_NVLINK_HOP_S + across * NCCL_NETWORK_HOP_S


def spread(group_size: int, group_span: int, gpus_per_node: int) -> tuple[int, int]:
    """(ranks per node, nodes) of a group of ``group_size`` ranks evenly spaced over ``group_span`` consecutive
    ranks. Inside one node when the span fits in one and nodes hold a whole number of spans; else the group's
    ranks are shared evenly by the nodes the span reaches. A span that fits in a node but does not tile it
    (3 ranks of an 8-GPU node) leaves some groups across a boundary: two nodes, the thinner side's ranks."""
    if not 1 <= group_size <= group_span or gpus_per_node < 1:
        raise ValueError(f"group_size={group_size}, group_span={group_span}, gpus_per_node={gpus_per_node}: a group "
                         "of at least 1 rank, spaced over at least as many consecutive ranks, on nodes of >= 1 GPU")
    if group_span <= gpus_per_node and gpus_per_node % group_span == 0:
        return group_size, 1
    if group_span < gpus_per_node or group_size == 1:
        return max(1, group_size // 2), min(2, group_size)
    per_node = max(1, group_size * gpus_per_node // group_span)
    return per_node, -(-group_size // per_node)


def link_for(group_span: int, gpus_per_node: int, gpu: GPU, group_size: int | None = None) -> Link:
    """NVLink if a group of ``group_span`` consecutive ranks stays inside one node, else the network. A ring
    collective over ``group_size`` ranks that spans nodes with k of them in each node runs as NCCL runs it on a
    rail-optimised cluster (one NIC per GPU): k rings side by side, each crossing each node boundary on its own
    NIC, the other hops on NVLink, so each GPU moves its ring bytes at min(k · NIC, NVLink) (DGX A100: 8 × 25 =
    200 GB/s; nccl-tests measure ~192 GB/s of bus bandwidth across DGX A100 nodes and ~380 across DGX H100's
    8 × 50, NVIDIA's GTC 2024 NCCL talk). One GPU per node (a group strided by tp), or point-to-point: one NIC."""
    if group_span < 1 or gpus_per_node < 1:
        raise ValueError(f"group_span={group_span}, gpus_per_node={gpus_per_node}: each at least 1")
    if group_span <= gpus_per_node and gpus_per_node % group_span == 0:
        return gpu.nvlink
    per_node = 1 if group_size is None else spread(group_size, group_span, gpus_per_node)[0]
    if per_node == 1:
        return gpu.network
    rate = min(per_node * gpu.network.bytes_per_s, gpu.nvlink.bytes_per_s)
    return replace(gpu.network, name=f"{gpu.network.name}, {per_node} rails per node", bytes_per_s=rate)


def collective_link(gpu: GPU, link: Link, op: str) -> Link:
    """The link ``op`` ("all_reduce", "all_gather", "reduce_scatter", "send") runs on: a measured machine's own
    fit for that op (GPU.collective_links), else ``link`` (link_for's)."""
    return dict(gpu.collective_links).get(op, link)
