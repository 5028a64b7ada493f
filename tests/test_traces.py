"""course_lib.traces: the interval arithmetic on a trace made by hand (exact), merging ranks into one timeline,
and a real 2-rank bucketed DDP step under torch.profiler whose all-reduces overlap backward."""

import json

import pytest

from course_lib import launch, traces
from course_lib.runs.profile import exposed_after, profiled_ddp_step
from course_lib.units import MiB

MAIN = 100


def op(name, start_us, dur_us, tid=MAIN, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": start_us, "dur": dur_us, "pid": MAIN, "tid": tid, "cat": cat}


HAND_MADE = {"traceEvents": [
    op("aten::mm", 0, 100), op("aten::add", 50, 20),            # nested: one span 0..100
    op("c10d::allreduce_", 100, 5),                             # enqueueing is not compute
    op("aten::mm", 150, 50),
    op("gloo:all_reduce", 80, 100, tid=7, cat="user_annotation"),   # 80..180: 20 + 30 covered, 50 exposed
    op("gloo:all_reduce", 250, 10, tid=8, cat="user_annotation"),   # all exposed
    {"ph": "M", "name": "process_name", "pid": MAIN, "tid": 0, "args": {"name": "python"}}]}


def test_intervals_exposed_and_overlapped_on_a_hand_made_trace():
    communication, compute = traces.intervals(HAND_MADE)
    assert communication == [(80e-6, 180e-6), (250e-6, 260e-6)]
    assert compute == [(0.0, 100e-6), (150e-6, 200e-6)]
    assert traces.overlapped_seconds(HAND_MADE) == pytest.approx(50e-6, abs=1e-12)
    assert traces.exposed_seconds(HAND_MADE) == pytest.approx(60e-6, abs=1e-12)


def test_an_op_that_waited_for_a_blocking_collective_is_not_compute_but_its_children_are():
    trace = {"traceEvents": [
        op("ReduceFromTensorParallelRegion", 0, 100),                 # TP's g: a copy, then a blocking all-reduce
        op("aten::copy_", 5, 10), op("c10d::allreduce_", 20, 2), op("c10d::wait", 22, 78, cat="user_annotation"),
        op("aten::mm", 100, 40),
        op("gloo:all_reduce", 30, 70, tid=7, cat="user_annotation")]}
    communication, compute = traces.intervals(trace)
    assert compute == [(5e-6, 15e-6), (100e-6, 140e-6)]
    assert traces.exposed_seconds(trace) == pytest.approx(70e-6, abs=1e-12)       # all of it: the op waited


def test_a_gpu_trace_is_read_on_the_gpu_nccl_kernels_against_the_others():
    trace = {"traceEvents": [
        op("aten::mm", 0, 10), op("c10d::allreduce_", 10, 2),                  # the host, far ahead of its GPU
        op("sm80_xmma_gemm", 100, 50, tid=7, cat="kernel"),
        op("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 120, 60, tid=20, cat="kernel"),
        op("sm80_xmma_gemm", 190, 10, tid=7, cat="kernel")]}
    assert traces.intervals(trace) == ([(120e-6, 180e-6)], [(100e-6, 150e-6), (190e-6, 200e-6)])
    assert traces.overlapped_seconds(trace) == pytest.approx(30e-6, abs=1e-12)
    assert traces.exposed_seconds(trace) == pytest.approx(30e-6, abs=1e-12)


def test_merge_makes_each_rank_a_process_of_its_own():
    merged = traces.merge([HAND_MADE, HAND_MADE])
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    assert sum(e.get("ph") == "X" for e in merged["traceEvents"]) == 2 * 6


def test_exposed_after_counts_the_union_of_buckets_after_backward():
    buckets = [{"issued": 0.0, "done": 1.0}, {"issued": 1.5, "done": 3.0}, {"issued": 2.0, "done": 2.5}]
    assert exposed_after(buckets, backward_end=2.0) == pytest.approx(1.0)
    assert exposed_after(buckets, backward_end=4.0) == 0.0


@pytest.mark.ranks
def test_a_bucketed_ddp_step_s_all_reduces_overlap_backward_in_every_rank_s_trace(tmp_path):
    results = launch(profiled_ddp_step, 2, folder=str(tmp_path), bucket_bytes=1 * MiB)
    for rank, result in enumerate(results):
        trace = json.loads((tmp_path / f"rank{rank}.json").read_text())
        communication, compute = traces.intervals(trace)
        assert communication and len(result["buckets"]) > 4   # (the transfers may touch: a rank waits for the other)
        assert traces.overlapped_seconds(trace) > 0, f"rank {rank}: no all-reduce ran during backward"
        assert communication[0][0] < compute[-1][0]       # the first transfer starts before the last op
