"""3-D training runs (notebook 06, lab parallel_3d, tests): the course model on a dp × tp × pp grid of ranks,
and torch's FSDP2 + DTensor TP on a 2-D DeviceMesh beside it."""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from tqdm import tqdm

from ..data import SyntheticTokens, shard
from ..launch import device
from ..measure import measure_state_bytes
from ..mesh import Mesh, make_comms, parallelize_3d
from ..model import build, loss_fn, preset
from ..pipeline_parallel import pipeline_step
from ..tensor_parallel import dtensor_plan


def train_3d(rank: int, world_size: int, *, dp: int = 1, tp: int = 1, pp: int = 1, num_microbatches: int = 2,
             schedule: str = "1f1b", steps: int = 3, batch_size: int = 8, seq_len: int = 16, lr: float = 1e-2,
             dtype=None, seed: int = 0, progress: bool = False, return_params: bool = True, **overrides) -> dict:
    """``steps`` Adam steps of the tiny model on a dp × tp × pp mesh, for ``launch``. Each step: this dp rank's
    share of the batch goes through the pipeline in ``num_microbatches`` micro-batches (TP all-reduces inside
    every layer of the stage), then gradients are averaged over the DP group, then Adam updates this rank's
    pieces. Returns this rank's coordinates, its losses (last stage only), its parameters, its measured state
    bytes, the bytes it sent on each axis in the last step (and how many ops), and each step's seconds.
    ``progress``: a tqdm bar on rank 0; ``return_params=False``: keep the parameters here (for the lab, at scale)."""
    mesh = Mesh(dp=dp, tp=tp, pp=pp)
    mesh.check(world_size)
    config = preset("tiny", **overrides)
    mesh.check_model(config, batch_size=batch_size, num_microbatches=num_microbatches)
    where = mesh.coords(rank)
    comms = make_comms(mesh, rank)

    model = build(config, seed=seed, device=device(), dtype=dtype)   # every rank draws the whole model, keeps its piece
    data_parallel = parallelize_3d(model, mesh, comms, rank)
    stage = data_parallel.module
    optimizer = torch.optim.Adam(stage.parameters(), lr=lr)
    data = SyntheticTokens(config.vocab_size, seq_len, seed=seed)
    losses, seconds = [], []
    step_range = range(steps)
    if progress and rank == 0:
        step_range = tqdm(step_range, desc=f"dp {dp} × tp {tp} × pp {pp}", mininterval=1.0)
    for step in step_range:
        start = time.perf_counter()
        inputs, targets = (shard(t, where["dp"], dp) for t in data.batch(step, batch_size))
        optimizer.zero_grad()
        with comms["tp"].trace() as tp_log, comms["pp"].trace() as pp_log, comms["dp"].trace() as dp_log:
            result = pipeline_step(stage, comms["pp"], inputs, targets, num_microbatches=num_microbatches,
                                   schedule=schedule)
            data_parallel.finish_gradient_sync()   # the mean over the dp ranks' shares: the batch's gradient
        optimizer.step()
        if device().type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        losses.append(result["loss"])
    return {"rank": rank, "coords": where, "losses": losses, "step_seconds": seconds, "backend": dist.get_backend(),
            "params": {name: p.detach().cpu() for name, p in stage.named_parameters()} if return_params else None,
            "state_bytes": measure_state_bytes(stage, optimizer),
            "sent_bytes": {"tp": tp_log.wire_bytes, "pp": pp_log.wire_bytes, "dp": dp_log.wire_bytes},
            "ops": {axis: {op: t.count for op, t in log.summary().items()}
                    for axis, log in (("tp", tp_log), ("pp", pp_log), ("dp", dp_log))}}


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
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    data = SyntheticTokens(config.vocab_size, seq_len, seed=seed)
    dp_rank, losses = mesh["dp"].get_local_rank(), []
    for step in range(steps):
        inputs, targets = (shard(t, dp_rank, dp).to(device()) for t in data.batch(step, batch_size))
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        loss = loss.detach()
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        losses.append(loss.item() / dp)
    return losses
