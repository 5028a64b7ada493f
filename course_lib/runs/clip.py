"""Gradient-norm runs (notebook 10, tests): the global norm over expert parallelism, and torch's clip_grad_norm_
on DTensor parameters, each beside one process's (ZeRO, TP and PP layouts: runs.checkpoint.Trainer(max_norm=...))."""

from __future__ import annotations

import logging
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from ..clip import counted_parameters, global_norm, naive_norm
from ..comm import Comm
from ..data import SyntheticTokens, shard
from ..expert_parallel import apply_ep
from ..mesh import Mesh, make_comms
from ..model import build, loss_fn, preset
from ..tensor_parallel import dtensor_plan

MOE = dict(num_experts=4, top_k=2)


def one_process_norm(config=None, *, batch_size: int = 8, seq_len: int = 16, seed: int = 0) -> float:
    """torch's clip_grad_norm_ (max_norm = inf: it only measures) of one process's gradients for step 0's batch."""
    config = config or preset("tiny")
    model = build(config, seed=seed, dtype=torch.float64)
    inputs, targets = SyntheticTokens(config.vocab_size, seq_len, seed=seed).batch(0, batch_size)
    loss_fn(model(inputs), targets).backward()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()


def expert_parallel_norms(rank: int, world_size: int, *, ep: int = 2, batch_size: int = 8, seq_len: int = 16,
                          seed: int = 0) -> dict:
    """For ``launch``: a mixture-of-experts model, dp = world_size, its experts split over EP groups of ``ep``
    ranks (expert_parallel.apply_ep). Each rank's gradients for its rows of step 0's batch, averaged as training would:
    the shared weights over dp, each expert over its expert-dp replicas (its gradient already holds every EP
    rank's tokens). Returns the global norm, each parameter counted once (clip.counted_parameters), the naive
    one (every rank's squares of all it holds), and how many times the naive one counts a shared weight."""
    config = preset("tiny", **MOE)
    mesh = Mesh(dp=world_size, ep=ep)
    comms = make_comms(mesh, rank)
    model = apply_ep(build(config, seed=seed, dtype=torch.float64), comms["ep"])
    inputs, targets = (shard(t, rank, world_size) for t in SyntheticTokens(config.vocab_size, seq_len, seed=seed)
                       .batch(0, batch_size))
    loss_fn(model(inputs), targets).backward()
    for name, param in model.named_parameters():
        comm = comms["expert_dp"] if ".experts." in name else comms["dp"]
        comm.all_reduce(param.grad)
        param.grad /= world_size          # the mean loss over all dp ranks' rows
    world = Comm()
    counted = [p.grad for _, p in counted_parameters(model, mesh, rank)]
    # how many times the naive sum counts one shared weight's square: the embedding's, summed over every rank
    shared = model.embed.weight.grad.square().sum()
    everywhere = shared.clone()
    world.all_reduce(everywhere)
    return {"norm": global_norm(counted, world).item(), "naive": naive_norm(model, world).item(),
            "shared_counted": (everywhere / shared).item()}


def dtensor_norm(rank: int, world_size: int, *, dp: int = 2, batch_size: int = 8, seq_len: int = 16,
                 seed: int = 0) -> float:
    """For ``launch``: torch's own 2-D layout, as torchtitan's: DTensor TP (``parallelize_module``) inside each TP
    group, FSDP2 (``fully_shard``) over dp, every parameter a DTensor; then torch's clip_grad_norm_ on them. Each
    DTensor's placements say which squares to sum over which ranks (Shard: summed, Replicate: counted once).
    Returns the global norm; the gradients are clipped to norm 1 with torch's clip_grads_with_norm_."""
    warnings.filterwarnings("ignore", category=FutureWarning)   # gloo's reduce_scatter/all_gather notices
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)   # "2 sequential all_reduce"
    config = preset("tiny")
    mesh = init_device_mesh("cpu", (dp, world_size // dp), mesh_dim_names=("dp", "tp"))
    model = build(config, seed=seed, dtype=torch.float64)
    parallelize_module(model, mesh["tp"], dtensor_plan(config))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    inputs, targets = (shard(t, mesh["dp"].get_local_rank(), dp)
                       for t in SyntheticTokens(config.vocab_size, seq_len, seed=seed).batch(0, batch_size))
    loss_fn(model(inputs), targets).backward()
    # clip_grad_norm_ stacks the per-tensor norms, and DTensor refuses to stack tensors of different meshes: the
    # TP-split weights live on (dp, tp), the norms, embedding and head on dp alone. torchtitan's answer: a norm per
    # mesh (torch's get_total_norm: each DTensor reduces its squares over its Shard dims), then combine those.
    by_mesh = {}
    for param in model.parameters():
        by_mesh.setdefault(param.grad.device_mesh, []).append(param)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in params]).full_tensor() for params in by_mesh.values()]
    total = torch.stack(norms).pow(2).sum().sqrt()
    for params in by_mesh.values():                # then torch's clip with that norm, mesh by mesh
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, total)
    return total.item()
