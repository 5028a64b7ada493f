"""The data-parallel exercises given the typical wrong answers, on ranks: exercises.check_accumulation_step
(notebook 02: gradient accumulation on BucketedDDP) and exercises.check_reduce_grad_shard (notebook 03: one
reduce-scatter of a padded gradient). Each wrong answer gets its own hint, ✗ and False (tests/test_exercises.py
runs each checker on its reference answer and on the notebook's unfinished cell)."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from test_exercises import NOT_DONE, unfinished, verdict

from course_lib.presentation import exercises
from course_lib.presentation.exercises import solutions

# ---- 02 · check_accumulation_step --------------------------------------------------------------------

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


def never_sync_then_finish(ddp, optimizer, micro_batches, loss_fn):
    """finish_gradient_sync() then finds no bucket sent, and ddp's own error blames unused parameters."""
    optimizer.zero_grad()
    with ddp.no_sync():
        for inputs, targets in micro_batches:
            (loss_fn(ddp(inputs), targets) / len(micro_batches)).backward()
    ddp.finish_gradient_sync()
    optimizer.step()


def finish_inside_no_sync(ddp, optimizer, micro_batches, loss_fn):
    optimizer.zero_grad()
    with ddp.no_sync():
        for inputs, targets in micro_batches:
            (loss_fn(ddp(inputs), targets) / len(micro_batches)).backward()
        ddp.finish_gradient_sync()
    optimizer.step()


def no_backward(ddp, optimizer, micro_batches, loss_fn):
    optimizer.zero_grad()
    for inputs, targets in micro_batches:
        loss_fn(ddp(inputs), targets)
    optimizer.step()


def finish_twice(ddp, optimizer, micro_batches, loss_fn):
    """A synced backward, then an error from ddp that is not the never-synced case: reported as it is."""
    solutions.accumulation_step(ddp, optimizer, micro_batches, loss_fn)
    ddp.finish_gradient_sync()


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


NEVER_SYNCED = ("✗ no gradient was ever all-reduced: every micro-batch, the last one included, ran inside "
                "no_sync()")


@pytest.mark.ranks
@pytest.mark.parametrize("answer, expected, words", [
    (unfinished, False, [NOT_DONE]),
    (sync_every_micro_batch, False, ["you synced after every one of the 3 micro-batches", "ddp.no_sync()"]),
    (never_sync, False, [NEVER_SYNCED]),
    (never_sync_then_finish, False, [NEVER_SYNCED, "The last one must run outside it"]),
    (finish_inside_no_sync, False, [NEVER_SYNCED]),
    (no_backward, False, ["✗ no backward ran: call .backward() on each micro-batch's loss"]),
    (finish_twice, False, ["RuntimeError: no gradient was all-reduced since the last finish_gradient_sync()"]),
    (step_without_waiting, False, ["✗ the ranks ended with different weights", "finish_gradient_sync()"]),
    (summed_losses, False, ["✗ the gradient is 3x too large", "divide each micro-batch's loss"]),
    (zero_grad_every_micro_batch, False, ["✗ the weights differ from one process", "zero the gradients once"]),
], ids=["unfinished", "sync-every-time", "never-sync", "never-sync-then-finish", "finish-inside-no-sync",
        "no-backward", "finish-twice", "no-finish", "no-division", "zero-grad-inside"])
def test_check_accumulation_step(capsys, answer, expected, words):
    shown = verdict(capsys, exercises.check_accumulation_step(answer), expected, *words)
    assert "find_unused_parameters" not in shown, shown   # no answer here leaves a parameter out of the loss


# ---- 03 · check_reduce_grad_shard --------------------------------------------------------------------

def padded_sum_shard(flat_grad, comm):
    """This rank's shard of the sum over ranks, with one traced reduce-scatter (the reference, before /N)."""
    shard_size = -(-flat_grad.numel() // comm.size)
    padded = torch.cat([flat_grad, flat_grad.new_zeros(comm.size * shard_size - flat_grad.numel())])
    shard = flat_grad.new_empty(shard_size)
    comm.reduce_scatter(shard, padded)
    return shard, padded


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
], ids=["unfinished", "unpadded", "fails", "all-reduce", "untraced", "whole", "sum", "wrong-values"])
def test_check_reduce_grad_shard(capsys, answer, expected, words):
    verdict(capsys, exercises.check_reduce_grad_shard(answer), expected, *words)
