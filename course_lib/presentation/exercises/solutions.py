"""Reference answers to the "your turn" exercises, one per checker in course_lib/presentation/exercises/

They live here, not in the notebooks, so that a learner sees an answer only by asking for it:
``exercises.solution("mean_over_ranks")`` prints the source of :func:`mean_over_ranks`. An exercise is named
after its checker (``check_mean_over_ranks`` → ``"mean_over_ranks"``); ``BY_EXERCISE`` maps each name to its
answer, and tests/test_exercises.py checks that every checker has one here and that it passes.
"""

import contextlib
import inspect

import torch
import torch.distributed as dist


def mean_over_ranks(rank, world_size, value):
    """The reference answer to notebook 00's exercise: the mean of every rank's ``value``, on every rank.

    all_reduce works in place, so reduce a copy (the caller's ``value`` must stay as it was): the sum over
    ranks, then a division by the number of ranks.
    """
    total = value.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total / world_size


def mlp_saved_bytes(batch_size, seq_len, hidden, intermediate, bytes_per_value):
    """The reference answer to notebook 01's exercise: the bytes the SwiGLU MLP saves for backward.

    gate_proj and up_proj both save their input x (one storage: b·s·h values); silu saves its input, the gate
    output; the product saves both factors, silu(gate) and the up output; down_proj saves its input, the
    product: four tensors of b·s·I values. Weights are parameters, not activations. So b·s·h·e + 4·b·s·I·e.
    """
    tokens = batch_size * seq_len
    return tokens * hidden * bytes_per_value + 4 * tokens * intermediate * bytes_per_value


def accumulation_step(ddp, optimizer, micro_batches, loss_fn):
    """The reference answer to notebook 02's exercise: one optimizer step of gradient accumulation.

    Every micro-batch but the last runs inside ``ddp.no_sync()``, so its gradients only add up locally; the
    last one's backward all-reduces the sum, once. Each loss is divided by the number of micro-batches, so that
    the summed gradient is the gradient of the mean loss. Then wait for the all-reduces, and update.
    """
    optimizer.zero_grad()
    for i, (inputs, targets) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            (loss_fn(ddp(inputs), targets) / len(micro_batches)).backward()
    ddp.finish_gradient_sync()
    optimizer.step()


def reduce_grad_shard(flat_grad, comm):
    """The reference answer to notebook 03's exercise: this rank's shard of the mean gradient (ZeRO-2).

    Pad to N·S elements (S = ceil(n/N)), reduce-scatter into an S-element buffer (the sum of this rank's
    slice over all ranks), divide by N. It is ``ZeroDataParallel._gradient_ready`` in course_lib/zero.py for
    stages 2 and 3, without the bookkeeping.
    """
    shard_size = -(-flat_grad.numel() // comm.size)
    padded = torch.cat([flat_grad, flat_grad.new_zeros(comm.size * shard_size - flat_grad.numel())])
    shard = flat_grad.new_empty(shard_size)
    comm.reduce_scatter(shard, padded)
    return shard / comm.size


class CopyToTensorParallelRegion(torch.autograd.Function):
    """The reference answer to notebook 04's exercise: Megatron's f, identity forward, all-reduce backward.

    The same class is in course_lib/tensor_parallel.py.
    """

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)   # a new tensor object, same storage: autograd needs an output of its own

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()   # all-reduce sums in place: on our own copy, not autograd's buffer
        ctx.comm.all_reduce(grad)
        return grad, None                  # one value per input of forward: x, comm


def one_f_one_b(stage, num_stages, num_microbatches):
    """The reference answer to notebook 05's exercise: one stage's 1F1B order.

    p - s - 1 warm-up forwards (no more than there are micro-batches), then one forward and one backward in
    turn, then the backwards that are left.
    """
    warmup = min(num_stages - stage - 1, num_microbatches)
    actions = [("F", k) for k in range(warmup)]
    for k in range(warmup, num_microbatches):
        actions += [("F", k), ("B", k - warmup)]
    return actions + [("B", k) for k in range(num_microbatches - warmup, num_microbatches)]


def layout_3d():
    """The reference answer to notebook 06's exercise (one of several that pass): Llama-2-70B on 4 nodes of 8.

    TP 8 fills a node (and, with sequence parallelism, cuts every activation 8 ways), PP 2 crosses nodes, dp 2 is
    what is left; ZeRO-1 over dp (no extra traffic) brings the state to 42.3 GiB per GPU. 32 micro-batches of one
    sequence each (64 / (dp 2 · 32)): stage 0 keeps 2 in flight, 26.6 GiB of activations, and with the 8 GiB
    reserve the busiest GPU needs 76.9 of its 80 GiB; the bubble is 1/33 = 3.0%. (16 micro-batches of 2
    sequences would double the activations: 103.1 GiB, it does not fit.)
    """
    return {"dp": 2, "tp": 8, "pp": 2, "zero_stage": 1, "num_microbatches": 32}


def expert_exchange(buffer, experts, comm):
    """The reference answer to notebook 08's exercise: expert parallelism's two all-to-alls (forward only).

    ``buffer`` [E, C, d] is ordered by expert, so it is already ep chunks, chunk j for rank j's experts. After the
    dispatch all-to-all, chunk i holds rank i's slots for this rank's experts: [ep, E/ep, C, d]. Each expert runs
    once on its rows from every rank, [:, i]; the outputs, kept in that layout, go back with the combine
    all-to-all and arrive in expert order. It is ``MoE._run_experts`` in course_lib/expert_parallel.py, without the
    autograd Function that sends the gradients back the same way.
    """
    ep, mine = comm.size, len(experts)
    received = torch.empty_like(buffer)
    comm.all_to_all(received, buffer)                                           # dispatch
    received = received.view(ep, mine, *buffer.shape[1:])
    outputs = torch.stack([expert(received[:, i]) for i, expert in enumerate(experts)], dim=1)
    combined = torch.empty_like(buffer)
    comm.all_to_all(combined, outputs.reshape(buffer.shape))                    # combine
    return combined


def own_job():
    """The reference answer to notebook 09's exercise on its own job (one of several that pass): the same torchtitan file
    with one sequence per pass and four passes of gradient accumulation a step (global_batch_size keeps the 32
    sequences), each block recomputed in backward. The busiest GPU then holds its 15.0 GiB of FSDP2 shards, 2.0
    GiB of a gathered layer, the block inputs of one sequence and the 8 GiB reserve. (Without recomputation, one
    sequence per pass holds 48 GiB of activations: 73 GiB, which fits too, narrowly.)"""
    return """[model]
name = "llama3"
flavor = "8B"

[training]
local_batch_size = 1
global_batch_size = 32
seq_len = 8192

[activation_checkpoint]
mode = "full"
"""


def layout_at_scale():
    """The reference answer to notebook 09's exercise (one of a few that pass): Llama-2-70B on 64 H100 SXM.

    512 sequences of 4,096 tokens. TP 4 (two TP groups per node: TP's share of the step grows with t - 1), PP 8
    across nodes (10 layers per stage), dp 2 with ZeRO-1; micro-batches of one sequence, m = 512/2 = 256, bubble
    7/263 = 2.7%. Stage 0 holds 8 micro-batches in flight: 42.8 GiB of activations without sequence parallelism
    (73.2 GiB in all: it fits, narrowly), 35.3 GiB with it: 65.7 of 80 GiB with the 22.4 GiB of state and the 8 GiB
    reserve. No recomputation: the course model's SDPA never stores the s×s scores, so "selective" would run the
    attention core again to save only its repeated keys and values. MFU 47.9%. (The planner's pick, dp 4 × tp 4 ×
    pp 4 with ZeRO-1 and sequence parallelism, MFU 50.4%, passes too.)
    """
    return {"dp": 2, "tp": 4, "pp": 8, "zero_stage": 1, "micro_batch_size": 1, "sequence_parallel": True,
            "recompute": "none"}


def lse_merge(out_a, lse_a, out_b, lse_b):
    """The reference answer to notebook 07's exercise: ring attention's log-sum-exp merge of two partial attentions.

    Each block's out is normalised by its own sum e^L_A; over both blocks the sum is e^L_A + e^L_B, so
    L = log(e^L_A + e^L_B) = logaddexp(L_A, L_B), and block A's share of the softmax is e^L_A / e^L = exp(L_A - L).
    The exponents are <= 0: nothing overflows, however large the scores. lse has one value per query: [..., None]
    lines it up with out's [..., queries, head_dim]. It is ``_merge`` in course_lib/context_parallel.py.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse


def global_norm(grads, is_split, tp_rank, comm):
    """The reference answer to notebook 10's exercise: the global gradient norm over TP ranks.

    Each rank adds the squares of the elements it counts: every split gradient (its slice is its own), a
    replicated one only on tp rank 0 (every tp rank holds the same copy). One all-reduce sums the ranks' sums;
    the square root of that is the norm of all the gradients, on every rank. In float64: a sum of many squares.
    It is clip.global_norm in course_lib/clip.py, with who counts what decided here.
    """
    total = torch.zeros((), dtype=torch.float64)
    for name, grad in grads.items():
        if is_split[name] or tp_rank == 0:
            total += grad.double().pow(2).sum()
    comm.all_reduce(total)
    return total.sqrt()


def micro_batch_loss(logits, targets, *, real_tokens, world_size, accumulation):
    """The reference answer to notebook 11's exercise 6: the loss of one micro-batch of gradient accumulation.

    Every real token of the global batch must weigh the same, whichever micro-batch and rank it is on: add this
    micro-batch's token losses (padding ignored) and divide by the real tokens of the whole batch. The gradients
    are then averaged over the ranks, a division by world_size: multiply it back. ``accumulation`` is not needed:
    real_tokens already counts every micro-batch's tokens.
    """
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                             reduction="sum")
    return loss * world_size / real_tokens


def pipeline_swap(comm, outgoing, incoming, peer):
    """The reference answer to notebook 11's exercise 2: two pipeline stages that both have something to send.

    A blocking send finishes only once the peer has posted its receive; if both ranks send first, both wait
    forever. Posting the send and the receive together (torch's batch_isend_irecv, here Comm.exchange) lets both
    transfers start at once; then wait for both. (Ordering by rank works too: the lower rank sends first, the
    higher receives first.)
    """
    for work in comm.exchange(sends=[(outgoing, peer)], recvs=[(incoming, peer)]):
        work.wait()


def step_count(dataset_rows, my_rows, world_size, batch_size):
    """The reference answer to notebook 11's exercise 1: the steps of an epoch, the same on every rank.

    A count from this rank's own rows differs between ranks whenever the dataset does not split evenly, and the
    rank with a step more waits in an all-reduce no other rank calls. Every rank knows the dataset's size: take
    its whole global batches and drop the rest (DistributedSampler(drop_last=True))."""
    return dataset_rows // batch_size


def replica_sync(model, comm):
    """The reference answer to notebook 11's exercise 3: replicas made equal before the first step.

    Every weight of rank 0 broadcast to every rank, in place (DDP's constructor does this, and so does
    ddp.broadcast_parameters, with the buffers too). Rank 0's, because that is the model the job's seed built."""
    with torch.no_grad():
        for param in model.parameters():
            comm.broadcast(param, src=0)


def rank_rows(batch, rank, world_size):
    """The reference answer to notebook 11's exercise 4: this rank's rows of the step's global batch.

    A contiguous slice, each rank its own (data.shard; DistributedSampler takes every world_size-th row
    instead, which is as right: what matters is that each row goes to exactly one rank)."""
    per_rank = len(batch) // world_size
    return batch[rank * per_rank:(rank + 1) * per_rank]


def resume_load(folder, rank):
    """The reference answer to notebook 11's exercise 5: a ZeRO-1 rank's optimizer state on resume.

    Under ZeRO-1 each rank's optimizer holds the state of its own shard of the weights, so each rank saved a
    different file and must load its own; rank 0's loaded and broadcast gives every rank the wrong momentum with
    the right shapes."""
    from course_lib.presentation.incidents.replicas import optimizer_file
    return torch.load(optimizer_file(folder, rank))


def fp16_step(loss, optimizer, scaler, sync):
    """The reference answer to notebook 11's exercise 7: the end of an fp16 mixed-precision step.

    Scale the loss before backward, so that the gradients fp16 computes stay above its smallest numbers;
    average them; ``scaler.step`` divides the fp32 gradients by the scale before the update (and skips a step
    whose gradients overflowed); ``update`` adjusts the scale for the next step. By hand: backward on loss × S,
    then divide every gradient by S before optimizer.step()."""
    scaler.scale(loss).backward()
    sync()
    scaler.step(optimizer)
    scaler.update()


BY_EXERCISE = {  # the name of an exercise (its checker is exercises.check_<name>) → its reference answer
    "mean_over_ranks": mean_over_ranks,
    "mlp_saved_bytes": mlp_saved_bytes,
    "accumulation_step": accumulation_step,
    "reduce_grad_shard": reduce_grad_shard,
    "copy_to_tp_region": CopyToTensorParallelRegion,
    "one_f_one_b": one_f_one_b,
    "3d_layout": layout_3d,
    "lse_merge": lse_merge,
    "expert_exchange": expert_exchange,
    "layout_at_scale": layout_at_scale,
    "own_job": own_job,
    "global_norm": global_norm,
    "micro_batch_loss": micro_batch_loss,
    "pipeline_swap": pipeline_swap,
    "step_count": step_count,
    "replica_sync": replica_sync,
    "rank_rows": rank_rows,
    "resume_load": resume_load,
    "fp16_step": fp16_step,
}


def solution(name: str) -> None:
    """Print the reference answer to exercise ``name`` (its checker's name without ``check_``)."""
    answer = BY_EXERCISE.get(name)
    if answer is None:
        print(f"There is no exercise {name!r}; the exercises are {', '.join(map(repr, BY_EXERCISE))}")
        return
    print(inspect.getsource(answer))
