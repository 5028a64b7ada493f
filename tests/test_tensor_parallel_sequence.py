"""Sequence parallelism (the tensor-parallel model's norms and the boundaries between blocks split over the
sequence): its scatter and gather operators forward and backward, its traced bytes per layer against the
formula (the same as plain TP's), its saved activations against the course's formula, and the sequence length
it needs. tests/test_tensor_parallel.py checks plain TP, the SP model against one process and torch's
SequenceParallel beside ours."""

import types

import pytest
import torch
from test_tensor_parallel import traffic

from course_lib import launch
from course_lib.comm import Comm, wire_bytes
from course_lib.data import SyntheticTokens
from course_lib.ledger import gpt_activation_bytes, gpt_layer_activation_bytes
from course_lib.measure import SavedActivations
from course_lib.model import build, loss_fn, preset
from course_lib.tensor_parallel import (
    GatherFromSequenceParallelRegion,
    ScatterToSequenceParallelRegion,
    apply_tp,
    tp_step_traffic,
)

pytestmark = pytest.mark.ranks   # run apart with: pytest -m ranks


# ---- sequence parallelism -------------------------------------------------------------------------------

def sequence_operators(rank, world_size):
    """Each operator on [batch 2, seq 4, hidden 3], forward and backward, with the ops each direction traced."""
    comm, rows = Comm(), {}
    whole = torch.arange(24, dtype=torch.float64).view(2, 4, 3)           # the same on every rank
    cases = {"scatter": (ScatterToSequenceParallelRegion, whole, (False,)),
             "reduce-scatter": (ScatterToSequenceParallelRegion, whole * (rank + 1), (True,)),
             "gather, partial grad": (GatherFromSequenceParallelRegion, whole.chunk(world_size, 1)[rank], (True,)),
             "gather, whole grad": (GatherFromSequenceParallelRegion, whole.chunk(world_size, 1)[rank], (False,))}
    for name, (operator, x, extra) in cases.items():
        x = x.clone().requires_grad_()
        with comm.trace() as forward:
            y = operator.apply(x, comm, *extra)
        with comm.trace() as backward:
            (y * (rank + 1)).sum().backward()          # upstream gradient: rank + 1 everywhere
        rows[name] = (y.detach(), x.grad, [r.op for r in forward.records], [r.op for r in backward.records])
    return rows


def test_sequence_parallel_operators_forward_and_backward():
    whole = torch.arange(24, dtype=torch.float64).view(2, 4, 3)
    slices = whole.chunk(2, dim=1)
    per_rank_grad = torch.cat([torch.full_like(slices[r], r + 1.0) for r in range(2)], dim=1)
    for rank, rows in enumerate(launch(sequence_operators, 2)):
        y, grad, forward, backward = rows["scatter"]
        assert torch.equal(y, slices[rank]) and (forward, backward) == ([], ["all_gather"])
        assert torch.equal(grad, per_rank_grad)         # every rank's slice gradient, gathered
        y, grad, forward, backward = rows["reduce-scatter"]
        assert torch.equal(y, 3 * slices[rank]) and (forward, backward) == (["reduce_scatter"], ["all_gather"])
        assert torch.equal(grad, per_rank_grad)
        y, grad, forward, backward = rows["gather, partial grad"]
        assert torch.equal(y, whole) and (forward, backward) == (["all_gather"], ["reduce_scatter"])
        assert torch.equal(grad, torch.full_like(slices[rank], 1.0 + 2.0))   # the ranks' gradients summed
        y, grad, forward, backward = rows["gather, whole grad"]
        assert torch.equal(y, whole) and (forward, backward) == (["all_gather"], [])
        assert torch.equal(grad, torch.full_like(slices[rank], rank + 1.0))  # this rank's slice, as it is


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_sends_plain_tps_bytes_per_layer_traced(tp):
    batch_size, seq_len = 3, 8
    config = preset("tiny")
    payload, norm_weight = batch_size * seq_len * config.hidden * 4, config.hidden * 4
    predicted = tp_step_traffic(config, batch_size, seq_len, tp, sequence_parallel=True)
    plain = tp_step_traffic(config, batch_size, seq_len, tp)
    for forward, backward in launch(traffic, tp, batch_size=batch_size, seq_len=seq_len, sequence_parallel=True):
        for records, ops in ((forward, predicted["forward_ops"]), (backward, predicted["backward_ops"])):
            assert {op: sum(1 for o, _, _ in records if o == op) for op in ops} == ops
            assert len(records) == sum(ops.values())
        records = forward + backward
        assert all(n == (norm_weight if op == "all_reduce" else payload) for op, n, _ in records)
        assert sum(n for _, n, _ in records) == predicted["payload_bytes"]
        assert sum(w for _, _, w in records) == predicted["wire_bytes_per_rank"]
        layers = sum(w for op, _, w in records if op != "all_reduce") - predicted["ends_wire_bytes"]
        assert layers == predicted["layers_wire_bytes"] == plain["wire_bytes_per_rank"]   # the same bytes as TP
    assert predicted["ends_wire_bytes"] == 2 * wire_bytes("all_gather", payload, tp)
    assert predicted["norm_weights_wire_bytes"] == 2 * config.num_layers * wire_bytes("all_reduce", norm_weight, tp)


def saved_by_kind(rank, world_size, dtype, sequence_parallel, batch_size=2, seq_len=16):
    config = preset("tiny")
    model = apply_tp(build(config, seed=0, dtype=dtype), Comm(), sequence_parallel=sequence_parallel)
    inputs, targets = SyntheticTokens(config.vocab_size, seq_len, seed=0).batch(0, batch_size)
    with SavedActivations(model) as saved:
        loss_fn(model(inputs), targets)
    return saved.by_kind()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_activations_equal_the_course_formula(tp, dtype):
    """Per rank, module by module: the layers' terms of ledger.gpt_layer_activation_bytes(..., sequence_parallel=
    True) (norms / tp; the gathered input of the column layers whole), the rest as one process's."""
    config, b, s = preset("tiny"), 2, 16
    layer = gpt_layer_activation_bytes(config, b, s, dtype, tp, sequence_parallel=True)
    plain_layer = gpt_layer_activation_bytes(config, b, s, dtype, tp)
    whole = gpt_activation_bytes(config, b, s, dtype)
    expected = {kind: config.num_layers * nbytes for kind, nbytes in layer.items()}
    expected.update({kind: whole[kind] for kind in ("embed", "norm", "head", "loss")})
    for measured in launch(saved_by_kind, tp, dtype=dtype, sequence_parallel=True):
        assert measured == expected
    for kind in ("attn_norm", "mlp_norm"):
        assert layer[kind] * tp == plain_layer[kind]
    assert sum(layer.values()) < sum(plain_layer.values())


def test_sequence_parallel_needs_a_sequence_that_divides():
    model = apply_tp(build(preset("tiny"), seed=0), types.SimpleNamespace(size=4, rank=0), sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by TP=4 \(10 % 4 = 2\)"):
        model(torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by TP=4"):
        tp_step_traffic(preset("tiny"), 1, 10, 4, sequence_parallel=True)
