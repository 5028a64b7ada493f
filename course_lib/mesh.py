"""The dp × tp × pp grid of ranks, its process groups, and the course model split over all three.

A world of N = dp · tp · pp ranks is a 3-D grid. Rank r sits at coordinates (pp_rank, dp_rank, tp_rank):

    r = (pp_rank · dp + dp_rank) · tp + tp_rank

tp varies fastest, so the ranks of one TP group are neighbours: torchrun numbers the GPUs of one node
consecutively, so a TP group whose size divides gpus_per_node stays inside a node, on its fast links (TP talks in
every layer). pp varies slowest, so consecutive pipeline stages are far apart, on different nodes: they only
pass one activation per micro-batch. This is Megatron-LM's order (tp innermost, pp outermost) and the order of
torchtitan's mesh ("pp", "dp", "tp"); ``Mesh.grid()`` equals torch's ``init_device_mesh`` mesh for it.

Every rank belongs to exactly one group along each axis: the ranks that differ from it in that coordinate only.

* TP group (tp ranks): split each layer's matrices; 2 all-reduces forward and 2 backward per layer.
* PP group (pp ranks): one stage each; send activations forward, their gradients backward.
* DP group (dp ranks): the same (tp, pp) piece of the model on different data; all-reduce gradients once a step.

``parallelize_3d`` puts the three together on the course model, with the modules of the earlier lessons and
apart from any training loop (torchtitan's shape): ``apply_tp`` over the TP group, ``make_stage`` over the PP
group, a gradient all-reduce over the DP group (02's NaiveDDP); a step then runs ``pipeline_step`` over the PP
group (course_lib.runs.mesh.train_3d). Each rank holds 1/(tp·pp) of the layers' weights (``params_per_rank``
counts them exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import Comm, wire_bytes
from .ddp import NaiveDDP
from .ledger import gpt_activation_bytes, gpt_layer_activation_bytes
from .model import layer_projection_params
from .pipeline_parallel import make_stage, partition_layers
from .tensor_parallel import apply_tp, check_tp_divisible, tp_allreduce_bytes
from .zero import ZeroDataParallel

AXES = ("pp", "dp", "tp")   # slowest to fastest: the order of the coordinates, and of Mesh.grid()'s dims


@dataclass(frozen=True)
class Mesh:
    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{axis}={value!r}: each degree of parallelism is a whole number of ranks, >= 1")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1) -> Mesh:
        """The mesh that gives TP and PP their degrees and data parallelism the rest: dp = world_size / (tp·pp)."""
        if world_size % (tp * pp):
            raise ValueError(f"world_size {world_size} is not divisible by tp {tp} × pp {pp} = {tp * pp}: "
                             "the data-parallel degree dp = world_size / (tp × pp) must be a whole number")
        return cls(dp=world_size // (tp * pp), tp=tp, pp=pp)

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    def check(self, world_size: int) -> None:
        if world_size != self.size:
            raise ValueError(f"world_size {world_size} != dp {self.dp} × tp {self.tp} × pp {self.pp} = {self.size}: "
                             "every rank must sit at exactly one place on the grid")

    def check_model(self, config, *, batch_size: int | None = None, num_microbatches: int | None = None) -> None:
        """Errors for a model or batch this mesh cannot split, naming the numbers and the rule."""
        check_tp_divisible(config, self.tp)
        if self.pp > config.num_layers:
            raise ValueError(f"pp {self.pp} stages > {config.num_layers} layers: every stage needs at least one layer")
        if num_microbatches is not None and (not isinstance(num_microbatches, int) or num_microbatches < 1):
            raise ValueError(f"num_microbatches={num_microbatches!r} must be a whole number >= 1")
        if batch_size is not None:
            if batch_size % self.dp:
                raise ValueError(f"batch {batch_size} is not divisible by dp {self.dp}: each data-parallel rank "
                                 "needs an equal share of the batch")
            if num_microbatches is not None and (batch_size // self.dp) % num_microbatches:
                raise ValueError(f"each dp rank's batch of {batch_size // self.dp} (= {batch_size} / dp {self.dp}) "
                                 f"is not divisible by num_microbatches={num_microbatches}")

    def coords(self, rank: int) -> dict[str, int]:
        """{"pp": stage, "dp": data-parallel index, "tp": tensor-parallel index} of ``rank``."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside 0..{self.size - 1} for {self}")
        return {"pp": rank // (self.dp * self.tp), "dp": rank // self.tp % self.dp, "tp": rank % self.tp}

    def rank_of(self, *, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``: the lists of ranks that differ only in that coordinate."""
        if axis not in AXES:
            raise ValueError(f"axis={axis!r}: one of {', '.join(AXES)}")
        others = [a for a in AXES if a != axis]
        found = {}
        for rank in range(self.size):
            c = self.coords(rank)
            found.setdefault(tuple(c[a] for a in others), []).append(rank)
        return list(found.values())

    def group_of(self, rank: int, axis: str) -> list[int]:
        return next(g for g in self.groups(axis) if rank in g)

    def grid(self) -> torch.Tensor:
        """The ranks as a tensor of shape (pp, dp, tp): grid[s, d, t] is the rank at those coordinates."""
        return torch.arange(self.size).reshape(self.pp, self.dp, self.tp)


def make_comms(mesh: Mesh, rank: int) -> dict[str, Comm]:
    """This rank's Comm along each axis. Call on every rank: torch makes each group collectively, all ranks
    creating every group in the same order, members or not."""
    mesh.check(dist.get_world_size())
    comms = {}
    for axis in AXES:
        for ranks in mesh.groups(axis):
            group = dist.new_group(ranks)
            if rank in ranks:
                comms[axis] = Comm(group)
    return comms


def parallelize_3d(model: torch.nn.Module, mesh: Mesh, comms: dict[str, Comm], rank: int, *,
                   zero_stage: int | None = None, **optimizer_kwargs) -> NaiveDDP | ZeroDataParallel:
    """``model`` (the whole course model, the same on every rank) cut down, in place, to this rank's piece:
    its heads and MLP slice (TP), its layers (PP), wrapped so that ``finish_gradient_sync()`` averages its
    gradients over the DP group. Returns the wrapper; its ``.module`` is the stage for ``pipeline_step``.
    ``zero_stage`` (0-3): wrap in ZeroDataParallel instead, which also shards the optimizer's state (its
    ``.optimizer``, made with ``optimizer_kwargs``): run pipeline_step inside its ``no_sync()``, then
    ``finish_gradient_sync()`` and ``step()``."""
    mesh.check_model(model.config)
    if mesh.tp > 1:
        apply_tp(model, comms["tp"])
    stage = make_stage(model, mesh.coords(rank)["pp"], partition_layers(model.config.num_layers, mesh.pp))
    if zero_stage is not None:
        return ZeroDataParallel(stage, comms["dp"], stage=zero_stage, **optimizer_kwargs)
    return NaiveDDP(stage, comms["dp"])


# ----------------------------------------------------------------------------------- what each rank holds

def layer_params(config, tp: int = 1) -> int:
    """Parameters of one transformer layer on one of ``tp`` ranks: its 7 matrices (and q/k/v biases, if any)
    split, its 2 norms whole."""
    return layer_projection_params(config) // tp + 2 * config.hidden


def params_per_rank(config, mesh: Mesh, stage: int) -> int:
    """Parameters held by one rank of pipeline stage ``stage``: its layers' matrices / tp (TP splits every
    projection of attention and MLP), its layers' norms whole, plus the embedding on the first stage and the
    final norm and head on the last (none of which TP splits here). Exact for the course model; a tied head is
    the embedding itself when one stage holds both, and a copy of it on the last stage otherwise."""
    count = len(partition_layers(config.num_layers, mesh.pp)[stage]) * layer_params(config, mesh.tp)
    if stage == 0:
        count += config.vocab_size * config.hidden
    if stage == mesh.pp - 1:
        count += config.hidden
        if not (config.tie_embeddings and mesh.pp == 1):
            count += config.vocab_size * config.hidden
    return count


def sent_bytes_per_rank(config, mesh: Mesh, stage: int, *, batch_size: int, seq_len: int, num_microbatches: int,
                        bytes_per_element: int = 4, sequence_parallel: bool = False) -> dict[str, float]:
    """Bytes one rank of ``stage`` sends in one training step, per axis (ring algorithms, as comm.wire_bytes):

    * tp: 4 all-reduces per layer and micro-batch (2 forward, 2 backward), each of one activation
      a = (batch/dp/m) · seq · hidden · bytes, each sending 2(tp-1)/tp · a;
    * pp: one activation a per micro-batch to the next stage (not from the last), one gradient of it to the
      previous stage (not from the first);
    * dp: one all-reduce of this rank's gradients, 2(dp-1)/dp · params_per_rank · bytes.

    ``sequence_parallel`` (Megatron's; tensor_parallel.apply_tp(..., sequence_parallel=True)): each all-reduce
    becomes a reduce-scatter and an all-gather, (tp-1)/tp · a each, the same bytes; Megatron's stages pass 1/tp
    of the sequence, a/tp (the course's pipeline_step passes whole activations: the virtual cluster says so).
    """
    activation = tp_allreduce_bytes(batch_size // mesh.dp // num_microbatches, seq_len, config.hidden,
                                    bytes_per_element)
    layers = len(partition_layers(config.num_layers, mesh.pp)[stage])
    tp = 4 * layers * num_microbatches * wire_bytes("all_reduce", activation, mesh.tp)
    boundary = activation // mesh.tp if sequence_parallel else activation
    pp = num_microbatches * boundary * ((stage < mesh.pp - 1) + (stage > 0))
    dp = wire_bytes("all_reduce", params_per_rank(config, mesh, stage) * bytes_per_element, mesh.dp)
    return {"tp": tp, "pp": pp, "dp": dp}


def microbatches_in_flight(mesh: Mesh, stage: int, num_microbatches: int, schedule: str = "1f1b") -> int:
    """How many micro-batches' activations ``stage`` holds at once: GPipe all m; 1F1B min(p - s, m)."""
    if schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"schedule={schedule!r}: one of 1f1b, gpipe")
    return num_microbatches if schedule == "gpipe" else min(mesh.pp - stage, num_microbatches)


def activation_bytes_per_rank(config, mesh: Mesh, stage: int, *, micro_batch_size: int, seq_len: int,
                              num_microbatches: int, schedule: str = "1f1b", dtype=torch.bfloat16,
                              recompute: str = "selective", sequence_parallel: bool = False) -> dict[str, int]:
    """Saved-activation bytes on one rank of ``stage``: {"per_microbatch", "in_flight", "peak"}.

    One micro-batch: the stage's layers (ledger.gpt_layer_activation_bytes on one of tp ranks), plus the token
    ids on the first stage and the final norm, head and loss on the last (ledger.gpt_activation_bytes). The
    peak holds ``in_flight`` of them (microbatches_in_flight). recompute "none" and "selective" are the same
    for the course model (SDPA never stores the s×s scores); "full" keeps each layer's input (b·s·d·e, /tp
    with sequence parallelism) per micro-batch in flight, plus one layer's own terms while backward recomputes
    it. Exact for the course's code in torch 2.13 (the virtual cluster measures it).
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: one of none, selective, full")
    b, s, num_layers = micro_batch_size, seq_len, len(partition_layers(config.num_layers, mesh.pp)[stage])
    layer = sum(gpt_layer_activation_bytes(config, b, s, dtype, mesh.tp, sequence_parallel).values())
    whole = gpt_activation_bytes(config, b, s, dtype)
    edges = (whole["embed"] if stage == 0 else 0) + (
        whole["norm"] + whole["head"] + whole["loss"] if stage == mesh.pp - 1 else 0)
    in_flight = microbatches_in_flight(mesh, stage, num_microbatches, schedule)
    if recompute == "full":
        layer_input = b * s * config.hidden * torch.tensor([], dtype=dtype).element_size()
        per_microbatch = num_layers * layer_input // (mesh.tp if sequence_parallel else 1) + edges
        return {"per_microbatch": per_microbatch, "in_flight": in_flight, "peak": in_flight * per_microbatch + layer}
    per_microbatch = num_layers * layer + edges
    return {"per_microbatch": per_microbatch, "in_flight": in_flight, "peak": in_flight * per_microbatch}
