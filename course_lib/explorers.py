"""ipywidgets panels the notebooks share. Each computes what it shows for real, caching what it has run."""

import os

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
from IPython.display import display

from . import plots
from .ledger import CONVENTIONS, activation_bytes, gpt_activation_bytes, zero_state_bytes
from .mesh import Mesh
from .model import ModelConfig, build, param_count_formula, preset
from .pipeline_parallel import Timeline, bubble_fraction, simulate
from .plan import bad_smells, plan, stage_name, state_per_gpu
from .runs.ddp import phase_seconds, run_data_parallel
from .runs.pipeline import pipeline_worker
from .runs.tensor_parallel import measure_tp_speed
from .train import tiny_loss_curve
from .units import GiB
from .workers import WorkerGroup
from .zero import wire_bytes_per_step

LEARNING_RATES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)


def _settle(controls: dict, label_width: str = "100px") -> None:
    """Labels of one width, and a redraw only when a control is released: every redraw computes for real."""
    for control in controls.values():
        control.style = {"description_width": label_width}
        if hasattr(control, "continuous_update"):
            control.continuous_update = False


def _redraw_on_change(controls: dict, show) -> None:
    """Call ``show`` whenever a control's value changes, and once now."""
    for control in controls.values():
        control.observe(show, names="value")
    show()


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


# ---- 01 · the memory ledger ---------------------------------------------------------------------------

def _explorer_configs():
    """Models of the memory explorer: the course presets, and TinyLlama-1.1B's published config as "1B"."""
    long = 1 << 16       # allow every sequence length of the slider; it changes no parameter count
    return {
        "tiny": preset("tiny", max_seq_len=long),
        "1B (TinyLlama-1.1B)": ModelConfig(vocab_size=32000, hidden=2048, num_layers=22, num_heads=32,
                                           num_kv_heads=4, intermediate=5632, max_seq_len=long),
        "Llama-2-7B": preset("llama2-7b", max_seq_len=long),
        "Llama-2-70B": preset("llama2-70b", max_seq_len=long),
    }


def _custom_config(hidden: int, num_layers: int):
    """A Llama-shaped model: heads of 128, SwiGLU width 8/3·hidden rounded up to a multiple of 256."""
    intermediate = -(-8 * hidden // 3 // 256) * 256
    return ModelConfig(vocab_size=32000, hidden=hidden, num_layers=num_layers, num_heads=max(1, hidden // 128),
                       intermediate=intermediate, max_seq_len=1 << 16)


GPUS = {"24 GiB (RTX 4090)": 24 * 2**30, "40 GiB (A100 40GB)": 40 * 2**30, "80 GiB (A100 80GB)": 80 * 2**30}


def memory_explorer(model="Llama-2-7B", convention="mixed", batch_size=1, seq_len=4096, recompute="none",
                    gpu="80 GiB (A100 80GB)"):
    """Model, precision convention, batch, sequence length, recomputation → training memory on one GPU.

    Two bars: the course model's activations (gpt_activation_bytes: SDPA never stores the s×s scores, so
    "selective" changes nothing there) and the GPT-3 formula's (activation_bytes, 16-bit, with the s² term
    unless recomputed). Weights, grads and optimizer state are the same in both: zero_state_bytes, stage 0.
    """


    configs = _explorer_configs()
    def powers(lo, hi):
        return [2**k for k in range(lo, hi + 1)]

    controls = {
        "model": widgets.Dropdown(options=[*configs, "custom"], value=model, description="model"),
        "hidden": widgets.SelectionSlider(options=powers(9, 14), value=4096, description="custom hidden"),
        "layers": widgets.IntSlider(value=32, min=1, max=128, description="custom layers"),
        "convention": widgets.Dropdown(options=list(CONVENTIONS), value=convention, description="precision"),
        "batch_size": widgets.SelectionSlider(options=powers(0, 6), value=batch_size, description="batch"),
        "seq_len": widgets.SelectionSlider(options=powers(7, 15), value=seq_len, description="sequence"),
        "recompute": widgets.ToggleButtons(options=["none", "selective", "full"], value=recompute,
                                           description="recompute"),
        "gpu": widgets.Dropdown(options=list(GPUS), value=gpu, description="GPU"),
    }
    _settle(controls, "100px")
    out = widgets.Output()
    panel = widgets.VBox([widgets.HBox([widgets.VBox([controls[k] for k in ("model", "hidden", "layers", "gpu")]),
                                        widgets.VBox([controls[k] for k in ("convention", "batch_size", "seq_len",
                                                                            "recompute")])]), out])

    def show(_=None):
        name = controls["model"].value
        custom = name == "custom"
        controls["hidden"].layout.display = controls["layers"].layout.display = None if custom else "none"
        config = _custom_config(controls["hidden"].value, controls["layers"].value) if custom else configs[name]
        params = param_count_formula(config)
        convention = CONVENTIONS[controls["convention"].value]
        b, s, recompute = controls["batch_size"].value, controls["seq_len"].value, controls["recompute"].value
        state = zero_state_bytes(params, 0, 1, **convention.per_param)
        state.pop("total")
        dtype = torch.float32 if controls["convention"].value == "fp32" else torch.bfloat16
        ours = gpt_activation_bytes(config, b, s, dtype, "full" if recompute == "full" else "none")["total"]
        gpt3 = activation_bytes(s, b, config.hidden, config.num_heads, config.num_layers, recompute=recompute)
        label = f"{name} ({params / 1e9:.2f}B params)" if params >= 1e8 else f"{name} ({params:,} params)"
        panel.rows = {"course model (Llama layer, SDPA)": {**state, "activations": ours},
                      "GPT-3 formula (16-bit activations)": {**state, "activations": gpt3}}
        capacity = GPUS[controls["gpu"].value]
        with out:
            out.clear_output(wait=True)
            fig = plots.memory_bars(panel.rows, capacity_bytes=capacity, capacity_label=controls["gpu"].value,
                                    title=f"{label}, {controls['convention'].value}, batch {b} × {s} tokens, "
                                          f"recompute {recompute}")
            display(fig)
            plt.close(fig)
            for row, parts in panel.rows.items():
                total = sum(parts.values())
                verdict = "fits" if total <= capacity else f"does not fit: {total / capacity:.1f}× the card"
                print(f"{row:38} {total / GiB:10,.1f} GiB  {verdict}")

    _redraw_on_change(controls, show)
    panel.controls = controls   # so a notebook cell can set values and read panel.rows
    return panel


# ---- 04 · tensor parallelism --------------------------------------------------------------------------


def tp_speed_explorer(measured: list[dict] | None = None, hiddens=(64, 128, 256, 512, 1024), tps=(2, 4),
                      hidden: int = 64, tp: int = 2):
    """Hidden size and TP degree → the measured step time of TP against one rank (run when first chosen).

    ``measured``: rows of :func:`measure_tp_speed` already taken (the notebook's sweep), so they are not
    run again. Every point measured stays on the plot.
    """

    rows = list(measured or [])
    controls = {"hidden": widgets.SelectionSlider(options=list(hiddens), value=hidden, description="hidden size",
                                                  continuous_update=False),
                "tp": widgets.ToggleButtons(options=list(tps), value=tp, description="TP degree")}
    out = widgets.Output()

    def show(_=None):
        h, p = controls["hidden"].value, controls["tp"].value
        with out:
            out.clear_output(wait=True)
            row = next((r for r in rows if (r["hidden"], r["tp"]) == (h, p)), None)
            if row is None:
                print(f"measuring hidden {h} on 1 rank and on TP={p} ...")
                row = measure_tp_speed([h], p)[0]
                rows.append(row)
                out.clear_output(wait=True)
            fig = plots.tp_speed(rows, highlight=(h, p))
            display(fig)
            plt.close(fig)
            compute = row["tp_s"] - row["comm_s"]
            verdict = "slower" if row["tp_s"] > row["one_rank_s"] else "faster"
            print(f"hidden {h}: 1 rank {row['one_rank_s'] * 1e3:.1f} ms; TP={p} {row['tp_s'] * 1e3:.1f} ms = "
                  f"{compute * 1e3:.1f} ms compute + {row['comm_s'] * 1e3:.1f} ms all-reduce → TP is "
                  f"{max(row['tp_s'], row['one_rank_s']) / min(row['tp_s'], row['one_rank_s']):.1f}× {verdict}")
            cores = len(os.sched_getaffinity(0))
            if p > cores:
                print(f"(TP={p} here puts {p} ranks on {cores} CPU cores: they take turns, and every all-reduce "
                      "waits for ranks that are not running; on a GPU box each rank has its own GPU)")

    _redraw_on_change(controls, show)
    panel = widgets.VBox([widgets.HBox(list(controls.values())), out])
    panel.rows, panel.controls = rows, controls   # for a notebook cell to read what was measured
    return panel


# ---- 02 · data parallelism ----------------------------------------------------------------------------

DDP_BUCKETS = {"naive: no buckets": None, "16 KiB": 16 * 2**10, "64 KiB": 64 * 2**10, "256 KiB": 256 * 2**10,
               "1 MiB": 2**20, "25 MiB (torch's default)": 25 * 2**20}


def ddp_overlap_explorer(world_sizes=(1, 2, 3, 4), buckets=None, ranks=2, bucket="64 KiB", steps=6, config=None,
                         per_rank_batch=4, seq_len=32):
    """Ranks and bucket size → a real data-parallel run: the step time split into compute, exposed
    communication and optimizer (every setup explored so far at this number of ranks), and the timeline of
    one step on every rank, all-reduces included.

    Runs happen live on persistent ranks (one WorkerGroup per world size, started on first use), and are
    cached. ``panel.stop_ranks()`` stops them; ``panel.runs`` maps (ranks, bucket label) → every rank's result.
    """

    buckets = buckets or DDP_BUCKETS
    groups, runs = {}, {}
    controls = {"ranks": widgets.SelectionSlider(options=list(world_sizes), value=ranks, description="ranks"),
                "bucket": widgets.Dropdown(options=list(buckets), value=bucket, description="bucket size")}
    _settle(controls, "80px")
    out = widgets.Output()

    def run(world_size, label):
        if (world_size, label) not in runs:
            if world_size not in groups:
                groups[world_size] = WorkerGroup(world_size, on_output=lambda *_: None)
            bucket_bytes = buckets[label]
            runs[world_size, label] = groups[world_size].run(run_data_parallel, dict(
                kind="naive" if bucket_bytes is None else "bucketed", bucket_bytes=bucket_bytes or 2**20,
                steps=steps, bucket_log=True, config=config, per_rank_batch=per_rank_batch, seq_len=seq_len))
        return runs[world_size, label]

    def show(_=None):
        world_size, label = controls["ranks"].value, controls["bucket"].value
        with out:
            out.clear_output(wait=True)
            print(f"running {steps} steps on {world_size} ranks...")
            per_rank = run(world_size, label)
            out.clear_output(wait=True)
            rows = {name: phase_seconds([r["steps"] for r in runs[world_size, name]])
                    for name in buckets if (world_size, name) in runs}
            fig = plots.step_time_split(rows, highlight=label, title=f"{world_size} rank(s), tiny model, "
                                        f"{per_rank[0]['grad_bytes'] / 2**20:.2f} MiB of gradients per step")
            display(fig)
            plt.close(fig)
            totals = [s["end"] - s["start"] for s in per_rank[0]["steps"][1:]]
            typical = 1 + sorted(range(len(totals)), key=totals.__getitem__)[len(totals) // 2]  # the median step
            fig = plots.ddp_timeline([r["steps"][typical] for r in per_rank],
                                     title=f"step {typical} of {label}: compute and all-reduces on every rank")
            display(fig)
            plt.close(fig)

    _redraw_on_change(controls, show)
    panel = widgets.VBox([widgets.HBox(list(controls.values())), out])
    panel.controls, panel.runs = controls, runs

    def stop_ranks():
        while groups:
            groups.popitem()[1].close()

    panel.stop_ranks = stop_ranks
    return panel


# ---- 05 · pipeline parallelism ------------------------------------------------------------------------

def pipeline_explorer(num_stages=4, num_microbatches=8, schedule="1f1b", last_stage_cost=1.0, op_ms=30, steps=2):
    """Stages, micro-batches, schedule and the last stage's cost → a real pipeline step on that many ranks in
    controlled-cost mode (every forward and backward padded to ``op_ms``, the last stage's to
    ``last_stage_cost`` × op_ms; the fastest of ``steps`` steps): its measured Gantt chart and bubble beside
    the formula (p-1)/(m+p-1) and the simulated prediction for these costs. Runs are cached (``panel.runs``:
    settings → Timeline) on persistent ranks, one WorkerGroup per number of stages; ``panel.stop_ranks()`` stops them.
    """

    weights = build(preset("tiny"), seed=0).state_dict()   # built once here, not on every rank
    groups, runs = {}, {}
    controls = {
        "stages": widgets.IntSlider(value=num_stages, min=2, max=4, description="stages p"),
        "microbatches": widgets.SelectionSlider(options=[1, 2, 4, 8, 16], value=num_microbatches,
                                                description="micro-batches m"),
        "schedule": widgets.ToggleButtons(options=["gpipe", "1f1b"], value=schedule, description="schedule"),
        "cost": widgets.SelectionSlider(options=[1.0, 1.5, 2.0, 3.0], value=last_stage_cost,
                                        description="last stage ×"),
    }
    _settle(controls, "110px")
    out = widgets.Output()

    def show(_=None):
        p, m = controls["stages"].value, controls["microbatches"].value
        name, factor = controls["schedule"].value, controls["cost"].value
        costs_ms = [op_ms] * (p - 1) + [op_ms * factor]
        with out:
            out.clear_output(wait=True)
            if (p, m, name, factor) not in runs:
                print(f"running {p} ranks, {m} micro-batches, {name} ...")
                if p not in groups:
                    groups[p] = WorkerGroup(p, on_output=lambda *_: None)
                runs[p, m, name, factor] = Timeline.from_results(groups[p].run(pipeline_worker, dict(
                    num_microbatches=m, schedule=name, forward_ms=costs_ms, batch_size=16, seq_len=8,
                    steps=steps, measure_memory=False, weights=weights)))
                out.clear_output(wait=True)
            timeline = runs[p, m, name, factor]
            predicted = simulate(name, p, m, [c / 1e3 for c in costs_ms], [c / 1e3 for c in costs_ms])
            fig = plots.pipeline_gantt(timeline, title=f"{name}, p = {p}, m = {m}: measured bubble {timeline.bubble:.1%}")
            display(fig)
            plt.close(fig)
            print(f"measured bubble {timeline.bubble:6.1%}   (mean idle fraction over the {p} ranks)")
            print(f"simulated       {predicted.bubble:6.1%}   (these op costs, instant hand-offs)")
            print(f"formula         {bubble_fraction(p, m):6.1%}   (p-1)/(m+p-1) = {p - 1}/{m + p - 1}"
                  + ("" if factor == 1 else ": it assumes equal stages, and these are not"))
            print("peak micro-batches in flight per stage:", [timeline.peak_in_flight(r) for r in range(p)])

    _redraw_on_change(controls, show)
    panel = widgets.VBox([widgets.HBox([widgets.VBox([controls["stages"], controls["microbatches"]]),
                                        widgets.VBox([controls["schedule"], controls["cost"]])]), out])
    panel.controls, panel.runs = controls, runs
    panel.stop_ranks = lambda: [groups.pop(size).close() for size in list(groups)]
    return panel


# ---- 03 · ZeRO and FSDP ------------------------------------------------------------------------------

ZERO_RANKS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def zero_explorer(model="Llama-2-7B", stage=1, ranks=8, convention="mixed", gpu="80 GiB (A100 80GB)"):
    """ZeRO stage × ranks × model → the training state each rank holds (weights, gradients, optimizer state,
    ledger.zero_state_bytes) for every stage, against a card, and the bytes each rank sends per step
    (zero.wire_bytes_per_step, Ψ = the gradients' bytes). The chosen stage is drawn in full colour.
    Models: the memory explorer's, the source's round 7.1e9 and 70e9, and a custom Llama-shaped one."""

    configs = _explorer_configs()
    counts = {name: param_count_formula(config) for name, config in configs.items()}
    counts.update({"7.1e9 (the source's 7B)": int(7.1e9), "70e9 (the source's 70B)": int(70e9)})
    controls = {
        "model": widgets.Dropdown(options=[*counts, "custom"], value=model, description="model"),
        "hidden": widgets.SelectionSlider(options=[2**k for k in range(9, 15)], value=4096,
                                          description="custom hidden"),
        "layers": widgets.IntSlider(value=32, min=1, max=128, description="custom layers"),
        "stage": widgets.ToggleButtons(options=[0, 1, 2, 3], value=stage, description="ZeRO stage"),
        "ranks": widgets.SelectionSlider(options=list(ZERO_RANKS), value=ranks, description="ranks"),
        "convention": widgets.Dropdown(options=list(CONVENTIONS), value=convention, description="precision"),
        "gpu": widgets.Dropdown(options=list(GPUS), value=gpu, description="GPU"),
    }
    _settle(controls, "100px")
    out = widgets.Output()
    panel = widgets.VBox([widgets.HBox([widgets.VBox([controls[k] for k in ("model", "hidden", "layers", "gpu")]),
                                        widgets.VBox([controls[k] for k in ("stage", "ranks", "convention")])]),
                          out])
    names = plots.ZERO_STAGE_NAMES

    def show(_=None):
        name = controls["model"].value
        custom = name == "custom"
        controls["hidden"].layout.display = controls["layers"].layout.display = None if custom else "none"
        params = (param_count_formula(_custom_config(controls["hidden"].value, controls["layers"].value))
                  if custom else counts[name])
        convention = CONVENTIONS[controls["convention"].value]
        n, chosen = controls["ranks"].value, controls["stage"].value
        panel.memory = {names[s]: zero_state_bytes(params, s, n, **convention.per_param) for s in range(4)}
        panel.wire = {names[s]: sum(wire_bytes_per_step(convention.grad_bytes * params, s, n).values())
                      for s in range(4)}
        capacity = GPUS[controls["gpu"].value]
        with out:
            out.clear_output(wait=True)
            fig = plots.zero_explorer_figure(panel.memory, panel.wire, highlight=names[chosen],
                                             capacity_bytes=capacity, capacity_label=controls["gpu"].value,
                                             title=f"{name}: {params / 1e9:.2f}B parameters, {n} ranks, "
                                                   f"{controls['convention'].value}")
            display(fig)
            plt.close(fig)
            state = panel.memory[names[chosen]]["total"]
            verdict = "fits" if state <= capacity else f"does not fit: {state / capacity:.1f}× the card"
            print(f"{names[chosen]} on {n} ranks: {state / GiB:,.1f} GiB of training state per rank ({verdict}, "
                  f"before activations); each rank sends {panel.wire[names[chosen]] / GiB:,.1f} GiB per step")

    _redraw_on_change(controls, show)
    panel.controls = controls   # a notebook cell can set values and read panel.memory and panel.wire
    return panel


PLAN_GPUS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def plan_explorer(model="Llama-2-70B", num_gpus=32, gpu="80 GiB (A100 80GB)", gpus_per_node=8):
    """Model × GPUs × card → the three questions of plan.plan answered, the state per GPU of every ZeRO rung
    over all the GPUs and of the chosen layout, against the card, and the layout's bad smells, if any."""

    configs = _explorer_configs()
    controls = {
        "model": widgets.Dropdown(options=list(configs), value=model, description="model"),
        "gpus": widgets.SelectionSlider(options=list(PLAN_GPUS), value=num_gpus, description="GPUs"),
        "gpu": widgets.Dropdown(options=list(GPUS), value=gpu, description="GPU"),
        "per_node": widgets.ToggleButtons(options=[4, 8], value=gpus_per_node, description="GPUs per node"),
    }
    _settle(controls, "100px")
    out = widgets.Output()
    panel = widgets.VBox([widgets.HBox([widgets.VBox([controls["model"], controls["gpu"]]),
                                        widgets.VBox([controls["gpus"], controls["per_node"]])]), out])

    def show(_=None):
        config, n, capacity = configs[controls["model"].value], controls["gpus"].value, GPUS[controls["gpu"].value]
        per_node = min(controls["per_node"].value, n)
        try:
            panel.plan = plan(config, num_gpus=n, gpu_bytes=capacity, gpus_per_node=per_node)
        except ValueError as err:
            panel.plan = None
            with out:
                out.clear_output(wait=True)
                print(err)
            return
        rows = {f"{stage_name(s)} over {n}": state_per_gpu(config, Mesh(dp=n), s)
                for s in range(4)}
        if panel.plan.fits:
            m = panel.plan.mesh
            rows[f"plan: dp{m.dp}×tp{m.tp}×pp{m.pp}, {stage_name(panel.plan.zero_stage)}"] = state_per_gpu(
                config, m, panel.plan.zero_stage)
        with out:
            out.clear_output(wait=True)
            fig = plots.memory_bars({k: {p: v[p] for p in ("weights", "grads", "optimizer")} for k, v in rows.items()},
                                    capacity_bytes=capacity, capacity_label=controls["gpu"].value,
                                    title=f"{controls['model'].value} on {n} GPUs: training state per GPU")
            display(fig)
            plt.close(fig)
            print(panel.plan)
            if panel.plan.fits:
                for smell in bad_smells(panel.plan.mesh, gpus_per_node=per_node, zero_stage=panel.plan.zero_stage,
                                        config=config, gpu_bytes=capacity):
                    print("bad smell:", smell)
            print(f"(state only, in GiB = 2**30 bytes; activations come on top: notebook 01. Card: "
                  f"{capacity / GiB:.0f} GiB)")

    _redraw_on_change(controls, show)
    panel.controls = controls
    return panel
