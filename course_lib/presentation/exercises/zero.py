"""Notebook 03's exercise: reduce-scatter the gradients into this rank's shard."""

import torch

from ...comm import Comm
from .common import exercise, run_on_ranks


@exercise
def check_reduce_grad_shard(reduce_grad_shard) -> bool:
    """03: ``reduce_grad_shard(flat_grad, comm)`` must return this rank's shard of the *average* over ranks of
    every rank's ``flat_grad``: with n elements on N ranks, S = ceil(n/N), elements [r·S, (r+1)·S) of the mean,
    zero past the end (the last shard is padded), using one ``comm.reduce_scatter`` and nothing else.
    Checked on 2 ranks (10 elements: even) and 3 ranks (10 elements: uneven)."""

    def trial(rank, world_size, n):
        comm = Comm()
        flat_grad = torch.arange(n, dtype=torch.float64) * (rank + 1)    # rank r holds (r + 1) × [0, 1, ..., n-1]
        with comm.trace() as log:
            shard = reduce_grad_shard(flat_grad.clone(), comm)
        return shard, {op: totals.count for op, totals in log.summary().items()}

    for world_size, n in [(2, 10), (3, 10)]:
        unpadded = (f"✗ on {world_size} ranks, {n} elements: reduce_scatter needs an input of exactly N × the "
                    "shard's size. Pad flat_grad with zeros to N·S elements, S = ceil(n/N)")
        results = run_on_ranks(trial, world_size, n=n,
                                explain=lambda summary: unpadded if "(the group size) parts" in summary else None)
        if results is None:
            return False
        shard_size = -(-n // world_size)
        mean = torch.arange(n, dtype=torch.float64) * (world_size + 1) / 2       # the mean of (r + 1) over ranks
        padded = torch.cat([mean, torch.zeros(world_size * shard_size - n, dtype=torch.float64)])
        for rank, (shard, ops) in enumerate(results):
            expected = padded[rank * shard_size:(rank + 1) * shard_size]
            where = f"on {world_size} ranks, rank {rank}"
            if "all_reduce" in ops:
                print(f"✗ {where}: you used all_reduce; every rank then gets the whole sum, and ZeRO-2 keeps only "
                      "its shard. One reduce_scatter sends half the bytes")
                return False
            if ops != {"reduce_scatter": 1}:
                print(f"✗ {where}: traced collectives {ops or 'none'}; use exactly one comm.reduce_scatter "
                      "(dist.reduce_scatter_tensor is not traced)")
                return False
            if not isinstance(shard, torch.Tensor) or shard.shape != expected.shape:
                got = getattr(shard, "shape", type(shard).__name__)
                print(f"✗ {where}: expected a shard of {shard_size} elements (ceil({n}/{world_size})), got {got}")
                return False
            if torch.allclose(shard, expected * world_size):
                print(f"✗ {where}: that is the sum over ranks; divide by the world size for the mean")
                return False
            if not torch.allclose(shard, expected):
                print(f"✗ {where}: got {shard.tolist()}, expected {expected.tolist()}")
                return False
    print("✓ correct: one reduce-scatter, this rank's shard of the mean, the last shard padded with zeros")
    return True
