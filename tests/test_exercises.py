"""course_lib.presentation.exercises: every checker given an unfinished answer (the notebook's "Not done yet", not an error),
each typical wrong answer it has a hint for (that hint printed, and False), and its reference answer from
course_lib.presentation.exercises.solutions (✓ and True). Checkers that run the answer on ranks do so here too (marked ``ranks``); the
rest run in this process. Last, the notebooks: each exercise appears once, as the learner's unfinished cell, with
no reference answer anywhere on the page. The wrong answers of some checkers are in the test_exercises_*.py beside
this file (tests/test_exercises_data_parallel.py: notebooks 02 and 03)."""

import inspect
import json
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course_lib.pipeline_parallel import gpipe_actions
from course_lib.presentation import exercises
from course_lib.presentation.exercises import common as exercises_common
from course_lib.presentation.exercises import layout as exercises_layout
from course_lib.presentation.exercises import solutions

NOT_DONE = "Not done yet: replace `raise NotImplementedError`"
NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))
CHECKERS = sorted(name for name, fn in inspect.getmembers(exercises, inspect.isfunction) if name.startswith("check_"))
IN_PROCESS = {"check_mlp_saved_bytes", "check_3d_layout", "check_layout_at_scale", "check_own_job"}   # the others start ranks


def unfinished(*args, **kwargs):
    raise NotImplementedError("your turn")


def verdict(capsys, result: bool, expected: bool, *words: str) -> str:
    """Assert the checker's result, that its output holds ``words``, that it says ✓ exactly when right, ✗ exactly
    for a wrong answer that ran (not for an unfinished one, nor one that raised or hung), and how to see the
    reference answer exactly when wrong."""
    shown = capsys.readouterr().out
    assert result is expected, shown
    for word in words:
        assert word in shown, shown
    ran = not any(text in shown for text in (NOT_DONE, "failed on", "did not finish within"))
    assert ("✓" in shown) == expected and ("✗" in shown) == (not expected and ran), shown
    assert ("stuck? run exercises.solution('" in shown) == (not expected), shown
    return shown


# ---- every checker · its reference answer ---------------------------------------------------------

RIGHT = {   # what a checker says to its reference answer
    "check_mean_over_ranks": ["✓ correct: all 4 ranks hold the mean [15.0, 16.0, 17.0]"],
    "check_mlp_saved_bytes": ["✓ correct at all 4 shapes"],
    "check_copy_to_tp_region": ["✓ correct: identity forward, one all-reduce backward"],
    "check_accumulation_step": ["✓ correct:", "for 3 micro-batches", "on all 12 rows"],
    "check_one_f_one_b": ["✓ correct: as fast as GPipe (bubble 27.3% at p=4, m=8)", "on 3 real ranks"],
    "check_reduce_grad_shard": ["✓ correct: one reduce-scatter"],
    "check_3d_layout": ["✓ dp 2 × tp 8 × pp 2, ZeRO-1, m = 32 (micro-batches of 1)", "state 42.3 GiB + activations "
                        "21.7 GiB + reserve 8.0 GiB = 72.0 GiB of 80.0 GiB", "bubble 3.0%, TP inside the node"],
}


@pytest.mark.parametrize("checker", [pytest.param(name, marks=() if name in IN_PROCESS else pytest.mark.ranks)
                                     for name in CHECKERS])
def test_every_checker_passes_its_reference_answer(capsys, checker):
    """A new exercise fails here until course_lib/presentation/exercises/solutions.py has its answer, and that answer passes."""
    exercise = checker.removeprefix("check_")
    assert exercise in solutions.BY_EXERCISE, f"course_lib/presentation/exercises/solutions.py has no reference answer to {checker}"
    verdict(capsys, getattr(exercises, checker)(solutions.BY_EXERCISE[exercise]), True, *RIGHT.get(checker, []))


@pytest.mark.parametrize("checker", CHECKERS)
@pytest.mark.parametrize("given", [None, "my_function", 42])
def test_every_checker_answers_a_value_instead_of_a_function_with_one_line(capsys, checker, given):
    """A learner who passes a value (or calls their function in the call) gets a ✗ line, not a traceback."""
    shown = verdict(capsys, getattr(exercises, checker)(given), False, "takes your function itself")
    assert type(given).__name__ in shown and "Traceback" not in shown


def test_every_reference_answer_has_a_checker():
    assert sorted(f"check_{name}" for name in solutions.BY_EXERCISE) == CHECKERS


@pytest.mark.parametrize("checker", CHECKERS)
def test_solution_prints_the_reference_answer_of_the_checkers_notebook(capsys, checker):
    exercise = checker.removeprefix("check_")
    notebook = getattr(exercises, checker).__doc__[:2]           # each checker's docstring starts "NN:"
    exercises.solution(exercise)
    shown = capsys.readouterr().out
    assert shown.strip() == inspect.getsource(solutions.BY_EXERCISE[exercise]).strip()
    assert f"The reference answer to notebook {notebook}'s exercise" in shown, shown   # "exercise 1:" where several


def test_solution_of_an_unknown_exercise_lists_the_exercises(capsys):
    exercises.solution("mean")
    shown = capsys.readouterr().out
    assert shown.startswith("There is no exercise 'mean'; the exercises are 'mean_over_ranks', "), shown


# ---- 00 · check_mean_over_ranks --------------------------------------------------------------------

def sum_over_ranks(rank, world_size, value):
    total = value.clone()
    dist.all_reduce(total)
    return total                                    # forgot to divide


def mean_in_place(rank, world_size, value):
    dist.all_reduce(value)                          # the caller's tensor now holds the sum
    return value / world_size


def all_reduce_returns_none(rank, world_size, value):
    return dist.all_reduce(value.clone()) / world_size


@pytest.mark.ranks
@pytest.mark.parametrize("answer, expected, words", [
    (unfinished, False, [NOT_DONE]),
    (all_reduce_returns_none, False, ["Your function failed on rank", "TypeError"]),
    (sum_over_ranks, False, ["✗ rank 0 returned tensor([10., 12., 14.]", "expected [5.0, 6.0, 7.0]"]),
    (mean_in_place, False, ["✗ rank 0: your function changed the caller's `value` in place", "value.clone()"]),
], ids=["unfinished", "fails", "sum", "in-place"])
def test_check_mean_over_ranks(capsys, answer, expected, words):
    verdict(capsys, exercises.check_mean_over_ranks(answer, world_size=2), expected, *words)


# ---- 01 · check_mlp_saved_bytes (in this process) --------------------------------------------------

@pytest.mark.parametrize("answer, expected, words, hint", [
    (unfinished, False, ["Not done yet: replace `raise NotImplementedError` with your formula"], None),
    (lambda b, s, h, i, e: 4 * b * s * i * e, False, ["✗ for batch 2, seq 8, hidden 16, intermediate 32, 4 bytes",
                                                      "you predicted 8192, measured 9216"],
     "the input x is saved too"),
    (lambda b, s, h, i, e: b * s * h * e + 3 * b * s * i * e, False, ["you predicted 7168"],
     "down_proj saves its own input"),
    (lambda b, s, h, i, e: 2 * b * s * h * e + 4 * b * s * i * e, False, ["you predicted 10240"],
     "count that storage once"),
    (lambda b, s, h, i, e: b * s * (h + 4 * i) * 4, False,          # fp32 only: right at the first shape
     ["✗ for batch 3, seq 5, hidden 64, intermediate 96, 2 bytes/value"], None),
    (lambda b, s, h, i, e: 1, False, ["you predicted 1, measured 9216"], None),
], ids=["unfinished", "no-input", "no-down-input", "input-twice", "fp32-only", "unrecognised"])
def test_check_mlp_saved_bytes(capsys, answer, expected, words, hint):
    shown = verdict(capsys, exercises.check_mlp_saved_bytes(answer), expected, *words)
    assert shown.count("hint:") == (hint is not None) and (hint or "") in shown


# ---- 04 · check_copy_to_tp_region --------------------------------------------------------------------

ReferenceCopy = solutions.CopyToTensorParallelRegion   # each wrong answer below changes one of its methods


class UnfinishedCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        raise NotImplementedError("your turn")


class ReduceForward(ReferenceCopy):
    """Megatron's g instead of f: all-reduces going forward."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        y = x.clone()
        comm.all_reduce(y)
        return y


class MeanForward(ReferenceCopy):
    """The identity (every rank holds the same x), but with an all-reduce it does not need."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        y = x.clone()
        comm.all_reduce(y)
        return y / comm.size


class LocalBackward(ReferenceCopy):
    @staticmethod
    def backward(ctx, grad):
        return grad, None


class UntracedBackward(ReferenceCopy):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad, None


class MeanBackward(ReferenceCopy):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad)
        return grad / ctx.comm.size, None


@pytest.mark.ranks
@pytest.mark.parametrize("answer, expected, words", [
    (UnfinishedCopy, False, [NOT_DONE]),
    (ReduceForward, False, ["✗ rank 0: forward must return x unchanged"]),
    (MeanForward, False, ["✗ rank 0: your forward sent 1 collective(s); f communicates only backward"]),
    (LocalBackward, False, ["only this rank's share", "All-reduce the gradient in backward"]),
    (UntracedBackward, False, ["backward made 0 traced collectives", "dist.all_reduce is not traced"]),
    (MeanBackward, False, ["differs from the dense layer's (sum, not mean"]),
], ids=["unfinished", "g-not-f", "forward-collective", "no-all-reduce", "untraced", "mean"])
def test_check_copy_to_tp_region(capsys, answer, expected, words):
    verdict(capsys, exercises.check_copy_to_tp_region(answer), expected, *words)


# ---- 05 · check_one_f_one_b --------------------------------------------------------------------------

def with_warmup(count):
    """1F1B's shape with ``count(stage, num_stages)`` warm-up forwards instead of p - s - 1."""
    def actions(stage, num_stages, num_microbatches):
        warmup = min(count(stage, num_stages), num_microbatches)
        order = [("F", k) for k in range(warmup)]
        for k in range(warmup, num_microbatches):
            order += [("F", k), ("B", k - warmup)]
        return order + [("B", k) for k in range(num_microbatches - warmup, num_microbatches)]
    return actions


def forgets_the_last_backward(stage, num_stages, num_microbatches):
    return solutions.one_f_one_b(stage, num_stages, num_microbatches)[:-1]


@pytest.mark.parametrize("answer, words", [
    (unfinished, [NOT_DONE]),
    (with_warmup(lambda s, p: s), ["✗ p=2, m=4: deadlock: stage 0 waits at ('B', 0)",
                                   "hint: a stage waits for a backward", "p - s - 1 forwards"]),   # reversed stages
    (forgets_the_last_backward, ["✗ p=2, m=1: stage 0: [('F', 0)] must hold ('F', k) and ('B', k) exactly once"]),
    (with_warmup(lambda s, p: 0), ["✗ p=2, m=4: the step takes 16 op-times, the formula 5·2 = 10",
                                   "too few warm-up forwards?"]),
    (gpipe_actions, ["✗ p=2, m=4: stages hold [4, 4] micro-batches at their peak; 1F1B holds [2, 1]",
                     "hint: that is GPipe"]),
    (with_warmup(lambda s, p: p - s), ["✗ p=2, m=4: stages hold [3, 2] micro-batches at their peak; 1F1B holds "
                                       "[2, 1]"]),
], ids=["unfinished", "deadlock", "invalid", "too-slow", "gpipe", "too-many-in-flight"])
def test_check_one_f_one_b_finds_a_wrong_schedule_by_simulation(capsys, answer, words):
    shown = verdict(capsys, exercises.check_one_f_one_b(answer), False, *words)
    if "hint" not in " ".join(words):
        assert "hint" not in shown


def one_f_one_b_that_changes_the_loss(stage, num_stages, num_microbatches):
    """A right order with a side effect on the ranks only: a stand-in for any mistake that the simulation
    cannot see (any valid order gives the same loss and gradients, so a pure schedule function cannot)."""
    if dist.is_initialized() and not getattr(torch.nn.functional.cross_entropy, "smoothed", False):
        original = torch.nn.functional.cross_entropy

        def smoothed(*args, **kwargs):
            return original(*args, label_smoothing=0.1, **kwargs)
        smoothed.smoothed = True
        torch.nn.functional.cross_entropy = smoothed
    return solutions.one_f_one_b(stage, num_stages, num_microbatches)


@pytest.mark.ranks
def test_check_one_f_one_b_on_real_ranks(capsys):
    verdict(capsys, exercises.check_one_f_one_b(one_f_one_b_that_changes_the_loss), False,
            "✗ on 3 real ranks the loss is", "gradients off by up to")


# ---- 06 · check_3d_layout (in this process) ----------------------------------------------------------

def layout(dp=2, tp=8, pp=2, zero_stage=1, num_microbatches=32, **changes):
    """The reference layout with some values changed; a value of None removes that key."""
    answer = dict(dp=dp, tp=tp, pp=pp, zero_stage=zero_stage, num_microbatches=num_microbatches, **changes)
    return lambda: {key: value for key, value in answer.items() if value is not None}


@pytest.mark.parametrize("answer, words", [
    (unfinished, [NOT_DONE]),
    (lambda: {"dp": 2, "tp": 8, "pp": 2, "num_microbatches": 32},
     ["✗ your dict has no 'zero_stage': it needs the keys dp, tp, pp, zero_stage, num_microbatches\n"]),
    (layout(zero=1, zero_stage=None), ["✗ your dict has no 'zero_stage'", "(and 'zero' is not one of them)"]),
    (lambda: {"tp": 8}, ["✗ your dict has no 'dp', 'pp', 'zero_stage', 'num_microbatches': it needs the keys"]),
    (lambda: (2, 8, 2, 1, 32), ["✗ layout() returned a tuple; return a dict with the keys dp, tp, pp, zero_stage"]),
    (layout(dp="2"), ["✗ ValueError: dp='2': each degree of parallelism is a whole number"]),
    (layout(dp=4), ["✗ ValueError: world_size 32 != dp 4 × tp 8 × pp 2 = 64"]),
    (layout(dp=4, tp=1, pp=8, num_microbatches=3), ["✗ ValueError: each dp rank's batch of 16", "num_microbatches=3"]),
    (layout(zero_stage=4), ["✗ zero_stage=4: one of 0 (DDP), 1, 2, 3"]),
    (layout(dp=32, tp=1, pp=1, zero_stage=0, num_microbatches=1),
     ["✗ the busiest GPU needs state 1027.8 GiB + activations 204.4 GiB + reserve 8.0 GiB = 1240.3 GiB: 1160.3 GiB "
      "more than its 80.0 GiB", "hint: the state overflows: 1027.8 GiB where the card leaves 72.0 GiB beside its "
      "8.0 GiB reserve, 955.8 GiB too much before any activation: shard it more"]),
    (layout(dp=32, tp=1, pp=1, zero_stage=3, num_microbatches=2),      # FSDP alone: every GPU runs all 80 layers
     ["✗ the busiest GPU needs state 35.3 GiB + activations 102.4 GiB + reserve 8.0 GiB = 145.7 GiB",
      "hint: the activations overflow: 102.4 GiB where the state and the reserve leave 36.7 GiB, 65.7 GiB too "
      "much. They shrink with more TP;"]),
    (layout(num_microbatches=2), ["✗ the bubble is (p-1)/(m+p-1) = 1/3 = 33%: more micro-batches"]),
    (layout(num_microbatches=0), ["✗ ValueError: num_microbatches=0 must be a whole number >= 1"]),
], ids=["unfinished", "missing-key", "misspelt-key", "missing-keys", "not-a-dict", "not-a-number", "wrong-size",
        "uneven-batch", "no-such-stage", "state-does-not-fit", "activations-do-not-fit", "bubble",
        "no-micro-batches"])
def test_check_3d_layout_says_what_is_wrong(capsys, answer, words):
    verdict(capsys, exercises.check_3d_layout(answer), False, *words)


def test_check_3d_layout_passes_zero_3_beside_a_pipeline_and_says_what_it_costs(capsys):
    """DeepSpeed refuses ZeRO-2/3 with a pipeline; Llama 3 and torchtitan run FSDP with PP. It fits (34.2 GiB of
    state instead of ZeRO-1's 42.3), so it passes, with a note on its traffic."""
    verdict(capsys, exercises.check_3d_layout(layout(zero_stage=3)), True, "ZeRO-3, m = 32", "state 34.8 GiB",
            "note: ZeRO-3 beside a pipeline reduce-scatters the gradients and gathers the weights for every one of "
            "the 32 micro-batches")


def test_check_3d_layout_refuses_the_old_answer_whose_activations_do_not_fit(capsys):
    """The old checker weighed the state alone and passed dp 2 × tp 8 × pp 2, ZeRO-1 with 16 micro-batches:
    42.3 GiB of state. Its micro-batches are 2 sequences (64 / (2 · 16)), and stage 0 keeps 2 of them in flight:
    the activations no longer fit. Micro-batches of one sequence fit, with sequence parallelism only."""
    verdict(capsys, exercises.check_3d_layout(layout(num_microbatches=16)), False,
            "✗ the busiest GPU needs state 42.3 GiB + activations 43.2 GiB + reserve 8.0 GiB = 93.5 GiB: 13.5 GiB "
            "more than its 80.0 GiB", "hint: the activations overflow: 43.2 GiB where the state and the reserve "
            "leave 29.7 GiB, 13.5 GiB too much. They shrink with smaller micro-batches (b = 2 sequences now")
    without_sp = replace(exercises_layout.WORKLOAD, sequence_parallel=False)
    verdict(capsys, exercises.check_3d_layout(layout(), workload=without_sp), False,
            "activations 30.5 GiB + reserve 8.0 GiB = 80.8 GiB",
            "the activations overflow: 30.5 GiB where the state and the reserve leave 29.7 GiB",
            "They shrink with sequence parallelism")
    verdict(capsys, exercises.check_3d_layout(layout()), True, "72.0 GiB of 80.0 GiB")


def test_check_3d_layout_names_the_larger_part_first(capsys):
    """dp 4 × tp 8 × pp 1 with ZeRO-1 holds 59.2 GiB of state beside 22.4 GiB of activations: the hint names the
    state first, with what shards it, and does not offer full recomputation as if it were one of the choices.
    Its own suggestion, ZeRO-3 over the same dp, fits."""
    shown = verdict(capsys, exercises.check_3d_layout(layout(dp=4, pp=1, num_microbatches=16)), False,
                    "state 59.2 GiB + activations 22.4 GiB + reserve 8.0 GiB = 89.6 GiB",
                    "hint: the state is the larger part: 59.2 GiB beside 22.4 GiB of activations, 9.6 GiB too much "
                    "together. Shard the state more: a higher ZeRO stage over dp 4",
                    "full recomputation alone (not one of the choices here)")
    assert shown.index("Shard the state") < shown.index("the activations overflow")
    verdict(capsys, exercises.check_3d_layout(layout(dp=4, pp=1, zero_stage=3, num_microbatches=16)), True)


@pytest.mark.parametrize("answer", [layout(dp=4, pp=1, zero_stage=3, num_microbatches=16),   # FSDP + TP
                                    layout(dp=1, pp=4, zero_stage=1, num_microbatches=64)],
                         ids=["fsdp-tp", "tp-pp"])
def test_check_3d_layout_passes_other_layouts_that_fit(capsys, answer):
    verdict(capsys, exercises.check_3d_layout(answer), True, "TP inside the node")


# ---- an answer that hangs ------------------------------------------------------------------------

def mean_that_never_returns(rank, world_size, value):
    while True:
        time.sleep(0.05)


@pytest.mark.ranks
def test_an_answer_that_hangs_says_the_ranks_are_running_then_where_they_hung(capsys, monkeypatch):
    monkeypatch.setattr(exercises_common, "NOTICE_SECONDS", 0.5)
    monkeypatch.setattr(exercises_common, "TIMEOUT_SECONDS", 4.0)
    shown = verdict(capsys, exercises.check_mean_over_ranks(mean_that_never_returns, world_size=2), False,
                    "Your function did not finish within 4 s: ranks [0, 1] were still running",
                    "a loop that never ends?", "--- where rank 0 was ---", "--- where rank 1 was ---",
                    "in mean_that_never_returns")
    assert shown.startswith("waiting for 2 ranks… (a hang is reported after 4 s)\n"), shown


# ---- the notebooks: the learner's cell, and no answer on the page -----------------------------------

def exercise_cells(notebook: Path) -> list[tuple[int, dict]]:
    cells = json.loads(notebook.read_text())["cells"]
    return [(i, cell) for i, cell in enumerate(cells)
            if cell["cell_type"] == "code" and "exercises.check_" in "".join(cell["source"])]


def test_each_checker_is_called_once_in_the_notebooks_by_the_learners_unfinished_cell():
    called = []
    for notebook in NOTEBOOKS:
        for i, cell in exercise_cells(notebook):
            source = "".join(cell["source"])
            where = f"{notebook.name}, cell {i}"
            called += re.findall(r"exercises\.(check_\w+)\(", source)
            assert "raise NotImplementedError" in source, f"{where} calls a checker with a finished answer"
            assert not cell["metadata"].get("jupyter", {}).get("source_hidden"), f"{where} is hidden"
            text = "".join("".join(output.get("text", "")) for output in cell.get("outputs", []))
            if cell.get("outputs"):                                  # committed outputs, where there are any
                assert "✓" not in text and "Not done yet" in text, f"{where} shows {text!r}"
    assert sorted(called) == CHECKERS


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[n.stem for n in NOTEBOOKS])
def test_no_reference_answer_is_on_a_notebooks_page(notebook):
    """No code cell prints an answer, and no "Your turn" section (up to the next heading) hides one in a
    <details> block: a learner sees an answer only by running exercises.solution(...) themselves."""
    cells = json.loads(notebook.read_text())["cells"]
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            assert "solution" not in "".join(cell["source"]), f"{notebook.name}, cell {i} shows a reference answer"
    markdown = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")
    for section in re.findall(r"## Your turn\n(.*?)(?=\n#|\Z)", markdown, flags=re.S):
        assert "<details>" not in section, f"{notebook.name}: an answer under 'Your turn'"
