"""Benchmark: ZeRO stages 0-3 by hand against torch's DDP, ZeroRedundancyOptimizer and FSDP2 fully_shard.

    python benchmarks/zero.py                         # 4 ranks, hidden 256, 4 layers, 4 x 64 tokens per rank
    python benchmarks/zero.py --hidden 512 --rounds 5

Every implementation trains the same model on the same data with torch's Adam (fp32), one thread per rank.
They run in rounds, each round every implementation in turn for a few steps (the first step of each run is
warm-up: fully_shard initialises itself lazily in it), so a busy neighbour on a shared machine slows all of
them alike; a step's time is its slowest rank's, and the table shows the median over rounds and steps.

Memory per rank, in KiB: "state" is measure_state_bytes after the step (weights, gradients, optimizer state,
each storage once; the largest rank). "peak weights" is the most parameter memory a rank held during the step,
the shards plus what it borrowed: ours measured from storage at every gather and free
(ZeroDataParallel.memory_trace); fully_shard's sharded + unsharded parameters at its peak, from torch's
FSDPMemTracker; DDP and ZeroRedundancyOptimizer borrow nothing, so their weights. The last line is stage 3's
step time over fully_shard's: below 1 means ours is faster.
"""

import argparse
import contextlib
import statistics
import warnings

import torch

from course_lib import launch
from course_lib.data import SyntheticTokens
from course_lib.model import build, count_params, loss_fn, preset, widened
from course_lib.runs.zero import train
from course_lib.zero import default_units

RUNS = [("ours", 0), ("ours", 1), ("ours", 2), ("ours", 3), ("ddp", 0), ("zero_redundancy", 1), ("fully_shard", 3)]
NAMES = {"ours": "ours", "ddp": "torch DDP", "zero_redundancy": "ZeroRedundancyOptimizer",
         "fully_shard": "FSDP2 fully_shard"}
KiB = 1024


def fully_shard_peak_weights(rank, world_size, config, micro_batch_size, seq_len) -> int:
    """FSDPMemTracker's sharded + unsharded parameter bytes at the peak of one training step."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build(config, seed=0)
    mesh = init_device_mesh("cpu", (world_size,))
    for unit in default_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    inputs, targets = SyntheticTokens(config.vocab_size, seq_len).rank_batch(0, micro_batch_size * world_size, rank,
                                                                           world_size)
    for step in range(2):                       # the first step makes Adam's state; track the second
        tracker = FSDPMemTracker(model, optimizer) if step else None
        with tracker or contextlib.nullcontext():
            optimizer.zero_grad(set_to_none=False)
            loss_fn(model(inputs), targets).backward()
            optimizer.step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return sum(value for kind, value in peak.items() if str(kind).endswith(("SHARDED_PARAM", "UNSHARDED_PARAM")))


def every_run(rank, world_size, *, config, rounds, steps, micro_batch_size, seq_len):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)                    # one core per rank, as one GPU per rank
    results = {run: {"seconds": []} for run in RUNS}
    for _ in range(rounds):
        for impl, stage in RUNS:
            out = train(rank, world_size, impl=impl, zero_stage=stage, steps=steps, micro_batch_size=micro_batch_size,
                        seq_len=seq_len, lr=1e-3, config=config)
            result = results[impl, stage]
            result["seconds"] += out["step_seconds"][1:]            # the first step is warm-up
            result["state"] = out["state"]["total"]
            result["wire"] = sum(out["wire"][-1].values()) if impl == "ours" else None
            result["bytes_written"] = out["bytes_written"][-1]
            result["peak"] = out["state"]["weights"]
    for stage in range(4):                      # one more run each, recording memory (not timed)
        out = train(rank, world_size, zero_stage=stage, steps=2, micro_batch_size=micro_batch_size, seq_len=seq_len,
                    lr=1e-3, config=config, memory_trace=True)
        results["ours", stage]["peak"] = max(event["weights"] for event in out["memory_trace"])
    results["fully_shard", 3]["peak"] = fully_shard_peak_weights(rank, world_size, config, micro_batch_size, seq_len)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--per-rank-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps per run, the first one warm-up")
    args = parser.parse_args()
    config = preset("tiny", num_layers=args.layers, max_seq_len=args.seq_len, **widened(args.hidden))
    per_rank = launch(every_run, args.world_size, config=config, rounds=args.rounds, steps=args.steps,
                      micro_batch_size=args.micro_batch_size, seq_len=args.seq_len, timeout=1200)
    params = count_params(config)
    print(f"{args.world_size} ranks (gloo, 1 thread each), {params:,} parameters (hidden {args.hidden}, "
          f"{args.layers} layers), {args.micro_batch_size} x {args.seq_len} tokens per rank, fp32 Adam; "
          f"median of {args.rounds} rounds x {args.steps - 1} steps\n")
    print(f"{'implementation':>26} {'stage':>5} {'step (ms)':>10} {'/ DDP':>6} {'state KiB':>10} {'peak weights KiB':>17} "
          f"{'traced wire KiB':>16} {'kernel KiB':>11}")
    medians = {}
    for run in RUNS:
        # a step ends when its slowest rank ends: the max over ranks, step by step
        seconds = [max(times) for times in zip(*(r[run]["seconds"] for r in per_rank))]
        medians[run] = statistics.median(seconds)
    for run in RUNS:
        worst = {key: max(r[run][key] for r in per_rank) for key in ("state", "peak")}
        wire, written = per_rank[0][run]["wire"], per_rank[0][run]["bytes_written"]
        print(f"{NAMES[run[0]]:>26} {run[1]:>5} {medians[run] * 1e3:>10.1f} "
              f"{medians[run] / medians['ddp', 0]:>6.2f} {worst['state'] / KiB:>10,.0f} {worst['peak'] / KiB:>17,.0f} "
              f"{'—' if wire is None else f'{wire / KiB:,.0f}':>16} "
              f"{'n/a' if written is None else f'{written / KiB:,.0f}':>11}")
    print(f"\nratio ours stage 0/DDP: {medians['ours', 0] / medians['ddp', 0]:.2f}")
    print(f"ratio ours stage 1/ZeroRedundancyOptimizer: {medians['ours', 1] / medians['zero_redundancy', 1]:.2f}")
    print(f"ratio ours stage 3/stage 0: {medians['ours', 3] / medians['ours', 0]:.2f}")
    print(f"ratio zero3/fully_shard: {medians['ours', 3] / medians['fully_shard', 3]:.2f}")


if __name__ == "__main__":
    main()
