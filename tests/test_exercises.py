"""course_lib.exercises: every checker given an unfinished answer (the notebook's "Not done yet", not an error),
each typical wrong answer it has a hint for (that hint printed, and False), and the notebook's reference answer
(✓ and True). Checkers that run the answer on ranks do so here too (marked ``ranks``); the rest run in this
process."""

import contextlib

import pytest
import torch
import torch.distributed as dist

from course_lib import exercises
from course_lib.pipeline_parallel import gpipe_actions

NOT_DONE = "Not done yet: replace `raise NotImplementedError`"


def unfinished(*args, **kwargs):
    raise NotImplementedError("your turn")


def verdict(capsys, result: bool, expected: bool, *words: str) -> str:
    """Assert the checker's result, that its output holds ``words``, that it says ✓ exactly when right, and ✗
    exactly for a wrong answer that ran (not for an unfinished one, nor one that raised)."""
    shown = capsys.readouterr().out
    assert result is expected, shown
    for word in words:
        assert word in shown, shown
    assert ("✓" in shown) == expected and ("✗" in shown) == (not expected and NOT_DONE not in shown
                                                             and "failed on" not in shown), shown
    return shown


# ---- 00 · check_mean_over_ranks --------------------------------------------------------------------

def reference_mean_over_ranks(rank, world_size, value):
    total = value.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total / world_size


def sum_over_ranks(rank, world_size, value):
    total = value.clone()
    dist.all_reduce(total)
    return total                                    # forgot to divide


def mean_in_place(rank, world_size, value):
    dist.all_reduce(value)                          # the caller's tensor now holds the sum
    return value / world_size


def all_reduce_returns_none(rank, world_size, value):
    return dist.all_reduce(value.clone()) / world_size


@pytest.mark.ranks
@pytest.mark.parametrize("answer, expected, words", [
    (unfinished, False, [NOT_DONE]),
    (all_reduce_returns_none, False, ["Your function failed on rank", "TypeError"]),
    (sum_over_ranks, False, ["✗ rank 0 returned tensor([10., 12., 14.]", "expected [5.0, 6.0, 7.0]"]),
    (mean_in_place, False, ["✗ rank 0: your function changed the caller's `value` in place", "value.clone()"]),
    (reference_mean_over_ranks, True, ["✓ correct: all 2 ranks hold the mean [5.0, 6.0, 7.0]"]),
], ids=["unfinished", "fails", "sum", "in-place", "right"])
def test_check_mean_over_ranks(capsys, answer, expected, words):
    verdict(capsys, exercises.check_mean_over_ranks(answer, world_size=2), expected, *words)


# ---- 01 · check_mlp_saved_bytes (in this process) --------------------------------------------------

def reference_mlp_saved_bytes(batch_size, seq_len, hidden, intermediate, bytes_per_value):
    tokens = batch_size * seq_len
    return tokens * hidden * bytes_per_value + 4 * tokens * intermediate * bytes_per_value


@pytest.mark.parametrize("answer, expected, words, hint", [
    (unfinished, False, ["Not done yet: replace `raise NotImplementedError` with your formula"], None),
    (lambda b, s, h, i, e: 4 * b * s * i * e, False, ["✗ for batch 2, seq 8, hidden 16, intermediate 32, 4 bytes",
                                                      "you predicted 8192, measured 9216"],
     "the input x is saved too"),
    (lambda b, s, h, i, e: b * s * h * e + 3 * b * s * i * e, False, ["you predicted 7168"],
     "down_proj saves its own input"),
    (lambda b, s, h, i, e: 2 * b * s * h * e + 4 * b * s * i * e, False, ["you predicted 10240"],
     "count that storage once"),
    (lambda b, s, h, i, e: b * s * (h + 4 * i) * 4, False,          # fp32 only: right at the first shape
     ["✗ for batch 3, seq 5, hidden 64, intermediate 96, 2 bytes/value"], None),
    (lambda b, s, h, i, e: 1, False, ["you predicted 1, measured 9216"], None),
    (reference_mlp_saved_bytes, True, ["✓ correct at all 4 shapes"], None),
], ids=["unfinished", "no-input", "no-down-input", "input-twice", "fp32-only", "unrecognised", "right"])
def test_check_mlp_saved_bytes(capsys, answer, expected, words, hint):
    shown = verdict(capsys, exercises.check_mlp_saved_bytes(answer), expected, *words)
    assert shown.count("hint:") == (hint is not None) and (hint or "") in shown


# ---- 04 · check_copy_to_tp_region --------------------------------------------------------------------

class ReferenceCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad)
        return grad, None


class UnfinishedCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        raise NotImplementedError("your turn")


class ReduceForward(ReferenceCopy):
    """Megatron's g instead of f: all-reduces going forward."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        y = x.clone()
        comm.all_reduce(y)
        return y


class MeanForward(ReferenceCopy):
    """The identity (every rank holds the same x), but with an all-reduce it does not need."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        y = x.clone()
        comm.all_reduce(y)
        return y / comm.size


class LocalBackward(ReferenceCopy):
    @staticmethod
    def backward(ctx, grad):
        return grad, None


class UntracedBackward(ReferenceCopy):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad, None


class MeanBackward(ReferenceCopy):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad)
        return grad / ctx.comm.size, None


@pytest.mark.ranks
@pytest.mark.parametrize("answer, expected, words", [
    (UnfinishedCopy, False, [NOT_DONE]),
    (ReduceForward, False, ["✗ rank 0: forward must return x unchanged"]),
    (MeanForward, False, ["✗ rank 0: your forward sent 1 collective(s); f communicates only backward"]),
    (LocalBackward, False, ["only this rank's share", "All-reduce the gradient in backward"]),
    (UntracedBackward, False, ["backward made 0 traced collectives", "dist.all_reduce is not traced"]),
    (MeanBackward, False, ["differs from the dense layer's (sum, not mean"]),
    (ReferenceCopy, True, ["✓ correct: identity forward, one all-reduce backward"]),
], ids=["unfinished", "g-not-f", "forward-collective", "no-all-reduce", "untraced", "mean", "right"])
def test_check_copy_to_tp_region(capsys, answer, expected, words):
    verdict(capsys, exercises.check_copy_to_tp_region(answer), expected, *words)


# ---- 02 · check_accumulation_step --------------------------------------------------------------------

def reference_accumulation_step(ddp, optimizer, micro_batches, loss_fn):
    optimizer.zero_grad()
    for i, (inputs, targets) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            (loss_fn(ddp(inputs), targets) / len(micro_batches)).backward()
    ddp.finish_gradient_sync()
    optimizer.step()


def sync_every_micro_batch(ddp, optimizer, micro_batches, loss_fn):
    optimizer.zero_grad()
    for inputs, targets in micro_batches:
        (loss_fn(ddp(inputs), targets) / len(micro_batches)).backward()
        ddp.finish_gradient_sync()
    optimizer.step()


def never_sync(ddp, optimizer, micro_batches, loss_fn):
    optimizer.zero_grad()
    with ddp.no_sync():
        for inputs, targets in micro_batches:
            (loss_fn(ddp(inputs), targets) / len(micro_batches)).backward()
    optimizer.step()


def step_without_waiting(ddp, optimizer, micro_batches, loss_fn):
    optimizer.zero_grad()
    for i, (inputs, targets) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else ddp.no_sync():
            (loss_fn(ddp(inputs), targets) / len(micro_batches)).backward()
    optimizer.step()                                # the all-reduces were issued, never waited for


def summed_losses(ddp, optimizer, micro_batches, loss_fn):
    optimizer.zero_grad()
    for i, (inputs, targets) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else ddp.no_sync():
            loss_fn(ddp(inputs), targets).backward()
    ddp.finish_gradient_sync()
    optimizer.step()


def zero_grad_every_micro_batch(ddp, optimizer, micro_batches, loss_fn):
    for i, (inputs, targets) in enumerate(micro_batches):
        optimizer.zero_grad()                       # throws away the micro-batches before
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else ddp.no_sync():
            (loss_fn(ddp(inputs), targets) / len(micro_batches)).backward()
    ddp.finish_gradient_sync()
    optimizer.step()


@pytest.mark.ranks
@pytest.mark.parametrize("answer, expected, words", [
    (unfinished, False, [NOT_DONE]),
    (sync_every_micro_batch, False, ["you synced after every one of the 3 micro-batches", "ddp.no_sync()"]),
    (never_sync, False, ["✗ no all-reduce at all"]),
    (step_without_waiting, False, ["✗ the ranks ended with different weights", "finish_gradient_sync()"]),
    (summed_losses, False, ["✗ the gradient is 3x too large", "divide each micro-batch's loss"]),
    (zero_grad_every_micro_batch, False, ["✗ the weights differ from one process", "zero the gradients once"]),
    (reference_accumulation_step, True, ["✓ correct:", "for 3 micro-batches", "on all 12 rows"]),
], ids=["unfinished", "sync-every-time", "never-sync", "no-finish", "no-division", "zero-grad-inside", "right"])
def test_check_accumulation_step(capsys, answer, expected, words):
    verdict(capsys, exercises.check_accumulation_step(answer), expected, *words)


# ---- 05 · check_one_f_one_b --------------------------------------------------------------------------

def reference_one_f_one_b(stage, num_stages, num_microbatches):
    warmup = min(num_stages - stage - 1, num_microbatches)
    actions = [("F", k) for k in range(warmup)]
    for k in range(warmup, num_microbatches):
        actions += [("F", k), ("B", k - warmup)]
    return actions + [("B", k) for k in range(num_microbatches - warmup, num_microbatches)]


def with_warmup(count):
    """1F1B's shape with ``count(stage, num_stages)`` warm-up forwards instead of p - s - 1."""
    def actions(stage, num_stages, num_microbatches):
        warmup = min(count(stage, num_stages), num_microbatches)
        order = [("F", k) for k in range(warmup)]
        for k in range(warmup, num_microbatches):
            order += [("F", k), ("B", k - warmup)]
        return order + [("B", k) for k in range(num_microbatches - warmup, num_microbatches)]
    return actions


def forgets_the_last_backward(stage, num_stages, num_microbatches):
    return reference_one_f_one_b(stage, num_stages, num_microbatches)[:-1]


@pytest.mark.parametrize("answer, words", [
    (unfinished, [NOT_DONE]),
    (with_warmup(lambda s, p: s), ["✗ p=2, m=4: deadlock: stage 0 waits at ('B', 0)",
                                   "hint: a stage waits for a backward", "p - s - 1 forwards"]),   # reversed stages
    (forgets_the_last_backward, ["✗ p=2, m=1: stage 0: [('F', 0)] must hold ('F', k) and ('B', k) exactly once"]),
    (with_warmup(lambda s, p: 0), ["✗ p=2, m=4: the step takes 16 op-times, the formula 5·2 = 10",
                                   "too few warm-up forwards?"]),
    (gpipe_actions, ["✗ p=2, m=4: stages hold [4, 4] micro-batches at their peak; 1F1B holds [2, 1]",
                     "hint: that is GPipe"]),
    (with_warmup(lambda s, p: p - s), ["✗ p=2, m=4: stages hold [3, 2] micro-batches at their peak; 1F1B holds "
                                       "[2, 1]"]),
], ids=["unfinished", "deadlock", "invalid", "too-slow", "gpipe", "too-many-in-flight"])
def test_check_one_f_one_b_finds_a_wrong_schedule_by_simulation(capsys, answer, words):
    shown = verdict(capsys, exercises.check_one_f_one_b(answer), False, *words)
    if "hint" not in " ".join(words):
        assert "hint" not in shown


def one_f_one_b_that_changes_the_loss(stage, num_stages, num_microbatches):
    """A right order with a side effect on the ranks only: a stand-in for any mistake that the simulation
    cannot see (any valid order gives the same loss and gradients, so a pure schedule function cannot)."""
    if dist.is_initialized() and not getattr(torch.nn.functional.cross_entropy, "smoothed", False):
        original = torch.nn.functional.cross_entropy

        def smoothed(*args, **kwargs):
            return original(*args, label_smoothing=0.1, **kwargs)
        smoothed.smoothed = True
        torch.nn.functional.cross_entropy = smoothed
    return reference_one_f_one_b(stage, num_stages, num_microbatches)


@pytest.mark.ranks
@pytest.mark.parametrize("answer, expected, words", [
    (one_f_one_b_that_changes_the_loss, False, ["✗ on 3 real ranks the loss is", "gradients off by up to"]),
    (reference_one_f_one_b, True, ["✓ correct: as fast as GPipe (bubble 27.3% at p=4, m=8)", "on 3 real ranks"]),
], ids=["wrong-on-ranks", "right"])
def test_check_one_f_one_b_on_real_ranks(capsys, answer, expected, words):
    verdict(capsys, exercises.check_one_f_one_b(answer), expected, *words)


# ---- 03 · check_reduce_grad_shard --------------------------------------------------------------------

def padded_sum_shard(flat_grad, comm):
    """This rank's shard of the sum over ranks, with one traced reduce-scatter (the reference, before /N)."""
    shard_size = -(-flat_grad.numel() // comm.size)
    padded = torch.cat([flat_grad, flat_grad.new_zeros(comm.size * shard_size - flat_grad.numel())])
    shard = flat_grad.new_empty(shard_size)
    comm.reduce_scatter(shard, padded)
    return shard, padded


def reference_reduce_grad_shard(flat_grad, comm):
    shard, _ = padded_sum_shard(flat_grad, comm)
    return shard / comm.size


def unpadded(flat_grad, comm):
    shard = flat_grad.new_empty(flat_grad.numel() // comm.size)
    comm.reduce_scatter(shard, flat_grad)
    return shard / comm.size


def missing_argument(flat_grad, comm):
    return comm.reduce_scatter(flat_grad) / comm.size


def with_all_reduce(flat_grad, comm):
    total = flat_grad.clone()
    comm.all_reduce(total)
    shard_size = -(-flat_grad.numel() // comm.size)
    return total[comm.rank * shard_size:(comm.rank + 1) * shard_size] / comm.size


def untraced(flat_grad, comm):
    shard_size = -(-flat_grad.numel() // comm.size)
    padded = torch.cat([flat_grad, flat_grad.new_zeros(comm.size * shard_size - flat_grad.numel())])
    shard = flat_grad.new_empty(shard_size)
    dist.reduce_scatter_tensor(shard, padded, group=comm.group)
    return shard / comm.size


def whole_input(flat_grad, comm):
    _, padded = padded_sum_shard(flat_grad, comm)
    return padded / comm.size


def shard_sum(flat_grad, comm):
    return padded_sum_shard(flat_grad, comm)[0]


def divided_by_elements(flat_grad, comm):
    return padded_sum_shard(flat_grad, comm)[0] / flat_grad.numel()


@pytest.mark.ranks
@pytest.mark.parametrize("answer, expected, words", [
    (unfinished, False, [NOT_DONE]),
    (unpadded, False, ["✗ on 3 ranks, 10 elements: reduce_scatter needs an input of exactly N × the shard's size",
                       "Pad flat_grad with zeros"]),                       # right on 2 ranks: 10 = 2 × 5
    (missing_argument, False, ["Your function failed on rank", "TypeError"]),
    (with_all_reduce, False, ["✗ on 2 ranks, rank 0: you used all_reduce"]),
    (untraced, False, ["✗ on 2 ranks, rank 0: traced collectives none", "dist.reduce_scatter_tensor is not traced"]),
    (whole_input, False, ["✗ on 2 ranks, rank 0: expected a shard of 5 elements (ceil(10/2)), got torch.Size([10])"]),
    (shard_sum, False, ["✗ on 2 ranks, rank 0: that is the sum over ranks"]),
    (divided_by_elements, False, ["✗ on 2 ranks, rank 0: got [0.0, 0.3", "expected [0.0, 1.5, 3.0, 4.5, 6.0]"]),
    (reference_reduce_grad_shard, True, ["✓ correct: one reduce-scatter"]),
], ids=["unfinished", "unpadded", "fails", "all-reduce", "untraced", "whole", "sum", "wrong-values", "right"])
def test_check_reduce_grad_shard(capsys, answer, expected, words):
    verdict(capsys, exercises.check_reduce_grad_shard(answer), expected, *words)


# ---- 06 · check_3d_layout (in this process) ----------------------------------------------------------

def layout(dp=2, tp=8, pp=2, zero_stage=1, num_microbatches=16, **changes):
    answer = dict(dp=dp, tp=tp, pp=pp, zero_stage=zero_stage, num_microbatches=num_microbatches)
    return lambda: {**answer, **changes}


@pytest.mark.parametrize("answer, words", [
    (unfinished, [NOT_DONE]),
    (lambda: {"dp": 2, "tp": 8, "pp": 2, "zero_stage": 1}, ["✗ KeyError: 'num_microbatches'"]),
    (lambda: (2, 8, 2, 1, 16), ["✗ TypeError: tuple indices must be integers"]),
    (layout(dp=4), ["✗ ValueError: world_size 32 != dp 4 × tp 8 × pp 2 = 64"]),
    (layout(dp=4, tp=1, pp=8, num_microbatches=3), ["✗ ValueError: each dp rank's batch of 16", "num_microbatches=3"]),
    (layout(zero_stage=4), ["✗ zero_stage=4: one of 0 (DDP), 1, 2, 3"]),
    (layout(zero_stage=3), ["✗ ZeRO-3 with a pipeline", "ZeRO-1 is the most a pipeline takes"]),
    (layout(dp=32, tp=1, pp=1, zero_stage=0, num_microbatches=1), ["✗ 1027.8 GiB of training state on the "
                                                                   "fullest GPU > 80 GiB: shard more"]),
    (layout(num_microbatches=2), ["✗ the bubble is (p-1)/(m+p-1) = 1/3 = 33%: more micro-batches"]),
    (layout(num_microbatches=0), ["✗ ValueError: num_microbatches=0 must be a whole number >= 1"]),
], ids=["unfinished", "missing-key", "not-a-dict", "wrong-size", "uneven-batch", "no-such-stage", "zero3-pipeline",
        "does-not-fit", "bubble", "no-micro-batches"])
def test_check_3d_layout_says_what_is_wrong(capsys, answer, words):
    verdict(capsys, exercises.check_3d_layout(answer), False, *words)


def test_check_3d_layout_accepts_the_notebooks_answer(capsys):
    verdict(capsys, exercises.check_3d_layout(layout()), True,
            "✓ dp 2 × tp 8 × pp 2, ZeRO-1, m = 16", "bubble 5.9%, TP inside the node")
