"""Notebook 05's exercise: the 1F1B schedule's actions."""

import torch

from ...model import build, preset
from ...pipeline_parallel import bubble_fraction, pipeline_makespan, simulate
from ...runs.pipeline import pipeline_worker, single_process_step
from . import common
from .common import NOT_DONE, exercise, run_on_ranks


@exercise
def check_one_f_one_b(actions) -> bool:
    """05: ``actions(stage, num_stages, num_microbatches)`` must return that stage's 1F1B order, a list of
    ("F", k) and ("B", k). Checked by simulation for several (p, m): valid and deadlock-free, as fast as the
    formula (m + p - 1)·(t_f + t_b), and at most min(p - s, m) micro-batches in flight on stage s; then run
    for real on 3 ranks, with loss and gradients against one process."""

    for p, m in [(2, 1), (2, 4), (3, 5), (4, 2), (4, 8)]:
        try:
            timeline = simulate(actions, p, m, 1.0, 1.0)
        except NotImplementedError:
            print(NOT_DONE)
            return False
        except ValueError as err:
            print(f"✗ p={p}, m={m}: {err}")
            if "deadlock" in str(err):
                print("  hint: a stage waits for a backward that needs a forward it has not sent yet: stage s "
                      "should run p - s - 1 forwards before its first backward")
            return False
        peaks = [timeline.peak_in_flight(s) for s in range(p)]
        limit = [min(p - s, m) for s in range(p)]
        if timeline.makespan > pipeline_makespan(p, m, 1, 1) + 1e-9:
            print(f"✗ p={p}, m={m}: the step takes {timeline.makespan:g} op-times, the formula {m + p - 1}·2 = "
                  f"{2 * (m + p - 1)}: some stage waits more than it has to (too few warm-up forwards?)")
            return False
        if peaks != limit:
            print(f"✗ p={p}, m={m}: stages hold {peaks} micro-batches at their peak; 1F1B holds {limit}")
            if peaks == [m] * p:
                print("  hint: that is GPipe (all forwards, then all backwards): start backwards after p - s - 1 "
                      "warm-up forwards, then alternate one forward, one backward")
            return False
    weights = build(preset("tiny"), seed=0).state_dict()
    # float64: micro-batches round differently from one batch only at ~1e-16, on any CPU; a lost micro-batch
    # or a missing 1/m moves gradients by > 1e-4
    results = run_on_ranks(pipeline_worker, 3, "schedule", num_microbatches=6, schedule=actions, batch_size=12,
                            weights=weights, return_grads=True, timeout=2 * common.TIMEOUT_SECONDS, dtype=torch.float64)
    if results is None:
        return False
    loss, grads = single_process_step(batch_size=12, dtype=torch.float64)
    worst = max((r["grads"][n] - grads[n]).abs().max().item() for r in results for n in r["grads"])
    if abs(results[-1]["loss"] - loss) > 1e-12 or worst > 1e-12:
        print(f"✗ on 3 real ranks the loss is {results[-1]['loss']:.6f} (one process: {loss:.6f}), gradients off "
              f"by up to {worst:.1e}")
        return False
    print(f"✓ correct: as fast as GPipe (bubble {bubble_fraction(4, 8):.1%} at p=4, m=8) with at most p - s "
          f"micro-batches in flight; on 3 real ranks loss {results[-1]['loss']:.4f} = one process's, gradients "
          f"within {worst:.0e}")
    return True
