"""Interleaved 1F1B and zero bubble (ZB-H1): their formulas and the papers' numbers, their action lists (and
torch's, op for op), the simulator against the formulas, a rank's chunks; on real ranks: loss and gradients
equal to one process and to torch.distributed.pipelining, the messages, bubbles measured in controlled-cost
mode against the formulas and against 1F1B, and the micro-batches in flight."""

import itertools
from fractions import Fraction

import pytest
import torch

from course_lib import RankError, launch
from course_lib.model import build, preset
from course_lib.pipeline_parallel import (
    Timeline,
    bubble_fraction,
    make_stage,
    partition_layers,
    pipeline_makespan,
    schedule_actions,
    simulate,
)
from course_lib.runs.pipeline import pipeline_sweep, pipeline_worker, single_process_step, torch_pipeline_worker
from course_lib.schedules import interleaved_actions, zb_h1_actions, zero_bubble_fraction

# float64: the schedules change only the order in which micro-batch gradients are added (see
# test_pipeline_parallel.py); 1e-12 is far above that rounding and far below a lost micro-batch (> 1e-4).
F64 = dict(rtol=0, atol=1e-12)
BUBBLE_TOLERANCE = 0.06   # as in test_pipeline_parallel.py, where the margin is explained


def interleaved_peaks(p, m, v):
    """Chunk-micro-batches stage s holds at its peak: its warm-up forwards and one more."""
    return [min(v * m, (v - 1) * p + 2 * (p - s - 1) + 1) for s in range(p)]


# ---------------------------------------------------------------------------------------- the formulas

def test_interleaving_divides_the_fill_and_drain_by_v():
    # Megatron-LM (Narayanan et al. 2021) counts the bubble against the ideal time: (p - 1)/(v·m)
    p, m = 8, 32
    for v in (1, 2, 4):
        of_step = bubble_fraction(p, m, num_chunks=v)
        assert of_step == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-15)
        assert of_step / (1 - of_step) == pytest.approx((p - 1) / (v * m), abs=1e-15)   # Megatron's convention
    assert [round(100 * bubble_fraction(8, 32, num_chunks=v), 1) for v in (1, 2, 4)] == [17.9, 9.9, 5.2]
    assert pipeline_makespan(4, 8, 1, 2, num_chunks=2) == (8 + 3 / 2) * 3
    with pytest.raises(ValueError, match="num_chunks=0"):
        bubble_fraction(4, 8, num_chunks=0)


def test_zb_h1_idles_a_third_of_1f1b_when_f_b_and_w_cost_the_same():
    p, m = 4, 8
    assert Fraction(zero_bubble_fraction(p, m)).limit_denominator(1000) == Fraction(3, 27)   # (p-1)/(3m+p-1)
    # idle time (p - 1)(T_F + T_B - T_W) against 1F1B's (p - 1)(T_F + T_B + T_W): one third
    idle = {name: b / (1 - b) * m * 3 for name, b in (("zb", zero_bubble_fraction(p, m)),
                                                       ("1f1b", bubble_fraction(p, m)))}
    assert idle["zb"] / idle["1f1b"] == pytest.approx(1 / 3, abs=1e-12)
    assert zero_bubble_fraction(4, 8, 2, 1.5, 1) == pytest.approx(3 * 2.5 / (8 * 4.5 + 3 * 2.5), abs=1e-15)
    with pytest.raises(ValueError, match="assumes num_microbatches >= num_stages"):
        zero_bubble_fraction(4, 2)
    with pytest.raises(ValueError, match="T_W <= T_F, T_B"):
        zero_bubble_fraction(4, 8, 1, 1, 2)


# ------------------------------------------------------------------------------------- action lists

def test_interleaved_goes_depth_first_in_groups_of_p_as_megatron_does():
    # p = 2, v = 2, m = 4: micro-batches 0, 1 through chunk 0, then through chunk 1, then 2, 3 ...
    assert interleaved_actions(0, 2, 4, 2) == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),                    # (v-1)·p + 2·(p-s-1) = 4 warm-up
        ("F", 2, 0), ("B", 0, 1), ("F", 3, 0), ("B", 1, 1), ("F", 2, 1), ("B", 0, 0), ("F", 3, 1), ("B", 1, 0),
        ("B", 2, 1), ("B", 3, 1), ("B", 2, 0), ("B", 3, 0)]
    for p, m, v in [(2, 2, 2), (2, 6, 3), (4, 8, 2), (3, 9, 3)]:
        schedule_actions("interleaved", p, m, num_chunks=v)     # each op once, message orders agree
    with pytest.raises(ValueError, match=r"num_microbatches=6 to be a multiple of num_stages=4"):
        schedule_actions("interleaved", 4, 6, num_chunks=2)
    with pytest.raises(ValueError, match="'1f1b' runs one chunk per stage: num_chunks=2 needs 'interleaved'"):
        schedule_actions("1f1b", 2, 4, num_chunks=2)


def test_zb_h1_is_1f1b_with_w_deferred_s_times_on_stage_s():
    assert zb_h1_actions(0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("W", 0), ("F", 2), ("B", 1), ("W", 1),
                                      ("B", 2), ("W", 2)]
    assert zb_h1_actions(1, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("F", 2), ("B", 2),
                                      ("W", 1), ("W", 2)]
    for p, m in [(1, 3), (2, 1), (3, 5), (4, 2), (4, 8)]:
        for s, actions in enumerate(schedule_actions("zb-h1", p, m)):
            without_w = [a for a in actions if a[0] != "W"]
            assert without_w == schedule_actions("1f1b", p, m)[s]           # F and B in 1F1B's order
            after_last_b = len(actions) - 1 - max(i for i, a in enumerate(actions) if a[0] == "B")
            assert after_last_b == min(s, m) + (s < m)                       # s deferred W's, and the last B's own


def test_schedules_refuse_a_w_before_its_b():
    with pytest.raises(ValueError, match="runs a W before the B"):
        schedule_actions(lambda s, p, m: [("F", 0), ("W", 0), ("B", 0)], 1, 1)
    with pytest.raises(ValueError, match="exactly once"):
        schedule_actions(lambda s, p, m: [("F", 0), ("B", 0), ("W", 0), ("W", 0)], 1, 1)


# -------------------------------------------------------------------------------------------- simulator

def test_simulated_interleaved_makespan_bubble_and_memory_are_the_formulas():
    for p, v, (t_f, t_b) in itertools.product(range(2, 6), range(1, 4), [(1, 1), (1, 2), (3, 5)]):
        for m in range(p, 4 * p + 1, p):
            timeline = simulate("interleaved", p, m, t_f, t_b, num_chunks=v)
            assert timeline.makespan == pytest.approx(pipeline_makespan(p, m, t_f, t_b, num_chunks=v), abs=1e-9)
            assert timeline.idle_fractions == pytest.approx([bubble_fraction(p, m, num_chunks=v)] * p, abs=1e-12)
            assert [timeline.peak_in_flight(s) for s in range(p)] == interleaved_peaks(p, m, v)


def test_simulated_zb_h1_makespan_is_the_papers_and_holds_1f1bs_peak_on_every_stage():
    for p, (t_f, t_b, t_w) in itertools.product(range(1, 7), [(1, 1, 1), (2, 1.5, 1), (1, 1, 0.5), (3, 2, 2)]):
        for m in range(p, p + 8):
            timeline = simulate("zb-h1", p, m, t_f, t_b + t_w, weight_fraction=t_w / (t_b + t_w))
            assert timeline.makespan == pytest.approx(m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b - t_w), abs=1e-9)
            assert timeline.bubble == pytest.approx(zero_bubble_fraction(p, m, t_f, t_b, t_w), abs=1e-12)
            assert [timeline.peak_in_flight(s) for s in range(p)] == [p] * p
    # the formula's condition T_W <= T_F, T_B matters: a W longer than F leaves the drain partly idle
    long_w = simulate("zb-h1", 4, 8, 1, 3, weight_fraction=2 / 3)          # T_F = 1, T_B = 1, T_W = 2
    assert long_w.makespan >= 8 * (1 + 1 + 2) + 3 * (1 + 1 - 2) + 3         # the formula's 32, plus 3 or more


def test_both_beat_1f1b_in_simulation_and_pay_in_messages_or_memory():
    p, m = 4, 8
    one_f_one_b = simulate("1f1b", p, m, 1, 2)
    assert simulate("interleaved", p, m, 1, 2, num_chunks=2).bubble < one_f_one_b.bubble
    assert simulate("zb-h1", p, m, 1, 2).bubble < one_f_one_b.bubble
    # zero bubble: every stage holds 1F1B's stage-0 peak (p), not p - s
    assert [one_f_one_b.peak_in_flight(s) for s in range(p)] == [4, 3, 2, 1]


# ------------------------------------------------------------------------------------------ a rank's chunks

def test_a_rank_holds_v_chunks_of_the_virtual_stages_c_p_plus_s():
    config = preset("tiny", num_layers=8)
    parts = partition_layers(8, 2, num_chunks=2)       # 4 virtual stages of 2 layers
    assert parts == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    full = {name for name, _ in build(config).named_parameters()}
    names = []
    for rank in range(2):
        chunks = make_stage(build(config), rank, parts, num_chunks=2)
        assert isinstance(chunks, torch.nn.ModuleList) and len(chunks) == 2
        for c, chunk in enumerate(chunks):
            kept = {int(n.split(".")[1]) for n, _ in chunk.named_parameters() if n.startswith("layers.")}
            assert kept == set(parts[c * 2 + rank])
            names += [name for name, _ in chunk.named_parameters()]
    assert sorted(names) == sorted(full)                     # every parameter on exactly one chunk
    with pytest.raises(ValueError, match=r"num_stages=2 × num_chunks=4 = 8 virtual stages > num_layers=4: every "
                                         "virtual stage needs at least one layer"):
        partition_layers(4, 2, num_chunks=4)


# ---------------------------------------------------------------------------------------------- real ranks

@pytest.mark.ranks
@pytest.mark.parametrize("num_stages,schedule,num_chunks,num_layers,microbatches", [
    (2, "interleaved", 2, 4, (2, 8)), (4, "interleaved", 2, 8, (4, 8)), (2, "zb-h1", 1, 4, (1, 4)),
    (4, "zb-h1", 1, 4, (2, 8))])
def test_loss_and_grads_equal_one_process(num_stages, schedule, num_chunks, num_layers, microbatches):
    weights = {k: v.double() for k, v in build(preset("tiny", num_layers=num_layers), seed=0).state_dict().items()}
    loss, grads = single_process_step(num_layers=num_layers, batch_size=8, seq_len=16, dtype=torch.float64)
    runs = launch(pipeline_sweep, num_stages, runs=[{"num_microbatches": m} for m in microbatches],
                  schedule=schedule, num_chunks=num_chunks, num_layers=num_layers, batch_size=8, seq_len=16,
                  dtype=torch.float64, weights=weights, return_grads=True, measure_memory=False)
    boundary = 8 * 16 * preset("tiny").hidden * 8          # one float64 activation of the batch
    for i, m in enumerate(microbatches):
        results = [runs[rank][i] for rank in range(num_stages)]
        assert results[-1]["loss"] == pytest.approx(loss, rel=0, abs=F64["atol"])
        pipeline_grads = {name: g for r in results for name, g in r["grads"].items()}
        assert pipeline_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(pipeline_grads[name], grad, **F64, msg=name)
        # a rank sends an activation from each chunk but the last virtual stage's and a gradient from each but
        # the first's: v times 1F1B's messages, each 1/m of the boundary
        sends = [2 * num_chunks - (s == 0) - (s == num_stages - 1) for s in range(num_stages)]
        assert [r["sent_bytes"] for r in results] == [n * boundary for n in sends]
        assert [r["messages"] for r in results] == [n * m for n in sends]


@pytest.mark.ranks
def test_torch_pipelining_gives_the_same_loss_and_grads_and_the_same_orders():
    weights = {k: v.double() for k, v in build(preset("tiny"), seed=0).state_dict().items()}
    for schedule, num_chunks in [("interleaved", 2), ("zb-h1", 1)]:
        ours = launch(pipeline_worker, 2, num_microbatches=4, schedule=schedule, num_chunks=num_chunks,
                      batch_size=8, seq_len=16, dtype=torch.float64, weights=weights, return_grads=True)
        actions = schedule_actions(schedule, 2, 4, num_chunks=num_chunks)
        torch_schedules = [(schedule, num_chunks)] + ([("zbv", 2), ("zb-h1", 2)] if schedule == "zb-h1" else [])
        for name, v in torch_schedules:
            theirs = launch(torch_pipeline_worker, 2, weights=weights, schedule=name, num_microbatches=4, num_chunks=v)
            last = 0 if name == "zbv" else 1                  # ZBV's V puts the last stage on the first rank
            assert theirs[last]["loss"] == pytest.approx(ours[1]["loss"], rel=0, abs=F64["atol"]), name
            ours_grads = {n: g for r in ours for n, g in r["grads"].items()}
            theirs_grads = {n: g for r in theirs for n, g in r["grads"].items()}
            assert theirs_grads.keys() == ours_grads.keys()
            for n, grad in ours_grads.items():
                torch.testing.assert_close(theirs_grads[n], grad, **F64, msg=f"{name}: {n}")
            if (name, v) == (schedule, num_chunks):       # op for op: torch's order of each rank's ops is ours
                assert [r["order"] for r in theirs] == [[(*a[:2], a[2] if len(a) > 2 else 0) for a in acts]
                                                       for acts in actions]


@pytest.mark.ranks
def test_controlled_cost_bubbles_are_the_formulas_and_beat_1f1b():
    # 4 ranks whose ops only sleep (compute=False: 4 ranks computing in lockstep would fight over 2 cores);
    # t_b = 2·t_f, so that ZB-H1 has T_F = T_B = T_W. 8 layers: 8 virtual stages for v = 2. 60 ms per forward
    # (30 ms per interleaved chunk): interleaving pays a hand-off at twice as many ops, and at 30 ms per forward
    # its gap reached 0.043 on a loaded machine; at 60 ms, 0.010-0.029 (1F1B 0.004-0.009, ZB-H1 0.008-0.014).
    p, m = 4, 8
    weights = build(preset("tiny", num_layers=8), seed=0).state_dict()
    runs = launch(pipeline_sweep, p, runs=[{"schedule": "1f1b"}, {"schedule": "interleaved", "num_chunks": 2},
                                           {"schedule": "zb-h1"}],
                  num_microbatches=m, num_layers=8, forward_ms=60, backward_ratio=2, batch_size=16, seq_len=8,
                  steps=3, measure_memory=False, compute=False, weights=weights)
    one_f_one_b, interleaved, zero_bubble = (Timeline.from_results([ranks[i] for ranks in runs]) for i in range(3))
    assert one_f_one_b.overruns == interleaved.overruns == zero_bubble.overruns == 0
    assert interleaved.bubble == pytest.approx(bubble_fraction(p, m, num_chunks=2), abs=BUBBLE_TOLERANCE)
    assert zero_bubble.bubble == pytest.approx(zero_bubble_fraction(p, m), abs=BUBBLE_TOLERANCE)
    # formulas 15.8% and 11.1% against 1F1B's 27.3%
    assert interleaved.bubble < one_f_one_b.bubble and zero_bubble.bubble < one_f_one_b.bubble
    assert [interleaved.peak_in_flight(s) for s in range(p)] == interleaved_peaks(p, m, 2)   # chunk-micro-batches
    assert [zero_bubble.peak_in_flight(s) for s in range(p)] == [p] * p
    assert [one_f_one_b.peak_in_flight(s) for s in range(p)] == [4, 3, 2, 1]


@pytest.mark.ranks
def test_zb_h1_holds_each_micro_batch_until_its_w():
    # real compute, saved bytes counted: ZB-H1's stage 1 of 2 holds 2 micro-batches (1F1B: 1), stage 0 the same 2
    weights = build(preset("tiny"), seed=0).state_dict()
    runs = launch(pipeline_sweep, 2, runs=[{"schedule": "1f1b"}, {"schedule": "zb-h1"}], num_microbatches=4,
                  batch_size=16, seq_len=8, weights=weights)
    one_f_one_b, zero_bubble = (Timeline.from_results([ranks[i] for ranks in runs]) for i in range(2))
    assert [zero_bubble.peak_in_flight(s) for s in range(2)] == [2, 2]
    assert zero_bubble.peak_in_flight_bytes(0) == one_f_one_b.peak_in_flight_bytes(0) > 0
    assert zero_bubble.peak_in_flight_bytes(1) == 2 * one_f_one_b.peak_in_flight_bytes(1) > 0


@pytest.mark.ranks
def test_clear_errors_on_every_rank():
    with pytest.raises(RankError, match="num_microbatches=3 to be a multiple of num_stages=2"):
        launch(pipeline_worker, 2, num_microbatches=3, batch_size=12, schedule="interleaved", num_chunks=2,
               timeout=30)
    with pytest.raises(RankError, match=r"num_stages=2 × num_chunks=4 = 8 virtual stages > num_layers=4"):
        launch(pipeline_worker, 2, num_microbatches=2, schedule="interleaved", num_chunks=4, timeout=30)


# ------------------------------------------------------------------------------------------------ figures

def test_gantt_charts_colour_w_and_label_each_chunk():
    import matplotlib.colors
    import matplotlib.pyplot as plt

    from course_lib.presentation import interactive, plots

    zero_bubble = simulate("zb-h1", 2, 4, 1, 2)
    ax = plots.pipeline_gantt(zero_bubble).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "input grad (B)", "weight grads (W)",
                                                                   "idle"]
    colours = [matplotlib.colors.to_hex(p.get_facecolor()[:3]) for p in ax.patches]
    assert colours.count(matplotlib.colors.to_hex("tab:orange")) == 2 * 4          # a W per micro-batch per stage
    interleaved = simulate("interleaved", 2, 4, 1, 1, num_chunks=2)
    top, low = plots.pipeline_gantt(interleaved, in_flight=True).axes
    assert [t.get_text() for t in top.get_legend().get_texts()] == [
        "forward, chunk 0", "forward, chunk 1", "backward, chunk 0", "backward, chunk 1", "idle"]
    labels = {t.get_text() for t in top.texts}
    assert {f"${k}_{{{c}}}$" for k in range(4) for c in range(2)} <= labels     # micro-batch, chunk as subscript
    assert max(low.get_lines()[0].get_ydata()) == interleaved_peaks(2, 4, 2)[0]
    plt.close("all")
    fig = interactive.pipeline_gantt(interleaved)
    assert [t.name for t in fig.data] == ["forward, chunk 0", "forward, chunk 1", "backward, chunk 0",
                                          "backward, chunk 1"]
    assert "chunk 1 (virtual stage %{customdata[4]})" in fig.data[1].hovertemplate
    assert {c[4] for c in fig.data[1].customdata} == {2, 3}                      # chunk 1: virtual stages p + s
    assert [t.name for t in interactive.pipeline_gantt(zero_bubble).data] == ["forward", "input grad (B)",
                                                                              "weight grads (W)"]


def torch_zb_h1_orders(p: int, m: int) -> list[list[tuple[str, int]]] | None:
    """torch's ScheduleInterleavedZeroBubble, one stage per rank, as each rank's (op, micro-batch) list; None
    where torch refuses m (it needs m divisible by its rounds, max(1, m // p)). Only the planning step runs: no
    process group, no stage (the constructor's arithmetic, set by hand; the ranks test above runs it for real)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble
    planner = object.__new__(ScheduleInterleavedZeroBubble)
    planner.pp_group_size, planner.n_local_stages, planner._n_microbatches = p, 1, m
    planner.number_of_rounds = max(1, m // p)
    planner.microbatches_per_round = m // planner.number_of_rounds
    if m % planner.number_of_rounds:
        return None
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    return [[(kinds[a.computation_type.name], a.microbatch_index)
             for a in planner._calculate_single_rank_operations(rank) if a is not None] for rank in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zb_h1_is_torch_s_interleaved_zero_bubble_op_for_op_for_every_m_up_to_16(p):
    compared = []
    for m in range(p, 17):
        theirs = torch_zb_h1_orders(p, m)
        if theirs is None:
            assert m % (m // p) != 0                         # only where torch refuses the micro-batch count
            continue
        assert theirs == [[tuple(a[:2]) for a in acts] for acts in schedule_actions("zb-h1", p, m)], (p, m)
        compared.append(m)
    assert len(compared) >= 8 and compared[-1] >= 15
