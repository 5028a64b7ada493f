"""The pp × dp × cp × tp grid of ranks, its process groups, and the course model split over them.

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

Expert parallelism (ep) adds no dimension: it is carved out of the dp × cp ranks, which all hold the same layers.
Number them c = dp_rank · cp + cp_rank; ep consecutive ones form an EP group ("ep", coordinate c mod ep) and split
a mixture of experts' E experts, E/ep each (experts.apply_ep); the rest of the model stays replicated over them, as
over dp. The ranks holding the same experts, dp·cp/ep of them, average those experts' gradients ("expert_dp").
torchtitan builds the same groups (its ep = dp_shard_in_ep × cp); so does Megatron-LM's expert rank generator.

``parallelize_3d`` puts them together on the course model, with the modules of the earlier lessons and apart
from any training loop (torchtitan's shape): ``apply_context_parallel`` over the CP group, ``apply_tp`` over the
TP group, ``make_stage`` over the PP group, a gradient all-reduce over the DP (dp_cp) group (02's NaiveDDP); a step
then runs ``pipeline_step`` over the PP group (course_lib.runs.mesh.train_3d). Each rank holds 1/(tp·pp) of the
layers' weights, and 1/ep of the experts (``params_per_rank`` counts them exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import Comm, wire_bytes
from .context_parallel import apply_context_parallel, ring_attention_activation_bytes, ring_attention_bytes
from .ddp import NaiveDDP
from .experts import all_to_all_bytes, check_ep_divisible
from .ledger import gpt_activation_bytes, gpt_layer_activation_bytes
from .model import layer_projection_params
from .pipeline_parallel import make_stage, partition_layers
from .tensor_parallel import apply_tp, check_tp_divisible, tp_allreduce_bytes
from .zero import ZeroDataParallel

AXES = ("pp", "dp", "cp", "tp")   # slowest to fastest: the order of the coordinates, and of Mesh.grid()'s dims
# Each group along an axis: the ranks that share these places (and differ in the others).
SHARED = {"pp": ("dp", "cp", "tp"), "dp": ("pp", "cp", "tp"), "cp": ("pp", "dp", "tp"), "tp": ("pp", "dp", "cp"),
          "dp_cp": ("pp", "tp"),                    # same weights: gradients averaged here when cp > 1
          "ep": ("pp", "tp", "ep_group"),           # ep consecutive ranks of a dp_cp group: all the experts
          "expert_dp": ("pp", "tp", "ep")}          # the same experts: their gradients averaged here


@dataclass(frozen=True, repr=False)
class Mesh:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        for axis in ("dp", "tp", "pp", "cp", "ep"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{axis}={value!r}: each degree of parallelism is a whole number of ranks, >= 1")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep {self.ep} does not divide dp {self.dp} × cp {self.cp} = {self.dp * self.cp}: "
                             "expert parallelism takes groups of ep ranks out of the dp × cp ranks that hold the "
                             "same layers")

    def __repr__(self):   # a dp × tp × pp mesh prints as it always did; cp and ep appear when they are used
        extra = "".join(f", {axis}={getattr(self, axis)}" for axis in ("cp", "ep") if getattr(self, axis) > 1)
        return f"Mesh(dp={self.dp}, tp={self.tp}, pp={self.pp}{extra})"

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> Mesh:
        """The mesh that gives TP, PP and CP their degrees and data parallelism the rest: dp = world_size / (cp·tp·pp)."""
        others = cp * tp * pp
        if world_size % others:
            named = f"cp {cp} × " if cp > 1 else ""
            raise ValueError(f"world_size {world_size} is not divisible by {named}tp {tp} × pp {pp} = {others}: "
                             f"the data-parallel degree dp = world_size / ({'cp × ' if cp > 1 else ''}tp × pp) "
                             "must be a whole number")
        return cls(dp=world_size // others, tp=tp, pp=pp, cp=cp, ep=ep)

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def axes(self) -> tuple[str, ...]:
        """The grid's dimensions, slowest first: ("pp", "dp", "tp"), with "cp" before "tp" when cp > 1."""
        return tuple(axis for axis in AXES if axis != "cp" or self.cp > 1)

    def factors(self) -> str:
        """"dp 2 × cp 2 × tp 2 × pp 2": the degrees whose product is the world (cp named when > 1)."""
        return " × ".join(f"{axis} {getattr(self, axis)}" for axis in ("dp", "cp", "tp", "pp")
                          if axis != "cp" or self.cp > 1)

    def check(self, world_size: int) -> None:
        if world_size != self.size:
            raise ValueError(f"world_size {world_size} != {self.factors()} = {self.size}: "
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
        return {**place, "ep": same_layers % self.ep, "ep_group": same_layers // self.ep}

    def coords(self, rank: int) -> dict[str, int]:
        """{"pp": stage, "dp": data-parallel index, "tp": tensor-parallel index} of ``rank``, with "cp" (its slice
        of the sequence) when cp > 1 and "ep" (its share of the experts) when ep > 1."""
        place = self._place(rank)
        return {axis: place[axis] for axis in (*self.axes, "ep") if axis != "ep" or self.ep > 1}

    def rank_of(self, *, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0, ep: int | None = None) -> int:
        """The rank at these coordinates. ``ep`` is not a free coordinate (dp and cp set it); if given, it is checked."""
        rank = ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp
        if ep is not None and ep != self._place(rank)["ep"]:
            raise ValueError(f"ep {ep} does not fit dp {dp}, cp {cp}: that rank is number {dp * self.cp + cp} of "
                             f"its dp × cp ranks, so its ep coordinate is {self._place(rank)['ep']}")
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` (one of AXES, "dp_cp", "ep", "expert_dp"), each in rank order."""
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
        """The ranks as a tensor of shape (pp, dp, tp), or (pp, dp, cp, tp) when cp > 1: grid[s, d, t] is the
        rank at those coordinates (the dims are ``axes``)."""
        return torch.arange(self.size).reshape([getattr(self, axis) for axis in self.axes])


def make_comms(mesh: Mesh, rank: int) -> dict[str, Comm]:
    """This rank's Comm along each axis: "pp", "dp", "tp"; "cp" when cp > 1; "ep" and "expert_dp" when ep > 1;
    and "dp_cp", the group that averages gradients (the "dp" Comm itself when cp = 1). Call on every rank: torch
    makes each group collectively, all ranks creating every group in the same order, members or not."""
    mesh.check(dist.get_world_size())
    axes = ["pp", "dp", "tp"] + (["cp", "dp_cp"] if mesh.cp > 1 else []) + (["ep", "expert_dp"] if mesh.ep > 1 else [])
    comms = {}
    for axis in axes:
        for ranks in mesh.groups(axis):
            group = dist.new_group(ranks)
            if rank in ranks:
                comms[axis] = Comm(group)
    comms.setdefault("dp_cp", comms["dp"])
    return comms


def parallelize_3d(model: torch.nn.Module, mesh: Mesh, comms: dict[str, Comm], rank: int, *,
                   zero_stage: int | None = None, **optimizer_kwargs) -> NaiveDDP | ZeroDataParallel:
    """``model`` (the whole course model, the same on every rank) cut down, in place, to this rank's piece:
    its slice of the sequence (CP: ring attention), its heads and MLP slice (TP), its layers (PP), wrapped so that
    ``finish_gradient_sync()`` averages its gradients over the dp_cp group. Returns the wrapper; its ``.module``
    is the stage for ``pipeline_step`` (fed this rank's slice of the sequence, context_parallel.shard_sequence).
    ``zero_stage`` (0-3): wrap in ZeroDataParallel instead, which also shards the optimizer's state (its
    ``.optimizer``, made with ``optimizer_kwargs``): run pipeline_step inside its ``no_sync()``, then
    ``finish_gradient_sync()`` and ``step()``.

    Not ep > 1: an expert's gradients are averaged over the expert_dp group, the rest over dp_cp, and both
    wrappers average over one group (the virtual cluster runs EP, and counts that part with the formulas)."""
    mesh.check_model(model.config)
    if mesh.ep > 1:
        raise ValueError(f"parallelize_3d runs ep 1 only (ep {mesh.ep} asked): experts' gradients average over "
                         "the expert_dp group and the rest over dp_cp, and NaiveDDP and ZeroDataParallel take one")
    if mesh.cp > 1:   # first: apply_tp then splits the new attention modules' projections and hooks them
        apply_context_parallel(model, comms["cp"])
    if mesh.tp > 1:
        apply_tp(model, comms["tp"])
    stage = make_stage(model, mesh.coords(rank)["pp"], partition_layers(model.config.num_layers, mesh.pp))
    if zero_stage is not None:
        return ZeroDataParallel(stage, comms["dp_cp"], stage=zero_stage, **optimizer_kwargs)
    return NaiveDDP(stage, comms["dp_cp"])


# ----------------------------------------------------------------------------------- what each rank holds

def _expert_mlp_params(config) -> int:
    """One layer's expert MLPs, all E of them (3·d·intermediate each); 0 for a dense model."""
    return getattr(config, "num_experts", 0) * 3 * config.hidden * config.intermediate


def layer_params(config, tp: int = 1, ep: int = 1) -> int:
    """Parameters of one transformer layer on one of ``tp`` ranks (and of ``ep``): its 7 matrices (and q/k/v
    biases, if any) split over tp, of a mixture of experts E/ep experts (the router whole), its 2 norms whole."""
    experts = _expert_mlp_params(config)
    return (layer_projection_params(config) - experts + experts // ep) // tp + 2 * config.hidden


def expert_params_per_rank(config, mesh: Mesh, stage: int) -> int:
    """The part of params_per_rank that is experts (E/ep per layer, / tp): the part averaged over expert_dp."""
    layers = len(partition_layers(config.num_layers, mesh.pp)[stage])
    return layers * _expert_mlp_params(config) // mesh.ep // mesh.tp


def params_per_rank(config, mesh: Mesh, stage: int) -> int:
    """Parameters held by one rank of pipeline stage ``stage``: its layers' matrices / tp (TP splits every
    projection of attention and MLP), E/ep of a mixture's experts, its layers' norms whole, plus the embedding on
    the first stage and the final norm and head on the last (none of which TP splits here). Exact for the course
    model; a tied head is the embedding itself when one stage holds both, and a copy of it on the last stage
    otherwise. CP splits the sequence, not the weights: every rank of a CP group holds the same."""
    count = len(partition_layers(config.num_layers, mesh.pp)[stage]) * layer_params(config, mesh.tp, mesh.ep)
    if stage == 0:
        count += config.vocab_size * config.hidden
    if stage == mesh.pp - 1:
        count += config.hidden
        if not (config.tie_embeddings and mesh.pp == 1):
            count += config.vocab_size * config.hidden
    return count


def sent_bytes_per_rank(config, mesh: Mesh, stage: int, *, batch_size: int, seq_len: int, num_microbatches: int,
                        bytes_per_element: int = 4, sequence_parallel: bool = False,
                        capacity_factor: float | None = None) -> dict[str, float]:
    """Bytes one rank of ``stage`` sends in one training step, per axis (ring algorithms, as comm.wire_bytes):

    * tp: 4 all-reduces per layer and micro-batch (2 forward, 2 backward), each of one activation
      a = (batch/dp/m) · (seq/cp) · hidden · bytes, each sending 2(tp-1)/tp · a;
    * pp: one activation a per micro-batch to the next stage (not from the last), one gradient of it to the
      previous stage (not from the first);
    * dp: one all-reduce of this rank's gradients over the dp × cp ranks that hold the same weights,
      2(dp·cp-1)/(dp·cp) · params_per_rank · bytes; a mixture's experts over their dp·cp/ep ranks (expert_dp);
    * cp (when cp > 1): ring attention in each layer and micro-batch, forward and backward
      (context_parallel.ring_attention_bytes, on this rank's kv_heads/tp heads);
    * ep (when ep > 1): 4 all-to-alls per layer and micro-batch, dispatch and combine forward and backward, of
      this rank's (batch/dp/m)·(seq/cp) tokens (experts.all_to_all_bytes; ``capacity_factor`` as the MoE's).

    ``sequence_parallel`` (Megatron's; tensor_parallel.apply_tp(..., sequence_parallel=True)): each all-reduce
    becomes a reduce-scatter and an all-gather, (tp-1)/tp · a each, the same bytes; Megatron's stages pass 1/tp
    of the sequence, a/tp (the course's pipeline_step passes whole activations: the virtual cluster says so).
    """
    mesh.check_sequence(seq_len)
    micro_batch, local_seq = batch_size // mesh.dp // num_microbatches, seq_len // mesh.cp
    activation = tp_allreduce_bytes(micro_batch, local_seq, config.hidden, bytes_per_element)
    layers = len(partition_layers(config.num_layers, mesh.pp)[stage])
    tp = 4 * layers * num_microbatches * wire_bytes("all_reduce", activation, mesh.tp)
    boundary = activation // mesh.tp if sequence_parallel else activation
    pp = num_microbatches * boundary * ((stage < mesh.pp - 1) + (stage > 0))
    params, experts = params_per_rank(config, mesh, stage), expert_params_per_rank(config, mesh, stage)
    same_weights = mesh.dp * mesh.cp
    if experts:
        dp = (wire_bytes("all_reduce", (params - experts) * bytes_per_element, same_weights)
              + wire_bytes("all_reduce", experts * bytes_per_element, same_weights // mesh.ep))
    else:
        dp = wire_bytes("all_reduce", params * bytes_per_element, same_weights)
    sent = {"tp": tp, "pp": pp, "dp": dp}
    if mesh.cp > 1:
        dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[bytes_per_element]
        ring = ring_attention_bytes(micro_batch, config.num_kv_heads // mesh.tp, seq_len, config.head_dim, mesh.cp,
                                    dtype)
        sent["cp"] = layers * num_microbatches * (ring["forward"] + ring["backward"])
    if mesh.ep > 1:
        one = all_to_all_bytes(micro_batch * local_seq, config.hidden, config.num_experts, config.top_k,
                               capacity_factor, mesh.ep, bytes_per_element)
        sent["ep"] = 4 * layers * num_microbatches * one
    return sent


def microbatches_in_flight(mesh: Mesh, stage: int, num_microbatches: int, schedule: str = "1f1b") -> int:
    """How many micro-batches' activations ``stage`` holds at once: GPipe all m; 1F1B min(p - s, m)."""
    if schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"schedule={schedule!r}: one of 1f1b, gpipe")
    return num_microbatches if schedule == "gpipe" else min(mesh.pp - stage, num_microbatches)


def context_parallel_layer_terms(config, batch_size: int, seq_len: int, dtype, tp: int, cp: int) -> dict[str, int]:
    """The terms of ledger.gpt_layer_activation_bytes that a layer under context parallelism saves differently
    (context_parallel.apply_context_parallel), on one of tp × cp ranks, for sequences of ``seq_len`` tokens:

    * "attn": ring attention's Q, K, V, O and log-sum-exp (ring_attention_activation_bytes: K and V with their
      kv_heads, not repeated to the query heads as the model does before SDPA), and the rotary tables of the
      rank's s/cp positions, 4 · (s/cp) · (head_dim/2) · 4 bytes;
    * "attn.o_proj": the ring's output transposed for o_proj is a copy, which o_proj saves, b·(s/cp)·(d/tp)·e
      bytes (SDPA's CPU kernel returns its output already laid out for o_proj: the model saves it once).

    Every other term is the model's own at s/cp tokens. Exact for torch 2.13 (the virtual cluster measures it).
    """
    e, local_seq = dtype.itemsize, seq_len // cp
    ring = ring_attention_activation_bytes(batch_size, config.num_heads // tp, config.num_kv_heads // tp, seq_len,
                                           config.head_dim, cp, dtype)
    rotary = 4 * local_seq * (config.head_dim // 2) * 4
    return {"attn": ring + rotary, "attn.o_proj": batch_size * local_seq * config.hidden // tp * e}


def activation_bytes_per_rank(config, mesh: Mesh, stage: int, *, micro_batch_size: int, seq_len: int,
                              num_microbatches: int, schedule: str = "1f1b", dtype=torch.bfloat16,
                              recompute: str = "selective", sequence_parallel: bool = False) -> dict[str, int]:
    """Saved-activation bytes on one rank of ``stage``: {"per_microbatch", "in_flight", "peak"}.

    One micro-batch: the stage's layers (ledger.gpt_layer_activation_bytes on one of tp ranks), plus the token
    ids on the first stage and the final norm, head and loss on the last (ledger.gpt_activation_bytes). The
    peak holds ``in_flight`` of them (microbatches_in_flight). recompute "none" and "selective" are the same
    for the course model (SDPA never stores the s×s scores); "full" keeps each layer's input (b·s·d·e, /tp
    with sequence parallelism) per micro-batch in flight, plus one layer's own terms while backward recomputes
    it. With cp > 1 each rank holds s/cp tokens: every term at s/cp, attention's as
    context_parallel_layer_terms. Exact for the course's code in torch 2.13 (the virtual cluster measures it;
    a dense MLP: a mixture of experts' layer has no formula here).
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: one of none, selective, full")
    mesh.check_sequence(seq_len)
    b, s, num_layers = micro_batch_size, seq_len // mesh.cp, len(partition_layers(config.num_layers, mesh.pp)[stage])
    terms = gpt_layer_activation_bytes(config, b, s, dtype, mesh.tp, sequence_parallel)
    if mesh.cp > 1:
        terms.update(context_parallel_layer_terms(config, b, seq_len, dtype, mesh.tp, mesh.cp))
    layer = sum(terms.values())
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
