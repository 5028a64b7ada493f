"""Pipeline schedules as action lists: the order in which each rank runs its forwards and backwards.

A schedule gives each stage s (a rank) a list of actions: ("F", k) runs micro-batch k's forward, ("B", k) its
backward. Two more kinds of schedule need more:

* **Interleaved 1F1B (交错调度)**, Megatron-LM's (Narayanan et al. 2021). Each rank holds v model chunks instead
  of one stage: with p ranks the model is cut into p·v virtual stages and rank s holds virtual stages s, s + p,
  s + 2p, … (chunk c of rank s is virtual stage c·p + s, `make_stage(..., num_chunks=v)`). Actions carry the
  chunk: ("F", k, c). A micro-batch now goes round the ranks v times, and each chunk's op costs 1/v of the
  rank's whole forward or backward, so the fill and drain, p - 1 hops, shrink v-fold:

      makespan T = (m + (p - 1)/v)·(t_f + t_b)        bubble = (p - 1)/(v·m + p - 1) of T

  ((p - 1)/(v·m) of the ideal time m·(t_f + t_b), Megatron's convention). The price: every micro-batch crosses
  v·p - 1 boundaries instead of p - 1, so v times the messages (and bytes) per rank, each paying its latency,
  and stage s holds up to (v - 1)·p + 2·(p - s - 1) + 1 chunk-micro-batches (each 1/v of a stage's) in flight.
  Micro-batches go round the ranks in groups of p, so m must be a multiple of p (Megatron's rule).

* **Zero bubble ZB-H1 (零气泡)**, Qi et al. 2023, "Zero Bubble Pipeline Parallelism". A backward does two
  things: the gradient w.r.t. the stage's input (B, which the stage before waits for) and the gradients w.r.t.
  its weights (W, which nobody waits for). ZB-H1 runs B at once, sends its gradient upstream, and defers W to
  fill the drain: stage s runs 1F1B's p - s - 1 warm-up forwards, then F and B in turn, and after its s-th B
  one W (the oldest) after each B; the W's left over run at the end. With op times T_F, T_B, T_W, m >= p
  micro-batches, T_W <= T_F and T_W <= T_B (the paper's setting is T_F = T_B = T_W):

      makespan T = m·(T_F + T_B + T_W) + (p - 1)·(T_F + T_B - T_W)

  against 1F1B's (p - 1)·(T_F + T_B + T_W) of idle time: a third of it when T_F = T_B = T_W. A micro-batch is
  held from its F to its W: s deferred W's plus 1F1B's p - s make every stage hold min(p, m), 1F1B's peak
  (its stage 0's), now on every stage. These are torch's ScheduleInterleaved1F1B and
  ScheduleInterleavedZeroBubble (with one stage per rank) orders, op for op.
"""

from __future__ import annotations

import inspect
from collections import defaultdict


def op_parts(action) -> tuple[str, int, int]:
    """(kind, micro-batch, chunk) of an action: ("F", k) is chunk 0 of a rank that holds one."""
    kind, k, *chunk = action
    return kind, k, chunk[0] if chunk else 0


def needs_from(kind: str, virtual_stage: int, num_virtual_stages: int) -> int | None:
    """The virtual stage whose output this op waits for: the one before for a forward, the one after for a
    backward (its output's gradient); None at the model's ends, and for W (it needs only this rank's own B)."""
    neighbour = {"F": virtual_stage - 1, "B": virtual_stage + 1}.get(kind)
    return neighbour if neighbour is not None and 0 <= neighbour < num_virtual_stages else None


def sends_to(kind: str, virtual_stage: int, num_virtual_stages: int) -> int | None:
    """The virtual stage this op's result goes to: a forward's output to the next, a backward's input
    gradient to the one before; None at the model's ends and for W."""
    neighbour = {"F": virtual_stage + 1, "B": virtual_stage - 1}.get(kind)
    return neighbour if neighbour is not None and 0 <= neighbour < num_virtual_stages else None


def splits_backward(actions) -> bool:
    """Whether these actions split backward into B (input gradient) and W (weight gradients)."""
    return any(op_parts(action)[0] == "W" for stage in actions for action in stage)


# ------------------------------------------------------------------------------------------- schedules

def gpipe_actions(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """All forwards, then all backwards. With one micro-batch: the plain, un-pipelined step."""
    return [("F", k) for k in range(num_microbatches)] + [("B", k) for k in range(num_microbatches)]


def one_f_one_b_actions(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """p-s-1 warm-up forwards, then one forward and one backward in turn, then the remaining backwards."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    actions = [("F", k) for k in range(warmup)]
    for k in range(warmup, num_microbatches):
        actions += [("F", k), ("B", k - warmup)]
    return actions + [("B", k) for k in range(num_microbatches - warmup, num_microbatches)]


def interleaved_actions(stage: int, num_stages: int, num_microbatches: int,
                        num_chunks: int = 2) -> list[tuple[str, int, int]]:
    """Megatron-LM's interleaved 1F1B for rank ``stage`` holding ``num_chunks`` chunks. Forwards go
    depth-first in groups of p micro-batches: micro-batches 0..p-1 through chunk 0, the same through chunk 1,
    …, then the next p. Backwards go the same way from the last chunk down. (v - 1)·p + 2·(p - s - 1) warm-up
    forwards (what fills the pipe before the first backward can return), then one forward and one backward in
    turn, then the backwards left."""
    p, m, v = num_stages, num_microbatches, num_chunks
    if p < 2:
        raise ValueError(f"interleaved 1F1B needs num_stages={p} >= 2: its chunks go round the pipeline's ranks")
    if m % p:
        raise ValueError(f"interleaved 1F1B needs num_microbatches={m} to be a multiple of num_stages={p}: "
                         "micro-batches go round the ranks in groups of p (Megatron-LM's rule)")

    def forward(i):   # this rank's i-th forward
        return "F", (i // (p * v)) * p + i % p, (i // p) % v

    def backward(i):
        return "B", (i // (p * v)) * p + i % p, v - 1 - (i // p) % v

    total = v * m
    warmup = min((v - 1) * p + 2 * (p - stage - 1), total)
    actions = [forward(i) for i in range(warmup)]
    for i in range(total - warmup):
        actions += [forward(warmup + i), backward(i)]
    return actions + [backward(i) for i in range(total - warmup, total)]


def zb_h1_actions(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """ZB-H1: 1F1B's order with each backward split into B (input gradient, sent upstream at once) and W
    (weight gradients). Stage s holds its first s W's back, then runs the oldest one after each B; the s left
    run at the end, where they fill what would have been the drain's bubble."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    actions = [("F", k) for k in range(warmup)]
    for k in range(num_microbatches):           # the k-th backward, after 1F1B's forward while any is left
        if k + warmup < num_microbatches:
            actions.append(("F", k + warmup))
        actions.append(("B", k))
        if k >= stage:
            actions.append(("W", k - stage))
    return actions + [("W", k) for k in range(max(num_microbatches - stage, 0), num_microbatches)]


SCHEDULES = {"gpipe": gpipe_actions, "1f1b": one_f_one_b_actions, "interleaved": interleaved_actions,
             "zb-h1": zb_h1_actions}


def schedule_actions(schedule, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> list[list[tuple]]:
    """Every stage's list of actions, checked. ``schedule``: a name of SCHEDULES or a function
    (stage, num_stages, num_microbatches) -> actions (and a ``num_chunks`` argument, for chunked ones)."""
    make = SCHEDULES.get(schedule) if isinstance(schedule, str) else schedule
    if make is None:
        raise ValueError(f"schedule={schedule!r}: known schedules are {', '.join(SCHEDULES)}")
    p, m, v = num_stages, num_microbatches, num_chunks
    chunked = "num_chunks" in inspect.signature(make).parameters
    if v != 1 and not chunked:
        raise ValueError(f"schedule={schedule!r} runs one chunk per stage: num_chunks={v} needs 'interleaved'")
    actions = [list(make(s, p, m, num_chunks=v) if chunked else make(s, p, m)) for s in range(p)]
    ops = [[op_parts(action) for action in acts] for acts in actions]
    both = sorted((kind, k, c) for kind in "BF" for k in range(m) for c in range(v))
    with_w = sorted(both + [("W", k, c) for k in range(m) for c in range(v)])
    chunks = "" if v == 1 else f" and chunk c in 0..{v - 1}"
    for s, acts in enumerate(ops):
        if sorted(acts) not in (both, with_w):
            raise ValueError(f"stage {s}: {actions[s]} must hold ('F', k) and ('B', k) exactly once for each "
                             f"micro-batch k in 0..{m - 1}{chunks} (and ('W', k) once for each, or never)")
        at = {op: position for position, op in enumerate(acts)}    # each op once (checked above): linear in m
        if any(at["B", k, c] < at["F", k, c] for k in range(m) for c in range(v)):
            raise ValueError(f"stage {s}: {actions[s]} runs a backward before the forward of its micro-batch")
        if any(at["W", k, c] < at["B", k, c] for kind, k, c in acts if kind == "W"):
            raise ValueError(f"stage {s}: {actions[s]} runs a W before the B of its micro-batch")
    # Messages between two ranks are matched in the order they are posted: what a sends to b, in a's order,
    # must be what b receives from a, in b's order.
    n = p * v
    sent, received = defaultdict(list), defaultdict(list)     # keyed by (from, to): neighbours only, not p²
    for s, acts in enumerate(ops):
        for kind, k, c in acts:
            if (target := sends_to(kind, c * p + s, n)) is not None:
                sent[s, target % p].append((kind, k, target))
            if (source := needs_from(kind, c * p + s, n)) is not None:
                received[source % p, s].append((kind, k, c * p + s))
    for a, b in set(sent) | set(received):
        messages = sent[a, b]
        if messages != received[a, b]:
            kind = next(x for x, y in zip(messages, received[a, b]) if x != y)[0]
            raise ValueError(f"stages {a} and {b} order their {kind} micro-batches differently; they cross the "
                             "boundary in one order, so both sides must use it")
    return actions


def zero_bubble_fraction(num_stages: int, num_microbatches: int, forward_s: float = 1.0, input_grad_s: float = 1.0,
                         weight_grad_s: float = 1.0) -> float:
    """ZB-H1's bubble as a share of its makespan, (p-1)(T_F+T_B-T_W) / (m(T_F+T_B+T_W) + (p-1)(T_F+T_B-T_W)),
    for op times T_F, T_B (input gradient), T_W (weight gradients). Exact (the simulator's makespan) when
    m >= p, T_W <= T_F and T_W <= T_B; with T_F = T_B = T_W: (p - 1)/(3m + p - 1)."""
    p, m, f, b, w = num_stages, num_microbatches, forward_s, input_grad_s, weight_grad_s
    if m < p or w > f or w > b:
        raise ValueError(f"the ZB-H1 formula assumes num_microbatches >= num_stages and T_W <= T_F, T_B (got m={m}, "
                         f"p={p}, T_F={f}, T_B={b}, T_W={w}); simulate() times any case")
    idle = (p - 1) * (f + b - w)
    return idle / (m * (f + b + w) + idle)
