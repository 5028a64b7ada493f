"""The virtual cluster: any one rank of a world of thousands, run in this process, in seconds.

    python -m course_lib.virtual --preset llama2-70b --dp 4 --tp 8 --pp 4 --rank 37 \\
        --seq-len 4096 --micro-batch-size 1 --num-microbatches 16 --zero-stage 1 --recompute selective
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
dp × cp group, or HSDP), one ``pipeline_step`` (the schedule, every micro-batch's forward and backward, the
sends and receives), the gradient reduction and the optimizer's step. It counts state with
``measure_state_bytes`` (meta storages count numel × element size), saved activations with
``SavedActivations`` via the step's ``StepRecorder`` (each forward's, held until its backward: the peak over
the schedule), and bytes with ``Comm.trace``.

One thing is rerouted, and said here: on meta tensors torch picks SDPA's math path, which stores the s×s
attention scores; on CPU (and CUDA) it runs a flash kernel that stores q, k, v, the output and a
log-sum-exp. :class:`MetaFlashAttention` sends meta SDPA to the CPU flash kernel, so meta saves what a real
run saves (checked on the tiny model: every module's saved bytes equal a CPU run's).

``recompute`` runs course_lib.recompute ("selective": each attention core, "full": each block, "op": each block
keeping every second matmul's output, through torch.utils.checkpoint): the forward's saved bytes are measured
as before (with what "op" keeps in the checkpoint, recompute.kept_during), and what each rerun saves in
backward by recompute.RecomputeMeter; the peak is the most held plus the largest rerun. A recomputed block
reruns its TP collectives: traced. ``sequence_parallel`` runs ``apply_tp(..., sequence_parallel=True)``
(activations and the TP group's bytes measured, the all-gathers at the stack's ends and the norm-weight
all-reduces included: tensor_parallel.tp_step_traffic), and the stages pass s/tp of the sequence (Megatron-LM's
scatter/gather): measured. ``vocab_parallel`` runs apply_tp's split vocabulary (course_lib.vocab_parallel).

The axes beyond 3D (``--cp``, ``--ep``, ``--dp-replicate``; mesh.py lays them out). cp: ring attention over
the CP group on s/cp tokens of every sequence, ZeRO over the dp × cp ranks ("dp_cp"), all measured (activations:
per_rank.context_parallel_layer_terms). Hybrid sharding (R > 1, ZeRO-3): hsdp.HybridShardedDataParallel, ZeRO-3
over a replica's dp/R × cp ranks, the gradients all-reduced over the R replicas, all measured. ep (a MoE preset,
tp 1: its layer has no TP split): ``expert_parallel.apply_ep`` keeps this rank's E/ep experts and sends tokens by
all-to-all (measured); the experts average over expert_dp and the rest over dp_cp, which no one wrapper does, so
the step runs none (Job's data_parallel=False) and state_bytes and sent_bytes.dp are per_rank's, labelled
computed. A MoE layer has no activation formula (formulas says None).

An exception to the course's rule that ``launch`` makes the one process group: the fake group exists only
inside :func:`fake_world`, in this process, and is destroyed on the way out; nothing real is ever connected.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from .hardware import GPUS
from .job import Job
from .ledger import RECOMPUTE
from .measure import measure_state_bytes
from .mesh import Mesh, make_comms
from .model import PRESETS, RMSNorm, build, preset
from .parallelize import parallelize
from .per_rank import (
    activation_bytes_per_rank,
    data_parallel_bytes_per_step,
    data_parallel_state_bytes,
    microbatches_in_flight,
    sent_bytes_per_rank,
    transient_bytes_per_rank,
)
from .pipeline_parallel import StepRecorder, stage_chunks
from .recompute import RecomputeMeter
from .runtime.arguments import MAX_VIRTUAL_MICROBATCHES, MAX_VIRTUAL_WORLD, integer
from .virtual_table import format_result


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


def check_job(job: Job) -> Job:
    """The errors a real run would raise, before any group is made: the job's own rules (Job.problems, the
    messages parallelize raises), and what the virtual cluster cannot run. Returns the job."""
    job.check()
    if job.config.num_experts and job.recompute == "full":
        raise ValueError("recompute='full' with a mixture of experts: not run here, the course has no activation "
                         "formula for its MoE layer to check a rerun's bytes against")
    if job.zero_stage is None and job.data_parallel:
        raise ValueError("zero_stage=None: the virtual cluster's step runs ZeroDataParallel (its optimizer "
                         "included); give zero_stage 0 for plain data parallelism")
    if job.dtype == "fp64":
        raise ValueError("dtype='fp64': the virtual cluster runs the dtypes of a GPU run (bf16, fp16, fp32)")
    return job


def run_rank(job: Job, rank: int) -> dict:
    """One training step of ``rank`` of ``job.mesh``, virtually: what it holds and what it sends (module docstring).

    Each dp rank takes job.micro_batch_size × job.num_microbatches sequences of job.seq_len tokens (its s/cp of
    each, when cp > 1); the optimizer is ZeroDataParallel's MixedPrecisionAdam (12 bytes of state per parameter it
    owns), torch's Adam for fp32 weights (8 bytes: :func:`_optimizer`; its 4-byte step per tensor is not in total).
    Returns a dict that json.dumps can print: rank, world_size, coords, layers (this stage's [first, last + 1)),
    state_bytes, activation_bytes_peak, activation_bytes_per_microbatch, microbatches_in_flight, sent_bytes, ops
    (per axis, per op: counts; "cp" and "ep" when those degrees are > 1), measured / computed, formulas
    (:func:`formulas`: the same numbers, and ZeRO-2/3's transient_bytes, which meta tensors cannot show:
    tests/test_zero_reshard.py measures them), seconds."""
    start = time.perf_counter()
    job = check_job(job.replace(data_parallel=job.mesh.ep == 1))   # ep > 1: no wrapper averages two groups
    job.stage_of(rank)                  # a rank outside the mesh: the mesh's one-line error, before any group
    with fake_world(job.mesh.size, rank):
        step = _run_step(job, rank)
    result = {**_header(job, rank, step["stage"]), **_measured(step), "formulas": formulas(job, rank)}
    if step["data_parallel"] is None:   # ep > 1: no data-parallel wrapper ran (module docstring)
        _use_formulas(result, ("state_bytes", "sent_bytes.dp"))
    result["seconds"] = time.perf_counter() - start
    return result


def _run_step(job: Job, rank: int) -> dict:
    """Build this rank's piece with ``parallelize``, run one step (schedule, gradient reduction, optimizer) under
    the traces and meters, inside a fake world. Returns what was measured, with the stage and its wrapper."""
    mesh = job.mesh
    # The batch's token ids stay on the host, as in a GPU run: pipeline_step copies each micro-batch to the
    # model's device (here meta), so each one saves its own ids, not a view of the whole batch's. With cp > 1
    # these are this rank's s/cp tokens of each sequence (all zeros: any slice is the same).
    tokens = torch.zeros(job.micro_batch_size * job.num_microbatches, job.tokens_per_sequence // mesh.cp,
                         dtype=torch.long)
    axes = ("tp", "pp", "dp") + ("cp",) * (mesh.cp > 1) + ("ep",) * (mesh.ep > 1)
    comms = make_comms(mesh, rank)
    model = build(job.config, device="meta", dtype=job.torch_dtype)
    for norm in (module for module in model.modules() if isinstance(module, RMSNorm)):
        norm.fused = job.fused_norm       # False: F.rms_norm, as the CPU runs it (model.RMSNorm)
    parallel = parallelize(model, job, comms, rank, optimizer_kwargs=_optimizer(job))
    stage, data_parallel = parallel.stage, parallel.data_parallel
    recorder = StepRecorder(stage, measure_memory=True)
    traced = {**comms, "dp": comms["dp_cp"]}    # gradients are averaged over the dp × cp ranks
    state = None
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
    return {"stage": stage, "data_parallel": data_parallel, "recorder": recorder, "rerun": rerun.peak,
            "state": state, "logs": logs}


def _header(job: Job, rank: int, stage) -> dict:
    """Who this rank is: its place in the mesh, the layers it holds (each chunk's [first, last + 1))."""
    coords = job.mesh.coords(rank)
    held = [[i for i, layer in enumerate(chunk.layers) if not isinstance(layer, torch.nn.Identity)]
            for chunk in stage_chunks(stage)]
    layers = [[chunk[0], chunk[-1] + 1] for chunk in held]
    where = {axis: coords[axis] for axis in ("dp", "tp", "pp")}
    where.update({axis: coords[axis] for axis in ("cp", "ep", "dp_replicate", "dp_shard") if axis in coords})
    return {"rank": rank, "world_size": job.mesh.size, "coords": where,
            "layers": layers[0] if job.num_chunks == 1 else layers}


def _measured(step: dict) -> dict:
    """The numbers one step measured: state, activations over the schedule, bytes sent."""
    recorder, state = step["recorder"], step["state"]
    # recorder.in_flight: (time, micro-batches held, their saved bytes) after every op (recorder.events', in
    # order): a forward's own bytes are what it added. One micro-batch's are micro-batch 0's, over its chunks.
    after_ops = zip(recorder.events, recorder.in_flight, recorder.in_flight[1:])
    per_microbatch = sum(now[2] - before[2] for event, before, now in after_ops
                         if event.kind == "F" and event.microbatch == 0)
    return {
        "state_bytes": ({part: state[part] for part in ("weights", "grads", "optimizer", "total")}
                        if state is not None else None),
        # the most held at once (at a backward's start), and the largest rerun that backward holds beside it
        "activation_bytes_peak": max(nbytes for _, _, nbytes in recorder.in_flight) + step["rerun"],
        "activation_bytes_per_microbatch": per_microbatch,
        "microbatches_in_flight": max(count for _, count, _ in recorder.in_flight),
        "sent_bytes": {axis: log.wire_bytes for axis, log in step["logs"].items()},
        "ops": {axis: _ops(log) for axis, log in step["logs"].items()},
        "measured": ["state_bytes", "activation_bytes_peak", "sent_bytes", "ops"],
        "computed": [],
    }


def _use_formulas(result: dict, names) -> None:
    """Where no wrapper ran, the formula's number stands in, labelled computed ("sent_bytes.AXIS": one axis)."""
    for name in names:
        if name.startswith("sent_bytes."):
            axis = name.split(".")[1]
            result["sent_bytes"][axis] = result["formulas"]["sent_bytes"][axis]
            result["measured"][result["measured"].index("sent_bytes")] = ", ".join(
                f"sent_bytes.{a}" for a in result["sent_bytes"] if a != axis)
        else:
            result[name] = result["formulas"][name]
            result["measured"].remove(name)
        result["computed"].append(name)


def _optimizer(job: Job) -> dict:
    """ZeroDataParallel's optimizer for ``job``'s state convention: MixedPrecisionAdam (fp32 master, m, v: 12
    bytes per parameter) for 16-bit weights, torch's Adam (m, v: 8 bytes; the weight is its own master) for fp32."""
    return {"optimizer_class": torch.optim.Adam} if job.state_convention == "fp32" else {}


def _ops(log) -> dict[str, int]:
    """How many collectives of each op a trace holds. One over a group of one rank (ZeRO's over dp 1) sends
    nothing and is left out: an axis of one rank lists no ops."""
    return dict(Counter(record.op for record in log.records if record.group_size > 1))


def formulas(job: Job, rank: int) -> dict:
    """What course_lib.per_rank's formulas say ``rank`` holds and sends, beside :func:`run_rank`'s numbers:
    data_parallel_state_bytes (e bytes per weight and gradient, 12 of optimizer state, 8 in fp32),
    transient_bytes_per_rank, activation_bytes_per_rank, sent_bytes_per_rank (tp, pp, cp, ep) and
    data_parallel_bytes_per_step ("dp"; "dp_ops": by op). No padding: ZeroDataParallel pads each unit to a
    multiple of its group, fewer than dp parameters more (zero.padded_num_params). ZeRO shards over the dp × cp
    ranks that hold the same weights (HSDP: a replica's dp/R × cp), experts over their expert_dp: each part over
    its own group, added. A mixture of experts' activations have no formula: None. (v > 1: the in-flight count
    is of chunk-micro-batches, per_rank.microbatches_in_flight.)"""
    stage = job.stage_of(rank)
    if job.config.num_experts:
        activations = {"peak": None, "per_microbatch": None,
                       "in_flight": microbatches_in_flight(job.mesh, stage, job.num_microbatches, job.schedule,
                                                           job.num_chunks)}
    else:
        activations = activation_bytes_per_rank(job, stage)
    return {"state_bytes": data_parallel_state_bytes(job, stage),
            "transient_bytes": transient_bytes_per_rank(job, stage),
            "activation_bytes_peak": activations["peak"],
            "activation_bytes_per_microbatch": activations["per_microbatch"],
            "microbatches_in_flight": activations["in_flight"], "sent_bytes": sent_bytes_per_rank(job, stage),
            "dp_ops": data_parallel_bytes_per_step(job, stage)}


# ------------------------------------------------------------------------------------------ command line

class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks; adds "(default: ...)" where the default is a value, or a switch's."""

    def _get_help_string(self, action):
        flag = action.default is False and not isinstance(action, argparse.BooleanOptionalAction)
        return action.help if action.default is None or flag else super()._get_help_string(action)


# Each on/off field of Job is a --name / --no-name switch (a new field at once); the help lines of the known ones:
SWITCH_HELP = {
    "sequence_parallel": "Megatron's sequence parallelism with TP",
    "vocab_parallel": "split the embedding, head and loss by vocabulary over TP",
    "reshard_after_forward": "ZeRO-3 frees each unit's gathered weights after its forward (FSDP2's default); "
                             "--no-reshard-after-forward keeps them until its backward: half the all-gathers",
    "reshard_after_backward": "--no-reshard-after-backward too: gather and reduce once a step (torch's pipelining)",
    "fused_norm": "count RMSNorm as a fused GPU kernel saves it (--no-fused-norm: as F.rms_norm on the CPU)",
}
NOT_SWITCHES = {"data_parallel"}     # set by the virtual cluster itself (run_rank)
OPTIONS = ("micro_batch_size", "num_microbatches", "zero_stage", "recompute", "schedule", "num_chunks", "dtype")


def _switches() -> list[str]:
    return [f.name for f in dataclasses.fields(Job) if f.type in ("bool", bool) and f.name not in NOT_SWITCHES]


def _add_switches(parser: argparse.ArgumentParser) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(Job)}
    for name in _switches():
        parser.add_argument(f"--{name.replace('_', '-')}", action=argparse.BooleanOptionalAction,
                            default=defaults[name], help=SWITCH_HELP.get(name, f"the job's {name} option"))


def _parser() -> argparse.ArgumentParser:
    """The command line: the model, the mesh, the rank, and the job's options under their own names."""
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
                        help="hybrid sharding (HSDP, --zero-stage 3): dp_replicate replicas of dp/dp_replicate ranks")
    parser.add_argument("--rank", type=integer(0, MAX_VIRTUAL_WORLD - 1), default=0, help="the rank to run")
    parser.add_argument("--seq-len", type=integer(1),
                        help="tokens per sequence (default: the preset's max_seq_len)")
    parser.add_argument("--micro-batch-size", type=integer(1), default=1, help="sequences per micro-batch")
    parser.add_argument("--num-microbatches", type=integer(1, MAX_VIRTUAL_MICROBATCHES), default=1,
                        help=f"micro-batches per step, at most {MAX_VIRTUAL_MICROBATCHES} (each is traced: "
                             "~0.06 s for a 70B stack)")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=1,
                        help="ZeRO stage over the dp group: 0 (plain DDP), 1, 2, 3")
    parser.add_argument("--recompute", default="selective", choices=RECOMPUTE,
                        help="activation recomputation: none, selective (each attention core), full (each block)")
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved", "zb-h1"),
                        help="the pipeline schedule (course_lib.schedules); interleaved needs --num-chunks >= 2")
    parser.add_argument("--num-chunks", type=integer(1), default=1,
                        help="layer chunks per stage, v (--schedule interleaved)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                        help="weights and gradients: bf16/fp16 with MixedPrecisionAdam (fp32 master, m, v: "
                             "12 bytes), fp32 with torch's Adam (m, v: 8 bytes)")
    _add_switches(parser)
    parser.add_argument("--gpu", default="H100 SXM", choices=sorted(GPUS),
                        help="the card the rank's peak memory is weighed against")
    parser.add_argument("--json", action="store_true",
                        help="print run_rank's record as JSON instead of the table (off unless given)")
    return parser


def main(argv=None) -> int:
    parser = _parser()
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
        options = {name: getattr(args, name) for name in (*OPTIONS, *_switches())}
        job = Job(config, mesh, seq_len=args.seq_len or config.max_seq_len, **options)
        result = run_rank(job, args.rank)
    except ValueError as error:          # the run's own one-line errors, as a real run would raise them
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else format_result(result, args.gpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
