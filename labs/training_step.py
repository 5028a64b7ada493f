"""Lab 00: the four-move training step on N ranks, gradients averaged by hand with one all_reduce.

    python labs/training_step.py --world-size 2                      # this CPU: 2 gloo ranks via launch()
    torchrun --nproc-per-node 8 labs/training_step.py --hidden 1024 --layers 8 --steps 100   # one GPU box
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        labs/training_step.py --hidden 2048 --layers 16                                    # two boxes

Every rank builds the same model (same seed), takes its own slice of each global batch, runs forward,
loss and backward, then all-reduces the gradients and divides by world_size before the optimizer step,
so the replicas stay identical. The lab prints a table, checks that the replicas agree and that the
loss matches one process training on the whole global batch (small models only; "vs 1 process" is the largest
loss gap of any step: float32 sums in another order, carried forward by Adam: 1.1e-3 after the default 30 steps
on 2 CPU ranks, growing with the run; after a loss spike the two trajectories part, up to the loss itself. Not a pass/fail
over long runs: the replica spread must be exactly 0, and tests/test_ddp.py checks parity in float64), and writes
labs/results/training_step.json and .png for the notebook to show beside the learner's CPU run. On GPUs
(NCCL, one GPU per rank) forward and loss run under bf16 autocast by default (--dtype fp32 to compare); the
JSON then also holds each rank's torch.cuda.max_memory_allocated beside the ledger's 16 bytes per parameter.
"""

import time

import torch
import torch.distributed as dist

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
from course_lib.data import SyntheticTokens
from course_lib.model import build, loss_fn, preset
from course_lib.runtime.arguments import integer
from course_lib.train import reference_run


def data_parallel_training(rank, world_size, *, overrides, steps, global_batch_size, seq_len, lr, dtype):
    reset_peak_memory()
    config = preset("tiny", **overrides)
    model = build(config, seed=0, device=device())
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    data = SyntheticTokens(config.vocab_size, seq_len, seed=0)
    losses, step_seconds = [], []
    progress = range(steps)
    if rank == 0:
        from tqdm import tqdm
        progress = tqdm(progress, desc=f"{world_size} ranks", mininterval=1.0)
    for step in progress:
        start = time.perf_counter()
        inputs, targets = (t.to(device()) for t in data.rank_batch(step, global_batch_size, rank, world_size))
        with autocast(dtype):                               # bf16 matmuls on GPUs; weights stay fp32
            loss = loss_fn(model(inputs), targets)          # 1-2. forward and loss on my slice
        optimizer.zero_grad()
        loss.backward()                                     # 3. my slice's gradients
        for param in model.parameters():                    # average them over ranks: g = (g0 + g1 + ...) / W
            dist.all_reduce(param.grad)
            param.grad /= world_size
        optimizer.step()                                    # 4. every rank applies the same update
        dist.all_reduce(loss.detach())
        losses.append(loss.item() / world_size)             # the loss of the whole global batch
        step_seconds.append(time.perf_counter() - start)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(copies, flat)
    spread = max((c - flat).abs().max().item() for c in copies)  # 0.0 when every replica is identical
    return {"losses": losses, "step_seconds": step_seconds, "replica_spread": spread,
            "params": sum(p.numel() for p in model.parameters()), "backend": dist.get_backend(),
            "max_memory_allocated": peak_memory()}


def check_arguments(args) -> None:
    """Rules between arguments, checked before any rank starts (common.parse)."""
    if args.global_batch_size % args.world_size:
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not divisible by --world-size {args.world_size}: "
                         "every rank takes an equal slice of each batch")


def main(argv=None):
    parser = lab_parser(__doc__, steps=30)
    parser.add_argument("--global-batch-size", type=integer(1), default=16, help="rows per step, split over the ranks")
    args = parse(parser, argv, check=check_arguments)
    overrides = model_overrides(args)
    results = launch(data_parallel_training, args.world_size, backend=args.backend, timeout=args.timeout, overrides=overrides,
                     steps=args.steps, global_batch_size=args.global_batch_size, seq_len=args.seq_len, lr=args.lr,
                     dtype=args.dtype)
    if not reports():
        return None
    run = {**results[0], "max_memory_allocated": [r["max_memory_allocated"] for r in results]}
    losses = run["losses"]
    reference = None
    if run["params"] < 5_000_000:  # one process on the whole global batch: the answer DP must reproduce
        config = preset("tiny", **overrides)
        reference = reference_run(config, steps=args.steps, batch_size=args.global_batch_size, lr=args.lr,
                                  seq_len=args.seq_len)[0]
    median = sorted(run["step_seconds"])[len(run["step_seconds"]) // 2]
    print(f"\n{'ranks':>6} {'backend':>8} {'dtype':>6} {'params':>12} {'first loss':>11} {'last loss':>10} "
          f"{'step (ms)':>10} {'replica spread':>15} {'vs 1 process':>13}")
    gap = max(abs(a - b) for a, b in zip(losses, reference)) if reference else float("nan")
    print(f"{args.world_size:>6} {run['backend']:>8} {args.dtype:>6} {run['params']:>12,} {losses[0]:>11.4f} "
          f"{losses[-1]:>10.4f} {median * 1e3:>10.2f} {run['replica_spread']:>15.2e} {gap:>13.2e}")
    record = {"world_size": args.world_size, **run, "single_process_losses": reference,
              "predicted_state_bytes": [fp32_adam_state_bytes(run["params"])] * args.world_size}
    path = write_record(args, "training_step", record)
    from course_lib.presentation.plots import loss_curves
    curves = {f"{args.world_size} ranks ({run['backend']}, {args.dtype})": losses}
    if reference:
        curves["1 process, whole batch (fp32)"] = reference
    loss_curves(curves, title="data-parallel training step").savefig(args.out / "training_step.png", dpi=100)
    print(f"wrote {path} and .png")
    return record


if __name__ == "__main__":
    main()
