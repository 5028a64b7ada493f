"""course_lib.zero: ZeRO stages 0-3 by hand, checked against one process on the global batch, against torch's
DistributedDataParallel, ZeroRedundancyOptimizer and FSDP2 fully_shard on the same data, byte for byte against
the ledger's zero_state_bytes, and against the traced bytes of the ring formula. ZeRO-3 without resharding after
forward (reshard_after_forward=False) too: the same weights, one all-gather per unit and micro-step, and the
gathered weights it holds while a step runs (transient_weight_bytes), measured to the byte.

Tolerances. Every parity check runs in float64, so it holds on any CPU whatever kernels torch picks.
* One process vs N ranks, SGD: the two compute the same gradients from batches of different shapes (12 rows
  at once, or 4 + 4 + 4 then a sum), so they differ by rounding only, ~1e-16 relative per operation. SGD is
  linear in the gradient. 1e-9 (≈ 10⁷ units of float64 rounding) still catches a missing division by the
  world size (a 2x gradient: ~1e-3 on the weights) or a shard updated with another rank's gradient.
* One process vs N ranks, Adam: Adam divides by sqrt(v) + eps, which can magnify a rounding difference δ on a
  near-zero gradient up to lr·δ/eps (measured: 3e-14 on 2 ranks, 5e-14 on 3, 1e-12 on 4). 1e-9 still catches a
  wrong or stale shard, which moves a weight by ~lr = 1e-2 per step. Adam is blind to a missing division by N
  (it divides by the gradient's own size): that is the SGD test's job.
* Gradient accumulation (2 micro-steps of 4 rows per rank), SGD: the micro-steps' gradients are summed
  before the update, another order of the same additions: rounding only, 1e-9 as above.
* Ours vs torch's implementations, Adam: every rank computes the same gradients in both, only the order of
  the sums over ranks may differ: ~1e-17; Adam's lr/eps = 1e6 amplification bounds the weights' gap by 1e-11
  (measured 3e-15). 1e-10.
"""

import pytest
import torch
from torch.nn.utils import parameters_to_vector

from course_lib import RankError, launch
from course_lib.comm import Comm
from course_lib.data import SyntheticTokens
from course_lib.ledger import zero_state_bytes
from course_lib.measure import measure_state_bytes
from course_lib.model import build, count_params, loss_fn, preset
from course_lib.runs.zero import fully_shard_traffic, train
from course_lib.train import reference_run
from course_lib.zero import ZeroDataParallel, borrowers, default_units, padded_num_params
from course_lib.zero_bytes import wire_bytes_per_step

pytestmark = pytest.mark.ranks   # run apart with: pytest -m ranks

STEPS = 3
TINY = preset("tiny")
P = count_params(TINY)
NUM_UNITS = len(default_units(build(TINY)))      # embed, 4 layers, norm, head
UNIT_PARAMS = [sum(p.numel() for p in unit.parameters()) for unit in default_units(build(TINY))]
UNIT_NAMES = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head"]


def every_run(rank, world_size):
    """One launch per world size, every run in turn (a launch per run would start the ranks again)."""
    runs = {}
    for stage in range(4):
        # the ledger's convention: bf16 weights and grads, MixedPrecisionAdam (12 bytes of fp32 state)
        runs["mixed", stage] = train(rank, world_size, zero_stage=stage, steps=2, optimizer="mixed",
                                     dtype=torch.bfloat16, memory_trace=True)
        runs["sgd", stage] = train(rank, world_size, zero_stage=stage, steps=STEPS, optimizer="sgd", lr=0.1,
                                   dtype=torch.float64)
        runs["adam", stage] = train(rank, world_size, zero_stage=stage, steps=STEPS, dtype=torch.float64)
    for impl in ("ddp", "zero_redundancy", "fully_shard"):
        runs[impl] = train(rank, world_size, impl=impl, steps=STEPS, dtype=torch.float64)
    return runs


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n} ranks")
def setup(request):
    world_size = request.param
    return world_size, launch(every_run, world_size, timeout=300)


def one_process(optimizer, world_size, lr, accumulation_steps=1, steps=STEPS):
    """The reference: one process, Adam or SGD on the whole global batch, the same data and seed."""
    _, model = reference_run(steps=steps, batch_size=4 * world_size * accumulation_steps, lr=lr, optimizer=optimizer,
                             dtype=torch.float64)
    return parameters_to_vector(model.parameters()).detach()


def test_every_stage_matches_one_process_with_sgd(setup):
    world_size, per_rank = setup
    reference = one_process("sgd", world_size, lr=0.1)
    for stage in range(4):
        for rank in range(world_size):
            gap = (per_rank[rank]["sgd", stage]["params"] - reference).abs().max().item()
            assert gap < 1e-9, (stage, rank, gap)


def test_every_stage_matches_one_process_with_adam(setup):
    world_size, per_rank = setup
    reference = one_process("adam", world_size, lr=1e-2)
    for stage in range(4):
        gap = (per_rank[0]["adam", stage]["params"] - reference).abs().max().item()
        assert gap < 1e-9, (stage, gap)
        assert all(torch.equal(ranks["adam", stage]["params"], per_rank[0]["adam", stage]["params"])
                   for ranks in per_rank)             # every rank ends with the same weights, bit for bit


def test_ours_matches_torch_ddp_zero_redundancy_and_fully_shard(setup):
    world_size, per_rank = setup
    for ours, theirs in [(0, "ddp"), (1, "zero_redundancy"), (3, "fully_shard")]:
        gap = (per_rank[0]["adam", ours]["params"] - per_rank[0][theirs]["params"]).abs().max().item()
        assert gap < 1e-10, (ours, theirs, gap)


def test_state_bytes_per_rank_equal_the_ledger(setup):
    """Measured from tensor storage on every rank: exactly zero_state_bytes, padding included (2 + 2 + 12)."""
    world_size, per_rank = setup
    padded = padded_num_params(build(TINY), world_size)
    assert (padded == P) == (world_size in (2, 4))    # N divides every unit of the tiny model on 2 and 4 ranks
    assert P <= padded < P + world_size * NUM_UNITS   # each unit pads fewer than N parameters
    for stage in range(4):
        predicted = zero_state_bytes(padded, stage, world_size)
        for rank in range(world_size):
            measured = dict(per_rank[rank]["mixed", stage]["state"])
            assert measured.pop("step_counters") == 0
            assert measured == predicted, (stage, rank)


def test_fully_shard_holds_the_same_state_when_no_padding(setup):
    world_size, per_rank = setup
    ours, theirs = per_rank[0]["adam", 3]["state"], per_rank[0]["fully_shard"]["state"]
    if world_size in (2, 4):      # FSDP2 pads every tensor's first dimension; no padding here either
        assert all(ours[part] == theirs[part] for part in ("weights", "grads", "optimizer"))
    assert ours["step_counters"] == 4 * NUM_UNITS     # torch's Adam: one float32 step per tensor it updates
    assert theirs["step_counters"] == 4 * len(list(build(TINY).parameters()))


def test_traced_bytes_on_the_wire(setup):
    """Stages 0, 1, 2 send the same bytes (an all-reduce is a reduce-scatter + an all-gather); stage 3 sends 1.5x."""
    world_size, per_rank = setup
    grad_bytes = 2 * padded_num_params(build(TINY), world_size)      # bf16
    totals = {}
    for stage in range(4):
        for step in per_rank[0]["mixed", stage]["wire"]:      # float sums over units: equal up to rounding
            assert step == pytest.approx(wire_bytes_per_step(grad_bytes, stage, world_size), rel=1e-12)
        totals[stage] = sum(per_rank[0]["mixed", stage]["wire"][-1].values())
    ddp = 2 * grad_bytes * (world_size - 1) / world_size
    assert totals[0] == pytest.approx(ddp, rel=1e-12) and totals[1] == totals[2] == pytest.approx(ddp, rel=1e-12)
    assert totals[3] == pytest.approx(1.5 * ddp, rel=1e-12)


ACCUMULATION_STEPS = 2


def accumulated_runs(rank, world_size):
    runs = {stage: train(rank, world_size, zero_stage=stage, steps=2, accumulation_steps=ACCUMULATION_STEPS,
                         optimizer="sgd", lr=0.1, dtype=torch.float64) for stage in range(4)}
    runs["ddp"] = train(rank, world_size, impl="ddp", steps=2, accumulation_steps=ACCUMULATION_STEPS,
                        optimizer="sgd", lr=0.1, dtype=torch.float64)
    return runs


@pytest.fixture(scope="module")
def accumulated():
    return launch(accumulated_runs, 2, timeout=300)


def test_gradient_accumulation_matches_one_process(accumulated):
    """2 ranks × 2 micro-steps × 4 rows: every stage, and torch's DDP with no_sync, = one process on 16 rows."""
    reference = one_process("sgd", 2, lr=0.1, accumulation_steps=ACCUMULATION_STEPS, steps=2)
    for key in (0, 1, 2, 3, "ddp"):
        for ranks in accumulated:
            gap = (ranks[key]["params"] - reference).abs().max().item()
            assert gap < 1e-9, (key, gap)


def test_traced_bytes_with_gradient_accumulation(accumulated):
    """Per optimizer step of A micro-steps, in units of Ψ(p-1)/p: DDP 2 (one all-reduce, after the last
    micro-step), ZeRO-1 2 (it keeps full gradients: one reduce-scatter, one all-gather), ZeRO-2 A + 1 (a
    reduce-scatter every micro-step: it keeps only its shard of the gradients), ZeRO-3 3A (two gathers and
    a reduce-scatter every micro-step)."""
    world_size, a = 2, ACCUMULATION_STEPS
    grad_bytes = 8 * P                                             # float64, no padding on 2 ranks
    unit = grad_bytes * (world_size - 1) / world_size
    expected = {0: 2, 1: 2, 2: a + 1, 3: 3 * a}
    collectives = {0: NUM_UNITS, 1: 2 * NUM_UNITS, 2: (a + 1) * NUM_UNITS, 3: 3 * a * NUM_UNITS}
    for stage in range(4):
        for ranks in accumulated:
            for wire, count in zip(ranks[stage]["wire"], ranks[stage]["collectives"]):
                assert sum(wire.values()) == pytest.approx(expected[stage] * unit, rel=1e-12), stage
                assert wire == pytest.approx(wire_bytes_per_step(grad_bytes, stage, world_size, a), rel=1e-12)
                assert count == collectives[stage], stage
    with pytest.raises(ValueError, match="accumulation_steps=0"):
        wire_bytes_per_step(grad_bytes, 1, world_size, 0)


def test_stage3_gathers_each_unit_twice_and_holds_one_at_a_time(setup):
    world_size, per_rank = setup
    trace = per_rank[0]["mixed", 3]["memory_trace"]
    model = build(TINY)
    units = [name for name, m in model.named_modules() if m in default_units(model)]
    gathers = [(e["event"], e["unit"]) for e in trace if e["event"].startswith("gather")]
    assert gathers == [("gather (forward)", u) for u in units] + [("gather (backward)", u) for u in units[::-1]]
    shard_bytes = 2 * padded_num_params(model, world_size) // world_size
    largest_unit = 2 * max(sum(p.numel() for p in m.parameters()) for m in default_units(model))
    largest_buffer = 2 * world_size * -(-largest_unit // 2 // world_size)     # the flat buffer, padding included
    assert max(e["weights"] for e in trace) == shard_bytes + largest_buffer  # one block's weights, no more
    assert trace[-1]["weights"] == shard_bytes                               # all freed after the step
    # backward: one unit's full gradients at a time (autograd's, unpadded), then only the shard's
    assert max(e["grads"] for e in trace) == shard_bytes + largest_unit
    assert trace[-1]["grads"] == shard_bytes


def test_stage2_never_holds_all_gradients(setup):
    world_size, per_rank = setup
    trace = per_rank[0]["mixed", 2]["memory_trace"]
    shard_bytes = 2 * padded_num_params(build(TINY), world_size) // world_size
    largest_unit = 2 * max(sum(p.numel() for p in m.parameters()) for m in default_units(build(TINY)))
    assert max(e["grads"] for e in trace) == shard_bytes + largest_unit < 2 * P
    assert all(e["weights"] == 2 * padded_num_params(build(TINY), world_size) for e in trace)


def _uneven_shards(rank, world_size):
    comm = Comm()
    model = ZeroDataParallel(build(TINY, seed=0), comm, zero_stage=3, optimizer_class=torch.optim.SGD, lr=0.1)
    data = SyntheticTokens(TINY.vocab_size, 32, seed=0)
    for step in range(2):
        loss_fn(model(data.rank_batch(step, 4 * world_size, rank, world_size)[0]),
                data.rank_batch(step, 4 * world_size, rank, world_size)[1]).backward()
        model.step()
    tails = [unit.shard.detach()[unit.numel - rank * unit.shard_numel:] for unit in model.units
             if (rank + 1) * unit.shard_numel > unit.numel]
    return ([unit.shard.numel() for unit in model.units], [unit.shard.detach().clone() for unit in model.units],
            tails, model.full_parameters())


def test_uneven_shards_are_padded_at_the_end_and_the_padding_stays_zero():
    world_size = 3
    per_rank = launch(_uneven_shards, world_size)
    sizes = [sizes for sizes, *_ in per_rank]
    assert sizes[0] == sizes[1] == sizes[2]                        # equal shards: what all-gather needs
    units = default_units(build(TINY))
    assert sizes[0] == [-(-sum(p.numel() for p in u.parameters()) // world_size) for u in units]
    # rank 2 holds every unit's padding; it never learns anything
    assert len(per_rank[2][2]) == len(units) and all(torch.count_nonzero(t) == 0 for t in per_rank[2][2])
    # the shards, concatenated in rank order with the padding cut off, are the weights every rank reports
    full = per_rank[0][3]
    offset = 0
    for u, unit in enumerate(units):
        numel = sum(p.numel() for p in unit.parameters())
        assert torch.equal(torch.cat([per_rank[r][1][u] for r in range(world_size)])[:numel],
                           full[offset:offset + numel])
        offset += numel
    assert offset == full.numel() == P


def test_wire_bytes_per_step_formula():
    assert wire_bytes_per_step(1000, 0, 4) == {"all_reduce": 1500.0}
    assert wire_bytes_per_step(1000, 2, 4) == {"reduce_scatter": 750.0, "all_gather": 750.0}
    assert sum(wire_bytes_per_step(1000, 3, 4).values()) == 2250.0
    with pytest.raises(ValueError, match="stage=4"):
        wire_bytes_per_step(1000, 4, 4)


def test_default_units_of_the_course_model():
    model = build(TINY)
    names = {id(m): name for name, m in model.named_modules()}
    assert [names[id(m)] for m in default_units(model)] == UNIT_NAMES
    tied = build(preset("tiny", tie_embeddings=True))          # the head's weight sits in the embedding's unit
    names = {id(m): name for name, m in tied.named_modules()}
    assert [names[id(m)] for m in default_units(tied)] == UNIT_NAMES[:-1]
    assert [(names[id(m)], owner) for m, owner in borrowers(tied, default_units(tied))] == [("head", 0)]
    chunks = torch.nn.ModuleList([build(TINY), build(TINY)])       # an interleaved stage: chunks hold units
    assert borrowers(chunks, [unit for chunk in chunks for unit in default_units(chunk)]) == []


def tied_runs(rank, world_size):
    config = preset("tiny", tie_embeddings=True)
    runs = {stage: train(rank, world_size, zero_stage=stage, steps=STEPS, dtype=torch.float64, config=config)
            for stage in range(4)}
    return runs | {"fully_shard": train(rank, world_size, impl="fully_shard", steps=STEPS, dtype=torch.float64,
                                        config=config)}


def test_tied_embeddings_match_one_process_at_every_stage_and_fsdp2():
    """A tied head runs on the embedding's unit (stage 3 gathers it around the head's forward and backward too),
    as FSDP2 takes the two in one group: every stage and fully_shard end where one process does (a Llama 3.2 or
    Megatron GPT with tied embeddings failed at the shared weight)."""
    _, model = reference_run(preset("tiny", tie_embeddings=True), steps=STEPS, batch_size=8, lr=1e-2,
                             dtype=torch.float64)
    reference = parameters_to_vector(model.parameters()).detach()
    for run in launch(tied_runs, 2, timeout=300)[0].values():
        assert (run["params"] - reference).abs().max().item() < 1e-10


def _bad_inputs(rank, world_size, case):
    comm, module = Comm(), build(TINY)
    if case == "stage":
        ZeroDataParallel(module, comm, zero_stage=4)
    elif case == "tied":                         # the head given a unit of its own: its weight is embed's
        tied = build(preset("tiny", tie_embeddings=True))
        ZeroDataParallel(tied, comm, zero_stage=3, units=default_units(tied) + [tied.head])
    elif case == "no backward":
        ZeroDataParallel(module, comm, zero_stage=2).step()
    elif case == "unit missing":
        ZeroDataParallel(module, comm, zero_stage=2, units=default_units(module)[1:])
    elif case == "grads replaced":
        model = ZeroDataParallel(module, comm, zero_stage=1)
        module.zero_grad()                       # nn.Module's: sets the gradient views to None
        inputs, targets = SyntheticTokens(TINY.vocab_size, 32).batch(0, 2)
        loss_fn(model(inputs), targets).backward()
    elif case == "two backwards":                # stage 1 averaged after the first: a second would add to it
        model = ZeroDataParallel(module, comm, zero_stage=1)
        inputs, targets = SyntheticTokens(TINY.vocab_size, 32).batch(0, 2)
        for _ in range(2):
            loss_fn(model(inputs), targets).backward()
    elif case == "never averaged":
        model = ZeroDataParallel(module, comm, zero_stage=0)
        inputs, targets = SyntheticTokens(TINY.vocab_size, 32).batch(0, 2)
        with model.no_sync():
            loss_fn(model(inputs), targets).backward()
        model.step()
    elif case == "mixed dtypes":
        module.layers[0].attn_norm.weight.data = module.layers[0].attn_norm.weight.data.double()
        ZeroDataParallel(module, comm, zero_stage=1)
    elif case == "reshard at stage 1":
        ZeroDataParallel(module, comm, zero_stage=1, reshard_after_forward=False)


@pytest.mark.parametrize("case, message", [
    ("stage", r"zero_stage=4: ZeRO stages are 0 \(plain DDP\), 1, 2, 3"),
    ("reshard at stage 1", r"reshard_after_forward=False with zero_stage=1: only ZeRO-3 frees .* must be True"),
    ("tied", r"parameter head.weight is also in unit embed: .*tied embeddings"),
    ("no backward", r"unit embed: 0 of its 1 parameters got a gradient"),
    ("unit missing", r"parameters in no unit: \['embed.weight'\]"),
    ("mixed dtypes", r"unit layers.0 mixes dtypes"),
    ("two backwards", r"unit head: a second backward before step\(\), after the gradients were averaged"),
    ("never averaged", r"unit embed: its gradients were never averaged"),
    ("grads replaced", r"unit head: gradients are no longer views of the flat gradient buffer"),
])
def test_bad_input_is_named(case, message):
    with pytest.raises(RankError, match=message):
        launch(_bad_inputs, 1, case=case)


def test_one_rank_keeps_everything():
    """world_size 1 is allowed (a one-rank group): even stage 3 keeps everything, 16 bytes per parameter."""
    def one_rank(rank, world_size):
        model = ZeroDataParallel(build(TINY, dtype=torch.bfloat16), Comm(), zero_stage=3)
        inputs, targets = SyntheticTokens(TINY.vocab_size, 32).batch(0, 2)
        loss_fn(model(inputs), targets).backward()
        model.step()
        return measure_state_bytes(model, model.optimizer)
    state = launch(one_rank, 1)[0]
    assert state["total"] == 16 * P


def test_torchs_fully_shard_gathers_every_weight_twice_and_reduce_scatters_every_gradient_once():
    """FSDP2 calls c10d itself: WatchCollectives sees its collectives as torch dispatches them."""
    for records in launch(fully_shard_traffic, 2, batch_size=4, seq_len=16, timeout=60):
        payload = {op: sum(n for o, n in records if o == op) for op in ("all_gather", "reduce_scatter")}
        assert payload == {"all_gather": 2 * 4 * P, "reduce_scatter": 4 * P}    # float32: forward and backward


def _freed_after_training(rank, world_size):
    """Whether a wrapper's model is freed as soon as the wrapper is dropped (no garbage collection run)."""
    import gc
    import weakref

    from course_lib.ddp import BucketedDDP

    gc.disable()                                  # reference counting alone must free it
    try:
        freed = {}
        data = SyntheticTokens(TINY.vocab_size, 16, seed=0)
        for name in ("zero 0", "zero 3", "bucketed ddp"):
            module = build(TINY, seed=0)
            model = (BucketedDDP(module, Comm(), bucket_bytes=2**14) if name == "bucketed ddp" else
                     ZeroDataParallel(module, Comm(), zero_stage=int(name[-1]), optimizer_class=torch.optim.SGD,
                                      lr=0.1))
            inputs, targets = data.rank_batch(0, 2 * world_size, rank, world_size)
            loss_fn(model(inputs), targets).backward()
            alive = weakref.ref(module)
            del model
            if name != "zero 3":                  # (stage 3 freed the module's own weights: it lives in the shards)
                loss_fn(module(inputs), targets).backward()    # the hooks went with the wrapper: a plain module
            del module
            freed[name] = alive() is None
        return freed
    finally:
        gc.enable()


def test_a_finished_runs_model_is_freed_with_its_wrapper():
    """The gradient hooks hold the wrapper weakly: a strong reference made a cycle through autograd's C++ objects
    that no collector frees, and on one H200 each run of labs/zero.py kept the one before it (1.5 GiB each).
    A module that outlives its wrapper trains on without the wrapper's hooks."""
    expected = {"zero 0": True, "zero 3": True, "bucketed ddp": True}
    assert launch(_freed_after_training, 2) == [expected] * 2
