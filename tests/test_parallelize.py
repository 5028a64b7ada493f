"""course_lib.parallelize: the one place the axes are combined. The job's errors name every broken rule at once;
it applies CP, TP, EP, the pipeline cut (v chunks too) and data parallelism in its order, on any rank of a fake
world; and the code that combines axes (virtual cluster, runs.mesh, lab parallel_3d) goes through it."""

import ast
from pathlib import Path

import pytest
import torch.nn as nn

from course_lib.context_parallel import ContextParallelAttention
from course_lib.ddp import NaiveDDP
from course_lib.hsdp import HybridShardedDataParallel
from course_lib.job import Job
from course_lib.mesh import Mesh, make_comms
from course_lib.model import build, preset
from course_lib.parallelize import parallelize
from course_lib.per_rank import params_per_rank
from course_lib.tensor_parallel import ColumnParallelLinear
from course_lib.virtual import fake_world
from course_lib.zero import ZeroDataParallel

REPO = Path(__file__).resolve().parents[1]
TINY = preset("tiny")


def test_the_job_names_every_rule_it_breaks_in_one_error():
    job = Job(TINY, Mesh(dp=4, cp=2, pp=2, dp_replicate=2), seq_len=16, micro_batch_size=1, num_microbatches=3,
              zero_stage=1, vocab_parallel=True, recompute="selective", num_chunks=3, sequence_parallel=True)
    with pytest.raises(ValueError) as error:
        job.check()
    message = str(error.value)
    for rule in ("dp_replicate 2 with zero_stage=1", "sequence_parallel with cp 2",
                 "pp 2 × num_chunks 3 = 6 virtual stages > 4 layers"):
        assert rule in message, rule
    assert message.count("; ") >= 2
    Job(TINY, Mesh(dp=2, tp=2, pp=2), seq_len=16, micro_batch_size=2, num_microbatches=2).check()   # a good one
    with pytest.raises(ValueError, match=r"recompute='some': one of none, selective, op, full"):
        Job(TINY, recompute="some").check()
    with pytest.raises(ValueError, match=r"schedule='zb-h1' with recompute='full': ZB-H1's W"):
        Job(TINY, Mesh(pp=2), schedule="zb-h1", recompute="full", num_microbatches=2).check()
    with pytest.raises(ValueError, match=r"reshard_after_forward=False with zero_stage=1: only ZeRO-3"):
        Job(TINY, Mesh(dp=2), zero_stage=1, reshard_after_forward=False).check()
    with pytest.raises(ValueError, match=r"the job describes .* build the model from job.config"):
        parallelize(build(TINY, device="meta"), Job(preset("tiny", num_layers=2)), {}, 0)


def test_a_typo_is_refused_before_anything_grows_with_it():
    """Issue 34's pp = 100,000 built the schedule after its rule had failed: the rules come first."""
    found = Job(TINY, Mesh(pp=100_000), num_microbatches=10**9).problems()
    assert found == ["num_microbatches=1000000000 must be a whole number from 1 to 1,048,576"]
    found = Job(TINY, Mesh(pp=100_000), num_microbatches=2).problems()
    assert any("100000" in problem for problem in found), found


def _parallelize(config, mesh, rank, **options):
    with fake_world(mesh.size, rank):
        job = Job(config, mesh, **options)
        return parallelize(build(config, device="meta"), job, make_comms(mesh, rank), rank)


def test_every_axis_is_applied_in_order_on_one_rank():
    mesh = Mesh(dp=2, cp=2, tp=2, pp=2)
    rank = mesh.rank_of(pp=1, dp=1, cp=1, tp=1)
    parallel = _parallelize(TINY, mesh, rank, zero_stage=1)
    attention = parallel.stage.layers[2].attn
    assert isinstance(attention, ContextParallelAttention)                    # 1. CP swapped the attention ...
    assert isinstance(attention.q_proj, ColumnParallelLinear)                 # 2. ... and TP split its projections
    assert [isinstance(layer, nn.Identity) for layer in parallel.stage.layers] == [True, True, False, False]   # 5.
    assert isinstance(parallel.data_parallel, ZeroDataParallel) and parallel.data_parallel.comm.size == 4   # dp·cp
    assert sum(p.numel() for p in parallel.stage.parameters()) == params_per_rank(TINY, mesh, 1)
    plain = _parallelize(TINY, Mesh(dp=2), 1)
    assert isinstance(plain.data_parallel, NaiveDDP) and plain.optimizer is None
    hybrid = _parallelize(TINY, Mesh.hybrid(dp_shard=2, dp_replicate=2), 3, zero_stage=3)
    assert isinstance(hybrid.data_parallel, HybridShardedDataParallel)
    assert hybrid.data_parallel.comm.size == hybrid.data_parallel.replicate_comm.size == 2
    moe = preset("tiny", num_experts=4)
    experts = _parallelize(moe, Mesh(dp=2, ep=2), 1, data_parallel=False)
    assert experts.data_parallel is None and len(experts.stage.layers[0].mlp.experts) == 2   # 3. EP: 4 / 2 each


def test_interleaved_chunks_are_cut_after_the_split():
    mesh = Mesh(pp=2, tp=2)
    parallel = _parallelize(TINY, mesh, mesh.rank_of(pp=1, tp=1), num_chunks=2, schedule="interleaved",
                            num_microbatches=2, zero_stage=1)
    assert isinstance(parallel.stage, nn.ModuleList) and len(parallel.stage) == 2
    kept = [[i for i, layer in enumerate(chunk.layers) if not isinstance(layer, nn.Identity)] for chunk in parallel.stage]
    assert kept == [[1], [3]]                                    # chunk c is virtual stage c·p + 1
    assert all(isinstance(chunk.layers[i].mlp.up_proj, ColumnParallelLinear) for chunk, [i] in zip(parallel.stage, kept))
    # ZeRO's units: each chunk's layer, and the last chunk's final norm and head (the embedding is stage 0's)
    assert [unit.name for unit in parallel.data_parallel.units] == ["0.layers.1", "1.layers.3", "1.norm", "1.head"]


@pytest.mark.parametrize("path", ["course_lib/virtual.py", "course_lib/runs/mesh.py", "labs/parallel_3d.py"])
def test_code_that_combines_axes_goes_through_parallelize(path):
    tree = ast.parse((REPO / path).read_text())
    called = {node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
              for node in ast.walk(tree) if isinstance(node, ast.Call)}
    techniques = {"apply_tp", "apply_context_parallel", "apply_ep", "make_stage", "ZeroDataParallel", "NaiveDDP",
                  "HybridShardedDataParallel", "parallelize_3d"}
    assert not called & techniques, called & techniques
    text = (REPO / path).read_text()
    assert "parallelize" in text
