"""Lab 06: train the course model on a dp × tp × pp grid of ranks, and count what each axis holds and sends.

    python labs/parallel_3d.py --world-size 8 --tp 2 --pp 2          # this CPU: 8 gloo ranks, dp = 8/(2·2) = 2
    torchrun --nproc-per-node 8 labs/parallel_3d.py --tp 2 --pp 2 --hidden 1024 --layers 8 --global-batch-size 32
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        labs/parallel_3d.py --tp 8 --pp 2 --hidden 512 --layers 4 --global-batch-size 64 --num-microbatches 16

Ranks are laid out as in course_lib/mesh.py and the model split by course_lib/parallelize.py: tp fastest (a TP group is consecutive ranks, inside a node), pp
slowest (stages across nodes), dp between. Each step: this dp rank's share of the batch goes through the
pipeline (1F1B) in --num-microbatches micro-batches, with TP's all-reduces inside every layer, then gradients are
averaged over the dp group. The table has one row per rank: coordinates, parameters held, and the bytes it sent
on each axis in the last step, traced, with the formula's (per_rank.sent_bytes_per_rank) beside them; then the
median step time. Results go to labs/results/parallel_3d.json and .png for notebook 06. On GPUs (NCCL, one GPU
per rank) every step runs under bf16 autocast by default (--dtype fp32 to compare): TP's forward all-reduces then
carry bf16 (see predicted_sent_bytes), and each rank's row holds its torch.cuda.max_memory_allocated beside the
ledger's state, 16 bytes per parameter it holds.
"""

import math
import statistics

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
from course_lib import launch
from course_lib.job import Job
from course_lib.mesh import Mesh
from course_lib.model import preset
from course_lib.per_rank import params_per_rank, sent_bytes_per_rank
from course_lib.runs.mesh import train_3d
from course_lib.runtime.arguments import integer


def train_3d_in(rank, world_size, *, dtype, **kwargs):
    """runs.mesh.train_3d in ``dtype`` (common.autocast), with this rank's peak GPU memory."""
    reset_peak_memory()
    with autocast(dtype):
        result = train_3d(rank, world_size, **kwargs)
    return {**result, "max_memory_allocated": peak_memory()}


def predicted_sent_bytes(config, mesh: Mesh, stage: int, dtype: str, *, batch_size: int, seq_len: int,
                         num_microbatches: int) -> dict:
    """per_rank.sent_bytes_per_rank, in fp32; under bf16 autocast TP's forward all-reduces (half of its 4 per layer)
    carry bf16, the output of a row-parallel matmul, while its backward ones, the pipeline's activations and
    gradients (the residual stream) and DP's gradients stay fp32 (tensor_parallel.py's predicted_traffic)."""
    job = Job(config, mesh, seq_len=seq_len, micro_batch_size=batch_size // (mesh.dp * num_microbatches),
              num_microbatches=num_microbatches, dtype="fp32")
    fp32 = sent_bytes_per_rank(job, stage)
    if dtype != "bf16":
        return fp32
    bf16 = sent_bytes_per_rank(job.replace(dtype="bf16"), stage)
    return {**fp32, "tp": (fp32["tp"] + bf16["tp"]) / 2}


def check_arguments(args) -> None:
    """The grid and the model it splits, checked before any rank starts (common.parse)."""
    Mesh.for_world(args.world_size, tp=args.tp, pp=args.pp).check_model(
        preset("tiny", **model_overrides(args)), batch_size=args.global_batch_size, num_microbatches=args.num_microbatches)


def main(argv=None):
    parser = lab_parser(__doc__, world_size=8, steps=10)
    parser.add_argument("--tp", type=integer(1), default=2, help="tensor-parallel degree (inside a node)")
    parser.add_argument("--pp", type=integer(1), default=2, help="pipeline stages (across nodes)")
    parser.add_argument("--num-microbatches", type=integer(1), default=4)
    parser.add_argument("--global-batch-size", type=integer(1), default=16, help="global batch, in sequences")
    args = parse(parser, argv, check=check_arguments)
    mesh = Mesh.for_world(args.world_size, tp=args.tp, pp=args.pp)
    overrides = model_overrides(args)
    config = preset("tiny", **overrides)
    results = launch(train_3d_in, args.world_size, backend=args.backend, timeout=args.timeout, dp=mesh.dp, tp=mesh.tp, pp=mesh.pp,
                     num_microbatches=args.num_microbatches, steps=args.steps, batch_size=args.global_batch_size,
                     seq_len=args.seq_len, lr=args.lr, progress=True, return_params=False, dtype=args.dtype,
                     **overrides)
    if not reports():
        return None
    print(f"\n{mesh}, {results[0]['backend']}, {args.dtype}, global batch {args.global_batch_size} × {args.seq_len} tokens, "
          f"{args.num_microbatches} micro-batches")
    print(f"{'rank':>4} {'pp dp tp':>9} {'params held':>12}   " +
          "   ".join(f"{axis + ' KiB sent (pred)':>24}" for axis in ("tp", "pp", "dp")))
    rows = []
    for r in results:
        c = r["coords"]
        predicted = predicted_sent_bytes(config, mesh, c["pp"], args.dtype, batch_size=args.global_batch_size,
                                         seq_len=args.seq_len, num_microbatches=args.num_microbatches)
        held = params_per_rank(config, mesh, c["pp"])
        print(f"{r['rank']:>4} {c['pp']:>3}{c['dp']:>3}{c['tp']:>3} {held:>12,}   " + "   ".join(
            f"{r['sent_bytes'][a] / 1024:>12,.1f} ({predicted[a] / 1024:>9,.1f})" for a in ("tp", "pp", "dp")))
        assert all(math.isclose(r["sent_bytes"][a], predicted[a]) for a in predicted), \
            f"rank {r['rank']}: traced bytes differ from the formula"
        assert r["state_bytes"]["weights"] == 4 * held, f"rank {r['rank']}: weights differ from params_per_rank"
        rows.append({**{k: r[k] for k in ("rank", "coords", "sent_bytes", "state_bytes", "ops", "step_seconds",
                                          "max_memory_allocated")},
                     "predicted_sent_bytes": predicted, "params_held": held,
                     "predicted_state_bytes": fp32_adam_state_bytes(held)})
    step = statistics.median(max(r["step_seconds"][i] for r in results) for i in range(1, args.steps)) \
        if args.steps > 1 else max(r["step_seconds"][0] for r in results)
    losses = [r["losses"] for r in results if r["losses"][0] is not None]
    print(f"traced bytes = formula on every rank; median step {step * 1e3:.1f} ms; loss "
          f"{losses[0][0]:.3f} → {losses[0][-1]:.3f} (last stage, dp rank 0)")
    record = {"mesh": {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp}, "batch_size": args.global_batch_size,
              "seq_len": args.seq_len, "num_microbatches": args.num_microbatches, "median_step_seconds": step,
              "config": {k: getattr(config, k) for k in ("hidden", "num_layers", "num_heads", "num_kv_heads",
                                                         "intermediate")}, "ranks": rows,
              "max_memory_allocated": [row["max_memory_allocated"] for row in rows],
              "predicted_state_bytes": [row["predicted_state_bytes"] for row in rows]}
    path = write_record(args, "parallel_3d", record)
    from course_lib.presentation.plots import bytes_per_axis
    bytes_per_axis([r["sent_bytes"] for r in rows], [r["predicted_sent_bytes"] for r in rows],
                   title=f"bytes each rank sends per step, {mesh}").savefig(args.out / "parallel_3d.png", dpi=100)
    print(f"wrote {path} and .png")
    return record


if __name__ == "__main__":
    main()
