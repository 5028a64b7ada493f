"""What each rank of a mesh holds and sends: the one source of every per-rank formula.

course_lib.parallelize cuts the model over a mesh; this module says, without running anything, what that
leaves on one rank: its parameters (``params_per_rank``), its training state and data-parallel bytes under ZeRO
or HSDP (``data_parallel_state_bytes``, ``data_parallel_bytes_per_step``), the bytes it sends on every axis in a
step (``sent_bytes_per_rank``) and its saved activations (``activation_bytes_per_rank``). The planner (recipes,
plan), the cost model, the labs and the virtual cluster all call these; the virtual cluster measures each one.

Data parallelism, once. The ranks that hold the same weights are the dp × cp ranks of one (pp, tp) place: CP
splits the sequence, not the weights. So ZeRO shards the state over dp·cp ranks, and their gradients are
averaged over them ("dp_cp"). Two refinements, each one part of a rank's parameters with its own group:

* a mixture's experts (ep > 1) are held by dp·cp/ep ranks ("expert_dp"): their state is sharded, and their
  gradients averaged, over those;
* HSDP (dp_replicate > 1) shards over the dp_shard·cp ranks of a replica and all-reduces the shards'
  gradients over the dp_replicate replicas (course_lib.hsdp).

``data_parallel_parts`` lists these parts as (parameters, shard group, replicas); every data-parallel formula
here adds ledger.zero_state_bytes, zero_bytes.wire_bytes_per_step or hsdp.hsdp_wire_bytes_per_step over them.
"""

from __future__ import annotations

from .comm import wire_bytes
from .context_parallel import ring_attention_activation_bytes, ring_attention_bytes
from .expert_parallel import all_to_all_bytes
from .hsdp import hsdp_wire_bytes_per_step
from .job import Job
from .ledger import (
    CONVENTIONS,
    gpt_activation_bytes,
    gpt_layer_activation_bytes,
    recomputed_layer_bytes,
    zero_state_bytes,
)
from .mesh import Mesh
from .model import layer_projection_params
from .pipeline_parallel import partition_layers
from .schedules import SCHEDULES, op_parts, splits_backward
from .tensor_parallel import tp_allreduce_bytes, tp_step_traffic
from .vocab_parallel import vocab_parallel_activation_bytes, vocab_parallel_traffic
from .zero_bytes import transient_gradient_bytes, transient_weight_bytes, wire_bytes_per_step


def _expert_mlp_params(config) -> int:
    """One layer's expert MLPs, all E of them (3·d·intermediate each); 0 for a dense model."""
    return getattr(config, "num_experts", 0) * 3 * config.hidden * config.intermediate


def layer_params(config, tp: int = 1, ep: int = 1) -> int:
    """Parameters of one transformer layer on one of ``tp`` ranks (and of ``ep``): its 7 matrices (and q/k/v
    biases, if any) split over tp, of a mixture of experts E/ep experts (the router whole), its 2 norms whole."""
    experts = _expert_mlp_params(config)
    return (layer_projection_params(config) - experts + experts // ep) // tp + 2 * config.hidden


def check_stage(mesh: Mesh, stage) -> None:
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < mesh.pp:
        raise ValueError(f"stage={stage!r}: a pipeline stage is a whole number from 0 to pp - 1 = {mesh.pp - 1}")


def layers_per_rank(config, mesh: Mesh, stage: int, num_chunks: int = 1) -> int:
    """How many layers a rank of pipeline stage ``stage`` holds: its part of partition_layers, or, with
    ``num_chunks`` v > 1 (interleaved schedules), its v chunks, virtual stages c·pp + stage (make_stage)."""
    check_stage(mesh, stage)
    parts = partition_layers(config.num_layers, mesh.pp, num_chunks=num_chunks)
    return sum(len(parts[c * mesh.pp + stage]) for c in range(num_chunks))


def expert_params_per_rank(config, mesh: Mesh, stage: int, num_chunks: int = 1) -> int:
    """The part of params_per_rank that is experts (E/ep per layer, / tp): the part averaged over expert_dp."""
    layers = layers_per_rank(config, mesh, stage, num_chunks)
    return layers * _expert_mlp_params(config) // mesh.ep // mesh.tp


def params_per_rank(config, mesh: Mesh, stage: int, num_chunks: int = 1, vocab_parallel: bool = False) -> int:
    """Parameters held by one rank of pipeline stage ``stage``: its layers' matrices / tp (TP splits every
    projection of attention and MLP), E/ep of a mixture's experts, its layers' norms whole, plus the embedding on
    the first stage and the final norm and head on the last (none of which TP splits here). Exact for the course
    model; a tied head is the embedding itself when one stage holds both, and a copy of it on the last stage
    otherwise. CP splits the sequence, not the weights: every rank of a CP group holds the same. ``num_chunks``
    v > 1: the layers of its v chunks (layers_per_rank); the embedding and head stay on the first and last stage.
    ``vocab_parallel`` (apply_tp(..., vocab_parallel=True)): embedding and head hold V/tp rows each."""
    count = layers_per_rank(config, mesh, stage, num_chunks) * layer_params(config, mesh.tp, mesh.ep)
    table = config.vocab_size * config.hidden // (mesh.tp if vocab_parallel else 1)
    if stage == 0:
        count += table
    if stage == mesh.pp - 1:
        count += config.hidden
        if not (config.tie_embeddings and mesh.pp == 1):
            count += table
    return count


def checkpoint_bytes(config, mesh, stage: int, tp_rank: int, bytes_per_param: int = 24) -> int:
    """The tensor bytes the dp ranks of one (stage, tp) place write together into a checkpoint (course_lib.checkpoint,
    24 bytes a parameter in float64 Adam): bytes_per_param × the parameters of that piece (params_per_rank), less
    the TP-replicated ones (norms; embedding and head, which apply_tp leaves whole) on tp ranks other than 0, which
    tp rank 0 writes."""
    params = params_per_rank(config, mesh, stage)
    if mesh.tp > 1 and tp_rank > 0:
        layers = layers_per_rank(config, mesh, stage)
        replicated = 2 * config.hidden * layers
        replicated += config.vocab_size * config.hidden if stage == 0 else 0
        replicated += config.hidden + config.vocab_size * config.hidden if stage == mesh.pp - 1 else 0
        params -= replicated
    return bytes_per_param * params


# ------------------------------------------------------------------------------ data parallelism, once

def data_parallel_parts(config, mesh: Mesh, stage: int, num_chunks: int = 1,
                        vocab_parallel: bool = False) -> list[tuple[int, int, int]]:
    """This rank's parameters as (count, shard group size, replicas), one entry per group that averages them
    (module docstring): the dense part over the dp_shard·cp ranks that hold it (dp·cp unless HSDP), replicated
    dp_replicate times; a mixture's experts over their dp·cp/ep ranks (expert_dp)."""
    params = params_per_rank(config, mesh, stage, num_chunks, vocab_parallel)
    experts = expert_params_per_rank(config, mesh, stage, num_chunks)
    parts = [(params - experts, mesh.dp_shard * mesh.cp, mesh.dp_replicate)]
    if experts:
        parts.append((experts, mesh.dp * mesh.cp // mesh.ep, 1))
    return parts


def data_parallel_state_bytes(job: Job, stage: int) -> dict[str, int]:
    """Training state on one rank of pipeline stage ``stage``: {"weights", "grads", "optimizer", "total"},
    ledger.zero_state_bytes of each data_parallel_parts entry over its own shard group, added, with the bytes per
    parameter of ``job``'s state convention (ledger.CONVENTIONS). HSDP (dp_replicate > 1) is ZeRO-3 inside a
    replica. At rest, between steps: what a step holds beside it is transient_bytes_per_rank. No ZeRO padding
    (zero.padded_num_params)."""
    per_param = CONVENTIONS[job.state_convention]
    states = [zero_state_bytes(count, job.zero, group, weight_bytes=per_param.weight_bytes,
                               grad_bytes=per_param.grad_bytes, optimizer_bytes=per_param.optimizer_bytes)
              for count, group, _ in data_parallel_parts(job.config, job.mesh, stage, job.num_chunks,
                                                         job.vocab_parallel)]
    return {part: sum(state[part] for state in states) for part in states[0]}


def transient_bytes_per_rank(job: Job, stage: int) -> dict[str, int]:
    """Weights and gradients held only while a step runs, beyond data_parallel_state_bytes' state at rest. ZeRO-3
    gathers each unit (embedding, each layer, final norm, head) whole to run it (zero_bytes.transient_weight_bytes:
    the largest unit when it reshards after forward, every unit of the stage when it keeps them,
    reshard_after_forward=False); ZeRO-2 and -3 hold a unit's whole gradients until they reduce-scatter them, every
    unit's across the micro-batches without resharding after backward (zero_bytes.transient_gradient_bytes);
    stages 0-1 hold both whole anyway: 0. {"weights", "grads", "total"}; the course's ZeroDataParallel records
    them (tests/test_zero*)."""
    if job.zero < 2:
        return {"weights": 0, "grads": 0, "total": 0}
    config, mesh = job.config, job.mesh
    layer = layer_params(config, mesh.tp, mesh.ep)
    table = config.vocab_size * config.hidden // (mesh.tp if job.vocab_parallel else 1)
    units = [layer] * layers_per_rank(config, mesh, stage, job.num_chunks)
    units += [table] if stage == 0 else []
    if stage == mesh.pp - 1:
        units += [config.hidden] + ([] if config.tie_embeddings and mesh.pp == 1 else [table])
    weights = transient_weight_bytes(units, job.zero, job.bytes_per_element, job.reshard_after_forward,
                                     reshard_after_backward=job.reshard_after_backward)
    grads = transient_gradient_bytes(units, job.zero, job.grad_bytes, job.reshard_after_backward)
    return {"weights": weights, "grads": grads, "total": weights + grads}


def data_parallel_traffic(job: Job, stage: int) -> list[dict]:
    """What one rank of ``stage`` sends per optimizer step to average its gradients (ZeRO 1-3: and gather its
    weights), group by group: [{"group", "size", "span", "ops"}]. "group" names the mesh's group ("dp_cp",
    "expert_dp"; HSDP: "dp_shard_cp" for ZeRO-3 inside the replica, "dp_replicate" for the all-reduce across);
    "span" is how many consecutive ranks the group reaches across (its link: inside a node when the span fits
    one); "ops" maps each op to its bytes (zero_bytes.wire_bytes_per_step, hsdp.hsdp_wire_bytes_per_step), gradients
    of job.grad_bytes and gathered weights of job.bytes_per_element each. The job's micro-batches are the
    micro-steps of an optimizer step (ZeRO-2 and -3 reduce in each of them; ZeRO-3 gathers twice in each, or once
    without resharding after forward; without resharding after backward too, it gathers and reduces once a step)."""
    config, mesh, zero_stage, grad_bytes = job.config, job.mesh, job.zero, job.grad_bytes
    accumulation_steps, num_chunks, vocab_parallel = job.num_microbatches, job.num_chunks, job.vocab_parallel
    replica_span = mesh.dp_shard * mesh.cp * mesh.tp             # consecutive ranks: tp fastest, then cp, then dp
    traffic = []
    # a tied head gathers the embedding's unit again for its own forward (zero.borrowers): the dense part's
    # first group, every micro-batch
    table = config.vocab_size * config.hidden * job.bytes_per_element
    tied = zero_stage == 3 and config.tie_embeddings and mesh.pp == 1 and job.reshard_after_forward and (
        job.reshard_after_backward)
    for index, (count, group, replicas) in enumerate(data_parallel_parts(config, mesh, stage, num_chunks,
                                                                          vocab_parallel)):
        extra = accumulation_steps * wire_bytes("all_gather", table, group) if tied and index == 0 else 0
        if replicas > 1:
            if zero_stage != 3:
                raise ValueError(f"dp_replicate {replicas} with zero_stage={zero_stage}: hybrid sharding is ZeRO-3 "
                                 "inside each replica (zero_stage=3)")
            ops = hsdp_wire_bytes_per_step(count * grad_bytes, group, replicas, accumulation_steps)
            ops["all_gather"] = hsdp_wire_bytes_per_step(count * job.bytes_per_element, group, replicas,
                                                         accumulation_steps)["all_gather"]      # the weights
            across = ops.pop("all_reduce")
            ops["all_gather"] += extra
            traffic += [{"group": "dp_shard_cp", "size": group, "span": replica_span, "ops": ops},
                        {"group": "dp_replicate", "size": replicas, "span": mesh.dp * mesh.cp * mesh.tp,
                         "ops": {"all_reduce": across}}]
        else:
            name = "dp_cp" if group == mesh.dp * mesh.cp else "expert_dp"
            resharding = (job.reshard_after_forward, job.reshard_after_backward)
            reduce = wire_bytes_per_step(count * job.grad_bytes, zero_stage, group, accumulation_steps, *resharding)
            gather = wire_bytes_per_step(count * job.bytes_per_element, zero_stage, group, accumulation_steps,
                                         *resharding)
            ops = {op: (gather if op == "all_gather" else reduce)[op] for op in reduce}
            if extra:                                       # ZeRO-3 only: other stages have no gathers to add to
                ops["all_gather"] += extra
            traffic.append({"group": name, "size": group, "span": mesh.dp * mesh.cp * mesh.tp, "ops": ops})
    return traffic


def data_parallel_bytes_per_step(job: Job, stage: int) -> dict[str, float]:
    """data_parallel_traffic's bytes by op, over all its groups: what one rank sends per optimizer step to
    average its gradients."""
    total: dict[str, float] = {}
    for part in data_parallel_traffic(job, stage):
        for op, nbytes in part["ops"].items():
            total[op] = total.get(op, 0) + nbytes
    return total


def sent_bytes_per_rank(job: Job, stage: int) -> dict[str, float]:
    """Bytes one rank of ``stage`` sends in one training step of ``job``, per axis (ring algorithms, as
    comm.wire_bytes), each element of job.bytes_per_element bytes:

    * tp: 4 all-reduces per layer and micro-batch (2 forward, 2 backward), each of one activation
      a = (batch/dp/m) · (seq/cp) · hidden · bytes, each sending 2(tp-1)/tp · a;
    * pp: one activation a per micro-batch to the next stage (not from the last), one gradient of it to the
      previous stage (not from the first); with ``num_chunks`` v > 1, so for each of its chunks (virtual stage
      c·pp + stage: to the next virtual stage unless the last, back unless the first);
    * dp: data_parallel_bytes_per_step (ZeRO stage 0 or NaiveDDP: one all-reduce of this rank's gradients
      over the dp × cp ranks that hold the same weights, 2(dp·cp-1)/(dp·cp) · params_per_rank · bytes; a
      mixture's experts over their dp·cp/ep ranks, expert_dp), the micro-batches its accumulation steps;
    * cp (when cp > 1): ring attention in each layer and micro-batch, forward and backward
      (context_parallel.ring_attention_bytes, on this rank's kv_heads/tp heads);
    * ep (when ep > 1): 4 all-to-alls per layer and micro-batch, dispatch and combine forward and backward, of
      this rank's (batch/dp/m)·(seq/cp) tokens (expert_parallel.all_to_all_bytes; ``capacity_factor`` as the MoE's).

    ``sequence_parallel`` (Megatron's; tensor_parallel.apply_tp(..., sequence_parallel=True)): each all-reduce
    becomes a reduce-scatter and an all-gather, (tp-1)/tp · a each, the same bytes, plus the stack's ends and the
    norms' weights (tensor_parallel.tp_step_traffic); the stages pass 1/tp of the sequence, a/tp.
    ``recompute="full"``: backward reruns part of each layer's TP collectives (tp_step_traffic), each layer's
    ring (cp) and its experts' two all-to-alls (ep). ``vocab_parallel``: the split embedding's, head's and
    loss's all-reduces (vocab_parallel_traffic).
    """
    config, mesh, seq_len, num_microbatches = job.config, job.mesh, job.tokens_per_sequence, job.num_microbatches
    sequence_parallel, vocab_parallel, num_chunks = job.sequence_parallel, job.vocab_parallel, job.num_chunks
    mesh.check_sequence(seq_len)
    micro_batch, local_seq, bytes_per_element = job.micro_batch_size, seq_len // mesh.cp, job.bytes_per_element
    activation = tp_allreduce_bytes(micro_batch, local_seq, config.hidden, bytes_per_element)
    layers = layers_per_rank(config, mesh, stage, num_chunks)
    tp = 0
    if mesh.tp > 1:
        tp = num_microbatches * tp_step_traffic(config, micro_batch, local_seq, mesh.tp, bytes_per_element,
                                                sequence_parallel, layers, stage, mesh.pp, job.recompute)["wire_bytes_per_rank"]
        if vocab_parallel:
            tp += num_microbatches * vocab_parallel_traffic(micro_batch, local_seq, config.hidden, bytes_per_element,
                                                            mesh.tp, first_stage=stage == 0,
                                                            last_stage=stage == mesh.pp - 1)["wire_bytes_per_rank"]
    boundary = activation // mesh.tp if sequence_parallel else activation
    last = mesh.pp * num_chunks - 1
    hand_offs = sum((c * mesh.pp + stage < last) + (c * mesh.pp + stage > 0) for c in range(num_chunks))
    pp = num_microbatches * boundary * hand_offs
    sent = {"tp": tp, "pp": pp, "dp": sum(data_parallel_bytes_per_step(job, stage).values())}
    if mesh.cp > 1:
        ring = ring_attention_bytes(micro_batch, config.num_kv_heads // mesh.tp, seq_len, config.head_dim, mesh.cp,
                                    job.torch_dtype)
        rerun = ring["forward"] if job.recompute == "full" else 0        # a recomputed layer runs its ring again
        sent["cp"] = layers * num_microbatches * (ring["forward"] + ring["backward"] + rerun)
    if mesh.ep > 1:
        one = all_to_all_bytes(micro_batch * local_seq, config.hidden, config.num_experts, config.top_k,
                               job.capacity_factor, mesh.ep, bytes_per_element)
        sent["ep"] = (6 if job.recompute == "full" else 4) * layers * num_microbatches * one   # + the rerun's two
    return sent


def held_over_schedule(mesh: Mesh, stage: int, num_microbatches: int, schedule: str = "1f1b",
                       num_chunks: int = 1, chunk_bytes=lambda chunk: 1) -> tuple[int, int]:
    """Walk ``stage``'s actions (schedules.SCHEDULES): a forward keeps what its chunk-micro-batch saves,
    ``chunk_bytes(chunk)``, until its backward frees it (its W, when the schedule splits backward: the course
    keeps the whole graph until the weight gradients are taken). Returns (the most chunk-micro-batches held at
    once, the most bytes held at once)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: one of {', '.join(SCHEDULES)}")
    chunks = {"num_chunks": num_chunks} if schedule == "interleaved" else {}
    actions = SCHEDULES[schedule](stage, mesh.pp, num_microbatches, **chunks)  # (schedule_actions checks them all)
    frees = "W" if splits_backward([actions]) else "B"
    held, most, now, peak = {}, 0, 0, 0
    for action in actions:
        kind, k, chunk = op_parts(action)
        if kind == "F":
            held[k, chunk] = chunk_bytes(chunk)
            now += held[k, chunk]
        elif kind == frees:
            now -= held.pop((k, chunk))
        most, peak = max(most, len(held)), max(peak, now)
    return most, peak


def microbatches_in_flight(mesh: Mesh, stage: int, num_microbatches: int, schedule: str = "1f1b",
                           num_chunks: int = 1) -> int:
    """How many micro-batches' activations ``stage`` holds at once: GPipe all m; 1F1B min(p - s, m); ZB-H1
    min(p, m) on every stage (a micro-batch is held until its W); interleaved 1F1B over v chunks counts
    chunk-micro-batches, each 1/v of a stage's layers: min((v - 1)·p + 2·(p - s - 1) + 1, v·m), so stage 0
    holds 1 + (p - 1)/(p·v) times 1F1B's p stage-micro-batches (Korthikanti et al. 2022, 4.2.3)."""
    return held_over_schedule(mesh, stage, num_microbatches, schedule, num_chunks)[0]


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


def activation_bytes_per_rank(job: Job, stage: int) -> dict[str, int]:
    """Saved-activation bytes on one rank of ``stage`` in ``job``: {"per_microbatch", "in_flight", "peak"}.

    One micro-batch: the stage's layers (ledger.gpt_layer_activation_bytes on one of tp ranks, with
    ``recompute``: course_lib.recompute's "selective" keeps q, k, v of each attention core, "full" each
    layer's input), plus the token ids on the first stage and the final norm, head and loss on the last
    (ledger.gpt_activation_bytes; ``vocab_parallel``: the split embedding's and loss's, vocab_parallel.
    vocab_parallel_activation_bytes). The peak is the most the schedule holds at once (held_over_schedule:
    ``in_flight`` micro-batches, or chunk-micro-batches when ``num_chunks`` v > 1, each chunk its own layers and
    the model's ends only on the first and last virtual stage), plus what one rerun saves while backward
    recomputes it (ledger.recomputed_layer_bytes). With cp > 1 each rank holds s/cp
    tokens: every term at s/cp, attention's as context_parallel_layer_terms ("full" only: selective would rerun
    the ring). ``fused_norm`` False: the norms as F.rms_norm on the CPU saves them (ledger.rms_norm_bytes).
    Exact for the course's code in torch 2.13 (the virtual cluster measures it; a dense MLP: a
    mixture of experts' layer has no formula here).
    """
    config, mesh, seq_len, dtype = job.config, job.mesh, job.tokens_per_sequence, job.torch_dtype
    recompute = job.recompute
    sequence_parallel, fused_norm, num_chunks = job.sequence_parallel, job.fused_norm, job.num_chunks
    mesh.check_sequence(seq_len)
    check_stage(mesh, stage)
    b, s = job.micro_batch_size, seq_len // mesh.cp
    terms = gpt_layer_activation_bytes(config, b, s, dtype, mesh.tp, sequence_parallel, fused_norm=fused_norm,
                                       recompute="none" if mesh.cp > 1 and recompute == "selective" else recompute)
    if mesh.cp > 1 and recompute != "full":
        terms.update(context_parallel_layer_terms(config, b, seq_len, dtype, mesh.tp, mesh.cp))
    whole = gpt_activation_bytes(config, b, s, dtype, fused_norm=fused_norm)
    embed, loss = whole["embed"], whole["loss"]
    if job.vocab_parallel and mesh.tp > 1:
        split = vocab_parallel_activation_bytes(b, s, config.vocab_size, mesh.tp)
        embed, loss = split["embed"], split["loss"]
    parts, last = partition_layers(config.num_layers, mesh.pp, num_chunks=num_chunks), mesh.pp * num_chunks - 1

    def chunk_bytes(chunk: int) -> int:      # what one micro-batch's forward through this chunk saves
        virtual_stage = chunk * mesh.pp + stage
        return (len(parts[virtual_stage]) * sum(terms.values()) + (embed if virtual_stage == 0 else 0)
                + (whole["norm"] + whole["head"] + loss if virtual_stage == last else 0))

    in_flight, held = held_over_schedule(mesh, stage, job.num_microbatches, job.schedule, num_chunks, chunk_bytes)
    per_microbatch = sum(chunk_bytes(chunk) for chunk in range(num_chunks))
    rerun = 0 if mesh.cp > 1 and recompute == "selective" else recomputed_layer_bytes(   # (ring: no rerun)
        config, b, s, dtype, mesh.tp, sequence_parallel, recompute=recompute, fused_norm=fused_norm)
    if mesh.cp > 1 and recompute == "full":     # the rerun layer's attention is ring attention's
        layer = gpt_layer_activation_bytes(config, b, s, dtype, mesh.tp, fused_norm=fused_norm)
        layer.update(context_parallel_layer_terms(config, b, seq_len, dtype, mesh.tp, mesh.cp))
        rerun = sum(layer.values()) - terms["layer input"]
    return {"per_microbatch": per_microbatch, "in_flight": in_flight, "peak": held + rerun}
