"""course_lib.presentation.predict: a prediction is locked in by its button, and only then is the answer shown beside it; no
committed notebook shows a reveal's answer."""

import re
from pathlib import Path

import nbformat
import pytest

from course_lib.presentation.predict import (
    LOCK_FIRST,
    Prediction,
    format_value,
    reveal_cells,
    strip_reveal_outputs,
    verdict,
)

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_a_reveal_without_a_locked_guess_shows_no_answer():
    guess = Prediction("p = 8, m = 8: bubble?", unit="%")
    line = guess.reveal(46.7, "the formula")
    assert LOCK_FIRST in line and "46.7" not in line and line.startswith("the formula: ")
    assert guess.answer == 46.7     # kept for the browser test, which looks for it on the page above


def test_the_working_is_held_back_until_a_guess_is_locked(capsys):
    """Run All without a guess shows no answer: what ``working()`` prints stays hidden (the block still runs),
    and appears once a guess is locked in."""
    guess = Prediction("p = 8, m = 8: bubble?", unit="%")
    with guess.working():
        print("bubble = 46.7%")
        ran = True
    shown = capsys.readouterr().out
    assert ran and "46.7" not in shown and "once a guess is locked in" in shown
    guess.box.value = 20
    guess.button.click()
    with guess.working():
        print("bubble = 46.7%")
    assert "bubble = 46.7%" in capsys.readouterr().out


def test_a_locked_guess_is_revealed_beside_the_answer_in_the_question_s_units_with_a_verdict():
    guess = Prediction("p = 8, m = 8: bubble?", unit="%")
    guess.box.value = 20
    guess.button.click()
    assert guess.guess == 20 and guess.box.disabled and "Locked in: 20.0 %" in guess.note.value
    assert guess.reveal(46.7, "the formula") == ("you predicted 20.0 %; the formula: 46.7 %: off by 26.7 percentage "
                                                  "points, 2.33x (too low)")
    assert repr(guess) == "Predict first: p = 8, m = 8: bubble? (run this cell to answer)"
    sent = Prediction("bytes sent?", unit="bytes", high=1e6)
    sent.box.value = 30720
    sent.lock()
    assert sent.reveal(18432, "traced") == "you predicted 30,720 bytes; traced: 18,432 bytes: off by 67% (too high)"


@pytest.mark.parametrize("guess, actual, unit, words", [
    (236, 236, "GiB", "exactly right"), (230, 236, "GiB", "within 5%"), (200, 236, "GiB", "off by 15% (too low)"),
    (20, 236, "GiB", "off by 11.8x (too low)"), (3000, 236, "GiB", "off by 12.7x (too high)"),
    (0, 13.2, "GiB", "off by 13.2 GiB"), (11, 11.9, "%", "off by 0.9 percentage points, 8% (too low)")])
def test_the_verdict_says_how_far_off_in_words(guess, actual, unit, words):
    assert verdict(guess, actual, unit) == words


def test_numbers_are_formatted_as_the_question_asks():
    assert [format_value(18432, "bytes"), format_value(236.4, "GiB"), format_value(46.66, "%"),
            format_value(4.7321, "GiB"), format_value(46.70, "billion")] == \
        ["18,432 bytes", "236 GiB", "46.7 %", "4.73 GiB", "46.7 billion"]


@pytest.mark.parametrize("value", [-50, 1e9])
def test_a_guess_outside_the_box_s_range_is_not_clamped_silently(value):
    guess = Prediction("how many?", unit="GiB", low=0, high=10000)
    guess.box.value = value
    guess.lock()
    assert guess.guess is None and not guess.box.disabled
    assert f"{value:g} is outside 0 to 10,000 GiB" in guess.note.value and "not locked in" in guess.note.value


def test_strip_reveal_outputs_empties_only_the_reveal_cells():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("guess = Prediction('q')"),
                                               nbformat.v4.new_code_cell("print(guess.reveal(3))")])
    for cell in notebook.cells:
        cell.outputs = [nbformat.v4.new_output("stream", text="shown\n")]
    assert strip_reveal_outputs(notebook) == 1 and strip_reveal_outputs(notebook) == 0
    assert notebook.cells[0].outputs and not notebook.cells[1].outputs


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_committed_notebook_shows_a_reveal_s_answer(path):
    notebook = nbformat.read(path, as_version=4)
    shown = [cell.get("id") for cell in reveal_cells(notebook) if cell.outputs]
    assert not shown, (f"{path.name}: reveal cells {shown} carry outputs (the answer before a guess): run "
                       f"`python -m course_lib.presentation.predict {path.relative_to(path.parent.parent)}`")
    for cell in reveal_cells(notebook):   # checks that hold the answer go in the next cell, its source collapsed
        assert not re.search(r"^\s*assert\b", cell.source, re.M), (f"{path.name}: reveal cell {cell.get('id')} "
                                                                    "asserts (its source shows the answer)")
    for before, after in zip(notebook.cells, notebook.cells[1:]):
        if before in reveal_cells(notebook) and re.search(r"^\s*assert\b", after.source, re.M):
            assert after.metadata.get("jupyter", {}).get("source_hidden"), f"{path.name}: {after.get('id')}"
    for cell in notebook.cells:     # every answer goes through a Prediction's reveal, which hides it until locked
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain", "")
            assert "you predicted" not in text and "(no prediction locked in above" not in text, cell.get("id")


def test_a_table_escapes_its_cells_and_refuses_a_ragged_row():
    from course_lib.presentation.tables import table

    shown = table(["run", "MFU"], [["GPT <1T>", "52.2%"]], caption="published").data
    assert "GPT &lt;1T&gt;" in shown and shown.count("<tr>") == 2 and "<caption" in shown
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        table(["run", "MFU"], [["GPT"]])
