"""ZeRO training runs (notebook 03, lab zero, tests, benchmarks): ours at every stage, or torch's DDP,
ZeroRedundancyOptimizer and FSDP2 fully_shard, on the same model and data; traced, timed and measured."""

from __future__ import annotations

import contextlib
import functools
import time
import warnings

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from tqdm.auto import tqdm

from ..comm import Comm, WatchCollectives, bytes_written
from ..data import SyntheticTokens, micro_batches
from ..measure import measure_state_bytes
from ..mixed_precision import MixedPrecisionAdam
from ..model import build, loss_fn, preset
from ..runtime.launch import device
from ..zero import ZeroDataParallel, borrowers, default_units
from ..zero_bytes import check_resharding
from .ddp import wrap

IMPLEMENTATIONS = ("ours", "ddp", "zero_redundancy", "fully_shard")


def train(rank: int, world_size: int, *, impl: str = "ours", zero_stage: int = 3, steps: int = 3, micro_batch_size: int = 4,
          accumulation_steps: int = 1, seq_len: int = 32, lr: float = 1e-2, optimizer: str = "adam",
          dtype=torch.float32, config=None, seed: int = 0, memory_trace: bool = False, progress: bool = False,
          reshard_after_forward: bool = True, reshard_after_backward: bool = True) -> dict:
    """A worker for ``launch``: train ``config`` (default: the tiny model) for ``steps`` steps with ``impl``:
    "ours" (ZeroDataParallel at ``zero_stage``), or torch's "ddp" (DistributedDataParallel, stage 0),
    "zero_redundancy" (DDP + ZeroRedundancyOptimizer: stage 1) or "fully_shard" (FSDP2 on the same units
    plus the root: stage 3). ``optimizer``: "adam" (torch's, foreach=False), "sgd", or "mixed"
    (MixedPrecisionAdam: 12 bytes of state per parameter; use it with dtype=torch.bfloat16).
    ``accumulation_steps``: micro-steps of ``micro_batch_size`` rows per optimizer step (global batch =
    micro_batch_size × world_size × accumulation_steps), all but the last inside ``no_sync()`` (ours, and torch's
    DDP under "ddp" and "zero_redundancy"; FSDP2 reduce-scatters every micro-step, as ZeRO-3 does).
    ``reshard_after_forward``: stage 3 only (ours, and fully_shard's units): False keeps each unit's gathered
    weights from its forward to its backward; ``reshard_after_backward=False`` too keeps them, and whole gradients,
    across the micro-steps, reduced once a step (fully_shard: set_reshard_after_backward and
    set_requires_gradient_sync False for all but the last micro-step, as torch's pipelining does).

    Returns lists with one entry per step: "losses" (this rank's), "step_seconds", "comm_seconds" and
    "collectives" (ours: time in, and number of, traced collectives), "wire" (ours: {op: traced wire bytes}),
    all of them over the whole optimizer step (every micro-step); "losses" is the mean over the micro-steps;
    "bytes_written" (counted by the kernel; None without /proc); and "state" (measure_state_bytes after the last
    step), "params" (the full weights, flattened), "memory_trace" (ours, last step, if asked).
    ``progress``: a tqdm bar on rank 0.
    """
    warnings.filterwarnings("ignore", category=FutureWarning)   # gloo's notice on reduce_scatter/all_gather
    optimizer_class = _optimizer_class(impl, optimizer)
    comm, dev = Comm(), device()
    config = config or preset("tiny")
    module = build(config, seed=seed, device=dev, dtype=dtype)
    resharding = {"reshard_after_forward": reshard_after_forward, "reshard_after_backward": reshard_after_backward}
    model, update = _parallel_model(impl, module, comm, world_size, zero_stage, optimizer_class, lr, resharding)
    data = SyntheticTokens(config.vocab_size, seq_len, seed=seed)
    run = {"losses": [], "step_seconds": [], "comm_seconds": [], "collectives": [], "wire": [], "bytes_written": [],
           "memory_trace": None}
    steps_range = range(steps)
    if progress and rank == 0:
        steps_range = tqdm(steps_range, desc=f"{impl} ZeRO-{zero_stage}" if impl == "ours" else impl, leave=False,
                           mininterval=1.0)
    for step in steps_range:
        batches = micro_batches(data, step, micro_batch_size, rank, world_size, accumulation_steps)
        if memory_trace and impl == "ours" and step == steps - 1:
            model.memory_trace = []
        for key, value in _optimizer_step(impl, model, update, comm, batches, accumulation_steps, dev,
                                          reshard_after_backward).items():
            run[key].append(value)
    run["state"] = measure_state_bytes(model, update)
    run["params"] = _full_weights(impl, model, module)
    if impl == "ours":
        run["memory_trace"] = model.memory_trace
    return run


def _optimizer_class(impl: str, optimizer: str):
    """The optimizer class ``train``'s ``optimizer`` names, once ``impl`` and ``optimizer`` are checked."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r}: choose one of {', '.join(IMPLEMENTATIONS)}")
    optimizers = {"adam": functools.partial(torch.optim.Adam, foreach=False), "sgd": torch.optim.SGD,
                  "mixed": MixedPrecisionAdam}
    if optimizer not in optimizers:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {', '.join(optimizers)}")
    return optimizers[optimizer]


def _parallel_model(impl: str, module, comm: Comm, world_size: int, zero_stage: int, optimizer_class, lr: float,
                    resharding: dict[str, bool]):
    """(the model to call, what steps it): ZeroDataParallel and its optimizer, or torch's implementation around
    ``module`` with an optimizer over its parameters (ZeroRedundancyOptimizer's under "zero_redundancy")."""
    if impl == "ours":
        model = ZeroDataParallel(module, comm, zero_stage=zero_stage, optimizer_class=optimizer_class, lr=lr,
                                 **resharding)
        return model, model.optimizer
    check_resharding(resharding["reshard_after_forward"], 3 if impl == "fully_shard" else 0,   # DDP's: stage 0, 1
                     resharding["reshard_after_backward"])
    model = module
    if impl == "fully_shard":
        mesh = init_device_mesh(device().type, (world_size,))
        units = default_units(module)
        borrowed = borrowers(module, units)
        for index, unit in enumerate(units):     # a tied head in its embedding's group, as FSDP2 asks
            group = [unit] + [borrower for borrower, owner in borrowed if owner == index]
            fully_shard(group if len(group) > 1 else unit, mesh=mesh,
                        reshard_after_forward=resharding["reshard_after_forward"])
        fully_shard(module, mesh=mesh)
    else:
        model = wrap(module, "torch", comm)
    if impl == "zero_redundancy":
        return model, ZeroRedundancyOptimizer(module.parameters(), optimizer_class=optimizer_class, lr=lr)
    return model, optimizer_class(module.parameters(), lr=lr)


def _optimizer_step(impl: str, model, update, comm: Comm, batches, accumulation_steps: int, dev,
                    reshard_after_backward: bool = True) -> dict:
    """One optimizer step over ``batches``, all micro-steps but the last inside ``no_sync()`` where the
    implementation has it; traced, timed and counted: this step's entry of each of ``train``'s lists."""
    ours = impl == "ours"
    accumulate = model.no_sync if impl in ("ours", "ddp", "zero_redundancy") else contextlib.nullcontext
    if impl == "fully_shard" and not reshard_after_backward:
        accumulate = functools.partial(_fsdp_no_sync, model)
    if not ours:
        update.zero_grad(set_to_none=False)        # keep gradient memory allocated, as ours does
    comm.barrier()
    written, start = bytes_written(), time.perf_counter()
    with comm.trace() as log:
        micro_losses = []
        for i, (inputs, targets) in enumerate(batches):
            with accumulate() if i < accumulation_steps - 1 else contextlib.nullcontext():
                # each micro-step's loss / A, so that the summed gradients are those of the mean loss
                micro_loss = loss_fn(model(inputs.to(dev)), targets.to(dev)) / accumulation_steps
                micro_loss.backward()
            micro_losses.append(micro_loss.detach())
        (model if ours else update).step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - start
    return {"losses": sum(loss.item() for loss in micro_losses), "step_seconds": seconds,
            "comm_seconds": sum(record.seconds for record in log.records) if ours else None,
            "collectives": len(log.records), "wire": {op: totals.wire_bytes for op, totals in log.summary().items()},
            "bytes_written": None if written is None else bytes_written() - written}


@contextlib.contextmanager
def _fsdp_no_sync(model):
    """FSDP2 across micro-steps as torch's pipelining runs it: no reduce-scatter, no reshard after backward."""
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


def _full_weights(impl: str, model, module) -> torch.Tensor:
    """Every weight, flattened in module.parameters() order, on the CPU (a collective for ours and fully_shard)."""
    if impl == "ours":
        return model.full_parameters().cpu()
    if impl == "fully_shard":
        return torch.cat([p.full_tensor().reshape(-1) for p in module.parameters()]).cpu()
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).cpu()


def fully_shard_model(world_size: int, *, dtype=None, seed: int = 0):
    """The tiny model under torch's FSDP2 as a pure ZeRO-3: every unit of ours (default_units) and the root
    sharded over all ranks, resharded after forward."""
    model = build(preset("tiny"), seed=seed, dtype=dtype)
    mesh = init_device_mesh(device().type, (world_size,))
    for unit in default_units(model):
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh, reshard_after_forward=True)


def fully_shard_traffic(rank: int, world_size: int, *, batch_size: int = 4, seq_len: int = 32) -> list:
    """One forward + backward of FSDP2 on this rank's own data: every collective torch issued, (op, bytes)."""
    warnings.filterwarnings("ignore", category=FutureWarning)   # gloo's notice on reduce_scatter/all_gather
    model = fully_shard_model(world_size)
    inputs, targets = SyntheticTokens(model.config.vocab_size, seq_len, seed=rank).batch(0, batch_size)
    with WatchCollectives() as watch:
        loss_fn(model(inputs), targets).backward()
    return watch.records


def fully_shard_peak(rank: int, world_size: int, *, dtype=torch.float64) -> dict[str, int]:
    """FSDP2's peak memory in one Adam step, by torch's own tool (FSDPMemTracker): bytes by kind
    ("SHARDED_PARAM", "UNSHARDED_PARAM", ...). The step before it is untracked: it makes Adam's state."""
    model = fully_shard_model(world_size, dtype=dtype)
    adam = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    inputs, targets = SyntheticTokens(model.config.vocab_size, 32, seed=0).rank_batch(0, 8, rank, world_size)
    for step in range(2):
        with FSDPMemTracker(model, adam) if step else contextlib.nullcontext() as tracker:
            adam.zero_grad(set_to_none=False)
            loss_fn(model(inputs), targets).backward()
            adam.step()
    return {str(kind).split(".")[-1]: nbytes for kind, nbytes in tracker.get_tracker_snapshot("peak")[device()].items()}

