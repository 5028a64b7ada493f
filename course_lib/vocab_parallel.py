"""A split vocabulary (词表并行): the embedding, the head and the loss over the TP group, never gathering logits.

Plain TP (tensor_parallel.apply_tp) keeps the embedding [V, d] and the head [d, V] whole on every rank, and the
loss keeps fp32 log-probabilities of the whole vocabulary, b·s·V·4 bytes. For V = 128k those tables are a large
share of a rank's weights. Megatron-LM and picotron split all three over the t ranks of the TP group; rank r
holds vocabulary rows [r·V/t, (r+1)·V/t):

    embedding   rank r looks up the tokens in its rows, writes 0 for the others; an all-reduce (g) sums the t
                partial lookups into the whole [b, s, d] (each token's row lives on exactly one rank)
    head        split by output columns (a ColumnParallelLinear, f before it): rank r computes logits of its
                V/t words only, [b, s, V/t]; backward all-reduces the input's gradient (f)
    loss        cross-entropy on the split logits z (per token, m = max_v z_v):
                    loss = log Σ_v exp(z_v - m) - (z_target - m)
                three all-reduces of one number per token: the max (op MAX), Σ exp (SUM), and the target's logit
                (SUM: only the rank holding the target's row contributes it). Backward, on each rank's slice:
                    d loss / d z_v = softmax_v - [v = target]
                so it saves its fp32 softmax slice, b·s·V/t·4 bytes (1/t of the unsplit loss), the target's
                position in its slice (int64) and whether the target is elsewhere (bool): b·s·9 bytes.

As Megatron-LM's VocabParallelEmbedding and _VocabParallelCrossEntropy (tensor_parallel/layers.py,
cross_entropy.py), written here from the maths above. Traffic per micro-batch (vocab_parallel_traffic): forward,
one all-reduce of b·s·d·e (the lookup) and three of b·s·4 (the loss); backward, one of b·s·d·e (the head's f).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .comm import Comm, wire_bytes


class VocabParallelEmbedding(nn.Module):
    """This rank's V/t rows of an nn.Embedding; the lookup of the others' tokens is 0, and ``reduce`` (tensor_
    parallel.g: all-reduce forward, identity backward) sums the ranks' lookups. Made by apply_tp(...,
    vocab_parallel=True), which splits the head (a ColumnParallelLinear) and sets the loss too."""

    def __init__(self, embedding: nn.Embedding, comm: Comm, reduce):
        super().__init__()
        self.comm, self.reduce, self.num_embeddings = comm, reduce, embedding.num_embeddings
        per_rank = embedding.num_embeddings // comm.size
        self.rows = slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
        self.weight = nn.Parameter(embedding.weight[self.rows].detach().clone())

    def forward(self, tokens):
        elsewhere = (tokens < self.rows.start) | (tokens >= self.rows.stop)
        local = (tokens - self.rows.start).masked_fill(elsewhere, 0)
        partial = F.embedding(local, self.weight).masked_fill(elsewhere[..., None], 0.0)
        return self.reduce(partial, self.comm)

    def extra_repr(self):
        return f"{self.num_embeddings} words (this rank: {self.rows.start}..{self.rows.stop - 1}), tp={self.comm.size}"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocabulary (module docstring): logits [N, V/t], targets [N]."""

    @staticmethod
    def forward(ctx, logits, targets, comm, first_word):
        maximum = logits.max(dim=-1).values
        comm.all_reduce(maximum, op=dist.ReduceOp.MAX)
        shifted = logits - maximum[:, None]
        elsewhere = (targets < first_word) | (targets >= first_word + logits.shape[-1])
        local = (targets - first_word).masked_fill(elsewhere, 0)
        target_logit = shifted.gather(1, local[:, None]).squeeze(1).masked_fill(elsewhere, 0.0)
        comm.all_reduce(target_logit)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp)
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), local, elsewhere)   # the softmax slice, in place
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, elsewhere = ctx.saved_tensors
        grad = softmax * grad_loss[:, None]
        # - [v = target] · grad_loss, on the rank that holds the target's row
        grad.scatter_add_(1, local[:, None], -(grad_loss * (~elsewhere))[:, None])
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The mean cross-entropy of every token, from this rank's logits slice [..., V/t] (rank r holds words
    [r·V/t, (r+1)·V/t)), in at least float32 (as model.loss_fn). Equal to model.loss_fn on the gathered logits."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logits = logits.reshape(-1, logits.shape[-1])
    first_word = comm.rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, targets.reshape(-1), comm, first_word).mean()


class VocabParallelLoss:
    """loss_fn(logits slice, targets) over ``comm``: what apply_tp(..., vocab_parallel=True) sets as the model's
    ``loss_fn`` (pipeline_step and the runs call it)."""

    def __init__(self, comm: Comm):
        self.comm = comm

    def __call__(self, logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, self.comm)


# ---------------------------------------------------------------------------------------------- what it costs

def vocab_parallel_activation_bytes(batch_size: int, seq_len: int, vocab_size: int, tp: int) -> dict[str, int]:
    """Bytes the split embedding and loss save for backward on one rank (the head saves its input, b·s·d·e, as
    unsplit): {"embed": its slice-local token ids (int64) and the mask of others' tokens (bool), "loss": the fp32
    softmax slice, the target's local position (int64) and the mask}. The unsplit loss saves b·s·V·4 + b·s·8 + 4."""
    tokens = batch_size * seq_len
    return {"embed": tokens * (8 + 1), "loss": tokens * vocab_size // tp * 4 + tokens * (8 + 1)}


def vocab_parallel_traffic(batch_size: int, seq_len: int, hidden: int, bytes_per_element: int, tp: int, *,
                           first_stage: bool = True, last_stage: bool = True) -> dict:
    """All-reduces of one micro-batch's forward and backward for the split embedding (on the first pipeline
    stage), head and loss (on the last), and the bytes a rank sends (ring): the lookup's b·s·d·e forward, the
    loss's three of b·s numbers forward (in at least fp32: 4 bytes each, 8 in float64), the head input's
    gradient b·s·d·e backward."""
    tokens, loss_bytes = batch_size * seq_len, max(bytes_per_element, 4)
    activation = tokens * hidden * bytes_per_element
    forward = [activation] * first_stage + [tokens * loss_bytes] * 3 * last_stage
    backward = [activation] * last_stage
    return {"forward_all_reduces": len(forward), "backward_all_reduces": len(backward),
            "payload_bytes": sum(forward + backward),
            "wire_bytes_per_rank": sum(wire_bytes("all_reduce", p, tp) for p in forward + backward)}
