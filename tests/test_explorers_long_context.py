"""course_lib.presentation.explorers.long_context (notebook 07): the panel's activations per rank are the ledger's formulas
composed, and hold the relation notebook 07 measures for context parallelism (every byte / cp but the loss's
one fp32 scalar); it redraws for every control and names a split that cannot be made."""

import matplotlib
import pytest
import test_explorers
import torch
from test_explorers import assert_says_what_it_is, every_option, values

from course_lib.ledger import gpt_activation_bytes, gpt_layer_activation_bytes
from course_lib.model import preset
from course_lib.presentation import explorers
from course_lib.presentation.explorers.long_context import activations_per_rank
from course_lib.units import GiB

matplotlib.use("Agg")
drawn = test_explorers.drawn


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_context_parallel_keeps_one_cp_th_of_every_byte_but_the_loss_scalar_as_notebook_07_measures(cp):
    tiny = preset("tiny")
    whole = gpt_activation_bytes(tiny, 2, 32, torch.float32)["total"]
    assert (activations_per_rank(tiny, 32, cp=cp, batch_size=2, dtype=torch.float32) - 4) * cp == whole - 4


def test_tensor_and_sequence_parallel_split_the_layers_as_the_ledger_measures_them():
    tiny = preset("tiny")
    plain, split = (activations_per_rank(tiny, 32, tp=4, sequence_parallel=sp, batch_size=2, dtype=torch.float32)
                    for sp in (False, True))
    layers = {sp: tiny.num_layers * sum(gpt_layer_activation_bytes(tiny, 2, 32, torch.float32, 4, sp).values())
              for sp in (False, True)}
    assert plain - split == layers[False] - layers[True] > 0           # SP saves only inside the layers
    with pytest.raises(ValueError, match="not divisible by 2·cp = 64"):
        activations_per_rank(tiny, 32, cp=32)


def test_long_context_explorer_draws_five_layouts_and_names_a_split_it_cannot_make(drawn, capsys):
    panel = explorers.long_context_explorer()
    assert values(panel.controls) == {"model": "Llama-2-7B", "seq_len": 32768, "tp": 8, "sequence_parallel": True,
                                      "cp": 4}
    llama = preset("llama2-7b", max_seq_len=1 << 17)
    assert list(panel.rows) == ["one GPU", "TP 8", "TP 8 + SP", "CP 4", "TP 8 + SP, CP 4"]
    assert panel.rows["one GPU"]["activations"] == gpt_activation_bytes(llama, 1, 32768, torch.bfloat16)["total"]
    acts = [parts["activations"] for parts in panel.rows.values()]
    assert acts[0] > acts[1] > acts[2] and acts[0] > acts[3] > acts[4]
    assert panel.rows["CP 4"]["weights"] == panel.rows["one GPU"]["weights"] > panel.rows["TP 8"]["weights"]
    assert drawn[-1].kwargs["capacity_bytes"] == 80 * GiB and "32,768 tokens" in drawn[-1].title
    assert "TP 8 + SP, CP 4 (32 GPUs)" in capsys.readouterr().out
    panel.controls["model"].value = "Qwen2-7B"                 # 28 heads do not split 8 ways
    assert panel.rows == {} and "num_heads=28" in capsys.readouterr().out
    panel.controls["tp"].value = 4
    assert list(panel.rows)[-1] == "TP 4 + SP, CP 4" and "one GPU (1 GPU)" in capsys.readouterr().out


def test_long_context_explorer_draws_every_setting_of_every_control(drawn):
    panel = explorers.long_context_explorer(tp=4)
    every_option(panel, drawn, skip=("model",))                     # Llama-2-7B splits its heads 8 ways too
    panel.controls["tp"].value = 4
    every_option(panel, drawn, skip=tuple(name for name in panel.controls if name != "model"))  # TP 4: every model


def test_long_context_explorer_says_what_it_is_where_no_kernel_draws_it(drawn):
    panel = explorers.long_context_explorer()
    assert_says_what_it_is(panel, panel._repr_mimebundle_())
