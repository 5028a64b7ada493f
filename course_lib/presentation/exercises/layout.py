"""The checker of notebook 06's exercise (a 3D layout for Llama-2-70B), kept apart so that exercises.py stays short
to read; exercises.py wraps and re-exports it, so notebooks call ``exercises.check_3d_layout`` like the others.

It judges with the planner's honest model (course_lib.recipes): a layout fits only when its busiest GPU holds
the training state, the activations 1F1B keeps in flight and a reserve for what no formula counts (10% of the
card) within the card. ``overflow_hint`` says which part overflows, and by how much.
"""

from dataclasses import replace

from ...ledger import ZERO_STAGES
from ...mesh import Mesh
from ...model import preset
from ...pipeline_parallel import bubble_fraction
from ...plan import bad_smells
from ...recipes import Workload, memory_per_gpu, size_text, stage_name
from ...units import GiB
from .common import NOT_DONE

NUM_GPUS, GPUS_PER_NODE, CARD = 32, 8, 80 * GiB        # 4 nodes of 8 A100 80GB
# What notebook 06's exercise states: 64 sequences of 4,096 tokens a step, selective recomputation, sequence
# parallelism. The micro-batch follows from the answer: b = 64 / (dp · m) sequences.
WORKLOAD = Workload(seq_len=4096, global_batch_size=64, recompute="selective", sequence_parallel=True)
KEYS = ("dp", "tp", "pp", "zero_stage", "num_microbatches")


def read_answer(layout, keys, wanted: str | None = None):
    """The learner's ``layout()``, if it returns a dict (``wanted``: "a string", when the answer is a file's text);
    otherwise say what it did instead and return None."""
    try:
        answer = layout()
    except NotImplementedError:
        print(NOT_DONE)
        return None
    if not isinstance(answer, str if wanted else dict):
        name = getattr(layout, "__name__", "")
        name = name if name.isidentifier() else "layout" if wanted is None else "your function"   # not "<lambda>"
        print(f"✗ {name}() returned a {type(answer).__name__}; return "
              + (wanted or f"a dict with the keys {', '.join(keys)}"))
        return None
    return answer


def overflow_hint(memory: dict[str, int], gpu_bytes: int, *, mesh: Mesh, workload: Workload,
                  zero_stage: int | None = None) -> str:
    """Which part of the busiest GPU's memory (recipes.memory_per_gpu) does not fit in ``gpu_bytes``, by how
    much, and what shrinks it. The reserve is a fixed share of the card, so either the state alone takes more
    than the card leaves beside the reserve, or the state and the activations together do. Then both are named,
    the larger first: that is where most of the bytes are (dp 4 × tp 8 × pp 1 with ZeRO-1 holds 59.2 GiB of
    state beside 27.4 GiB of activations, and sharding the state is what makes it fit)."""
    room = gpu_bytes - memory["reserve"]             # what the state and the activations may share
    if memory["state"] > room:
        return (f"the state overflows: {size_text(memory['state'])} where the card leaves {size_text(room)} beside "
                f"its {size_text(memory['reserve'])} reserve, {size_text(memory['state'] - room)} too much before any "
                "activation: shard it more (a higher ZeRO stage over dp, or more TP or PP)")
    left, too_much = room - memory["state"], memory["total"] - gpu_bytes
    ways = []
    if workload.micro_batch_size > 1:
        ways.append(f"smaller micro-batches (b = {workload.micro_batch_size} sequences now: more micro-batches)")
    if not workload.sequence_parallel:
        ways.append("sequence parallelism (TP alone leaves the norms' tensors whole on every GPU)")
    if mesh.tp < GPUS_PER_NODE:
        ways.append("more TP")
    shrink = " or ".join(ways) or "full recomputation alone (not one of the choices here)"
    activations = (f"the activations overflow: {size_text(memory['activations'])} where the state and the reserve "
                   f"leave {size_text(left)}, {size_text(too_much)} too much. They shrink with {shrink}; more "
                   "pipeline stages do not shrink them (1F1B keeps p micro-batches of L/p layers each on stage 0: the "
                   "activations of all L layers)")
    if memory["activations"] >= memory["state"]:
        return activations
    shard = ([f"a higher ZeRO stage over dp {mesh.dp}" if mesh.pp == 1 else "ZeRO-3 over dp without a pipeline"]
             if mesh.dp > 1 and zero_stage != 3 else [])
    shard += ["more PP stages (each holds L/p of the layers)"] + (["more TP"] if mesh.tp < GPUS_PER_NODE else [])
    return (f"the state is the larger part: {size_text(memory['state'])} beside {size_text(memory['activations'])} of "
            f"activations, {size_text(too_much)} too much together. Shard the state more: {', or '.join(shard)}. "
            f"Otherwise, {activations}")


def check_3d_layout(layout, workload: Workload = WORKLOAD) -> bool:
    """06: ``layout()`` must return {"dp", "tp", "pp", "zero_stage", "num_microbatches"} for Llama-2-70B on 32
    GPUs of 80 GiB (4 nodes of 8) running ``workload``: 64 sequences of 4,096 tokens a step, selective
    recomputation, sequence parallelism. Checked with the course's own rules: dp·tp·pp = 32; TP divides the heads
    and stays inside a node; no more stages than layers; the batch splits into dp shares of num_microbatches
    equal micro-batches (b = 64 / (dp·m) sequences each); no bad smell (plan.bad_smells: TP across nodes); the
    bubble stays under 20%; the busiest GPU's state + activations + reserve fit on the card
    (recipes.memory_per_gpu)."""
    config, batch = preset("llama2-70b"), workload.global_batch_size
    answer = read_answer(layout, KEYS)
    if answer is None:
        return False
    missing, unknown = [k for k in KEYS if k not in answer], [k for k in answer if k not in KEYS]
    if missing:
        print(f"✗ your dict has no {', '.join(map(repr, missing))}: it needs the keys {', '.join(KEYS)}"
              + (f" (and {', '.join(map(repr, unknown))} is not one of them)" if unknown else ""))
        return False
    try:
        mesh = Mesh(dp=answer["dp"], tp=answer["tp"], pp=answer["pp"])
        stage, m = answer["zero_stage"], answer["num_microbatches"]
        mesh.check(NUM_GPUS)
        mesh.check_model(config, batch_size=batch, num_microbatches=m)
    except (TypeError, ValueError) as err:
        print(f"✗ {type(err).__name__}: {err}")
        return False
    if stage not in ZERO_STAGES:
        print(f"✗ zero_stage={stage!r}: one of 0 (DDP), 1, 2, 3")
        return False
    smells = [s for s in bad_smells(mesh, gpus_per_node=GPUS_PER_NODE, zero_stage=stage) if "ZeRO-3 on a" not in s]
    if smells:
        print(f"✗ {smells[0]}")
        return False
    bubble = bubble_fraction(mesh.pp, m)
    if bubble > 0.2:
        print(f"✗ the bubble is (p-1)/(m+p-1) = {mesh.pp - 1}/{m + mesh.pp - 1} = {bubble:.0%}: more micro-batches")
        return False
    workload = replace(workload, micro_batch_size=batch // (mesh.dp * m))
    memory = memory_per_gpu(config, mesh, stage, workload, gpu_bytes=CARD)
    held = (f"state {size_text(memory['state'])} + activations {size_text(memory['activations'])} + reserve "
            f"{size_text(memory['reserve'])} = {size_text(memory['total'])}")
    if memory["total"] > CARD:
        print(f"✗ the busiest GPU needs {held}: {size_text(memory['total'] - CARD)} more than its "
              f"{size_text(CARD)}")
        print("  hint: " + overflow_hint(memory, CARD, mesh=mesh, workload=workload, zero_stage=stage))
        return False
    print(f"✓ dp {mesh.dp} × tp {mesh.tp} × pp {mesh.pp}, {stage_name(stage)}, m = {m} (micro-batches of "
          f"{workload.micro_batch_size}): the busiest GPU needs {held} of {size_text(CARD)}; bubble {bubble:.1%}, TP "
          "inside the node")
    if mesh.pp > 1 and stage >= 2:   # allowed (Llama 3 runs FSDP with PP), but not free: say what it costs
        print(f"  note: ZeRO-{stage} beside a pipeline reduce-scatters the gradients"
              + (" and gathers the weights" if stage == 3 else "") + f" for every one of the {m} micro-batches, "
              "over this dp group's links (part 8 counts the bytes); ZeRO-1 does it once a step")
    return True
