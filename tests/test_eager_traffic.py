"""course_lib.eager_traffic: the count on the meta device is the count of the model run for real on this CPU, a TP
rank's layer keeps its norms whole, and a machine that runs the model eagerly is costed with it, as is a GPU run
whose code dispatches its memory-bound ops one by one (kernel_times' elementwise_ops), its rotary as its code
writes it (eager_traffic.ROTARY)."""

from dataclasses import replace

import pytest
import torch

from course_lib import model
from course_lib.eager_traffic import (
    DTYPES,
    ROTARY,
    _complex_rotary,
    _counted,
    _fields,
    _rotary_counted,
    _rotate_half_rotary,
    all_but_norms,
    head_traffic,
    layer_traffic,
)
from course_lib.hardware import GPUS
from course_lib.kernel_times import head_operations, layer_operations
from course_lib.model import apply_rope, preset, widened

TINY = preset("tiny")
SHAPE = dict(micro_batch_size=2, seq_len=16)


@pytest.mark.parametrize("bytes_per_element", [2, 4, 8])
@pytest.mark.parametrize("tp", [1, 2])
def test_meta_counts_what_the_cpu_runs(tp, bytes_per_element):
    # On the meta device SDPA is sent to the CPU's flash kernel; on the CPU it picks it itself. Same ops, same bytes.
    on_meta = layer_traffic(TINY, tp=tp, bytes_per_element=bytes_per_element, **SHAPE)
    on_cpu = layer_traffic(TINY, tp=tp, bytes_per_element=bytes_per_element, device="cpu", **SHAPE)
    assert on_meta == on_cpu
    assert head_traffic(TINY, bytes_per_element=bytes_per_element, **SHAPE) == head_traffic(
        TINY, bytes_per_element=bytes_per_element, device="cpu", **SHAPE)


def test_the_tiny_layer_as_the_docstrings_count_it():
    """eager_traffic's and kernel_times' docstrings: 48 ops forward and 44 backward, 17.8 MB, where the fused
    rows move 5.8 MB (8 × 64 tokens, fp32)."""
    counted = layer_traffic(TINY, micro_batch_size=8, seq_len=64)
    assert (counted["forward"].kernels, counted["backward"].kernels) == (48, 44)
    assert round((counted["forward"].bytes + counted["backward"].bytes) / 1e6, 1) == 17.8
    memory_bound = ("rotary", "RMSNorm ×2", "residual add ×2", "SwiGLU products")
    fused = sum(op.bytes for op in layer_operations(TINY, GPUS["A100 80GB"], micro_batch_size=8, seq_len=64,
                                                    bytes_per_element=4) if op.name in memory_bound)
    assert round(fused / 1e6, 1) == 5.8


def test_a_tp_rank_halves_its_heads_and_columns_not_its_norms():
    whole, half = (layer_traffic(TINY, tp=tp, **SHAPE) for tp in (1, 2))
    for direction in ("forward", "backward"):
        assert half[direction].kernels == whole[direction].kernels          # the same ops, on narrower tensors
        assert whole[direction].bytes / 2 < half[direction].bytes < whole[direction].bytes


def test_eager_moves_more_than_the_fused_count_and_is_costed_at_bandwidth():
    fused_gpu = GPUS["A100 80GB"]
    eager_gpu = replace(fused_gpu, eager_elementwise=True)
    kernels = dict(micro_batch_size=8, seq_len=64, bytes_per_element=4)
    memory_bound = ("rotary", "RMSNorm ×2", "residual add ×2", "SwiGLU products")
    fused = sum(op.bytes for op in layer_operations(TINY, fused_gpu, **kernels) if op.name in memory_bound)
    (eager,) = [op for op in layer_operations(TINY, eager_gpu, **kernels) if op.name.startswith("elementwise")]
    counted = layer_traffic(TINY, micro_batch_size=8, seq_len=64)
    assert eager.bytes == counted["forward"].bytes + counted["backward"].bytes
    assert 3 * fused < eager.bytes < 3.5 * fused        # "about three times" (notebook 09, part 3)
    assert eager.seconds == pytest.approx(eager.kernels * eager_gpu.launch_s)   # tiny: each op its launch
    wide, big = preset("tiny", **widened(4096)), dict(micro_batch_size=1, seq_len=4096, bytes_per_element=2)
    (eager,) = [op for op in layer_operations(wide, eager_gpu, **big) if op.name.startswith("elementwise")]
    bandwidth = eager_gpu.hbm_share * eager_gpu.hbm_bytes_per_s
    assert eager.seconds == pytest.approx(eager.bytes / bandwidth)             # a 4,096-wide layer: memory-bound
    (recomputed,) = [op for op in layer_operations(wide, eager_gpu, recompute="full", **big)
                     if op.name.startswith("elementwise")]
    assert recomputed.bytes == eager.bytes + layer_traffic(wide, **big)["forward"].bytes   # the forward again


def test_a_gpu_run_eager_or_eager_but_for_its_norms():
    """elementwise_ops: "eager" prices a catalogue GPU's layer as eager_traffic counts it (as the calibrated CPU
    is), each op at a copy's rate; "eager, fused norm" (torchtitan's fused_rmsnorm) takes the two norms out of the
    count and runs them as one fused kernel each; the head likewise its final norm. Bytes: fused < eager but the
    norms < eager."""
    h100, wide = GPUS["H100 SXM"], preset("tiny", **widened(1024))
    big = dict(micro_batch_size=2, seq_len=512, bytes_per_element=2)

    def layer(ops):
        return {op.name: op for op in layer_operations(wide, h100, recompute="op", elementwise_ops=ops, **big)}
    fused, eager, but_norms = layer("fused"), layer("eager"), layer("eager, fused norm")
    as_the_cpu = {op.name: op for op in layer_operations(wide, replace(h100, eager_elementwise=True),
                                                         recompute="op", **big)}
    assert eager.keys() == as_the_cpu.keys() and eager["elementwise ops, as model.py runs them"].bytes == as_the_cpu[
        "elementwise ops, as model.py runs them"].bytes
    counted = layer_traffic(wide, **big)
    total = counted["forward"].bytes * 2 + counted["backward"].bytes          # the forward again: recomputed
    assert eager["elementwise ops, as model.py runs them"].bytes == total
    rest = but_norms["elementwise ops but the norms, as model.py runs them"]
    left = all_but_norms(counted, wide, norms=2, **big)
    assert rest.bytes == left["forward"].bytes * 2 + left["backward"].bytes
    assert but_norms["RMSNorm ×2"] == fused["RMSNorm ×2"] and "rotary" not in but_norms
    assert 0 < rest.bytes < total and rest.kernels < eager["elementwise ops, as model.py runs them"].kernels
    memory_bound = ("rotary", "RMSNorm ×2", "residual add ×2", "SwiGLU products")
    assert sum(fused[name].bytes for name in memory_bound) < rest.bytes + but_norms["RMSNorm ×2"].bytes < total
    head = {ops: [op.name for op in head_operations(wide, h100, elementwise_ops=ops, **big)]
            for ops in ("fused", "eager", "eager, fused norm")}
    assert head["eager, fused norm"] == ["final RMSNorm", "head", "loss, as model.py runs it"]
    assert head["eager"] == ["head", "final RMSNorm and loss, as model.py runs them"]
    # sequence parallelism: the norms fused on the rank's T/t rows (a GPU run's; this CPU's refuses it, below)
    split = {op.name: op for op in layer_operations(wide, h100, tp=2, sequence_parallel=True, recompute="op",
                                                    elementwise_ops="eager", **big)}
    fused_split = {op.name: op for op in layer_operations(wide, h100, tp=2, sequence_parallel=True, recompute="op",
                                                          **big)}
    assert split["RMSNorm ×2"].bytes == pytest.approx(fused["RMSNorm ×2"].bytes / 2)       # T/2 rows
    whole = layer_traffic(wide, tp=2, **big)                       # the count's adds cut to 1/t (2 reads, 1 write)
    adds = 2 * 3 * 2 * 512 * 1024 * 2 / 2
    rest = all_but_norms(whole, wide, norms=2, **big)
    assert split["elementwise ops but the norms, as model.py runs them"].bytes == pytest.approx(
        2 * (rest["forward"].bytes - adds) + rest["backward"].bytes - adds)
    assert fused_split["RMSNorm ×2"] == split["RMSNorm ×2"]
    with pytest.raises(ValueError, match="elementwise_ops='compiled': one of 'fused', 'eager', 'eager, fused norm'"):
        layer_operations(wide, h100, elementwise_ops="compiled", **big)
    with pytest.raises(ValueError, match="elementwise_ops='compiled'"):
        head_operations(wide, h100, elementwise_ops="compiled", **big)


def test_what_it_cannot_count_is_refused():
    with pytest.raises(ValueError, match="num_experts=4"):
        layer_traffic(preset("tiny", num_experts=4), **SHAPE)
    with pytest.raises(ValueError, match="TP=3"):
        layer_traffic(TINY, tp=3, **SHAPE)
    with pytest.raises(ValueError, match="bytes_per_element=1"):
        layer_traffic(TINY, bytes_per_element=1, **SHAPE)
    eager_gpu = replace(GPUS["A100 80GB"], eager_elementwise=True)
    with pytest.raises(ValueError, match="sequence_parallel=True"):
        layer_operations(TINY, eager_gpu, tp=2, sequence_parallel=True, **SHAPE)
    with pytest.raises(ValueError, match="elementwise_ops='eager, fused norm', rotary='model.py' on .*: it runs the "
                                         "course's model"):
        layer_operations(TINY, eager_gpu, elementwise_ops="eager, fused norm", **SHAPE)
    with pytest.raises(ValueError, match="rotary='complex' on .*: it runs the course's model"):
        layer_operations(TINY, eager_gpu, rotary="complex", **SHAPE)
    with pytest.raises(ValueError, match="rotary='yarn': one of 'model.py', 'complex', 'rotate_half'"):
        layer_operations(TINY, GPUS["A100 80GB"], elementwise_ops="eager", rotary="yarn", **SHAPE)
    with pytest.raises(ValueError, match="rotary='yarn': one of"):
        layer_traffic(TINY, rotary="yarn", **SHAPE)


def test_each_frameworks_rotary_is_the_same_rotation():
    """The rotaries layer_traffic(rotary=...) counts compute what model.py's does: Hugging Face's on the same
    channel pairs (i, i + h_d/2), torchtitan's on adjacent pairs (2i, 2i + 1), the same rotation once the channels
    are reordered."""
    batch, seq, heads, head_dim, theta = 2, 12, 3, 8, 10000.0
    x = torch.randn(batch, seq, heads, head_dim, generator=torch.Generator().manual_seed(0))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32),
                         theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ours = apply_rope(x, theta)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1)[:, None, :] for f in (torch.cos, torch.sin))
    torch.testing.assert_close(_rotate_half_rotary(x, cos, sin), ours)
    adjacent = torch.stack(x.chunk(2, dim=-1), dim=-1).flatten(3)        # (i, i + h_d/2) -> (2i, 2i + 1)
    rotated = _complex_rotary(adjacent, torch.polar(torch.ones_like(angles), angles))
    torch.testing.assert_close(torch.cat([rotated[..., 0::2], rotated[..., 1::2]], dim=-1), ours)


@pytest.mark.parametrize("rotary", ROTARY)
def test_a_rotary_counted_on_meta_is_counted_as_the_cpu_runs_it(rotary):
    fields = tuple(sorted(vars(TINY).items()))
    assert _rotary_counted(rotary, fields, 2, 16, 1, 4) == _rotary_counted(rotary, fields, 2, 16, 1, 4, "cpu")


def test_a_layer_with_another_rotary_is_counted_as_that_layer_runs(monkeypatch):
    """layer_traffic(rotary=...) takes model.py's rotary out of the count and puts the framework's in: the same
    count as the layer run with apply_rope replaced by the framework's rotary (its angles made outside the count,
    as the framework makes them once), for a TP rank too, in fp32 and bf16."""
    config = preset("tiny", hidden=64, num_heads=4, num_kv_heads=2)
    for tp, e in ((1, 4), (2, 2)):
        shape = dict(micro_batch_size=2, seq_len=16, tp=tp, bytes_per_element=e)
        with torch.device("meta"):
            angles = torch.zeros(16, config.head_dim // 2)
            complex_angles = torch.polar(torch.ones_like(angles), angles)
            cos, sin = (torch.zeros(16, 1, config.head_dim, dtype=DTYPES[e]) for _ in range(2))
        for rotary, rotate in (("complex", lambda x, theta: _complex_rotary(x, complex_angles)),
                               ("rotate_half", lambda x, theta: _rotate_half_rotary(x, cos, sin))):
            _counted.cache_clear()                            # the layer counted afresh, with the rotary replaced
            try:
                with monkeypatch.context() as patch:
                    patch.setattr(model, "apply_rope", rotate)
                    as_it_runs = _counted("layer", _fields(config, e), 2, 16, tp, e, "meta")
            finally:
                _counted.cache_clear()                        # no replaced count left in the cache
            assert layer_traffic(config, rotary=rotary, **shape) == as_it_runs != layer_traffic(config, **shape)


def test_torchtitans_and_hugging_faces_rotary_move_less_than_model_pys():
    """Llama 3 8B's layer, one sequence of 8,192 tokens in bf16 (eager_traffic's docstring: 2.5 and 2.1 times):
    the course's rotary computes its angles at every call and rotates in fp32; torchtitan's multiplies complex
    numbers in fp32 by angles computed once, Hugging Face's rotates in bf16, its halves sliced (a backward that pads
    each slice's gradient, and adds)."""
    llama3_8b = preset("tiny", vocab_size=128256, hidden=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                       intermediate=14336, max_seq_len=8192, rope_theta=500000.0)
    fields = tuple(sorted(vars(llama3_8b).items()))
    rotary = {name: _rotary_counted(name, fields, 1, 8192, 1, 2) for name in ROTARY}
    moved = {name: sum(way.bytes for way in counted.values()) for name, counted in rotary.items()}
    assert 2.3 < moved["model.py"] / moved["complex"] < 2.7 and 1.9 < moved["model.py"] / moved["rotate_half"] < 2.3
    assert rotary["rotate_half"]["backward"].bytes > rotary["complex"]["backward"].bytes     # the padded slices
    h100, kernels = GPUS["H100 SXM"], dict(micro_batch_size=1, seq_len=8192, bytes_per_element=2)

    def eager(**choice):
        (op,) = [op for op in layer_operations(llama3_8b, h100, elementwise_ops="eager", **choice, **kernels)
                 if op.name.startswith("elementwise")]
        return op
    assert eager(rotary="complex").seconds < eager().seconds
    assert eager(rotary="complex").name == "elementwise ops, as model.py runs them, rotary 'complex'"
    fused = [layer_operations(llama3_8b, h100, rotary=name, **kernels) for name in ROTARY]
    assert fused[0] == fused[1] == fused[2]                      # fused kernels: how the code writes it is moot


def test_counting_leaves_no_state_behind_and_shares_none():
    before = torch.get_default_dtype(), torch.is_grad_enabled()
    config = preset("tiny", hidden=32, num_heads=4, num_kv_heads=2)
    counted = layer_traffic(config, **SHAPE)
    assert (torch.get_default_dtype(), torch.is_grad_enabled()) == before
    assert torch.zeros(1).device.type == "cpu"                                  # torch.device("meta") is left
    with torch.no_grad():                                                       # counted as if grad were on
        assert layer_traffic(config, micro_batch_size=3, seq_len=16) == layer_traffic(
            config, micro_batch_size=3, seq_len=16, device="cpu")
    with pytest.raises(TypeError):
        counted["forward"] = None                                               # the cache's copy is read-only
