"""Which parallelism for which model and cluster: three questions, each answered with the ledger.

1. Does the training state fit? Climb the ladder over all the GPUs and stop at the first rung that fits:
   DDP (everything replicated: (w + g + o)·P per GPU), ZeRO-1, ZeRO-2 (shard the optimizer state, then the
   gradients too: no more traffic than DDP), ZeRO-3 / FSDP (shard the weights too: 1.5× the traffic).
   If even ZeRO-3 over every GPU does not fit, no layout of these GPUs will: (w + g + o)·P / N is the least
   any of them can hold. Add GPUs (at least ceil((w + g + o)·P / budget)) or other techniques.
2. Does one layer fit? ZeRO-3 gathers each layer whole to compute it: its weights and gradients, (w + g) bytes
   per parameter of the layer, must fit beside the GPU's shards. If they do not, split the layer: tensor
   parallelism, inside one node (every layer talks 4 times a micro-batch), with a degree that divides the
   heads and the node.
3. Where are the node boundaries? If the sharded model fits in one node, keep it there and let the nodes be
   data-parallel replicas. If it must span nodes, the cross-node axis goes to pipeline parallelism (only
   boundary activations cross), tensor parallelism takes the node, and ZeRO shards what remains over the
   data-parallel group: "TP inside the node + PP across nodes + ZeRO over everything". With a pipeline, ZeRO
   stops at stage 1: stages 2 and 3 would reduce or gather for every micro-batch (DeepSpeed refuses them).

The ZeRO stage is chosen again for the final layout (TP and PP already cut the model, so a lower rung may do).
Only the training state and one gathered layer are counted, as the source counts: activations come on top
(notebook 01: they grow with batch and sequence length; recomputation or TP shrinks them); pass
``reserve_bytes`` to keep room for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .ledger import CONVENTIONS, zero_state_bytes
from .mesh import Mesh, layer_params, params_per_rank
from .model import param_count_formula
from .pipeline_parallel import bubble_fraction
from .tensor_parallel import check_tp_divisible
from .units import GiB, MiB


@dataclass
class Plan:
    mesh: Mesh | None                      # None: these GPUs cannot hold the training state
    zero_stage: int | None
    state_bytes: int                       # what the fullest GPU needs for the plan (for ZeRO-3 over all, if none)
    budget_bytes: int
    answers: list[str] = field(default_factory=list)   # the three questions, answered with numbers
    min_gpus: int | None = None            # when it does not fit: a lower bound on the GPUs it needs

    @property
    def fits(self) -> bool:
        return self.mesh is not None and self.state_bytes <= self.budget_bytes

    def __str__(self) -> str:
        if not self.fits:
            head = "does not fit" + (f": at least {self.min_gpus} GPUs" if self.min_gpus else "")
        else:
            m = self.mesh
            name = "no data parallelism" if m.dp == 1 else stage_name(self.zero_stage) + " over dp"
            head = f"dp {m.dp} × tp {m.tp} × pp {m.pp}, {name}: {_size(self.state_bytes)} per GPU"
        return "\n".join([head] + [f"  {i}. {a}" for i, a in enumerate(self.answers, 1)])


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= 0.1 * GiB else f"{nbytes / MiB:.1f} MiB"


def stage_name(stage: int) -> str:
    return "DDP" if stage == 0 else f"ZeRO-{stage}"


def _tp_ok(config, tp: int) -> bool:
    try:
        check_tp_divisible(config, tp)
        return True
    except ValueError:
        return False


def state_per_gpu(config, mesh: Mesh, stage: int, convention: str = "mixed") -> dict[str, int]:
    """Training state on the fullest GPU of ``mesh`` with ZeRO-``stage`` over its dp group:
    {"weights", "grads", "optimizer", "total"} (ledger.zero_state_bytes of mesh.params_per_rank)."""
    return max((zero_state_bytes(params_per_rank(config, mesh, s), stage, mesh.dp,
                                 **CONVENTIONS[convention].per_param) for s in range(mesh.pp)),
               key=lambda state: state["total"])


def gathered_layer_bytes(config, tp: int = 1, convention: str = "mixed") -> int:
    """What ZeRO-3 gathers to compute one layer: its weights and gradients, whole (or this rank's TP slice)."""
    per_param = CONVENTIONS[convention]
    return (per_param.weight_bytes + per_param.grad_bytes) * layer_params(config, tp)


def need_per_gpu(config, mesh: Mesh, stage: int, convention: str = "mixed") -> int:
    """The fullest GPU's training state, plus, with ZeRO-3, one layer gathered whole beside its shards."""
    extra = gathered_layer_bytes(config, mesh.tp, convention) if stage == 3 else 0
    return state_per_gpu(config, mesh, stage, convention)["total"] + extra


def plan(config, *, num_gpus: int, gpu_bytes: int, gpus_per_node: int = 8, convention: str = "mixed",
         reserve_bytes: int = 0) -> Plan:
    """The layout the three questions lead to for ``config`` on ``num_gpus`` GPUs of ``gpu_bytes`` each."""
    if num_gpus < 1 or gpus_per_node < 1 or num_gpus % min(gpus_per_node, num_gpus):
        raise ValueError(f"num_gpus={num_gpus} must be a whole number of nodes of gpus_per_node={gpus_per_node}")
    ask = _Questions(config, num_gpus, gpu_bytes - reserve_bytes, min(gpus_per_node, num_gpus), convention)
    stage, ladder = ask.does_the_state_fit()
    if stage is None:
        whole = CONVENTIONS[convention].total * param_count_formula(config)
        return Plan(None, None, ladder[3], ask.budget, ask.answers, math.ceil(whole / ask.budget))
    tp = ask.does_one_layer_fit(stage, ladder[3])
    layout = ask.where_are_the_node_boundaries(tp)
    if layout is None:
        return Plan(None, None, ladder[3], ask.budget, ask.answers)
    mesh, stage = layout
    return Plan(mesh, stage, need_per_gpu(config, mesh, stage, convention), ask.budget, ask.answers)


@dataclass
class _Questions:
    """The three questions for one model and cluster; each appends its answer, with numbers, to ``answers``."""
    config: object
    num_gpus: int
    budget: int
    node: int                 # GPUs per node (or all of them, if fewer)
    convention: str
    answers: list[str] = field(default_factory=list)

    def first_fit(self, mesh: Mesh, stages=range(4)) -> int | None:
        return next((s for s in stages if need_per_gpu(self.config, mesh, s, self.convention) <= self.budget), None)

    def does_the_state_fit(self) -> tuple[int | None, dict[int, int]]:
        """1. The DDP / ZeRO ladder over every GPU: the first rung that fits (None: none does)."""
        ladder = {s: state_per_gpu(self.config, Mesh(dp=self.num_gpus), s, self.convention)["total"] for s in range(4)}
        rungs = ", ".join(f"{stage_name(s)} {_size(n)}" for s, n in ladder.items())
        stage = next((s for s, n in ladder.items() if n <= self.budget), None)
        if stage is None:
            whole = CONVENTIONS[self.convention].total * param_count_formula(self.config)
            self.answers.append(f"state per GPU over {self.num_gpus} GPUs: {rungs}; none fits in "
                                f"{_size(self.budget)}: {_size(whole)} of state needs at least "
                                f"{math.ceil(whole / self.budget)} such GPUs")
        else:
            self.answers.append(f"state per GPU over {self.num_gpus} GPUs: {rungs}; first that fits in "
                                f"{_size(self.budget)}: {stage_name(stage)}")
        return stage, ladder

    def does_one_layer_fit(self, stage: int, shards: int) -> int:
        """2. With ZeRO-3 a layer is gathered whole beside the ``shards``; if it does not fit, split it (TP, in a
        node). Returns the TP degree."""
        layer = gathered_layer_bytes(self.config, 1, self.convention)
        if stage != 3 or shards + layer <= self.budget:
            self.answers.append(f"one layer gathered whole is {_size(layer)}: it fits, its size forces no TP")
            return 1
        tp = next((t for t in range(2, self.node + 1) if self.node % t == 0 and _tp_ok(self.config, t)
                   and shards + layer / t <= self.budget), None)
        if tp is None:
            raise ValueError(f"one layer's weights and gradients ({_size(layer)}) do not fit beside the shards "
                             f"({_size(shards)}) in {_size(self.budget)}, even split over the {self.node} GPUs "
                             "of a node")
        self.answers.append(f"one layer gathered whole is {_size(layer)}, beside {_size(shards)} of shards > "
                            f"{_size(self.budget)}: TP={tp} inside a node")
        return tp

    def where_are_the_node_boundaries(self, tp: int) -> tuple[Mesh, int] | None:
        """3. Keep the model inside one node if its sharded state fits there; else TP takes the node, PP
        crosses nodes, ZeRO-1 at most with a pipeline (or, if no pipeline fits, ZeRO-3 across nodes)."""
        node, num_gpus = self.node, self.num_gpus
        if self.first_fit(Mesh(dp=node // tp, tp=tp)) is not None:
            mesh = Mesh(dp=num_gpus // tp, tp=tp)
            where = "the nodes are data-parallel replicas" if num_gpus > node else "nothing crosses nodes"
            self.answers.append(f"the model fits in one node of {node} GPUs: "
                                + (f"its TP group stays inside a node and {where}" if tp > 1 else where))
            return mesh, self.first_fit(mesh)
        node_tp = max(t for t in range(1, node + 1) if node % t == 0 and _tp_ok(self.config, t))
        layouts = [Mesh(dp=num_gpus // (node_tp * pp), tp=node_tp, pp=pp)
                   for pp in range(2, self.config.num_layers + 1) if num_gpus % (node_tp * pp) == 0]
        # ZeRO-1 whenever there is a dp axis: it costs no more traffic than DDP and leaves room for activations
        found = [(m, s) for m in layouts for s in ((1,) if m.dp > 1 else (0,))
                 if need_per_gpu(self.config, m, s, self.convention) <= self.budget]
        groups = "one TP group" if node_tp == node else f"{node // node_tp} TP groups of {node_tp}"
        if found:
            mesh, stage = found[0]
            self.answers.append(f"the model does not fit in one node of {node} GPUs, so it spans nodes: each node "
                                f"holds {groups} (TP talks in every layer: it needs the node's fast links), "
                                f"PP={mesh.pp} crosses nodes, "
                                + (f"ZeRO-1 over the dp group of {mesh.dp} (free: DDP's traffic)"
                                   if mesh.dp > 1 else "no data parallelism left"))
            return mesh, stage
        if self.first_fit(Mesh(dp=num_gpus // tp, tp=tp), (3,)) is not None:   # no pipeline fits: ZeRO-3
            mesh = Mesh(dp=num_gpus // tp, tp=tp)
            self.answers.append(f"the model does not fit in one node of {node} GPUs, and no pipeline with ZeRO-1 "
                                f"does: ZeRO-3 over all {mesh.dp} data-parallel ranks, across nodes (1.5× DDP's "
                                "traffic)")
            return mesh, 3
        self.answers.append(f"no layout of {num_gpus} GPUs holds the state and one gathered layer")
        return None


def bad_smells(mesh: Mesh, *, gpus_per_node: int = 8, num_microbatches: int | None = None,
               zero_stage: int = 0, config=None, gpu_bytes: int | None = None) -> list[str]:
    """The source's warnings against turning parallelism up like a speed knob, for one layout."""
    smells = []
    if mesh.tp > gpus_per_node or gpus_per_node % mesh.tp:
        smells.append(f"TP {mesh.tp} does not fit in the nodes of {gpus_per_node} GPUs: its 4 all-reduces per layer "
                      "and micro-batch would cross the slow network between nodes")
    if mesh.pp > 1 and num_microbatches is not None and num_microbatches < mesh.pp:
        smells.append(f"PP {mesh.pp} stages > {num_microbatches} micro-batches: the bubble is "
                      f"{bubble_fraction(mesh.pp, num_microbatches):.0%} of the step")
    if mesh.pp > 1 and zero_stage >= 2:
        smells.append(f"ZeRO-{zero_stage} with a pipeline: its gradients (and weights) would be reduced (and "
                      "gathered) for every micro-batch; ZeRO-1 is the most a pipeline takes")
    if zero_stage == 3 and config is not None and gpu_bytes is not None:
        whole = zero_state_bytes(param_count_formula(config), 0, 1)["total"]
        if whole <= gpu_bytes:
            smells.append(f"ZeRO-3 on a model whose whole state ({_size(whole)}) fits on one GPU: 1.5× the "
                          "traffic of DDP for memory that was not needed")
    return smells
