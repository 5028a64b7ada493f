"""Benchmark: how much of a checkpoint's time dcp.async_save takes off the training step.

    python benchmarks/checkpoint.py                       # 4 ranks, dp 2 × tp 2 with ZeRO-3, hidden 512, 4 layers
    python benchmarks/checkpoint.py --hidden 1024 --steps 6

Each rank trains the course model (float64 Adam, course_lib.runs.checkpoint.Trainer) and, in three phases of
--steps steps each, runs plain steps; steps that first save a distributed checkpoint with dcp.save (the step waits
for the files); and steps that first start dcp.async_save (it stages a copy of the state in memory, returns, and
writes in a background thread while the step computes; each save waits for the previous one before it starts).
A step's time is its slowest rank's; the table shows medians. The overlap is the share of a blocking save's cost
that the asynchronous one hides: 1 - (async step - plain step) / (saving step - plain step). On 2 busy CPU cores
the writer thread competes with the step for the same cores, so the overlap here is a floor; on a GPU box the
step runs on the GPU while a CPU thread writes.
"""

import argparse
import statistics
import tempfile

from course_lib import launch
from course_lib.model import count_params, preset, widened
from course_lib.runs.checkpoint import LAYOUTS, async_overlap, layout_name, world_of


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="dp2 tp2 zero3", choices=list(LAYOUTS))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    layout, config = LAYOUTS[args.layout], preset("tiny", num_layers=args.layers, **widened(args.hidden))
    with tempfile.TemporaryDirectory(prefix="ckpt_bench_") as root:
        per_rank = launch(async_overlap, world_of(layout), layout=layout, root=root, steps=args.steps,
                          config=config, timeout=1800)
    slowest = {kind: [max(r[kind][i] for r in per_rank) for i in range(args.steps)]
               for kind in ("plain", "save", "async_save", "async_blocking")}
    median = {kind: statistics.median(times) for kind, times in slowest.items()}
    size = 24 * count_params(config)
    print(f"{layout_name(layout)}, {count_params(config):,} parameters: a checkpoint of {size / 2**20:.0f} MiB "
          f"(float64 weights + Adam), median of {args.steps} steps, slowest rank")
    print(f"  plain step                         {median['plain'] * 1e3:8.0f} ms")
    print(f"  dcp.save, then the step            {median['save'] * 1e3:8.0f} ms")
    print(f"  dcp.async_save, then the step      {median['async_save'] * 1e3:8.0f} ms   "
          f"(async_save itself blocked {median['async_blocking'] * 1e3:.0f} ms: staging the copy)")
    cost = median["save"] - median["plain"]
    hidden = 1 - (median["async_save"] - median["plain"]) / cost if cost > 0 else float("nan")
    print(f"overlap: async_save hides {hidden:.0%} of a blocking save's cost")


if __name__ == "__main__":
    main()
