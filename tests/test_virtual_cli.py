"""``python -m course_lib.virtual``: its table says what the JSON record says, its help every default, and the
numbers behind its options (dp 1, fp32, ZB-H1) are measured and equal their formulas."""

import json
import re

import pytest

from course_lib.job import Job
from course_lib.ledger import CONVENTIONS, zero_state_bytes
from course_lib.mesh import Mesh
from course_lib.model import PRESETS, preset
from course_lib.per_rank import params_per_rank
from course_lib.virtual import format_result, main, run_rank

TINY = preset("tiny")
ARGV = ["--preset", "tiny", "--dp", "2", "--tp", "2", "--pp", "2", "--rank", "7", "--seq-len", "16",
        "--num-microbatches", "2"]


def job(config, mesh, **options) -> Job:
    """A Job with ZeRO-1 and selective recomputation (the command line's defaults) unless ``options`` say otherwise."""
    return Job(config, mesh, **{"zero_stage": 1, "recompute": "selective", **options})


def test_the_table_shows_the_json_records_numbers_in_gib(capsys):
    assert main([*ARGV, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert main(ARGV) == 0
    table = capsys.readouterr().out
    assert table.startswith("rank 7 of 8 (dp 1, tp 1, pp 1): layers [2, 4) (first included, end excluded)")

    def shown(label):      # the "this run" number on the row that starts with label
        line = next(line for line in table.splitlines() if line.startswith(f"  {label} "))
        return float(line[len(label) + 2:].split()[0]), line

    for part, nbytes in record["state_bytes"].items():
        assert shown(part)[0] == pytest.approx(nbytes / 2**30, rel=1e-3)
    assert shown("peak")[0] == pytest.approx(record["activation_bytes_peak"] / 2**30, rel=1e-3)
    assert set(record["sent_bytes"]) == {"tp", "pp", "dp"}
    for axis, nbytes in record["sent_bytes"].items():
        gib, line = shown(axis)
        assert nbytes > 0 and gib == pytest.approx(nbytes / 2**30, rel=1e-3)
        assert line.endswith("measured: " + ", ".join(f"{op} x {n}" for op, n in record["ops"][axis].items()))
    assert re.search(r"^ran in \d+\.\d s", table, re.MULTILINE)
    assert " GB" not in table.replace("80GB", "")                       # one unit throughout
    total = record["state_bytes"]["total"] + record["formulas"]["transient_bytes"]["total"] + \
        record["activation_bytes_peak"]
    assert f"peak = {total / 2**30:.4g} GiB: it fits" in table and "H100 SXM 80GB (80 GiB)" in table


def test_a_rank_that_does_not_fit_on_its_card_is_told_so(capsys):
    """The help's Mixtral example: 157 GiB on one rank, beside an 80 GiB H100 and a 141 GiB H200."""
    argv = ["--preset", "mixtral-8x7b", "--dp", "4", "--cp", "2", "--ep", "8", "--pp", "4", "--rank", "5",
            "--seq-len", "32768"]
    assert main(argv) == 0 and "it does NOT fit" in capsys.readouterr().out
    assert main([*argv, "--gpu", "H200 SXM"]) == 0 and "(141 GiB)" in capsys.readouterr().out


def test_help_gives_every_flag_a_line_and_its_default_and_lists_the_presets(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    flags = re.findall(r"^  (--[a-z-]+)(.*(?:\n {6,}.*)*)", text, re.MULTILINE)
    assert len(flags) == 24, [flag for flag, _ in flags]      # all but -h, --help
    for flag, block in flags:
        words = " ".join(block.split())
        assert "(default: " in words or "(off unless given)" in words, (flag, words)
    assert "(default: llama2-70b)" in text and "(default: 1f1b)" in text
    assert all(name in text for name in PRESETS) and "zb-h1" in text and "interleaved" in text


def test_a_preset_alone_runs_at_its_models_sequence_length(capsys):
    assert main(["--preset", "tiny", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    whole = run_rank(job(TINY, Mesh(), seq_len=TINY.max_seq_len), 0)
    assert record["activation_bytes_per_microbatch"] == whole["activation_bytes_per_microbatch"]
    assert main(["--preset", "tiny"]) == 0
    assert capsys.readouterr().out.startswith("rank 0 of 1 (dp 0, tp 0, pp 0): layers [0, 4)")


def test_an_axis_of_one_rank_lists_no_ops():
    one, two = (run_rank(job(TINY, Mesh(dp=dp, tp=2), seq_len=16, zero_stage=1), 0) for dp in (1, 2))
    assert one["ops"]["dp"] == {} and one["sent_bytes"]["dp"] == 0 and one["ops"]["pp"] == {}
    assert set(two["ops"]["dp"]) == {"reduce_scatter", "all_gather"} and two["sent_bytes"]["dp"] > 0
    assert one["ops"]["tp"] == two["ops"]["tp"] != {}


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_fp32_counts_plain_adam_with_no_master_copy(zero_stage):
    mesh = Mesh(dp=2)
    run = run_rank(job(TINY, mesh, seq_len=16, zero_stage=zero_stage, dtype="fp32"), 0)
    fp32 = CONVENTIONS["fp32"]
    expected = zero_state_bytes(params_per_rank(TINY, mesh, 0), zero_stage, 2, weight_bytes=fp32.weight_bytes,
                                grad_bytes=fp32.grad_bytes, optimizer_bytes=fp32.optimizer_bytes)
    assert run["state_bytes"] == expected == run["formulas"]["state_bytes"]
    if zero_stage == 0:
        assert run["state_bytes"]["total"] == 16 * params_per_rank(TINY, mesh, 0)


def test_zb_h1_runs_and_holds_each_graph_until_its_w():
    """The last stage of p = 2 runs each micro-batch's B at once under 1F1B (holds 1), but ZB-H1 keeps the graph
    for W, one step later: min(p, m) = 2 micro-batches, measured (pipeline_step's docstring)."""
    runs = {schedule: run_rank(job(TINY, Mesh(pp=2), seq_len=16, num_microbatches=4, schedule=schedule,
                                   recompute="none"), 1) for schedule in ("1f1b", "zb-h1")}
    assert runs["1f1b"]["microbatches_in_flight"] == 1 and runs["zb-h1"]["microbatches_in_flight"] == 2
    per_microbatch = runs["1f1b"]["activation_bytes_per_microbatch"]
    assert runs["zb-h1"]["activation_bytes_per_microbatch"] == per_microbatch > 0
    assert runs["zb-h1"]["activation_bytes_peak"] == 2 * per_microbatch
    assert runs["zb-h1"]["sent_bytes"]["pp"] == runs["1f1b"]["sent_bytes"]["pp"] > 0


def test_interleaved_needs_chunks_and_runs_with_them(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["--preset", "tiny", "--pp", "2", "--schedule", "interleaved"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("--schedule interleaved with --num-chunks 1: give each "
                                                             "stage v >= 2 chunks of layers (v = 1 is 1F1B)")
    assert main(["--preset", "tiny", "--pp", "2", "--schedule", "interleaved", "--num-chunks", "2",
                 "--num-microbatches", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == [[0, 1], [2, 3]]


def test_the_table_marks_what_was_computed_not_measured():
    run = run_rank(job(preset("tiny", num_experts=4), Mesh(dp=2, ep=2), seq_len=16), 1)
    assert run["computed"] == ["state_bytes", "sent_bytes.dp"]
    rows = {line.split()[0]: line for line in format_result(run).splitlines() if line.startswith("  ")}
    assert all(rows[part].endswith("computed") for part in ("weights", "grads", "optimizer", "total", "dp"))
    assert rows["ep"].endswith("measured: all_to_all x 16")   # 4 layers × (dispatch, combine) × (forward, backward)
    assert rows["peak"].split()[2] == "-"                     # the MoE layer has no activation formula
    assert "(dp 1, tp 0, pp 0, ep 1)" in format_result(run).splitlines()[0]
