"""Checkers for the "your turn" exercises. Each runs the learner's code for real and says what is wrong.

A checker returns True when the answer is right. An unfinished answer (still raising NotImplementedError)
gets a hint instead of an error, so a notebook runs top to bottom before the learner has tried.
"""

import torch
import torch.distributed as dist

from .launch import RankError, launch


def _unfinished(err: RankError) -> bool:
    return "NotImplementedError" in err.summary


def check_mean_over_ranks(mean_over_ranks, world_size: int = 4) -> bool:
    """00: ``mean_over_ranks(rank, world_size, value)`` must return, on every rank, the mean of all
    ranks' ``value`` tensors, and leave the caller's ``value`` as it was."""

    def trial(rank, world_size):
        value = torch.arange(3.0) + 10 * rank            # rank r holds [10r, 10r + 1, 10r + 2]
        original = value.clone()
        result = mean_over_ranks(rank, world_size, value)
        dist.barrier()
        return result, torch.equal(value, original)

    try:
        results = launch(trial, world_size, timeout=30)
    except RankError as err:
        if _unfinished(err):
            print("Not done yet: replace `raise NotImplementedError` with your code, then run this cell again.")
            return False
        print(f"Your function failed on {err}")
        return False
    expected = torch.arange(3.0) + 10 * (world_size - 1) / 2
    for rank, (result, untouched) in enumerate(results):
        if not isinstance(result, torch.Tensor) or not torch.allclose(result, expected):
            print(f"✗ rank {rank} returned {result}, expected {expected.tolist()} (the mean over {world_size} ranks)")
            return False
        if not untouched:
            print(f"✗ rank {rank}: your function changed the caller's `value` in place (all_reduce does that!"
                  " work on a copy: value.clone())")
            return False
    print(f"✓ correct: all {world_size} ranks hold the mean {expected.tolist()}")
    return True
