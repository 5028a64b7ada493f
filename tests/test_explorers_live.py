"""course_lib.presentation.explorers.live: the panels that compute for real. The learning-rate panel trains
each rate once and keeps every curve; TP speed shows measured rows without running them again, measures a new
point (on ranks), and ends showing what its controls say when they move during a measurement; DDP overlap and
the pipeline run tiny settings on persistent ranks, once per setting, and stop them. tests/test_explorers.py
checks the formula panels and what every panel shares."""

import os

import ipywidgets as widgets
import matplotlib
import matplotlib.pyplot as plt
import pytest
import test_explorers
from test_explorers import assert_says_what_it_is, values

from course_lib.pipeline_parallel import Timeline
from course_lib.presentation import explorers
from course_lib.presentation.explorers import live

matplotlib.use("Agg")   # no window, on any machine
drawn = test_explorers.drawn   # the fixture: every figure a panel draws through course_lib.presentation.plots, in order


# ---- 00 · learning rate -------------------------------------------------------------------------------

def test_learning_rate_explorer_trains_each_rate_once_and_keeps_every_curve(drawn, monkeypatch):
    trained, disabled_while_training, panel = [], [], None
    real = live.tiny_loss_curve

    def train(lr, steps):                                            # the real training, watched
        trained.append(lr)
        if panel is not None:                                        # (not while the panel is being built)
            disabled_while_training.append(panel.controls["lr"].disabled)
        return real(lr, steps=steps)
    monkeypatch.setattr(live, "tiny_loss_curve", train)
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
    assert disabled_while_training == [True] and not slider.disabled     # disabled while training only
    label_px = int(slider.style.description_width.removesuffix("px"))
    assert label_px >= 8 * len("learning rate")                      # the label is not cut to "learning r..."


# ---- 04 · TP speed ----------------------------------------------------------------------------------------

def measured_rows():
    return [{"hidden": 64, "tp": 2, "one_rank_s": 0.002, "tp_s": 0.004, "comm_s": 0.002},
            {"hidden": 128, "tp": 2, "one_rank_s": 0.010, "tp_s": 0.008, "comm_s": 0.003},
            {"hidden": 64, "tp": 4, "one_rank_s": 0.002, "tp_s": 0.006, "comm_s": 0.004}]


def test_tp_speed_explorer_shows_measured_rows_without_running_them_again(drawn, capsys, monkeypatch):
    measured = []
    monkeypatch.setattr(live, "measure_tp_speed", lambda hiddens, tp: measured.append((hiddens, tp)) or [
        {"hidden": hiddens[0], "tp": tp, "one_rank_s": 0.010, "tp_s": 0.020, "comm_s": 0.012}])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})       # a 2-core laptop
    panel = explorers.tp_speed_explorer(measured_rows(), hiddens=(64, 128), tps=(2, 4))
    assert isinstance(panel, widgets.VBox) and values(panel.controls) == {"hidden": 64, "tp": 2}
    assert measured == [] and len(panel.rows) == 3
    assert drawn[-1].name == "tp_speed" and drawn[-1].kwargs["highlight"] == (64, 2)
    assert "hidden 64: 1 rank 2.0 ms; TP=2 4.0 ms = 2.0 ms compute + 2.0 ms all-reduce → TP: 2.0× slower" in (
        capsys.readouterr().out)
    panel.controls["hidden"].value = 128
    assert measured == [] and drawn[-1].kwargs["highlight"] == (128, 2)
    assert "→ TP: 1.2× faster" in capsys.readouterr().out
    panel.controls["tp"].value = 4                                   # (128, 4) was not measured: measured now
    assert measured == [([128], 4)] and len(panel.rows) == 4 and drawn[-1].args[0] is panel.rows
    shown = capsys.readouterr().out
    assert "measuring hidden 128 on 1 rank and on TP=4… (~1 s)" in shown    # 1 s + 6 × 8 ms × (128/64)²
    assert "(TP=4 here puts 4 ranks on 2 CPU cores" in shown
    panel.controls["hidden"].value = 64
    assert len(measured) == 1 and len(drawn) == 4


def test_tp_speed_explorer_ends_showing_what_the_controls_say_when_they_move_during_a_measurement(
        drawn, capsys, monkeypatch):
    calls, running = [], []

    def measure(hiddens, tp):        # a learner moves both controls while (256, 2) is being measured
        assert not running and all(c.disabled for c in panel.controls.values())    # no re-entry; busy
        running.append(True)
        calls.append((hiddens[0], tp))
        if len(calls) == 1:
            panel.controls["hidden"].value, panel.controls["tp"].value = 128, 4      # (128, 4): not measured
        running.pop()
        return [{"hidden": hiddens[0], "tp": tp, "one_rank_s": 0.010, "tp_s": 0.020, "comm_s": 0.012}]
    monkeypatch.setattr(live, "measure_tp_speed", measure)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))   # no note on sharing cores
    panel = explorers.tp_speed_explorer(measured_rows(), hiddens=(64, 128, 256), tps=(2, 4))
    capsys.readouterr()
    panel.controls["hidden"].value = 256
    assert calls == [(256, 2), (128, 4)]                             # the latest request measured after the first
    assert values(panel.controls) == {"hidden": 128, "tp": 4} and drawn[-1].kwargs["highlight"] == (128, 4)
    shown = capsys.readouterr().out
    assert "measuring hidden 256 on 1 rank and on TP=2… (~" in shown
    last_line = shown.rstrip().splitlines()[-1].split("\r")[-1]     # (after clear_output's "erase line")
    assert last_line.startswith("hidden 128: 1 rank 10.0 ms; TP=4 20.0 ms")
    assert not any(c.disabled for c in panel.controls.values())      # enabled again
    assert panel.figures == [drawn[-1].figure]                       # the picture is the figure shown last


def test_a_panel_is_re_enabled_and_usable_after_its_work_fails(drawn, monkeypatch):
    def fail(hiddens, tp):
        raise RuntimeError("a rank died")
    monkeypatch.setattr(live, "measure_tp_speed", fail)
    panel = explorers.tp_speed_explorer(measured_rows(), hiddens=(64, 128, 256), tps=(2, 4))
    with pytest.raises(RuntimeError, match="a rank died"):           # in a kernel the output area shows it
        panel.controls["hidden"].value = 256
    assert not any(c.disabled for c in panel.controls.values())
    panel.controls["hidden"].value = 128                             # measured already: drawn
    assert drawn[-1].kwargs["highlight"] == (128, 2)


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
                                           micro_batch_size=1, seq_len=8)
    try:
        assert isinstance(panel, widgets.VBox)
        assert values(panel.controls) == {"ranks": 1, "bucket": "naive: no buckets"}
        assert list(panel.controls["bucket"].options) == list(explorers.DDP_BUCKETS)
        assert list(panel.runs) == [(1, "naive: no buckets")] and len(panel.runs[1, "naive: no buckets"]) == 1
        assert [d.name for d in drawn] == ["step_time_split", "ddp_timeline"]
        assert list(drawn[0].args[0]) == ["naive: no buckets"] and drawn[0].kwargs["highlight"] == "naive: no buckets"
        assert "starting 1 rank, then running 2 steps on 1 rank…" in capsys.readouterr().out

        panel.controls["bucket"].value = "64 KiB"
        assert list(panel.runs) == [(1, "naive: no buckets"), (1, "64 KiB")]
        assert list(drawn[-2].args[0]) == ["naive: no buckets", "64 KiB"] and drawn[-2].kwargs["highlight"] == "64 KiB"
        panel.controls["ranks"].value = 2
        assert len(panel.runs[2, "64 KiB"]) == 2 and len(drawn[-1].args[0]) == 2        # a timeline row per rank
        assert list(drawn[-2].args[0]) == ["64 KiB"]                     # only the setups run on 2 ranks
        panel.controls["ranks"].value = 1                                # cached: redrawn without running
        assert len(panel.runs) == 3 and len(drawn) == 8
        assert not any(c.disabled for c in panel.controls.values())
        assert panel.figures == [d.figure for d in drawn[-2:]]           # the step-time split is pictured
        assert_says_what_it_is(panel, panel._repr_mimebundle_())
    finally:
        assert panel.stop_ranks() is None
    assert capsys.readouterr().out.endswith("stopped the explorer's 3 ranks\n")     # 1 + 2


# ---- 05 · pipeline (ranks) --------------------------------------------------------------------------------

@pytest.mark.ranks
def test_pipeline_explorer_measures_each_setting_once_beside_the_formula(drawn, capsys):
    panel = explorers.pipeline_explorer(num_stages=2, num_microbatches=1, op_ms=2, steps=1)
    try:
        assert isinstance(panel, widgets.VBox)
        assert values(panel.controls) == {"stages": 2, "microbatches": 1, "schedule": "1f1b", "cost": 1.0,
                                          "chunks": 2, "weight": 0.5}
        assert panel.controls["chunks"].layout.display == panel.controls["weight"].layout.display == "none"
        timeline = panel.runs[2, 1, "1f1b", 1.0, 1, 0.5]
        assert isinstance(timeline, Timeline) and timeline.num_stages == 2 and len(timeline.events) == 2 * 2
        (drawing,) = drawn
        assert drawing.name == "pipeline_gantt" and drawing.args[0] is timeline
        assert drawing.kwargs["title"].startswith("1f1b, p = 2, m = 1: measured bubble")
        shown = capsys.readouterr().out
        assert "formula          50.0%   (p-1)/(m+p-1) = 1/2\n" in shown and "per stage: [1, 1]" in shown
        assert "starting 2 ranks, then running 1 micro-batch through 2 stages, 1f1b… (~1 s)" in shown

        panel.controls["microbatches"].value = 2
        panel.controls["schedule"].value = "gpipe"
        assert list(panel.runs)[1:] == [(2, 2, "1f1b", 1.0, 1, 0.5), (2, 2, "gpipe", 1.0, 1, 0.5)]
        shown = capsys.readouterr().out
        assert "per stage: [2, 1]" in shown and "per stage: [2, 2]" in shown   # 1F1B holds fewer than GPipe
        panel.controls["cost"].value = 2.0
        assert "it assumes equal stages, and these are not" in capsys.readouterr().out
        panel.controls["cost"].value = 1.0
        panel.controls["schedule"].value = "1f1b"                        # both cached: redrawn without running
        assert len(panel.runs) == 4 and len(drawn) == 6
        assert not any(c.disabled for c in panel.controls.values())
        assert_says_what_it_is(panel, panel._repr_mimebundle_())

        capsys.readouterr()
        panel.controls["schedule"].value = "interleaved"                 # v = 2 chunks per rank, p = 2, m = 2
        assert panel.controls["chunks"].layout.display is None and panel.controls["weight"].layout.display == "none"
        assert drawn[-1].kwargs["title"].startswith("interleaved, p = 2, m = 2, v = 2")
        shown = capsys.readouterr().out
        assert "formula          20.0%   (p-1)/(v·m+p-1) = 1/5" in shown and "chunk micro-batches" in shown
        panel.controls["microbatches"].value = 1                         # not a multiple of p: named, not drawn
        assert len(drawn) == 7 and "interleaved refuses this setting" in capsys.readouterr().out
        panel.controls["stages"].value, panel.controls["chunks"].value = 3, 4
        assert "p·v = 3·4 = 12 virtual stages for a model of 8 layers" in capsys.readouterr().out
        panel.controls["stages"].value, panel.controls["microbatches"].value = 2, 4
        panel.controls["schedule"].value = "zb-h1"
        panel.controls["weight"].value = 0.25                            # T_W = ¼ of a backward, T_B = ¾
        assert list(panel.runs)[-2:] == [(2, 4, "zb-h1", 1.0, 1, 0.5), (2, 4, "zb-h1", 1.0, 1, 0.25)]
        assert "T_B = 0.75·T_F, T_W = 0.25·T_F" in capsys.readouterr().out
    finally:
        assert panel.stop_ranks() is None
