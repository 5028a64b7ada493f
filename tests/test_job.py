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


def test_the_command_line_flags_are_the_fields_names():
    text = virtual._parser().format_help()
    for name in ("zero_stage", "recompute", "schedule", "num_chunks", "micro_batch_size", "num_microbatches",
                 "sequence_parallel", "vocab_parallel", "reshard_after_forward", "dtype"):
        assert f"--{name.replace('_', '-')}" in text and name in {f.name for f in dataclasses.fields(Job)}, name


def test_fsdp_without_resharding_halves_the_gathers_in_every_formula():
    """reshard_after_forward=False, one field: the virtual cluster's bytes, per_rank's and the step time follow."""
    resharding = Job(TINY, Mesh(dp=2), seq_len=16, num_microbatches=2, zero_stage=3, gpu="A100 80GB")
    keeping = resharding.replace(reshard_after_forward=False)
    gathers = [per_rank.data_parallel_bytes_per_step(job, 0)["all_gather"] for job in (resharding, keeping)]
    assert gathers[0] == 2 * gathers[1]
    assert per_rank.transient_bytes_per_rank(keeping, 0) > per_rank.transient_bytes_per_rank(resharding, 0) > 0
    assert cost.step_time(keeping).dp_comm_s < cost.step_time(resharding).dp_comm_s
    measured = virtual.run_rank(keeping, 1)
    assert measured["sent_bytes"]["dp"] == measured["formulas"]["sent_bytes"]["dp"]


@pytest.mark.parametrize("changes, rule", [
    (dict(zero_stage=5), "zero_stage=5: one of None (NaiveDDP), 0, 1, 2, 3"),
    (dict(recompute="all"), "recompute='all': one of none, selective, full"),
    (dict(mesh=Mesh(tp=3)), "3"),
    (dict(num_microbatches=2**40), "num_microbatches=1099511627776 must be a whole number from 1 to 1,048,576"),
    (dict(convention="fp32", dtype="bf16"), "convention='fp32' keeps 4-byte weights, dtype='bf16' has 2"),
    (dict(gpu="H300"), "H300"),
])
def test_a_broken_rule_names_the_value(changes, rule):
    with pytest.raises(ValueError, match=None) as refused:
        Job(TINY).replace(**changes).check()
    assert rule in str(refused.value)
