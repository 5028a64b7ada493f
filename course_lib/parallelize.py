"""Every parallelism of the course, combined in one place: ``parallelize(model, mesh, comms, rank, options)``.

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
3. EP   ``apply_ep`` over "ep": each MoE keeps its E/ep experts (torchtitan applies EP with TP).
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

``Parallelism`` holds the options and checks them against the model and the mesh, every broken rule in one
error. ``Parallelized.forward_backward`` runs a step's micro-batches through the pipeline and averages the
gradients; what each rank then holds and sends is course_lib.per_rank's to predict.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .comm import Comm
from .context_parallel import apply_context_parallel
from .ddp import NaiveDDP
from .expert_parallel import apply_ep
from .hsdp import HybridShardedDataParallel
from .ledger import ZERO_STAGES
from .mesh import Mesh
from .pipeline_parallel import make_stage, partition_layers, pipeline_step, stage_chunks
from .recompute import apply_checkpointing
from .schedules import schedule_actions
from .tensor_parallel import apply_tp
from .zero import ZeroDataParallel, default_units

ACTIVATION_CHECKPOINTING = (None, "selective", "full")


@dataclass(frozen=True)
class Parallelism:
    """How to parallelize, beyond the mesh's degrees: each option of the six steps (module docstring).

    zero_stage: None (NaiveDDP), 0-3 (ZeroDataParallel; HSDP meshes: 3). sequence_parallel: Megatron's SP with
    TP. vocab_parallel: embedding, head and loss split by vocabulary over TP (apply_tp's). activation_checkpointing:
    None, "selective" or "full" (recompute.apply_checkpointing). num_chunks: v, interleaved schedules. schedule, num_microbatches: the
    pipeline's (checked here, run by Parallelized.forward_backward). data_parallel=False: no wrapper, gradients
    stay local (the virtual cluster with ep > 1, where no wrapper averages over two groups yet).
    """
    zero_stage: int | None = None
    sequence_parallel: bool = False
    vocab_parallel: bool = False
    activation_checkpointing: str | None = None
    num_chunks: int = 1
    schedule: str = "1f1b"
    num_microbatches: int = 1
    data_parallel: bool = True

    def problems(self, config, mesh: Mesh, *, batch_size: int | None = None, seq_len: int | None = None) -> list[str]:
        """Every rule these options, ``mesh`` and ``config`` break (and the batch's, if given), one line each."""
        found = []

        def check(rule, *args, **kwargs):
            try:
                rule(*args, **kwargs)
            except ValueError as error:
                found.append(str(error))

        check(mesh.check_model, config, batch_size=batch_size, num_microbatches=self.num_microbatches,
              seq_len=seq_len)
        if self.zero_stage is not None and self.zero_stage not in ZERO_STAGES:
            found.append(f"zero_stage={self.zero_stage!r}: one of None (NaiveDDP), {', '.join(map(str, ZERO_STAGES))}")
        if mesh.dp_replicate > 1 and self.zero_stage != 3:
            found.append(f"dp_replicate {mesh.dp_replicate} with zero_stage={self.zero_stage!r}: hybrid sharding is "
                         "ZeRO-3 inside each replica (zero_stage=3)")
        if mesh.ep > 1 and self.data_parallel:
            found.append(f"ep {mesh.ep} with a data-parallel wrapper: the experts' gradients average over the "
                         "expert_dp group and the rest over dp_cp, and each wrapper averages over one group; pass "
                         "data_parallel=False (per_rank counts that part)")
        if getattr(config, "num_experts", 0) and mesh.tp > 1:
            found.append(f"tp {mesh.tp} with num_experts={config.num_experts}: the course's MoE layer has no "
                         "tensor-parallel split (apply_tp splits a dense MLP); run a mixture of experts with tp 1")
        if self.sequence_parallel and mesh.cp > 1:
            found.append(f"sequence_parallel with cp {mesh.cp}: apply_tp's SP would cut each rank's slice of the "
                         "sequence again, and ring attention's positions assume it does not")
        if self.sequence_parallel and seq_len is not None and seq_len % mesh.tp:
            found.append(f"seq_len={seq_len} is not divisible by tp={mesh.tp}: sequence parallelism gives each rank "
                         "seq_len/tp tokens")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            found.append(f"activation_checkpointing={self.activation_checkpointing!r}: one of None, selective, full")
        if self.schedule == "zb-h1" and self.activation_checkpointing is not None:
            found.append(f"schedule='zb-h1' with activation_checkpointing={self.activation_checkpointing!r}: ZB-H1's "
                         "W is a second backward over the graph its B kept, and a checkpointed block's recomputation "
                         "fails on that second pass (torch 2.13's torch.utils.checkpoint); run zb-h1 without it")
        if not isinstance(self.num_chunks, int) or self.num_chunks < 1:
            found.append(f"num_chunks={self.num_chunks!r} must be a whole number >= 1")
        elif self.num_chunks > 1 and mesh.pp * self.num_chunks > config.num_layers:
            found.append(f"pp {mesh.pp} × num_chunks {self.num_chunks} = {mesh.pp * self.num_chunks} virtual stages "
                         f"> {config.num_layers} layers: every chunk needs at least one layer")
        if isinstance(self.num_microbatches, int) and self.num_microbatches >= 1 and isinstance(self.num_chunks, int):
            check(schedule_actions, self.schedule, mesh.pp, self.num_microbatches, num_chunks=self.num_chunks)
        return found

    def check(self, config, mesh: Mesh, *, batch_size: int | None = None, seq_len: int | None = None) -> None:
        """Raise one ValueError listing every broken rule (``problems``), or nothing."""
        found = self.problems(config, mesh, batch_size=batch_size, seq_len=seq_len)
        if found:
            raise ValueError("; ".join(found))


@dataclass
class Parallelized:
    """What ``parallelize`` returns: this rank's piece of the model and the wrapper that averages its gradients."""
    stage: nn.Module                       # this rank's layers (or its v chunks): pipeline_step's stage_module
    data_parallel: nn.Module | None        # NaiveDDP, ZeroDataParallel, HybridShardedDataParallel, or None
    comms: dict[str, Comm]
    options: Parallelism = field(default_factory=Parallelism)

    @property
    def optimizer(self):
        """ZeroDataParallel's optimizer over this rank's shards (None for NaiveDDP: make one over ``stage``)."""
        return getattr(self.data_parallel, "optimizer", None)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, *, recorder=None) -> dict:
        """One step's forwards and backwards: ``pipeline_step`` over the "pp" group with the options' schedule and
        micro-batches (inside the wrapper's ``no_sync()``: the gradients add up over the micro-batches), then the
        gradients averaged over the data-parallel group(s). Returns pipeline_step's result; step the optimizer
        next (``data_parallel.step()`` for ZeRO and HSDP)."""
        sync = self.data_parallel.no_sync() if self.data_parallel is not None else contextlib.nullcontext()
        with sync:
            result = pipeline_step(self.stage, self.comms["pp"], inputs, targets, recorder=recorder,
                                   num_microbatches=self.options.num_microbatches, schedule=self.options.schedule)
        if self.data_parallel is not None:
            self.data_parallel.finish_gradient_sync()
        return result


def parallelize(model: nn.Module, mesh: Mesh, comms: dict[str, Comm], rank: int,
                options: Parallelism | None = None, *, optimizer_kwargs: dict | None = None) -> Parallelized:
    """``model`` (the whole course model, the same on every rank) cut down, in place, to ``rank``'s piece of
    ``mesh`` by the six steps of the module docstring; ``comms`` is mesh.make_comms(mesh, rank).
    ``optimizer_kwargs`` go to ZeroDataParallel's optimizer (zero_stage 0-3). Feed the stage this rank's slice of
    the sequence when cp > 1 (context_parallel.shard_sequence) and this dp rank's share of the batch."""
    options = options or Parallelism()
    options.check(model.config, mesh)
    where = mesh.coords(rank)
    v = options.num_chunks
    parts = partition_layers(model.config.num_layers, mesh.pp, num_chunks=v)
    copies = [copy.deepcopy(model) for _ in range(v - 1)] + [model]    # before any Comm is attached
    chunks = []
    for c, chunk in enumerate(copies):
        if mesh.cp > 1:                                                     # 1. CP
            apply_context_parallel(chunk, comms["cp"])
        if mesh.tp > 1:                                                     # 2. TP (+SP)
            apply_tp(chunk, comms["tp"], sequence_parallel=options.sequence_parallel,
                     vocab_parallel=options.vocab_parallel)
        if mesh.ep > 1:                                                     # 3. EP
            apply_ep(chunk, comms["ep"])
        apply_checkpointing(chunk, options.activation_checkpointing or "none")   # 4. activation checkpointing
        chunks.append(make_stage(chunk, c * mesh.pp + where["pp"], parts))   # 5. PP
    stage = chunks[0] if v == 1 else nn.ModuleList(chunks)
    return Parallelized(stage, _data_parallel(stage, mesh, comms, options, optimizer_kwargs or {}), comms, options)


def _data_parallel(stage: nn.Module, mesh: Mesh, comms: dict[str, Comm], options: Parallelism, optimizer_kwargs):
    """6. The wrapper that averages ``stage``'s gradients over the ranks that hold the same weights."""
    if not options.data_parallel:
        return None
    units = [unit for chunk in stage_chunks(stage) for unit in default_units(chunk)]   # embed, each layer, norm, head
    if mesh.dp_replicate > 1:
        return HybridShardedDataParallel(stage, comms["dp_shard_cp"], comms["dp_replicate"], units=units,
                                         **optimizer_kwargs)
    if options.zero_stage is None:
        return NaiveDDP(stage, comms["dp_cp"])
    return ZeroDataParallel(stage, comms["dp_cp"], stage=options.zero_stage, units=units, **optimizer_kwargs)
