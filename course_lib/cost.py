"""Step time and MFU: the FLOPs of a step, the time each part of it takes on a cluster, and the share of peak.

1. FLOPs (matmuls only)
-----------------------
For b sequences of s tokens (T = b·s), hidden d, n_h query and n_kv key/value heads of h_d channels, MLP
width I, vocabulary V, L layers, one forward of the course model (course_lib.model) multiplies:

    q, k, v, o projections   2·T·d·(n_h + 2·n_kv)·h_d + 2·T·n_h·h_d·d    per layer
    attention scores  QKᵀ    2·b·n_h·s²·h_d                             per layer (the full s×s square)
    attention values  AV     2·b·n_h·s²·h_d                             per layer
    MLP gate, up, down       3 · 2·T·d·I                                per layer
    head                     2·T·d·V                                    once (tied or not: the same matmul)

Backward does twice the forward: every matmul Y = X·W needs dX and dW (for QKᵀ and AV, the gradients of both
operands). Model FLOPs = 3·forward. Recomputation adds forward work that the model does not need, counted in
hardware FLOPs only (as ledger.activation_bytes names them): "selective" recomputes the attention core, QKᵀ
and AV, once more; "op" (torchtitan's per-op policy) k_proj, o_proj and up_proj, every second matmul; "full"
each block's forward (the head is not checkpointed). That is how
Megatron-LM counts them and what torch's reentrant checkpoint runs; torch's non-reentrant checkpoint stops as
soon as backward has what it saved, skipping a last matmul whose output nobody saved (down_proj in a block, AV
in the attention core): tests/test_cost.py measures both.

Causal attention is counted in full, not halved. Megatron-LM (Narayanan et al. 2021 eq. 3; Korthikanti et al.
2022 appendix A, "2Bs²h" for the attention matrix) and PaLM (Chowdhery et al. 2022 appendix B, 6N + 12·L·H·Q·T)
both count the whole square, and so does torch's FlopCounterMode: an MFU computed here compares with theirs.
FlashAttention's benchmarks halve it for causal masks, and a causal kernel does skip the masked blocks: the
hardware does about half the attention counted here (llama2-7b at s = 4096: attention is 14% of the count).
Elementwise work (norms, rotary, softmax, SiLU, the loss) and the embedding lookup are left out, as both
conventions leave them out: a few FLOPs per value against thousands per value for a matmul.

The 6ND rule: 6 · (all parameters) · (tokens), which counts each weight's multiply-add forward (2) and backward
(4), misses attention's s-dependent term and counts the embedding table as if it were a matmul. For llama2-7b
at s = 4096 it is 12.3% below the exact count; for llama2-70b 6.9%.

2. Step time (step_time)
------------------------
Each operation of a micro-batch timed on its roofline (course_lib.kernel_times, with hardware.py's GEMM curve),
then the communication that is left exposed, the bubble and the optimizer. MFU and HFU keep the FLOP count
above (model FLOPs: 72·B·s·L·d²·(1 + s/6d + V/12Ld) on GPT shapes; hardware FLOPs add the recomputation, which
is what Narayanan et al.'s eq. 3 counts), whatever the kernels run.

b = micro_batch_size, s = seq_len, m = num_microbatches, t, p, dp = the mesh, v = num_chunks
(interleaved 1F1B: v chunks of layers per GPU), P = the GPU's dense peak, a = b·s·d·bytes_per_element (one
activation). Every micro-batch costs the same; the busiest stage sets the pace (partition_layers' split; the
last stage also runs the final norm, the head and the loss):

  compute_s = m · Σ operations' seconds on one GPU of the busiest stage (course_lib.kernel_times: each matmul
             at max(FLOPs / its shape's achievable rate, bytes / HBM), each memory-bound op at bytes / HBM,
             none below its kernel launches; ``attention``: "flash" (FlashAttention-2), "flash3", "efficient",
             "triton" or "unfused", each fused kernel at its benchmark's rate, read or derived,
             kernel_times.attention_rate).
             The head is whole on every TP rank (the course's apply_tp) or / t with vocab_parallel (Megatron's
             vocab-parallel head).
             ``compute_efficiency`` = e instead: the old flat model, F_stage / (e·P) (hardware FLOPs).
  tp_s      = m · L_stage · (n · (α + 2(t-1)/t · a/β) - hidden)   n = all-reduces per layer: 4 (2 forward,
             2 backward), + those the rerun forward runs again (tensor_parallel.tp_step_traffic's count of what
             the course runs): 1 with "op" or "full" (torch's non-reentrant checkpoint stops once down_proj's GEMM
             has saved its input, before its reduction), 2 with "full" and checkpoint="reentrant" (Megatron-LM's
             and DeepSpeed's rerun the whole forward). The kernels rerun down_proj's GEMM either way. Sequence
             parallelism turns each into a reduce-scatter + an all-gather: the same bytes, two α (its rerun
             gathers both inputs again: "op" reruns 2 all-gathers and 1 reduce-scatter).
             hidden = the backward's two all-reduces (with SP, their reduce-scatters), × tp_overlap, each up to
             its block's weight-gradient GEMMs (Megatron runs a column-parallel layer's input-gradient reduction
             beside its dW GEMM: Korthikanti et al. 2022, 5; collective_times). NVLink if the TP group fits in a
             node. With vocab_parallel, + the lookup's all-reduce on the first stage and the loss's three and the
             head input's gradient on the last (collective_times.vocab_seconds), not hidden.
  pp_s      = (1 - pp_overlap) · m · 2v · (α + a_pp / β)   one activation forward and one gradient back
             per micro-batch and chunk; a_pp = a/t with sequence parallelism or Megatron's scatter/gather
             (Narayanan et al. 2021, 4.1: each TP rank sends its slice, an all-gather over NVLink rebuilds
             it), else a. That is ``pipeline_sends="blocking"``: a stage waits for its own sends as for its
             receives (Megatron-LM's send_forward_recv_backward and the like; torch's Schedule1F1B waits on
             each send batched with its next receive), so every hop is on its busy time. pp_overlap = 1:
             hidden (Llama 3's asynchronous point-to-point, as its paper states).
  bubble_s  = busy · (p-1)/(v·m),  busy = compute_s + tp_s + pp_s (bubble_fraction, interleaved over v; 1F1B's
             for every schedule: "blocking" does not model ZB-H1's smaller bubble)
             ``pipeline_sends="async"`` (the course's executor): a send completes in the background and a
             stage waits only for its input, so a hop costs time only where the schedule's chain of waits runs
             through it: with balanced stages, 1F1B's steady state crosses 2(p-1)/p hops a micro-batch (1 at
             p = 2, where "blocking" counts 2); where the other stages wait for a slower one (the last, with the
             head), hops shorter than that slack hide in it, and 1F1B, GPipe and interleaved 1F1B pay only the
             fill and the drain, 2(p-1) hops. Both terms then come from pipeline_parallel.simulate's timeline of
             job.schedule, its own bubble included (ZB-H1's too): each stage's forward a third of its
             micro-batch's compute + tp, backward two thirds (an approximation: recomputation and TP's
             collectives shift it), every message (1 - pp_overlap)·(α + a_pp/β) late; pp_s = its makespan less
             the makespan with instant messages, bubble_s = that less m × the busiest stage's compute + tp.
  dp_s      = DP traffic of the busiest stage, group by group (per_rank.data_parallel_traffic: each group on
             its own link, gradients of the convention's reduce bytes, weights of the dtype's): ZeRO 0
             all-reduces the gradients once; 1 reduce-scatters them once and all-gathers the updated weights;
             2 reduce-scatters every micro-batch (it keeps only its shard of the gradients); 3 also
             all-gathers the weights before every micro-batch's forward and backward (FSDP's default,
             resharded after forward): 2m all-gathers, m reduce-scatters; m all-gathers with
             job.reshard_after_forward False; one of each with reshard_after_backward False too (torch's
             pipelining: gathered in the first micro-batch's forward, reduced in the last's backward). Then
             hidden = min(dp_overlap · traffic, window): bucket by bucket, the gradients' reduction runs
             beside the backward of the layers before it, so the window is one micro-batch's backward (ZeRO 0,
             1), m of them (ZeRO 2), every micro-batch's compute (ZeRO 3, prefetched gathers; one
             micro-batch's without resharding after backward); the weights'
             all-gather of ZeRO 1 and 2 follows the optimizer and hides behind nothing, unless
             ``overlap_param_gather`` (Megatron-LM's --overlap-param-gather with its distributed optimizer,
             ZeRO 1, no pipeline: the gather runs into the next step one bucket at a time, each module's forward
             waiting for its own): then it too hides, × dp_overlap, behind the first micro-batch's forward (a
             third of its compute). With a pipeline Megatron buckets the first stage's gather alone: no change.
  cp_s      = m · L_stage · (n·α + ring bytes/β - min(cp_overlap · that, attention kernels' time))
             context parallelism (a GPU holds s/cp tokens of each sequence, and 1/cp of attention's square as
             cp block kernels): ring attention's hops on the CP group's link, as
             context_parallel.ring_attention_bytes counts them: n = cp - 1 forward + 2cp - 1 backward, the
             bytes forward + backward ("full": the forward's hops and bytes twice, n = 4cp - 3).
  ep_s      = m · L_stage · 4 all-to-alls (6 with "full": the rerun forward dispatches and combines again), each
             latency + expert_parallel.all_to_all_bytes / β on the EP group's link (across nodes, what each GPU
             sends to other nodes on its own NIC); not hidden.
  optimizer_s = Adam's bytes (kernel_times.optimizer_operation) over the parameters this GPU updates
             (per_rank.data_parallel_state_bytes' shard: /dp with ZeRO >= 1)
  overhead_s = a calibrated machine's own work per step and per layer updated (0 on a catalogue GPU)
  total_s   = compute + tp + cp + ep + pp + bubble + dp + optimizer + overhead;   tokens_per_s = dp·m·b·s / total_s
  mfu       = model FLOPs (flops_per_step: forward and backward, no recomputation) of the dp·m·b sequences /
             (total_s · P · GPUs); hfu with hardware FLOPs.

Left out: data loading, stragglers, the embedding's lookup and its gradient on the first stage, MoE routing's
imbalance (every expert gets its share of the tokens) and the router's own kernels.

tp_s, cp_s, ep_s and dp_s are priced call by call in course_lib.collective_times. 3. a roofline for one layer:
course_lib.roofline. 4. The published runs live in course_lib.published
(compare_published), which builds on this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .collective_times import (
    cp_seconds_per_layer,
    dp_seconds,
    ep_seconds_per_layer,
    tp_seconds_per_layer,
    vocab_seconds,
)
from .cost_checks import check_assumptions, check_costed
from .hardware import GPU, collective_link, link_for
from .job import Job
from .kernel_times import Operation, head_operations, layer_operations, optimizer_operation
from .ledger import CONVENTIONS, RECOMPUTE, active_params_per_token
from .model import ModelConfig, param_count_formula
from .per_rank import data_parallel_state_bytes
from .pipeline_parallel import bubble_fraction, partition_layers, simulate
from .tensor_parallel import tp_allreduce_bytes

# ---------------------------------------------------------------------------------------------- 1. FLOPs

def forward_terms(config: ModelConfig, *, batch_size: int, seq_len: int,
                  capacity_factor: float | None = None) -> dict[str, int]:
    """One forward's matmul FLOPs by part (layer parts summed over all layers), as in the module docstring. A
    mixture of experts with ``capacity_factor`` below 1 drops tokens: its experts compute that share of them."""
    if not 1 <= seq_len <= config.max_seq_len or batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1 and seq_len={seq_len} in 1..{config.max_seq_len}")
    b, s, d, h_d, L = batch_size, seq_len, config.hidden, config.head_dim, config.num_layers
    tokens, n_h, n_kv = b * s, config.num_heads, config.num_kv_heads
    # A mixture of experts (course_lib.expert_parallel) sends each token through top_k expert MLPs, after a router
    # matmul of d × num_experts: the FLOPs of the active experts, not of all of them.
    experts = getattr(config, "num_experts", 0)
    active_mlps, router = (config.top_k, L * 2 * tokens * d * experts) if experts else (1, 0)
    kept = min(1.0, capacity_factor) if experts and capacity_factor is not None else 1
    terms = {
        "attention projections": L * (2 * tokens * d * (n_h + 2 * n_kv) * h_d + 2 * tokens * n_h * h_d * d),
        "attention scores": L * 2 * b * n_h * s * s * h_d,
        "attention values": L * 2 * b * n_h * s * s * h_d,
        "mlp": int(L * active_mlps * 3 * 2 * tokens * d * config.intermediate * kept),
        "head": 2 * tokens * d * config.vocab_size,
    }
    return {**terms, "router": router} if experts else terms


@dataclass(frozen=True)
class Flops:
    forward: int              # one forward pass, matmuls only
    backward: int             # 2 × forward
    recompute: int            # forward work done again (hardware FLOPs, not model FLOPs)
    six_nd: int               # the 6ND rule for the same tokens, beside the exact count

    @property
    def model(self) -> int:
        """What MFU counts: forward + backward, whatever the implementation recomputes."""
        return self.forward + self.backward

    @property
    def hardware(self) -> int:
        """What HFU counts: model FLOPs + recomputation."""
        return self.model + self.recompute


def recompute_flops(terms: dict[str, int], recompute: str, config: ModelConfig | None = None) -> int:
    """Forward matmul FLOPs that ``recompute`` reruns (``terms``: forward_terms'). "op" reruns k_proj, o_proj and
    up_proj: (n_kv + n_h) / (2·n_h + 2·n_kv) of the projections and a third of the MLP (``config``: the heads)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: choose one of {', '.join(RECOMPUTE)}")
    core = terms["attention scores"] + terms["attention values"]
    if recompute == "op":
        if config is None:
            raise ValueError("recompute='op': pass the model's config (its heads split the projections' FLOPs)")
        n_h, n_kv = config.num_heads, config.num_kv_heads
        return terms["attention projections"] * (n_kv + n_h) // (2 * n_h + 2 * n_kv) + terms["mlp"] // 3
    return {"none": 0, "selective": core,
            "full": core + terms["attention projections"] + terms["mlp"]}[recompute]


def flops_per_step(config: ModelConfig, *, batch_size: int, seq_len: int, recompute: str = "none",
                   capacity_factor: float | None = None) -> Flops:
    """Exact matmul FLOPs of one training step on ``batch_size`` sequences of ``seq_len`` tokens (module
    docstring): causal attention counted in full, as Megatron-LM, PaLM and FlopCounterMode count it; the experts'
    on the tokens a ``capacity_factor`` below 1 keeps."""
    terms = forward_terms(config, batch_size=batch_size, seq_len=seq_len, capacity_factor=capacity_factor)
    forward = sum(terms.values())
    return Flops(forward, 2 * forward, recompute_flops(terms, recompute, config),
                 six_nd(config, tokens=batch_size * seq_len))


def six_nd(config: ModelConfig, *, tokens: int) -> int:
    """The 6ND rule: 6 × parameters (param_count_formula, a tied table counted once) × tokens; for a mixture of
    experts, the parameters a token is multiplied by (ledger.active_params_per_token), not all of them."""
    params = active_params_per_token(config) if getattr(config, "num_experts", 0) else param_count_formula(config)
    return 6 * params * tokens


# ------------------------------------------------------------------------------------------ 2. step time

@dataclass
class StepTime:
    compute_s: float          # m micro-batches' operations on the busiest stage (kernel_times.py's roofline)
    tp_s: float               # TP collectives left exposed after the overlap
    pp_s: float               # stage-to-stage sends and receives left exposed after the overlap
    dp_s: float               # DP traffic left exposed after the overlap
    bubble_s: float           # the pipeline's fill and drain
    total_s: float
    tokens_per_s: float
    mfu: float                # model FLOPs / (total_s × peak × GPUs)
    hfu: float                # hardware FLOPs (with recomputation) / (total_s × peak × GPUs)
    dp_comm_s: float          # DP traffic before the overlap
    links: dict[str, str] = field(default_factory=dict)   # axis -> link it uses
    optimizer_s: float = 0.0  # the optimizer step, once a step (memory-bound)
    operations: list[Operation] = field(default_factory=list)   # one micro-batch on the busiest GPU, by op
    achieved_share: float = 0.0   # the busiest GPU's hardware FLOPs (the MFU count) / (compute time × peak)
    overhead_s: float = 0.0   # the framework's own work once a step (GPU.step_overhead_s and layer_update_overhead_s)
    cp_s: float = 0.0         # ring attention's K/V hops left exposed (context parallelism)
    ep_s: float = 0.0         # a mixture of experts' all-to-alls (expert parallelism)

    def breakdown(self) -> dict[str, float]:
        terms = {"compute": self.compute_s, "tp": self.tp_s, "pp": self.pp_s, "dp": self.dp_s,
                 "bubble": self.bubble_s}
        terms.update({axis: seconds for axis, seconds in (("cp", self.cp_s), ("ep", self.ep_s)) if seconds})
        terms.update({"optimizer": self.optimizer_s} if self.optimizer_s else {})
        return {**terms, "overhead": self.overhead_s} if self.overhead_s else terms


ASSUMPTIONS = ("compute_efficiency", "dp_overlap", "pp_overlap", "tp_overlap", "attention", "scatter_gather",
               "pipeline_sends", "elementwise_ops", "rotary", "overlap_param_gather", "grad_reduce_bytes",
               "cp_overlap", "checkpoint")


def step_time(job: Job, *, compute_efficiency: float | None = None, dp_overlap: float = 0.0,
              pp_overlap: float = 0.0, tp_overlap: float = 0.0, attention: str = "flash",
              scatter_gather: bool = False, pipeline_sends: str = "blocking", elementwise_ops: str = "fused",
              rotary: str = "model.py", overlap_param_gather: bool = False,
              grad_reduce_bytes: int | None = None, cp_overlap: float = 0.0,
              checkpoint: str = "non-reentrant") -> StepTime:
    """One training step of ``job`` on its cluster (job.gpu, job.gpus_per_node): each part's time, tokens/s, MFU,
    and each operation's time. The keywords are the cost model's assumptions, not the job's options: how much
    communication hides behind compute, which attention kernel, Megatron's scatter/gather of pipeline sends,
    whether a pipeline stage waits for its own sends ("blocking") or only for its input ("async"), whether the
    memory-bound ops run fused or op by op (kernel_times.ELEMENTWISE_OPS) and, op by op, how its code writes
    rotary (eager_traffic.ROTARY), whether ZeRO-1's weights are gathered beside the next forward (Megatron's
    --overlap-param-gather), the bytes the framework reduces each gradient in where not the job's (fp32
    reductions of 16-bit gradients: FSDP2's reduce_dtype, Composer's "DEFAULT"), how much of ring attention's
    traffic hides behind its block kernels (cp_overlap) and how full recomputation reruns a layer (checkpoint:
    torch's non-reentrant checkpoint stops at down_proj's GEMM, before its TP reduction; a reentrant one,
    Megatron-LM's or DeepSpeed's, reruns the whole forward). The formulas: the module docstring's part 2."""
    check_assumptions(checkpoint=checkpoint, pipeline_sends=pipeline_sends, grad_reduce_bytes=grad_reduce_bytes,
                      scatter_gather=scatter_gather, overlap_param_gather=overlap_param_gather)
    hw = check_costed(job, compute_efficiency, dp_overlap=dp_overlap, pp_overlap=pp_overlap,
                      tp_overlap=tp_overlap, cp_overlap=cp_overlap)
    if job.mesh.size < job.gpus_per_node:          # part of one node: every group on NVLink
        job = job.replace(gpus_per_node=job.mesh.size)
    m = job.num_microbatches
    card, hw = hw, hw.for_dtype(job.dtype)          # kernels at the dtype's rates; MFU against the card's peak
    stages = _stage_seconds(job, hw, compute_efficiency=compute_efficiency, tp_overlap=tp_overlap,
                            pp_overlap=pp_overlap, attention=attention, scatter_gather=scatter_gather,
                            elementwise_ops=elementwise_ops, rotary=rotary, cp_overlap=cp_overlap,
                            checkpoint=checkpoint)
    compute, layers_comm, pp, operations, stage_flops, axes = max(stages, key=lambda stage: sum(stage[:3]))
    if pipeline_sends == "async" and job.mesh.pp > 1:
        exposed_sends_s, bubble = _async_pipeline(job, stages, hop_s=pp / (2 * job.num_chunks))
        pp = exposed_sends_s / m                                # per micro-batch, as the blocking term
    else:
        stalled = bubble_fraction(job.mesh.pp, job.num_chunks * m)   # 1F1B's idle share, interleaved over v chunks
        bubble = m * (compute + layers_comm + pp) * stalled / (1 - stalled)
    # A stage's parameters, counted over its layers as p stages hold them (v chunks hold the same layers, give or
    # take one, and Llama 3's chunks of the embedding or head alone are no layer split per_rank can count).
    held = job.replace(num_chunks=1, schedule="1f1b")
    dp_comm, dp, dp_link = dp_seconds(held, hw, compute, dp_overlap, overlap_param_gather, grad_reduce_bytes)
    optimizer = max(optimizer_operation(hw, _updated_params(held, stage), job.grad_bytes).seconds
                    for stage in range(job.mesh.pp))
    overhead = hw.step_overhead_s + hw.layer_update_overhead_s * max(map(len, partition_layers(job.config.num_layers,
                                                                                              job.mesh.pp)))
    total = m * (compute + layers_comm + pp) + bubble + dp + optimizer + overhead
    sequences, seq_len = job.global_batch_size, job.tokens_per_sequence
    flops = flops_per_step(job.config, batch_size=sequences, seq_len=seq_len, recompute=job.recompute,
                           capacity_factor=job.capacity_factor)
    capacity = total * card.peak_flops * job.mesh.size
    return StepTime(compute_s=m * compute, tp_s=m * axes["tp"], pp_s=m * pp, dp_s=dp, bubble_s=bubble, total_s=total,
                    tokens_per_s=sequences * seq_len / total, mfu=flops.model / capacity,
                    hfu=flops.hardware / capacity, dp_comm_s=dp_comm,
                    links=_links(job, hw, dp_link),
                    optimizer_s=optimizer, operations=operations,
                    achieved_share=stage_flops / (compute * card.peak_flops), overhead_s=overhead,
                    cp_s=m * axes["cp"], ep_s=m * axes["ep"])


def _links(job: Job, hw: GPU, dp_link: str) -> dict[str, str]:
    """The link each axis's group spans (cp and ep only where they are > 1: consecutive tp·cp, tp·ep ranks)."""
    mesh, per_node = job.mesh, job.gpus_per_node
    links = {"tp": link_for(mesh.tp, per_node, hw).name, "pp": link_for(mesh.size, per_node, hw).name, "dp": dp_link}
    links.update({axis: link_for(size * mesh.tp, per_node, hw).name
                  for axis, size in (("cp", mesh.cp), ("ep", mesh.ep)) if size > 1})
    return links


def _async_pipeline(job: Job, stages: list, hop_s: float) -> tuple[float, float]:
    """(pp_s, bubble_s) of a pipeline whose sends complete in the background (module docstring, part 2): the
    makespan of job.schedule's timeline with every message ``hop_s`` late less the same timeline with instant
    messages, and that less the busiest stage's own work."""
    work = [compute + layers_comm for compute, layers_comm, *_ in stages]   # each stage's micro-batch

    def makespan(latency_s: float) -> float:
        return simulate(job.schedule, job.mesh.pp, job.num_microbatches, [w / 3 for w in work],
                        [2 * w / 3 for w in work], latency_s, num_chunks=job.num_chunks).makespan
    with_hops, instant = makespan(hop_s), makespan(0.0)
    return with_hops - instant, instant - job.num_microbatches * max(work)


def _stage_seconds(job: Job, hw: GPU, *, compute_efficiency: float | None, tp_overlap: float, pp_overlap: float,
                   attention: str, scatter_gather: bool, elementwise_ops: str, rotary: str, cp_overlap: float,
                   checkpoint: str):
    """One micro-batch on each pipeline stage: (compute, its layers' exposed tp + cp + ep, exposed pp seconds, its
    operations, its FLOPs, {"tp", "cp", "ep"} apart) on one GPU of the stage; the slowest stage sets the pace
    (step_time's docstring). With context parallelism a GPU holds seq_len/cp tokens of each sequence."""
    config, t, p, v, cp = job.config, job.mesh.tp, job.mesh.pp, job.num_chunks, job.mesh.cp
    b, seq_len, e = job.micro_batch_size, job.tokens_per_sequence, job.bytes_per_element
    kernels = dict(micro_batch_size=b, elementwise_ops=elementwise_ops, bytes_per_element=e)
    layer_ops = layer_operations(config, hw, tp=t, sequence_parallel=job.sequence_parallel, seq_len=seq_len, cp=cp,
                                 recompute=job.recompute, attention=attention, rotary=rotary,
                                 capacity_factor=job.capacity_factor, **kernels)
    head_ops = head_operations(config, hw, vocab_split=t if job.vocab_parallel else 1, seq_len=seq_len // cp,
                               **kernels)
    terms = forward_terms(config, batch_size=b, seq_len=seq_len, capacity_factor=job.capacity_factor)
    layer_flops = 3 * (sum(terms.values()) - terms["head"]) + recompute_flops(terms, job.recompute, config)
    layer_flops /= config.num_layers * cp
    head_flops = 3 * terms["head"] / (t if job.vocab_parallel else 1) / cp
    per_layer = {"tp": tp_seconds_per_layer(job, hw, layer_ops, tp_overlap, checkpoint),
                 "cp": cp_seconds_per_layer(job, hw, layer_ops, cp_overlap), "ep": ep_seconds_per_layer(job, hw)}
    # every hop priced on the slowest link a hop takes (a stage whose neighbour is on another node sets the pace)
    pp_link = collective_link(hw, link_for(job.mesh.size, job.gpus_per_node, hw), "send")
    activation = tp_allreduce_bytes(b, seq_len // cp, config.hidden, e)      # what one stage hands the next
    pp_bytes = activation // (t if job.sequence_parallel or scatter_gather else 1)
    pp_per_microbatch = 2 * v * (pp_link.alpha_s + pp_bytes / pp_link.bytes_per_s) if p > 1 else 0.0
    pp_per_microbatch *= 1 - pp_overlap
    stages = []
    for stage, layers in enumerate(partition_layers(config.num_layers, p)):
        ops = [op.times(len(layers)) for op in layer_ops] + (head_ops if stage == p - 1 else [])
        if hw.layer_overhead_s:                          # the framework's own work per layer (a CPU's, measured)
            ops.append(Operation("framework, per layer", 0, 0, len(layers) * hw.layer_overhead_s, "launch", 0))
        flops = len(layers) * layer_flops / t + (head_flops if stage == p - 1 else 0)
        compute = (sum(op.seconds for op in ops) if compute_efficiency is None
                   else flops / (compute_efficiency * hw.peak_flops))
        axes = {axis: len(layers) * seconds for axis, seconds in per_layer.items()}
        axes["tp"] += vocab_seconds(job, hw, stage)
        stages.append((compute, sum(axes.values()), pp_per_microbatch, ops, flops, axes))
    return stages


def _updated_params(job: Job, stage: int) -> int:
    """The parameters one GPU of ``stage`` updates: its shard of the optimizer state, in parameters."""
    per_param = CONVENTIONS[job.state_convention].optimizer_bytes
    return data_parallel_state_bytes(job, stage)["optimizer"] // per_param
