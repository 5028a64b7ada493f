"""The long-context explorer of notebook 07: sequence length × tensor parallel (with or without sequence
parallelism) × context parallel → what each GPU holds, from the ledger's formulas (instant).

Per rank, with t = tp and c = cp, one micro-batch of one sequence of s tokens in bf16:

    activations = L · layer(s/c tokens, t, SP)  +  embedding, final norm, head and loss of s/c tokens
    state       = the mixed-precision state of the rank's TP slice (CP keeps every weight on every rank)

``layer`` is ledger.gpt_layer_activation_bytes, which notebooks 04 and 07 measure to the byte for TP and TP + SP;
07 measures CP alone at exactly 1/cp. TP and CP together are the two formulas composed (the course runs each
alone): CP gives each TP group s/c tokens, and TP splits those as it would split a shorter sequence.
"""

import ipywidgets as widgets
import torch

from ...ledger import gpt_activation_bytes, gpt_layer_activation_bytes
from ...mesh import Mesh
from ...model import preset
from ...recipes import state_per_gpu
from ...units import GiB
from .. import plots
from ._panel import ExplorerPanel, format_bytes, plural

MODELS = {"Llama-2-7B": "llama2-7b", "Llama-2-70B": "llama2-70b", "Qwen2-7B": "qwen2-7b"}  # Qwen2-7B last: its 28 heads refuse TP 8
SEQ_LENS = tuple(2**k for k in range(12, 18))          # 4k … 128k tokens
TP_SIZES, CP_SIZES = (1, 2, 4, 8), (1, 2, 4, 8, 16, 32)
OUTSIDE_LAYERS = ("embed", "norm", "head", "loss")


def activations_per_rank(config, seq_len: int, tp: int = 1, sequence_parallel: bool = False, cp: int = 1,
                         batch_size: int = 1, dtype=torch.bfloat16) -> int:
    """Bytes of activations one rank saves for backward (the module docstring's sum). Raises the ledger's
    ValueError when tp does not split the heads or the MLP, and one when s is not divisible by 2·cp."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2·cp = {2 * cp}: load-balanced context "
                         "parallelism cuts it into 2·cp equal chunks")
    local = seq_len // cp
    layer = gpt_layer_activation_bytes(config, batch_size, local, dtype, tp, sequence_parallel)
    ends = gpt_activation_bytes(config, batch_size, local, dtype)
    return config.num_layers * sum(layer.values()) + sum(ends[name] for name in OUTSIDE_LAYERS)


def long_context_explorer(model="Llama-2-7B", seq_len=32768, tp=8, sequence_parallel=True, cp=4,
                          gpu_bytes=80 * GiB):
    """Bars for one GPU alone, TP, TP + SP, CP, and TP (+ SP) with CP together: state and activations per rank
    against an 80 GiB card. ``panel.rows``: bar → {part: bytes}, as drawn (empty when the split is refused)."""
    controls = {
        "model": widgets.Dropdown(options=list(MODELS), value=model, description="model"),
        "seq_len": widgets.SelectionSlider(options=list(SEQ_LENS), value=seq_len, description="tokens s"),
        "tp": widgets.ToggleButtons(options=list(TP_SIZES), value=tp, description="TP"),
        "sequence_parallel": widgets.ToggleButtons(options=[("off", False), ("on", True)], value=sequence_parallel,
                                                   description="SP"),
        "cp": widgets.SelectionSlider(options=list(CP_SIZES), value=cp, description="CP"),
    }
    panel = ExplorerPanel([widgets.HBox([widgets.VBox([controls[k] for k in ("model", "seq_len", "cp")]),
                                         widgets.VBox([controls[k] for k in ("tp", "sequence_parallel")])])],
                          controls, "the memory of each GPU for one long sequence, split by tensor, sequence and "
                                    "context parallelism")
    panel.rows = {}

    def show(chosen):
        config = preset(MODELS[chosen["model"]], max_seq_len=max(SEQ_LENS))
        s, t, sp, c = chosen["seq_len"], chosen["tp"], chosen["sequence_parallel"], chosen["cp"]
        both = f"TP {t}" + (" + SP" if sp else "") + f", CP {c}"
        layouts = {"one GPU": (1, False, 1), f"TP {t}": (t, False, 1), f"TP {t} + SP": (t, True, 1),
                   f"CP {c}": (1, False, c), both: (t, sp, c)}
        try:
            rows = {}
            for label, (tp_, sp_, cp_) in layouts.items():
                state = state_per_gpu(config, Mesh(tp=tp_), 0)
                rows[label] = {"weights": state["weights"], "grads": state["grads"], "optimizer": state["optimizer"],
                               "activations": activations_per_rank(config, s, tp_, sp_, cp_)}
        except ValueError as err:
            panel.rows = {}
            print(err)
            return
        panel.rows = rows
        panel.draw(plots.memory_bars(rows, capacity_bytes=gpu_bytes, capacity_label=f"{format_bytes(gpu_bytes)} card",
                                     title=f"{chosen['model']}, one sequence of {s:,} tokens, bf16: per GPU"))
        for label, parts in rows.items():
            gpus = layouts[label][0] * layouts[label][2]
            name = f"{label} ({plural(gpus, 'GPU')})"
            print(f"{name:30} activations {format_bytes(parts['activations']):>11}, with the "
                  f"state {format_bytes(sum(parts.values())):>11} per GPU")
        print("(TP and CP together: the two formulas composed; the course runs and measures each alone)")

    panel.redraw_on_change(show)
    return panel
