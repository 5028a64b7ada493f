"""course_lib.calibration: the fits recover what made their data, and a measured machine is a GPU the step-time
model takes. (The measurements themselves, and the model against the live runs, are benchmarks/cost_model.py:
timing is a benchmark, not a test.)"""

import math
from dataclasses import replace

import pytest

from course_lib import calibration
from course_lib.cost import step_time
from course_lib.hardware import GPUS, matmul_rate
from course_lib.job import Job
from course_lib.mesh import Mesh
from course_lib.model import preset


def made_up_measurements(peak=80e9, half=20.0, alpha=300e-6, beta=1e9, launch_s=2e-6):
    """What calibration.measure returns, made from known constants (and the degenerate steps' seconds)."""
    def rate(m, n, k):
        return peak * m / (m + half) * n / (n + half) * k / (k + half)
    sizes = calibration.MATMUL_SIZES
    matmuls = []       # a weight's three GEMMs, in calibration._gemms' order, each at the forward shape's rate
    for m, k, n in ((m, k, n) for m in sizes for k in sizes for n in sizes):
        seconds = launch_s + 2 * m * n * k / rate(m, n, k)
        matmuls += [(m, n, k, seconds), (m, k, n, seconds), (n, k, m, seconds)]
    attention = []
    for h_d in calibration.ATTENTION_HEAD_DIMS:
        flops = 3.5 * 4 * 8 * 64 * 64 * h_d * 0.5
        rate = 0.5 * peak * 64 / (64 + half) * h_d / (h_d + 32)
        attention.append({"heads": 8, "seq_len": 64, "head_dim": h_d, "seconds": 3 * launch_s + flops / rate})
    return {"dtype_bytes": 4, "launch_s": launch_s, "matmuls": matmuls, "stream_bytes_per_s": 20e9,
            "adam_s_per_param": 4e-9,
            "attention": attention, "world_size": 2,
            "collectives": {op: [(wire, slow * alpha + wire / (beta / slow)) for wire in (4.0, 4e3, 4e5, 4e7)]
                            for op, slow in (("all_reduce", 1), ("all_gather", 1), ("reduce_scatter", 2), ("send", 1))},
            "steps": {1: {"forward_backward_s": 2e-3, "update_s": 0.5e-3},
                      2: {"forward_backward_s": 3e-3, "update_s": 0.8e-3}},
            "runner_steps": {1: 5e-3, 2: 7e-3}}


def test_the_fits_recover_the_constants_that_made_the_data():
    gpu = calibration.as_gpu(made_up_measurements())
    assert gpu.peak_flops == pytest.approx(80e9, rel=0.05) and 16 <= gpu.matmul_half_dim <= 24
    assert gpu.attention_share == pytest.approx(0.5, rel=0.1) and 27 <= gpu.attention_half_dim <= 38
    assert gpu.nvlink.alpha_s == pytest.approx(300e-6, rel=1e-6) and gpu.nvlink.bytes_per_s == pytest.approx(1e9)
    assert gpu.launch_adds and gpu.hbm_share == 1 and gpu.matmul_share == 1
    assert gpu.layer_update_overhead_s == pytest.approx(0.3e-3)          # Adam's loop over one more layer
    assert gpu.optimizer_bytes_per_param == pytest.approx(80)             # 4 ns a parameter at 20 GB/s
    from course_lib.kernel_times import optimizer_operation
    assert optimizer_operation(gpu, 10**6, 4).bytes == pytest.approx(80e6)   # its own Adam, not the fused 38 bytes
    assert optimizer_operation(GPUS["A100 80GB"], 10**6, 4).bytes == 38e6
    assert 0 < gpu.layer_overhead_s < 2e-3 and gpu.step_overhead_s > 0    # the runner's, less the kernels


def test_a_measured_machine_reads_its_gemm_rates_off_its_own_grid():
    gpu = calibration.as_gpu(made_up_measurements())
    assert len(gpu.matmul_grid) == len(calibration.MATMUL_SIZES) ** 3
    curve = 80e9 * (64 / 84) * (256 / 276) * (1024 / 1044)
    assert matmul_rate(gpu, 64, 256, 1024) == pytest.approx(curve, rel=1e-9)         # a grid point: as measured
    low, high = matmul_rate(gpu, 64, 64, 64), matmul_rate(gpu, 64, 256, 64)
    assert matmul_rate(gpu, 64, 128, 64) == pytest.approx((low + high) / 2, rel=1e-9)  # halfway in log2(n)
    assert matmul_rate(gpu, 8, 4096, 16) == matmul_rate(gpu, 16, 1024, 16)            # the edge beyond the grid
    assert not GPUS["A100 80GB"].matmul_grid                                         # the catalogue keeps its curve


def test_a_measured_machine_costs_a_job_and_its_overheads_count():
    gpu = calibration.as_gpu(made_up_measurements())
    job = Job(preset("tiny"), Mesh(dp=2), seq_len=64, micro_batch_size=4, zero_stage=0, dtype="fp32", gpu=gpu,
              gpus_per_node=2)
    time = step_time(job)
    framework = [op for op in time.operations if op.name == "framework, per layer"]
    assert framework and framework[0].seconds == pytest.approx(4 * gpu.layer_overhead_s)
    assert time.overhead_s == pytest.approx(gpu.step_overhead_s + 4 * gpu.layer_update_overhead_s)
    assert time.total_s == pytest.approx(sum(time.breakdown().values()))
    assert "1.0 GB/s" in calibration.describe(gpu) or "1.00 GB/s" in calibration.describe(gpu)


def test_a_cpu_adds_an_ops_launch_to_its_work_where_a_gpu_takes_the_longer():
    gpu = calibration.as_gpu(made_up_measurements())
    rate = matmul_rate(gpu, 64, 64, 64)
    from course_lib.kernel_times import matmul
    one = matmul("x", gpu, 64, 64, 64, 4, passes=1)
    assert one.seconds == pytest.approx(2 * 64**3 / rate + gpu.launch_s)
    a100 = GPUS["A100 80GB"]
    assert matmul("x", a100, 8, 8, 8, 2, passes=1).seconds == pytest.approx(a100.launch_s)    # launch-bound: max
    assert not math.isclose(a100.attention_half_dim, gpu.attention_half_dim)


def test_each_collective_is_costed_on_its_own_measured_link():
    gpu = calibration.as_gpu(made_up_measurements())       # the reduce-scatter made twice as slow as the others
    links = dict(gpu.collective_links)
    assert links["reduce_scatter"].alpha_s == pytest.approx(600e-6) and links["reduce_scatter"].bytes_per_s == (
        pytest.approx(0.5e9))
    assert links["all_gather"].alpha_s == pytest.approx(300e-6) and set(links) == set(calibration.COLLECTIVES)

    def dp_seconds(machine):
        job = Job(preset("tiny"), Mesh(dp=2), seq_len=64, micro_batch_size=4, zero_stage=2, dtype="fp32",
                  gpu=machine, gpus_per_node=2)
        return step_time(job).dp_comm_s
    # ZeRO-2 reduce-scatters the gradients and all-gathers the weights, equal bytes and calls: only the first doubles
    assert dp_seconds(gpu) == pytest.approx(1.5 * dp_seconds(replace(gpu, collective_links=())), rel=1e-9)


def test_no_round_of_calibration_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"rounds=0 must be a whole number >= 1"):
        calibration.calibrate(2, rounds=0)


@pytest.mark.parametrize("run, rule", [(dict(tp=3), r"world_size 2 != dp 1 × tp 3"),
                                       (dict(pp=2, num_layers=1), r"pp 2 stages > 1 layers")])
def test_a_live_run_that_cannot_run_is_refused_before_the_calibration_starts(monkeypatch, run, rule):
    monkeypatch.setattr(calibration, "calibrate", lambda *args, **kwargs: pytest.fail("the calibration started"))
    with pytest.raises(ValueError, match=rule):
        calibration.check_live_runs({"good": dict(dp=2), "bad": run})


def test_live_runs_of_one_step_are_refused_before_the_calibration_starts(monkeypatch):
    monkeypatch.setattr(calibration, "calibrate", lambda *args, **kwargs: pytest.fail("the calibration started"))
    with pytest.raises(ValueError, match=r"steps=1 must be a whole number >= 2"):   # its only step is the warm-up
        calibration.check_live_runs({"DDP": dict(dp=2)}, steps=1)


def test_a_live_run_is_priced_as_the_job_train_3d_runs(monkeypatch):
    """The run and its price take the same keywords and defaults (one micro-batch unless given): the Job priced
    is train_3d's own, on the calibrated machine, its pipeline's sends asynchronous as the course's executor's."""
    launched, priced = [], []

    def fake_launch(fn, world_size, **keywords):
        launched.append(keywords)
        return [{"step_seconds": [9.0, 0.5, 0.5], "collective_seconds": [8.0, 0.1, 0.3]},
                {"step_seconds": [9.0, 0.5, 0.6], "collective_seconds": [8.0, 0.3, 0.5]}]

    def fake_calibrate(world_size, rounds, between):
        between()
        return GPUS["A100 80GB"]
    monkeypatch.setattr(calibration, "launch", fake_launch)
    monkeypatch.setattr(calibration, "calibrate", fake_calibrate)
    assumed = []
    monkeypatch.setattr(calibration, "step_time", lambda job, **assumptions: priced.append(job)
                        or assumed.append(assumptions) or step_time(job, **assumptions))
    _, rows = calibration.check_live_runs({"ZeRO-3": dict(dp=2, zero_stage=3), "PP": dict(pp=2, num_microbatches=4),
                                           "TP": dict(tp=2)}, batch_size=8, seq_len=32)
    assert [run["num_microbatches"] for run in launched] == [1, 4, 1]
    assert [(job.mesh.dp, job.mesh.pp, job.mesh.tp, job.zero_stage) for job in priced] == [
        (2, 1, 1, 3), (1, 2, 1, None), (1, 1, 2, None)]
    assert [(job.micro_batch_size, job.num_microbatches, job.seq_len) for job in priced] == [
        (4, 1, 32), (2, 4, 32), (8, 1, 32)]
    assert all(job.dtype == "fp32" and job.gpu is GPUS["A100 80GB"] and job.gpus_per_node == 2 for job in priced)
    assert assumed == [{"pipeline_sends": "async"}] * 3       # the course's executor never waits for its sends
    assert [(row["measured_s"], row["measured_rounds_s"]) for row in rows] == [(0.55, (0.55,))] * 3   # slowest rank
    assert [row["measured_collectives_s"] for row in rows] == pytest.approx([0.3] * 3)     # the ranks' mean
    zero3, pp, tp = (step_time(job, pipeline_sends="async") for job in priced)
    assert [row["predicted_collectives_s"] for row in rows] == [zero3.dp_s, 0.0, tp.tp_s]   # not the pipeline's sends
    assert zero3.dp_s > 0 and pp.pp_s > 0 and tp.tp_s > 0
