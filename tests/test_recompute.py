"""Activation checkpointing, run: saved bytes against ledger's formula (what a forward keeps, and what backward's
rerun of a layer saves), the extra FLOPs counted by FlopCounterMode against cost.recompute_flops, and gradients
equal to a run without checkpointing in float64 (one process, TP with sequence parallelism, the pipeline)."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from course_lib import launch
from course_lib.comm import Comm
from course_lib.cost import forward_terms, recompute_flops
from course_lib.data import SyntheticTokens
from course_lib.ledger import gpt_activation_bytes, gpt_layer_activation_bytes, recomputed_layer_bytes
from course_lib.measure import SavedActivations
from course_lib.model import build, loss_fn, preset
from course_lib.pipeline_parallel import make_stage, partition_layers, pipeline_step
from course_lib.recompute import RecomputeMeter, apply_checkpointing, checkpointed, kept_by_policy
from course_lib.tensor_parallel import apply_tp

BATCH, SEQ = 2, 16
F64 = dict(rtol=0, atol=1e-12)   # float64: checkpointing reruns the same ops in the same order


def step(model, inputs, targets, meter=False):
    """One forward (saved bytes counted) and backward (reruns counted); returns (saved, meter, loss)."""
    with SavedActivations(model) as saved:
        loss = loss_fn(model(inputs), targets)
    with RecomputeMeter(model) as rerun:
        loss.backward()
    return saved, rerun, loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", ["none", "selective", "op", "full"])
def test_saved_bytes_equal_the_formula(policy, dtype):
    config = preset("tiny")
    model = apply_checkpointing(build(config, dtype=dtype), policy)
    inputs, targets = SyntheticTokens(config.vocab_size, SEQ, seed=0).batch(0, BATCH)
    saved, rerun, _ = step(model, inputs, targets)
    predicted = gpt_activation_bytes(config, BATCH, SEQ, dtype, recompute=policy)
    rerun_predicted = predicted.pop("one layer, recomputed", 0)
    assert saved.bytes + kept_by_policy(model) == predicted["total"] - rerun_predicted
    assert rerun.peak == rerun_predicted == recomputed_layer_bytes(config, BATCH, SEQ, dtype, recompute=policy)
    layer = gpt_layer_activation_bytes(config, BATCH, SEQ, dtype, recompute=policy)
    by_kind = saved.by_kind()
    if policy in ("full", "op"):   # the checkpoint keeps each block's input, filed under the block itself
        assert by_kind["block"] == config.num_layers * layer.pop("layer input")
        assert kept_by_policy(model) == config.num_layers * sum(layer.values())   # "op": the outputs it keeps
    else:
        for kind, nbytes in layer.items():
            assert by_kind[kind] == config.num_layers * nbytes, kind


def test_selective_keeps_k_and_v_at_their_own_heads_and_drops_the_log_sum_exp():
    config = preset("tiny")           # 8 query heads, 4 key/value heads
    none, selective = (gpt_layer_activation_bytes(config, BATCH, SEQ, recompute=r) for r in ("none", "selective"))
    kv_repeated = 2 * BATCH * SEQ * (config.num_heads - config.num_kv_heads) * config.head_dim * 4
    log_sum_exp = BATCH * config.num_heads * SEQ * 4
    assert sum(none.values()) - sum(selective.values()) == kv_repeated + log_sum_exp


def test_policy_is_checked_and_applied_once():
    model = build(preset("tiny"))
    with pytest.raises(ValueError, match=r"policy='some': choose one of none, selective, op, full"):
        apply_checkpointing(model, "some")
    apply_checkpointing(model, "full")
    assert checkpointed(model) == "full"
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_checkpointing(model, "selective")


# ------------------------------------------------------------------------------- FLOPs, counted by torch

def counted_flops(policy):
    config = preset("tiny")
    model = apply_checkpointing(build(config, dtype=torch.float64), policy)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # (test_cost.py says why MATH)
        loss_fn(model(tokens), tokens).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("policy", ["selective", "op", "full"])
def test_extra_flops_are_costs_recompute_term(policy):
    """Non-reentrant checkpoint stops a rerun once backward has every tensor it saved: in a block, down_proj's
    output is saved by nobody, and in the core, AV's output is o_proj's input, kept outside the checkpoint. So the
    counted extra is cost's recompute term less those last matmuls (tests/test_cost.py counts the same). "op"
    reruns exactly its term: k, o and up (down_proj's output is one it keeps)."""
    config = preset("tiny")
    terms = forward_terms(config, batch_size=BATCH, seq_len=SEQ)
    extra = counted_flops(policy) - counted_flops("none")
    down_proj = config.num_layers * 2 * BATCH * SEQ * config.hidden * config.intermediate
    not_rerun = {"full": down_proj, "selective": terms["attention values"], "op": 0}[policy]
    assert extra == recompute_flops(terms, policy, config) - not_rerun > 0
    if policy == "op":
        k, o = (2 * BATCH * SEQ * config.hidden * width for width in (config.num_kv_heads * config.head_dim,
                                                                      config.hidden))
        assert extra == config.num_layers * (k + o + 2 * BATCH * SEQ * config.hidden * config.intermediate)


# ------------------------------------------------------------------------- gradients, float64

def grads_of(model, inputs, targets):
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("policy", ["selective", "op", "full"])
def test_gradients_equal_a_run_without_checkpointing(policy):
    config = preset("tiny")
    inputs, targets = SyntheticTokens(config.vocab_size, SEQ, seed=0).batch(0, BATCH)
    loss, grads = grads_of(build(config, dtype=torch.float64), inputs, targets)
    loss_ck, grads_ck = grads_of(apply_checkpointing(build(config, dtype=torch.float64), policy), inputs, targets)
    assert loss_ck == pytest.approx(loss, rel=0, abs=F64["atol"])
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ck[name], grad, **F64, msg=name)


def tp_sp_checkpointed(rank, world_size, policy):
    torch.set_num_threads(1)
    config = preset("tiny")
    comm = Comm()
    inputs, targets = SyntheticTokens(config.vocab_size, SEQ, seed=0).batch(0, BATCH)
    runs = []
    for recompute in ("none", policy):
        model = apply_tp(build(config, dtype=torch.float64), comm, sequence_parallel=True)
        runs.append(grads_of(apply_checkpointing(model, recompute), inputs, targets))
    model = apply_checkpointing(apply_tp(build(config, dtype=torch.float32), comm, sequence_parallel=True), policy)
    saved, rerun, _ = step(model, inputs, targets)
    return runs, saved.by_kind(), rerun.peak, kept_by_policy(model)


@pytest.mark.ranks
@pytest.mark.parametrize("policy", ["selective", "op", "full"])
def test_with_tensor_and_sequence_parallelism(policy):
    tp, config = 2, preset("tiny")
    for [(loss, grads), (loss_ck, grads_ck)], by_kind, peak, kept in launch(tp_sp_checkpointed, tp, policy=policy):
        assert loss_ck == pytest.approx(loss, rel=0, abs=F64["atol"])
        for name, grad in grads.items():
            torch.testing.assert_close(grads_ck[name], grad, **F64, msg=name)
        layer = gpt_layer_activation_bytes(config, BATCH, SEQ, torch.float32, tp, True, recompute=policy)
        if policy in ("full", "op"):   # each block keeps this rank's s/t slice of its input
            assert by_kind["block"] == config.num_layers * layer.pop("layer input") == config.num_layers * BATCH \
                * SEQ * config.hidden * 4 // tp
            assert kept == config.num_layers * sum(layer.values())     # "op": the outputs it keeps
        else:
            assert {kind: by_kind[kind] for kind in layer} == {k: config.num_layers * n for k, n in layer.items()}
        assert peak == recomputed_layer_bytes(config, BATCH, SEQ, torch.float32, tp, True, recompute=policy)


def pipeline_checkpointed(rank, world_size, policy, num_microbatches=4):
    torch.set_num_threads(1)
    config = preset("tiny")
    inputs, targets = SyntheticTokens(config.vocab_size, SEQ, seed=0).batch(0, 8)
    grads = []
    for recompute in ("none", policy):
        stage = make_stage(build(config, dtype=torch.float64), rank, partition_layers(config.num_layers, world_size))
        apply_checkpointing(stage, recompute)
        result = pipeline_step(stage, Comm(), inputs, targets, num_microbatches=num_microbatches)
        grads.append((result["loss"], {name: p.grad for name, p in stage.named_parameters()}))
    return grads


@pytest.mark.ranks
@pytest.mark.parametrize("policy", ["selective", "op", "full"])
def test_with_the_pipeline(policy):
    for (loss, grads), (loss_ck, grads_ck) in launch(pipeline_checkpointed, 2, policy=policy):
        assert (loss is None) == (loss_ck is None)
        if loss is not None:
            assert loss_ck == pytest.approx(loss, rel=0, abs=F64["atol"])
        for name, grad in grads.items():
            torch.testing.assert_close(grads_ck[name], grad, **F64, msg=name)
