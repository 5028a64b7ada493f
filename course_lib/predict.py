"""Predict first: a learner commits to a number before the cell that works it out, and that cell shows both.

    guess = Prediction("p = 8 stages, m = 8 micro-batches: what share of the step does a GPU idle?", unit="%")
    guess                         # the question, a number box and a "lock it in" button
    ...
    print(guess.reveal(46.7))     # "you predicted 20 %; the formula: 46.7 % (26.7 off)"

A guess made before the answer is seen is what makes the answer stick; one that was never made is said so.
"""

import ipywidgets as widgets


class Prediction(widgets.VBox):
    """A question, a number box and a "lock it in" button; ``guess`` holds the locked-in number, or None."""

    def __init__(self, question: str, *, unit: str = "", low: float = 0.0, high: float = 100.0, step: float = 1.0):
        self.question, self.unit, self.guess = question, unit, None
        self.box = widgets.BoundedFloatText(value=low, min=low, max=high, step=step, description="my guess",
                                            layout=widgets.Layout(width="220px"))
        self.button = widgets.Button(description="lock it in", button_style="info")
        self.note = widgets.HTML()
        self.button.on_click(self.lock)
        super().__init__([widgets.HTML(f"<b>Predict first.</b> {question}"),
                          widgets.HBox([self.box, widgets.Label(unit), self.button]), self.note])

    def lock(self, _=None) -> None:
        self.guess = self.box.value
        self.box.disabled = self.button.disabled = True
        self.note.value = f"Locked in: {self.guess:g} {self.unit}. Now run the cells below."

    def reveal(self, actual: float, how: str = "measured") -> str:
        """One line for the cell that works the number out: the guess beside the answer."""
        if self.guess is None:
            return f"{how}: {actual:.3g} {self.unit} (no prediction locked in above: make one next time first)"
        return f"you predicted {self.guess:g} {self.unit}; {how}: {actual:.3g} {self.unit} ({actual - self.guess:+.3g})"

    def __repr__(self) -> str:   # what a saved notebook shows before the cell is run again
        return f"Predict first: {self.question} (run this cell to answer)"
