"""Predict first: a learner commits to a number before the cell that works it out, and that cell shows both.

    guess = Prediction("p = 8 stages, m = 8 micro-batches: what share of the step does a GPU idle?", unit="%")
    guess                         # the question, a number box and a "lock it in" button
    ...
    with guess.working():         # the lines and plots that would give the answer away: held until a guess
        print(table)
    print(guess.reveal(46.7))     # "you predicted 20 %; measured: 46.7 %: off by 26.7 points (2.3x too low)"

A guess made before the answer is seen is what makes the answer stick, so the answer waits for it: a reveal
with no guess locked in says "lock in a guess first" and shows no number, and ``working()`` shows nothing of
what it holds (a learner who runs every cell without guessing sees no answer). The checks that hold the answer
go in the cell after the reveal, its source collapsed. For the same reason a committed notebook carries no
output of a reveal cell (a cell that calls ``.reveal(``): ``strip_reveal_outputs`` removes them after a
notebook is executed, and the course's tests check every notebook.

    python -m course_lib.presentation.predict notebooks/*.ipynb       # strip reveal cells' outputs in place
"""

import contextlib
import math
import re
import sys

import ipywidgets as widgets
from IPython.utils.capture import capture_output

REVEAL_CALL = re.compile(r"\.reveal\(")
LOCK_FIRST = "lock in a guess first"


def format_value(value: float, unit: str = "") -> str:
    """A number as the question states it: whole bytes with thousands separators, 3 significant digits else."""
    if unit == "bytes" or (abs(value) >= 1000 and float(value).is_integer()):
        text = f"{value:,.0f}"
    elif abs(value) >= 100:
        text = f"{value:,.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.3g}"
    return f"{text} {unit}".rstrip()


def verdict(guess: float, actual: float, unit: str = "") -> str:
    """How far a guess is from the answer, in words: "within 5%", "off by 26%", "off by 12x (too high)".

    A share in % is also judged in percentage points, the unit its question is asked in."""
    if guess == actual:
        return "exactly right"
    if actual == 0 or guess == 0 or (guess < 0) != (actual < 0):
        return f"off by {format_value(abs(guess - actual), unit)}"
    side = "too high" if guess > actual else "too low"
    relative = abs(guess - actual) / abs(actual)
    if relative <= 0.05:
        words = "within 5%"
    elif max(guess / actual, actual / guess) < 2:
        words = f"off by {relative:.0%} ({side})"
    else:
        words = f"off by {max(guess / actual, actual / guess):.3g}x ({side})"
    if unit == "%" and relative > 0.05:
        words = f"off by {abs(guess - actual):.1f} percentage points, {words.removeprefix('off by ')}"
    return words


class Prediction(widgets.VBox):
    """A question, a number box and a "lock it in" button; ``guess`` holds the locked-in number, or None.

    ``low``..``high`` is the range the box accepts: a number outside it is not locked in, and the note says why
    (nothing is clamped silently). ``answer`` holds the last number a reveal was given (guess or not), so that a
    test can look for it on the page before the reveal runs."""

    def __init__(self, question: str, *, unit: str = "", low: float = 0.0, high: float = 100.0, step: float = 1.0):
        self.question, self.unit, self.low, self.high, self.guess = question, unit, low, high, None
        self.answer = None
        self.box = widgets.FloatText(value=low, step=step, description="my guess", layout=widgets.Layout(width="220px"))
        self.button = widgets.Button(description="lock it in", button_style="info")
        self.note = widgets.HTML(f"<i>a number from {format_value(low)} to {format_value(high)}</i>")
        self.button.on_click(self.lock)
        super().__init__([widgets.HTML(f"<b>Predict first.</b> {question}"),
                          widgets.HBox([self.box, widgets.Label(unit), self.button]), self.note])

    def lock(self, _=None) -> None:
        value = self.box.value
        if not (self.low <= value <= self.high) or math.isnan(value):
            self.note.value = (f"{value:g} is outside {format_value(self.low)} to {format_value(self.high, self.unit)}:"
                               " not locked in. Enter a number in that range.")
            return
        self.guess = value
        self.box.disabled = self.button.disabled = True
        self.note.value = f"Locked in: {format_value(value, self.unit)}. Now run the cells below."

    def reveal(self, actual: float, how: str = "measured") -> str:
        """One line for the cell that works the number out: the guess beside the answer, with a verdict.

        Without a locked guess the answer is not shown: the cell's other lines may still show the working."""
        self.answer = actual
        if self.guess is None:
            return (f"{how}: {LOCK_FIRST} (the box above, then run this cell again): the answer waits for your "
                    "prediction")
        return (f"you predicted {format_value(self.guess, self.unit)}; {how}: {format_value(actual, self.unit)}: "
                f"{verdict(self.guess, actual, self.unit)}")

    @contextlib.contextmanager
    def working(self):
        """Show what the block prints and draws only once a guess is locked in; before, hold it back (the block
        still runs: the cells after it may need what it computes)."""
        if self.guess is not None:
            yield
            return
        with capture_output():
            yield
        print("(the working that gives the answer away appears here once a guess is locked in)")

    def __repr__(self) -> str:   # what a saved notebook shows before the cell is run again
        return f"Predict first: {self.question} (run this cell to answer)"


def reveal_cells(notebook) -> list:
    """The code cells of an nbformat notebook that reveal a prediction's answer (they call ``.reveal(``)."""
    return [cell for cell in notebook.cells if cell.cell_type == "code" and REVEAL_CALL.search(cell.source)]


def strip_reveal_outputs(notebook) -> int:
    """Empty the outputs of every reveal cell (so a committed notebook never shows an answer before a guess);
    returns how many cells had outputs."""
    stripped = 0
    for cell in reveal_cells(notebook):
        stripped += bool(cell.outputs)
        cell.outputs, cell.execution_count = [], None
    return stripped


def main(paths: list[str]) -> None:
    import nbformat
    for path in paths:
        notebook = nbformat.read(path, as_version=4)
        if strip_reveal_outputs(notebook):
            nbformat.write(notebook, path)
            print(f"{path}: reveal outputs stripped")


if __name__ == "__main__":
    main(sys.argv[1:])
