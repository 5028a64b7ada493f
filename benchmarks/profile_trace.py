"""Benchmark: exposed communication read from torch.profiler traces against the course's own clock.

    python benchmarks/profile_trace.py

A bucketed DDP step of the tiny model widened to 256 on 2 ranks (runs.profile.profiled_ddp_step), for three
bucket sizes: one bucket (nothing overlaps backward), 4 MiB and 1 MiB (more buckets start during backward). Per
rank: the communication the trace shows outside any op of the main thread (traces.exposed_seconds), the
course's own measurement of the same step (the buckets' issue and finish times after backward ended,
runs.profile.exposed_after), and their ratio; goal: within 20% wherever the exposure is over 5 ms. Below that the
two differ by a fraction of a millisecond for a reason, not noise: while the last bucket is in flight the main
thread copies the earlier buckets' averaged gradients back, which the trace counts as compute (overlap) and the
course's clock as waiting.
"""

import json
import tempfile
import time

from course_lib import launch, traces
from course_lib.runs.profile import profiled_ddp_step
from course_lib.units import MiB


def main():
    began = time.perf_counter()
    print(f"{'buckets':>10} {'rank':>5} {'comm (trace)':>13} {'overlapped':>11} {'exposed: trace':>15} "
          f"{'course':>8} {'ratio':>6}")
    worst = 1.0
    for bucket_bytes in (64 * MiB, 4 * MiB, 1 * MiB):
        with tempfile.TemporaryDirectory() as folder:
            results = launch(profiled_ddp_step, 2, folder=folder, bucket_bytes=bucket_bytes)
            rank_traces = [json.load(open(result["trace"])) for result in results]
        for rank, (trace, result) in enumerate(zip(rank_traces, results)):
            communication, _ = traces.intervals(trace)
            exposed, course = traces.exposed_seconds(trace), result["exposed_s"]
            ratio = exposed / course if course > 0 else float("nan")
            if course > 5e-3:
                worst = max(worst, ratio, 1 / ratio, key=lambda r: abs(r - 1))
            print(f"{len(result['buckets']):>10} {rank:>5} {sum(e - s for s, e in communication) * 1e3:10.1f} ms "
                  f"{traces.overlapped_seconds(trace) * 1e3:8.1f} ms {exposed * 1e3:12.1f} ms {course * 1e3:5.1f} ms "
                  f"{ratio:6.2f}")
    print(f"\nlargest miss where over 5 ms exposed: {abs(worst - 1):.0%} (goal within 20%), "
          f"in {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
