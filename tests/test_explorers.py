"""course_lib.explorers: every panel built with small arguments is a widget with its documented controls and
defaults, computes and draws at once, and redraws when a control changes: new numbers in the panel's
attributes (rows, memory, plan, runs, curves), a new figure (each figure a panel draws is recorded here, since
an Output widget only captures inside a kernel) and new printed text. The panels that run ranks (DDP overlap,
pipeline, TP speed when it must measure) run tiny settings and stop their ranks."""

import os
from dataclasses import dataclass

import ipywidgets as widgets
import matplotlib
import matplotlib.pyplot as plt
import pytest

from course_lib import explorers, plots
from course_lib.ledger import zero_state_bytes
from course_lib.mesh import Mesh
from course_lib.model import param_count_formula, preset
from course_lib.pipeline_parallel import Timeline
from course_lib.units import GiB

matplotlib.use("Agg")   # no window, on any machine


@dataclass
class Drawing:
    name: str
    args: tuple
    kwargs: dict
    figure: matplotlib.figure.Figure

    @property
    def title(self) -> str:
        """The figure's title, wherever the plot put it (suptitle or the first axes')."""
        ax = self.figure.axes[0]
        suptitle = self.figure._suptitle.get_text() if self.figure._suptitle else ""
        return suptitle or ax.get_title() or ax.get_title(loc="left")


@pytest.fixture
def drawn(monkeypatch):
    """Every figure a panel draws through course_lib.plots, in order."""
    drawings = []
    for name in [n for n, f in vars(plots).items() if callable(f) and getattr(f, "__module__", "") == plots.__name__]:
        def record(*args, _name=name, _draw=getattr(plots, name), **kwargs):
            figure = _draw(*args, **kwargs)
            drawings.append(Drawing(_name, args, kwargs, figure))
            return figure
        monkeypatch.setattr(plots, name, record)
    yield drawings
    plt.close("all")


def values(controls: dict) -> dict:
    return {name: control.value for name, control in controls.items()}


def every_option(panel, drawn, skip=()):
    """Set every control of ``panel`` to each of its values in turn: each change draws one more figure."""
    for name, control in panel.controls.items():
        if name in skip:
            continue
        options = control.options if hasattr(control, "options") else (control.min, control.max)
        for option in options:
            option = option[1] if isinstance(option, tuple) else option
            if option == control.value:
                continue
            before = len(drawn)
            control.value = option
            assert len(drawn) == before + 1, (name, option)


# ---- 00 · learning rate -------------------------------------------------------------------------------

def test_learning_rate_explorer_trains_each_rate_once_and_keeps_every_curve(drawn, monkeypatch):
    trained = []
    real = explorers.tiny_loss_curve
    monkeypatch.setattr(explorers, "tiny_loss_curve", lambda lr, steps: trained.append(lr) or real(lr, steps=steps))
    panel = explorers.learning_rate_explorer(steps=3)
    assert isinstance(panel, widgets.VBox)
    slider, out = panel.children
    assert isinstance(slider, widgets.SelectionSlider) and isinstance(out, widgets.Output)
    assert slider.value == 1e-2 and [v for _, v in slider.options] == list(explorers.LEARNING_RATES)
    assert not slider.continuous_update                              # trains on release, not while dragging
    assert trained == [1e-2] and list(panel.curves) == ["lr=0.01"] and len(panel.curves["lr=0.01"]) == 3
    assert [d.name for d in drawn] == ["loss_curves"] and drawn[0].kwargs["highlight"] == "lr=0.01"
    assert drawn[0].title.startswith("lr=0.01: loss ") and drawn[0].title.endswith(" in 3 steps")

    slider.value = 0.1
    assert trained == [1e-2, 0.1] and list(panel.curves) == ["lr=0.01", "lr=0.1"]
    assert drawn[-1].kwargs["highlight"] == "lr=0.1" and len(drawn[-1].figure.axes[0].get_lines()) >= 2
    slider.value = 1e-2                                              # explored already: redrawn, not retrained
    assert trained == [1e-2, 0.1] and len(drawn) == 3 and drawn[-1].kwargs["highlight"] == "lr=0.01"
    assert plt.get_fignums() == []                                   # each figure closed once shown


# ---- 01 · memory ----------------------------------------------------------------------------------------

def test_memory_explorer_starts_at_its_defaults_and_shows_both_activation_estimates(drawn, capsys):
    panel = explorers.memory_explorer()
    assert isinstance(panel, widgets.VBox) and isinstance(panel.children[-1], widgets.Output)
    assert values(panel.controls) == {"model": "Llama-2-7B", "hidden": 4096, "layers": 32, "convention": "mixed",
                                      "batch_size": 1, "seq_len": 4096, "recompute": "none",
                                      "gpu": "80 GiB (A100 80GB)"}
    assert panel.controls["hidden"].layout.display == panel.controls["layers"].layout.display == "none"
    assert list(panel.rows) == ["course model (Llama layer, SDPA)", "GPT-3 formula (16-bit activations)"]
    params = param_count_formula(preset("llama2-7b"))
    state = zero_state_bytes(params, 0, 1)
    for parts in panel.rows.values():
        assert {k: parts[k] for k in ("weights", "grads", "optimizer")} == {k: state[k] for k in
                                                                            ("weights", "grads", "optimizer")}
    (drawing,) = drawn
    assert drawing.name == "memory_bars" and drawing.args[0] is panel.rows
    assert drawing.kwargs["capacity_bytes"] == 80 * GiB and drawing.kwargs["capacity_label"] == "80 GiB (A100 80GB)"
    assert drawing.title.startswith("Llama-2-7B (6.74B params), mixed, batch 1 × 4096 tokens, recompute none")
    shown = capsys.readouterr().out
    assert shown.count("does not fit") == 2                      # 7B, mixed, 4096 tokens: over 80 GiB either way


def test_memory_explorer_redraws_for_a_smaller_model_recomputation_and_a_custom_model(drawn, capsys):
    panel = explorers.memory_explorer()
    capsys.readouterr()
    panel.controls["model"].value = "tiny"
    assert "tiny (" in drawn[-1].title and capsys.readouterr().out.count(" fits") == 2
    before = {row: parts["activations"] for row, parts in panel.rows.items()}
    panel.controls["recompute"].value = "full"
    after = {row: parts["activations"] for row, parts in panel.rows.items()}
    assert all(after[row] < before[row] for row in before) and drawn[-1].title.endswith("recompute full")
    panel.controls["model"].value = "custom"
    assert panel.controls["hidden"].layout.display is None and panel.controls["layers"].layout.display is None
    panel.controls["hidden"].value, panel.controls["layers"].value = 512, 2
    custom = param_count_formula(explorers._custom_config(512, 2))
    assert panel.rows["GPT-3 formula (16-bit activations)"]["weights"] == 2 * custom
    assert drawn[-1].title.startswith(f"custom ({custom:,} params)") and len(drawn) == 6


def test_memory_explorer_draws_every_setting_of_every_control(drawn):
    panel = explorers.memory_explorer(model="custom", seq_len=128)
    every_option(panel, drawn)
    assert len(drawn) > 30 and plt.get_fignums() == []


# ---- 03 · ZeRO ------------------------------------------------------------------------------------------

def test_zero_explorer_shows_every_stage_and_highlights_the_chosen_one(drawn, capsys):
    panel = explorers.zero_explorer()
    assert isinstance(panel, widgets.VBox)
    assert values(panel.controls) == {"model": "Llama-2-7B", "hidden": 4096, "layers": 32, "stage": 1, "ranks": 8,
                                      "convention": "mixed", "gpu": "80 GiB (A100 80GB)"}
    names = list(plots.ZERO_STAGE_NAMES.values())
    assert list(panel.memory) == list(panel.wire) == names
    totals = [panel.memory[name]["total"] for name in names]
    assert totals == sorted(totals, reverse=True) and panel.wire["ZeRO-3"] == pytest.approx(1.5 * panel.wire[names[0]])
    (drawing,) = drawn
    assert drawing.name == "zero_explorer_figure" and drawing.kwargs["highlight"] == "ZeRO-1"
    assert "ZeRO-1 on 8 ranks" in capsys.readouterr().out

    memory = dict(panel.memory)
    panel.controls["stage"].value = 3
    assert drawn[-1].kwargs["highlight"] == "ZeRO-3" and panel.memory == memory    # the same numbers, redrawn
    assert "ZeRO-3 on 8 ranks" in capsys.readouterr().out
    panel.controls["ranks"].value = 64
    assert panel.memory["ZeRO-3"]["total"] < memory["ZeRO-3"]["total"] and "64 ranks" in drawn[-1].title
    panel.controls["model"].value = "custom"
    assert panel.controls["hidden"].layout.display is None and len(drawn) == 4


def test_zero_explorer_draws_every_setting_of_every_control(drawn):
    every_option(explorers.zero_explorer(model="custom"), drawn)


# ---- 06 · the plan ----------------------------------------------------------------------------------------

def test_plan_explorer_answers_the_three_questions_and_redraws_for_fewer_gpus(drawn, capsys):
    panel = explorers.plan_explorer()
    assert values(panel.controls) == {"model": "Llama-2-70B", "gpus": 32, "gpu": "80 GiB (A100 80GB)",
                                      "per_node": 8}
    assert panel.plan.fits and (panel.plan.mesh, panel.plan.zero_stage) == (Mesh(dp=2, tp=8, pp=2), 1)
    (drawing,) = drawn
    rows = list(drawing.args[0])
    assert len(rows) == 5 and rows[-1] == "plan: dp2×tp8×pp2, ZeRO-1"       # 4 ZeRO rungs, then the plan
    assert drawing.kwargs["capacity_bytes"] == 80 * GiB
    shown = capsys.readouterr().out
    assert str(panel.plan) in shown and "bad smell" not in shown

    panel.controls["gpus"].value = 8
    assert not panel.plan.fits and len(drawn[-1].args[0]) == 4 and "on 8 GPUs" in drawn[-1].title
    panel.controls["model"].value = "tiny"
    assert panel.plan.fits and drawn[-1].title.startswith("tiny on 8 GPUs")


def test_plan_explorer_prints_an_impossible_request_and_every_bad_smell(drawn, capsys, monkeypatch):
    panel = explorers.plan_explorer()
    capsys.readouterr()
    monkeypatch.setattr(explorers, "bad_smells", lambda *args, **kwargs: ["TP 16 does not fit in the nodes"])
    panel.controls["gpu"].value = "40 GiB (A100 40GB)"
    assert "bad smell: TP 16 does not fit in the nodes" in capsys.readouterr().out

    def refuse(*args, **kwargs):   # the controls offer no such request: a stand-in for plan's ValueErrors
        raise ValueError("num_gpus=12 must be a whole number of nodes")
    monkeypatch.setattr(explorers, "plan", refuse)
    panel.controls["gpus"].value = 16
    assert panel.plan is None and len(drawn) == 2                    # no new figure, the message instead
    assert "num_gpus=12 must be a whole number of nodes" in capsys.readouterr().out


# ---- 04 · TP speed ----------------------------------------------------------------------------------------

def measured_rows():
    return [{"hidden": 64, "tp": 2, "one_rank_s": 0.002, "tp_s": 0.004, "comm_s": 0.002},
            {"hidden": 128, "tp": 2, "one_rank_s": 0.010, "tp_s": 0.008, "comm_s": 0.003},
            {"hidden": 64, "tp": 4, "one_rank_s": 0.002, "tp_s": 0.006, "comm_s": 0.004}]


def test_tp_speed_explorer_shows_measured_rows_without_running_them_again(drawn, capsys, monkeypatch):
    measured = []
    monkeypatch.setattr(explorers, "measure_tp_speed", lambda hiddens, tp: measured.append((hiddens, tp)) or [
        {"hidden": hiddens[0], "tp": tp, "one_rank_s": 0.010, "tp_s": 0.020, "comm_s": 0.012}])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})       # a 2-core laptop
    panel = explorers.tp_speed_explorer(measured_rows(), hiddens=(64, 128), tps=(2, 4))
    assert isinstance(panel, widgets.VBox) and values(panel.controls) == {"hidden": 64, "tp": 2}
    assert measured == [] and len(panel.rows) == 3
    assert drawn[-1].name == "tp_speed" and drawn[-1].kwargs["highlight"] == (64, 2)
    assert "hidden 64: 1 rank 2.0 ms; TP=2 4.0 ms = 2.0 ms compute + 2.0 ms all-reduce → TP is 2.0× slower" in (
        capsys.readouterr().out)
    panel.controls["hidden"].value = 128
    assert measured == [] and drawn[-1].kwargs["highlight"] == (128, 2)
    assert "→ TP is 1.2× faster" in capsys.readouterr().out
    panel.controls["tp"].value = 4                                   # (128, 4) was not measured: measured now
    assert measured == [([128], 4)] and len(panel.rows) == 4 and drawn[-1].args[0] is panel.rows
    shown = capsys.readouterr().out
    assert "measuring hidden 128 on 1 rank and on TP=4 ..." in shown
    assert "(TP=4 here puts 4 ranks on 2 CPU cores" in shown
    panel.controls["hidden"].value = 64
    assert len(measured) == 1 and len(drawn) == 4


@pytest.mark.ranks
def test_tp_speed_explorer_measures_a_new_point_on_ranks(drawn):
    panel = explorers.tp_speed_explorer(hiddens=(64,), tps=(2,))
    (row,) = panel.rows
    assert (row["hidden"], row["tp"]) == (64, 2) and 0 < row["comm_s"] < row["tp_s"] and row["one_rank_s"] > 0
    assert [d.name for d in drawn] == ["tp_speed"]


# ---- 02 · DDP overlap (ranks) -----------------------------------------------------------------------------

@pytest.mark.ranks
def test_ddp_overlap_explorer_runs_each_setup_once_on_persistent_ranks(drawn, capsys):
    panel = explorers.ddp_overlap_explorer(world_sizes=(1, 2), ranks=1, bucket="naive: no buckets", steps=2,
                                           per_rank_batch=1, seq_len=8)
    try:
        assert isinstance(panel, widgets.VBox)
        assert values(panel.controls) == {"ranks": 1, "bucket": "naive: no buckets"}
        assert list(panel.controls["bucket"].options) == list(explorers.DDP_BUCKETS)
        assert list(panel.runs) == [(1, "naive: no buckets")] and len(panel.runs[1, "naive: no buckets"]) == 1
        assert [d.name for d in drawn] == ["step_time_split", "ddp_timeline"]
        assert list(drawn[0].args[0]) == ["naive: no buckets"] and drawn[0].kwargs["highlight"] == "naive: no buckets"
        assert "running 2 steps on 1 ranks..." in capsys.readouterr().out

        panel.controls["bucket"].value = "64 KiB"
        assert list(panel.runs) == [(1, "naive: no buckets"), (1, "64 KiB")]
        assert list(drawn[-2].args[0]) == ["naive: no buckets", "64 KiB"] and drawn[-2].kwargs["highlight"] == "64 KiB"
        panel.controls["ranks"].value = 2
        assert len(panel.runs[2, "64 KiB"]) == 2 and len(drawn[-1].args[0]) == 2        # a timeline row per rank
        assert list(drawn[-2].args[0]) == ["64 KiB"]                     # only the setups run on 2 ranks
        panel.controls["ranks"].value = 1                                # cached: redrawn without running
        assert len(panel.runs) == 3 and len(drawn) == 8
    finally:
        panel.stop_ranks()


# ---- 05 · pipeline (ranks) --------------------------------------------------------------------------------

@pytest.mark.ranks
def test_pipeline_explorer_measures_each_setting_once_beside_the_formula(drawn, capsys):
    panel = explorers.pipeline_explorer(num_stages=2, num_microbatches=1, op_ms=2, steps=1)
    try:
        assert isinstance(panel, widgets.VBox)
        assert values(panel.controls) == {"stages": 2, "microbatches": 1, "schedule": "1f1b", "cost": 1.0}
        timeline = panel.runs[2, 1, "1f1b", 1.0]
        assert isinstance(timeline, Timeline) and timeline.num_stages == 2 and len(timeline.events) == 2 * 2
        (drawing,) = drawn
        assert drawing.name == "pipeline_gantt" and drawing.args[0] is timeline
        assert drawing.kwargs["title"].startswith("1f1b, p = 2, m = 1: measured bubble")
        shown = capsys.readouterr().out
        assert "formula          50.0%   (p-1)/(m+p-1) = 1/2\n" in shown and "per stage: [1, 1]" in shown

        panel.controls["microbatches"].value = 2
        panel.controls["schedule"].value = "gpipe"
        assert list(panel.runs)[1:] == [(2, 2, "1f1b", 1.0), (2, 2, "gpipe", 1.0)]
        shown = capsys.readouterr().out
        assert "per stage: [2, 1]" in shown and "per stage: [2, 2]" in shown   # 1F1B holds fewer than GPipe
        panel.controls["cost"].value = 2.0
        assert "it assumes equal stages, and these are not" in capsys.readouterr().out
        panel.controls["cost"].value = 1.0
        panel.controls["schedule"].value = "1f1b"                        # both cached: redrawn without running
        assert len(panel.runs) == 4 and len(drawn) == 6
    finally:
        panel.stop_ranks()
