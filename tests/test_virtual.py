"""course_lib.virtual: one rank of a big world, run on torch's fake process group with meta tensors, holds and
sends exactly what the course's formulas say, for every kind of rank (first, middle, last stage).

Exact, not approximate: state (ledger.zero_state_bytes of per_rank.params_per_rank, when dp divides every ZeRO
unit), saved activations (per_rank.activation_bytes_per_rank, rotary tables included: 4·s·(h_d/2)·4 bytes per
layer, whole on every TP rank), bytes sent on each axis (per_rank.sent_bytes_per_rank, zero_bytes.wire_bytes_per_step).
The one approximation is ZeRO's padding: each unit is padded to a multiple of dp, so where dp does not divide
it the run holds and sends up to dp - 1 parameters more per unit than the formulas, which count none
(test_padding_is_the_only_gap bounds it). Sequence parallelism runs too; only its pipeline bytes are computed.
"""

import pytest
import torch
import torch.distributed as dist

from course_lib import launch
from course_lib.comm import Comm
from course_lib.job import Job
from course_lib.ledger import zero_state_bytes
from course_lib.measure import SavedActivations, measure_state_bytes
from course_lib.mesh import Mesh
from course_lib.model import build, loss_fn, preset
from course_lib.per_rank import activation_bytes_per_rank, params_per_rank, sent_bytes_per_rank
from course_lib.pipeline_parallel import partition_layers
from course_lib.tensor_parallel import check_tp_divisible, tp_step_traffic
from course_lib.virtual import MetaFlashAttention, fake_world, main, run_rank
from course_lib.zero import ZeroDataParallel
from course_lib.zero_bytes import wire_bytes_per_step

TINY = preset("tiny")           # 4 layers: over 3 stages, 2 + 1 + 1
LLAMA_70B = preset("llama2-70b")


def job(config, mesh, **options) -> Job:
    """A Job with ZeRO-1 and selective recomputation (the command line's defaults) unless ``options`` say otherwise."""
    return Job(config, mesh, **{"zero_stage": 1, "recompute": "selective", **options})


def assert_equals_formulas(config, mesh, rank, *, seq_len, micro_batch_size=1, num_microbatches=1, zero_stage=1,
                           schedule="1f1b", dtype="bf16"):
    """Run ``rank`` virtually; every number it measures equals the course's formula for it."""
    described = job(config, mesh, seq_len=seq_len, micro_batch_size=micro_batch_size,
                    num_microbatches=num_microbatches, zero_stage=zero_stage, schedule=schedule, dtype=dtype)
    run = run_rank(described, rank)
    stage, m, e = mesh.coords(rank)["pp"], num_microbatches, described.bytes_per_element
    layers = partition_layers(config.num_layers, mesh.pp)[stage]
    params = params_per_rank(config, mesh, stage)
    assert run["coords"] == {"dp": mesh.coords(rank)["dp"], "tp": mesh.coords(rank)["tp"], "pp": stage}
    assert run["layers"] == [layers.start, layers.stop]
    adam = 8 if dtype == "fp32" else 12            # torch's Adam (m, v) or MixedPrecisionAdam (+ an fp32 master)
    state = zero_state_bytes(params, zero_stage, mesh.dp, weight_bytes=e, grad_bytes=e, optimizer_bytes=adam)
    assert run["state_bytes"] == state
    activations = activation_bytes_per_rank(described, stage)
    assert run["microbatches_in_flight"] == (m if schedule == "gpipe" else min(mesh.pp - stage, m))
    assert run["activation_bytes_per_microbatch"] == activations["per_microbatch"]
    assert run["activation_bytes_peak"] == activations["peak"]
    sent = sent_bytes_per_rank(described, stage)
    dp_ops = wire_bytes_per_step(params * e, zero_stage, mesh.dp, accumulation_steps=m)
    assert run["sent_bytes"] == {"tp": sent["tp"], "pp": sent["pp"], "dp": sum(dp_ops.values())}
    # Counts: 4 TP all-reduces per layer and micro-batch; one send per micro-batch and direction that has a
    # neighbour (and as many receives); one reduction (and gather) per ZeRO unit: embed, layers, norm + head (a
    # tied head is in embed's unit).
    neighbours = (stage > 0) + (stage < mesh.pp - 1)
    units = len(layers) + (stage == 0) + (2 - config.tie_embeddings) * (stage == mesh.pp - 1)
    assert run["ops"]["tp"] == ({"all_reduce": 4 * len(layers) * m} if mesh.tp > 1 else {})
    assert run["ops"]["pp"] == ({"send": m * neighbours, "recv": m * neighbours} if neighbours else {})
    if mesh.dp > 1 and zero_stage == 1:
        assert run["ops"]["dp"] == {"reduce_scatter": units, "all_gather": units}
    assert run["measured"] == ["state_bytes", "activation_bytes_peak", "sent_bytes", "ops"]
    assert run["formulas"]["state_bytes"] == run["state_bytes"]
    return run


@pytest.mark.parametrize("rank_kind", ["first", "middle", "last"])
def test_tiny_ranks_equal_the_formulas(rank_kind):
    mesh = Mesh(dp=2, tp=2, pp=3)
    stage = {"first": 0, "middle": 1, "last": 2}[rank_kind]
    assert_equals_formulas(TINY, mesh, mesh.rank_of(pp=stage, dp=1, tp=1), seq_len=16, num_microbatches=4)


@pytest.mark.parametrize("rank", [5, 37, 127], ids=["first stage", "middle stage", "last stage"])
def test_llama2_70b_at_dp4_tp8_pp4_equals_the_formulas(rank):
    run = assert_equals_formulas(LLAMA_70B, Mesh(dp=4, tp=8, pp=4), rank, seq_len=4096, num_microbatches=16)
    print(f"rank {rank} of 128: {run['seconds']:.1f} s")


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_every_zero_stage_and_gpipe_equal_the_formulas(zero_stage):
    mesh = Mesh(dp=2, tp=2, pp=2)
    for stage in range(mesh.pp):
        assert_equals_formulas(TINY, mesh, mesh.rank_of(pp=stage), seq_len=16, num_microbatches=3,
                               zero_stage=zero_stage, schedule="gpipe", dtype="fp32")


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_tied_embeddings_equal_the_formulas(zero_stage):
    """A tied head holds no weight of its own (params_per_rank) and, at ZeRO-3, gathers the embedding's unit again
    for its forward (zero.borrowers): a Llama 3.2, or a Megatron GPT at TP 1, failed at the shared weight."""
    tied, mesh, m = preset("tiny", tie_embeddings=True), Mesh(dp=4), 3
    if zero_stage == 1:
        assert_equals_formulas(tied, mesh, 1, seq_len=16, num_microbatches=m, dtype="fp32")
        return
    described = job(tied, mesh, seq_len=16, num_microbatches=m, zero_stage=3, dtype="fp32")
    run = run_rank(described, 1)
    table = tied.vocab_size * tied.hidden * 4
    gathers = wire_bytes_per_step(params_per_rank(tied, mesh, 0) * 4, 3, mesh.dp, accumulation_steps=m)
    assert run["sent_bytes"]["dp"] == sent_bytes_per_rank(described, 0)["dp"] == (
        sum(gathers.values()) + m * 3 / 4 * table)                       # one more gather of the table a micro-batch
    assert run["state_bytes"] == run["formulas"]["state_bytes"]
    assert run["activation_bytes_peak"] == run["formulas"]["activation_bytes_peak"]
    # the extra gather on the dense part's group only: a mixture's experts, HSDP's shard group (a review found both)
    for config, mesh in ((preset("tiny", num_experts=4, top_k=2, tie_embeddings=True), Mesh(dp=4)),
                         (tied, Mesh(dp=4, dp_replicate=2))):
        described = job(config, mesh, seq_len=16, num_microbatches=m, zero_stage=3, dtype="fp32")
        assert run_rank(described, 0)["sent_bytes"]["dp"] == sent_bytes_per_rank(described, 0)["dp"]


def test_one_rank_of_a_4096_rank_world():
    mesh = Mesh(dp=64, tp=8, pp=8)
    run = assert_equals_formulas(LLAMA_70B, mesh, mesh.rank_of(pp=5, dp=33, tp=3), seq_len=4096,
                                 num_microbatches=16)
    print(f"one rank of {mesh.size}: {run['seconds']:.1f} s")


def test_padding_is_the_only_gap():
    """dp = 3 divides no unit of the tiny model split over tp = 2: each unit holds up to 2 parameters more."""
    mesh, e = Mesh(dp=3, tp=2, pp=2), 2
    for stage in range(mesh.pp):
        run = run_rank(job(TINY, mesh, seq_len=16, num_microbatches=3), mesh.rank_of(pp=stage))
        units = len(partition_layers(TINY.num_layers, mesh.pp)[stage]) + (stage == 0) + 2 * (stage == 1)
        formula = run["formulas"]
        assert run["state_bytes"] != formula["state_bytes"]           # the case really has padding
        for part, per_param in (("weights", e), ("grads", e), ("optimizer", 12)):
            gap = run["state_bytes"][part] - formula["state_bytes"][part]
            assert 0 <= gap < per_param * (mesh.dp - 1) * units, part
        gap = run["sent_bytes"]["dp"] - formula["sent_bytes"]["dp"]
        assert 0 < gap < 2 * e * (mesh.dp - 1) * units
        assert run["sent_bytes"]["tp"] == formula["sent_bytes"]["tp"]
        assert run["activation_bytes_peak"] == formula["activation_bytes_peak"]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["TP", "TP+SP"])
def test_recomputation_and_the_split_vocabulary_run_and_equal_the_formulas(sequence_parallel):
    """apply_checkpointing and apply_tp(..., vocab_parallel=True) for real, with the SP hand-off between stages:
    nothing is computed; the peak (most held + the largest rerun), the state and every axis's bytes equal
    per_rank's formulas, the reruns' TP collectives included."""
    mesh, m = Mesh(dp=2, tp=2, pp=2), 2
    runs = {recompute: run_rank(job(TINY, mesh, seq_len=16, num_microbatches=m, recompute=recompute,
                                    sequence_parallel=sequence_parallel, vocab_parallel=True), 0)
            for recompute in ("none", "selective", "op", "full")}
    for recompute, run in runs.items():
        assert run["computed"] == [], recompute
        formula = run["formulas"]
        for key in ("activation_bytes_peak", "activation_bytes_per_microbatch", "state_bytes"):
            assert run[key] == formula[key], (recompute, key)
        assert run["sent_bytes"]["tp"] == formula["sent_bytes"]["tp"], recompute
        assert run["sent_bytes"]["pp"] == formula["sent_bytes"]["pp"], recompute
    peaks = [runs[recompute]["activation_bytes_peak"] for recompute in ("full", "op", "selective", "none")]
    assert peaks == sorted(set(peaks))                  # each policy keeps less than the next
    assert runs["full"]["sent_bytes"]["tp"] > runs["none"]["sent_bytes"]["tp"]   # a rerun block's collectives
    assert runs["selective"]["sent_bytes"]["tp"] == runs["none"]["sent_bytes"]["tp"]   # the core talks to nobody
    plain = run_rank(job(TINY, mesh, seq_len=16, num_microbatches=m, sequence_parallel=sequence_parallel), 0)
    assert runs["none"]["state_bytes"]["total"] < plain["state_bytes"]["total"]   # V/tp rows of embedding and head
    if sequence_parallel:      # the stages pass s/tp of the sequence
        assert runs["none"]["sent_bytes"]["pp"] == run_rank(job(TINY, mesh, seq_len=16, num_microbatches=m), 0)[
            "sent_bytes"]["pp"] / mesh.tp


@pytest.mark.parametrize("rank_kind", ["first", "middle", "last"])
def test_sequence_parallelism_runs_and_equals_the_formulas(rank_kind):
    """apply_tp(..., sequence_parallel=True) for real: the activation peak and the TP group's bytes measured, equal
    to per_rank.activation_bytes_per_rank and tensor_parallel.tp_step_traffic; the layers send what plain TP sends."""
    mesh, m, e = Mesh(dp=2, tp=2, pp=3), 4, 2
    stage = {"first": 0, "middle": 1, "last": 2}[rank_kind]
    rank = mesh.rank_of(pp=stage, dp=1, tp=1)
    plain = run_rank(job(TINY, mesh, seq_len=16, num_microbatches=m), rank)
    sp_job = job(TINY, mesh, seq_len=16, num_microbatches=m, sequence_parallel=True)
    sp = run_rank(sp_job, rank)
    layers = len(partition_layers(TINY.num_layers, mesh.pp)[stage])
    formula = sp["formulas"]
    assert sp["activation_bytes_peak"] == formula["activation_bytes_peak"] == activation_bytes_per_rank(
        sp_job, stage)["peak"]
    assert sp["activation_bytes_per_microbatch"] == formula["activation_bytes_per_microbatch"]
    assert sp["activation_bytes_peak"] < plain["activation_bytes_peak"]
    assert sp["state_bytes"] == plain["state_bytes"]
    assert sp["sent_bytes"]["tp"] == formula["sent_bytes"]["tp"] and sp["sent_bytes"]["dp"] == plain["sent_bytes"]["dp"]
    # per micro-batch: 4 all-gathers + 4 reduce-scatters per layer (plain TP's 4 all-reduces, the same bytes), an
    # all-gather at the first stage's start (backward) and the last stage's end (forward): the stages pass slices;
    # an all-reduce of each norm's weight gradient
    ends = (stage == 0) + (stage == mesh.pp - 1)
    assert sp["ops"]["tp"] == {"all_gather": m * (4 * layers + ends), "reduce_scatter": m * 4 * layers,
                               "all_reduce": m * 2 * layers}
    traffic = tp_step_traffic(TINY, 1, 16, mesh.tp, e, sequence_parallel=True, num_layers=layers, stage=stage,
                              num_stages=mesh.pp)
    assert m * traffic["layers_wire_bytes"] == plain["sent_bytes"]["tp"]
    assert sp["sent_bytes"]["tp"] == m * traffic["wire_bytes_per_rank"]


def test_meta_attention_saves_what_a_cpu_run_saves():
    """On meta, torch would run SDPA's math path (s×s scores saved); MetaFlashAttention runs the CPU kernel's."""
    saved = {}
    for device in ("cpu", "meta"):
        model = build(TINY, device=device, dtype=torch.bfloat16)
        tokens = torch.zeros(2, 16, dtype=torch.long, device=device)
        with MetaFlashAttention(), SavedActivations(model) as activations:
            loss_fn(model(tokens), tokens)
        saved[device] = activations.by_module
    assert saved["meta"] == saved["cpu"]


def test_meta_state_counts_numel_times_element_size_once_per_storage():
    model = build(TINY, device="meta", dtype=torch.bfloat16)
    state = measure_state_bytes(model)
    assert state["weights"] == 2 * sum(p.numel() for p in model.parameters())
    assert state == measure_state_bytes(build(TINY, dtype=torch.bfloat16))
    whole = torch.empty(10, device="meta")
    views = torch.nn.ParameterList([torch.nn.Parameter(whole[:4]), torch.nn.Parameter(whole[4:])])
    assert measure_state_bytes(views)["weights"] == whole.nbytes     # views of one storage: counted once


@pytest.mark.parametrize("argv, real_check", [
    (["--world-size", "100", "--tp", "8", "--pp", "4"], lambda: Mesh.for_world(100, tp=8, pp=4)),
    (["--dp", "2", "--tp", "16", "--pp", "1"], lambda: check_tp_divisible(LLAMA_70B, 16)),
    (["--dp", "1", "--tp", "1", "--pp", "100"], lambda: Mesh(pp=100).check_model(LLAMA_70B)),
    (["--dp", "4", "--tp", "8", "--pp", "4", "--rank", "128"], lambda: Mesh(dp=4, tp=8, pp=4).coords(128)),
], ids=["world does not factor", "more TP than KV heads", "more stages than layers", "no such rank"])
def test_bad_input_gets_the_real_runs_one_line_error(argv, real_check, capsys):
    with pytest.raises(ValueError) as real:
        real_check()
    assert main(["--preset", "llama2-70b", "--seq-len", "16", *argv]) == 2
    assert capsys.readouterr().err == f"error: {real.value}\n"
    assert not dist.is_initialized()


def test_command_line_prints_one_json_object(capsys):
    import json
    assert main(["--preset", "tiny", "--dp", "2", "--tp", "2", "--pp", "2", "--rank", "7", "--seq-len", "16",
                 "--num-microbatches", "2", "--zero-stage", "1", "--dtype", "fp32", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert run["rank"] == 7 and run["coords"] == {"dp": 1, "tp": 1, "pp": 1}
    assert set(run["state_bytes"]) == {"weights", "grads", "optimizer", "total"}
    assert set(run["sent_bytes"]) == set(run["ops"]) == {"tp", "pp", "dp"}
    assert run["state_bytes"]["weights"] == 4 * params_per_rank(TINY, Mesh(dp=2, tp=2, pp=2), 1)


def test_fake_world_is_gone_afterwards_and_refuses_a_second():
    with fake_world(4, 1):
        assert dist.get_world_size() == 4 and dist.get_rank() == 1
        with pytest.raises(RuntimeError, match="already exists"):
            with fake_world(4, 2):
                pass
    assert not dist.is_initialized()


# ------------------------------------------------------------- the change it needed in ZeroDataParallel

def _all_backwards_inside_no_sync(rank, world_size):
    """Per stage: every micro-step's backward inside no_sync(), then finish_gradient_sync() (as a pipeline
    must), against the usual way (the last backward outside). float64 and SGD: the same sums, same order."""
    config = preset("tiny", num_layers=2)
    tokens = torch.randint(0, config.vocab_size, (4, 8), generator=torch.Generator().manual_seed(rank))
    results = {}
    for stage in range(4):
        for pipeline_way in (False, True):
            model = ZeroDataParallel(build(config, dtype=torch.float64), Comm(), zero_stage=stage,
                                     optimizer_class=torch.optim.SGD, lr=0.1)
            for step in range(2):
                with model.no_sync():
                    loss_fn(model(tokens[:2]), tokens[:2]).backward()
                    if pipeline_way:
                        loss_fn(model(tokens[2:]), tokens[2:]).backward()
                if pipeline_way:
                    model.finish_gradient_sync()
                else:
                    loss_fn(model(tokens[2:]), tokens[2:]).backward()
                model.step()
            results[stage, pipeline_way] = model.full_parameters()
    return results


@pytest.mark.ranks
def test_finish_gradient_sync_equals_the_last_backward_outside_no_sync():
    for results in launch(_all_backwards_inside_no_sync, 2, timeout=120):
        for stage in range(4):
            assert torch.equal(results[stage, True], results[stage, False]), stage


# ------------------------------------------------------------ beyond 3D: context (cp) and expert (ep) parallelism

@pytest.mark.parametrize("rank_kind", ["first", "last"])
def test_a_context_parallel_rank_runs_ring_attention_and_equals_the_formulas(rank_kind):
    """cp 2 on the tiny model with dp, tp and pp: every number measured (none computed), equal to the formulas;
    the ring sends K/V cp-1 times forward and backward and dK/dV cp times, per layer and micro-batch."""
    mesh, m, cp = Mesh(dp=2, cp=2, tp=2, pp=2), 2, 2
    stage = {"first": 0, "last": 1}[rank_kind]
    rank = mesh.rank_of(pp=stage, dp=1, cp=1, tp=1)
    run = run_rank(job(TINY, mesh, seq_len=16, num_microbatches=m), rank)
    formula = run["formulas"]
    assert run["coords"] == {"dp": 1, "tp": 1, "pp": stage, "cp": 1}
    assert run["measured"] == ["state_bytes", "activation_bytes_peak", "sent_bytes", "ops"] and run["computed"] == []
    assert run["state_bytes"] == formula["state_bytes"]           # ZeRO-1 over the dp × cp = 4 ranks
    assert run["state_bytes"]["optimizer"] == 12 * params_per_rank(TINY, mesh, stage) // 4
    assert run["activation_bytes_peak"] == formula["activation_bytes_peak"]
    assert run["activation_bytes_per_microbatch"] == formula["activation_bytes_per_microbatch"]
    assert run["sent_bytes"] == formula["sent_bytes"] and set(run["sent_bytes"]) == {"tp", "pp", "dp", "cp"}
    layers = len(partition_layers(TINY.num_layers, mesh.pp)[stage])
    hops = (cp - 1) + (cp - 1) + cp
    assert run["ops"]["cp"] == {"send": hops * layers * m, "recv": hops * layers * m}
    block = 2 * 1 * (TINY.num_kv_heads // mesh.tp) * (16 // cp) * TINY.head_dim     # K and V of one rank
    assert run["sent_bytes"]["cp"] == layers * m * ((cp - 1) * block * 2 * 2 + cp * block * 4)
    plain = Mesh(dp=2, tp=2, pp=2)                               # the same rank without cp: twice the tokens
    whole = run_rank(job(TINY, plain, seq_len=16, num_microbatches=m), plain.rank_of(pp=stage, dp=1, tp=1))
    assert run["activation_bytes_peak"] < whole["activation_bytes_peak"]


def test_a_context_parallel_rank_of_llama2_70b():
    mesh = Mesh(dp=2, cp=4, tp=8, pp=4)
    run = run_rank(job(LLAMA_70B, mesh, seq_len=4096, num_microbatches=2), mesh.rank_of(pp=1, dp=1, cp=2, tp=5))
    formula = run["formulas"]
    assert run["computed"] == [] and run["state_bytes"] == formula["state_bytes"]
    assert run["activation_bytes_peak"] == formula["activation_bytes_peak"]
    assert run["sent_bytes"] == formula["sent_bytes"]
    print(f"cp rank of {mesh.size}: {run['seconds']:.1f} s")


@pytest.mark.parametrize("config, mesh, seq_len", [
    (preset("tiny", num_experts=4), Mesh(dp=2, cp=2, pp=2, ep=4), 16),
    (preset("mixtral-8x7b", num_layers=4), Mesh(dp=8, ep=8, pp=2), 4096),
], ids=["tiny MoE, dp 2 × cp 2 × pp 2, ep 4", "Mixtral 8x7B (4 layers), dp 8 × pp 2, ep 8"])
def test_an_expert_parallel_rank_runs_apply_ep_and_labels_what_it_computes(config, mesh, seq_len):
    """apply_ep for real: the all-to-alls measured, equal to expert_parallel.all_to_all_bytes; the state and the dp bytes
    computed (experts and the rest average over different groups) and labelled so; activations measured only."""
    m = 2
    for stage in range(mesh.pp):
        rank = mesh.rank_of(pp=stage, dp=mesh.dp - 1, cp=mesh.cp - 1)
        run = run_rank(job(config, mesh, seq_len=seq_len, num_microbatches=m), rank)
        formula = run["formulas"]
        layers = len(partition_layers(config.num_layers, mesh.pp)[stage])
        assert run["coords"]["ep"] == mesh.ep - 1
        assert run["computed"] == ["state_bytes", "sent_bytes.dp"]
        axes = ["tp", "pp"] + ["cp"] * (mesh.cp > 1) + ["ep"]
        assert run["measured"] == ["activation_bytes_peak", ", ".join(f"sent_bytes.{a}" for a in axes), "ops"]
        assert run["sent_bytes"] == formula["sent_bytes"]
        assert run["ops"]["ep"] == {"all_to_all": 4 * layers * m} and run["ops"]["dp"] == {}
        tokens = seq_len // mesh.cp
        assert run["sent_bytes"]["ep"] == 4 * layers * m * (mesh.ep - 1) / mesh.ep * (
            config.num_experts * tokens * config.hidden * 2)
        assert run["state_bytes"] == formula["state_bytes"]
        assert formula["activation_bytes_peak"] is None and run["activation_bytes_peak"] > 0


@pytest.mark.parametrize("argv, real_check", [
    (["--preset", "tiny", "--dp", "2", "--cp", "2", "--ep", "3"], lambda: Mesh(dp=2, cp=2, ep=3)),
    (["--preset", "mixtral-8x7b", "--dp", "3", "--ep", "3"], lambda: Mesh(dp=3, ep=3).check_model(preset("mixtral-8x7b"))),
    (["--preset", "tiny", "--cp", "3", "--seq-len", "16"], lambda: Mesh(cp=3).check_sequence(16)),
    (["--preset", "tiny", "--world-size", "12", "--tp", "2", "--cp", "4"], lambda: Mesh.for_world(12, tp=2, cp=4)),
], ids=["ep does not divide dp × cp", "experts do not split", "sequence does not split", "world does not factor"])
def test_bad_cp_and_ep_input_gets_the_real_runs_one_line_error(argv, real_check, capsys):
    with pytest.raises(ValueError) as real:
        real_check()
    assert main(["--seq-len", "16", *argv]) == 2
    assert capsys.readouterr().err == f"error: {real.value}\n"
    assert not dist.is_initialized()


def test_what_the_virtual_cluster_does_not_run_with_cp_and_ep_is_refused():
    moe = preset("tiny", num_experts=4)
    for config, mesh, kwargs, message in [
        (TINY, Mesh(cp=2, tp=2), {"sequence_parallel": True}, "sequence_parallel with cp 2: apply_tp's SP"),
        (moe, Mesh(dp=2, tp=2, ep=2), {}, "tp 2 with num_experts=4: the course's MoE layer has no tensor-parallel"),
        (moe, Mesh(dp=2, ep=2), {"recompute": "full"}, "recompute='full' with a mixture of experts"),
    ]:
        with pytest.raises(ValueError, match=message):
            run_rank(job(config, mesh, seq_len=16, **kwargs), 0)
    assert not dist.is_initialized()


def test_command_line_runs_cp_and_ep(capsys):
    import json
    assert main(["--preset", "tiny", "--world-size", "8", "--cp", "2", "--tp", "2", "--rank", "5", "--seq-len", "16",
                 "--dtype", "fp32", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert run["world_size"] == 8 and run["coords"] == {"dp": 1, "tp": 1, "pp": 0, "cp": 0}
    assert set(run["sent_bytes"]) == set(run["ops"]) == {"tp", "pp", "dp", "cp"}
    assert main(["--preset", "mixtral-8x7b", "--dp", "4", "--ep", "4", "--rank", "3", "--seq-len", "64", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert run["coords"] == {"dp": 3, "tp": 0, "pp": 0, "ep": 3} and run["computed"] == ["state_bytes", "sent_bytes.dp"]
    assert run["state_bytes"]["weights"] == 2 * params_per_rank(preset("mixtral-8x7b"), Mesh(dp=4, ep=4), 0)


@pytest.mark.parametrize("recompute", ["none", "selective", "op", "full"])
def test_the_norm_as_the_cpu_runs_it_equals_its_formula_too(recompute):
    """fused_norm=False: every RMSNorm runs F.rms_norm (fp32 copies of its input and of x·rstd, as torch runs it on
    the CPU), and the formulas' fused_norm=False predicts it; the fused norm keeps less."""
    mesh = Mesh(dp=2, tp=2, pp=2)
    runs = {fused: run_rank(job(TINY, mesh, seq_len=16, num_microbatches=2, recompute=recompute,
                                sequence_parallel=True, fused_norm=fused), 0) for fused in (True, False)}
    for run in runs.values():
        assert run["computed"] == [] and run["activation_bytes_peak"] == run["formulas"]["activation_bytes_peak"]
    assert runs[True]["activation_bytes_peak"] < runs[False]["activation_bytes_peak"]


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_an_interleaved_stage_0_holds_1_plus_p_minus_1_over_pv_of_1f1b(recompute):
    """Korthikanti et al. 2022 (4.2.3): with v chunks per rank, stage s holds (v - 1)·p + 2·(p - s - 1) + 1
    chunk-micro-batches, each 1/v of its layers, so stage 0 holds 1 + (p - 1)/(p·v) times what 1F1B holds.
    Measured on every stage of p = 4, v = 2, m = 8 (16 layers: 2 a chunk), against per_rank's walk of the
    schedule; the middle stages, which hold no embedding or head, give the ratio exactly."""
    config, mesh, m = preset("tiny", num_layers=16), Mesh(pp=4), 8
    interleaved = dict(schedule="interleaved", num_chunks=2)
    described = job(config, mesh, seq_len=16, num_microbatches=m, zero_stage=0, recompute=recompute, **interleaved)
    runs = [run_rank(described, stage) for stage in range(4)]
    assert [run["microbatches_in_flight"] for run in runs] == [11, 9, 7, 5]
    for stage, run in enumerate(runs):
        formula = activation_bytes_per_rank(described, stage)
        assert run["activation_bytes_peak"] == formula["peak"] == run["formulas"]["activation_bytes_peak"]
        assert run["activation_bytes_per_microbatch"] == formula["per_microbatch"]
    if recompute == "none":                          # (a rerun would add the same layer to both)
        for stage in (1, 2):
            one_f_one_b = run_rank(job(config, mesh, seq_len=16, num_microbatches=m, zero_stage=0, recompute="none"),
                                   stage)
            ratio = runs[stage]["activation_bytes_peak"] / one_f_one_b["activation_bytes_peak"]
            assert ratio == (4 + 2 * (3 - stage) + 1) / 2 / (4 - stage)      # 9/6 and 7/4
