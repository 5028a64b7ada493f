"""Failures at scale (故障): how often a big job loses a rank, how often to checkpoint, how a slow rank shows.

How often. Failures of independent GPUs (and their hosts, links, ...) add up: a job on N GPUs, each failing at rate
λ, fails at rate N·λ, so its mean time between failures (MTBF, 平均故障间隔) is M = 1/(N·λ). The Llama 3 paper
(Dubey et al. 2024, §3.3.4) reports 419 unexpected interruptions in 54 days of pre-training on 16,384 H100 GPUs:
λ = 419 / (54 days · 16,384 GPUs), and a 1,024-GPU job then fails every 54·16,384/(419·1,024) = 2.06 days.

How often to checkpoint (Young 1974, Daly 2006). Writing a checkpoint stalls training for δ seconds; a failure
loses the work since the last checkpoint (on average half an interval τ) plus the restart R (reschedule, reload).
The share of the run lost is

    waste(τ) = δ/τ + (τ/2 + R)/M          (checkpoint overhead + expected lost work and restarts per second)

d/dτ = 0 gives Young's interval τ* = sqrt(2·δ·M), where both terms of δ/τ + τ/(2M) are equal. Daly's higher-order
estimate, τ* = sqrt(2δM)·(1 + sqrt(δ/(2M))/3 + δ/(18M)) - δ (for δ < 2M), differs by well under 1% when δ ≪ M.
Checkpointing every step of a 1,000-GPU run costs δ/t_step of the run (a bad smell); asynchronous saving
(dcp.async_save) shrinks δ to the in-memory copy, and τ* shrinks with sqrt(δ).

Stragglers (掉队者). In a synchronous step every collective waits for its slowest member: one slow rank makes
every rank's step slow, so step times alone do not say which rank it is. What a rank spends *outside*
collectives (its compute) does: the straggler computes longest and waits least (straggler_report).
"""

from __future__ import annotations

import math
import statistics

from .runtime.arguments import check_number, check_whole

DAY_S = 86_400.0
# Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.4): 419 unexpected interruptions in a 54-day
# snapshot of pre-training on 16,384 H100 GPUs (78% of them hardware: GPUs, HBM, hosts, network).
LLAMA3 = {"interruptions": 419, "days": 54, "gpus": 16_384}


def mtbf_seconds(num_gpus: int, interruptions: int = LLAMA3["interruptions"], days: float = LLAMA3["days"],
                 observed_gpus: int = LLAMA3["gpus"]) -> float:
    """A ``num_gpus`` job's mean time between failures, from ``interruptions`` seen in ``days`` on ``observed_gpus``
    GPUs (failures per GPU-second scale with the number of GPUs): M = days · observed_gpus / (interruptions · N)."""
    for name, value in (("num_gpus", num_gpus), ("interruptions", interruptions), ("observed_gpus", observed_gpus)):
        check_whole(name, value)
    check_number("days", days, above=0)
    return days * DAY_S * observed_gpus / (interruptions * num_gpus)


def _check(checkpoint_s: float, mtbf_s: float) -> None:
    check_number("checkpoint_s", checkpoint_s, above=0)
    check_number("mtbf_s", mtbf_s, above=0)


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval, sqrt(2·δ·M) seconds of training between checkpoints."""
    _check(checkpoint_s, mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum: sqrt(2δM)·(1 + sqrt(δ/(2M))/3 + δ/(18M)) - δ for δ < 2M, else M."""
    _check(checkpoint_s, mtbf_s)
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s


def waste_fraction(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> dict[str, float]:
    """The share of a run lost at checkpoint interval τ: {"checkpoint": δ/τ, "lost_work": τ/(2M),
    "restart": R/M, "total"} (first order: valid while τ and δ are small beside M)."""
    _check(checkpoint_s, mtbf_s)
    check_number("interval_s", interval_s, above=0)
    check_number("restart_s", restart_s, at_least=0)
    parts = {"checkpoint": checkpoint_s / interval_s, "lost_work": interval_s / (2 * mtbf_s),
             "restart": restart_s / mtbf_s}
    return {**parts, "total": sum(parts.values())}


def checkpoint_seconds(state_bytes: float, write_bytes_per_s: float) -> float:
    """δ for a synchronous save: the whole checkpoint over the storage's aggregate write bandwidth."""
    check_number("state_bytes", state_bytes, above=0)
    check_number("write_bytes_per_s", write_bytes_per_s, above=0)
    return state_bytes / write_bytes_per_s


def straggler_report(step_seconds: list[float], comm_seconds: list[float]) -> dict:
    """Per rank (index = rank): its step time, its time inside collectives (mostly waiting for others) and the
    rest, its compute. The straggler is the rank that computes longest; "slowdown" is its compute over the
    median rank's."""
    if len(step_seconds) != len(comm_seconds) or not step_seconds:
        raise ValueError(f"one step time and one collective time per rank: got {len(step_seconds)} and "
                         f"{len(comm_seconds)}")
    for rank, (step, comm) in enumerate(zip(step_seconds, comm_seconds)):
        check_number(f"step_seconds[{rank}]", step, above=0)
        check_number(f"comm_seconds[{rank}]", comm, at_least=0, below=step)   # inside the step
    compute = [s - c for s, c in zip(step_seconds, comm_seconds)]
    slowest = max(range(len(compute)), key=compute.__getitem__)
    return {"compute": compute, "straggler": slowest,
            "slowdown": compute[slowest] / statistics.median_high(compute)}
