"""course_lib.presentation.explorers: every panel built with small arguments is a widget with its documented controls and
defaults, computes and draws at once, and redraws when a control changes: new numbers in the panel's
attributes (rows, memory, plan, runs, curves), a new figure (each figure a panel draws is recorded here, since
an Output widget only captures inside a kernel) and new printed text. Here the formula panels (memory, ZeRO,
the plan) and what every panel shares: a panel says what it is where no kernel draws it. The panels that
compute for real (learning rate, TP speed, and the ones that run ranks: DDP overlap, pipeline) are in
tests/test_explorers_live.py, which also checks that a panel ends showing what its controls say, even when they
change while it works."""

import base64
import html
from dataclasses import dataclass

import ipywidgets as widgets
import matplotlib
import matplotlib.figure
import matplotlib.pyplot as plt
import pytest

from course_lib.ledger import zero_state_bytes
from course_lib.mesh import Mesh
from course_lib.model import param_count_formula, preset
from course_lib.presentation import explorers, plots
from course_lib.presentation.explorers import formulas, live
from course_lib.presentation.explorers._panel import format_bytes, plural
from course_lib.recipes import Workload, memory_per_gpu
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
        """The title the panel asked for (how the figure sets it out, wrapped or not, is the plot's business)."""
        return self.kwargs["title"]


@pytest.fixture
def drawn(monkeypatch):
    """Every figure a panel draws through course_lib.presentation.plots, in order."""
    drawings = []
    for name in [n for n in plots.__all__ if callable(getattr(plots, n))]:
        def record(*args, _name=name, _draw=getattr(plots, name), **kwargs):
            figure = _draw(*args, **kwargs)
            if isinstance(figure, matplotlib.figure.Figure):   # not helpers such as speed_words
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
    custom = param_count_formula(formulas._custom_config(512, 2))
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

def test_plan_explorer_answers_the_five_questions_and_draws_every_recipe_with_its_activations(drawn, capsys):
    """Llama-2-70B on 32 × A100 80GB: the three questions' layout (dp 2 × tp 8 × pp 2, ZeRO-1) holds 42.3 GiB of
    state, but with its activations and the reserve it misses by under a GiB; a deeper pipeline (tp 8 × pp 4)
    fits without sequence parallelism, and with it the three questions' layout fits too."""
    panel = explorers.plan_explorer()
    assert values(panel.controls) == {"model": "Llama-2-70B", "gpus": 32, "gpu": "A100 80GB", "per_node": 8,
                                      "sequence_parallel": False, "recompute": "selective"}
    assert panel.plan.source == (Mesh(dp=2, tp=8, pp=2), 1) and panel.plan.fits
    assert (panel.plan.mesh, panel.plan.num_microbatches) == (Mesh(dp=1, tp=8, pp=4), 1024)
    (drawing,) = drawn
    rows = drawing.args[0]
    assert drawing.kwargs["capacity_bytes"] == 80 * GiB and drawing.kwargs["capacity_label"] == "A100 80GB"
    assert list(rows) == ["questions 1-3: dp2×tp8×pp2, ZeRO-1"] + [
        ("▶ " if i == 0 else "") + f"{c.recipe}: dp{c.mesh.dp}×tp{c.mesh.tp}×pp{c.mesh.pp}, "
        + ("no dp" if c.mesh.dp == 1 else f"ZeRO-{c.zero_stage}")
        for i, c in enumerate(panel.plan.candidates)]         # ▶: the chosen one, the fastest that fits
    source = memory_per_gpu(preset("llama2-70b"), Mesh(dp=2, tp=8, pp=2), 1, Workload(seq_len=4096),
                            gpu_bytes=80 * GiB)
    for parts, memory in zip(rows.values(), [source] + [c.memory for c in panel.plan.candidates]):
        assert list(parts) == ["weights", "grads", "optimizer", "activations", "reserve"]
        assert parts["reserve"] == 8 * GiB and parts["activations"] == memory["activations"]
        assert sum(parts.values()) == memory["total"]
    assert source["total"] > 80 * GiB
    shown = capsys.readouterr().out
    assert str(panel.plan) in shown and "4. with 1024 sequences of 4096 tokens" in shown and "it does NOT fit" in shown
    assert "TP + PP + ZeRO-1  dp1×tp8×pp4, no dp, m = 1024" in shown

    panel.controls["sequence_parallel"].value = True
    chosen = panel.plan
    assert chosen.fits and chosen.source == (Mesh(dp=2, tp=8, pp=2), 1) and chosen.memory["total"] <= 80 * GiB
    mesh = chosen.mesh
    bar = next(k for k in drawn[-1].args[0]
               if k.startswith(f"▶ TP + PP + FSDP: dp{mesh.dp}×tp{mesh.tp}×pp{mesh.pp}"))
    assert "sequence parallel" in drawn[-1].title and sum(drawn[-1].args[0][bar].values()) == chosen.memory["total"]
    shown = capsys.readouterr().out
    assert "5. fastest that fits: TP + PP + FSDP" in shown and f"{chosen.time.tokens_per_s:>10,.0f}" in shown
    # FSDP's traffic half hidden (recipes.framework_overlap): the pipeline without dp comes second, a tie
    assert "TP + PP + ZeRO-1 0.98× as fast" in shown and "a tie: closer than the cost model can tell" in shown

    panel.controls["gpu"].value = "H100 SXM"                  # the same 80 GiB, three times the FLOP/s
    assert panel.plan.time.tokens_per_s > 2 * chosen.time.tokens_per_s and "H100 SXM 80GB" in capsys.readouterr().out
    panel.controls["gpu"].value = "A100 80GB"
    panel.controls["sequence_parallel"].value = False
    panel.controls["recompute"].value = "full"                # the other way to make it fit
    assert panel.plan.fits and panel.plan.memory["activations"] < chosen.memory["activations"]

    panel.controls["gpus"].value = 8                          # not even the state fits: the ZeRO ladder, state only
    assert not panel.plan.fits and panel.plan.source is None and "on 8 GPUs" in drawn[-1].title
    assert list(drawn[-1].args[0]) == [f"{name} over 8 (state only)" for name in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")]
    assert "at least 13 GPUs" in capsys.readouterr().out
    assert "tiny" not in panel.controls["model"].options       # 4,096 tokens and a share of peak mean nothing there
    panel.controls["model"].value = "1B (TinyLlama-1.1B)"
    assert panel.plan.fits and drawn[-1].title.startswith("1B (TinyLlama-1.1B) on 8 GPUs")
    assert "full recomputation" in drawn[-1].title
    panel.controls["recompute"].value = "none"
    assert "no recomputation" in drawn[-1].title


def test_plan_explorer_marks_one_chosen_recipe_and_labels_layouts_that_differ_in_bytes_apart(drawn):
    """1B on one GPU: several recipes end at dp1×tp1×pp1, but only the fastest is chosen, and ZeRO-3's bar (one
    layer gathered beside its shards) is labelled apart from the others, which hold the same bytes."""
    panel = explorers.plan_explorer(model="1B (TinyLlama-1.1B)", num_gpus=1, recompute="full")
    rows = drawn[-1].args[0]
    assert panel.plan.fits and sum(label.startswith("▶ ") for label in rows) == 1
    assert next(iter(rows)).startswith("questions 1-3") and list(rows)[1].startswith("▶ " + panel.plan.candidates[0].recipe)
    by_label = {}
    for label, parts in rows.items():
        by_label.setdefault(label.split(": ", 1)[1], set()).add(sum(parts.values()))
    assert all(len(totals) == 1 for totals in by_label.values()), by_label
    assert "dp1×tp1×pp1, no dp, ZeRO-3's gathered layer" in by_label


def test_plan_explorer_prints_an_impossible_request_and_every_bad_smell(drawn, capsys, monkeypatch):
    panel = explorers.plan_explorer(sequence_parallel=True)
    assert panel.plan.fits and "bad smell" not in capsys.readouterr().out
    monkeypatch.setattr(formulas, "bad_smells", lambda *args, **kwargs: ["TP 16 does not fit in the nodes"])
    panel.controls["gpu"].value = "H200 SXM"
    assert "bad smell: TP 16 does not fit in the nodes" in capsys.readouterr().out

    def refuse(*args, **kwargs):   # the controls offer no such request: a stand-in for plan's ValueErrors
        raise ValueError("num_gpus=12 must be a whole number of nodes")
    monkeypatch.setattr(formulas, "plan", refuse)
    panel.controls["gpus"].value = 16
    assert panel.plan is None and len(drawn) == 2                    # no new figure, the message instead
    assert "num_gpus=12 must be a whole number of nodes" in capsys.readouterr().out


def test_plan_explorer_draws_every_setting_of_every_control(drawn):
    every_option(explorers.plan_explorer(), drawn)


def test_the_memory_and_zero_explorers_offer_the_catalogues_cards_and_a_learners_own():
    assert explorers.GPUS == {"24 GiB (RTX 4090)": 24 * GiB, "40 GiB (A100 40GB)": 40 * GiB,
                              "80 GiB (A100 80GB)": 80 * GiB, "80 GiB (H100 SXM)": 80 * GiB,
                              "141 GiB (H200 SXM)": 141 * GiB}


# ---- what every panel shares ------------------------------------------------------------------------------

def fake_measure(hiddens, tp):
    return [{"hidden": hiddens[0], "tp": tp, "one_rank_s": 0.010, "tp_s": 0.020, "comm_s": 0.012}]


@pytest.mark.parametrize("build", [
    lambda: explorers.learning_rate_explorer(steps=2),
    lambda: explorers.memory_explorer(),
    lambda: explorers.zero_explorer(),
    lambda: explorers.plan_explorer(),
    lambda: explorers.tp_speed_explorer(hiddens=(64,), tps=(2,)),
], ids=["learning_rate", "memory", "zero", "plan", "tp_speed"])
def test_a_panel_without_a_live_kernel_shows_a_sentence_and_its_figure_not_a_widget_repr(build, drawn, monkeypatch):
    monkeypatch.setattr(live, "measure_tp_speed", fake_measure)
    panel = build()
    bundle = panel._repr_mimebundle_()                               # what a notebook saves for the cell
    assert_says_what_it_is(panel, bundle)
    assert panel.figures == [drawn[-1].figure]


def assert_says_what_it_is(panel, bundle):
    """text/plain: a sentence, not "VBox(children=(..."; text/html: the sentence over a PNG of the first figure;
    the widget view still there, for a live kernel."""
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == panel.model_id
    sentence = bundle["text/plain"]
    assert sentence == f"▶ Run this cell to explore: {panel.what}" and len(panel.what) > 40
    assert "Box" not in sentence and "children=" not in sentence
    head, png = bundle["text/html"].split('<img src="data:image/png;base64,')
    assert head == f"<p><b>{html.escape(sentence, quote=False)}</b></p>"
    assert base64.b64decode(png.split('"')[0])[:8] == b"\x89PNG\r\n\x1a\n"


def test_numbers_and_counts_read_as_words():
    assert [plural(1, "rank"), plural(2, "rank"), plural(1, "GPU"), plural(1024, "GPU")] == [
        "1 rank", "2 ranks", "1 GPU", "1,024 GPUs"]
    assert plural(4, "micro-batch", "micro-batches") == "4 micro-batches"
    assert [format_bytes(b) for b in (0, 1000, 1536, 5 * 2**20, 24.1 * GiB, 3 * 2**40)] == [
        "0 bytes", "1,000 bytes", "1.5 KiB", "5.0 MiB", "24.1 GiB", "3.0 TiB"]


def test_the_zero_explorer_prints_the_tiny_model_in_units_that_show_it(drawn, capsys):
    panel = explorers.zero_explorer(model="tiny", zero_stage=3, ranks=2)
    shown = capsys.readouterr().out
    state = panel.memory["ZeRO-3"]["total"]
    assert 2**20 < state < 2**30 and "0.0 GiB" not in shown
    assert f"ZeRO-3 on 2 ranks: {state / 2**20:,.1f} MiB of training state per rank (fits" in shown
    panel.controls["ranks"].value = 1
    assert "ZeRO-3 on 1 rank: " in capsys.readouterr().out and drawn[-1].title.endswith("1 rank, mixed")


def test_the_memory_explorer_says_by_how_much_a_model_is_over_the_card(drawn, capsys):
    explorers.memory_explorer(model="1B (TinyLlama-1.1B)", seq_len=4096, gpu="24 GiB (RTX 4090)")
    shown = capsys.readouterr().out
    assert "× the card" not in shown and "GiB over the card" in shown


def test_stop_ranks_closes_every_group_and_says_so_without_returning_a_value(capsys):
    class Group:
        closed = 0

        def close(self):
            Group.closed += 1
    stop_ranks = live._stopper({2: Group(), 3: Group()})
    assert stop_ranks() is None and Group.closed == 2                # nothing for a cell to echo, like [None]
    assert stop_ranks() is None and Group.closed == 2
    assert capsys.readouterr().out == "stopped the explorer's 5 ranks\nthe explorer had no ranks running\n"


# ---- 10 · checkpoints and failures ------------------------------------------------------------------------

def test_failures_explorer_marks_youngs_interval_for_round_checkpoint_times(drawn):
    """The δ slider offers round seconds (8, not the 7.94 a log slider shows); each redraw marks Young's
    interval for the cluster's MTBF at Llama 3's rate, and 16 times the GPUs shortens it 4 times."""
    from course_lib import failures

    panel = explorers.failures_explorer()
    assert values(panel.controls) == {"gpus": 1024, "checkpoint_s": 8, "restart_min": 10}
    assert panel.best == pytest.approx(failures.young_interval(8, failures.mtbf_seconds(1024)))
    at_1024 = panel.best
    panel.controls["gpus"].value = 16384
    assert panel.best == pytest.approx(at_1024 / 4) and drawn[-1].name == "checkpoint_waste"
    every_option(panel, drawn)
