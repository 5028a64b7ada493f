"""Lab 02: data parallelism three ways (naive, bucketed with overlap, torch's DDP) on N ranks, timed and counted.

    python labs/ddp.py --world-size 2                                    # this CPU: 2 gloo ranks via launch()
    torchrun --nproc-per-node 8 labs/ddp.py --hidden 1024 --layers 8 --steps 50 --bucket-mb 25   # one GPU box
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        labs/ddp.py --hidden 2048 --layers 16                                                  # two boxes

Every rank builds the same model, and each implementation in turn trains it for --steps steps on the same
batches (each rank its own slice; --accumulation micro-steps per optimizer step, synced once). For each the lab
prints the median step split into compute (forward + backward), exposed communication (the wait for gradients
after backward) and optimizer; the bytes each rank sends per step, predicted (gradient bytes × 2(p-1)/p) and
traced through course_lib.comm (torch's DDP bypasses it: "-"); the spread between replicas (0 when they are
identical); and how far ours ends from torch's DDP on the same data. It writes labs/results/ddp.json, ddp.png
(the step split) and ddp_timeline.png (one bucketed step on every rank).

On GPUs the split is measured after the compute stream has caught up; NCCL reports an all-reduce's future as
done when it is enqueued, so there the timeline's per-bucket bars show launches, not transfers. There each step
runs under bf16 autocast by default (--dtype fp32 to compare; gradients, and so the wire bytes, stay fp32), and
each row of the JSON holds every rank's torch.cuda.max_memory_allocated beside the ledger's state, 16 bytes
per parameter (buckets, activations and torch's own copies come on top).
"""

import torch
from torch.nn.utils import parameters_to_vector

from common import (
    autocast,
    fp32_adam_state_bytes,
    lab_parser,
    model_overrides,
    parse,
    peak_memory,
    reports,
    reset_peak_memory,
    write_record,
)
from course_lib import device, launch
from course_lib.comm import Comm
from course_lib.data import SyntheticTokens, micro_batches
from course_lib.model import build, preset
from course_lib.runs.ddp import DDP_KINDS, phase_seconds, replica_spread, train_step, wrap
from course_lib.runtime.arguments import integer, real
from course_lib.units import MiB

KINDS = DDP_KINDS[1:]   # naive, bucketed, torch


def compare_implementations(rank, world_size, *, overrides, steps, micro_batch_size, accumulation, seq_len, lr,
                            bucket_bytes, dtype):
    config = preset("tiny", **overrides)
    progress = None
    if rank == 0:
        from tqdm import tqdm
        progress = tqdm(total=steps * len(KINDS), desc=f"{world_size} ranks", mininterval=1.0)
    results = {kind: train_one(kind, rank, world_size, config=config, steps=steps, micro_batch_size=micro_batch_size,
                               accumulation=accumulation, seq_len=seq_len, lr=lr, bucket_bytes=bucket_bytes,
                               dtype=dtype, progress=progress)
               for kind in KINDS}
    if progress is not None:
        progress.close()
    return results


def train_one(kind, rank, world_size, *, config, steps, micro_batch_size, accumulation, seq_len, lr, bucket_bytes,
              dtype, progress):
    """One implementation's run; its model and optimizer are freed on return, so the next run's peak GPU
    memory is its own."""
    comm, dev = Comm(), device()
    data = SyntheticTokens(config.vocab_size, seq_len, seed=0)
    reset_peak_memory()
    model = build(config, seed=0, device=dev)
    parallel = wrap(model, kind, comm, bucket_bytes)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    records = []
    for step in range(steps):
        batches = [(x.to(dev), y.to(dev)) for x, y in
                   micro_batches(data, step, micro_batch_size, rank, world_size, accumulation)]
        if hasattr(parallel, "bucket_log"):
            parallel.bucket_log = []
        with comm.trace() as log, autocast(dtype):
            record = train_step(parallel, optimizer, batches)
        record.update(wire_bytes=log.wire_bytes, bucket_log=getattr(parallel, "bucket_log", None) or [])
        records.append(record)
        if progress is not None:
            progress.update()
    return {"steps": records, "spread": replica_spread(model, comm), "max_memory_allocated": peak_memory(),
            # rank 0's weights only, the ones compared (under torchrun every rank's result reaches every rank)
            "params": parameters_to_vector(model.parameters()).detach().cpu() if rank == 0 else None,
            "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def main(argv=None):
    parser = lab_parser(__doc__, lr=1e-3, min_steps=2)   # the first step (warm-up) is left out of the timings
    parser.add_argument("--micro-batch-size", type=integer(1), default=4)
    parser.add_argument("--accumulation", type=integer(1), default=1, help="micro-steps per optimizer step")
    parser.add_argument("--bucket-mb", type=real(at_least=1 / 1024, below=2**20), default=1.0,
                        help="bucket size of ours and torch's, MiB (1 KiB to 1 TiB)")
    args = parse(parser, argv)
    overrides = model_overrides(args)
    results = launch(compare_implementations, args.world_size, backend=args.backend, timeout=args.timeout, overrides=overrides,
                     steps=args.steps,
                     micro_batch_size=args.micro_batch_size, accumulation=args.accumulation, seq_len=args.seq_len,
                     lr=args.lr, bucket_bytes=int(args.bucket_mb * MiB), dtype=args.dtype)
    if not reports():
        return None
    p = args.world_size
    grad_bytes = results[0]["torch"]["grad_bytes"]
    predicted = grad_bytes * 2 * (p - 1) / p
    backend = args.backend
    print(f"\n{p} ranks ({backend}, {args.dtype}), {grad_bytes // 4:,} parameters, {args.bucket_mb} MiB buckets, "
          f"global batch {args.micro_batch_size} × {p} × {args.accumulation}")
    print(f"{'DDP':>9} {'step ms':>8} {'compute':>8} {'exposed':>8} {'optim':>6} {'wire bytes':>12} "
          f"{'predicted':>12} {'spread':>7} {'vs torch':>9}")
    rows = []
    for kind in KINDS:
        run = results[0][kind]
        phases = phase_seconds([r[kind]["steps"] for r in results])
        traced = run["steps"][-1]["wire_bytes"] if kind != "torch" else None
        gap = (run["params"] - results[0]["torch"]["params"]).abs().max().item()
        rows.append({"kind": kind, "step_ms": phases["step"] * 1e3, "compute_ms": phases["compute"] * 1e3,
                     "exposed_ms": phases["exposed communication"] * 1e3, "optimizer_ms": phases["optimizer"] * 1e3,
                     "wire_bytes": traced if traced is not None else predicted, "traced": traced is not None,
                     "predicted_wire_bytes": predicted, "replica_spread": run["spread"], "max_diff_vs_torch": gap,
                     "max_memory_allocated": [r[kind]["max_memory_allocated"] for r in results],
                     "predicted_state_bytes": [fp32_adam_state_bytes(grad_bytes // 4)] * p})
        print(f"{kind:>9} {phases['step'] * 1e3:>8.2f} {phases['compute'] * 1e3:>8.2f} "
              f"{phases['exposed communication'] * 1e3:>8.2f} {phases['optimizer'] * 1e3:>6.2f} "
              f"{'-' if traced is None else f'{traced:,.0f}':>12} {predicted:>12,.0f} {run['spread']:>7.1e} {gap:>9.1e}")
    steps = results[0]["bucketed"]["steps"]
    totals = [s["end"] - s["start"] for s in steps[1:]]
    typical = 1 + sorted(range(len(totals)), key=totals.__getitem__)[len(totals) // 2]
    bucketed_steps = [r["bucketed"]["steps"][typical] for r in results]
    record = {"world_size": p, "backend": backend, "params": grad_bytes // 4, "bucket_mb": args.bucket_mb,
              "rows": rows, "bucketed_step_per_rank": bucketed_steps,
              "max_memory_allocated": _largest_per_rank([row["max_memory_allocated"] for row in rows]),
              "predicted_state_bytes": rows[0]["predicted_state_bytes"]}
    path = write_record(args, "ddp", record)
    from course_lib.presentation.plots import ddp_timeline, step_time_split
    step_time_split({row["kind"]: {"compute": row["compute_ms"] / 1e3, "exposed communication": row["exposed_ms"] / 1e3,
                                   "optimizer": row["optimizer_ms"] / 1e3} for row in rows},
                    title=f"{p} ranks ({backend}): where a step's time goes").savefig(args.out / "ddp.png", dpi=100)
    ddp_timeline(bucketed_steps, title=f"bucketed DDP, step {typical}, {p} ranks ({backend})").savefig(
        args.out / "ddp_timeline.png", dpi=100)
    print(f"wrote {path}, ddp.png and ddp_timeline.png")
    return record


def _largest_per_rank(runs: list[list]) -> list:
    """Each rank's largest value over several runs (None on a CPU, where nothing was measured)."""
    return [None if None in values else max(values) for values in zip(*runs)]


if __name__ == "__main__":
    main()
