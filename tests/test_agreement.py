"""Every axis the course combines, one small world each: the virtual cluster runs a rank through ``parallelize``
(on torch's fake group, meta tensors) and what it measures equals what the planner (recipes), the cost model's
traffic formula (tensor_parallel.tp_step_traffic, which cost.step_time charges) and per_rank say, exactly.

Axes: dp with ZeRO 0-3, tp, sp, pp (1F1B, GPipe, interleaved over v chunks, ZB-H1), cp, ep (a mixture of experts), hsdp. The tiny model (4
layers, hidden 64), 16 tokens, 2 micro-batches: each world takes a second or two. Where the course code does not
run a thing (ep's data-parallel average over two groups) the virtual cluster says it computed it, and that number
is held to the others only through per_rank."""

import pytest

from course_lib.job import Job
from course_lib.mesh import Mesh
from course_lib.model import preset
from course_lib.per_rank import activation_bytes_per_rank, data_parallel_state_bytes, layers_per_rank, params_per_rank
from course_lib.recipes import state_per_gpu
from course_lib.tensor_parallel import tp_step_traffic
from course_lib.virtual import run_rank

TINY, MOE = preset("tiny"), preset("tiny", num_experts=4)
SEQ, M = 16, 2

# (name, config, mesh, zero stage, the Job's other options; recompute: "selective" unless given)
WORLDS = [
    ("dp2 ddp", TINY, Mesh(dp=2), 0, {}),
    ("dp2 zero1", TINY, Mesh(dp=2), 1, {}),
    ("dp2 zero2", TINY, Mesh(dp=2), 2, {}),
    ("dp2 zero3", TINY, Mesh(dp=2), 3, {}),
    ("tp2", TINY, Mesh(tp=2), 1, {}),
    ("tp2 sp", TINY, Mesh(tp=2, dp=2), 1, {"sequence_parallel": True}),
    ("pp2 1f1b", TINY, Mesh(pp=2, dp=2), 1, {}),
    ("pp2 gpipe", TINY, Mesh(pp=2), 0, {"schedule": "gpipe"}),
    ("pp2 v2 tp2", TINY, Mesh(pp=2, tp=2, dp=2), 1, {"schedule": "interleaved", "num_chunks": 2}),
    ("pp2 v2 zero3", preset("tiny", num_layers=8), Mesh(pp=2, dp=2), 3, {"schedule": "interleaved", "num_chunks": 2}),
    ("cp2", TINY, Mesh(cp=2, dp=2), 1, {}),
    ("cp2 tp2 pp2", TINY, Mesh(cp=2, tp=2, pp=2), 3, {}),
    ("ep2", MOE, Mesh(dp=2, ep=2), 1, {}),
    ("ep2 cp2 pp2", MOE, Mesh(dp=2, cp=2, ep=4, pp=2), 1, {}),
    ("hsdp", TINY, Mesh.hybrid(dp_shard=2, dp_replicate=2), 3, {}),
    ("hsdp tp2 pp2 cp2", TINY, Mesh.hybrid(dp_shard=2, dp_replicate=2, tp=2, pp=2, cp=2), 3, {}),
    ("dp2 tp2 pp2 zero1", TINY, Mesh(dp=2, tp=2, pp=2), 1, {}),
    ("dp2 tp2 pp2 sp full vocab", TINY, Mesh(dp=2, tp=2, pp=2), 1,
     {"sequence_parallel": True, "recompute": "full", "vocab_parallel": True}),
    ("tp2 pp2 selective vocab", TINY, Mesh(tp=2, pp=2), 0, {"recompute": "selective", "vocab_parallel": True}),
    ("cp2 pp2 full", TINY, Mesh(cp=2, pp=2), 1, {"recompute": "full"}),
    ("dp2 tp2 pp2 sp op", TINY, Mesh(dp=2, tp=2, pp=2), 1, {"sequence_parallel": True, "recompute": "op"}),
    ("pp2 zb-h1 dp2", TINY, Mesh(pp=2, dp=2), 1, {"schedule": "zb-h1", "recompute": "none"}),
    ("pp2 v2 tp2 sp full", TINY, Mesh(pp=2, tp=2), 1,
     {"schedule": "interleaved", "num_chunks": 2, "recompute": "full", "sequence_parallel": True}),
]


@pytest.mark.parametrize("name, config, mesh, zero_stage, options", WORLDS, ids=[w[0] for w in WORLDS])
def test_virtual_measurement_planner_and_cost_formulas_agree(name, config, mesh, zero_stage, options):
    e = 2                                                        # bf16: the planner's "mixed" convention
    job = Job(config, mesh, seq_len=SEQ, num_microbatches=M, zero_stage=zero_stage,
              **{"recompute": "selective", **options})
    for stage in range(mesh.pp):
        rank = mesh.rank_of(pp=stage, dp=mesh.dp - 1, cp=mesh.cp - 1, tp=mesh.tp - 1)
        run = run_rank(job, rank)
        formula = run["formulas"]
        # per_rank: every measured number equals its formula
        assert run["sent_bytes"] == formula["sent_bytes"], name
        assert run["state_bytes"] == formula["state_bytes"], name
        if formula["activation_bytes_peak"] is not None:
            assert run["activation_bytes_peak"] == formula["activation_bytes_peak"], name
        measured = [item for item in run["measured"] if item.startswith("sent_bytes")]
        assert measured and run["computed"] in ([], ["state_bytes", "sent_bytes.dp"]), name
        # the planner: its state per GPU (mixed convention: 2 + 2 + 12 bytes) and its activation peak
        v = options.get("num_chunks", 1)
        vocab_parallel = options.get("vocab_parallel", False)
        assert run["state_bytes"] == data_parallel_state_bytes(job, stage), name
        assert state_per_gpu(config, mesh, zero_stage, "mixed", stage, vocab_parallel, v) == run["state_bytes"], name
        if not config.num_experts:
            planned = activation_bytes_per_rank(job, stage)
            assert run["activation_bytes_peak"] == planned["peak"], name
        # the cost model's TP traffic (what step_time charges per micro-batch), times the micro-batches
        layers = layers_per_rank(config, mesh, stage, v)
        if mesh.tp > 1 and not options.get("sequence_parallel") and not vocab_parallel:
            traffic = tp_step_traffic(config, 1, SEQ // mesh.cp, mesh.tp, e, num_layers=layers)
            assert run["sent_bytes"]["tp"] == M * traffic["wire_bytes_per_rank"], name
        # and below ZeRO-3 the weights it holds are params_per_rank's, whatever the axes
        if zero_stage < 3:
            assert run["state_bytes"]["weights"] == e * params_per_rank(config, mesh, stage, v, vocab_parallel), name


def test_every_axis_is_in_some_world():
    used = set()
    for name, config, mesh, zero_stage, options in WORLDS:
        used |= {axis for axis in ("dp", "tp", "pp", "cp", "ep") if getattr(mesh, axis) > 1}
        used |= {f"zero{zero_stage}"} | ({"hsdp"} if mesh.dp_replicate > 1 else set())
        used |= {key for key in ("sequence_parallel", "num_chunks", "vocab_parallel") if options.get(key)}
        used |= {options.get("schedule", "1f1b"), options.get("recompute", "selective")}
    assert used >= {"dp", "tp", "pp", "cp", "ep", "hsdp", "zero0", "zero1", "zero2", "zero3", "sequence_parallel",
                    "1f1b", "gpipe", "interleaved", "zb-h1", "num_chunks", "vocab_parallel", "selective", "op", "full"}
