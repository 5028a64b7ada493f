"""A layout of GPUs for a training run, and what it costs: the memory its busiest GPU holds, its step time.

A layout is a mesh (dp × tp × pp), a ZeRO stage over dp and the number of micro-batches the workload gives it.
Its busiest GPU holds

    state (per_rank.data_parallel_state_bytes, and per_rank.transient_bytes_per_rank: what ZeRO-2/3 hold only
    while a step runs, ZeRO-3's gathered unit and a unit's whole gradients)
  + activations (per_rank.activation_bytes_per_rank: 1F1B keeps p - s micro-batches in flight on stage s;
    interleaved over v chunks, stage 0 holds 1 + (p - 1)/(p·v) times as much)
  + a reserve (RESERVE_SHARE of the card: the caching allocator's fragmentation, NCCL's buffers, cuBLAS
    workspaces, temporaries such as a gathered layer's output)

and its step takes cost.step_time. The global batch ties the axes: m = B / (dp · b) micro-batches per step,
so more dp means fewer micro-batches and a bigger bubble. ``compare_recipes`` costs every layout of five
recipes and keeps the best of each; ``plan`` (course_lib/plan.py) asks its questions with them:

    data parallel       DDP, ZeRO-1 or ZeRO-2 over every GPU
    ZeRO-3 / FSDP       weights sharded too, over every GPU
    FSDP + TP           TP inside the node, ZeRO-3 over the rest
    TP + PP + ZeRO-1    Megatron-LM's: TP inside the node, a pipeline (1F1B, or interleaved over v = 2 chunks when
                        that is faster and fits), ZeRO-1 over dp
    TP + PP + FSDP      Llama 3's and torchtitan's: the same cuts with ZeRO-3 over dp, run as torch's pipelining
                        runs FSDP: no resharding between micro-batches (reshard_after_forward and
                        reshard_after_backward False; torchtitan: reshard_after_forward = not pp_enabled), so each
                        stage gathers its weights once and reduce-scatters its gradients once a step, for holding
                        them whole for the step (course_lib.zero_bytes). Where that does not fit, the course's
                        resharding ZeRO-3 (RESHARDING_FSDP: 2m all-gathers and m reduce-scatters a step, one unit
                        gathered at a time), printed as "resharding every micro-batch".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cost import StepTime, step_time
from .job import Job
from .ledger import CONVENTIONS, RECOMPUTE
from .mesh import Mesh
from .per_rank import activation_bytes_per_rank, data_parallel_state_bytes, layer_params, transient_bytes_per_rank
from .published import FSDP_OVERLAP
from .runtime.arguments import check_whole
from .tensor_parallel import check_tp_divisible
from .units import GiB, MiB

RESERVE_SHARE = 0.10   # of each GPU's memory, kept free for what no formula here counts (question 4)
RECIPES = ("data parallel", "ZeRO-3 / FSDP", "FSDP + TP", "TP + PP + ZeRO-1", "TP + PP + FSDP")
PIPELINED_FSDP = {"reshard_after_forward": False, "reshard_after_backward": False}   # torch's pipelining
RESHARDING_FSDP = {"reshard_after_forward": True, "reshard_after_backward": True}    # the course's ZeRO-3


@dataclass(frozen=True)
class Workload:
    """What one training step processes: ``global_batch_size`` sequences of ``seq_len`` tokens (None: the
    model's max_seq_len), in micro-batches of ``micro_batch_size`` per data-parallel rank. 1,024 sequences of
    4,096 tokens is Llama 2's 4M-token batch. ``template``: a Job whose other options every layout carries (a new
    Job field too); Workload.from_job(job) takes a job's batch and options at once."""
    seq_len: int | None = None
    micro_batch_size: int = 1
    global_batch_size: int = 1024
    recompute: str = "selective"
    sequence_parallel: bool = False
    vocab_parallel: bool = False      # embedding, head and loss split over TP (course_lib.vocab_parallel)
    fused_norm: bool = True           # False: RMSNorm as F.rms_norm on the CPU saves it (fp32 copies)
    template: Job | None = None       # the job the layouts start from (the planner sets the fields job() names)

    @classmethod
    def from_job(cls, job: Job, global_batch_size: int | None = None) -> Workload:
        """``job``'s sequences, micro-batch size, recomputation and splits, and every other field it sets, as the
        workload to plan for (global batch: ``global_batch_size``, or the job's own, dp·m·b)."""
        return cls(seq_len=job.tokens_per_sequence, micro_batch_size=job.micro_batch_size,
                   global_batch_size=global_batch_size or job.global_batch_size, recompute=job.recompute,
                   sequence_parallel=job.sequence_parallel, vocab_parallel=job.vocab_parallel,
                   fused_norm=job.fused_norm, template=job)

    def __post_init__(self):
        check_whole("micro_batch_size", self.micro_batch_size)
        check_whole("global_batch_size", self.global_batch_size)
        if self.seq_len is not None:
            check_whole("seq_len", self.seq_len)
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}: choose one of {', '.join(RECOMPUTE)}")
        if self.global_batch_size < self.micro_batch_size:
            raise ValueError(f"micro_batch_size={self.micro_batch_size} must be >= 1 and <= global_batch_size="
                             f"{self.global_batch_size}")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not a multiple of micro_batch_size="
                             f"{self.micro_batch_size}: a step is dp × m micro-batches of {self.micro_batch_size}")

    def assumptions(self) -> str:
        """What the memory counted for this workload assumes, in words (the planner prints it)."""
        return (f"{self.recompute} recomputation, sequence parallelism {'on' if self.sequence_parallel else 'off'}, "
                f"vocabulary {'split over TP' if self.vocab_parallel else 'whole on every TP rank'}, "
                + ("fused-kernel RMSNorm (its input and an fp32 rstd per token)" if self.fused_norm else
                   "RMSNorm as F.rms_norm on the CPU (fp32 copies of its input and of x·rstd)"))

    def job(self, config, mesh: Mesh, zero_stage: int, *, convention: str = "mixed", num_chunks: int = 1,
            gpu: str | None = None, gpus_per_node: int = 8, **options) -> Job:
        """This workload on ``mesh`` as one Job (m = B / (dp · b), which must be whole: num_microbatches), with the
        convention's dtype (16-bit weights: bf16) and 1F1B, or interleaved 1F1B over ``num_chunks`` v > 1, from
        the template's other fields; ``options``: more Job fields (a recipe's, e.g. PIPELINED_FSDP)."""
        m = self.num_microbatches(mesh.dp)
        if m is None:
            raise ValueError(f"global_batch_size={self.global_batch_size} does not split into micro-batches of "
                             f"{self.micro_batch_size} over dp {mesh.dp}")
        dtype = dtype_of(convention)
        base = Job(config) if self.template is None else self.template.replace(config=config)
        return base.replace(mesh=mesh, seq_len=self.seq_len or config.max_seq_len,
                            micro_batch_size=self.micro_batch_size, num_microbatches=m, zero_stage=zero_stage,
                            sequence_parallel=self.sequence_parallel, vocab_parallel=self.vocab_parallel,
                            recompute=self.recompute, num_chunks=num_chunks,
                            schedule="interleaved" if num_chunks > 1 else "1f1b", dtype=dtype, convention=convention,
                            fused_norm=self.fused_norm, gpu=gpu, gpus_per_node=gpus_per_node, **options)

    def num_microbatches(self, dp: int) -> int | None:
        """m = B / (dp · b), or None if the global batch does not split into whole micro-batches."""
        m, rest = divmod(self.global_batch_size, dp * self.micro_batch_size)
        return m if m >= 1 and rest == 0 else None


@dataclass
class Layout:
    """One candidate layout of a recipe, with what its busiest GPU holds and how long a step takes."""
    recipe: str
    mesh: Mesh
    zero_stage: int
    num_microbatches: int
    memory: dict[str, int]    # the busiest GPU: state, activations, reserve, total
    gpu_bytes: int
    time: StepTime
    num_chunks: int = 1       # v > 1: interleaved 1F1B over v chunks of layers per GPU
    job: Job | None = None    # the whole job this layout costs (run it: virtual.run_rank(layout.job, rank))

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.gpu_bytes

    def __str__(self) -> str:
        m, mem = self.mesh, self.memory
        zero = "no dp" if m.dp == 1 else stage_name(self.zero_stage)
        recipe = self.recipe + (" (no pipeline)" if self.recipe == "TP + PP + ZeRO-1" and m.pp == 1 else "")
        if self.recipe == "TP + PP + FSDP" and self.job is not None and self.job.reshard_after_backward:
            recipe += " (resharding every micro-batch)"
        chunks = f" (interleaved, v = {self.num_chunks})" if self.num_chunks > 1 else ""
        return (f"{recipe}: dp {m.dp} × tp {m.tp} × pp {m.pp}{chunks}, {zero}, m = {self.num_microbatches}: "
                f"{size_text(mem['total'])} of {size_text(self.gpu_bytes)} (state {size_text(mem['state'])} + activations "
                f"{size_text(mem['activations'])} + reserve {size_text(mem['reserve'])}), "
                f"{self.time.tokens_per_s:,.0f} tokens/s, MFU {share_text(self.time.mfu)}")


def size_text(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= 0.1 * GiB else f"{nbytes / MiB:.1f} MiB"


def share_text(share: float) -> str:
    """A share as a percentage a reader can tell from zero: "58%", or "0.031%" for a launch-bound toy."""
    return f"{share:.0%}" if share >= 0.01 else f"{100 * share:.2g}%"


def seconds_text(seconds: float) -> str:
    return next(f"{seconds * scale:.3g} {unit}" for scale, unit in ((1, "s"), (1e3, "ms"), (1e6, "µs"))
                if seconds * scale >= 1 or unit == "µs")


def stage_name(stage: int) -> str:
    return "DDP" if stage == 0 else f"ZeRO-{stage}"


def tp_splits_heads(config, tp: int) -> bool:
    try:
        check_tp_divisible(config, tp)
        return True
    except ValueError:
        return False


def dtype_of(convention: str) -> str:
    """The weights' dtype a state convention (ledger.CONVENTIONS) stands for: 16-bit weights are bf16."""
    return "bf16" if CONVENTIONS[convention].weight_bytes == 2 else "fp32"


def state_per_gpu(config, mesh: Mesh, stage: int, convention: str = "mixed",
                  pp_stage: int | None = None, vocab_parallel: bool = False, num_chunks: int = 1) -> dict[str, int]:
    """Training state on the fullest GPU of ``mesh`` (or on a GPU of pipeline stage ``pp_stage``) with
    ZeRO-``stage`` over the ranks that hold the same weights: {"weights", "grads", "optimizer", "total"}
    (per_rank.data_parallel_state_bytes)."""
    stages = range(mesh.pp) if pp_stage is None else [pp_stage]
    job = Job(config, mesh, zero_stage=stage, convention=convention, dtype=dtype_of(convention),
              vocab_parallel=vocab_parallel, num_chunks=num_chunks)
    return max((data_parallel_state_bytes(job, s) for s in stages), key=lambda state: state["total"])


def gathered_layer_bytes(config, tp: int = 1, convention: str = "mixed") -> int:
    """What ZeRO-3 gathers to compute one layer: its weights and gradients, whole (or this rank's TP slice)."""
    per_param = CONVENTIONS[convention]
    return (per_param.weight_bytes + per_param.grad_bytes) * layer_params(config, tp)


def need_per_gpu(config, mesh: Mesh, stage: int, convention: str = "mixed") -> int:
    """The fullest GPU's training state, with what ZeRO-2/3 hold while a step runs (ZeRO-3: a unit gathered whole
    beside the shards, and its whole gradients: per_rank.transient_bytes_per_rank)."""
    job = Job(config, mesh, zero_stage=stage, convention=convention, dtype=dtype_of(convention))
    return max(data_parallel_state_bytes(job, s)["total"] + transient_bytes_per_rank(job, s)["total"]
               for s in range(mesh.pp))


def memory_per_gpu(config, mesh: Mesh, zero_stage: int, workload: Workload, *, gpu_bytes: int,
                   convention: str = "mixed", reserve_share: float = RESERVE_SHARE, num_chunks: int = 1,
                   **options) -> dict[str, int]:
    """Question 4 for one layout: {"state", "activations", "reserve", "total"} bytes on its busiest GPU of the
    job ``workload.job`` makes (``options``: more Job fields, as a recipe's).

    state: per_rank.data_parallel_state_bytes of the GPU's stage and per_rank.transient_bytes_per_rank (ZeRO-3: a
    unit gathered beside the shards; without resharding, the stage's weights and gradients whole); activations:
    per_rank.activation_bytes_per_rank's peak for that stage under 1F1B (interleaved 1F1B over ``num_chunks``
    v > 1), in the convention's 16- or 32-bit dtype;
    reserve: ``reserve_share`` of the card. The busiest GPU is the stage with the largest sum (stage 0 holds the
    most micro-batches, the last stage the head)."""
    job = workload.job(config, mesh, zero_stage, convention=convention, num_chunks=num_chunks, **options)
    stages = [{"state": data_parallel_state_bytes(job, stage)["total"] + transient_bytes_per_rank(job, stage)["total"],
               "activations": activation_bytes_per_rank(job, stage)["peak"]} for stage in range(mesh.pp)]
    busiest = max(stages, key=lambda parts: parts["state"] + parts["activations"])
    reserve = int(reserve_share * gpu_bytes)
    return {**busiest, "reserve": reserve, "total": busiest["state"] + busiest["activations"] + reserve}


def memory_parts(job: Job, memory: dict[str, int]) -> dict[str, int]:
    """``memory`` (memory_per_gpu of ``job``) part by part, as plots.memory_bars draws it: the state of the stage
    it counted as weights, grads and optimizer state, what ZeRO-2/3 hold only while stepping (gathered weights,
    whole gradients) added to the weights and grads, then the activations and the reserve."""
    for stage in range(job.mesh.pp):
        state, held = data_parallel_state_bytes(job, stage), transient_bytes_per_rank(job, stage)
        if state["total"] + held["total"] == memory["state"]:
            return {"weights": state["weights"] + held["weights"], "grads": state["grads"] + held["grads"],
                    "optimizer": state["optimizer"], "activations": memory["activations"], "reserve": memory["reserve"]}
    raise ValueError(f"no stage of {job.mesh} holds {memory['state']} bytes of state: memory is not this job's")


def _divisors(n: int) -> list[int]:
    """Every divisor of n, ascending, in √n steps (a typo of 2**40 GPUs answers in a second, not never)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def candidate_layouts(config, num_gpus: int, node: int):
    """(recipe, mesh, ZeRO stages to try, lowest first) for every grid the five recipes allow: TP degrees that
    divide the node and the heads, pipelines no deeper than the layers.
    Megatron-style TP + PP + ZeRO-1 includes pp = 1 (TP and ZeRO-1 alone), which Layout prints as "(no pipeline)"."""
    for tp in [t for t in _divisors(node) if tp_splits_heads(config, t)]:
        for pp in [p for p in _divisors(num_gpus // tp) if p <= config.num_layers]:
            mesh = Mesh(dp=num_gpus // (tp * pp), tp=tp, pp=pp)
            if tp == pp == 1:
                yield "data parallel", mesh, (0, 1, 2)
                yield "ZeRO-3 / FSDP", mesh, (3,)
                continue
            if pp == 1:
                yield "FSDP + TP", mesh, (3,)
            yield "TP + PP + ZeRO-1", mesh, (1,)
            if pp > 1 and mesh.dp > 1:         # (with dp 1 there is nothing to shard: it is the recipe above)
                yield "TP + PP + FSDP", mesh, (3,)


def resharding_choices(mesh: Mesh, zero_stage: int) -> list[dict[str, bool]]:
    """The Job options to try, least traffic first: ZeRO-3 beside a pipeline as torch's pipelining runs it
    (PIPELINED_FSDP), then the course's resharding ZeRO-3; nothing to choose otherwise."""
    return [PIPELINED_FSDP, RESHARDING_FSDP] if zero_stage == 3 and mesh.pp > 1 and mesh.dp > 1 else [{}]


def cost_layout(recipe: str, config, mesh: Mesh, zero_stage: int, workload: Workload, *, gpu_bytes: int,
                num_chunks: int = 1, gpu="A100 80GB", gpus_per_node: int = 8, convention: str = "mixed",
                reserve_share: float = RESERVE_SHARE, dp_overlap: float | None = None, **assumptions) -> Layout:
    """One layout, its busiest GPU's memory (memory_per_gpu) and its step time (cost.step_time, ``dp_overlap`` of
    the DP traffic hidden; None: framework_overlap's; ``assumptions``, step_time's others, as a framework's file
    sets them: elementwise_ops, rotary, overlap_param_gather), with the first of resharding_choices that fits (the
    last if none does)."""
    dp_overlap = framework_overlap(zero_stage) if dp_overlap is None else dp_overlap
    for options in resharding_choices(mesh, zero_stage):
        memory = memory_per_gpu(config, mesh, zero_stage, workload, gpu_bytes=gpu_bytes, convention=convention,
                                reserve_share=reserve_share, num_chunks=num_chunks, **options)
        job = workload.job(config, mesh, zero_stage, convention=convention, num_chunks=num_chunks, gpu=gpu,
                           gpus_per_node=gpus_per_node, **options)
        layout = Layout(recipe, mesh, zero_stage, job.num_microbatches, memory, gpu_bytes,
                        step_time(job, dp_overlap=dp_overlap, **assumptions), num_chunks, job)
        if layout.fits:
            break
    return layout


DDP_OVERLAP = 0.5    # gradient buckets reduced during backward: half hidden (notebook 02 measures it live)


def framework_overlap(zero_stage: int) -> float:
    """The share of the DP traffic hidden behind compute as the frameworks schedule it: ZeRO-3's (FSDP's) gathers
    and reduce-scatters as the published FSDP runs fit (published.FSDP_OVERLAP: half); DDP's and ZeRO-1/2's
    gradient buckets half hidden behind backward (DDP_OVERLAP, an assumption). Both a half, from different
    evidence. The planner's recipes reduce the gradients their convention keeps (16-bit under "mixed"); frameworks
    that reduce them in fp32 (torchtitan's FSDP2, Composer's "DEFAULT") send a third more on FSDP, which their
    readers and the published rows count (cost.step_time's grad_reduce_bytes)."""
    return FSDP_OVERLAP if zero_stage == 3 else DDP_OVERLAP


def chunk_choices(config, mesh: Mesh, num_microbatches: int) -> tuple[int, ...]:
    """How many chunks a pipeline may take per GPU: 1 (1F1B), and 2 (interleaved) when every one of the p·2
    virtual stages gets a layer and m is a multiple of p (Megatron-LM's rule, schedules.interleaved_actions)."""
    p = mesh.pp
    interleaves = p > 1 and config.num_layers >= 2 * p and num_microbatches % p == 0
    return (1, 2) if interleaves else (1,)


def compare_recipes(config, *, num_gpus: int, gpu_bytes: int, workload: Workload, gpu="A100 80GB",
                    gpus_per_node: int = 8, convention: str = "mixed", reserve_share: float = RESERVE_SHARE,
                    dp_overlap: float | None = None, **assumptions) -> list[Layout]:
    """Question 5: the best layout of each recipe, fastest first: the fastest that fits, or, where none fits,
    the one that needs the least memory. Step time is cost.step_time on ``gpu``'s speed and links, with
    ``dp_overlap`` of the data-parallel traffic hidden behind compute (None: as each layout's framework schedules
    it, framework_overlap; how much depends on the network too: an assumption, stated) and its memory-bound ops
    fused, or as ``assumptions`` say (step_time's others, as a framework's file sets them: cost_layout)."""
    node = min(gpus_per_node, num_gpus)
    best: dict[str, Layout] = {}
    for recipe, mesh, stages in candidate_layouts(config, num_gpus, node):
        m = workload.num_microbatches(mesh.dp)
        if m is None:
            continue                         # the global batch does not split over this many replicas
        for num_chunks in chunk_choices(config, mesh, m):
            layout = None
            for stage in stages:
                if workload.job(config, mesh, stage, convention=convention, num_chunks=num_chunks).problems():
                    continue                 # one the job's own rules refuse (a sequence TP does not split): not offered
                layout = cost_layout(recipe, config, mesh, stage, workload, gpu_bytes=gpu_bytes, num_chunks=num_chunks,
                                     gpu=gpu, gpus_per_node=gpus_per_node, convention=convention,
                                     reserve_share=reserve_share, dp_overlap=dp_overlap, **assumptions)
                if layout.fits:
                    break                    # the lowest ZeRO stage that fits: least traffic
            if layout is None:
                continue
            old = best.get(recipe)
            if old is None or (layout.fits, layout.time.tokens_per_s if layout.fits else -layout.memory["total"]) > (
                    old.fits, old.time.tokens_per_s if old.fits else -old.memory["total"]):
                best[recipe] = layout
    return sorted(best.values(), key=lambda c: (not c.fits, -c.time.tokens_per_s))
