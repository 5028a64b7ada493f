"""Notebook 00's exercise: the mean of a tensor over ranks."""

import torch
import torch.distributed as dist

from .common import exercise, run_on_ranks


@exercise
def check_mean_over_ranks(mean_over_ranks, world_size: int = 4) -> bool:
    """00: ``mean_over_ranks(rank, world_size, value)`` must return, on every rank, the mean of all
    ranks' ``value`` tensors, and leave the caller's ``value`` as it was."""

    def trial(rank, world_size):
        value = torch.arange(3.0) + 10 * rank            # rank r holds [10r, 10r + 1, 10r + 2]
        original = value.clone()
        result = mean_over_ranks(rank, world_size, value)
        dist.barrier()
        return result, torch.equal(value, original)

    results = run_on_ranks(trial, world_size)
    if results is None:
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
