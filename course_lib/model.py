"""A small decoder-only transformer in the Llama style: the one model every notebook and lab uses.

    tokens ─ embed ─┬─ Block ─ ... ─ Block ─ norm ─ head ─ logits
                    Block(x):  x = x + attn(attn_norm(x))       (pre-norm residual blocks)
                               x = x + mlp(mlp_norm(x))

    RMSNorm(x)   = weight * x / sqrt(mean(x²) + eps)
    attention    = softmax(q kᵀ / sqrt(head_dim) + causal mask) v, with rotary positions on q and k;
                   grouped-query: num_heads query heads share num_kv_heads key/value heads
    MLP (SwiGLU) = down_proj(silu(gate_proj(x)) * up_proj(x))

The model knows nothing of parallelism. Later modules split it by these exact names:
`embed`, `layers[i]`, `norm`, `head`; inside a block `attn.{q,k,v,o}_proj` and `mlp.{gate,up,down}_proj`.
Attention reads its number of heads from the tensors, not from the config, so a tensor-parallel rank
whose projections hold only some of the heads runs the same forward. A pipeline stage can keep a slice
of `layers` and replace `embed`, `norm` or `head` with `nn.Identity()`.

Parameter count (P = `param_count_formula`, d = hidden, h = head_dim, L = num_layers):
    P = V·d (embed) + L·[d·(n_heads + 2·n_kv)·h + n_heads·h·d  (q, k, v, o)
                         + 3·d·intermediate                     (gate, up, down)
                         + 2·d]                                 (two norms)
        + d (final norm) + V·d (head, 0 when tied to embed)
    A mixture of experts (num_experts = E > 0, course_lib.feed_forward) has E MLPs and a router per layer:
    3·d·intermediate becomes E·3·d·intermediate + d·E.
"""

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .feed_forward import (
    MLP as MLP,  # the feed-forward layers live in feed_forward.py; named here, where the model is built
)
from .feed_forward import MoE
from .runtime.arguments import is_number


@dataclass(kw_only=True)   # keywords only: ModelConfig(hidden=64, ...) reads better than 7 bare numbers
class ModelConfig:
    vocab_size: int
    hidden: int               # model width d: the size of every token's vector in the residual stream
    num_layers: int
    num_heads: int            # query heads
    num_kv_heads: int | None = None   # key/value heads (grouped-query attention); None means num_heads
    intermediate: int         # width of the SwiGLU hidden layer
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False      # head.weight is embed.weight
    attn_bias: bool = False           # q/k/v biases, only so Qwen2 can be counted exactly
    num_experts: int = 0              # > 0: each block's MLP is a mixture of this many experts (0: one dense MLP)
    top_k: int = 2                    # experts each token is sent to (only with num_experts > 0)

    def __post_init__(self):
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        for name in ("vocab_size", "hidden", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}: "
                             "each head gets an equal slice of the model width")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}: "
                             "each key/value head must serve a whole group of query heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = hidden/num_heads = {self.hidden}/{self.num_heads} = {self.head_dim} "
                             "is odd: rotary embeddings rotate channels in pairs")
        whole = all(isinstance(v, int) and not isinstance(v, bool) for v in (self.num_experts, self.top_k))
        if not whole or self.num_experts < 0 or (self.num_experts and not 1 <= self.top_k <= self.num_experts):
            raise ValueError(f"num_experts={self.num_experts!r} must be a whole number >= 0 (0: a dense MLP) and "
                             f"top_k={self.top_k!r} a whole number between 1 and num_experts")
        if not all(is_number(v) and v > 0 for v in (self.rope_theta, self.norm_eps)):
            raise ValueError(f"rope_theta={self.rope_theta} and norm_eps={self.norm_eps} must both be finite and > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm over the last dimension, forward and backward by hand, saving what a fused kernel saves.

    Forward, per token (a row x of d values), in at least float32 (c = the computation dtype):
        r = 1 / sqrt(mean(x²) + eps)          the reciprocal RMS, "rstd": one number per token
        y = (x·r) ⊙ w                          cast back to x's dtype
    Backward, with x̂ = x·r and g = dy ⊙ w:
        dw = Σ_tokens dy ⊙ x̂
        dx = r · (g - x̂ · mean(g ⊙ x̂))       (d/dx of x·r(x): r·I - r³·x xᵀ/d, applied to g)
    Saved for backward: x in its own dtype, w (a parameter: no new memory) and r in c, so b·s·d·e + b·s·4
    bytes in 16-bit or fp32 training. torch's fused kernel saves exactly these: derivatives.yaml (torchgen/
    packaged/autograd) gives `_fused_rms_norm` (CUDA, MPS, XPU) the backward `_fused_rms_norm_backward(grad,
    input, normalized_shape, result1, weight, ...)`, and the generated FusedRmsNormBackward0 (torch/include/
    torch/csrc/autograd/generated/Functions.h) holds input_, weight_ and result1_ (rstd); torch/_decomp/
    decompositions.py writes out the same maths. Apex's and Transformer Engine's kernels save the same.
    ``F.rms_norm`` on the CPU runs a composite of small ops instead (rms_norm_composite: no fused kernel there),
    each saving its own input: an fp32 copy of x, rstd and x·r in fp32, 2·b·s·d·4 + b·s·4 bytes (notebook 01).
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        compute = torch.promote_types(x.dtype, torch.float32)     # float64 stays float64
        x_c = x.to(compute)
        rstd = torch.rsqrt(x_c.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x_c * rstd * weight.to(compute)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        compute = rstd.dtype
        x_hat = x.to(compute) * rstd
        g = grad.to(compute) * weight.to(compute)
        grad_x = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        grad_w = (grad.to(compute) * x_hat).reshape(-1, x.shape[-1]).sum(0)
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dimension, as a fused kernel computes and saves it (FusedRMSNorm)."""
    return FusedRMSNorm.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """``fused`` (the default): FusedRMSNorm, what GPU training runs. False: torch's ``F.rms_norm``, which on
    the CPU is a composite of small ops saving fp32 copies (the same values: float64 parity, tests/test_model.py)."""

    def __init__(self, dim: int, eps: float, fused: bool = True):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if self.fused:
            return rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def apply_rope(x, theta: float):
    """Rotary position embedding of x[batch, seq, heads, head_dim].

    Channel pair (i, i + head_dim/2) at position p is rotated by the angle p·θ^(-2i/head_dim), so the
    dot product q·k depends only on the distance between the two positions. The angles are computed
    here from the positions (no buffer, no parameter): cheap, and it works on the meta device.
    """
    seq, head_dim = x.shape[1], x.shape[-1]
    # At least float32 (bf16 angles would be off by whole degrees at long positions), and float64 stays
    # float64, so that float64 runs round only at float64's precision.
    dtype = torch.promote_types(x.dtype, torch.float32)
    freqs = theta ** (-torch.arange(0, head_dim, 2, device=x.device, dtype=dtype) / head_dim)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=dtype), freqs)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]   # [seq, 1, head_dim/2]: same for all heads
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim, self.rope_theta = config.head_dim, config.rope_theta
        q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden, q_width, bias=config.attn_bias)
        self.k_proj = nn.Linear(config.hidden, kv_width, bias=config.attn_bias)
        self.v_proj = nn.Linear(config.hidden, kv_width, bias=config.attn_bias)
        self.o_proj = nn.Linear(q_width, config.hidden, bias=False)

    def forward(self, x):
        batch, seq, _ = x.shape
        # -1, not config.num_heads: under tensor parallelism this rank holds only some of the heads.
        q = apply_rope(self.q_proj(x).view(batch, seq, -1, self.head_dim), self.rope_theta)
        k = apply_rope(self.k_proj(x).view(batch, seq, -1, self.head_dim), self.rope_theta)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)
        return self.o_proj(self.core(q, k, v))

    def core(self, q, k, v):
        """The attention core, q, k, v [batch, seq, heads, head_dim] → [batch, seq, heads·head_dim]: what
        selective recomputation reruns (course_lib.recompute)."""
        batch, seq = q.shape[:2]
        # Grouped-query attention: query heads [g·i, g·(i+1)) all read key/value head i.
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)               # [batch, heads, seq, head_dim]
        return out.transpose(1, 2).reshape(batch, seq, -1)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden, config.norm_eps)
        self.mlp = MoE(config) if config.num_experts else MLP(config)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        """tokens: LongTensor[batch, seq] -> logits[batch, seq, vocab_size]."""
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} > max_seq_len={self.config.max_seq_len}")
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def loss_fn(logits, targets):
    """Mean cross entropy over every token of the batch, in at least float32: bf16 logits lose the small
    probabilities that the log-softmax needs (float64 stays float64)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build(config: ModelConfig, seed: int = 0, device=None, dtype=None) -> GPT:
    """A GPT whose parameters depend only on `seed` (not on the global RNG, which is left untouched).

    Init: normal(0, 0.02) for embeddings and linears; the two projections that write into the residual
    stream (o_proj, down_proj) get 0.02/sqrt(2·num_layers), so the stream's variance does not grow with
    depth (as GPT-2); biases 0, norm weights 1. Parameters are drawn on the CPU in float32 and then moved,
    so every device and dtype starts from the same numbers. device="meta" allocates nothing.
    """
    # On meta, torch's default init runs on no data and draws nothing from the global RNG.
    with torch.device("meta"):
        model = GPT(config)
    if device is None or torch.device(device).type != "meta":
        model.to_empty(device="cpu")
        if config.tie_embeddings:   # to_empty gives each module its own new tensor: tie them again
            model.head.weight = model.embed.weight
        generator = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * config.num_layers)
        with torch.no_grad():
            for name, param in model.named_parameters():   # a tied weight is listed (and drawn) once
                if "norm" in name:
                    param.fill_(1.0)
                elif name.endswith("bias"):
                    param.zero_()
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    param.normal_(0.0, residual_std, generator=generator)
                else:
                    param.normal_(0.0, 0.02, generator=generator)
    model.to(device=device, dtype=dtype)
    return model


PRESETS = {
    # Small enough for a laptop CPU; heads (8), kv heads (4) and intermediate (128) divide by TP = 2 and 4,
    # and the 4 layers split evenly over 2 or 4 pipeline stages.
    "tiny": ModelConfig(vocab_size=128, hidden=64, num_layers=4, num_heads=8, num_kv_heads=4,
                        intermediate=128, max_seq_len=64),
    # The published configurations (Hugging Face config.json of each model).
    "llama2-7b": ModelConfig(vocab_size=32000, hidden=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                             intermediate=11008, max_seq_len=4096),
    "llama2-70b": ModelConfig(vocab_size=32000, hidden=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                              intermediate=28672, max_seq_len=4096),
    "qwen2-7b": ModelConfig(vocab_size=152064, hidden=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                            intermediate=18944, max_seq_len=32768, rope_theta=1e6, norm_eps=1e-6,
                            attn_bias=True),
    "mixtral-8x7b": ModelConfig(vocab_size=32000, hidden=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                                intermediate=14336, max_seq_len=32768, rope_theta=1e6, num_experts=8, top_k=2),
    # Llama 3 405B: the paper's Table 3 (the vocabulary from its config.json).
    "llama3-405b": ModelConfig(vocab_size=128256, hidden=16384, num_layers=126, num_heads=128, num_kv_heads=8,
                               intermediate=53248, max_seq_len=8192, rope_theta=500000.0),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A fresh copy of a named config, e.g. preset("tiny", num_layers=12)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def widened(hidden: int) -> dict:
    """Overrides that make the tiny model ``hidden`` wide in its own proportions: heads of 8 channels, 2 query
    heads per key/value head, an MLP 3× as wide (so every width divisible by 16 splits over TP = 2, 4, 8).
    Use as preset("tiny", **widened(1024))."""
    return {"hidden": hidden, "num_heads": hidden // 8, "num_kv_heads": hidden // 16, "intermediate": 3 * hidden}


def count_params(config: ModelConfig) -> int:
    """Exact parameter count, from a model built on the meta device (shapes only, no memory).
    parameters() lists a tied weight once, so it is counted once."""
    with torch.device("meta"):
        model = GPT(config)
    return sum(p.numel() for p in model.parameters())


def layer_projection_params(config: ModelConfig) -> int:
    """Parameters of one layer's projections: attention's q, k, v, o (and q/k/v biases) and the MLP's gate,
    up, down. Everything in a layer but its two norms (what tensor parallelism splits)."""
    d, h = config.hidden, config.head_dim
    q_width, kv_width = config.num_heads * h, config.num_kv_heads * h
    attention = d * q_width + 2 * d * kv_width + q_width * d          # q, k, v, o weights
    if config.attn_bias:
        attention += q_width + 2 * kv_width                           # q, k, v biases
    mlp = 3 * d * config.intermediate                                 # gate, up, down
    if config.num_experts:
        mlp = config.num_experts * mlp + d * config.num_experts       # every expert's, and the router
    return attention + mlp


def param_count_formula(config: ModelConfig) -> int:
    """The same count in closed form (see the module docstring); tested equal to count_params."""
    d = config.hidden
    norms = 2 * d                                                     # attn_norm, mlp_norm
    embed = config.vocab_size * d
    head = 0 if config.tie_embeddings else config.vocab_size * d
    return embed + config.num_layers * (layer_projection_params(config) + norms) + d + head
