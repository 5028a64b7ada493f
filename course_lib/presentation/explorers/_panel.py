"""What every explorer shares: the panel (controls over an output area), its redraw loop, its busy state, and
the words and numbers it prints.

How a panel reaches the screen. A cell that ends with a panel saves three representations of it:
``application/vnd.jupyter.widget-view+json`` (the live widget), ``text/html`` (a sentence over a picture of
its first figure) and ``text/plain`` (the sentence). JupyterLab 4 draws the first one, in the order of its
renderers' ranks, that it can: the widget's renderer ranks first (-10) but only exists once a kernel runs for
the notebook, and is never used for untrusted output, such as a notebook freshly cloned. There the sentence
and picture (HTML, rank 50) come next, ahead of text/plain (rank 120), which used to be the widget's repr:
``VBox(children=(SelectionSlider(...``.
"""

import base64
import html
from contextlib import contextmanager

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.core.pylabtools import print_figure
from IPython.display import display

from ...units import GiB, KiB, MiB, TiB


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """'1 rank', '2 ranks': the count and its noun, singular for exactly one (``nouns``: an irregular plural)."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {nouns or noun + 's'}"


def format_bytes(num_bytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number at 1 or more: '1.5 MiB', never '0.0 GiB'."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if num_bytes >= size:
            return f"{num_bytes / size:,.1f} {unit}"
    return f"{num_bytes:,.0f} bytes"


def about(seconds: float | None) -> str:
    """' (~3 s)': how long a run should take, for a busy message; nothing when it cannot be told."""
    return "" if seconds is None else f" (~{max(1, round(seconds))} s)"


def settle(controls: dict) -> None:
    """One label width for all of a panel's controls, wide enough for the longest description (8 px a
    character covers JupyterLab's 13 px sans-serif, so no label is cut to "learning r..."), and a redraw only
    when a control is released, not while it is dragged: every redraw computes for real."""
    width = 8 * max(len(control.description) for control in controls.values())
    for control in controls.values():
        control.style.description_width = f"{width}px"
        if hasattr(control, "continuous_update"):
            control.continuous_update = False


class ExplorerPanel(widgets.VBox):
    """Controls over an output area that shows what the controls say. ``what`` finishes the sentence a fresh
    notebook shows in place of the widget: "▶ Run this cell to explore: <what>".

    ``redraw_on_change(show)`` calls ``show(chosen)``, chosen = {control name: value}, now and after each
    change; ``show`` prints and calls ``draw(figure)``, inside ``busy(message)`` for work that takes seconds.
    """

    def __init__(self, rows: list, controls: dict, what: str):
        self.controls = controls          # a notebook cell may set their values and read what the panel keeps
        self.what = what
        self.out = widgets.Output()
        self.figures = []                 # the figures of the latest redraw, in order
        self._showing = False
        settle(controls)
        super().__init__([*rows, self.out])

    def chosen(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def redraw_on_change(self, show) -> None:
        """Call ``show(chosen)`` now, and whenever a control's value changes; the latest request wins.

        A change that comes while ``show`` runs (made inside it, or by a learner) does not start a second
        ``show`` on top of the first. When ``show`` returns, the panel compares what it showed with what the
        controls say now, and shows again until the two agree: it always ends showing what the controls say.
        """
        def on_change(_=None):
            if self._showing:
                return                    # the running loop below sees the new value when its show ends
            self._showing = True
            try:
                shown = None
                while shown != (wanted := self.chosen()):
                    with self.out:
                        self.out.clear_output(wait=True)
                        self.figures = []
                        show(wanted)
                    shown = wanted
            finally:
                self._showing = False

        for control in self.controls.values():
            control.observe(on_change, names="value")
        on_change()

    @contextmanager
    def busy(self, message: str):
        """For work that takes seconds: ``message`` in the output area and every control disabled while it
        runs, so a learner sees the panel working and cannot ask for something else meanwhile."""
        print(message, flush=True)
        for control in self.controls.values():
            control.disabled = True
        try:
            yield
        finally:
            for control in self.controls.values():
                control.disabled = False
            self.out.clear_output(wait=True)    # the message goes when the next output comes

    def draw(self, figure) -> None:
        """Show ``figure`` in the output area and close it (pyplot keeps no copy); the panel keeps it for its
        picture (only the first figure of a redraw is pictured)."""
        display(figure)
        plt.close(figure)
        self.figures.append(figure)

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)      # the widget itself, for a live kernel
        sentence = f"▶ Run this cell to explore: {self.what}"
        bundle["text/plain"] = sentence
        bundle["text/html"] = f"<p><b>{html.escape(sentence, quote=False)}</b></p>"
        if self.figures:
            png = base64.b64encode(print_figure(self.figures[0], "png")).decode("ascii")
            bundle["text/html"] += (f'<img src="data:image/png;base64,{png}" '
                                    f'alt="the explorer\'s figure, as it was when the notebook was saved">')
        return bundle
