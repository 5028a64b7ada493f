"""DeepSpeed's JSON config (deepspeed/runtime/config.py and zero/config.py), with the model from a Hugging Face
``config.json`` (or a course preset), read into a Job.

DeepSpeed's conventions, and how the course counts them:

* ``train_batch_size`` = ``train_micro_batch_size_per_gpu`` × ``gradient_accumulation_steps`` × dp, where dp is
  the world over the tensor- and pipeline-parallel degrees; any two give the third, all three must agree.
* ``zero_optimization.stage`` 0-3 is the course's ZeRO stage over dp, with mixed-precision Adam's 16 bytes per
  parameter (the ZeRO paper's 2 + 2 + 12, its own formula). DeepSpeed's estimators (estimate_zero2/3_model_states_
  mem_needs, ledger.deepspeed_estimate) count an fp32 gradient partition too: the report prints both.
* A ``pipeline`` section's ``stages`` is the pipeline degree; DeepSpeed runs ZeRO-1 at most beside a pipeline.
  ``tensor_parallel.autotp_size`` is the TP degree (AutoTP training).
* An ``activation_checkpointing`` section configures deepspeed.checkpointing, which the model's code calls for
  each block (Hugging Face's gradient checkpointing, Megatron-DeepSpeed): counted as full recomputation.
* The sequence length is not DeepSpeed's to say (the data pipeline's): ``--seq-len`` gives it.
* DeepSpeed sets the pipeline's degree in code (``PipelineModule(num_stages=...)``); this reader takes it from a
  ``pipeline`` section's ``stages``, the way to tell it here.
* ``"auto"`` is a value Hugging Face's Trainer fills from its own arguments: the report needs the number.
* Gradients are reduced in the training dtype (the engine's ``communication_data_type`` default), or in the
  ``communication_data_type`` the config names: the step time counts those bytes.
"""

from __future__ import annotations

import functools
import json

from ..job import Job
from ..mesh import Mesh
from ..recipes import framework_overlap
from .common import ConfigError, ReadConfig, nearest, whole
from .huggingface import load_model

READ = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization",
        "bf16", "bfloat16", "fp16", "activation_checkpointing", "pipeline", "tensor_parallel", "sequence_parallel_size",
        "communication_data_type", "data_types"}
NO_EFFECT = {"optimizer", "scheduler", "gradient_clipping", "steps_per_print", "wall_clock_breakdown",
             "prescale_gradients", "gradient_predivide_factor", "tensorboard", "wandb", "csv_monitor",
             "flops_profiler", "comms_logger", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
             "dump_state", "memory_breakdown", "seed", "checkpoint",
             "aio", "elasticity"}
DTYPE_NAMES = {**dict.fromkeys(("torch.float16", "float16", "fp16", "half"), "fp16"),    # data_types' names, as
               **dict.fromkeys(("torch.float32", "float32", "fp32", "float"), "fp32"),   # DeepSpeed's DtypeEnum
               **dict.fromkeys(("torch.bfloat16", "bfloat16", "bf16"), "bf16")}          # spells them
ZERO_READ = {"stage", "overlap_comm", "offload_optimizer", "offload_param"}
ZERO_NO_EFFECT = {"contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size", "allgather_partitions",
                  "reduce_scatter", "round_robin_gradients", "sub_group_size", "stage3_prefetch_bucket_size",
                  "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                  "stage3_gather_16bit_weights_on_model_save", "load_from_fp32_weights", "elastic_checkpoint",
                  "ignore_unused_parameters", "stage3_model_persistence_threshold"}
NOT_MODELLED = {
    "zero_optimization.offload_optimizer": "the optimizer's state in CPU (or NVMe) memory: counted on the GPU, an "
                                           "upper bound of what the GPU holds",
    "zero_optimization.offload_param": "the weights in CPU (or NVMe) memory: counted on the GPU, an upper bound",
    "zero_optimization.cpu_offload": "the optimizer's state in CPU memory (the old switch): counted on the GPU, an "
                                     "upper bound",
    "zero_optimization.zero_hpz_partition_size": "ZeRO++'s secondary weight partition: not counted",
    "zero_optimization.zero_quantized_weights": "ZeRO++'s int8 weight gathers: counted in 16 bits",
    "zero_optimization.zero_quantized_gradients": "ZeRO++'s int4 gradient reduction: counted in 16 bits",
    "zero_optimization.mics_shard_size": "MiCS' sub-group sharding: counted as ZeRO over all of dp",
    "activation_checkpointing.partition_activations": "checkpoints split over the TP ranks: counted whole",
    "activation_checkpointing.cpu_checkpointing": "checkpoints moved to the CPU: counted on the GPU",
    "amp": "NVIDIA Apex's AMP: counted as bf16/fp16 mixed precision",
    "torch_autocast": "torch.autocast inside the engine: counted as the config's precision",
    "bf16.bf16_master_weights_and_grads": "bf16 master weights and gradients (no fp32 copy): counted as mixed "
                                          "precision's 16 bytes per parameter, an upper bound",
    "bf16.bf16_optimizer_states": "bf16 Adam moments: counted in fp32, an upper bound",
    "optimizer.type": "1-bit compression of the gradients' reduction after its freeze_step, with error-feedback "
                      "buffers: timed and counted uncompressed",
    "progressive_layer_drop": "layers skipped as training goes: every layer timed, every step",
    "compression_training": "quantization and pruning while training: counted in the config's precision, unpruned",
    "data_efficiency": "curriculum learning and token dropping (random-LTD): timed at the full sequence",
    "compile": "DeepSpeed's torch.compile of the model: timed as the eager run it reads",
    "zero_optimization.zenflow": "ZenFlow's optimizer offload: counted on the GPU, an upper bound",
}
ONE_BIT = {"onebitadam", "zerooneadam", "onebitlamb"}     # optimizer.type values that compress the reduction


def default_overlap(stage: int) -> bool:
    """DeepSpeed's overlap_comm where a file does not set it: on for ZeRO-3 only."""
    return stage == 3


def spell(job: Job, stage: int = 0, overlap: bool | None = None) -> dict[str, str]:
    """``job`` as the DeepSpeed keys that set it (ReadConfig.changes: a dotted key is a key inside its section).
    ``stage`` and ``overlap``: the file's ZeRO stage and overlap_comm (None: not set). Its layouts are timed with
    the file's overlap, so a layout at another ZeRO stage, whose default differs (on for stage 3 only), says it;
    without ZeRO (stage 0) DeepSpeed does not read the key."""
    overlapping = default_overlap(stage) if overlap is None else overlap
    as_in_file = "(default)" if overlap is None else str(overlap).lower()
    written = (as_in_file if job.zero in (0, stage) or overlapping == default_overlap(job.zero)
               else str(overlapping).lower())
    return {"zero_optimization.stage =": str(job.zero), "zero_optimization.overlap_comm =": written,
            "train_micro_batch_size_per_gpu =": str(job.micro_batch_size),
            "gradient_accumulation_steps =": str(job.num_microbatches),
            "tensor_parallel.autotp_size =": str(job.mesh.tp), "pipeline.stages =": str(job.mesh.pp),
            "the activation_checkpointing section, and the model's gradient checkpointing":
                "(on)" if job.recompute != "none" else "(off)"}


def _section(ds: dict, key: str) -> dict:
    """A section of the config: a JSON object, or a one-line error."""
    value = ds.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{key} = {value!r}: a section of the config, a JSON object of keys")
    return value


def _enabled(ds: dict, *keys: str) -> bool:
    """bf16.enabled (or its legacy name bfloat16.enabled): a switch, never "auto"."""
    for key in keys:
        value = _section(ds, key).get("enabled", False)
        if value == "auto":
            raise ConfigError(f'{key}.enabled = "auto": Hugging Face\'s Trainer fills it from its own arguments; '
                              "write true or false")
        if value:
            return True
    return False


def _switched_on(name: str, value) -> bool:
    """A not-modelled key set away from its default (offload to a device, ZeRO++'s partitions, MiCS's shards, a
    section enabled: its own "enabled", or one of its parts', as compression_training's; ZenFlow's by being there)."""
    defaults = {"zero_optimization.zero_hpz_partition_size": 1, "zero_optimization.mics_shard_size": -1}
    if isinstance(value, dict):
        if name == "zero_optimization.zenflow" or "enabled" in value:
            return name == "zero_optimization.zenflow" or bool(value["enabled"])
        return value.get("device", "none") != "none" or any(
            _switched_on(name, part) for part in value.values() if isinstance(part, dict))
    return bool(value) and value != defaults.get(name) and value != "none"


def read(text: str, where: str, *, num_gpus: int | None, gpu: str, gpus_per_node: int, model: str | None,
         seq_len: int | None) -> ReadConfig:
    try:
        ds = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where}: not JSON ({error.msg}, line {error.lineno})") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"{where}: a DeepSpeed config is a JSON object of keys")
    if "model_type" in ds:
        raise ConfigError(f"{where} is a model's config.json: give the DeepSpeed config, and this file as --model")
    if model is None:
        raise ConfigError("a DeepSpeed config does not name its model: give --model config.json (a Hugging Face "
                          "model's) or a course preset")
    config, model_name, not_modelled, unknown = load_model(model)
    unknown, not_modelled = list(unknown), list(not_modelled)
    zero = _section(ds, "zero_optimization")
    checkpointing = _section(ds, "activation_checkpointing") if "activation_checkpointing" in ds else None
    for key, value in ds.items():
        if key in NOT_MODELLED:
            if _switched_on(key, value):
                not_modelled.append(f"{key}: {NOT_MODELLED[key]}")
        elif key not in READ | NO_EFFECT:
            unknown.append(nearest(key, READ | NO_EFFECT | set(NOT_MODELLED)))
    subsections = (("zero_optimization", zero), ("activation_checkpointing", checkpointing or {}),
                   ("bf16", _section(ds, "bf16")), ("optimizer", _section(ds, "optimizer")))
    for section, keys in subsections:
        for key, value in keys.items():
            name = f"{section}.{key}"
            if name == "optimizer.type" and str(value).lower() not in ONE_BIT:
                continue
            if name == "zero_optimization.offload_param" and zero.get("stage", 0) != 3:
                continue                  # DeepSpeed offloads the weights at ZeRO-3 only
            if name in NOT_MODELLED:
                if _switched_on(name, value):
                    not_modelled.append(f"{name}: {NOT_MODELLED[name]}")
            elif section == "zero_optimization" and key not in ZERO_READ | ZERO_NO_EFFECT:
                unknown.append(nearest(name, [f"{section}.{k}" for k in ZERO_READ | ZERO_NO_EFFECT]))
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if ds.get(key) == "auto":
            raise ConfigError(f'{key} = "auto": Hugging Face\'s Trainer fills it from its own arguments; write the '
                              "number the run uses")
    if ds.get("sequence_parallel_size", 1) not in (1, None):
        raise ConfigError(f"sequence_parallel_size = {ds['sequence_parallel_size']!r}: DeepSpeed-Ulysses splits each "
                          "sequence by all-to-all, which the course does not model (its context parallelism is ring "
                          "attention), and it changes the data-parallel size the batch keys count")

    tp = whole("tensor_parallel.autotp_size", _section(ds, "tensor_parallel").get("autotp_size", 1))
    pp = whole("pipeline.stages", _section(ds, "pipeline").get("stages", 1))
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"zero_optimization.stage = {stage!r}: 0, 1, 2 or 3")
    if pp > 1 and stage > 1:
        raise ConfigError(f"zero_optimization.stage = {stage} with pipeline.stages = {pp}: DeepSpeed runs ZeRO-1 "
                          "at most beside a pipeline (stages 2 and 3 would reduce every micro-batch)")
    micro, accumulation, dp = _batch(ds, num_gpus, tp * pp)
    if _enabled(ds, "bf16", "bfloat16") and _enabled(ds, "fp16"):
        raise ConfigError("bf16.enabled and fp16.enabled both true: DeepSpeed takes one (its config refuses both)")
    precision = "bf16" if _enabled(ds, "bf16", "bfloat16") else "fp16" if _enabled(ds, "fp16") else "fp32"
    accum = _section(ds, "data_types").get("grad_accum_dtype")
    if accum is not None and accum not in DTYPE_NAMES:
        raise ConfigError(f"data_types.grad_accum_dtype = {accum!r}: one of {', '.join(DTYPE_NAMES)}")
    if accum is not None and DTYPE_NAMES[accum] != precision:      # engine.py's _do_optimizer_sanity_check
        if stage == 0:
            raise ConfigError(f"data_types.grad_accum_dtype = {accum!r} with {precision} weights and no ZeRO: "
                              "DeepSpeed refuses the mix")
        not_modelled.append(f"data_types.grad_accum_dtype = {accum!r}: gradients accumulated in {accum} beside the "
                            f"{precision} weights (with bf16 and ZeRO-1, DeepSpeed's BF16_Optimizer and its whole fp32 "
                            "gradient buffer): counted as the ZeRO paper's 16 bytes per parameter")
    reduce_bytes = _communication_bytes(ds.get("communication_data_type"), precision)
    conventions = ["the ZeRO paper's mixed-precision Adam: 2 + 2 + 12 bytes per parameter"
                   if precision != "fp32" else "fp32 Adam: 4 + 4 + 8 bytes per parameter"]
    if reduce_bytes:
        conventions.append(f"communication_data_type = {ds['communication_data_type']!r}: gradients reduced in "
                           f"{8 * reduce_bytes}-bit floats (DeepSpeed's default: the training dtype); the step time "
                           "counts those bytes")
    if seq_len is None:
        raise ConfigError("give the sequence length (--seq-len S): a DeepSpeed config does not hold it (the data "
                          f"pipeline does; the model allows up to {config.max_seq_len:,} tokens)")
    if not 1 <= seq_len <= config.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len}: from 1 to the model's max_position_embeddings {config.max_seq_len}")
    if checkpointing is not None:
        conventions.append("activation_checkpointing: the model's code checkpoints each block (Hugging Face's "
                           "gradient checkpointing): counted as full recomputation")
    overlap = zero.get("overlap_comm", default_overlap(stage))
    job = Job(config, Mesh(dp=dp, tp=tp, pp=pp), seq_len=seq_len, micro_batch_size=micro,
              num_microbatches=accumulation, zero_stage=stage, recompute="full" if checkpointing is not None else "none",
              dtype=precision, gpu=gpu, gpus_per_node=gpus_per_node)
    problems = job.problems()
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    # overlap_comm: as the frameworks schedule it (ZeRO-3's gathers and reduce-scatters as the published FSDP runs
    # fit, ZeRO-1 and 2's gradient buckets as DDP's); without it, none hidden
    overlap = framework_overlap(stage) if overlap else 0.0
    eager = not config.num_experts         # eager_traffic cannot route tokens: a mixture of experts timed fused
    if eager:
        conventions.append("the Hugging Face model in eager PyTorch, as it runs without torch.compile or fused "
                           "kernels (Liger): its norms, SwiGLU products and residual adds op by op, timed as eager "
                           "PyTorch runs the course's model, its rotary as Hugging Face writes it (rotate_half: "
                           "eager_traffic.ROTARY)")
    else:
        not_modelled.append("a mixture of experts in eager PyTorch: its norms, rotary, SwiGLU products and residual "
                            "adds timed as fused kernels (the eager count cannot route tokens), a lower bound")
    spelled = functools.partial(spell, stage=stage, overlap=zero.get("overlap_comm"))
    return ReadConfig("deepspeed", where, job, model_name, conventions, not_modelled, unknown, spelled,
                      assumptions=dict(dp_overlap=overlap, elementwise_ops="eager" if eager else "fused",
                                       rotary="rotate_half" if eager else "model.py", grad_reduce_bytes=reduce_bytes))


def _communication_bytes(value, precision: str) -> int | None:
    """Bytes per gradient element DeepSpeed reduces in, where ``communication_data_type`` makes them other than the
    training dtype's (its engine's default): None where they are the same."""
    if value is None:
        return None
    names = {"fp32": 4, "fp16": 2, "bf16": 2, "bfp16": 2}      # config.py's get_communication_data_type (bfp16: older)
    if not isinstance(value, str) or value.lower() not in names:
        raise ConfigError(f"communication_data_type = {value!r}: DeepSpeed takes 'fp32', 'fp16' or 'bf16'")
    reduced, trained = names[value.lower()], 4 if precision == "fp32" else 2
    return None if reduced == trained else reduced


def _batch(ds: dict, num_gpus: int | None, model_parallel: int) -> tuple[int, int, int]:
    """(micro-batch, accumulation steps, dp) from train_batch_size = micro × accumulation × dp."""
    given = {key: whole(key, ds[key]) for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                  "gradient_accumulation_steps") if key in ds}
    if num_gpus is None:
        if len(given) < 3:
            raise ConfigError("give the GPU count (--gpus N): the batch keys alone do not fix the world")
        num_gpus = given["train_batch_size"] // (given["train_micro_batch_size_per_gpu"]
                                                 * given["gradient_accumulation_steps"]) * model_parallel
    if num_gpus % model_parallel:
        raise ConfigError(f"{num_gpus} GPUs are not divisible by autotp_size × pipeline stages = {model_parallel}: "
                          "DeepSpeed's data-parallel size is the world over them")
    dp = num_gpus // model_parallel
    micro = given.get("train_micro_batch_size_per_gpu")
    accumulation = given.get("gradient_accumulation_steps")
    total = given.get("train_batch_size")
    if total is None and micro is None:
        raise ConfigError("no train_batch_size and no train_micro_batch_size_per_gpu: DeepSpeed needs one of them "
                          "(the other, and gradient_accumulation_steps, follow from train_batch_size = micro × "
                          "accumulation × dp)")
    if micro is None and accumulation is None:
        accumulation = 1
    if total is None:
        micro, accumulation = micro or 1, accumulation or 1
        total = micro * accumulation * dp
    elif micro is None or accumulation is None:
        known = micro or accumulation
        if total % (known * dp):
            raise ConfigError(f"train_batch_size = {total} is not divisible by {known} × dp {dp}: "
                              "train_batch_size = micro-batch × gradient_accumulation_steps × dp")
        micro, accumulation = (micro, total // (micro * dp)) if micro else (total // (accumulation * dp), accumulation)
    if micro * accumulation * dp != total:
        raise ConfigError(f"train_batch_size = {total} != train_micro_batch_size_per_gpu {micro} × "
                          f"gradient_accumulation_steps {accumulation} × dp {dp} = {micro * accumulation * dp}: "
                          "DeepSpeed requires them to agree")
    return micro, accumulation, dp
