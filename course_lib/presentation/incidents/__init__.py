"""Incidents: realistic training steps, each with one seeded bug, for notebook 11 ("when parallel training goes
wrong"). Like the exercises' solutions, this package names the bugs; the notebook shows each first as a user meets
it (a hang, replicas that disagree, a curve that drifts from the reference) and lets the learner find it.

Each incident is one worker for ``launch``, ``fn(rank, world_size, *, fixed=False, ...)``: the buggy line and its
fix sit side by side under ``if fixed``. Everything runs the tiny model in float64 with SGD (``common``), so a
correct parallel step equals the one-process reference to ~1e-15 and a wrong one is off by far more than 1e-3
after three steps (Adam would hide a gradient that is wrong by a constant factor: its update divides it out).

    hangs        uneven_shards      one rank's data runs out a batch early: the others wait in an all-reduce
                                    that never comes (RankTimeout shows where each rank waits;
                                    TORCH_DISTRIBUTED_DEBUG=DETAIL names the mismatch at once)
                 pipeline_sends     1F1B with blocking sends: both stages send at once and wait for each other
                 straggler          one rank slower than the rest: every step as slow as it, the others waiting
    replicas     unsynced_init      replicas built from different seeds, never broadcast: they disagree
                 same_batch         every data-parallel rank reads the batch's same first rows
                 zero_resume        a ZeRO-1 resume that gives every rank rank 0's optimizer shard
                 tp_dropout         TP ranks seeding their dropout apart: copies of the replicated weights drift
    numerics     token_mean         gradient accumulation that averages each micro-batch's loss over its own
                                    tokens: micro-batches with fewer real tokens weigh as much as full ones
                 tp_norm            the gradient norm summed over TP ranks with the replicated weights counted
                                    on every rank: clipping too hard
                 fp16_loss_scale    fp16 mixed precision without loss scaling: a third of the gradients round to
                                    zero (the one incident on Adam, checked to fp16's precision, not 1e-12)

The tools that find them (``common``): ``reference``, the one-process float64 run on the same data, and ``gap``
from it; ``checksums``, each rank's sum of its weights, equal on replicas that agree; (``hangs``) every rank's
flight recorder dumped while it waits, read by torch's analyzer.

Each incident takes the line it gets wrong as an argument too (``steps_of``, ``swap``, ``sync``, ``rows_of``,
``load``, ``loss_of``, ``step_of``), so that notebook 11's exercises run the learner's version in the real job.
"""

from .common import BATCH_SIZE, LR, STEPS, checksums, flat, gap, reference
from .hangs import pipeline_sends, straggler, uneven_shards
from .numerics import fp16_loss_scale, token_mean, tp_norm
from .replicas import same_batch, tp_dropout, unsynced_init, zero_resume

INCIDENTS = {fn.__name__: fn for fn in (uneven_shards, pipeline_sends, straggler, unsynced_init, same_batch,
                                        zero_resume, tp_dropout, token_mean, tp_norm, fp16_loss_scale)}

__all__ = ["BATCH_SIZE", "INCIDENTS", "LR", "STEPS", "checksums", "flat", "gap", "reference"]
