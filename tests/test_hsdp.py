"""HSDP (course_lib.hsdp): ZeRO-3 inside each replica, all-reduce across replicas. On 4 ranks (2 replicas of 2)
it trains like one process in float64, holds 1/dp_shard of the state, sends exactly hsdp_wire_bytes_per_step,
beside torch's fully_shard on a 2-D DeviceMesh; the mesh's groups match torch's; the virtual cluster runs it."""

import pytest
import torch
import torch.distributed as dist

from course_lib import launch
from course_lib.comm import wire_bytes
from course_lib.hsdp import hsdp_wire_bytes_per_step
from course_lib.job import Job
from course_lib.ledger import zero_state_bytes
from course_lib.mesh import Mesh
from course_lib.model import preset
from course_lib.per_rank import (
    data_parallel_bytes_per_step,
    data_parallel_parts,
    data_parallel_traffic,
    params_per_rank,
)
from course_lib.runs.mesh import global_losses, max_parameter_gap, train_3d, train_torch_hsdp
from course_lib.train import reference_run
from course_lib.virtual import fake_world, run_rank
from course_lib.zero_bytes import wire_bytes_per_step

F64 = 1e-9          # as tests/test_mesh.py: float64, the order of additions only
STEPS, BATCH, SEQ, M = 3, 8, 16, 2
TINY = preset("tiny")


def test_the_hybrid_mesh_splits_dp_into_replicas_of_shards():
    mesh = Mesh.hybrid(dp_shard=2, dp_replicate=2, tp=2)
    assert mesh == Mesh(dp=4, tp=2, dp_replicate=2) and mesh.dp_shard == 2
    assert repr(mesh) == "Mesh(dp=4, tp=2, pp=1, dp_replicate=2)" and mesh.axes == ("pp", "dp_replicate", "dp_shard", "tp")
    assert mesh.groups("dp_shard_cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]       # ZeRO-3 inside a replica
    assert mesh.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]      # the same shard, across replicas
    assert mesh.coords(5) == {"pp": 0, "dp": 2, "dp_replicate": 1, "dp_shard": 0, "tp": 1}
    assert all(mesh.rank_of(**{k: v for k, v in mesh.coords(r).items() if k != "dp"}) == r for r in range(8))
    assert mesh.grid().shape == (1, 2, 2, 2)
    with pytest.raises(ValueError, match=r"dp_replicate 3 does not divide dp 4"):
        Mesh(dp=4, dp_replicate=3)
    with pytest.raises(ValueError, match=r"world_size 6 != dp_replicate 2 × dp_shard 2 × tp 2 × pp 1 = 8"):
        mesh.check(6)
    with pytest.raises(ValueError, match=r"dp_replicate 2 with zero_stage=1: hybrid sharding is ZeRO-3"):
        Job(TINY, Mesh(dp=4, dp_replicate=2), zero_stage=1).check()


def test_the_groups_match_torchs_2d_device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = Mesh.hybrid(dp_shard=2, dp_replicate=2, cp=2)
    for rank in range(mesh.size):
        with fake_world(mesh.size, rank):
            theirs = init_device_mesh("cpu", (1, 2, 2, 2, 1), mesh_dim_names=mesh.axes)
            assert theirs.mesh.tolist() == mesh.grid().tolist()
            for axis in ("dp_replicate", "dp_shard"):
                assert sorted(dist.get_process_group_ranks(theirs[axis].get_group())) == mesh.group_of(rank, axis)
            shard_cp = theirs["dp_shard", "cp"]._flatten("dp_shard_cp")      # torchtitan's FSDP group under CP
            assert sorted(dist.get_process_group_ranks(shard_cp.get_group())) == mesh.group_of(rank, "dp_shard_cp")


def test_the_formula_is_zero3_inside_and_an_all_reduce_of_a_shard_across():
    psi = 8 * 10**6
    ops = hsdp_wire_bytes_per_step(psi, dp_shard=4, dp_replicate=2, accumulation_steps=3)
    zero3 = wire_bytes_per_step(psi, 3, 4, accumulation_steps=3)
    assert ops == {**zero3, "all_reduce": 2 * (2 - 1) / 2 * psi / 4}
    assert hsdp_wire_bytes_per_step(psi, 8, 1) == {**wire_bytes_per_step(psi, 3, 8), "all_reduce": 0}
    assert hsdp_wire_bytes_per_step(psi, 1, 8)["all_reduce"] == wire_bytes("all_reduce", psi, 8)   # S = 1: DDP
    # per group, with the consecutive ranks each spans (what a cost model needs to pick its link)
    mesh = Mesh.hybrid(dp_shard=4, dp_replicate=2, tp=2)                   # a replica: 4 × tp 2 = 8 ranks, a node
    params = params_per_rank(TINY, mesh, 0)
    inside, across = data_parallel_traffic(Job(TINY, mesh, zero_stage=3, num_microbatches=3, dtype="bf16"), 0)
    assert (inside["group"], inside["size"], inside["span"]) == ("dp_shard_cp", 4, 8)
    assert (across["group"], across["size"], across["span"]) == ("dp_replicate", 2, 16)
    assert {**inside["ops"], **across["ops"]} == hsdp_wire_bytes_per_step(2 * params, 4, 2, accumulation_steps=3)
    # fp32 gradients (Megatron's convention): the reductions move 4 bytes an element, the weights' gathers still 2
    fp32_grads = Job(TINY, mesh, zero_stage=3, num_microbatches=3, dtype="bf16", convention="bf16+fp32 grads")
    inside32, across32 = data_parallel_traffic(fp32_grads, 0)
    assert inside32["ops"]["all_gather"] == inside["ops"]["all_gather"]
    assert (inside32["ops"]["reduce_scatter"], across32["ops"]["all_reduce"]) == (
        2 * inside["ops"]["reduce_scatter"], 2 * across["ops"]["all_reduce"])


@pytest.fixture(scope="module")
def reference():
    losses, model = reference_run(steps=STEPS, batch_size=BATCH, lr=1e-2, seq_len=SEQ, dtype=torch.float64)
    return losses, model.state_dict()


@pytest.mark.ranks
def test_hsdp_at_4_ranks_equals_one_process_and_sends_the_formula(reference):
    mesh = Mesh.hybrid(dp_shard=2, dp_replicate=2)
    results = launch(train_3d, 4, dp=4, dp_replicate=2, zero_stage=3, num_microbatches=M, steps=STEPS,
                     batch_size=BATCH, seq_len=SEQ, dtype=torch.float64, backend="gloo")
    losses, state = reference
    assert max(abs(a - b) for a, b in zip(global_losses(results), losses)) <= F64
    assert max_parameter_gap(results, state) <= F64
    params = params_per_rank(TINY, mesh, 0)
    predicted = hsdp_wire_bytes_per_step(8 * params, 2, 2, accumulation_steps=M)
    fp64 = Job(TINY, mesh, zero_stage=3, num_microbatches=M, dtype="fp64")       # the run, described once
    assert sum(predicted.values()) == sum(data_parallel_bytes_per_step(fp64, 0).values())
    [(count, group, replicas)] = data_parallel_parts(TINY, mesh, 0)       # float64 state: 8 + 8 + 16 bytes
    assert (count, group, replicas) == (params, 2, 2)
    state_formula = zero_state_bytes(count, 3, group, weight_bytes=8, grad_bytes=8, optimizer_bytes=16)
    for r in results:
        inside = {op: t for op, t in predicted.items() if op != "all_reduce"}
        assert r["sent_bytes"]["dp"] == sum(inside.values())                 # traced over the shard group
        assert r["sent_bytes"]["dp_replicate"] == predicted["all_reduce"]    # traced over the replicate group
        assert r["ops"]["dp_replicate"] == {"all_reduce": TINY.num_layers + 3}   # one per unit: embed, layers, norm, head
        assert r["state_bytes"]["optimizer"] == state_formula["optimizer"] == 16 * params // 2   # 1/dp_shard
        assert r["state_bytes"]["grads"] == state_formula["grads"]


@pytest.mark.ranks
def test_torchs_fully_shard_on_a_2d_mesh_gives_the_same_losses_and_shards(reference):
    losses, _ = reference
    theirs = launch(train_torch_hsdp, 4, dp_shard=2, dp_replicate=2, steps=STEPS, batch_size=BATCH, seq_len=SEQ,
                    dtype=torch.float64, backend="gloo")
    for result in theirs:
        assert max(abs(a - b) for a, b in zip(result["losses"], losses)) <= F64
        assert result["params_held"] == params_per_rank(TINY, Mesh(), 0) // 2     # 1/dp_shard, not 1/4


def test_the_virtual_cluster_runs_hsdp_and_equals_the_formulas():
    mesh = Mesh.hybrid(dp_shard=2, dp_replicate=2, tp=2, pp=2)
    for stage in range(mesh.pp):
        job = Job(TINY, mesh, seq_len=16, num_microbatches=2, zero_stage=3, dtype="fp32", recompute="selective")
        run = run_rank(job, mesh.rank_of(pp=stage, dp_replicate=1, dp_shard=1))
        formula = run["formulas"]
        assert run["computed"] == [] and run["state_bytes"] == formula["state_bytes"]
        assert run["sent_bytes"] == formula["sent_bytes"]
        assert run["ops"]["dp"]["all_reduce"] == len(range(*run["layers"])) + (stage == 0) + 2 * (stage == 1)
        assert run["coords"]["dp_replicate"] == 1
