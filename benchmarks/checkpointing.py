"""Benchmark: what activation checkpointing costs in time, against what it saves in memory, on one process.

    python benchmarks/checkpointing.py                       # hidden 256, 4 layers, 2 × 128 tokens
    python benchmarks/checkpointing.py --hidden 1024 --repeats 9

One forward + backward of the course model with each policy of ``apply_checkpointing`` ("none", "selective",
"op", "full"), timed interleaved repeat by repeat (a busy neighbour slows all alike), median of each. Beside each
time: the bytes the forward saved (measured by SavedActivations, with what "op" keeps in the checkpoint:
recompute.kept_by_policy) and the recomputed FLOPs' share
(cost.recompute_flops over the step's model FLOPs). "full" reruns every block's forward: about 1 + 1/3 of a
step's matmuls, so expect a ratio near 1.3 where matmuls dominate (less on a CPU, where norms, rotary and
softmax take a larger share of the time and are rerun too). "op" reruns a third of "full"'s matmuls but every
op of the block passes through torch's selective-checkpoint dispatch mode, in Python, forward and rerun: on a
small CPU model that overhead can cost as much as the matmuls it saves. The ratios are the last lines.
"""

import argparse
import statistics
import time

import torch

from course_lib.cost import flops_per_step
from course_lib.data import SyntheticTokens
from course_lib.measure import SavedActivations
from course_lib.model import build, loss_fn, preset, widened
from course_lib.recompute import POLICIES, apply_checkpointing, kept_by_policy


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    config = preset("tiny", num_layers=args.layers, max_seq_len=args.seq_len, **widened(args.hidden))
    inputs, targets = SyntheticTokens(config.vocab_size, args.seq_len, seed=0).batch(0, args.batch_size)
    models = {policy: apply_checkpointing(build(config, seed=0), policy) for policy in POLICIES}
    saved = {}
    for policy, model in models.items():          # warm-up, and the saved bytes
        with SavedActivations(model) as counted:
            loss = loss_fn(model(inputs), targets)
        loss.backward()
        saved[policy] = counted.bytes + kept_by_policy(model)
    seconds = {policy: [] for policy in POLICIES}
    for _ in range(args.repeats):
        for policy, model in models.items():
            model.zero_grad()
            start = time.perf_counter()
            loss_fn(model(inputs), targets).backward()
            seconds[policy].append(time.perf_counter() - start)
    print(f"hidden {args.hidden}, {args.layers} layers, {args.batch_size} × {args.seq_len} tokens, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    base = statistics.median(seconds["none"])
    for policy in POLICIES:
        flops = flops_per_step(config, batch_size=args.batch_size, seq_len=args.seq_len, recompute=policy)
        median = statistics.median(seconds[policy])
        print(f"{policy:>9}: {median * 1e3:8.1f} ms  saved {saved[policy] / 2**20:7.2f} MiB  "
              f"recomputed FLOPs {flops.recompute / flops.model:5.1%} of the step's  "
              f"time ratio {median / base:.2f}")


if __name__ == "__main__":
    main()
