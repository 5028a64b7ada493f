"""The pp × dp × cp × tp grid of ranks and its process groups: coordinates, groups, ``make_comms``. Nothing else:
course_lib.parallelize cuts the model over the grid, course_lib.per_rank counts what each rank holds and sends.

A world of N = pp · dp · cp · tp ranks is a grid (cp, context parallelism, is 1 unless asked for: then the grid
is the 3-D dp × tp × pp of notebook 06). Rank r sits at coordinates (pp_rank, dp_rank, cp_rank, tp_rank):

    r = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank

tp varies fastest, so the ranks of one TP group are neighbours: torchrun numbers the GPUs of one node
consecutively, so a TP group whose size divides gpus_per_node stays inside a node, on its fast links (TP talks in
every layer). cp comes next: its ring passes K and V in every layer too, so it sits beside TP, as close as what is
left. pp varies slowest, so consecutive pipeline stages are far apart, on different nodes: they only pass one
activation per micro-batch. This is Megatron-LM's order (tp, cp, dp, pp from fastest) and the order of
torchtitan's mesh ("pp", "dp", "cp", "tp"); ``Mesh.grid()`` equals torch's ``init_device_mesh`` mesh for it.

Every rank belongs to exactly one group along each axis: the ranks that differ from it in that coordinate only.

* TP group (tp ranks): split each layer's matrices; 2 all-reduces forward and 2 backward per layer.
* CP group (cp ranks): each holds 2 of 2·cp chunks of every sequence; ring attention (context_parallel).
* PP group (pp ranks): one stage each; send activations forward, their gradients backward.
* DP group (dp ranks): the same (tp, pp) piece of the model on different data; all-reduce gradients once a step.
  With cp > 1 the ranks of a CP group hold the same weights too, and saw different tokens: gradients are
  averaged over the dp × cp ranks that share (pp, tp), the "dp_cp" group (Megatron's DP-with-CP group).

Hybrid sharding (HSDP, ``dp_replicate`` > 1): the dp ranks are dp_replicate × dp_shard, replicate slower
(torchtitan's ("pp", "dp_replicate", "dp_shard", "cp", "tp")): dp_rank = replicate_index · dp_shard + shard_index.
ZeRO-3 shards over the dp_shard × cp ranks of a replica ("dp_shard_cp"), and the replicas all-reduce their
shards' gradients over "dp_replicate" (course_lib.hsdp). Put dp_shard · cp · tp on one node and the shards'
gathers stay on its fast links; only the all-reduce of 1/(dp_shard·cp) of the gradients crosses nodes.

Expert parallelism (ep) adds no dimension: it is carved out of the dp × cp ranks, which all hold the same layers.
Number them c = dp_rank · cp + cp_rank; ep consecutive ones form an EP group ("ep", coordinate c mod ep) and split
a mixture of experts' E experts, E/ep each (expert_parallel.apply_ep); the rest of the model stays replicated over them, as
over dp. The ranks holding the same experts, dp·cp/ep of them, average those experts' gradients ("expert_dp").
torchtitan builds the same groups (its ep = dp_shard_in_ep × cp); so does Megatron-LM's expert rank generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import Comm
from .expert_parallel import check_ep_divisible
from .runtime.arguments import check_whole
from .tensor_parallel import check_tp_divisible

AXES = ("pp", "dp", "cp", "tp")   # slowest to fastest: the order of the coordinates, and of Mesh.grid()'s dims
# Each group along an axis: the ranks that share these places (and differ in the others).
SHARED = {"pp": ("dp", "cp", "tp"), "dp": ("pp", "cp", "tp"), "cp": ("pp", "dp", "tp"), "tp": ("pp", "dp", "cp"),
          "dp_cp": ("pp", "tp"),                    # same weights: gradients averaged here when cp > 1
          "ep": ("pp", "tp", "ep_group"),           # ep consecutive ranks of a dp_cp group: all the experts
          "expert_dp": ("pp", "tp", "ep"),          # the same experts: their gradients averaged here
          "dp_shard": ("pp", "dp_replicate", "cp", "tp"),    # HSDP: the dp ranks of one replica
          "dp_shard_cp": ("pp", "dp_replicate", "tp"),       # HSDP: ZeRO-3 shards over these (dp_shard × cp)
          "dp_replicate": ("pp", "dp_shard", "cp", "tp")}    # HSDP: the replicas of one shard


@dataclass(frozen=True, repr=False)
class Mesh:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_replicate: int = 1     # HSDP: dp = dp_replicate × dp_shard; ZeRO-3 inside a replica, all-reduce across

    def __post_init__(self):
        for axis in ("dp", "tp", "pp", "cp", "ep", "dp_replicate"):
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{axis}={value!r}: each degree of parallelism is a whole number of ranks, >= 1")
        if self.dp % self.dp_replicate:
            raise ValueError(f"dp_replicate {self.dp_replicate} does not divide dp {self.dp}: hybrid sharding "
                             "splits the dp ranks into dp_replicate replicas of dp_shard = dp / dp_replicate ranks")
        if self.dp_replicate > 1 and self.ep > 1:
            raise ValueError(f"ep {self.ep} with dp_replicate {self.dp_replicate}: the course does not combine "
                             "expert parallelism with hybrid sharding (the experts' groups would cut the replicas)")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep {self.ep} does not divide dp {self.dp} × cp {self.cp} = {self.dp * self.cp}: "
                             "expert parallelism takes groups of ep ranks out of the dp × cp ranks that hold the "
                             "same layers")

    def __repr__(self):   # a dp × tp × pp mesh prints as it always did; cp, ep, dp_replicate appear when used
        extra = "".join(f", {axis}={getattr(self, axis)}" for axis in ("cp", "ep", "dp_replicate")
                        if getattr(self, axis) > 1)
        return f"Mesh(dp={self.dp}, tp={self.tp}, pp={self.pp}{extra})"

    @classmethod
    def hybrid(cls, *, dp_shard: int, dp_replicate: int, **degrees) -> Mesh:
        """HSDP's mesh: ``dp_replicate`` replicas of ``dp_shard`` ranks each (dp = their product)."""
        for name, value in (("dp_shard", dp_shard), ("dp_replicate", dp_replicate)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: each degree of parallelism is a whole number of ranks, >= 1")
        return cls(dp=dp_shard * dp_replicate, dp_replicate=dp_replicate, **degrees)

    @property
    def dp_shard(self) -> int:
        """The dp ranks of one replica: all of dp unless hybrid sharding (dp_replicate > 1)."""
        return self.dp // self.dp_replicate

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                  dp_replicate: int = 1) -> Mesh:
        """The mesh that gives TP, PP and CP their degrees and data parallelism the rest: dp = world_size / (cp·tp·pp)."""
        for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("cp", cp)):
            check_whole(name, value)                     # before the division below
        others = cp * tp * pp
        if world_size % others:
            named = f"cp {cp} × " if cp > 1 else ""
            raise ValueError(f"world_size {world_size} is not divisible by {named}tp {tp} × pp {pp} = {others}: "
                             f"the data-parallel degree dp = world_size / ({'cp × ' if cp > 1 else ''}tp × pp) "
                             "must be a whole number")
        return cls(dp=world_size // others, tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=dp_replicate)

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def axes(self) -> tuple[str, ...]:
        """The grid's dimensions, slowest first: ("pp", "dp", "tp"), with "cp" before "tp" when cp > 1, and
        "dp" as ("dp_replicate", "dp_shard") when dp_replicate > 1 (torch's HSDP mesh dims)."""
        axes = [axis for axis in AXES if axis != "cp" or self.cp > 1]
        if self.dp_replicate > 1:
            axes[1:2] = ["dp_replicate", "dp_shard"]
        return tuple(axes)

    def factors(self) -> str:
        """"dp 2 × cp 2 × tp 2 × pp 2": the degrees whose product is the world (cp named when > 1; dp as
        "dp_replicate 2 × dp_shard 2" when hybrid)."""
        dp = (f"dp_replicate {self.dp_replicate} × dp_shard {self.dp_shard}" if self.dp_replicate > 1
              else f"dp {self.dp}")
        return " × ".join([dp] + [f"{axis} {getattr(self, axis)}" for axis in ("cp", "tp", "pp")
                                  if axis != "cp" or self.cp > 1])

    def check(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size != self.size:
            raise ValueError(f"world_size {world_size!r} != {self.factors()} = {self.size}: "
                             "every rank must sit at exactly one place on the grid")

    def check_sequence(self, seq_len: int) -> None:
        """Load-balanced context parallelism cuts each sequence into 2·cp equal chunks, two per rank."""
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise ValueError(f"seq_len {seq_len} is not divisible by 2·cp = {2 * self.cp} (load-balanced context "
                             f"parallelism: each of the cp {self.cp} ranks takes 2 of 2·cp equal chunks)")

    def check_model(self, config, *, batch_size: int | None = None, num_microbatches: int | None = None,
                    seq_len: int | None = None) -> None:
        """Errors for a model or batch this mesh cannot split, naming the numbers and the rule."""
        check_tp_divisible(config, self.tp)
        if self.pp > config.num_layers:
            raise ValueError(f"pp {self.pp} stages > {config.num_layers} layers: every stage needs at least one layer")
        if self.ep > 1:
            if not getattr(config, "num_experts", 0):
                raise ValueError(f"ep {self.ep} needs a mixture of experts: this model has num_experts=0 (one dense "
                                 "MLP per layer, nothing to spread over ranks)")
            check_ep_divisible(config.num_experts, self.ep)
        if seq_len is not None:
            self.check_sequence(seq_len)
        if num_microbatches is not None and (not isinstance(num_microbatches, int) or num_microbatches < 1):
            raise ValueError(f"num_microbatches={num_microbatches!r} must be a whole number >= 1")
        if batch_size is not None:
            if batch_size % self.dp:
                raise ValueError(f"batch {batch_size} is not divisible by dp {self.dp}: each data-parallel rank "
                                 "needs an equal share of the batch")
            if num_microbatches is not None and (batch_size // self.dp) % num_microbatches:
                raise ValueError(f"each dp rank's batch of {batch_size // self.dp} (= {batch_size} / dp {self.dp}) "
                                 f"is not divisible by num_microbatches={num_microbatches}")

    def _place(self, rank: int) -> dict[str, int]:
        """Every coordinate of ``rank``: the grid's four, and its place among the experts (ep, ep_group)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside 0..{self.size - 1} for {self}")
        place = {"pp": rank // (self.dp * self.cp * self.tp), "dp": rank // (self.cp * self.tp) % self.dp,
                 "cp": rank // self.tp % self.cp, "tp": rank % self.tp}
        same_layers = place["dp"] * self.cp + place["cp"]     # its number among the dp × cp ranks of its (pp, tp)
        return {**place, "ep": same_layers % self.ep, "ep_group": same_layers // self.ep,
                "dp_replicate": place["dp"] // self.dp_shard, "dp_shard": place["dp"] % self.dp_shard}

    def coords(self, rank: int) -> dict[str, int]:
        """{"pp": stage, "dp": data-parallel index, "tp": tensor-parallel index} of ``rank``, with "cp" (its slice
        of the sequence) when cp > 1, "ep" (its share of the experts) when ep > 1, and "dp_replicate", "dp_shard"
        (its replica, its place in it) when dp_replicate > 1; "dp" stays the index of its share of the batch."""
        place = self._place(rank)
        names = [axis for axis in ("pp", "dp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
                 if axis in ("pp", "dp", "tp") or axis in self.axes or (axis == "ep" and self.ep > 1)]
        return {axis: place[axis] for axis in names}

    def rank_of(self, *, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0, ep: int | None = None,
                dp_replicate: int | None = None, dp_shard: int | None = None) -> int:
        """The rank at these coordinates. ``ep`` is not a free coordinate (dp and cp set it); if given, it is checked.
        ``dp_replicate`` and ``dp_shard`` (HSDP) give dp = dp_replicate · dp_shard(degree) + dp_shard, if given."""
        if dp_replicate is not None or dp_shard is not None:
            dp = (dp_replicate or 0) * self.dp_shard + (dp_shard or 0)
        for axis, value in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
            size = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise ValueError(f"{axis}={value!r}: a coordinate on an axis of {size} runs from 0 to {size - 1}")
        rank = ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp
        if ep is not None and ep != self._place(rank)["ep"]:
            raise ValueError(f"ep {ep} does not fit dp {dp}, cp {cp}: that rank is number {dp * self.cp + cp} of "
                             f"its dp × cp ranks, so its ep coordinate is {self._place(rank)['ep']}")
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` (one of AXES, "dp_cp", "ep", "expert_dp", "dp_shard", "dp_shard_cp",
        "dp_replicate"), each in rank order."""
        if axis not in SHARED:
            raise ValueError(f"axis={axis!r}: one of {', '.join(SHARED)}")
        found = {}
        for rank in range(self.size):
            place = self._place(rank)
            found.setdefault(tuple(place[a] for a in SHARED[axis]), []).append(rank)
        return list(found.values())

    def group_of(self, rank: int, axis: str) -> list[int]:
        return next(g for g in self.groups(axis) if rank in g)

    def grid(self) -> torch.Tensor:
        """The ranks as a tensor of shape (pp, dp, tp), or (pp, dp, cp, tp) when cp > 1, dp as (dp_replicate,
        dp_shard) when hybrid: grid[s, d, t] is the rank at those coordinates (the dims are ``axes``)."""
        return torch.arange(self.size).reshape([getattr(self, axis) for axis in self.axes])


def make_comms(mesh: Mesh, rank: int) -> dict[str, Comm]:
    """This rank's Comm along each axis: "pp", "dp", "tp"; "cp" when cp > 1; "ep" and "expert_dp" when ep > 1;
    "dp_shard_cp" and "dp_replicate" when dp_replicate > 1 (HSDP); and "dp_cp", the group that averages gradients
    (the "dp" Comm itself when cp = 1). Call on every rank: torch makes each group collectively, all ranks
    creating every group in the same order, members or not."""
    mesh.check(dist.get_world_size())
    axes = (["pp", "dp", "tp"] + (["cp", "dp_cp"] if mesh.cp > 1 else []) + (["ep", "expert_dp"] if mesh.ep > 1 else [])
            + (["dp_shard_cp", "dp_replicate"] if mesh.dp_replicate > 1 else []))
    comms = {}
    for axis in axes:
        for ranks in mesh.groups(axis):
            group = dist.new_group(ranks)
            if rank in ranks:
                comms[axis] = Comm(group)
    comms.setdefault("dp_cp", comms["dp"])
    return comms
