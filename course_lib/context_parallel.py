"""Context parallelism (上下文并行) by ring attention: each rank holds a slice of the sequence.

Everything in a transformer but attention works token by token, so a rank holding S/cp of the S tokens runs
it alone. Attention mixes tokens: each query needs every key and value. Ring attention keeps each rank's
queries at home and sends the keys and values around a ring of cp ranks: at step t rank r holds the K/V
block of rank r - t, attends its queries to it, and passes it on to rank r + 1 (sending the next block while
computing on this one, so a fast enough link hides the traffic). After cp steps every query has seen every
key, and no rank holds more than two K/V blocks at a time, nor any of the S × S scores beyond one block's.

**The online softmax (log-sum-exp merge).** For one query row with scores s_j, out = Σ_j e^(s_j - L) v_j with
L = log Σ_j e^(s_j). Split the keys into blocks A and B, and let each block normalise by its own sum:
out_A = Σ_{j∈A} e^(s_j - L_A) v_j, L_A = log Σ_{j∈A} e^(s_j). Then L = log(e^L_A + e^L_B) and

    out = e^(L_A - L) · out_A + e^(L_B - L) · out_B          L = logaddexp(L_A, L_B)

exactly (the exponents are ≤ 0: no overflow). The merge is associative and commutative, so the blocks may
arrive in any order: that is what lets them travel. Each rank keeps, per query, its running (out, L).

**Why K and V travel and Q stays.** A rank's output rows need only its own queries, so the loop runs over key
blocks. What moves is read-only: a K/V block is forwarded unchanged, while a travelling Q would drag its
accumulators (out, L) along and have to come home. Per token K and V are 2·kv_heads·head_dim numbers, Q and
out 2·heads·head_dim: with grouped-query attention (kv_heads < heads) K/V are the smaller pair, and the
unrepeated K/V are what is sent (each rank repeats them for its query heads locally). A step hides its
message when computing on the block takes longer than sending it; with local length c = S/cp, e bytes per
element, F flop/s and β bytes/s per link: 4·heads·c²·d / F ≥ 2·kv_heads·c·d·e / β, so c ≥ e·F·kv/(2·β·heads)
for full blocks (:func:`hop_hiding_tokens`). bf16 at ~1e15 flop/s with kv = heads: c ≥ 1e15/β, ~2,200 tokens
over 450 GB/s NVLink, 20,000 over 50 GB/s IB. Grouped-query attention divides it by heads/kv (8:1: ~280 and
2,500), and the balanced causal layout computes about half of each step's block pairs, which doubles it. The
course posts each hop before the block's computation and waits after it, which is what lets a GPU overlap
them; it does not measure the overlap (on shared CPU cores the send and the matmuls compete for the cores).

**Causal masking, block by block.** Cut the sequence into chunks; query chunk i against key chunk j is full
(j < i), diagonal-causal (j = i: the lower triangle) or skipped (j > i: all masked). With plain contiguous
slices (rank r holds chunk r of cp) rank 0 computes one half block and rank cp-1 cp - 1/2 blocks: every step
waits for the busiest rank, and on average half the ranks idle. **Load-balanced sharding** cuts the sequence
into 2·cp chunks of n = S/(2·cp) tokens and gives rank r chunks r and 2cp-1-r (one from the front, one from
the back): every rank then computes 2cp-1 full blocks and 2 diagonal ones, the same work. Rank r's tokens are
at global positions [r·n, (r+1)·n) ∪ [(2cp-1-r)·n, (2cp-r)·n): rotary embeddings must use those. torch's
context_parallel uses the same layout (its head-tail load balancer). ``load_balanced`` (default True) names
the layout everywhere: shard, gather and attend with the same value. Without a causal mask any layout is
correct (attention does not care about the order of the keys), and the work is balanced anyway.

**Backward (a hand-written ring, not autograd through the forward).** With P = softmax(Q Kᵀ·τ), O = P V,
τ = 1/sqrt(head_dim), Δ_i = Σ_d dO_id·O_id:

    dV = Pᵀ dO      dS = P ∘ (dO Vᵀ - Δ)      dQ = dS K·τ      dK = dSᵀ Q·τ

and each block of P is recomputed exactly from the saved L: P_ij = e^(s_ij - L_i). So every (query block,
key block) pair contributes on its own: dQ accumulates at home; dK_j and dV_j, sums over every rank's queries,
travel with K_j and V_j and take one more hop at the end to reach their owner.

**Bytes sent per rank** (b batch, kv key/value heads, d head_dim, e bytes per element, e' = max(e, 4): dK/dV
accumulate in float32 or wider). One K/V block is 2·b·kv·(S/cp)·d values:

    forward    (cp - 1) · 2·b·kv·(S/cp)·d·e                               K/V, one hop per step
    backward   (cp - 1) · 2·b·kv·(S/cp)·d·e  +  cp · 2·b·kv·(S/cp)·d·e'    K/V again, dK/dV home   (0 at cp = 1)

(:func:`ring_attention_bytes`). The forward's is what an all-gather of K and V would send, (cp-1)/cp of them:
the ring does not save bytes, it saves memory and overlaps them with compute. **Saved for backward per
rank**: Q, K, V, O (S/cp tokens each) and L: exactly 1/cp of one process's (:func:`ring_attention_activation_bytes`).

**torch's own.** ``torch.distributed.tensor.experimental.context_parallel`` in torch 2.13 has two ways to
move K and V (``_ContextParallelOptions.rotate_method``, chosen by ``set_rotate_method``): **"allgather"**, the
default on every device, all-gathers every rank's K/V once and reads block r - t from it at step t (all cp
blocks held at once, one collective, overlapped with the first block's computation); **"alltoall"**, the
opt-in ring, sends one block a hop per step (``permute_tensor``, an all_to_all_single: one block held). Llama
3's context parallelism is all-gather based too (Llama 3 paper, 3.3.2): with grouped-query attention (8 K/V
heads for 64 query heads) K and V are small beside attention's computation, so one exposed all-gather costs
little, and any attention mask (document masks included) is easy on the whole K/V. The ring wins when the
gathered K/V would not fit, or K/V are large (kv = heads) and the hops must hide behind blocks. Either runs its attention blocks only through the CUDA kernels' handlers: on CPU
the non-causal forward runs through DTensor's generic rules (K and V all-gathered whole), and a causal call,
or any backward, raises "NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default
does not have a sharding strategy registered." (``..._for_cpu_backward.default`` for the backward;
tests/test_context_parallel.py checks both).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .comm import Comm

FULL, DIAGONAL, SKIP = "full", "diagonal", "skip"


# ------------------------------------------------------------------------------------------- the layout

def chunk_ids(rank: int, cp: int, load_balanced: bool = True) -> tuple[int, ...]:
    """The chunks of the sequence rank ``rank`` holds: (r, 2cp-1-r) of 2·cp chunks, or (r,) of cp."""
    return (rank, 2 * cp - 1 - rank) if load_balanced else (rank,)


def _num_chunks(cp: int, load_balanced: bool) -> int:
    return 2 * cp if load_balanced else cp


def _check_divisible(seq_len: int, cp: int, load_balanced: bool, what: str = "sequence length") -> None:
    chunks = _num_chunks(cp, load_balanced)
    if seq_len % chunks:
        rule = (f"2·cp = {chunks}: load-balanced sharding cuts it into 2·cp equal chunks" if load_balanced
                else f"cp = {cp}: each rank gets an equal slice")
        raise ValueError(f"{what} {seq_len} is not divisible by {rule} ({seq_len} % {chunks} = {seq_len % chunks})")


def shard_sequence(x: torch.Tensor, comm: Comm, dim: int, load_balanced: bool = True) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim``: chunks r and 2cp-1-r of 2·cp, concatenated (load_balanced),
    or the r-th of cp contiguous slices. Every rank must pass the same whole ``x``."""
    _check_divisible(x.shape[dim], comm.size, load_balanced)
    chunks = x.chunk(_num_chunks(comm.size, load_balanced), dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(comm.rank, comm.size, load_balanced)], dim=dim)


def gather_sequence(x: torch.Tensor, comm: Comm, dim: int, load_balanced: bool = True) -> torch.Tensor:
    """The whole tensor from every rank's part (the inverse of shard_sequence): one traced all-gather, then
    the chunks put back in sequence order. For looking at results: no gradient flows through it."""
    local = x.detach().movedim(dim, 0).contiguous()   # all_gather stacks along dim 0
    gathered = torch.empty((comm.size * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(gathered, local)
    parts = gathered.chunk(_num_chunks(comm.size, load_balanced), dim=0)   # rank by rank, as each holds them
    held = [i for r in range(comm.size) for i in chunk_ids(r, comm.size, load_balanced)]
    return torch.cat([parts[held.index(i)] for i in range(len(held))], dim=0).movedim(0, dim)


def positions(seq_len: int, comm: Comm, load_balanced: bool = True, device=None) -> torch.Tensor:
    """The global positions of this rank's tokens (what rotary embeddings need), in its local order."""
    return shard_sequence(torch.arange(seq_len, device=device), comm, 0, load_balanced)


def mask_kind(query_chunk: int, key_chunk: int, causal: bool) -> str:
    """FULL, DIAGONAL (lower triangle) or SKIP for one (query chunk, key chunk) pair of the same length."""
    if not causal or key_chunk < query_chunk:
        return FULL
    return DIAGONAL if key_chunk == query_chunk else SKIP


def attention_work(seq_len: int, cp: int, causal: bool = True, load_balanced: bool = True) -> list[int]:
    """(query, key) scores each rank must compute (the unmasked ones), rank by rank: equal when balanced."""
    _check_divisible(seq_len, cp, load_balanced)
    c = seq_len // _num_chunks(cp, load_balanced)
    per_kind = {FULL: c * c, DIAGONAL: c * (c + 1) // 2, SKIP: 0}
    all_chunks = range(_num_chunks(cp, load_balanced))
    return [sum(per_kind[mask_kind(i, j, causal)] for i in chunk_ids(r, cp, load_balanced) for j in all_chunks)
            for r in range(cp)]


# ------------------------------------------------------------------------------------ one block, merged

def _block_scores(q, k, kind, scale):
    """q kᵀ·τ for one (query chunk, key chunk) pair, the upper triangle at -inf on the diagonal."""
    scores = q @ k.transpose(-2, -1) * scale
    if kind == DIAGONAL:
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, -math.inf)
    return scores


def _merge(out_a, lse_a, out_b, lse_b):
    """The log-sum-exp merge of two partial attentions over disjoint key blocks (see the docstring)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse


def _blocks(kv: torch.Tensor, heads: int, n: int, dtype):
    """A travelling [2, b, kv_heads, s, d] K/V block as (K, V) chunk lists, repeated to ``heads`` query heads."""
    group = heads // kv.shape[2]
    k, v = (t.to(dtype).repeat_interleave(group, dim=1).chunk(n, dim=2) for t in kv)
    return k, v


def _ring_step(comm: Comm, tensor: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Post one hop of the ring: send ``tensor`` to rank + 1, receive the same shape from rank - 1."""
    incoming = torch.empty_like(tensor)
    works = comm.exchange(sends=[(tensor, (comm.rank + 1) % comm.size)],
                          recvs=[(incoming, (comm.rank - 1) % comm.size)])
    return incoming, works


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, comm, causal, load_balanced):
        cp, rank, heads, n = comm.size, comm.rank, q.shape[1], len(chunk_ids(0, comm.size, load_balanced))
        work_dtype = torch.promote_types(q.dtype, torch.float32)   # accumulate in float32 or wider
        scale = q.shape[-1] ** -0.5
        queries = q.to(work_dtype).chunk(n, dim=2)
        mine = chunk_ids(rank, cp, load_balanced)
        kv = torch.stack([k, v])            # what travels: K and V unrepeated, one message per step
        out, lse = [None] * n, [None] * n   # per query chunk: the running attention and its log-sum-exp
        for step in range(cp):
            if step < cp - 1:
                incoming, works = _ring_step(comm, kv)   # in flight while this block is computed
            theirs = chunk_ids((rank - step) % cp, cp, load_balanced)
            keys, values = _blocks(kv, heads, n, work_dtype)
            for a, i in enumerate(mine):
                for b, j in enumerate(theirs):
                    kind = mask_kind(i, j, causal)
                    if kind == SKIP:
                        continue
                    scores = _block_scores(queries[a], keys[b], kind, scale)
                    block_lse = scores.logsumexp(dim=-1)
                    block_out = torch.exp(scores - block_lse[..., None]) @ values[b]
                    out[a], lse[a] = ((block_out, block_lse) if out[a] is None
                                      else _merge(out[a], lse[a], block_out, block_lse))
            if step < cp - 1:
                for work in works:
                    work.wait()
                kv = incoming
        out, lse = torch.cat(out, dim=2).to(q.dtype), torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.causal, ctx.load_balanced = comm, causal, load_balanced
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, causal, load_balanced = ctx.comm, ctx.causal, ctx.load_balanced
        cp, rank, heads, n = comm.size, comm.rank, q.shape[1], len(chunk_ids(0, comm.size, load_balanced))
        work_dtype = torch.promote_types(q.dtype, torch.float32)
        scale, group = q.shape[-1] ** -0.5, heads // k.shape[1]
        queries, grad_outs = q.to(work_dtype).chunk(n, dim=2), grad_out.to(work_dtype).chunk(n, dim=2)
        deltas = (grad_out.to(work_dtype) * out.to(work_dtype)).sum(-1).chunk(n, dim=2)   # Δ = rowsum(dO ∘ O)
        lses, mine = lse.chunk(n, dim=2), chunk_ids(rank, cp, load_balanced)
        grad_q = [torch.zeros_like(t) for t in queries]
        kv = torch.stack([k, v])
        grad_kv = torch.zeros(kv.shape, dtype=work_dtype, device=kv.device)   # travels with the K/V block
        for step in range(cp):
            if step < cp - 1:
                incoming, works = _ring_step(comm, kv)
            theirs = chunk_ids((rank - step) % cp, cp, load_balanced)
            keys, values = _blocks(kv, heads, n, work_dtype)
            grad_k, grad_v = [torch.zeros_like(t) for t in keys], [torch.zeros_like(t) for t in values]
            for a, i in enumerate(mine):
                for b, j in enumerate(theirs):
                    kind = mask_kind(i, j, causal)
                    if kind == SKIP:
                        continue
                    probs = torch.exp(_block_scores(queries[a], keys[b], kind, scale) - lses[a][..., None])
                    grad_v[b] += probs.transpose(-2, -1) @ grad_outs[a]
                    grad_scores = probs * (grad_outs[a] @ values[b].transpose(-2, -1) - deltas[a][..., None])
                    grad_q[a] += grad_scores @ keys[b] * scale
                    grad_k[b] += grad_scores.transpose(-2, -1) @ queries[a] * scale
            # query heads g·h ... g·h + g-1 read K/V head h: their gradients sum into it
            for slot, grads in enumerate((grad_k, grad_v)):
                whole = torch.cat(grads, dim=2)
                grad_kv[slot] += whole.unflatten(1, (k.shape[1], group)).sum(2)
            if step < cp - 1:
                for work in works:
                    work.wait()
                kv = incoming
            if cp > 1:   # this block's dK/dV moves on with it; after the last step it reaches its owner
                grad_kv, works = _ring_step(comm, grad_kv)
                for work in works:
                    work.wait()
        grad_k, grad_v = grad_kv
        return (torch.cat(grad_q, dim=2).to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None)


def _check_inputs(q, k, v, load_balanced):
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: each must be "
                         "[batch, heads, seq/cp, head_dim], k and v of one shape")
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: batch, local sequence and head_dim must "
                         "agree (self-attention over this rank's slice)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not divisible by {k.shape[1]} key/value heads "
                         f"({q.shape[1]} % {k.shape[1]} = {q.shape[1] % k.shape[1]}): each key/value head "
                         "must serve a whole group of query heads")
    if load_balanced and q.shape[2] % 2:
        raise ValueError(f"local sequence length {q.shape[2]} is odd: with load_balanced=True each rank holds "
                         "two equal chunks (the whole sequence must divide by 2·cp)")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, causal: bool = True,
                   load_balanced: bool = True) -> torch.Tensor:
    """softmax(q kᵀ/sqrt(head_dim)) v for this rank's queries against the whole sequence's keys.

    q: [batch, heads, seq/cp, head_dim], k and v: [batch, kv_heads, seq/cp, head_dim] (kv_heads divides
    heads: grouped-query attention), each this rank's slice in the layout of ``shard_sequence(...,
    load_balanced)``. Returns this rank's slice of the output, like q. Call on every rank of ``comm``."""
    _check_inputs(q, k, v, load_balanced)
    return _RingAttention.apply(q, k, v, comm, causal, load_balanced)


# ---------------------------------------------------------------------------------- what it costs

def _sizes(dtype) -> tuple[int, int]:
    """(bytes per element of the tensors, of the float32-or-wider accumulators)."""
    return dtype.itemsize, torch.promote_types(dtype, torch.float32).itemsize


def ring_attention_bytes(batch: int, kv_heads: int, seq_len: int, head_dim: int, cp: int,
                         dtype=torch.float32) -> dict[str, int]:
    """Bytes one rank sends in ring attention over the whole sequence ``seq_len`` (see the docstring)."""
    element, accumulator = _sizes(dtype)
    block = 2 * batch * kv_heads * (seq_len // cp) * head_dim   # K and V of one rank's slice, in values
    forward = (cp - 1) * block * element
    backward = forward + cp * block * accumulator if cp > 1 else 0
    return {"forward": forward, "backward": backward}


def hop_hiding_tokens(heads: int, kv_heads: int, bytes_per_value: int, flops_per_s: float, link_bytes_per_s: float,
                      causal: bool = False) -> int:
    """The fewest tokens per rank c at which computing a K/V block takes as long as sending it (the docstring):
    c = e·F·kv/(2·β·heads) for full blocks; twice that under the balanced causal layout (half the pairs)."""
    tokens = bytes_per_value * flops_per_s * kv_heads / (2 * link_bytes_per_s * heads)
    return math.ceil(2 * tokens if causal else tokens)


def ring_attention_activation_bytes(batch: int, heads: int, kv_heads: int, seq_len: int, head_dim: int,
                                    cp: int, dtype=torch.float32) -> int:
    """Bytes ring attention saves for backward on one rank: Q, O (heads), K, V (kv_heads) and the log-sum-exp."""
    element, accumulator = _sizes(dtype)
    tokens = batch * (seq_len // cp)
    return tokens * head_dim * (2 * heads + 2 * kv_heads) * element + tokens * heads * accumulator


# ---------------------------------------------------------------------------------- the course model

def apply_rope_at(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """model.apply_rope for x[batch, seq, heads, head_dim] at the given global positions (model.apply_rope
    numbers a tensor's tokens 0..seq-1, which is wrong for every rank's slice but the first)."""
    head_dim = x.shape[-1]
    dtype = torch.promote_types(x.dtype, torch.float32)
    freqs = theta ** (-torch.arange(0, head_dim, 2, device=x.device, dtype=dtype) / head_dim)
    angles = torch.outer(positions.to(dtype), freqs)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class ContextParallelAttention(nn.Module):
    """model.Attention on this rank's slice of the sequence: the same projections (the same parameter
    names), rotary at the slice's global positions, ring attention for the core (causal)."""

    def __init__(self, attn: nn.Module, comm: Comm, load_balanced: bool = True):
        super().__init__()
        self.comm, self.load_balanced = comm, load_balanced
        self.head_dim, self.rope_theta = attn.head_dim, attn.rope_theta
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj

    def forward(self, x):
        batch, local_seq, _ = x.shape
        where = positions(local_seq * self.comm.size, self.comm, self.load_balanced, device=x.device)
        q = apply_rope_at(self.q_proj(x).view(batch, local_seq, -1, self.head_dim), where, self.rope_theta)
        k = apply_rope_at(self.k_proj(x).view(batch, local_seq, -1, self.head_dim), where, self.rope_theta)
        v = self.v_proj(x).view(batch, local_seq, -1, self.head_dim)
        out = ring_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.comm, causal=True,
                             load_balanced=self.load_balanced)               # [batch, heads, seq/cp, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(batch, local_seq, -1))


def apply_context_parallel(model: nn.Module, comm: Comm, load_balanced: bool = True) -> nn.Module:
    """Run the course GPT on this rank's slice of the sequence, in place: every layer's attention becomes a
    :class:`ContextParallelAttention`. Feed it ``shard_sequence(tokens, comm, dim=1, load_balanced)`` (and
    shard the targets alike); after backward, :func:`all_reduce_gradients` over the same group."""
    if getattr(model, "cp_size", None) is not None:
        raise ValueError(f"this model already runs context-parallel over CP={model.cp_size}: apply it once")
    for layer in model.layers:
        layer.attn = ContextParallelAttention(layer.attn, comm, load_balanced)
    model.cp_size = comm.size
    return model


def all_reduce_gradients(model: nn.Module, comm: Comm) -> None:
    """Average the gradients over the CP group. Each rank's loss is the mean over its own S/cp tokens: the mean
    of the ranks' gradients is the whole sequence's (as DDP's is the whole batch's; with DP × CP this
    all-reduce spans both) when every rank has as many loss tokens; else scale each loss by
    :func:`loss_scale` before backward."""
    for param in model.parameters():
        if param.grad is not None:
            comm.all_reduce(param.grad)
            param.grad /= comm.size


def loss_scale(loss_tokens: int, comm: Comm) -> float:
    """cp·n_r/Σn: what to multiply this rank's mean loss by, before backward, when the ranks hold different
    numbers n_r of loss tokens (padding, ``ignore_index``). The mean of the ranks' means is then Σ n_r·mean_r/Σ n,
    the sequence's mean, and all_reduce_gradients averages the right gradients. Scale the loss, not the
    gradients after backward: the ring's backward sends dK and dV home, so a rank's gradients already hold
    terms of the other ranks' losses, each at that loss's own scale. One all-reduce, of a number."""
    total = torch.tensor(float(loss_tokens), dtype=torch.float64)
    comm.all_reduce(total)
    if total.item() <= 0:
        raise ValueError(f"loss_tokens={loss_tokens}: the CP group has {total.item():.0f} loss tokens in all, and "
                         "a mean needs at least one")
    return comm.size * loss_tokens / total.item()
