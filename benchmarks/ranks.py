"""Benchmark: the round trip of a trivial ``%%ranks`` cell on 4 persistent ranks.

    python benchmarks/ranks.py

Measures the ``World.exec`` call alone, and the whole ``%%ranks`` magic run by an IPython shell in this
process (parsing, grouped display, and all). The course's goal is a median under 50 ms.
"""

import statistics
import time

from IPython.core.interactiveshell import InteractiveShell

from course_lib import World


def median_ms(fn, repeats: int = 50) -> float:
    fn()  # warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main():
    with World(4) as world:
        api = median_ms(lambda: world.exec("1"))
        collective = median_ms(lambda: world.exec("dist.barrier()"))
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "course_lib")
    shell.run_line_magic("ranks", "start 4")
    try:
        magic = median_ms(lambda: shell.run_cell("%%ranks\nx = rank", silent=True))
    finally:
        shell.run_line_magic("ranks", "stop")
    rows = [("what (4 ranks)", "median (ms)"), ("World.exec('1')", f"{api:.2f}"),
            ("World.exec('dist.barrier()')", f"{collective:.2f}"), ("%%ranks cell, whole magic", f"{magic:.2f}")]
    for what, ms in rows:
        print(f"{what:<34} {ms:>12}")
    print(f"median %%ranks round trip: {magic:.1f} ms (goal: under 50 ms)")


if __name__ == "__main__":
    main()
