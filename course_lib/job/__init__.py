"""One training job, described once: the model, the mesh, how to parallelize, the batch, the precision, the cluster.

Every part of the course that needs to know what a run is takes a ``Job``: ``parallelize`` (which pieces each
rank builds), course_lib.per_rank (what each rank holds and sends), ``cost.step_time`` (how long a step takes),
the planner's recipes, and the virtual cluster (``virtual.run_rank`` and its command line, whose flags are
these fields' names with dashes). Adding an option is one field here, its rule in ``problems``, and the code
that reads it: no signature in between changes.

The names are the ones a torchtitan or Megatron-LM user knows; where the other framework says it differently,
the field's comment says so once.

    Job(preset("llama2-70b"), Mesh(dp=4, tp=8, pp=4), seq_len=4096, num_microbatches=16, zero_stage=1,
        recompute="selective", sequence_parallel=True, gpu="H100 SXM")

``problems()`` lists every rule the job breaks, one line each naming the value and the rule; ``check()`` raises
them all in one ValueError. The rules run cheapest first, and nothing that grows with a value (the pipeline's
schedule) is built while a simpler rule is broken.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from ..ledger import CONVENTIONS, RECOMPUTE, ZERO_STAGES
from ..mesh import Mesh
from ..model import ModelConfig
from ..schedules import SCHEDULES, schedule_actions
from ..zero_bytes import check_resharding

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
LIMIT = 1 << 20     # the largest micro-batch count or size the course will lay out (a typo, not a run, beyond)


@functools.lru_cache(maxsize=256)
def _schedule_problem(schedule: str, pp: int, num_microbatches: int, num_chunks: int) -> str | None:
    """schedule_actions' own error for this pipeline, if any: built once per shape (the planner asks thousands)."""
    try:
        schedule_actions(schedule, pp, num_microbatches, num_chunks=num_chunks)
    except ValueError as error:
        return str(error)
    return None


@dataclass(frozen=True)
class Job:
    """A training run: what ``parallelize``, ``per_rank``, ``cost.step_time``, the planner and the virtual cluster
    all take (module docstring). Defaults: one rank, plain data parallelism, no recomputation, bf16."""
    config: ModelConfig
    mesh: Mesh = field(default_factory=Mesh)

    # the batch: each data-parallel rank runs num_microbatches micro-batches of micro_batch_size sequences
    seq_len: int | None = None            # tokens per sequence; None: the model's max_seq_len
    micro_batch_size: int = 1
    num_microbatches: int = 1             # torchtitan: pipeline_parallel_microbatches; Megatron: global / (dp·b)

    # how to parallelize, beyond the mesh's degrees (parallelize's steps)
    zero_stage: int | None = None         # None: notebook 02's NaiveDDP; 0-3 ZeroDataParallel (HSDP meshes: 3).
                                          # Megatron: --use-distributed-optimizer is 1; torchtitan's FSDP is 3
    reshard_after_forward: bool = True    # ZeRO-3: free each unit's gathered weights after its forward (FSDP2's)
    reshard_after_backward: bool = True   # ZeRO-3: False keeps weights and whole gradients across micro-batches,
                                          # reduced once a step (torch's pipelining with FSDP; course_lib.zero_bytes)
    sequence_parallel: bool = False       # Megatron's SP with TP
    vocab_parallel: bool = False          # embedding, head and loss split by vocabulary over TP
    recompute: str = "none"               # none, selective, op, full. torchtitan: activation_checkpoint.mode
    schedule: str = "1f1b"                # 1f1b, gpipe, interleaved, zb-h1 (course_lib.schedules)
    num_chunks: int = 1                   # v model chunks per stage. Megatron: virtual pipeline stages
    data_parallel: bool = True            # False: no wrapper, gradients stay local (the virtual cluster, ep > 1)
    capacity_factor: float | None = None  # a mixture of experts' (course_lib.feed_forward.capacity)

    # precision: the type of weights and activations, and the training state kept per parameter
    dtype: str = "bf16"                   # bf16, fp16, fp32 (fp64: the course's parity runs)
    convention: str | None = None         # ledger.CONVENTIONS; None: "fp32" for fp32 weights, else "mixed"
    fused_norm: bool = True               # False: RMSNorm as F.rms_norm on the CPU saves it (fp32 copies)

    # the cluster, when the job is costed
    gpu: str | None = None                # hardware.GPUS' name, e.g. "A100 80GB", "H100 SXM"; cost.step_time also
                                          # takes a hardware.GPU itself (a calibrated machine, a GPU of your own)
    gpus_per_node: int = 8

    # ------------------------------------------------------------------------------ what follows from it
    @property
    def tokens_per_sequence(self) -> int:
        return self.seq_len or self.config.max_seq_len

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step, over all data-parallel ranks: dp · m · b."""
        return self.mesh.dp * self.num_microbatches * self.micro_batch_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def bytes_per_element(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element as it is reduced and as the optimizer reads it: at least fp32's 4 where the
        convention keeps fp32 gradients (fp32, Megatron's fp32 gradients or fp32 accumulation), else the dtype's
        (fp64 runs reduce 8-byte gradients)."""
        fp32_grads = CONVENTIONS[self.state_convention].grad_bytes >= 4
        return max(4, self.bytes_per_element) if fp32_grads else self.bytes_per_element

    @property
    def state_convention(self) -> str:
        """The ledger.CONVENTIONS key of the state kept per parameter."""
        if self.convention is not None:
            return self.convention
        return "fp32" if self.dtype in ("fp32", "fp64") else "mixed"

    @property
    def zero(self) -> int:
        """The ZeRO stage the formulas count (NaiveDDP keeps what stage 0 keeps)."""
        return self.zero_stage or 0

    def stage_of(self, rank: int) -> int:
        return self.mesh.coords(rank)["pp"]

    def replace(self, **changes) -> Job:
        """A copy with ``changes``: ``job.replace(zero_stage=3)``."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------------------------------ the rules
    def problems(self) -> list[str]:
        """Every rule this job breaks, one line each (module docstring)."""
        found = self._value_problems()
        if found:            # the rules below compare values, and one of them may be a typo of 10**9
            return found
        found = self._mesh_problems() + self._option_problems()
        operations = self.mesh.pp * self.num_microbatches * self.num_chunks
        if not found and operations > LIMIT:
            found.append(f"pp {self.mesh.pp} × num_microbatches {self.num_microbatches} × num_chunks {self.num_chunks}"
                         f" = {operations:,} forwards through the pipeline's stages: more than the course lays out "
                         f"({LIMIT:,}), a typo rather than a run")
        if not found:        # the schedule is built step by step: only for a job that passed the rest
            problem = _schedule_problem(self.schedule, self.mesh.pp, self.num_microbatches, self.num_chunks)
            found += [problem] if problem else []
        return found

    def check(self) -> Job:
        """Raise one ValueError listing every broken rule (``problems``); returns the job when it has none."""
        found = self.problems()
        if found:
            raise ValueError("; ".join(found))
        return self

    def _value_problems(self) -> list[str]:
        """Each field on its own: types and ranges."""
        found = []
        for name in ("micro_batch_size", "num_microbatches", "num_chunks", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= LIMIT:
                found.append(f"{name}={value!r} must be a whole number from 1 to {LIMIT:,}")
        if self.seq_len is not None and (isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int)
                                         or not 1 <= self.seq_len <= self.config.max_seq_len):
            found.append(f"seq_len={self.seq_len!r} must be a whole number from 1 to the model's max_seq_len="
                         f"{self.config.max_seq_len}")
        if self.zero_stage is not None and (isinstance(self.zero_stage, bool) or not isinstance(self.zero_stage, int)
                                            or self.zero_stage not in ZERO_STAGES):
            found.append(f"zero_stage={self.zero_stage!r}: one of None (NaiveDDP), "
                         f"{', '.join(map(str, ZERO_STAGES))}")
        for name in ("reshard_after_forward", "reshard_after_backward", "sequence_parallel", "vocab_parallel",
                     "data_parallel", "fused_norm"):
            if not isinstance(getattr(self, name), bool):     # "no" is a true string: it would switch it on
                found.append(f"{name}={getattr(self, name)!r} must be True or False")
        choices = {"recompute": RECOMPUTE, "schedule": tuple(SCHEDULES), "dtype": tuple(DTYPES)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                found.append(f"{name}={getattr(self, name)!r}: one of {', '.join(allowed)}")
        if self.convention is not None and self.convention not in CONVENTIONS:
            found.append(f"convention={self.convention!r}: one of None, {', '.join(CONVENTIONS)}")
        if self.capacity_factor is not None and not (isinstance(self.capacity_factor, (int, float))
                                                     and 0 < self.capacity_factor <= 1e3):
            found.append(f"capacity_factor={self.capacity_factor!r} must be None or a number in (0, 1000]")
        if self.gpu is not None:
            from ..hardware import find_gpu  # the catalogue, only for a costed job
            try:
                find_gpu(self.gpu)
            except ValueError as error:
                found.append(str(error))
        return found

    def _mesh_problems(self) -> list[str]:
        """The mesh against the model and the batch (Mesh.check_model's rules, the same messages)."""
        try:
            self.mesh.check_model(self.config, batch_size=self.global_batch_size,
                                  num_microbatches=self.num_microbatches, seq_len=self.tokens_per_sequence)
        except ValueError as error:
            return [str(error)]
        return []

    def _option_problems(self) -> list[str]:
        """The options against each other, the mesh and the model."""
        mesh, found = self.mesh, []
        if mesh.dp_replicate > 1 and self.zero_stage != 3:
            found.append(f"dp_replicate {mesh.dp_replicate} with zero_stage={self.zero_stage!r}: hybrid sharding is "
                         "ZeRO-3 inside each replica (zero_stage=3)")
        if not (self.reshard_after_forward and self.reshard_after_backward) and mesh.dp_replicate > 1:
            found.append(f"reshard_after_forward/backward=False with dp_replicate {mesh.dp_replicate}: the course's "
                         "HSDP reshards after forward and backward (course_lib.hsdp); keep both True")
        try:
            check_resharding(self.reshard_after_forward, self.zero_stage, self.reshard_after_backward)
        except ValueError as error:
            found.append(str(error))
        if mesh.ep > 1 and self.data_parallel:
            found.append(f"ep {mesh.ep} with a data-parallel wrapper: the experts' gradients average over the "
                         "expert_dp group and the rest over dp_cp, and each wrapper averages over one group; pass "
                         "data_parallel=False (per_rank counts that part)")
        if getattr(self.config, "num_experts", 0) and mesh.tp > 1:
            found.append(f"tp {mesh.tp} with num_experts={self.config.num_experts}: the course's MoE layer has no "
                         "tensor-parallel split (apply_tp splits a dense MLP); run a mixture of experts with tp 1")
        if self.recompute == "op" and (mesh.cp > 1 or getattr(self.config, "num_experts", 0)):
            found.append(f"recompute='op' with cp {mesh.cp} and num_experts={self.config.num_experts}: the per-op "
                         "policy counts a dense block's matmuls (ring attention and the experts' would rerun "
                         "their sends); use 'full' or 'selective' there")
        if self.sequence_parallel and mesh.cp > 1:
            found.append(f"sequence_parallel with cp {mesh.cp}: apply_tp's SP would cut each rank's slice of the "
                         "sequence again, and ring attention's positions assume it does not")
        if self.sequence_parallel and self.tokens_per_sequence % mesh.tp:
            found.append(f"seq_len={self.tokens_per_sequence} is not divisible by tp={mesh.tp}: sequence "
                         "parallelism gives each rank seq_len/tp tokens")
        if self.schedule == "zb-h1" and self.recompute != "none":
            found.append(f"schedule='zb-h1' with recompute={self.recompute!r}: ZB-H1's W is a second backward over "
                         "the graph its B kept, and a checkpointed block's recomputation fails on that second pass "
                         "(torch 2.13's torch.utils.checkpoint); run zb-h1 without it")
        if self.num_chunks > 1 and mesh.pp * self.num_chunks > self.config.num_layers:
            found.append(f"pp {mesh.pp} × num_chunks {self.num_chunks} = {mesh.pp * self.num_chunks} virtual stages "
                         f"> {self.config.num_layers} layers: every chunk needs at least one layer")
        if self.convention is not None and self.convention in CONVENTIONS and (
                CONVENTIONS[self.convention].weight_bytes != self.bytes_per_element):
            found.append(f"convention={self.convention!r} keeps {CONVENTIONS[self.convention].weight_bytes}-byte "
                         f"weights, dtype={self.dtype!r} has {self.bytes_per_element}: choose a matching pair")
        return found

