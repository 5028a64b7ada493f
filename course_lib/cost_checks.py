"""What cost.step_time refuses, checked before anything is priced.

* The job's own rules (Job.problems), save one: Llama 3's interleaved layout gives the embedding and the head a
  chunk each, so step_time costs up to L + 2 chunks where Job (and parallelize) count layers only. Job checks
  the schedule only once every other rule holds, so where that one rule is all it found, the schedule is
  checked here.
* A GPU named (hardware.GPUS, or a hardware.GPU of your own), and whole nodes: torchrun starts as many ranks on
  each node, so a world larger than a node fills whole ones.
* The assumptions by name: each in its list, shares (the overlaps) numbers in [0, 1] and not True or False,
  the flags True or False, and no fp64 (a GPU is priced at its 16-bit or fp32 rates: GPU.for_dtype).
"""

from __future__ import annotations

from .hardware import GPU, find_gpu
from .job import Job, _schedule_problem
from .runtime.arguments import is_number

PIPELINE_SENDS = ("blocking", "async")
CHECKPOINTS = ("non-reentrant", "reentrant")


def check_assumptions(*, checkpoint: str, pipeline_sends: str, grad_reduce_bytes: int | None,
                      scatter_gather: bool, overlap_param_gather: bool) -> None:
    """step_time's keywords that are names or flags: each one of its own."""
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"checkpoint={checkpoint!r}: one of {CHECKPOINTS} (how full recomputation reruns a layer)")
    if pipeline_sends not in PIPELINE_SENDS:
        raise ValueError(f"pipeline_sends={pipeline_sends!r}: one of {PIPELINE_SENDS} (cost.py's part 2)")
    if grad_reduce_bytes not in (None, 2, 4, 8):
        raise ValueError(f"grad_reduce_bytes={grad_reduce_bytes!r}: None (the job's gradients) or the bytes of a "
                         "16-, 32- or 64-bit float (2, 4, 8)")
    for flag, value in (("scatter_gather", scatter_gather), ("overlap_param_gather", overlap_param_gather)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag}={value!r}: True or False")


def check_costed(job: Job, compute_efficiency, **shares) -> GPU:
    """The job's own rules, a GPU to cost it on, and the shares in range. Returns the GPU."""
    if not isinstance(job, Job):
        raise TypeError(f"step_time takes a Job (course_lib.job.Job), not {type(job).__name__} {job!r:.40}")
    mesh, layers = job.mesh, job.config.num_layers
    chunks_rule = f"pp {mesh.pp} × num_chunks {job.num_chunks} = "
    problems = job.problems()
    found = [problem for problem in problems
             if not (problem.startswith(chunks_rule) and mesh.pp * job.num_chunks <= layers + 2)]
    if problems and not found:
        found = [p for p in [_schedule_problem(job.schedule, mesh.pp, job.num_microbatches, job.num_chunks)] if p]
    if mesh.pp * job.num_chunks > layers + 2:
        found.append(f"num_chunks={job.num_chunks}: pp {mesh.pp} × v chunks > {layers} layers + embedding + head")
    if found:
        raise ValueError("; ".join(found))
    if job.gpu is None:
        raise ValueError("job.gpu=None: a costed job names its GPU (hardware.GPUS), e.g. gpu='A100 80GB'")
    world, per_node = mesh.size, job.gpus_per_node
    if world > per_node and world % per_node:
        raise ValueError(f"a world of {world} GPUs on nodes of gpus_per_node={per_node} (--gpus-per-node): a costed "
                         "job fills whole nodes, as torchrun starts as many ranks on each, or runs inside one")

    def share(x):
        return is_number(x) and 0 <= x <= 1
    bad = [f"{name}={x!r}" for name, x in shares.items() if not share(x)]
    if compute_efficiency is not None and not (share(compute_efficiency) and compute_efficiency > 0):
        bad.append(f"compute_efficiency={compute_efficiency!r} (in (0, 1], or None)")
    if bad:
        raise ValueError(f"{', '.join(bad)}: shares are numbers in [0, 1], not True or False")
    if job.dtype == "fp64":
        raise ValueError("dtype='fp64': a GPU is priced at its 16-bit or fp32 rates (GPU.for_dtype), this machine "
                         "at its fp32 rates; fp64 is for the course's parity runs")
    gpu = find_gpu(job.gpu)
    if job.dtype == "fp32" and not (gpu.fp32_flops or gpu.matmul_grid):
        raise ValueError(f"dtype='fp32' on {gpu.name}, which has no fp32_flops: give its FP32 peak (the rate fp32 "
                         "matmuls run at without TF32), or its 16-bit peak would price them up to 15x too fast")
    return gpu
