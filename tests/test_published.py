"""course_lib.published beyond the sixteen runs the model was shaped beside: llm-foundry's FSDP runs (each row
as the README prints it) and torchtitan's, held out (on A100, and on H100 eager and compiled); and the network as
clusters are built (rail-optimised rings), which the cross-node FSDP rows rest on."""

import csv
import dataclasses

import pytest

from course_lib.cost import link_for, step_time
from course_lib.hardware import GPUS
from course_lib.job import Job
from course_lib.kernel_times import attention_rate
from course_lib.mesh import Mesh
from course_lib.model import preset
from course_lib.published import (
    COMPOSER_REDUCE_BYTES,
    FSDP_OVERLAP,
    LLM_FOUNDRY_FILE,
    PUBLISHED_RUNS,
    compare_published,
    error_by_regime,
    gpt_config,
    llm_foundry_runs,
    rank_correlation,
    torchtitan_h100_runs,
    torchtitan_runs,
)
from course_lib.published_misses import above_ceiling_why, best_kernels_ceiling, wider_runs


def test_every_llm_foundry_row_is_read_from_the_row_as_printed():
    """The fields the runs are built from agree with the README's row (Model | SeqLen | GPUs | GPU | MFU | HFU |
    Model TFLOP | MicroBatchSize | GradAccum | GlobalBatchSize | ...), every row, and each run keeps its row."""
    with LLM_FOUNDRY_FILE.open() as rows:
        rows = list(csv.DictReader(rows))
    assert len(rows) == 203
    for row in rows:
        cells = [cell.strip() for cell in row["readme_row"].strip("|").split("|")]
        assert [cells[i] for i in (1, 2, 4, 5, 7, 9)] == [row[k] for k in (
            "seq_len", "gpus", "mfu_percent", "hfu_percent", "micro_batch_size", "global_batch_size")], cells
        assert cells[16] == "FULL_SHARD" and cells[17] == {"full": "True", "none": "False"}[row[
            "activation_checkpointing"]]
        assert int(cells[7]) * int(cells[8]) * int(cells[2]) == int(cells[9])   # b · accumulation · GPUs = B
        assert cells[15] == row["fsdp_mixed_precision"] in COMPOSER_REDUCE_BYTES   # Composer's FSDP mixed precision
    runs = llm_foundry_runs()
    assert all(row["readme_row"] in run.source for row, run in zip(rows, runs))
    assert {run.gpu for run in runs} == {"A100 40GB", "A100 80GB", "H100 SXM"}


def test_the_model_on_runs_it_was_not_shaped_beside():
    """llm-foundry: at least 186 of 203 within 5 points (181 before the memory-bound ops took the shares one H200
    measured, kernel_times.STREAM_SHARE; 183 before the rows' fp32 reductions were counted), every regime's mean
    within 5; every row at 16k tokens and more within 6
    (with attention as one flat share they were 16-22 points off on H100, and the trend ran backwards); H100 there
    within 5 each. torchtitan, held out: all 6 within 5, its 'selective op' rows run as recompute='op' (every
    second matmul rerun): costed as the course's 'selective' (each attention core rerun), they come out 3 points
    higher or more, further off on average (+5.8 to +8.3 against +0.7 to +3.1 when written)."""
    runs = llm_foundry_runs()
    rows = compare_published(runs)
    by_regime = error_by_regime(rows, runs)
    assert sum(error["within_5"] for error in by_regime.values()) >= 186
    assert all(abs(error["mean"]) <= 5 for error in by_regime.values()), by_regime
    long = [(row, run) for row, run in zip(rows, runs) if run.layout["seq_len"] >= 16384]
    assert len(long) == 43 and all(abs(row["points"]) <= 6 for row, _ in long)
    assert all(abs(row["points"]) <= 5 for row, run in long if run.gpu == "H100 SXM")
    titan_runs = torchtitan_runs()
    titan = compare_published(titan_runs)
    assert len(titan) == 6 and all(abs(row["points"]) <= 5 for row in titan)
    per_op = [run for run in titan_runs if run.layout["recompute"] == "op"]
    as_selective = compare_published([with_layout(run, recompute="selective") for run in per_op])
    ours = compare_published(per_op)
    assert len(per_op) == 3 and all(a["points"] > b["points"] + 3 for a, b in zip(as_selective, ours))
    assert sum(abs(row["points"]) for row in ours) < sum(abs(row["points"]) for row in as_selective)


def with_layout(run, **changes):
    return dataclasses.replace(run, layout={**run.layout, **changes})


def test_fsdp_overlap_was_chosen_on_one_source_and_holds_on_another():
    """published.FSDP_OVERLAP: chosen among none, half and all hidden on llm-foundry's rows, each reducing its
    gradients in the bytes its row says (fp32 under Composer's 'DEFAULT'): 182, 186 and 172 within 5 points; then
    checked on torchtitan's, held out (fp32 reductions): 5, 6 and 2 of 6. Counted as 16-bit reductions, a quarter of
    the bytes short, the rows had preferred none (183 against 182; torchtitan 6 and 6): two errors cancelling.
    torchtitan's H100 rows, on the card they ran on, lean the other way (at most 1.0 points off with none hidden,
    2.5 with half, 4.6 with all): every choice but all keeps them within 5."""
    def within_5(runs, overlap, **changes):
        return sum(abs(row["points"]) <= 5 for row in compare_published([with_layout(r, dp_overlap=overlap, **changes)
                                                                         for r in runs]))
    assert FSDP_OVERLAP == 0.5
    assert [within_5(llm_foundry_runs(), overlap) for overlap in (0.0, 0.5, 1.0)] == [182, 186, 172]
    assert [within_5(torchtitan_runs(), overlap) for overlap in (0.0, 0.5, 1.0)] == [5, 6, 2]
    assert [within_5(llm_foundry_runs(), overlap, grad_reduce_bytes=None) for overlap in (0.0, 0.5)] == [183, 182]

    def on_their_gpu(overlap):
        return max(abs(row["on_its_gpu"] - row["theirs"]) for row in compare_published(
            [with_layout(run, dp_overlap=overlap) for run in torchtitan_h100_runs()]))
    assert on_their_gpu(0.0) < on_their_gpu(FSDP_OVERLAP) <= 0.03 < on_their_gpu(1.0) <= 0.05


def test_torchtitan_on_h100_eager_and_compiled_on_the_card_it_ran_on():
    """torchtitan's December 2024 H100 rows, held out: Llama 3.1 8B with FSDP2 on 8 and 128 GPUs, eager PyTorch
    (every memory-bound op op by op, elementwise_ops='eager') and with torch.compile (fused). On the catalogue's
    H100 SXM the model is 7.9-10.3 points high: the source's cards are 500 W HBM2e parts whose peak it places
    between the NVL's and the SXM's, without knowing it. On such a card at the low end, the NVL's peak, and 2.4
    TB/s (ran_on), every row lands within 5 points (2.5 when written), and the row says so. Eager costs the model
    a little more than it cost torchtitan (0.84-0.85 of the compiled MFU against 0.86 when written), never less; with
    the course's own rotary in place of torchtitan's complex multiply, more still (0.82)."""
    runs = torchtitan_h100_runs()
    rows = compare_published(runs)
    assert [run.layout["elementwise_ops"] for run in runs] == ["eager", "fused"] * 2
    assert all(5 < row["points"] < 11 for row in rows)
    assert all(abs(row["on_its_gpu"] - row["theirs"]) <= 0.05 for row in rows)
    assert all(row["why"].startswith("ran on another GPU, H100 HBM2e 96GB at 500 W") for row in rows)
    as_model_py = compare_published([with_layout(run, rotary="model.py") for run in runs])
    for (eager, compiled), course_rotary in zip((rows[0:2], rows[2:4]), as_model_py[0::2]):
        assert 0.8 < course_rotary["ours"] / compiled["ours"] < eager["ours"] / compiled["ours"] < eager[
            "theirs"] / compiled["theirs"] < 1
    assert rows[2]["ours"] < rows[0]["ours"] and rows[2]["theirs"] < rows[0]["theirs"]   # 128 GPUs: across nodes


def test_attention_runs_at_its_benchmarks_rate():
    """kernel_times.attention_rate reads the kernel's published figure (FlashAttention-2 on A100, causal, head
    dim 128: 189 TFLOP/s at 16k tokens, 155 at 2k), between them in log(s), flat beyond; H200 as the H100;
    Triton's at 3.5/6.4 of FlashAttention-2's; the memory-efficient kernel at the same A100 figure's xformers bar
    (87 at 4k), on the H100 at the A100's ratio to FlashAttention-2 (87/173 of 294); FlashAttention-3 refused off
    Hopper, by name."""
    a100, h100, h200 = GPUS["A100 80GB"], GPUS["H100 SXM"], GPUS["H200 SXM"]
    assert attention_rate(a100, "flash", 16384, 128) == pytest.approx(189e12)
    assert attention_rate(a100, "flash", 65536, 128) == pytest.approx(189e12)
    assert attention_rate(a100, "flash", 2048, 128) == pytest.approx(155e12)
    assert attention_rate(a100, "flash", 2048 * 2**0.5, 128) == pytest.approx((155e12 + 173e12) / 2)
    assert attention_rate(a100, "flash", 2048, 96) == pytest.approx((155e12 + 140e12) / 2)
    assert attention_rate(a100, "flash", 2048, 128, causal=False) == pytest.approx(187e12)
    assert attention_rate(h200, "flash3", 8192, 128) == attention_rate(h100, "flash3", 8192, 128) > 500e12
    assert attention_rate(h100, "triton", 8192, 128) == pytest.approx(308e12 * 3.5 / 6.4)
    assert attention_rate(a100, "efficient", 4096, 128) == pytest.approx(87e12)
    assert attention_rate(a100, "efficient", 4096, 64, causal=False) == pytest.approx(77e12)
    assert attention_rate(h100, "efficient", 4096, 128) == pytest.approx(294e12 * 87 / 173)
    assert attention_rate(h200, "efficient", 4096, 128) == attention_rate(h100, "efficient", 4096, 128)
    with pytest.raises(ValueError, match="flash3.*Hopper"):
        attention_rate(a100, "flash3", 8192, 128)


def _fsdp_mfu(config, *, gpus: int, seq_len: int, micro_batch_size: int, attention: str) -> float:
    job = Job(config=config, mesh=Mesh(dp=gpus), gpu="H100 SXM", seq_len=seq_len,
              micro_batch_size=micro_batch_size, zero_stage=3)
    return step_time(job, attention=attention, dp_overlap=0.5).mfu


def test_long_sequences_lower_mfu_where_attention_runs_below_the_matmuls():
    """7B on 8 H100 with FSDP, 16k tokens a micro-batch: MFU counts attention's whole square, which a causal
    kernel runs half of. Beyond 8k tokens MFU falls with the Triton kernel (counted, it runs below the GEMMs'
    rate), as llm-foundry's MPT rows fall; FlashAttention-3 counted runs above them, and its MFU rises."""
    seqs = (8192, 16384, 32768, 65536)
    def curve(attention):
        return [_fsdp_mfu(dataclasses.replace(preset("llama2-7b"), max_seq_len=s), gpus=8, seq_len=s,
                          micro_batch_size=max(1, 16384 // s), attention=attention) for s in seqs]
    triton, flash3 = curve("triton"), curve("flash3")
    assert all(a > b for a, b in zip(triton, triton[1:])), triton
    assert triton[0] - triton[-1] > 0.05
    assert all(a < b for a, b in zip(flash3, flash3[1:])), flash3


def test_mfu_rises_with_model_size_at_a_fixed_layout():
    """64 H100, FSDP, 4,096 tokens, micro-batch 2, FlashAttention-2: wider layers run larger GEMMs, and the
    memory-bound work per FLOP shrinks as 1/d: 125M < 1.3B < 6.7B < 13B."""
    sizes = [(768, 12, 12), (2048, 24, 16), (4096, 32, 32), (5120, 40, 40)]
    mfus = [_fsdp_mfu(gpt_config(hidden=d, num_layers=layers, num_heads=heads, seq_len=4096), gpus=64,
                      seq_len=4096, micro_batch_size=2, attention="flash") for d, layers, heads in sizes]
    assert all(a < b for a, b in zip(mfus, mfus[1:])), mfus


@pytest.mark.parametrize("gpu, per_node, rate", [("A100 80GB", 8, 200e9), ("H100 SXM", 8, 400e9),
                                                 ("H100 SXM", 2, 100e9), ("H100 SXM", 1, 50e9)])
def test_a_ring_across_nodes_moves_at_its_nics_per_node(gpu, per_node, rate):
    """A group of 64 GPUs on nodes of 8, with ``per_node`` of them in each node (consecutive ranks: all 8;
    strided by tp: fewer): k rings side by side, one NIC each, capped by NVLink (A100: 8 × 25 GB/s = 200;
    H100: 8 × 50 = 400, under NVLink 4's 450). Inside one node: NVLink."""
    hardware = GPUS[gpu]
    link = link_for(64 * 8 // per_node, 8, hardware, group_size=64)
    assert link.bytes_per_s == pytest.approx(rate) and link.alpha_s == hardware.network.alpha_s
    assert link_for(8, 8, hardware, group_size=8) is hardware.nvlink
    assert link_for(64, 8, hardware) is hardware.network          # point-to-point across nodes: one NIC


def test_runs_above_the_kernels_ceiling_are_marked():
    """compare_published's ceiling: the figure a run would reach on the model's kernels alone (no communication,
    bubble or optimizer), so ours <= ceiling always. The runs on one node of 8 A100 80GB that the model puts more
    than 5 points low (recomputation, large micro-batches) all report more than that ceiling: no overlap assumption
    could reach them, only faster kernels. Each also stays under its best-kernels ceiling (every matmul at the
    best rate a search over shapes measured on an A100, MAMF), most of them within a few percent of it: their
    GEMMs ran at about the best rate any benchmark shows, where the model holds every A100 to one sustained share."""
    rows = compare_published(llm_foundry_runs() + torchtitan_runs())
    assert all(row["ours"] <= row["ceiling"] + 1e-12 for row in rows)
    low = [row for row in rows if row["points"] < -5 and ", 8 A100 80GB," in row["name"]]
    assert len(low) >= 10 and all(row["above_ceiling"] for row in low)
    above = [row for row in rows if row["above_ceiling"]]
    assert all(row["ceiling"] < row["best_ceiling"] for row in above)   # the best kernels are faster than the model's
    off = [row for row in above if abs(row["points"]) > 5]
    nearness = sorted(row["theirs"] / row["best_ceiling"] for row in off)
    assert len(off) == 10 and nearness[-1] < 1 and nearness[len(nearness) // 2] > 0.95   # 0.91-0.99 when written
    assert all("its matmuls ran faster than the model's share" in row["why"] for row in off)
    # above even the best kernels: five rows, all within 5 points, all at 32k-65k tokens (attention's kernel ran
    # faster than the model's)
    beyond = [row for row in above if row["theirs"] > row["best_ceiling"]]
    assert len(beyond) == 5 and all(abs(row["points"]) <= 5 and (", s 32,768," in row["name"]
                                                                  or ", s 65,536," in row["name"]) for row in beyond)


def test_a_run_above_even_the_best_kernels_says_so():
    """No row more than 5 points off reports more than its best-kernels ceiling (five within 5 points do:
    test_runs_above_the_kernels_ceiling_are_marked); one that did would be told apart."""
    row = {"theirs": 0.62, "ceiling": 0.50, "best_ceiling": 0.60}
    assert above_ceiling_why(row).endswith("its other kernels (attention, say) ran faster than the model's")
    assert above_ceiling_why(dict(row, theirs=0.57)).endswith("95% of the 60.0% with every matmul at the best rate "
                                                              "measured on its GPU")



def test_the_best_kernels_ceiling_is_for_the_catalogues_gpus():
    """A GPU of your own has no attention benchmark here (its attention would take the matmul's shape factor too)
    and a calibrated one reads a measured GEMM grid: refused, by name."""
    own = dataclasses.replace(PUBLISHED_RUNS[0], gpu=dataclasses.replace(GPUS["A100 80GB"], name="My GPU"))
    with pytest.raises(ValueError, match="My GPU is not one of the catalogue's GPUs"):
        best_kernels_ceiling(own)
    assert best_kernels_ceiling(PUBLISHED_RUNS[0]) > compare_published(PUBLISHED_RUNS[:1])[0]["ceiling"]

def test_every_row_off_by_more_than_5_points_says_why_or_is_a_miss():
    """compare_published's "why": above the kernels' ceiling, or out of line with the run's own source (its
    siblings, the same model and GPUs at other GPU counts or sequence lengths, report a figure the run is far from
    while the model barely moves), or "" for the model's own misses. Rows within 5 points carry none."""
    rows = {row["name"]: row for row in compare_published(llm_foundry_runs() + torchtitan_runs()
                                                           + torchtitan_h100_runs())}
    assert all(bool(row["why"]) <= (abs(row["points"]) > 5) for row in rows.values())
    outlier = rows["MPT-1b, 32 A100 40GB, s 2,048, b 10"]           # 45.4% against 54.4-56.2% at 8 to 128 GPUs
    assert outlier["why"].startswith("out of line with its source: -10.2 points from the median of its 4 siblings "
                                     "(8 to 128 GPUs)")
    short = rows["MPT-760m, 8 A100 80GB, s 512, b 96"]               # 9-12 points below the same model at 2k-32k
    assert "(1,024 to 65,536 tokens)" in short["why"]
    # MPT-125M's rows were 6-11 points high while every memory-bound op streamed like a copy; at the shares one
    # H200 measured (kernel_times.STREAM_SHARE) all 20 are within 5
    assert all(abs(row["points"]) <= 5 for name, row in rows.items() if name.startswith("MPT-125m"))
    off = [row for row in rows.values() if abs(row["points"]) > 5]
    assert not [row["name"] for row in off if not row["why"]]    # 4 before the shares, 1 before out_of_order


def test_a_run_reported_below_the_same_run_on_more_gpus_is_out_of_order():
    """MPT-760m on 8 H100 is reported 3.0 points below the same run on 16 (the same micro-batch of 24 and global
    batch of 384, two micro-batches a step where 16 GPUs take one), which only adds communication; the model puts it
    0.2 points above, 5.7 points above its own figure and 2.7 above the wider run's. Of the 9 such pairs in the
    published runs, only this one and MPT-70b on 64 H100 (0.8 points, within 5 of the model) are reported the other
    way round. The reason changes no figure: a row's points are the same with its why taken out."""
    runs = PUBLISHED_RUNS + llm_foundry_runs() + torchtitan_runs() + torchtitan_h100_runs()
    rows = compare_published(runs)
    by_name = {row["name"]: row for row in rows}
    row = by_name["MPT-760m, 8 H100 SXM, s 2,048, b 24"]
    assert row["why"] == ("out of order in its source: -3.0 points from the same run on 16 GPUs (37.9%), which only "
                          "adds communication, where the model moves +0.2; at that run's figure it would be +2.7 "
                          "points off")
    assert 5 < row["points"] < 6
    pairs = [(run.name, index) for run in runs for index in wider_runs(run, runs)]
    assert len(pairs) == 9
    inverted = [name for name, index in pairs if rows[index]["theirs"] > by_name[name]["theirs"]]
    assert inverted == ["MPT-70b, 64 H100 SXM, s 2,048, b 8, recompute", "MPT-760m, 8 H100 SXM, s 2,048, b 24"]
    mpt_70b = by_name[inverted[0]]
    assert mpt_70b["why"] == "" and abs(mpt_70b["points"]) <= 5
    # a wider run's own figure is never above the run's, in the model
    assert all(rows[index]["ours"] <= by_name[name]["ours"] for name, index in pairs)


def test_every_published_run_together():
    """All 229 runs of the three sets (the sixteen, llm-foundry's, torchtitan's on A100 and H100), five sources: at
    least 208 within 5 points (the 4 torchtitan H100 rows, priced on the SXM, are not: they ran on another card).
    The 225 that ran on a card of the catalogue come out in the published order, Spearman's ρ at least 0.92
    (0.928 when written; 203 and 0.910 before the memory-bound ops took the shares one H200 measured)."""
    rows = compare_published(PUBLISHED_RUNS + llm_foundry_runs() + torchtitan_runs() + torchtitan_h100_runs())
    assert len(rows) == 229 and sum(abs(row["points"]) <= 5 for row in rows) >= 208
    on_theirs = [row for row in rows if row["on_its_gpu"] is None]
    assert len(on_theirs) == 225
    assert rank_correlation([row["ours"] for row in on_theirs], [row["theirs"] for row in on_theirs]) >= 0.92


def test_a_collectives_latency_grows_with_its_ring_as_nccls_model_says():
    """hardware.ring_latency, NCCL's tuning model (Simple protocol): 8.4 µs, plus 3.4 µs a step inside a node and
    14 µs a step across. An all-gather over N ranks takes N - 1 steps (n - 1 of them across n nodes), an
    all-reduce 2(N - 1) (2n across). MPT-125M on 8 to 128 A100s, 14 gathers and reductions a micro-batch: with
    more GPUs in the ring, each costs more, and MFU falls as llm-foundry's does."""
    from course_lib.hardware import ring_latency
    assert ring_latency("all_gather", 1) == 0
    assert ring_latency("all_gather", 8) == pytest.approx(8.4e-6 + 7 * 3.4e-6)
    assert ring_latency("reduce_scatter", 64, 8) == pytest.approx(8.4e-6 + 56 * 3.4e-6 + 7 * 14e-6)
    assert ring_latency("all_reduce", 16, 2) == pytest.approx(8.4e-6 + 26 * 3.4e-6 + 4 * 14e-6)
    family = [(run, row) for run, row in zip(llm_foundry_runs(), compare_published(llm_foundry_runs()))
              if run.name.startswith("MPT-125m") and run.name.endswith("A100 40GB, s 2,048, b 26")]
    family.sort(key=lambda pair: pair[0].mesh.dp)
    assert [run.mesh.dp for run, _ in family] == [8, 16, 32, 64, 128]
    theirs, ours = [row["theirs"] for _, row in family], [row["ours"] for _, row in family]
    assert theirs == sorted(theirs, reverse=True) and ours == sorted(ours, reverse=True)
