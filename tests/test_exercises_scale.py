"""exercises.check_layout_at_scale and check_own_job (notebook 09) given the typical wrong answers: each gets its own hint, ✗ and
False (tests/test_exercises.py runs it on its reference answer and on the notebook's unfinished cell). It judges
an answer with the planner's own models, so the planner's best layout is the checker's."""

import pytest
from test_exercises import NOT_DONE, unfinished, verdict

from course_lib.plan import plan
from course_lib.presentation import exercises
from course_lib.presentation.exercises import scale as exercises_scale
from course_lib.presentation.exercises import solutions
from course_lib.recipes import Workload


def layout(**changes):
    """The reference layout with some values changed; a value of None removes that key."""
    answer = {**solutions.layout_at_scale(), **changes}
    return lambda: {key: value for key, value in answer.items() if value is not None}


@pytest.mark.parametrize("answer, words", [
    (unfinished, [NOT_DONE]),
    (lambda: (2, 4, 8), ["✗ layout() returned a tuple; return a dict with the keys dp, tp, pp, zero_stage, "
                         "micro_batch_size, sequence_parallel, recompute"]),
    (layout(recompute=None), ["✗ your dict needs the keys", "; it has no 'recompute'\n"]),
    (layout(zero=1, zero_stage=None), ["it has no 'zero_stage'; 'zero' is not one of them"]),
    (layout(dp=4), ["✗ ValueError: world_size 64 != dp 4 × tp 4 × pp 8 = 128"]),
    (layout(dp=1, tp=16, pp=4), ["✗ ValueError: 8 key/value heads (num_kv_heads) cannot split over TP=16"]),
    (layout(zero_stage=4), ["✗ zero_stage=4: one of 0 (DDP), 1, 2, 3"]),
    (layout(recompute="some"), ["✗ recompute='some': one of 'none', 'selective', 'op', 'full'"]),
    (layout(sequence_parallel="yes"), ["✗ sequence_parallel='yes': True or False"]),
    (layout(micro_batch_size=1.5), ["✗ micro_batch_size=1.5: a whole number of sequences >= 1"]),
    (layout(micro_batch_size=3), ["✗ the 512 sequences of a step do not split into dp 2 × micro-batches of 3: "
                                  "m = B/(dp·b) = 512/6 must be a whole number"]),
    (layout(dp=8, tp=1, pp=8, micro_batch_size=64), ["✗ PP 8 stages > 1 micro-batches: the bubble is 88%"]),
], ids=["unfinished", "not-a-dict", "missing-key", "misspelt-key", "wrong-size", "tp-over-kv-heads", "no-such-stage",
        "no-such-recompute", "sp-not-bool", "fractional-micro-batch", "uneven-batch",
        "fewer-micro-batches-than-stages"])
def test_an_answer_that_is_no_layout_says_why(capsys, answer, words):
    verdict(capsys, exercises.check_layout_at_scale(answer), False, *words)


@pytest.mark.parametrize("answer, words", [
    (layout(dp=64, tp=1, pp=1, zero_stage=0, sequence_parallel=False),
     ["✗ does not fit: the busiest GPU needs state 1027.8 GiB + activations 111.0 GiB + reserve 8.0 GiB = 1146.8 GiB "
      "of 80.0 GiB, 1066.8 GiB over", "the training state alone, with the reserve, needs 1035.8 GiB: shard it more"]),
    (layout(sequence_parallel=False, micro_batch_size=2),
     ["✗ does not fit: the busiest GPU needs state 22.4 GiB + activations 85.4 GiB + reserve 8.0 GiB = 115.7 GiB of "
      "80.0 GiB, 35.7 GiB over", "the activations must shrink by 35.7 GiB, to at most 49.6 GiB: sequence parallelism"]),
], ids=["state", "activations"])
def test_a_layout_that_does_not_fit_says_which_part_overflows_and_by_how_much(capsys, answer, words):
    shown = verdict(capsys, exercises.check_layout_at_scale(answer), False, *words)
    assert "MFU" not in shown


@pytest.mark.parametrize("answer, worst, words", [
    (layout(dp=1, tp=8, pp=8, recompute="none"), "tp",
     ["MFU is 37.8% < 42%", "The largest loss is tp, 6.66 s (17% of the step)", "A smaller TP"]),
    (layout(dp=16, tp=4, pp=1, zero_stage=3), "dp",
     ["MFU is 33.0% < 42%", "The largest loss is dp, 16.4 s (37% of the step)", "gathered 2m times"]),
    (layout(dp=4, tp=1, pp=16, micro_batch_size=4, recompute="full", sequence_parallel=False), "bubble",
     ["The largest loss is bubble, 15.9 s (32% of the step)", "(p-1)/(m+p-1)"]),
    (layout(dp=8, tp=1, pp=8, recompute="full", sequence_parallel=False), "recompute",
     ["The largest loss is recompute, 8.34 s (22% of the step)", "hardware FLOPs that MFU does not count"]),
    (layout(dp=1, tp=1, pp=64, recompute="full", sequence_parallel=False), "imbalance",
     ["MFU is 24.4% < 42%", "The largest loss is imbalance", "whole on every TP rank"]),
], ids=["tp", "dp", "bubble", "recompute", "imbalance"])
def test_a_layout_that_fits_but_is_slow_names_its_largest_loss(capsys, answer, worst, words):
    shown = verdict(capsys, exercises.check_layout_at_scale(answer), False, "✗ it fits, but", *words)
    assert exercises_scale.HINTS[worst] in shown
    _, _, _, time = exercises_scale.judge(answer())
    lost = exercises_scale.losses(time)
    assert max(lost, key=lost.get) == worst and min(lost.values()) >= -1e-9
    ideal = time.mfu * time.total_s / time.achieved_share     # every second beyond the ideal step has a name
    assert sum(lost.values()) == pytest.approx(time.total_s - ideal)


@pytest.mark.parametrize("answer", [layout(dp=1, tp=4, pp=16), layout(dp=4, tp=8, pp=2), layout(zero_stage=3)],
                         ids=["dp1-tp4-pp16", "dp4-tp8-pp2", "zero3-beside-a-pipeline"])
def test_other_layouts_pass_too(capsys, answer):
    verdict(capsys, exercises.check_layout_at_scale(answer), True, "✓ dp", "(≥ 42%)")


def test_the_checker_judges_with_the_planners_numbers():
    """The planner, asked for the reference answer's workload, picks a layout that the checker passes, with the
    planner's memory and step time to the byte and the second; the reference answer passes too."""
    answer = solutions.layout_at_scale()
    workload = Workload(seq_len=exercises_scale.SEQ_LEN, global_batch_size=exercises_scale.GLOBAL_BATCH,
                        recompute=answer["recompute"], sequence_parallel=answer["sequence_parallel"])
    chosen = plan(exercises_scale.CONFIG, num_gpus=exercises_scale.NUM_GPUS, gpu=exercises_scale.GPU,
                  gpus_per_node=exercises_scale.GPUS_PER_NODE, workload=workload)
    picked = {**answer, "dp": chosen.mesh.dp, "tp": chosen.mesh.tp, "pp": chosen.mesh.pp,
              "zero_stage": chosen.zero_stage}
    mesh, m, memory, time = exercises_scale.judge(picked)
    assert (chosen.mesh, chosen.num_microbatches) == (mesh, m)
    assert chosen.memory == memory and chosen.time == time
    assert time.mfu >= exercises_scale.TARGET_MFU
    assert exercises_scale.judge(answer)[3].mfu >= exercises_scale.TARGET_MFU


# ---- 09 · check_own_job: a torchtitan file that does not fit -------------------------------------------

@pytest.mark.parametrize("change, words", [
    ({}, ["✗ still does not fit: stage 0's GPUs need 217.5 GiB", "activations 192.5 GiB"]),
    ({"local_batch_size = 4": "local_batch_size = 1"}, ["✗ 65,536 tokens a step, fewer than the 262,144"]),
    ({'flavor = "8B"': 'flavor = "70B"'}, ["✗ keep the model (llama3 8B)"]),
    ({"seq_len = 8192": "seq_len = 8192\nglobal_batch_size = 30"}, ["✗ the reader refuses it:", "global_batch_size = 30"]),
], ids=["unchanged", "fewer-tokens", "other-model", "refused"])
def test_check_own_job_wrong(capsys, change, words):
    text = exercises_scale.OWN_JOB
    for old, new in change.items():
        text = text.replace(old, new)
    verdict(capsys, exercises.check_own_job(lambda: text), False, *words)


def test_check_own_job_takes_a_string(capsys):
    def my_config():
        return {"local_batch_size": 1}
    verdict(capsys, exercises.check_own_job(my_config), False, "✗ my_config() returned a dict; return the TOML file")
