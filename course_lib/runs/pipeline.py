"""Pipeline runs (notebook 05, lab pipeline_parallel, tests, benchmarks): one step of the tiny model on
``world_size`` stages, in controlled cost or real compute; the same step in one process; torch's own."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from ..comm import Comm
from ..data import SyntheticTokens
from ..model import GPT, build, preset
from ..model import loss_fn as default_loss_fn
from ..pipeline_parallel import (
    StepRecorder,
    make_stage,
    partition_layers,
    pipeline_step,
    schedule_actions,
    split_microbatches,
    splits_backward,
    stage_chunks,
)
from ..runtime.launch import device


def pipeline_worker(rank: int, world_size: int, *, num_microbatches: int, schedule="1f1b", num_layers: int = 4,
                    batch_size: int = 8, seq_len: int = 16, forward_ms=None, layer_ms=None,
                    backward_ratio: float = 1.0, balance: bool = False, dtype=None, seed: int = 0,
                    steps: int = 1, compute: bool = True, return_grads: bool = False, measure_memory: bool = True,
                    weights: dict | None = None, num_chunks: int = 1, weight_fraction: float = 0.5,
                    **overrides) -> dict:
    """One pipeline step of the tiny model on ``world_size`` stages, for ``launch``. Controlled cost:
    ``forward_ms`` (every stage, or one per stage) or ``layer_ms`` (one per layer, summed per stage), with
    t_b = backward_ratio·t_f; ``compute=False`` skips the model then (ops only sleep: for many ranks on few
    cores). ``balance`` cuts the layers by ``layer_ms`` instead of by count. ``num_chunks`` = v: each rank
    holds v chunks (interleaved schedules), each op costing 1/v of the stage's time; a schedule that splits
    backward gives W ``weight_fraction`` of t_b and B the rest. A first step, unpadded, warms up (first calls,
    connections) and is not measured; then ``steps`` measured steps, of which the fastest is returned.
    ``weights``: the whole model's state_dict, built once by the caller with build(config, seed), so that the
    ranks copy it instead of each drawing it (the same numbers either way)."""
    config = preset("tiny", num_layers=num_layers, **overrides)
    if layer_ms is not None and num_chunks != 1:
        raise ValueError(f"layer_ms gives one cost per stage; with num_chunks={num_chunks} give forward_ms")
    parts = partition_layers(num_layers, world_size, layer_ms if balance else None, num_chunks=num_chunks)
    if weights is None:
        model = build(config, seed=seed, device=device(), dtype=dtype)
    else:
        model = GPT(config)
        model.load_state_dict(weights)
        model.to(device=device(), dtype=dtype)
    stage = make_stage(model, rank, parts, num_chunks=num_chunks)
    inputs, targets = SyntheticTokens(config.vocab_size, seq_len, seed=seed).batch(0, batch_size)
    split_microbatches(inputs, num_microbatches)   # a clear error before any rank waits for another
    split = splits_backward(schedule_actions(schedule, world_size, num_microbatches, num_chunks=num_chunks))
    costs = _op_costs(rank, parts, forward_ms, layer_ms, backward_ratio, weight_fraction, num_chunks, split)
    if not compute:
        stage = _stand_ins(stage, rank, world_size)
    comm = Comm()
    pipeline_step(stage, comm, inputs, targets, num_microbatches=num_microbatches, schedule=schedule)
    tries = []
    for _ in range(steps):
        stage.zero_grad()
        recorder = StepRecorder(stage, costs["F"], costs["B"], measure_memory=measure_memory, weight_s=costs["W"])
        with comm.trace() as log:
            tries.append(pipeline_step(stage, comm, inputs, targets, num_microbatches=num_microbatches,
                                       schedule=schedule, recorder=recorder))
        tries[-1]["sent_bytes"] = sum(r.payload_bytes for r in log.records if r.op == "send")
        tries[-1]["messages"] = sum(r.op == "send" for r in log.records)
    # Best of `steps`, as timeit does: a busy machine only ever delays an op, never hurries one. Every rank
    # keeps the same step: the one with the shortest makespan over all ranks. (Every step computes the same
    # loss and gradients: the grads returned are the last step's.)
    spans = torch.tensor([[max(e.end for e in t["events"]), -min(e.start for e in t["events"])] for t in tries],
                         device=device())                  # NCCL reduces GPU tensors only
    comm.all_reduce(spans, op=torch.distributed.ReduceOp.MAX)
    result = tries[int(spans.sum(dim=1).argmin())]
    result.update(parts=parts, costs=costs)
    if return_grads:
        result["grads"] = {name: p.grad.clone() for chunk in stage_chunks(stage)
                           for name, p in chunk.named_parameters()}
    return result



def _op_costs(rank: int, parts: list, forward_ms, layer_ms, backward_ratio: float, weight_fraction: float,
              num_chunks: int, split: bool) -> dict:
    """Rank ``rank``'s seconds per op, {"F", "B", "W"}; None for each when no cost is given (real compute only).

    t_F is the sum of ``layer_ms`` over the rank's layers (``parts[rank]``), or else its ``forward_ms`` / v; then
    t_B = backward_ratio·t_F·(1 − weight_fraction) and t_W = backward_ratio·t_F·weight_fraction when the
    schedule ``split``s backward (otherwise B is the whole backward_ratio·t_F)."""
    costs = {"F": None, "B": None, "W": None}
    if layer_ms is not None:
        costs["F"] = sum(layer_ms[i] for i in parts[rank]) / 1e3
    elif forward_ms is not None:
        costs["F"] = (forward_ms[rank] if isinstance(forward_ms, (list, tuple)) else forward_ms) / num_chunks / 1e3
    if costs["F"] is not None:
        costs["B"] = costs["F"] * backward_ratio * ((1 - weight_fraction) if split else 1)
        costs["W"] = costs["F"] * backward_ratio * weight_fraction
    return costs


class _StandIn(nn.Module):
    """``compute=False``: a stage that does no work, for many ranks on few cores. Zeros of the shape the real
    stage would output travel (logits on the last stage, so the loss is ln V), tied to the input and to one
    parameter so that backward runs and sends a gradient of the right shape; the ops' time is all padding."""
    def __init__(self, stage: nn.Module, last: bool):
        super().__init__()
        self.config, self.last = stage.config, last
        param = next(stage.parameters())
        self.anchor = nn.Parameter(torch.zeros((), dtype=param.dtype, device=param.device))

    def forward(self, x):
        width = self.config.vocab_size if self.last else self.config.hidden
        out = torch.zeros(*x.shape[:2], width, dtype=self.anchor.dtype, device=self.anchor.device) + self.anchor
        return out + 0 * x.sum() if x.is_floating_point() else out


def _stand_ins(stage: nn.Module, rank: int, world_size: int) -> nn.Module:
    """A stand-in for each of the rank's chunks (the last virtual stage outputs logits)."""
    chunks = stage_chunks(stage)
    last = len(chunks) * world_size - 1
    stand_ins = [_StandIn(chunk, last=c * world_size + rank == last) for c, chunk in enumerate(chunks)]
    return nn.ModuleList(stand_ins) if isinstance(stage, nn.ModuleList) else stand_ins[0]


def pipeline_sweep(rank: int, world_size: int, *, runs: list[dict], **common) -> list[dict]:
    """Several ``pipeline_worker`` runs in one launch: [pipeline_worker(**common, **run) for run in runs]."""
    return [pipeline_worker(rank, world_size, **{**common, **run}) for run in runs]


def single_process_step(*, num_layers: int = 4, batch_size: int = 8, seq_len: int = 16, dtype=None, seed: int = 0,
                        **overrides) -> tuple[float, dict[str, torch.Tensor]]:
    """The reference: the whole model in one process on the same batch → (loss, {name: grad})."""
    config = preset("tiny", num_layers=num_layers, **overrides)
    model = build(config, seed=seed, dtype=dtype)
    inputs, targets = SyntheticTokens(config.vocab_size, seq_len, seed=seed).batch(0, batch_size)
    loss = default_loss_fn(model(inputs), targets)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                   "zb-h1": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}


def torch_virtual_stages(schedule: str, rank: int, world_size: int, num_chunks: int = 1) -> list[int]:
    """The virtual stages torch's ``schedule`` expects on ``rank``: c·p + rank for chunk c (as ours), except
    ZBV's V shape, rank r holding stages r and 2p - 1 - r (so the first rank also holds the last stage)."""
    if schedule == "zbv":
        return [rank, 2 * world_size - 1 - rank]
    return [c * world_size + rank for c in range(num_chunks)]


def torch_schedule(stage_module: nn.Module, rank: int, world_size: int, *, num_microbatches: int,
                   schedule: str = "1f1b"):
    """torch's ``schedule`` object for this rank's stage, or its chunks (an nn.ModuleList, in
    torch_virtual_stages' order) for the schedules that take several stages per rank: "interleaved"
    (ScheduleInterleaved1F1B), "zb-h1" (ScheduleInterleavedZeroBubble, which with one stage per rank is ZB-H1,
    op for op), "zbv" (ScheduleZBVZeroBubble, two chunks in a V). All of them run on gloo / CPU (torch 2.13)."""
    chunks = stage_chunks(stage_module)
    indices = torch_virtual_stages(schedule, rank, world_size, len(chunks))
    stages = [PipelineStage(chunk, j, world_size * len(chunks), device()) for chunk, j in zip(chunks, indices)]
    Schedule = TORCH_SCHEDULES[schedule]
    one_stage = Schedule in (ScheduleGPipe, Schedule1F1B)
    return Schedule(stages[0] if one_stage else stages, n_microbatches=num_microbatches,
                    loss_fn=default_loss_fn)   # grads scaled by 1/m


def torch_pipeline_step(stage_module: nn.Module, rank: int, world_size: int, inputs, targets, *,
                        num_microbatches: int, schedule: str = "1f1b") -> float | None:
    """The same step with torch.distributed.pipelining; returns the batch's loss on the rank that holds the
    last stage (``schedule`` and ``stage_module``: see torch_schedule)."""
    runner = torch_schedule(stage_module, rank, world_size, num_microbatches=num_microbatches, schedule=schedule)
    indices = torch_virtual_stages(schedule, rank, world_size, len(stage_chunks(stage_module)))
    losses = []
    first = [inputs.to(device())] if 0 in indices else []                 # the first stage takes the inputs
    last_stage = world_size * len(stage_chunks(stage_module)) - 1          # the last the targets
    runner.step(*first, **(dict(target=targets.to(device()), losses=losses) if last_stage in indices else {}))
    return torch.stack(losses).mean().item() if losses else None


def torch_pipeline_worker(rank: int, world_size: int, *, weights: dict, schedule: str, num_microbatches: int,
                          num_chunks: int = 1, batch_size: int = 8, seq_len: int = 16, dtype=torch.float64) -> dict:
    """One torch step of the tiny model (``weights``, in ``dtype``), for ``launch``: the loss (on the rank
    holding the last stage), this rank's gradients by name, and, for the schedules with several stages per
    rank, torch's order of this rank's ops as our actions ("F"|"B"|"W", micro-batch, chunk) (torch's I, the
    input gradient, is our B when W ops follow)."""
    num_chunks = 2 if schedule == "zbv" else num_chunks
    num_layers = len({name.split(".")[1] for name in weights if name.startswith("layers.")})
    model = GPT(preset("tiny", num_layers=num_layers))
    model.load_state_dict(weights)
    model.to(dtype)
    parts = partition_layers(num_layers, world_size, num_chunks=num_chunks)
    indices = torch_virtual_stages(schedule, rank, world_size, num_chunks)
    chunks = [make_stage(copy.deepcopy(model), j, parts) for j in indices]
    stage = nn.ModuleList(chunks) if len(chunks) > 1 else chunks[0]
    planned = torch_schedule(stage, rank, world_size, num_microbatches=num_microbatches, schedule=schedule)
    kinds = {"F": "F", "B": "B", "I": "B", "W": "W"}
    order = [(kinds[a.computation_type.value], a.microbatch_index, indices.index(a.stage_index))
             for a in getattr(planned, "pipeline_order", {}).get(rank, []) if a is not None]
    inputs, targets = SyntheticTokens(model.config.vocab_size, seq_len, seed=0).batch(0, batch_size)
    loss = torch_pipeline_step(stage, rank, world_size, inputs, targets, num_microbatches=num_microbatches,
                               schedule=schedule)
    return {"loss": loss, "order": order, "grads": {name: p.grad for chunk in chunks
                                                    for name, p in chunk.named_parameters()}}
