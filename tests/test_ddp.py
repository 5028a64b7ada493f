"""course_lib.ddp: data parallelism by hand, checked against one process on the global batch, against torch's
DistributedDataParallel on the same data, and byte for byte against the ring formula.

Tolerances. Every run is in float64, so that the checks hold on any CPU (float32 results depend on which
vectorised kernels torch picks). Ours and one process differ only by rounding in *how* the same numbers are
summed (a backward over 16 rows at once, or over 4 + 4 + 4 + 4 rows then an all-reduce): ~1e-16 relative
per operation, measured ≤ 1e-15 on the weights after 3 SGD steps. 1e-9 (≈ 10⁷ units of float64 rounding)
leaves room for any summation order and still catches a missing division by the world size (a 2x gradient,
~1e-2 on the weights) or a lost micro-batch (~1e-3). With Adam (which divides by sqrt(v) and so can magnify
a rounding difference on a near-zero gradient) we compare two implementations that must be bit-identical:
on 2 ranks a sum of two numbers does not depend on the order, and halving is exact.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.utils import parameters_to_vector

from course_lib import launch
from course_lib.comm import Comm, wire_bytes
from course_lib.data import SyntheticTokens, micro_batches
from course_lib.ddp import BucketedDDP, NaiveDDP, bucket_indices, ring_all_reduce
from course_lib.model import build, count_params, preset
from course_lib.runs.ddp import phase_seconds, run_data_parallel, wrap
from course_lib.train import reference_run
from course_lib.units import MiB

pytestmark = pytest.mark.ranks   # run apart with: pytest -m ranks

STEPS, LR = 3, 0.1
DTYPE, VALUE_BYTES = torch.float64, 8
F64 = 1e-9   # see the module docstring
VARIANTS = [("naive", MiB), ("bucketed", 1), ("bucketed", 64 * 1024), ("bucketed", 25 * MiB), ("torch", 64 * 1024)]


def every_variant(rank, world_size, accumulation_steps):
    """One launch, every implementation in turn (a fresh launch per variant would re-import half of torch)."""
    common = dict(steps=STEPS, accumulation_steps=accumulation_steps, lr=LR, optimizer="sgd", bucket_log=True,
                  spread=True, dtype=DTYPE)
    runs = {variant: run_data_parallel(rank, world_size, kind=variant[0], bucket_bytes=variant[1], **common)
            for variant in VARIANTS}
    runs["none"] = run_data_parallel(rank, world_size, kind="none", **common)
    for kind in ("bucketed", "torch"):
        runs[kind, "adam"] = run_data_parallel(rank, world_size, kind=kind, bucket_bytes=64 * 1024, steps=STEPS,
                                               accumulation_steps=accumulation_steps, lr=1e-2, optimizer="adam",
                                               dtype=DTYPE)
    return runs


def one_process(global_batch_size):
    """The reference: one process, the whole global batch, the same data and seed."""
    _, model = reference_run(steps=STEPS, batch_size=global_batch_size, lr=LR, optimizer="sgd", dtype=DTYPE)
    return parameters_to_vector(model.parameters()).detach()


SETUPS = {"2 ranks x 2 micro-steps": (2, 2), "4 ranks x 1": (4, 1), "3 ranks x 2": (3, 2)}


@pytest.fixture(scope="module", params=list(SETUPS))
def setup(request):
    world_size, accumulation_steps = SETUPS[request.param]
    per_rank = launch(every_variant, world_size, accumulation_steps=accumulation_steps, timeout=300)
    return world_size, accumulation_steps, per_rank


def test_every_variant_matches_one_process_on_the_global_batch(setup):
    world_size, accumulation_steps, per_rank = setup
    reference = one_process(global_batch_size=4 * world_size * accumulation_steps)
    for variant in VARIANTS:
        params = per_rank[0][variant]["params"]
        assert (params - reference).abs().max().item() < F64, variant
    # without synchronisation each replica learns from its own rows only: far from the reference
    assert (per_rank[0]["none"]["params"] - reference).abs().max().item() > 1e-3


def test_synced_replicas_are_bit_identical_and_unsynced_ones_drift(setup):
    world_size, _, per_rank = setup
    for variant in VARIANTS:
        assert all(step["spread"] == 0.0 for step in per_rank[0][variant]["steps"]), variant
        assert all(torch.equal(ranks[variant]["params"], per_rank[0][variant]["params"]) for ranks in per_rank)
    drift = [step["spread"] for step in per_rank[0]["none"]["steps"]]
    assert 0 < drift[0] < drift[-1]        # apart after one step, and further apart after each


def test_ours_and_torch_ddp_agree(setup):
    world_size, _, per_rank = setup
    sgd = {v: per_rank[0][v]["params"] for v in VARIANTS}
    for variant in VARIANTS:
        assert (sgd[variant] - sgd["torch", 64 * 1024]).abs().max().item() < F64, variant
    if world_size == 2:   # Adam too, bit for bit: see the module docstring
        assert torch.equal(per_rank[0]["bucketed", "adam"]["params"], per_rank[0]["torch", "adam"]["params"])


def test_bytes_on_the_wire_per_step_are_gradient_bytes_times_the_ring_factor(setup):
    world_size, accumulation_steps, per_rank = setup
    p = world_size
    grad_bytes = VALUE_BYTES * count_params(preset("tiny"))
    predicted = grad_bytes * 2 * (p - 1) / p
    sizes = [VALUE_BYTES * p.numel() for p in build(preset("tiny"), device="meta").parameters()]
    tensors = len(sizes)
    for ranks in per_rank:
        for variant in VARIANTS:
            run = ranks[variant]
            assert run["grad_bytes"] == grad_bytes
            for step in run["steps"]:
                if variant[0] != "torch":   # torch's DDP talks to gloo directly; the kernel still counts it
                    # exactly, whatever the bucketing (3 ranks: thirds of a byte, summed in floating point)
                    assert step["wire_bytes"] == pytest.approx(predicted, rel=1e-12, abs=0), variant
                    # one all-reduce per tensor (naive) or per bucket, per optimizer step: none in no_sync()
                    expected = tensors if variant[0] == "naive" else len(bucket_indices(sizes, variant[1]))
                    assert step["all_reduces"] == expected, variant
                if step["bytes_written"] is not None:   # Linux: what the kernel saw leave this process
                    header = step["bytes_written"] - predicted
                    assert 0 < header <= tensors * 2 * (p - 1) * 1024, variant   # gloo's ~300 B per message


def test_buckets_fill_in_reverse_and_are_sent_during_backward(setup):
    _, _, per_rank = setup
    step = per_rank[0]["bucketed", 64 * 1024]["steps"][-1]
    issued = [entry["issued"] for entry in step["bucket_log"]]
    assert [entry["bucket"] for entry in step["bucket_log"]] == list(range(len(issued)))   # in order
    assert sum(t < step["backward"] for t in issued) >= len(issued) - 1 >= 2   # all but the last overlap backward
    assert all(entry["done"] >= entry["issued"] for entry in step["bucket_log"])
    naive = per_rank[0]["naive", MiB]["steps"][-1]
    assert all(entry["issued"] >= naive["backward"] for entry in naive["bucket_log"])   # naive: nothing overlaps


def test_steps_record_their_phases_in_order_and_medians_add_up(setup):
    _, _, per_rank = setup
    for variant in VARIANTS:
        for step in per_rank[0][variant]["steps"]:
            assert step["start"] <= step["backward"] <= step["synced"] <= step["end"]
    fake = [[{"start": 0.0, "backward": 3.0, "synced": 4.0, "end": 6.0}] * 3, [{"start": 1.0, "backward": 2.0,
                                                                               "synced": 2.5, "end": 3.0}]]
    assert phase_seconds(fake, skip=1) == {"compute": 3.0, "exposed communication": 1.0, "optimizer": 2.0, "step": 6.0}
    assert phase_seconds([fake[1]], skip=1) == {"compute": 1.0, "exposed communication": 0.5, "optimizer": 0.5,
                                                "step": 2.0}    # too few steps to skip one: all of them


def test_unknown_optimizer_is_refused_before_any_work():
    with pytest.raises(ValueError, match="optimizer='lamb': choose one of adam, sgd"):
        run_data_parallel(0, 1, optimizer="lamb")


def test_bucket_indices_group_the_last_parameters_first():
    assert bucket_indices([4, 4, 4, 10, 4], 8) == [[4], [3], [2, 1], [0]]   # 10 > 8 gets a bucket of its own
    assert bucket_indices([4, 4, 4], 100) == [[2, 1, 0]]
    assert bucket_indices([4, 4, 4], 1) == [[2], [1], [0]]
    assert bucket_indices([], 8) == []
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError, match=rf"bucket_bytes={bad}: a bucket size must be a positive number"):
            bucket_indices([4], bad)


def test_micro_batches_are_disjoint_and_cover_the_global_batch():
    data = SyntheticTokens(128, 8, seed=3)
    inputs, _ = data.batch(5, 4 * 2 * 2)
    pieces = {(r, m): micro_batches(data, 5, 4, r, 2, 2)[m][0] for r in range(2) for m in range(2)}
    assert all(piece.shape == (4, 8) for piece in pieces.values())
    assert torch.equal(torch.cat([pieces[0, 0], pieces[1, 0], pieces[0, 1], pieces[1, 1]]), inputs)


def misuse(rank, world_size):
    """Each mistake on a small model; returns the messages of the errors it raised."""
    comm, errors = Comm(), []
    torch.manual_seed(rank)                       # different weights on each rank...
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ddp = BucketedDDP(model, comm, bucket_bytes=16)
    weights = model[0].weight.detach().clone()
    everyone = torch.empty(world_size * weights.numel())
    comm.all_gather(everyone, weights.reshape(-1))
    identical = all(torch.equal(w, everyone[:weights.numel()]) for w in everyone.view(world_size, -1))

    x = torch.ones(2, 3)
    with ddp.no_sync():
        ddp(x).sum().backward()
        try:
            ddp.finish_gradient_sync()
        except RuntimeError as err:
            errors.append(str(err))
    ddp(x).sum().backward()
    try:
        ddp(x).sum().backward()                   # a second synced backward before finishing the first
    except RuntimeError as err:
        errors.append(str(err))
    naive = NaiveDDP(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), comm)
    naive.module[0](x).sum().backward()           # the second layer takes no part: no gradient
    try:
        naive.finish_gradient_sync()
    except RuntimeError as err:
        errors.append(str(err))
    fresh = BucketedDDP(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), comm, bucket_bytes=16)
    fresh(x).sum().backward()
    fresh.finish_gradient_sync()
    try:
        fresh.finish_gradient_sync()              # twice: nothing new was all-reduced
    except RuntimeError as err:
        errors.append(str(err))
    try:
        wrap(model, "deepspeed", comm)
    except ValueError as err:
        errors.append(str(err))
    return identical, errors


def test_mistakes_fail_with_errors_that_say_what_to_do():
    for identical, errors in launch(misuse, 2):
        assert identical                           # the wrapper broadcast rank 0's weights to everyone
        assert len(errors) == 5, errors
        assert "finish_gradient_sync() was called inside no_sync()" in errors[0]
        assert "the gradient of 1.bias was ready twice before finish_gradient_sync()" in errors[1]
        assert "parameter 1.weight has no gradient" in errors[2]
        assert errors[3].startswith("no gradient was all-reduced since the last finish_gradient_sync()")
        assert errors[4] == "kind='deepspeed': choose one of none, naive, bucketed, torch"


def ring_against_gloo(rank, world_size, n):
    comm = Comm()
    mine = torch.arange(n, dtype=torch.float32) * (rank + 1) + rank   # integers: sums are exact in any order
    expected = mine.clone()
    dist.all_reduce(expected)
    snapshots = []
    with comm.trace() as log:
        result = ring_all_reduce(mine.clone(), comm, snapshots)
    return torch.equal(result, expected), log.summary()["send"].payload_bytes, log.summary()["recv"].wire_bytes, \
        len(snapshots)


@pytest.mark.parametrize("world_size,n", [(2, 8), (3, 10), (4, 10), (4, 1000)])
def test_ring_all_reduce_by_hand_equals_gloo_and_sends_the_ring_bytes(world_size, n):
    results = launch(ring_against_gloo, world_size, n=n)
    assert all(equal for equal, _, _, _ in results)
    sent = [s for _, s, _, _ in results]
    # every step moves each chunk once around the ring: 2(p-1) steps of n bytes in all, i.e. the formula per
    # rank on average (exactly per rank when p divides n)
    assert sum(sent) == world_size * wire_bytes("all_reduce", 4 * n, world_size)
    if n % world_size == 0:
        assert sent == [wire_bytes("all_reduce", 4 * n, world_size)] * world_size
    assert all(received == 0 and steps == 2 * (world_size - 1) for _, _, received, steps in results)
