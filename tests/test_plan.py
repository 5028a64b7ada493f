"""course_lib.plan: the three questions (does the state fit, does one layer fit, where are the node
boundaries) give the source's layouts, keep the rules on many clusters, and warn of the bad smells."""

import itertools

import pytest

from course_lib.mesh import Mesh
from course_lib.model import ModelConfig, preset
from course_lib.plan import bad_smells, need_per_gpu, plan
from course_lib.units import GB, GiB


def test_the_plan_for_the_sources_cases():
    small = plan(preset("tiny"), num_gpus=8, gpu_bytes=24 * GiB)   # fits on one card, training is just slow
    assert (small.mesh, small.zero_stage) == (Mesh(dp=8), 0)
    seven = plan(preset("llama2-7b"), num_gpus=8, gpu_bytes=80 * GiB)
    assert (seven.mesh, seven.zero_stage) == (Mesh(dp=8), 1)   # DDP 100 GiB does not fit, ZeRO-1 does
    seventy = plan(preset("llama2-70b"), num_gpus=8, gpu_bytes=80 * GiB)
    assert not seventy.fits and seventy.min_gpus == 13      # 16 B × 68.98e9 / 80 GiB = 12.8
    assert 125 * GiB < seventy.state_bytes < 135 * GiB       # ZeRO-3 on 8 cards: ~130 GiB per card
    many = plan(preset("llama2-70b"), num_gpus=32, gpu_bytes=80 * GiB)
    assert (many.mesh, many.zero_stage) == (Mesh(dp=2, tp=8, pp=2), 1)   # TP in the node, PP across, ZeRO-1
    assert many.fits and "each node holds one TP group" in str(many) and "PP=2 crosses nodes" in str(many)


HUGE_LAYERS = ModelConfig(vocab_size=32000, hidden=16384, num_layers=4, num_heads=128, num_kv_heads=16,
                          intermediate=65536, max_seq_len=4096)   # one layer's weights + grads: 14.3 GiB


def test_a_layer_too_big_for_one_gpu_is_split_with_tp():
    layout = plan(HUGE_LAYERS, num_gpus=8, gpu_bytes=40 * GiB)   # ZeRO-3 shards 30.5 GiB + a whole layer 14.3
    assert "14.3 GiB, beside 30.5 GiB of shards > 40.0 GiB: TP=2 inside a node" in layout.answers[1]
    assert layout.fits and (layout.mesh, layout.zero_stage) == (Mesh(dp=4, tp=2), 3)
    assert layout.state_bytes <= 40 * GiB


@pytest.mark.parametrize("name", ["tiny", "llama2-7b", "qwen2-7b", "llama2-70b"])
def test_every_plan_keeps_the_rules(name):
    """Over many clusters: a plan that fits needs no more than the card, TP divides the node and the heads,
    a pipeline takes ZeRO-1 at most, and the grid covers every GPU."""
    for num_gpus, per_node, card in itertools.product((4, 8, 16, 32, 64, 128), (4, 8), (13, 24, 40, 80)):
        if num_gpus % min(per_node, num_gpus):
            continue
        layout = plan(preset(name), num_gpus=num_gpus, gpu_bytes=card * GiB, gpus_per_node=per_node)
        if not layout.fits:
            continue
        mesh = layout.mesh
        assert mesh.size == num_gpus and min(per_node, num_gpus) % mesh.tp == 0
        assert layout.state_bytes == need_per_gpu(preset(name), mesh, layout.zero_stage) <= card * GiB
        assert mesh.pp == 1 or layout.zero_stage <= 1
        mesh.check_model(preset(name))


def test_bad_smells_and_bad_input():
    smells = bad_smells(Mesh(tp=16, pp=8), gpus_per_node=8, num_microbatches=4, zero_stage=3,
                        config=preset("tiny"), gpu_bytes=80 * GB)
    assert [s.split(":")[0] for s in smells] == ["TP 16 does not fit in the nodes of 8 GPUs",
                                                 "PP 8 stages > 4 micro-batches", "ZeRO-3 with a pipeline",
                                                 "ZeRO-3 on a model whose whole state (2.5 MiB) fits on one GPU"]
    assert bad_smells(Mesh(dp=2, tp=8, pp=2), gpus_per_node=8, num_microbatches=16) == []
    with pytest.raises(ValueError, match="num_gpus=12 must be a whole number of nodes of gpus_per_node=8"):
        plan(preset("tiny"), num_gpus=12, gpu_bytes=80 * GB)
