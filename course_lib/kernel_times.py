"""Time per operation: the kernels of one training step on one GPU, each placed on its roofline.

Every kernel is limited by one of three things, and takes the longest of them:

    seconds = max(FLOPs / rate,  bytes / HBM bandwidth,  kernels × launch)        (bound: whichever wins)

A matmul [M, K] × [K, N] does 2·M·K·N FLOPs and moves at least (M·K + K·N + M·N) · e bytes (read both operands,
write the result once; e bytes per element). Its rate is not the dense peak: hardware.matmul_rate gives the
share a GEMM of that shape reaches (published benchmarks, hardware.GEMM_SOURCES: large GEMMs ~75% of an A100's
peak, ~67% of an H100's, less when a dimension is small). Backward runs two more GEMMs of the same three dimensions, dX and dW:
three GEMMs per weight matrix in all (four with full recomputation's extra forward).

The operations that no FLOP formula counts (MFU leaves them out, see cost.py) are memory-bound: a few FLOPs per
element against hundreds of FLOPs per byte at the ridge. Their bytes, per token on one of t GPUs (r = 1/t with
sequence parallelism, 1 without: each TP rank repeats them on the whole activation), forward + backward:

    RMSNorm ×2            (2 + 3)·d·e·r each          read x, write y; backward reads x and dy, writes dx
    residual add ×2       (3 + 3)·d·e·r each          read two, write one, both ways
    rotary on q and k     (2 + 2)·(n_h + n_kv)·h_d·e/t
    SwiGLU's products     (3 + 5)·I·e/t               read gate and up, write their product; backward 2 in, 3 out
    loss                  3·V·e/t_V                   softmax cross-entropy over the logits, t_V = t if the head
                                                      is vocab-parallel; the head's GEMM itself is a matmul row

The attention core, for b sequences of s tokens and n_h/t heads per GPU:

* "flash" (FlashAttention, torch's SDPA): one fused kernel that never writes the s×s scores. It reads q, k, v
  and writes o (backward reads q, k, v, o, dO and writes dq, dk, dv). A causal kernel skips the masked blocks:
  it runs half of the square that cost.flops_per_step counts (MFU keeps the whole square, as Megatron-LM does),
  and backward runs 2.5 times forward's matmul work (it recomputes QKᵀ). Its rate: hardware.GPU.attention_share
  of the peak (FlashAttention-2's published share), × f(s) of hardware's shape curve.
* "unfused" (Megatron-LM's GPT layer before FlashAttention, as in Narayanan et al. 2021 and Korthikanti et al.
  2022): QKᵀ and AV are batched GEMMs [s, h_d] × [h_d, s] and [s, s] × [s, h_d] on the whole square, and
  between them a fused scale-mask-softmax and the attention dropout pass the s×s scores through HBM:
  forward (4e + 1) bytes per score (softmax reads and writes them, dropout reads them and writes them and a
  1-byte mask), backward (5e + 1). GPT-3's learned positions need no rotary.

Not here: the embedding's lookup and its gradient (T·d·e bytes each way, on the first stage), hidden dropout,
fp32 statistics of the norms, the optimizer (cost.step_time adds it once a step).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import GPU, dimension_factor, matmul_rate

ATTENTION = ("flash", "unfused")


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


def timed(name: str, gpu: GPU, flops: float, nbytes: float, *, rate: float, kernels: int = 1) -> Operation:
    """max(FLOPs / rate, bytes / achievable HBM bandwidth, kernels × launch), and which of them it was (on a GPU
    whose launches add to the work, gpu.launch_adds: the longer of the first two, plus the launches)."""
    limits = {"compute": flops / rate, "memory": nbytes / (gpu.hbm_share * gpu.hbm_bytes_per_s),
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
                forward_again: bool) -> Operation:
    """A memory-bound operation: one kernel forward, one backward (and the forward again when recomputed), each
    at bytes / HBM bandwidth or its launch. ``flops_per_byte``: the few FLOPs it does, to place it on a roofline."""
    passes = [forward_bytes, backward_bytes] + ([forward_bytes] if forward_again else [])
    parts = [timed(name, gpu, flops_per_byte * b, b, rate=gpu.peak_flops) for b in passes]
    seconds = sum(p.seconds for p in parts)
    bound = max(("memory", "launch"), key=lambda kind: sum(p.seconds for p in parts if p.bound == kind))
    return Operation(name, sum(p.flops for p in parts), sum(p.bytes for p in parts), seconds, bound, len(parts))


def layer_operations(config, gpu: GPU, *, micro_batch_size: int, seq_len: int, tp: int = 1,
                     sequence_parallel: bool = False, recompute: str = "none", attention: str = "flash",
                     causal: bool = True, bytes_per_element: int = 2) -> list[Operation]:
    """One transformer layer's operations, forward + backward (+ what ``recompute`` runs again), on one of
    ``tp`` GPUs, for one micro-batch (module docstring)."""
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: one of {', '.join(ATTENTION)}")
    b, s, e, t = micro_batch_size, seq_len, bytes_per_element, tp
    T, d, h_d = b * s, config.hidden, config.head_dim
    q_width, kv_width = config.num_heads * h_d // t, config.num_kv_heads * h_d // t
    mlp_width = config.intermediate // t
    experts = config.top_k if getattr(config, "num_experts", 0) else 1
    full = recompute == "full"
    passes = 4 if full else 3
    ops = [matmul("q_proj", gpu, T, d, q_width, e, passes), matmul("k_proj", gpu, T, d, kv_width, e, passes),
           matmul("v_proj", gpu, T, d, kv_width, e, passes), matmul("o_proj", gpu, T, q_width, d, e, passes)]
    ops += [matmul(name, gpu, T, k, n, e, passes).times(experts)
            for name, k, n in (("gate_proj", d, mlp_width), ("up_proj", d, mlp_width), ("down_proj", mlp_width, d))]
    heads = b * config.num_heads // t
    core_again = recompute in ("selective", "full")
    if attention == "flash":
        square = 4 * heads * s * s * h_d * (0.5 if causal else 1)      # QKᵀ and AV, forward
        forward_flops = square * (2 if core_again else 1)
        flops = forward_flops + 2.5 * square
        io = T * (q_width + kv_width) * e                              # q and k (v and o: the same widths)
        nbytes = 2 * io * (2 if core_again else 1) + 4 * io
        rate = gpu.attention_share * gpu.peak_flops * dimension_factor(s, gpu.matmul_half_dim)
        rate *= dimension_factor(h_d, gpu.attention_half_dim)          # 1 when attention_half_dim is 0
        ops.append(timed("attention core", gpu, flops, nbytes, rate=rate, kernels=3 if core_again else 2))
        ops.append(elementwise("rotary", gpu, 2 * T * (q_width + kv_width) * e, 2 * T * (q_width + kv_width) * e,
                               1.5 / e, full))
    else:
        extra = 1 if core_again else 0
        scores = matmul("attention scores QKᵀ", gpu, s, h_d, s, e, 3 + extra, batch=heads)
        values = matmul("attention values AV", gpu, s, s, h_d, e, 3 + extra, batch=heads)
        softmax = elementwise("softmax + dropout", gpu, heads * s * s * (4 * e + 1), heads * s * s * (5 * e + 1),
                              1.0, core_again)
        ops += [scores, softmax, values]
    rows = T // t if sequence_parallel else T
    ops.append(elementwise("RMSNorm ×2", gpu, 2 * 2 * rows * d * e, 2 * 3 * rows * d * e, 2.5 / e, full))
    ops.append(elementwise("residual add ×2", gpu, 2 * 3 * rows * d * e, 2 * 3 * rows * d * e, 1 / (3 * e), full))
    ops.append(elementwise("SwiGLU products", gpu, 3 * T * mlp_width * e * experts,
                           5 * T * mlp_width * e * experts, 2 / e, full))
    return ops


def head_operations(config, gpu: GPU, *, micro_batch_size: int, seq_len: int, vocab_split: int = 1,
                    bytes_per_element: int = 2) -> list[Operation]:
    """The last stage's extra work per micro-batch: the final norm, the head's GEMM (split over ``vocab_split``
    GPUs with a vocab-parallel head) and the loss over the logits."""
    T, d, e, V = micro_batch_size * seq_len, config.hidden, bytes_per_element, config.vocab_size // vocab_split
    return [elementwise("final RMSNorm", gpu, 2 * T * d * e, 3 * T * d * e, 2.5 / e, False),
            matmul("head", gpu, T, d, V, e, 3),
            elementwise("loss (softmax cross-entropy)", gpu, T * V * e, 2 * T * V * e, 2.5 / e, False)]


def optimizer_operation(gpu: GPU, params: int, grad_bytes: int = 2) -> Operation:
    """Mixed-precision Adam on ``params`` parameters, once a step: read and write the fp32 master weights and both
    moments (24 bytes), read the gradient, write the bf16 weights (2); gradient clipping reads the gradients once
    more, and zeroing them for the next step writes them: (26 + 3·grad_bytes) bytes a parameter, ~10 FLOPs.
    Memory-bound; torch's foreach/fused Adam runs it in a handful of kernels."""
    nbytes = params * (26 + 3 * grad_bytes)
    return timed("optimizer (Adam)", gpu, 10 * params, nbytes, rate=gpu.peak_flops, kernels=4)


def summed(ops: list[Operation]) -> dict[str, float]:
    """Seconds by bound ("compute", "memory", "launch") over ``ops``."""
    out = {"compute": 0.0, "memory": 0.0, "launch": 0.0}
    for op in ops:
        out[op.bound] += op.seconds
    return out
