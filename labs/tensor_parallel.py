"""Lab 04: train the course model split over N ranks with tensor parallelism, and count what it costs.

    python labs/tensor_parallel.py --world-size 2                     # this CPU: 2 gloo ranks via launch()
    torchrun --nproc-per-node 8 labs/tensor_parallel.py --hidden 4096 --layers 4 --global-batch-size 4 --seq-len 2048
    torchrun --nproc-per-node 2 labs/tensor_parallel.py --hidden 512   # TP = 2 on two GPUs of one box

TP is the whole world: every rank reads the same batch and holds 1/N of every attention and MLP matrix
(course_lib/tensor_parallel.py, ``apply_tp``). The lab trains a few steps with Adam and prints one row:
all-reduces per step and their bytes, traced, against the formula (2 forward + 2 backward per layer, each
batch × seq × hidden × bytes); the median step time of TP against the same model on rank 0 alone (the
"5 ms compute / 1 ms comm vs 0.5 ms / 1 ms" question at your scale: at a small width one device wins); and,
for small models, the largest loss difference from that one-device run (float32 sums in another order, grown
a little by Adam: ~1e-5 after 20 steps; tests/test_tensor_parallel.py checks the same in float64 to 1e-9).
Results go to labs/results/tensor_parallel.json and .png for notebook 04 to show beside the learner's run.
On CPU each rank gets one thread, so "one device" means one core. On GPUs (NCCL, one GPU per rank) forward and
loss run under bf16 autocast by default (--dtype fp32 to compare): the forward all-reduces then carry bf16, 2
bytes an element, the backward ones still fp32 (see predicted_traffic), the loss gap is bf16's (~1e-2 after 3
steps with --dtype bf16 on a CPU), and the JSON holds every rank's torch.cuda.max_memory_allocated beside
the ledger's 16 bytes per parameter it holds.
"""

import contextlib

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
from course_lib.comm import Comm
from course_lib.data import SyntheticTokens
from course_lib.model import build, count_params, loss_fn, preset
from course_lib.runs.tensor_parallel import step_seconds
from course_lib.runtime.arguments import integer
from course_lib.tensor_parallel import apply_tp, check_tp_divisible, tp_step_traffic


def train_losses(model, data, steps, batch_size, lr, comm=None, dtype="fp32"):
    """Adam steps on the same batches as every other rank (``steps``: a count, or an iterable such as a
    progress bar), forward and loss in ``dtype`` (common.autocast); the traced comm of each step, when given."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses, logs = [], []
    for step in range(steps) if isinstance(steps, int) else steps:
        inputs, targets = (t.to(device()) for t in data.batch(step, batch_size))
        with comm.trace() if comm is not None else contextlib.nullcontext() as log:
            with autocast(dtype):
                loss = loss_fn(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
        if log is not None:
            logs.append(log.summary().get("all_reduce"))
        optimizer.step()
        losses.append(loss.item())
    return losses, logs


def tensor_parallel_run(rank, world_size, *, overrides, steps, batch_size, seq_len, lr, reference, dtype):
    if device().type == "cpu":
        torch.set_num_threads(1)              # one core per rank: "one device" below means one core
    reset_peak_memory()
    config = preset("tiny", **overrides)
    data = SyntheticTokens(config.vocab_size, seq_len, seed=0)
    comm = Comm()
    model = apply_tp(build(config, seed=0, device=device()), comm)
    progress = range(steps)
    if rank == 0:
        from tqdm import tqdm
        progress = tqdm(progress, desc=f"TP={world_size}", mininterval=1.0)
    losses, logs = train_losses(model, data, progress, batch_size, lr, comm, dtype)
    inputs, targets = (t.to(device()) for t in data.batch(0, batch_size))
    with autocast(dtype):
        timing = step_seconds(model, inputs, targets, comm)
    result = {"losses": losses, "all_reduces_per_step": logs[-1].count, "payload_bytes_per_step": logs[-1].payload_bytes,
              "wire_bytes_per_step": logs[-1].wire_bytes, "step_seconds": timing["seconds"],
              "comm_seconds": timing["comm_seconds"] if device().type == "cpu" else None,
              "params_per_rank": sum(p.numel() for p in model.parameters()), "backend": dist.get_backend(),
              "max_memory_allocated": peak_memory()}      # before rank 0 runs the whole model below
    del model
    dist.barrier()
    if rank == 0:                             # the same model on this one device, while the others wait
        dense = build(config, seed=0, device=device())
        with autocast(dtype):
            result["one_device_step_seconds"] = step_seconds(dense, inputs, targets)["seconds"]
        if reference:
            result["one_device_losses"] = train_losses(build(config, seed=0, device=device()), data, steps,
                                                       batch_size, lr, dtype=dtype)[0]
    dist.barrier()
    return result


def predicted_traffic(config, batch_size: int, seq_len: int, tp: int, dtype: str) -> dict:
    """tp_step_traffic with each direction's element size. In fp32 both are 4 bytes. Under bf16 autocast the
    row-parallel matmuls (o_proj, down_proj) return bf16, so the forward all-reduces carry 2 bytes an element;
    backward's all-reduce sums the gradient of the norm's output, which is fp32 (the f operator sits before
    the matmul's cast to bf16, and the residual stream stays fp32): 4 bytes. Each direction holds half of the
    step's all-reduces, so the step's bytes are half of one figure (forward's size) plus half of the other."""
    forward = tp_step_traffic(config, batch_size, seq_len, tp, bytes_per_element=2 if dtype == "bf16" else 4)
    backward = tp_step_traffic(config, batch_size, seq_len, tp, bytes_per_element=4)
    return {**backward, "payload_bytes_each": forward["payload_bytes_each"],
            "backward_payload_bytes_each": backward["payload_bytes_each"],
            "payload_bytes": (forward["payload_bytes"] + backward["payload_bytes"]) // 2,
            "wire_bytes_per_rank": (forward["wire_bytes_per_rank"] + backward["wire_bytes_per_rank"]) / 2}


def main(argv=None):
    parser = lab_parser(__doc__)
    parser.add_argument("--global-batch-size", type=integer(1), default=8)
    args = parse(parser, argv, check=lambda args: check_tp_divisible(preset("tiny", **model_overrides(args)),
                                                                      args.world_size))
    overrides = model_overrides(args)
    config = preset("tiny", **overrides)
    reference = count_params(config) < 5_000_000   # one device trains it too, for the loss comparison
    results = launch(tensor_parallel_run, args.world_size, backend=args.backend, timeout=args.timeout, overrides=overrides, steps=args.steps,
                     batch_size=args.global_batch_size, seq_len=args.seq_len, lr=args.lr, reference=reference,
                     dtype=args.dtype)
    if not reports():
        return None
    run = results[0]
    predicted = predicted_traffic(config, args.global_batch_size, args.seq_len, args.world_size, args.dtype)
    predicted_count = predicted["forward_all_reduces"] + predicted["backward_all_reduces"]
    gap = (max(abs(a - b) for a, b in zip(run["losses"], run["one_device_losses"]))
           if reference else float("nan"))
    speedup = run["one_device_step_seconds"] / run["step_seconds"]
    comm_ms = f"{run['comm_seconds'] * 1e3:.2f}" if run["comm_seconds"] is not None else "n/a"
    print(f"\n{'TP':>3} {'backend':>8} {'dtype':>6} {'params/rank':>12} {'all-reduces/step':>17} {'MiB/step':>9} "
          f"{'step (ms)':>10} {'of it comm':>11} {'1 device (ms)':>14} {'TP speed-up':>12} {'loss gap':>9}")
    print(f"{args.world_size:>3} {run['backend']:>8} {args.dtype:>6} {run['params_per_rank']:>12,} "
          f"{run['all_reduces_per_step']:>8} (pred {predicted_count:>3}) "
          f"{run['payload_bytes_per_step'] / 2**20:>9.2f} {run['step_seconds'] * 1e3:>10.2f} {comm_ms:>11} "
          f"{run['one_device_step_seconds'] * 1e3:>14.2f} {speedup:>11.2f}x {gap:>9.1e}")
    assert run["all_reduces_per_step"] == predicted_count, "traced all-reduces differ from 4 per layer"
    assert run["payload_bytes_per_step"] == predicted["payload_bytes"], "traced bytes differ from the formula"
    shape = f"{args.global_batch_size}×{args.seq_len}×{config.hidden}"
    print(f"traced traffic = formula: {predicted_count} all-reduces of {shape}, each "
          f"{predicted['payload_bytes_each']:,} bytes forward and {predicted['backward_payload_bytes_each']:,} "
          "backward")
    record = {"tp": args.world_size, "config": {k: getattr(config, k) for k in
                                                ("hidden", "num_layers", "num_heads", "num_kv_heads", "intermediate")},
              "batch_size": args.global_batch_size, "seq_len": args.seq_len, **run, "predicted": predicted,
              "speedup_vs_one_device": speedup, "max_loss_gap": gap if reference else None,
              "max_memory_allocated": [r["max_memory_allocated"] for r in results],
              "predicted_state_bytes": [fp32_adam_state_bytes(r["params_per_rank"]) for r in results]}
    path = write_record(args, "tensor_parallel", record)
    from course_lib.presentation.plots import loss_curves
    curves = {f"TP={args.world_size} ({run['backend']}, {args.dtype})": run["losses"]}
    if reference:
        curves["1 device, whole model"] = run["one_device_losses"]
    loss_curves(curves, title=f"tensor-parallel training: step {run['step_seconds'] * 1e3:.1f} ms on TP="
                              f"{args.world_size}, {run['one_device_step_seconds'] * 1e3:.1f} ms on one device"
                ).savefig(args.out / "tensor_parallel.png", dpi=100)
    print(f"wrote {path} and .png")
    return record


if __name__ == "__main__":
    main()
