"""Benchmark: how long it takes to start N ranks, run a trivial function, and stop them.

    python benchmarks/launch.py

Ours (`course_lib.runtime.launch`: forkserver with torch preloaded, cloudpickle) against
`torch.multiprocessing.spawn` (every rank starts a fresh interpreter and imports torch), at 2, 4 and 8 ranks.
"Cold" is the first launch of this process (it starts the forkserver, which imports torch once); "warm" is the
median of the next few. Both sides form a real gloo process group and run one all_reduce.
"""

import datetime
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from course_lib import launch


def one_all_reduce(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def spawned_rank(rank, world_size, port):
    """What a plain torch.multiprocessing.spawn worker has to do itself: join a group, work, leave."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    one_all_reduce(rank, world_size)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(warm_repeats: int = 5, spawn_repeats: int = 2):
    cold = seconds(lambda: launch(one_all_reduce, 2))
    print(f"cold start of ours (forkserver imports torch once), 2 ranks: {cold:.2f} s\n")
    print(f"{'ranks':>5} {'ours warm (s)':>14} {'spawn (s)':>10} {'spawn / ours':>13}")
    for world_size in (2, 4, 8):
        ours = statistics.median(seconds(lambda: launch(one_all_reduce, world_size)) for _ in range(warm_repeats))
        spawn = statistics.median(
            seconds(lambda: mp.spawn(spawned_rank, args=(world_size, free_port()), nprocs=world_size))
            for _ in range(spawn_repeats))
        print(f"{world_size:>5} {ours:>14.3f} {spawn:>10.2f} {spawn / ours:>12.0f}x")


if __name__ == "__main__":
    main()
