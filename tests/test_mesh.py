"""3D parallelism: the dp × tp × pp grid (coordinates, groups, the same layout as torch's init_device_mesh),
its errors, a dp 2 × tp 2 × pp 2 training run on 8 ranks equal to one process, the exact state bytes and bytes
sent per axis, and the planner's three questions on the source's models."""


import pytest
import torch
import torch.distributed as dist

from course_lib import RankError, launch
from course_lib.mesh import Mesh, make_comms, params_per_rank, sent_bytes_per_rank
from course_lib.model import count_params, param_count_formula, preset
from course_lib.runs.mesh import global_losses, max_parameter_gap, train_3d, train_torch_2d
from course_lib.train import reference_run

pytestmark = pytest.mark.ranks   # run apart with: pytest -m ranks

GB = 10**9
# float64: the three splits change only the order of additions (TP's partial sums, the micro-batches' sum,
# the dp mean), ~1e-16 relative per op; measured ≤ 1e-13 on parameters after 3 Adam steps. Adam divides by
# sqrt(v), which can magnify a rounding difference on a near-zero gradient: 1e-9 stays far below any real
# mistake (a missing all-reduce, a wrong slice or a lost micro-batch moves values by > 1e-3).
F64 = 1e-9
STEPS, BATCH, SEQ = 3, 8, 16


# ------------------------------------------------------------------------------------------- the grid

def test_coordinates_put_tp_innermost_and_pp_outermost():
    mesh = Mesh(dp=2, tp=2, pp=2)
    assert [mesh.coords(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [mesh.coords(r)["pp"] for r in range(8)] == [0] * 4 + [1] * 4
    assert all(mesh.rank_of(**mesh.coords(r)) == r for r in range(8))
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for axis in ("tp", "dp", "pp"):   # each axis cuts the world into disjoint groups that cover it
        assert sorted(r for g in mesh.groups(axis) for r in g) == list(range(8))
    assert mesh.grid().tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def _groups_beside_torch(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = Mesh(dp=2, tp=2, pp=2)
    ours = make_comms(mesh, rank)
    theirs = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    assert theirs.mesh.tolist() == mesh.grid().tolist()
    return {axis: (dist.get_process_group_ranks(ours[axis].group),
                   dist.get_process_group_ranks(theirs.get_group(axis)), mesh.group_of(rank, axis))
            for axis in ("tp", "dp", "pp")}


def test_groups_match_torchs_init_device_mesh():
    for result in launch(_groups_beside_torch, 8, backend="gloo"):
        for axis, (ours, theirs, predicted) in result.items():
            assert sorted(ours) == sorted(theirs) == predicted, axis


def test_bad_meshes_name_every_factor():
    with pytest.raises(ValueError, match=r"world_size 6 != dp 2 × tp 2 × pp 2 = 8"):
        Mesh(dp=2, tp=2, pp=2).check(6)
    with pytest.raises(ValueError, match=r"world_size 6 is not divisible by tp 4 × pp 1 = 4"):
        Mesh.for_world(6, tp=4)
    assert Mesh.for_world(8, tp=2, pp=2) == Mesh(dp=2, tp=2, pp=2)
    with pytest.raises(ValueError, match=r"tp=0"):
        Mesh(tp=0)
    with pytest.raises(ValueError, match=r"16 attention heads \(num_heads\) cannot split over TP=3"):
        Mesh(tp=3).check_model(preset("tiny", num_heads=16, num_kv_heads=16, hidden=128, intermediate=192))
    with pytest.raises(ValueError, match=r"pp 5 stages > 4 layers"):
        Mesh(pp=5).check_model(preset("tiny"))
    with pytest.raises(ValueError, match=r"batch 6 is not divisible by dp 4"):
        Mesh(dp=4).check_model(preset("tiny"), batch_size=6)
    with pytest.raises(ValueError, match=r"batch of 4 \(= 8 / dp 2\) is not divisible by num_microbatches=3"):
        Mesh(dp=2).check_model(preset("tiny"), batch_size=8, num_microbatches=3)


def test_a_world_that_does_not_fit_the_mesh_fails_fast_on_every_rank():
    with pytest.raises(RankError, match=r"world_size 6 != dp 2 × tp 2 × pp 2 = 8"):
        launch(train_3d, 6, dp=2, tp=2, pp=2, timeout=30, backend="gloo")


# ------------------------------------------------------------------------------------ training in 3D

@pytest.fixture(scope="module")
def reference():
    """One process, the whole batch, the same seed: losses and parameters after STEPS Adam steps."""
    losses, model = reference_run(steps=STEPS, batch_size=BATCH, lr=1e-2, seq_len=SEQ, dtype=torch.float64)
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def run_2x2x2():
    return launch(train_3d, 8, dp=2, tp=2, pp=2, num_microbatches=2, steps=STEPS, batch_size=BATCH, seq_len=SEQ,
                  dtype=torch.float64, backend="gloo")


@pytest.mark.parametrize("layout", [(2, 2, 2), (1, 2, 2), (2, 1, 2), (2, 2, 1)], ids=lambda t: "dp%d-tp%d-pp%d" % t)
def test_3d_training_equals_one_process(layout, reference, run_2x2x2):
    dp, tp, pp = layout
    results = run_2x2x2 if layout == (2, 2, 2) else launch(
        train_3d, dp * tp * pp, dp=dp, tp=tp, pp=pp, num_microbatches=2, steps=STEPS, batch_size=BATCH,
        seq_len=SEQ, dtype=torch.float64, schedule="gpipe", backend="gloo")
    losses, state = reference
    assert max(abs(a - b) for a, b in zip(global_losses(results), losses)) <= F64
    assert max_parameter_gap(results, state) <= F64
    # every parameter of the unsplit model is held whole, or in tp pieces that add up to it
    held = {}
    for r in results:
        if r["coords"]["dp"] == 0:
            for name, p in r["params"].items():
                held.setdefault(name, set()).add((r["coords"]["tp"], p.numel()))
    assert held.keys() == state.keys()
    for name, pieces in held.items():
        whole = {numel for _, numel in pieces} == {state[name].numel()}
        assert whole or sum(numel for _, numel in pieces) == state[name].numel(), name


def test_each_rank_holds_exactly_its_share_of_the_state(run_2x2x2):
    config, mesh = preset("tiny"), Mesh(dp=2, tp=2, pp=2)
    for r in run_2x2x2:
        params = params_per_rank(config, mesh, r["coords"]["pp"])
        assert r["state_bytes"]["weights"] == r["state_bytes"]["grads"] == 8 * params
        assert r["state_bytes"]["optimizer"] == 2 * 8 * params   # Adam's m and v, float64
    assert params_per_rank(config, Mesh(), 0) == param_count_formula(config)   # one rank: the whole model


def test_bytes_sent_on_each_axis_equal_the_prediction(run_2x2x2):
    config, mesh = preset("tiny"), Mesh(dp=2, tp=2, pp=2)
    for r in run_2x2x2:
        predicted = sent_bytes_per_rank(config, mesh, r["coords"]["pp"], batch_size=BATCH, seq_len=SEQ,
                                        num_microbatches=2, bytes_per_element=8)
        assert r["sent_bytes"] == predicted
        layers = config.num_layers // mesh.pp
        assert r["ops"]["tp"] == {"all_reduce": 4 * layers * 2}   # 2 forward + 2 backward, per layer and micro-batch
    assert all(r["sent_bytes"]["tp"] > r["sent_bytes"]["pp"] for r in run_2x2x2)   # TP: every layer; PP: boundary


def test_a_tied_head_is_counted_once_on_one_stage():
    tied = preset("tiny", tie_embeddings=True)
    assert params_per_rank(tied, Mesh(), 0) == param_count_formula(tied) == count_params(tied)


def test_torchs_fsdp_with_tp_on_a_2d_mesh_gives_the_same_losses(reference, run_2x2x2):
    losses, _ = reference
    theirs = launch(train_torch_2d, 4, dp=2, tp=2, steps=STEPS, batch_size=BATCH, seq_len=SEQ, dtype=torch.float64,
                    backend="gloo")
    for rank_losses in theirs:
        assert max(abs(a - b) for a, b in zip(rank_losses, losses)) <= F64
        assert max(abs(a - b) for a, b in zip(rank_losses, global_losses(run_2x2x2))) <= F64


def test_the_lab_runs_under_torchrun_and_checks_its_bytes(tmp_path):
    """The instructors' path: torchrun starts the ranks, each runs train_3d in place, rank 0 reports."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               str(repo / "labs" / "parallel_3d.py"), "--tp", "2", "--pp", "2", "--steps", "2", "--out", str(tmp_path)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(repo)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "traced bytes = formula on every rank" in out.stdout
    assert (tmp_path / "parallel_3d.json").exists() and (tmp_path / "parallel_3d.png").exists()
