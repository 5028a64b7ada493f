"""Failures at scale (course_lib.failures): Young/Daly's checkpoint interval, the Llama 3 failure rate, stragglers,
and a hung collective ended by the process group's timeout with the missing rank named."""

import math

import pytest

from course_lib import failures
from course_lib.runs.failures import hung_collective
from course_lib.runtime.launch import RankError, launch


def test_a_job_fails_as_often_as_all_its_gpus_together():
    whole = failures.mtbf_seconds(failures.LLAMA3["gpus"])
    assert whole == pytest.approx(54 * 86_400 / 419)                       # the paper's own rate
    assert failures.mtbf_seconds(1024) == pytest.approx(16 * whole)       # 16× fewer GPUs, 16× longer between


@pytest.mark.parametrize("checkpoint_s, mtbf_s", [(10.0, 2e5), (60.0, 1e4), (1.0, 3600.0)])
def test_young_interval_minimises_the_waste_where_its_two_terms_are_equal(checkpoint_s, mtbf_s):
    best = failures.young_interval(checkpoint_s, mtbf_s)
    parts = failures.waste_fraction(best, checkpoint_s, mtbf_s)
    assert parts["checkpoint"] == pytest.approx(parts["lost_work"])
    for other in (0.5 * best, 0.9 * best, 1.1 * best, 2 * best):
        assert failures.waste_fraction(other, checkpoint_s, mtbf_s)["total"] > parts["total"]


def test_daly_agrees_with_young_when_a_checkpoint_is_short_beside_the_mtbf():
    young, daly = failures.young_interval(10.0, 2e5), failures.daly_interval(10.0, 2e5)
    assert abs(daly - young) / young < 0.01
    assert failures.daly_interval(10.0, 4.0) == 4.0                        # δ ≥ 2M: checkpoint once per MTBF


def test_checkpointing_every_step_costs_the_checkpoint_over_the_step():
    assert failures.waste_fraction(10.0, 8.0, 1e5)["checkpoint"] == pytest.approx(0.8)


@pytest.mark.parametrize("call, message", [
    (lambda: failures.young_interval(0, 10), "checkpoint_s=0 must be a finite number > 0"),
    (lambda: failures.mtbf_seconds(0), "num_gpus=0"),
    (lambda: failures.mtbf_seconds(True), "num_gpus=True must be a whole number"),
    (lambda: failures.waste_fraction(-1, 1, 1), "interval_s=-1 must be a finite number > 0"),
    (lambda: failures.waste_fraction(math.nan, 60, 3600), "interval_s=nan must be a finite number"),
    (lambda: failures.straggler_report([1.0], [0.5, 0.5]), "one step time and one collective time per rank"),
    (lambda: failures.straggler_report([1.0, 1.0], [2.0, 0.1]), r"comm_seconds\[0\]=2.0 must be .* < 1"),
])
def test_bad_numbers_are_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_straggler_is_the_rank_that_computes_longest_not_the_one_with_the_longest_step():
    # everyone's step is ~1.3 s (they all wait for rank 2); rank 2 waits least, inside its collectives
    report = failures.straggler_report([1.30, 1.31, 1.30, 1.32], [1.0, 1.0, 0.05, 1.02])
    assert report["straggler"] == 2
    assert report["slowdown"] == pytest.approx(1.25 / 0.31)
    assert math.isclose(sum(report["compute"]), 0.3 + 0.31 + 1.25 + 0.30)


@pytest.mark.ranks
def test_a_hung_collective_ends_with_the_groups_timeout_and_the_missing_rank_named():
    results = launch(hung_collective, 4, missing_rank=2, timeout_s=1.0)
    waiting = [r for r in results if r["rank"] != 2]
    assert all(r["error"] for r in waiting)
    assert max(r["waited_s"] for r in waiting) >= 1.0     # the first to time out waited it all; its peers then fail
    assert results[0]["barrier"] == "[Rank 0]: Ranks 2 failed to pass monitoredBarrier in 1000 ms"


@pytest.mark.ranks
@pytest.mark.parametrize("bad, message", [
    (dict(missing_rank=2), r"missing_rank=2 is not a rank of this world: its ranks are 0..1"),
    (dict(missing_rank=-1), r"missing_rank=-1 must be a whole number >= 0"),
    (dict(missing_rank=1, timeout_s=0), r"timeout_s=0 must be a finite number > 0"),
    (dict(missing_rank=1, timeout_s=math.nan), r"timeout_s=nan must be a finite number > 0")])
def test_a_hung_collective_refuses_a_rank_or_timeout_it_cannot_show(bad, message):
    with pytest.raises(RankError, match=message):
        launch(hung_collective, 2, **bad)


@pytest.mark.ranks
def test_a_rank_killed_under_torchrun_restarts_from_the_checkpoint_and_ends_as_if_never_stopped(tmp_path):
    """labs/checkpoint.py under torchrun --max-restarts 1: rank 1 SIGKILLs itself in step 3 of the first attempt;
    torchrun starts every rank again, they resume from step 2's checkpoint, finish, and reshard into pp 4."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    lab = Path(__file__).resolve().parent.parent / "labs" / "checkpoint.py"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          "--max-restarts", "1", str(lab), "--world-size", "4", "--steps", "6", "--every", "2",
                          "--kill-at", "3", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "checkpoint.json").read_text())
    assert (record["restarts"], record["resumed_from"], record["lost_steps"]) == (1, "step_00002", 1)
    assert record["max_gap_vs_one_process"] < 1e-12 and record["resharded_max_gap_vs_one_process"] < 1e-12

