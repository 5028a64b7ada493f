"""Benchmark: step time of our data parallelism (naive, bucketed) against torch's DistributedDataParallel.

    python benchmarks/ddp.py                              # 2 and 4 gloo ranks on this CPU
    python benchmarks/ddp.py --hidden 512 --bucket-mb 4   # a bigger model, other buckets

All three train the same model on the same batches in the same processes, one step each in turn (the order
rotates every step), so a change in the machine's load hits all three alike and the ratios come from one run.
A step's time is the slowest rank's (everyone waits for it at the next all-reduce); the table shows the median
over the measured steps. Both bucketed versions use the same bucket size (torch's `bucket_cap_mb`).
The last line is the ratio bucketed/torch at 4 ranks: the course's goal is at most 1.3.
"""

import argparse
import statistics

import torch

from course_lib import launch
from course_lib.comm import Comm
from course_lib.data import SyntheticTokens, micro_batches
from course_lib.model import build, count_params, preset, widened
from course_lib.runs.ddp import DDP_KINDS, train_step, wrap
from course_lib.units import MiB

KINDS = DDP_KINDS[1:]   # naive, bucketed, torch


def interleaved_steps(rank, world_size, *, config, steps, warmup, bucket_bytes, micro_batch_size, seq_len):
    """Each kind's step times on this rank, the kinds taking turns on the same batches."""
    comm = Comm()
    data = SyntheticTokens(config.vocab_size, seq_len, seed=0)
    setups = {}
    for kind in KINDS:
        model = wrap(build(config, seed=0), kind, comm, bucket_bytes)
        setups[kind] = (model, torch.optim.Adam(model.parameters(), lr=1e-3))
    seconds = {kind: [] for kind in KINDS}
    for step in range(warmup + steps):
        batches = micro_batches(data, step, micro_batch_size, rank, world_size)
        order = KINDS[step % 3:] + KINDS[:step % 3]
        for kind in order:
            comm.barrier()                               # start together: no rank carries the last one's lag
            record = train_step(*setups[kind], batches)
            if step >= warmup:
                seconds[kind].append(record["end"] - record["start"])
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden", type=int, default=256, help="model width (the tiny model has 64)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size of ours and torch's, MiB")
    parser.add_argument("--per-rank-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    config = preset("tiny", num_layers=args.layers, **{**widened(args.hidden), "intermediate": 2 * args.hidden})
    params = count_params(config)
    print(f"model: hidden {args.hidden}, {args.layers} layers, {params:,} parameters = {4 * params / MiB:.1f} MiB "
          f"of fp32 gradients; buckets {args.bucket_mb} MiB; per-rank batch {args.micro_batch_size} × "
          f"{args.seq_len} tokens; median of {args.steps} steps after {args.warmup} warm-up\n")
    print(f"{'ranks':>5} {'naive ms':>9} {'bucketed ms':>12} {'torch ms':>9} {'naive/torch':>12} {'bucketed/torch':>15}")
    ratio = None
    for world_size in args.world_sizes:
        per_rank = launch(interleaved_steps, world_size, timeout=600, config=config, steps=args.steps,
                          warmup=args.warmup, bucket_bytes=int(args.bucket_mb * MiB),
                          micro_batch_size=args.micro_batch_size, seq_len=args.seq_len)
        median = {kind: statistics.median(max(times) for times in zip(*(r[kind] for r in per_rank)))
                  for kind in KINDS}
        ratio = median["bucketed"] / median["torch"]
        print(f"{world_size:>5} {median['naive'] * 1e3:>9.1f} {median['bucketed'] * 1e3:>12.1f} "
              f"{median['torch'] * 1e3:>9.1f} {median['naive'] / median['torch']:>12.2f} {ratio:>15.2f}")
    print(f"ratio bucketed/torch: {ratio:.2f}")


if __name__ == "__main__":
    main()
