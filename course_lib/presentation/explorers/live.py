"""Explorers that run for real (training, ranks): each run takes seconds, so while it runs the panel says what it
is doing and its controls are disabled; every result is cached, and a setting met again is redrawn at once."""

import math
import os
import time

import ipywidgets as widgets

from ...model import build, preset
from ...pipeline_parallel import Timeline, bubble_fraction, simulate
from ...runs.ddp import phase_seconds, run_data_parallel
from ...runs.pipeline import pipeline_worker
from ...runs.tensor_parallel import measure_tp_speed
from ...runtime.workers import WorkerGroup
from ...schedules import zero_bubble_fraction
from ...train import tiny_loss_curve
from ...units import KiB, MiB
from .. import plots
from ._panel import ExplorerPanel, about, plural

PIPELINE_LAYERS = 8   # the pipeline explorer's model: enough layers for p·v = 8 virtual stages
LEARNING_RATES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)
DDP_BUCKETS = {"naive: no buckets": None, "16 KiB": 16 * KiB, "64 KiB": 64 * KiB, "256 KiB": 256 * KiB,
               "1 MiB": MiB, "25 MiB (torch's default)": 25 * MiB}


def _stopper(groups: dict):
    """``panel.stop_ranks``: close every WorkerGroup the explorer started, and say so."""
    def stop_ranks() -> None:
        stopped = 0
        while groups:
            size, group = groups.popitem()
            group.close()
            stopped += size
        print(f"stopped the explorer's {plural(stopped, 'rank')}" if stopped else "the explorer had no ranks running")
    return stop_ranks


# ---- 00 · the training step ---------------------------------------------------------------------------

def learning_rate_explorer(rates=LEARNING_RATES, value=1e-2, steps=40):
    """A slider over learning rates → the tiny model's loss curve at that rate, trained for real.

    Curves already explored stay on the plot, so a learner sees too small (slow), right, and too large (noisy,
    or stuck above the start) side by side. ``panel.curves``: label → losses, as trained.
    """
    curves, seconds = {}, []          # seconds: how long each training took, for the next busy message
    slider = widgets.SelectionSlider(options=[(f"{lr:g}", lr) for lr in rates], value=value,
                                     description="learning rate", layout=widgets.Layout(width="420px"))
    panel = ExplorerPanel([slider], {"lr": slider},
                          "the tiny model's loss curve at each learning rate, trained when you choose it")

    def show(chosen):
        lr = chosen["lr"]
        label = f"lr={lr:g}"
        if label not in curves:
            with panel.busy(f"training the tiny model at {label} for {steps} steps…"
                            f"{about(seconds[-1] if seconds else None)}"):
                start = time.perf_counter()
                curves[label] = tiny_loss_curve(lr, steps=steps)
                seconds.append(time.perf_counter() - start)
        losses = curves[label]
        panel.draw(plots.loss_curves(curves, highlight=label, vocab_size=128,
                                     title=f"{label}: loss {losses[0]:.2f} → {losses[-1]:.2f} in {steps} steps"))

    panel.redraw_on_change(show)
    panel.curves = curves
    return panel


# ---- 04 · tensor parallelism --------------------------------------------------------------------------

def _tp_seconds(rows: list[dict], hidden: int, tp: int, rounds: int = 6) -> float | None:
    """About how long measure_tp_speed([hidden], tp) takes: its ``rounds`` (a warm-up and 5 timed) of one
    step on one rank and one on TP ranks, scaled from the nearest point measured (same TP first) as hidden²
    (a layer's weights, so its work, grow as hidden²), plus ~1 s to start the ranks and build the models."""
    if not rows:
        return None
    near = min(rows, key=lambda r: (r["tp"] != tp, abs(math.log(r["hidden"] / hidden))))
    return 1 + rounds * (near["one_rank_s"] + near["tp_s"]) * (hidden / near["hidden"]) ** 2


def tp_speed_explorer(measured: list[dict] | None = None, hiddens=(64, 128, 256, 512, 1024), tps=(2, 4),
                      hidden: int = 64, tp: int = 2):
    """Hidden size and TP degree → the measured step time of TP against one rank (run when first chosen).

    ``measured``: rows of :func:`measure_tp_speed` already taken (the notebook's sweep), so they are not
    run again. Every point measured stays on the plot; ``panel.rows`` holds them all.
    """
    rows = list(measured or [])
    controls = {"hidden": widgets.SelectionSlider(options=list(hiddens), value=hidden, description="hidden size"),
                "tp": widgets.ToggleButtons(options=list(tps), value=tp, description="TP degree")}
    panel = ExplorerPanel([widgets.HBox(list(controls.values()))], controls,
                          "the measured step time of a model split over TP ranks against one rank, for each "
                          "hidden size and TP degree")

    def show(chosen):
        h, p = chosen["hidden"], chosen["tp"]
        row = next((r for r in rows if (r["hidden"], r["tp"]) == (h, p)), None)
        if row is None:
            with panel.busy(f"measuring hidden {h} on 1 rank and on TP={p}…{about(_tp_seconds(rows, h, p))}"):
                row = measure_tp_speed([h], p)[0]
            rows.append(row)
        panel.draw(plots.tp_speed(rows, highlight=(h, p)))
        compute = row["tp_s"] - row["comm_s"]
        verdict, _ = plots.speed_words(row["tp_s"], row["one_rank_s"])
        print(f"hidden {h}: 1 rank {row['one_rank_s'] * 1e3:.1f} ms; TP={p} {row['tp_s'] * 1e3:.1f} ms = "
              f"{compute * 1e3:.1f} ms compute + {row['comm_s'] * 1e3:.1f} ms all-reduce → TP: {verdict}")
        cores = len(os.sched_getaffinity(0))
        if p > cores:
            print(f"(TP={p} here puts {p} ranks on {plural(cores, 'CPU core')}: they take turns, and every "
                  "all-reduce waits for ranks that are not running; on a GPU box each rank has its own GPU)")

    panel.redraw_on_change(show)
    panel.rows = rows
    return panel


# ---- 02 · data parallelism ----------------------------------------------------------------------------

def ddp_overlap_explorer(world_sizes=(1, 2, 3, 4), buckets=None, ranks=2, bucket="64 KiB", steps=6, config=None,
                         micro_batch_size=4, seq_len=32):
    """Ranks and bucket size → a real data-parallel run: the step time split into compute, exposed
    communication and optimizer (every setup explored so far at this number of ranks), and the timeline of
    one step on every rank, all-reduces included.

    Runs happen live on persistent ranks (one WorkerGroup per world size, started on first use), and are
    cached. ``panel.stop_ranks()`` stops them; ``panel.runs`` maps (ranks, bucket label) → every rank's result.
    """
    buckets = buckets or DDP_BUCKETS
    groups, runs, seconds = {}, {}, {}    # seconds: world size → how long its last run took
    controls = {"ranks": widgets.SelectionSlider(options=list(world_sizes), value=ranks, description="ranks"),
                "bucket": widgets.Dropdown(options=list(buckets), value=bucket, description="bucket size")}
    panel = ExplorerPanel([widgets.HBox(list(controls.values()))], controls,
                          "a real data-parallel run on the number of ranks and the gradient bucket size you "
                          "choose: where its step time goes, and every rank's all-reduces")

    def run(world_size, label):
        starting = "" if world_size in groups else f"starting {plural(world_size, 'rank')}, then "
        with panel.busy(f"{starting}running {steps} steps on {plural(world_size, 'rank')}…"
                        f"{about(seconds.get(world_size))}"):
            start = time.perf_counter()
            if world_size not in groups:
                groups[world_size] = WorkerGroup(world_size, on_output=lambda *_: None)
            bucket_bytes = buckets[label]
            runs[world_size, label] = groups[world_size].run(run_data_parallel, dict(
                kind="naive" if bucket_bytes is None else "bucketed", bucket_bytes=bucket_bytes or MiB,
                steps=steps, bucket_log=True, config=config, micro_batch_size=micro_batch_size, seq_len=seq_len))
            seconds[world_size] = time.perf_counter() - start

    def show(chosen):
        world_size, label = chosen["ranks"], chosen["bucket"]
        if (world_size, label) not in runs:
            run(world_size, label)
        per_rank = runs[world_size, label]
        rows = {name: phase_seconds([r["steps"] for r in runs[world_size, name]])
                for name in buckets if (world_size, name) in runs}
        panel.draw(plots.step_time_split(rows, highlight=label, title=f"{plural(world_size, 'rank')}, tiny model, "
                                         f"{per_rank[0]['grad_bytes'] / MiB:.2f} MiB of gradients per step"))
        totals = [s["end"] - s["start"] for s in per_rank[0]["steps"][1:]]
        typical = 1 + sorted(range(len(totals)), key=totals.__getitem__)[len(totals) // 2]  # the median step
        panel.draw(plots.ddp_timeline([r["steps"][typical] for r in per_rank],
                                      title=f"step {typical} of {label}: compute and all-reduces on every rank"))

    panel.redraw_on_change(show)
    panel.runs, panel.stop_ranks = runs, _stopper(groups)
    return panel


# ---- 05 · pipeline parallelism ------------------------------------------------------------------------

def pipeline_explorer(num_stages=4, num_microbatches=8, schedule="1f1b", last_stage_cost=1.0, op_ms=30, steps=2,
                      num_chunks=2, weight_fraction=0.5):
    """Stages, micro-batches, schedule and the last stage's cost → a real pipeline step on that many ranks in
    controlled-cost mode (every forward and backward padded to ``op_ms``, the last stage's to
    ``last_stage_cost`` × op_ms; the fastest of ``steps`` steps): its measured Gantt chart and bubble beside
    the formula and the simulated prediction for these costs. Schedules: GPipe, 1F1B, interleaved 1F1B with v
    chunks per rank (``num_chunks``; the model has PIPELINE_LAYERS layers, so p·v at most that) and ZB-H1, whose
    W takes ``weight_fraction`` of a backward (T_W; B the rest). Runs are cached (``panel.runs``: (p, m,
    schedule, cost, v, W share) → Timeline) on persistent ranks, one WorkerGroup per number of stages;
    ``panel.stop_ranks()`` stops them. A setting the schedule refuses is named, not drawn."""
    weights = build(preset("tiny", num_layers=PIPELINE_LAYERS), seed=0).state_dict()   # built once, not per rank
    groups, runs = {}, {}
    controls = _pipeline_controls(num_stages, num_microbatches, schedule, last_stage_cost, num_chunks,
                                  weight_fraction)
    panel = ExplorerPanel([widgets.HBox([widgets.VBox([controls["stages"], controls["microbatches"], controls["cost"]]),
                                         widgets.VBox([controls["schedule"], controls["chunks"], controls["weight"]])])],
                          controls, "a real pipeline step's Gantt chart and bubble, for the stages, micro-batches, "
                                    "schedule (GPipe, 1F1B, interleaved, ZB-H1) and last-stage cost you choose, "
                                    "beside the formula's bubble")

    def show(chosen):
        p, m, name, factor = chosen["stages"], chosen["microbatches"], chosen["schedule"], chosen["cost"]
        v = chosen["chunks"] if name == "interleaved" else 1
        w = chosen["weight"] if name == "zb-h1" else 0.5
        controls["chunks"].layout.display = None if name == "interleaved" else "none"
        controls["weight"].layout.display = None if name == "zb-h1" else "none"
        if p * v > PIPELINE_LAYERS:
            print(f"p·v = {p}·{v} = {p * v} virtual stages for a model of {PIPELINE_LAYERS} layers: each needs a "
                  "layer at least. Choose fewer stages or chunks.")
            return
        costs_ms = [op_ms] * (p - 1) + [op_ms * factor]
        try:
            predicted = simulate(name, p, m, [c / 1e3 for c in costs_ms], [c / 1e3 for c in costs_ms],
                                 num_chunks=v, weight_fraction=w)
        except ValueError as err:                       # e.g. interleaved with m not a multiple of p
            print(f"{name} refuses this setting: {err}")
            return
        key = (p, m, name, factor, v, w)
        if key not in runs:
            starting = "" if p in groups else f"starting {plural(p, 'rank')}, then "
            # every op is padded to its cost, so a step lasts the simulated makespan
            with panel.busy(f"{starting}running {plural(m, 'micro-batch', 'micro-batches')} through {p} stages, {name}…"
                            f"{about(steps * predicted.makespan)}"):
                if p not in groups:
                    groups[p] = WorkerGroup(p, on_output=lambda *_: None)
                runs[key] = Timeline.from_results(groups[p].run(pipeline_worker, dict(
                    num_microbatches=m, schedule=name, forward_ms=costs_ms, batch_size=16, seq_len=8,
                    steps=steps, measure_memory=False, weights=weights, num_layers=PIPELINE_LAYERS, num_chunks=v,
                    weight_fraction=w)))
        timeline = runs[key]
        shape = f"p = {p}, m = {m}" + (f", v = {v}" if v > 1 else "")
        panel.draw(plots.pipeline_gantt(timeline, title=f"{name}, {shape}: measured bubble {timeline.bubble:.1%}"))
        _print_bubbles(timeline, predicted, name, p, m, v, w, factor)

    panel.redraw_on_change(show)
    panel.runs, panel.stop_ranks = runs, _stopper(groups)
    return panel


def _pipeline_controls(num_stages, num_microbatches, schedule, last_stage_cost, num_chunks, weight_fraction) -> dict:
    """The pipeline explorer's controls, by name, starting at the explorer's arguments."""
    return {
        "stages": widgets.IntSlider(value=num_stages, min=2, max=4, description="stages p"),
        "microbatches": widgets.SelectionSlider(options=[1, 2, 4, 8, 16], value=num_microbatches,
                                                description="micro-batches m"),
        "schedule": widgets.ToggleButtons(options=["gpipe", "1f1b", "interleaved", "zb-h1"], value=schedule,
                                          description="schedule"),
        "cost": widgets.SelectionSlider(options=[1.0, 1.5, 2.0, 3.0], value=last_stage_cost,
                                        description="last stage ×"),
        "chunks": widgets.ToggleButtons(options=[2, 4], value=num_chunks, description="chunks v"),
        "weight": widgets.ToggleButtons(options=[("¼ of backward", 0.25), ("½ of backward", 0.5)],
                                        value=weight_fraction, description="T_W"),
    }


def _bubble_formula(name: str, p: int, m: int, v: int, w: float) -> str:
    """The bubble the formula gives for schedule ``name`` (p stages, m micro-batches, v chunks, T_W = w·T_F), and
    the formula itself: (p-1)/(m+p-1), interleaved's (p-1)/(v·m+p-1), or ZB-H1's
    (p-1)(T_F+T_B-T_W) / (m(T_F+T_B+T_W) + (p-1)(T_F+T_B-T_W)), which holds for m >= p only."""
    if name == "interleaved":
        return f"{bubble_fraction(p, m, v):6.1%}   (p-1)/(v·m+p-1) = {p - 1}/{v * m + p - 1}"
    if name == "zb-h1":
        if m < p:
            return "   —     (p-1)(T_F+T_B-T_W)/… assumes m >= p"
        return (f"{zero_bubble_fraction(p, m, 1.0, 1 - w, w):6.1%}   (p-1)(T_F+T_B-T_W) / (m(T_F+T_B+T_W) "
                f"+ (p-1)(T_F+T_B-T_W)), T_B = {1 - w:g}·T_F, T_W = {w:g}·T_F")
    return f"{bubble_fraction(p, m):6.1%}   (p-1)/(m+p-1) = {p - 1}/{m + p - 1}"


def _print_bubbles(timeline: Timeline, predicted: Timeline, name: str, p: int, m: int, v: int, w: float,
                   factor: float) -> None:
    """Print the measured bubble beside the simulated one and the formula's, and each stage's peak micro-batches
    in flight (``factor``: the last stage's cost, in ops of the others)."""
    print(f"measured bubble {timeline.bubble:6.1%}   (mean idle fraction over the {p} ranks)")
    print(f"simulated       {predicted.bubble:6.1%}   (these op costs, instant hand-offs)")
    print(f"formula         {_bubble_formula(name, p, m, v, w)}"
          + ("" if factor == 1 else ": it assumes equal stages, and these are not"))
    unit = " (chunk micro-batches: each 1/v of a stage's activations)" if v > 1 else ""
    print(f"peak micro-batches in flight per stage{unit}:", [timeline.peak_in_flight(r) for r in range(p)])
