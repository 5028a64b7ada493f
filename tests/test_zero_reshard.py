"""course_lib.zero's ZeRO-3 without resharding after forward (reshard_after_forward=False, torch FSDP2's name):
the same weights as one process and as resharding, one all-gather per unit and micro-step (traced bytes equal
zero.wire_bytes_per_step), and the gathered weights it holds while a step runs (zero.transient_weight_bytes),
measured to the byte with ZeroDataParallel's memory trace. Tolerances as tests/test_zero.py's (float64)."""

import pytest
import torch
from test_zero import NUM_UNITS, UNIT_NAMES, UNIT_PARAMS, P, one_process

from course_lib import launch
from course_lib.comm import Comm
from course_lib.data import SyntheticTokens
from course_lib.ledger import zero_state_bytes
from course_lib.model import build, loss_fn, preset
from course_lib.runs.zero import train
from course_lib.zero import ZeroDataParallel, transient_weight_bytes, wire_bytes_per_step

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
            assert held[-1] == 0                                   # all freed after the step
            if reshard:
                size = dict(zip(UNIT_NAMES, UNIT_PARAMS))
                assert all(gathered == 8 * size[event["unit"]] for event, gathered in zip(run["memory_trace"], held)
                           if event["event"].startswith("gather")), "two units gathered at once"


def test_transient_weight_bytes_formula():
    units = [10, 7, 3]
    assert transient_weight_bytes(units, 3, 2) == 20                               # the largest unit, 2 bytes each
    assert transient_weight_bytes(units, 3, 2, reshard_after_forward=False) == 40  # all of them
    assert transient_weight_bytes(units, 3, 2, world_size=4) == 2 * 12             # the flat buffer: 4·ceil(10/4)
    assert transient_weight_bytes(units, 3, 2, False, world_size=4) == 2 * (12 + 8 + 4)
    assert all(transient_weight_bytes(units, stage, 2) == 0 for stage in (0, 1, 2))    # weights whole already
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
