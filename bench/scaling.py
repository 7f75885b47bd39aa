"""Data-parallel scaling on this machine: tokens/s at dp=1 and dp=2, and the communication share of a step.

    python bench/scaling.py [--steps N] [--config schedules/curriculum.toml]

Launches the same measurement single-process and under torchrun (gloo on CPU, NCCL on CUDA) with
the same global batch, one after the other, and prints a Markdown table. The communication share
is the time spent in collectives (all-gather, reduce-scatter, all-reduce: every op torch.profiler
records under a c10d/gloo/nccl name) over the wall time of the profiled steps, on rank 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # works without `pip install -e .`
from benchlib import SMOKE_SHAPE, parse  # noqa: E402  (bench/benchlib.py)

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
COLLECTIVE_MARKERS = ("c10d", "gloo", "nccl", "all_gather", "reduce_scatter", "allreduce", "all_reduce")


def worker(config_path: str, steps: int, dp: int, shape: list[str]) -> None:
    """Runs in each process: warm up, time `steps` steps, then profile two more for the communication share."""
    from torch.profiler import ProfilerActivity, profile

    import nanoflow
    from nanoflow.data import load_tokenizer, open_stage
    from nanoflow.parallel.mesh import exit_process, init_topology, shutdown

    accumulation = 2
    config = nanoflow.load_config(config_path, [*shape,
        f"parallelism.dp={dp}", f"tokens.batch_accumulation_per_replica={accumulation // dp}",
        f"tokens.train_steps={steps + 4}"])
    topology = init_topology(config)
    state = nanoflow.init_state(config, topology)
    loader = open_stage(config, 0, load_tokenizer("bytes"), state.schedule)
    batches = [loader.batch_at(s, topology.dp_rank, topology.dp) for s in range(1, steps + 5)]
    state, _ = nanoflow.train_step(state, batches[0])  # warm-up
    started, tokens = time.perf_counter(), 0
    for batch in batches[1:steps + 1]:
        state, metrics = nanoflow.train_step(state, batch)
        tokens += metrics["tokens"]
    elapsed = time.perf_counter() - started
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled_start = time.perf_counter()
        for batch in batches[steps + 1:steps + 3]:
            state, _ = nanoflow.train_step(state, batch)
        profiled = time.perf_counter() - profiled_start
    comm_us = sum(e.cpu_time_total for e in prof.key_averages()
                  if any(m in e.key.lower() for m in COLLECTIVE_MARKERS) and not e.key.startswith("ProfilerStep"))
    if topology.is_main:
        print(json.dumps({"dp": dp, "tokens_per_s": tokens / elapsed,
                          "comm_share": min(comm_us / 1e6 / profiled, 1.0) if dp > 1 else 0.0}))
    shutdown()
    exit_process(0)


def launch(config: str, steps: int, dp: int, smoke: bool) -> dict:
    args = [__file__, "--worker", "--config", config, "--steps", str(steps), "--dp", str(dp), *(["--smoke"] * smoke)]
    command = [sys.executable, *args] if dp == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(dp), *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // dp))}
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"dp={dp} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(REPO, "schedules", "curriculum.toml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    args = parse(parser, None, steps=1)
    if args.worker:
        return worker(args.config, args.steps, args.dp, SMOKE_SHAPE if args.smoke else [])

    import torch
    results = [launch(args.config, args.steps, dp, args.smoke) for dp in (1, 2)]
    base = results[0]["tokens_per_s"]
    print(f"date {datetime.date.today()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
          f"config {os.path.relpath(args.config, REPO)}, {args.steps} timed steps per run")
    print("| dp | tokens/s | vs dp=1 | communication share of step |")
    print("|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['dp']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f} | {r['comm_share']:.0%} |")


if __name__ == "__main__":
    main()
