"""ipywidgets panels the notebooks share. Each computes what it shows for real, caching what it has run."""

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import display

from . import plots
from .train import tiny_loss_curve

LEARNING_RATES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)


def learning_rate_explorer(rates=LEARNING_RATES, value=1e-2, steps=40):
    """A slider over learning rates → the tiny model's loss curve at that rate, trained for real.

    Curves already explored stay on the plot in grey, so a learner sees too small (slow), right, and too
    large (noisy, or stuck above the start) side by side.
    """
    curves = {}
    slider = widgets.SelectionSlider(options=[(f"{lr:g}", lr) for lr in rates], value=value,
                                     description="learning rate", continuous_update=False,
                                     layout=widgets.Layout(width="420px"))
    out = widgets.Output()

    def show(_=None):
        label = f"lr={slider.value:g}"
        if label not in curves:
            curves[label] = tiny_loss_curve(slider.value, steps=steps)
        with out:
            out.clear_output(wait=True)
            losses = curves[label]
            fig = plots.loss_curves(curves, highlight=label, vocab_size=128,
                                    title=f"{label}: loss {losses[0]:.2f} → {losses[-1]:.2f} in {steps} steps")
            display(fig)
            plt.close(fig)

    slider.observe(show, names="value")
    show()
    panel = widgets.VBox([slider, out])
    panel.curves = curves  # what was trained, for a notebook cell to inspect
    return panel
