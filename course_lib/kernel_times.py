"""Time per operation: the kernels of one training step on one GPU, each placed on its roofline.

Every kernel is limited by one of three things, and takes the longest of them:

    seconds = max(FLOPs / rate,  bytes / HBM bandwidth,  kernels × launch)        (bound: whichever wins)

A matmul [M, K] × [K, N] does 2·M·K·N FLOPs and moves at least (M·K + K·N + M·N) · e bytes (read both operands,
write the result once; e bytes per element). Its rate is not the dense peak: hardware.matmul_rate gives the
share a GEMM of that shape reaches (published benchmarks, hardware.GEMM_SOURCES: large GEMMs ~75% of an A100's
peak, ~67% of an H100's, less when a dimension is small). Backward runs two more GEMMs of the same three
dimensions, dX and dW: three GEMMs per weight matrix in all (four where recomputation reruns it: every one
under "full"; k, o and up under "op", torchtitan's per-op policy).

The operations that no FLOP formula counts (MFU leaves them out, see cost.py) are memory-bound: a few FLOPs per
element against hundreds of FLOPs per byte at the ridge. Their bytes, per token on one of t GPUs (r = 1/t with
sequence parallelism, 1 without: each TP rank repeats them on the whole activation), forward + backward:

    RMSNorm ×2            (2 + 3)·d·e·r each          read x, write y; backward reads x and dy, writes dx
    residual add ×2       (3 + 3)·d·e·r each          read two, write one, both ways
    rotary on q and k     (2 + 2)·(n_h + n_kv)·h_d·e/t
    SwiGLU's products     (3 + 5)·I·e/t               read gate and up, write their product; backward 2 in, 3 out
    loss                  3·V·e/t_V                   softmax cross-entropy over the logits, t_V = t if the head
                                                      is vocab-parallel; the head's GEMM itself is a matmul row

Each streams its bytes at its own share of a plain copy's rate, as one H200 measured it (STREAM_SHARE: a norm
0.66, SwiGLU's product 0.80, the loss 0.35, Adam's step 0.73, a residual add 1).

Eager PyTorch has no such kernels: on a machine that runs the course's own model (GPU.eager_elementwise: this CPU,
calibrated), and for a run whose code dispatches them op by op (elementwise_ops="eager": torchtitan without
torch.compile; "eager, fused norm" where its norm is one kernel), these rows, the final norm and the loss are the
ops model.py dispatches, each reading its inputs and writing its output, as course_lib.eager_traffic counts them
(the tiny model's layer, 8 × 64 tokens in fp32: 92 ops moving 17.8 MB forward + backward, where the four rows above
move 5.8 MB; Llama 3 8B's, one sequence of 8,192 tokens in bf16, 18.7 GB against 3.7). With sequence parallelism a
GPU run's norms are taken as fused kernels on its T/t rows and its residual adds' bytes cut to 1/t. Its rotary is
counted as the run's code writes it (rotary: "complex", torchtitan's; "rotate_half", Hugging Face's; model.py's
by default, 2-2.5 times their bytes: eager_traffic.ROTARY).

The attention core, for b sequences of s tokens and n_h/t heads per GPU:

* "flash" (FlashAttention-2, torch's SDPA flash backend), "flash3" (FlashAttention-3, H100/H200 only),
  "efficient" (xformers' memory-efficient kernel: torch's SDPA memory-efficient backend) and "triton" (the
  Triton FlashAttention that MPT runs for ALiBi, priced from another Triton kernel's): one fused kernel that
  never writes the s×s scores. It reads q, k, v and writes o (backward reads q, k, v, o, dO and writes dq, dk,
  dv). A causal kernel skips the masked blocks: it runs half of the square that cost.flops_per_step counts (MFU
  keeps the whole square, as Megatron-LM does), and backward runs 2.5 times forward's matmul work (it recomputes
  QKᵀ). Its rate is read from published kernel benchmarks, or derived from them where none was published
  (attention_rate; FLASH_TFLOPS and TRITON_VS_FLASH2 say which: by GPU, causal or not, head dim and sequence
  length), never from a training run; on a card of the family with a lower peak (a lower clock: a power limit)
  the same kernels run that much slower.
* "unfused" (Megatron-LM's GPT layer before FlashAttention, as in Narayanan et al. 2021 and Korthikanti et al.
  2022): QKᵀ and AV are batched GEMMs [s, h_d] × [h_d, s] and [s, s] × [s, h_d] on the whole square, and
  between them a fused scale-mask-softmax and the attention dropout pass the s×s scores through HBM:
  forward (4e + 1) bytes per score (softmax reads and writes them, dropout reads them and writes them and a
  1-byte mask), backward (5e + 1), each pass at a copy's rate (Megatron's fused kernels have no published
  benchmark). GPT-3's learned positions need no rotary. Against a benchmark of standard attention it was not
  shaped on (the FlashAttention-2 figures' "Pytorch" bars, 512 to 8k tokens: tests/test_cost.py), the same
  batched GEMMs and the passes torch makes there (standard_attention) run 1.1-1.4 times faster than measured on
  the A100, 1.3-1.8 on the H100: most likely torch's softmax streams the scores well below a copy's rate (at
  half of it the two agree within 17% from 2k tokens on), though batched GEMMs slower than the model's curve
  would show the same (labs/kernel_rates.py times standard attention on a GPU).

Not here: the embedding's lookup and its gradient (T·d·e bytes each way, on the first stage), hidden dropout,
fp32 statistics of the norms, the optimizer (cost.step_time adds it once a step).

course_lib.roofline: the same idea for teaching, each of one layer's matmuls at the dense peak against the ridge.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from .eager_traffic import all_but_norms, check_rotary, head_traffic, layer_traffic
from .feed_forward import capacity
from .hardware import GPU, GPUS, dimension_factor, matmul_rate

ATTENTION = ("flash", "flash3", "efficient", "triton", "unfused")
# The memory-bound ops as a run's code dispatches them: one fused kernel each (Megatron's, MPT's, torch.compile's),
# op by op as the course's model runs them (eager PyTorch), or so but for the norms (torchtitan's fused_rmsnorm)
ELEMENTWISE_OPS = ("fused", "eager", "eager, fused norm")
# The attention core's operations, one fused kernel or three (what ring attention's traffic can hide behind)
ATTENTION_OPS = ("attention core", "attention scores QKᵀ", "softmax + dropout", "attention values AV")

# Forward + backward TFLOP/s of the attention kernels, FLOPs counted as their authors count them (a causal
# kernel's half square; backward 2.5 × forward: 3.5 × forward in all), at sequence lengths FLASH_SEQ (batch
# 16k tokens / s, hidden 2,048), keyed by (GPU family, kernel, causal, head dim). Sources:
#   A100 "flash": FlashAttention-2 (Dao 2023, arXiv:2307.08691) Fig. 4 = flash-attention's README figure
#     assets/flash2_a100_fwd_bwd_benchmark.png (A100 80GB SXM4);
#   H100 "flash": the README's assets/flash2_h100_fwd_bwd_benchmark.png (H100 80GB SXM5);
#   H100 "flash3": FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608) Fig. 5 (forward) and Fig. 6 (backward,
#     measured non-causal only; the causal backward taken as the non-causal one × causal/non-causal forward,
#     an assumption), combined as 3.5 / (1/forward + 2.5/backward);
#   A100 "efficient": the same A100 figure's "xformers" bars (xformers' cutlass kernel, which torch's SDPA
#     memory-efficient backend is); H100 "efficient": no published figure, so the A100's ratio to FlashAttention-2
#     at each point times the H100's FlashAttention-2 bar (_derived_efficient, an assumption: one H200 ran torch's
#     memory-efficient backend at 0.79-0.94 of these rows from 2k tokens on, 0.71-0.80 at 512, much as its flash
#     backend ran of the "flash" rows).
# The bars were read from the figures to ~2%. Beyond 16k tokens the 16k value holds (the curves are flat there);
# below 512 the 512 value. H200: the H100's (the same Tensor Cores and clock; these kernels are compute-bound).
# Checked on one H200 (labs/kernel_rates.py; tests/test_cost.py): torch's flash backend ran 0.83-0.98 of the
# H100 "flash" rows from 2k tokens on (0.63-0.72 at 512), cuDNN's fused attention 0.89-1.03 of the "flash3" ones.
FLASH_SEQ = (512, 1024, 2048, 4096, 8192, 16384)
_FA3_FORWARD = {(True, 64): (197, 265, 371, 420, 460, 473), (True, 128): (292, 423, 521, 579, 602, 616),
                (False, 64): (333, 392, 460, 476, 496, 497), (False, 128): (467, 565, 625, 638, 646, 648)}
_FA3_BACKWARD = {64: (272, 363, 422, 453, 472, 474), 128: (316, 424, 501, 542, 559, 561)}     # non-causal


def _fa3(causal: bool, head_dim: int) -> tuple:
    forward, plain = _FA3_FORWARD[causal, head_dim], _FA3_FORWARD[False, head_dim]
    backward = [bw * fw / pf for bw, fw, pf in zip(_FA3_BACKWARD[head_dim], forward, plain)]
    return tuple(3.5 / (1 / fw + 2.5 / bw) for fw, bw in zip(forward, backward))


FLASH_TFLOPS = {
    ("A100", "flash", False, 64): (132, 153, 162, 171, 175, 176),
    ("A100", "flash", False, 128): (152, 173, 187, 196, 201, 203),
    ("A100", "flash", True, 64): (88, 119, 140, 156, 165, 171),
    ("A100", "flash", True, 128): (99, 133, 155, 173, 182, 189),
    ("H100", "flash", False, 64): (215, 254, 274, 288, 294, 296),
    ("H100", "flash", False, 128): (248, 294, 320, 326, 335, 338),
    ("H100", "flash", True, 64): (141, 192, 232, 257, 273, 284),
    ("H100", "flash", True, 128): (163, 221, 265, 294, 308, 328),
    **{("H100", "flash3", causal, hd): _fa3(causal, hd) for causal in (False, True) for hd in (64, 128)},
    ("A100", "efficient", False, 64): (68, 73, 76, 77, 75, 75),
    ("A100", "efficient", False, 128): (83, 91, 95, 96, 97, 98),
    ("A100", "efficient", True, 64): (51, 60, 66, 68, 69, 67),
    ("A100", "efficient", True, 128): (58, 72, 82, 87, 91, 92),
}


def _derived_efficient(causal: bool, head_dim: int) -> tuple:
    """The H100's memory-efficient kernel: its FlashAttention-2 bar × the A100's efficient / FlashAttention-2."""
    keys = [(family, kernel, causal, head_dim) for family, kernel in (("H100", "flash"), ("A100", "efficient"),
                                                                       ("A100", "flash"))]
    return tuple(h100 * a100_efficient / a100_flash for h100, a100_efficient, a100_flash in
                 zip(*(FLASH_TFLOPS[key] for key in keys)))


FLASH_TFLOPS.update({("H100", "efficient", causal, hd): _derived_efficient(causal, hd)
                     for causal in (False, True) for hd in (64, 128)})
# The Triton FlashAttention: "FlashAttention-2 is ... around 1.3-1.5x faster than FlashAttention in Triton in the
# forward pass and around 2x faster in the backward pass" (Dao 2023, section 4.1). With forward at 1/1.4 and
# backward at 1/2 of FlashAttention-2's rate, forward + backward takes (1.4 + 2.5·2) / 3.5 of its time: a rate of
# 3.5 / 6.4 = 0.55 of its. That Triton kernel is OpenAI's, Phil Tillet's tutorial kernel as triton.ops packages
# it (triton.ops.flash_attention, the "Triton" of flash-attention's benchmark scripts, the A100 figure's
# "FlashAttention Triton" bars). MPT's ALiBi runs on flash_attn_triton, which started from Tillet's kernel and
# added the bias and a faster backward at head dim 128 (its header: "slightly slower than CUDA", FlashAttention-1's,
# forward + backward). No benchmark of MPT's kernel is published. The figure's bars for OpenAI's kernel run
# 0.42-0.68 of FlashAttention-2's by point; priced at those, 136 of llm-foundry's 203 rows land within 5 points
# (at the flat 0.55, 186), most of them low: MPT's kernel runs nearer FlashAttention-2 than the kernel it started
# from. The flat ratio is kept, an approximation.
TRITON_VS_FLASH2 = 3.5 / (1.4 + 2.5 * 2)
FAMILIES = {"A100": "A100", "H100": "H100", "H200": "H100"}
FAMILY_PEAK = {family: GPUS[card].peak_flops for family, card in (("A100", "A100 80GB"), ("H100", "H100 SXM"))}
# (the cards the benchmarks ran on: their bf16 dense peak)


def attention_rate(gpu: GPU, kernel: str, seq_len: int, head_dim: int, causal: bool = True) -> float:
    """FLOP/s of a fused attention kernel forward + backward (FLOPs as its authors count them: FLASH_TFLOPS):
    its row of FLASH_TFLOPS (published, or derived where none was: the table's comment says which; Triton's at
    TRITON_VS_FLASH2 of FlashAttention-2's), interpolated in log(sequence length) and in head dim between 64 and
    128 (clamped outside), scaled by the card's peak against the benchmarks' (FAMILY_PEAK: a card clocked lower, 1
    for the catalogue's). A GPU with no benchmark here (this CPU, calibrated; one of your own) takes
    attention_share × peak × f(s) × f(head dim) (hardware.dimension_factor)."""
    family, base = FAMILIES.get(gpu.name.split()[0]), "flash" if kernel == "triton" else kernel
    if kernel not in ATTENTION[:-1] or not seq_len >= 1 or not head_dim >= 1:
        raise ValueError(f"kernel={kernel!r}, seq_len={seq_len}, head_dim={head_dim}: a fused kernel, one of "
                         f"{', '.join(ATTENTION[:-1])}, on at least one token of a head dim of at least 1")
    if kernel == "flash3" and family != "H100":
        raise ValueError(f"attention='flash3' on {gpu.name}: FlashAttention-3 runs on Hopper (H100, H200) only")
    if family is None:
        rate = gpu.attention_share * gpu.peak_flops * dimension_factor(seq_len, gpu.matmul_half_dim)
        rate *= dimension_factor(head_dim, gpu.attention_half_dim)     # 1 when attention_half_dim is 0
    else:
        first, last = math.log2(FLASH_SEQ[0]), math.log2(FLASH_SEQ[-1])
        x = min(max(math.log2(seq_len), first), last) - first     # FLASH_SEQ doubles: x is a place in the table
        low = min(int(x), len(FLASH_SEQ) - 2)

        def at(hd):
            table = FLASH_TFLOPS[family, base, causal, hd]
            return 1e12 * (table[low] + (x - low) * (table[low + 1] - table[low]))
        weight = min(max((head_dim - 64) / 64, 0.0), 1.0)
        rate = (1 - weight) * at(64) + weight * at(128)
        rate *= gpu.peak_flops / FAMILY_PEAK[family]
    return rate * (TRITON_VS_FLASH2 if kernel == "triton" else 1.0)


@dataclass(frozen=True)
class Operation:
    name: str
    flops: float              # FLOPs the kernels run (causal FlashAttention: half the square)
    bytes: float              # bytes moved through HBM, at least
    seconds: float
    bound: str                # "compute", "memory" or "launch": what sets seconds
    kernels: int = 1          # kernel launches

    @property
    def intensity(self) -> float:
        """FLOPs per byte: where the operation sits on the roofline's x axis."""
        return self.flops / self.bytes if self.bytes else float("inf")

    def times(self, n: float) -> Operation:
        """The same operation run n times (n layers, n passes)."""
        return replace(self, flops=n * self.flops, bytes=n * self.bytes, seconds=n * self.seconds,
                       kernels=round(n * self.kernels))


# A memory-bound kernel that does more than stream runs below a copy's rate (hbm_share × bandwidth). Its share of
# that rate, measured on one H200 (labs/kernel_rates.py, labs/results/gpu-1x-nvidia-h200; tests/test_cost.py):
# a residual add 1.03 (taken as 1), RMSNorm as torch.compile fuses it 0.66 (its forward, taken for backward too:
# eager, forward + backward ran 0.60), SwiGLU's product fused 0.80,
# cross-entropy over the logits 0.35 (torch's), Adam's fused step 0.73. Rotary is taken as SwiGLU's product (a
# fused elementwise product of the same kind; not measured), Megatron's fused softmax as a copy (not measured).
# The frameworks fuse these ops as torch.compile does (Megatron-LM's and Apex's kernels); that the H200's shares
# hold on an A100 or H100, where the same kernels are memory-bound the same way, is an assumption. A measured
# machine (this CPU, calibrated: its ops as model.py runs them, its own Adam) keeps its own rates.
STREAM_SHARE = {"RMSNorm ×2": 0.66, "final RMSNorm": 0.66, "SwiGLU products": 0.80, "rotary": 0.80,
                "loss (softmax cross-entropy)": 0.35, "optimizer (Adam)": 0.73}


def timed(name: str, gpu: GPU, flops: float, nbytes: float, *, rate: float, kernels: int = 1,
          stream_share: float = 1.0) -> Operation:
    """max(FLOPs / rate, bytes / achievable HBM bandwidth, kernels × launch), and which of them it was (on a GPU
    whose launches add to the work, gpu.launch_adds: the longer of the first two, plus the launches). The
    achievable bandwidth is a copy's, hbm_share × hbm_bytes_per_s, times ``stream_share`` (STREAM_SHARE)."""
    limits = {"compute": flops / rate, "memory": nbytes / (gpu.hbm_share * stream_share * gpu.hbm_bytes_per_s),
              "launch": kernels * gpu.launch_s}
    bound = max(limits, key=limits.get)
    if gpu.launch_adds:
        work = max(limits["compute"], limits["memory"])
        return Operation(name, flops, nbytes, work + limits["launch"], bound, kernels)
    return Operation(name, flops, nbytes, limits[bound], bound, kernels)


def matmul(name: str, gpu: GPU, m: int, k: int, n: int, e: int, passes: int, batch: int = 1) -> Operation:
    """[m, k] × [k, n] and its two backward GEMMs (dX: [m, n] × [n, k]; dW: [k, m] × [m, n]), the same three
    dimensions each: ``passes`` GEMMs of the same time (3, or 4 with a recomputed forward). ``batch``: that many
    independent products in one batched kernel (attention's heads), each at the rate of its own shape."""
    one = timed(name, gpu, batch * 2 * m * k * n, batch * (m * k + k * n + m * n) * e, rate=matmul_rate(gpu, m, n, k))
    return one.times(passes)


def elementwise(name: str, gpu: GPU, forward_bytes: float, backward_bytes: float, flops_per_byte: float,
                forward_again: bool, kernels_per_pass: int = 1) -> Operation:
    """A memory-bound operation: ``kernels_per_pass`` kernels forward, as many backward (and the forward again
    when recomputed), each pass at bytes / (its STREAM_SHARE of the achievable HBM bandwidth) or its launches.
    ``flops_per_byte``: the few FLOPs it does, to place it on a roofline."""
    passes = [forward_bytes, backward_bytes] + ([forward_bytes] if forward_again else [])
    share = 1.0 if gpu.eager_elementwise else STREAM_SHARE.get(name, 1.0)
    parts = [timed(name, gpu, flops_per_byte * b, b, rate=gpu.peak_flops, kernels=kernels_per_pass,
                   stream_share=share) for b in passes]
    seconds = sum(p.seconds for p in parts)
    bound = max(("memory", "launch"), key=lambda kind: sum(p.seconds for p in parts if p.bound == kind))
    return Operation(name, sum(p.flops for p in parts), sum(p.bytes for p in parts), seconds, bound,
                     kernels_per_pass * len(parts))


def standard_attention(gpu: GPU, heads: int, seq_len: int, head_dim: int, e: int, causal: bool = True
                       ) -> list[Operation]:
    """Attention as plain PyTorch writes it (FlashAttention's benchmark scripts' attention_pytorch), for ``heads``
    (batch × heads) of one sequence length, forward + backward: QKᵀ and AV as batched GEMMs on the whole square,
    and the s×s scores through HBM at a copy's rate: softmax (forward reads and writes them, backward reads two
    and writes one) and, causal, the mask added (read, write; the [s, s] mask itself, built each call and read
    again for every head, is left out). Not Megatron's layer ("unfused" above, whose fused softmax and dropout move
    other bytes): the model's primitives on kernels a benchmark published (tests/test_cost.py) and
    labs/kernel_rates.py measures on a GPU."""
    scores = heads * seq_len * seq_len
    return [matmul("attention scores QKᵀ", gpu, seq_len, head_dim, seq_len, e, 3, batch=heads),
            matmul("attention values AV", gpu, seq_len, seq_len, head_dim, e, 3, batch=heads),
            elementwise("softmax", gpu, scores * 2 * e * (2 if causal else 1), scores * 3 * e, 1.0, False)]


def _eager_ops(gpu: GPU, elementwise_ops: str, rotary: str = "model.py") -> bool:
    """Whether the memory-bound ops run op by op: on a machine that runs the course's model (this CPU), or as a
    run's code dispatches them (ELEMENTWISE_OPS; ``rotary``, eager_traffic.ROTARY: how its code writes rotary)."""
    if elementwise_ops not in ELEMENTWISE_OPS:
        raise ValueError(f"elementwise_ops={elementwise_ops!r}: one of {', '.join(map(repr, ELEMENTWISE_OPS))}")
    check_rotary(rotary)
    if gpu.eager_elementwise and (elementwise_ops == "eager, fused norm" or rotary != "model.py"):
        raise ValueError(f"elementwise_ops={elementwise_ops!r}, rotary={rotary!r} on {gpu.name}: it runs the "
                         "course's model, whose norms are no fused kernel and whose rotary is model.py's")
    return gpu.eager_elementwise or elementwise_ops != "fused"


def eager(name: str, gpu: GPU, counted: Mapping, e: int, forward_again: bool) -> Operation:
    """Memory-bound ops as eager PyTorch runs them, counted by eager_traffic: forward, backward (and the forward
    again when recomputed), each pass its bytes at HBM bandwidth and a launch per op (timed's rule)."""
    passes = [counted["forward"], counted["backward"]] + ([counted["forward"]] if forward_again else [])
    parts = [timed(name, gpu, p.bytes / e, p.bytes, rate=gpu.peak_flops, kernels=p.kernels) for p in passes]
    bound = max(("memory", "launch"), key=lambda kind: sum(p.seconds for p in parts if p.bound == kind))
    return Operation(name, sum(p.flops for p in parts), sum(p.bytes for p in parts), sum(p.seconds for p in parts),
                     bound, sum(p.kernels for p in parts))


def weight_widths(config, tp: int = 1) -> dict[str, tuple[int, int]]:
    """Each weight of a layer as its GEMM [tokens, k] × [k, n] sees it on one of ``tp`` GPUs: (k, n) by name (the
    heads and the MLP split over tp)."""
    d, h_d = config.hidden, config.head_dim
    q_width, kv_width, mlp_width = (config.num_heads * h_d // tp, config.num_kv_heads * h_d // tp,
                                    config.intermediate // tp)
    return {"q_proj": (d, q_width), "k_proj": (d, kv_width), "v_proj": (d, kv_width), "o_proj": (q_width, d),
            "gate_proj": (d, mlp_width), "up_proj": (d, mlp_width), "down_proj": (mlp_width, d)}


def attention_square(config, micro_batch_size: int, seq_len: int, tp: int = 1) -> int:
    """FLOPs of QKᵀ and AV forward on the whole s×s square, on one of ``tp`` GPUs: 2·2·b·(n_h/t)·s²·h_d (what MFU
    counts, as cost.forward_terms does for the whole model; a causal kernel runs half of it)."""
    return 4 * (micro_batch_size * config.num_heads // tp) * seq_len**2 * config.head_dim


def layer_operations(config, gpu: GPU, *, micro_batch_size: int, seq_len: int, tp: int = 1,
                     sequence_parallel: bool = False, recompute: str = "none", attention: str = "flash",
                     causal: bool = True, elementwise_ops: str = "fused", rotary: str = "model.py",
                     bytes_per_element: int = 2, cp: int = 1, capacity_factor: float | None = None) -> list[Operation]:
    """One transformer layer's operations, forward + backward (+ what ``recompute`` runs again), on one of
    ``tp`` GPUs, for one micro-batch (module docstring; ``elementwise_ops``: one of ELEMENTWISE_OPS; ``rotary``,
    eager_traffic.ROTARY: the rotary an eager run's code writes). With context parallelism (``cp`` > 1) a GPU
    holds seq_len/cp tokens of each sequence, and ring attention gives it 1/cp of the (causal) square in cp
    steps (cp - 1 hops), each on seq_len/cp queries and as many keys: the non-causal rate at that length (of the
    2cp + 1 chunk pairs a rank computes in course_lib.context_parallel's balanced layout, 2 are diagonal). A
    mixture of experts runs its MLP on E·C rows for T tokens, C its slots per expert at ``capacity_factor``
    (feed_forward.capacity; the rows the all-to-alls carry): top_k·T at 1, all E·T at None, the course's MoE."""
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: one of {', '.join(ATTENTION)}")
    if not (isinstance(cp, int) and cp >= 1) or cp > 1 and (attention == "unfused" or seq_len % cp):
        raise ValueError(f"cp={cp}, attention={attention!r}, seq_len={seq_len}: cp a whole number >= 1 dividing "
                         "seq_len; ring attention runs fused kernels on seq_len/cp tokens ('unfused': not modelled)")
    eager_ops = _eager_ops(gpu, elementwise_ops, rotary)
    b, s, e, t = micro_batch_size, seq_len // cp, bytes_per_element, tp
    T, d, h_d = b * s, config.hidden, config.head_dim
    widths = weight_widths(config, t)
    q_width, kv_width, mlp_width = widths["q_proj"][1], widths["k_proj"][1], widths["gate_proj"][1]
    experts = config.num_experts * capacity(T, config.num_experts, config.top_k, capacity_factor) / T \
        if getattr(config, "num_experts", 0) else 1
    # A recomputed block ("full", or "op": every second matmul, k, o and up, whose outputs it does not keep) runs
    # its elementwise ops again, and the matmuls it reruns a fourth time.
    block_rerun = recompute in ("full", "op")
    rerun = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} if recompute == "full" \
        else {"k_proj", "o_proj", "up_proj"} if recompute == "op" else set()

    def passes(name):
        return 4 if name in rerun else 3
    ops = [matmul(name, gpu, T, *widths[name], e, passes(name)) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    ops += [matmul(name, gpu, T, *widths[name], e, passes(name)).times(experts)
            for name in ("gate_proj", "up_proj", "down_proj")]
    heads = b * config.num_heads // t
    core_again = recompute in ("selective", "full")
    if attention != "unfused":
        square = attention_square(config, b, s, t) * cp * (0.5 if causal else 1)   # what the kernels run
        forward_flops = square * (2 if core_again else 1)
        flops = forward_flops + 2.5 * square
        io = T * (q_width + kv_width) * e                              # q and k (v and o: the same widths)
        nbytes = 2 * io * (2 if core_again else 1) + 4 * io
        rate = attention_rate(gpu, attention, s, h_d, causal and cp == 1)
        ops.append(timed("attention core", gpu, flops, nbytes, rate=rate, kernels=(3 if core_again else 2) * cp))
        if not eager_ops:
            ops.append(elementwise("rotary", gpu, 2 * T * (q_width + kv_width) * e, 2 * T * (q_width + kv_width) * e,
                                   1.5 / e, block_rerun))
    else:
        extra = 1 if core_again else 0
        scores = matmul("attention scores QKᵀ", gpu, s, h_d, s, e, 3 + extra, batch=heads)
        values = matmul("attention values AV", gpu, s, s, h_d, e, 3 + extra, batch=heads)
        softmax = elementwise("softmax + dropout", gpu, heads * s * s * (4 * e + 1), heads * s * s * (5 * e + 1),
                              1.0, core_again)
        ops += [scores, softmax, values]
    rows = T // t if sequence_parallel else T
    norms = elementwise("RMSNorm ×2", gpu, 2 * 2 * rows * d * e, 2 * 3 * rows * d * e, 2.5 / e, block_rerun, 2)
    if eager_ops:                                     # the course's model, op by op (eager_traffic)
        if sequence_parallel and gpu.eager_elementwise:
            raise ValueError("sequence_parallel=True on a machine that runs the course's model eagerly: "
                             "eager_traffic counts a TP rank's layer on every row")
        counted = layer_traffic(config, micro_batch_size=b, seq_len=s, tp=t, bytes_per_element=e, rotary=rotary)
        written = "" if rotary == "model.py" else f", rotary {rotary!r}"      # eager_traffic.ROTARY
        split = t if sequence_parallel else 1          # SP: the norms fused, they and the adds on T/t rows
        if elementwise_ops == "eager, fused norm" or split > 1:
            counted = all_but_norms(counted, config, micro_batch_size=b, seq_len=s, bytes_per_element=e, norms=2,
                                    sequence_split=split)
            return ops + [norms, eager("elementwise ops but the norms, as model.py runs them" + written, gpu,
                                       counted, e, block_rerun)]
        return ops + [eager("elementwise ops, as model.py runs them" + written, gpu, counted, e, block_rerun)]
    ops.append(norms)
    ops.append(elementwise("residual add ×2", gpu, 2 * 3 * rows * d * e, 2 * 3 * rows * d * e, 1 / (3 * e),
                           block_rerun, 2))
    ops.append(elementwise("SwiGLU products", gpu, 3 * T * mlp_width * e * experts,
                           5 * T * mlp_width * e * experts, 2 / e, block_rerun))
    return ops


def head_operations(config, gpu: GPU, *, micro_batch_size: int, seq_len: int, vocab_split: int = 1,
                    elementwise_ops: str = "fused", bytes_per_element: int = 2) -> list[Operation]:
    """The last stage's extra work per micro-batch: the final norm, the head's GEMM (split over ``vocab_split``
    GPUs with a vocab-parallel head) and the loss over the logits (``elementwise_ops``: as layer_operations')."""
    T, d, e, V = micro_batch_size * seq_len, config.hidden, bytes_per_element, config.vocab_size // vocab_split
    norm = elementwise("final RMSNorm", gpu, 2 * T * d * e, 3 * T * d * e, 2.5 / e, False)
    if _eager_ops(gpu, elementwise_ops):              # the course's model, op by op (eager_traffic)
        counted = head_traffic(config, micro_batch_size=micro_batch_size, seq_len=seq_len, vocab_split=vocab_split,
                               bytes_per_element=e)
        if elementwise_ops == "eager, fused norm":
            counted = all_but_norms(counted, config, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                    bytes_per_element=e, norms=1)
            return [norm, matmul("head", gpu, T, d, V, e, 3),
                    eager("loss, as model.py runs it", gpu, counted, e, False)]
        return [matmul("head", gpu, T, d, V, e, 3), eager("final RMSNorm and loss, as model.py runs them", gpu,
                                                          counted, e, False)]
    return [norm, matmul("head", gpu, T, d, V, e, 3),
            elementwise("loss (softmax cross-entropy)", gpu, T * V * e, 2 * T * V * e, 2.5 / e, False)]


def optimizer_operation(gpu: GPU, params: int, grad_bytes: int = 2) -> Operation:
    """Mixed-precision Adam on ``params`` parameters, once a step: read and write the fp32 master weights and both
    moments (24 bytes), read the gradient, write the bf16 weights (2); gradient clipping reads the gradients once
    more, and zeroing them for the next step writes them: (26 + 3·grad_bytes) bytes a parameter, ~10 FLOPs.
    Memory-bound; torch's foreach/fused Adam runs it in a handful of kernels. A measured machine
    (GPU.optimizer_bytes_per_param) gives its own Adam's bytes a parameter instead."""
    nbytes = params * (gpu.optimizer_bytes_per_param or 26 + 3 * grad_bytes)
    share = 1.0 if gpu.optimizer_bytes_per_param else STREAM_SHARE["optimizer (Adam)"]
    return timed("optimizer (Adam)", gpu, 10 * params, nbytes, rate=gpu.peak_flops, kernels=4, stream_share=share)
