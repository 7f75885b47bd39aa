"""What does bin/train's loop cost over `train_step` alone on the same batches?

    python bench/loop_overhead.py [--steps N] [--plain] [--evaluation]

The run: schedules/curriculum.toml shortened to N steps (default 200) that keep its three stages
and their switches (pretrain 60 %, anneal 20 %, sft 20 % of the steps) and its checkpoint interval
(100: saves at steps 100 and 200, the second being the end-of-run save), written to a fresh
temporary folder. The curriculum's [evaluation] is dropped unless `--evaluation`: evaluating is work the
user asks for (its cost is bench/evaluation.py's), not the loop's overhead; with the flag it is kept
and shown as its own row of where the time went.

- loop: `nanoflow.training.loop.train(config, fresh=True)` in this process, timed from the call to its
  return: tokenizer, fresh state, metrics.jsonl (one JSON line a step, flushed), TensorBoard events
  (when the `tensorboard` package is installed, as it is with the test extras), the progress
  display (a live tqdm bar drawn into /dev/null; `--plain` for the plain log lines a non-terminal
  gets), data loading (`batch_at` each step, with no loading workers: the curriculum's setting),
  the stage switches (closing one loader, opening the next), the signal handling and the
  checkpoint saves.
- train_step alone: a second fresh state stepped by `nanoflow.train_step` through the same batches
  (built beforehand by the same loaders, so no data loading), timed around each call. Its steps
  are interleaved with the loop's, step by step (the loop's `train_step` is wrapped to run the
  other side's step for the same global step before it on even steps, after it on odd ones), so
  drift in the machine's speed hits both sides alike; the time spent beside the loop's step is
  measured and subtracted from the loop's wall time.

Both sides start from the same weights and read the same batches, so they end bit-identical (checked).
Both run after a warm-up of both batch shapes. Before anything is timed, the stages' HF text
sources are tokenized once into their token cache, as any earlier run (or a resume) has done.
Also printed: where the loop's time went, from nanoflow.training.loop's own functions wrapped with timers
(microseconds each). Target: loop tokens/s / train_step tokens/s ≥ 0.95.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # works without `pip install -e .`

import attrs  # noqa: E402
import torch  # noqa: E402
from benchlib import SMOKE_SHAPE, parse  # noqa: E402  (bench/benchlib.py)

import nanoflow  # noqa: E402
import nanoflow.observe.progress as progress  # noqa: E402
import nanoflow.run  # noqa: E402
import nanoflow.training.loop as loop  # noqa: E402
from nanoflow.data import load_tokenizer, open_stage  # noqa: E402
from nanoflow.schedule import Schedule, active_stage  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "schedules", "curriculum.toml")


def load_config(steps: int, run: str, evaluation: bool, shape: list[str]):
    anneal, sft = int(steps * 0.6) + 1, int(steps * 0.8) + 1
    config = nanoflow.load_config(CONFIG, overrides=[*shape,
        f"tokens.train_steps={steps}", f"data_stages.anneal.start_training_step={anneal}",
        f"data_stages.sft.start_training_step={sft}",
        f"optimizer.learning_rate_scheduler.lr_decay_starting_step={anneal - 1}",
        f'checkpoints.checkpoints_path="{run}"',
    ])
    return config if evaluation else attrs.evolve(config, evaluation=None)


def build_batches(config) -> dict[int, dict[str, torch.Tensor]]:
    """Every step's batch, read by the stages' own loaders (this also fills the HF token cache)."""
    schedule, tokenizer = Schedule.from_config(config), load_tokenizer(config.tokenizer.tokenizer_name_or_path)
    batches, loader, index = {}, None, None
    for step in range(1, schedule.train_steps + 1):
        if active_stage(schedule, step) != index:
            if loader is not None:
                loader.close()
            index = active_stage(schedule, step)
            loader = open_stage(config, index, tokenizer, schedule)
        batches[step] = loader.batch_at(step)
    loader.close()
    return batches


class Timers:
    """Wraps functions of nanoflow.training.loop (module functions and methods) to add up the time spent in each."""

    def __init__(self):
        self.seconds, self.calls = collections.Counter(), collections.Counter()

    def wrap(self, owner, name: str, label: str, result_hook=None):
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                result = original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1
            return result_hook(result) if result_hook is not None else result

        setattr(owner, name, timed)

    def wrap_loader(self, loader):
        self.wrap(loader, "batch_at", "data: batch_at")
        self.wrap(loader, "close", "data: stage switch (open, close)")
        return loader


class Alone:
    """The other side: a fresh state stepped by `nanoflow.train_step` alone through the prepared batches."""

    def __init__(self, config, batches: dict):
        self.state, self.batches, self.seconds, self.tokens = nanoflow.init_state(config), batches, 0.0, 0

    def step(self, step: int) -> None:
        start = time.perf_counter()
        self.state, metrics = nanoflow.train_step(self.state, self.batches[step])
        self.seconds += time.perf_counter() - start
        self.tokens += metrics["tokens"]


def run_loop(config, timers: Timers, plain: bool, alone: Alone) -> tuple[float, nanoflow.TrainState, list[int]]:
    """`nanoflow.training.loop.train` with its parts timed and `alone` stepped beside each of its steps.

    Returns the loop's time (its wall time less the time spent beside it: the alone side's steps and
    the batch check), its final state, and the steps whose batch differed from the prepared one.
    """
    differed, beside, step_of_loop = [], 0.0, loop.train_step

    def interleaved(state, batch):
        nonlocal beside
        entered, step = time.perf_counter(), state.step + 1
        if not all(torch.equal(batch[k], alone.batches[step][k]) for k in ("input_ids", "labels")):
            differed.append(step)
        if step % 2 == 0:  # the order flips every step
            alone.step(step)
        start = time.perf_counter()
        result = step_of_loop(state, batch)
        finish = time.perf_counter()
        timers.seconds["train_step"] += finish - start
        timers.calls["train_step"] += 1
        if step % 2 == 1:
            alone.step(step)
        beside += (time.perf_counter() - entered) - (finish - start)
        return result

    loop.train_step = interleaved
    timers.wrap(loop, "open_stage", "data: stage switch (open, close)", result_hook=timers.wrap_loader)
    timers.wrap(loop.Checkpointer, "save", "checkpoint saves")
    timers.wrap(loop.Checkpointer, "restore", "start: fresh state")
    timers.wrap(nanoflow.run, "open_run", "start: tokenizer (preflight)")   # the run's checks, opened once
    timers.wrap(loop.MetricsLog, "write", "metrics.jsonl")
    timers.wrap(loop.MetricsLog, "__init__", "metrics.jsonl")
    timers.wrap(loop.TensorBoardLog, "write", "TensorBoard events")
    timers.wrap(loop.TensorBoardLog, "__enter__", "TensorBoard events")
    timers.wrap(loop.TensorBoardLog, "__exit__", "TensorBoard events")
    timers.wrap(loop.Progress, "step_done", "progress display")
    timers.wrap(loop.Progress, "__init__", "progress display")
    timers.wrap(loop.Progress, "close", "progress display")
    timers.wrap(progress.FlopsAndPeak, "of", "progress: start-up header (CPU matmul peak measured once)")
    timers.wrap(progress, "header", "progress: start-up header (CPU matmul peak measured once)")
    timers.wrap(loop.StopRequest, "agreed", "signals (agree on a stop)")
    timers.wrap(loop.Evaluator, "maybe_run", "evaluation (--evaluation: the curriculum's eval sets)")
    timers.wrap(loop.Evaluator, "__init__", "evaluation (--evaluation: the curriculum's eval sets)")
    with open(os.devnull, "w") as out:
        start = time.perf_counter()
        state = loop.train(config, fresh=True, out=out, progress=not plain)
        return time.perf_counter() - start - beside, state, differed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps of the shortened curriculum (default 200)")
    parser.add_argument("--plain", action="store_true", help="plain progress lines instead of the tqdm bar")
    parser.add_argument("--evaluation", action="store_true", help="keep the curriculum's [evaluation] (timed apart)")
    args = parse(parser, None, steps=3, plain=True)  # 3 steps: one in each stage

    date = datetime.date.today().isoformat()
    print(f"{date}  torch {torch.__version__}  {os.cpu_count()} CPU cores "
          f"({platform.processor() or platform.machine()}), {torch.get_num_threads()} torch threads  "
          f"load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="loop-overhead-") as folder:
        config = load_config(args.steps, os.path.join(folder, "run"), args.evaluation, SMOKE_SHAPE if args.smoke else [])
        schedule = Schedule.from_config(config)
        started = time.perf_counter()
        batches = build_batches(config)
        print(f"batches of {args.steps} steps read in {time.perf_counter() - started:.1f}s; stages: "
              + ", ".join(f"{s.name} from {s.start_step} ({s.global_batch_size} × {s.sequence_length})"
                          for s in schedule.stages)
              + f"; saves every {config.checkpoints.checkpoint_interval} steps and at the end")

        warm = nanoflow.init_state(config)  # both batch shapes once, so neither side pays torch's first-call costs
        warm, _ = nanoflow.train_step(warm, batches[1])
        warm = nanoflow.TrainState.create(step=args.steps - 1, model=warm.model, optimizer=warm.optimizer,
                                          lr_origin=0, run=warm.run)
        nanoflow.train_step(warm, batches[args.steps])
        del warm

        alone, timers = Alone(config, batches), Timers()
        loop_seconds, looped, differed = run_loop(config, timers, args.plain, alone)
        tokens, alone_seconds = alone.tokens, alone.seconds

        same = all(torch.equal(a, b) for a, b in zip(looped.model.parameters(), alone.state.model.parameters(), strict=True))
        loop_rate, alone_rate = tokens / loop_seconds, tokens / alone_seconds
        print(f"\n{args.steps} steps, {tokens:,} tokens; final weights of both sides identical: {same}")
        print(f"loop (nanoflow.training.loop.train)  {loop_seconds:7.2f} s  {loop_rate:9,.0f} tokens/s")
        print(f"train_step alone            {alone_seconds:7.2f} s  {alone_rate:9,.0f} tokens/s")
        print(f"loop / train_step alone: {loop_rate / alone_rate:.3f}  (target ≥ 0.95)\n")

        print("| where the loop's time went | calls | seconds | share of the loop |")
        print("|---|---:|---:|---:|")
        accounted = 0.0
        for label, seconds in sorted(timers.seconds.items(), key=lambda item: -item[1]):
            accounted += seconds
            print(f"| {label} | {timers.calls[label]} | {seconds:.3f} | {seconds / loop_seconds:.2%} |")
        rest = loop_seconds - accounted
        print(f"| the loop's own code (stage lookup, messages, the rest) | | {rest:.3f} | {rest / loop_seconds:.2%} |")
        print(f"| total | | {loop_seconds:.3f} | 100% |")
        inside = timers.seconds["train_step"]
        print(f"\ntrain_step inside the loop: {inside:.2f} s ({tokens / inside:,.0f} tokens/s), "
              f"{inside / loop_seconds:.1%} of the loop's time")
        print(f"load average at the end: {os.getloadavg()[0]:.1f}")
        if differed:  # the data (schedules/data/words) is fixed: only a file rewritten mid-run changes it
            print(f"warning: the loop read other batches at {len(differed)} steps (first {differed[0]}): a data "
                  "file changed during the run; the comparison is still one of equal work")
        elif not same:
            print("error: the loop and train_step alone ended with different weights from the same batches")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
