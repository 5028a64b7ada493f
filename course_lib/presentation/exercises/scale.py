"""The checkers of notebook 09's exercises (a layout at scale; a torchtitan file that does not fit), kept apart so
that exercises.py stays short to read; exercises.py wraps and re-exports them, so notebooks call
``exercises.check_layout_at_scale`` and ``exercises.check_own_job`` like the others.

An answer is judged by the course's own models, with the planner's assumptions (recipes.cost_layout, as
compare_recipes costs each layout): recipes.memory_per_gpu for what its busiest GPU holds (state + activations +
reserve) and cost.step_time for its step (each operation on its roofline, TP, PP, DP with half of it hidden, the
bubble, the optimizer); ZeRO-3 beside a pipeline as torch's pipelining runs it, where that fits.

Where a step's time goes. MFU = model FLOPs / (step time × peak × GPUs), so a step that did nothing but the
model's FLOPs, evenly spread over the GPUs at the share of peak e its busiest GPU's compute reaches
(StepTime.achieved_share), would reach MFU = e. The ideal step is ``mfu · total_s / e`` seconds; every other
second is a loss, and each loss has a name:

    total_s - ideal = tp + pp + dp + bubble + optimizer + recompute + imbalance

recompute: the forward work done again (hardware FLOPs that MFU does not count); imbalance: the busiest GPU
computing longer than the average one (uneven stages; the last stage also runs the head, whole on every TP
rank in the course's apply_tp). The hint names the largest.
"""

import tempfile
from pathlib import Path

from ...cost import StepTime
from ...frameworks import read_config
from ...hardware import find_gpu
from ...job_report import job_report
from ...ledger import RECOMPUTE, ZERO_STAGES
from ...mesh import Mesh
from ...model import preset
from ...plan import bad_smells
from ...recipes import Workload, cost_layout, seconds_text, size_text
from .layout import read_answer

CONFIG = preset("llama2-70b")
NUM_GPUS, GPUS_PER_NODE, GPU = 64, 8, "H100 SXM"    # 8 nodes of 8 H100 SXM, 80 GiB each
SEQ_LEN, GLOBAL_BATCH = 4096, 512                    # 2M tokens a step
TARGET_MFU = 0.42
DP_OVERLAP = 0.5     # half the DP traffic hidden, as the planner hides it (recipes.framework_overlap: DDP's and
                     # ZeRO-1/2's buckets, ZeRO-3's gathers and reduce-scatters alike)
KEYS = ("dp", "tp", "pp", "zero_stage", "micro_batch_size", "sequence_parallel", "recompute")

HINTS = {   # the largest loss of a step that fits → what to change
    "tp": "each GPU sends 4 all-reduces of b·s·d bytes per layer and micro-batch, 2(t-1)/t of them on the wire, "
          "while its compute shrinks as 1/t: TP's share of the step grows with t. A smaller TP (make room with "
          "PP or ZeRO instead)",
    "pp": "each micro-batch's activation goes forward and its gradient back at every stage boundary, and the "
          "course's executor waits for each: fewer stages, or fewer, larger micro-batches",
    "dp": "the DP traffic of the gradients (and, with ZeRO-3, the weights gathered 2m times a step) is only half "
          "hidden: a lower ZeRO stage, or shard the model with TP and PP instead",
    "bubble": "the pipeline idles (p-1)/(m+p-1) of the step, and m = B/(dp·b): fewer stages, or more "
              "micro-batches (a smaller dp or micro-batch)",
    "optimizer": "the optimizer step streams the training state through memory once a step: more micro-batches "
                 "a step, or ZeRO to shard the state it reads",
    "recompute": "recomputation runs part of the forward again: hardware FLOPs that MFU does not count. Recompute "
                 "less, and make room for the activations another way (sequence parallelism divides them by tp)",
    "imbalance": "the busiest GPU computes longer than the average one: 80 layers may not split evenly into p "
                 "stages, and the last stage also runs the head, 2·b·s·d·V FLOPs forward, whole on every TP rank "
                 "(the course's apply_tp does not split it). With few layers per stage that weighs: fewer stages, "
                 "or a smaller TP",
}


def judge(answer: dict) -> tuple[Mesh, int, dict[str, int], StepTime]:
    """The course's models on a valid answer: its mesh, its number of micro-batches m = B/(dp·b), what its
    busiest GPU holds ({"state", "activations", "reserve", "total"} bytes) and its step time."""
    mesh = Mesh(dp=answer["dp"], tp=answer["tp"], pp=answer["pp"])
    workload = Workload(seq_len=SEQ_LEN, micro_batch_size=answer["micro_batch_size"], global_batch_size=GLOBAL_BATCH,
                        recompute=answer["recompute"], sequence_parallel=answer["sequence_parallel"])
    layout = cost_layout("yours", CONFIG, mesh, answer["zero_stage"], workload, gpu_bytes=find_gpu(GPU).memory_bytes,
                         gpu=GPU, gpus_per_node=GPUS_PER_NODE, dp_overlap=DP_OVERLAP)
    return mesh, layout.num_microbatches, layout.memory, layout.time


def losses(time: StepTime) -> dict[str, float]:
    """The seconds of a step beyond the ideal one, by name (module docstring); they sum to total_s - ideal."""
    ideal = time.mfu * time.total_s / time.achieved_share
    recompute = time.compute_s * (1 - time.mfu / time.hfu)
    return {"tp": time.tp_s, "pp": time.pp_s, "dp": time.dp_s, "bubble": time.bubble_s, "optimizer": time.optimizer_s,
            "recompute": recompute, "imbalance": time.compute_s - recompute - ideal}


def _invalid(answer: dict) -> str | None:
    """What makes the answer no layout at all (the same errors a real run would raise), or None."""
    try:
        mesh = Mesh(dp=answer["dp"], tp=answer["tp"], pp=answer["pp"])
        mesh.check(NUM_GPUS)
        mesh.check_model(CONFIG)
    except (TypeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    b = answer["micro_batch_size"]
    if answer["zero_stage"] not in ZERO_STAGES:
        return f"zero_stage={answer['zero_stage']!r}: one of 0 (DDP), 1, 2, 3"
    if answer["recompute"] not in RECOMPUTE:
        return f"recompute={answer['recompute']!r}: one of {', '.join(map(repr, RECOMPUTE))}"
    if not isinstance(answer["sequence_parallel"], bool):
        return f"sequence_parallel={answer['sequence_parallel']!r}: True or False"
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        return f"micro_batch_size={b!r}: a whole number of sequences >= 1"
    if GLOBAL_BATCH % (mesh.dp * b):
        return (f"the {GLOBAL_BATCH} sequences of a step do not split into dp {mesh.dp} × micro-batches of {b}: "
                f"m = B/(dp·b) = {GLOBAL_BATCH}/{mesh.dp * b} must be a whole number")
    return None


def _overflow(memory: dict[str, int], gpu_bytes: int) -> str:
    """Which part overflows the card, and by how much."""
    over = memory["total"] - gpu_bytes
    held = (f"state {size_text(memory['state'])} + activations {size_text(memory['activations'])} + reserve "
            f"{size_text(memory['reserve'])} = {size_text(memory['total'])}")
    if memory["state"] + memory["reserve"] > gpu_bytes:
        hint = (f"the training state alone, with the reserve, needs {size_text(memory['state'] + memory['reserve'])}: "
                "shard it more (TP and PP cut the model, ZeRO over dp shards what is left; a pipeline takes ZeRO-1 "
                "at most)")
    else:
        hint = (f"the activations must shrink by {size_text(over)}, to at most "
                f"{size_text(memory['activations'] - over)}: sequence parallelism divides them by tp, a smaller "
                "micro-batch shrinks them, full recomputation keeps only each layer's input (and stage 0 of a "
                "pipeline holds p micro-batches in flight)")
    return f"✗ does not fit: the busiest GPU needs {held} of {size_text(gpu_bytes)}, {size_text(over)} over; {hint}"


def _too_slow(time: StepTime) -> str:
    """The step, term by term, and its largest loss with what to change."""
    lost = losses(time)
    worst = max(lost, key=lost.get)
    terms = ", ".join(f"{term} {seconds_text(seconds)}" for term, seconds in time.breakdown().items() if seconds)
    return (f"✗ it fits, but MFU is {time.mfu:.1%} < {TARGET_MFU:.0%}: a step of {seconds_text(time.total_s)} = "
            f"{terms}. The largest loss is {worst}, {seconds_text(lost[worst])} ({lost[worst] / time.total_s:.0%} "
            f"of the step): {HINTS[worst]}")


def check_layout_at_scale(layout) -> bool:
    """09: ``layout()`` must return {"dp", "tp", "pp", "zero_stage", "micro_batch_size", "sequence_parallel",
    "recompute"} for Llama-2-70B on 64 H100 SXM GPUs of 80 GiB (8 nodes of 8), 512 sequences of 4,096 tokens a
    step. It passes if it is a valid layout (the grid covers the 64 GPUs, TP divides the heads, the batch splits
    into whole micro-batches), has no bad smell (plan.bad_smells), fits with its activations and the reserve
    (recipes.memory_per_gpu) and reaches an MFU of at least 42% (cost.step_time); otherwise the hint says which
    part overflows and by how much, or which term of the step costs most."""
    answer = read_answer(layout, KEYS)
    if answer is None:
        return False
    missing, unknown = [k for k in KEYS if k not in answer], [k for k in answer if k not in KEYS]
    if missing or unknown:
        print(f"✗ your dict needs the keys {', '.join(KEYS)}"
              + (f"; it has no {', '.join(map(repr, missing))}" if missing else "")
              + (f"; {', '.join(map(repr, unknown))} is not one of them" if unknown else ""))
        return False
    problem = _invalid(answer)
    if problem:
        print(f"✗ {problem}")
        return False
    mesh, m, memory, time = judge(answer)
    smells = bad_smells(mesh, gpus_per_node=GPUS_PER_NODE, num_microbatches=m, zero_stage=answer["zero_stage"])
    if smells:
        print(f"✗ {smells[0]}")
        return False
    gpu_bytes = find_gpu(GPU).memory_bytes
    if memory["total"] > gpu_bytes:
        print(_overflow(memory, gpu_bytes))
        return False
    if time.mfu < TARGET_MFU:
        print(_too_slow(time))
        return False
    print(f"✓ dp {mesh.dp} × tp {mesh.tp} × pp {mesh.pp}, ZeRO-{answer['zero_stage']}, micro-batch "
          f"{answer['micro_batch_size']}, m = {m}, " + ("no" if answer["recompute"] == "none" else answer["recompute"])
          + " recomputation"
          + (", sequence parallel" if answer["sequence_parallel"] else "")
          + f": {size_text(memory['total'])} of {size_text(gpu_bytes)} on the busiest GPU, MFU {time.mfu:.1%} "
          f"(≥ {TARGET_MFU:.0%}), {time.tokens_per_s:,.0f} tokens/s, a step of {seconds_text(time.total_s)}")
    return True


# The torchtitan file of the second exercise: Llama 3 8B on one node of 8 H100, 32 sequences of 8,192 tokens a
# step, without recomputation: its busiest GPU needs 217.5 GiB.
OWN_JOB = """[model]
name = "llama3"
flavor = "8B"

[training]
local_batch_size = 4
seq_len = 8192

[activation_checkpoint]
mode = "none"
"""
OWN_JOB_GPUS, OWN_JOB_TOKENS = 8, 32 * 8192


def check_own_job(edited) -> bool:
    """09: ``edited()`` returns OWN_JOB's torchtitan TOML changed so that the job fits 8 H100 of 80 GiB: the same
    model and sequence length, at least as many tokens a step (32 sequences of 8,192). Judged by the report
    (job_report: the busiest GPU run virtually, with the reserve); a miss names the part that overflows, and a
    file the reader refuses gets its one-line error."""
    text = read_answer(edited, (), wanted='the TOML file as one string (a """...""" block)')
    if text is None:
        return False
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "train.toml"
        path.write_text(text)
        try:
            read = read_config(path, num_gpus=OWN_JOB_GPUS)
        except ValueError as error:
            print(f"✗ the reader refuses it: {error}")
            return False
    job = read.job
    if (read.model_name, job.tokens_per_sequence) != ("llama3 8B", 8192):
        print("✗ keep the model (llama3 8B) and seq_len = 8192: the exercise is to fit this job, not a smaller one")
        return False
    tokens = job.global_batch_size * job.tokens_per_sequence
    if tokens < OWN_JOB_TOKENS:
        print(f"✗ {tokens:,} tokens a step, fewer than the {OWN_JOB_TOKENS:,} asked: keep 32 sequences a step "
              "(gradient accumulation, [training] global_batch_size, keeps the batch when local_batch_size shrinks)")
        return False
    report = job_report(read)
    memory = report["memory"]
    if not memory["fits"]:
        print(f"✗ still does not fit: {report['bottleneck'].removeprefix('it does not fit: ')} (state {size_text(memory['state'])}, activations "
              f"{size_text(memory['activations'])}, reserve {size_text(memory['reserve'])}). Fewer sequences per "
              "pass (local_batch_size, with global_batch_size kept), recomputation ([activation_checkpoint] mode) "
              "or TP (which splits each layer's activations too) shrink the activations")
        return False
    step = report["step"]
    print(f"✓ {report['mesh']}, {size_text(memory['total'])} of {size_text(memory['card'])} on the busiest GPU; "
          f"{step['tokens_per_s']:,.0f} tokens/s, MFU {step['mfu']:.0%}")
    return True

