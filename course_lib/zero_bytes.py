"""What ZeRO holds while a step runs and what it sends: the formulas that zero.py's ZeroDataParallel runs and
its traces measure, to the byte (tests/test_zero*.py). Stages and symbols as zero.py's: N ranks, w bytes per
weight, Ψ = bytes of all the gradients (= of all the weights), A micro-steps per optimizer step.

Beyond the state at rest (ledger.zero_state_bytes), stage 3 holds the weights it has gathered while a step runs
(transient_weight_bytes, with W_u = w·N·ceil(P_u/N) the bytes of unit u's gathered flat buffer):

    stages 0-2                               0           (their weights are whole already)
    stage 3                                  max_u W_u   (one unit gathered at a time, never two)
    stage 3, reshard_after_forward=False     Σ_u W_u     (every unit at the end of forward: the whole model)

Bytes each rank sends per step on a ring (comm.py):

    stage 0    all-reduce the gradients                              2Ψ·(N-1)/N
    stage 1, 2 reduce-scatter the gradients, all-gather the weights   Ψ·(N-1)/N + Ψ·(N-1)/N = 2Ψ·(N-1)/N
    stage 3    all-gather weights for forward, again for backward,
               reduce-scatter the gradients                          3Ψ·(N-1)/N, 1.5 x stage 0
    stage 3    reshard_after_forward=False: gather for forward only  2Ψ·(N-1)/N, as stage 0

An all-reduce *is* a reduce-scatter followed by an all-gather; stages 1 and 2 do the two halves at different
moments (gradients before the update, weights after it) and keep only their shard in between: memory saved for
no extra bytes. Stage 3 throws each layer's weights away after use, so it gathers them twice. Unless told not
to: ``reshard_after_forward=False`` (torch FSDP2's name, ``fully_shard(..., reshard_after_forward=False)``; FSDP1's
SHARD_GRAD_OP) keeps each unit's weights gathered from its forward until its backward is done, trading the
second all-gather for holding the whole model's weights at the end of forward (the table above). Megatron and
DeepSpeed have no direct switch for it (DeepSpeed's closest: ``stage3_max_reuse_distance``, which keeps a
gathered parameter that will be used again soon, and ZeRO++'s hpZ, which gathers backward's copy from a
secondary shard inside the node).

With gradient accumulation over A micro-steps (all but the last inside ``no_sync()``, as with DDP) the stages
part ways. Stages 0 and 1 keep full gradients, add the micro-steps into them locally and reduce once per
optimizer step. Stage 2 keeps only its shard of the gradients, so it must reduce-scatter after every micro-step;
stage 3 also gathers the weights for every micro-step's forward and backward. Per optimizer step:

    stage 0, 1   2Ψ·(N-1)/N          stage 2   (A + 1)·Ψ·(N-1)/N          stage 3   3A·Ψ·(N-1)/N
    stage 3, reshard_after_forward=False   2A·Ψ·(N-1)/N  (A all-gathers, not 2A; A reduce-scatters)
    stage 3, and reshard_after_backward=False   2Ψ·(N-1)/N  (one all-gather, one reduce-scatter a step)

The last row is how torch's pipelining runs FSDP across micro-batches (torchtitan with PP; FSDP2's
``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)`` for all but the last): inside
``no_sync()`` each unit keeps its gathered weights and adds into whole gradients, which are reduce-scattered once,
in the last backward (or by ``finish_gradient_sync()``). It holds, for the step, every unit's weights and whole
gradients (transient_weight_bytes, transient_gradient_bytes): the traffic of ZeRO-1 for the memory of DDP's
weights and gradients, with the optimizer state still sharded.
"""

from __future__ import annotations

from .comm import wire_bytes
from .ledger import check_zero_stage


def check_resharding(reshard_after_forward, zero_stage: int, reshard_after_backward=True) -> None:
    """True or False each, False only at ZeRO stage 3 (stages 0-2 keep whole weights: nothing to reshard), and
    reshard_after_backward=False only with reshard_after_forward=False (the weights stay for the whole step)."""
    for name, value in (("reshard_after_forward", reshard_after_forward),
                        ("reshard_after_backward", reshard_after_backward)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: True or False")
        if not value and zero_stage != 3:
            raise ValueError(f"{name}=False with zero_stage={zero_stage!r}: only ZeRO-3 frees a unit's weights "
                             "after its forward; stages 0-2 keep whole weights, so it must be True there")
    if reshard_after_forward and not reshard_after_backward:
        raise ValueError("reshard_after_backward=False with reshard_after_forward=True: keeping the weights for the "
                         "whole step means keeping them after forward too (torch's pipelining sets both False)")


def wire_bytes_per_step(grad_bytes: int, zero_stage: int, world_size: int, accumulation_steps: int = 1,
                        reshard_after_forward: bool = True, reshard_after_backward: bool = True) -> dict[str, float]:
    """Bytes one rank sends per optimizer step, by op, on a ring of world_size ranks, with ``accumulation_steps``
    micro-steps per optimizer step (the module docstring's tables). ``reshard_after_forward=False`` (stage 3
    only): each unit is gathered once per micro-step, not twice: all_gather A·Ψ·(N-1)/N, not 2A·Ψ·(N-1)/N;
    and ``reshard_after_backward=False``: once per optimizer step, as are the gradients reduce-scattered."""
    check_zero_stage(zero_stage)
    check_resharding(reshard_after_forward, zero_stage, reshard_after_backward)
    if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps={accumulation_steps!r}: a whole number of micro-steps, at least 1")
    a = accumulation_steps if reshard_after_backward else 1
    share = wire_bytes("reduce_scatter", grad_bytes, world_size)   # one reduce-scatter, or one all-gather
    gathers = 2 * a if reshard_after_forward else a                # forward and backward, or forward only
    return {0: {"all_reduce": wire_bytes("all_reduce", grad_bytes, world_size)},
            1: {"reduce_scatter": share, "all_gather": share},
            2: {"reduce_scatter": a * share, "all_gather": share},
            3: {"all_gather": gathers * share, "reduce_scatter": a * share}}[zero_stage]


def transient_weight_bytes(unit_params: list[int], zero_stage: int, weight_bytes: int, reshard_after_forward: bool = True,
                           world_size: int = 1, reshard_after_backward: bool = True) -> int:
    """Peak bytes of gathered weights one rank holds while a step runs, on top of its weights at rest (its
    shards, zero_state_bytes' "weights"): what ZeroDataParallel's memory_trace measures, to the byte.

    ``unit_params``: the parameters of each unit (default_units), P_u. A gathered unit is its flat buffer,
    W_u = weight_bytes · N·ceil(P_u/N) bytes (N = ``world_size``; padding included). The buffer holds all N
    shards, this rank's too: its own shard is then held twice (the shard is a separate tensor), so nothing is
    subtracted.

        stages 0-2                             0           whole weights are the state at rest already
        stage 3                                max_u W_u   a unit is freed after its forward and after its
                                                           reduce-scatter, before the next unit is gathered:
                                                           one unit at a time, never two (measured)
        stage 3, reshard_after_forward=False   Σ_u W_u     each unit stays from its forward to its backward:
                                                           at the end of forward every unit is gathered
                 (and reshard_after_backward=False: the same Σ_u W_u, held to the step's last backward)
    """
    check_zero_stage(zero_stage)
    check_resharding(reshard_after_forward, zero_stage, reshard_after_backward)
    if zero_stage < 3 or not unit_params:
        return 0
    gathered = [weight_bytes * world_size * -(-numel // world_size) for numel in unit_params]
    return max(gathered) if reshard_after_forward else sum(gathered)


def transient_gradient_bytes(unit_params: list[int], zero_stage: int, grad_bytes: int,
                             reshard_after_backward: bool = True) -> int:
    """Peak bytes of whole gradients one rank holds while a step runs, on top of its gradients at rest (G_u =
    g·P_u, the module's own gradients of unit u, unpadded): what ZeroDataParallel's memory_trace measures.

        stages 0-1                              0           the whole gradients are the state at rest
        stages 2-3                              max_u G_u   each unit's, from its backward to its reduce-scatter
        stage 3, reshard_after_backward=False   Σ_u G_u     every unit's, added into across the micro-steps,
                                                            until the step's one reduce-scatter
    """
    check_zero_stage(zero_stage)
    check_resharding(reshard_after_backward, zero_stage, reshard_after_backward)   # False implies forward's False
    if zero_stage < 2 or not unit_params:
        return 0
    whole = [grad_bytes * numel for numel in unit_params]
    return max(whole) if reshard_after_backward else sum(whole)
