"""Pipeline parallelism (流水线并行): the model cut into stages by layers, micro-batches flowing through.

    stage 0: embed + layers[0:6]  ── activations ──►  stage 1: layers[6:12] + norm + head + loss
                                  ◄── their gradients ──

Each rank holds one stage: a contiguous run of layers, the embedding with the first, the final norm and the
head with the last (`make_stage` replaces the rest with nn.Identity(), so parameter names stay those of the
whole model). Forward: stage s receives stage s-1's output, runs its layers, sends the result to s+1.
Backward: stage s receives dL/d(its output) from s+1, backpropagates, sends dL/d(its input) to s-1. Nothing
else crosses a boundary: per boundary and step, an activation and its gradient for every token of the batch,
2·B·S·d values, whatever the number of micro-batches.

The bubble (流水线气泡)
----------------------
A batch of B rows is cut into m micro-batches of B/m rows. With p stages and every forward taking t_f and
every backward t_b, GPipe (all forwards, then all backwards) and 1F1B (after p-s-1 warm-up forwards, one
forward then one backward) both take

    makespan T = (m + p - 1)·(t_f + t_b)

Every rank computes for m·(t_f + t_b) of it and waits (p - 1)·(t_f + t_b): the fill before its first forward
plus the drain after its last backward. Hence

    bubble = (p - 1) / (m + p - 1)            utilisation = 1 - bubble = m / (m + p - 1)

p = 8: m = 8, 32, 64 → 46.7%, 17.9%, 9.9%.  p = 2: utilisation 1/2, 4/5, 16/17 at m = 1, 4, 16.

Measured idle fraction. Every forward and backward of every micro-batch is timed on its rank: it starts once
its input has arrived and ends when its output is ready (a `Timeline` holds these events). T is the span from
the first start to the last end over all ranks; busy_r is the sum of rank r's op durations; rank r's idle
fraction is 1 - busy_r / T, and the pipeline's measured bubble is their mean, 1 - Σ_r busy_r / (p·T). With
equal op costs this is exactly the formula above. With unequal stages the slowest one sets the pace and the
others idle longer; `simulate` predicts any case, and `partition_layers(..., layer_costs)` cuts the layers so
that the most expensive stage is as cheap as possible.

Memory. A stage keeps a micro-batch's saved activations from its forward until its backward. GPipe holds all
m before its first backward; 1F1B starts backwards as soon as the pipe is full, so stage s holds at most
min(p - s, m): the same bubble, at most p micro-batches in flight instead of m.

Hand-offs. A message takes a latency h to arrive. GPipe pays it once per boundary on the way down and once on
the way back (a stage's ops then run back to back); in 1F1B's steady state every op waits for a neighbour, so
h is paid at every op. `simulate(..., latency_s=h)` predicts both.

More schedules (course_lib/schedules.py): interleaved 1F1B, v chunks per rank (`make_stage(..., num_chunks=v)`),
bubble (p - 1)/(v·m + p - 1) for v times the messages; ZB-H1, each backward split into B (the input's gradient,
sent at once) and W (the weights', deferred into the drain), idle (p - 1)·(T_F + T_B - T_W) where 1F1B idles
(p - 1)·(T_F + T_B + T_W). `simulate` and `pipeline_step` run them all: actions ("F"|"B"|"W", k[, chunk]).

Controlled cost. A `StepRecorder` given forward_s / backward_s pads every op with sleep to exactly that
duration (the real compute runs inside it; `pipeline_worker(compute=False)` swaps in a stage that computes
nothing, so the op only sleeps and zeros of the right shape travel), so bubbles are measured cleanly even on a
busy 2-core CPU: a sleeping rank uses no core. Without them the ops take what they take. The schedule loop is
the same either way; the recorder only watches it (and counts the bytes each forward saves for backward).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .comm import Comm
from .measure import SavedActivations
from .model import loss_fn as default_loss_fn
from .recompute import kept_during
from .schedules import SCHEDULES as SCHEDULES
from .schedules import gpipe_actions as gpipe_actions
from .schedules import needs_from, op_parts, schedule_actions, sends_to, splits_backward
from .schedules import one_f_one_b_actions as one_f_one_b_actions


def bubble_fraction(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> float:
    """(p - 1) / (v·m + p - 1): the share of the makespan each rank waits, with equal op costs; v = num_chunks
    per rank (interleaved 1F1B; 1 for GPipe and 1F1B). Megatron-LM's papers divide the same idle time by the
    ideal time m·(t_f + t_b) instead: (p - 1)/(v·m); the two convert as b = b_ideal / (1 + b_ideal)."""
    if min(num_stages, num_microbatches, num_chunks) < 1:
        raise ValueError(f"num_stages={num_stages}, num_microbatches={num_microbatches} and num_chunks={num_chunks} "
                         "must all be >= 1")
    return (num_stages - 1) / (num_chunks * num_microbatches + num_stages - 1)


def pipeline_makespan(num_stages: int, num_microbatches: int, forward_s: float, backward_s: float,
                      num_chunks: int = 1) -> float:
    """(m + (p - 1)/v)·(t_f + t_b): a step with equal op costs and instant messages (t_f, t_b: a rank's whole
    forward and backward of a micro-batch; each of its v chunks takes 1/v)."""
    return (num_chunks * num_microbatches + num_stages - 1) * (forward_s + backward_s) / num_chunks


# ---------------------------------------------------------------------------------------------- stages

def partition_layers(num_layers: int, num_stages: int, layer_costs=None, num_chunks: int = 1) -> list[range]:
    """Contiguous layer ranges, one per stage, that make the most expensive stage as cheap as possible.

    Without ``layer_costs`` every layer costs the same, so stages differ by at most one layer (earlier stages
    take the extra ones: the last also holds the head). With costs, dynamic programming over (stages, layers).
    ``num_chunks`` = v: cut into p·v virtual stages instead (interleaved schedules, `make_stage`).
    """
    if num_stages < 1 or num_chunks < 1:
        raise ValueError(f"num_stages={num_stages} and num_chunks={num_chunks} must be >= 1")
    if num_stages * num_chunks > num_layers:
        if num_chunks == 1:
            raise ValueError(f"num_stages={num_stages} > num_layers={num_layers}: every stage needs at least one "
                             "layer (use fewer stages, or a model with more layers)")
        raise ValueError(f"num_stages={num_stages} × num_chunks={num_chunks} = {num_stages * num_chunks} virtual "
                         f"stages > num_layers={num_layers}: every virtual stage needs at least one layer (use "
                         "fewer stages or chunks, or a model with more layers)")
    num_stages *= num_chunks
    if layer_costs is None:   # the first num_layers % num_stages stages one layer more, as picotron splits them
        per_stage, extra = divmod(num_layers, num_stages)
        bounds = [stage * per_stage + min(stage, extra) for stage in range(num_stages + 1)]
        return [range(start, end) for start, end in zip(bounds, bounds[1:])]
    costs = [float(c) for c in layer_costs]
    if len(costs) != num_layers or any(c < 0 for c in costs):
        raise ValueError(f"layer_costs={layer_costs!r}: give one cost >= 0 for each of the {num_layers} layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[s][i]: the smallest possible max stage cost when layers [0, i) form s stages; cut[s][i]: the
    # start of the last of those stages.
    best = [[math.inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, num_layers - (num_stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost <= best[s][i] + 1e-12:   # "<=": on ties the last stage starts later (is shorter)
                    best[s][i], cut[s][i] = cost, j
    bounds = [num_layers]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def make_stage(model: nn.Module, stage: int, parts: list[range], num_chunks: int = 1) -> nn.Module:
    """Turn ``model`` (in place) into pipeline stage ``stage`` of ``len(parts)``: it keeps layers
    ``parts[stage]``, the embedding if first, norm and head if last; the rest become nn.Identity().

    ``num_chunks`` = v > 1, for interleaved schedules: ``parts`` cuts the layers into p·v virtual stages
    (partition_layers(..., num_chunks=v)) and rank ``stage`` gets an nn.ModuleList of its v chunks, chunk c
    being virtual stage c·p + stage, as in Megatron-LM; each chunk is a copy of ``model`` cut as above (the last
    is ``model`` itself)."""
    if num_chunks != 1:
        if num_chunks < 1 or len(parts) % num_chunks:
            raise ValueError(f"parts holds {len(parts)} virtual stages: not num_chunks={num_chunks} per stage")
        num_stages = len(parts) // num_chunks
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage={stage} is outside 0..{num_stages - 1}")
        copies = [copy.deepcopy(model) for _ in range(num_chunks - 1)] + [model]
        return nn.ModuleList(make_stage(chunk, c * num_stages + stage, parts) for c, chunk in enumerate(copies))
    num_stages = len(parts)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage} is outside 0..{num_stages - 1}")
    if [i for part in parts for i in part] != list(range(len(model.layers))) or not all(parts):
        raise ValueError(f"parts={parts} must cut layers 0..{len(model.layers) - 1} into non-empty consecutive ranges")
    if model.config.tie_embeddings and num_stages > 1:
        raise ValueError("tie_embeddings=True shares head.weight with embed.weight across the first and the last "
                         "stage; this course's pipeline keeps them untied")
    for i in range(len(model.layers)):
        if i not in parts[stage]:
            model.layers[i] = nn.Identity()
    if stage > 0:
        model.embed = nn.Identity()                    # receives hidden states instead of tokens
    if stage < num_stages - 1:
        model.norm, model.head = nn.Identity(), nn.Identity()
    return model


def split_microbatches(batch: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    if num_microbatches < 1 or batch.shape[0] % num_microbatches:
        raise ValueError(f"a batch of {batch.shape[0]} rows is not divisible by num_microbatches={num_microbatches}: "
                         "micro-batches must be equal, so that the mean of their losses is the batch's loss")
    return list(batch.chunk(num_microbatches))


def stage_chunks(stage_module: nn.Module) -> list[nn.Module]:
    """A rank's chunks: the ModuleList that make_stage(..., num_chunks=v) returns, or [the one stage]."""
    return list(stage_module) if isinstance(stage_module, nn.ModuleList) else [stage_module]


# -------------------------------------------------------------------------------------------- timeline

@dataclass(frozen=True)
class Event:
    rank: int
    kind: str          # "F", "B" or "W"
    microbatch: int
    start: float       # seconds since the step began
    end: float
    chunk: int = 0     # which of the rank's chunks (interleaved schedules)


@dataclass
class Timeline:
    """Every op of one step on every rank, and what each rank held in flight over time."""
    events: list[Event]
    num_stages: int
    num_microbatches: int
    in_flight: dict[int, list[tuple[float, int, int]]] = field(default_factory=dict)  # rank → (time, count, bytes)
    overruns: int = 0  # ops whose real compute took longer than their controlled cost

    @classmethod
    def from_results(cls, results: list[dict]) -> Timeline:
        """Join the results that ``pipeline_worker`` returned on each rank."""
        return cls([e for r in results for e in r["events"]], len(results), results[0]["num_microbatches"],
                   {r["rank"]: r["in_flight"] for r in results}, sum(r["overruns"] for r in results))

    @property
    def makespan(self) -> float:
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy(self, rank: int) -> float:
        return sum(e.end - e.start for e in self.events if e.rank == rank)

    def idle_fraction(self, rank: int) -> float:
        return 1 - self.busy(rank) / self.makespan

    @property
    def idle_fractions(self) -> list[float]:
        return [self.idle_fraction(r) for r in range(self.num_stages)]

    @property
    def bubble(self) -> float:
        """The measured bubble: the mean idle fraction over ranks, 1 - Σ busy / (p·T)."""
        return sum(self.idle_fractions) / self.num_stages

    def peak_in_flight(self, rank: int) -> int:
        return max((count for _, count, _ in self.in_flight.get(rank, [])), default=0)

    def peak_in_flight_bytes(self, rank: int) -> int:
        return max((nbytes for _, _, nbytes in self.in_flight.get(rank, [])), default=0)


def simulate(schedule, num_stages: int, num_microbatches: int, forward_s, backward_s,
             latency_s: float = 0.0, *, num_chunks: int = 1, weight_fraction: float = 0.5) -> Timeline:
    """The timeline ``schedule`` would have if stage s's forwards took forward_s[s] and its backwards
    backward_s[s] (a number means every stage), and every message latency_s to arrive: each op starts as soon
    as its rank is free and its input has arrived. Raises on a deadlock, naming what each stuck stage waits for.
    With v = ``num_chunks``, each chunk's op takes 1/v of its stage's time; a schedule that splits backward
    gives W ``weight_fraction`` of it and B the rest (0.5 with backward_s = 2·forward_s: T_F = T_B = T_W)."""
    p, m, v = num_stages, num_microbatches, num_chunks
    fs = [float(forward_s)] * p if isinstance(forward_s, (int, float)) else [float(f) for f in forward_s]
    bs = [float(backward_s)] * p if isinstance(backward_s, (int, float)) else [float(b) for b in backward_s]
    actions = schedule_actions(schedule, p, m, num_chunks=v)
    split = splits_backward(actions)
    share = {"F": 1.0, "B": 1 - weight_fraction if split else 1.0, "W": weight_fraction}
    done, free, nxt, events = {}, [0.0] * p, [0] * p, []
    held = {s: [(0.0, 0, 0)] for s in range(p)}
    while any(nxt[s] < len(actions[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while nxt[s] < len(actions[s]):
                kind, k, c = op_parts(actions[s][nxt[s]])
                source = needs_from(kind, c * p + s, p * v)      # the virtual stage whose output this op needs
                if source is not None and (kind, source, k) not in done:
                    break
                start = max(free[s], done[kind, source, k] + latency_s if source is not None else 0.0)
                free[s] = done[kind, c * p + s, k] = start + (fs[s] if kind == "F" else bs[s]) * share[kind] / v
                events.append(Event(s, kind, k, start, free[s], c))
                change = {"F": 1, "B": 0 if split else -1, "W": -1}[kind]   # held from F to its last backward op
                held[s].append((free[s], held[s][-1][1] + change, 0))
                nxt[s], progressed = nxt[s] + 1, True
        if not progressed:
            waits = [f"stage {s} waits at {actions[s][nxt[s]]}" for s in range(p) if nxt[s] < len(actions[s])]
            raise ValueError("deadlock: " + "; ".join(waits))
    return Timeline(events, p, m, held)


# -------------------------------------------------------------------------------------------- executor

class StepRecorder:
    """Watches one rank's step from outside the schedule loop: times every op (an `Event` each), counts the
    bytes each forward saves for backward and so what the stage holds in flight, and, given ``forward_s`` /
    ``backward_s`` (and ``weight_s`` for W ops), pads every op with sleep to exactly that cost (controlled cost;
    ``overruns`` counts ops whose real compute took longer). ``pipeline_step`` wraps each op in
    ``recorder.op(kind, k, chunk)``. A micro-batch is held from its forward until its backward, or its W when
    the schedule splits backward (B keeps the graph for W)."""

    def __init__(self, stage_module: nn.Module, forward_s: float | None = None, backward_s: float | None = None,
                 measure_memory: bool = False, weight_s: float | None = None):
        self.stage_module, self.measure_memory = stage_module, measure_memory
        self.cost = {"F": forward_s, "B": backward_s, "W": weight_s}
        self.device = next(stage_module.parameters()).device
        self.in_flight = [(0.0, 0, 0)]   # (time, micro-batches held, their saved bytes) after each op
        self.saved: dict[tuple[int, int], int] = {}  # (micro-batch, chunk) → bytes its forward saved, until freed
        self.events, self.overruns, self.stage, self.t0, self.split_backward = [], 0, None, None, False

    def start(self, stage: int, split_backward: bool = False) -> None:
        self.stage, self.t0, self.split_backward = stage, time.perf_counter(), split_backward

    @contextlib.contextmanager
    def op(self, kind: str, k: int, chunk: int = 0):
        measured = kind == "F" and self.measure_memory
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # a received tensor has arrived: waiting for it is idle, not the op
        start = time.perf_counter()
        with SavedActivations(self.stage_module) if measured else contextlib.nullcontext() as saved, \
                kept_during(self.stage_module) as kept:       # (recompute="op" keeps outputs in the checkpoint)
            yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # GPU work is asynchronous: the op is done when the device is
        if self.cost[kind] is not None:
            left = start + self.cost[kind] - time.perf_counter()
            if left > 0:
                time.sleep(left)
            self.overruns += left < 0
        end = time.perf_counter()
        if kind == "F":
            self.saved[k, chunk] = saved.bytes + kept["bytes"] if measured else 0
        elif kind == "W" or not self.split_backward:
            self.saved.pop((k, chunk))
        self.events.append(Event(self.stage, kind, k, start - self.t0, end - self.t0, chunk))
        self.in_flight.append((end - self.t0, len(self.saved), sum(self.saved.values())))

    def result(self) -> dict:
        return {"events": self.events, "in_flight": self.in_flight, "overruns": self.overruns, "t0": self.t0}


def pipeline_step(stage_module: nn.Module, comm: Comm, inputs: torch.Tensor, targets: torch.Tensor, *,
                  num_microbatches: int, schedule="1f1b", loss_fn=None, recorder: StepRecorder | None = None) -> dict:
    """This rank's part of one step: its stage's forwards and backwards in ``schedule``'s order. Gradients
    accumulate in .grad (zero them first; no optimizer step). Stage = ``comm.rank``; every rank passes the
    batch's inputs and targets (the first stage reads the inputs, the last the targets). ``stage_module``: this
    rank's stage, or its v chunks (make_stage(..., num_chunks=v)) for an interleaved schedule. Returns {"rank",
    "num_microbatches", "loss" (the batch's mean loss, on the last stage; else None), and the recorder's
    "events", "in_flight", "overruns", "t0" (this rank's perf_counter at the step's start)}.

    ``loss_fn``: by default the last stage's own (``loss_fn``, set by apply_tp(..., vocab_parallel=True)), else
    model.loss_fn. Under sequence parallelism (apply_tp(..., sequence_parallel=True) before make_stage) the stages
    pass each other this rank's slice of the sequence, [B/m, S/tp, d]: 1/tp of the bytes (Narayanan et al. 2021's
    scatter/gather; the next stage's first all-gather, before its attention, makes it whole where needed).
    Messages: `_receive`; backward, whole or split into B and W: `_backward`.
    """
    chunks = stage_chunks(stage_module)
    stage, num_stages, m = comm.rank, comm.size, num_microbatches
    num_virtual = num_stages * len(chunks)        # chunk c of this rank is virtual stage c·p + stage
    input_chunks, target_chunks = split_microbatches(inputs, m), split_microbatches(targets, m)
    actions = schedule_actions(schedule, num_stages, m, num_chunks=len(chunks))
    split = splits_backward(actions)
    loss_fn = loss_fn or getattr(chunks[-1], "loss_fn", default_loss_fn)
    param = next(stage_module.parameters())
    rows, seq = input_chunks[0].shape
    if getattr(chunks[0], "sequence_parallel", False):
        seq //= chunks[0].tp_size              # SP: this rank's slice of the sequence crosses the boundary
    boundary = dict(size=(rows, seq, chunks[0].config.hidden), dtype=param.dtype,
                    device=param.device)       # an activation [B/m, S, d], and its gradient: one shape
    recorder = recorder or StepRecorder(stage_module)
    held = {}              # (micro-batch, chunk) → (its input, its output, its output's gradient once B has it)
    outgoing, in_transit, loss = [], [], 0.0    # to post with the next receive; posted, not yet waited for
    comm.barrier()                  # every rank starts its clock together (to within a message's latency)
    recorder.start(stage, split_backward=split)
    for kind, k, c in map(op_parts, actions[stage]):
        virtual = c * num_stages + stage
        source = needs_from(kind, virtual, num_virtual)     # the virtual stage whose output this op needs
        incoming = _receive(comm, outgoing, in_transit, source, num_stages, boundary)
        outgoing = []
        with recorder.op(kind, k, c):
            if kind == "F":
                x = input_chunks[k].to(param.device) if virtual == 0 else incoming.requires_grad_()
                out = chunks[c](x)
                if virtual == num_virtual - 1:   # each micro-batch's mean loss / m: grads sum to the batch mean's
                    out = loss_fn(out, target_chunks[k].to(param.device)) / m
                    loss += math.nan if out.is_meta else out.item()   # a meta tensor has no value
                held[k, c] = (x, out, None)
            else:
                input_grad = _backward(kind, held, (k, c), incoming, split, virtual > 0, chunks[c])
        target = sends_to(kind, virtual, num_virtual)
        if target is not None:
            outgoing = [(out.detach() if kind == "F" else input_grad, target % num_stages)]
    in_transit += zip(outgoing, comm.exchange(sends=outgoing))
    for _, work in in_transit:                  # (the pairs keep each sent tensor alive until it has left)
        work.wait()
    return {"rank": stage, "num_microbatches": m, "loss": loss if stage == num_stages - 1 else None,
            **recorder.result()}


def _receive(comm: Comm, outgoing: list, in_transit: list, source: int | None, num_stages: int, boundary: dict):
    """Post ``outgoing`` (what the previous op produced for a neighbour) and the receive of this op's input from virtual
    stage ``source`` (None: none) as one batch, `Comm.exchange` (torch's batch_isend_irecv); wait for the input only
    (the rank's idle time) and return it. Sends complete in the background (``in_transit``), waited for at the end of
    the step. Everything is posted from this thread, as Megatron-LM and picotron do, so the same code runs on gloo and
    NCCL. NCCL runs a batch as one group: in 1F1B's steady state two neighbours send to each other at the same moment,
    and posted one by one each send would wait for a receive queued behind the other's send."""
    incoming = torch.empty(**boundary) if source is not None else None
    works = comm.exchange(sends=outgoing, recvs=[] if source is None else [(incoming, source % num_stages)])
    in_transit += zip(outgoing, works)
    if source is not None:
        works[-1].wait()                    # idle until the neighbour's tensor has arrived
    return incoming


def _backward(kind: str, held: dict, key: tuple, incoming, split: bool, has_input_grad: bool, chunk: nn.Module):
    """Backward op ``kind`` ("B" or "W") of ``key`` = (micro-batch, chunk), on what ``held`` keeps of it; returns
    dL/dx to send upstream (None for W, and for B on the first virtual stage: ``has_input_grad`` False).
    Split backward: B runs torch.autograd.grad(out, x, grad, retain_graph=True), dL/dx, sent upstream at once; W,
    later, torch.autograd.backward(out, grad, inputs=the chunk's parameters) on the graph B kept. Simplest and
    honest, not cheapest: W walks the graph again, recomputing B's activation gradients (B + W ≈ 1.5 backwards),
    and the graph lives until W (torch and the paper keep B's intermediate gradients: W then does only the weight
    products). On the first virtual stage, with no input gradient to send, B does nothing and W all of it."""
    if kind == "B" and not split:
        x, out, _ = held.pop(key)
        torch.autograd.backward(out, incoming)   # dL/d(out) from the next virtual stage (None: the loss)
        return x.grad
    if kind == "W":
        x, out, output_grad = held.pop(key)
        torch.autograd.backward(out, output_grad, inputs=list(chunk.parameters()))
        return None
    x, out, _ = held[key]
    held[key] = (x, out, incoming)      # for W (.contiguous(): autograd may return an expanded view)
    return torch.autograd.grad(out, x, incoming, retain_graph=True)[0].contiguous() if has_input_grad else None
