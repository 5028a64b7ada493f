"""course_lib.presentation.incidents: each incident, run live on 2 ranks, shows its symptom with the bug (a hang
named within seconds, replicas that disagree, weights more than 1e-3 from the one-process float64 reference), and
with the fix equals that reference to 1e-12."""

import statistics
import time

import pytest

from course_lib import launch
from course_lib.presentation import incidents
from course_lib.presentation.incidents import hangs, numerics, replicas
from course_lib.runtime.launch import RankError, RankTimeout

pytestmark = pytest.mark.ranks


@pytest.fixture(scope="module")
def reference():
    return incidents.flat(incidents.reference())


def test_uneven_shards_hang_names_where_each_rank_waits_and_the_fix_matches_the_reference(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankTimeout) as hang:
        launch(incidents.uneven_shards, 2, timeout=5, flight_records=str(tmp_path))
    assert time.monotonic() - start < 30
    said = str(hang.value)
    rank0, rank1 = said.split("where rank 1 was")
    assert "in all_reduce" in rank0 and "in barrier" in rank1, said       # rank 0 waits a step ahead of rank 1
    # the flight recorders, dumped while both ranks waited: torch's analyzer finds the mismatched collective
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rank0", "rank1"]
    report = hangs.analyze_flight_records(str(tmp_path))
    assert "COLLECTIVE_TYPE_MISMATCH" in report and "'barrier'" in report and "'all_reduce'" in report, report
    fixed = launch(incidents.uneven_shards, 2, fixed=True)
    assert [result["steps"] for result in fixed] == [2, 2]
    expected = incidents.flat(incidents.reference(2))
    assert max(incidents.gap(result["weights"], expected) for result in fixed) < 1e-12


def test_uneven_shards_under_detail_debug_is_a_mismatch_error_at_once():
    start = time.monotonic()
    with pytest.raises(RankError, match="Detected mismatch between collectives"):
        launch(incidents.uneven_shards, 2, timeout=20, debug=True)
    assert time.monotonic() - start < 10                  # no waiting for the timeout
    fixed = launch(incidents.uneven_shards, 2, fixed=True, debug=True)
    assert incidents.gap(fixed[0]["weights"], incidents.flat(incidents.reference(2))) < 1e-12


def test_unsynced_init_replicas_disagree_until_rank_0_s_weights_are_broadcast(reference):
    buggy = launch(incidents.unsynced_init, 2)
    sums = buggy[0]["checksums"]
    assert abs(sums[0] - sums[1]) > 1e-3 and incidents.gap(buggy[1]["weights"], reference) > 1e-3
    fixed = launch(incidents.unsynced_init, 2, fixed=True)
    assert fixed[0]["checksums"][0] == fixed[0]["checksums"][1]
    assert max(incidents.gap(result["weights"], reference) for result in fixed) < 1e-12


def test_same_batch_replicas_agree_yet_drift_from_the_reference(reference):
    buggy = launch(incidents.same_batch, 2)
    assert buggy[0]["checksums"][0] == buggy[0]["checksums"][1]          # the checksums cannot see this one
    assert incidents.gap(buggy[0]["weights"], reference) > 1e-3
    fixed = launch(incidents.same_batch, 2, fixed=True)
    assert max(incidents.gap(result["weights"], reference) for result in fixed) < 1e-12


def test_token_mean_accumulation_differs_from_the_big_batch_step_until_tokens_are_counted_globally():
    expected = numerics.token_mean_reference()
    assert incidents.gap(launch(numerics.token_mean, 2)[0]["weights"], expected) > 1e-3
    fixed = launch(numerics.token_mean, 2, fixed=True)
    assert max(incidents.gap(result["weights"], expected) for result in fixed) < 1e-12


def test_pad_leaves_rows_of_different_lengths():
    targets = numerics.pad(incidents.common.tiny()[2].batch(0, 8)[1], 0)
    lengths = (targets != numerics.IGNORE).sum(dim=1).tolist()
    assert len(set(lengths)) > 3 and min(lengths) >= 2


def test_tp_norm_counted_on_every_rank_clips_too_hard_until_each_element_counts_once():
    expected = numerics.tp_norm_reference()
    for fixed, low, high in ((False, 1e-3, float("inf")), (True, 0.0, 1e-12)):
        result = launch(numerics.tp_norm, 2, fixed=fixed)[0]
        norm_gap = max(abs(a - b) for a, b in zip(result["norms"], expected["norms"]))
        weight_gap = max(incidents.gap(weights, expected["weights"][name])
                         for name, weights in result["replicated"].items())
        assert low < norm_gap < high and low < weight_gap < high, (fixed, norm_gap, weight_gap)
    assert all(a > b for a, b in zip(launch(numerics.tp_norm, 2)[0]["norms"], expected["norms"]))   # too big


def test_tp_dropout_seeded_by_rank_splits_the_replicated_weights_until_the_tp_group_shares_a_seed():
    expected = replicas.tp_dropout_reference()

    def weight_gap(results):
        return max(incidents.gap(weights, expected[name]) for result in results
                   for name, weights in result["replicated"].items())

    buggy = launch(replicas.tp_dropout, 2)
    sums = buggy[0]["checksums"]
    assert abs(sums[0] - sums[1]) > 1e-3 and weight_gap(buggy) > 1e-3
    assert buggy[0]["losses"][1:] != buggy[1]["losses"][1:]       # one batch, two losses: two different networks
    fixed = launch(replicas.tp_dropout, 2, fixed=True)
    assert fixed[0]["checksums"][0] == fixed[0]["checksums"][1] and weight_gap(fixed) < 1e-12
    assert sorted(fixed[0]["replicated"]) == sorted(n for n in expected if "norm" in n or n in ("embed.weight",
                                                                                                 "head.weight"))


def test_fp16_without_loss_scaling_flushes_gradients_to_zero_and_grad_scaler_keeps_them():
    expected = numerics.fp16_reference()
    buggy = launch(numerics.fp16_loss_scale, 2)[0]
    assert numerics.flushed(buggy["gradient"].double(), expected["gradient"]) > 0.1
    assert buggy["losses"][-1] - expected["losses"][-1] > 0.1                   # it learns slower
    fixed = launch(numerics.fp16_loss_scale, 2, fixed=True)[0]
    gradient, truth = fixed["gradient"].double(), expected["gradient"]
    # fp16 cannot equal float64: the fixed gradient is checked to fp16's precision (its epsilon is 9.8e-4)
    assert numerics.flushed(gradient, truth) < 1e-3 and (gradient - truth).norm() / truth.norm() < 2e-3
    assert max(abs(a - b) for a, b in zip(fixed["losses"], expected["losses"])) < 0.05


def test_pipeline_sends_both_stages_wait_in_send_until_the_pairs_are_posted_together():
    with pytest.raises(RankTimeout) as hang:
        launch(hangs.pipeline_sends, 2, timeout=5)
    rank0, rank1 = str(hang.value).split("where rank 1 was")
    assert "in send" in rank0 and "in send" in rank1, str(hang.value)
    expected = {name: p.detach() for name, p in incidents.reference().named_parameters()}
    fixed = launch(hangs.pipeline_sends, 2, fixed=True)
    assert sorted(n for result in fixed for n in result["weights"]) == sorted(expected)   # the two stages: all
    assert max(incidents.gap(weights, expected[name]) for result in fixed
               for name, weights in result["weights"].items()) < 1e-12
    with pytest.raises(ValueError, match="world_size=3"):
        hangs.pipeline_sends(0, 3)


def test_straggler_every_rank_as_slow_as_it_and_the_straggler_waits_least(reference):
    delay = 0.2
    slow = launch(hangs.straggler, 2, delay_s=delay)
    waits = [statistics.median(result["wait_s"]) for result in slow]
    assert waits[0] - waits[1] > delay / 2, waits                  # rank 0 waits in the all-reduce for rank 1
    assert min(statistics.median(result["step_s"]) for result in slow) > delay
    fast = launch(hangs.straggler, 2, delay_s=delay, fixed=True)
    assert statistics.median(fast[0]["step_s"]) < statistics.median(slow[0]["step_s"]) - delay / 2
    assert max(incidents.gap(result["weights"], reference) for result in slow + fast) < 1e-12   # only slower


def test_zero_resume_with_rank_0_s_shard_everywhere_drifts_until_each_rank_loads_its_own(tmp_path):
    expected = incidents.flat(incidents.reference(momentum=replicas.MOMENTUM))
    (tmp_path / "bug").mkdir(), (tmp_path / "fix").mkdir()
    buggy = launch(replicas.zero_resume, 2, root=str(tmp_path / "bug"))
    assert incidents.gap(buggy[0]["weights"], expected) > 1e-3
    fixed = launch(replicas.zero_resume, 2, root=str(tmp_path / "fix"), fixed=True)
    assert max(incidents.gap(result["weights"], expected) for result in fixed) < 1e-12


def test_the_micro_batch_loss_checker_names_each_wrong_fix(capsys):
    from course_lib.presentation import exercises
    cross_entropy = numerics.F.cross_entropy

    def summed(logits, targets):
        return cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=numerics.IGNORE, reduction="sum")

    wrong = {"per-micro-batch mean": numerics.mean_per_micro_batch,
             "number of ranks": lambda logits, targets, *, real_tokens, world_size, accumulation:
                 summed(logits, targets) / real_tokens,
             "number of micro-batches": lambda logits, targets, *, real_tokens, world_size, accumulation:
                 summed(logits, targets) * world_size / real_tokens / accumulation}
    for words, answer in wrong.items():
        assert exercises.check_micro_batch_loss(answer) is False
        said = capsys.readouterr().out
        assert words in said and "✓" not in said, said
    assert exercises.check_micro_batch_loss(numerics.mean_over_the_batch) is True


def test_the_pipeline_swap_checker_reports_the_deadlock_with_a_hint_and_takes_either_fix(capsys):
    from course_lib.presentation import exercises

    def lower_rank_sends_first(comm, outgoing, incoming, peer):
        if comm.rank < peer:
            comm.send(outgoing, peer)
            comm.recv(incoming, peer)
        else:
            comm.recv(incoming, peer)
            comm.send(outgoing, peer)

    assert exercises.check_pipeline_swap(hangs.send_then_receive) is False
    said = capsys.readouterr().out
    assert "did not finish within 10 s" in said and "in send" in said and "Hint" in said, said
    for right in (hangs.posted_together, lower_rank_sends_first):
        assert exercises.check_pipeline_swap(right) is True


def test_the_step_count_checker_reports_the_hang_and_a_short_or_long_epoch(capsys, monkeypatch):
    from course_lib.presentation import exercises
    from course_lib.presentation.exercises import incidents as checkers
    monkeypatch.setattr(checkers, "HANG_SECONDS", 4.0)
    assert exercises.check_step_count(hangs.steps_from_my_rows) is False
    said = capsys.readouterr().out
    assert "did not finish within 4 s" in said and "in all_reduce" in said and "dataset_rows" in said, said

    def rounded_up(dataset_rows, my_rows, world_size, batch_size):
        return -(-dataset_rows // batch_size)
    assert exercises.check_step_count(rounded_up) is False
    said = capsys.readouterr().out
    assert "no hang, but 3 steps" in said and "short" in said, said
    assert exercises.check_step_count(hangs.steps_from_the_dataset) is True


def test_the_replica_sync_checker_tells_replicas_that_differ_from_equal_replicas_of_the_wrong_model(capsys):
    from course_lib.presentation import exercises

    def from_rank_1(model, comm):
        for param in model.parameters():
            comm.broadcast(param.detach(), src=1)

    def nothing(model, comm):
        pass

    for answer, words in ((nothing, "still differ"), (from_rank_1, "no one initialised")):
        assert exercises.check_replica_sync(answer) is False
        said = capsys.readouterr().out
        assert words in said and "✓" not in said, said


def test_the_rank_rows_checker_names_rows_read_twice_and_missed_before_any_rank_starts(capsys):
    from course_lib.presentation import exercises
    assert exercises.check_rank_rows(replicas.rows_as_written) is False
    said = capsys.readouterr().out
    assert "rank 0 takes [0, 1, 2, 3] and rank 1 takes [0, 1, 2, 3]; read twice: [0, 1, 2, 3]" in said, said
    assert "read by no rank: [4, 5, 6, 7]" in said
    assert exercises.check_rank_rows(lambda batch, rank, world_size: batch[rank::world_size]) is True


def test_the_resume_load_checker_refuses_rank_0_s_shard_everywhere(capsys):
    from course_lib.presentation import exercises
    assert exercises.check_resume_load(replicas.rank_0_s_state) is False
    said = capsys.readouterr().out
    assert "from the uninterrupted one" in said and "optimizer_file(folder, rank)" in said, said


def test_the_fp16_step_checker_names_a_missing_scale_and_a_missing_unscale(capsys):
    from course_lib.presentation import exercises

    def never_unscaled(loss, optimizer, scaler, sync):
        (loss * numerics.LOSS_SCALE).backward()
        sync()
        optimizer.step()

    def scaler_without_scale(loss, optimizer, scaler, sync):
        loss.backward()
        sync()
        scaler.step(optimizer)

    for answer, words in ((numerics.unscaled_step, "came out exactly 0"), (never_unscaled, "6.55e+04 times"),
                          (scaler_without_scale, "not on loss")):
        assert exercises.check_fp16_step(answer) is False
        said = capsys.readouterr().out
        assert words in said and "✓" not in said, said
