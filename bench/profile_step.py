"""Where one step of the default curriculum goes: torch.profiler's operators, and nanoflow's own Python.

    python bench/profile_step.py [--warmup W] [--steps K] [--rows N]

Runs `nanoflow.training.loop.train` on schedules/curriculum.toml (its checkpoints in a temporary folder)
through its pretrain stage — 200 of its 300 steps, batch 16 × 256 as 2 micro-batches of 8 — and
profiles whole loop iterations: from the batch read to the progress update, train_step and the
metrics.jsonl / TensorBoard writes in between. After W warm-up steps (default 3):

1. K steps (default 3) under torch.profiler (CPU activity, shapes off): the operators with the most
   self time per step, and the loop's parts — nanoflow.training.loop's calls wrapped in record_function
   ranges — with their total and self time. A range's self time is the time spent in it outside
   any torch operator: Python, nanoflow's included.
2. K more steps under cProfile (not at the same time: each profiler distorts the other): the Python
   functions of nanoflow/ with the most self time per step. A tensor expression such as `x * cos`
   runs its kernel without a Python call, so the kernel's time counts as the self time of the
   function that wrote it (model.py's forward functions, mostly).
3. Unprofiled, the floor: the same train_step with every tensor made tiny (1 × 8 tokens per
   micro-batch, still 2 micro-batches: the same operators, the same Python), median of 20 steps —
   the cost of Python, torch's dispatch and autograd per step, which no kernel speed-up removes.

The figures are per step, averaged over the K profiled steps. The profilers themselves add
overhead (torch.profiler about 1-2 µs per operator), so the step here is slower than unprofiled.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import functools
import os
import platform
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # works without `pip install -e .`
import torch  # noqa: E402
from benchlib import SMOKE_SHAPE, parse  # noqa: E402  (bench/benchlib.py)
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import nanoflow  # noqa: E402
import nanoflow.model  # noqa: E402
import nanoflow.step  # noqa: E402
import nanoflow.training.loop as loop  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "schedules", "curriculum.toml")
NANOFLOW = os.path.dirname(os.path.abspath(nanoflow.__file__))
LABEL = "loop: "


def ranged(owner, name: str, label: str, result_hook=None) -> None:
    """Wrap owner.name in a torch.profiler range called LABEL + label."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        with record_function(LABEL + label):
            result = original(*args, **kwargs)
        return result_hook(result) if result_hook is not None else result

    setattr(owner, name, wrapper)


class Window:
    """Starts a profiler at the batch read of step `first` and stops it after step `last`'s progress update."""

    def __init__(self, first: int, last: int, start, stop):
        self.first, self.last, self.start, self.stop = first, last, start, stop
        self.started = self.seconds = 0.0

    def install(self) -> None:
        window = self
        batch_at_of_loader = {}

        def on_loader(loader):
            original = batch_at_of_loader.setdefault(id(loader), loader.batch_at)

            def batch_at(step, *args, **kwargs):
                if step == window.first:
                    window.start()
                    window.started = time.perf_counter()
                return original(step, *args, **kwargs)

            loader.batch_at = batch_at
            return loader

        open_stage = loop.open_stage
        loop.open_stage = lambda *a, **k: on_loader(open_stage(*a, **k))
        step_done = loop.Progress.step_done

        def progress(self, metrics):
            step_done(self, metrics)
            if metrics["step"] == window.last:
                window.seconds = time.perf_counter() - window.started
                window.stop()

        loop.Progress.step_done = progress


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=15)
    args = parse(parser, None, warmup=1, steps=1)
    print(f"{datetime.date.today()}  torch {torch.__version__}  {os.cpu_count()} CPU cores "
          f"({platform.processor() or platform.machine()}), {torch.get_num_threads()} torch threads  "
          f"load average {os.getloadavg()[0]:.1f}")

    k = args.steps
    # The ranges first, then the windows around them: a profiler starts before the range it is to see opens.
    ranged(loop, "train_step", "train_step")
    ranged(loop, "open_stage", "open_stage",
           result_hook=lambda loader: (ranged(loader, "batch_at", "batch_at"), loader)[1])
    ranged(loop.MetricsLog, "write", "metrics.jsonl")
    ranged(loop.TensorBoardLog, "write", "TensorBoard")
    ranged(loop.Progress, "step_done", "progress")
    ranged(loop.StopRequest, "agreed", "stop check")
    ranged(nanoflow.model.Llama, "forward", "train_step › model forward")
    ranged(torch.autograd, "backward", "train_step › backward")  # what Tensor.backward calls
    ranged(nanoflow.step, "grad_norm", "train_step › gradient norm")
    prof = profile(activities=[ProfilerActivity.CPU])
    python = cProfile.Profile()
    torch_window = Window(args.warmup + 1, args.warmup + k, prof.__enter__,
                          lambda: prof.__exit__(None, None, None))
    python_window = Window(args.warmup + k + 1, args.warmup + 2 * k, python.enable, python.disable)
    torch_window.install()
    python_window.install()

    with tempfile.TemporaryDirectory(prefix="profile-step-") as folder:
        config = nanoflow.load_config(CONFIG, [*(SMOKE_SHAPE if args.smoke else []),
                                               f'checkpoints.checkpoints_path="{folder}"'])
        with open(os.devnull, "w") as out:
            loop.train(config, fresh=True, until_step=python_window.last, out=out, progress=False)
        tokens = config.tokens   # what the profiled (pretrain) steps are made of

    events = prof.key_averages()
    ranges = (LABEL, "Optimizer.")  # ours, and the ones torch.optim opens itself
    ours = {e.key: e for e in events if e.key.startswith(ranges)}
    ops = sorted((e for e in events if not e.key.startswith(ranges)), key=lambda e: -e.self_cpu_time_total)
    step_ms = torch_window.seconds * 1e3 / k
    print(f"\npretrain step ({tokens.micro_batch_size * tokens.batch_accumulation_per_replica} × "
          f"{tokens.sequence_length} tokens, {tokens.batch_accumulation_per_replica} micro-batches), profiled steps "
          f"{torch_window.first}–{torch_window.last}: "
          f"{step_ms:.0f} ms per loop iteration under torch.profiler\n")
    print("| operator (torch.profiler) | calls / step | self ms / step | share of the step |")
    print("|---|---:|---:|---:|")
    for e in ops[:args.rows]:
        print(f"| `{e.key}` | {e.count / k:.0f} | {e.self_cpu_time_total / 1e3 / k:.1f} | "
              f"{e.self_cpu_time_total / 1e3 / k / step_ms:.1%} |")
    rest = sum(e.self_cpu_time_total for e in ops[args.rows:]) / 1e3 / k
    print(f"| {len(ops) - args.rows} other operators | | {rest:.1f} | {rest / step_ms:.1%} |")

    print("\n| loop part (record_function range) | calls / step | total ms / step | self ms / step "
          "(outside torch operators) | self share of the step |")
    print("|---|---:|---:|---:|---:|")
    for key in sorted(ours, key=lambda key: -ours[key].cpu_time_total):
        e = ours[key]
        print(f"| {key.removeprefix(LABEL)} | {e.count / k:.0f} | {e.cpu_time_total / 1e3 / k:.2f} | "
              f"{e.self_cpu_time_total / 1e3 / k:.2f} | {e.self_cpu_time_total / 1e3 / k / step_ms:.2%} |")

    stats = pstats.Stats(python)
    rows, total = [], 0.0
    for (filename, line, function), (_, calls, tottime, cumtime, _) in stats.stats.items():
        path = os.path.abspath(filename)  # "bench/../nanoflow/…" when imported through this script's sys.path
        if path.startswith(NANOFLOW + os.sep):
            name = f"{os.path.relpath(path, os.path.dirname(NANOFLOW))}:{line} {function}"
            rows.append((tottime, calls, cumtime, name))
            total += tottime
    everything = python_window.seconds
    print(f"\ncProfile, steps {python_window.first}–{python_window.last}: "
          f"{python_window.seconds / k * 1e3:.0f} ms per "
          f"loop iteration; "
          f"self time in nanoflow's own Python functions {total / k * 1e3:.2f} ms per step "
          f"({total / everything:.2%}); the functions with the most:\n")
    print("| nanoflow function | calls / step | self ms / step | cumulative ms / step |")
    print("|---|---:|---:|---:|")
    for tottime, calls, cumtime, name in sorted(rows, reverse=True)[:args.rows]:
        print(f"| `{name}` | {calls / k:.0f} | {tottime / k * 1e3:.3f} | {cumtime / k * 1e3:.1f} |")
    floor = floor_ms()
    print(f"\nthe floor (the same step with 1 × 8-token micro-batches, unprofiled, median of 20): {floor:.1f} ms "
          f"per step: Python, dispatch and autograd for the step's operators, whatever their size")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    return 0


def floor_ms(steps: int = 20) -> float:
    import statistics

    with tempfile.TemporaryDirectory(prefix="profile-floor-") as folder:
        config = nanoflow.load_config(CONFIG, [f'checkpoints.checkpoints_path="{folder}"', "tokens.sequence_length=8",
                                               "tokens.micro_batch_size=1"])
        tokens = config.stage_tokens(0)
        rows = tokens.micro_batch_size * tokens.batch_accumulation_per_replica
        ids = torch.randint(0, 257, (rows, tokens.sequence_length + 1), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        state, times = nanoflow.init_state(config), []
        for _ in range(steps + 3):
            start = time.perf_counter()
            state, _ = nanoflow.train_step(state, batch)
            times.append(time.perf_counter() - start)
        return statistics.median(times[3:]) * 1e3


if __name__ == "__main__":
    sys.exit(main())
