"""Tensor parallelism: each split layer against the dense layer, the split model against the unsplit one
(logits, gradients, parameters after Adam steps), the all-reduces counted from the trace, the divisibility
rule, and torch's DTensor version beside ours. Sequence parallelism: the model against one process here, and
torch's SequenceParallel beside ours; its operators, traced bytes and saved activations against the formulas
in tests/test_tensor_parallel_sequence.py."""

import types
import warnings

import pytest
import torch

from course_lib import RankError, launch
from course_lib.comm import Comm, wire_bytes
from course_lib.data import SyntheticTokens
from course_lib.model import build, loss_fn, preset
from course_lib.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    apply_tp,
    check_tp_divisible,
    dtensor_plan,
    f,
    g,
    tp_allreduce_bytes,
    tp_step_traffic,
)

pytestmark = pytest.mark.ranks   # run apart with: pytest -m ranks

# Tolerances. In float64 the split changes only the order of additions (a row layer adds p partial products
# where the dense layer adds all in one matmul), so the two sides differ by rounding: ~1e-16 relative per op,
# ~1e-14 after a forward and backward of 4 layers (measured: 6e-15 on logits). Adam divides by sqrt(v), which
# could magnify a rounding difference of a near-zero gradient, so params are compared after 3 steps at 1e-9:
# far above rounding, far below any real mistake (a wrong slice or a missing all-reduce moves values by >1e-3).
F64 = dict(rtol=0, atol=1e-9)


def dense_slice(tp_module, dense_tensor, rank, tp):
    """The part of a dense parameter (or gradient) that this TP rank holds."""
    if isinstance(tp_module, ColumnParallelLinear):
        return dense_tensor.chunk(tp, dim=0)[rank]
    if isinstance(tp_module, RowParallelLinear) and dense_tensor.dim() == 2:
        return dense_tensor.chunk(tp, dim=1)[rank]
    return dense_tensor


def compare_to_dense(tp_model, dense_model, rank, tp, what):
    """Largest difference between every TP parameter (what="data") or gradient ("grad") and its dense slice."""
    dense = dict(dense_model.named_parameters())
    worst = 0.0
    for name, param in tp_model.named_parameters():
        module = tp_model.get_submodule(name.rsplit(".", 1)[0])
        mine, theirs = getattr(param, what), dense_slice(module, getattr(dense[name], what), rank, tp)
        assert mine.shape == theirs.shape, name
        worst = max(worst, (mine - theirs).abs().max().item())
    return worst


# ---- the operators and the two layers -------------------------------------------------------------------

def f_and_g(rank, world_size):
    comm = Comm()
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    with comm.trace() as forward:
        y_f, y_g = f(x, comm), g(x * 1.0, comm)
    with comm.trace() as backward:
        (y_f * (rank + 1)).sum().backward()     # f's backward sums the upstream gradients of all ranks
    grad_f = x.grad.clone()
    x.grad = None
    g(x * 1.0, comm).sum().backward()           # g's backward passes the gradient through
    return (y_f.tolist(), y_g.tolist(), grad_f.tolist(), x.grad.tolist(),
            forward.summary()["all_reduce"].count, backward.summary()["all_reduce"].count)


def test_f_is_identity_forward_all_reduce_backward_and_g_the_reverse():
    results = launch(f_and_g, 2)
    for rank, (y_f, y_g, grad_f, grad_g, forward_count, backward_count) in enumerate(results):
        assert y_f == [rank + 1.0] * 3          # f forward: identity
        assert y_g == [1.0 + 2.0] * 3           # g forward: the sum over ranks
        assert grad_f == [1.0 + 2.0] * 3        # f backward: sum of the ranks' upstream gradients 1 and 2
        assert grad_g == [1.0] * 3              # g backward: identity
        assert (forward_count, backward_count) == (1, 1)   # one all-reduce each way (g forward, f backward)


def layers_against_dense(rank, world_size):
    torch.manual_seed(0)                        # same dense layers and input on every rank
    comm = Comm()
    column, row = torch.nn.Linear(8, 12, dtype=torch.float64), torch.nn.Linear(12, 8, dtype=torch.float64)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    dense_y = row(torch.relu(column(x)))
    dense_y.square().sum().backward()
    worst = {}

    # column (sliced output) → row (sliced input): the Megatron pair, one f before, one g after
    col_tp, row_tp = ColumnParallelLinear.from_dense(column, comm), RowParallelLinear.from_dense(row, comm)
    x_tp = x.detach().clone().requires_grad_()
    y = row_tp(torch.relu(col_tp(x_tp)))
    y.square().sum().backward()
    worst["pair output"] = (y - dense_y).abs().max().item()
    worst["pair input grad"] = (x_tp.grad - x.grad).abs().max().item()
    worst["column weight grad"] = (col_tp.weight.grad - column.weight.grad.chunk(world_size, 0)[rank]).abs().max().item()
    worst["column bias grad"] = (col_tp.bias.grad - column.bias.grad.chunk(world_size, 0)[rank]).abs().max().item()
    worst["row weight grad"] = (row_tp.weight.grad - row.weight.grad.chunk(world_size, 1)[rank]).abs().max().item()
    worst["row bias grad"] = (row_tp.bias.grad - row.bias.grad).abs().max().item()

    # each on its own: column with the output gathered, row taking the whole input
    col_gathered = ColumnParallelLinear.from_dense(column, comm, gather_output=True)
    row_whole = RowParallelLinear.from_dense(row, comm, input_is_parallel=False)
    hidden = torch.randn(2, 5, 12, dtype=torch.float64)
    worst["column gathered"] = (col_gathered(x) - column(x)).abs().max().item()
    worst["row whole input"] = (row_whole(hidden) - row(hidden)).abs().max().item()
    x_g = x.detach().clone().requires_grad_()
    (col_gathered(x_g) * torch.arange(12.0, dtype=torch.float64)).sum().backward()
    x_d = x.detach().clone().requires_grad_()
    (column(x_d) * torch.arange(12.0, dtype=torch.float64)).sum().backward()
    worst["column gathered input grad"] = (x_g.grad - x_d.grad).abs().max().item()
    h_tp, h_d = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    row_whole(h_tp).sum().backward()
    row(h_d).sum().backward()
    worst["row whole input grad"] = (h_tp.grad - h_d.grad).abs().max().item()
    return worst, tuple(col_tp.weight.shape), tuple(row_tp.weight.shape)


@pytest.mark.parametrize("tp", [2, 4])
def test_column_and_row_parallel_linear_match_the_dense_layer(tp):
    for worst, column_shape, row_shape in launch(layers_against_dense, tp):
        assert column_shape == (12 // tp, 8) and row_shape == (8, 12 // tp)   # each rank holds 1/tp
        for what, gap in worst.items():
            assert gap <= F64["atol"], f"{what}: {gap}"


def test_from_dense_keeps_this_ranks_slice_and_draws_no_random_numbers():
    comm = types.SimpleNamespace(size=2, rank=1)      # slicing needs only the group's size and this rank
    torch.manual_seed(0)
    column, row = torch.nn.Linear(4, 6), torch.nn.Linear(6, 4)
    state = torch.get_rng_state()
    col_tp, row_tp = ColumnParallelLinear.from_dense(column, comm), RowParallelLinear.from_dense(row, comm)
    assert torch.equal(torch.get_rng_state(), state)   # build() leaves the global RNG alone; so does the split
    assert torch.equal(col_tp.weight, column.weight[3:]) and torch.equal(col_tp.bias, column.bias[3:])
    assert torch.equal(row_tp.weight, row.weight[:, 3:]) and torch.equal(row_tp.bias, row.bias)


def test_layer_sizes_must_divide():
    comm = types.SimpleNamespace(size=3, rank=0)
    with pytest.raises(ValueError, match=r"out_features=8 cannot split over TP=3: 8 % 3 = 2"):
        ColumnParallelLinear(4, 8, comm)
    with pytest.raises(ValueError, match=r"in_features=10 cannot split over TP=3"):
        RowParallelLinear(10, 4, comm)


# ---- the model ------------------------------------------------------------------------------------------

def train_both(rank, world_size, steps=3, batch_size=4, seq_len=16, sequence_parallel=False):
    """The split model and the unsplit one, same seed and data, side by side for a few Adam steps."""
    torch.set_num_threads(1)
    config = preset("tiny")
    comm = Comm()
    dense = build(config, seed=0, dtype=torch.float64)
    split = apply_tp(build(config, seed=0, dtype=torch.float64), comm, sequence_parallel=sequence_parallel)
    data = SyntheticTokens(config.vocab_size, seq_len, seed=0)
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (dense, split)]
    gaps = {"logits": 0.0, "loss": 0.0, "grads": 0.0}
    for step in range(steps):
        inputs, targets = data.batch(step, batch_size)
        logits_dense, logits_split = dense(inputs), split(inputs)
        loss_dense, loss_split = loss_fn(logits_dense, targets), loss_fn(logits_split, targets)
        loss_dense.backward()
        loss_split.backward()
        gaps["logits"] = max(gaps["logits"], (logits_split - logits_dense).abs().max().item())
        gaps["loss"] = max(gaps["loss"], abs(loss_split.item() - loss_dense.item()))
        gaps["grads"] = max(gaps["grads"], compare_to_dense(split, dense, rank, world_size, "grad"))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    gaps["params"] = compare_to_dense(split, dense, rank, world_size, "data")
    per_rank = sum(p.numel() for p in split.parameters())
    return gaps, per_rank, sum(p.numel() for p in dense.parameters())


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["TP", "TP+SP"])
@pytest.mark.parametrize("tp", [2, 4])
def test_split_model_matches_the_unsplit_model(tp, sequence_parallel):
    results = launch(train_both, tp, sequence_parallel=sequence_parallel)
    for gaps, per_rank, whole in results:
        for what, gap in gaps.items():
            assert gap <= F64["atol"], f"TP={tp}, sequence_parallel={sequence_parallel}: {what} differ by {gap}"
    # Each rank holds 1/tp of the attention and MLP matrices; embedding, head and norms stay whole.
    config = preset("tiny")
    d, hd = config.hidden, config.head_dim
    block_matrices = config.num_layers * (2 * d * config.num_heads * hd + 2 * d * config.num_kv_heads * hd
                                          + 3 * d * config.intermediate)
    assert results[0][1] == results[0][2] - block_matrices + block_matrices // tp


def traffic(rank, world_size, batch_size, seq_len, sequence_parallel=False):
    config = preset("tiny")
    comm = Comm()
    model = apply_tp(build(config, seed=0), comm, sequence_parallel=sequence_parallel)
    inputs, targets = SyntheticTokens(config.vocab_size, seq_len, seed=0).batch(0, batch_size)
    with comm.trace() as forward:
        loss = loss_fn(model(inputs), targets)
    with comm.trace() as backward:
        loss.backward()
    return [[(r.op, r.payload_bytes, r.wire_bytes) for r in log.records] for log in (forward, backward)]


@pytest.mark.parametrize("tp", [2, 4])
def test_two_all_reduces_forward_and_two_backward_per_layer_each_one_activation(tp):
    batch_size, seq_len = 3, 10
    config = preset("tiny")
    payload = batch_size * seq_len * config.hidden * 4          # float32
    assert tp_allreduce_bytes(batch_size, seq_len, config.hidden, 4) == payload
    predicted = tp_step_traffic(config, batch_size, seq_len, tp)
    for forward, backward in launch(traffic, tp, batch_size=batch_size, seq_len=seq_len):
        for records in (forward, backward):
            assert len(records) == 2 * config.num_layers
            assert all(op == "all_reduce" and n == payload for op, n, _ in records)
        assert len(forward) == predicted["forward_all_reduces"] and len(backward) == predicted["backward_all_reduces"]
        assert sum(n for _, n, _ in forward + backward) == predicted["payload_bytes"]
        assert sum(w for _, _, w in forward + backward) == predicted["wire_bytes_per_rank"]
        assert predicted["wire_bytes_per_rank"] == 4 * config.num_layers * wire_bytes("all_reduce", payload, tp)


def test_the_source_message_size():
    # The source: batch 4, sequence 4096, hidden 3584, 2-byte precision → 112 MiB per TP all-reduce.
    assert tp_allreduce_bytes(4, 4096, 3584, 2) == 112 * 2**20


def test_step_traffic_refuses_a_degree_the_model_cannot_split_over():
    """Qwen2-7B (hidden 3584, the source's TP message) has 28 query heads and 4 key/value heads: TP = 8 cannot
    run, so tp_step_traffic refuses it with check_tp_divisible's message; TP = 4 works, with the same message."""
    qwen = preset("qwen2-7b")
    with pytest.raises(ValueError, match=r"28 attention heads \(num_heads\) cannot split over TP=8 .*"
                                         r"4 key/value heads \(num_kv_heads\) cannot split over TP=8 .*"
                                         r"TP degrees that work for this model: \[1, 2, 4\]"):
        tp_step_traffic(qwen, batch_size=4, seq_len=4096, tp=8, bytes_per_element=2)
    traffic = tp_step_traffic(qwen, batch_size=4, seq_len=4096, tp=4, bytes_per_element=2)
    assert traffic["payload_bytes_each"] == 112 * 2**20
    assert traffic["wire_bytes_per_rank"] == 4 * qwen.num_layers * wire_bytes("all_reduce", 112 * 2**20, 4)


def test_divisibility_rule_names_the_numbers():
    sixteen = preset("llama2-7b", num_heads=16, num_kv_heads=16, hidden=2048)
    check_tp_divisible(sixteen, 2)
    check_tp_divisible(sixteen, 4)
    with pytest.raises(ValueError, match=r"16 attention heads \(num_heads\) cannot split over TP=3 \(16 % 3 = 1\)"):
        check_tp_divisible(sixteen, 3)
    with pytest.raises(ValueError) as err:
        check_tp_divisible(preset("tiny"), 8)        # 8 heads fine, 4 kv heads not
    assert "4 key/value heads (num_kv_heads) cannot split over TP=8" in str(err.value)
    assert "attention heads" not in str(err.value)
    assert "TP degrees that work for this model: [1, 2, 4]" in str(err.value)
    with pytest.raises(ValueError, match=r"120 MLP width \(intermediate\) cannot split over TP=16"):
        check_tp_divisible(preset("tiny", num_heads=16, num_kv_heads=16, intermediate=120), 16)
    with pytest.raises(ValueError, match="TP=0"):
        check_tp_divisible(preset("tiny"), 0)
    # apply_tp checks before it touches the model: a TP=3 group leaves the model whole.
    model = build(preset("tiny"), seed=0)
    with pytest.raises(ValueError, match="8 attention heads .* cannot split over TP=3"):
        apply_tp(model, types.SimpleNamespace(size=3, rank=0))
    assert isinstance(model.layers[0].attn.q_proj, torch.nn.Linear)


def split_twice(rank, world_size):
    model = apply_tp(build(preset("tiny"), seed=0), Comm())
    apply_tp(model, Comm())


def test_splitting_twice_is_refused():
    with pytest.raises(RankError, match="already split over TP=2"):
        launch(split_twice, 2)


# ---- torch's DTensor beside ours ------------------------------------------------------------------------

def ours_and_dtensor(rank, world_size, sequence_parallel=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    warnings.simplefilter("ignore")   # CommDebugMode's backward hooks warn that inputs need no grad
    config = preset("tiny")
    inputs, targets = SyntheticTokens(config.vocab_size, 16, seed=0).batch(0, 4)
    ours = apply_tp(build(config, seed=0, dtype=torch.float64), Comm(), sequence_parallel=sequence_parallel)
    theirs = build(config, seed=0, dtype=torch.float64)
    parallelize_module(theirs, init_device_mesh("cpu", (world_size,)), dtensor_plan(config, sequence_parallel))
    logits_ours = ours(inputs)
    loss_fn(logits_ours, targets).backward()
    with CommDebugMode() as forward:
        logits_theirs = theirs(inputs)
    with CommDebugMode() as backward:
        loss_fn(logits_theirs, targets).backward()
    grad_gap, partial = 0.0, []
    for (name, mine), (_, dtensor_param) in zip(ours.named_parameters(), theirs.named_parameters()):
        grad = dtensor_param.grad
        if hasattr(grad, "placements"):
            if any(isinstance(p, Partial) for p in grad.placements):   # each rank's own part of the sum
                partial.append(name)
                grad = grad.redistribute(placements=[Replicate()])
            grad = grad.to_local()
        grad_gap = max(grad_gap, (mine.grad - grad).abs().max().item())
    return ((logits_ours - logits_theirs).abs().max().item(), grad_gap,
            forward.get_total_counts(), backward.get_total_counts(),
            *({str(op).split(".")[-1]: n for op, n in debug.get_comm_counts().items()} for debug in (forward, backward)),
            partial)


def test_dtensor_parallelize_module_gives_the_same_logits_and_grads():
    config = preset("tiny")
    for logits_gap, grad_gap, forward_count, backward_count, *_ in launch(ours_and_dtensor, 2):
        assert logits_gap <= F64["atol"] and grad_gap <= F64["atol"]
        # DTensor: the same 2 all-reduces per layer forward, but 5 backward: each column layer (q, k, v,
        # gate, up) all-reduces its own input gradient, where ours shares one f per block.
        assert forward_count == 2 * config.num_layers and backward_count == 5 * config.num_layers


def test_dtensor_sequence_parallel_gives_the_same_logits_and_grads():
    """torch's SequenceParallel plan (torchtitan's layout, dtensor_plan(config, sequence_parallel=True)) against
    ours: the same numbers and the same all-gathers and reduce-scatters. DTensor leaves the norms' weight
    gradients Partial (each rank's own tokens' sum) for later; ours all-reduces them in backward (f on the weight)."""
    config = preset("tiny")
    layers = config.num_layers
    for logits_gap, grad_gap, _, _, forward, backward, partial in launch(ours_and_dtensor, 2, sequence_parallel=True):
        assert logits_gap <= F64["atol"] and grad_gap <= F64["atol"]
        ours = tp_step_traffic(config, 4, 16, 2, sequence_parallel=True)
        assert forward == {"all_gather_into_tensor": ours["forward_ops"]["all_gather"],
                           "reduce_scatter_tensor": ours["forward_ops"]["reduce_scatter"]}
        assert backward == {"all_gather_into_tensor": ours["backward_ops"]["all_gather"],
                            "reduce_scatter_tensor": ours["backward_ops"]["reduce_scatter"]}
        assert sorted(partial) == sorted(f"layers.{i}.{n}_norm.weight" for i in range(layers) for n in ("attn", "mlp"))
