"""Tensor parallelism (张量并行), Megatron style: split a layer's matrices over the ranks of a group.

A linear layer computes Y = X·W (X: [tokens, in], W: [in, out]). With p ranks there are two ways to split W.

    By columns   W = [W_0 | W_1 | ... ]      rank i holds W_i = W[:, i·out/p : (i+1)·out/p]
                 Y = [X·W_0 | X·W_1 | ...]   rank i computes its slice Y_i = X·W_i; no sum is needed.
                 Backward: dX = dY·Wᵀ = Σ_i dY_i·W_iᵀ, a sum over ranks → all-reduce of dX.
    By rows      W = [W_0 ; W_1 ; ... ]      rank i holds W_i = W[i·in/p : (i+1)·in/p, :]
                 X = [X_0 | X_1 | ...]       and needs only its slice X_i of the input's features
                 Y = Σ_i X_i·W_i             each rank has a partial sum → all-reduce of Y.
                 Backward: dX_i = dY·W_iᵀ    dY is the same on every rank: no communication.

(nn.Linear stores W transposed, as weight[out, in]: a column split cuts weight's rows, a row split its columns.)

Megatron-LM puts a column-parallel layer first and a row-parallel layer second, so the column layer's output
slice *is* the row layer's input slice, and what sits between them (an activation, attention within a head)
runs on slices with no communication. Two conjugate operators carry the communication:

    f   forward: identity            backward: all-reduce      (before the column layer: dX is a sum)
    g   forward: all-reduce          backward: identity        (after the row layer: Y is a sum)

A transformer block then costs exactly one f and one g around attention (q, k, v by columns, i.e. by heads;
o_proj by rows) and one of each around the MLP (gate and up by columns, down by rows):

    per layer: 2 all-reduces forward (g) + 2 backward (f), each of one activation, batch × seq × hidden
    values. In bytes: b·s·h·e per all-reduce, and a ring all-reduce sends 2(p-1)/p of that per rank.

q, k and v share one f, and so do gate and up: :func:`apply_tp` applies f once at the input of `attn` and `mlp`
(``copy_input=False`` on those column layers). torch's DTensor ``ColwiseParallel`` reduces each layer's input
gradient on its own: 5 all-reduces backward per layer instead of 2.

Heads are split over ranks, so every rank must get whole heads, and with grouped-query attention its own
key/value heads: rank r keeps query heads [r·H/p, (r+1)·H/p) and key/value heads [r·K/p, (r+1)·K/p), which
are exactly the key/value heads its query heads read (query head j reads key/value head j // (H/K)).
So num_heads, num_kv_heads and intermediate must all divide by p: 16 heads cannot split over TP = 3.

Norms, embedding and head stay whole on every rank (replicated; vocab_parallel=True splits the last two and
the loss: course_lib.vocab_parallel); f and g make every replicated activation, and its gradient, whole.

Sequence parallelism (序列并行, Korthikanti et al. 2022), ``apply_tp(model, comm, sequence_parallel=True)``. Plain TP keeps
the residual stream whole between the matrices: every rank runs the same norms and saves the same activations. SP cuts
that stream along the sequence (rank r keeps tokens [r·s/p, (r+1)·s/p)), and f and g change partner: before the column
layers an all-gather (backward: reduce-scatter), after the row layers a reduce-scatter (backward: all-gather). An
all-reduce *is* a reduce-scatter then an all-gather, (p-1)/p·n bytes each: the layers send exactly plain TP's bytes.
Attention sees the whole gathered sequence: rotary positions stay global. New, and traced: (1) the first layer takes
its slice and the last one's output is gathered whole (backward: all-gather, and keep the slice), so embedding, final
norm, head and loss see whole activations: one all-gather each way per step; pipeline stages pass each other slices,
s/p tokens; (2) a norm's weight meets only this rank's tokens, so its gradient is a sum over ranks: f on the weight, 2
all-reduces of d values per layer in every backward (Megatron-LM: once per step, ``finalize_model_grads``; here
gradients are whole when backward returns). Gathered inputs stay whole (ledger.gpt_layer_activation_bytes).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .comm import Comm, wire_bytes
from .dtensor_plans import dtensor_plan as dtensor_plan  # torch's DTensor version of apply_tp
from .model import rms_norm
from .vocab_parallel import VocabParallelEmbedding, VocabParallelLoss

# ------------------------------------------------------------------------------ the conjugate operators

class CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)   # a new tensor object, same storage: autograd needs an output of its own

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()   # all-reduce sums in place: on our own copy, not autograd's buffer
        ctx.comm.all_reduce(grad)
        return grad, None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        x = x.contiguous().clone()   # the partial sum belongs to the caller's graph: reduce a copy
        comm.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """Concatenate every rank's slice along the last dimension; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        slices = torch.empty(comm.size * x.numel(), dtype=x.dtype, device=x.device)   # rank after rank
        comm.all_gather(slices, x.contiguous().view(-1))
        return torch.cat(slices.view(comm.size, *x.shape).unbind(0), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.comm.size, dim=-1)[ctx.comm.rank].contiguous(), None


def f(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Megatron's f (copy_to_tensor_model_parallel_region): identity forward, all-reduce backward."""
    return CopyToTensorParallelRegion.apply(x, comm)


def g(x: torch.Tensor, comm: Comm) -> torch.Tensor:   # Megatron's reduce_from_tensor_model_parallel_region
    return ReduceFromTensorParallelRegion.apply(x, comm)


def gather_last_dim(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """All-gather of the ranks' slices along the last dimension (gather_from_tensor_model_parallel_region)."""
    return GatherFromTensorParallelRegion.apply(x, comm)


# ------------------------------------------- sequence parallelism's operators, on [batch, seq, hidden]

def _check_sequence(seq_len: int, tp: int) -> None:
    if seq_len % tp:
        raise ValueError(f"sequence length {seq_len} is not divisible by TP={tp} ({seq_len} % {tp} = "
                         f"{seq_len % tp}): sequence parallelism gives each rank an equal slice of the tokens")


def _all_gather_sequence(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[b, s/p, d] on every rank → [b, s, d], the slices in rank order (Comm stacks them along dim 0)."""
    local = x.transpose(0, 1).contiguous()
    whole = torch.empty((comm.size * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(whole, local)
    return whole.transpose(0, 1).contiguous()   # one copy in [b, s, d]: q, k and v then save the same storage


def _reduce_scatter_sequence(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[b, s, d] partial sums on every rank → this rank's slice [b, s/p, d] of their sum."""
    _check_sequence(x.shape[1], comm.size)
    whole = x.transpose(0, 1).contiguous()
    mine = torch.empty((whole.shape[0] // comm.size, *whole.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(mine, whole)
    return mine.transpose(0, 1).contiguous()


def _my_slice(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    _check_sequence(x.shape[1], comm.size)
    return x.chunk(comm.size, dim=1)[comm.rank].clone(memory_format=torch.contiguous_format)   # a copy, not a view


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather along the sequence. Backward: reduce-scatter (``grad_is_partial``: the whole gradient is a
    sum over ranks, as before column layers), or this rank's slice (the gradient is whole on every rank)."""

    @staticmethod
    def forward(ctx, x, comm, grad_is_partial):
        ctx.comm, ctx.grad_is_partial = comm, grad_is_partial
        return _all_gather_sequence(x, comm)

    @staticmethod
    def backward(ctx, grad):
        reduce_or_slice = _reduce_scatter_sequence if ctx.grad_is_partial else _my_slice
        return reduce_or_slice(grad, ctx.comm), None, None


class ScatterToSequenceParallelRegion(torch.autograd.Function):
    """This rank's slice of the sequence: of the sum of every rank's x (``reduce``: a reduce-scatter, after the
    row layers), or of an x that every rank holds whole (no communication). Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, comm, reduce):
        ctx.comm = comm
        return _reduce_scatter_sequence(x, comm) if reduce else _my_slice(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sequence(grad, ctx.comm), None, None


# ------------------------------------------------------------------------------------ the two layers

def _rank_slice(size: int, comm: Comm, what: str) -> slice:
    if size % comm.size:
        raise ValueError(f"{what}={size} cannot split over TP={comm.size}: {size} % {comm.size} = "
                         f"{size % comm.size}, and every rank must get an equal slice")
    per_rank = size // comm.size
    return slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)


class ColumnParallelLinear(nn.Module):
    """Y_i = X·W_i: this rank's ``out_features / p`` output features (weight rows, in nn.Linear's layout).

    ``copy_input``: apply f to the input (its gradient all-reduced in backward); turn it off when one f is
    shared by several column layers reading the same input. ``gather_output``: all-gather the slices into
    the whole Y (otherwise the output is this rank's slice, ready for a :class:`RowParallelLinear`).
    """

    def __init__(self, in_features: int, out_features: int, comm: Comm, *, bias: bool = False,
                 gather_output: bool = False, copy_input: bool = True):
        super().__init__()
        self.comm, self.gather_output, self.copy_input = comm, gather_output, copy_input
        self.in_features, self.out_features = in_features, out_features
        rows = _rank_slice(out_features, comm, "out_features")
        bound = 1 / math.sqrt(in_features)   # nn.Linear's default init; each rank draws its own slice
        self.weight = nn.Parameter(torch.empty(rows.stop - rows.start, in_features).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.zeros(rows.stop - rows.start)) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, comm: Comm, **kwargs) -> ColumnParallelLinear:
        """This rank's slice of a dense layer that every rank holds alike (same seed)."""
        with torch.device("meta"):   # no memory, no random draws: the weights are replaced right below
            layer = cls(linear.in_features, linear.out_features, comm, bias=linear.bias is not None, **kwargs)
        rows = _rank_slice(linear.out_features, comm, "out_features")
        with torch.no_grad():
            layer.weight = nn.Parameter(linear.weight[rows].clone())
            if linear.bias is not None:
                layer.bias = nn.Parameter(linear.bias[rows].clone())
        return layer

    def forward(self, x):
        if self.copy_input:
            x = f(x, self.comm)
        y = F.linear(x, self.weight, self.bias)
        return gather_last_dim(y, self.comm) if self.gather_output else y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(this rank: {self.weight.shape[0]}), tp={self.comm.size}")


class RowParallelLinear(nn.Module):
    """Y = Σ_i X_i·W_i: this rank's ``in_features / p`` input features (weight columns), summed by g.

    The input is this rank's slice X_i (``input_is_parallel``, the output of a column layer); otherwise the
    whole X is given and this rank takes its slice itself. The bias is added once, after the sum.
    ``sequence_parallel``: reduce-scatter the sum along the sequence instead (this rank keeps its tokens).
    """

    def __init__(self, in_features: int, out_features: int, comm: Comm, *, bias: bool = False,
                 input_is_parallel: bool = True, sequence_parallel: bool = False):
        super().__init__()
        self.comm, self.input_is_parallel, self.sequence_parallel = comm, input_is_parallel, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.columns = _rank_slice(in_features, comm, "in_features")
        bound = 1 / math.sqrt(in_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // comm.size).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, comm: Comm, **kwargs) -> RowParallelLinear:
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features, comm, bias=linear.bias is not None, **kwargs)
        with torch.no_grad():
            layer.weight = nn.Parameter(linear.weight[:, layer.columns].clone())
            if linear.bias is not None:
                layer.bias = nn.Parameter(linear.bias.clone())
        return layer

    def forward(self, x):
        if not self.input_is_parallel:
            x = f(x, self.comm)[..., self.columns]   # the whole X came in: its gradient is a sum over ranks
        partial, comm = F.linear(x, self.weight), self.comm
        y = ScatterToSequenceParallelRegion.apply(partial, comm, True) if self.sequence_parallel else g(partial, comm)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return (f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), "
                f"out_features={self.out_features}, tp={self.comm.size}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


class SequenceParallelRMSNorm(nn.Module):
    """model.RMSNorm on this rank's tokens: the same (whole) weight, whose gradient is a sum over ranks: f on it."""

    def __init__(self, norm: nn.Module, comm: Comm):
        super().__init__()
        self.weight, self.eps, self.fused, self.comm = norm.weight, norm.eps, getattr(norm, "fused", True), comm

    def forward(self, x):
        weight = f(self.weight, self.comm)
        return rms_norm(x, weight, self.eps) if self.fused else F.rms_norm(x, weight.shape, weight, self.eps)


# --------------------------------------------------------------------------------- the course model

def check_tp_divisible(config, tp: int) -> None:
    """Raise a ValueError naming every dimension of ``config`` that cannot split over ``tp`` ranks."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"TP={tp!r}: the tensor-parallel degree is a whole number of ranks, at least 1")
    rules = [("num_heads", config.num_heads, "attention heads", "each rank computes whole heads"),
             ("num_kv_heads", config.num_kv_heads, "key/value heads",
              "each rank keeps the key/value heads its query heads read"),
             ("intermediate", config.intermediate, "MLP width", "each rank gets an equal slice of the MLP")]
    problems = [f"{value} {what} ({name}) cannot split over TP={tp} ({value} % {tp} = {value % tp}): {why}"
                for name, value, what, why in rules if value % tp]
    if problems:
        common = math.gcd(config.num_heads, config.num_kv_heads, config.intermediate)   # what every degree divides
        divisors = sorted({d for k in range(1, math.isqrt(common) + 1) if common % k == 0 for d in (k, common // k)})
        raise ValueError("; ".join(problems) + f". TP degrees that work for this model: {divisors}")


def apply_tp(model: nn.Module, comm: Comm, sequence_parallel: bool = False, vocab_parallel: bool = False) -> nn.Module:
    """Split the course GPT over ``comm``'s ranks, in place (every rank must hold the same model).

    Attention: q/k/v by columns (this rank's heads), o_proj by rows. MLP: gate/up by columns, down by rows.
    One f at the input of each of the two, one g inside each row layer: 2 all-reduces forward, 2 backward
    per layer. Norms stay whole; embedding and head too, unless ``vocab_parallel``: split by vocabulary rows
    and columns, and ``model.loss_fn`` a cross-entropy that never gathers the logits (course_lib.vocab_parallel).

    ``sequence_parallel``: the residual stream and the layers' norms on this rank's s/p tokens, f and g an
    all-gather and a reduce-scatter (module docstring). On a pipeline (make_stage after apply_tp) the stages pass
    each other this rank's s/p slice (pipeline_step), 1/p of the bytes (Megatron-LM's scatter/gather).
    """
    if getattr(model, "tp_size", None) is not None:
        raise ValueError(f"this model is already split over TP={model.tp_size}: apply_tp it once, to a whole model")
    check_tp_divisible(model.config, comm.size)

    def enter_region(module, args):   # f, or its SP partner, once for all the column layers reading this input
        x = args[0]
        return (GatherFromSequenceParallelRegion.apply(x, comm, True) if sequence_parallel else f(x, comm),)

    def held(end):   # the first (0) or last (-1) layer this rank runs: a pipeline stage's others are Identity
        return [layer for layer in model.layers if not isinstance(layer, nn.Identity)][end]

    def enter_stack(block, args):   # SP: the first stage's first layer takes this rank's slice of the sequence
        if block is held(0) and not isinstance(model.embed, nn.Identity):     # (a later stage receives it)
            return (ScatterToSequenceParallelRegion.apply(args[0], comm, False),)

    def leave_stack(block, args, output):   # ... the last stage's last layer gathers it whole (earlier: send it)
        if block is held(-1) and not isinstance(model.head, nn.Identity):
            return GatherFromSequenceParallelRegion.apply(output, comm, False)

    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, ColumnParallelLinear.from_dense(getattr(attn, name), comm, copy_input=False))
        attn.o_proj = RowParallelLinear.from_dense(attn.o_proj, comm, sequence_parallel=sequence_parallel)
        mlp.gate_proj = ColumnParallelLinear.from_dense(mlp.gate_proj, comm, copy_input=False)
        mlp.up_proj = ColumnParallelLinear.from_dense(mlp.up_proj, comm, copy_input=False)
        mlp.down_proj = RowParallelLinear.from_dense(mlp.down_proj, comm, sequence_parallel=sequence_parallel)
        attn.register_forward_pre_hook(enter_region)
        mlp.register_forward_pre_hook(enter_region)
        if sequence_parallel:
            layer.attn_norm = SequenceParallelRMSNorm(layer.attn_norm, comm)
            layer.mlp_norm = SequenceParallelRMSNorm(layer.mlp_norm, comm)
            layer.register_forward_pre_hook(enter_stack)
            layer.register_forward_hook(leave_stack)
    if vocab_parallel:
        split_vocabulary(model, comm)
    model.tp_size, model.sequence_parallel, model.vocab_parallel = comm.size, sequence_parallel, vocab_parallel
    return model


def split_vocabulary(model: nn.Module, comm: Comm) -> nn.Module:
    """apply_tp's ``vocab_parallel``: the embedding by rows, the head by columns (f before it), ``model.loss_fn``
    the cross-entropy of the split logits (course_lib.vocab_parallel). A stage without them keeps its Identity."""
    if model.config.tie_embeddings:
        raise ValueError("vocab_parallel with tie_embeddings=True: the course splits the embedding and the head "
                         "apart (each its own slice); untie them")
    _rank_slice(model.config.vocab_size, comm, "vocab_size")     # the clear error, before anything changes
    if isinstance(model.embed, nn.Embedding):
        model.embed = VocabParallelEmbedding(model.embed, comm, g)
    if isinstance(model.head, nn.Linear):
        model.head = ColumnParallelLinear.from_dense(model.head, comm, copy_input=True)
    model.loss_fn = VocabParallelLoss(comm)
    return model


# --------------------------------------------------------------------------------- what it costs

def tp_allreduce_bytes(batch_size: int, seq_len: int, hidden: int, bytes_per_element: int) -> int:
    """The payload of one TP all-reduce: one activation, batch × seq × hidden × bytes per element."""
    return batch_size * seq_len * hidden * bytes_per_element


def tp_step_traffic(config, batch_size: int, seq_len: int, tp: int, bytes_per_element: int = 4,
                    sequence_parallel: bool = False, num_layers: int | None = None, stage: int = 0,
                    num_stages: int = 1, recompute: str = "none") -> dict:
    """All-reduces of one forward + backward of the split model, and the bytes each rank sends (ring). Refuses
    a ``tp`` that ``config`` cannot split over (check_tp_divisible), as apply_tp would. ``num_layers``: those of
    pipeline stage ``stage`` of ``num_stages`` (default: all of them, one stage).

    ``sequence_parallel``: per layer 4 all-gathers and 4 reduce-scatters of one activation, plain TP's bytes
    ("layers_wire_bytes"); at the stack's ends ("ends_wire_bytes") an all-gather backward on the first stage
    (its scatter's) and one forward on the last (the gather before the final norm): stages pass slices; an
    all-reduce of each norm's weight gradient ("norm_weights_wire_bytes"). "forward_ops"/"backward_ops" count.
    ``recompute="full"`` (course_lib.recompute): backward reruns each layer's forward, and with it its
    collectives up to the last saved tensor, down_proj's input: attention's g (SP: both all-gathers and o_proj's
    reduce-scatter) again, the MLP's not ("recompute_ops", in backward_ops too, "recompute_wire_bytes"); "op" too.
    """
    check_tp_divisible(config, tp)
    layers = config.num_layers if num_layers is None else num_layers
    payload = tp_allreduce_bytes(batch_size, seq_len, config.hidden, bytes_per_element)
    rerun = layers if recompute in ("full", "op") else 0
    if not sequence_parallel:
        per_direction = 2 * layers
        return {"forward_all_reduces": per_direction, "backward_all_reduces": per_direction + rerun,
                "forward_ops": {"all_reduce": per_direction}, "backward_ops": {"all_reduce": per_direction + rerun},
                "recompute_ops": {"all_reduce": rerun}, "payload_bytes_each": payload,
                "payload_bytes": (2 * per_direction + rerun) * payload,
                "recompute_wire_bytes": rerun * wire_bytes("all_reduce", payload, tp),
                "wire_bytes_per_rank": (2 * per_direction + rerun) * wire_bytes("all_reduce", payload, tp)}
    _check_sequence(seq_len, tp)
    norm_weight = config.hidden * bytes_per_element
    gather, scatter = wire_bytes("all_gather", payload, tp), wire_bytes("reduce_scatter", payload, tp)
    first, last = int(stage == 0), int(stage == num_stages - 1)
    parts = {"layers_wire_bytes": 4 * layers * (gather + scatter), "ends_wire_bytes": (first + last) * gather,
             "norm_weights_wire_bytes": 2 * layers * wire_bytes("all_reduce", norm_weight, tp),
             "recompute_wire_bytes": rerun * (2 * gather + scatter)}
    return {"forward_ops": {"all_gather": 2 * layers + last, "reduce_scatter": 2 * layers},
            "backward_ops": {"reduce_scatter": 2 * layers + rerun, "all_gather": 2 * layers + first + 2 * rerun,
                             "all_reduce": 2 * layers},
            "recompute_ops": {"all_gather": 2 * rerun, "reduce_scatter": rerun}, "payload_bytes_each": payload,
            "payload_bytes": (8 * layers + first + last + 3 * rerun) * payload + 2 * layers * norm_weight,
            **parts, "wire_bytes_per_rank": sum(parts.values())}
