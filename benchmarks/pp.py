"""Benchmark: pipeline bubbles measured against their formulas, and our pipeline's step against torch's.

    python benchmarks/pp.py

1. Bubbles, controlled cost (course_lib.pipeline_parallel): every op of the tiny model is padded to 60 ms (its
   real compute runs inside), p ∈ {2, 4} real ranks, m ∈ {1, 4, 8, 16}, the fastest of 2 steps. GPipe and 1F1B
   (each forward and backward 60 ms) against (p-1)/(m+p-1); interleaved 1F1B with v = 2 chunks per rank (each
   chunk's forward and backward 60 ms; m a multiple of p) against (p-1)/(v·m+p-1); ZB-H1 (forward, B and W
   60 ms each; m >= p) against (p-1)/(3m+p-1), the paper's (p-1)(T_F+T_B-T_W) of idle time in a makespan of
   m(T_F+T_B+T_W) + (p-1)(T_F+T_B-T_W). Measured bubble = mean over ranks of 1 - busy / makespan. The
   formulas assume instant hand-offs; a gloo message between two ranks here takes ~1 ms, which GPipe pays once
   per boundary and the others at every steady-state op (so they measure a little higher; 60 ms ops keep that
   under 0.03: at 30 ms per op, interleaving's twice as many hand-offs measured up to 0.032). p = 4 interleaved
   runs an 8-layer model (8 virtual stages), the rest the 4-layer one.
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
from course_lib.schedules import zero_bubble_fraction

MICROBATCHES = (1, 4, 8, 16)
OP_MS = 60
# schedule → (extra pipeline_worker arguments, formula(p, m), whether it runs at (p, m))
SCHEDULE_RUNS = {
    "gpipe": ({}, bubble_fraction, lambda p, m: True),
    "1f1b": ({}, bubble_fraction, lambda p, m: True),
    "interleaved": ({"num_chunks": 2, "forward_ms": 2 * OP_MS},   # a rank's forward: two chunks of 60 ms
                    lambda p, m: bubble_fraction(p, m, num_chunks=2), lambda p, m: m % p == 0),
    "zb-h1": ({"backward_ratio": 2},                                # backward: B and W of 60 ms each
              zero_bubble_fraction, lambda p, m: m >= p),
}


def bubbles(weights, weights8) -> list[dict]:
    rows = []
    for p in (2, 4):
        for schedule, (extra, formula, runs_at) in SCHEDULE_RUNS.items():
            ms = [m for m in MICROBATCHES if runs_at(p, m)]
            eight = p * extra.get("num_chunks", 1) > 4        # more virtual stages than the 4-layer model has
            runs = launch(pipeline_sweep, p, runs=[{"num_microbatches": m} for m in ms], schedule=schedule,
                          **{"forward_ms": OP_MS, **extra}, batch_size=16, seq_len=8, steps=2,
                          measure_memory=False, weights=weights8 if eight else weights, num_layers=8 if eight else 4)
            for i, m in enumerate(ms):
                timeline = Timeline.from_results([ranks[i] for ranks in runs])
                rows.append({"p": p, "m": m, "schedule": schedule, "formula": formula(p, m),
                             "measured": timeline.bubble, "overruns": timeline.overruns})
                row = rows[-1]
                print(f"{p:3} {m:4} {schedule:>11} {row['formula']:9.1%} {row['measured']:9.1%} "
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
    weights8 = build(preset("tiny", num_layers=8), seed=0).state_dict()
    print(f"bubbles, controlled cost ({OP_MS} ms per op, fastest of 2 steps)")
    print(f"{'p':>3} {'m':>4} {'sched':>11} {'formula':>9} {'measured':>9} {'gap':>8}")
    rows = bubbles(weights, weights8)

    seconds = launch(ours_vs_torch, 2, weights=weights, steps=15, num_microbatches=4)[0]
    ours, theirs = statistics.median(seconds["ours"]), statistics.median(seconds["torch"])
    print(f"\nstep time, 1F1B on 2 stages, real compute (median of {len(seconds['ours'])} steps): ours "
          f"{ours * 1e3:.1f} ms, torch.distributed.pipelining {theirs * 1e3:.1f} ms")
    print(f"ours / torch step time: {ours / theirs:.2f}")
    for schedule in SCHEDULE_RUNS:
        worst = max(abs(r["measured"] - r["formula"]) for r in rows if r["schedule"] == schedule)
        print(f"{schedule} max bubble gap: {worst:.3f}")
    print(f"max bubble gap: {max(abs(r['measured'] - r['formula']) for r in rows):.3f}")


if __name__ == "__main__":
    main()
