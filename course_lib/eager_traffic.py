"""What the course's own model moves through memory when PyTorch runs it op by op (eager), counted by running it.

kernel_times prices a layer's memory-bound work as the frameworks of the published GPU runs run it: each of
RMSNorm, rotary, the residual add and SwiGLU's product one fused kernel that reads its inputs once and writes its
output once. The course's model (course_lib.model) runs on this CPU as model.py writes it, one op at a time, and
each op reads its inputs from memory and writes its output back:

    RMSNorm     forward pow, mean, add, rsqrt, two multiplies; backward nine ops (FusedRMSNorm.backward)
    rotary      per q and k: the angles (eight small ops), four multiplies, a subtract, an add, a cat;
                backward eight ops
    attention   repeat_interleave of k and v (grouped-query), and in backward the sums that undo it
    SwiGLU      silu, a multiply; backward silu's and the multiply's
    residual    the two adds, and in backward the adds where a gradient arrives by two paths (q, k and v from
                one input; gate and up from one; each residual)

so in fp32 it moves about three times the fused count (the tiny model's layer, 8 × 64 tokens: 48 ops forward and
44 backward, 17.8 MB in all, against 5.8 MB); in bf16 more, for the norms and rotary compute in fp32 and cast.
Here those ops are counted, not assumed: a layer (and, for the last stage, the final norm and the loss) runs
forward and then backward on the meta device (shapes only: no data, no time, any size) under a dispatch mode that
sees every op autograd runs, and adds up, for every op that touches a tensor,

    bytes(op) = Σ over its tensor inputs and outputs of min(numel · element size, its storage's bytes)

(the min: a broadcast input, expanded to many elements, is read from one small storage). Left out: views (no data
moved) and the kernels kernel_times times by their FLOPs, the matmuls and the attention kernel. SDPA is sent to
torch's CPU flash kernel, the one it runs on this CPU (on the meta device it would fall back to its unfused maths).
A tensor-parallel rank's layer is the same Block with its projections narrowed to the rank's share (what
tensor_parallel shards: q, k, v, gate and up by output columns, o and down by input rows); its collectives are no
ops of this count. A mixture of experts is not counted: its routing depends on the data, which the meta device
does not have. Not counted either: the attention core's grouped-query copies again where selective recomputation
reruns the core alone, and the gradient's accumulation from the second micro-batch on (an add per parameter).

Frameworks write rotary differently, and run eager it costs them differently (layer_traffic's ``rotary``: each
counted on q and k of the rank's heads, in place of model.py's; ROTARY):

    "model.py"     the course's apply_rope: the angles from the positions at every call (eight small ops), both
                   halves rotated in fp32 (four multiplies, a subtract, an add, a cat), cast back
    "complex"      torchtitan's (apply_rotary_emb; ComplexRoPE): the angles precomputed once as complex numbers
                   (freqs_cis), q and k cast to fp32, multiplied as complex numbers, cast back
    "rotate_half"  Hugging Face's Llama (apply_rotary_pos_emb): cos and sin computed once a forward, in the
                   activation's dtype, then x·cos + rotate_half(x)·sin, its halves sliced (backward pads each
                   slice's gradient back to the whole width, and adds the three paths into x)

For Llama 3 8B's layer (one sequence of 8,192 tokens, bf16) the course's moves about 2.5 times the bytes of
torchtitan's and 2.1 times Hugging Face's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from functools import lru_cache
from types import MappingProxyType

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .model import Block, ModelConfig, RMSNorm, apply_rope, loss_fn
from .tensor_parallel import check_tp_divisible

TIMED_ON_THEIR_OWN = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_flash_attention_for_cpu_backward"}
NOT_DATA = {"_unsafe_view"}                         # a view by another name
DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
COLUMN_SPLIT, ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Traffic:
    kernels: int              # ops that touch a tensor and move its data (each one launch)
    bytes: int                # what they read and write, at least


class _Counter(TorchDispatchMode):
    """Every op dispatched while active, but views and TIMED_ON_THEIR_OWN: how many, and their bytes."""

    def __init__(self):
        super().__init__()
        self.kernels, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [x for x in tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor)]
        name = func.__name__.split(".")[0]
        if tensors and not func.is_view and name not in TIMED_ON_THEIR_OWN | NOT_DATA:
            self.kernels += 1
            self.bytes += sum(min(x.numel() * x.element_size(), x.untyped_storage().nbytes()) for x in tensors)
        return out

    def traffic(self) -> Traffic:
        return Traffic(self.kernels, self.bytes)


class _CpuFlash(TorchFunctionMode):
    """F.scaled_dot_product_attention as torch runs it on a CPU, its flash kernel, on the meta device too (where
    SDPA would otherwise run its unfused maths: a softmax over the scores, and more ops)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            if len(args) > 3 or set(kwargs) - {"is_causal"}:
                raise ValueError("eager_traffic counts SDPA called as model.py calls it, (q, k, v, is_causal=...); "
                                 f"got {len(args)} positional arguments and {sorted(kwargs)}")
            q, k, v = args
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, is_causal=kwargs.get("is_causal", False))[0]
        return func(*args, **kwargs)


def _forward_backward(forward, device: str) -> MappingProxyType:
    """{"forward", "backward"}: the traffic of ``forward()`` and of the backward of what it returns (read-only:
    the caches below hand the same one to every caller)."""
    with torch.enable_grad():                          # counted the same under a caller's no_grad()
        with _CpuFlash() if device == "meta" else contextlib.nullcontext(), _Counter() as counted:
            out = forward()
        grad = torch.ones_like(out)                    # outside the count: the gradient arriving from above
        with _Counter() as counted_backward:
            out.backward(grad)
    return MappingProxyType({"forward": counted.traffic(), "backward": counted_backward.traffic()})


@lru_cache(maxsize=256)
def _counted(part: str, fields: tuple, micro_batch_size: int, seq_len: int, split: int, bytes_per_element: int,
             device: str) -> MappingProxyType:
    """``part`` "layer": a Block on one of ``split`` TP ranks; "head": the final norm, the head over 1/``split``
    of the vocabulary, and the loss; "norm": one RMSNorm. Cached: a config's count is the same every time."""
    config = ModelConfig(**dict(fields))
    dtype = DTYPES[bytes_per_element]
    with torch.device(device):
        x = torch.randn(micro_batch_size, seq_len, config.hidden, dtype=dtype, requires_grad=True)
        if part == "layer":
            block = _tp_rank_block(config, split, dtype)
            return _forward_backward(lambda: block(x), device)
        norm = RMSNorm(config.hidden, config.norm_eps).to(dtype)
        if part == "norm":
            return _forward_backward(lambda: norm(x), device)
        head = nn.Linear(config.hidden, config.vocab_size // split, bias=False, dtype=dtype)
        targets = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
    return _forward_backward(lambda: loss_fn(head(norm(x)), targets), device)


ROTARY = ("model.py", "complex", "rotate_half")


def check_rotary(rotary: str) -> None:
    """Refuse a rotary eager_traffic cannot count, naming the ones it can."""
    if rotary not in ROTARY:
        raise ValueError(f"rotary={rotary!r}: one of {', '.join(map(repr, ROTARY))} (eager_traffic's docstring)")


def _complex_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """torchtitan's rotary (module docstring): channel pairs (2i, 2i + 1) as complex numbers, times e^(i·angle)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * angles[:, None, :]).flatten(3).type_as(x)


def _rotate_half_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotary (module docstring): channel pairs (i, i + h_d/2), in x's dtype, its halves sliced."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@lru_cache(maxsize=256)
def _rotary_counted(rotary: str, fields: tuple, micro_batch_size: int, seq_len: int, tp: int,
                    bytes_per_element: int, device: str = "meta") -> MappingProxyType:
    """``rotary`` (ROTARY) on q and k of one of ``tp`` TP ranks, each [b, s, heads, h_d], forward and backward,
    its angles computed outside the count where the framework computes them once (module docstring)."""
    config, dtype = ModelConfig(**dict(fields)), DTYPES[bytes_per_element]
    half = config.head_dim // 2
    counts = []
    with torch.device(device):
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), torch.ones(half))   # shapes are what count
        complex_angles = torch.polar(torch.ones_like(angles), angles)                # torchtitan's freqs_cis
        cos, sin = (torch.cat([f(angles)] * 2, dim=-1)[:, None, :].to(dtype) for f in (torch.cos, torch.sin))
        rotate = {"model.py": lambda x: apply_rope(x, config.rope_theta),
                  "complex": lambda x: _complex_rotary(x, complex_angles),
                  "rotate_half": lambda x: _rotate_half_rotary(x, cos, sin)}[rotary]
        for heads in (config.num_heads // tp, config.num_kv_heads // tp):
            x = torch.randn(micro_batch_size, seq_len, heads, config.head_dim, dtype=dtype, requires_grad=True)
            counts.append(_forward_backward(lambda: rotate(x), device))
    return MappingProxyType({way: Traffic(sum(c[way].kernels for c in counts), sum(c[way].bytes for c in counts))
                             for way in ("forward", "backward")})


def _tp_rank_block(config: ModelConfig, tp: int, dtype) -> Block:
    """A Block as one of ``tp`` ranks holds it: its projections narrowed to the rank's share (module docstring)."""
    block = Block(config).to(dtype)
    for module in list(block.modules()):
        for name, linear in list(module.named_children()):
            if isinstance(linear, nn.Linear) and tp > 1 and name in COLUMN_SPLIT + ROW_SPLIT:
                rows, columns = linear.in_features, linear.out_features
                rows, columns = (rows, columns // tp) if name in COLUMN_SPLIT else (rows // tp, columns)
                setattr(module, name, nn.Linear(rows, columns, bias=linear.bias is not None, dtype=dtype))
    return block


def _fields(config: ModelConfig, bytes_per_element: int) -> tuple:
    if bytes_per_element not in DTYPES:
        raise ValueError(f"bytes_per_element={bytes_per_element!r}: one of {sorted(DTYPES)} (bf16, fp32, fp64)")
    if getattr(config, "num_experts", 0):
        raise ValueError(f"num_experts={config.num_experts}: the eager traffic of a mixture of experts is not "
                         "counted (its routing depends on the data, which the meta device does not have)")
    return tuple(sorted(dataclasses.asdict(config).items()))


def layer_traffic(config: ModelConfig, *, micro_batch_size: int, seq_len: int, tp: int = 1,
                  bytes_per_element: int = 4, rotary: str = "model.py", device: str = "meta") -> MappingProxyType:
    """One layer's memory-bound ops on one of ``tp`` ranks, as model.py dispatches them: {"forward",
    "backward"} -> Traffic (module docstring), its rotary written as ``rotary`` says (ROTARY: model.py's count
    less its rotary's, plus the other's). ``device="cpu"`` runs it for real (the same count, slower)."""
    check_rotary(rotary)
    check_tp_divisible(config, tp)
    fields, shape = _fields(config, bytes_per_element), (micro_batch_size, seq_len, tp, bytes_per_element, device)
    counted = _counted("layer", fields, *shape)
    if rotary == "model.py":
        return counted
    ours, theirs = _rotary_counted("model.py", fields, *shape), _rotary_counted(rotary, fields, *shape)
    return MappingProxyType({way: Traffic(counted[way].kernels - ours[way].kernels + theirs[way].kernels,
                                          counted[way].bytes - ours[way].bytes + theirs[way].bytes)
                             for way in ("forward", "backward")})


def head_traffic(config: ModelConfig, *, micro_batch_size: int, seq_len: int, vocab_split: int = 1,
                 bytes_per_element: int = 4, device: str = "meta") -> MappingProxyType:
    """The final norm and the loss over one rank's ``vocab_size / vocab_split`` logits (the plain cross entropy's
    ops; vocab_parallel's own differ a little), as model.py dispatches them: {"forward", "backward"} -> Traffic."""
    return _counted("head", _fields(config, bytes_per_element), micro_batch_size, seq_len, vocab_split,
                    bytes_per_element, device)


def all_but_norms(counted: Mapping, config: ModelConfig, *, micro_batch_size: int, seq_len: int,
                  bytes_per_element: int, norms: int, sequence_split: int = 1) -> dict:
    """The ops still run one by one when the norms are fused kernels, timed apart (torchtitan's fused_rmsnorm,
    torch's nn.RMSNorm on a GPU): ``counted`` (layer_traffic's or head_traffic's) less ``norms`` RMSNorms as
    model.py dispatches them. ``sequence_split`` t > 1 (a layer under sequence parallelism): its two residual
    adds, which then run on T/t rows, less (1 - 1/t) of their bytes too (an add reads two and writes one,
    forward and backward)."""
    norm = _counted("norm", _fields(config, bytes_per_element), micro_batch_size, seq_len, 1, bytes_per_element,
                    "meta")
    adds = 2 * 3 * micro_batch_size * seq_len * config.hidden * bytes_per_element * (1 - 1 / sequence_split)
    return {way: Traffic(counted[way].kernels - norms * norm[way].kernels,
                         counted[way].bytes - norms * norm[way].bytes - round(adds)) for way in ("forward", "backward")}
