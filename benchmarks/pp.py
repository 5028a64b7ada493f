"""Benchmark: pipeline bubbles measured against (p-1)/(m+p-1), and our pipeline's step against torch's.

    python benchmarks/pp.py

1. Bubbles, controlled cost (course_lib.pipeline_parallel): every forward and backward of the tiny model is
   padded to 60 ms (its real compute runs inside), p ∈ {2, 4} real ranks, m ∈ {1, 4, 8, 16}, GPipe and 1F1B,
   the fastest of 2 steps. Measured bubble = mean over ranks of 1 - busy / makespan. The formula assumes
   instant hand-offs; a gloo message between two ranks here takes ~1 ms, which GPipe pays once per boundary
   and 1F1B at every steady-state op (so 1F1B measures a little higher; 60 ms ops keep that under 0.03).
2. Speed, real compute: a 1F1B step of the tiny model (4 layers, batch 16 × 64 tokens, 4 micro-batches) on
   2 stages, ours (`pipeline_step`) against torch.distributed.pipelining's `Schedule1F1B`, alternating step by
   step so both meet the same machine; median of 15 steps each after warm-up; ratio ours / torch.

The last line is `max bubble gap: X.XXX`, the largest |measured - formula| over every run (goal ≤ 0.03).
"""

import statistics
import time

import torch

from course_lib import launch
from course_lib.comm import Comm
from course_lib.data import SyntheticTokens
from course_lib.model import GPT, build, preset
from course_lib.pipeline_parallel import Timeline, bubble_fraction, make_stage, partition_layers, pipeline_step
from course_lib.runs.pipeline import pipeline_sweep

MICROBATCHES = (1, 4, 8, 16)
OP_MS = 60


def bubbles(weights) -> list[dict]:
    rows = []
    for p in (2, 4):
        for schedule in ("gpipe", "1f1b"):
            runs = launch(pipeline_sweep, p, runs=[{"num_microbatches": m} for m in MICROBATCHES], schedule=schedule,
                          forward_ms=OP_MS, batch_size=16, seq_len=8, steps=2, measure_memory=False, weights=weights)
            for i, m in enumerate(MICROBATCHES):
                timeline = Timeline.from_results([ranks[i] for ranks in runs])
                rows.append({"p": p, "m": m, "schedule": schedule, "formula": bubble_fraction(p, m),
                             "measured": timeline.bubble, "overruns": timeline.overruns})
                row = rows[-1]
                print(f"{p:3} {m:4} {schedule:>6} {row['formula']:9.1%} {row['measured']:9.1%} "
                      f"{row['measured'] - row['formula']:+8.3f}", flush=True)
    return rows


def ours_vs_torch(rank, world_size, *, weights, steps, num_microbatches):
    """Alternate one step of ours and one of torch's; return the seconds of each (rank 0's clock)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from course_lib.model import loss_fn

    parts = partition_layers(4, world_size)
    stages = []
    for _ in range(2):
        model = GPT(preset("tiny"))
        model.load_state_dict(weights)
        stages.append(make_stage(model, rank, parts))
    ours, theirs = stages
    schedule = Schedule1F1B(PipelineStage(theirs, rank, world_size, torch.device("cpu")),
                            n_microbatches=num_microbatches, loss_fn=loss_fn)
    inputs, targets = SyntheticTokens(128, 64, seed=0).batch(0, 16)
    comm = Comm()
    seconds = {"ours": [], "torch": []}
    for step in range(steps + 2):       # the first two rounds warm up (first calls, imports, shape inference)
        for name in ("ours", "torch"):
            comm.barrier()
            start = time.perf_counter()
            if name == "ours":
                ours.zero_grad()
                pipeline_step(ours, comm, inputs, targets, num_microbatches=num_microbatches, schedule="1f1b")
            else:
                theirs.zero_grad()
                if rank == 0:
                    schedule.step(inputs)
                elif rank == world_size - 1:
                    schedule.step(target=targets, losses=[])
                else:
                    schedule.step()
            comm.barrier()
            if step >= 2:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def main():
    weights = build(preset("tiny"), seed=0).state_dict()
    print(f"bubbles, controlled cost ({OP_MS} ms per forward and per backward, fastest of 2 steps)")
    print(f"{'p':>3} {'m':>4} {'sched':>6} {'formula':>9} {'measured':>9} {'gap':>8}")
    rows = bubbles(weights)

    seconds = launch(ours_vs_torch, 2, weights=weights, steps=15, num_microbatches=4)[0]
    ours, theirs = statistics.median(seconds["ours"]), statistics.median(seconds["torch"])
    print(f"\nstep time, 1F1B on 2 stages, real compute (median of {len(seconds['ours'])} steps): ours "
          f"{ours * 1e3:.1f} ms, torch.distributed.pipelining {theirs * 1e3:.1f} ms")
    print(f"ours / torch step time: {ours / theirs:.2f}")
    for schedule in ("gpipe", "1f1b"):
        worst = max(abs(r["measured"] - r["formula"]) for r in rows if r["schedule"] == schedule)
        print(f"{schedule} max bubble gap: {worst:.3f}")
    print(f"max bubble gap: {max(abs(r['measured'] - r['formula']) for r in rows):.3f}")


if __name__ == "__main__":
    main()
