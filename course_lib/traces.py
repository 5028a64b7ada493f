"""Every rank's torch.profiler trace in one timeline, and how much of its communication was hidden.

torch.profiler records what each rank runs; ``export_chrome_trace`` writes it as Chrome trace JSON, which
Perfetto (ui.perfetto.dev) and chrome://tracing open. A collective appears twice in it: the op that hands it to
the backend on the rank's main thread (``c10d::allreduce_``, a fraction of a millisecond) and the transfer itself,
on the backend's own threads (``gloo:all_reduce`` on gloo's worker threads; with NCCL, ``nccl:all_reduce`` and the
``ncclDevKernel_...`` kernel on the GPU's stream). The transfer is the communication's time. On one machine every
rank's trace counts from the same clock, so the traces line up as they are; across machines the clocks agree only
as well as the hosts' clock synchronisation (NTP: ~1 ms; PTP: µs).

    traces = [json.load(open(path)) for path in paths]        # rank r's trace in paths[r]
    json.dump(merge(traces), open("all_ranks.json", "w"))     # one timeline, rank r as process r
    communication, compute = intervals(traces[0])             # (start, end) seconds on rank 0
    exposed_seconds(traces[0])                                # communication while no op computes

The split: communication is the union of the transfers; compute the union of the ops on the main thread (the
thread that ran the step), without the ``c10d::`` ops that only enqueue or wait, and without the ops that waited
for a blocking collective inside them (course_lib.comm marks each such wait as a ``c10d::wait`` span): tensor
parallelism's f and g spend most of their time waiting for their all-reduce; their children still count. Exposed communication is the
part of the first union outside the second (the rank had nothing to do but wait); overlapped, the part inside.
"""

from __future__ import annotations

import re

from .comm import WAIT

TRANSFER = re.compile(r"^(gloo:|nccl:|ncclDevKernel|ncclKernel)")
ENQUEUE = "c10d::"


def merge(traces: list[dict]) -> dict:
    """One Chrome trace of every rank: rank r's events as process r, named "rank r"."""
    events = []
    for rank, trace in enumerate(traces):
        for event in trace["traceEvents"]:
            if event.get("ph") == "M" and event.get("name") in ("process_name", "process_sort_index"):
                continue                               # each rank's own "python": replaced below
            events.append({**event, "pid": rank})
        events += [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
                   {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping (start, end) spans joined: a sorted list of disjoint ones."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def intervals(trace: dict) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(communication, compute) of one rank's trace as exported: each a sorted list of disjoint (start, end)
    seconds on the trace's clock. A trace with GPU kernels is read on the GPU: NCCL's kernels against the
    others (the host runs ahead of its GPU, so its ops say nothing of what the GPU overlaps)."""
    spans = [event for event in trace["traceEvents"] if event.get("ph") == "X" and "dur" in event]
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    if kernels:     # a GPU's trace: what counts is the GPU's time, NCCL's kernels against all the others
        return (union([_seconds(e) for e in kernels if TRANSFER.match(e["name"])]),
                union([_seconds(e) for e in kernels if not TRANSFER.match(e["name"])]))
    main_thread = next(e["pid"] for e in spans if e.get("cat") == "cpu_op")   # Linux: the main thread's id
    communication = [_seconds(e) for e in spans if TRANSFER.match(e["name"])]
    ops = [e for e in spans if e.get("tid") == main_thread and e.get("cat") in ("cpu_op", "user_annotation")]
    waits = [(e["ts"], e["ts"] + e["dur"]) for e in ops if e["name"] == WAIT]

    def waited_inside(op) -> bool:           # an op that called a blocking collective (TP's f and g)
        return any(op["ts"] <= start and end <= op["ts"] + op["dur"] for start, end in waits)

    compute = [_seconds(e) for e in ops
               if e.get("cat") == "cpu_op" and not e["name"].startswith(ENQUEUE) and not waited_inside(e)]
    return union(communication), union(compute)


def _seconds(event: dict) -> tuple[float, float]:
    """An event's (start, end) in seconds (the trace counts µs)."""
    return event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds that two unions of disjoint intervals share."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def exposed_seconds(trace: dict) -> float:
    """Communication during which the rank's main thread ran no op: the time it only waited."""
    communication, compute = intervals(trace)
    return sum(end - start for start, end in communication) - _overlap(communication, compute)


def overlapped_seconds(trace: dict) -> float:
    """Communication hidden behind the rank's own computation."""
    return _overlap(*intervals(trace))
