"""What a learner reads from the %ranks magics in a real Jupyter kernel: syntax errors as in any cell, a world too
large for the machine refused by name, and magics that are still there after a kernel restart under `make lab`."""

import json
import re

import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import start_new_kernel

from conftest import REPO, run_cell

pytestmark = pytest.mark.ranks   # run apart with: pytest -m ranks

COLOURS = re.compile(r"\x1b\[[0-9;]*m")


def test_a_syntax_error_in_a_ranks_cell_shows_the_cell_and_line_and_no_machinery(kernel):
    km, kc = kernel
    run_cell(kc, "%load_ext course_lib\n%ranks start 2")
    text, ename = run_cell(kc, "%%ranks\nx = 1\ndef broken(:\n    pass")
    text = COLOURS.sub("", text)
    assert ename == "CellSyntaxError"
    lines = text.splitlines()
    # IPython's own layout for a syntax error: where, the line, a caret, the error; nothing else
    assert re.fullmatch(r"  Cell In\[\d+\], line 3", lines[0]), text
    assert lines[1] == "    def broken(:" and lines[2].strip() == "^" and lines[3].startswith("SyntaxError: ")
    assert len(lines) == 4, text
    text, ename = run_cell(kc, "%%ranks\nrank")   # no rank ran the broken cell; the world is as it was
    assert ename is None and "Out: 0" in text and "Out: 1" in text


def test_ranks_start_refuses_a_world_far_beyond_the_machine(kernel):
    km, kc = kernel
    text, ename = run_cell(kc, "%load_ext course_lib\n%ranks start 1000")
    assert "UsageError: %ranks start: world_size=1000 is more than this machine can run: it has" in text
    assert "CPU cores and" in text and "GiB of memory" in text and "ranks started" not in text
    text, _ = run_cell(kc, "%ranks status")
    assert "no ranks are running" in text
    # A running world is checked against before it is stopped: a bad start keeps it, and its variables.
    run_cell(kc, "%ranks start 2")
    run_cell(kc, "%%ranks\nkept = rank * 10")
    for bad, says in (("1000", "is more than this machine can run"), ("2 --backend nccl", "needs one GPU per rank")):
        text, _ = run_cell(kc, f"%ranks start {bad}")
        assert "UsageError: %ranks start" in text and says in text and "(the running world is kept)" in text, text
    text, ename = run_cell(kc, "%%ranks\nkept")
    assert ename is None and "Out: 0" in text and "Out: 10" in text, text


@pytest.fixture
def make_lab_kernel(monkeypatch):
    """A kernel started as `make lab` starts one: from the course's kernel spec, found first on JUPYTER_PATH."""
    monkeypatch.setenv("JUPYTER_PATH", str(REPO / ".jupyter"))
    spec = KernelSpecManager().get_kernel_spec("python3")
    assert spec.resource_dir == str(REPO / ".jupyter" / "kernels" / "python3")
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(REPO / "notebooks"))
    yield km, kc
    kc.stop_channels()
    if km.is_alive():
        km.shutdown_kernel(now=True)


def test_under_make_lab_the_magics_are_loaded_and_survive_a_kernel_restart(make_lab_kernel):
    km, kc = make_lab_kernel
    text, ename = run_cell(kc, "%ranks start 2")   # no %load_ext needed
    assert ename is None and "2 ranks started (gloo)" in text
    # The notebooks' own %load_ext course_lib stays harmless: no message, and the running world is kept.
    text, ename = run_cell(kc, "%load_ext course_lib")
    assert ename is None and text == ""
    text, ename = run_cell(kc, "%%ranks\nrank * 10")
    assert ename is None and "Out: 0" in text and "Out: 10" in text
    km.restart_kernel(now=True)
    kc.wait_for_ready(timeout=60)
    text, ename = run_cell(kc, "%ranks status")
    assert ename is None and "no ranks are running" in text


def test_the_course_kernel_spec_is_the_default_one_plus_the_extension():
    ours = json.loads((REPO / ".jupyter" / "kernels" / "python3" / "kernel.json").read_text())
    assert ours["argv"] == ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}", "--ext=course_lib.runtime.magics"]
    assert ours["language"] == "python"


def test_only_needs_at_least_one_rank():
    """`%%ranks --only ,` names the flag and the form it wants, not "min() arg is an empty sequence"."""
    import argparse

    from course_lib.runtime.magics import _rank_list

    assert _rank_list("0, 2") == [0, 2]
    for bad in (",", "", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError, match="give rank numbers separated by commas"):
            _rank_list(bad)
