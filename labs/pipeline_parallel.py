"""Lab 05: pipeline parallelism on N stages: bubbles against (p-1)/(m+p-1), memory of GPipe against 1F1B.

    python labs/pipeline_parallel.py --world-size 4 --real                            # this CPU: 4 gloo ranks
    torchrun --nproc-per-node 8 labs/pipeline_parallel.py --num-microbatches 8 32 64        # one GPU box, p = 8
    torchrun --nproc-per-node 8 labs/pipeline_parallel.py --hidden 1024 --layers 16 --seq-len 512 --real

The model (the course's tiny GPT, or a wider one with --hidden/--layers) is cut into one stage per rank. For each
schedule (GPipe, 1F1B) and each number of micro-batches m, one training step runs (the fastest of --steps):
  * in controlled cost: every forward and backward padded to --op-ms (the real compute runs inside), so the
    measured bubble (mean over ranks of 1 - busy / makespan) can be set beside the formula, and the bytes of
    saved activations each stage holds at its peak (saved-tensor hooks) show GPipe (m micro-batches) against
    1F1B (at most p);
  * with --real, also as fast as it goes: its step time.
Small models are also checked against one process on the whole batch (loss). Prints a table, and writes
labs/results/pipeline_parallel.json and .png (the bubble curve with the measurements, and one Gantt chart).
It runs on gloo (CPU) or NCCL (one GPU per rank): the executor posts every send and receive from the main
thread, batched as Megatron-LM does (see course_lib/pipeline_parallel.py). On GPUs every step runs under bf16
autocast by default (--dtype fp32 to compare; the activations passed between stages stay fp32, the residual
stream's dtype), and each row holds every stage's torch.cuda.max_memory_allocated beside the ledger's state of
a stage, its weights and gradients (4 + 4 bytes per parameter; the lab takes no optimizer step).
"""

from common import autocast, lab_parser, model_overrides, parse, peak_memory, reports, reset_peak_memory, write_record
from course_lib import launch
from course_lib.ledger import zero_state_bytes
from course_lib.model import build, preset
from course_lib.pipeline_parallel import Timeline, bubble_fraction, make_stage, partition_layers
from course_lib.runs.pipeline import pipeline_worker, single_process_step
from course_lib.runtime.arguments import integer
from course_lib.runtime.arguments import real as finite_number  # `real` names the --real run below


def sweep(rank, world_size, *, runs, dtype, **common):
    """pipeline_worker for each run in turn (as runs.pipeline.pipeline_sweep), in ``dtype``, with this rank's
    peak GPU memory during each run."""
    results = []
    for run in runs:
        reset_peak_memory()
        with autocast(dtype):
            result = pipeline_worker(rank, world_size, **common, **run)
        results.append({**result, "max_memory_allocated": peak_memory()})
    return results


def stage_state_bytes(config, p: int) -> list[int]:
    """The ledger's state of each stage: its weights and gradients, 4 + 4 bytes per parameter (no optimizer),
    its parameters counted on a stage cut from the model on the meta device (no memory) as every rank cuts it."""
    parts = partition_layers(config.num_layers, p)
    params = [sum(t.numel() for t in make_stage(build(config, device="meta"), s, parts).parameters())
              for s in range(p)]
    return [zero_state_bytes(n, 0, 1, weight_bytes=4, grad_bytes=4, optimizer_bytes=0)["total"] for n in params]


def check_arguments(args) -> None:
    """Rules between arguments, checked before any rank starts (common.parse)."""
    if args.layers is not None and args.layers < args.world_size:
        raise ValueError(f"--layers {args.layers} < --world-size {args.world_size} stages: every stage needs at "
                         "least one layer")
    batch = args.global_batch_size or 2 * max(args.num_microbatches)
    uneven = [m for m in args.num_microbatches if batch % m]
    if uneven:
        raise ValueError(f"a batch of {batch} rows does not split into {uneven} micro-batches of equal size: "
                         "give --global-batch-size a multiple of every --num-microbatches count")


def main(argv=None):
    parser = lab_parser(__doc__, world_size=4, steps=3)
    parser.add_argument("--num-microbatches", type=integer(1), nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--op-ms", type=finite_number(above=0, below=10_000), default=40.0,
                        help="controlled cost of each forward and backward, ms (under 10 s)")
    parser.add_argument("--global-batch-size", type=integer(1), help="rows per step (default: 2 × the largest micro-batch count)")
    parser.add_argument("--real", action="store_true", help="also run each step with real compute (its time)")
    parser.set_defaults(seq_len=8)
    args = parse(parser, argv, check=check_arguments)
    p, batch = args.world_size, args.global_batch_size or 2 * max(args.num_microbatches)
    overrides = {**model_overrides(args), "num_layers": args.layers or max(4, p)}   # a layer per stage at least
    runs = [{"schedule": s, "num_microbatches": m} for s in ("gpipe", "1f1b") for m in args.num_microbatches]
    common = dict(batch_size=batch, seq_len=args.seq_len, **overrides)
    weights = build(preset("tiny", **overrides), seed=0).state_dict()   # built once, copied by every rank
    controlled = launch(sweep, p, backend=args.backend, timeout=args.timeout, runs=runs, forward_ms=args.op_ms, steps=args.steps,
                        measure_memory=True, weights=weights, dtype=args.dtype, **common)
    real = (launch(sweep, p, backend=args.backend, timeout=args.timeout, runs=runs, steps=args.steps, weights=weights, dtype=args.dtype,
                   **common) if args.real else None)
    if not reports():
        return None
    predicted_state = stage_state_bytes(preset("tiny", **overrides), p)
    reference = single_process_step(**common)[0] if overrides.get("hidden", 64) <= 256 else None
    rows = []
    print(f"\n{p} stages ({args.backend}, {args.dtype}), batch {batch} × {args.seq_len} tokens")
    print(f"{'sched':>6} {'m':>4} {'formula':>8} {'measured':>9} {'gap':>7} {'in flight (stage 0)':>20} "
          f"{'saved KiB (stage 0)':>20} {'real step ms':>13} {'loss - 1 process':>17}")
    for i, run in enumerate(runs):
        timeline = Timeline.from_results([ranks[i] for ranks in controlled])
        row = {**run, "formula": bubble_fraction(p, run["num_microbatches"]), "measured": timeline.bubble,
               "idle_fractions": timeline.idle_fractions, "overruns": timeline.overruns,
               "peak_in_flight": [timeline.peak_in_flight(s) for s in range(p)],
               "peak_saved_bytes": [timeline.peak_in_flight_bytes(s) for s in range(p)],
               "loss": controlled[-1][i]["loss"],
               "max_memory_allocated": [ranks[i]["max_memory_allocated"] for ranks in controlled],
               "predicted_state_bytes": predicted_state}
        if real:
            real_timeline = Timeline.from_results([ranks[i] for ranks in real])
            row["real_step_s"] = real_timeline.makespan
            row["real_bubble"] = real_timeline.bubble
        rows.append(row)
        loss_gap = f"{row['loss'] - reference:+.1e}" if reference is not None else "-"
        real_ms = f"{row['real_step_s'] * 1e3:.1f}" if real else "-"
        print(f"{run['schedule']:>6} {run['num_microbatches']:>4} {row['formula']:8.1%} {row['measured']:9.1%} "
              f"{row['measured'] - row['formula']:+7.3f} {row['peak_in_flight'][0]:>20} "
              f"{row['peak_saved_bytes'][0] / 2**10:>20,.0f} {real_ms:>13} {loss_gap:>17}")
    worst = max(abs(r["measured"] - r["formula"]) for r in rows)
    print(f"max bubble gap: {worst:.3f}")

    peaks = [row["max_memory_allocated"] for row in rows]
    record = {"stages": p, "batch": batch, "seq_len": args.seq_len, "op_ms": args.op_ms, "model": overrides,
              "single_process_loss": reference, "rows": rows, "max_bubble_gap": worst,
              "max_memory_allocated": [None if None in stage else max(stage) for stage in zip(*peaks)],
              "predicted_state_bytes": predicted_state}
    path = write_record(args, "pipeline_parallel", record)
    save_figure(args, p, rows, controlled, runs)
    print(f"wrote {path} and .png")
    return record


def save_figure(args, p, rows, controlled, runs):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib.presentation.plots import pipeline_gantt

    fig, (curve, gantt) = plt.subplots(2, 1, figsize=(8, 3.2 + 0.45 * p + 1.3),
                                       gridspec_kw={"height_ratios": [3.2, 0.45 * p + 1.3]})
    ms = list(range(1, max(args.num_microbatches) + 1))
    curve.plot(ms, [100 * bubble_fraction(p, m) for m in ms], "-", color="0.6", lw=2, label="(p−1)/(m+p−1)")
    for schedule, marker in (("gpipe", "o"), ("1f1b", "s")):
        points = [(r["num_microbatches"], 100 * r["measured"]) for r in rows if r["schedule"] == schedule]
        curve.plot(*zip(*points), marker, ms=6, label=f"{schedule}, measured")
    curve.set(xscale="log", xlabel="micro-batches m", ylabel="bubble (%)", ylim=(0, 100),
              title=f"p = {p} stages, controlled cost {args.op_ms:g} ms per op")
    curve.legend(fontsize=8)
    shown = next(i for i, run in enumerate(runs) if run["schedule"] == "1f1b" and run["num_microbatches"] > 1)
    pipeline_gantt(Timeline.from_results([ranks[shown] for ranks in controlled]), ax=gantt,
                   title=f"1F1B, m = {runs[shown]['num_microbatches']}: measured")
    fig.tight_layout()
    fig.savefig(args.out / "pipeline_parallel.png", dpi=100)


if __name__ == "__main__":
    main()
