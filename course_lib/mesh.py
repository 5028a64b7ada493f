"""The dp × tp × pp grid of ranks, its process groups, and one training step that uses all three.

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

``train_3d`` puts the three together on the course model, with the modules of the earlier lessons:
``apply_tp`` over the TP group, ``make_stage`` + ``pipeline_step`` over the PP group, a gradient all-reduce
over the DP group. Each rank holds 1/(tp·pp) of the layers' weights (``params_per_rank`` counts them exactly).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import Comm, wire_bytes
from .data import SyntheticTokens, shard
from .ddp import NaiveDDP
from .launch import device
from .ledger import measure_state_bytes
from .model import build, layer_projection_params, loss_fn, preset
from .pipeline_parallel import make_stage, partition_layers, pipeline_step
from .tensor_parallel import apply_tp, check_tp_divisible, dtensor_plan, tp_allreduce_bytes

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
                        bytes_per_element: int = 4) -> dict[str, float]:
    """Bytes one rank of ``stage`` sends in one training step, per axis (ring algorithms, as comm.wire_bytes):

    * tp: 4 all-reduces per layer and micro-batch (2 forward, 2 backward), each of one activation
      a = (batch/dp/m) · seq · hidden · bytes, each sending 2(tp-1)/tp · a;
    * pp: one activation a per micro-batch to the next stage (not from the last), one gradient of it to the
      previous stage (not from the first);
    * dp: one all-reduce of this rank's gradients, 2(dp-1)/dp · params_per_rank · bytes.
    """
    activation = tp_allreduce_bytes(batch_size // mesh.dp // num_microbatches, seq_len, config.hidden,
                                    bytes_per_element)
    layers = len(partition_layers(config.num_layers, mesh.pp)[stage])
    tp = 4 * layers * num_microbatches * wire_bytes("all_reduce", activation, mesh.tp)
    pp = num_microbatches * activation * ((stage < mesh.pp - 1) + (stage > 0))
    dp = wire_bytes("all_reduce", params_per_rank(config, mesh, stage) * bytes_per_element, mesh.dp)
    return {"tp": tp, "pp": pp, "dp": dp}


# ----------------------------------------------------------------------------------- one 3-D training step

def train_3d(rank: int, world_size: int, *, dp: int = 1, tp: int = 1, pp: int = 1, num_microbatches: int = 2,
             schedule: str = "1f1b", steps: int = 3, batch_size: int = 8, seq_len: int = 16, lr: float = 1e-2,
             dtype=None, seed: int = 0, progress: bool = False, return_params: bool = True, **overrides) -> dict:
    """``steps`` Adam steps of the tiny model on a dp × tp × pp mesh, for ``launch``. Each step: this dp rank's
    share of the batch goes through the pipeline in ``num_microbatches`` micro-batches (TP all-reduces inside
    every layer of the stage), then gradients are averaged over the DP group, then Adam updates this rank's
    pieces. Returns this rank's coordinates, its losses (last stage only), its parameters, its measured state
    bytes, the bytes it sent on each axis in the last step (and how many ops), and each step's seconds.
    ``progress``: a tqdm bar on rank 0; ``return_params=False``: keep the parameters here (for the lab, at scale)."""
    mesh = Mesh(dp=dp, tp=tp, pp=pp)
    mesh.check(world_size)
    config = preset("tiny", **overrides)
    mesh.check_model(config, batch_size=batch_size, num_microbatches=num_microbatches)
    where = mesh.coords(rank)
    comms = make_comms(mesh, rank)

    model = build(config, seed=seed, device=device(), dtype=dtype)   # every rank draws the whole model, keeps its piece
    if tp > 1:
        apply_tp(model, comms["tp"])
    stage = make_stage(model, where["pp"], partition_layers(config.num_layers, pp))
    data_parallel = NaiveDDP(stage, comms["dp"])   # 02's gradient averaging, over this rank's dp group
    optimizer = torch.optim.Adam(stage.parameters(), lr=lr)
    data = SyntheticTokens(config.vocab_size, seq_len, seed=seed)
    losses, seconds = [], []
    step_range = range(steps)
    if progress and rank == 0:
        from tqdm import tqdm
        step_range = tqdm(step_range, desc=f"dp {dp} × tp {tp} × pp {pp}", mininterval=1.0)
    for step in step_range:
        start = time.perf_counter()
        inputs, targets = (shard(t, where["dp"], dp) for t in data.batch(step, batch_size))
        optimizer.zero_grad()
        with comms["tp"].trace() as tp_log, comms["pp"].trace() as pp_log, comms["dp"].trace() as dp_log:
            result = pipeline_step(stage, comms["pp"], inputs, targets, num_microbatches=num_microbatches,
                                   schedule=schedule)
            data_parallel.finish_gradient_sync()   # the mean over the dp ranks' shares: the batch's gradient
        optimizer.step()
        if device().type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        losses.append(result["loss"])
    return {"rank": rank, "coords": where, "losses": losses, "step_seconds": seconds, "backend": dist.get_backend(),
            "params": {name: p.detach().cpu() for name, p in stage.named_parameters()} if return_params else None,
            "state_bytes": measure_state_bytes(stage, optimizer),
            "sent_bytes": {"tp": tp_log.wire_bytes, "pp": pp_log.wire_bytes, "dp": dp_log.wire_bytes},
            "ops": {axis: {op: t.count for op, t in log.summary().items()}
                    for axis, log in (("tp", tp_log), ("pp", pp_log), ("dp", dp_log))}}


def global_losses(results: list[dict]) -> list[float]:
    """The whole batch's loss at each step: the mean of the last stage's losses over the dp ranks (the tp
    ranks of a stage compute the same loss)."""
    last = [r for r in results if r["losses"][0] is not None and r["coords"]["tp"] == 0]
    return [sum(r["losses"][step] for r in last) / len(last) for step in range(len(last[0]["losses"]))]


def max_parameter_gap(results: list[dict], reference: dict[str, torch.Tensor]) -> float:
    """Largest |difference| between any rank's parameter pieces and the same slices of the unsplit model's
    ``reference`` state_dict. A TP piece is the tp_rank-th equal slice along the one dim where shapes differ."""
    gap = 0.0
    for result in results:
        tp_rank = result["coords"]["tp"]
        for name, piece in result["params"].items():
            full = reference[name]
            for dim, (a, b) in enumerate(zip(full.shape, piece.shape)):
                if a != b:
                    full = full.narrow(dim, tp_rank * b, b)
            gap = max(gap, (full - piece).abs().max().item())
    return gap


def train_torch_2d(rank: int, world_size: int, *, dp: int = 2, tp: int = 2, steps: int = 3, batch_size: int = 8,
                   seq_len: int = 16, lr: float = 1e-2, dtype=None, seed: int = 0) -> list[float]:
    """torch's own 2-D version, for comparison: DTensor TP (``parallelize_module``) inside each TP group and
    FSDP2 (``fully_shard``, i.e. ZeRO-3) over the DP groups of a ``init_device_mesh`` ("dp", "tp") mesh. Returns
    the whole batch's loss at each step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    warnings.filterwarnings("ignore", category=FutureWarning)   # gloo's reduce_scatter/all_gather notices
    config = preset("tiny")
    mesh = init_device_mesh(device().type, (dp, tp), mesh_dim_names=("dp", "tp"))
    model = build(config, seed=seed, device=device(), dtype=dtype)
    parallelize_module(model, mesh["tp"], dtensor_plan(config))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    data = SyntheticTokens(config.vocab_size, seq_len, seed=seed)
    dp_rank, losses = mesh["dp"].get_local_rank(), []
    for step in range(steps):
        inputs, targets = (shard(t, dp_rank, dp).to(device()) for t in data.batch(step, batch_size))
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        loss = loss.detach()
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        losses.append(loss.item() / dp)
    return losses
