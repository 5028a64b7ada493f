"""3D parallelism: the dp × tp × pp grid (coordinates, groups, the same layout as torch's init_device_mesh),
its errors, a dp 2 × tp 2 × pp 2 training run on 8 ranks equal to one process, the exact state bytes and bytes
sent per axis, and the planner's three questions on the source's models."""


import pytest
import torch
import torch.distributed as dist

from course_lib import RankError, launch
from course_lib.job import Job
from course_lib.mesh import Mesh, make_comms
from course_lib.model import count_params, param_count_formula, preset
from course_lib.per_rank import params_per_rank, sent_bytes_per_rank
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
        job = Job(config, mesh, seq_len=SEQ, micro_batch_size=BATCH // (mesh.dp * 2), num_microbatches=2, dtype="fp64")
        predicted = sent_bytes_per_rank(job, r["coords"]["pp"])
        assert r["sent_bytes"] == predicted
        layers = config.num_layers // mesh.pp
        assert r["ops"]["tp"] == {"all_reduce": 4 * layers * 2}   # 2 forward + 2 backward, per layer and micro-batch
    assert all(r["sent_bytes"]["tp"] > r["sent_bytes"]["pp"] for r in run_2x2x2)   # TP: every layer; PP: boundary


def test_each_step_says_how_long_it_spent_in_collectives(run_2x2x2):
    """train_3d's collective_seconds: per step, the time inside its all-reduces, all-gathers and reduce-scatters
    (TP's and DP's here), some of every step and never more than the step; the pipeline's sends not among them."""
    for r in run_2x2x2:
        assert len(r["collective_seconds"]) == len(r["step_seconds"]) == STEPS
        assert all(0 < inside < step for inside, step in zip(r["collective_seconds"], r["step_seconds"]))
    pipeline = launch(train_3d, 2, pp=2, steps=2, return_params=False, backend="gloo")
    assert [r["collective_seconds"] for r in pipeline] == [[0, 0]] * 2 and pipeline[0]["ops"]["pp"]["send"] == 2


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


# ------------------------------------------------------------ beyond 3D: context (cp) and expert (ep) parallelism

def test_cp_sits_between_dp_and_tp_and_ep_is_carved_out_of_dp_times_cp():
    mesh = Mesh(dp=2, cp=2, tp=2, pp=2, ep=2)
    assert [mesh.coords(r)["tp"] for r in range(16)] == [0, 1] * 8
    assert [mesh.coords(r)["cp"] for r in range(16)] == [0, 0, 1, 1] * 4       # next to tp
    assert [mesh.coords(r)["pp"] for r in range(16)] == [0] * 8 + [1] * 8
    assert mesh.coords(13) == {"pp": 1, "dp": 1, "cp": 0, "tp": 1, "ep": 0}
    assert all(mesh.rank_of(**mesh.coords(r)) == r for r in range(16))
    assert mesh.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert mesh.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert mesh.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    # ep = 2 consecutive ranks of each dp_cp group (here one CP group); expert_dp: the same experts
    assert mesh.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert mesh.groups("expert_dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    for axis in ("pp", "dp", "cp", "tp", "dp_cp", "ep", "expert_dp"):   # disjoint groups that cover the world
        assert sorted(r for g in mesh.groups(axis) for r in g) == list(range(16)), axis
    assert mesh.grid().shape == (2, 2, 2, 2) and mesh.grid()[1, 1, 0, 1] == 13
    assert Mesh(dp=4, ep=4).groups("ep") == [[0, 1, 2, 3]] and Mesh(dp=4, ep=2).groups("ep") == [[0, 1], [2, 3]]
    # cp = ep = 1 is the 3-D mesh of before, print and all
    plain = Mesh(dp=2, tp=2, pp=2, cp=1, ep=1)
    assert plain == Mesh(dp=2, tp=2, pp=2) and repr(plain) == "Mesh(dp=2, tp=2, pp=2)"
    assert plain.coords(6) == {"pp": 1, "dp": 1, "tp": 0} and plain.grid().shape == (2, 2, 2)
    assert plain.groups("cp") == [[r] for r in range(8)] and plain.groups("dp_cp") == plain.groups("dp")
    assert repr(mesh) == "Mesh(dp=2, tp=2, pp=2, cp=2, ep=2)"


def test_cp_and_ep_groups_match_torchs_device_mesh():
    """Each rank of a fake 16-rank world (in this process): torch's init_device_mesh ("pp", "dp", "cp", "tp"),
    its flattened dp × cp, and torchtitan's EP construction (ep = dp_shard_in_ep × cp) give our groups."""
    from torch.distributed.device_mesh import init_device_mesh

    from course_lib.virtual import fake_world

    def ranks_of(device_mesh):
        return dist.get_process_group_ranks(device_mesh.get_group())

    grid, experts = Mesh(dp=2, cp=2, tp=2, pp=2), Mesh(dp=4, cp=2, tp=2, ep=4)
    for rank in range(16):
        with fake_world(16, rank):
            theirs = init_device_mesh("cpu", (2, 2, 2, 2), mesh_dim_names=("pp", "dp", "cp", "tp"))
            assert theirs.mesh.tolist() == grid.grid().tolist()
            for axis in ("pp", "dp", "cp", "tp"):
                assert sorted(ranks_of(theirs[axis])) == grid.group_of(rank, axis), (rank, axis)
            assert sorted(ranks_of(theirs["dp", "cp"]._flatten("dp_cp"))) == grid.group_of(rank, "dp_cp")
            # torchtitan: dp = dp_shard_mod_ep × dp_shard_in_ep, ep = dp_shard_in_ep × cp (here 2 × 2 × 2, tp 2)
            titan = init_device_mesh("cpu", (2, 2, 2, 2), mesh_dim_names=("mod_ep", "in_ep", "cp", "tp"))
            assert sorted(ranks_of(titan["in_ep", "cp"]._flatten("ep"))) == experts.group_of(rank, "ep")
            assert sorted(ranks_of(titan["mod_ep"])) == experts.group_of(rank, "expert_dp")


def test_bad_cp_and_ep_meshes_name_every_factor():
    with pytest.raises(ValueError, match=r"world_size 12 != dp 2 × cp 2 × tp 2 × pp 2 = 16"):
        Mesh(dp=2, cp=2, tp=2, pp=2).check(12)
    with pytest.raises(ValueError, match=r"ep 3 does not divide dp 2 × cp 2 = 4"):
        Mesh(dp=2, cp=2, ep=3)
    with pytest.raises(ValueError, match=r"world_size 12 is not divisible by cp 4 × tp 2 × pp 1 = 8"):
        Mesh.for_world(12, tp=2, cp=4)
    assert Mesh.for_world(16, tp=2, pp=2, cp=2, ep=2) == Mesh(dp=2, cp=2, tp=2, pp=2, ep=2)
    for bad in ({"cp": 0}, {"ep": 1.5}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}="):
            Mesh(**bad)
    with pytest.raises(ValueError, match=r"num_experts=8 cannot split over ep=3"):
        Mesh(dp=3, ep=3).check_model(preset("mixtral-8x7b"))
    with pytest.raises(ValueError, match=r"ep 2 needs a mixture of experts: this model has num_experts=0"):
        Mesh(dp=2, ep=2).check_model(preset("tiny"))
    # 100 divides by 2·cp = 4; by 2·cp = 6 it does not
    Mesh(cp=2).check_model(preset("tiny"), seq_len=100)
    with pytest.raises(ValueError, match=r"seq_len 100 is not divisible by 2·cp = 6 \(load-balanced context "):
        Mesh(cp=3).check_model(preset("tiny"), seq_len=100)
    assert Mesh(dp=2, ep=2).rank_of(dp=1, ep=1) == 1
    with pytest.raises(ValueError, match=r"ep 0 does not fit dp 1, cp 0: .* its ep coordinate is 1"):
        Mesh(dp=2, ep=2).rank_of(dp=1, ep=0)
    from course_lib.model import build
    from course_lib.parallelize import parallelize
    with pytest.raises(ValueError, match=r"ep 2 with a data-parallel wrapper"):
        moe = preset("tiny", num_experts=4)
        parallelize(build(moe, device="meta"), Job(moe, Mesh(dp=2, ep=2)), {}, 0)


@pytest.mark.parametrize("name, mesh", [("mixtral-8x7b", Mesh(dp=8, ep=8)), ("mixtral-8x7b", Mesh(dp=2, cp=2, ep=2, pp=4)),
                                        ("tiny-moe", Mesh(dp=2, ep=4, cp=2, pp=2))])
def test_params_per_rank_with_ep_counts_what_apply_ep_and_make_stage_keep(name, mesh):
    from course_lib.comm import Comm
    from course_lib.expert_parallel import apply_ep
    from course_lib.model import build
    from course_lib.pipeline_parallel import make_stage, partition_layers
    from course_lib.virtual import fake_world

    config = preset("tiny", num_experts=4) if name == "tiny-moe" else preset(name)
    for stage in range(mesh.pp):
        rank = mesh.rank_of(pp=stage, dp=mesh.dp - 1, cp=mesh.cp - 1)
        with fake_world(mesh.size, rank):
            model = apply_ep(build(config, device="meta"), Comm(dist.new_group(mesh.group_of(rank, "ep"))))
            held = make_stage(model, stage, partition_layers(config.num_layers, mesh.pp))
            assert sum(p.numel() for p in held.parameters()) == params_per_rank(config, mesh, stage)
    # the E - E/ep experts it does not hold, every layer: all that EP takes away (CP takes no weights away)
    whole, mine = params_per_rank(config, Mesh(pp=mesh.pp), 0), params_per_rank(config, mesh, 0)
    layers = config.num_layers // mesh.pp
    experts_away = config.num_experts - config.num_experts // mesh.ep
    assert whole - mine == layers * experts_away * 3 * config.hidden * config.intermediate


def test_activations_scale_by_one_over_cp_but_for_one_copy():
    """Every saved tensor of a layer is a token's, so each of cp ranks saves 1/cp of it; the one extra is
    o_proj's input, a copy of ring attention's output (per_rank.context_parallel_layer_terms). Llama-2-7B has
    kv_heads = heads, so the ring's K and V are the model's own; only the loss's 4-byte weight sum stays whole."""
    from course_lib.per_rank import activation_bytes_per_rank

    config, b, s, cp = preset("llama2-7b"), 1, 4096, 4
    whole, mine = (activation_bytes_per_rank(Job(config, mesh, seq_len=s, micro_batch_size=b), 0)["per_microbatch"]
                   for mesh in (Mesh(), Mesh(cp=cp)))
    o_proj_copies = config.num_layers * b * (s // cp) * config.hidden * 2
    assert mine == (whole - 4) // cp + 4 + o_proj_copies
    assert mine < whole / cp * 1.15


def test_bytes_sent_gain_cp_and_ep_entries():
    """The ring's K/V and its dK/dV, and the all-to-alls, from their definitions: Llama-2-70B over cp 4 and
    tp 8 (1 of 8 KV heads per rank), Mixtral 8x7B over ep 8 (capacity = all of a rank's tokens: nothing dropped)."""
    big, m, b = preset("llama2-70b"), 4, 2                      # b sequences per micro-batch and dp rank
    mesh = Mesh(dp=2, cp=4, tp=8, pp=4)
    sent = sent_bytes_per_rank(Job(big, mesh, seq_len=4096, micro_batch_size=b, num_microbatches=m), 1)
    block = 2 * b * (big.num_kv_heads // 8) * (4096 // 4) * big.head_dim      # K and V of one rank, values
    per_layer = 2 * 3 * block * 2 + 4 * block * 4              # cp-1 bf16 hops forward and backward; cp of fp32 dK/dV
    assert sent["cp"] == (big.num_layers // 4) * m * per_layer
    assert sent["tp"] == 4 * 20 * m * 2 * 7 / 8 * (b * 1024 * big.hidden * 2)   # activations of s/cp tokens
    assert set(sent) == {"tp", "pp", "dp", "cp"}
    moe, ep = preset("mixtral-8x7b"), Mesh(dp=8, ep=8)
    sent = sent_bytes_per_rank(Job(moe, ep, seq_len=4096, micro_batch_size=8 * m // (ep.dp * m), num_microbatches=m,
                                   data_parallel=False), 0)
    tokens = 1 * 4096
    assert sent["ep"] == 4 * moe.num_layers * m * 7 / 8 * (8 * tokens * moe.hidden * 2)
    experts = moe.num_layers * 1 * 3 * moe.hidden * moe.intermediate             # 8 experts / ep 8 = 1 per layer
    dense = params_per_rank(moe, ep, 0) - experts
    assert sent["dp"] == 2 * 7 / 8 * dense * 2       # the experts: their expert_dp group is this rank alone, 0 bytes
    assert set(sent_bytes_per_rank(Job(preset("tiny"), Mesh(dp=2), seq_len=8), 0)) \
        == {"tp", "pp", "dp"}


def _cp_tp_gradients(rank, world_size):
    """One forward and backward of the tiny model in float64 on a cp 2 × tp 2 mesh, split by parallelize:
    each rank's loss over its half of the tokens, and the gradients of the weights TP leaves whole, averaged over
    dp_cp (the two CP ranks)."""
    from course_lib.context_parallel import shard_sequence
    from course_lib.model import build, loss_fn
    from course_lib.parallelize import parallelize

    mesh = Mesh(cp=2, tp=2)
    comms = make_comms(mesh, rank)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    job = Job(preset("tiny"), mesh, seq_len=16, dtype="fp64")
    wrapper = parallelize(build(job.config, dtype=torch.float64), job, comms, rank).data_parallel
    inputs, targets = (shard_sequence(t, comms["cp"], dim=1) for t in (tokens[:, :-1], tokens[:, 1:]))
    loss = loss_fn(wrapper.module(inputs), targets)
    loss.backward()
    wrapper.finish_gradient_sync()
    whole = {name: p.grad for name, p in wrapper.module.named_parameters() if "norm" in name or "embed" in name}
    return {"loss": loss.item(), "grads": whole, "tokens": tokens}


def test_parallelize_with_cp_and_tp_equals_one_process():
    from course_lib.model import build, loss_fn

    results = launch(_cp_tp_gradients, 4, backend="gloo")
    tokens = results[0]["tokens"]
    model = build(preset("tiny"), dtype=torch.float64)
    loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    for cp_pair in ((0, 2), (1, 3)):                       # each TP index: its two CP ranks hold half the tokens each
        assert abs(sum(results[r]["loss"] for r in cp_pair) / 2 - loss.item()) <= F64
    reference = dict(model.named_parameters())
    for result in results:
        assert len(result["grads"]) == 2 + 2 * 4               # embed, final norm, two norms per layer
        for name, grad in result["grads"].items():
            assert torch.allclose(grad, reference[name].grad, rtol=0, atol=1e-12), name


@pytest.mark.parametrize("coords, rule", [(dict(tp=2), "tp=2: a coordinate on an axis of 2 runs from 0 to 1"),
                                          (dict(dp=-1), "dp=-1: a coordinate on an axis of 2 runs from 0 to 1"),
                                          (dict(pp=1.0), "pp=1.0: a coordinate on an axis of 1 runs from 0 to 0")])
def test_a_coordinate_off_the_grid_is_refused_not_wrapped_to_another_rank(coords, rule):
    with pytest.raises(ValueError) as refused:          # tp=2 on tp 2 would otherwise be rank 2: dp 1, tp 0
        Mesh(dp=2, tp=2).rank_of(**coords)
    assert rule in str(refused.value)


@pytest.mark.parametrize("keywords, rule", [(dict(steps=0), "steps=0 must be a whole number >= 1"),
                                            (dict(steps=2.5), "steps=2.5 must be a whole number >= 1"),
                                            (dict(batch_size="8"), "batch_size='8' must be a whole number >= 1"),
                                            (dict(dtype="bf16"), "dtype='bf16': a torch.dtype such as torch.float64")])
def test_train_3d_refuses_a_bad_run_length_or_batch_before_anything_starts(keywords, rule):
    with pytest.raises(ValueError, match=None) as refused:     # no process group: refused before it is needed
        train_3d(0, 1, **keywords)
    assert rule in str(refused.value)


@pytest.mark.parametrize("call, rule", [(lambda: Mesh.for_world(8, tp=0), "tp=0 must be a whole number >= 1"),
                                        (lambda: Mesh.for_world("8"), "world_size='8' must be a whole number >= 1"),
                                        (lambda: Mesh(dp=True), "dp=True: each degree of parallelism"),
                                        (lambda: Mesh().check("1"), "world_size '1' != dp 1")])
def test_a_world_size_or_degree_that_is_no_whole_number_is_refused_by_name(call, rule):
    with pytest.raises(ValueError) as refused:
        call()
    assert rule in str(refused.value)
