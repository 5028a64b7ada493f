"""Benchmark: one forward + backward of the tensor-parallel model, ours against torch's DTensor, on gloo.

    python benchmarks/tp.py                      # TP = 2 and 4, hidden 256, 4 layers, 4 × 64 tokens
    python benchmarks/tp.py --hidden 512 --repeats 9

Both sides split the same course model the same way (q/k/v and gate/up by columns, o/down by rows):
ours with ``apply_tp`` (course_lib/tensor_parallel.py), torch's with ``parallelize_module`` and
``ColwiseParallel``/``RowwiseParallel`` on a CPU ``DeviceMesh``. Each rank gets one thread. The two are
timed in one run, interleaved repeat by repeat (so a busy neighbour slows both alike), and the median of
each is compared. Ours also sends fewer messages: one all-reduce per block for q/k/v's (and gate/up's)
input gradients where DTensor sends one per layer, 2 + 2 against 2 + 5 all-reduces per layer.
The last line is the ratio at TP = 2: below 1 means ours is faster.
"""

import argparse
import statistics
import warnings

import torch

from course_lib import launch
from course_lib.comm import Comm
from course_lib.data import SyntheticTokens
from course_lib.model import build, preset, widened
from course_lib.runs.tensor_parallel import step_seconds
from course_lib.tensor_parallel import apply_tp, dtensor_plan


def ours_and_dtensor(rank, world_size, *, hidden, layers, batch_size, seq_len, repeats, warmup):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)    # one core per rank, as one GPU per rank
    config = preset("tiny", num_layers=layers, **widened(hidden))
    comm = Comm()
    ours = apply_tp(build(config, seed=0), comm)
    theirs = build(config, seed=0)
    parallelize_module(theirs, init_device_mesh("cpu", (world_size,)), dtensor_plan(config))
    inputs, targets = SyntheticTokens(config.vocab_size, seq_len, seed=0).batch(0, batch_size)
    times = {"ours": [], "dtensor": []}
    for i in range(warmup + repeats):
        for name, model in (("ours", ours), ("dtensor", theirs)):
            comm.barrier()
            seconds = step_seconds(model, inputs, targets, repeats=1, warmup=0)["seconds"]
            if i >= warmup:
                times[name].append(seconds)
    return {name: statistics.median(values) for name, values in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    print(f"hidden {args.hidden}, {args.layers} layers, {args.batch_size} × {args.seq_len} tokens, gloo, "
          f"1 thread per rank, median of {args.repeats}\n")
    print(f"{'TP':>3} {'ours (ms)':>10} {'DTensor (ms)':>13} {'ours / DTensor':>15}")
    ratios = {}
    for tp in (2, 4):
        result = launch(ours_and_dtensor, tp, hidden=args.hidden, layers=args.layers, batch_size=args.batch_size,
                        seq_len=args.seq_len, repeats=args.repeats, warmup=args.warmup, timeout=600)
        ours = max(r["ours"] for r in result)          # a step ends when its slowest rank ends
        theirs = max(r["dtensor"] for r in result)
        ratios[tp] = ours / theirs
        print(f"{tp:>3} {ours * 1e3:>10.1f} {theirs * 1e3:>13.1f} {ratios[tp]:>15.2f}")
    print(f"ratio tp/dtensor: {ratios[2]:.2f}")


if __name__ == "__main__":
    main()
