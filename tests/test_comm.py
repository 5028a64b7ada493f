"""course_lib.comm: traced collectives count exactly the ring formulas' bytes; the cost model and the bandwidth
benchmark give sane numbers; bad requests fail with errors that name the rule."""

import warnings

import pytest
import torch

from course_lib import launch
from course_lib.comm import BUS_FACTOR, RING_FACTOR, Comm, CostModel, bytes_written, measure_bandwidth, wire_bytes

pytestmark = pytest.mark.ranks   # run apart with: pytest -m ranks

N = 1200  # float32 elements: divisible by 2, 3 and 4, so every shard is whole


def every_op_traced(rank, world_size, n):
    """Each op once inside a trace; return the summary as plain tuples."""
    warnings.simplefilter("ignore")  # gloo's reduce_scatter/all_gather print a FutureWarning
    comm = Comm()
    full, part = torch.ones(n), torch.ones(n // world_size)
    comm.all_reduce(full.clone())  # outside the trace: not counted
    with comm.trace() as log:
        comm.all_reduce(full.clone())
        comm.reduce_scatter(part, full)
        comm.all_gather(full, part)
        comm.broadcast(full, src=0)
        if rank == 0:
            comm.send(full, dst=1)
        elif rank == 1:
            comm.recv(full, src=0)
        comm.all_reduce(full.clone(), async_op=True).wait()   # async ops are counted when issued
    return {op: (t.count, t.payload_bytes, t.wire_bytes) for op, t in log.summary().items()}, log.wire_bytes


@pytest.mark.parametrize("world_size", [2, 4])
def test_traced_bytes_are_exactly_the_ring_formulas(world_size):
    n_bytes = N * 4
    p = world_size
    for rank, (summary, total) in enumerate(launch(every_op_traced, world_size, n=N)):
        assert summary["all_reduce"] == (2, 2 * n_bytes, 2 * 2 * (p - 1) * n_bytes / p)
        assert summary["reduce_scatter"] == (1, n_bytes, (p - 1) * n_bytes / p)   # n is the full input
        assert summary["all_gather"] == (1, n_bytes, (p - 1) * n_bytes / p)       # n is the full output
        assert summary["broadcast"] == (1, n_bytes, n_bytes)
        if rank == 0:
            assert summary["send"] == (1, n_bytes, n_bytes) and "recv" not in summary
        elif rank == 1:
            assert summary["recv"] == (1, n_bytes, 0) and "send" not in summary
        assert total == sum(wire for _, _, wire in summary.values())
    # the formulas themselves, at the numbers the notebooks quote
    assert wire_bytes("all_reduce", 4000, 2) == 4000 and wire_bytes("all_reduce", 4000, 4) == 6000
    assert wire_bytes("reduce_scatter", 4000, 4) + wire_bytes("all_gather", 4000, 4) == wire_bytes("all_reduce", 4000, 4)
    assert wire_bytes("all_reduce", 4000, 1) == 0


def nested_traces(rank, world_size):
    comm = Comm()
    with comm.trace() as outer:
        comm.all_reduce(torch.ones(10))
        with comm.trace() as inner:
            comm.all_reduce(torch.ones(20))
    return len(outer.records), len(inner.records), inner.payload_bytes, outer.payload_bytes


def test_nested_traces_both_see_the_inner_ops():
    assert launch(nested_traces, 2) == [(2, 1, 80, 120)] * 2


def kernel_counted_bytes(rank, world_size, n):
    """Bytes the kernel saw this rank write (sockets included) around one all_reduce and one all_gather."""
    warnings.simplefilter("ignore")
    comm, full, part = Comm(), torch.ones(n), torch.ones(n // world_size)
    measured = {}
    for op, run in {"all_reduce": lambda: comm.all_reduce(full), "all_gather": lambda: comm.all_gather(full, part)}.items():
        run()            # warm up: the first collective of a kind may set up connections
        comm.barrier()
        before = bytes_written()
        run()
        measured[op] = bytes_written() - before
        comm.barrier()
    return measured


@pytest.mark.skipif(bytes_written() is None, reason="needs Linux's /proc/self/io")
@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_really_sends_the_ring_bytes_plus_a_small_header_per_step(world_size):
    """Not only our count: the kernel's own byte counter agrees with the ring formula. gloo adds a fixed
    header per message (288 bytes in torch 2.13); a ring all-reduce has 2(p-1) steps, an all-gather p-1."""
    p, n = world_size, 2**16
    for measured in launch(kernel_counted_bytes, world_size, n=n):
        headers = {op: measured[op] - wire_bytes(op, 4 * n, p) for op in measured}
        per_step = {"all_reduce": headers["all_reduce"] / (2 * (p - 1)), "all_gather": headers["all_gather"] / (p - 1)}
        assert per_step["all_reduce"] == per_step["all_gather"]      # the same fixed cost for every message
        assert 0 < per_step["all_reduce"] < 1024 < 4 * n // p         # ...and small beside a chunk


def test_wire_bytes_rejects_unknown_ops_and_bad_sizes():
    with pytest.raises(ValueError, match=r"op='gather': known ops are all_reduce, reduce_scatter"):
        wire_bytes("gather", 100, 2)
    with pytest.raises(ValueError, match=r"group_size=0 must be >= 1"):
        wire_bytes("all_reduce", 100, 0)
    with pytest.raises(ValueError, match=r"payload_bytes=-1"):
        wire_bytes("all_reduce", -1, 2)
    assert set(BUS_FACTOR) < set(RING_FACTOR)


def mismatched_shapes(rank, world_size):
    warnings.simplefilter("ignore")
    comm, errors = Comm(), []
    for bad in (lambda: comm.reduce_scatter(torch.ones(3), torch.ones(7)),
                lambda: comm.all_gather(torch.ones(7), torch.ones(3)),
                lambda: comm.all_gather(torch.ones(4, 3), torch.ones(2, 2)),   # rows right, columns not
                lambda: measure_bandwidth(comm, op="send")):
        try:
            bad()
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_collectives_reject_shapes_that_do_not_split_over_the_group():
    errors = launch(mismatched_shapes, 2)[0]
    assert errors == [
        "reduce_scatter: the whole tensor (7,) must be 2 (the group size) parts of shape (3,) stacked along dim 0",
        "all_gather: the whole tensor (7,) must be 2 (the group size) parts of shape (3,) stacked along dim 0",
        "all_gather: the whole tensor (4, 3) must be 2 (the group size) parts of shape (2, 2) stacked along dim 0",
        "op='send': measure one of all_reduce, reduce_scatter, all_gather, broadcast"]


def test_cost_model_fit_recovers_a_known_latency_and_bandwidth():
    alpha, beta, p = 25e-6, 1.5e9, 4
    rows = [{"op": "all_reduce", "bytes": n, "seconds": alpha + wire_bytes("all_reduce", n, p) / beta}
            for n in (2**10, 2**14, 2**18, 2**22)]
    model = CostModel.fit(rows, group_size=p)
    assert model.alpha == pytest.approx(alpha, rel=1e-6) and model.beta == pytest.approx(beta, rel=1e-6)
    assert model.seconds("all_reduce", 2**20, p) == pytest.approx(alpha + 1.5 * 2**20 / beta, rel=1e-6)
    # all_gather of the same payload sends half the bytes: the model predicts it from the same line
    assert model.seconds("all_gather", 2**20, p) == pytest.approx(alpha + 0.75 * 2**20 / beta, rel=1e-6)
    # a line through the origin or below it means "no measurable latency", not a negative one
    assert CostModel.fit([{**r, "seconds": r["seconds"] - 2 * alpha} for r in rows], p).alpha == 0.0


def bandwidth_rows(rank, world_size, op):
    warnings.simplefilter("ignore")
    return measure_bandwidth(Comm(), op=op, sizes_bytes=(2**10, 2**16, 2**18), repeats=3, warmup=1)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
def test_measure_bandwidth_rows_follow_nccl_tests_definitions(op):
    per_rank = launch(bandwidth_rows, 2, op=op)
    for rows in per_rank:
        assert [r["bytes"] for r in rows] == [2**10, 2**16, 2**18]   # sizes divisible by the group: kept
        for row in rows:
            assert row["op"] == op and 0 < row["seconds"] < 5
            assert row["algbw"] == pytest.approx(row["bytes"] / row["seconds"])
            assert row["busbw"] == pytest.approx(row["algbw"] * BUS_FACTOR[op](2))
    model = CostModel.fit(per_rank[0], group_size=2)
    assert model.alpha >= 0 and model.beta > 0


def test_framing_per_message_and_its_inverse_count_all_reduces():
    """A ring all-reduce sends 2(p-1) messages per rank; a fixed header on each explains every extra byte."""
    from course_lib.comm import all_reduces_from_framing, framing_bytes_per_message
    payload, header, p, num_all_reduces = 986_496, 288, 4, 12
    counted = payload + num_all_reduces * 2 * (p - 1) * header
    assert framing_bytes_per_message(counted, payload, num_all_reduces, p) == header
    assert all_reduces_from_framing(counted, payload, header, p) == num_all_reduces
    assert not all_reduces_from_framing(counted + 100, payload, header, p).is_integer()  # unexplained bytes show


def all_to_all_exchanged(rank, world_size):
    """Chunk j of this rank's input (two values, 100·rank + 2j and + 1) goes to rank j; also one bad shape."""
    comm = Comm()
    sent = torch.arange(2 * world_size, dtype=torch.float64) + 100 * rank
    received = torch.empty_like(sent)
    with comm.trace() as log:
        comm.all_to_all(received, sent)
    try:
        comm.all_to_all(torch.empty(5), torch.empty(5))
    except ValueError as err:
        error = str(err)
    return received.tolist(), [(r.op, r.payload_bytes, r.wire_bytes) for r in log.records], error


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_delivers_chunk_j_to_rank_j_and_counts_what_leaves_the_rank(world_size):
    p, payload = world_size, 2 * world_size * 8     # 2 float64 values per rank pair
    for rank, (received, records, error) in enumerate(launch(all_to_all_exchanged, world_size)):
        assert received == [float(100 * i + 2 * rank + half) for i in range(p) for half in (0, 1)]
        assert records == [("all_to_all", payload, (p - 1) * payload / p)]   # its own chunk stays here
        assert error == (f"all_to_all: input (5,) and output (5,) must have the same shape, with dim 0 divisible "
                         f"by {p} (the group size)")
    assert wire_bytes("all_to_all", 4000, 4) == 3000 and wire_bytes("all_to_all", 4000, 1) == 0
