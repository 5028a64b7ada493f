"""Lab results in the notebooks are labelled by where they ran: no cell may call a CPU run a GPU result."""

import json
import re

import pytest

from conftest import REPO
from course_lib.presentation.lab_results import LABS, RESULTS, describe

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def write(folder, name, **record):
    (folder / f"{name}.json").write_text(json.dumps(record))


TRAINING_STEP = {"world_size": 2, "params": 164_416, "losses": [4.8759, 4.3939], "replica_spread": 0.0}


def test_no_results_says_how_to_make_them(tmp_path):
    text = describe("ddp", tmp_path)
    assert text.startswith("no lab results yet: run `python labs/ddp.py --world-size 2`")
    assert "`make gpu-check` on a GPU box" in text
    assert "GPU results" not in text


def test_a_cpu_run_is_labelled_a_smoke_run_with_what_a_gpu_box_would_show(tmp_path):
    write(tmp_path, "training_step", **TRAINING_STEP, backend="gloo", device="cpu", machine="AMD EPYC 7B13 (2 cores)",
          dtype="fp32", max_memory_allocated=[None, None], predicted_state_bytes=[2_630_656] * 2)
    first, *rest = describe("training_step", tmp_path).splitlines()
    assert first == ("CPU smoke run (gloo, tiny sizes) on AMD EPYC 7B13 (2 cores): a GPU box would show "
                     f"{LABS['training_step'].on_gpus}; get it with `make gpu-check`.")
    assert rest == ["  2 ranks, 164,416 parameters: loss 4.8759 → 4.3939, replica spread 0.0e+00"]


def test_a_gpu_run_is_labelled_with_its_machine_and_its_memory(tmp_path):
    write(tmp_path, "training_step", **TRAINING_STEP, backend="nccl", device="cuda", machine="8 × NVIDIA H100 80GB HBM3",
          dtype="bf16", date="2027-01-05", max_memory_allocated=[3 * 2**30, 2**30],
          predicted_state_bytes=[2**30, 2**30])
    text = describe("training_step", tmp_path)
    assert text.splitlines()[0] == "GPU results from 8 × NVIDIA H100 80GB HBM3 (nccl, bf16, 2 ranks, 2027-01-05):"
    assert "smoke" not in text
    assert text.splitlines()[-1] == ("  peak GPU memory per rank (max_memory_allocated): 3.00 GiB at most; "
                                     "the ledger's training state: 1.00 GiB at most")


def test_a_file_that_does_not_say_cuda_is_never_a_gpu_result(tmp_path):
    """An older lab wrote no device (or, for ddp, the device's name there): it is shown as a CPU run."""
    write(tmp_path, "ddp", world_size=2, backend="nccl", device="NVIDIA A100-SXM4-80GB")
    text = describe("ddp", tmp_path)
    assert text.startswith("CPU smoke run") and "GPU results" not in text
    assert text.splitlines()[-1] == "  (this file is from an older version of the lab: run it again for its numbers)"


def test_results_are_read_from_the_repositorys_labs_results():
    assert RESULTS == REPO / "labs" / "results"     # it once pointed inside course_lib/: nothing was ever shown


def test_committed_gpu_results_follow_the_learners_own_run_and_only_cuda_ones(tmp_path):
    write(tmp_path, "training_step", **TRAINING_STEP, backend="gloo", device="cpu", machine="AMD EPYC 7B13 (2 cores)",
          dtype="fp32")
    for folder, device, machine in (("gpu-8x-h100", "cuda", "8 × NVIDIA H100 80GB HBM3"),
                                    ("gpu-oops", "cpu", "a laptop")):
        (tmp_path / folder).mkdir()
        write(tmp_path / folder, "training_step", **TRAINING_STEP, backend="nccl", device=device, machine=machine,
              dtype="bf16", date="2027-01-05")
    (tmp_path / "gpu-8x-h100" / "training_step.png").write_bytes(b"")
    lines = describe("training_step", tmp_path).splitlines()
    assert lines[0].startswith("CPU smoke run (gloo, tiny sizes) on AMD EPYC 7B13 (2 cores)")
    assert lines[2:] == ["", "`make gpu-check` (labs/results/gpu-8x-h100): GPU results from "
                         "8 × NVIDIA H100 80GB HBM3 (nccl, bf16, 2 ranks, 2027-01-05):",
                         "  2 ranks, 164,416 parameters: loss 4.8759 → 4.3939, replica spread 0.0e+00",
                         "  figure: labs/results/gpu-8x-h100/training_step.png"]


def test_an_unknown_lab_is_refused_with_the_names():
    with pytest.raises(ValueError, match="no lab named 'dp'.*training_step, ddp, zero"):
        describe("dp")


READS_RESULTS = re.compile(r"labs/results|results/\w+\.json")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_notebook_cell_reads_lab_results_but_through_the_helper(path):
    """A cell that opened labs/results/ itself could print a CPU run as anything: the helper labels it."""
    cells = json.loads(path.read_text())["cells"]
    reading = [i for i, cell in enumerate(cells)
               if cell["cell_type"] == "code" and READS_RESULTS.search("".join(cell["source"]))]
    assert not reading, f"cells {reading} read labs/results/: use course_lib.presentation.lab_results.describe"


def test_the_notebooks_show_their_labs_through_the_helper():
    shown = {}
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and "describe(" in source:
                shown.update({lab: path.name for lab in re.findall(r'describe\("(\w+)"\)', source)})
    expected = {"ddp": "02_ddp.ipynb", "zero": "03_zero_fsdp.ipynb", "tensor_parallel": "04_tensor_parallel.ipynb"}
    assert expected.items() <= shown.items()
