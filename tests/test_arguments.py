"""Bad input refused up front, in one line that names the value: course_lib.runtime.arguments (the command lines of the labs
and of ``python -m course_lib.virtual``), and the same rules in plan(), Workload and step_time."""

import argparse
import sys

import pytest

from conftest import REPO
from course_lib.mesh import Mesh
from course_lib.model import preset
from course_lib.plan import plan
from course_lib.recipes import Workload
from course_lib.runtime.arguments import MAX_VIRTUAL_MICROBATCHES, MAX_VIRTUAL_WORLD, integer, real, writable_folder
from course_lib.virtual import main as virtual_main

sys.path.insert(0, str(REPO / "labs"))   # the labs import each other by name, as scripts do
import check_gpu  # noqa: E402

from conftest import costed


@pytest.mark.parametrize("parse, text, message", [
    (integer(1), "0", "0 is below 1: it must be at least 1"),
    (integer(1, 8), "9", "9 is above 8: it must be at most 8"),
    (integer(16, multiple_of=16), "24", "24 is not a multiple of 16"),
    (integer(), "4k", "'4k' is not a whole number"),
    (integer(), "1.5", "'1.5' is not a whole number"),
    (real(above=0), "nan", "nan is not a finite number"),
    (real(above=0), "inf", "inf is not a finite number"),
    (real(above=0), "0", "0 must be more than 0"),
    (real(at_least=0, below=1), "1", "1 must be less than 1"),
    (real(), "fast", "'fast' is not a number"),
])
def test_a_value_out_of_range_is_refused_naming_it_and_the_rule(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        parse(text)
    assert str(refused.value) == message


def test_values_in_range_are_read():
    assert integer(1, 8)("8") == 8 and integer(16, multiple_of=16)("32") == 32
    assert real(above=0)("1e-3") == 1e-3 and real(at_least=0, below=1)("0") == 0.0


def test_an_output_folder_is_checked_before_the_run(tmp_path):
    assert writable_folder(str(tmp_path / "new" / "folder")) == tmp_path / "new" / "folder"
    assert list(tmp_path.iterdir()) == []       # checked, not made: a later argument may still be refused
    (tmp_path / "file").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="is a file, not a folder"):
        writable_folder(str(tmp_path / "file"))
    with pytest.raises(argparse.ArgumentTypeError, match="cannot write into /proc/x"):
        writable_folder("/proc/x")


@pytest.mark.parametrize("argv, message", [
    (["--tp", "0"], "argument --tp: 0 is below 1: it must be at least 1"),
    (["--pp", "0"], "argument --pp: 0 is below 1: it must be at least 1"),
    (["--cp", "0"], "argument --cp: 0 is below 1: it must be at least 1"),
    (["--world-size", "0"], "argument --world-size: 0 is below 1: it must be at least 1"),
    (["--world-size", "-8"], "argument --world-size: -8 is below 1: it must be at least 1"),
    (["--world-size", "1000000000"], f"argument --world-size: 1000000000 is above {MAX_VIRTUAL_WORLD}"),
    (["--dp", "1024", "--tp", "1024"], f"dp × tp × pp × cp = 1,048,576 ranks: more than the {MAX_VIRTUAL_WORLD:,}"),
    (["--num-microbatches", "100000"], f"argument --num-microbatches: 100000 is above {MAX_VIRTUAL_MICROBATCHES}"),
    (["--zero-stage", "4"], "argument --zero-stage: invalid choice: 4"),
])
def test_the_virtual_command_line_refuses_bad_degrees_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as stopped:
        virtual_main(["--preset", "tiny", "--seq-len", "32", *argv])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("python -m course_lib.virtual: error: ") and message in err, err


LLAMA_7B = preset("llama2-7b")


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_gpus=8, gpu_bytes=0), "gpu_bytes=0 must be a finite number > 0"),
    (dict(num_gpus=8, gpu_bytes=-1), "gpu_bytes=-1 must be a finite number > 0"),
    (dict(num_gpus="8"), "num_gpus='8' must be a whole number >= 1"),
    (dict(num_gpus=8.0), "num_gpus=8.0 must be a whole number >= 1"),
    (dict(num_gpus=8, convention="fp4"), "convention='fp4': choose one of 'mixed'"),
    (dict(num_gpus=8, reserve_share=1.5), "reserve_share=1.5 must be a finite number >= 0 and < 1"),
    (dict(num_gpus=8, reserve_share=-1), "reserve_share=-1 must be a finite number >= 0 and < 1"),
])
def test_plan_refuses_bad_input_naming_the_value(kwargs, message):
    with pytest.raises(ValueError) as refused:
        plan(LLAMA_7B, **kwargs)
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize("kwargs, message", [
    (dict(micro_batch_size=1.5), "micro_batch_size=1.5 must be a whole number >= 1"),
    (dict(seq_len="4k"), "seq_len='4k' must be a whole number >= 1"),
    (dict(seq_len=0), "seq_len=0 must be a whole number >= 1"),
    (dict(global_batch_size=0), "global_batch_size=0 must be a whole number >= 1"),
])
def test_a_workload_refuses_bad_input_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$".replace("(", r"\(")):
        Workload(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(micro_batch_size=1.5), "micro_batch_size=1.5 must be a whole number from 1 to 1,048,576"),
    (dict(seq_len=100.5), "seq_len=100.5 must be a whole number from 1 to the model's max_seq_len=4096"),
    (dict(dtype="fp8"), "dtype='fp8': one of bf16, fp16, fp32, fp64"),
    (dict(num_microbatches=0), "num_microbatches=0 must be a whole number from 1 to 1,048,576"),
    (dict(micro_batch_size=10**9), "micro_batch_size=1000000000 must be a whole number from 1 to 1,048,576"),
])
def test_step_time_refuses_bad_input_naming_the_value(kwargs, message):
    shape = {"seq_len": 4096, "micro_batch_size": 1, "num_microbatches": 8, **kwargs}
    with pytest.raises(ValueError) as refused:
        costed(LLAMA_7B, Mesh(dp=1, tp=8, pp=1), gpu="A100 80GB", **shape)
    assert str(refused.value) == message


def test_a_bandwidth_that_could_not_be_measured_says_so():
    """A CPU smoke run's tiny messages may take no longer for more bytes: the fitted slope is 0 or less, and β
    would print as 999999999999999868928.00 GB/s."""
    flat = [{"op": op, "bytes": size, "seconds": 1e-4, "algbw": size / 1e-4, "busbw": size / 1e-4}
            for op in check_gpu.OPS for size in (1024, 4096, 16384)]
    table = check_gpu.bandwidth_table(flat, 2)
    assert "β = not measurable" in table and "GB/s per rank" not in table
    sloped = [{**row, "seconds": 1e-4 + row["bytes"] / 1e9} for row in flat]
    assert "GB/s per rank" in check_gpu.bandwidth_table(sloped, 2)
