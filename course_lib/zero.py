"""ZeRO stages 1, 2 and 3 by hand: shard the training state over the data-parallel ranks.

Plain data parallelism (stage 0) keeps the whole training state on each of the N ranks. ZeRO, the Zero
Redundancy Optimizer (零冗余优化器, Rajbhandari et al. 2020), removes the copies one part at a time. Rank r only
has to *update* its own 1/N of the parameters, so it only needs their optimizer state (stage 1); then only their
gradients (stage 2); then only their weights, borrowing the others' just while a layer runs (stage 3, which is
what PyTorch's FSDP does). With w, g, o bytes per parameter (mixed-precision Adam: 2, 2, 12), per rank:

    stage 0  (w + g + o)·P          stage 2  w·P + (g + o)·P/N
    stage 1  (w + g)·P + o·P/N      stage 3  (w + g + o)·P/N        (either reshard_after_forward)

That is the state at rest, between steps. What a rank holds while a step runs and what it sends, stage by
stage, with and without gradient accumulation and resharding, is in course_lib/zero_bytes.py, with its formulas.

How it is built. The parameters are grouped into units (default_units: embed, each block, norm, head: the
modules FSDP would wrap). Each unit's parameters move into one flat buffer of N·S elements, S = ceil(P_u/N),
zero-padded at the end; the module's parameters become views of it (param.data = view), so the model runs
unchanged. Rank r owns elements [r·S, (r+1)·S) of every unit, its shard: the one tensor its optimizer updates
(stage 0: the whole buffer; stages 1, 2: a view of the buffer; stage 3: the only copy). When backward has
finished a unit (post-accumulate-grad hooks), its gradients are all-reduced (stage 0), reduce-scattered from a
flat gradient buffer that backward wrote into (stage 1), or flattened, reduce-scattered and dropped, so that one
unit's full gradients exist at a time (stages 2, 3). Stage 3 frees the weight buffer (storage resized to 0)
except between a unit's forward pre-hook and forward hook, and again from the moment the gradient reaches the
unit's output in backward until its reduce-scatter. With reshard_after_forward=False the forward hook keeps it,
so it stays from the forward pre-hook to the reduce-scatter (a forward without autograd still frees it, and
step() frees any unit still gathered: its weights are stale once the shards change). On gloo a reduce-scatter
runs as a full all-reduce (it sends 2Ψ·(N-1)/N, notebook 02): the traced bytes above are the ring's, what NCCL
sends.

Per rank this is exactly ledger.zero_state_bytes(padded_num_params(...), zero_stage, N), padded_num_params =
Σ_u N·ceil(P_u/N): each unit's padding counts. It equals P when N divides every unit (the tiny model on 2, 4
or 8 ranks); otherwise it exceeds P by fewer than N·(number of units) parameters.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
import torch.nn as nn

from .comm import Comm
from .ddp import remove_with
from .ledger import ZERO_STAGES
from .measure import measure_state_bytes
from .mixed_precision import MixedPrecisionAdam
from .zero_bytes import check_resharding

STAGES = ZERO_STAGES


def _children(model: nn.Module) -> list[nn.Module]:
    """Each child of ``model`` that has parameters, each entry of a ModuleList on its own."""
    modules = [module for child in model.children()
               for module in (child if isinstance(child, nn.ModuleList) else [child])]
    return [module for module in modules if any(True for _ in module.parameters())]


def default_units(model: nn.Module) -> list[nn.Module]:
    """The modules whose weights stage 3 gathers together: each child of ``model`` that has parameters, with each
    entry of a ModuleList a unit of its own, but for one whose weights an earlier unit holds (a tied head: its
    weight is the embedding's, in the embedding's unit, as per_rank counts it). For the course's GPT: embed,
    layers[0..L-1], norm, head."""
    units, held = [], set()
    for module in _children(model):
        params = {id(p) for p in module.parameters()}
        if not params <= held:
            units.append(module)
            held |= params
    return units


def borrowers(model: nn.Module, units: list[nn.Module]) -> list[tuple[nn.Module, int]]:
    """(module, index of the unit that holds its weights) for each of ``model``'s children that is no unit but
    runs with another's weights (a tied head): stage 3 gathers that unit around its forward too."""
    owner = {id(p): index for index, unit in enumerate(units) for p in unit.parameters()}
    unit_ids = {id(unit) for unit in units}
    return [(module, owner[id(next(module.parameters()))]) for module in _children(model)
            if not any(id(inner) in unit_ids for inner in module.modules())      # a unit, or holds one (a chunk)
            and all(id(p) in owner for p in module.parameters())]


def padded_num_params(model: nn.Module, world_size: int, units: list[nn.Module] | None = None) -> int:
    """Σ over units of world_size·ceil(P_u/world_size): the parameters ZeroDataParallel stores, padding included."""
    units = default_units(model) if units is None else units
    return sum(-(-sum(p.numel() for p in unit.parameters()) // world_size) * world_size for unit in units)


def _starts_at(tensor: torch.Tensor, base: torch.Tensor, offset: int) -> bool:
    """``tensor`` lives in ``base``'s memory, ``offset`` elements in: the same storage object (compared by its
    address, so that meta tensors, whose data pointers are all 0, are told apart too) at that offset."""
    return (tensor.untyped_storage()._cdata == base.untyped_storage()._cdata
            and tensor.storage_offset() == base.storage_offset() + offset)


class _Unit:
    """One unit's parameters in one flat buffer of world_size equal shards; the module's parameters view it."""

    def __init__(self, name: str, module: nn.Module, world_size: int):
        self.name, self.module = name, module
        self.params = list(module.parameters())
        if len({p.dtype for p in self.params}) > 1:
            raise ValueError(f"unit {name} mixes dtypes {sorted({str(p.dtype) for p in self.params})}: one flat "
                             "buffer holds one dtype")
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = -(-self.numel // world_size)          # S = ceil(P_u / N); the last shard is padded
        self.full = torch.zeros(world_size * self.shard_numel, dtype=self.params[0].dtype,
                                device=self.params[0].device)
        self.offsets, offset = [], 0
        with torch.no_grad():
            for param in self.params:
                view = self.full[offset:offset + param.numel()].view_as(param)
                view.copy_(param)
                param.data = view     # the parameter keeps its identity (hooks, optimizers), now in the buffer
                self.offsets.append(offset)
                offset += param.numel()
        self.ready = 0                # parameters whose gradient the running backward has finished
        self.backwards = 0            # backwards finished since the last step()
        self.reduced = False          # stages 0, 1: the gradients were averaged since the last step()
        self.kept = False             # stage 3, reshard_after_backward=False: whole gradients not yet reduced
        self.flat_grad = None         # stages 0 and 1: the full gradients, as one buffer
        self.shard = None             # the nn.Parameter this rank's optimizer updates

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def free(self):
        self.full.untyped_storage().resize_(0)    # every view of the buffer (the module's weights) loses its memory

    def gather(self, shard: torch.Tensor, comm: Comm):
        self.full.untyped_storage().resize_(self.full.nbytes)
        comm.all_gather(self.full, shard.detach())


class ZeroDataParallel(nn.Module):
    """``module`` trained data-parallel with ZeRO stage ``zero_stage`` (0 = plain DDP) over ``comm``'s ranks.

        model = ZeroDataParallel(build(config), Comm(), zero_stage=3, lr=1e-3)  # optimizer_class(shards, lr=1e-3)
        loss_fn(model(inputs), targets).backward()                              # each rank: its slice of the batch
        model.step()                                                            # update; the next step may start

    Gradients are averaged over the ranks during backward; ``step()`` runs the optimizer on this rank's shards
    and (stages 1, 2) all-gathers the updated weights. Gradient accumulation: run all but the last micro-step's
    backward inside ``with model.no_sync():`` (stages 0, 1 then reduce once; stages 2, 3 reduce every micro-step
    anyway: they keep no full gradients to add into); in a pipeline, run them all inside it and then call
    ``finish_gradient_sync()``. ``parameters()`` lists the module's parameters and the
    shards, which share memory with them in stages 0-2: pass the model and ``model.optimizer`` to
    measure.measure_state_bytes, not ``parameters()`` to an optimizer. Set ``memory_trace = []`` to record, at each
    gather, free and reduce, the weight and gradient bytes this rank holds (counted from storage).

    ``reshard_after_forward`` (torch FSDP2's ``fully_shard(..., reshard_after_forward=...)``), ZeRO-3 only: True
    frees each unit's weights after its forward and gathers them again for its backward; False keeps them from
    the forward's gather until the unit's backward is done: one all-gather per unit and micro-step, not two, for
    holding every unit's weights at the end of forward (transient_weight_bytes). Stages 0-2 require True.
    ``reshard_after_backward=False`` (with it): inside ``no_sync()`` a unit keeps its weights after its backward
    and adds into whole gradients; the last backward (or ``finish_gradient_sync()``) reduce-scatters them once.
    """

    def __init__(self, module: nn.Module, comm: Comm, zero_stage: int, optimizer_class=MixedPrecisionAdam,
                 units: list[nn.Module] | None = None, reshard_after_forward: bool = True,
                 reshard_after_backward: bool = True, **optimizer_kwargs):
        if zero_stage not in ZERO_STAGES or isinstance(zero_stage, bool):
            raise ValueError(f"zero_stage={zero_stage!r}: ZeRO stages are 0 (plain DDP), 1, 2, 3")
        check_resharding(reshard_after_forward, zero_stage, reshard_after_backward)   # before any allocation
        super().__init__()
        self.module, self.comm, self.zero_stage = module, comm, zero_stage
        self.reshard_after_forward, self.reshard_after_backward = reshard_after_forward, reshard_after_backward
        units = default_units(module) if units is None else units
        names = {id(m): name for name, m in module.named_modules()}
        owner = {}
        for unit in units:
            for name, param in unit.named_parameters():
                if id(param) in owner:
                    raise ValueError(f"parameter {names[id(unit)]}.{name} is also in unit {owner[id(param)]}: a "
                                     "weight shared by two units (tied embeddings?) must sit in one unit")
                owner[id(param)] = names[id(unit)]
        missing = [name for name, p in module.named_parameters() if id(p) not in owner]
        if missing:
            raise ValueError(f"parameters in no unit: {missing}; every parameter must belong to one unit")
        self.units = [_Unit(names[id(unit)], unit, comm.size) for unit in units]
        self.memory_trace: list[dict] | None = None
        self._sync = True
        rank, shards = comm.rank, []
        # The hooks hold this wrapper weakly, and a unit by its index: a hook lives as long as its parameter, and a
        # strong reference back to the parameter would close a cycle through autograd's C++ objects that Python's
        # collector cannot see, so a finished run's model would stay in memory (on one H200 each run of
        # labs/zero.py kept the one before it: 1.5 GiB more per run). They are removed with the wrapper.
        wrapper, handles = weakref.proxy(self), []
        for index, unit in enumerate(self.units):
            comm.broadcast(unit.full, src=0)               # every rank starts from rank 0's weights
            mine = slice(rank * unit.shard_numel, (rank + 1) * unit.shard_numel)
            if zero_stage == 0:
                shard = nn.Parameter(unit.full)            # nothing sharded: the optimizer updates everything
            elif zero_stage < 3:
                shard = nn.Parameter(unit.full[mine])      # a view: updating it updates this rank's weights
            else:
                shard = nn.Parameter(unit.full[mine].clone())   # the only lasting copy of this rank's weights
                unit.free()
            if zero_stage <= 1:                            # full gradients kept: backward writes into views
                unit.flat_grad = torch.zeros_like(unit.full)
                for param, offset in zip(unit.params, unit.offsets):
                    param.grad = unit.flat_grad[offset:offset + param.numel()].view_as(param)
                shard.grad = unit.flat_grad if zero_stage == 0 else unit.flat_grad[mine]
            else:
                shard.grad = torch.zeros_like(shard)       # the reduced gradients of this rank's shard only
            unit.shard = shard
            shards.append(shard)
            handles += [param.register_post_accumulate_grad_hook(
                lambda param, i=index: wrapper._gradient_ready(wrapper.units[i])) for param in unit.params]
        if zero_stage == 3:                                # a tied head gathers the embedding's unit as its own
            for index, borrower in [(i, unit.module) for i, unit in enumerate(self.units)] + [
                    (i, m) for m, i in borrowers(module, units)]:
                handles.append(borrower.register_forward_pre_hook(
                    lambda module, args, i=index: wrapper._gather(wrapper.units[i], "forward")))
                handles.append(borrower.register_forward_hook(
                    lambda module, args, output, i=index: wrapper._after_forward(wrapper.units[i], output)))
        remove_with(self, handles)
        self.shards = nn.ParameterList(shards)
        self.optimizer = optimizer_class(list(self.shards), **optimizer_kwargs)


    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward inside this block adds into the gradients without averaging them,
        where the stage can. Stages 0 and 1 keep full gradients, so they average once, in the last micro-step's
        backward (run it outside the block). Stages 2 and 3 keep only their shard of the gradients: they
        reduce-scatter every micro-step whatever the block says (stage 3 also gathers the weights for every
        micro-step's forward and backward)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # ---- stage 3: borrow a unit's weights just while it runs

    def _gather(self, unit: _Unit, phase: str):
        if not unit.gathered:
            unit.gather(unit.shard, self.comm)
            self._record(f"gather ({phase})", unit)

    def _after_forward(self, unit: _Unit, output):
        if torch.is_grad_enabled():
            # Backward needs the weights again: gather them when the gradient reaches this unit's output (a no-op
            # while they are still gathered: reshard_after_forward=False, until this unit's backward frees them).
            for tensor in output if isinstance(output, (tuple, list)) else [output]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad: self._gather(unit, "backward"))
            if not self.reshard_after_forward:
                return                                      # keep them: freed after this unit's reduce-scatter
        unit.free()
        self._record("free (forward)", unit)

    # ---- every stage: average the gradients once backward has finished a unit

    def _gradient_ready(self, unit: _Unit):
        if unit.ready == 0 and unit.reduced:
            raise RuntimeError(f"unit {unit.name}: a second backward before step(), after the gradients were "
                               "averaged: for gradient accumulation run all but the last backward inside no_sync()")
        unit.ready += 1
        if unit.ready < len(unit.params):
            return
        unit.ready, unit.backwards = 0, unit.backwards + 1
        self._record("gradients ready", unit)             # stages 2, 3: this unit's full gradients exist now
        if unit.flat_grad is not None and not all(_starts_at(p.grad, unit.flat_grad, offset) for p, offset in
                                                  zip(unit.params, unit.offsets)):
            raise RuntimeError(f"unit {unit.name}: gradients are no longer views of the flat gradient buffer; "
                               "reset them with model.zero_grad() (or let step() do it), not the module's own")
        if self.zero_stage <= 1:
            if self._sync:                                  # no_sync: the next backward adds into flat_grad
                self._average_full_gradients(unit)
            return
        if not (self._sync or self.reshard_after_backward):
            unit.kept = True                                # weights stay gathered; the next backward adds in
            return
        self._reduce_scatter_gradients(unit)

    def _reduce_scatter_gradients(self, unit: _Unit):
        """Stages 2 and 3: reduce-scatter the unit's whole gradients into this rank's shard and drop them."""
        shard, size = unit.shard, self.comm.size
        padding = unit.full.numel() - unit.numel
        flat = torch.cat([p.grad.reshape(-1) for p in unit.params] + [unit.full.new_zeros(padding)])
        for param in unit.params:
            param.grad = None                               # stage 2's saving: full gradients live one unit long
        reduced = torch.empty_like(shard.grad)
        self.comm.reduce_scatter(reduced, flat)
        shard.grad.add_(reduced.div_(size))                 # micro-steps add up in the shard's gradient
        if self.zero_stage == 3:
            unit.free()
        unit.kept = False
        self._record("reduce gradients", unit)

    def _average_full_gradients(self, unit: _Unit):
        """Stages 0 and 1: all-reduce the unit's flat gradients, or reduce-scatter them into this rank's shard."""
        if self.zero_stage == 0:
            self.comm.all_reduce(unit.flat_grad)
            unit.flat_grad.div_(self.comm.size)
        else:
            reduced = torch.empty_like(unit.shard.grad)
            self.comm.reduce_scatter(reduced, unit.flat_grad)
            unit.shard.grad.copy_(reduced.div_(self.comm.size))   # shard.grad is this rank's slice of flat_grad
        unit.reduced = True
        self._record("reduce gradients", unit)

    def finish_gradient_sync(self):
        """For a pipeline (pipeline_step runs every micro-batch's backward itself, so none can stay outside
        ``no_sync()``): run them all inside the block, then call this once. Stages 0 and 1 average what the
        micro-batches added up, and so does stage 3 without resharding after backward; otherwise stages 2 and 3
        reduced in every backward already, so it does nothing there."""
        if not self._sync:
            raise RuntimeError("finish_gradient_sync() inside no_sync(): call it after the block")
        for unit in self.units:
            if self.zero_stage <= 1 and unit.backwards and not unit.reduced:
                self._average_full_gradients(unit)
            elif unit.kept:
                self._reduce_scatter_gradients(unit)

    def step(self):
        """Update this rank's shards (gradients already averaged); stages 1, 2: all-gather the new weights."""
        for unit in self.units:
            if unit.ready or not unit.backwards:
                when = "in the last backward" if unit.ready else "since the last step()"
                raise RuntimeError(f"unit {unit.name}: {unit.ready} of its {len(unit.params)} parameters got a "
                                   f"gradient {when}; every parameter must take part in the loss on every rank")
            if (self.zero_stage <= 1 and not unit.reduced) or unit.kept:
                raise RuntimeError(f"unit {unit.name}: its gradients were never averaged: the last backward before "
                                   "step() must run outside no_sync()")
            unit.backwards, unit.reduced = 0, False
        self.optimizer.step()
        self.regather_weights()
        for unit in self.units:
            if unit.flat_grad is not None:
                unit.flat_grad.zero_()                      # backward adds into these views next step
            else:
                unit.shard.grad.zero_()                     # stages 2, 3: micro-steps add into it
        self._record("step", None)

    def regather_weights(self):
        """ZeRO-1/2 keep whole weights: after the shards change (an optimizer step, a checkpoint load) every rank
        all-gathers them. (ZeRO-3 gathers a unit when it is used; a unit still gathered now, after a forward that
        had no backward with reshard_after_forward=False, holds the old weights: it is freed.)"""
        if self.zero_stage in (1, 2):
            for unit in self.units:
                self.comm.all_gather(unit.full, unit.shard.detach().clone())   # a copy: the input is part of the output
        elif self.zero_stage == 3:
            for unit in self.units:
                if unit.gathered:
                    unit.free()

    def zero_grad(self, set_to_none: bool = True):
        """Nothing to do: step() zeroes the flat gradient buffers (stages 0, 1) that backward adds into, and
        stages 2, 3 keep no module gradients. (nn.Module's zero_grad would set them to None, breaking the views.)"""

    def full_parameters(self) -> torch.Tensor:
        """Every weight of the module, flattened in module.parameters() order, the same on every rank (a
        collective in stage 3: call it on every rank)."""
        pieces = {}
        for unit in self.units:
            full = unit.full
            if not unit.gathered:
                full = torch.empty(unit.full.numel(), dtype=full.dtype, device=full.device)
                self.comm.all_gather(full, unit.shard.detach())
            for param, offset in zip(unit.params, unit.offsets):
                pieces[id(param)] = full[offset:offset + param.numel()].clone()
        return torch.cat([pieces[id(p)] for p in self.module.parameters()])

    def _record(self, event: str, unit: _Unit | None):
        if self.memory_trace is not None:
            held = measure_state_bytes(self, self.optimizer)
            self.memory_trace.append({"time": time.perf_counter(), "event": event, "unit": unit and unit.name,
                                  "weights": held["weights"], "grads": held["grads"]})
