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
   data-parallel group: "TP inside the node + PP across nodes + ZeRO over everything". With a pipeline this
   question takes ZeRO-1, as the source and DeepSpeed do: stages 2 and 3 reduce (and gather) for every
   micro-batch. That is a cost, not a rule: question 5 also costs ZeRO-3 with a pipeline (TP + PP + FSDP).

The ZeRO stage is chosen again for the final layout (TP and PP already cut the model, so a lower rung may do).

The three questions count the training state only, as the source does. A GPU also holds activations, and
two more questions, asked of the workload (sequence length s, micro-batch b, global batch B, recomputation,
sequence parallelism), decide:

4. Does it fit with its activations? On the busiest GPU: state + peak saved activations (per_rank.
   activation_bytes_per_rank: 1F1B keeps p - s micro-batches in flight on stage s) + a reserve (RESERVE_SHARE
   of the card: the caching allocator's fragmentation, NCCL's buffers, cuBLAS workspaces, temporaries such as
   a gathered layer's output). The global batch ties the axes: m = B / (dp · b) micro-batches per step, so more
   dp means fewer micro-batches and a bigger bubble.
5. Which recipe is fastest? Every layout of five recipes (data parallelism alone with DDP or ZeRO-1/2;
   ZeRO-3 / FSDP alone; FSDP + TP; Megatron-style TP + PP + ZeRO-1, with 1F1B or interleaved; TP + PP + FSDP,
   as Llama 3 and torchtitan run it: recipes.py) is costed with cost.step_time; the fastest that fits wins, and
   the answer says by how much and why the others lost, and calls a tie what the cost model cannot rank. (HSDP, FSDP sharded
   inside a node and replicated across nodes, sits between the last two: the same cuts as FSDP with less
   traffic across nodes and more memory per GPU.)
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

from .cost import StepTime
from .hardware import find_gpu
from .ledger import CONVENTIONS, zero_state_bytes
from .mesh import Mesh
from .model import ModelConfig, param_count_formula
from .pipeline_parallel import bubble_fraction
from .recipes import (
    RESERVE_SHARE,
    Layout,
    Workload,
    compare_recipes,
    gathered_layer_bytes,
    memory_per_gpu,
    need_per_gpu,
    seconds_text,
    share_text,
    size_text,
    stage_name,
    state_per_gpu,
    tp_splits_heads,
)
from .runtime.arguments import check_number, check_whole

# Two recipes within this share of each other's tokens/s are a tie: cost.step_time lands within 5 points of MFU
# of published runs (published.compare_published), and 5 points are 11% of a 45% MFU, so it cannot rank them.
TIE_SHARE = 0.11

QUESTIONS = ("does the training state fit?", "does one layer fit?", "where are the node boundaries?",
             "with the activations, does it fit?", "which recipe is fastest?")


@dataclass
class Plan:
    mesh: Mesh | None                      # None: no layout of these GPUs fits
    zero_stage: int | None
    state_bytes: int                       # the chosen layout's training state on its fullest GPU
    budget_bytes: int                      # what questions 1-3 weigh the state against: the whole card
    answers: list[str] = field(default_factory=list)   # the five questions, answered with numbers
    min_gpus: int | None = None            # when even the state does not fit: a lower bound on the GPUs it needs
    num_microbatches: int | None = None
    memory: dict[str, int] = field(default_factory=dict)     # the chosen layout's busiest GPU
    time: StepTime | None = None
    candidates: list[Layout] = field(default_factory=list)   # the best layout of each recipe, fastest first
    gpu_bytes: int = 0
    source: tuple[Mesh, int] | None = None  # the three questions' layout and ZeRO stage, from the state alone
    num_chunks: int = 1                     # v > 1: the chosen pipeline is interleaved over v chunks per GPU
    assumed: str = ""                       # what question 4 assumed (the workload's choices, the state's convention)

    @property
    def fits(self) -> bool:
        return self.mesh is not None and self.memory.get("total", math.inf) <= self.gpu_bytes

    def _repr_html_(self) -> str:
        """In a notebook: the verdict, the five answers as a table, the recipes side by side, the assumptions once
        (the text of ``str(plan)`` wraps mid-word at a normal window width)."""
        from .presentation.tables import table_html  # only a notebook draws a plan as HTML

        answers = [a.replace(f"; assumed: {self.assumed}", "") if self.assumed else a for a in self.answers]
        out = [f"<p><b>{html.escape(str(self).splitlines()[0])}</b></p>",
               table_html(["question", "answer"], [[f"{i}. {q}", a] for i, (q, a) in
                                                   enumerate(zip(QUESTIONS, answers), 1)])]
        if self.candidates:
            fastest = max((c.time.tokens_per_s for c in self.candidates if c.fits), default=None)
            rows = []
            for c in self.candidates:
                m, zero = c.mesh, "no dp" if c.mesh.dp == 1 else stage_name(c.zero_stage)
                chunks = f", v = {c.num_chunks}" if c.num_chunks > 1 else ""
                if not c.fits:
                    against = "does not fit"
                elif fastest is None or c.time.tokens_per_s == fastest:
                    against = "fastest"
                else:
                    ratio = c.time.tokens_per_s / fastest
                    against = f"{ratio:.2g}×" + (" (a tie: within the model's error)" if ratio > 1 - TIE_SHARE else "")
                rows.append([c.recipe, f"dp {m.dp} × tp {m.tp} × pp {m.pp}{chunks}, {zero}, m = {c.num_microbatches}",
                             f"{size_text(c.memory['total'])} of {size_text(c.gpu_bytes)}",
                             size_text(c.memory["state"]), size_text(c.memory["activations"]),
                             f"{c.time.tokens_per_s:,.0f}", share_text(c.time.mfu), against])
            out.append(table_html(["recipe", "layout", "busiest GPU", "state", "activations", "tokens/s", "MFU",
                                   "against the fastest"], rows))
        if self.assumed:
            out.append(f"<p><i>assumed: {html.escape(self.assumed)}</i></p>")
        return "".join(out)

    def __str__(self) -> str:
        if not self.fits:
            head = "does not fit" + (f": at least {self.min_gpus} GPUs" if self.min_gpus else "")
        else:
            m = self.mesh
            name = "no data parallelism" if m.dp == 1 else stage_name(self.zero_stage) + " over dp"
            chunks = f" (interleaved, v = {self.num_chunks})" if self.num_chunks > 1 else ""
            head = (f"dp {m.dp} × tp {m.tp} × pp {m.pp}{chunks}, {name}, m = {self.num_microbatches}: "
                    f"{size_text(self.memory['total'])} per GPU, {self.time.tokens_per_s:,.0f} tokens/s, "
                    f"MFU {share_text(self.time.mfu)}")
        return "\n".join([head] + [f"  {i}. {a}" for i, a in enumerate(self.answers, 1)])


def plan(config, *, num_gpus: int, gpu_bytes: int | None = None, gpus_per_node: int = 8, convention: str = "mixed",
         workload: Workload | None = None, gpu="A100 80GB", reserve_share: float = RESERVE_SHARE) -> Plan:
    """The five questions for ``config`` on ``num_gpus`` GPUs of ``gpu_bytes`` each (default: ``gpu``'s memory;
    ``gpu``, a hardware.GPUS key, also sets the speed and links that step time uses) for ``workload`` (default:
    Workload()). The three questions give the source's layout from the state alone; the chosen layout is the
    fastest that fits with its activations (questions 4 and 5), and ``fits`` is true only for such a layout."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"plan takes a ModelConfig first (e.g. preset('llama2-7b')), not {type(config).__name__} "
                        f"{config!r:.40}")
    if workload is not None and not isinstance(workload, Workload):
        raise TypeError(f"workload={workload!r:.40}: a recipes.Workload (e.g. Workload(global_batch_size=512)), "
                        f"not {type(workload).__name__}")
    check_whole("num_gpus", num_gpus)
    check_whole("gpus_per_node", gpus_per_node)
    if gpu_bytes is not None:
        check_number("gpu_bytes", gpu_bytes, above=0)
    if convention not in CONVENTIONS:
        raise ValueError(f"convention={convention!r}: choose one of {', '.join(map(repr, CONVENTIONS))}")
    check_number("reserve_share", reserve_share, at_least=0, below=1)
    if num_gpus % min(gpus_per_node, num_gpus):
        raise ValueError(f"num_gpus={num_gpus} must be a whole number of nodes of gpus_per_node={gpus_per_node}")
    workload = workload or Workload()
    gpu_bytes = gpu_bytes or find_gpu(gpu).memory_bytes
    # Questions 1-3 weigh the state against the whole card, as the source does; 4 adds activations and the reserve.
    ask = _Questions(config, num_gpus, gpu_bytes, min(gpus_per_node, num_gpus), convention)
    stage, ladder = ask.does_the_state_fit()
    if stage is None:
        whole = CONVENTIONS[convention].total * param_count_formula(config)
        return Plan(None, None, ladder[3], ask.budget, ask.answers, math.ceil(whole / ask.budget), gpu_bytes=gpu_bytes)
    tp = ask.does_one_layer_fit(stage, ladder[3])
    source = ask.where_are_the_node_boundaries(tp)
    candidates = compare_recipes(config, num_gpus=num_gpus, gpu_bytes=gpu_bytes, workload=workload, gpu=gpu,
                                 gpus_per_node=gpus_per_node, convention=convention, reserve_share=reserve_share)
    ask.with_activations(source, workload, gpu_bytes, reserve_share)
    ask.which_is_fastest(candidates)
    chosen = candidates[0] if candidates and candidates[0].fits else None
    if chosen is None:
        return Plan(None, None, ladder[3], ask.budget, ask.answers, candidates=candidates, gpu_bytes=gpu_bytes,
                    source=source, assumed=ask.assumed)
    return Plan(chosen.mesh, chosen.zero_stage, chosen.memory["state"], ask.budget, ask.answers,
                num_microbatches=chosen.num_microbatches, memory=chosen.memory, time=chosen.time,
                candidates=candidates, gpu_bytes=gpu_bytes, source=source, num_chunks=chosen.num_chunks,
                assumed=ask.assumed)


@dataclass
class _Questions:
    """The three questions for one model and cluster; each appends its answer, with numbers, to ``answers``."""
    config: object
    num_gpus: int
    budget: int
    node: int                 # GPUs per node (or all of them, if fewer)
    convention: str
    answers: list[str] = field(default_factory=list)
    assumed: str = ""

    def first_fit(self, mesh: Mesh, stages=range(4)) -> int | None:
        return next((s for s in stages if need_per_gpu(self.config, mesh, s, self.convention) <= self.budget), None)

    def does_the_state_fit(self) -> tuple[int | None, dict[int, int]]:
        """1. The DDP / ZeRO ladder over every GPU: the first rung that fits (None: none does)."""
        ladder = {s: state_per_gpu(self.config, Mesh(dp=self.num_gpus), s, self.convention)["total"] for s in range(4)}
        rungs = ", ".join(f"{stage_name(s)} {size_text(n)}" for s, n in ladder.items())
        stage = next((s for s, n in ladder.items() if n <= self.budget), None)
        if stage is None:
            whole = CONVENTIONS[self.convention].total * param_count_formula(self.config)
            self.answers.append(f"state per GPU over {gpus(self.num_gpus)}: {rungs}; none fits in "
                                f"{size_text(self.budget)}: {size_text(whole)} of state needs at least "
                                f"{math.ceil(whole / self.budget)} such GPUs")
        else:
            self.answers.append(f"state per GPU over {gpus(self.num_gpus)}: {rungs}; first that fits in "
                                f"{size_text(self.budget)}: {stage_name(stage)}")
        return stage, ladder

    def does_one_layer_fit(self, stage: int, shards: int) -> int:
        """2. With ZeRO-3 a layer is gathered whole beside the ``shards``; if it does not fit, split it (TP, in a
        node). Returns the TP degree."""
        layer = gathered_layer_bytes(self.config, 1, self.convention)
        if stage != 3 or shards + layer <= self.budget:
            self.answers.append(f"one layer gathered whole is {size_text(layer)}: it fits, its size forces no TP")
            return 1
        tp = next((t for t in range(2, self.node + 1) if self.node % t == 0 and tp_splits_heads(self.config, t)
                   and shards + layer / t <= self.budget), None)
        if tp is None:
            raise ValueError(f"one layer's weights and gradients ({size_text(layer)}) do not fit beside the shards "
                             f"({size_text(shards)}) in {size_text(self.budget)}, even split over the {gpus(self.node)} "
                             "of a node")
        self.answers.append(f"one layer gathered whole is {size_text(layer)}, beside {size_text(shards)} of shards > "
                            f"{size_text(self.budget)}: TP={tp} inside a node")
        return tp

    def where_are_the_node_boundaries(self, tp: int) -> tuple[Mesh, int] | None:
        """3. Keep the model inside one node if its sharded state fits there; else TP takes the node, PP
        crosses nodes, with ZeRO-1 over dp (the planner's choice beside a pipeline: it reduces once per step; or,
        if no pipeline fits, ZeRO-3 across nodes)."""
        node, num_gpus = self.node, self.num_gpus
        if self.first_fit(Mesh(dp=node // tp, tp=tp)) is not None:
            mesh = Mesh(dp=num_gpus // tp, tp=tp)
            where = "the nodes are data-parallel replicas" if num_gpus > node else "nothing crosses nodes"
            self.answers.append(f"the model fits in one node of {gpus(node)}: "
                                + (f"its TP group stays inside a node and {where}" if tp > 1 else where))
            return mesh, self.first_fit(mesh)
        node_tp = max(t for t in range(1, node + 1) if node % t == 0 and tp_splits_heads(self.config, t))
        layouts = [Mesh(dp=num_gpus // (node_tp * pp), tp=node_tp, pp=pp)
                   for pp in range(2, self.config.num_layers + 1) if num_gpus % (node_tp * pp) == 0]
        # ZeRO-1 whenever there is a dp axis: it costs no more traffic than DDP and leaves room for activations
        found = [(m, s) for m in layouts for s in ((1,) if m.dp > 1 else (0,))
                 if need_per_gpu(self.config, m, s, self.convention) <= self.budget]
        groups = "one TP group" if node_tp == node else f"{node // node_tp} TP groups of {node_tp}"
        if found:
            mesh, stage = found[0]
            self.answers.append(f"the model does not fit in one node of {gpus(node)}, so it spans nodes: each node "
                                f"holds {groups} (TP talks in every layer: it needs the node's fast links), "
                                f"PP={mesh.pp} crosses nodes, "
                                + (f"ZeRO-1 over the dp group of {mesh.dp} (free: DDP's traffic)"
                                   if mesh.dp > 1 else "no data parallelism left"))
            return mesh, stage
        if self.first_fit(Mesh(dp=num_gpus // tp, tp=tp), (3,)) is not None:   # no pipeline fits: ZeRO-3
            mesh = Mesh(dp=num_gpus // tp, tp=tp)
            self.answers.append(f"the model does not fit in one node of {gpus(node)}, and no pipeline with ZeRO-1 "
                                f"does: ZeRO-3 over all {mesh.dp} data-parallel ranks, across nodes (1.5× DDP's "
                                "traffic)")
            return mesh, 3
        self.answers.append(f"no layout of {gpus(num_gpus)} holds the state and one gathered layer")
        return None


    def with_activations(self, source: tuple[Mesh, int] | None, workload: Workload, gpu_bytes: int,
                         reserve_share: float) -> None:
        """4. The three questions' layout with the workload's activations and the reserve: does it still fit?"""
        if source is None:
            return
        mesh, stage = source
        m = workload.num_microbatches(mesh.dp)
        seq_len = workload.seq_len or self.config.max_seq_len
        shape = (f"{workload.global_batch_size} sequences of {seq_len} tokens, micro-batch "
                 f"{workload.micro_batch_size}, {workload.recompute} recomputation"
                 + (", sequence parallelism" if workload.sequence_parallel else ""))
        if m is None:
            self.answers.append(f"with {shape}: the batch does not split into whole micro-batches over dp {mesh.dp}")
            return
        memory = memory_per_gpu(self.config, mesh, stage, workload, gpu_bytes=gpu_bytes,
                                convention=self.convention, reserve_share=reserve_share)
        verdict = "it fits" if memory["total"] <= gpu_bytes else "it does NOT fit"
        self.assumed = (f"{workload.assumptions()}; state as {self.convention!r}, "
                        f"{CONVENTIONS[self.convention].description}")
        self.answers.append(f"with {shape} (m = {m}; assumed: {self.assumed}): that layout needs "
                            f"{size_text(memory['state'])} of state + "
                            f"{size_text(memory['activations'])} of activations + {size_text(memory['reserve'])} reserve = "
                            f"{size_text(memory['total'])} of {size_text(gpu_bytes)}: {verdict}")

    def which_is_fastest(self, candidates: list[Layout]) -> None:
        """5. The recipes side by side: the fastest that fits, and what each other one loses on."""
        fitting = [c for c in candidates if c.fits]
        if not fitting:
            least = min(candidates, key=lambda c: c.memory["total"], default=None)
            self.answers.append("no recipe fits with its activations" + (
                f"; the closest is {least.recipe}, {size_text(least.memory['total'])} of {size_text(least.gpu_bytes)}: "
                "recompute more, shorten the micro-batch, or add GPUs" if least else ""))
            return
        best, parts = fitting[0], []
        for other in candidates[1:]:
            if not other.fits:
                parts.append(f"{other.recipe} does not fit ({size_text(other.memory['total'])})")
                continue
            slower = {k: v - best.time.breakdown().get(k, 0.0) for k, v in other.time.breakdown().items()}
            worst = max(slower, key=slower.get)
            ratio = other.time.tokens_per_s / best.time.tokens_per_s
            tie = ", a tie: closer than the cost model can tell" if ratio > 1 - TIE_SHARE else ""
            parts.append(f"{other.recipe} {ratio:.2g}× as fast ({worst} +{seconds_text(slower[worst])} a step{tie})")
        self.answers.append(f"fastest that fits: {best}" + ("; " + "; ".join(parts) if parts else ""))


def gpus(count: int) -> str:
    """'1 GPU', '8 GPUs': the count with its noun."""
    return f"{count} GPU" + ("" if count == 1 else "s")


def bad_smells(mesh: Mesh, *, gpus_per_node: int = 8, num_microbatches: int | None = None,
               zero_stage: int = 0, config=None, gpu_bytes: int | None = None) -> list[str]:
    """The source's warnings against turning parallelism up like a speed knob, for one layout."""
    smells = []
    if mesh.tp > gpus_per_node or gpus_per_node % mesh.tp:
        smells.append(f"TP {mesh.tp} does not fit in the nodes of {gpus(gpus_per_node)}: its 4 all-reduces per layer "
                      "and micro-batch would cross the slow network between nodes")
    if mesh.pp > 1 and num_microbatches is not None and num_microbatches < mesh.pp:
        smells.append(f"PP {mesh.pp} stages > {num_microbatches} micro-batches: the bubble is "
                      f"{bubble_fraction(mesh.pp, num_microbatches):.0%} of the pipeline's time")
    if zero_stage == 3 and config is not None and gpu_bytes is not None:
        whole = zero_state_bytes(param_count_formula(config), 0, 1)["total"]
        if whole <= gpu_bytes:
            smells.append(f"ZeRO-3 on a model whose whole state ({size_text(whole)}) fits on one GPU: 1.5× the "
                          "traffic of DDP for memory that was not needed")
    return smells
