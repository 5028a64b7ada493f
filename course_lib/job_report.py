"""Your own job, before it runs: a torchtitan, Megatron-LM or DeepSpeed configuration read (course_lib.frameworks)
and what each GPU of it will hold, send and do.

    python -m course_lib.job train.toml --gpus 8 --gpu H100
    python -m course_lib.job pretrain_gpt.sh --gpus 64 --gpu "A100 80GB" --gpus-per-node 8
    python -m course_lib.job ds_config.json --model config.json --gpus 16 --seq-len 4096 --json

The report, from Python ``job_report(read_config(...))`` and ``format_report``:

* **Memory of the busiest GPU**: the pipeline stage whose state + activations the formulas put highest, then one
  rank of it run through the virtual cluster (virtual.run_rank: the framework's layout built by the course's
  code on fake process groups and meta tensors), so state and activations are measured, not only computed.
  Added: what ZeRO-2/3 hold only while stepping (per_rank.transient_bytes_per_rank: meta tensors cannot show it)
  and a reserve (recipes.RESERVE_SHARE of the card: allocator, NCCL buffers, workspaces).
* **Bytes per axis** that rank sends in one step (per_rank's formulas for the whole step, checked against the bytes
  the virtual run measured on its shorter one), and the pipeline's bubble, (p - 1)/(v·m + p - 1).
* **Step time**, tokens/s and MFU (cost.step_time, with the framework's overlaps and reduction bytes), and the
  cost model's error on the held-out published runs of the same regime (published.held_out_errors).
* **The bottleneck**, in one sentence, and **better layouts** among those the framework can run (the planner's
  recipes, same global batch), each as the lines to change in the file.

Errors (a contradiction in the file, a key the model cannot take) are one line and exit code 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from .collective_times import reduced_bytes
from .cost import step_time
from .frameworks import ConfigError, NotWritable, ReadConfig, read_config
from .hardware import GPUS, find_gpu
from .job import Job
from .ledger import CONVENTIONS, deepspeed_estimate, zero_state_bytes
from .per_rank import (
    activation_bytes_per_rank,
    data_parallel_bytes_per_step,
    data_parallel_state_bytes,
    layer_params,
    microbatches_in_flight,
    params_per_rank,
    sent_bytes_per_rank,
    transient_bytes_per_rank,
)
from .pipeline_parallel import bubble_fraction
from .plan import TIE_SHARE
from .published import held_out_errors, regime_of
from .recipes import RESERVE_SHARE, Workload, compare_recipes, share_text, size_text, stage_name
from .units import GiB
from .virtual import run_rank

# The planner's recipes each framework runs (recipes.RECIPES), and the ZeRO stages it has.
FRAMEWORK_RECIPES = {
    "torchtitan": ({"ZeRO-3 / FSDP", "FSDP + TP", "TP + PP + FSDP"}, {3}),
    "megatron": ({"data parallel", "TP + PP + ZeRO-1"}, {0, 1}),
    "deepspeed": ({"data parallel", "ZeRO-3 / FSDP"}, {0, 1, 2, 3}),
}
BETTER = 3          # alternatives shown
OVERHEAD_SHARE = 0.10   # a part of the step above this share is named as the bottleneck
# The state conventions the virtual cluster's optimizers build (MixedPrecisionAdam, torch's Adam); the others'
# state (Megatron's fp32 gradients) is the formula's, labelled so.
MEASURED_CONVENTIONS = ("mixed", "fp32")


def busiest_stage(job: Job) -> int:
    """The pipeline stage whose GPUs hold the most by the formulas (state, transient, activations). A mixture of
    experts has no activation formula: its stages are compared on state alone."""
    def held(stage):
        activations = activation_bytes_per_rank(job, stage)["peak"] if not job.config.num_experts else 0
        return (data_parallel_state_bytes(job, stage)["total"] + transient_bytes_per_rank(job, stage)["total"]
                + activations)
    return max(range(job.mesh.pp), key=held)


def microbatches_to_run(job: Job, stage: int) -> int:
    """The fewest micro-batches whose step holds ``stage``'s peak: 1F1B holds min(p - s, m) at once, so a step of
    p - s micro-batches reaches the peak a step of hundreds does (interleaved: a multiple of p, as its schedule
    needs). The virtual cluster traces each micro-batch (~0.35 s for a 70B stage), so the report runs these."""
    held = microbatches_in_flight(job.mesh, stage, job.num_microbatches, job.schedule, job.num_chunks)
    step = job.mesh.pp if job.schedule == "interleaved" else 1
    return next(m for m in range(step, job.num_microbatches + 1, step)
                if microbatches_in_flight(job.mesh, stage, m, job.schedule, job.num_chunks) == held)


def job_report(read: ReadConfig, alternatives: bool = True) -> dict:
    """The report's numbers (module docstring), as one dict json.dumps can print; ``alternatives=False`` leaves out
    the search for better layouts (the planner over every layout of the framework's recipes)."""
    job = read.job
    card = find_gpu(job.gpu).memory_bytes
    stage, run = _busiest_run(job)
    run_m = run["num_microbatches"]
    formulas = run["formulas"]
    state = run["state_bytes"]
    measured = list(run["measured"])
    built = job.state_convention in MEASURED_CONVENTIONS
    if not built and "state_bytes" in measured:
        # The virtual cluster's optimizer keeps 16-bit gradients: the convention's are the formula's.
        measured.remove("state_bytes")
        state = formulas["state_bytes"]
    memory = {"stage": stage, "rank": run["rank"], "weights": state["weights"], "grads": state["grads"],
              "optimizer": state["optimizer"], "state": state["total"],
              "transient": transient_bytes_per_rank(job, stage)["total"],
              "activations": run["activation_bytes_peak"], "reserve": int(RESERVE_SHARE * card)}
    memory["total"] = sum(memory[part] for part in ("state", "transient", "activations", "reserve"))
    memory.update(card=card, fits=memory["total"] <= card, measured=measured, run_microbatches=run_m,
                  virtual_state=run["state_bytes"]["total"] if "state_bytes" in run["measured"] else None,
                  formulas={"state": formulas["state_bytes"]["total"], "activations": formulas["activation_bytes_peak"]},
                  framework_state=framework_state(read, stage))
    time = step_time(job, **read.assumptions)
    name = regime_of(job.gpu, job.config.hidden, job.tokens_per_sequence, job.recompute)
    name += ", fp32" if job.dtype == "fp32" else ""            # every published run here trained in 16 bits
    return {
        "framework": read.framework, "path": read.path, "model": read.model_name, "gpu": job.gpu,
        "gpus": job.mesh.size, "mesh": repr(job.mesh), "zero_stage": job.zero_stage, "recompute": job.recompute,
        "seq_len": job.tokens_per_sequence, "micro_batch_size": job.micro_batch_size,
        "num_microbatches": job.num_microbatches, "global_batch_size": job.global_batch_size,
        "convention": job.state_convention, "memory": memory,
        "sent_bytes": sent_bytes_per_rank(job, stage), "framework_dp_bytes": framework_dp_bytes(read, stage),
        # the formulas against the virtual run's bytes (dp: only where its optimizer holds the convention's gradients)
        "sent_bytes_checked": _agreement(run["sent_bytes"], formulas["sent_bytes"], skip=() if built else ("dp",)),
        "bubble": bubble_fraction(job.mesh.pp, job.num_microbatches, job.num_chunks),
        "step": {"seconds": time.total_s, "tokens_per_s": time.tokens_per_s, "mfu": time.mfu,
                 "parts": time.breakdown(), "dp_overlap": read.assumptions.get("dp_overlap", 0.0),
                 "tp_overlap": read.assumptions.get("tp_overlap", 0.0) if job.mesh.tp > 1 else 0.0,
                 "cp_overlap": read.assumptions.get("cp_overlap", 0.0) if job.mesh.cp > 1 else 0.0},
        "error_band": {"regime": name, **held_out_errors().get(name, {"runs": 0})},
        "bottleneck": bottleneck(memory, time, job),
        "better": better_layouts(read, time.tokens_per_s, memory["fits"]) if alternatives else None,
        "conventions": read.conventions, "not_modelled": read.not_modelled, "unknown": read.unknown,
        "virtual_run": {key: run[key] for key in ("rank", "num_microbatches", "state_bytes", "activation_bytes_peak",
                                                  "sent_bytes", "measured", "seconds")},
    }


def _agreement(measured: dict, computed: dict, skip=()) -> float:
    """The largest gap, as a share, between the virtual run's bytes per axis and the formulas' for the same step."""
    return max((abs(measured[axis] - computed[axis]) / max(computed[axis], 1) for axis in measured
                if axis in computed and axis not in skip), default=0.0)


def _busiest_run(job: Job) -> tuple[int, dict]:
    """The busiest stage and one rank of it run virtually, on microbatches_to_run's step. A mixture of experts has
    no activation formula to pick the stage by: every stage is run and the fullest measured wins."""
    stages = range(job.mesh.pp) if job.config.num_experts else [busiest_stage(job)]
    runs = []
    for stage in stages:
        num_microbatches = microbatches_to_run(job, stage)
        run = run_rank(job.replace(num_microbatches=num_microbatches), job.mesh.rank_of(pp=stage))
        runs.append((stage, {**run, "num_microbatches": num_microbatches}))
    return max(runs, key=lambda pair: pair[1]["state_bytes"]["total"] + pair[1]["activation_bytes_peak"]
               + transient_bytes_per_rank(job, pair[0])["total"])


# Megatron-LM's bytes per parameter (docs/user-guide/features/dist_optimizer.md): (whole, sharded over d) for each
# precision, with and without --use-distributed-optimizer.
MEGATRON_TABLE = {("fp16", 0): (20, 0), ("bf16", 0): (18, 0), ("fp32", 0): (16, 0),
                  ("fp16", 1): (4, 16), ("bf16", 1): (6, 12), ("fp32", 1): (8, 8)}


def framework_state(read: ReadConfig, stage: int) -> dict | None:
    """The training state of a GPU of ``stage`` as the framework's own documentation counts it, where it does:
    Megatron-LM's distributed-optimizer table, the ZeRO paper's formula that DeepSpeed implements (and DeepSpeed's
    estimator, which counts an fp32 gradient partition too), FSDP2's fp32 shards for torchtitan. P is what the
    GPU holds after TP and PP (per_rank.params_per_rank), d the ranks its state is sharded over (dp × cp).
    None for expert parallelism (experts and the rest shard over different groups)."""
    job = read.job
    if job.mesh.ep > 1:
        return None
    params = params_per_rank(job.config, job.mesh, stage, job.num_chunks, job.vocab_parallel)
    shards = job.mesh.dp_shard * job.mesh.cp
    zero = job.zero
    if read.framework == "megatron":
        if job.state_convention == "mixed":
            return None                   # --grad-reduce-in-bf16: bf16 gradients, a row the table does not have
        whole, sharded = MEGATRON_TABLE[job.dtype, zero]
        return {"source": f"Megatron-LM's distributed-optimizer table: {whole}"
                          + (f" + {sharded}/d" if sharded else "") + " bytes per parameter",
                "bytes": whole * params + sharded * params / shards}
    if read.framework == "torchtitan":
        where = "sharded by FSDP2 over dp_shard × cp" if zero == 3 else "whole on each GPU"
        return {"source": f"fp32 weight, gradient, Adam's m and v, 4 bytes each, {where}",
                "bytes": 16 * params / (shards if zero == 3 else 1)}
    found = {"source": "the ZeRO paper's formula (ledger.zero_state_bytes), as DeepSpeed implements it",
             "bytes": zero_state_bytes(params, zero, shards, **CONVENTIONS[job.state_convention].per_param)["total"]}
    if zero in (2, 3) and job.mesh.tp == job.mesh.pp == 1:
        found["estimator"] = deepspeed_estimate(params, zero, shards, layer_params(job.config))
    return found


def framework_dp_bytes(read: ReadConfig, stage: int) -> float | None:
    """The data-parallel bytes a step sends where the framework reduces gradients in other bytes than the course's
    ZeRO (torchtitan's FSDP2 reduces in fp32, where the course reduces 16-bit gradients): every reduction scaled,
    the weights' all-gathers as they are. None where the two agree."""
    job, reduce_bytes = read.job, read.assumptions.get("grad_reduce_bytes")
    if reduce_bytes in (None, job.grad_bytes):
        return None
    ops = data_parallel_bytes_per_step(job, stage)
    return sum(reduced_bytes(op, nbytes, job, reduce_bytes) for op, nbytes in ops.items())


def _overlap_text(step: dict, sent_bytes: dict) -> str:
    """What the step hides behind compute, as the framework schedules it: " (...)", or "" where nothing hides."""
    hidden = [f"data-parallel traffic {step['dp_overlap']:.0%} hidden"] if sent_bytes.get("dp") else []
    for share, text in (("tp_overlap", "TP's backward {:.0%}, up to its weight-gradient GEMMs"),
                        ("cp_overlap", "ring attention {:.0%}, up to the attention kernels")):
        hidden += [text.format(step[share])] if step[share] else []
    return f" ({'; '.join(hidden)})" if hidden else ""


def bottleneck(memory: dict, time, job: Job) -> str:
    """One sentence: what stops the job, or what most of its step is spent on beside the arithmetic."""
    if not memory["fits"]:
        parts = {part: memory[part] for part in ("state", "transient", "activations")}
        largest = max(parts, key=parts.get)
        return (f"it does not fit: stage {memory['stage']}'s GPUs need {size_text(memory['total'])} of "
                f"{size_text(memory['card'])}, and the largest part is {largest} ({size_text(parts[largest])})")
    parts = {part: seconds for part, seconds in time.breakdown().items() if part != "compute"}
    largest = max(parts, key=parts.get)
    share = parts[largest] / time.total_s
    if share < OVERHEAD_SHARE:
        card = find_gpu(job.gpu)
        kernels = card.for_dtype(job.dtype)
        fp32 = (f", in fp32 on the CUDA cores' {kernels.peak_flops / 1e12:.3g} TFLOP/s where 16 bits run on the "
                f"Tensor Cores' {card.peak_flops / 1e12:.3g}" if kernels is not card else "")
        return (f"compute: {time.compute_s / time.total_s:.0%} of the step is arithmetic{fp32}; nothing else takes "
                f"{OVERHEAD_SHARE:.0%}")
    why = {"bubble": f"pp {job.mesh.pp} over {job.num_microbatches} micro-batches of v = {job.num_chunks}",
           "dp": "the data-parallel traffic left exposed",
           "tp": "the tensor-parallel " + ("reduce-scatters and all-gathers" if job.sequence_parallel else "all-reduces")
                 + " of every layer",
           "pp": "the stage-to-stage sends", "optimizer": "the optimizer's step, memory-bound",
           "cp": "ring attention's K/V hops left exposed", "ep": "the experts' all-to-alls of every layer",
           "overhead": "the framework's per-step work"}[largest]
    return f"{largest}: {share:.0%} of the step ({why})"


def better_layouts(read: ReadConfig, tokens_per_s: float, fits: bool) -> list[dict]:
    """Layouts that fit among the recipes the framework runs, with the same global batch and precision (the
    planner's compare_recipes; micro-batches of the job's size or of 1), each with the lines to change: those
    faster than the job by more than the cost model's error when it fits; when it does not, the fastest that do,
    with full recomputation tried too."""
    job = read.job
    if job.config.num_experts or job.mesh.cp > 1 or job.mesh.dp_replicate > 1:
        return []      # the planner's recipes are dense dp × tp × pp layouts (recipes.candidate_layouts)
    recipes, stages = FRAMEWORK_RECIPES[read.framework]
    template = job.replace(reshard_after_forward=True, reshard_after_backward=True)   # each recipe sets its own
    recomputes = [job.recompute] + (["full"] if not fits and job.recompute != "full" else [])
    found = []
    for recompute, micro_batch_size in dict.fromkeys(itertools.product(recomputes, (job.micro_batch_size, 1))):
        workload = Workload.from_job(template.replace(recompute=recompute, micro_batch_size=micro_batch_size),
                                     global_batch_size=job.global_batch_size)
        layouts = compare_recipes(job.config, num_gpus=job.mesh.size, gpu_bytes=find_gpu(job.gpu).memory_bytes,
                                  workload=workload, gpu=job.gpu, gpus_per_node=job.gpus_per_node,
                                  convention=read.recipes_convention or job.state_convention,
                                  **read.assumptions)
        for layout in layouts:
            # torchtitan's pipelining keeps FSDP's weights gathered through the step: a resharding one is not its run
            runnable = not (read.framework == "torchtitan" and layout.mesh.pp > 1 and layout.job.reshard_after_backward)
            if runnable and layout.recipe in recipes and layout.zero_stage in stages and layout.fits and (
                    not fits or layout.time.tokens_per_s > (1 + TIE_SHARE) * tokens_per_s):
                try:
                    change = read.changes(layout.job)
                except NotWritable:      # a layout the framework's keys cannot write (Megatron: uneven stages)
                    continue
                found.append({"recipe": layout.recipe, "layout": str(layout).split(": ", 1)[1],
                              "tokens_per_s": layout.time.tokens_per_s,
                              "speedup": layout.time.tokens_per_s / tokens_per_s,
                              "memory": layout.memory["total"], "change": change})
    return sorted(found, key=lambda alt: -alt["tokens_per_s"])[:BETTER]


def format_report(report: dict) -> str:
    """The report as text (the command line's default)."""
    mem, step, band = report["memory"], report["step"], report["error_band"]
    lines = [f"{report['framework']}: {report['path']}",
             f"  model {report['model']}; {report['gpus']} × {report['gpu']}, {report['mesh']}, "
             f"{_zero_text(report)}, "
             f"recompute {report['recompute']}, {report['convention']} state",
             f"  batch {report['global_batch_size']:,} sequences of {report['seq_len']:,} tokens: "
             f"{_count(report['num_microbatches'], 'micro-batch')} of {report['micro_batch_size']} per dp rank", "",
             f"busiest GPU: rank {mem['rank']} (stage {mem['stage']}): {size_text(mem['total'])} of "
             f"{size_text(mem['card'])}: {'fits' if mem['fits'] else 'DOES NOT FIT'}",
             f"  state        {size_text(mem['state']):>10}  (weights {size_text(mem['weights'])}, grads "
             f"{size_text(mem['grads'])}, optimizer {size_text(mem['optimizer'])}; formula "
             f"{size_text(mem['formulas']['state'])})",
             *([f"  transient    {size_text(mem['transient']):>10}  (ZeRO-2/3's gathered weights, whole gradients)"]
               if mem["transient"] else []),
             f"  activations  {size_text(mem['activations']):>10}  (peak over the schedule"
             + (f"; formula {size_text(mem['formulas']['activations'])})" if mem["formulas"]["activations"] else ")"),
             f"  reserve      {size_text(mem['reserve']):>10}  ({RESERVE_SHARE:.0%} of the card)",
             f"  measured by the virtual cluster (rank {mem['rank']}, a step of "
             f"{_count(mem['run_microbatches'], 'micro-batch')}: the same peak): {', '.join(mem['measured'])}"]
    theirs = mem["framework_state"]
    if theirs:
        lines.append(f"  the framework's own count of the state: {size_text(theirs['bytes'])} ({theirs['source']})"
                     + (f"; DeepSpeed's estimator prints {theirs['estimator'] / GiB:.2f}GB (GiB), counting 18 "
                        f"bytes per parameter sharded where the paper shards {14 if report['zero_stage'] == 2 else 16}"
                        + (", and one layer gathered" if report["zero_stage"] == 3 else "")
                        if "estimator" in theirs else ""))
    if mem["virtual_state"] is None:
        lines.append("  the state is per_rank's formula: with ep > 1 no one data-parallel wrapper averages the "
                     "experts' and the rest's gradients, so the virtual step runs none (virtual.py)")
    elif "state_bytes" not in mem["measured"]:
        lines.append(f"  the state is the formula's: the virtual cluster's optimizer keeps 16-bit gradients "
                     f"(it measured {size_text(mem['virtual_state'])}), {report['convention']} keeps more")
    lines += ["",
              "sent per step by that rank: " + ", ".join(f"{axis} {size_text(b)}" for axis, b in
                                                         report["sent_bytes"].items() if b),
              *([f"  {report['framework']} reduces its gradients in fp32: dp {size_text(report['framework_dp_bytes'])} "
                "(the step time counts these)"] if report["framework_dp_bytes"] else []),
             f"  (per_rank's formulas for m = {report['num_microbatches']}; on the virtual run's step of "
              f"{_count(mem['run_microbatches'], 'micro-batch')} they are within "
              f"{report['sent_bytes_checked']:.1%} of the bytes measured"
             + ("; dp not compared: its gradients are 16-bit there)" if "state_bytes" not in mem["measured"] else ")"),
              f"pipeline bubble: {report['bubble']:.1%}", "",
              f"step {step['seconds']:.3g} s, {step['tokens_per_s']:,.0f} tokens/s, MFU {share_text(step['mfu'])}"
              + _overlap_text(step, report["sent_bytes"]),
              "  " + ", ".join(f"{part} {seconds / step['seconds']:.0%}" for part, seconds in step["parts"].items()),
              "  " + _band_text(band), "",
              f"bottleneck: {report['bottleneck']}"]
    if mem["fits"]:
        title = f"layouts this framework can run, faster by more than the cost model's error ({TIE_SHARE:.0%})," 
    else:
        title = "layouts this framework can run that fit,"
    if report["better"]:
        lines += ["", f"{title} for the same batch (× this job's tokens/s):"]
        for alt in report["better"]:
            lines.append(f"  {alt['speedup']:.2f}× {alt['recipe']}: {alt['layout']}")
            lines += [f"      {change}" for change in alt["change"]]
    elif report["better"] == []:                 # (None: not searched, job_report(..., alternatives=False))
        lines += ["", f"no layout this framework can run is faster by more than the cost model's error ({TIE_SHARE:.0%})"
                  if mem["fits"] else "no layout this framework can run fits these GPUs with this batch"]
    for title, notes in (("the framework's conventions", report["conventions"]),
                         ("read, not modelled", report["not_modelled"]), ("unknown keys", report["unknown"])):
        if notes:
            lines += ["", f"{title}:"] + [f"  - {note}" for note in notes]
    return "\n".join(lines)


def _count(number: int, thing: str) -> str:
    return f"{number:,} {thing}" + ("" if number == 1 else "es" if thing.endswith("h") else "s")


def _zero_text(report: dict) -> str:
    return "no data parallelism" if report["mesh"].startswith("Mesh(dp=1,") else stage_name(report["zero_stage"])


def _band_text(band: dict) -> str:
    if not band["runs"]:
        return f"no held-out published run in this regime ({band['regime']}): no error band"
    return (f"the cost model on {band['runs']} held-out published runs of this regime ({band['regime']}): "
            f"{band['min']:+.1f} to {band['max']:+.1f} points of MFU, mean {band['mean']:+.1f}, "
            f"{band['within_5']} within 5")


def gpu_name(text: str) -> str:
    """A catalogue key from what people type: "H100" is "H100 SXM", "A100" the 80GB one."""
    if text in GPUS:
        return text
    matches = sorted(name for name in GPUS if name.lower().startswith(text.lower()))
    if len(matches) == 1 or matches and {name.split()[0].lower() for name in matches} == {text.lower()}:
        return matches[-1]             # one GPU, or a family by its name: its largest memory
    raise argparse.ArgumentTypeError(f"{text!r} " + ("names more than one GPU" if matches else "is not in the catalogue")
                                     + f": {', '.join(matches or GPUS)}")


class _OneLineParser(argparse.ArgumentParser):
    """argparse, with a bad argument reported as the file's errors are: one line, exit code 2."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


def main(argv=None) -> int:
    parser = _OneLineParser(prog="python -m course_lib.job", description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="torchtitan .toml, DeepSpeed .json, or a Megatron-LM launch script")
    parser.add_argument("--gpus", type=int, help="GPUs in the job (default: what the file says)")
    parser.add_argument("--gpu", type=gpu_name, default="H100 SXM", help="the card (default: H100 SXM)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default: 8)")
    parser.add_argument("--model", help="for DeepSpeed: a Hugging Face config.json, or a course preset")
    parser.add_argument("--seq-len", type=int, help="for DeepSpeed: tokens per sequence (default: the model's "
                        "max_position_embeddings)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:          # --help (0), or a bad argument's one line (2)
        return done.code
    try:
        read = read_config(args.config, num_gpus=args.gpus, gpu=args.gpu, gpus_per_node=args.gpus_per_node,
                           model=args.model, seq_len=args.seq_len)
        report = job_report(read)
    except ValueError as error:     # ConfigError and the job's own rules: one line, as argparse's are
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


__all__ = ["ConfigError", "job_report", "format_report", "main", "read_config"]
