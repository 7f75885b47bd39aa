"""Intra-op threads: the Quickstart's curriculum trained with OMP_NUM_THREADS=1, =2, and unset (nanoflow's choice,
nanoflow.parallel.threads), in interleaved rounds, as the machine is found and with busy-loop processes added.

    python bench/threads.py [--steps 20] [--rounds 3] [--busy 0,1]

Each run is a bin/train process (the `--fresh` first STEPS steps of schedules/curriculum.toml, no evaluation
falls in them); its time per step comes from metrics.jsonl's `elapsed` (steps 2 to STEPS: start-up and the
first step's warm-up left out). The arms of a round run back to back in an order that alternates between
rounds, so that a change in the machine's load falls on each alike; the load average is printed with each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import CONFIG, REPO, SMOKE_SHAPE, load_average, machine_line, parse

ARMS = ("1", "2", "auto")


def run(arm: str, steps: int, folder: str, extra: list[str]) -> tuple[float, str]:
    """Seconds per step of one bin/train run with OMP_NUM_THREADS=arm (unset for "auto"), and what it chose."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if arm != "auto":
        env["OMP_NUM_THREADS"] = arm
    overrides = [f"tokens.train_steps={steps}", f"checkpoints.checkpoint_interval={steps}",
                 f"checkpoints.checkpoints_path={json.dumps(folder)}", "logging.iteration_step_info_interval=1000",
                 *extra]
    command = [sys.executable, os.path.join(REPO, "bin", "train"), CONFIG, "--fresh",
               *[a for o in overrides for a in ("--set", o)]]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bin/train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    rows = [r for r in rows if r["step"] >= 1]
    per_step = (rows[-1]["elapsed"] - rows[0]["elapsed"]) / max(len(rows) - 1, 1)
    chosen = re.search(r"intra-op threads: (\d+) \(", done.stdout + done.stderr)
    return per_step, (chosen.group(1) if chosen else arm)


def spinners(count: int) -> list[subprocess.Popen]:
    """`count` processes that keep a CPU busy each (a loop of Python), until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per condition")
    parser.add_argument("--busy", default="0,1", help="busy-loop processes added, one condition each")
    args = parse(parser, argv, steps=3, rounds=1, busy="0")
    extra = SMOKE_SHAPE if args.smoke else []
    print(f"# {machine_line()}; {os.cpu_count()} CPUs; {len(os.sched_getaffinity(0))} in this process's affinity")
    print(f"# curriculum.toml, first {args.steps} steps, seconds per step "
          f"(median of {args.rounds} rounds)")
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as work:
        for busy in (int(b) for b in args.busy.split(",")):
            added = spinners(busy)
            try:
                time.sleep(0 if args.smoke else 5)   # let the load average see the busy loops
                times: dict[str, list[float]] = {arm: [] for arm in ARMS}
                chosen = []
                for r in range(args.rounds):
                    order = ARMS if r % 2 == 0 else ARMS[::-1]
                    for arm in order:
                        load = load_average()
                        seconds, count = run(arm, args.steps, os.path.join(work, f"{busy}-{r}-{arm}"), extra)
                        times[arm].append(seconds)
                        if arm == "auto":
                            chosen.append(count)
                        print(f"busy +{busy} round {r + 1} threads {arm:>4}{f' (chose {count})' if arm == 'auto' else ''}: "
                              f"{seconds * 1000:8.1f} ms/step  ({load})", flush=True)
            finally:
                for process in added:
                    process.kill()
                    process.wait()
            one, two, auto = (statistics.median(times[arm]) for arm in ARMS)
            print(f"busy +{busy}: one thread {one * 1000:.1f} ms/step, two {two * 1000:.1f}, nanoflow's choice "
                  f"({'/'.join(chosen)}) {auto * 1000:.1f}; two / one = {two / one:.2f}, choice / one = "
                  f"{auto / one:.2f}", flush=True)


if __name__ == "__main__":
    main()
