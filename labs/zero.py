"""Lab 03: ZeRO stages 0-3 by hand, and torch's ZeroRedundancyOptimizer and FSDP2 fully_shard, on N ranks.

    python labs/zero.py --world-size 4                                          # this CPU: 4 gloo ranks
    torchrun --nproc-per-node 8 labs/zero.py --hidden 2048 --layers 16 --steps 20    # one GPU box (NCCL)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        labs/zero.py --hidden 4096 --layers 16                                  # two boxes

Every run trains the same model (bf16 weights and gradients, MixedPrecisionAdam: the ledger's 2 + 2 + 12 bytes
per parameter) on the same data. For each, the lab prints: the training state per rank, measured from tensor
storage on every rank (the largest is shown) against ledger.zero_state_bytes; the bytes each rank sent per
step, traced (ours) against zero_bytes.wire_bytes_per_step (stages 0, 1, 2: 2Ψ(N-1)/N; stage 3: 3Ψ(N-1)/N); the
median step time (slowest rank); the last loss, averaged over ranks. It checks that the measured state equals
the formula, and reports how far torch's runs end from ours at the same stage (on 2 ranks: bit-identical; on
more, bf16 sums in another order: about one bf16 step, 2**-7 relative). Writes labs/results/zero.json and zero.png (the
state of every rank, every stage) for notebook 03 to show beside the learner's CPU run. On GPUs (NCCL, one GPU
per rank) each run also records every rank's torch.cuda.max_memory_allocated beside the ledger's state: the
state plus one step's activations and the gathered weights in flight. The weights are bf16 already, so this lab
has no --dtype: mixed precision here is MixedPrecisionAdam's fp32 master copy, not autocast.
"""

import statistics

import torch

from common import lab_parser, model_overrides, parse, peak_memory, reports, reset_peak_memory, write_record
from course_lib import launch
from course_lib.ledger import zero_state_bytes
from course_lib.model import build, count_params, preset
from course_lib.runs.zero import train
from course_lib.runtime.arguments import integer
from course_lib.zero import padded_num_params
from course_lib.zero_bytes import wire_bytes_per_step

RUNS = [("ours", 0), ("ours", 1), ("ours", 2), ("ours", 3), ("zero_redundancy", 1), ("fully_shard", 3)]


def every_run(rank, world_size, *, config, steps, micro_batch_size, seq_len, lr):
    results = {}
    for impl, stage in RUNS:
        reset_peak_memory()                           # each run's peak is its own: the last run's model is freed
        run = train(rank, world_size, impl=impl, zero_stage=stage, steps=steps, micro_batch_size=micro_batch_size,
                    seq_len=seq_len, lr=lr, optimizer="mixed", dtype=torch.bfloat16, config=config, progress=True)
        # bf16 weights, sent back as fp32 for the comparison, by rank 0 only (the one compared: under torchrun every
        # rank's result reaches every rank, 6 copies of the weights from each)
        run["params"] = run["params"].float() if rank == 0 else None
        run["max_memory_allocated"] = peak_memory()
        results[f"{impl} {stage}"] = run
    results["backend"] = torch.distributed.get_backend()
    return results


def main(argv=None):
    parser = lab_parser(__doc__, world_size=4, steps=8, lr=1e-3, autocast=False, min_steps=2)  # median after step 1
    parser.add_argument("--micro-batch-size", type=integer(1), default=4)
    parser.set_defaults(dtype="bf16")                 # recorded with the results: bf16 weights and gradients
    args = parse(parser, argv)
    overrides = model_overrides(args)
    config = preset("tiny", **overrides)
    per_rank = launch(every_run, args.world_size, backend=args.backend, timeout=args.timeout, config=config, steps=args.steps,
                      micro_batch_size=args.micro_batch_size,
                      seq_len=args.seq_len, lr=args.lr)
    if not reports():
        return None
    n = args.world_size
    params = count_params(config)
    padded = padded_num_params(build(config, device="meta"), n)
    grad_bytes = 2 * padded
    print(f"\n{n} ranks ({per_rank[0]['backend']}), {params:,} parameters ({padded:,} with padding), bf16 + MixedPrecisionAdam, "
          f"{args.micro_batch_size} x {args.seq_len} tokens per rank, median of {args.steps - 1} steps\n")
    print(f"{'run':>18} {'state/rank (MiB)':>17} {'formula':>9} {'wire/step (MiB)':>16} {'formula':>9} "
          f"{'step (ms)':>10} {'last loss':>10} {'‖Δw‖/‖w-w₀‖ vs ours':>20}")
    start = torch.cat([p.detach().float().reshape(-1) for p in build(config, seed=0, dtype=torch.bfloat16).parameters()])
    record = {"world_size": n, "params": params, "padded_params": padded,
              "backend": per_rank[0]["backend"], "runs": {}}
    mib = 2**20
    for impl, stage in RUNS:
        key = f"{impl} {stage}"
        runs = [ranks[key] for ranks in per_rank]
        predicted = zero_state_bytes(padded, stage, n)
        largest = max(run["state"]["total"] for run in runs)
        wire = sum(runs[0]["wire"][-1].values()) if impl == "ours" else None
        wire_predicted = sum(wire_bytes_per_step(grad_bytes, stage, n).values())
        step = statistics.median(max(r["step_seconds"][i] for r in runs) for i in range(1, args.steps))
        loss = sum(r["losses"][-1] for r in runs) / n
        ours = per_rank[0][f"ours {stage}"]["params"]
        gap = ((runs[0]["params"] - ours).norm() / (ours - start).norm()).item()   # apart, against the way trained
        print(f"{key:>18} {largest / mib:>17.3f} {predicted['total'] / mib:>9.3f} "
              f"{'—' if wire is None else f'{wire / mib:.3f}':>16} {wire_predicted / mib:>9.3f} {step * 1e3:>10.1f} "
              f"{loss:>10.4f} {gap:>20.1e}")
        if impl == "ours":   # the ledger, to the byte, on every rank
            assert all({k: r["state"][k] for k in predicted} == predicted for r in runs), key
            assert abs(wire - wire_predicted) <= 1e-9 * wire_predicted, key
        record["runs"][key] = {"impl": impl, "stage": stage, "state_per_rank": [r["state"] for r in runs],
                               "predicted_state": predicted, "wire_bytes": wire, "predicted_wire_bytes": wire_predicted,
                               "step_seconds": step, "losses": [sum(x) / n for x in zip(*(r["losses"] for r in runs))],
                               "bytes_written": runs[0]["bytes_written"][-1], "weight_gap_vs_ours": gap,
                               "max_memory_allocated": [r["max_memory_allocated"] for r in runs],
                               "predicted_state_bytes": [predicted["total"]] * n}
    every = record["runs"].values()   # the whole lab: each rank's highest peak, the largest state predicted
    record["max_memory_allocated"] = [None if None in peaks else max(peaks)
                                      for peaks in zip(*(run["max_memory_allocated"] for run in every))]
    record["predicted_state_bytes"] = [max(run["predicted_state_bytes"][0] for run in every)] * n
    path = write_record(args, "zero", record)
    from course_lib.presentation.plots import zero_per_rank_bars
    unit = ("GiB", 2**30) if predicted["total"] > 2**31 else ("MiB", 2**20) if predicted["total"] > 2**21 else ("KiB", 2**10)
    measured = {n: {s: record["runs"][f"ours {s}"]["state_per_rank"] for s in range(4)}}
    formula = {n: {s: record["runs"][f"ours {s}"]["predicted_state"]["total"] for s in range(4)}}
    zero_per_rank_bars(measured, formula, unit=unit, title=f"{params:,} parameters on {n} ranks: training state per "
                       "rank, measured (bars) and zero_state_bytes (line)").savefig(args.out / "zero.png", dpi=100)
    print(f"\nwrote {path} and .png")
    return record


if __name__ == "__main__":
    main()
