"""Traced collectives: every byte a rank puts on the wire, counted per op.

All parallel code in the course talks through a :class:`Comm`, a thin wrapper over one process group that
records each collective it issues: the op, the group size p, the payload (the tensor's bytes n), the bytes a
ring algorithm makes this rank *send*, and the time it took::

    comm = Comm()                              # the default group; Comm(group) for a subgroup
    with comm.trace() as log:
        comm.all_reduce(grad)
    log.summary()                              # {'all_reduce': OpTotals(count=1, payload_bytes=..., ...)}

Bytes on the wire per rank, for a ring over p ranks (n = payload bytes, as nccl-tests counts it):

    all_reduce       2(p-1)/p · n    reduce-scatter, then all-gather: each is (p-1) steps of n/p
    reduce_scatter    (p-1)/p · n    n = the full input; each rank keeps n/p
    all_gather        (p-1)/p · n    n = the full output; each rank contributes n/p
    broadcast              n         nccl-tests' bus factor 1 (a pipelined ring forwards n per rank;
                                     gloo's tree sends 2n, n, 0, 0 at p = 4: the total differs by op and library)
    send / recv            n / 0     the sender counts the bytes; the receiver sends nothing
    all_to_all        (p-1)/p · n    n = the whole input, p equal chunks, chunk j to rank j: a rank keeps its
                                     own chunk and sends the p-1 others (pairwise, not a ring; nccl-tests' factor)

These factors are also nccl-tests' "bus bandwidth" factors: busbw = algbw × factor, with algbw = n / time, so
busbw compares hardware across ops and sizes. :func:`measure_bandwidth` measures both; :class:`CostModel`
fits time = α + n/β to the measurements and predicts a collective's time (used by later notebooks).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# torch 2.13 calls the one-tensor collectives all_gather_single and reduce_scatter_single (its older names,
# all_gather_into_tensor and reduce_scatter_tensor, warn); a GPU box's own image may carry an older torch, which
# has only the older names (2.11 on the H200 where labs/results/gpu-1x-nvidia-h200 was measured).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
WAIT = "c10d::wait"     # the profiler span of a blocking op's wait (Comm._finish; course_lib.traces reads it)

RING_FACTOR = {  # bytes sent per rank / payload bytes, for a ring over p ranks
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0 if p > 1 else 0.0,
    "send": lambda p: 1.0,
    "recv": lambda p: 0.0,
    "all_to_all": lambda p: (p - 1) / p,
}


def wire_bytes(op: str, payload_bytes: int, group_size: int) -> float:
    """Bytes one rank sends for ``op`` on ``payload_bytes`` over a ring of ``group_size`` ranks."""
    if op not in RING_FACTOR:
        raise ValueError(f"op={op!r}: known ops are {', '.join(RING_FACTOR)}")
    if group_size < 1 or payload_bytes < 0:
        raise ValueError(f"group_size={group_size} must be >= 1 and payload_bytes={payload_bytes} >= 0")
    return RING_FACTOR[op](group_size) * payload_bytes


@dataclass
class Record:
    op: str
    group_size: int
    payload_bytes: int
    wire_bytes: float
    seconds: float
    start: float  # time.perf_counter() when the op began (for timelines)


@dataclass
class OpTotals:
    count: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    seconds: float = 0.0


@dataclass
class CommLog:
    """The collectives one rank issued inside a ``trace()`` block, in order."""
    records: list[Record] = field(default_factory=list)

    def summary(self) -> dict[str, OpTotals]:
        totals = defaultdict(OpTotals)
        for r in self.records:
            t = totals[r.op]
            t.count, t.payload_bytes = t.count + 1, t.payload_bytes + r.payload_bytes
            t.wire_bytes, t.seconds = t.wire_bytes + r.wire_bytes, t.seconds + r.seconds
        return dict(totals)

    @property
    def wire_bytes(self) -> float:
        return sum(r.wire_bytes for r in self.records)

    @property
    def payload_bytes(self) -> int:
        return sum(r.payload_bytes for r in self.records)


class Comm:
    """Collectives over one process group (default: the whole world), each one recorded while tracing.

    Async ops (``async_op=True``) are recorded when issued; their time is the time to *issue* them, and
    ``Work.wait()`` is where a caller pays for them. A blocking op is issued and then waited for inside a
    ``c10d::wait`` span, so that a profiler trace shows the wait as such (course_lib.traces) instead of as time of
    whatever op called it.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._logs: list[CommLog] = []

    @contextmanager
    def trace(self):
        """Record every collective issued through this Comm inside the block (nested traces see them too)."""
        log = CommLog()
        self._logs.append(log)
        try:
            yield log
        finally:
            self._logs.remove(log)

    def _finish(self, op: str, payload_bytes: int, start: float, work, async_op: bool):
        """Wait for a blocking op's ``work`` (a span of its own in a profiler trace), record the op, and return
        what torch.distributed would: the Work of an async op, None for a blocking one."""
        if not async_op:
            with torch.profiler.record_function(WAIT):
                work.wait()
        self._record(op, payload_bytes, start)
        return work if async_op else None

    def _record(self, op: str, payload_bytes: int, start: float) -> None:
        if self._logs:
            seconds = time.perf_counter() - start
            record = Record(op, self.size, payload_bytes, wire_bytes(op, payload_bytes, self.size), seconds, start)
            for log in self._logs:
                log.records.append(record)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        start = time.perf_counter()
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        return self._finish("all_reduce", tensor.nbytes, start, work, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                       async_op: bool = False):
        """``output`` (n/p elements) gets this rank's chunk of the sum of every rank's ``input`` (n)."""
        _check_stacked("reduce_scatter", whole=input, part=output, size=self.size)
        start = time.perf_counter()
        work = _reduce_scatter_single(output, input, op=op, group=self.group, async_op=True)
        return self._finish("reduce_scatter", input.nbytes, start, work, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """``output`` (n elements) gets every rank's ``input`` (n/p), concatenated in rank order."""
        _check_stacked("all_gather", whole=output, part=input, size=self.size)
        start = time.perf_counter()
        work = _all_gather_single(output, input, group=self.group, async_op=True)
        return self._finish("all_gather", output.nbytes, start, work, async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """``input`` is p equal chunks along dim 0: chunk j goes to rank j, and chunk i of ``output`` (same shape)
        comes from rank i. Equal chunks only (pad to a fixed size, as GShard does): this rank sends (p-1)/p of
        ``input``'s bytes, its own chunk staying here."""
        if input.shape != output.shape or input.dim() == 0 or input.shape[0] % self.size:
            raise ValueError(f"all_to_all: input {tuple(input.shape)} and output {tuple(output.shape)} must have "
                             f"the same shape, with dim 0 divisible by {self.size} (the group size)")
        start = time.perf_counter()
        work = dist.all_to_all_single(output, input, group=self.group, async_op=True)
        return self._finish("all_to_all", input.nbytes, start, work, async_op)

    def _global(self, rank: int) -> int:
        """torch.distributed names peers by their rank in the whole world; a Comm by their rank in its group."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """``src`` is a rank of this Comm's group."""
        start = time.perf_counter()
        work = dist.broadcast(tensor, src=self._global(src), group=self.group, async_op=True)
        return self._finish("broadcast", tensor.nbytes, start, work, async_op)

    def send(self, tensor: torch.Tensor, dst: int):
        """``dst`` is a rank of this Comm's group."""
        start = time.perf_counter()
        dist.send(tensor, dst=self._global(dst), group=self.group)
        self._record("send", tensor.nbytes, start)

    def recv(self, tensor: torch.Tensor, src: int):
        """``src`` is a rank of this Comm's group."""
        start = time.perf_counter()
        dist.recv(tensor, src=self._global(src), group=self.group)
        self._record("recv", tensor.nbytes, start)

    def exchange(self, sends=(), recvs=()) -> list:
        """Post point-to-point ``sends`` and ``recvs`` ((tensor, peer) pairs, peers ranks of this group)
        together, as one batch (torch's batch_isend_irecv; NCCL runs a batch as one group, so two ranks that
        send to each other at once do not wait on each other). Returns one Work per op, sends first: wait on
        a receive's before reading its tensor, on a send's before changing or freeing its tensor."""
        ops = [dist.P2POp(dist.isend, tensor, self._global(peer), self.group) for tensor, peer in sends]
        ops += [dist.P2POp(dist.irecv, tensor, self._global(peer), self.group) for tensor, peer in recvs]
        if not ops:
            return []
        start = time.perf_counter()
        works = dist.batch_isend_irecv(ops)
        for op, (tensor, _) in [("send", pair) for pair in sends] + [("recv", pair) for pair in recvs]:
            self._record(op, tensor.nbytes, start)
        return works

    def barrier(self):
        dist.barrier(group=self.group)


def _check_stacked(op: str, whole: torch.Tensor, part: torch.Tensor, size: int) -> None:
    """The whole tensor is ``size`` parts stacked along dim 0 (what the backends require, gloo strictly)."""
    if whole.dim() == 0 or whole.shape[0] != size * part.shape[0] or whole.shape[1:] != part.shape[1:]:
        raise ValueError(f"{op}: the whole tensor {tuple(whole.shape)} must be {size} (the group size) parts "
                         f"of shape {tuple(part.shape)} stacked along dim 0")


# ---------------------------------------------------------------------------------------- measuring


BUS_FACTOR = {op: RING_FACTOR[op] for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")}


def measure_bandwidth(comm: Comm, op: str = "all_reduce", sizes_bytes=(2**10, 2**14, 2**18, 2**22),
                      repeats: int = 5, warmup: int = 2) -> list[dict]:
    """nccl-tests style: for each size, the median time of ``op`` and its algbw and busbw (bytes/s).

    Call on every rank of ``comm``'s group. algbw = n / t; busbw = algbw × bus factor (2(p-1)/p for
    all_reduce, (p-1)/p for reduce_scatter and all_gather, 1 for broadcast), as nccl-tests define them.
    """
    if op not in BUS_FACTOR:
        raise ValueError(f"op={op!r}: measure one of {', '.join(BUS_FACTOR)}")
    rows = []
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(comm.group) == "nccl" else "cpu"
    for size in sizes_bytes:
        elements = max(comm.size, size // 4 // comm.size * comm.size)  # float32, divisible by the group
        full = torch.ones(elements, device=device)
        shard = torch.ones(elements // comm.size, device=device)
        run = {"all_reduce": lambda: comm.all_reduce(full),
               "reduce_scatter": lambda: comm.reduce_scatter(shard, full),
               "all_gather": lambda: comm.all_gather(full, shard),
               "broadcast": lambda: comm.broadcast(full)}[op]
        times = []
        for i in range(warmup + repeats):
            comm.barrier()
            start = time.perf_counter()
            run()
            if full.is_cuda:
                torch.cuda.synchronize()   # NCCL returns once the kernel is queued: wait for it to finish
            if i >= warmup:
                times.append(time.perf_counter() - start)
        seconds = statistics.median_high(times)
        algbw = full.nbytes / seconds
        rows.append({"op": op, "bytes": full.nbytes, "seconds": seconds, "algbw": algbw,
                     "busbw": algbw * BUS_FACTOR[op](comm.size)})
    return rows


@dataclass
class CostModel:
    """time = alpha + wire_bytes / beta: a fixed latency per collective plus bytes over bandwidth.

    ``fit`` takes rows of :func:`measure_bandwidth` (one op, one group size) and solves the least-squares
    line through (wire bytes, seconds). Where noise makes that line fall instead of rise (a small size measured
    slower than a large one), no bandwidth was seen: beta is infinite and every byte free, which says so.
    """
    alpha: float  # seconds per collective, whatever its size (latency)
    beta: float   # bytes per second each rank can send (bandwidth)

    @classmethod
    def fit(cls, rows: list[dict], group_size: int) -> CostModel:
        xs = torch.tensor([wire_bytes(r["op"], r["bytes"], group_size) for r in rows], dtype=torch.float64)
        ys = torch.tensor([r["seconds"] for r in rows], dtype=torch.float64)
        design = torch.stack([torch.ones_like(xs), xs], dim=1)
        alpha, per_byte = torch.linalg.lstsq(design, ys[:, None]).solution.flatten().tolist()
        return cls(alpha=max(alpha, 0.0), beta=1.0 / per_byte if per_byte > 0 else math.inf)

    def seconds(self, op: str, payload_bytes: int, group_size: int) -> float:
        return self.alpha + wire_bytes(op, payload_bytes, group_size) / self.beta


def bytes_written() -> int | None:
    """Bytes this process has handed to write-like system calls so far (Linux: ``wchar`` of /proc/self/io,
    all threads), or None without /proc. gloo sends through TCP sockets with writev, which the kernel counts
    here, so the difference around a collective (with nothing printed meanwhile) is what this rank really
    put on the wire: the payload plus gloo's header of a few hundred bytes per message."""
    try:
        with open("/proc/self/io") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("wchar:"))
    except (OSError, StopIteration):
        return None


def framing_bytes_per_message(counted_bytes: int, payload_bytes: float, num_all_reduces: int,
                              world_size: int) -> float:
    """What the transport added to each message: (bytes counted by the kernel - payload) / messages, a ring
    all-reduce sending 2(p-1) messages per rank. gloo's is a fixed few hundred bytes, whatever the size."""
    return (counted_bytes - payload_bytes) / (num_all_reduces * 2 * (world_size - 1))


def all_reduces_from_framing(counted_bytes: int, payload_bytes: float, framing_bytes: float,
                             world_size: int) -> float:
    """The inverse: how many ring all-reduces carried ``payload_bytes`` if each message costs ``framing_bytes``
    extra. A whole number means the framing explains every extra byte; torch's DDP does not say how many
    buckets it used, and this counts them."""
    return (counted_bytes - payload_bytes) / (2 * (world_size - 1) * framing_bytes)


class WatchCollectives(TorchDispatchMode):
    """Inside ``with WatchCollectives() as watch:`` every all-gather and reduce-scatter that torch's own
    implementations issue (FSDP2, DTensor: they call c10d directly, not through a Comm) is noted in
    ``watch.records`` as (op, payload bytes), the payload being the full tensor, as ``Comm`` counts it: the
    gather's output, the scatter's input. It sees them as torch dispatches them, below the Python API."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "allgather" in name or "reduce_scatter" in name:
            op = "all_gather" if "allgather" in name else "reduce_scatter"
            full = args[0] if op == "all_gather" else args[1]
            self.records.append((op, full.numel() * full.element_size()))
        return func(*args, **(kwargs or {}))

