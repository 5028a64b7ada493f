"""Every parallelism of the course, combined in one place: ``parallelize(model, job, comms, rank)``.

The model knows nothing of parallelism (course_lib.model); each technique module splits it one way
(apply_context_parallel, apply_tp, apply_ep, make_stage, a data-parallel wrapper). Wherever more than one is
combined (notebook 06 onwards, runs.mesh, labs/parallel_3d.py, the virtual cluster) they are combined here, in
this order, so that each sees the model it expects:

1. CP   ``apply_context_parallel`` over the "cp" group: each layer's attention becomes ring attention on this
        rank's 2 of 2·cp chunks of the sequence. Before TP, because apply_tp hooks the attention module it finds
        (its f), which must be the one that runs. torchtitan's CP is a context manager around the step that
        changes no module, so its place in torchtitan's order is free.
2. TP   ``apply_tp`` over "tp" (``sequence_parallel``: Megatron's SP). The first of torchtitan's
        parallelize_llama.
3. EP   ``apply_ep`` over "ep": each MoE keeps its E/ep experts (torchtitan applies EP with TP). Every MoE,
        split or not, takes the job's capacity_factor (None: no token dropped), whatever the model was built with.
4. activation checkpointing: ``apply_checkpointing`` ("full": each block, "selective": each attention core;
        course_lib.recompute), after the layers are split and before they are cut into stages and wrapped
        (torchtitan: after TP, before FSDP): a recomputed block reruns its TP collectives as they ran.
5. PP   ``make_stage``: this rank keeps its stage's layers (``num_chunks`` v > 1: its v chunks, each a copy made
        before steps 1-4, as make_stage's own copies are). torchtitan cuts first and parallelizes each stage; the
        course's apply_* walk every layer of a whole model, so the cut comes after them: the same pieces.
6. data parallelism over the ranks that hold the same weights: NaiveDDP (``zero_stage=None``, notebook 02's),
        ZeroDataParallel (``zero_stage`` 0-3) over "dp_cp", or, when the mesh has dp_replicate > 1, HSDP
        (hsdp.HybridShardedDataParallel: ZeRO-3 over "dp_shard_cp", all-reduce over "dp_replicate"). Last, as
        torchtitan's FSDP/HSDP is last: it wraps the pieces that the other steps left.

The mesh and the options are a course_lib.job.Job's: one description of the run, checked in one place
(``Job.problems``). ``Parallelized.forward_backward`` runs a step's micro-batches through the pipeline and
averages the
gradients; what each rank then holds and sends is course_lib.per_rank's to predict.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from .comm import Comm
from .context_parallel import apply_context_parallel
from .ddp import NaiveDDP
from .expert_parallel import apply_ep
from .feed_forward import MoE
from .hsdp import HybridShardedDataParallel
from .job import Job
from .pipeline_parallel import make_stage, partition_layers, pipeline_step, stage_chunks
from .recompute import apply_checkpointing
from .tensor_parallel import apply_tp
from .zero import ZeroDataParallel, default_units


@dataclass
class Parallelized:
    """What ``parallelize`` returns: this rank's piece of the model and the wrapper that averages its gradients."""
    stage: nn.Module                       # this rank's layers (or its v chunks): pipeline_step's stage_module
    data_parallel: nn.Module | None        # NaiveDDP, ZeroDataParallel, HybridShardedDataParallel, or None
    comms: dict[str, Comm]
    job: Job

    @property
    def optimizer(self):
        """ZeroDataParallel's optimizer over this rank's shards (None for NaiveDDP: make one over ``stage``)."""
        return getattr(self.data_parallel, "optimizer", None)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, *, recorder=None) -> dict:
        """One step's forwards and backwards: ``pipeline_step`` over the "pp" group with the job's schedule and
        micro-batches (inside the wrapper's ``no_sync()``: the gradients add up over the micro-batches), then the
        gradients averaged over the data-parallel group(s). Returns pipeline_step's result; step the optimizer
        next (``data_parallel.step()`` for ZeRO and HSDP)."""
        sync = self.data_parallel.no_sync() if self.data_parallel is not None else contextlib.nullcontext()
        with sync:
            result = pipeline_step(self.stage, self.comms["pp"], inputs, targets, recorder=recorder,
                                   num_microbatches=self.job.num_microbatches, schedule=self.job.schedule)
        if self.data_parallel is not None:
            self.data_parallel.finish_gradient_sync()
        return result


def parallelize(model: nn.Module, job: Job, comms: dict[str, Comm], rank: int, *,
                optimizer_kwargs: dict | None = None) -> Parallelized:
    """``model`` (the whole course model, the same on every rank) cut down, in place, to ``rank``'s piece of
    ``job.mesh`` by the six steps of the module docstring, with ``job``'s options (checked first, every broken
    rule in one error: Job.problems); ``comms`` is mesh.make_comms(job.mesh, rank).
    ``optimizer_kwargs`` go to ZeroDataParallel's optimizer (zero_stage 0-3). Feed the stage this rank's slice of
    the sequence when cp > 1 (context_parallel.shard_sequence) and this dp rank's share of the batch."""
    if job.config != model.config:
        raise ValueError(f"the job describes {job.config}, the model is {model.config}: build the model from "
                         "job.config")
    job.check()
    mesh = job.mesh
    where = mesh.coords(rank)
    v = job.num_chunks
    parts = partition_layers(model.config.num_layers, mesh.pp, num_chunks=v)
    copies = [copy.deepcopy(model) for _ in range(v - 1)] + [model]    # before any Comm is attached
    chunks = []
    for c, chunk in enumerate(copies):
        if mesh.cp > 1:                                                     # 1. CP
            apply_context_parallel(chunk, comms["cp"])
        if mesh.tp > 1:                                                     # 2. TP (+SP)
            apply_tp(chunk, comms["tp"], sequence_parallel=job.sequence_parallel, vocab_parallel=job.vocab_parallel)
        for moe in (module for module in chunk.modules() if isinstance(module, MoE)):
            moe.capacity_factor = job.capacity_factor                       # the job's routing rule
        if mesh.ep > 1:                                                     # 3. EP
            apply_ep(chunk, comms["ep"])
        apply_checkpointing(chunk, job.recompute)   # 4. activation checkpointing
        chunks.append(make_stage(chunk, c * mesh.pp + where["pp"], parts))   # 5. PP
    stage = chunks[0] if v == 1 else nn.ModuleList(chunks)
    return Parallelized(stage, _data_parallel(stage, job, comms, optimizer_kwargs or {}), comms, job)


def _data_parallel(stage: nn.Module, job: Job, comms: dict[str, Comm], optimizer_kwargs):
    """6. The wrapper that averages ``stage``'s gradients over the ranks that hold the same weights."""
    if not job.data_parallel:
        return None
    mesh = job.mesh
    units = [unit for chunk in stage_chunks(stage) for unit in default_units(chunk)]   # embed, each layer, norm, head
    if mesh.dp_replicate > 1:
        return HybridShardedDataParallel(stage, comms["dp_shard_cp"], comms["dp_replicate"], units=units,
                                         **optimizer_kwargs)
    if job.zero_stage is None:
        # One rank holds these weights (a TP or PP mesh without DP): nothing to average, no all-reduces to send.
        return NaiveDDP(stage, comms["dp_cp"]) if comms["dp_cp"].size > 1 else None
    return ZeroDataParallel(stage, comms["dp_cp"], zero_stage=job.zero_stage, units=units,
                            reshard_after_forward=job.reshard_after_forward,
                            reshard_after_backward=job.reshard_after_backward, **optimizer_kwargs)
