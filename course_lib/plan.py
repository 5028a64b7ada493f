"""Which parallelism for which model and cluster: three questions, each answered with the ledger.

1. Does the training state fit? Climb the ladder over all the GPUs and stop at the first rung that fits:
   DDP (everything replicated: (w + g + o)·P per GPU), ZeRO-1, ZeRO-2 (shard the optimizer state, then the
   gradients too: no more traffic than DDP), ZeRO-3 / FSDP (shard the weights too: 1.5× the traffic).
   If even ZeRO-3 over every GPU does not fit, no layout of these GPUs will: (w + g + o)·P / N is the least
   any of them can hold. Add GPUs (at least ceil((w + g + o)·P / budget)) or other techniques.
2. Does one layer fit? ZeRO-3 still gathers each layer whole to compute it, so a layer whose own state does
   not fit on one GPU must be split: tensor parallelism, inside one node (every layer talks 4 times a
   micro-batch), with a degree that divides the heads.
3. Where are the node boundaries? If the sharded model fits in one node, keep it there and let the nodes be
   data-parallel replicas. If it must span nodes, the cross-node axis goes to pipeline parallelism (only
   boundary activations cross), tensor parallelism stays inside the node, and ZeRO shards what remains over
   the data-parallel group: "TP inside the node + PP across nodes + ZeRO over everything".

Only the training state is counted (as the source does): activations come on top (notebook 01: they grow with
batch and sequence length, and recomputation or TP shrinks them); pass ``reserve_bytes`` to keep room for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .ledger import CONVENTIONS, GiB, MiB, zero_state_bytes
from .mesh import Mesh, layer_params, params_per_rank
from .model import param_count_formula
from .tensor_parallel import check_tp_divisible


@dataclass
class Plan:
    mesh: Mesh | None                      # None: these GPUs cannot hold the training state
    zero_stage: int | None
    state_bytes: int                       # training state on the fullest GPU, for the plan (or for ZeRO-3)
    budget_bytes: int
    answers: list[str] = field(default_factory=list)   # the three questions, answered with numbers
    min_gpus: int | None = None            # when it does not fit: the fewest GPUs that could hold the state

    @property
    def fits(self) -> bool:
        return self.mesh is not None and self.state_bytes <= self.budget_bytes

    def __str__(self) -> str:
        if not self.fits:
            head = f"does not fit: at least {self.min_gpus} GPUs"
        else:
            m, name = self.mesh, ("DDP" if self.zero_stage == 0 else f"ZeRO-{self.zero_stage}")
            head = f"dp {m.dp} × tp {m.tp} × pp {m.pp}, {name}: {_size(self.state_bytes)} of state per GPU"
        return "\n".join([head] + [f"  {i}. {a}" for i, a in enumerate(self.answers, 1)])


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= 0.1 * GiB else f"{nbytes / MiB:.1f} MiB"


def state_per_gpu(config, mesh: Mesh, stage: int, convention: str = "mixed") -> dict[str, int]:
    """Training state on the fullest GPU of ``mesh`` with ZeRO-``stage`` over its dp group:
    {"weights", "grads", "optimizer", "total"} (ledger.zero_state_bytes of mesh.params_per_rank)."""
    return max((zero_state_bytes(params_per_rank(config, mesh, s), stage, mesh.dp,
                                 **CONVENTIONS[convention].per_param) for s in range(mesh.pp)),
               key=lambda state: state["total"])


def _state(config, mesh: Mesh, stage: int, convention: str) -> int:
    return state_per_gpu(config, mesh, stage, convention)["total"]


def plan(config, *, num_gpus: int, gpu_bytes: int, gpus_per_node: int = 8, convention: str = "mixed",
         reserve_bytes: int = 0) -> Plan:
    """The layout the three questions lead to for ``config`` on ``num_gpus`` GPUs of ``gpu_bytes`` each."""
    if num_gpus < 1 or gpus_per_node < 1 or num_gpus % min(gpus_per_node, num_gpus):
        raise ValueError(f"num_gpus={num_gpus} must be a whole number of nodes of gpus_per_node={gpus_per_node}")
    bytes_per_param = CONVENTIONS[convention].total
    budget = gpu_bytes - reserve_bytes
    num_params = param_count_formula(config)
    answers = []

    # 1. The state: the DDP / ZeRO ladder over every GPU.
    ladder = {stage: _state(config, Mesh(dp=num_gpus), stage, convention) for stage in range(4)}
    fitting = [stage for stage, nbytes in ladder.items() if nbytes <= budget]
    rungs = ", ".join(f"{'DDP' if s == 0 else f'ZeRO-{s}'} {_size(n)}" for s, n in ladder.items())
    if not fitting:
        min_gpus = math.ceil(bytes_per_param * num_params / budget)
        answers.append(f"state per GPU over {num_gpus} GPUs: {rungs}; none fits in {_size(budget)}: "
                       f"{bytes_per_param} B × {num_params:,} params needs at least {min_gpus} such GPUs")
        return Plan(None, None, ladder[3], budget, answers, min_gpus)
    stage = fitting[0]
    answers.append(f"state per GPU over {num_gpus} GPUs: {rungs}; first that fits in {_size(budget)}: "
                   f"{'DDP' if stage == 0 else f'ZeRO-{stage}'}")

    # 2. One layer: split it (TP, inside a node) if its own state does not fit on one GPU.
    layer_state = bytes_per_param * layer_params(config)
    tp = 1
    if layer_state > budget:
        for candidate in range(2, min(gpus_per_node, num_gpus) + 1):
            if _tp_ok(config, candidate) and layer_state / candidate <= budget:
                tp = candidate
                break
        else:
            raise ValueError(f"one layer's state ({_size(layer_state)}) does not fit in {_size(budget)} even split "
                             f"over the {gpus_per_node} GPUs of a node that TP may use")
        answers.append(f"one layer's state is {_size(layer_state)} > {_size(budget)}: TP={tp} inside a node")
    else:
        answers.append(f"one layer's state is {_size(layer_state)}: fits on one GPU, its size forces no TP")

    # 3. Node boundaries: keep the model inside one node if its sharded state fits there.
    node = min(gpus_per_node, num_gpus)
    if any(_state(config, Mesh(dp=node // tp, tp=tp), s, convention) <= budget for s in range(4)):
        mesh = Mesh(dp=num_gpus // tp, tp=tp)
        stage = next(s for s in range(4) if _state(config, mesh, s, convention) <= budget)
        where = "the nodes are data-parallel replicas" if num_gpus > node else "nothing crosses nodes"
        answers.append(f"the model fits in one node of {node} GPUs: " +
                       (f"its TP group stays inside a node and {where}" if tp > 1 else where))
    else:   # it must span nodes: a node is one TP group (its fast links), PP crosses nodes, ZeRO shards the rest
        node_tp = max(t for t in range(1, node + 1) if node % t == 0 and _tp_ok(config, t))
        layouts = [Mesh(dp=num_gpus // (node_tp * pp), tp=node_tp, pp=pp) for pp in range(2, config.num_layers + 1)
                   if num_gpus % (node_tp * pp) == 0]
        # ZeRO-1 at least on a dp axis: it costs no more traffic than DDP and leaves room for activations
        found = [(mesh, s) for mesh in layouts for s in range(1 if mesh.dp > 1 else 0, 4)
                 if _state(config, mesh, s, convention) <= budget]
        if found:
            mesh, stage = found[0]
            answers.append(f"the model does not fit in one node of {node} GPUs, so it spans nodes: each node is one "
                           f"TP={mesh.tp} group (TP talks in every layer: it needs the node's fast links), PP={mesh.pp}"
                           " crosses nodes, " + (f"ZeRO-{stage} over the dp group of {mesh.dp} (free: DDP's traffic)"
                                                 if mesh.dp > 1 else "no data parallelism left"))
        else:   # no pipeline fits (the embedding and head are whole on their stage): shard them with ZeRO-3
            mesh, stage = Mesh(dp=num_gpus // tp, tp=tp), 3
            answers.append(f"the model does not fit in one node of {node} GPUs, and no pipeline of TP={node_tp} "
                           f"stages does: ZeRO-3 over all {mesh.dp} data-parallel ranks, across nodes")
    return Plan(mesh, stage, _state(config, mesh, stage, convention), budget, answers)


def _tp_ok(config, tp: int) -> bool:
    try:
        check_tp_divisible(config, tp)
        return True
    except ValueError:
        return False


def bad_smells(mesh: Mesh, *, gpus_per_node: int = 8, num_microbatches: int | None = None,
               zero_stage: int = 0, config=None, gpu_bytes: int | None = None) -> list[str]:
    """The source's warnings against turning parallelism up like a speed knob, for one layout."""
    from .pipeline_parallel import bubble_fraction

    smells = []
    if mesh.tp > gpus_per_node:
        smells.append(f"TP {mesh.tp} > {gpus_per_node} GPUs per node: its 4 all-reduces per layer and micro-batch "
                      "would cross the slow network between nodes")
    if mesh.pp > 1 and num_microbatches is not None and num_microbatches < mesh.pp:
        smells.append(f"PP {mesh.pp} stages > {num_microbatches} micro-batches: the bubble is "
                      f"{bubble_fraction(mesh.pp, num_microbatches):.0%} of the step")
    if zero_stage == 3 and config is not None and gpu_bytes is not None:
        whole = zero_state_bytes(param_count_formula(config), 0, 1)["total"]
        if whole <= gpu_bytes:
            smells.append(f"ZeRO-3 on a model whose whole state ({whole / GiB:.2f} GiB) fits on one GPU: 1.5× the "
                          "traffic of DDP for memory that was not needed")
    return smells
