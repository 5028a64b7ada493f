"""torch's DTensor version of tensor_parallel.apply_tp: the plan that ``parallelize_module`` applies on a DeviceMesh
(tests and notebooks 04 and 07 run it beside the course's own split, which must give the same logits and grads)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)


def dtensor_plan(config, sequence_parallel: bool = False) -> dict:
    """torch's DTensor plan for the same split: ``parallelize_module(model, mesh, dtensor_plan(config))``.
    ``sequence_parallel``: torchtitan's layout: the embedding's output cut along the sequence (Shard(1)), the
    layers' norms ``SequenceParallel()``, attention and MLP inputs gathered whole (Replicate), their row layers
    reduce-scattering back to Shard(1), the final norm's input gathered whole."""
    plan, sequence = {}, dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if sequence_parallel:
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        plan["norm"] = PrepareModuleInput(**sequence, use_local_output=True)
    for i in range(config.num_layers):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else None)
        if sequence_parallel:
            for name in ("attn", "mlp"):
                plan[f"layers.{i}.{name}"] = PrepareModuleInput(**sequence)
                plan[f"layers.{i}.{name}_norm"] = SequenceParallel()
    return plan
