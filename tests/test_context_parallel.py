"""Context parallelism: ring attention against torch's attention on the whole sequence (float64; cp = 1..4;
causal and not; balanced and contiguous layouts; grouped-query heads; forward and q, k, v gradients), the
bytes each rank sends against the formula (traced), saved activations against 1/cp, the layout, the course
model trained on cp = 2 against one process, and torch's own context_parallel beside ours."""

import functools
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from course_lib import launch
from course_lib.comm import Comm
from course_lib.context_parallel import (
    all_reduce_gradients,
    apply_context_parallel,
    apply_rope_at,
    attention_work,
    chunk_ids,
    gather_sequence,
    hop_hiding_tokens,
    loss_scale,
    positions,
    ring_attention,
    ring_attention_activation_bytes,
    ring_attention_bytes,
    shard_sequence,
)
from course_lib.data import SyntheticTokens
from course_lib.measure import SavedActivations
from course_lib.model import apply_rope, build, loss_fn, preset

pytestmark = pytest.mark.ranks   # run apart with: pytest -m ranks

# float64: the ring adds the same terms as one softmax, in another order and through the exp(L_A - L) merge;
# measured gaps are ~1e-15. 1e-9 is far above that rounding and far below any real mistake (a wrong mask,
# a chunk at the wrong position or a missing block moves values by > 1e-2).
TOL = 1e-9
BATCH, HEADS, HEAD_DIM = 2, 4, 8
SEQ = 24   # divides by 2·cp for cp = 1, 2, 3, 4 (2, 4, 6, 8): both layouts work at every cp


def whole_inputs(kv_heads):
    """q, k, v and an output weighting for the whole sequence, the same on every rank."""
    generator = torch.Generator().manual_seed(kv_heads)
    shape = lambda heads: (BATCH, heads, SEQ, HEAD_DIM)  # noqa: E731
    q, k, v, weight = (torch.randn(shape(h), generator=generator, dtype=torch.float64)
                       for h in (HEADS, kv_heads, kv_heads, HEADS))
    return q, k, v, weight


def reference(q, k, v, weight, causal):
    """torch's attention on the whole sequence: the output and the q, k, v gradients of sum(out · weight)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         is_causal=causal)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def ring_against_whole(rank, world_size):
    comm, rows = Comm(), []
    for kv_heads in (HEADS, 2):                      # plain and grouped-query attention
        whole = whole_inputs(kv_heads)
        for causal in (True, False):
            expected = reference(*whole, causal)
            for balanced in (True, False):
                q, k, v, weight = (shard_sequence(t, comm, 2, balanced).requires_grad_() for t in whole)
                with comm.trace() as forward, SavedActivations(torch.nn.Module()) as saved:
                    out = ring_attention(q, k, v, comm, causal=causal, load_balanced=balanced)
                with comm.trace() as backward:
                    (out * weight).sum().backward()
                mine = [shard_sequence(t, comm, 2, balanced) for t in expected]
                gaps = [(got - want).abs().max().item() for got, want in zip((out, q.grad, k.grad, v.grad), mine)]
                rows.append(dict(kv_heads=kv_heads, causal=causal, balanced=balanced, gaps=gaps,
                                 forward_bytes=forward.wire_bytes, backward_bytes=backward.wire_bytes,
                                 forward_sends=len([r for r in forward.records if r.op == "send"]),
                                 backward_sends=len([r for r in backward.records if r.op == "send"]),
                                 saved_bytes=saved.bytes, gathered_gap=(gather_sequence(out, comm, 2, balanced)
                                                                        - expected[0]).abs().max().item()))
    return rows


@functools.cache
def ring_results(cp):
    return launch(ring_against_whole, cp)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ring_attention_matches_torch_on_the_whole_sequence(cp):
    for rank_rows in ring_results(cp):
        for row in rank_rows:
            out_gap, q_gap, k_gap, v_gap = row["gaps"]
            assert max(row["gaps"]) <= TOL, row
            assert row["gathered_gap"] <= TOL, row      # and the slices put back together are the whole output


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_traced_bytes_equal_the_formula(cp):
    for rank_rows in ring_results(cp):
        for row in rank_rows:
            predicted = ring_attention_bytes(BATCH, row["kv_heads"], SEQ, HEAD_DIM, cp, torch.float64)
            assert row["forward_bytes"] == predicted["forward"]
            assert row["backward_bytes"] == predicted["backward"]
            # one K/V message per hop forward; backward K/V again plus dK/dV, whose last hop goes home
            assert row["forward_sends"] == cp - 1
            assert row["backward_sends"] == (2 * cp - 1 if cp > 1 else 0)
    # grouped-query attention sends the unrepeated K/V: half the bytes with half the key/value heads
    if cp > 1:
        assert (2 * ring_attention_bytes(BATCH, 2, SEQ, HEAD_DIM, cp)["forward"]
                == ring_attention_bytes(BATCH, 4, SEQ, HEAD_DIM, cp)["forward"])


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_saved_activations_per_rank_are_one_cp_th(cp):
    for rank_rows in ring_results(cp):
        for row in rank_rows:
            predicted = ring_attention_activation_bytes(BATCH, HEADS, row["kv_heads"], SEQ, HEAD_DIM, cp,
                                                        torch.float64)
            assert row["saved_bytes"] == predicted
            one_rank = ring_attention_activation_bytes(BATCH, HEADS, row["kv_heads"], SEQ, HEAD_DIM, 1,
                                                       torch.float64)
            assert predicted * cp == one_rank


# ---- the layout, the work per rank, bad input (no ranks needed) ----------------------------------------

def fake_comm(rank, cp):
    return types.SimpleNamespace(rank=rank, size=cp)


def test_load_balanced_rank_holds_a_front_and_a_back_chunk():
    x = torch.arange(16)
    assert [shard_sequence(x, fake_comm(r, 4), 0).tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert shard_sequence(x, fake_comm(1, 4), 0, load_balanced=False).tolist() == [4, 5, 6, 7]
    assert positions(16, fake_comm(3, 4)).tolist() == [6, 7, 8, 9]
    assert chunk_ids(0, 3) == (0, 5) and chunk_ids(2, 3, load_balanced=False) == (2,)


def test_rope_at_global_positions_is_the_models_rope_of_the_whole_sequence():
    x = torch.randn(2, 16, 4, 8, dtype=torch.float64)
    assert torch.equal(apply_rope_at(x, torch.arange(16), 1e4), apply_rope(x, 1e4))
    for rank in range(4):
        comm = fake_comm(rank, 4)
        mine = apply_rope_at(shard_sequence(x, comm, 1), positions(16, comm), 1e4)
        assert torch.equal(mine, shard_sequence(apply_rope(x, 1e4), comm, 1))


def count_unmasked_scores(seq_len, cp, causal, balanced):
    """Brute force: the whole mask, each rank's rows of it."""
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool)
    allowed = allowed.tril() if causal else allowed
    return [int(shard_sequence(allowed, fake_comm(r, cp), 0, balanced).sum()) for r in range(cp)]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_load_balancing_gives_every_rank_the_same_causal_work(cp):
    seq_len = 8 * cp
    for causal in (True, False):
        for balanced in (True, False):
            assert attention_work(seq_len, cp, causal, balanced) == count_unmasked_scores(seq_len, cp, causal,
                                                                                          balanced)
    balanced, contiguous = attention_work(seq_len, cp), attention_work(seq_len, cp, load_balanced=False)
    assert len(set(balanced)) == 1 and sum(balanced) == seq_len * (seq_len + 1) // 2
    size = seq_len // cp                            # contiguous: rank r has r full blocks and one diagonal
    assert contiguous == [r * size * size + size * (size + 1) // 2 for r in range(cp)]


def test_bad_input_is_refused_in_one_line_naming_the_value_and_the_rule():
    q, kv, odd = torch.zeros(1, 6, 4, 8), torch.zeros(1, 4, 4, 8), torch.zeros(1, 4, 3, 8)
    cases = [
        (lambda: shard_sequence(torch.zeros(10), fake_comm(0, 2), 0),
         r"sequence length 10 is not divisible by 2·cp = 4: load-balanced sharding cuts it into 2·cp equal chunks"),
        (lambda: shard_sequence(torch.zeros(10), fake_comm(0, 3), 0, load_balanced=False),
         r"sequence length 10 is not divisible by cp = 3: each rank gets an equal slice"),
        (lambda: ring_attention(q, kv, kv, fake_comm(0, 2)),
         r"6 query heads are not divisible by 4 key/value heads \(6 % 4 = 2\)"),
        (lambda: ring_attention(odd, odd, odd, fake_comm(0, 2)), r"local sequence length 3 is odd"),
        (lambda: ring_attention(q, torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4), fake_comm(0, 2)),
         r"batch, local sequence and head_dim must agree"),
    ]
    for call, rule in cases:
        with pytest.raises(ValueError, match=rule) as error:
            call()
        assert "\n" not in str(error.value)


# ---- the course model: a few training steps on cp = 2 against one process -------------------------------

def train_model(rank, world_size, balanced, steps=3, seq_len=16):
    torch.set_num_threads(1)
    comm, config = Comm(), preset("tiny")
    data = SyntheticTokens(config.vocab_size, seq_len, seed=0, noise=0.3)
    whole = build(config, seed=0, dtype=torch.float64)
    split = apply_context_parallel(build(config, seed=0, dtype=torch.float64), comm, load_balanced=balanced)
    start = {name: p.detach().clone() for name, p in whole.named_parameters()}
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (whole, split)]
    loss_gaps = []
    for step in range(steps):
        inputs, targets = data.batch(step, 2)
        whole_loss = loss_fn(whole(inputs), targets)
        whole_loss.backward()
        local_inputs, local_targets = (shard_sequence(t, comm, 1, balanced) for t in (inputs, targets))
        local_loss = loss_fn(split(local_inputs), local_targets)
        local_loss.backward()
        all_reduce_gradients(split, comm)
        mean_loss = local_loss.detach().clone()
        comm.all_reduce(mean_loss)              # every rank has as many tokens: the mean of means is the mean
        loss_gaps.append(abs(mean_loss.item() / world_size - whole_loss.item()))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    params = dict(whole.named_parameters())
    param_gap = max((p - params[name]).abs().max().item() for name, p in split.named_parameters())
    moved = max((p - start[name]).abs().max().item() for name, p in whole.named_parameters())
    return max(loss_gaps), param_gap, moved


@pytest.mark.parametrize("balanced", [True, False])
def test_course_model_trains_on_cp2_as_on_one_process(balanced):
    for loss_gap, param_gap, moved in launch(train_model, 2, balanced=balanced):
        assert loss_gap <= TOL and param_gap <= TOL
        assert moved > 1e-2                         # the steps did move the parameters: 3 Adam steps of 1e-2


def model_activations(rank, world_size, seq_len=32):
    """Bytes saved for backward by one forward of the course model: on this rank's slice, and whole."""
    config = preset("tiny")
    inputs, targets = SyntheticTokens(config.vocab_size, seq_len, seed=0).batch(0, 2)
    comm, whole = Comm(), build(config, seed=0)
    split = apply_context_parallel(build(config, seed=0), comm)
    with SavedActivations(split) as per_rank:
        loss_fn(split(shard_sequence(inputs, comm, 1)), shard_sequence(targets, comm, 1))
    with SavedActivations(whole) as one_process:
        loss_fn(whole(inputs), targets)
    return per_rank.bytes, one_process.bytes


@pytest.mark.parametrize("cp", [2, 4])
def test_course_model_activations_per_rank_are_one_cp_th(cp):
    # Every saved tensor is per token, except the one float32 scalar the loss keeps (nll_loss's total weight)
    scalar = 4
    for per_rank, one_process in launch(model_activations, cp):
        assert (per_rank - scalar) * cp == one_process - scalar


def wrong_positions(rank, world_size):
    """A negative control: rotary at the local positions 0..S/cp-1 (the model's own apply_rope) breaks it."""
    import course_lib.context_parallel as cp_module

    comm, config = Comm(), preset("tiny", num_layers=1)
    inputs, _ = SyntheticTokens(config.vocab_size, 16, seed=0).batch(0, 2)
    whole = build(config, seed=0, dtype=torch.float64)(inputs)
    original = cp_module.positions
    cp_module.positions = lambda seq_len, comm, load_balanced=True, device=None: torch.arange(seq_len // comm.size)
    try:
        split = apply_context_parallel(build(config, seed=0, dtype=torch.float64), comm)
        wrong = split(shard_sequence(inputs, comm, 1))
    finally:
        cp_module.positions = original
    return (wrong - shard_sequence(whole, comm, 1)).abs().max().item()


def test_rotary_at_local_positions_would_be_wrong():
    assert max(launch(wrong_positions, 2)) > 1e-3


# ---- torch's own context_parallel ---------------------------------------------------------------------

def torch_context_parallel(rank, world_size, non_causal):
    """torch's layout and causal call (fast); with ``non_causal`` also its non-causal forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.experimental import context_parallel

    warnings.simplefilter("ignore")
    comm, mesh = Comm(), init_device_mesh("cpu", (world_size,))
    q, k, v, _ = whole_inputs(HEADS)
    buffers, result = [t.clone() for t in (q, k, v)], {}
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
        result["layout_gap"] = max((b - shard_sequence(t, comm, 2)).abs().max().item()
                                   for b, t in zip(buffers, (q, k, v)))
        try:
            F.scaled_dot_product_attention(*buffers, is_causal=True)
        except NotImplementedError as error:
            result["causal_error"] = str(error)
        if non_causal:
            with CommDebugMode() as debug:
                theirs = F.scaled_dot_product_attention(*buffers)
            ours = ring_attention(*(shard_sequence(t, comm, 2) for t in (q, k, v)), comm, causal=False)
            result["gap"] = (ours - theirs).abs().max().item()
            result["comm_counts"] = {str(op): n for op, n in debug.get_comm_counts().items()}
            needing_grad = [b.detach().clone().requires_grad_() for b in buffers]
            try:
                F.scaled_dot_product_attention(*needing_grad).sum().backward()
            except NotImplementedError as error:
                result["backward_error"] = str(error)
    return result


NO_RULE = ("Operator aten._scaled_dot_product_flash_attention_for_cpu{}.default does not have a sharding strategy "
           "registered.")


def test_torch_context_parallel_shards_like_ours_and_refuses_a_causal_mask_on_cpu():
    for result in launch(torch_context_parallel, 2, non_causal=False):
        assert result["layout_gap"] == 0             # its head-tail load balancer is our load-balanced layout
        assert result["causal_error"] == NO_RULE.format("")   # the sentence in the module docstring


def test_torch_context_parallel_runs_the_non_causal_forward_on_cpu_by_all_gather_not_ring():
    # ~15-20 s on 2 cores, all of it in torch: DTensor finds a sharding for the CPU attention kernel by
    # propagating ~125 candidate placements through its decomposition (once per process; cached after).
    for result in launch(torch_context_parallel, 2, non_causal=True):
        assert result["gap"] <= TOL                  # the non-causal forward agrees with ours
        assert list(result["comm_counts"].values()) == [2]         # K and V gathered whole: no ring
        assert "all_gather" in next(iter(result["comm_counts"]))
        assert result["backward_error"] == NO_RULE.format("_backward")


# ---- uneven loss tokens (padding, ignore_index): weight each rank's gradient by its tokens ---------------

def train_with_ignored_targets(rank, world_size, weighted):
    torch.set_num_threads(1)
    comm, config = Comm(), preset("tiny")
    inputs, targets = SyntheticTokens(config.vocab_size, 16, seed=0).batch(0, 2)
    targets = targets.clone()
    targets[:, :6] = -100      # ignored (cross_entropy's ignore_index): rank 0 holds 4 of each row's, rank 1 two
    whole = build(config, seed=0, dtype=torch.float64)
    loss_fn(whole(inputs), targets).backward()
    split = apply_context_parallel(build(config, seed=0, dtype=torch.float64), comm)
    local_targets = shard_sequence(targets, comm, 1)
    tokens = int((local_targets != -100).sum())
    scale = loss_scale(tokens, comm) if weighted else 1.0
    (scale * loss_fn(split(shard_sequence(inputs, comm, 1)), local_targets)).backward()
    all_reduce_gradients(split, comm)
    grads = dict(whole.named_parameters())
    return tokens, max((p.grad - grads[name].grad).abs().max().item() for name, p in split.named_parameters())


def test_losses_scaled_by_loss_tokens_give_the_sequence_s_gradient_when_ranks_ignore_different_numbers():
    weighted = launch(train_with_ignored_targets, 2, weighted=True)
    assert [tokens for tokens, _ in weighted] == [8, 12]      # 2 × (8 tokens per rank, minus 4 or 2 ignored)
    assert all(gap <= TOL for _, gap in weighted)
    plain = launch(train_with_ignored_targets, 2, weighted=False)
    assert all(gap > 1e-6 for _, gap in plain)                # the mean of the ranks' means is not the mean


def test_hop_hiding_tokens_for_nvlink_and_infiniband_with_and_without_grouped_query_attention():
    bf16, flops = 2, 1e15
    assert [hop_hiding_tokens(64, 64, bf16, flops, link) for link in (450e9, 50e9)] == [2223, 20000]
    assert [hop_hiding_tokens(64, 8, bf16, flops, link) for link in (450e9, 50e9)] == [278, 2500]   # GQA 8:1
    assert hop_hiding_tokens(64, 8, bf16, flops, 50e9, causal=True) == 5000   # half the pairs per step


# ---- torch's two ways to move K and V: all-gather (the default) and the all-to-all ring ------------------

def torch_rotations(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

    warnings.simplefilter("ignore")
    default = cp_attention._cp_options.rotate_method.name
    block = torch.full((6,), float(rank))              # this rank's K/V block, flattened as torch's ring does
    seen = {}
    for method in ("allgather", "alltoall"):
        cp_attention.set_rotate_method(method)
        rotater = cp_attention._create_rotater(dist.group.WORLD, seq_dim=2)
        current, arrived, held = block, [], 0
        with CommDebugMode() as debug:
            for _ in range(world_size - 1):
                rotater.exchange_buffers(current)
                current = rotater.next_buffer()
                arrived.append(int(current[0]))
                held = max(held, getattr(rotater, "_aggregated_buffer", current).numel() // block.numel())
        seen[method] = (arrived, held, {str(op).split(".")[-1]: n for op, n in debug.get_comm_counts().items()})
    return default, seen


def test_torch_context_parallel_rotates_by_all_gather_by_default_and_by_an_all_to_all_ring_on_request():
    for rank, (default, seen) in enumerate(launch(torch_rotations, 4)):
        assert default == "ALL_GATHER"
        ring_order = [(rank - step) % 4 for step in (1, 2, 3)]       # block r - t at step t, as ours
        assert seen["allgather"] == (ring_order, 4, {"all_gather_into_tensor": 1})   # all 4 blocks held at once
        assert seen["alltoall"] == (ring_order, 1, {"all_to_all_single": 3})        # one hop per step
