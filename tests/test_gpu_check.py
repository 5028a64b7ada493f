"""labs/check_gpu.py (`make gpu-check`): on this CPU machine, its CPU smoke run end to end, every check green; a
wrong number in a lab's results turns its check red, and a lab that fails is reported; on a GPU box, labs that need
more GPUs than it has are skipped, and every lab accepts the flags it would get on 8 GPUs."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "labs"))

import check_gpu  # noqa: E402  (labs/ is not a package: its scripts import each other by name)

on_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU box this is the real run: make gpu-check")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One whole CPU smoke run (every lab, ~40 s here): its output folder and the finished process."""
    out = tmp_path_factory.mktemp("check_gpu")
    done = subprocess.run([sys.executable, str(REPO / "labs" / "check_gpu.py"), "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"})
    return out, done


@on_cpu_only
@pytest.mark.ranks
def test_the_cpu_smoke_run_passes_every_check_of_every_lab(smoke):
    out, done = smoke
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.startswith("No GPU found"), done.stdout[:300]
    report = json.loads((out / "check_gpu.json").read_text())
    assert report["run"] == "CPU smoke run" and report["machine"]["gpus"] == []
    assert [(lab["lab"], lab["ranks"], lab["status"]) for lab in report["labs"]] == [("kernel_rates", 1, "ran")] + [
        (name, 4 if name == "parallel_3d" else 2, "ran") for name in check_gpu.LABS]
    checks = [check_gpu.Check(**c) for c in report["checks"]]
    assert {c.verdict for c in checks} <= {"ok", "info", "n/a"}, check_gpu.checks_table(checks)
    # every lab checked something (the kernel rates: torch's CPU flash attention against float64)
    assert {c.lab for c in checks if c.verdict == "ok"} == {"kernel_rates", *check_gpu.LABS}
    by_name = {(c.lab, c.what): c for c in checks}
    replicas = by_name["training_step", "replicas identical after training, max |Δw|"]
    assert (replicas.predicted, replicas.measured) == ("0", "0.0e+00")
    all_reduces = by_name["tensor_parallel", "all-reduces per step (4 per layer), traced"]
    assert (all_reduces.predicted, all_reduces.measured) == ("16", "16")     # 4 layers × (2 forward + 2 backward)
    in_flight = by_name["pipeline_parallel", "1f1b: micro-batches in flight, stage 0, m = 1, 4"]
    assert (in_flight.predicted, in_flight.measured) == ("1 / 2", "1 / 2")  # 1F1B holds at most p = 2
    # a CPU has no CUDA allocator: each lab's memory row says so rather than showing a number
    memory = [c for c in checks if c.what == "peak CUDA memory per rank ≥ ledger's state"]
    assert [(c.lab, c.verdict) for c in memory] == [(name, "n/a") for name in check_gpu.LABS]
    assert {c.measured for c in memory} <= {"not measured on a CPU (no CUDA allocator)", "not measured by this lab"}
    assert [row["op"] for row in report["bandwidth"]] == [op for op in check_gpu.OPS for _ in check_gpu.CPU_SIZES]
    assert all(row["busbw"] > 0 for row in report["bandwidth"])


@on_cpu_only
@pytest.mark.ranks
def test_the_table_summary_and_files_say_cpu_smoke_run(smoke):
    out, done = smoke
    machine = json.loads((out / "check_gpu.json").read_text())["machine"]["name"]
    assert f"\nCPU smoke run on {machine}\nlab " in done.stdout
    header = next(line for line in done.stdout.splitlines() if line.startswith("lab  "))
    assert header.split() == ["lab", "what", "was", "checked", "predicted", "measured", "verdict"]
    summary = (out / "summary.md").read_text()
    assert summary.startswith(f"# CPU smoke run: {machine}\n") and "no GPU" in machine
    assert "**CPU smoke run**: no GPU on this machine" in summary
    assert "| parallel_3d | 4 |" in summary and "| zero | ours, stages 0/1/2/3: state per rank" in summary
    assert "Verdicts: " in summary and "FAIL" not in summary
    assert "| training_step | replicas identical after training, max \\|Δw\\| | 0 | 0.0e+00 | ok |" in summary
    assert ("- peak CUDA memory per rank ≥ ledger's state: training_step, ddp, zero, tensor_parallel, "
            "pipeline_parallel, parallel_3d: not measured on a CPU (no CUDA allocator)\n") in summary
    assert "## Kernel rates beside the step-time model's constants" in summary and "matmul 256×256×256" in summary
    for name in ["kernel_rates", *check_gpu.LABS]:
        assert (out / f"{name}.json").exists() and (out / f"{name}.png").exists()
        started = "torchrun --standalone --nproc-per-node " if check_gpu.LABS.get(name, check_gpu.Lab(
            1, "", None, "", torchrun=False)).torchrun else "python labs/"
        assert (out / "logs" / f"{name}.log").read_text().startswith(started)   # profiling starts its own ranks
    assert (out / "bandwidth.png").stat().st_size > 10_000


def _checks_of(name: str, record: dict, folder: Path) -> dict:
    (folder / f"{name}.json").write_text(json.dumps(record))
    return {c.what: c.verdict for c in check_gpu.lab_checks(name, folder)}


@on_cpu_only
@pytest.mark.ranks
def test_a_wrong_number_in_a_labs_results_fails_its_check(smoke, tmp_path):
    out = smoke[0]

    def record(name):
        return json.loads((out / f"{name}.json").read_text())

    ddp = record("ddp")
    next(row for row in ddp["rows"] if row["kind"] == "bucketed")["wire_bytes"] += 4
    verdicts = _checks_of("ddp", ddp, tmp_path)
    assert verdicts["bucketed: bytes each rank sends per step, traced"] == "FAIL"
    assert verdicts["naive: bytes each rank sends per step, traced"] == "ok"

    ddp = record("ddp")
    weights = "weights vs torch's DDP (naive, bucketed; {}), max |Δw|"
    next(row for row in ddp["rows"] if row["kind"] == "naive")["max_diff_vs_torch"] = 5e-4
    assert _checks_of("ddp", ddp, tmp_path)[weights.format("fp32")] == "FAIL"
    ddp["dtype"] = "bf16"                                   # bf16 autocast: a wider band
    assert _checks_of("ddp", ddp, tmp_path)[weights.format("bf16")] == "ok"

    training = record("training_step")
    training["replica_spread"] = 1e-7
    training["losses"][-1] += 0.01
    verdicts = _checks_of("training_step", training, tmp_path)
    assert verdicts["replicas identical after training, max |Δw|"] == "FAIL"
    assert verdicts["loss vs 1 process on the whole batch, every step"] == "FAIL"

    pipeline = record("pipeline_parallel")
    pipeline["rows"][-1]["peak_in_flight"][0] = 4          # 1F1B holding all 4 micro-batches, as GPipe does
    assert _checks_of("pipeline_parallel", pipeline, tmp_path)["1f1b: micro-batches in flight, stage 0, m = 1, 4"] \
        == "FAIL"

    zero = record("zero")
    zero["runs"]["ours 2"]["state_per_rank"][1]["grads"] += 2
    assert _checks_of("zero", zero, tmp_path)["ours, stages 0/1/2/3: state per rank (storage) vs ledger"] == "FAIL"

    assert _checks_of("parallel_3d", {"mesh": {}}, tmp_path) == {"results readable": "FAIL"}   # a changed format


@on_cpu_only
@pytest.mark.ranks
def test_on_gpus_the_peak_memory_of_every_rank_must_hold_the_ledgers_state(smoke, tmp_path):
    """What a GPU run records, put into a CPU run's results: peaks at or above the state pass, one below fails."""
    tensor_parallel = json.loads((smoke[0] / "tensor_parallel.json").read_text())
    states = tensor_parallel["predicted_state_bytes"]
    what = "peak CUDA memory per rank ≥ ledger's state"
    tensor_parallel["max_memory_allocated"] = [3 * state for state in states]
    assert _checks_of("tensor_parallel", tensor_parallel, tmp_path)[what] == "ok"
    tensor_parallel["max_memory_allocated"][-1] = states[-1] // 2      # the ledger over-counts on the last rank
    assert _checks_of("tensor_parallel", tensor_parallel, tmp_path)[what] == "FAIL"

    zero = json.loads((smoke[0] / "zero.json").read_text())
    for stage in range(4):
        run = zero["runs"][f"ours {stage}"]
        run["max_memory_allocated"] = [2 * run["predicted_state"]["total"]] * len(run["state_per_rank"])
    stages = "ours, stages 0/1/2/3: peak CUDA memory per rank ≥ state"
    assert _checks_of("zero", zero, tmp_path)[stages] == "ok"
    zero["runs"]["ours 0"]["max_memory_allocated"][0] = zero["runs"]["ours 3"]["predicted_state"]["total"]
    assert _checks_of("zero", zero, tmp_path)[stages] == "FAIL"


@pytest.mark.ranks
def test_a_lab_that_fails_is_reported_with_its_log(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    command, code, _ = check_gpu.run_lab("training_step", 1, "gloo", ["--no-such-flag"], tmp_path)
    assert command[:4] == ["torchrun", "--standalone", "--nproc-per-node", "1"] and code not in (0, None)
    log = (tmp_path / "logs" / "training_step.log").read_text()
    assert log.startswith(" ".join(command)) and "unrecognized arguments: --no-such-flag" in log
    assert not (tmp_path / "training_step.json").exists()


def test_labs_that_need_more_gpus_than_the_box_has_are_skipped_with_the_reason():
    assert [name for name in check_gpu.LABS if check_gpu.skip_reason(name, 1) is None] == [
        "training_step", "ddp", "zero", "checkpoint"]       # one GPU: the NCCL world of 1
    assert check_gpu.skip_reason("tensor_parallel", 1) == \
        "needs 2 GPUs (TP splits every layer over 2 or more ranks), found 1"
    assert check_gpu.skip_reason("parallel_3d", 2) == "needs 4 GPUs (tp 2 × pp 2 (× dp)), found 2"
    assert all(check_gpu.skip_reason(name, 8) is None for name in check_gpu.LABS)
    # six GPUs: TP uses 4 (it must divide the 16 key/value heads), 3D uses 4 (tp 2 × pp 2), the others all 6
    assert {name: check_gpu.ranks_for(name, 6) for name in check_gpu.LABS} == {
        "training_step": 6, "ddp": 6, "zero": 6, "tensor_parallel": 4, "pipeline_parallel": 6, "parallel_3d": 4,
        "checkpoint": 4,                                  # its layouts: 8, 4, 2 or 1 ranks
        "profiling": 4}                                   # its TP, as tensor_parallel's
    assert check_gpu.ranks_for("parallel_3d", 0) == 4 and check_gpu.ranks_for("zero", 0) == 2   # the CPU smoke run


class Launched(Exception):
    """Raised instead of starting ranks: the lab got that far."""


@pytest.mark.parametrize("gpus", [1, 8])
@pytest.mark.parametrize("name", list(check_gpu.LABS))
def test_every_labs_gpu_flags_pass_its_own_checks_on_1_and_8_gpus(name, gpus, monkeypatch):
    """No GPU here, so no rank starts: each lab parses the flags check_gpu gives it on a box of 1 or 8 GPUs and
    runs its checks up to launch (a 3-D grid that does not divide the model or the batch stops before that; on one
    H200 the checkpoint lab once refused its default --kill-rank 1 though --no-kill kills nobody)."""
    if check_gpu.skip_reason(name, gpus):
        pytest.skip(check_gpu.skip_reason(name, gpus))
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    spec = importlib.util.spec_from_file_location(f"lab_{name}", REPO / "labs" / f"{name}.py")
    lab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab)

    def launch(fn, world_size, **kwargs):
        raise Launched(world_size)

    monkeypatch.setattr(lab, "launch", launch)
    ranks = check_gpu.ranks_for(name, gpus)
    with pytest.raises(Launched) as launched:
        lab.main(["--world-size", str(ranks), "--backend", "gloo", *check_gpu.LABS[name].gpu_flags(ranks).split()])
    assert launched.value.args == (ranks,)



def test_kernel_rates_take_the_catalogue_gpu_of_the_device_name():
    import kernel_rates

    catalogue = {name: kernel_rates.catalogue_gpu(name) for name in (
        "NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA H100 PCIe",
        "NVIDIA H100 NVL", "NVIDIA GH200 480GB", "Tesla V100")}
    assert {name: gpu and gpu.name for name, gpu in catalogue.items()} == {
        "NVIDIA H200": "H200 SXM 141GB", "NVIDIA H100 80GB HBM3": "H100 SXM 80GB",
        "NVIDIA A100-SXM4-40GB": "A100 40GB (SXM)", "NVIDIA A100-SXM4-80GB": "A100 80GB (SXM)",
        "NVIDIA H100 PCIe": None, "NVIDIA H100 NVL": None, "NVIDIA GH200 480GB": None,   # other clocks, bandwidths
        "Tesla V100": None}
    assert check_gpu.gpu_folder(8, "NVIDIA H100 80GB HBM3") == "gpu-8x-nvidia-h100-80gb-hbm3"
    assert check_gpu.gpu_folder(1, "NVIDIA H200") == H200_RESULTS.name     # where the committed results lie


def test_the_lab_measures_fp32_matmuls_against_the_fp32_peak():
    """On a GPU the lab also times fp32 GEMMs (TF32 off) beside matmul_rate on GPU.for_dtype("fp32"); here on the
    CPU, the rows it writes for them."""
    import kernel_rates

    from course_lib.hardware import GPUS, matmul_rate
    fp32 = GPUS["A100 80GB"].for_dtype("fp32")
    rows = kernel_rates.measure_matmuls([(64, 32, 16)], torch.device("cpu"), torch.float32, fp32, 1, kind="matmul fp32")
    assert [(row["kind"], row["name"], row["shape"]) for row in rows] == [("matmul fp32", "matmul fp32 64×32×16",
                                                                          [64, 32, 16])]
    assert rows[0]["measured"] > 0 and rows[0]["model"] == matmul_rate(fp32, 64, 32, 16) / 1e12
    assert rows[0]["model"] == pytest.approx(matmul_rate(GPUS["A100 80GB"], 64, 32, 16) / 1e12 * 19.5 / 312)


def test_the_labs_standard_attention_is_attention():
    """kernel_rates.standard_attention_pass (plain PyTorch, as FlashAttention's benchmarks write it) gives SDPA's
    output and gradients in float64, causal or not: the lab times what it says it times."""
    import kernel_rates
    q, k, v, grad_out = kernel_rates.attention_inputs(2, 3, 16, 8, torch.device("cpu"), torch.float64)
    for causal in (True, False):
        ours = kernel_rates.standard_attention_pass(q, k, v, grad_out, causal)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        sdpa = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
        sdpa.backward(grad_out)
        for got, want in zip(ours, [sdpa] + [t.grad for t in leaves]):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@on_cpu_only
@pytest.mark.ranks
def test_a_wrong_attention_kernel_fails_and_rates_beside_a_model_show_their_ratios(smoke, tmp_path):
    record = json.loads((smoke[0] / "kernel_rates.json").read_text())
    kinds = [row["kind"] for row in record["rows"]]
    assert {"matmul", "attention flash", "attention standard", "memory-bound", "launch"} <= set(kinds)
    assert all(row["measured"] > 0 and row["model"] is None for row in record["rows"])    # a CPU: no constants
    flash = "attention flash (out, dq, dk, dv) vs math in float64, max |Δ| / max |value|"
    assert _checks_of("kernel_rates", record, tmp_path)[flash] == "ok"
    record["attention_checks"][0]["max_relative_diff"] = 0.5              # a kernel that computes something else
    assert _checks_of("kernel_rates", record, tmp_path)[flash] == "FAIL"
    for row, model in zip((r for r in record["rows"] if r["kind"] == "matmul"), (1.0, 2.0, 4.0, 8.0)):
        row["measured"], row["model"] = 1.0, model                            # ratios 1, 1/2, 1/4, 1/8
    (tmp_path / "kernel_rates.json").write_text(json.dumps(record))
    rows = {c.what: c for c in check_gpu.lab_checks("kernel_rates", tmp_path)}
    ratios = rows["matmul: measured / model over 4 kernels, median (range)"]
    assert (ratios.measured, ratios.verdict) == ("0.38 (0.12–1.00)", "info")


H200_RESULTS = REPO / "labs" / "results" / "gpu-1x-nvidia-h200"


def test_the_h200s_gemms_put_on_the_curve():
    """kernel_rates.matmul_fit on the committed H200 run (its record predates the fit): the curve fitted on its
    GEMMs of step shapes (thousands of tokens by weights at least 512 wide) has a higher share and a larger
    half-dimension than the model's, stays under the best rate a search over shapes found (MAMF), and sits closer
    to the measurements than the model's own curve; lab_checks shows it beside the model's."""
    import kernel_rates
    import lab_checks

    record = json.loads((H200_RESULTS / "kernel_rates.json").read_text())
    gpu = kernel_rates.catalogue_gpu(record["device_name"])
    fit = kernel_rates.matmul_fit(record["rows"], gpu)
    assert fit["shapes"] == 10 and gpu.matmul_share < fit["share"] < gpu.best_matmul_share    # 0.78 when written
    assert 2 * gpu.matmul_half_dim < fit["half_dim"] < 3 * gpu.matmul_half_dim                # 304
    assert fit["rms_log_error"] < 0.6 * fit["model_rms_log_error"]                            # 0.075 against 0.136
    assert kernel_rates.matmul_fit(record["rows"], None) is None                             # no model to compare
    fitted = lab_checks.check_kernel_rates({**record, "matmul_fit": fit})[-1]
    assert fitted == ("matmul curve fitted on 10 step shapes: share of the peak, half-dimension",
                      "0.67, 128 (rms 0.14)", "0.78, 304 (rms 0.07)", "info")


def test_the_committed_h200_results_name_their_machine_and_pass_todays_checks():
    report = json.loads((H200_RESULTS / "check_gpu.json").read_text())
    assert report["run"] == "GPU check" and report["machine"]["name"] == "1 × NVIDIA H200 (140 GiB)"
    ran = [lab["lab"] for lab in report["labs"] if lab["status"] == "ran"]
    assert ran == ["kernel_rates", "training_step", "ddp", "zero", "checkpoint"]     # the others need 2 or 4 GPUs
    for name in ran:                              # the checks as they are now, on what the GPU wrote then
        checks = check_gpu.lab_checks(name, H200_RESULTS)
        assert {c.verdict for c in checks} <= {"ok", "info", "n/a"}, check_gpu.checks_table(checks)
    assert (H200_RESULTS / "summary.md").read_text().startswith("# GPU check: 1 × NVIDIA H200 (140 GiB)\n")
