"""Tests for course_lib.ledger: the formulas, their checks on input, and measurement equal to prediction."""

import pytest
import torch

from course_lib import launch
from course_lib.data import SyntheticTokens
from course_lib.ledger import (
    CONVENTIONS,
    activation_bytes,
    deepspeed_estimate,
    gpt3_layer_terms,
    gpt_activation_bytes,
    gpt_layer_activation_bytes,
    zero_state_bytes,
)
from course_lib.measure import SavedActivations, measure_state_bytes, measure_step
from course_lib.mixed_precision import MixedPrecisionAdam
from course_lib.model import RMSNorm, build, count_params, loss_fn, preset
from course_lib.units import GiB, TiB

TINY_PARAMS = 164_416


# ---- training state: formulas ------------------------------------------------------------------------

def test_source_numbers():
    # The source: 7B (7.1e9) on 8 cards, mixed precision: DDP 106 GiB → Z1 36 → Z2 25 → Z3 13.
    per_rank = [zero_state_bytes(7.1e9, stage, 8)["total"] / GiB for stage in range(4)]
    assert [round(x) for x in per_rank] == [106, 36, 25, 13]
    assert zero_state_bytes(7.1e9, 0, 1)["total"] == 16 * 7_100_000_000
    assert round(zero_state_bytes(100e9, 0, 1)["total"] / TiB, 1) == 1.5
    assert round(zero_state_bytes(70e9, 3, 8)["total"] / GiB) == 130


def test_each_stage_shards_one_more_part():
    P, N = 1000, 4
    assert zero_state_bytes(P, 0, N) == {"weights": 2000, "grads": 2000, "optimizer": 12000, "total": 16000}
    assert zero_state_bytes(P, 1, N) == {"weights": 2000, "grads": 2000, "optimizer": 3000, "total": 7000}
    assert zero_state_bytes(P, 2, N) == {"weights": 2000, "grads": 500, "optimizer": 3000, "total": 5500}
    assert zero_state_bytes(P, 3, N) == {"weights": 500, "grads": 500, "optimizer": 3000, "total": 4000}


def test_uneven_shard_is_the_largest():
    # 10 parameters over 4 ranks: shards of 3, 3, 2, 2; the formula reports the largest, 3.
    assert zero_state_bytes(10, 3, 4, 4, 4, 8)["total"] == 3 * 16
    assert zero_state_bytes(2**62 + 1, 1, 2, 0, 0, 1)["optimizer"] == 2**61 + 1   # exact for huge counts


def test_one_rank_means_no_sharding():
    assert all(zero_state_bytes(12345, stage, 1) == zero_state_bytes(12345, 0, 1) for stage in range(4))


def test_conventions():
    totals = {name: c.total for name, c in CONVENTIONS.items()}
    assert totals == {"mixed": 16, "fp32": 16, "bf16+fp32 grads": 18, "fp32 grad accumulation": 20}
    fp32 = CONVENTIONS["fp32"]
    # Same 16 bytes as mixed, but ZeRO-1 can shard only 8 of them.
    assert zero_state_bytes(800, 1, 8, **fp32.per_param)["total"] == 800 * 8 + 100 * 8


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_params=-1, zero_stage=0, world_size=1), "num_params=-1"),
    (dict(num_params=7.5, zero_stage=0, world_size=1), "whole number"),
    (dict(num_params=10, zero_stage=4, world_size=1), "zero_stage=4: ZeRO stages are 0 (plain DDP), 1, 2, 3"),
    (dict(num_params=10, zero_stage=-1, world_size=1), "zero_stage=-1"),
    (dict(num_params=10, zero_stage=True, world_size=1), "zero_stage=True"),
    (dict(num_params=10, zero_stage=1, world_size=0), "world_size=0"),
    (dict(num_params=10, zero_stage=1, world_size=2, grad_bytes=-2), "grad_bytes=-2"),
])
def test_zero_state_bytes_rejects_nonsense(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        zero_state_bytes(**kwargs)


def test_deepspeed_estimate():
    assert deepspeed_estimate(800, 2, 8) == 2 * 800 + 18 * 100
    assert deepspeed_estimate(800, 3, 8, largest_layer_params=50) == 18 * 100 + 4 * 50
    # DeepSpeed's stage 2 is more than the formula's: it shards an fp32 gradient partition beside the state.
    assert deepspeed_estimate(7.1e9, 2, 8) > zero_state_bytes(7.1e9, 2, 8)["total"]
    with pytest.raises(ValueError, match="stage=1"):
        deepspeed_estimate(800, 1, 8)


# ---- activations: the published formula --------------------------------------------------------------

def test_korthikanti_formula_by_hand():
    # GPT-3 175B shapes: s=2048, h=12288, a=96, so 5as/h = 80.
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    assert activation_bytes(s, b, h, a) == sbh * (34 + 80) == sum(gpt3_layer_terms(s, b, h, a).values())
    assert activation_bytes(s, b, h, a, num_layers=96) == 96 * sbh * 114
    assert activation_bytes(s, b, h, a, tp=8) == sbh * (10 + 3 + 10)
    assert activation_bytes(s, b, h, a, tp=8, sequence_parallel=True) == sbh * 34 // 8 + sbh * 10
    assert activation_bytes(s, b, h, a, tp=8, recompute="selective") == sbh * (10 + 3)
    assert activation_bytes(s, b, h, a, tp=8, sequence_parallel=True, recompute="selective") == sbh * 34 // 8
    assert activation_bytes(s, b, h, a, recompute="full") == 2 * sbh
    assert activation_bytes(s, b, h, a, tp=8, sequence_parallel=True, recompute="full") == 2 * sbh // 8


def test_sequence_parallel_divides_everything_by_tp():
    full = activation_bytes(1024, 2, 4096, 32)
    assert activation_bytes(1024, 2, 4096, 32, tp=4, sequence_parallel=True) * 4 == full
    assert activation_bytes(1024, 2, 4096, 32, tp=4) * 4 > full     # without it, 10·sbh stays whole


@pytest.mark.parametrize("kwargs, message", [
    (dict(seq_len=-1), "seq_len=-1"), (dict(batch_size=0), "batch_size=0"), (dict(hidden=100), "hidden=100"),
    (dict(tp=3), "tp=3"), (dict(recompute="partial"), "recompute='partial'"),
])
def test_activation_bytes_rejects_nonsense(kwargs, message):
    args = dict(seq_len=128, batch_size=1, hidden=64, heads=8) | kwargs
    with pytest.raises(ValueError, match=message):
        activation_bytes(**args)


# ---- activations: the course model, predicted and measured ------------------------------------------

def measure_forward(config, batch_size, seq_len, dtype=torch.float32):
    model = build(config, dtype=dtype)
    # Separate tensors: with batch_size=1, SyntheticTokens' inputs and targets are two views of one storage.
    generator = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randint(config.vocab_size, (batch_size, seq_len), generator=generator) for _ in "xy")
    with SavedActivations(model) as saved:
        loss_fn(model(inputs), targets)
    return saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_size, seq_len", [(1, 1), (3, 17), (4, 64)])
def test_prediction_equals_measurement_term_by_term(dtype, batch_size, seq_len):
    config = preset("tiny")
    saved = measure_forward(config, batch_size, seq_len, dtype)
    predicted = gpt_activation_bytes(config, batch_size, seq_len, dtype)
    assert saved.bytes == predicted.pop("total")
    assert saved.by_kind() == predicted


def test_activations_are_linear_in_batch_plus_fixed_tables():
    config = preset("tiny", num_layers=2)
    fixed = gpt_activation_bytes(config, 0, 32)["total"]        # rotary tables and one scalar
    per_sample = measure_forward(config, 1, 32).bytes - fixed
    assert fixed == 2 * 4 * 32 * (config.head_dim // 2) * 4 + 4
    for batch_size in (2, 5):
        assert measure_forward(config, batch_size, 32).bytes - fixed == batch_size * per_sample


def test_saved_activations_leaves_out_parameters_and_counts_storage_once():
    linear = torch.nn.Linear(8, 4)
    x = torch.randn(5, 8, requires_grad=True)
    with SavedActivations(linear) as saved:
        y = linear(x)              # saves x and weight.t(), a view of the parameter
        (y * y).sum()              # saves y twice: one storage
    assert saved.bytes == x.nbytes + y.nbytes
    with SavedActivations(linear) as saved, torch.no_grad():
        linear(x)
    assert saved.bytes == 0


def test_full_recompute_keeps_layer_inputs_and_one_layer():
    """The peak: every layer's input, and one layer's rerun, which saves its own terms but its input (the
    checkpoint already holds it; tests/test_recompute.py measures both)."""
    config = preset("tiny")
    none = gpt_activation_bytes(config, 2, 16)
    full = gpt_activation_bytes(config, 2, 16, recompute="full")
    one_layer = sum(none[k] for k in ("attn_norm", "attn.q_proj", "attn", "mlp_norm", "mlp.gate_proj", "mlp",
                                      "mlp.down_proj")) // config.num_layers
    layer_input = 2 * 16 * config.hidden * 4
    assert full["one layer, recomputed"] == one_layer - layer_input
    assert full["layer input"] == config.num_layers * layer_input
    assert full["total"] < none["total"]


def test_the_fused_norm_saves_its_input_and_an_fp32_rstd_the_decomposed_one_two_fp32_copies():
    config = preset("tiny")
    b, s, d = 2, 16, config.hidden
    for dtype, e in ((torch.float32, 4), (torch.bfloat16, 2)):
        fused = gpt_layer_activation_bytes(config, b, s, dtype)["attn_norm"]
        decomposed = gpt_layer_activation_bytes(config, b, s, dtype, fused_norm=False)["attn_norm"]
        assert (fused, decomposed) == (b * s * d * e + b * s * 4, 2 * b * s * d * 4 + b * s * 4)
        measured = {}
        for fused_norm in (True, False):
            norm = RMSNorm(d, 1e-5, fused=fused_norm).to(dtype)
            x = torch.randn(b, s, d, dtype=dtype, requires_grad=True)
            with SavedActivations(norm) as saved:
                norm(x)
            measured[fused_norm] = saved.bytes
        assert (measured[True], measured[False]) == (fused, decomposed)


def test_gpt_activation_bytes_rejects_nonsense():
    config = preset("tiny")
    with pytest.raises(ValueError, match="batch_size=-2"):
        gpt_activation_bytes(config, -2, 16)
    with pytest.raises(ValueError, match="seq_len=65"):
        gpt_activation_bytes(config, 1, 65)
    with pytest.raises(ValueError, match="dtype=torch.float64"):
        gpt_activation_bytes(config, 1, 16, torch.float64)
    with pytest.raises(ValueError, match="recompute='some'"):
        gpt_activation_bytes(config, 1, 16, recompute="some")


# ---- training state: measured -----------------------------------------------------------------------

def one_step(model, optimizer, batch_size=4, seq_len=16):
    inputs, targets = SyntheticTokens(128, seq_len).batch(0, batch_size)
    return measure_step(model, optimizer, inputs, targets, loss_fn)


def test_fp32_adam_measured_equals_formula_plus_step_counters():
    model = build(preset("tiny"))
    optimizer = torch.optim.Adam(model.parameters())
    assert measure_state_bytes(model, optimizer)["optimizer"] == 0      # torch makes Adam's state at step 1
    result = one_step(model, optimizer)
    measured, predicted = result["state"], zero_state_bytes(TINY_PARAMS, 0, 1, **CONVENTIONS["fp32"].per_param)
    assert {k: measured[k] for k in ("weights", "grads", "optimizer")} == \
           {k: predicted[k] for k in ("weights", "grads", "optimizer")}
    assert measured["step_counters"] == 4 * len(list(model.parameters()))    # a float32 `step` per tensor
    assert measured["total"] == predicted["total"] + measured["step_counters"]
    assert result["cuda_peak"] is None
    assert result["activations"].bytes == gpt_activation_bytes(preset("tiny"), 4, 16)["total"]


def test_mixed_precision_measured_equals_the_16_bytes_exactly():
    model = build(preset("tiny"), dtype=torch.bfloat16)
    optimizer = MixedPrecisionAdam(model.parameters(), lr=1e-3)
    measured = one_step(model, optimizer)["state"]
    assert measured.pop("step_counters") == 0
    assert measured == zero_state_bytes(TINY_PARAMS, 0, 1) and measured["total"] == 16 * TINY_PARAMS


def test_tied_weight_counted_once():
    config = preset("tiny", tie_embeddings=True)
    model = build(config)
    state = measure_state_bytes(model)
    assert state["weights"] == 4 * count_params(config)
    assert sum(t.nbytes for t in model.state_dict().values()) > state["weights"]   # state_dict lists it twice


def test_mixed_precision_adam_is_adam():
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
    theirs.load_state_dict(ours.state_dict())
    opt_ours = MixedPrecisionAdam(ours.parameters(), lr=0.1)
    opt_theirs = torch.optim.Adam(theirs.parameters(), lr=0.1, foreach=False)
    for step in range(3):
        x = torch.randn(4, 6)
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))


def test_mixed_precision_adam_rounds_master_into_bf16():
    model = build(preset("tiny", num_layers=1), dtype=torch.bfloat16)
    optimizer = MixedPrecisionAdam(model.parameters(), lr=1e-2)
    one_step(model, optimizer)
    for param in model.parameters():
        master = optimizer.state[param]["master"]
        assert master.dtype == torch.float32 and torch.equal(param, master.to(torch.bfloat16))
    with pytest.raises(ValueError, match="lr=-1"):
        MixedPrecisionAdam(model.parameters(), lr=-1)


def _zero1_rank(rank, world_size):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    torch.manual_seed(0)     # the same replica on every rank; plain Linear layers start faster than build()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 16), torch.nn.Linear(16, 8)).bfloat16()
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=MixedPrecisionAdam, lr=1e-3)
    model(torch.randn(4, 32, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    return measure_state_bytes(model, optimizer)


@pytest.mark.ranks
def test_zero1_ranks_split_optimizer_state_exactly():
    params = (32 * 64 + 64) + (64 * 16 + 16) + (16 * 8 + 8)
    states = launch(_zero1_rank, 2, timeout=60)
    assert all(s["weights"] == 2 * params and s["grads"] == 2 * params for s in states)
    assert sum(s["optimizer"] for s in states) == 12 * params       # nothing lost, nothing held twice
    largest = zero_state_bytes(params, 1, 2)["optimizer"]
    assert all(0 < s["optimizer"] for s in states) and max(s["optimizer"] for s in states) >= largest
