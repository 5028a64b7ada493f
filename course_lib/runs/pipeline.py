"""Pipeline runs (notebook 05, lab pipeline_parallel, tests, benchmarks): one step of the tiny model on
``world_size`` stages, in controlled cost or real compute; the same step in one process; torch's own."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from ..comm import Comm
from ..data import SyntheticTokens
from ..launch import device
from ..model import GPT, build, preset
from ..model import loss_fn as default_loss_fn
from ..pipeline_parallel import StepRecorder, make_stage, partition_layers, pipeline_step, split_microbatches


def pipeline_worker(rank: int, world_size: int, *, num_microbatches: int, schedule="1f1b", num_layers: int = 4,
                    batch_size: int = 8, seq_len: int = 16, forward_ms=None, layer_ms=None,
                    backward_ratio: float = 1.0, balance: bool = False, dtype=None, seed: int = 0,
                    steps: int = 1, compute: bool = True, return_grads: bool = False, measure_memory: bool = True,
                    weights: dict | None = None, **overrides) -> dict:
    """One pipeline step of the tiny model on ``world_size`` stages, for ``launch``. Controlled cost:
    ``forward_ms`` (every stage, or one per stage) or ``layer_ms`` (one per layer, summed per stage), with
    t_b = backward_ratio·t_f; ``compute=False`` skips the model then (ops only sleep: for many ranks on few
    cores). ``balance`` cuts the layers by ``layer_ms`` instead of by count. A first
    step with one micro-batch and no padding warms up (first calls, connections) and is not measured; then
    ``steps`` measured steps, of which the fastest is returned.
    ``weights``: the whole model's state_dict, built once by the caller with build(config, seed), so that the
    ranks copy it instead of each drawing it (the same numbers either way)."""
    config = preset("tiny", num_layers=num_layers, **overrides)
    parts = partition_layers(num_layers, world_size, layer_ms if balance else None)
    if weights is None:
        model = build(config, seed=seed, device=device(), dtype=dtype)
    else:
        model = GPT(config)
        model.load_state_dict(weights)
        model.to(device=device(), dtype=dtype)
    stage = make_stage(model, rank, parts)
    inputs, targets = SyntheticTokens(config.vocab_size, seq_len, seed=seed).batch(0, batch_size)
    split_microbatches(inputs, num_microbatches)   # a clear error before any rank waits for another
    forward_s = backward_s = None                     # per stage, in seconds; None: real compute only
    if layer_ms is not None:
        forward_s = [sum(layer_ms[i] for i in part) / 1e3 for part in parts]
    elif forward_ms is not None:
        per_stage = forward_ms if isinstance(forward_ms, (list, tuple)) else [forward_ms] * world_size
        forward_s = [f / 1e3 for f in per_stage]
    if forward_s is not None:
        backward_s = [f * backward_ratio for f in forward_s]
    if not compute:
        stage = _StandIn(stage, last=rank == world_size - 1)
    comm = Comm()
    pipeline_step(stage, comm, inputs, targets, num_microbatches=1)
    tries = []
    for _ in range(steps):
        stage.zero_grad()
        recorder = StepRecorder(stage, forward_s and forward_s[rank], backward_s and backward_s[rank],
                                measure_memory=measure_memory)
        with comm.trace() as log:
            tries.append(pipeline_step(stage, comm, inputs, targets, num_microbatches=num_microbatches,
                                       schedule=schedule, recorder=recorder))
        tries[-1]["sent_bytes"] = sum(r.payload_bytes for r in log.records if r.op == "send")
    # Best of `steps`, as timeit does: a busy machine only ever delays an op, never hurries one. Every rank
    # keeps the same step: the one with the shortest makespan over all ranks. (Every step computes the same
    # loss and gradients: the grads returned are the last step's.)
    spans = torch.tensor([[max(e.end for e in t["events"]), -min(e.start for e in t["events"])] for t in tries])
    comm.all_reduce(spans, op=torch.distributed.ReduceOp.MAX)
    result = tries[int(spans.sum(dim=1).argmin())]
    result.update(parts=parts, forward_s=forward_s, backward_s=backward_s)
    if return_grads:
        result["grads"] = {name: p.grad.clone() for name, p in stage.named_parameters()}
    return result


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


def torch_pipeline_step(stage_module: nn.Module, rank: int, world_size: int, inputs, targets, *,
                        num_microbatches: int, schedule: str = "1f1b") -> float | None:
    """The same step with torch.distributed.pipelining; returns the batch's loss on the last stage."""

    stage = PipelineStage(stage_module, rank, world_size, device())
    Schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    runner = Schedule(stage, n_microbatches=num_microbatches, loss_fn=default_loss_fn)  # grads scaled by 1/m
    if rank == 0:
        runner.step(inputs.to(device()))
    elif rank == world_size - 1:
        losses = []
        runner.step(target=targets.to(device()), losses=losses)
        return torch.stack(losses).mean().item()
    else:
        runner.step()
    return None
