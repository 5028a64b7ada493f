"""Benchmark: the step-time model against this machine's own live runs.

    python benchmarks/cost_model.py

course_lib.calibration measures this machine's rates on kernels and a degenerate model (matmul by shape, memory
bandwidth, torch's Adam, an op's launch, the framework's work per layer and per step, each gloo collective's α and
β), every rank at once, in about a minute;
cost.step_time, the model that costs the GPU clusters of notebooks 06 and 09, then predicts the step of the
course's live runs (course_lib.runs.mesh.train_3d: parallelize on a mesh, fp32, gloo) that it never saw: DDP,
ZeRO-3, TP and 1F1B PP on 2 ranks, for the tiny model and one 10× wider. The live runs' communication is not
overlapped (the course's wrappers wait for each collective), so the model runs with no overlap.

Each run: the median of its steps after the first (warm-up), in each of three passes over all runs, each pass after
a round of the calibration (so that a slow spell of this shared machine meets both), and the median of the three.
Prints predicted, measured and their ratio per run, then the largest miss (goal: within 20% on an idle machine; a
busy one slows the measured runs, not the model). About two minutes.
"""

import statistics
import time

import torch

from course_lib import launch
from course_lib.calibration import calibrate, describe
from course_lib.cost import step_time
from course_lib.job import Job
from course_lib.mesh import Mesh
from course_lib.model import preset
from course_lib.runs.mesh import train_3d

WORLD_SIZE, BATCH_SIZE, SEQ_LEN = 2, 8, 64
MODELS = {"tiny": {}, "10× wider": dict(hidden=640, intermediate=1280)}
LAYOUTS = {   # name: train_3d's layout keywords (and the Job's)
    "DDP (ZeRO-0), dp 2": dict(dp=2, zero_stage=0, num_microbatches=1),
    "ZeRO-3, dp 2": dict(dp=2, zero_stage=3, num_microbatches=1),
    "TP 2": dict(tp=2, num_microbatches=1),
    "1F1B PP 2, m = 4": dict(pp=2, num_microbatches=4),
}
STEPS = {"tiny": 8, "10× wider": 5}   # a pass's steps of each run; three passes, between calibration rounds
PASSES = 3
RUNS = [(model, overrides, name, layout) for model, overrides in MODELS.items() for name, layout in LAYOUTS.items()]


def predicted(overrides: dict, layout: dict, gpu) -> float:
    mesh = Mesh(dp=layout.get("dp", 1), tp=layout.get("tp", 1), pp=layout.get("pp", 1))
    m = layout["num_microbatches"]
    job = Job(preset("tiny", **overrides), mesh, seq_len=SEQ_LEN, micro_batch_size=BATCH_SIZE // (mesh.dp * m),
              num_microbatches=m, zero_stage=layout.get("zero_stage"), dtype="fp32", gpu=gpu,
              gpus_per_node=WORLD_SIZE)
    return step_time(job).total_s


def measured(overrides: dict, layout: dict, steps: int) -> float:
    results = launch(train_3d, WORLD_SIZE, steps=steps, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, dtype=torch.float32,
                     return_params=False, timeout=600, **layout, **overrides)
    return max(statistics.median(result["step_seconds"][1:]) for result in results)   # the slowest rank's


def main():
    start = time.perf_counter()
    passes = {index: [] for index in range(len(RUNS))}

    def one_pass():                     # every run once, between two calibration rounds
        for index, (model, overrides, _, layout) in enumerate(RUNS):
            passes[index].append(measured(overrides, layout, STEPS[model]))
    gpu = calibrate(WORLD_SIZE, rounds=PASSES, between=one_pass)
    print(f"this machine, measured ({WORLD_SIZE} ranks at once): {describe(gpu)}\n")
    print(f"{'run':34}{'predicted':>12}{'measured':>12}{'ratio':>8}")
    ratios = []
    for index, (model, overrides, name, layout) in enumerate(RUNS):
        guess, real = predicted(overrides, layout, gpu), statistics.median(passes[index])
        ratios.append(guess / real)
        print(f"{model + ', ' + name:34}{guess * 1e3:10.1f} ms{real * 1e3:10.1f} ms{guess / real:8.2f}")
    worst = max(ratios, key=lambda ratio: abs(ratio - 1))
    print(f"\nlargest miss: predicted / measured = {worst:.2f} ({abs(worst - 1):.0%}; goal within 20%), "
          f"in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
