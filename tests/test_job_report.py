"""A learner's own configuration (course_lib.frameworks) and its report (course_lib.job_report): every example file
of each framework read and reported, its memory the virtual run's measured bytes and its state the framework's
own formula; the same layout in three dialects; every bad input one line and exit code 2."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from course_lib.cost import step_time
from course_lib.frameworks import ConfigError, read_config
from course_lib.job import Job
from course_lib.job_report import (
    MEGATRON_TABLE,
    bottleneck,
    format_report,
    job_report,
    main,
    microbatches_to_run,
)
from course_lib.mesh import Mesh
from course_lib.model import preset
from course_lib.per_rank import data_parallel_bytes_per_step, params_per_rank, sent_bytes_per_rank
from course_lib.published import FSDP_OVERLAP
from course_lib.virtual import run_rank

EXAMPLES = Path(__file__).parents[1] / "course_lib" / "frameworks" / "examples"
HF = EXAMPLES / "hf"
# (file, read_config's keywords): three per framework, the list among them
CONFIGS = {
    "llama3_8b.toml": {"num_gpus": 8},                    # Llama-3-8B on 8 H100 with FSDP
    "llama2_70b_fsdp_tp.toml": {"num_gpus": 64},          # Llama-2-70B, FSDP + TP on 64
    "llama3_8b_tp8.toml": {"num_gpus": 8},
    "gpt3_175b_3d.sh": {"gpu": "A100 80GB"},              # GPT-3-175B-shaped 3D, interleaved, 1,024 GPUs
    "llama2_70b.sh": {},
    "mixtral_8x7b_ep.sh": {},                             # a Mixtral with EP
    "zero3_llama2_7b.json": {"num_gpus": 8, "model": str(HF / "llama-2-7b.json"), "seq_len": 4096},   # a ZeRO-3 7B
    "zero2_qwen2_7b.json": {"num_gpus": 16, "model": str(HF / "qwen2-7b.json"), "seq_len": 4096},
    "zero3_mixtral_offload.json": {"num_gpus": 64, "model": str(HF / "mixtral-8x7b.json"), "seq_len": 4096},
}


SEARCHED = {"llama3_8b_tp8.toml", "llama2_70b.sh"}    # the reports whose better layouts the tests read


@pytest.fixture(scope="module")
def reports():
    found = {}
    for name, keywords in CONFIGS.items():
        read = read_config(EXAMPLES / name, **keywords)
        found[name] = (read, job_report(read, alternatives=name in SEARCHED))
    return found


@pytest.mark.parametrize("name", CONFIGS)
def test_memory_is_the_virtual_runs_measured_bytes(reports, name):
    read, report = reports[name]
    memory, run = report["memory"], report["virtual_run"]
    assert memory["activations"] == run["activation_bytes_peak"] > 0
    assert "activation_bytes_peak" in memory["measured"]
    if "state_bytes" in memory["measured"]:
        assert memory["state"] == run["state_bytes"]["total"]
    else:   # the formula's (ep > 1, or a convention the virtual optimizer does not hold), and said so
        assert memory["state"] == memory["formulas"]["state"]
        assert "the state is" in format_report(report)
        if memory["virtual_state"] is not None:   # Megatron's fp32 gradients: the measured 16-bit state + 2 bytes
            job = read.job                          # for each parameter of the rank, whole (ZeRO-1 shards none)
            params = params_per_rank(job.config, job.mesh, memory["stage"], job.num_chunks, job.vocab_parallel)
            assert job.state_convention == "bf16+fp32 grads" and job.zero_stage == 1
            assert memory["state"] == memory["virtual_state"] + 2 * params
    assert memory["total"] == memory["state"] + memory["transient"] + memory["activations"] + memory["reserve"]
    assert memory["fits"] == (memory["total"] <= memory["card"])
    assert report["sent_bytes_checked"] < 1e-3      # the formulas for m equal the measured bytes of the short step


@pytest.mark.parametrize("name", ["llama3_8b.toml", "llama2_70b.sh"])
def test_the_report_runs_the_virtual_cluster(reports, name):
    """The report's run is the virtual cluster's: run again, the same bytes."""
    read, report = reports[name]
    run = report["virtual_run"]
    again = run_rank(read.job.replace(num_microbatches=run["num_microbatches"]), run["rank"])
    assert again["activation_bytes_peak"] == report["memory"]["activations"]
    assert again["state_bytes"] == run["state_bytes"] and again["sent_bytes"] == run["sent_bytes"]


@pytest.mark.parametrize("name", [n for n in CONFIGS if "mixtral_8x7b_ep" not in n])
def test_state_is_the_frameworks_own_formula(reports, name):
    read, report = reports[name]
    theirs = report["memory"]["framework_state"]
    # within a shard's padding (ZeroDataParallel pads each unit to a multiple of its group)
    assert math.isclose(report["memory"]["state"], theirs["bytes"], rel_tol=1e-6), theirs["source"]


def test_megatron_table_by_hand(reports):
    """Megatron-LM's docs: bf16 parameters with fp32 gradients and the distributed optimizer, 6 + 12/d bytes."""
    read, report = reports["llama2_70b.sh"]
    job = read.job
    params = params_per_rank(job.config, job.mesh, report["memory"]["stage"], job.num_chunks, job.vocab_parallel)
    assert MEGATRON_TABLE["bf16", 1] == (6, 12)
    assert math.isclose(report["memory"]["state"], 6 * params + 12 * params / job.mesh.dp, rel_tol=1e-6)


def test_deepspeed_estimator_beside_the_paper(reports):
    """ZeRO-3 7B: the state is the paper's 16·P/N; DeepSpeed's estimator adds 2 bytes sharded and a layer."""
    read, report = reports["zero3_llama2_7b.json"]
    theirs, params = report["memory"]["framework_state"], 6_738_415_616
    assert math.isclose(theirs["bytes"], 16 * params / 8, rel_tol=1e-9)
    assert theirs["estimator"] > report["memory"]["state"]
    assert "estimator prints" in format_report(report)


@pytest.mark.parametrize("model, rest, ops", [
    ("", "", "eager, fused norm"),                                      # nn.RMSNorm: one kernel, the rest eager
    ("", "[compile]\nenable = true\n", "fused"),
    ("", '[compile]\nenable = true\ncomponents = ["loss"]\n', "eager, fused norm"),   # the model not compiled
    ("", '[compile]\nenable = true\nbackend = "aot_eager"\n', "eager, fused norm"),   # no Inductor, no fusion
    ("", "[training]\ncompile = true\n", "fused"),                         # an older file's switch
    ('norm_type = "RMSNorm"\n', "", "eager"),                              # torchtitan's own class, op by op
    ('norm_type = "fused_rmsnorm"\n', "", "eager, fused norm"),
])
def test_torchtitan_memory_bound_ops_as_the_file_runs_them(tmp_path, model, rest, ops):
    """kernel_times.ELEMENTWISE_OPS from a torchtitan file: compiled by Inductor, fused; else op by op, its norms
    one kernel unless an older file names torchtitan's own RMSNorm class."""
    (tmp_path / "t.toml").write_text('[model]\nflavor = "8B"\n' + model + rest)
    read = read_config(tmp_path / "t.toml", num_gpus=8)
    assert read.assumptions["elementwise_ops"] == ops
    assert any(("op by op" in line) == (ops != "fused") for line in read.conventions)


def test_torchtitan_reduces_fp32_gradients_under_fsdp2_and_ddp(tmp_path):
    """torchtitan's FSDP2 reduces 16-bit gradients in fp32 (mixed_precision_reduce, its default and only value); its
    DDP keeps fp32 parameters under autocast, so its gradients are fp32 (that key is FSDP2's): the step time counts
    4 bytes a gradient element for both, and the report gives the framework's byte count beside the course's."""
    for parallelism, stage in (("data_parallel_shard_degree = 8", 3),
                               ("data_parallel_replicate_degree = 8\ndata_parallel_shard_degree = 1", 0)):
        (tmp_path / "t.toml").write_text(f'[model]\nflavor = "8B"\n[parallelism]\n{parallelism}\n')
        read = read_config(tmp_path / "t.toml", num_gpus=8)
        assert (read.job.zero_stage, read.job.dtype, read.assumptions["grad_reduce_bytes"]) == (stage, "bf16", 4)
        report = job_report(read, alternatives=False)
        assert report["framework_dp_bytes"] > report["sent_bytes"]["dp"]
        assert report["step"]["seconds"] == pytest.approx(step_time(read.job, **read.assumptions).total_s, rel=1e-12)

@pytest.mark.parametrize("text, match", [
    ('[compile]\nenable = "false"\n', "a true or false"),
    ('[model]\nflavor = "8B"\nnorm_type = "foo"\n', "norm_type = 'foo': one of rmsnorm")])
def test_torchtitan_compile_and_norm_keys_are_checked(tmp_path, text, match):
    (tmp_path / "t.toml").write_text(text if text.startswith("[model]") else '[model]\nflavor = "8B"\n' + text)
    with pytest.raises(ConfigError, match=match):
        read_config(tmp_path / "t.toml", num_gpus=8)


def test_reports_read_their_files(reports):
    _, titan8 = reports["llama3_8b.toml"]     # FSDP2 reduces in fp32: its reduce-scatter moves twice the bytes
    assert titan8["framework_dp_bytes"] == pytest.approx(titan8["sent_bytes"]["dp"] * 4 / 3, rel=1e-9)  # 2 AG + RS
    assert reports["zero3_llama2_7b.json"][1]["framework_dp_bytes"] is None
    _, titan = reports["llama2_70b_fsdp_tp.toml"]
    assert titan["mesh"] == "Mesh(dp=8, tp=8, pp=1)" and titan["zero_stage"] == 3
    assert any(line.startswith("torch.compile: ") for line in titan["conventions"])   # [compile] enable = true
    eager, _ = reports["llama3_8b.toml"]                                     # no [compile]: torchtitan runs eagerly
    assert any(line.startswith("no torch.compile (its default)") for line in eager.conventions)
    ops = {name: reports[name][0].assumptions["elementwise_ops"] for name in (
        "llama2_70b_fsdp_tp.toml", "llama3_8b.toml", "gpt3_175b_3d.sh", "zero3_llama2_7b.json")}
    assert list(ops.values()) == ["fused", "eager, fused norm", "fused", "eager"]  # nn.RMSNorm is one kernel; HF's not
    mixtral, _ = reports["zero3_mixtral_offload.json"]                     # the eager count cannot route tokens
    assert mixtral.assumptions["elementwise_ops"] == "fused"
    assert any("mixture of experts" in line for line in mixtral.not_modelled)
    read, gpt3 = reports["gpt3_175b_3d.sh"]
    assert gpt3["gpus"] == 1024 and read.job.num_chunks == 4 and read.job.sequence_parallel
    assert read.job.config.vocab_size == 51200 and gpt3["num_microbatches"] == 96
    assert read.assumptions["dp_overlap"] == 0.5                          # --overlap-grad-reduce
    _, offload = reports["zero3_mixtral_offload.json"]
    assert any("offload_optimizer" in line for line in offload["not_modelled"])
    _, qwen = reports["zero2_qwen2_7b.json"]
    assert qwen["seq_len"] == 4096 and qwen["zero_stage"] == 2


def test_better_layouts_are_faster_and_written_in_the_files_keys(reports):
    read, report = reports["llama3_8b_tp8.toml"]
    assert report["better"][0]["recipe"] == "ZeRO-3 / FSDP"     # TP over 8 GPUs for an 8B model: FSDP is faster
    # the same layout in bf16 (torchtitan runs it in fp32: its compute bottleneck, test_torchtitan_tp_without_...):
    # TP 8 with torchtitan's SP
    bf16 = read.job.replace(dtype="bf16")
    says = bottleneck(report["memory"], step_time(bf16, **read.assumptions), bf16)
    assert read.job.sequence_parallel and says.startswith("tp: ")
    assert says.endswith("(the tensor-parallel reduce-scatters and all-gathers of every layer)")
    assert "[parallelism] tensor_parallel_degree = 1" in report["better"][0]["change"]
    for alternative in report["better"]:
        assert alternative["speedup"] > 1.11 and alternative["memory"] <= report["memory"]["card"]
        assert all(line.startswith("[") for line in alternative["change"])
    _, megatron = reports["llama2_70b.sh"]
    assert all(line.startswith("--") for alternative in megatron["better"] for line in alternative["change"])


def test_a_job_that_does_not_fit_gets_layouts_that_do(tmp_path):
    config = tmp_path / "big_batch.toml"
    config.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 4\nseq_len = 8192\n'
                      '[activation_checkpoint]\nmode = "none"\n')
    report = job_report(read_config(config, num_gpus=8))
    assert not report["memory"]["fits"] and report["bottleneck"].startswith("it does not fit")
    assert report["better"] and all(alt["memory"] <= report["memory"]["card"] for alt in report["better"])
    fsdp = report["better"][0]           # the same FSDP over 8 GPUs, micro-batches of 1 sequence: 4 passes
    assert fsdp["recipe"] == "ZeRO-3 / FSDP" and fsdp["change"] == ["[training] local_batch_size = 1",
                                                                    "[training] global_batch_size = 32"]


def test_microbatches_to_run_keeps_the_peak():
    """The report runs the fewest micro-batches that reach the stage's peak: the same peak as the whole step."""
    for schedule, num_chunks in (("1f1b", 1), ("interleaved", 2)):
        job = Job(preset("tiny"), Mesh(pp=2), seq_len=16, num_microbatches=8, zero_stage=1, schedule=schedule,
                  num_chunks=num_chunks)
        short = microbatches_to_run(job, 0)
        assert short < 8
        assert (run_rank(job.replace(num_microbatches=short), 0)["activation_bytes_peak"]
                == run_rank(job, 0)["activation_bytes_peak"])


# ------------------------------------------------------------------------- the same layout in three dialects

LLAMA3_8B_TOML = """[model]
name = "llama3"
flavor = "8B"
[training]
local_batch_size = 1
seq_len = 4096
[parallelism]
data_parallel_shard_degree = -1
[activation_checkpoint]
mode = "full"
"""
LLAMA3_8B_DEEPSPEED = """{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": true},
 "zero_optimization": {"stage": 3}, "activation_checkpointing": {}}"""
LLAMA3_8B_MEGATRON = """--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm --position-embedding-type rope
--disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 128256 --seq-length 4096
--micro-batch-size 1 --global-batch-size 8 --recompute-granularity full --recompute-method uniform
--recompute-num-layers 1 --bf16 --use-distributed-optimizer
--overlap-grad-reduce
"""


def test_one_layout_three_dialects(tmp_path):
    """Llama-3-8B on 8 GPUs, sharded, each block recomputed: torchtitan's FSDP2 and DeepSpeed's ZeRO-3 agree to
    the byte, and to the second but for the norms and rotary (torchtitan's nn.RMSNorm one kernel and its complex
    rotary, Hugging Face's norm op by op and its rotate_half); Megatron-LM runs it with its distributed optimizer
    (ZeRO-1) and fp32 gradients, and its report says which convention makes its state larger."""
    files = {"titan.toml": LLAMA3_8B_TOML, "ds.json": LLAMA3_8B_DEEPSPEED, "megatron.sh": LLAMA3_8B_MEGATRON}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    titan = job_report(read_config(tmp_path / "titan.toml", num_gpus=8))
    deepspeed = job_report(read_config(tmp_path / "ds.json", num_gpus=8, seq_len=4096,
                                       model=str(HF / "meta-llama-3-8b.json")))
    megatron = job_report(read_config(tmp_path / "megatron.sh", num_gpus=8))
    for part in ("state", "transient", "activations", "total"):
        assert titan["memory"][part] == deepspeed["memory"][part], part
    assert titan["sent_bytes"] == deepspeed["sent_bytes"]
    as_deepspeed_runs_it = step_time(read_config(tmp_path / "titan.toml", num_gpus=8).job, dp_overlap=FSDP_OVERLAP,
                                     elementwise_ops="eager", rotary="rotate_half").total_s
    assert titan["step"]["seconds"] < deepspeed["step"]["seconds"] == pytest.approx(as_deepspeed_runs_it, rel=1e-12)
    assert megatron["memory"]["activations"] == titan["memory"]["activations"]   # the same model and batch
    assert megatron["zero_stage"] == 1 and megatron["convention"] == "bf16+fp32 grads"
    ratio = megatron["memory"]["state"] / titan["memory"]["state"]
    assert math.isclose(ratio, (6 + 12 / 8) / (16 / 8), rel_tol=1e-6)             # bytes per parameter
    assert "Megatron-LM's distributed-optimizer table" in format_report(megatron)


# ------------------------------------------------------------------------------------------ bad input

BAD = {
    "degrees.toml": ('[model]\nflavor = "8B"\n[parallelism]\ndata_parallel_shard_degree = 2\ntensor_parallel_degree = 8\n',
                     ["--gpus", "64"], "multiply to the world size"),
    "batch.toml": ('[model]\nflavor = "8B"\n[training]\nlocal_batch_size = 3\nglobal_batch_size = 100\n', ["--gpus", "8"],
                   "gradient accumulation takes whole passes"),
    "heads.sh": ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 128 "
                 "--tensor-model-parallel-size 3", ["--gpus", "3"], "16"),
    "world.sh": ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 128 "
                 "--tensor-model-parallel-size 4", ["--gpus", "6"], "world / (tp × pp × cp)"),
    "global.sh": ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 128 "
                  "--micro-batch-size 3 --global-batch-size 10", ["--gpus", "2"], "--global-batch-size 10"),
    "stages.sh": ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 128 "
                  "--pipeline-model-parallel-size 8", ["--gpus", "8"],
                  "--num-layers 4 is not divisible by --pipeline-model-parallel-size 8: every stage holds as many"),
    "mismatch.json": ('{"train_batch_size": 100, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}',
                      ["--gpus", "8", "--model", "llama2-7b"], "train_batch_size = 100"),
    "auto.json": ('{"train_micro_batch_size_per_gpu": "auto"}', ["--gpus", "8", "--model", "llama2-7b"], '"auto"'),
    "nomodel.json": ('{"train_micro_batch_size_per_gpu": 1}', ["--gpus", "8"], "--model"),
    "stage2pipe.json": ('{"zero_optimization": {"stage": 2}, "pipeline": {"stages": 2}}',
                        ["--gpus", "8", "--model", "llama2-7b"], "ZeRO-1 at most"),
    "broken.toml": ("[parallelism\n", ["--gpus", "8"], "not TOML"),
    "noflavour.toml": ('[model]\nname = "llama3"\n', ["--gpus", "8"], "debugmodel, is not modelled"),
    "section.toml": ("parallelism = 3\n", ["--gpus", "8"], "parallelism = 3: torchtitan's config is made of"),
    "listname.toml": ('[model]\nname = ["llama3"]\n', ["--gpus", "8"], "must be a string"),
    "zero.json": ('{"zero_optimization": 3, "train_micro_batch_size_per_gpu": 1}', ["--gpus", "8", "--model",
                  "llama2-7b"], "zero_optimization = 3: a section"),
    "noseq.json": ('{"train_micro_batch_size_per_gpu": 1}', ["--gpus", "8", "--model", "llama2-7b"], "--seq-len"),
    "ulysses.json": ('{"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 4}',
                     ["--gpus", "8", "--model", "llama2-7b"], "DeepSpeed-Ulysses"),
    "nobatch.json": ('{"gradient_accumulation_steps": 4}', ["--gpus", "8", "--model", "llama2-7b"],
                     "no train_batch_size"),
    "heads0.sh": ("--num-layers 4 --hidden-size 64 --num-attention-heads 0 --seq-length 64", ["--gpus", "1"],
                  "--num-attention-heads = 0"),
    "noword.sh": ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --recompute-granularity",
                  ["--gpus", "1"], "--recompute-granularity has no value"),
    "fullnomethod.sh": ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                        "--recompute-granularity full", ["--gpus", "1"], "--recompute-method"),
    "badgpu.toml": ("", ["--gpus", "8", "--gpu", "Z100"], "--gpu"),
    "selfref.sh": ("A=$A$A$A$A$A$A$A$A$A$A$A$A$A$A$A$A\n--num-layers $A --hidden-size 64", ["--gpus", "1"],
                   "must be a whole number"),        # expanded once, not 16**5 times
    "typo_world.toml": ("", ["--gpus", "1000000000"], "more than the 131,072 GPUs"),
    # rules each framework checks before it starts (Megatron's arguments.py, torchtitan's pipeline_parallel.py and
    # config, DeepSpeed's engine): the reader names them instead of reporting a run that cannot start; and one the
    # course does not model (tpcp.toml: torchtitan's TP plan with ring attention)
    "uneven_chunks.sh": ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                         "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 3", ["--gpus", "2"],
                         "4 layers per pipeline rank do not split into --num-virtual-stages-per-pipeline-rank 3"),
    "positions.sh": ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
                     "--max-position-embeddings 64", ["--gpus", "1"], "--max-position-embeddings 64 < --seq-length 128"),
    "selectivemethod.sh": ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                           "--recompute-granularity selective --recompute-method uniform", ["--gpus", "1"],
                           "--recompute-method uniform with selective recomputation"),
    "stages.toml": ('[model]\nflavor = "8B"\n[parallelism]\npipeline_parallel_degree = 4\n'
                    'pipeline_parallel_schedule = "Interleaved1F1B"\npipeline_parallel_layers_per_stage = 4\n',
                    ["--gpus", "8"], "ceil((32 layers + 2 for the first and last stages) / 4) = 9 stages over"),
    "reduce.toml": ('[model]\nflavor = "8B"\n[training]\nmixed_precision_reduce = "flaot32"\n', ["--gpus", "8"],
                    "mixed_precision_reduce = 'flaot32': torchtitan takes only 'float32'"),
    "tpcp.toml": ('[model]\nflavor = "8B"\n[parallelism]\ntensor_parallel_degree = 2\ncontext_parallel_degree = 2\n',
                  ["--gpus", "8"], "tensor_parallel_degree = 2 with context_parallel_degree = 2: torchtitan's TP plan"),
    "globalbatch.toml": ('[model]\nflavor = "8B"\n[training]\nglobal_batch_size = 0\n', ["--gpus", "8"],
                         "global_batch_size = 0: must be a whole number"),
    "both.json": ('{"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true}, "fp16": {"enabled": true}}',
                  ["--gpus", "8", "--model", "llama2-7b", "--seq-len", "1024"], "bf16.enabled and fp16.enabled both"),
    "accum.json": ('{"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true}, "data_types": '
                   '{"grad_accum_dtype": "fp32"}}', ["--gpus", "8", "--model", "llama2-7b", "--seq-len", "1024"],
                   "grad_accum_dtype = 'fp32' with bf16 weights and no ZeRO: DeepSpeed refuses the mix"),
    "nnodes.sh": ("torchrun --nproc_per_node 8 --nnodes 1000000000 pretrain_gpt.py --num-layers 4 --hidden-size 64 "
                  "--num-attention-heads 4 --seq-length 64", [], "more than the 131,072"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, name):
    text, argv, says = BAD[name]
    path = tmp_path / name
    path.write_text(text)
    assert main([str(path), *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and says in err, err


def test_model_family_not_modelled(tmp_path, capsys):
    gpt2 = tmp_path / "config.json"
    gpt2.write_text('{"model_type": "gpt2", "n_embd": 768}')
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1}')
    assert main([str(tmp_path / "ds.json"), "--gpus", "8", "--model", str(gpt2)]) == 2
    assert "model_type = 'gpt2' is not modelled" in capsys.readouterr().err


def test_unknown_keys_are_named_with_the_nearest(tmp_path):
    (tmp_path / "typo.toml").write_text('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\n'
                                        'tensor_paralel_degree = 2\n[training]\nseq_len = 1024\n')
    read = read_config(tmp_path / "typo.toml", num_gpus=8)
    assert read.unknown == ["[parallelism] tensor_paralel_degree: unknown (did you mean "
                            "[parallelism] tensor_parallel_degree?)"]
    assert read.job.mesh.tp == 1                           # the typo set nothing
    (tmp_path / "typo.sh").write_text(LLAMA3_8B_MEGATRON + " --tensor-model-paralel-size 2 --fp8-format hybrid")
    read = read_config(tmp_path / "typo.sh", num_gpus=8)
    assert read.unknown == ["--tensor-model-paralel-size: unknown (did you mean --tensor-model-parallel-size?)"]
    assert any(line.startswith("--fp8-format") for line in read.not_modelled)
    (tmp_path / "typo.json").write_text('{"train_batch_size": 8, "train_micro_batch_size_per_gp": 1, "zero_optimization": {"stag": 1}}')
    read = read_config(tmp_path / "typo.json", num_gpus=8, model="llama2-7b", seq_len=1024)
    assert read.unknown == ["train_micro_batch_size_per_gp: unknown (did you mean train_micro_batch_size_per_gpu?)",
                            "zero_optimization.stag: unknown (did you mean zero_optimization.stage?)"]


def test_llama3_405b_as_llama3_trained_it():
    """torchtitan's 3D: shard degree -1 fills 512 GPUs; FSDP2 beside a pipeline keeps its weights gathered (the
    default policy); each pass is a pipeline of 16 micro-batches of 1 sequence per rank, 8 passes a step."""
    read = read_config(EXAMPLES / "llama3_405b_3d.toml", num_gpus=512)
    job = read.job
    assert job.mesh == Mesh(dp=8, tp=8, pp=8) and job.num_chunks == 2 and job.schedule == "interleaved"
    assert (job.num_microbatches, job.global_batch_size) == (16, 128)          # one pass: its own fill and drain
    assert any("8 gradient-accumulation passes" in line for line in read.conventions)
    assert not job.reshard_after_forward and not job.reshard_after_backward and job.sequence_parallel


def test_torchtitan_tp_without_fsdp_trains_in_fp32(reports):
    """torchtitan's maybe_enable_amp: TP or PP without FSDP turns mixed precision off; its FSDP layouts run bf16.
    The fp32 run's matmuls run on the CUDA cores, which the bottleneck says; no published run trained in fp32, so it
    has no error band; FSDP in bf16 is more than 10x faster."""
    read, report = reports["llama3_8b_tp8.toml"]
    assert read.job.dtype == "fp32" and not read.not_modelled
    assert any("every matmul runs at the fp32 rate" in line for line in read.conventions)
    assert report["bottleneck"].startswith("compute: ") and "in fp32 on the CUDA cores' 67 TFLOP/s" in report["bottleneck"]
    assert report["error_band"] == {"regime": "H100, > 1B, s < 16k, recompute, fp32", "runs": 0}
    assert "dp 8 × tp 1 × pp 1" in report["better"][0]["layout"] and report["better"][0]["speedup"] > 10


def test_pure_ddp_over_replicas(tmp_path):
    (tmp_path / "ddp.toml").write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nseq_len = 1024\n'
                                       "local_batch_size = 1\n[parallelism]\ndata_parallel_replicate_degree = 8\n"
                                       "data_parallel_shard_degree = 1\n")
    job = read_config(tmp_path / "ddp.toml", num_gpus=8).job
    assert job.mesh == Mesh(dp=8) and job.zero_stage == 0


def test_megatron_script_variables_and_torchrun():
    read = read_config(EXAMPLES / "gpt3_175b_3d.sh")       # $TP, ${PP}; 8 × 128 GPUs from torchrun's flags
    assert (read.job.mesh.tp, read.job.mesh.pp, read.job.mesh.size) == (8, 8, 1024)
    half = read_config(EXAMPLES / "gpt3_175b_3d.sh", num_gpus=512)          # --gpus wins, and is said
    assert half.job.mesh.size == 512 and any("--gpus 512 in place of the script's torchrun" in line
                                             for line in half.conventions)
    # the lines to change, as a launch script takes them: a switch added or removed, full recomputation with its method
    plain = read.job.replace(num_chunks=1, schedule="1f1b", recompute="full", sequence_parallel=False)
    assert read.changes(plain) == ["remove --num-layers-per-virtual-pipeline-stage",
                                   "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                                   "remove --sequence-parallel"]


def test_command_line_report_and_json(capsys):
    import json

    assert main([str(EXAMPLES / "zero3_llama2_7b.json"), "--gpus", "8", "--gpu", "H100", "--model",
                 str(HF / "llama-2-7b.json"), "--seq-len", "2048", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpu"] == "H100 SXM" and report["seq_len"] == 2048 and report["memory"]["fits"]


SMALL_MEGATRON = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 512 "
                  "--max-position-embeddings 512 --tensor-model-parallel-size 2 --use-distributed-optimizer "
                  "--overlap-grad-reduce --overlap-param-gather --micro-batch-size 1 --global-batch-size 16 --bf16")


def test_megatrons_overlapped_param_gather_is_read_and_checked(tmp_path):
    """--overlap-param-gather: the distributed optimizer's weight gather hidden behind the next step's first forward
    (cost.step_time's overlap_param_gather), which the report prices; with a pipeline it is named as not modelled
    and changes nothing; a layout without the distributed optimizer drops it; and Megatron-LM asserts it comes with
    --use-distributed-optimizer and --overlap-grad-reduce, which the reader says, naming what is missing."""
    small = tmp_path / "small.sh"
    small.write_text(SMALL_MEGATRON)
    read = read_config(small, num_gpus=8)
    (tmp_path / "plain.sh").write_text(SMALL_MEGATRON.replace(" --overlap-param-gather", ""))
    plain = read_config(tmp_path / "plain.sh", num_gpus=8)
    assert (plain.assumptions["overlap_param_gather"], read.assumptions["overlap_param_gather"]) == (False, True)
    assert any(line.startswith("--overlap-param-gather: ") for line in read.conventions)
    report = job_report(read, alternatives=False)
    assert report["step"]["seconds"] == pytest.approx(step_time(read.job, **read.assumptions).total_s, rel=1e-12)
    assert report["step"]["seconds"] < job_report(plain, alternatives=False)["step"]["seconds"]
    assert read.changes(read.job.replace(zero_stage=0)) == ["remove --use-distributed-optimizer",
                                                            "remove --overlap-param-gather"]
    script = (EXAMPLES / "llama2_70b.sh").read_text()                      # pp 4
    piped = tmp_path / "piped.sh"
    piped.write_text(script.replace("--overlap-grad-reduce", "--overlap-grad-reduce --overlap-param-gather"))
    with_flag, without = read_config(piped, num_gpus=64), read_config(EXAMPLES / "llama2_70b.sh", num_gpus=64)
    assert any(line.startswith("--overlap-param-gather with a pipeline") for line in with_flag.not_modelled)
    assert step_time(with_flag.job, **with_flag.assumptions) == step_time(without.job, **without.assumptions)
    for missing in ("--overlap-grad-reduce", "--use-distributed-optimizer"):
        bad = tmp_path / "bad.sh"
        bad.write_text(SMALL_MEGATRON.replace(missing + " ", ""))
        with pytest.raises(ConfigError, match=f"--overlap-param-gather without {missing}: Megatron-LM's arguments.py "
                                              "asserts"):
            read_config(bad, num_gpus=8)


def test_megatron_layouts_are_offered_only_where_its_layers_divide(tmp_path):
    """Megatron gives every stage and chunk as many layers: the planner's pp 4 × v 2 for a 60-layer model (7.5
    layers a chunk) cannot be written in its flags (spell raises) and is not offered, where a dividing one is; a
    file that recomputes by --recompute-activations is told to drop it when a layout recomputes otherwise."""
    model = ("--num-layers 60 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
             "--group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm --position-embedding-type "
             "rope --disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 32000 --seq-length 4096 "
             "--max-position-embeddings 4096 --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce "
             "--micro-batch-size 1 --global-batch-size 64 --bf16 --tensor-model-parallel-size 2 "
             "--pipeline-model-parallel-size 4 ")
    path = tmp_path / "sixty.sh"
    path.write_text(model + "--recompute-granularity selective")
    read = read_config(path, num_gpus=64)
    asked, spell = [], read.spell
    read = dataclasses.replace(read, spell=lambda job: asked.append((job.mesh.pp, job.num_chunks)) or spell(job))
    offered = [(int(alt["layout"].split("pp ")[1].split()[0]), int(alt["layout"].split("v = ")[1].split(")")[0])
                if "v = " in alt["layout"] else 1) for alt in job_report(read)["better"]]
    assert (4, 2) in asked and (4, 2) not in offered and offered and all(60 % (p * v) == 0 for p, v in offered)
    with pytest.raises(ValueError, match="60 layers over pp 4 × 2 chunks"):
        read.changes(read.job.replace(num_chunks=2, schedule="interleaved"))
    path.write_text(model + "--recompute-activations")
    activations = read_config(path, num_gpus=64)
    assert activations.job.recompute == "selective"
    assert "remove --recompute-activations" in activations.changes(activations.job.replace(recompute="full"))


def test_deepspeeds_other_stages_keep_the_overlap_they_were_timed_with(tmp_path):
    """A DeepSpeed layout is timed with the file's overlap_comm; DeepSpeed's default is on for stage 3 only, so a
    suggestion at another stage writes the key where its default would differ, and only there."""
    def read(zero):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8,
                                    "bf16": {"enabled": True}, "zero_optimization": zero}))
        return read_config(path, num_gpus=8, model="llama2-7b", seq_len=1024)
    three, one, one_on = read({"stage": 3}), read({"stage": 1}), read({"stage": 1, "overlap_comm": True})
    assert (three.assumptions["dp_overlap"] > 0, one.assumptions["dp_overlap"]) == (True, 0.0)
    assert three.changes(three.job.replace(zero_stage=1)) == ["zero_optimization.stage = 1",
                                                              "zero_optimization.overlap_comm = true"]
    assert one.changes(one.job.replace(zero_stage=3)) == ["zero_optimization.stage = 3",
                                                          "zero_optimization.overlap_comm = false"]
    assert one_on.changes(one_on.job.replace(zero_stage=3)) == ["zero_optimization.stage = 3"]   # its default
    assert three.changes(three.job.replace(micro_batch_size=2, num_microbatches=4)) == [
        "train_micro_batch_size_per_gpu = 2", "gradient_accumulation_steps = 4"]


def test_deepspeeds_communication_data_type_is_read(tmp_path):
    """DeepSpeed reduces gradients in the training dtype unless communication_data_type names another (its
    config.py and engine): 'fp32' under bf16 makes the step's reductions 4 bytes an element, which the report
    counts; the training dtype's own name changes nothing; any other value is refused, naming DeepSpeed's three."""
    config = json.loads((EXAMPLES / "zero3_llama2_7b.json").read_text())
    reads = {}
    for name, value in (("default", None), ("fp32", "fp32"), ("same", "BF16")):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config | ({} if value is None else {"communication_data_type": value})))
        reads[name] = read_config(path, num_gpus=8, seq_len=4096, model=str(HF / "llama-2-7b.json"))
    assert reads["default"].job.dtype == "bf16" and not reads["fp32"].unknown
    assert [reads[name].assumptions["grad_reduce_bytes"] for name in reads] == [None, 4, None]
    assert any(line.startswith("communication_data_type = 'fp32'") for line in reads["fp32"].conventions)
    steps = {name: step_time(read.job, **read.assumptions) for name, read in reads.items()}
    assert steps["default"] == steps["same"] and steps["fp32"].dp_comm_s > steps["default"].dp_comm_s
    report = job_report(reads["fp32"], alternatives=False)
    assert report["framework_dp_bytes"] > report["sent_bytes"]["dp"]
    (tmp_path / "bad.json").write_text(json.dumps(config | {"communication_data_type": "fp8"}))
    with pytest.raises(ConfigError, match="communication_data_type = 'fp8': DeepSpeed takes 'fp32', 'fp16' or 'bf16'"):
        read_config(tmp_path / "bad.json", num_gpus=8, seq_len=4096, model=str(HF / "llama-2-7b.json"))

def test_megatrons_bf16_gradient_reduction_is_read(tmp_path):
    """--grad-reduce-in-bf16: Megatron keeps bf16 gradient buffers and reduces them in bf16 (arguments.py turns
    accumulate_allreduce_grads_in_fp32 off), so the state is mixed-precision Adam's 16 bytes per parameter, not the
    18 of fp32 gradients, the data-parallel reductions move half the bytes, and the distributed-optimizer table,
    which has no such row, is not quoted. Without --bf16 Megatron ignores it, and the report says so."""
    script = SMALL_MEGATRON.replace(" --overlap-param-gather", "")
    (tmp_path / "fp32.sh").write_text(script)
    (tmp_path / "bf16.sh").write_text(script + " --grad-reduce-in-bf16")
    fp32, bf16 = (read_config(tmp_path / name, num_gpus=8) for name in ("fp32.sh", "bf16.sh"))
    assert (fp32.job.state_convention, bf16.job.state_convention) == ("bf16+fp32 grads", "mixed")
    assert any(line.startswith("--grad-reduce-in-bf16: ") for line in bf16.conventions) and not bf16.unknown
    sent = {name: data_parallel_bytes_per_step(read.job, 0) for name, read in (("fp32", fp32), ("bf16", bf16))}
    assert sent["bf16"]["reduce_scatter"] == sent["fp32"]["reduce_scatter"] / 2
    assert sent["bf16"]["all_gather"] == sent["fp32"]["all_gather"]                   # the bf16 weights, as before
    report = job_report(bf16, alternatives=False)
    assert report["memory"]["framework_state"] is None
    assert job_report(fp32, alternatives=False)["memory"]["framework_state"]["bytes"] > report["memory"]["state"]
    (tmp_path / "fp16.sh").write_text(script.replace("--bf16", "--fp16") + " --grad-reduce-in-bf16")
    fp16 = read_config(tmp_path / "fp16.sh", num_gpus=8)
    assert fp16.job.state_convention == "fp32 grad accumulation"
    assert any("changes nothing" in line for line in fp16.conventions)

def test_megatrons_tp_reductions_run_beside_the_weight_gradients(reports):
    """Megatron-LM always issues a column-parallel layer's input-gradient reduction before that layer's weight-gradient
    GEMM (no flag turns it off): its reader prices TP's backward as hidden up to those GEMMs (tp_overlap 1), which
    shortens the step. torchtitan's TP waits for each collective (its async TP is named as not modelled). A reader's
    assumptions are step_time's keywords, checked by name."""
    read, report = reports["gpt3_175b_3d.sh"]
    assert read.assumptions["tp_overlap"] == 1.0 and any(line.startswith("TP's backward: ") for line in read.conventions)
    hidden = step_time(read.job, **read.assumptions)
    assert report["step"]["seconds"] == pytest.approx(hidden.total_s, rel=1e-12)
    assert hidden.tp_s < step_time(read.job, **{**read.assumptions, "tp_overlap": 0.0}).tp_s
    titan, _ = reports["llama2_70b_fsdp_tp.toml"]
    assert titan.job.mesh.tp == 8 and "tp_overlap" not in titan.assumptions
    with pytest.raises(ValueError, match=r"ReadConfig assumptions \['tp_overlapp'\]: step_time takes"):
        dataclasses.replace(read, assumptions={"tp_overlapp": 1.0})


def test_context_parallel_files_are_priced_on_a_split_sequence(tmp_path):
    """A file with context parallelism: each GPU holds seq_len/cp tokens of a sequence, so its MFU stays near the
    run without it (it halved before the step split the sequence), and ring attention's hops are priced as each
    framework runs them: Megatron's Transformer Engine ring beside the attention kernels (cp_overlap 1; another
    --cp-comm-type is named as not modelled), torchtitan's all-gather exposed (an upper bound, said)."""
    script = ("--num-layers 4 --hidden-size 4096 --num-attention-heads 32 --seq-length 8192 --max-position-embeddings "
              "8192 --tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 16 --bf16")
    (tmp_path / "cp.sh").write_text(script + " --context-parallel-size 2")
    (tmp_path / "a2a.sh").write_text(script + " --context-parallel-size 2 --cp-comm-type a2a")
    (tmp_path / "plain.sh").write_text(script)
    cp, a2a, plain = (read_config(tmp_path / name, num_gpus=8) for name in ("cp.sh", "a2a.sh", "plain.sh"))
    assert cp.job.mesh.cp == 2 and cp.assumptions["cp_overlap"] == 1.0 and not cp.unknown
    assert any(line.startswith("context parallelism: Transformer Engine") for line in cp.conventions)
    assert any(line.startswith("--cp-comm-type a2a") for line in a2a.not_modelled) and not a2a.unknown
    assert "ring attention 100%, up to the attention kernels" in format_report(job_report(cp, alternatives=False))
    ours, theirs = (step_time(read.job, **read.assumptions) for read in (cp, plain))
    assert ours.mfu > 0.8 * theirs.mfu and ours.cp_s >= 0
    toml = '[model]\nflavor = "8B"\n[training]\nseq_len = 8192\n[parallelism]\ncontext_parallel_degree = 2\n'
    (tmp_path / "t.toml").write_text(toml)
    titan = read_config(tmp_path / "t.toml", num_gpus=8)
    assert titan.job.mesh.cp == 2 and "cp_overlap" not in titan.assumptions
    assert any("ring attention's K/V traffic timed exposed" in line for line in titan.conventions)
    assert "ring attention" not in format_report(job_report(titan, alternatives=False)).split("\n\nbottleneck")[0]
    step = step_time(titan.job, **titan.assumptions)
    assert step.cp_s > 0 and step.mfu > 0.8 * step_time(titan.job.replace(
        mesh=Mesh(dp=8)), **titan.assumptions).mfu


def test_megatrons_dropless_experts_send_the_routed_rows(tmp_path):
    """Megatron's MoE drops no token unless --moe-expert-capacity-factor says so, and its all-to-all dispatcher sends
    only the rows routed and kept (padded to capacity only with --moe-pad-expert-input-to-capacity): read as a
    balanced router's capacity factor, 1 at most (said), which the virtual run's MoE layers take too, so its
    measured all-to-all bytes equal per_rank's. A bad factor is refused; a dispatcher other than alltoall
    (Megatron's default all-gathers the tokens) is named as not modelled."""
    example = (EXAMPLES / "mixtral_8x7b_ep.sh").read_text()
    read = read_config(EXAMPLES / "mixtral_8x7b_ep.sh", num_gpus=64)
    assert read.job.capacity_factor == 1.0 and any(line.startswith("dropless experts") for line in read.conventions)
    assert not any("dispatcher" in line for line in read.not_modelled)
    for flags, factor in (("--moe-expert-capacity-factor 1.25", 1.0), ("--moe-expert-capacity-factor 0.5", 0.5),
                          ("--moe-expert-capacity-factor 1.25 --moe-pad-expert-input-to-capacity", 1.25)):
        (tmp_path / "cf.sh").write_text(example.replace("--num-experts 8", f"--num-experts 8 {flags}"))
        assert read_config(tmp_path / "cf.sh", num_gpus=64).job.capacity_factor == factor, flags
        assert main([str(tmp_path / "cf.sh"), "--gpus", "64"]) == 0, flags    # reported, dropped tokens and all
    bad = example.replace("--num-experts 8", "--num-experts 8 --moe-expert-capacity-factor x")
    (tmp_path / "bad.sh").write_text(bad)
    with pytest.raises(ConfigError, match="--moe-expert-capacity-factor x: a number above 0"):
        read_config(tmp_path / "bad.sh", num_gpus=64)
    (tmp_path / "gather.sh").write_text(example.replace(" --moe-token-dispatcher-type alltoall", ""))
    gather = read_config(tmp_path / "gather.sh", num_gpus=64)
    assert any(line.startswith("--moe-token-dispatcher-type allgather (Megatron's default)")
               for line in gather.not_modelled)
    small = read.job.replace(num_microbatches=4)
    run = run_rank(small, 0)
    assert run["sent_bytes"]["ep"] == sent_bytes_per_rank(small, 0)["ep"] > 0


def test_a_gpu_typed_short_must_name_one_gpu_or_a_family():
    import argparse

    from course_lib.job_report import gpu_name
    assert [gpu_name(text) for text in ("H100", "a100", "A100 40", "h200 sxm")] == [
        "H100 SXM", "A100 80GB", "A100 40GB", "H200 SXM"]
    for text, why in (("", "names more than one GPU"), ("H", "names more than one GPU"),
                      ("B200", "is not in the catalogue")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            gpu_name(text)


def test_megatron_scripts_as_they_are_written(tmp_path):
    """Real Megatron-LM scripts (a review ran the repository's examples): flags inside a quoted variable or array
    element, ${NAME:-default}, a tokenizer's vocabulary, a GeLU width TP splits, tied embeddings at TP 1 over a
    pipeline, and another model's entry point refused by name."""
    script = tmp_path / "old_style.sh"
    script.write_text('NNODES=${SLURM_NNODES:-1}\nGPT_ARGS="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 '
                      '--seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4"\n'
                      'EXTRA=( "--tokenizer-type Llama2Tokenizer" --bf16 )\n'
                      'torchrun --nproc_per_node 8 --nnodes $NNODES pretrain_gpt.py $GPT_ARGS "${EXTRA[@]}" '
                      '--tensor-model-parallel-size 8\n')
    read = read_config(script)
    config = read.job.config
    assert (config.num_layers, config.hidden, read.job.mesh.size, read.job.mesh.tp) == (24, 1024, 8, 8)
    assert config.vocab_size == 32768 and any("Llama2Tokenizer's 32,000 tokens" in line for line in read.conventions)
    assert config.intermediate == 2728 and config.intermediate % 8 == 0           # 2 × 4,096 / 3, split by TP 8
    piped = tmp_path / "piped.sh"
    piped.write_text(script.read_text().replace("--tensor-model-parallel-size 8", "--pipeline-model-parallel-size 2"))
    assert not read_config(piped).job.config.tie_embeddings                     # two stages: two matrices
    other = tmp_path / "bert.sh"
    other.write_text(script.read_text().replace("pretrain_gpt.py", "pretrain_bert.py"))
    with pytest.raises(ConfigError, match="pretrain_bert.py: the course reads GPT training"):
        read_config(other)
    echoed = tmp_path / "echoed.sh"     # an echo's text is no flag; a single-quoted value stays as written
    echoed.write_text("MSG='${NOTHING:-x}'\necho \"rerun with --tensor-model-parallel-size 4\"\n" + script.read_text())
    assert read_config(echoed).job.mesh.tp == 8
    unknown = tmp_path / "tokens.sh"
    unknown.write_text(script.read_text().replace("Llama2Tokenizer", "HuggingFaceTokenizer"))
    with pytest.raises(ConfigError, match="--tokenizer-type HuggingFaceTokenizer without --vocab-size"):
        read_config(unknown)


def test_torchtitan_fp8_options_count_only_when_converted_and_old_places_are_refused(tmp_path):
    """torchtitan's llama3 files carry [quantize.linear.float8] options with no converter in [model]: bf16, nothing
    flagged; named by [model] converters (or an older file's enable_float8_linear), FP8 is not modelled and said.
    An older file's [training] tensor_parallel_degree is refused, not read as TP 1."""
    base = '[model]\nname = "llama3"\nflavor = "8B"\n[activation_checkpoint]\nmode = "full"\n[training]\nseq_len = 2048\n'
    options = tmp_path / "options.toml"
    options.write_text(base + '[quantize.linear.float8]\nrecipe_name = "rowwise"\n')
    assert not read_config(options, num_gpus=8).not_modelled
    converted = tmp_path / "converted.toml"
    converted.write_text(base.replace('flavor = "8B"', 'flavor = "8B"\nconverters = ["quantize.linear.float8"]')
                         + '[quantize.linear.float8]\nrecipe_name = "rowwise"\n')
    assert any("model converters" in line for line in read_config(converted, num_gpus=8).not_modelled)
    old = tmp_path / "old.toml"
    old.write_text(base + '[float8]\nenable_float8_linear = true\n')
    assert any(line.startswith("[float8]") for line in read_config(old, num_gpus=8).not_modelled)
    moved = tmp_path / "moved.toml"
    moved.write_text(base + "tensor_parallel_degree = 8\n")
    with pytest.raises(ConfigError, match=r"\[training\] tensor_parallel_degree: where an older torchtitan kept it; "
                                          r"today's reads \[parallelism\] tensor_parallel_degree"):
        read_config(moved, num_gpus=8)


@pytest.mark.parametrize("extra, said", [
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-4, "freeze_step": 100}}}, "optimizer.type: 1-bit"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads"),
    ({"progressive_layer_drop": {"enabled": True, "theta": 0.5}}, "progressive_layer_drop: layers skipped"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}, None),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, None),      # ZeRO-3 only
    ({"zero_optimization": {"stage": 3, "stage3_model_persistence_threshold": 100}}, None),
    ({"zero_optimization": {"stage": 3, "zenflow": {"topk_ratio": 0.1}}}, "zero_optimization.zenflow"),
    ({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}},
     "compression_training"),
    ({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}}}}, None)])
def test_deepspeed_keys_that_change_the_run_are_named_and_real_ones_are_no_typos(tmp_path, extra, said):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**json.loads((EXAMPLES / "zero3_llama2_7b.json").read_text()), **extra}))
    read = read_config(config, num_gpus=8, seq_len=4096, model=str(EXAMPLES / "hf" / "llama-2-7b.json"))
    assert not read.unknown
    assert [line for line in read.not_modelled if said and line.startswith(said)] if said else not read.not_modelled
