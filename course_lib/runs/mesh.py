"""Training runs on a mesh (notebook 06, lab parallel_3d, tests): the course model on a dp × cp × tp × pp grid of
ranks (HSDP too), split by ``parallelize``, and torch's FSDP2 + DTensor TP on a 2-D DeviceMesh beside it."""

from __future__ import annotations

import contextlib
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from tqdm import tqdm

from ..context_parallel import shard_sequence
from ..data import SyntheticTokens, shard
from ..job import Job
from ..measure import measure_state_bytes
from ..mesh import Mesh, make_comms
from ..model import build, loss_fn, preset
from ..parallelize import parallelize
from ..runtime.arguments import check_whole
from ..runtime.launch import device
from ..tensor_parallel import dtensor_plan

# The collectives cost.step_time's tp_s and dp_s price (a pipeline's sends are in pp_s and the bubble)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def train_3d(rank: int, world_size: int, *, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1,
             dp_replicate: int = 1, zero_stage: int | None = None, sequence_parallel: bool = False,
             num_chunks: int = 1, num_microbatches: int = 2, schedule: str = "1f1b", steps: int = 3,
             batch_size: int = 8, seq_len: int = 16, lr: float = 1e-2, dtype=None, seed: int = 0,
             progress: bool = False, return_params: bool = True, **overrides) -> dict:
    """``steps`` Adam steps of the tiny model on a dp × cp × tp × pp mesh (dp_replicate > 1: HSDP), for
    ``launch``, the model split by ``parallelize``. Each step: this dp rank's share of the batch (its s/cp of
    every sequence) goes through the pipeline in ``num_microbatches`` micro-batches (TP all-reduces inside every
    layer of the stage), then gradients are averaged over the data-parallel group (NaiveDDP; ZeRO with
    ``zero_stage``), then Adam updates this rank's pieces. Returns this rank's coordinates, its losses (last
    stage only), its parameters (whole pieces, gathered under ZeRO-3), its measured state bytes, the bytes it
    sent on each axis in the last step (and how many ops), each step's seconds and, of them, its seconds inside
    COLLECTIVES (waiting for the slowest rank included; on gloo, whose collectives here all block: on NCCL, where
    wait() does not block the host, only the time to queue them). ``progress``: a tqdm bar on rank 0;
    ``return_params=False``: keep the parameters here (for the lab, at scale)."""
    check_whole("steps", steps)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={dtype!r}: a torch.dtype such as torch.float64, or None (the model's float32)")
    job = train_3d_job(world_size, dp=dp, tp=tp, pp=pp, cp=cp, dp_replicate=dp_replicate, zero_stage=zero_stage,
                       sequence_parallel=sequence_parallel, num_chunks=num_chunks, num_microbatches=num_microbatches,
                       schedule=schedule, batch_size=batch_size, seq_len=seq_len, **overrides)
    mesh, config = job.mesh, job.config
    where = mesh.coords(rank)
    comms = make_comms(mesh, rank)

    model = build(config, seed=seed, device=device(), dtype=dtype)   # every rank draws the whole model, keeps its piece
    parallel = parallelize(model, job, comms, rank, optimizer_kwargs={"optimizer_class": torch.optim.Adam, "lr": lr})
    stage, data_parallel = parallel.stage, parallel.data_parallel
    optimizer = parallel.optimizer or torch.optim.Adam(stage.parameters(), lr=lr)
    data = SyntheticTokens(config.vocab_size, seq_len, seed=seed)
    axes = {"tp": comms["tp"], "pp": comms["pp"], "dp": comms["dp_shard_cp" if dp_replicate > 1 else "dp_cp"]}
    axes.update({"cp": comms["cp"]} if cp > 1 else {})
    axes.update({"dp_replicate": comms["dp_replicate"]} if dp_replicate > 1 else {})
    losses, seconds, collective_seconds = [], [], []
    step_range = range(steps)
    if progress and rank == 0:
        step_range = tqdm(step_range, desc=mesh.factors(), mininterval=1.0)
    for step in step_range:
        start = time.perf_counter()
        inputs, targets = (shard(t, where["dp"], dp) for t in data.batch(step, batch_size))
        if cp > 1:
            inputs, targets = (shard_sequence(t, comms["cp"], dim=1) for t in (inputs, targets))
        if parallel.optimizer is None:
            optimizer.zero_grad()                      # (ZeroDataParallel.step() zeroes its own gradient buffers)
        with contextlib.ExitStack() as traces:
            logs = {axis: traces.enter_context(comm.trace()) for axis, comm in axes.items()}
            result = parallel.forward_backward(inputs, targets)   # averaged over dp: the batch's gradient
            if parallel.optimizer is not None:
                data_parallel.step()                   # ZeRO: update the shards (and gather, stages 1, 2)
        if parallel.optimizer is None:
            optimizer.step()
        if device().type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        # each axis has its own Comm and its own log: no op is counted twice
        collective_seconds.append(sum(r.seconds for log in logs.values() for r in log.records if r.op in COLLECTIVES))
        losses.append(result["loss"])
    held = stage if data_parallel is None or parallel.optimizer is None else data_parallel
    return {"rank": rank, "coords": where, "losses": losses, "step_seconds": seconds,
            "collective_seconds": collective_seconds, "backend": dist.get_backend(),
            "params": _named_parameters(stage, data_parallel, zero_stage) if return_params else None,
            "state_bytes": measure_state_bytes(held, optimizer),
            "sent_bytes": {axis: log.wire_bytes for axis, log in logs.items()},
            "ops": {axis: {op: t.count for op, t in log.summary().items()} for axis, log in logs.items()}}


def train_3d_job(world_size: int, *, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, dp_replicate: int = 1,
                 zero_stage: int | None = None, sequence_parallel: bool = False, num_chunks: int = 1,
                 num_microbatches: int = 2, schedule: str = "1f1b", batch_size: int = 8, seq_len: int = 16,
                 **overrides) -> Job:
    """The Job that train_3d runs with these keywords (its defaults; ``overrides`` change the tiny model), every
    rule checked: the mesh against ``world_size``, then the model, then the layout. cost.step_time prices the
    same Job (calibration.check_live_runs), so the prediction and the run cannot drift apart."""
    check_whole("world_size", world_size)
    check_whole("batch_size", batch_size)
    mesh = Mesh(dp=dp, tp=tp, pp=pp, cp=cp, dp_replicate=dp_replicate)
    mesh.check(world_size)
    config = preset("tiny", **overrides)
    mesh.check_model(config, batch_size=batch_size, num_microbatches=num_microbatches, seq_len=seq_len)
    return Job(config, mesh, seq_len=seq_len, micro_batch_size=batch_size // (mesh.dp * num_microbatches),
               num_microbatches=num_microbatches, zero_stage=zero_stage, sequence_parallel=sequence_parallel,
               num_chunks=num_chunks, schedule=schedule).check()


def _named_parameters(stage, data_parallel, zero_stage) -> dict[str, torch.Tensor]:
    """This rank's pieces by name, on the CPU; ZeRO-3 keeps only shards: gather them whole (a collective)."""
    if zero_stage != 3:
        return {name: p.detach().cpu() for name, p in stage.named_parameters()}
    flat = data_parallel.full_parameters().cpu()
    named = dict(stage.named_parameters())
    pieces = flat.split([p.numel() for p in named.values()])
    return {name: piece.view(p.shape) for (name, p), piece in zip(named.items(), pieces)}


def global_losses(results: list[dict]) -> list[float]:
    """The whole batch's loss at each step: the mean of the last stage's losses over the dp ranks (the tp
    ranks of a stage compute the same loss)."""
    last = [r for r in results if r["losses"][0] is not None and r["coords"]["tp"] == 0]
    return [sum(r["losses"][step] for r in last) / len(last) for step in range(len(last[0]["losses"]))]


def max_parameter_gap(results: list[dict], reference: dict[str, torch.Tensor]) -> float:
    """Largest |difference| between any rank's parameter pieces and the same slices of the unsplit model's
    ``reference`` state_dict. A TP piece is the tp_rank-th equal slice along the one dim where shapes differ."""
    gap = 0.0
    for result in results:
        tp_rank = result["coords"]["tp"]
        for name, piece in result["params"].items():
            full = reference[name]
            for dim, (a, b) in enumerate(zip(full.shape, piece.shape)):
                if a != b:
                    full = full.narrow(dim, tp_rank * b, b)
            gap = max(gap, (full - piece).abs().max().item())
    return gap


def train_torch_2d(rank: int, world_size: int, *, dp: int = 2, tp: int = 2, steps: int = 3, batch_size: int = 8,
                   seq_len: int = 16, lr: float = 1e-2, dtype=None, seed: int = 0) -> list[float]:
    """torch's own 2-D version, for comparison: DTensor TP (``parallelize_module``) inside each TP group and
    FSDP2 (``fully_shard``, i.e. ZeRO-3) over the DP groups of a ``init_device_mesh`` ("dp", "tp") mesh. Returns
    the whole batch's loss at each step."""

    warnings.filterwarnings("ignore", category=FutureWarning)   # gloo's reduce_scatter/all_gather notices
    config = preset("tiny")
    mesh = init_device_mesh(device().type, (dp, tp), mesh_dim_names=("dp", "tp"))
    model = build(config, seed=seed, device=device(), dtype=dtype)
    parallelize_module(model, mesh["tp"], dtensor_plan(config))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return _train_with_adam(model, SyntheticTokens(config.vocab_size, seq_len, seed=seed), steps=steps,
                            batch_size=batch_size, lr=lr, rank=mesh["dp"].get_local_rank(), size=dp,
                            group=mesh["dp"].get_group())


def train_torch_hsdp(rank: int, world_size: int, *, dp_shard: int = 2, dp_replicate: int = 2, steps: int = 3,
                     batch_size: int = 8, seq_len: int = 16, lr: float = 1e-2, dtype=None, seed: int = 0) -> dict:
    """torch's own HSDP, for comparison with hsdp.HybridShardedDataParallel: FSDP2's ``fully_shard`` on a 2-D
    ``init_device_mesh`` ("dp_replicate", "dp_shard") mesh shards each layer over the dp_shard ranks of a
    replica and all-reduces across the dp_replicate replicas. Returns the whole batch's loss at each step and
    the parameters this rank holds (its shard of every tensor)."""
    warnings.filterwarnings("ignore", category=FutureWarning)   # gloo's reduce_scatter/all_gather notices
    config = preset("tiny")
    mesh = init_device_mesh(device().type, (dp_replicate, dp_shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = build(config, seed=seed, device=device(), dtype=dtype)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = _train_with_adam(model, SyntheticTokens(config.vocab_size, seq_len, seed=seed), steps=steps,
                              batch_size=batch_size, lr=lr, rank=rank, size=world_size)
    return {"losses": losses, "params_held": sum(p.to_local().numel() for p in model.parameters())}


def _train_with_adam(model, data: SyntheticTokens, *, steps: int, batch_size: int, lr: float, rank: int, size: int,
                     group=None) -> list[float]:
    """torch's Adam for ``steps`` steps, each on this rank's 1/``size`` of the batch (``rank`` of the ``size``
    data-parallel ranks that ``group`` holds). Returns the whole batch's loss at each step: the ranks' mean."""
    optimizer, losses = torch.optim.Adam(model.parameters(), lr=lr), []
    for step in range(steps):
        inputs, targets = (shard(t, rank, size).to(device()) for t in data.batch(step, batch_size))
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        loss = loss.detach()
        dist.all_reduce(loss, group=group)
        losses.append(loss.item() / size)
    return losses
