"""Hybrid sharded data parallelism (HSDP, 混合分片数据并行): ZeRO-3 inside a group, all-reduce across groups.

ZeRO-3 over all N data-parallel ranks holds the least (1/N of the state each) but gathers every layer's weights
from all N ranks, twice a step: on a cluster most of those bytes cross the slow network between nodes. HSDP
splits the N = R · S ranks into R replicas of S ranks (S = dp_shard, often one node; R = dp_replicate). Inside
a replica the S ranks run ZeRO-3 (zero.ZeroDataParallel, stage 3); across replicas, rank s of every replica
holds the same shard, and the R of them average its gradients with one all-reduce before the update:

    per rank, state       (w + g + o) · P / S            (ZeRO-3 over N would hold P / N; DDP holds P)
    per rank, per step    inside the replica: all-gather 2A · Ψ(S-1)/S, reduce-scatter A · Ψ(S-1)/S
                          across replicas:    all-reduce 2(R-1)/R · Ψ/S         (Ψ = bytes of all the gradients;
                          the gathers move the weights' bytes, the same where weights and gradients share a dtype)

With R = 1 it is ZeRO-3; with S = 1, DDP (each rank's shard is the whole model). The gathers, 2A of the 3A+ terms,
stay on the fast links; what crosses nodes is 2(R-1)/R · Ψ/S, S times less than DDP's all-reduce. torch's
``fully_shard`` does the same on a 2-D DeviceMesh ("replicate", "shard"): notebook 03 shows it beside this one.

How it is built: ZeroDataParallel's stage 3 over the shard group as it is (its units, hooks, gathers and
reduce-scatters), plus, in ``__init__``, every shard broadcast from replica 0 (the replicas start equal) and, in
``step()``, the all-reduce of each shard's gradient over the replicate group, divided by R: the gradient of the
whole batch, whose N shares the N ranks saw.
"""

from __future__ import annotations

import torch.nn as nn

from .comm import Comm, wire_bytes
from .mixed_precision import MixedPrecisionAdam
from .zero import ZeroDataParallel
from .zero_bytes import wire_bytes_per_step


def hsdp_wire_bytes_per_step(grad_bytes: int, dp_shard: int, dp_replicate: int,
                             accumulation_steps: int = 1) -> dict[str, float]:
    """Bytes one rank sends per optimizer step, by op (the module docstring): ZeRO-3's all-gathers and
    reduce-scatters over the dp_shard ranks of its replica (zero_bytes.wire_bytes_per_step), and the all-reduce of
    its 1/dp_shard of the gradients over the dp_replicate replicas."""
    ops = dict(wire_bytes_per_step(grad_bytes, 3, dp_shard, accumulation_steps))
    ops["all_reduce"] = wire_bytes("all_reduce", grad_bytes / dp_shard, dp_replicate)
    return ops


class HybridShardedDataParallel(ZeroDataParallel):
    """``module`` trained with ZeRO-3 over ``shard_comm``'s ranks and replicated over ``replicate_comm``'s.

        model = HybridShardedDataParallel(build(config), comms["dp_shard_cp"], comms["dp_replicate"], lr=1e-3)
        loss_fn(model(inputs), targets).backward()      # each rank: its 1/(R·S) of the batch
        model.step()                                    # all-reduce the shards' gradients over R, then update

    Everything else is ZeroDataParallel's (stage 3): ``no_sync()``, ``finish_gradient_sync()``, ``optimizer``.
    """

    def __init__(self, module: nn.Module, shard_comm: Comm, replicate_comm: Comm, optimizer_class=MixedPrecisionAdam,
                 units: list[nn.Module] | None = None, **optimizer_kwargs):
        super().__init__(module, shard_comm, zero_stage=3, optimizer_class=optimizer_class, units=units,
                         **optimizer_kwargs)
        self.replicate_comm = replicate_comm
        for unit in self.units:                     # rank s of every replica holds shard s: replica 0's
            replicate_comm.broadcast(unit.shard.detach(), src=0)

    def step(self):
        """Average each shard's gradient over the replicas, then ZeroDataParallel's step (update the shards)."""
        replicas = self.replicate_comm.size
        for unit in self.units:
            self.replicate_comm.all_reduce(unit.shard.grad)
            unit.shard.grad.div_(replicas)
        super().step()
