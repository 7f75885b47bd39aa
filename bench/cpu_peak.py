"""The CPU's matmul peak as the progress line's MFU measures it, by the thread's CPU time, against the same
products timed by the wall clock (how it was measured before), in interleaved rounds, under the load the
machine has.

    python bench/cpu_peak.py [--rounds 7] [--shape 512 1024 2816]

Each round times both ways with nanoflow.observe.progress's budget (0.1 s, at least three products, one
thread), the order flipping every round. On cores other processes share, a product is descheduled for part
of its wall time: the wall-clock peak falls with the load, the CPU-time peak should not. Prints each round,
the medians and their ratio, with the load average before and after.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from benchlib import load_average, machine_line, parse  # (bench/benchlib.py: puts this checkout first on the path)


def wall_clock_peak(m: int, k: int, n: int, budget: float) -> float:
    """The former probe: the fastest product by the wall clock, times the threads."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a @ b
        best, start = math.inf, time.perf_counter()
        for repeat in range(200):
            began = time.perf_counter()
            a @ b
            finished = time.perf_counter()
            best = min(best, finished - began)
            if repeat >= 2 and finished - start > budget:
                break
    finally:
        torch.set_num_threads(threads)
    return threads * 2 * m * k * n / best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shape", type=int, nargs=3, default=[512, 1024, 2816],
                        help="m k n: the former probe's shape for a 1024-hidden model")
    args = parse(parser, argv, rounds=2, shape=[64, 128, 128])
    from nanoflow.observe.progress import PEAK_SECONDS, cpu_matmul_peak

    print(machine_line())
    print(f"{load_average()} before; shape {'×'.join(map(str, args.shape))}, budget {PEAK_SECONDS} s a probe")
    peaks = {"cpu time": [], "wall clock": []}
    probes = {"cpu time": cpu_matmul_peak, "wall clock": wall_clock_peak}
    for round_ in range(args.rounds):
        for name in (list(probes) if round_ % 2 == 0 else list(probes)[::-1]):
            peaks[name].append(probes[name](*args.shape, PEAK_SECONDS))
        print(f"round {round_ + 1}: cpu time {peaks['cpu time'][-1] / 1e9:.1f} GFLOP/s, wall clock "
              f"{peaks['wall clock'][-1] / 1e9:.1f} GFLOP/s", flush=True)
    cpu, wall = (statistics.median(peaks[name]) for name in probes)
    print(f"median: cpu time {cpu / 1e9:.1f} GFLOP/s, wall clock {wall / 1e9:.1f} GFLOP/s; wall / cpu time = "
          f"{wall / cpu:.3f}")
    print(f"{load_average()} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
