"""Explorers computed from formulas (ledger, zero, recipes and plan): every redraw is instant, for any model and
cluster."""

import ipywidgets as widgets
import torch

from ... import failures, hardware
from ...ledger import CONVENTIONS, activation_bytes, gpt_activation_bytes, zero_state_bytes
from ...mesh import Mesh
from ...model import ModelConfig, param_count_formula, preset
from ...plan import bad_smells, plan
from ...recipes import RESERVE_SHARE, Workload, memory_parts, memory_per_gpu, share_text, stage_name, state_per_gpu
from ...units import GiB
from ...zero_bytes import wire_bytes_per_step
from .. import plots
from ._panel import ExplorerPanel, format_bytes, plural

# The cards of the memory and ZeRO explorers, by memory only: a learner's own card (hardware.GPUS lists data-centre
# GPUs, with speeds and links) and the catalogue's, named "80 GiB (A100 80GB)".
GPUS = {"24 GiB (RTX 4090)": 24 * GiB,
        **{f"{card.memory_bytes // GiB} GiB ({name})": card.memory_bytes for name, card in hardware.GPUS.items()}}
ZERO_RANKS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PLAN_GPUS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


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


def _custom_controls() -> dict:
    """The width and depth of the "custom" model, shown only while it is chosen."""
    return {"hidden": widgets.SelectionSlider(options=[2**k for k in range(9, 15)], value=4096,
                                              description="custom hidden"),
            "layers": widgets.IntSlider(value=32, min=1, max=128, description="custom layers")}


def _verdict(total: float, capacity: float) -> str:
    """'fits', or by how much it does not: 24.1 GiB on a 24 GiB card is over by 0.1 GiB, not "1.0× the card"."""
    return "fits" if total <= capacity else f"does not fit: {format_bytes(total - capacity)} over the card"


def memory_explorer(model="Llama-2-7B", convention="mixed", batch_size=1, seq_len=4096, recompute="none",
                    gpu="80 GiB (A100 80GB)"):
    """Model, precision convention, batch, sequence length, recomputation → training memory on one GPU.

    Two bars: the course model's activations (gpt_activation_bytes: SDPA never stores the s×s scores, so
    "selective" changes nothing there) and the GPT-3 formula's (activation_bytes, 16-bit, with the s² term
    unless recomputed). Weights, grads and optimizer state are the same in both: zero_state_bytes, stage 0.
    ``panel.rows``: bar → {part: bytes}, as drawn.
    """
    configs = _explorer_configs()

    def powers(lo, hi):
        return [2**k for k in range(lo, hi + 1)]

    controls = {
        "model": widgets.Dropdown(options=[*configs, "custom"], value=model, description="model"),
        **_custom_controls(),
        "convention": widgets.Dropdown(options=list(CONVENTIONS), value=convention, description="precision"),
        "batch_size": widgets.SelectionSlider(options=powers(0, 6), value=batch_size, description="batch"),
        "seq_len": widgets.SelectionSlider(options=powers(7, 15), value=seq_len, description="sequence"),
        "recompute": widgets.ToggleButtons(options=["none", "selective", "full"], value=recompute,
                                           description="recompute"),
        "gpu": widgets.Dropdown(options=list(GPUS), value=gpu, description="GPU"),
    }
    panel = ExplorerPanel([widgets.HBox([widgets.VBox([controls[k] for k in ("model", "hidden", "layers", "gpu")]),
                                         widgets.VBox([controls[k] for k in ("convention", "batch_size", "seq_len",
                                                                             "recompute")])])],
                          controls, "the training memory of one GPU for a model, precision, batch, sequence "
                                    "length and recomputation of your choice")

    def show(chosen):
        name, b, s, recompute = chosen["model"], chosen["batch_size"], chosen["seq_len"], chosen["recompute"]
        custom = name == "custom"
        controls["hidden"].layout.display = controls["layers"].layout.display = None if custom else "none"
        config = _custom_config(chosen["hidden"], chosen["layers"]) if custom else configs[name]
        params = param_count_formula(config)
        convention = CONVENTIONS[chosen["convention"]]
        state = zero_state_bytes(params, 0, 1, **convention.per_param)
        state.pop("total")
        dtype = torch.float32 if chosen["convention"] == "fp32" else torch.bfloat16
        ours = gpt_activation_bytes(config, b, s, dtype, "full" if recompute == "full" else "none")["total"]
        gpt3 = activation_bytes(s, b, config.hidden, config.num_heads, config.num_layers, recompute=recompute)
        label = f"{name} ({params / 1e9:.2f}B params)" if params >= 1e8 else f"{name} ({params:,} params)"
        panel.rows = {"course model (Llama layer, SDPA)": {**state, "activations": ours},
                      "GPT-3 formula (16-bit activations)": {**state, "activations": gpt3}}
        capacity = GPUS[chosen["gpu"]]
        panel.draw(plots.memory_bars(panel.rows, capacity_bytes=capacity, capacity_label=chosen["gpu"],
                                     title=f"{label}, {chosen['convention']}, batch {b} × {s} tokens, "
                                           f"recompute {recompute}"))
        for row, parts in panel.rows.items():
            total = sum(parts.values())
            print(f"{row:38} {format_bytes(total):>12}  {_verdict(total, capacity)}")

    panel.redraw_on_change(show)
    return panel


def zero_explorer(model="Llama-2-7B", zero_stage=1, ranks=8, convention="mixed", gpu="80 GiB (A100 80GB)"):
    """ZeRO stage × ranks × model → the training state each rank holds (weights, gradients, optimizer state,
    ledger.zero_state_bytes) for every stage, against a card, and the bytes each rank sends per step
    (zero_bytes.wire_bytes_per_step, Ψ = the gradients' bytes). The chosen stage is drawn in full colour.
    Models: the memory explorer's, the source's round 7.1e9 and 70e9, and a custom Llama-shaped one.
    ``panel.memory`` and ``panel.wire``: stage name → bytes, as drawn."""
    configs = _explorer_configs()
    counts = {name: param_count_formula(config) for name, config in configs.items()}
    counts.update({"7.1e9 (the source's 7B)": int(7.1e9), "70e9 (the source's 70B)": int(70e9)})
    controls = {
        "model": widgets.Dropdown(options=[*counts, "custom"], value=model, description="model"),
        **_custom_controls(),
        "stage": widgets.ToggleButtons(options=[0, 1, 2, 3], value=zero_stage, description="ZeRO stage"),
        "ranks": widgets.SelectionSlider(options=list(ZERO_RANKS), value=ranks, description="ranks"),
        "convention": widgets.Dropdown(options=list(CONVENTIONS), value=convention, description="precision"),
        "gpu": widgets.Dropdown(options=list(GPUS), value=gpu, description="GPU"),
    }
    panel = ExplorerPanel([widgets.HBox([widgets.VBox([controls[k] for k in ("model", "hidden", "layers", "gpu")]),
                                         widgets.VBox([controls[k] for k in ("stage", "ranks", "convention")])])],
                          controls, "what each rank holds and sends per step under each ZeRO stage, for a model "
                                    "and number of ranks of your choice")
    names = plots.ZERO_STAGE_NAMES

    def show(chosen):
        name, n, stage_chosen = chosen["model"], chosen["ranks"], names[chosen["stage"]]
        custom = name == "custom"
        controls["hidden"].layout.display = controls["layers"].layout.display = None if custom else "none"
        params = param_count_formula(_custom_config(chosen["hidden"], chosen["layers"])) if custom else counts[name]
        convention = CONVENTIONS[chosen["convention"]]
        panel.memory = {names[s]: zero_state_bytes(params, s, n, **convention.per_param) for s in range(4)}
        panel.wire = {names[s]: sum(wire_bytes_per_step(convention.grad_bytes * params, s, n).values())
                      for s in range(4)}
        capacity = GPUS[chosen["gpu"]]
        size = f"{params / 1e9:.2f}B parameters" if params >= 1e8 else f"{params:,} parameters"
        panel.draw(plots.zero_explorer_figure(panel.memory, panel.wire, highlight=stage_chosen,
                                              capacity_bytes=capacity, capacity_label=chosen["gpu"],
                                              title=f"{name}: {size}, {plural(n, 'rank')}, {chosen['convention']}"))
        state = panel.memory[stage_chosen]["total"]
        print(f"{stage_chosen} on {plural(n, 'rank')}: {format_bytes(state)} of training state per rank "
              f"({_verdict(state, capacity)}, before activations); each rank sends "
              f"{format_bytes(panel.wire[stage_chosen])} per step")

    panel.redraw_on_change(show)
    return panel


def _layout_text(mesh: Mesh, zero_stage: int, num_chunks: int = 1) -> str:
    """The layout as a bar's label. Without a dp axis ZeRO-1 and -2 change nothing, but ZeRO-3 still gathers one
    unit whole beside the shards (recipes.memory_per_gpu counts it), and an interleaved pipeline (v chunks per
    GPU) holds more activations: two layouts that differ in bytes never share a label."""
    if mesh.dp == 1:
        axis = "no dp, ZeRO-3's gathered layer" if zero_stage == 3 else "no dp"
    else:
        axis = stage_name(zero_stage)
    chunks = f" (v = {num_chunks})" if num_chunks > 1 else ""
    return f"dp{mesh.dp}×tp{mesh.tp}×pp{mesh.pp}{chunks}, {axis}"


def plan_explorer(model="Llama-2-70B", num_gpus=32, gpu="A100 80GB", gpus_per_node=8, sequence_parallel=False,
                  recompute="selective"):
    """Model × GPUs × card × node size × workload → plan.plan's five answers, and the busiest GPU's memory (state
    as weights, grads and optimizer; activations; the reserve) for the three questions' layout and for the best
    layout of each recipe, side by side against the card, with each recipe's tokens/s and MFU (cost.step_time on
    the card's speed and links: hardware.GPUS). The workload is Llama 2's batch, 1,024 sequences of 4,096 tokens
    in micro-batches of one, with the sequence parallelism and recomputation chosen. When even the state does
    not fit, the bars are the ZeRO ladder over all the GPUs (state only). ``panel.plan``: the Plan shown (None
    when plan refused the request); ``panel.rows``: bar → {part: bytes}, as drawn."""
    # Not the tiny model: 4,096-token sequences and a share of a data-centre GPU's peak mean nothing at hidden 64
    configs = {name: config for name, config in _explorer_configs().items() if name != "tiny"}
    controls = _plan_controls(list(configs), model, num_gpus, gpu, gpus_per_node, sequence_parallel, recompute)
    panel = ExplorerPanel([widgets.HBox([widgets.VBox([controls[k] for k in ("model", "gpu", "gpus", "per_node")]),
                                         widgets.VBox([controls[k] for k in ("sequence_parallel", "recompute")])])],
                          controls, "the layout (data, tensor and pipeline parallel, ZeRO stage) a planner chooses "
                                    "for a model on a number of GPUs: what each recipe's busiest GPU holds, with "
                                    "its activations, and how fast it trains")

    def show(chosen):
        config, n, card = configs[chosen["model"]], chosen["gpus"], hardware.GPUS[chosen["gpu"]]
        per_node = min(chosen["per_node"], n)
        workload = Workload(seq_len=4096, recompute=chosen["recompute"], sequence_parallel=chosen["sequence_parallel"])
        try:
            panel.plan = plan(config, num_gpus=n, gpus_per_node=per_node, workload=workload, gpu=chosen["gpu"])
        except ValueError as err:
            panel.plan = None
            print(err)
            return
        chosen_plan, capacity = panel.plan, card.memory_bytes
        panel.rows = _plan_rows(config, chosen_plan, n, workload, capacity)
        sp = ", sequence parallel" if workload.sequence_parallel else ""
        recomputation = "no recomputation" if workload.recompute == "none" else f"{workload.recompute} recomputation"
        panel.draw(plots.memory_bars(panel.rows, capacity_bytes=capacity, capacity_label=chosen["gpu"],
                                     title=f"{chosen['model']} on {plural(n, 'GPU')}: the busiest GPU "
                                           f"(sequences of 4,096 tokens, {recomputation}{sp})"))
        _print_plan(chosen_plan, config, per_node, card)

    panel.redraw_on_change(show)
    return panel


def _plan_controls(model_names: list, model, num_gpus, gpu, gpus_per_node, sequence_parallel, recompute) -> dict:
    """The plan explorer's controls, by name, starting at the explorer's arguments."""
    return {
        "model": widgets.Dropdown(options=model_names, value=model, description="model"),
        "gpus": widgets.SelectionSlider(options=list(PLAN_GPUS), value=num_gpus, description="GPUs"),
        "gpu": widgets.Dropdown(options=[(f"{name}, {card.memory_bytes // GiB} GiB", name)
                                         for name, card in hardware.GPUS.items()], value=gpu, description="GPU"),
        "per_node": widgets.ToggleButtons(options=[4, 8], value=gpus_per_node, description="GPUs per node"),
        "sequence_parallel": widgets.ToggleButtons(options=[("off", False), ("on", True)], value=sequence_parallel,
                                                   description="sequence parallel"),
        "recompute": widgets.ToggleButtons(options=["none", "selective", "full"], value=recompute,
                                           description="recompute"),
    }


def _plan_rows(config, chosen_plan, n: int, workload, capacity: int) -> dict:
    """The memory bars for ``chosen_plan`` on ``n`` GPUs of ``capacity`` bytes: label → {part: bytes}. The three
    questions' layout, then each recipe's best layout; or, when not even the state fits, the ZeRO ladder (state
    only: weights, grads and optimizer)."""
    if chosen_plan.source is None:           # not even the state fits: show why, rung by rung
        ladder = {f"{stage_name(s)} over {n} (state only)": state_per_gpu(config, Mesh(dp=n), s) for s in range(4)}
        return {k: {p: v[p] for p in ("weights", "grads", "optimizer")} for k, v in ladder.items()}
    mesh, stage = chosen_plan.source
    memory = memory_per_gpu(config, mesh, stage, workload, gpu_bytes=capacity)
    rows = {f"questions 1-3: {_layout_text(mesh, stage)}": memory_parts(workload.job(config, mesh, stage), memory)}
    for i, c in enumerate(chosen_plan.candidates):   # fastest first: the chosen one is the first
        mark = "▶ " if chosen_plan.fits and i == 0 else ""
        label = f"{mark}{c.recipe}: {_layout_text(c.mesh, c.zero_stage, c.num_chunks)}"
        rows[label] = memory_parts(c.job, c.memory)
    return rows


def _print_plan(chosen_plan, config, per_node: int, card) -> None:
    """Print the plan, its recipes' table (best layout, busiest GPU, fits, tokens/s, MFU), the bad smells of the
    chosen layout and the reserve the planner keeps."""
    print(chosen_plan)
    if chosen_plan.candidates:
        print(f"\n{'recipe':17} {'best layout':30} {'busiest GPU':>12}  {'fits':4} {'tokens/s':>10} {'MFU':>6}")
        for c in chosen_plan.candidates:
            print(f"{c.recipe:17} {_layout_text(c.mesh, c.zero_stage, c.num_chunks) + f', m = {c.num_microbatches}':30} "
                  f"{format_bytes(c.memory['total']):>12}  {'yes' if c.fits else 'no':4} "
                  f"{c.time.tokens_per_s:>10,.0f} {share_text(c.time.mfu):>6}")
    if chosen_plan.fits:
        for smell in bad_smells(chosen_plan.mesh, gpus_per_node=per_node, zero_stage=chosen_plan.zero_stage,
                                num_microbatches=chosen_plan.num_microbatches, config=config,
                                gpu_bytes=card.memory_bytes):
            print("bad smell:", smell)
    print(f"(reserve: {RESERVE_SHARE:.0%} of the card for what no formula counts; {card.name}: "
          f"{format_bytes(card.memory_bytes)}, 1 GiB = 2**30 bytes)")


# checkpoint seconds δ the failures explorer offers: round numbers on a log scale (a FloatLogSlider shows 7.94 for 8)
CHECKPOINT_SECONDS = (0.1, 0.3, 1, 3, 8, 20, 60, 200, 1000)


def failures_explorer(gpus=1024, checkpoint_s=8, restart_min=10, step_s=10.0):
    """GPUs × checkpoint seconds δ × restart minutes → the share of a run lost against the checkpoint interval
    (failures.waste_fraction: δ/τ + τ/2M + R/M), M at Llama 3's failure rate per GPU (failures.mtbf_seconds),
    Young's interval marked. ``panel.best``: Young's interval in seconds, as drawn."""
    controls = {
        "gpus": widgets.SelectionSlider(options=[64, 256, 1024, 4096, 16384], value=gpus, description="GPUs"),
        "checkpoint_s": widgets.SelectionSlider(options=list(CHECKPOINT_SECONDS), value=checkpoint_s,
                                                description="checkpoint δ (s)"),
        "restart_min": widgets.IntSlider(value=restart_min, min=1, max=60, description="restart (min)"),
    }
    panel = ExplorerPanel([widgets.HBox(list(controls.values()))], controls,
                          "the share of a run lost to checkpoints, redone work and restarts, against how often it "
                          "checkpoints, for a cluster size and checkpoint time of your choice")

    def show(chosen):
        mtbf = failures.mtbf_seconds(chosen["gpus"])
        panel.best = failures.young_interval(chosen["checkpoint_s"], mtbf)
        panel.draw(plots.checkpoint_waste(chosen["checkpoint_s"], mtbf, chosen["restart_min"] * 60, step_s=step_s,
                                          title=f"{chosen['gpus']:,} GPUs: a failure every {mtbf / 3600:.1f} h"))

    panel.redraw_on_change(show)
    return panel
