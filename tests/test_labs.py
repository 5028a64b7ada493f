"""The labs' command line: which backend and precision they choose, the refusal of more NCCL ranks than GPUs
(before any process starts), and a lab run end to end on gloo that says where it ran."""

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from course_lib.presentation.lab_results import LABS, describe

sys.path.insert(0, str(REPO / "labs"))   # the labs import their shared module as `common`, as a script does
import common  # noqa: E402


@pytest.fixture(autouse=True)
def outside_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def gpus(monkeypatch, count: int) -> None:
    """Pretend this machine has ``count`` GPUs (what choose_backend asks torch)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def load_lab(name: str):
    spec = importlib.util.spec_from_file_location(f"lab_{name}", REPO / "labs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exit_code_before_launch(monkeypatch, name: str, argv: list[str]) -> int:
    """Lab ``name``'s main(argv) with its ``launch`` made to fail the test: the code it exits with first."""
    lab = load_lab(name)

    def no_launch(*args, **kwargs):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(lab, "launch", no_launch)
    with pytest.raises(SystemExit) as stopped:
        lab.main(argv)
    return stopped.value.code


@pytest.mark.parametrize("count, world_size, backend", [(8, 8, "nccl"), (8, 2, "nccl"), (1, 1, "nccl"),
                                                        (4, 8, "gloo"), (0, 2, "gloo")])
def test_the_default_is_nccl_when_every_rank_has_a_gpu(monkeypatch, count, world_size, backend):
    gpus(monkeypatch, count)
    assert common.choose_backend(None, world_size) == backend
    assert common.choose_backend("gloo", world_size) == "gloo"   # asked for: gloo even beside GPUs


def test_under_torchrun_the_gpus_are_counted_against_this_nodes_ranks(monkeypatch):
    gpus(monkeypatch, 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")                  # 2 nodes × 8 ranks
    assert common.choose_backend(None, 16) == "nccl"
    assert common.choose_backend("nccl", 16) == "nccl"


@pytest.mark.parametrize("count, message", [
    (1, "NCCL needs one GPU per rank: 8 ranks, 1 GPU; use --world-size 1 or --backend gloo"),
    (4, "NCCL needs one GPU per rank: 8 ranks, 4 GPUs; use --world-size 4 or --backend gloo"),
    (0, "NCCL needs one GPU per rank: 8 ranks, 0 GPUs; use --backend gloo")])
def test_more_nccl_ranks_than_gpus_is_refused_with_the_way_out(monkeypatch, count, message):
    gpus(monkeypatch, count)
    with pytest.raises(ValueError) as error:
        common.choose_backend("nccl", 8)
    assert str(error.value) == message


def test_under_torchrun_the_way_out_is_fewer_processes_per_node(monkeypatch):
    gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError) as error:
        common.choose_backend("nccl", 16)
    assert str(error.value) == ("NCCL needs one GPU per rank: 8 ranks on this node, 1 GPU; "
                                "use --nproc-per-node 1 or --backend gloo")


@pytest.mark.parametrize("name", list(LABS))
def test_every_lab_stops_before_any_rank_starts(monkeypatch, capsys, name):
    gpus(monkeypatch, 1)
    assert exit_code_before_launch(monkeypatch, name, ["--world-size", "8", "--backend", "nccl"]) == 2   # usage error
    assert ("error: NCCL needs one GPU per rank: 8 ranks, 1 GPU; use --world-size 1 or --backend gloo"
            in capsys.readouterr().err)


BAD_ARGUMENTS = [   # (lab, arguments, the one line that refuses them)
    ("training_step", "--world-size 0", "argument --world-size: 0 is below 1: it must be at least 1"),
    ("training_step", "--world-size -2", "argument --world-size: -2 is below 1: it must be at least 1"),
    ("training_step", "--world-size 1000", "world_size=1000 is more than this machine can run"),
    ("training_step", "--hidden -5", "argument --hidden: -5 is below 16: it must be at least 16"),
    ("training_step", "--hidden 0", "argument --hidden: 0 is below 16: it must be at least 16"),
    ("training_step", "--hidden 7", "argument --hidden: 7 is below 16: it must be at least 16"),
    ("training_step", "--hidden 24", "argument --hidden: 24 is not a multiple of 16"),
    ("training_step", "--layers 0", "argument --layers: 0 is below 1: it must be at least 1"),
    ("training_step", "--seq-len 0", "argument --seq-len: 0 is below 1: it must be at least 1"),
    ("training_step", "--steps 0", "argument --steps: 0 is below 1: it must be at least 1"),
    ("training_step", "--lr nan", "argument --lr: nan is not a finite number"),
    ("training_step", "--lr -1", "argument --lr: -1 must be more than 0"),
    ("training_step", "--global-batch-size 15", "--global-batch-size 15 is not divisible by --world-size 2"),
    ("training_step", "--out /etc/passwd", "argument --out: /etc/passwd is a file, not a folder"),
    ("training_step", "--out /proc/no/such/folder", "argument --out: cannot write into /proc/no/such/folder"),
    ("ddp", "--steps 1", "argument --steps: 1 is below 2: it must be at least 2"),
    ("ddp", "--bucket-mb 0", "argument --bucket-mb: 0 must be at least 0.000976562"),
    ("zero", "--micro-batch-size 0", "argument --micro-batch-size: 0 is below 1: it must be at least 1"),
    ("tensor_parallel", "--global-batch-size 0", "argument --global-batch-size: 0 is below 1: it must be at least 1"),
    ("tensor_parallel", "--world-size 3", "(num_heads) cannot split over TP=3"),
    ("pipeline_parallel", "--op-ms -5", "argument --op-ms: -5 must be more than 0"),
    ("pipeline_parallel", "--num-microbatches 4 0", "argument --num-microbatches: 0 is below 1: it must be at least 1"),
    ("pipeline_parallel", "--world-size 4 --layers 2", "--layers 2 < --world-size 4 stages"),
    ("pipeline_parallel", "--global-batch-size 6 --num-microbatches 4", "a batch of 6 rows does not split into [4] micro-batches"),
    ("parallel_3d", "--tp 0", "argument --tp: 0 is below 1: it must be at least 1"),
    ("parallel_3d", "--num-microbatches 0", "argument --num-microbatches: 0 is below 1: it must be at least 1"),
    ("parallel_3d", "--tp 1 --pp 8 --layers 4", "pp 8 stages > 4 layers"),
    # values each rule let through, that then failed inside the ranks (or ran silent for minutes)
    ("ddp", "--hidden 65536", "this run needs at least"),
    ("ddp", "--layers 100000", "this run needs at least"),
    ("zero", "--micro-batch-size 1000000000", "this run needs at least"),
    ("ddp", "--bucket-mb 1e-300", "argument --bucket-mb: 1e-300 must be at least"),
    ("ddp", "--bucket-mb 1e300", "argument --bucket-mb: 1e+300 must be less than"),
    ("pipeline_parallel", "--op-ms 1e300", "argument --op-ms: 1e+300 must be less than"),
    ("checkpoint", "--global-batch-size 3 --world-size 2", "--global-batch-size 3 does not split over dp2 zero1"),
    ("profiling", "--world-size 3", "(num_heads) cannot split over TP=3"),
    ("profiling", "--global-batch-size 5", "--global-batch-size 5 is not divisible by --world-size 2"),
]


@pytest.mark.parametrize("name, argv, message", BAD_ARGUMENTS)
def test_a_bad_argument_stops_the_lab_with_one_line_before_any_rank_starts(monkeypatch, capsys, name, argv, message):
    gpus(monkeypatch, 0)
    code = exit_code_before_launch(monkeypatch, name, argv.split())
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err, err


def test_no_notebook_runs_a_lab_that_writes_into_labs_results():
    """Only a lab run by a person writes labs/results/ (the instructor's GPU results live there): a notebook that
    runs a lab gives it a temporary --out."""
    import nbformat

    runs = 0
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code" and re.search(r"labs/\w+\.py", cell.source) and "subprocess" in cell.source:
                runs += 1
                assert re.search(r'"--out",\s*\w', cell.source), f"{path.name}: a lab run without --out"
    assert runs >= 1   # notebook 00 runs labs/training_step.py under torchrun


@pytest.mark.parametrize("count, argv, backend, dtype", [
    (8, [], "nccl", "bf16"),                     # a GPU box: NCCL, matmuls in bf16 as GPU training runs them
    (8, ["--dtype", "fp32"], "nccl", "fp32"),
    (0, [], "gloo", "fp32"),                     # a laptop: gloo, float32
    (0, ["--dtype", "bf16"], "gloo", "bf16")])   # CPU autocast: the GPU path's precision, checked here
def test_the_precision_follows_the_backend_unless_asked(monkeypatch, count, argv, backend, dtype):
    gpus(monkeypatch, count)
    args = common.parse(common.lab_parser("a lab", world_size=8), argv)
    assert (args.backend, args.dtype) == (backend, dtype)


def test_the_machine_is_named_as_the_gpus_or_the_cpu(monkeypatch):
    assert common.machine("gloo", 2) == f"{common.cpu_model()} ({len(os.sched_getaffinity(0))} cores)"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    assert common.machine("nccl", 8) == "8 × NVIDIA H100 80GB HBM3"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert common.machine("nccl", 16) == "2 nodes × 8 × NVIDIA H100 80GB HBM3"


def run_lab(name: str, *argv: str, out) -> dict:
    """The lab as an instructor runs it, ``python labs/<name>.py ...``; its JSON."""
    command = [sys.executable, str(REPO / "labs" / f"{name}.py"), *argv, "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.ranks
def test_a_lab_on_gloo_says_where_it_ran(tmp_path):
    record = run_lab("training_step", "--world-size", "2", "--steps", "2", out=tmp_path)
    assert {k: record[k] for k in ("backend", "device", "dtype", "world_size")} == \
        {"backend": "gloo", "device": "cpu", "dtype": "fp32", "world_size": 2}
    assert record["machine"] == common.machine("gloo", 2) and record["nodes"] == [socket.gethostname()]
    assert record["max_memory_allocated"] == [None, None]                  # no GPU: nothing measured
    assert record["predicted_state_bytes"] == [16 * record["params"]] * 2  # fp32 Adam: 4 + 4 + 8 bytes
    assert record["replica_spread"] == 0.0
    assert describe("training_step", tmp_path).startswith(f"CPU smoke run (gloo, tiny sizes) on {record['machine']}")


@pytest.mark.ranks
def test_tensor_parallel_under_bf16_autocast_sends_what_the_formula_says(tmp_path):
    """The GPU default's precision, on CPU: forward all-reduces in bf16, backward in fp32 (the lab asserts the
    traced bytes against predicted_traffic; here, the two directions' sizes)."""
    record = run_lab("tensor_parallel", "--world-size", "2", "--steps", "2", "--dtype", "bf16", out=tmp_path)
    batch, seq, hidden = record["batch_size"], record["seq_len"], record["config"]["hidden"]
    assert record["dtype"] == "bf16"
    assert record["predicted"]["payload_bytes_each"] == batch * seq * hidden * 2
    assert record["predicted"]["backward_payload_bytes_each"] == batch * seq * hidden * 4
    assert record["payload_bytes_per_step"] == 8 * record["config"]["num_layers"] * batch * seq * hidden * 3 // 2
    assert "older version" not in describe("tensor_parallel", tmp_path)


def test_the_slurm_example_gives_each_task_its_cpus_and_a_port_of_its_own():
    script = (REPO / "labs" / "slurm_example.sbatch").read_text()
    assert "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK" in script   # srun does not inherit it since 22.05
    assert "SLURM_JOB_ID %" in script and ":29500" not in script        # a port per job, not a fixed one
    assert "NCCL_SOCKET_IFNAME" in script and "GLOO_SOCKET_IFNAME" in script
    if shutil.which("shellcheck"):                                      # apt-get install shellcheck
        checked = subprocess.run(["shellcheck", str(REPO / "labs" / "slurm_example.sbatch")], capture_output=True,
                                 text=True)
        assert checked.returncode == 0, checked.stdout


def test_the_checkpoint_lab_refuses_a_folder_it_did_not_make_and_deletes_only_its_own_steps(monkeypatch, tmp_path,
                                                                                           capsys):
    """--out/checkpoints with a file of someone else's: one line, exit 2, nothing touched. With --force (or once
    the lab's marker is there) only its step_NNNNN folders are removed at a run's start, nothing else."""
    gpus(monkeypatch, 0)
    theirs = tmp_path / "checkpoints"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    code = exit_code_before_launch(monkeypatch, "checkpoint", ["--out", str(tmp_path), "--world-size", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "is not empty and this lab did not make it" in err and "Traceback" not in err, err
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"] and (theirs / "notes.txt").read_text() == "mine"
    lab = load_lab("checkpoint")
    (theirs / "step_00003").mkdir()
    (theirs / "step_00003" / "shard").write_text("an old checkpoint")
    (theirs / "step_notes").mkdir()
    assert lab.claim_checkpoint_folder(theirs, force=True) is None
    lab.remove_old_steps(str(theirs))
    assert sorted(p.name for p in theirs.iterdir()) == [lab.MARKER, "notes.txt", "step_notes"]
    assert lab.claim_checkpoint_folder(theirs, force=False) is None      # the lab's now: no --force needed
    assert "--force" in lab.__doc__ and "What it deletes" in lab.__doc__


def test_a_lab_record_is_replaced_whole_or_not_at_all(monkeypatch, tmp_path):
    """write_record writes beside the record and renames over it: a write that fails (a full disk) leaves the old
    record whole and no temporary file behind."""
    args = common.lab_parser("a lab").parse_args(["--out", str(tmp_path)])
    first = common.write_record(args, "lab", {"value": 1})
    assert json.loads(first.read_text())["value"] == 1

    def full_disk(*_):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(common.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        common.write_record(args, "lab", {"value": 2})
    assert json.loads(first.read_text())["value"] == 1 and [p.name for p in tmp_path.iterdir()] == ["lab.json"]


def test_a_lab_gives_a_long_run_time_to_finish(monkeypatch):
    """A lab's ranks are stopped after --timeout seconds, by default 120 + 60 per step: --steps 100000 is not
    taken for a hang after launch's 120 s (a wait with no end is what a hang is)."""
    gpus(monkeypatch, 0)
    lab = load_lab("training_step")
    seen = {}

    def recording_launch(fn, world_size, **kwargs):
        seen["timeout"] = kwargs["timeout"]
        raise SystemExit(0)
    monkeypatch.setattr(lab, "launch", recording_launch)
    for argv, timeout in ((["--steps", "100000"], 120 + 60 * 100000), (["--timeout", "30"], 30)):
        with pytest.raises(SystemExit):
            lab.main(argv)
        assert seen["timeout"] == timeout


def test_a_refused_command_leaves_no_folder_behind(monkeypatch, capsys, tmp_path):
    """`--out a/b/c --world-size 0`: refused by the later argument, and a/b/c was never made."""
    gpus(monkeypatch, 0)
    out = tmp_path / "a" / "b" / "c"
    assert exit_code_before_launch(monkeypatch, "training_step", ["--out", str(out), "--world-size", "0"]) == 2
    assert "--world-size: 0 is below 1" in capsys.readouterr().err and not (tmp_path / "a").exists()
