"""The virtual cluster: any one rank of a world of thousands, run in this process, in seconds.

    python -m course_lib.virtual --preset llama2-70b --dp 4 --tp 8 --pp 4 --rank 37 \\
        --seq-len 4096 --micro-batch-size 1 --num-microbatches 16 --zero 1 --recompute selective
    python -m course_lib.virtual --preset mixtral-8x7b --dp 4 --cp 2 --ep 8 --pp 4 --rank 5 --seq-len 32768

each prints a table (``--json``: run_rank's record, one JSON object): what rank 37 of 128 holds (training
state, the peak of its saved activations over the schedule) and what it sends (bytes and ops on each axis),
measured by running the course's own code, beside what the course's formulas say.

How. Two stand-ins make one rank of a huge world cheap, and nothing else changes:

* torch's fake process group (``backend="fake"``, torch.testing's FakeStore): every collective returns at
  once, having sent nothing; ``Comm`` still records each one with its bytes. The rank never waits for the
  others, because there are none: it runs its own part of the step alone.
* meta tensors: a shape and a dtype, no memory, no arithmetic. Llama-2-70B builds in a second.

On those, :func:`run_rank` runs the notebooks' code: ``make_comms`` (the mesh's groups), ``parallelize``
(``apply_context_parallel``, ``apply_tp``, ``apply_ep``, ``make_stage``, ZeRO's ``ZeroDataParallel`` over the
dp × cp group, or HSDP), one ``pipeline_step`` (the schedule, every micro-batch's forward and backward, the sends
and receives), the gradient reduction and the optimizer's step. It counts state with ``measure_state_bytes`` (meta storages count numel × element size),
saved activations with ``SavedActivations`` via the step's ``StepRecorder`` (what each forward saves,
held until its backward: the peak over the schedule), and bytes with ``Comm.trace``.

One thing is rerouted, and said here: on meta tensors torch picks SDPA's math path, which stores the s×s
attention scores; on CPU (and CUDA) it runs a flash kernel that stores q, k, v, the output and a
log-sum-exp. :class:`MetaFlashAttention` sends meta SDPA to the CPU flash kernel, so meta saves what a real
run saves (checked on the tiny model: every module's saved bytes equal a CPU run's).

``recompute`` runs course_lib.recompute ("selective": each attention core, "full": each block, through
torch.utils.checkpoint): the forward's saved bytes are measured as before, and what each rerun saves in
backward by recompute.RecomputeMeter; the peak is the most held plus the largest rerun. A recomputed block
reruns its TP collectives: traced. ``sequence_parallel`` runs ``apply_tp(..., sequence_parallel=True)``
(activations and the TP group's bytes measured, the all-gathers at the stack's ends and the norm-weight
all-reduces included: tensor_parallel.tp_step_traffic), and the stages pass s/tp of the sequence (Megatron-LM's
scatter/gather): measured. ``vocab_parallel`` runs apply_tp's split vocabulary (course_lib.vocab_parallel).

The axes beyond 3D (``--cp``, ``--ep``, ``--dp-replicate``; mesh.py lays them out):

* cp runs: ``parallelize`` applies ``apply_context_parallel`` (ring attention over the CP group) before TP,
  each rank takes s/cp tokens of every sequence, and ZeRO averages over the dp × cp ranks (the "dp_cp" group).
  Measured: state, activations (per_rank.context_parallel_layer_terms), the ring's bytes ("cp") and the rest.
* hybrid sharding runs (``--dp-replicate`` R > 1, ZeRO-3): hsdp.HybridShardedDataParallel shards over the
  dp/R × cp ranks of a replica and all-reduces the shards' gradients over the R replicas: all measured.
  Sequence parallelism with cp > 1 is refused: apply_tp's SP would cut the rank's slice again, and ring
  attention's positions assume it does not.
* ep runs on a mixture-of-experts preset (mixtral-8x7b), tp 1: ``expert_parallel.apply_ep`` keeps this rank's E/ep
  experts and sends tokens with all-to-all over the EP group (measured: "ep" bytes and ops, activations).
  Computed, labelled so: state_bytes and sent_bytes.dp. The experts' gradients are averaged over the expert_dp
  group (dp·cp/ep ranks) and everything else over dp_cp, and ZeroDataParallel averages over one group, so the
  step runs no data-parallel wrapper (``Parallelism(data_parallel=False)``); per_rank's
  data_parallel_state_bytes and data_parallel_bytes_per_step, each part over its own group, stand in. The course's MoE layer has no activation formula (formulas says None), and no TP split
  (apply_tp splits a dense MLP): a MoE model runs with tp 1.

An exception to the course's rule that ``launch`` makes the one process group: the fake group exists only
inside :func:`fake_world`, in this process, and is destroyed on the way out; nothing real is ever connected.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from .ledger import CONVENTIONS, RECOMPUTE, check_zero_stage
from .measure import measure_state_bytes
from .mesh import Mesh, make_comms
from .model import PRESETS, RMSNorm, build, preset
from .parallelize import Parallelism, parallelize
from .per_rank import (
    activation_bytes_per_rank,
    data_parallel_bytes_per_step,
    data_parallel_state_bytes,
    microbatches_in_flight,
    sent_bytes_per_rank,
)
from .pipeline_parallel import StepRecorder, stage_chunks
from .recompute import RecomputeMeter
from .runtime.arguments import MAX_VIRTUAL_MICROBATCHES, MAX_VIRTUAL_WORLD, integer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """A fake default process group of ``world_size`` ranks in which this process is ``rank``. "meta:fake"
    lets point-to-point batches (Comm.exchange) carry meta tensors, which plain "fake" refuses."""
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process: run the virtual cluster outside a "
                           "distributed run (it makes its own fake group)")
    dist.init_process_group(backend="cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size)
    # torch 2.13 gives a group of two device backends no default one, and warns (on stderr, from C++) when it
    # is destroyed; the fake backend is a plugin: say so.
    dist.group.WORLD._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    try:
        yield
    finally:
        dist.destroy_process_group()


class MetaFlashAttention(TorchFunctionMode):
    """Inside this mode, SDPA on meta tensors runs the CPU flash kernel's meta version (the kernel a CPU
    run uses), so that autograd saves q, k, v, the output and the log-sum-exp, not the s×s scores."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].is_meta:
            query, key, value = args[:3]
            if kwargs.get("attn_mask") is not None or kwargs.get("dropout_p", 0.0):
                raise ValueError("MetaFlashAttention covers the course model's SDPA: causal, no mask, no dropout")
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, 0.0, kwargs.get("is_causal", False), scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


def check_workload(config, mesh: Mesh, *, seq_len: int, micro_batch_size: int, num_microbatches: int,
                   zero_stage: int, recompute: str, schedule: str, sequence_parallel: bool, dtype,
                   vocab_parallel: bool = False, num_chunks: int = 1) -> Parallelism:
    """The errors a real run would raise, before any group is made: parallelize's own checks (the mesh's, the
    schedule's, the same messages), ZeRO's, and the model's limit on the sequence. Returns parallelize's options."""
    check_zero_stage(zero_stage)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: choose one of {', '.join(RECOMPUTE)}")
    options = Parallelism(zero_stage=zero_stage, sequence_parallel=sequence_parallel, schedule=schedule,
                          num_chunks=num_chunks,
                          num_microbatches=num_microbatches, data_parallel=mesh.ep == 1,
                          activation_checkpointing=None if recompute == "none" else recompute,
                          vocab_parallel=vocab_parallel)
    options.check(config, mesh, batch_size=mesh.dp * micro_batch_size * num_microbatches, seq_len=seq_len)
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size!r} must be a whole number >= 1")
    if not 1 <= seq_len <= config.max_seq_len:
        raise ValueError(f"sequence length {seq_len} must be between 1 and max_seq_len={config.max_seq_len}")
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype={dtype}: one of {', '.join(map(str, DTYPES.values()))}")
    if config.num_experts and recompute == "full":
        raise ValueError("recompute='full' with a mixture of experts: not run here, the course has no activation "
                         "formula for its MoE layer to check a rerun's bytes against")
    return options


def run_rank(config, mesh: Mesh, rank: int, *, seq_len: int, micro_batch_size: int = 1,
             num_microbatches: int = 1, zero_stage: int = 1, recompute: str = "selective",
             sequence_parallel: bool = False, schedule: str = "1f1b", dtype=torch.bfloat16,
             vocab_parallel: bool = False, fused_norm: bool = True, num_chunks: int = 1) -> dict:
    """One training step of ``rank`` of ``mesh``, virtually: what it holds and what it sends (module docstring).

    Each dp rank takes micro_batch_size × num_microbatches sequences of seq_len tokens (its s/cp of each, when
    cp > 1); the optimizer is ZeroDataParallel's MixedPrecisionAdam (12 bytes of state per parameter it owns),
    torch's Adam for fp32 weights (8 bytes: :func:`_optimizer`; its 4-byte step per tensor is not in total).
    Returns a dict that json.dumps can print: rank, world_size, coords, layers (this stage's [first, last + 1)), state_bytes,
    activation_bytes_peak, activation_bytes_per_microbatch, microbatches_in_flight, sent_bytes, ops (per axis,
    per op: counts; "cp" and "ep" when those degrees are > 1), measured / computed (which numbers are which),
    formulas (the same numbers from the course's formulas, see :func:`formulas`), seconds.
    """
    start = time.perf_counter()
    workload = dict(seq_len=seq_len, micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
                    zero_stage=zero_stage, recompute=recompute, sequence_parallel=sequence_parallel,
                    schedule=schedule, dtype=dtype, vocab_parallel=vocab_parallel, num_chunks=num_chunks)
    options = check_workload(config, mesh, **workload)
    workload["fused_norm"] = fused_norm
    coords = mesh.coords(rank)
    # The batch's token ids stay on the host, as in a GPU run: pipeline_step copies each micro-batch to the
    # model's device (here meta), so each one saves its own ids, not a view of the whole batch's. With cp > 1
    # these are this rank's s/cp tokens of each sequence (all zeros: any slice is the same).
    tokens = torch.zeros(micro_batch_size * num_microbatches, seq_len // mesh.cp, dtype=torch.long)
    axes = ("tp", "pp", "dp") + ("cp",) * (mesh.cp > 1) + ("ep",) * (mesh.ep > 1)
    with fake_world(mesh.size, rank):
        comms = make_comms(mesh, rank)
        model = build(config, device="meta", dtype=dtype)
        for norm in (module for module in model.modules() if isinstance(module, RMSNorm)):
            norm.fused = fused_norm       # False: F.rms_norm, as the CPU runs it (model.RMSNorm)
        parallel = parallelize(model, mesh, comms, rank, options, optimizer_kwargs=_optimizer(dtype))
        stage, data_parallel = parallel.stage, parallel.data_parallel
        recorder = StepRecorder(stage, measure_memory=True)
        traced = {**comms, "dp": comms["dp_cp"]}    # gradients are averaged over the dp × cp ranks
        with contextlib.ExitStack() as traces:
            logs = {axis: traces.enter_context(traced[axis].trace()) for axis in axes}
            if mesh.dp_replicate > 1:                # HSDP: ZeRO-3 over the replica, all-reduce over replicas
                logs["dp"] = traces.enter_context(comms["dp_shard_cp"].trace())
                replicas = traces.enter_context(comms["dp_replicate"].trace())
            with MetaFlashAttention(), RecomputeMeter(stage) as rerun:   # one gradient reduction, after the schedule
                parallel.forward_backward(tokens, tokens, recorder=recorder)
            if data_parallel:
                data_parallel.step()
                state = measure_state_bytes(data_parallel, data_parallel.optimizer)
                state["total"] -= state["step_counters"]   # torch Adam's step per tensor: not per parameter
        if mesh.dp_replicate > 1:                    # the replicas' all-reduce is data-parallel traffic too
            logs["dp"].records.extend(replicas.records)
    held = [[i for i, layer in enumerate(chunk.layers) if not isinstance(layer, torch.nn.Identity)]
            for chunk in stage_chunks(stage)]
    layers = [[chunk[0], chunk[-1] + 1] for chunk in held]
    # recorder.in_flight: (time, micro-batches held, their saved bytes) after every op (recorder.events', in
    # order): a forward's own bytes are what it added. One micro-batch's are micro-batch 0's, over its chunks.
    after_ops = zip(recorder.events, recorder.in_flight, recorder.in_flight[1:])
    per_microbatch = sum(now[2] - before[2] for event, before, now in after_ops
                         if event.kind == "F" and event.microbatch == 0)
    result = {
        "rank": rank, "world_size": mesh.size, "coords": {axis: coords[axis] for axis in ("dp", "tp", "pp")},
        "layers": layers[0] if num_chunks == 1 else layers,       # v > 1: each chunk's [first, last + 1)
        "state_bytes": ({part: state[part] for part in ("weights", "grads", "optimizer", "total")}
                        if data_parallel else None),
        # the most held at once (at a backward's start), and the largest rerun that backward holds beside it
        "activation_bytes_peak": max(nbytes for _, _, nbytes in recorder.in_flight) + rerun.peak,
        "activation_bytes_per_microbatch": per_microbatch,
        "microbatches_in_flight": max(count for _, count, _ in recorder.in_flight),
        "sent_bytes": {axis: log.wire_bytes for axis, log in logs.items()},
        "ops": {axis: _ops(log) for axis, log in logs.items()},
        "measured": ["state_bytes", "activation_bytes_peak", "sent_bytes", "ops"],
        "computed": [],
        "formulas": formulas(config, mesh, rank, **workload),
    }
    result["coords"].update({axis: coords[axis] for axis in ("cp", "ep", "dp_replicate", "dp_shard") if axis in coords})
    computed_sends = []
    if data_parallel is None:  # ep > 1: no data-parallel wrapper ran (module docstring)
        result["state_bytes"] = result["formulas"]["state_bytes"]
        result["measured"].remove("state_bytes")
        result["computed"].insert(0, "state_bytes")
        computed_sends.append("dp")
    if computed_sends:
        for axis in computed_sends:
            result["sent_bytes"][axis] = result["formulas"]["sent_bytes"][axis]
            result["computed"].append(f"sent_bytes.{axis}")
        result["measured"][result["measured"].index("sent_bytes")] = ", ".join(
            f"sent_bytes.{axis}" for axis in axes if axis not in computed_sends)
    result["seconds"] = time.perf_counter() - start
    return result


def _convention(dtype) -> str:
    """The state convention a run with weights of ``dtype`` keeps (ledger.CONVENTIONS): "mixed" for 16-bit
    weights (MixedPrecisionAdam: an fp32 master copy, m and v, 12 bytes per parameter), "fp32" for fp32 weights
    (torch's own Adam: m and v, 8 bytes, no master copy: the weight is one already)."""
    return "fp32" if dtype == torch.float32 else "mixed"


def _optimizer(dtype) -> dict:
    """ZeroDataParallel's optimizer for weights of ``dtype`` (:func:`_convention`)."""
    return {"optimizer_class": torch.optim.Adam} if _convention(dtype) == "fp32" else {}


def _ops(log) -> dict[str, int]:
    """How many collectives of each op a trace holds. One over a group of one rank (ZeRO's over dp 1) sends
    nothing and is left out: an axis of one rank lists no ops."""
    return dict(Counter(record.op for record in log.records if record.group_size > 1))


def formulas(config, mesh: Mesh, rank: int, *, seq_len: int, micro_batch_size: int = 1, num_microbatches: int = 1,
             zero_stage: int = 1, recompute: str = "selective", sequence_parallel: bool = False,
             schedule: str = "1f1b", dtype=torch.bfloat16, vocab_parallel: bool = False,
             fused_norm: bool = True, num_chunks: int = 1) -> dict:
    """What the course's formulas say ``rank`` holds and sends, for :func:`run_rank`'s numbers to be read
    beside, all from course_lib.per_rank: data_parallel_state_bytes (e bytes per weight and gradient, 12 of
    optimizer state, 8 in fp32: :func:`_optimizer`), activation_bytes_per_rank, sent_bytes_per_rank (tp, pp, cp,
    ep) and
    data_parallel_bytes_per_step ("dp", one micro-step per micro-batch; "dp_ops": by op). These count no
    padding: ZeroDataParallel pads each unit (embedding, each layer, final norm, head) to a multiple of its
    group, so where the group does not divide a unit the run holds and sends a little more: fewer than dp
    parameters per unit (zero.padded_num_params counts them exactly). ZeRO shards over the dp × cp ranks that
    hold the same weights (HSDP: the dp/R × cp of a replica), a mixture's experts over their dp·cp/ep
    (expert_dp): each part's state and bytes over its own group, added. A mixture of experts' activations have no
    formula: None. (``num_chunks`` v > 1: the in-flight count is of chunk-micro-batches,
    per_rank.microbatches_in_flight.)"""
    stage = mesh.coords(rank)["pp"]
    e = torch.tensor([], dtype=dtype).element_size()
    if config.num_experts:
        activations = {"peak": None, "per_microbatch": None,
                       "in_flight": microbatches_in_flight(mesh, stage, num_microbatches, schedule, num_chunks)}
    else:
        activations = activation_bytes_per_rank(config, mesh, stage, micro_batch_size=micro_batch_size,
                                                seq_len=seq_len, num_microbatches=num_microbatches,
                                                schedule=schedule, dtype=dtype, recompute=recompute,
                                                sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel,
                                                fused_norm=fused_norm, num_chunks=num_chunks)
    sent = sent_bytes_per_rank(config, mesh, stage, batch_size=mesh.dp * micro_batch_size * num_microbatches,
                               seq_len=seq_len, num_microbatches=num_microbatches, bytes_per_element=e,
                               sequence_parallel=sequence_parallel, zero_stage=zero_stage, num_chunks=num_chunks,
                               recompute=recompute, vocab_parallel=vocab_parallel)
    dp_ops = data_parallel_bytes_per_step(config, mesh, stage, zero_stage, grad_bytes=e,
                                          accumulation_steps=num_microbatches, num_chunks=num_chunks,
                                          vocab_parallel=vocab_parallel)
    adam = CONVENTIONS[_convention(dtype)].optimizer_bytes
    state = data_parallel_state_bytes(config, mesh, stage, zero_stage, weight_bytes=e, grad_bytes=e,
                                      optimizer_bytes=adam, num_chunks=num_chunks, vocab_parallel=vocab_parallel)
    return {"state_bytes": state, "activation_bytes_peak": activations["peak"],
            "activation_bytes_per_microbatch": activations["per_microbatch"],
            "microbatches_in_flight": activations["in_flight"], "sent_bytes": sent, "dp_ops": dp_ops}


# ------------------------------------------------------------------------------------------ command line

def _number(nbytes, unit: int) -> str:
    """Bytes in ``unit`` (2**30: GiB, 10**9: GB), four significant digits; "-" where there is no number."""
    return "-" if nbytes is None else f"{nbytes / unit:.4g}"


def format_result(result: dict) -> str:
    """run_rank's record as a table: state and activations in GiB (2**30 bytes), bytes sent per step in GB
    (10**9, as links are rated), each beside the formula's number and marked measured or computed."""
    formula, computed = result["formulas"], set(result["computed"])
    coords = ", ".join(f"{axis} {index}" for axis, index in result["coords"].items())
    spans = result["layers"] if isinstance(result["layers"][0], list) else [result["layers"]]
    lines = [f"rank {result['rank']} of {result['world_size']} ({coords}): layers "
             + " and ".join(f"[{first}, {end})" for first, end in spans) + " (first included, end excluded)",
             f"{'':30}{'this run':>12}{'formula':>12}"]

    def row(label, run, expected, unit, source):
        lines.append(f"  {label:<28}{_number(run, unit):>12}{_number(expected, unit):>12}  {source}".rstrip())

    how = "computed" if "state_bytes" in computed else "measured"
    lines.append("state, GiB")
    for part in ("weights", "grads", "optimizer", "total"):
        row(part, result["state_bytes"][part], formula["state_bytes"][part], 2**30, how)
    lines.append("activations, GiB")
    row("per micro-batch", result["activation_bytes_per_microbatch"], formula["activation_bytes_per_microbatch"],
        2**30, "measured")
    row("in flight (micro-batches)", result["microbatches_in_flight"], formula["microbatches_in_flight"], 1, "measured")
    row("peak", result["activation_bytes_peak"], formula["activation_bytes_peak"], 2**30, "measured")
    lines.append("sent per step, GB")
    for axis, sent in result["sent_bytes"].items():
        ops = ", ".join(f"{op} x {count}" for op, count in result["ops"].get(axis, {}).items()) or "no ops"
        source = "computed" if f"sent_bytes.{axis}" in computed else f"measured: {ops}"
        row(axis, sent, formula["sent_bytes"].get(axis), 10**9, source)
    lines.append(f"ran in {result['seconds']:.1f} s on a fake process group with meta tensors; formulas: "
                 "course_lib.per_rank (no ZeRO padding)")
    return "\n".join(lines)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks; adds "(default: ...)" where the default is a value (a default of
    None or a flag's False: the help line says what happens)."""

    def _get_help_string(self, action):
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.virtual", formatter_class=_HelpFormatter,
                                     description=__doc__[:__doc__.index("How.")].rstrip())
    parser.add_argument("--preset", default="llama2-70b", choices=sorted(PRESETS),
                        help=f"the model: one of course_lib.model.PRESETS, {', '.join(sorted(PRESETS))}")
    ranks = integer(1, MAX_VIRTUAL_WORLD)   # course_lib.runtime.arguments: a bad value is one line, exit code 2
    parser.add_argument("--world-size", type=ranks,
                        help="all the ranks (default: the product of the degrees); dp = world / (cp × tp × pp) "
                             "if --dp is not given")
    parser.add_argument("--dp", type=ranks, help="data-parallel degree (default: from --world-size, else 1)")
    parser.add_argument("--tp", type=ranks, default=1, help="tensor-parallel degree")
    parser.add_argument("--pp", type=ranks, default=1, help="pipeline stages")
    parser.add_argument("--cp", type=ranks, default=1, help="context parallelism: ring attention over s/cp tokens")
    parser.add_argument("--ep", type=ranks, default=1, help="expert parallelism (a MoE preset): out of dp × cp")
    parser.add_argument("--dp-replicate", type=ranks, default=1,
                        help="hybrid sharding (HSDP, with --zero 3): dp_replicate replicas of dp / dp_replicate ranks")
    parser.add_argument("--rank", type=integer(0, MAX_VIRTUAL_WORLD - 1), default=0, help="the rank to run")
    parser.add_argument("--seq-len", type=integer(1),
                        help="tokens per sequence (default: the preset's max_seq_len)")
    parser.add_argument("--micro-batch-size", type=integer(1), default=1, help="sequences per micro-batch")
    parser.add_argument("--num-microbatches", type=integer(1, MAX_VIRTUAL_MICROBATCHES), default=1,
                        help=f"micro-batches per step, at most {MAX_VIRTUAL_MICROBATCHES} (each is traced: "
                             "~0.06 s for a 70B stack)")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=1,
                        help="ZeRO stage over the dp group: 0 (plain DDP), 1, 2, 3")
    parser.add_argument("--recompute", default="selective", choices=RECOMPUTE,
                        help="activation recomputation: none, selective (each attention core), full (each block)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="Megatron's sequence parallelism with TP (off unless given)")
    parser.add_argument("--vocab-parallel", action="store_true",
                        help="split the embedding, head and loss by vocabulary over TP (off unless given)")
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved", "zb-h1"),
                        help="the pipeline schedule (course_lib.schedules); interleaved needs --num-chunks >= 2")
    parser.add_argument("--num-chunks", type=integer(1), default=1,
                        help="layer chunks per stage, v (--schedule interleaved)")
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES),
                        help="weights and gradients: bf16/fp16 with MixedPrecisionAdam (fp32 master, m, v: "
                             "12 bytes), fp32 with torch's Adam (m, v: 8 bytes)")
    parser.add_argument("--json", action="store_true",
                        help="print run_rank's record as JSON instead of the table (off unless given)")
    args = parser.parse_args(argv)
    if args.schedule == "interleaved" and args.num_chunks < 2:
        parser.error(f"--schedule interleaved with --num-chunks {args.num_chunks}: give each stage v >= 2 chunks "
                     "of layers (v = 1 is 1F1B)")
    size = (args.dp or 1) * args.tp * args.pp * args.cp * (args.dp_replicate if args.dp is None else 1)
    if size > MAX_VIRTUAL_WORLD:   # each degree is in range, their product need not be
        parser.error(f"dp × tp × pp × cp = {size:,} ranks: more than the {MAX_VIRTUAL_WORLD:,} a virtual world "
                     "may have (course_lib.runtime.arguments.MAX_VIRTUAL_WORLD)")
    try:
        config = preset(args.preset)
        if args.dp is None:
            mesh = Mesh.for_world(args.world_size or args.cp * args.tp * args.pp * args.dp_replicate, tp=args.tp,
                                  pp=args.pp, cp=args.cp, ep=args.ep, dp_replicate=args.dp_replicate)
        else:
            mesh = Mesh(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, dp_replicate=args.dp_replicate)
            if args.world_size is not None:
                mesh.check(args.world_size)
        result = run_rank(config, mesh, args.rank, seq_len=args.seq_len or config.max_seq_len,
                          micro_batch_size=args.micro_batch_size,
                          num_microbatches=args.num_microbatches, zero_stage=args.zero, recompute=args.recompute,
                          sequence_parallel=args.sequence_parallel, schedule=args.schedule,
                          num_chunks=args.num_chunks,
                          dtype=DTYPES[args.dtype], vocab_parallel=args.vocab_parallel)
    except ValueError as error:          # the run's own one-line errors, as a real run would raise them
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else format_result(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
