"""10 · checkpoints and failures: the share of a run lost against the checkpoint interval (Young/Daly)."""

import matplotlib.pyplot as plt
import numpy as np

from ...failures import waste_fraction, young_interval


def checkpoint_waste(checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0, *, step_s: float | None = None,
                     title: str | None = None, ax=None):
    """waste(τ) = δ/τ + τ/(2M) + R/M against the interval τ (log scale), its two moving terms dashed, Young's
    optimum marked, and (``step_s``) the interval of checkpointing every step."""
    best = young_interval(checkpoint_s, mtbf_s)
    low = min(best / 100, step_s or best / 100)
    intervals = np.geomspace(low, min(best * 100, mtbf_s), 200)
    parts = [waste_fraction(t, checkpoint_s, mtbf_s, restart_s) for t in intervals]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.6))
    ax.plot(intervals / 60, [100 * p["total"] for p in parts], color="black", label="total lost")
    ax.plot(intervals / 60, [100 * p["checkpoint"] for p in parts], "--", color="tab:blue", label="writing checkpoints δ/τ")
    ax.plot(intervals / 60, [100 * p["lost_work"] for p in parts], "--", color="tab:red",
            label="work redone after a failure τ/2M")
    at_best = waste_fraction(best, checkpoint_s, mtbf_s, restart_s)["total"]
    ax.plot([best / 60], [100 * at_best], "o", color="black")
    # the optimum's words in the corner, not beside the point (the curve runs through any spot near it), and the
    # legend outside the axes (at few GPUs the curves fill the whole box)
    ax.text(0.98, 0.96, f"Young: every {best / 60:.0f} min, {at_best:.1%} lost", transform=ax.transAxes,
            ha="right", va="top", fontsize=9)
    if step_s is not None:
        ax.axvline(step_s / 60, color="grey", lw=0.8)
        ax.annotate("every step", (step_s / 60, 50), textcoords="offset points", xytext=(4, 0), color="grey")
    ax.set(xscale="log", yscale="log", xlabel="checkpoint interval τ (minutes)",
           ylabel="share lost (%, first order:\nδ ≪ τ assumed)", ylim=(0.05, 100), title=title or "")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.figure.tight_layout()
    return ax.figure
