"""course_lib.job: one description of a training job. A new option is one field of Job: it reaches parallelize,
per_rank, the step-time model and the virtual cluster's command line with no signature in between changed."""

import dataclasses

import pytest

from course_lib import cost, per_rank, virtual
from course_lib.job import Job
from course_lib.mesh import Mesh, make_comms
from course_lib.model import build, preset
from course_lib.parallelize import parallelize

TINY = preset("tiny")


@dataclasses.dataclass(frozen=True)
class FancyJob(Job):
    """A job with a made-up on/off option, as a contributor would add one: a field, and nothing else."""
    fancy: bool = False


def test_a_new_option_reaches_every_part_through_the_job(monkeypatch, capsys):
    seen = []

    def spy(module, name):
        original = getattr(module, name)

        def wrapper(job, *args, **kwargs):
            seen.append((name, job.fancy))
            return original(job, *args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    job = FancyJob(TINY, Mesh(dp=2, pp=2), seq_len=16, num_microbatches=2, zero_stage=1, fancy=True,
                   gpu="A100 80GB")
    spy(per_rank, "data_parallel_traffic")            # under sent_bytes_per_rank and step_time
    per_rank.sent_bytes_per_rank(job, 0)
    cost.step_time(job)
    with virtual.fake_world(job.mesh.size, 1):
        parallel = parallelize(build(TINY, device="meta"), job, make_comms(job.mesh, 1), 1)
    assert parallel.job.fancy
    # the command line offers every on/off field of the job, under its own name with dashes
    monkeypatch.setattr(virtual, "Job", FancyJob)
    monkeypatch.setattr(virtual, "parallelize", lambda model, job, *a, **k: seen.append(("cli", job.fancy))
                        or parallelize(model, job, *a, **k))
    assert virtual.main(["--preset", "tiny", "--dp", "2", "--seq-len", "16", "--fancy", "--json"]) == 0
    assert "--fancy" in virtual._parser().format_help()
    assert ("data_parallel_traffic", True) in seen and ("cli", True) in seen, seen


def test_a_new_option_reaches_the_planner_through_its_workload(monkeypatch):
    """The planner costs every layout from the workload's template job: the made-up field rides along."""
    from course_lib import recipes
    from course_lib.plan import plan
    from course_lib.recipes import Workload
    seen = set()
    original = recipes.step_time

    def spy(job, **kwargs):
        seen.add(job.fancy)
        return original(job, **kwargs)
    monkeypatch.setattr(recipes, "step_time", spy)
    template = FancyJob(TINY, seq_len=64, micro_batch_size=2, recompute="full", fancy=True)
    workload = Workload.from_job(template, global_batch_size=16)
    assert (workload.seq_len, workload.micro_batch_size, workload.recompute) == (64, 2, "full")
    chosen = plan(TINY, num_gpus=4, gpus_per_node=4, workload=workload)
    assert seen == {True} and chosen.fits and all(layout.job.fancy for layout in chosen.candidates)


def test_the_command_line_flags_are_the_fields_names():
    text = virtual._parser().format_help()
    for name in ("zero_stage", "recompute", "schedule", "num_chunks", "micro_batch_size", "num_microbatches",
                 "sequence_parallel", "vocab_parallel", "reshard_after_forward", "reshard_after_backward", "dtype"):
        assert f"--{name.replace('_', '-')}" in text and name in {f.name for f in dataclasses.fields(Job)}, name


def test_fsdp_without_resharding_halves_the_gathers_in_every_formula():
    """reshard_after_forward=False, one field: the virtual cluster's bytes, per_rank's and the step time follow."""
    resharding = Job(TINY, Mesh(dp=2), seq_len=16, num_microbatches=2, zero_stage=3, gpu="A100 80GB")
    keeping = resharding.replace(reshard_after_forward=False)
    gathers = [per_rank.data_parallel_bytes_per_step(job, 0)["all_gather"] for job in (resharding, keeping)]
    assert gathers[0] == 2 * gathers[1]
    held = [per_rank.transient_bytes_per_rank(job, 0)["weights"] for job in (keeping, resharding)]
    assert held[0] > held[1] > 0
    assert cost.step_time(keeping).dp_comm_s < cost.step_time(resharding).dp_comm_s
    measured = virtual.run_rank(keeping, 1)
    assert measured["sent_bytes"]["dp"] == measured["formulas"]["sent_bytes"]["dp"]


def test_fsdp_kept_across_micro_batches_gathers_and_reduces_once_a_step():
    """reshard_after_backward=False too (torch's pipelining with FSDP): one all-gather and one reduce-scatter a step
    whatever m, in per_rank, the step time's collectives and a pipelined virtual run; the stage's weights and
    gradients held whole while it steps."""
    resharding = Job(TINY, Mesh(dp=2, pp=2), seq_len=16, num_microbatches=4, zero_stage=3, gpu="A100 80GB")
    kept = resharding.replace(reshard_after_forward=False, reshard_after_backward=False)
    ops = [per_rank.data_parallel_bytes_per_step(job, 0) for job in (resharding, kept)]
    assert ops[0]["all_gather"] == 8 * ops[1]["all_gather"] and ops[0]["reduce_scatter"] == 4 * ops[1]["reduce_scatter"]
    held = per_rank.transient_bytes_per_rank(kept, 0)
    state = per_rank.data_parallel_state_bytes(kept, 0)
    assert held["weights"] == 2 * state["weights"] and held["grads"] == 2 * state["grads"]   # dp 2: whole = 2 shards
    assert cost.step_time(kept).dp_comm_s < cost.step_time(resharding).dp_comm_s
    for rank in (0, kept.mesh.rank_of(pp=1)):
        measured = virtual.run_rank(kept, rank)
        assert measured["sent_bytes"]["dp"] == measured["formulas"]["sent_bytes"]["dp"] > 0
    with pytest.raises(ValueError, match="reshard_after_backward=False with reshard_after_forward=True"):
        resharding.replace(reshard_after_backward=False).check()


@pytest.mark.parametrize("changes, rule", [
    (dict(zero_stage=5), "zero_stage=5: one of None (NaiveDDP), 0, 1, 2, 3"),
    (dict(recompute="all"), "recompute='all': one of none, selective, op, full"),
    (dict(recompute="op", mesh=Mesh(cp=2)), "recompute='op' with cp 2 and num_experts=0: the per-op policy counts"),
    (dict(mesh=Mesh(tp=3)), "3"),
    (dict(num_microbatches=2**40), "num_microbatches=1099511627776 must be a whole number from 1 to 1,048,576"),
    (dict(convention="fp32", dtype="bf16"), "convention='fp32' keeps 4-byte weights, dtype='bf16' has 2"),
    (dict(gpu="H300"), "H300"),
    (dict(zero_stage=3.0), "zero_stage=3.0: one of None (NaiveDDP), 0, 1, 2, 3"),
    (dict(sequence_parallel="no"), "sequence_parallel='no' must be True or False"),    # a true string
    (dict(reshard_after_forward=0), "reshard_after_forward=0 must be True or False"),
])
def test_a_broken_rule_names_the_value(changes, rule):
    with pytest.raises(ValueError, match=None) as refused:
        Job(TINY).replace(**changes).check()
    assert rule in str(refused.value)


def test_a_pipeline_too_long_to_lay_out_is_refused_at_once_not_built():
    """pp × m × v forwards is what checking the schedule walks: beyond job.LIMIT it is a typo, refused by name in
    well under a second (built, 8 × 2²⁰ would take minutes)."""
    import time

    from course_lib.job import LIMIT
    start = time.perf_counter()
    problems = Job(preset("tiny", num_layers=8), Mesh(pp=8), num_microbatches=LIMIT).problems()
    assert time.perf_counter() - start < 1.0
    assert problems == [f"pp 8 × num_microbatches {LIMIT} × num_chunks 1 = {8 * LIMIT:,} forwards through the "
                        f"pipeline's stages: more than the course lays out ({LIMIT:,}), a typo rather than a run"]


def test_interleaving_on_one_stage_names_the_rule_it_breaks():
    problems = Job(preset("tiny"), schedule="interleaved", num_chunks=2, num_microbatches=4).problems()
    assert any("interleaved 1F1B needs num_stages=1 >= 2" in problem for problem in problems), problems


@pytest.mark.parametrize("stage", [-1, 2, True, 0.0])
def test_a_stage_outside_the_pipeline_is_refused_by_every_per_rank_count(stage):
    job = Job(preset("tiny"), Mesh(dp=2, pp=2), num_microbatches=2, zero_stage=1)
    for count in (per_rank.data_parallel_state_bytes, per_rank.activation_bytes_per_rank,
                  per_rank.sent_bytes_per_rank):
        with pytest.raises(ValueError, match=rf"stage={stage!r}: a pipeline stage is a whole number from 0 to pp - 1"):
            count(job, stage)


def test_a_capacity_that_drops_tokens_counts_only_the_experts_work_it_keeps():
    """Below capacity 1 the experts compute that share of the tokens: MFU counts what the model computes (counting
    the dropped ones too gave 1.23 at a quarter). The expert kernels shrink as the FLOPs do: the share stays put."""
    job = Job(preset("mixtral-8x7b"), Mesh(dp=8, ep=8), data_parallel=False, zero_stage=1, gpu="H100 SXM",
              seq_len=4096, num_microbatches=4, capacity_factor=1.0)
    full, terms = cost.step_time(job), cost.forward_terms(job.config, batch_size=1, seq_len=4096)
    for factor in (0.5, 0.25, 1e-9):
        dropped = cost.step_time(job.replace(capacity_factor=factor))
        kept = cost.forward_terms(job.config, batch_size=1, seq_len=4096, capacity_factor=factor)
        assert kept["mlp"] == int(factor * terms["mlp"]) and dropped.mfu < full.mfu < 1
        assert dropped.achieved_share < 1


def test_the_planner_offers_only_layouts_the_job_allows():
    """A sequence TP cannot split (4,095 tokens with sequence parallelism) rules out TP layouts, not the plan."""
    from course_lib.plan import plan
    from course_lib.recipes import Workload
    answer = plan(preset("llama2-7b"), num_gpus=8, workload=Workload(seq_len=4095, sequence_parallel=True,
                                                                      global_batch_size=64))
    assert answer.fits and all(candidate.mesh.tp == 1 for candidate in answer.candidates)
