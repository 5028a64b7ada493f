"""course_lib.zero's ZeRO-3 without resharding after forward (reshard_after_forward=False, torch FSDP2's name):
the same weights as one process and as resharding, one all-gather per unit and micro-step (traced bytes equal
zero_bytes.wire_bytes_per_step), and the gathered weights it holds while a step runs
(zero_bytes.transient_weight_bytes), measured to the byte with ZeroDataParallel's memory trace. Tolerances as
tests/test_zero.py's (float64)."""

import pytest
import torch
from test_zero import NUM_UNITS, UNIT_NAMES, UNIT_PARAMS, P, one_process

from course_lib import launch
from course_lib.comm import Comm
from course_lib.data import SyntheticTokens
from course_lib.ledger import zero_state_bytes
from course_lib.model import build, loss_fn, preset
from course_lib.runs.zero import train
from course_lib.zero import ZeroDataParallel
from course_lib.zero_bytes import transient_gradient_bytes, transient_weight_bytes, wire_bytes_per_step

pytestmark = pytest.mark.ranks   # run apart with: pytest -m ranks

STEPS, ACCUMULATION_STEPS = 3, 2
TINY = preset("tiny")


def kept_gathered_runs(rank, world_size):
    """ZeRO-3 both ways, with and without gradient accumulation (float64, SGD; memory traced), Adam, and torch's
    fully_shard with the same setting."""
    runs = {(reshard, a): train(rank, world_size, zero_stage=3, steps=2, accumulation_steps=a, optimizer="sgd", lr=0.1,
                                dtype=torch.float64, memory_trace=True, reshard_after_forward=reshard)
            for reshard in (True, False) for a in (1, ACCUMULATION_STEPS)}
    runs["adam"] = train(rank, world_size, zero_stage=3, steps=STEPS, dtype=torch.float64, reshard_after_forward=False)
    runs["fully_shard"] = train(rank, world_size, impl="fully_shard", steps=STEPS, dtype=torch.float64,
                                reshard_after_forward=False)
    # across micro-steps, as torch's pipelining runs FSDP: ours and fully_shard's
    keep = dict(zero_stage=3, steps=2, accumulation_steps=ACCUMULATION_STEPS, optimizer="sgd", lr=0.1,
                dtype=torch.float64, reshard_after_forward=False, reshard_after_backward=False)
    runs["kept across"] = train(rank, world_size, memory_trace=True, **keep)
    runs["fully_shard kept across"] = train(rank, world_size, impl="fully_shard", **keep)
    return runs


@pytest.fixture(scope="module")
def kept_gathered():
    return launch(kept_gathered_runs, 2, timeout=300)


def test_zero3_without_resharding_matches_one_process(kept_gathered):
    """2 ranks, with (2 micro-steps × 4 rows) and without gradient accumulation: one process on the global batch.
    Keeping the weights gathered changes when memory is freed, not one sum: bit for bit resharding's weights."""
    for a in (1, ACCUMULATION_STEPS):
        reference = one_process("sgd", 2, lr=0.1, accumulation_steps=a, steps=2)
        for ranks in kept_gathered:
            gap = (ranks[False, a]["params"] - reference).abs().max().item()
            assert gap < 1e-9, (a, gap)
            assert torch.equal(ranks[False, a]["params"], ranks[True, a]["params"]), a
    adam_gap = (kept_gathered[0]["adam"]["params"] - one_process("adam", 2, lr=1e-2)).abs().max().item()
    assert adam_gap < 1e-9, adam_gap
    torch_gap = (kept_gathered[0]["adam"]["params"] - kept_gathered[0]["fully_shard"]["params"]).abs().max().item()
    assert torch_gap < 1e-10, torch_gap


def test_zero3_without_resharding_gathers_each_unit_once_per_micro_step(kept_gathered):
    """Traced, every step, every rank: A all-gathers and A reduce-scatters of Ψ·(N-1)/N, exactly the formula
    (2 ranks: every unit's bytes halve exactly); resharding gathers 2A times. Forward gathers, backward does not."""
    world_size, grad_bytes = 2, 8 * P                              # float64, no padding on 2 ranks
    for a in (1, ACCUMULATION_STEPS):
        expected = wire_bytes_per_step(grad_bytes, 3, world_size, a, reshard_after_forward=False)
        assert expected == {"all_gather": a * grad_bytes / 2, "reduce_scatter": a * grad_bytes / 2}
        for ranks in kept_gathered:
            for wire, count in zip(ranks[False, a]["wire"], ranks[False, a]["collectives"]):
                assert wire == expected, a
                assert count == 2 * a * NUM_UNITS, a
            assert ranks[True, a]["wire"][-1] == wire_bytes_per_step(grad_bytes, 3, world_size, a)
            trace = ranks[False, a]["memory_trace"]
            gathers = [(e["event"], e["unit"]) for e in trace if e["event"].startswith("gather")]
            assert gathers == [("gather (forward)", unit) for unit in UNIT_NAMES] * a


def test_transient_weight_bytes_equal_the_measured_peak(kept_gathered):
    """The memory trace counts this rank's weight storage after every gather, free and reduce; only a gather adds
    bytes, and each is recorded as it happens, so the trace's maximum is the step's peak. Above the weights at
    rest (the shards: zero_state_bytes), it is transient_weight_bytes: one unit's flat buffer at a time when
    resharding (every gather finds the previous unit freed), all of them at the end of forward when not (each
    buffer holds this rank's own shard too, a second copy: nothing is subtracted)."""
    at_rest = zero_state_bytes(P, 3, 2, weight_bytes=8)["weights"]
    for (reshard, a), predicted in [((True, 1), 8 * max(UNIT_PARAMS)), ((True, 2), 8 * max(UNIT_PARAMS)),
                                    ((False, 1), 8 * P), ((False, 2), 8 * P)]:
        assert transient_weight_bytes(UNIT_PARAMS, 3, 8, reshard, world_size=2) == predicted
        for ranks in kept_gathered:
            run = ranks[reshard, a]
            assert run["state"]["weights"] == at_rest
            held = [event["weights"] - at_rest for event in run["memory_trace"]]
            assert max(held) == predicted, (reshard, a)
            whole_grads = max(event["grads"] for event in run["memory_trace"]) - run["state"]["grads"]
            assert whole_grads == transient_gradient_bytes(UNIT_PARAMS, 3, 8) == 8 * max(UNIT_PARAMS), (reshard, a)
            assert held[-1] == 0                                   # all freed after the step
            if reshard:
                size = dict(zip(UNIT_NAMES, UNIT_PARAMS))
                assert all(gathered == 8 * size[event["unit"]] for event, gathered in zip(run["memory_trace"], held)
                           if event["event"].startswith("gather")), "two units gathered at once"


def test_zero3_kept_across_micro_steps_matches_one_process_and_gathers_once_a_step(kept_gathered):
    """reshard_after_backward=False (torch's pipelining with FSDP): the same weights as one process and as
    fully_shard run the same way; each unit gathered once and reduced once per optimizer step, whatever A (the
    traced bytes: zero_bytes.wire_bytes_per_step); its weights and whole gradients held from the first forward to
    the step's reduce-scatter: transient_weight_bytes + transient_gradient_bytes above the state at rest."""
    world_size, grad_bytes, a = 2, 8 * P, ACCUMULATION_STEPS
    reference = one_process("sgd", 2, lr=0.1, accumulation_steps=a, steps=2)
    expected = wire_bytes_per_step(grad_bytes, 3, world_size, a, False, reshard_after_backward=False)
    assert expected == {"all_gather": grad_bytes / 2, "reduce_scatter": grad_bytes / 2}
    at_rest = zero_state_bytes(P, 3, 2, weight_bytes=8, grad_bytes=8)
    for ranks in kept_gathered:
        run = ranks["kept across"]
        assert {part: run["state"][part] for part in ("weights", "grads")} == {
            part: at_rest[part] for part in ("weights", "grads")}
        assert (run["params"] - reference).abs().max().item() < 1e-9
        assert (run["params"] - ranks["fully_shard kept across"]["params"]).abs().max().item() < 1e-10
        assert run["wire"] == [expected] * 2 and run["collectives"] == [2 * NUM_UNITS] * 2
        gathers = [e["unit"] for e in run["memory_trace"] if e["event"].startswith("gather")]
        assert gathers == UNIT_NAMES                               # A micro-steps, one gather per unit
        weights = max(e["weights"] for e in run["memory_trace"]) - at_rest["weights"]
        grads = max(e["grads"] for e in run["memory_trace"]) - at_rest["grads"]
        assert weights == transient_weight_bytes(UNIT_PARAMS, 3, 8, False, 2, reshard_after_backward=False) == 8 * P
        assert grads == transient_gradient_bytes(UNIT_PARAMS, 3, 8, reshard_after_backward=False) == 8 * P
        assert run["memory_trace"][-1]["weights"] == at_rest["weights"]


def _never_reduced(rank, world_size):
    model = ZeroDataParallel(build(TINY, dtype=torch.float64), Comm(), zero_stage=3, optimizer_class=torch.optim.SGD,
                             reshard_after_forward=False, reshard_after_backward=False, lr=0.1)
    inputs, targets = SyntheticTokens(TINY.vocab_size, 32).batch(0, 2)
    with model.no_sync():
        loss_fn(model(inputs), targets).backward()
    try:
        model.step()
    except RuntimeError as error:
        refused = str(error)
    model.finish_gradient_sync()                          # what a pipeline calls after its micro-batches
    model.step()
    return refused, sum(unit.gathered for unit in model.units)


def test_gradients_kept_across_micro_steps_must_be_reduced_before_step():
    refused, gathered = launch(_never_reduced, 1)[0]
    assert "its gradients were never averaged" in refused and gathered == 0


def test_transient_weight_bytes_formula():
    units = [10, 7, 3]
    assert transient_weight_bytes(units, 3, 2) == 20                               # the largest unit, 2 bytes each
    assert transient_weight_bytes(units, 3, 2, reshard_after_forward=False) == 40  # all of them
    assert transient_weight_bytes(units, 3, 2, world_size=4) == 2 * 12             # the flat buffer: 4·ceil(10/4)
    assert transient_weight_bytes(units, 3, 2, False, world_size=4) == 2 * (12 + 8 + 4)
    assert all(transient_weight_bytes(units, stage, 2) == 0 for stage in (0, 1, 2))    # weights whole already
    assert [transient_gradient_bytes(units, stage, 4) for stage in range(4)] == [0, 0, 40, 40]   # one unit's, whole
    assert transient_gradient_bytes(units, 3, 4, reshard_after_backward=False) == 80              # every unit's
    assert wire_bytes_per_step(1000, 3, 4, 2, reshard_after_forward=False) == {"all_gather": 1500.0,
                                                                                 "reduce_scatter": 1500.0}


def test_reshard_after_forward_false_needs_stage_3():
    """Checked before anything is made: no group, no comm needed (None here) to be told."""
    message = r"reshard_after_forward=False with zero_stage=1: only ZeRO-3 frees a unit's weights after its forward"
    with pytest.raises(ValueError, match=message):
        ZeroDataParallel(build(TINY), None, zero_stage=1, reshard_after_forward=False)
    with pytest.raises(ValueError, match=r"reshard_after_forward='no': True or False"):
        ZeroDataParallel(build(TINY), None, zero_stage=3, reshard_after_forward="no")
    with pytest.raises(ValueError, match=r"reshard_after_forward=False with zero_stage=2"):
        wire_bytes_per_step(1000, 2, 4, reshard_after_forward=False)
    with pytest.raises(ValueError, match=r"reshard_after_forward=False with zero_stage=0"):
        transient_weight_bytes([10], 0, 2, reshard_after_forward=False)
    with pytest.raises(ValueError, match=r"reshard_after_backward=False with reshard_after_forward=True: keeping"):
        ZeroDataParallel(build(TINY), None, zero_stage=3, reshard_after_backward=False)
    with pytest.raises(ValueError, match=r"reshard_after_backward=False with zero_stage=1"):
        wire_bytes_per_step(1000, 1, 4, reshard_after_backward=False)


def _forward_without_backward(rank, world_size):
    """reshard_after_forward=False: a forward whose graph is dropped (no backward) leaves its units gathered;
    step() changes the shards under them, so it frees them, and the next forward gathers the new weights."""
    model = ZeroDataParallel(build(TINY, dtype=torch.float64), Comm(), zero_stage=3, optimizer_class=torch.optim.SGD,
                             reshard_after_forward=False, lr=0.1)
    inputs, targets = SyntheticTokens(TINY.vocab_size, 32).batch(0, 2)
    loss_fn(model(inputs), targets).backward()
    loss_fn(model(inputs), targets)                       # an evaluation under autograd: its graph is dropped
    still_gathered = sum(unit.gathered for unit in model.units)
    model.step()
    return still_gathered, sum(unit.gathered for unit in model.units), model.full_parameters(), [
        unit.shard.detach().clone() for unit in model.units]


def test_step_frees_units_a_forward_left_gathered():
    still_gathered, after_step, full, shards = launch(_forward_without_backward, 1)[0]
    assert still_gathered == NUM_UNITS and after_step == 0
    assert torch.equal(full, torch.cat(shards))           # one rank: the shards are the weights, in unit order
