"""torchtitan's TOML job config, read into a Job (torchtitan/config/job_config.py names the keys and defaults; the
keys are those of its last TOML version, e347b1e5e, before it moved to Python config files).

How torchtitan builds the run, and how the course counts it:

* The mesh is ("pp", "dp_replicate", "dp_shard", "cp", "tp"), the course's order (mesh.py).
  ``data_parallel_shard_degree = -1`` takes what the other degrees leave of the GPUs. FSDP2 shards over
  dp_shard × cp: ZeRO-3; with ``data_parallel_replicate_degree`` > 1 too, HSDP; replicas alone are DDP.
* ``fsdp_reshard_after_forward = "default"`` reshards after each forward unless a pipeline runs (then FSDP2
  keeps the weights gathered across micro-batches and reduces once a step: the Job's reshard_after_forward and
  _backward False, as torch's pipelining runs it); "always" and "never" say so.
* The batch: each dp rank takes ``local_batch_size`` sequences of ``seq_len`` tokens a pass; a pipeline cuts
  them into micro-batches of ``pipeline_parallel_microbatch_size``; ``global_batch_size`` above local × dp
  accumulates gradients over global / (local × dp) passes. Without a pipeline the passes are the course's
  micro-batches; with one, each pass is a whole pipeline (its own fill and drain): the report is of one pass.
* Mixed precision: FSDP2 keeps each shard in fp32 (4 bytes of weight, 4 of gradient, 8 of Adam's m and v),
  gathers the weights in ``mixed_precision_param`` (bf16) and reduces gradients in ``mixed_precision_reduce``
  (fp32). The course counts ZeRO-3 with mixed-precision Adam (2 + 2 + 12): the same 16 bytes per parameter once
  everything is sharded; the report shows the fp32 reduction's bytes. Without FSDP, TP or PP turn mixed precision
  off (torchtitan's maybe_enable_amp): the run is fp32.
"""

from __future__ import annotations

import functools

import tomllib

from ..job import Job
from ..mesh import Mesh
from ..model import ModelConfig
from ..published import FSDP_OVERLAP, TORCHTITAN_H100_TPS, TORCHTITAN_ROTARY
from .common import ConfigError, NotWritable, ReadConfig, nearest, whole

# model.name -> flavour -> the model's shape (torchtitan/models/llama3/__init__.py and the older llama2's):
# FFN width = multiple_of · ceil(ffn_dim_multiplier · int(2 · 4d / 3) / multiple_of), as its FeedForward computes.
FLAVOURS = {
    "llama3": {"8B": (4096, 32, 32, 8, 1.3, 1024), "70B": (8192, 80, 64, 8, 1.3, 4096),
               "405B": (16384, 126, 128, 8, 1.2, 4096)},
    "llama2": {"7B": (4096, 32, 32, 32, None, 256), "13B": (5120, 40, 40, 40, None, 256),
               "70B": (8192, 80, 64, 8, 1.3, 4096)},
}
VOCAB = {"llama3": (128256, 500000.0), "llama2": (32000, 10000.0)}   # the tokenizer's vocabulary, rope theta

# Every key the reader takes (section -> keys); the keys that change nothing counted here are accepted too.
READ = {
    "model": {"name", "flavor", "norm_type"},
    "training": {"local_batch_size", "batch_size", "global_batch_size", "seq_len", "mixed_precision_param",
                 "mixed_precision_reduce", "compile"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                    "pipeline_parallel_degree", "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
                    "context_parallel_degree", "expert_parallel_degree", "fsdp_reshard_after_forward",
                    "pipeline_parallel_layers_per_stage", "pipeline_parallel_first_stage_less_layers",
                    "pipeline_parallel_last_stage_less_layers",
                    "disable_loss_parallel"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
    "compile": {"enable", "components", "backend"},
}
IGNORED_SECTIONS = {"profiling", "metrics", "optimizer", "lr_scheduler", "checkpoint", "comm", "validation",
                    "fault_tolerance", "experimental", "memory_estimation", "debug"}   # nothing in them counted here
NO_EFFECT = {
    "job": {"dump_folder", "description", "print_args", "print_config", "use_for_integration_test"},
    "model": {"tokenizer_path", "hf_assets_path", "converters", "print_after_conversion"},
    "training": {"steps", "max_norm", "dataset", "dataset_path", "seed", "deterministic", "warmup_steps",
                 "gc_freq", "gc_debug", "dataloader"},
    "parallelism": {"pipeline_parallel_split_points", "context_parallel_rotate_method",
                    "pipeline_parallel_schedule_csv", "expert_tensor_parallel_degree"},
    "activation_checkpoint": {"per_op_sac_force_recompute_mm_shapes_by_fqns", "preserve_rng_state",
                              "early_stop", "debug"},
}
# An older torchtitan's places for the parallel degrees, which today's would not read: refused, not lost
MOVED = {("training", key): "parallelism" for key in ("tensor_parallel_degree", "data_parallel_degree",
                                                       "data_parallel_shard_degree", "data_parallel_replicate_degree")}
MOVED |= {("experimental", key): "parallelism" for key in ("pipeline_parallel_degree", "context_parallel_degree")}
CONVERTED = {"float8", "mx", "quantize"}   # options of a model converter: in use when [model] converters names one
NOT_MODELLED = {   # (section, key or None for the whole section when present and enabled): what it changes
    ("float8", None): "FP8 matmuls (torchao): the course times and counts bf16",
    ("mx", None): "MX formats: the course times and counts bf16",
    ("quantize", None): "FP8 / MX matmuls (torchao): the course times and counts bf16",
    ("model", "converters"): "model converters (float8, mx): the course times and counts bf16",
    ("training", "enable_cpu_offload"): "FSDP's CPU offload: counted on the GPU, an upper bound",
    ("training", "dtype"): "training wholly in bfloat16 (no fp32 master, 2-byte m and v): counted as mixed "
                           "precision's 16 bytes per parameter, an upper bound",
    ("parallelism", "enable_async_tensor_parallel"): "async TP (its collectives overlapped with the matmuls): "
                                                     "timed without the overlap",
    ("parallelism", "module_fqns_per_model_part"): "stages split by hand: the course splits the layers evenly",
}
NORM_TYPES = ("", "rmsnorm", "fused_rmsnorm", "compiled_rmsnorm", "layernorm", "np_layernorm")   # older files'
SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved1f1b": "interleaved"}   # torch's names, any case
SCHEDULE_NAMES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}


def spell(job: Job, global_batch_size: int | None = None, layers_per_stage: bool = False,
          weights: int = 2) -> dict[str, str]:
    """``job`` as the lines of a torchtitan TOML that set it (ReadConfig.changes). ``global_batch_size``: the
    file's own, when it sets one (each alternative keeps the file's sequences a step). ``layers_per_stage``: the
    file sets pipeline_parallel_layers_per_stage (``weights``: its first and last stages' less_layers), which every
    pipeline then writes, as it does where the chunks per rank are not the schedule's default; a pipeline no
    value gives (torchtitan's ceil((layers + weights) / layers_per_stage) stages) raises NotWritable."""
    mesh = job.mesh
    lines = {"[parallelism] data_parallel_shard_degree =": str(mesh.dp_shard),
             "[parallelism] data_parallel_replicate_degree =": str(mesh.dp_replicate),
             "[parallelism] tensor_parallel_degree =": str(mesh.tp),
             "[parallelism] pipeline_parallel_degree =": str(mesh.pp),
             "[parallelism] context_parallel_degree =": str(mesh.cp),
             "[activation_checkpoint] mode =": f'"{"selective" if job.recompute == "op" else job.recompute}"'}
    if job.recompute in ("selective", "op"):       # torchtitan's only selective policy per op is "op"
        lines["[activation_checkpoint] selective_ac_option ="] = '"op"'
    # Without a pipeline, each of the m micro-batches is a pass of local_batch_size (gradient accumulation);
    # with one, local_batch_size is cut into micro-batches of pipeline_parallel_microbatch_size. -1: one pass.
    local = job.micro_batch_size * (job.num_microbatches if mesh.pp > 1 else 1)
    lines["[training] local_batch_size ="] = str(local)
    if global_batch_size is None:
        global_batch_size = -1 if local * mesh.dp == job.global_batch_size else job.global_batch_size
    lines["[training] global_batch_size ="] = str(global_batch_size)
    if mesh.pp > 1:
        lines["[parallelism] pipeline_parallel_schedule ="] = f'"{SCHEDULE_NAMES[job.schedule]}"'
        lines["[parallelism] pipeline_parallel_microbatch_size ="] = str(job.micro_batch_size)
        if layers_per_stage or job.num_chunks != (2 if job.schedule == "interleaved" else 1):
            stages, work = mesh.pp * job.num_chunks, job.config.num_layers + weights
            per_stage = -(-work // stages)
            if -(-work // per_stage) != stages:
                raise NotWritable(f"{stages} pipeline stages: no pipeline_parallel_layers_per_stage gives them")
            lines["[parallelism] pipeline_parallel_layers_per_stage ="] = str(per_stage)
    return lines


def _scan(toml: dict) -> tuple[list[str], list[str]]:
    """(unknown keys with the nearest known one, keys read that the course does not model)."""
    unknown, not_modelled = [], []
    for section, keys in toml.items():
        if not isinstance(keys, dict):
            raise ConfigError(f"{section} = {keys!r}: torchtitan's config is made of [sections] of keys")
        moved = [key for key in keys if (section, key) in MOVED]
        if moved:
            raise ConfigError(f"[{section}] {moved[0]}: where an older torchtitan kept it; today's reads "
                              f"[{MOVED[section, moved[0]]}] {moved[0]}: move it there")
        if (section, None) in NOT_MODELLED:
            if keys.get("enable_float8_linear") if section in CONVERTED else keys.get("enable", True):
                not_modelled.append(f"[{section}]: {NOT_MODELLED[section, None]}")
            continue
        if section in IGNORED_SECTIONS:
            continue
        if section not in READ and section not in NO_EFFECT:
            unknown.append(nearest(f"[{section}]", [f"[{s}]" for s in (*READ, *NO_EFFECT, *IGNORED_SECTIONS)]))
            continue
        for key, value in keys.items():
            if (section, key) in NOT_MODELLED:
                if value not in (False, None, [], "float32"):
                    not_modelled.append(f"[{section}] {key} = {value!r}: {NOT_MODELLED[section, key]}")
            elif key not in READ.get(section, set()) | NO_EFFECT.get(section, set()):
                unknown.append(nearest(f"[{section}] {key}", [f"[{s}] {k}" for s, ks in READ.items() for k in ks]))
    return unknown, not_modelled


def _text(section: dict, key: str, default: str, where: str) -> str:
    value = section.get(key, default)
    if not isinstance(value, str):
        raise ConfigError(f"[{where}] {key} = {value!r}: must be a string")
    return value


def model_config(name: str, flavour: str, seq_len: int) -> ModelConfig:
    if name not in FLAVOURS:
        raise ConfigError(f"[model] name = {name!r} is not modelled: the course reads {', '.join(FLAVOURS)} "
                          "(dense Llama models; MoE and MLA families are not the course model)")
    if flavour not in FLAVOURS[name]:
        raise ConfigError(f"[model] flavor = {flavour!r}: {name} has {', '.join(FLAVOURS[name])} here "
                          "(torchtitan's default, debugmodel, is not modelled: name the flavour)")
    dim, layers, heads, kv_heads, multiplier, multiple_of = FLAVOURS[name][flavour]
    width = int(2 * 4 * dim / 3)
    width = int(multiplier * width) if multiplier else width
    width = multiple_of * -(-width // multiple_of)
    vocab, theta = VOCAB[name]
    return ModelConfig(vocab_size=vocab, hidden=dim, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                       intermediate=width, max_seq_len=seq_len, rope_theta=theta)


def read(text: str, where: str, *, num_gpus: int | None, gpu: str, gpus_per_node: int) -> ReadConfig:
    try:
        toml = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{where}: not TOML ({error})") from None
    unknown, not_modelled = _scan(toml)
    model, training = toml.get("model", {}), toml.get("training", {})
    parallel, checkpointing = toml.get("parallelism", {}), toml.get("activation_checkpoint", {})
    seq_len = whole("[training] seq_len", training.get("seq_len", 2048))
    name, flavour = _text(model, "name", "llama3", "model"), _text(model, "flavor", "debugmodel", "model")
    config = model_config(name, flavour, seq_len)
    mesh, sharded = _mesh(parallel, num_gpus)
    dp = mesh.dp

    local = whole("[training] local_batch_size", training.get("local_batch_size", training.get("batch_size", 8)))
    micro = whole("[parallelism] pipeline_parallel_microbatch_size",
                  parallel.get("pipeline_parallel_microbatch_size", 1)) if mesh.pp > 1 else local
    if local % micro:
        raise ConfigError(f"[training] local_batch_size = {local} is not divisible by [parallelism] "
                          f"pipeline_parallel_microbatch_size = {micro}: the pipeline cuts each rank's batch into "
                          "whole micro-batches")
    global_batch = training.get("global_batch_size", -1)
    # torchtitan's default, -1 (any negative number): local_batch_size × dp
    explicit = not (isinstance(global_batch, int) and not isinstance(global_batch, bool) and global_batch < 0)
    global_batch = whole("[training] global_batch_size", global_batch) if explicit else local * dp
    if global_batch % (local * dp):
        raise ConfigError(f"[training] global_batch_size = {global_batch} is not divisible by local_batch_size "
                          f"{local} × dp {dp} = {local * dp}: gradient accumulation takes whole passes")
    passes = global_batch // (local * dp)
    conventions = []
    if passes > 1 and mesh.pp > 1:
        conventions.append(f"{passes} gradient-accumulation passes a step, each a pipeline of {local // micro} "
                           "micro-batches with its own fill and drain: the report is of one pass")
    elif passes > 1:
        conventions.append(f"{passes} gradient-accumulation passes of local_batch_size {local}: the course's "
                           f"{passes} micro-batches of {micro}")
    num_microbatches = local // micro if mesh.pp > 1 else passes

    schedule, num_chunks = _schedule(parallel, mesh, config.num_layers, conventions)
    recompute = _recompute(checkpointing, not_modelled)
    zero_stage, reshard = _sharding(mesh, sharded, conventions,
                                    _text(parallel, "fsdp_reshard_after_forward", "default", "parallelism"))
    reduce = _text(training, "mixed_precision_reduce", "float32", "training")
    if reduce != "float32":
        raise ConfigError(f"[training] mixed_precision_reduce = {reduce!r}: torchtitan takes only 'float32'")
    param = _text(training, "mixed_precision_param", "bfloat16", "training")
    if param not in ("bfloat16", "float32"):
        raise ConfigError(f"[training] mixed_precision_param = {param!r}: bfloat16 or float32")
    dtype = "bf16" if param == "bfloat16" else "fp32"
    amp_off = zero_stage != 3 and (mesh.tp > 1 or mesh.pp > 1) and dtype == "bf16"
    if amp_off:
        dtype = "fp32"       # torchtitan's maybe_enable_amp: no autocast with TP or PP unless FSDP runs
        conventions.append("TP or PP without FSDP: torchtitan turns mixed precision off, so weights and activations "
                           "are fp32 (its maybe_enable_amp) and every matmul runs at the fp32 rate; the FSDP layouts "
                           "suggested run bf16")
    if zero_stage == 3:
        conventions.append("FSDP2 keeps fp32 shards (4 + 4 + 8 bytes per parameter); counted as mixed-precision "
                           "Adam (2 + 2 + 12): the same 16 bytes per parameter, all sharded"
                           + ("; gradients reduced in fp32 (mixed_precision_reduce): the report shows both dp byte "
                              "counts, and the step time counts these" if dtype == "bf16" else ""))
    if zero_stage != 3 and mesh.dp > 1 and dtype == "bf16":
        conventions.append("DDP under autocast: torchtitan keeps fp32 parameters, so its gradients are fp32 and "
                           "reduced in fp32; counted as mixed-precision state, the step time counts the fp32 bytes")
    if mesh.cp > 1:
        conventions.append("context parallelism: ring attention's K/V traffic timed exposed (step_time's cp_overlap "
                           "= 0), an upper bound: torch's context_parallel (rotate method \"allgather\", its default) "
                           "gathers K and V once and waits for them at its second block, hiding them behind the first")
    elementwise_ops = _elementwise_ops(toml, mesh.tp, conventions)
    if mesh.pp > 1:
        conventions.append("the layers split evenly over the stages (torchtitan's default gives the first and the "
                           "last stage one layer less, for the embedding and the head)")
    job = Job(config, mesh, seq_len=seq_len, micro_batch_size=micro, num_microbatches=num_microbatches,
              zero_stage=zero_stage, recompute=recompute, schedule=schedule, num_chunks=num_chunks,
              sequence_parallel=mesh.tp > 1,    # torchtitan's TP plan shards the norms by sequence: Megatron's SP
              vocab_parallel=mesh.tp > 1 and not parallel.get("disable_loss_parallel", False), dtype=dtype,
              gpu=gpu, gpus_per_node=gpus_per_node, **reshard)
    problems = job.problems()
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    return ReadConfig("torchtitan", where, job, f"{name} {flavour}", conventions, not_modelled, unknown,
                      functools.partial(spell, global_batch_size=global_batch if explicit else None,
                                        layers_per_stage="pipeline_parallel_layers_per_stage" in parallel,
                                        weights=stage_weights(parallel)),
                      recipes_convention="mixed" if amp_off else None,   # its FSDP recipes run mixed precision
                      assumptions=dict(
                          dp_overlap=FSDP_OVERLAP,   # FSDP2's traffic half hidden, as its published runs fit
                          # fp32 reductions: FSDP2's reduce_dtype (mixed_precision_reduce, float32, the only value
                          # torchtitan takes), for this job and the FSDP layouts it suggests; its DDP's fp32 gradients
                          grad_reduce_bytes=4,
                          elementwise_ops=elementwise_ops,   # eager: rotary as torchtitan's apply_rotary_emb writes it
                          rotary="model.py" if elementwise_ops == "fused" else TORCHTITAN_ROTARY))


def _elementwise_ops(toml: dict, tp: int, conventions: list[str]) -> str:
    """How the run dispatches its memory-bound ops (kernel_times.ELEMENTWISE_OPS): fused by torch.compile's
    Inductor ([compile] enable with the model among its components; an older file's [training] compile), or one by
    one (torchtitan's default), its norms one kernel (nn.RMSNorm: torch's fused rms_norm on a GPU from torch 2.9;
    an older norm_type other than "rmsnorm", torchtitan's own class, op by op)."""
    section = toml.get("compile", {})
    enable = section.get("enable", toml.get("training", {}).get("compile", False))
    components, backend = section.get("components", ["model", "loss"]), _text(section, "backend", "inductor", "compile")
    if not isinstance(enable, bool) or not isinstance(components, list):
        raise ConfigError(f"[compile] enable = {enable!r}, components = {components!r}: a true or false, and a list "
                          '(["model", "loss"])')
    if enable and "model" in components and backend == "inductor":
        conventions.append("torch.compile: the norms, rotary, SwiGLU products and residual adds fused")
        return "fused"
    norm = _text(toml.get("model", {}), "norm_type", "", "model").lower()   # "": a current file's nn.RMSNorm
    if norm not in NORM_TYPES:
        raise ConfigError(f"[model] norm_type = {norm!r}: one of {', '.join(NORM_TYPES[1:])}")
    by_op = norm == "rmsnorm" and tp == 1     # torchtitan's own class; with TP, sequence parallelism's fused norm
    (_, eager, compiled), *_ = TORCHTITAN_H100_TPS
    why = ("no torch.compile (its default)" if not enable else f"torch.compile with backend {backend!r}"
           if backend != "inductor" else f"torch.compile of {components} only")
    conventions.append(f"{why}: SwiGLU products and residual adds op by op, timed as eager PyTorch runs the "
                       "course's model, rotary as torchtitan writes it (a complex multiply: eager_traffic.ROTARY), "
                       f"the norms ({norm or 'nn.RMSNorm, torch >= 2.9'}) "
                       + ("op by op too" if by_op else "timed as one kernel each on TP's sequence shards"
                          if norm == "rmsnorm" else "one kernel each")
                       + f" (torchtitan's own H100 benchmark ran {1 - eager / compiled:.0%} fewer tokens/s than "
                       "compiled: published.TORCHTITAN_H100)")
    return "eager" if by_op else "eager, fused norm"


def _mesh(parallel: dict, num_gpus: int | None) -> tuple[Mesh, bool]:
    """The degrees, data_parallel_shard_degree = -1 filled from the GPU count, and whether FSDP shards over
    dp_shard × cp (without it, the replicas are plain DDP's dp)."""
    degree = {name: whole(f"[parallelism] {key}", parallel.get(key, 1))
              for name, key in (("dp_replicate", "data_parallel_replicate_degree"), ("tp", "tensor_parallel_degree"),
                                ("pp", "pipeline_parallel_degree"), ("cp", "context_parallel_degree"),
                                ("ep", "expert_parallel_degree"))}
    shard = parallel.get("data_parallel_shard_degree", -1)
    others = degree["dp_replicate"] * degree["tp"] * degree["pp"] * degree["cp"]
    if shard == -1:
        if num_gpus is None:
            raise ConfigError("[parallelism] data_parallel_shard_degree = -1 takes the GPUs the other degrees "
                              "leave: give the GPU count (--gpus N)")
        if num_gpus % others:
            raise ConfigError(f"--gpus {num_gpus} is not divisible by replicate {degree['dp_replicate']} × tp "
                              f"{degree['tp']} × pp {degree['pp']} × cp {degree['cp']} = {others}: "
                              "data_parallel_shard_degree = -1 must come out whole")
        shard = num_gpus // others
    shard = whole("[parallelism] data_parallel_shard_degree", shard)
    if num_gpus is not None and shard * others != num_gpus:
        raise ConfigError(f"replicate {degree['dp_replicate']} × shard {shard} × tp {degree['tp']} × pp "
                          f"{degree['pp']} × cp {degree['cp']} = {shard * others} GPUs, not --gpus {num_gpus}: "
                          "torchtitan's degrees multiply to the world size")
    if degree["ep"] > 1:
        raise ConfigError(f"[parallelism] expert_parallel_degree = {degree['ep']}: the llama models here have no "
                          "experts (torchtitan's MoE families are not modelled)")
    if degree["tp"] > 1 and degree["cp"] > 1:
        raise ConfigError(f"[parallelism] tensor_parallel_degree = {degree['tp']} with context_parallel_degree = "
                          f"{degree['cp']}: torchtitan's TP plan shards the norms by sequence (sequence parallelism), "
                          "which the course does not combine with ring attention: not modelled")
    sharded = shard * degree["cp"] > 1
    mesh = Mesh(dp=shard * degree["dp_replicate"], tp=degree["tp"], pp=degree["pp"], cp=degree["cp"],
                dp_replicate=degree["dp_replicate"] if sharded else 1)
    return mesh, sharded


def _schedule(parallel: dict, mesh: Mesh, num_layers: int, conventions: list[str]) -> tuple[str, int]:
    """The course's schedule and chunks per rank for pipeline_parallel_schedule (and _layers_per_stage)."""
    if mesh.pp == 1:
        return "1f1b", 1
    name = _text(parallel, "pipeline_parallel_schedule", "1F1B", "parallelism")
    if name.lower() not in SCHEDULES:
        raise ConfigError(f"[parallelism] pipeline_parallel_schedule = {name!r}: the course runs "
                          f"{', '.join(SCHEDULE_NAMES.values())} (zero-bubble, looped BFS and DualPipeV are not "
                          "modelled)")
    schedule = SCHEDULES[name.lower()]
    per_stage = parallel.get("pipeline_parallel_layers_per_stage")
    if per_stage is None:
        if schedule == "interleaved":
            conventions.append("Interleaved1F1B: 2 stages per rank (torchtitan's default split of the layers)")
        return schedule, 2 if schedule == "interleaved" else 1
    # torchtitan's pipeline_parallel: ceil((layers + w) / layers_per_stage) stages, w = the first and the last
    # stage's less_layers (1 each by default: the embedding and the head); a whole number per rank, exactly 1 for
    # a one-stage schedule, 2 or more interleaved
    per_stage = whole("[parallelism] pipeline_parallel_layers_per_stage", per_stage)
    weights = stage_weights(parallel)
    stages = -(-(num_layers + weights) // per_stage)
    need = "2 or more" if schedule == "interleaved" else f"exactly 1 for {name}"
    if stages % mesh.pp or (stages // mesh.pp >= 2) != (schedule == "interleaved"):
        raise ConfigError(f"[parallelism] pipeline_parallel_layers_per_stage = {per_stage}: ceil(({num_layers} layers "
                          f"+ {weights} for the first and last stages) / {per_stage}) = {stages} "
                          f"stages over pipeline_parallel_degree {mesh.pp}; torchtitan needs a whole number per rank, "
                          f"{need}")
    return schedule, stages // mesh.pp


def stage_weights(parallel: dict) -> int:
    """The layers' worth torchtitan gives the first and the last stage's extra work (its *_stage_less_layers)."""
    return sum(whole(f"[parallelism] pipeline_parallel_{end}_stage_less_layers",
                     parallel.get(f"pipeline_parallel_{end}_stage_less_layers", 1), low=0) for end in ("first", "last"))


def _recompute(checkpointing: dict, not_modelled: list[str]) -> str:
    mode = _text(checkpointing, "mode", "selective", "activation_checkpoint")
    if mode not in ("none", "full", "selective", "memory_budget"):
        raise ConfigError(f"[activation_checkpoint] mode = {mode!r}: none, full, selective or memory_budget")
    if mode == "memory_budget":
        not_modelled.append('[activation_checkpoint] mode = "memory_budget": the compiler chooses what to save; '
                            "counted as selective recomputation")
        return "selective"
    option = str(checkpointing.get("selective_ac_option", "2"))
    if mode != "selective":
        return mode
    if option == "op":        # every second matmul rerun: the course runs the same policy (recompute.EveryOtherMatmul)
        return "op"
    if option.isdigit() and int(option) >= 1:
        if int(option) > 1:
            not_modelled.append(f'[activation_checkpoint] selective_ac_option = "{option}": one layer in {option} '
                                "recomputed whole, the others not; counted as full recomputation of every layer "
                                "(fewer activations and more recomputation than the run has)")
        return "full"
    raise ConfigError(f'[activation_checkpoint] selective_ac_option = {option!r}: "op" or a whole number of layers')


def _sharding(mesh: Mesh, sharded: bool, conventions: list[str], policy: str) -> tuple[int, dict[str, bool]]:
    """FSDP2 over dp_shard × cp (ZeRO-3, HSDP with replicas), or whole weights (DDP over replicas, or dp 1); and
    the resharding ``fsdp_reshard_after_forward`` asks for."""
    if policy not in ("default", "always", "never"):
        raise ConfigError(f"[parallelism] fsdp_reshard_after_forward = {policy!r}: default, always or never")
    if not sharded:                    # replicas alone (DDP), or one: whole weights, gradients, optimizer
        return 0, {}
    if mesh.dp_replicate > 1 and (policy == "never" or (policy == "default" and mesh.pp > 1)):
        conventions.append(f'fsdp_reshard_after_forward = "{policy}" with HSDP: counted as resharding after each '
                           "forward (the course's HSDP, hsdp.py, always reshards)")
        return 3, {}
    if policy == "always" or (policy == "default" and mesh.pp == 1):
        return 3, {}
    if mesh.pp > 1:                    # FSDP2 inside torch's pipelining: gathered and reduced once a step
        return 3, {"reshard_after_forward": False, "reshard_after_backward": False}
    return 3, {"reshard_after_forward": False}
