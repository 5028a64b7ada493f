"""The memory ledger: predict every byte of training state and activations, then measure it.

Units are course_lib.units: GiB = 2**30 bytes, GB = 10**9 bytes.

1. Training state: bytes per parameter
--------------------------------------
Training keeps, for every one of the P parameters, a weight, a gradient and the optimizer's state. With
Adam in mixed precision (the ZeRO paper's convention, and the source's "16 bytes per parameter"):

    weights   2   16-bit copy used by forward and backward (bf16 or fp16)
    grads     2   16-bit gradient written by backward
    optimizer 12  fp32 master copy of the weight (4) + Adam's first moment m (4) + second moment v (4)
    total     16 bytes/param            7.1e9 params × 16 = 113.6e9 bytes = 105.8 GiB

Other conventions give other splits (see CONVENTIONS): plain fp32 Adam is 4 + 4 + 8 = 16 as well, but only
8 of it is optimizer state; keeping an fp32 copy of the gradients for accumulation across micro-batches
adds 4 bytes: 2 + 6 + 12 = 20 (Megatron-LM, whose distributed optimizer shards that copy together with the
optimizer state: 4 + 16/N per rank, where the stages below would say 2 + 6 + 12/N).

ZeRO splits the same three parts over the N data-parallel ranks, one more part per stage:

    stage 0 (plain DDP)  per rank = (w + g + o)·P
    stage 1              per rank = (w + g)·P + o·P/N         optimizer state sharded
    stage 2              per rank = w·P + (g + o)·P/N         ... and gradients
    stage 3              per rank = (w + g + o)·P/N           ... and weights

A shard holds ceil(P/N) parameters (the largest shard, when N does not divide P).
DeepSpeed's own estimator counts differently (deepspeed_estimate): it adds an fp32 gradient partition to
the sharded state (18 bytes: 16-bit and fp32 gradients, fp32 master, m, v), so it prints 2·P + 18·P/N for
stage 2 where the formula above gives 2·P + 14·P/N.

2. Activations: the bytes saved for backward
--------------------------------------------
The published formula (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models") counts, per GPT-3 style layer, the bytes a forward pass keeps for backward. Its assumptions: a
post-2020 GPT layer (LayerNorm, multi-head attention that stores the s×s score matrix, a 4h GeLU MLP,
dropout with 1-byte masks), 16-bit activations, s = sequence length, b = micro-batch, h = hidden size,
a = attention heads, t = tensor-parallel size:

    attention  11·sbh + 5·a·s²·b   QKV input 2sbh; Q and K 4sbh; softmax output 2as²b; its dropout mask as²b;
                                   dropout output 2as²b and V 2sbh; output projection input 2sbh; mask sbh
    MLP        19·sbh              first linear input 2sbh; GeLU input 8sbh; GeLU output 8sbh; mask sbh
    2 norms     4·sbh              the input of each LayerNorm
    total      sbh·(34 + 5·a·s/h) bytes per layer

    tensor parallel            sbh·(10 + 24/t + 5·a·s/(h·t))   norms, masks and two inputs stay whole
    + sequence parallel        sbh·(34/t + 5·a·s/(h·t))        ... now split along the sequence too
    selective recomputation    drops the 5·a·s/h term (scores, softmax, dropout are recomputed)
    full recomputation         2·sbh (only each layer's input is kept; 2·sbh/t with sequence parallelism)

The course's model is not a GPT-3 layer: RMSNorm, rotary positions, grouped-query attention, SwiGLU, and
PyTorch's scaled_dot_product_attention, which never stores the s×s scores (like FlashAttention it
recomputes them in backward: selective recomputation built into the kernel). `gpt_activation_bytes`
derives its bytes term by term from what each operation saves in torch 2.13 (d = hidden, I = intermediate,
n_h = heads, h_d = head_dim, V = vocabulary, e = bytes per activation value, 2 in bf16/fp16 and 4 in fp32):

    per layer (× L):
      attn_norm, mlp_norm   2 × (bsd·e + bs·4)     RMSNorm as a fused kernel saves it (model.FusedRMSNorm): its
                                                   input in its own dtype and one fp32 rstd per token.
                                                   fused_norm=False: F.rms_norm as the CPU runs it, a composite
                                                   saving an fp32 copy of x and x·rstd: 2·bsd·4 + bs·4
      attn.q_proj           bsd·e                  the normed x, one storage shared by q, k, v projections
      attn                  4·bsd·e + b·n_h·s·4    SDPA keeps q, k, v (k, v already repeated to n_h heads: GQA
                            + 4·s·(h_d/2)·4        saves nothing here), its output (which o_proj reuses) and
                                                   fp32 log-sum-exp; rotary cos and sin tables of q and k
      mlp.gate_proj         bsd·e                  the normed x, shared by gate and up projections
      mlp                   3·bsI·e                gate and up outputs, silu(gate)
      mlp.down_proj         bsI·e                  silu(gate)·up
    once:
      embed                 bs·8                   the token ids (int64)
      norm, head            bsd·e + bs·4, bsd·e    final RMSNorm as above; the head's input
      loss                  bsV·4 + bs·8 + 4       fp32 log-probabilities, target ids, cross-entropy's
                                                   weight sum

Only the rotary tables and the 4-byte weight sum do not grow with the batch.

Activation checkpointing (course_lib.recompute, torch.utils.checkpoint) changes what a layer keeps:

    recompute="selective"   the attention core (GQA's repeat, SDPA) keeps only its inputs q, k, v, with k and v
                            at n_kv heads: attn = (bsd + 2·b·s·n_kv·h_d)·e + rotary tables; its output,
                            o_proj's input, is saved by o_proj (bsd·e); the log-sum-exp is recomputed
    recompute="full"        a layer keeps its input, bsd·e (/ t under sequence parallelism); backward reruns
                            one layer at a time, so the peak adds one layer's own terms These bytes are measured
exactly by `SavedActivations`, which counts the tensors autograd saves (torch.autograd.graph.
saved_tensors_hooks), each storage once, leaving out parameters and views of parameters (a Linear saves
weight.t(), which is a view of the weight, not new memory).

Measured by course_lib.measure (state from tensor storage, activations from saved-tensor hooks); the
16-bit optimizer with exactly these 12 bytes is course_lib.mixed_precision.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .model import count_params

# ---------------------------------------------------------------------------------------------------
# 1. Training state
# ---------------------------------------------------------------------------------------------------

class Convention(NamedTuple):
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    description: str

    @property
    def total(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def per_param(self) -> dict[str, int]:
        """The keyword arguments of zero_state_bytes: zero_state_bytes(P, 0, 1, **convention.per_param)."""
        return {"weight_bytes": self.weight_bytes, "grad_bytes": self.grad_bytes,
                "optimizer_bytes": self.optimizer_bytes}


CONVENTIONS = {
    "mixed": Convention(2, 2, 12, "mixed-precision Adam: 16-bit weights and grads; fp32 master weights, m and v "
                                  "(ZeRO paper, the source's 16 bytes/param)"),
    "fp32": Convention(4, 4, 8, "fp32 Adam: fp32 weights and grads; fp32 m and v (no master copy needed)"),
    "bf16+fp32 grads": Convention(2, 4, 12, "16-bit weights; backward accumulates straight into fp32 gradients "
                                            "(Megatron-LM's table: 16-bit params, fp32 grads, 18 bytes/param)"),
    "fp32 grad accumulation": Convention(2, 2 + 4, 12, "16-bit weights and grads, plus an fp32 copy of the grads "
                                                       "summed over micro-batches (Megatron-LM's table: 20 bytes/param)"),
}

ZERO_STAGES = (0, 1, 2, 3)


def _count(name: str, value, minimum: int = 0) -> int:
    """An integer ≥ minimum. Integral floats (7.1e9) are accepted: people write parameter counts that way."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"{name}={value!r}: must be a whole number")
    if value < minimum:
        raise ValueError(f"{name}={value!r}: must be >= {minimum}")
    return int(value)


def check_zero_stage(zero_stage) -> None:
    if zero_stage not in ZERO_STAGES or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage={zero_stage!r}: ZeRO stages are 0 (plain DDP), 1, 2, 3")


def zero_state_bytes(num_params, zero_stage: int, world_size: int, weight_bytes: int = 2, grad_bytes: int = 2,
                     optimizer_bytes: int = 12) -> dict[str, int]:
    """Bytes of training state on one rank: {"weights", "grads", "optimizer", "total"}.

    ZeRO stage 0 is plain data parallelism (every rank holds everything); stages 1, 2, 3 shard the optimizer
    state, then also the gradients, then also the weights over `world_size` ranks. A sharded part holds
    ceil(num_params / world_size) parameters: the largest shard, and every shard when world_size divides
    num_params. Defaults are mixed-precision Adam (2 + 2 + 12); CONVENTIONS lists others.
    """
    num_params = _count("num_params", num_params)
    check_zero_stage(zero_stage)
    world_size = _count("world_size", world_size, minimum=1)
    per_param = {"weights": _count("weight_bytes", weight_bytes), "grads": _count("grad_bytes", grad_bytes),
                 "optimizer": _count("optimizer_bytes", optimizer_bytes)}
    shard = -(-num_params // world_size)             # ceil division, exact for any size of integer
    # Stage k shards the last k parts of the list below: optimizer first, weights last.
    sharded = {"optimizer": zero_stage >= 1, "grads": zero_stage >= 2, "weights": zero_stage >= 3}
    state = {part: per_param[part] * (shard if sharded[part] else num_params) for part in per_param}
    state["total"] = sum(state.values())
    return state


def deepspeed_estimate(num_params, stage: int, world_size: int, largest_layer_params: int = 0) -> int:
    """Bytes per GPU that DeepSpeed's estimators print (no offload), for comparison with zero_state_bytes.

    stage 2, estimate_zero2_model_states_mem_needs:  2·P + 18·P/N   (16-bit weights whole; 16-bit and fp32
             gradients, fp32 master, m and v sharded: 18 bytes, its own comment's sum. DeepSpeed's #5099, 2024,
             deepspeed/runtime/zero/stage_1_and_2.py; before it the estimator printed 4·P + 16·P/N)
    stage 3, estimate_zero3_model_states_mem_needs:  18·P/N + 4·largest_layer   (16-bit weights and the 16
             sharded bytes; one layer's 16-bit weights and grads gathered whole)
    DeepSpeed prints these divided by 2**30 but labelled "GB": they are GiB.
    """
    num_params = _count("num_params", num_params)
    world_size = _count("world_size", world_size, minimum=1)
    largest_layer_params = _count("largest_layer_params", largest_layer_params)
    # Float division truncated to an integer, as DeepSpeed computes it.
    if stage == 2:
        return 2 * num_params + int(18 * num_params / world_size)
    if stage == 3:
        return 4 * largest_layer_params + int(18 * num_params / world_size)
    raise ValueError(f"stage={stage!r}: DeepSpeed's estimators cover stage 2 (also used for stage 1) and stage 3")


# ---------------------------------------------------------------------------------------------------
# 2. Activations: the published formula, and the course model's own
# ---------------------------------------------------------------------------------------------------

# course_lib.recompute's policies: what a layer keeps for backward ("op": torchtitan's per-op selective AC)
RECOMPUTE = ("none", "selective", "op", "full")


def _check_shape(seq_len, batch_size, hidden, heads, num_layers=1, tp=1):
    for name, value in [("seq_len", seq_len), ("batch_size", batch_size), ("hidden", hidden), ("heads", heads),
                        ("num_layers", num_layers), ("tp", tp)]:
        _count(name, value, minimum=1)
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not divisible by heads={heads}: every head gets hidden/heads values")
    if heads % tp:
        raise ValueError(f"heads={heads} is not divisible by tp={tp}: tensor parallelism gives each rank whole heads")


def gpt3_layer_terms(seq_len: int, batch_size: int, hidden: int, heads: int) -> dict[str, int]:
    """Korthikanti et al.'s per-layer terms (16-bit, no parallelism); they sum to sbh·(34 + 5as/h)."""
    _check_shape(seq_len, batch_size, hidden, heads)
    s, b, h, a = seq_len, batch_size, hidden, heads
    sbh = s * b * h
    return {
        "QKV input": 2 * sbh, "Q and K": 4 * sbh, "softmax output": 2 * a * s * s * b,
        "softmax dropout mask": a * s * s * b, "dropout output (for ·V)": 2 * a * s * s * b, "V": 2 * sbh,
        "output projection input": 2 * sbh, "attention dropout mask": sbh,
        "MLP first linear input": 2 * sbh, "GeLU input": 8 * sbh, "GeLU output": 8 * sbh, "MLP dropout mask": sbh,
        "two LayerNorm inputs": 4 * sbh,
    }


def activation_bytes(seq_len: int, batch_size: int, hidden: int, heads: int, num_layers: int = 1, tp: int = 1,
                     sequence_parallel: bool = False, recompute: str = "none") -> int:
    """Activation bytes per rank of `num_layers` GPT-3 style layers (Korthikanti et al. 2022, table 2).

    Per layer, 16-bit:  sbh·(34 + 5as/h);  tensor parallel: sbh·(10 + 24/t + 5as/(ht));  with sequence
    parallelism: sbh·(34/t + 5as/(ht)); selective recomputation drops the 5as/h term; full recomputation
    keeps 2·sbh (2·sbh/t with sequence parallelism). Embedding, final norm, output layer and loss are not
    included (the paper counts them apart).
    """
    _check_shape(seq_len, batch_size, hidden, heads, num_layers, tp)
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: Korthikanti et al.'s formula covers none, selective and full "
                         "(the course model's own, gpt_layer_activation_bytes, covers every policy)")
    s, b, h, a, t = seq_len, batch_size, hidden, heads, tp
    sbh = s * b * h
    split = t if sequence_parallel else 1            # sequence parallelism splits what plain TP keeps whole
    if recompute == "full":
        per_layer = 2 * sbh // split
    else:
        # heads % t == 0 and hidden % heads == 0 make every division below exact.
        per_layer = 10 * sbh // split + 24 * sbh // t
        if recompute == "none":
            per_layer += 5 * a * s * s * b // t
    return num_layers * per_layer


PREDICTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The terms of gpt_activation_bytes, for display: formula (b batch, s sequence, d hidden, I intermediate,
# L layers, n_h heads, h_d head_dim, V vocabulary, e bytes per value) and what is saved.
GPT_ACTIVATION_TERMS = {
    "embed": ("b·s·8", "token ids (int64)"),
    "attn_norm": ("L·(bsd·e + bs·4)", "RMSNorm (fused): its input, and one fp32 rstd per token"),
    "attn.q_proj": ("L·bsd·e", "normed x, one storage for the q, k, v projections"),
    "attn": ("L·(4·bsd·e + b·n_h·s·4 + 8·s·h_d)", "SDPA's q, k, v, output, log-sum-exp; rotary cos/sin"),
    "mlp_norm": ("L·(bsd·e + bs·4)", "RMSNorm (fused), as above"),
    "mlp.gate_proj": ("L·bsd·e", "normed x, one storage for the gate and up projections"),
    "mlp": ("L·3·bsI·e", "gate and up outputs, silu(gate)"),
    "mlp.down_proj": ("L·bsI·e", "silu(gate)·up"),
    "norm": ("bsd·e + bs·4", "final RMSNorm, as above"),
    "head": ("bsd·e", "normed x"),
    "loss": ("bsV·4 + bs·8 + 4", "fp32 log-probabilities, target ids, weight sum"),
}


def rms_norm_bytes(batch_size: int, seq_len: int, hidden: int, dtype=torch.float32, fused: bool = True) -> int:
    """Bytes one RMSNorm saves for backward on [batch, seq, hidden] in ``dtype``: fused (model.FusedRMSNorm, as
    torch's CUDA kernel), its input in its own dtype and an fp32 rstd per token, b·s·d·e + b·s·4; decomposed
    (F.rms_norm on the CPU), an fp32 copy of the input and of x·rstd, and rstd, 2·b·s·d·4 + b·s·4."""
    tokens, e = batch_size * seq_len, torch.tensor([], dtype=dtype).element_size()
    return tokens * hidden * (e if fused else 2 * 4) + tokens * 4


def _check_activation_shape(config, batch_size, seq_len, dtype) -> tuple[int, int, int]:
    """(b, s, e): batch, sequence, bytes per activation value, checked against ``config``."""
    if dtype not in PREDICTED_DTYPES:
        raise ValueError(f"dtype={dtype}: the prediction covers {', '.join(map(str, PREDICTED_DTYPES))}")
    b = _count("batch_size", batch_size)
    s = _count("seq_len", seq_len, minimum=1)
    if s > config.max_seq_len:
        raise ValueError(f"seq_len={s} > max_seq_len={config.max_seq_len} of this config")
    return b, s, torch.tensor([], dtype=dtype).element_size()


def gpt_layer_activation_bytes(config, batch_size: int, seq_len: int, dtype=torch.float32, tp: int = 1,
                               sequence_parallel: bool = False, *, recompute: str = "none",
                               fused_norm: bool = True) -> dict[str, int]:
    """One layer's terms of gpt_activation_bytes on one of ``tp`` tensor-parallel ranks (course_lib.
    tensor_parallel). What works on this rank's heads or MLP slice divides by tp: SDPA's q, k, v, output and
    log-sum-exp, the MLP's gate, up, silu(gate) and product. What TP keeps whole stays whole: the two norms and
    the normed x that the column projections read (the residual stream is replicated), and the rotary tables
    (one row per position, whatever the heads).

    ``sequence_parallel`` (apply_tp(..., sequence_parallel=True)): the two norms work on s/tp tokens, / tp. The
    normed x that the column projections save stays whole: it is the all-gather's output, b·s·d on every rank
    (Megatron-LM saves the slice and all-gathers it again in backward; Korthikanti's 34/t assumes that). So
    per layer the course saves 2·bsd·e more than "everything / tp" would.

    ``recompute`` (course_lib.recompute): "selective", the attention core keeps q, k, v (k and v at their
    n_kv heads) and o_proj saves its output; "op", the layer's input and the outputs of q_proj, v_proj, SDPA (with
    its log-sum-exp), gate_proj and down_proj (torch keeps them in the checkpoint, recompute.EveryOtherMatmul
    counts them); "full", {"layer input": b·s·d·e (/ tp under SP)}: what the layer
    keeps while backward has not reached it. ``fused_norm`` False: the norms as F.rms_norm decomposed saves them
    (rms_norm_bytes). Exact for torch 2.13 on CPU (the virtual cluster and the tests measure it)."""
    b, s, e = _check_activation_shape(config, batch_size, seq_len, dtype)
    _count("tp", tp, minimum=1)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: choose one of {', '.join(RECOMPUTE)}")
    if config.num_heads % tp or config.intermediate % tp:
        raise ValueError(f"num_heads={config.num_heads} and intermediate={config.intermediate} must both divide "
                         f"by tp={tp}: each rank keeps whole heads and an equal slice of the MLP")
    if sequence_parallel and s % tp:
        raise ValueError(f"seq_len={s} is not divisible by tp={tp}: sequence parallelism gives each rank s/tp tokens")
    d, inter, heads, kv_width = config.hidden, config.intermediate, config.num_heads, config.num_kv_heads * config.head_dim
    f32 = 4
    sequence_split = tp if sequence_parallel else 1      # the norms: whole under plain TP, s/tp tokens under SP
    if recompute == "full":
        return {"layer input": b * s * d * e // sequence_split}
    if recompute == "op":           # the layer's input, and the outputs recompute.EveryOtherMatmul keeps
        return {"layer input": b * s * d * e // sequence_split, "q_proj output": b * s * d * e // tp,
                "v_proj output": b * s * kv_width * e // tp,
                "attention output": (b * s * d * e + b * heads * s * f32) // tp,    # and its log-sum-exp
                "gate_proj output": b * s * inter * e // tp,
                "down_proj output": b * s * d * e}   # a row-parallel layer's partial sums: whole on each rank
    rms_norm = rms_norm_bytes(b, s, d, dtype, fused_norm) // sequence_split
    rotary = 4 * s * (config.head_dim // 2) * f32
    if recompute == "selective":    # q (n_h heads), k and v (n_kv heads) kept; SDPA's output saved by o_proj
        attention = {"attn": b * s * (d + 2 * kv_width) * e // tp + rotary, "attn.o_proj": b * s * d * e // tp}
    else:
        attention = {"attn": (4 * b * s * d * e + b * heads * s * f32) // tp + rotary}
    return {
        "attn_norm": rms_norm,
        "attn.q_proj": b * s * d * e,                    # the (gathered) whole normed x, even under SP
        **attention,
        "mlp_norm": rms_norm,
        "mlp.gate_proj": b * s * d * e,
        "mlp": 3 * b * s * inter * e // tp,
        "mlp.down_proj": b * s * inter * e // tp,
    }


def recomputed_layer_bytes(config, batch_size: int, seq_len: int, dtype=torch.float32, tp: int = 1,
                           sequence_parallel: bool = False, *, recompute: str = "full", fused_norm: bool = True) -> int:
    """What backward's rerun of one checkpointed piece saves beyond what the checkpoint holds (recompute.
    RecomputeMeter measures it), held while backward goes through that piece: the peak adds it once.

    "full", a layer: its own terms (gpt_layer_activation_bytes) less its input, which the norm saves and the
    checkpoint already keeps (F.rms_norm decomposed saves an fp32 copy instead, except in fp32); "op", the same
    less SDPA's output and gate_proj's, which the forward kept (gpt_layer_activation_bytes). "selective", an
    attention core: SDPA's repeated k and v, its output and log-sum-exp, (3·b·s·d·e + b·n_h·s·4) / tp (q, the
    core's input, is kept). "none": 0."""
    b, s, e = _check_activation_shape(config, batch_size, seq_len, dtype)
    if recompute == "selective":
        return (3 * b * s * config.hidden * e + b * config.num_heads * s * 4) // tp
    if recompute not in ("full", "op"):
        return 0
    layer = gpt_layer_activation_bytes(config, b, s, dtype, tp, sequence_parallel, fused_norm=fused_norm)
    layer_input = gpt_layer_activation_bytes(config, b, s, dtype, tp, sequence_parallel,
                                             recompute="full")["layer input"]
    shared = fused_norm or e == 4
    rerun = sum(layer.values()) - (layer_input if shared else 0)
    if recompute == "op":       # what backward reads that the forward kept already: SDPA's output, gate's
        kept = gpt_layer_activation_bytes(config, b, s, dtype, tp, sequence_parallel, recompute="op")
        rerun -= kept["attention output"] + kept["gate_proj output"]
    return rerun


def gpt_activation_bytes(config, batch_size: int, seq_len: int, dtype=torch.float32,
                         recompute: str = "none", *, fused_norm: bool = True) -> dict[str, int]:
    """Bytes that one forward of the course's GPT (course_lib.model) plus its loss saves for backward.

    Returns the terms of the module docstring, keyed by the module that saves them (layer terms summed
    over all layers), and "total". Exact for torch 2.13 on CPU; batch_size=0 gives the part that does not
    grow with the batch (rotary tables, one scalar). recompute (course_lib.recompute.apply_checkpointing):
    "selective" checkpoints each attention core; "op" keeps each layer's input and every second matmul's output;
    "full" keeps each layer's input. With any of them, the total is the
    peak: plus what one rerun (a core, a layer) saves while backward recomputes it ("one layer, recomputed",
    recomputed_layer_bytes).
    """
    b, s, e = _check_activation_shape(config, batch_size, seq_len, dtype)
    d, L = config.hidden, config.num_layers
    f32, i64 = 4, 8
    layer = gpt_layer_activation_bytes(config, b, s, dtype, recompute=recompute, fused_norm=fused_norm)
    terms = {"embed": b * s * i64}
    terms.update({name: L * nbytes for name, nbytes in layer.items()})
    if recompute != "none":
        terms["one layer, recomputed"] = recomputed_layer_bytes(config, b, s, dtype, recompute=recompute,
                                                                fused_norm=fused_norm)
    terms["norm"] = rms_norm_bytes(b, s, d, dtype, fused_norm)   # an RMSNorm like the layers' own
    terms["head"] = b * s * d * e
    terms["loss"] = b * s * config.vocab_size * f32 + b * s * i64 + f32
    terms["total"] = sum(terms.values())
    return terms


def active_params_per_token(config) -> int:
    """Parameters one token's forward pass multiplies by: all of ``count_params(config)`` but the experts the
    router does not send it to, (num_experts - top_k) expert MLPs of 3·d·intermediate per layer. A dense
    model's are all of them. Embedding and head count, as in Mistral's published 12.9e9 for Mixtral 8x7B
    (the embedding is a lookup: its rows cost no multiply).

    Total parameters set memory: every expert's weights, gradients and optimizer state are held (section 1's
    bytes per parameter × count_params), whichever tokens it serves. Active parameters set FLOPs: a token
    passes through top_k experts only, so a training step costs ≈ 6 · active · tokens. Mixtral 8x7B:
    46,702,792,704 total (747 GB of mixed-precision Adam state), 12,879,925,248 active (a 13B model's FLOPs).
    """
    total = count_params(config)
    if not getattr(config, "num_experts", 0):
        return total
    unused_experts = config.num_experts - config.top_k
    return total - config.num_layers * unused_experts * 3 * config.hidden * config.intermediate
