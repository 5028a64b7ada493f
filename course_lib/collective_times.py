"""The collectives of one training step, priced: tensor, context and expert parallelism's per layer and
micro-batch, data parallelism's per step, each call at its latency plus its wire bytes over its link's bandwidth,
then what hides behind compute. cost.step_time adds them to the kernels' time (course_lib.kernel_times); the
formulas, with their sources, are cost.py's part 2 (tp_s, cp_s, ep_s and dp_s).

    one call  = latency(op, ranks, nodes) + wire bytes(op) / β(link, op)
    latency   = NCCL's ring model on a catalogue GPU (hardware.ring_latency: it grows with the ring), a
                calibrated machine's measured α for that op (course_lib.calibration: gloo's, per call)
    link      = hardware.link_for: NVLink inside a node, the NICs across nodes; β per op where the machine
                measured it (hardware.collective_link: gloo's reduce-scatter costs more per byte than its
                all-reduce)
    tp        = a layer's all-reduces (or, with sequence parallelism, reduce-scatter + all-gather pairs) as
                tensor_parallel.tp_step_traffic counts them (full recomputation by a reentrant checkpoint: + the
                one more it reruns), less the backward's two reductions (with sequence
                parallelism their reduce-scatters) × tp_overlap, each up to the weight-gradient GEMMs of its
                column-parallel block (attention's q, k, v; the MLP's gate, up); on the first and last stage a
                vocab-parallel embedding's and head's all-reduces (vocab_seconds), not hidden
    dp        = each group of per_rank.data_parallel_traffic on its own link, every unit (a layer, the
                embedding, the head) paying each call's latency, as many calls as the ZeRO stage makes; then
                min(dp_overlap × what can hide, the window it can hide behind): the gradients' reduction
                behind backward, ZeRO-3's gathers behind compute, ZeRO-1's gather of the updated weights behind
                the next step's first forward where the framework overlaps it (overlap_param_gather, pp = 1)
    cp        = ring attention's hops of a layer (context_parallel.ring_attention_bytes; full recomputation runs
                the forward's again), less what hides behind the attention kernels × cp_overlap
    ep        = a mixture of experts' 4 all-to-alls a layer, 6 with full recomputation
                (expert_parallel.all_to_all_bytes: per_rank.sent_bytes_per_rank's count), not hidden; across
                nodes each GPU sends the share bound for other nodes through its own NIC
"""

from __future__ import annotations

from .comm import wire_bytes
from .context_parallel import ring_attention_bytes
from .expert_parallel import all_to_all_bytes
from .hardware import GPU, collective_link, link_for, ring_latency, spread
from .job import Job
from .kernel_times import ATTENTION_OPS
from .per_rank import data_parallel_traffic, layers_per_rank
from .tensor_parallel import tp_step_traffic
from .vocab_parallel import vocab_parallel_traffic

COLUMN_PARALLEL = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))   # kernel_times' names, by block


def tp_seconds_per_layer(job: Job, hw: GPU, layer_ops, tp_overlap: float, checkpoint: str = "non-reentrant") -> float:
    """A layer's TP collectives for one micro-batch, as many as tensor_parallel.tp_step_traffic counts for the
    job's recomputation and sequence parallelism (plus the reduction a reentrant checkpoint reruns too),
    less the backward's share hidden behind the column-parallel blocks' weight-gradient GEMMs (× tp_overlap,
    each reduction up to its own block's GEMMs)."""
    config, t = job.config, job.mesh.tp
    if t == 1:
        return 0.0
    traffic = tp_step_traffic(config, job.micro_batch_size, job.tokens_per_sequence // job.mesh.cp, t,
                              job.bytes_per_element, sequence_parallel=job.sequence_parallel, recompute=job.recompute)
    reduction = "reduce_scatter" if job.sequence_parallel else "all_reduce"
    ops = ("reduce_scatter", "all_gather") if job.sequence_parallel else ("all_reduce",)
    # 2 forward and 2 backward a layer, each op (the SP norms' weight gradients and the stack's two end gathers
    # are left out: once a step coalesced, once a stage), + what the rerun forward runs again.
    calls = {op: 4 + traffic["recompute_ops"].get(op, 0) / config.num_layers for op in ops}
    if job.recompute == "full" and checkpoint == "reentrant":
        # tp_step_traffic follows torch's non-reentrant checkpoint, which stops once down_proj's GEMM has saved its
        # input; a reentrant one (Megatron-LM's CheckpointFunction, DeepSpeed's) reruns the whole forward, and with
        # it down_proj's reduction.
        calls[reduction] += 1
    link = link_for(t, job.gpus_per_node, hw)     # across nodes: one NIC, not DP's rails (an open question)
    nodes = spread(t, t, job.gpus_per_node)[1]
    seconds = {op: collective_latency(hw, link, op, t, nodes)
               + wire_bytes(op, traffic["payload_bytes_each"], t) / collective_link(hw, link, op).bytes_per_s
               for op in ops}
    # The backward's reductions are the input gradients of the two column-parallel blocks, each issued before that
    # block's own weight-gradient GEMMs and waited for after them (Megatron-LM's
    # LinearWithGradAccumulationAndAsyncCommunication, Transformer Engine's Linear: "overlap dgrad-RS/AR with
    # wgrad"): attention's behind q, k and v's, the MLP's behind gate and up's. With sequence parallelism only the
    # reduce-scatter is: the all-gather of the row-parallel layer's output gradient comes before its input
    # gradient's GEMM (Megatron also gathers the column layer's input again there, behind the input gradient's
    # GEMM: tp_step_traffic does not count it). One GEMM of each projection's kernels (forward, input gradient,
    # weight gradient, + a rerun of the forward) is its weight gradient.
    windows = [sum(op.seconds / op.kernels for op in layer_ops if op.name in names) for names in COLUMN_PARALLEL]
    return (sum(calls[op] * seconds[op] for op in ops)
            - sum(min(tp_overlap * seconds[reduction], window) for window in windows))


def vocab_seconds(job: Job, hw: GPU, stage: int) -> float:
    """A vocab-parallel embedding's and head's all-reduces for one micro-batch on ``stage`` (the lookup's on the
    first, the loss's three and the head input's gradient on the last: vocab_parallel.vocab_parallel_traffic, as
    per_rank counts them), on TP's link; none hidden."""
    t = job.mesh.tp
    if t == 1 or not job.vocab_parallel:
        return 0.0
    traffic = vocab_parallel_traffic(job.micro_batch_size, job.tokens_per_sequence // job.mesh.cp, job.config.hidden,
                                     job.bytes_per_element, t, first_stage=stage == 0,
                                     last_stage=stage == job.mesh.pp - 1)
    link = link_for(t, job.gpus_per_node, hw)
    calls = traffic["forward_all_reduces"] + traffic["backward_all_reduces"]
    return (calls * collective_latency(hw, link, "all_reduce", t, spread(t, t, job.gpus_per_node)[1])
            + traffic["wire_bytes_per_rank"] / collective_link(hw, link, "all_reduce").bytes_per_s)


def cp_seconds_per_layer(job: Job, hw: GPU, layer_ops, cp_overlap: float) -> float:
    """A layer's ring attention traffic for one micro-batch (context_parallel.ring_attention_bytes: cp - 1 hops
    of a K/V block forward; backward the K/V again and the dK/dV home, 2cp - 1 hops; full recomputation runs the
    forward's cp - 1 again, as per_rank.sent_bytes_per_rank counts), each hop paying α on the link its CP group
    spans, less what hides behind the attention kernels (× cp_overlap): a ring posts each hop before its block's
    kernel and waits after it."""
    config, cp, t = job.config, job.mesh.cp, job.mesh.tp
    if cp == 1:
        return 0.0
    sent = ring_attention_bytes(job.micro_batch_size, config.num_kv_heads // t, job.tokens_per_sequence,
                                config.head_dim, cp, job.torch_dtype)
    link = collective_link(hw, link_for(cp * t, job.gpus_per_node, hw), "send")
    rerun = job.recompute == "full"
    seconds = ((3 * cp - 2 + rerun * (cp - 1)) * link.alpha_s
               + ((1 + rerun) * sent["forward"] + sent["backward"]) / link.bytes_per_s)
    window = sum(op.seconds for op in layer_ops if op.name in ATTENTION_OPS)
    return seconds - min(cp_overlap * seconds, window)


def ep_seconds_per_layer(job: Job, hw: GPU) -> float:
    """A mixture of experts' all-to-alls in a layer for one micro-batch: dispatch and combine forward, their
    gradients backward (+ the forward's again when full recomputation reruns it: the combine's output is saved by
    the weighting after it), each sending the buffer expert_parallel.all_to_all_bytes counts at
    job.capacity_factor (None: the course's MoE, every expert's buffer padded to all the tokens; a dropless
    framework sends the routed rows only, a reader's capacity 1). Across nodes, k of the ep GPUs in each, a GPU
    sends (ep - k)/ep of its buffer through its own NIC and the rest over NVLink beside it. Not hidden."""
    config, ep, t = job.config, job.mesh.ep, job.mesh.tp
    if ep == 1:
        return 0.0
    tokens = job.micro_batch_size * job.tokens_per_sequence // job.mesh.cp
    nbytes = all_to_all_bytes(tokens, config.hidden, config.num_experts, config.top_k, job.capacity_factor, ep,
                              job.bytes_per_element)
    per_node, nodes = spread(ep, ep * t, job.gpus_per_node)
    link = link_for(ep * t, job.gpus_per_node, hw)               # NVLink in a node, else one NIC per GPU
    rate = collective_link(hw, link, "all_to_all").bytes_per_s
    if nodes > 1:                                               # wire bytes (ep - 1)/ep, (ep - k)/ep of them on the NIC
        rate = min(rate * (ep - 1) / (ep - per_node), hw.nvlink.bytes_per_s)
    call = collective_latency(hw, link, "all_to_all", ep, nodes) + nbytes / rate
    return (6 if job.recompute == "full" else 4) * call


def reduced_bytes(op: str, nbytes: float, job: Job, grad_reduce_bytes: int | None) -> float:
    """``nbytes`` of a data-parallel ``op`` (per_rank.data_parallel_traffic's, counted at job.grad_bytes for the
    gradients) as the framework sends them: every reduction at ``grad_reduce_bytes`` a gradient element where
    given (dp_seconds' docstring), the weights' all-gathers as they are."""
    if op == "all_gather" or grad_reduce_bytes is None:
        return nbytes
    return nbytes * grad_reduce_bytes / job.grad_bytes


def dp_seconds(job: Job, hw: GPU, compute: float, dp_overlap: float, overlap_param_gather: bool = False,
               grad_reduce_bytes: int | None = None) -> tuple[float, float, str]:
    """(DP traffic's seconds, what is left exposed, the link of its widest group) on the busiest stage: each group
    of per_rank.data_parallel_traffic on its own link, each call paying α; then the overlap (cost.py's
    part 2): the gradients' reduction hides behind backward, ZeRO-3's prefetched gathers behind compute, and,
    ``overlap_param_gather``, ZeRO-1's gather of the updated weights behind the next step's first forward.
    ``grad_reduce_bytes``: bytes per gradient element as the framework reduces them, where not job.grad_bytes
    (FSDP2's reduce_dtype, Composer's "DEFAULT" mixed precision: fp32 reductions of 16-bit gradients)."""
    mesh, m, zero = job.mesh, job.num_microbatches, job.zero
    if mesh.dp * mesh.cp == 1:
        return 0.0, 0.0, link_for(mesh.tp, job.gpus_per_node, hw).name
    widest = max(data_parallel_traffic(job, 0), key=lambda group: group["span"])
    link_name = link_for(widest["span"], job.gpus_per_node, hw, widest["size"]).name
    busiest = (0.0, 0.0)
    for stage in range(mesh.pp):
        gradient = weight = 0.0
        for group in data_parallel_traffic(job, stage):
            link = link_for(group["span"], job.gpus_per_node, hw, group["size"])
            nodes = spread(group["size"], group["span"], job.gpus_per_node)[1]
            for op, nbytes in group["ops"].items():
                latency = collective_latency(hw, link, op, group["size"], nodes)
                rate = collective_link(hw, link, op).bytes_per_s
                seconds = (calls_per_step(job, op, group) * units_reduced(job, stage) * latency
                           + reduced_bytes(op, nbytes, job, grad_reduce_bytes) / rate)
                if op == "all_gather":                                # the weights
                    weight += seconds
                else:                                                 # the gradients
                    gradient += seconds
        if gradient + weight > sum(busiest):
            busiest = (gradient, weight)
    gradient, weight = busiest
    backward = 2 / 3 * compute         # backward's share of a micro-batch: two of its three matmul passes
    window = {0: backward, 1: backward, 2: m * backward, 3: m * compute}[zero]
    if zero == 3 and not job.reshard_after_backward:
        window = compute               # gathered in the first micro-batch's forward, reduced in the last's backward
    hideable = gradient + weight if zero == 3 else gradient
    hidden = min(dp_overlap * hideable, window)
    if overlap_param_gather and zero == 1 and mesh.pp == 1:
        # Megatron's --overlap-param-gather: one bucket gathered at a time, each module's forward waiting for its
        # own, through the first micro-batch's forward (a third of its compute). With a pipeline Megatron buckets
        # the first stage's gather alone; the others gather whole at their first forward: not hidden.
        hidden += min(dp_overlap * weight, compute / 3)
    return gradient + weight, gradient + weight - hidden, link_name


def collective_latency(hw: GPU, link, op: str, ranks: int, nodes: int) -> float:
    """One collective's latency: NCCL's ring model on a catalogue GPU (hardware.ring_latency), the measured α of
    a calibrated machine's link for that op (gloo's, per call)."""
    return ring_latency(op, ranks, nodes) if hw.nccl_rings else collective_link(hw, link, op).alpha_s


def units_reduced(job: Job, stage: int) -> int:
    """How many units a rank of ``stage`` reduces (and ZeRO-3 gathers) one by one: each layer, the embedding on
    the first stage, the final norm and head on the last (zero.default_units: FSDP's per-layer wrapping; the
    course's ZeroDataParallel works unit by unit at every stage; a tied head is in the embedding's unit). Each
    unit's collective pays α."""
    mesh = job.mesh
    last = 1 + (not job.config.tie_embeddings)
    return layers_per_rank(job.config, mesh, stage) + (stage == 0) + last * (stage == mesh.pp - 1)


def calls_per_step(job: Job, op: str, group: dict) -> int:
    """How many collectives of ``op`` a step runs on ``group`` (each pays the link's α once): one a step, or one
    per micro-batch where ZeRO-2/3 reduce each micro-step, two where ZeRO-3 gathers for forward and backward
    (zero_bytes.wire_bytes_per_step's counts: once a step without resharding after backward)."""
    m, zero = (job.num_microbatches if job.reshard_after_backward else 1), job.zero
    if op == "all_gather" and zero == 3 and group["group"] != "dp_replicate":
        return m * (2 if job.reshard_after_forward else 1)
    if op == "reduce_scatter" and zero >= 2:
        return m
    return 1
