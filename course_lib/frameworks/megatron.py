"""Megatron-LM's command-line arguments (megatron/training/arguments.py), read from a launch script into a Job.

The file is a shell script or a bare argument list (common.arguments): lines joined at their backslashes,
comments dropped, one-line ``NAME=value`` assignments substituted for ``$NAME``, ``${NAME}`` and
``${NAME:-default}``, and every ``--flag [value]`` anywhere in it read (those of a bash array such as
``GPT_MODEL_ARGS=( ... )`` or a quoted ``GPT_ARGS="..."`` included; torchrun's ``--nproc_per_node`` and
``--nnodes`` give the GPU count when ``--gpus`` does not, and ``--gpus`` wins, said, when both do). GPT training
only (pretrain_gpt.py): another entry point is refused by name.

Megatron's conventions, and how the course counts them:

* dp = world / (tp · pp · cp); m = global batch / (micro-batch · dp) micro-batches per step.
* ``--use-distributed-optimizer`` shards the optimizer's state over dp × cp: ZeRO-1. Bytes per parameter follow
  Megatron's own table (docs: "Distributed Optimizer"): bf16 weights with fp32 gradients, 6 + 12/d ("bf16+fp32
  grads", since bf16 accumulates and all-reduces gradients in fp32); fp32, 8 + 8/d; fp16, 4 + 16/d, where the
  fp32 copy of the gradients lives in the optimizer's shard and the course's "fp32 grad accumulation" keeps it
  whole (said in the report).
* Without ``--swiglu`` the MLP is GeLU with two matrices of width F (default 4h): counted as the course's
  SwiGLU of width 2F/3 rounded to a multiple of tp, the same weights and FLOPs to a few columns (the report says
  how many). LayerNorm, linear biases and learned positions (Megatron's defaults) are parameters the course model
  does not have: counted, in the report, as what is left out.
* The vocabulary is padded to a multiple of ``--make-vocab-size-divisible-by`` (128) × tp, as Megatron pads it.
* ``--overlap-grad-reduce`` reduces the gradients bucket by bucket during backward: half of it hidden (dp_overlap
  0.5, as DDP's buckets). ``--overlap-param-gather`` (with it, and the distributed optimizer: Megatron asserts
  both) gathers the updated weights into the next step, one bucket at a time, each module's forward waiting for
  its own: hidden as much again, up to the first micro-batch's forward, without a pipeline (with one, Megatron
  buckets the first stage's gather alone: timed as without the flag, and said).
"""

from __future__ import annotations

import functools
import math
import re

from ..job import Job
from ..mesh import Mesh
from ..model import ModelConfig
from ..recipes import DDP_OVERLAP
from .common import ConfigError, NotWritable, ReadConfig, arguments, nearest, whole

INTEGERS = {"tensor-model-parallel-size", "pipeline-model-parallel-size", "num-layers-per-virtual-pipeline-stage",
            "num-virtual-stages-per-pipeline-rank", "context-parallel-size", "expert-model-parallel-size",
            "recompute-num-layers", "micro-batch-size", "global-batch-size", "seq-length", "max-position-embeddings",
            "num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "num-query-groups", "kv-channels",
            "vocab-size", "make-vocab-size-divisible-by", "num-experts", "moe-router-topk", "moe-ffn-hidden-size",
            "expert-tensor-parallel-size", "nproc_per_node", "nproc-per-node", "nnodes"}
WORDS = {"recompute-granularity", "recompute-method", "normalization", "position-embedding-type", "rotary-base",
         "tokenizer-type", "attention-backend", "data-parallel-sharding-strategy", "cp-comm-type",
         "moe-expert-capacity-factor", "moe-token-dispatcher-type"}
SWITCHES = {"sequence-parallel", "use-distributed-optimizer", "group-query-attention", "swiglu",
            "untie-embeddings-and-output-weights", "bf16", "fp16", "accumulate-allreduce-grads-in-fp32",
            "add-qkv-bias", "disable-bias-linear", "use-flash-attn", "overlap-grad-reduce", "overlap-param-gather",
            "recompute-activations", "use-rotary-position-embeddings", "use-megatron-fsdp", "optimizer-cpu-offload",
            "grad-reduce-in-bf16", "moe-pad-expert-input-to-capacity"}
# Flags that change nothing the report counts (optimizer settings, data, logging, checkpoints, the launcher).
NO_EFFECT = {
    "lr", "min-lr", "lr-decay-style", "lr-decay-iters", "lr-decay-samples", "lr-warmup-iters", "lr-warmup-fraction",
    "lr-warmup-samples", "weight-decay", "clip-grad", "adam-beta1", "adam-beta2", "adam-eps", "init-method-std",
    "train-iters", "train-samples", "data-path", "split", "vocab-file", "merge-file", "tokenizer-model", "save",
    "load", "save-interval", "eval-interval", "eval-iters", "log-interval", "tensorboard-dir", "seed",
    "attention-dropout", "hidden-dropout", "distributed-backend", "use-mcore-models", "transformer-impl",
    "mock-data", "ckpt-format", "log-throughput", "log-timers-to-tensorboard", "wandb-project", "wandb-exp-name",
    "no-masked-softmax-fusion", "no-bias-gelu-fusion",
    "no-gradient-accumulation-fusion", "no-position-embedding", "data-cache-path", "exit-duration-in-mins",
    "timing-log-level", "master_addr", "master-addr", "master_port", "master-port", "node_rank", "node-rank",
    "rdzv_backend", "rdzv-backend", "rdzv_endpoint", "rdzv-endpoint", "rdzv_id", "rdzv-id", "norm-epsilon",
    "moe-grouped-gemm", "moe-aux-loss-coeff", "moe-router-load-balancing-type",
    "use-checkpoint-args", "no-load-optim", "no-load-rng", "bert-no-binary-head", "num-workers", "rampup-batch-size",
}
NOT_MODELLED = {
    "fp8-format": "FP8 matmuls (Transformer Engine): the course times and counts bf16",
    "no-bias-swiglu-fusion": "SwiGLU's product op by op: timed as Megatron's fused kernel",
    "no-bias-dropout-fusion": "the residual add and dropout op by op: timed as a fused kernel",
    "cpu-offloading": "activation and weight offload to the CPU: counted on the GPU, an upper bound",
    "multi-latent-attention": "MLA (DeepSeek's attention): the course model's attention is grouped-query",
    "use-torch-fsdp2": "Megatron's FSDP2 path: counted as the distributed optimizer (ZeRO-1) or DDP",
    "use-custom-fsdp": "Megatron's own FSDP: counted as the distributed optimizer (ZeRO-1) or DDP",
    "use-megatron-fsdp": "Megatron's own FSDP: counted as the distributed optimizer (ZeRO-1) or DDP",
    "data-parallel-sharding-strategy": "Megatron-FSDP's sharding: counted as the distributed optimizer or DDP",
    "optimizer-cpu-offload": "the optimizer's state in CPU memory: counted on the GPU, an upper bound",
    "tp-comm-overlap": "TP's forward collectives pipelined with the GEMMs (Transformer Engine's userbuffers): timed "
                       "with only the input gradients' reduction beside the weight-gradient GEMMs, as Megatron "
                       "always runs it",
    "overlap-param-gather-with-optimizer-step": "the weights' gather started in the optimizer step: timed as "
                                                "--overlap-param-gather alone",
    "no-align-param-gather": "each stage's gather started at its own first forward: timed as "
                             "--overlap-param-gather alone",
    "num-layers-in-first-pipeline-stage": "an uneven first stage: the course splits the layers evenly",
    "num-layers-in-last-pipeline-stage": "an uneven last stage: the course splits the layers evenly",
    "decoder-first-pipeline-num-layers": "an uneven first stage: the course splits the layers evenly",
    "decoder-last-pipeline-num-layers": "an uneven last stage: the course splits the layers evenly",
    "moe-shared-expert-intermediate-size": "a shared expert: the course's MoE layer has routed experts only",
    "account-for-embedding-in-pipeline-split": "an uneven split, the embedding as a layer: the course splits evenly",
    "account-for-loss-in-pipeline-split": "an uneven split, the loss as a layer: the course splits the layers evenly",
}
UNEVEN = [name for name, reason in NOT_MODELLED.items() if reason.startswith("an uneven")]   # stages set by hand
# Megatron-LM's column-parallel linear layers (megatron/core/tensor_parallel/layers.py,
# LinearWithGradAccumulationAndAsyncCommunication, and Transformer Engine's Linear: "Overlap dgrad-RS/AR with
# wgrad") issue the input gradient's all-reduce, or reduce-scatter under sequence parallelism, asynchronously before
# their weight-gradient GEMM and wait for it after: no flag turns it off (Korthikanti et al. 2022, 5, the published
# rows' tp_overlap). It relies on CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron's example scripts set.
TP_OVERLAP = 1.0
CP_OVERLAP = 1.0   # Transformer Engine's p2p ring attention: each hop beside the previous block's attention
KNOWN = INTEGERS | WORDS | SWITCHES | NO_EFFECT | set(NOT_MODELLED)
# Megatron's tokenizers whose vocabulary is known without their files: GPT-2's BPE (its default) and Llama 2's
# SentencePiece model (megatron/core/tokenizers); any other needs --vocab-size
TOKENIZERS = {"GPT2BPETokenizer": 50257, "Llama2Tokenizer": 32000}


def spell(job: Job, virtual_stages: bool = False, overlap_param_gather: bool = False,
          recompute_activations: bool = False, even: bool = True) -> dict[str, str]:
    """``job`` as the Megatron-LM flags that set it (ReadConfig.changes: "(on)" adds a switch, "(off)" removes it).
    ``virtual_stages``: the file gives interleaving as --num-virtual-stages-per-pipeline-rank, not as layers;
    ``overlap_param_gather``: the file sets it, which a layout without the distributed optimizer must drop;
    ``recompute_activations``: the file recomputes by --recompute-activations, which wins over a granularity.
    With ``even`` stages (no UNEVEN flag), layers that do not divide over stages and chunks raise NotWritable."""
    if even and job.config.num_layers % (job.mesh.pp * job.num_chunks):
        raise NotWritable(f"{job.config.num_layers} layers over pp {job.mesh.pp} × {job.num_chunks} chunks: "
                          "Megatron gives every stage and chunk as many layers")
    if virtual_stages:
        interleaving = {"--num-virtual-stages-per-pipeline-rank": str(job.num_chunks) if job.num_chunks > 1 else "(off)"}
    else:
        layers = job.config.num_layers // (job.mesh.pp * job.num_chunks)
        interleaving = {"--num-layers-per-virtual-pipeline-stage": str(layers) if job.num_chunks > 1 else "(off)"}
    recompute = {"none": "(off)", "selective": "selective",
                 "full": "full --recompute-method uniform --recompute-num-layers 1"}[job.recompute]
    return {"--tensor-model-parallel-size": str(job.mesh.tp), "--pipeline-model-parallel-size": str(job.mesh.pp),
            **interleaving, "--micro-batch-size": str(job.micro_batch_size), "--recompute-granularity": recompute,
            "--sequence-parallel": "(on)" if job.sequence_parallel else "(off)",
            "--use-distributed-optimizer": "(on)" if job.zero_stage == 1 else "(off)",
            **({"--overlap-param-gather": "(on)" if job.zero_stage == 1 else "(off)"} if overlap_param_gather
               else {}),
            **({"--recompute-activations": "(on)" if job.recompute == "selective" else "(off)"} if
               recompute_activations else {})}


def flags(tokens: list[str], where: str) -> tuple[dict, list[str]]:
    """{flag: value} (a switch: True) of every ``--flag`` in ``tokens``, and the unknown flags' lines."""
    found, unknown = {}, []
    for i, token in enumerate(tokens):
        if not token.startswith("--") or token == "--":
            continue
        name, _, inline = token[2:].partition("=")
        following = tokens[i + 1] if i + 1 < len(tokens) else None
        value = inline or (following if following is not None and not following.startswith("--") else None)
        if name in SWITCHES or (name not in INTEGERS | WORDS and value is None):
            value = True
        elif name in WORDS and value is None:
            raise ConfigError(f"{where}: --{name} has no value: it takes a word")
        if name in INTEGERS:
            if value is None or not re.fullmatch(r"-?\d+", str(value)):
                raise ConfigError(f"{where}: --{name} {value if value is not None else '(nothing)'}: must be a whole "
                                  "number (a shell expression the reader cannot evaluate? write the number)")
            value = int(value)
        if name not in KNOWN:
            unknown.append(nearest(f"--{name}", [f"--{k}" for k in KNOWN]))
        found[name] = value
    return found, unknown


def read(text: str, where: str, *, num_gpus: int | None, gpu: str, gpus_per_node: int) -> ReadConfig:
    tokens = arguments(text)
    others = sorted({token.rsplit("/", 1)[-1] for token in tokens if re.fullmatch(r"(.*/)?pretrain_\w+\.py", token)}
                    - {"pretrain_gpt.py"})
    if others:
        raise ConfigError(f"{where}: {', '.join(others)}: the course reads GPT training (pretrain_gpt.py); "
                          "BERT, T5, Mamba and other models are not the course's decoder")
    args, unknown = flags(tokens, where)
    not_modelled = [f"--{name}: {reason}" for name, reason in NOT_MODELLED.items() if name in args]

    launched = args.get("nproc_per_node", args.get("nproc-per-node", 0)) * args.get("nnodes", 1)
    if num_gpus is None:
        num_gpus = launched or None
    if num_gpus is None:
        raise ConfigError(f"{where}: no torchrun --nproc_per_node here: give the GPU count (--gpus N)")
    given = [f"--gpus {num_gpus} in place of the script's torchrun --nproc_per_node × --nnodes = {launched}"]
    tp, pp, cp, ep = (whole(f"--{name}-size", args.get(f"{name}-size", 1)) for name in
                      ("tensor-model-parallel", "pipeline-model-parallel", "context-parallel",
                       "expert-model-parallel"))
    if args.get("num-experts") and args.get("expert-tensor-parallel-size", tp) > 1:   # Megatron's default: tp
        not_modelled.append("experts split by TP (--expert-tensor-parallel-size, by default the TP size): the "
                            "course's MoE layer has none")
    if args.get("bf16") and args.get("fp16"):
        raise ConfigError(f"{where}: --bf16 and --fp16 together: Megatron-LM takes one")
    if num_gpus % (tp * pp * cp):
        raise ConfigError(f"{num_gpus} GPUs are not divisible by tp {tp} × pp {pp} × cp {cp} = {tp * pp * cp}: "
                          "Megatron's data-parallel size is world / (tp × pp × cp)")
    dp = num_gpus // (tp * pp * cp)
    config, conventions, left_out = _model(args, tp, pp)
    conventions += given if launched and launched != num_gpus else []
    not_modelled += left_out

    micro = whole("--micro-batch-size", args.get("micro-batch-size", 1))
    global_batch = whole("--global-batch-size", args.get("global-batch-size", micro * dp))
    if global_batch % (micro * dp):
        raise ConfigError(f"--global-batch-size {global_batch} is not divisible by --micro-batch-size {micro} × dp "
                          f"{dp} = {micro * dp}: Megatron runs whole micro-batches on every data-parallel rank")
    even = not any(name in args for name in UNEVEN)     # no stage's layers set by hand
    num_chunks = _chunks(args, config.num_layers, pp, even)
    precision = "fp16" if args.get("fp16") else "bf16" if args.get("bf16") else "fp32"
    convention = {"bf16": "bf16+fp32 grads", "fp16": "fp32 grad accumulation", "fp32": "fp32"}[precision]
    if args.get("grad-reduce-in-bf16") and precision == "bf16":
        convention = "mixed"     # arguments.py turns accumulate_allreduce_grads_in_fp32 off: bf16 gradient buffers
        conventions.append("--grad-reduce-in-bf16: gradients accumulated and reduced in bf16, counted as "
                           "mixed-precision state (2 + 2 + 12 bytes per parameter); Megatron's distributed-optimizer "
                           "table has no row for it")
    elif args.get("grad-reduce-in-bf16"):
        conventions.append(f"--grad-reduce-in-bf16 with {precision}: Megatron-LM's arguments.py reads it only for "
                           "bf16 training, so it changes nothing")
    zero_stage = 1 if args.get("use-distributed-optimizer") else 0
    overlap_param_gather = bool(args.get("overlap-param-gather"))
    if overlap_param_gather:
        sharded = zero_stage == 1 or args.get("use-megatron-fsdp") or args.get("use-custom-fsdp")
        missing = [flag for flag, given in (("--use-distributed-optimizer", sharded),
                                            ("--overlap-grad-reduce", args.get("overlap-grad-reduce"))) if not given]
        if missing:
            raise ConfigError(f"{where}: --overlap-param-gather without {' and '.join(missing)}: Megatron-LM's "
                              "arguments.py asserts it comes with --overlap-grad-reduce and the distributed "
                              "optimizer (or Megatron-FSDP)")
        conventions.append("--overlap-param-gather: the updated weights gathered into the next step, one bucket at a "
                           "time, each module's forward waiting for its own: timed as hidden as the gradients' "
                           "reduce (half), up to the first micro-batch's forward")
        if pp > 1:
            not_modelled.append("--overlap-param-gather with a pipeline: Megatron buckets the first stage's gather "
                                "alone, the others gather their weights whole at their first forward; timed as "
                                "without the flag")
    recompute = _recompute(args, not_modelled)
    if tp > 1 and recompute == "full":
        conventions.append("full recomputation reruns each layer's whole forward (Megatron-LM's CheckpointFunction), "
                           "TP's last reduction too: one more a layer than torch's non-reentrant checkpoint")
    if tp > 1:
        conventions.append("TP's backward: each column-parallel layer's input-gradient all-reduce (reduce-scatter "
                           "with --sequence-parallel) runs beside its weight-gradient GEMM, as Megatron-LM's "
                           "linear layers and Transformer Engine's always issue it: timed hidden up to those GEMMs "
                           "(step_time's tp_overlap = 1)")
    if cp > 1:
        comm_type = str(args.get("cp-comm-type", "p2p"))
        conventions.append("context parallelism: Transformer Engine's ring attention (--cp-comm-type p2p, the "
                           "default) sends each K/V block beside the attention kernel of the one before: timed "
                           "hidden up to the attention kernels (step_time's cp_overlap = 1)")
        if comm_type != "p2p":
            not_modelled.append(f"--cp-comm-type {comm_type}: all-to-all or all-gather context parallelism; timed "
                                "as p2p's ring")
    capacity = _capacity(args, where, conventions, not_modelled, ep) if config.num_experts else None
    if precision == "fp16" and zero_stage == 1:
        conventions.append("fp16 with the distributed optimizer: Megatron shards its fp32 gradient copy with the "
                           "optimizer (4 + 16/d bytes per parameter); the course keeps it whole (8 + 12/d)")
    job = Job(config, Mesh(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep), seq_len=config.max_seq_len, micro_batch_size=micro,
              num_microbatches=global_batch // (micro * dp), zero_stage=zero_stage, recompute=recompute,
              sequence_parallel=bool(args.get("sequence-parallel")), vocab_parallel=tp > 1,
              schedule="interleaved" if num_chunks > 1 else "1f1b", num_chunks=num_chunks, data_parallel=ep == 1,
              dtype="fp32" if precision == "fp32" else precision, convention=convention, capacity_factor=capacity,
              gpu=gpu, gpus_per_node=gpus_per_node)
    if problems := job.problems():
        raise ConfigError(f"{where}: " + "; ".join(problems))
    name = f"GPT {config.num_layers} layers × {config.hidden} wide" + (
        f", {config.num_experts} experts" if config.num_experts else "")
    return ReadConfig("megatron", where, job, name, conventions, not_modelled, unknown,
                      functools.partial(spell, virtual_stages="num-virtual-stages-per-pipeline-rank" in args,
                                        recompute_activations=bool(args.get("recompute-activations")),
                                        even=even,
                                        overlap_param_gather=overlap_param_gather),
                      assumptions=dict(dp_overlap=DDP_OVERLAP if args.get("overlap-grad-reduce") else 0.0,
                                       overlap_param_gather=overlap_param_gather, tp_overlap=TP_OVERLAP,
                                       elementwise_ops="fused",    # its fused norm, SwiGLU and dropout-add kernels
                                       cp_overlap=CP_OVERLAP, checkpoint="reentrant"))   # its CheckpointFunction


def _capacity(args: dict, where: str, conventions: list[str], not_modelled: list[str], ep: int) -> float:
    """The capacity factor that gives the rows Megatron's all-to-alls send (expert_parallel.all_to_all_bytes; the
    course's MoE, with None, pads every expert's buffer to all the tokens). Dropless by default, and without
    --moe-pad-expert-input-to-capacity it sends only the rows routed and kept: T·top_k at most, a balanced
    router's capacity 1. Its default dispatcher all-gathers the tokens instead (transformer_config.py)."""
    value = args.get("moe-expert-capacity-factor")
    try:
        factor = 1.0 if value is None else float(value)
    except ValueError:
        factor = 0.0
    if not factor > 0:
        raise ConfigError(f"{where}: --moe-expert-capacity-factor {value}: a number above 0")
    padded = bool(args.get("moe-pad-expert-input-to-capacity")) and value is not None
    counted = factor if padded else min(factor, 1.0)
    if value is None:
        conventions.append("dropless experts (no --moe-expert-capacity-factor): each all-to-all sends the rows "
                           "routed, counted as a balanced router's, capacity factor 1")
    elif padded:
        conventions.append(f"--moe-expert-capacity-factor {factor:g} with --moe-pad-expert-input-to-capacity: every "
                           "expert's buffer sent padded to its capacity")
    else:
        conventions.append(f"--moe-expert-capacity-factor {factor:g}, not padded: each all-to-all sends the rows kept, "
                           f"counted as a balanced router's, capacity factor {counted:g}")
    dispatcher = args.get("moe-token-dispatcher-type", "allgather")
    if ep > 1 and dispatcher != "alltoall":
        not_modelled.append(f"--moe-token-dispatcher-type {dispatcher}" + (" (Megatron's default)" if dispatcher ==
                            "allgather" else "") + ": not all-to-alls of the routed rows, as the step is timed")
    return counted


def _model(args: dict, tp: int, pp: int) -> tuple[ModelConfig, list[str], list[str]]:
    """The model the shape flags describe, with Megatron's defaults; what the reading assumed, what it left out."""
    missing = [f"--{name}" for name in ("num-layers", "hidden-size", "num-attention-heads", "seq-length")
               if name not in args]
    if missing:
        raise ConfigError(f"no {', '.join(missing)}: Megatron-LM requires the model's shape and the sequence length")
    for name in ("num-layers", "hidden-size", "num-attention-heads", "seq-length", "ffn-hidden-size", "kv-channels",
                 "num-query-groups", "vocab-size", "make-vocab-size-divisible-by", "moe-ffn-hidden-size",
                 "moe-router-topk", "max-position-embeddings"):
        if name in args:
            whole(f"--{name}", args[name])
    if args.get("max-position-embeddings", args["seq-length"]) < args["seq-length"]:
        raise ConfigError(f"--max-position-embeddings {args['max-position-embeddings']} < --seq-length "
                          f"{args['seq-length']}: Megatron-LM needs a position for every token of a sequence")
    hidden, heads, layers = args["hidden-size"], args["num-attention-heads"], args["num-layers"]
    if args.get("kv-channels", hidden // heads) * heads != hidden:
        raise ConfigError(f"--kv-channels {args.get('kv-channels', hidden / heads):g} × --num-attention-heads {heads} "
                          f"!= --hidden-size {hidden}: the course model's heads split the width evenly")
    # --group-query-attention without --num-query-groups is one group (Megatron's default)
    kv_heads = args.get("num-query-groups", 1) if args.get("group-query-attention") else heads
    experts = args.get("num-experts", 0)
    swiglu = bool(args.get("swiglu"))
    ffn = args.get("moe-ffn-hidden-size") if experts and "moe-ffn-hidden-size" in args else args.get("ffn-hidden-size")
    if ffn is None:                  # Megatron's defaults: 4h, and for SwiGLU 2/3 of it, down to a multiple of 64
        ffn = int(4 * hidden * 2 / 3 / 64) * 64 if swiglu else 4 * hidden
    width = ffn if swiglu else round(2 * ffn / 3 / tp) * tp     # a width TP splits, as Megatron splits 4h
    more = (3 * width - 2 * ffn) * hidden                        # weights a layer the SwiGLU has beyond the GeLU
    conventions = [] if swiglu else [f"GeLU MLP of width {ffn} (2 matrices) counted as SwiGLU of width {width} "
                                     "(3 matrices): " + (f"{more:+,} weights and their FLOPs a layer (a width "
                                                         + (f"TP {tp} splits)" if tp > 1 else "in whole columns)")
                                                         if more else "the same weights and FLOPs")]
    vocab = args.get("vocab-size")
    tokenizer = args.get("tokenizer-type", "GPT2BPETokenizer")
    if vocab is None and tokenizer not in TOKENIZERS:
        raise ConfigError(f"--tokenizer-type {tokenizer} without --vocab-size: its vocabulary is in its files; "
                          "write --vocab-size N")
    if vocab is None:
        vocab = TOKENIZERS[tokenizer]
        conventions.append(f"no --vocab-size: --tokenizer-type {tokenizer}'s {vocab:,} tokens")
    multiple = args.get("make-vocab-size-divisible-by", 128) * tp
    padded = math.ceil(vocab / multiple) * multiple
    if padded != vocab:
        conventions.append(f"vocabulary {vocab:,} padded to {padded:,} (a multiple of "
                           f"--make-vocab-size-divisible-by × tp = {multiple})")
    tied = not args.get("untie-embeddings-and-output-weights")
    if tied and (tp > 1 or pp > 1):   # split by vocabulary, or on two stages: apart in the course
        tied = False
        conventions.append("tied embedding and output layer, split by vocabulary over TP or pipeline stages: counted "
                           "as two "
                           + ("(Megatron keeps a copy of the embedding on the last pipeline stage: exact)" if pp > 1
                              else f"({padded // tp * hidden:,} parameters per GPU more than Megatron holds)"))
    seq_len = args["seq-length"]
    try:
        config = ModelConfig(vocab_size=padded, hidden=hidden, num_layers=layers, num_heads=heads,
                             num_kv_heads=kv_heads, intermediate=width, max_seq_len=seq_len,
                             tie_embeddings=tied,
                             attn_bias=bool(args.get("add-qkv-bias")), num_experts=experts,
                             top_k=args.get("moe-router-topk", 2))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return config, conventions, _left_out(args, config, ffn)


def _left_out(args: dict, config: ModelConfig, ffn: int) -> list[str]:
    """Megatron's default LayerNorm, linear biases and learned positions: the parameters the course model lacks."""
    d, h = config.hidden, config.hidden // config.num_heads
    parts = []
    if args.get("normalization", "LayerNorm") == "LayerNorm":
        parts.append(("LayerNorm's biases", config.num_layers * 2 * d + d))
    if not args.get("disable-bias-linear"):
        mlp = (ffn if not args.get("swiglu") else 2 * ffn) + d
        per_layer = (config.num_heads + 2 * config.num_kv_heads) * h + d + mlp * max(1, config.num_experts)
        parts.append(("linear layers' biases", config.num_layers * per_layer))
    if args.get("position-embedding-type", "learned_absolute") == "learned_absolute" and not args.get(
            "use-rotary-position-embeddings"):
        parts.append(("learned position embeddings", args.get("max-position-embeddings", config.max_seq_len) * d))
    return [f"{name}: {count:,} parameters the course model does not have (it uses RMSNorm, no biases, rotary "
            "positions), left out of every count" for name, count in parts]


def _chunks(args: dict, layers: int, pp: int, even: bool) -> int:
    """v, the model chunks per pipeline rank: --num-virtual-stages-per-pipeline-rank, or the layers per rank
    over --num-layers-per-virtual-pipeline-stage; every stage, and every chunk, holds as many layers, ``even``
    (Megatron's arguments.py and transformer_block.py assert it, unless the file sets the first or last stage's)."""
    if even and layers % pp:
        raise ConfigError(f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size {pp}: every "
                          "stage holds as many layers")
    if "num-virtual-stages-per-pipeline-rank" in args:
        chunks = whole("--num-virtual-stages-per-pipeline-rank", args["num-virtual-stages-per-pipeline-rank"])
        if even and (layers // pp) % chunks:
            raise ConfigError(f"{layers // pp} layers per pipeline rank do not split into "
                              f"--num-virtual-stages-per-pipeline-rank {chunks}: every chunk holds as many layers")
        return chunks
    if "num-layers-per-virtual-pipeline-stage" not in args:
        return 1
    per_chunk = whole("--num-layers-per-virtual-pipeline-stage", args["num-layers-per-virtual-pipeline-stage"])
    if layers % (pp * per_chunk):
        raise ConfigError(f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size {pp} × --num-"
                          f"layers-per-virtual-pipeline-stage {per_chunk}: every virtual stage holds as many layers")
    return layers // (pp * per_chunk)


def _recompute(args: dict, not_modelled: list[str]) -> str:
    """--recompute-activations is selective (and wins, as in Megatron-LM); full needs its method."""
    granularity = "selective" if args.get("recompute-activations") else args.get("recompute-granularity")
    if granularity is None:
        return "none"
    if granularity not in ("full", "selective"):
        raise ConfigError(f"--recompute-granularity {granularity}: full or selective")
    if granularity == "selective" and args.get("recompute-method"):
        raise ConfigError(f"--recompute-method {args['recompute-method']} with selective recomputation: Megatron-LM "
                          "takes a method only with --recompute-granularity full")
    if granularity == "full":
        method, layers = args.get("recompute-method"), args.get("recompute-num-layers")
        if method not in ("uniform", "block") or layers is None:
            raise ConfigError("--recompute-granularity full needs --recompute-method uniform or block and "
                              "--recompute-num-layers (Megatron-LM refuses it without them)")
        if (method, layers) != ("uniform", 1):
            not_modelled.append(f"--recompute-method {method} --recompute-num-layers {layers}: counted as full "
                                "recomputation of each layer")
    return granularity
