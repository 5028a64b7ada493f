"""Lab 11: one step of DDP, FSDP and TP profiled on every rank and merged into one timeline; then a hang, and each
rank's flight recorder read by torch's analyzer.

    python labs/profiling.py --world-size 2                                 # this CPU: 2 gloo ranks via launch()
    python labs/profiling.py --world-size 8 --hidden 1024 --layers 8        # one GPU box: 8 NCCL ranks via launch()

Part 1, the timeline. For each of three ways to split the same model, ours bucketed DDP (course_lib.ddp), torch's
FSDP2 (``fully_shard`` on every block and the root) and ours TP (course_lib.tensor_parallel), every rank runs
--steps warm-up steps and then one step (forward, backward, the gradients synced) under torch.profiler, with the
GPU's activity on a GPU. The ranks' traces are merged into one Chrome trace per way (profile_ddp.json,
profile_fsdp.json, profile_tp.json: open them in ui.perfetto.dev, rank r as process r) and drawn one above the
other (profiling.png). Per rank it prints the communication's time, the part of it behind computation and the part
exposed (course_lib.traces: on a GPU, the NCCL kernels on the GPU's stream against the compute kernels; on a CPU,
gloo's transfers against the main thread's ops).

Part 2, the flight recorder. Notebook 11's first incident in its bare form on the same ranks: rank 0 issues one
all-reduce more than the others, which have gone on to a barrier, and the job hangs. A few seconds in, every rank
dumps its flight recorder (the ring buffer of its last collectives that torch keeps on every backend), the ranks are
stopped, and torch's analyzer (torchfrtrace) reads the dumps and names the collective that not every rank issued.
Part 2 needs ranks that this process starts and stops (``launch``), so under torchrun, which would end the whole
job, it is skipped and says so.

It writes profiling.json (each way's per-rank times, the analyzer's finding), the three merged traces, their
figure, and flight_recorder/rank<r> (the dumps).
"""

import json
import os
import tempfile
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from common import autocast, lab_parser, model_overrides, parse, reports, write_record
from course_lib import device, launch, traces
from course_lib.comm import Comm
from course_lib.data import SyntheticTokens, shard
from course_lib.ddp import BucketedDDP
from course_lib.model import build, loss_fn, preset
from course_lib.presentation.incidents.hangs import analyze_flight_records, dump_flight_recorder
from course_lib.runs.profile import kineto_quiet
from course_lib.runtime.arguments import integer
from course_lib.runtime.launch import RankTimeout
from course_lib.tensor_parallel import apply_tp, check_tp_divisible
from course_lib.units import MiB

WAYS = ("ddp", "fsdp", "tp")
# seconds until each rank dumps its recorder: the ranks hang at once on gloo; NCCL first sets up its
# communicators (seconds on 8 GPUs). Two seconds later the dumps are written and the hung ranks are stopped.
RECORD_AFTER_S = {"gloo": 1.0, "nccl": 15.0}


def split(way: str, model):
    """``model`` split one way; returns the module to train and what ends the gradients' sync after backward."""
    if way == "ddp":
        ddp = BucketedDDP(model, Comm(), bucket_bytes=4 * MiB)
        return ddp, ddp.finish_gradient_sync
    if way == "fsdp":
        for layer in model.layers:
            fully_shard(layer)              # each block's all-gather prefetched while the one before computes
        return fully_shard(model), lambda: None
    return apply_tp(model, Comm()), lambda: None


def profiled_steps(rank, world_size, *, overrides, batch_size, seq_len, warmup, dtype):
    """Each way's last step under torch.profiler on this rank: its Chrome trace (a dict) and its times."""
    config = preset("tiny", **overrides)
    data = SyntheticTokens(config.vocab_size, seq_len, seed=0)
    return {way: profiled_step(way, build(config, seed=0, device=device()), data.batch(0, batch_size), rank,
                               world_size, warmup=warmup, dtype=dtype)
            for way in WAYS}


def profiled_step(way, model, batch, rank, world_size, *, warmup, dtype) -> dict:
    """``model`` split ``way``, ``warmup`` steps, then one under torch.profiler (the model is freed on return, so
    the next way's memory is its own)."""
    dev = device()
    module, finish_sync = split(way, model)
    inputs, targets = (t.to(dev) for t in batch)
    if way != "tp":                         # data parallel: each rank its rows; TP: every rank the same batch
        inputs, targets = shard(inputs, rank, world_size), shard(targets, rank, world_size)

    def step():
        with autocast(dtype):
            loss = loss_fn(module(inputs), targets)
        loss.backward()
        finish_sync()
        module.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)     # the GPU's work of this step inside the profiled span

    for _ in range(warmup):
        step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with kineto_quiet(), torch.profiler.profile(activities=activities) as profiler:
        step()
    with tempfile.TemporaryDirectory() as folder:       # the exporter writes a file; read it back
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
    communication, _ = traces.intervals(trace)
    return {"trace": trace, "communication_s": sum(end - start for start, end in communication),
            "overlapped_s": traces.overlapped_seconds(trace), "exposed_s": traces.exposed_seconds(trace)}


def mismatched_collectives(rank, world_size, *, folder, record_after_s, steps=2):
    """Notebook 11's incident 1, bare: ``steps`` gradient all-reduces on every rank and one more on rank 0, then a
    barrier. Rank 0's extra all-reduce meets the others' barrier: the job hangs. ``record_after_s`` in, a timer
    thread dumps this rank's flight recorder to ``folder``/rank<r> while the main thread waits."""
    dump = threading.Timer(record_after_s, dump_flight_recorder, [Path(folder) / f"rank{rank}", world_size])
    dump.daemon = True
    dump.start()
    gradient = torch.ones(128, 64, device=device())
    for _ in range(steps + (rank == 0)):
        dist.all_reduce(gradient)
    dist.barrier()
    if gradient.is_cuda:
        torch.cuda.synchronize()


def flight_recorder(args) -> dict:
    """Part 2: the hang, the dumps, torch's analyzer on them."""
    if "RANK" in os.environ:
        return {"skipped": "under torchrun: a hang would end the job; run `python labs/profiling.py --world-size N`"}
    folder = args.out / "flight_recorder"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("rank[0-9]*"):       # a last run's dumps (this lab's own files) must not pass for these
        old.unlink()
    try:
        record_after_s = RECORD_AFTER_S[args.backend]
        launch(mismatched_collectives, args.world_size, backend=args.backend, timeout=record_after_s + 2.0,
               folder=str(folder), record_after_s=record_after_s)
        hung = False
    except RankTimeout:
        hung = True
    dumps = sorted(path.name for path in folder.iterdir() if path.name.startswith("rank"))
    report = analyze_flight_records(str(folder)) if dumps else ""
    finding = report[report.find("Collective sequence number"):report.find("collective stack trace")].strip()
    return {"hung": hung, "dumps": dumps, "finding": finding,
            "mismatch_found": "MISMATCH" in finding and "Culprit rank" in finding}


def main(argv=None):
    parser = lab_parser(__doc__, steps=2)          # --steps: warm-up steps before the profiled one
    parser.add_argument("--global-batch-size", type=integer(1), default=8)
    args = parse(parser, argv, check=check_arguments)
    results = launch(profiled_steps, args.world_size, backend=args.backend, timeout=args.timeout,
                     overrides=model_overrides(args), batch_size=args.global_batch_size, seq_len=args.seq_len,
                     warmup=args.steps, dtype=args.dtype)
    record = {"ways": {}, "merged_ranks": {}, "flight_recorder": None}
    if reports():
        import matplotlib.pyplot as plt

        from course_lib.presentation.plots import trace_timeline
        figure, axes = plt.subplots(len(WAYS), 1, figsize=(10, len(WAYS) * (0.9 + 0.8 * args.world_size)))
        print(f"\n{args.world_size} ranks ({args.backend}, {args.dtype}): one step profiled on every rank")
        print(f"{'way':>5} {'rank':>4} {'communication ms':>17} {'behind compute':>15} {'exposed':>8}")
        for way, ax in zip(WAYS, axes):
            per_rank = [r[way] for r in results]
            for rank, times in enumerate(per_rank):
                print(f"{way:>5} {rank:>4} {times['communication_s'] * 1e3:>17.2f} {times['overlapped_s'] * 1e3:>15.2f} "
                      f"{times['exposed_s'] * 1e3:>8.2f}")
            rank_traces = [times.pop("trace") for times in per_rank]
            merged = traces.merge(rank_traces)
            write_record(args, f"profile_{way}", merged)
            record["merged_ranks"][way] = sorted({event["pid"] for event in merged["traceEvents"]})
            trace_timeline(rank_traces, title=f"{way}: one step, {args.world_size} ranks ({args.backend})", ax=ax)
            record["ways"][way] = per_rank
        figure.tight_layout()
        figure.savefig(args.out / "profiling.png", dpi=100)
    record["flight_recorder"] = flight_recorder(args) if reports() else None
    if not reports():
        return None
    found = record["flight_recorder"]
    print(f"\nflight recorder: {found.get('skipped') or found['finding'] or 'no finding: ' + str(found)}")
    path = write_record(args, "profiling", record)
    print(f"wrote {path}, profiling.png and profile_<way>.json (for ui.perfetto.dev) for {', '.join(WAYS)}")
    return record


def check_arguments(args) -> None:
    """TP must split the model's heads, and data parallelism the batch, over --world-size (before any rank starts)."""
    check_tp_divisible(preset("tiny", **model_overrides(args)), args.world_size)
    if args.global_batch_size % args.world_size:
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not divisible by --world-size "
                         f"{args.world_size}: every data-parallel rank takes the same number of rows")


if __name__ == "__main__":
    main()
