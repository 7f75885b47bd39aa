"""Does resuming late in a long run cost more than resuming early? Time from process start to the first step.

    python bench/resume.py [--rounds N] [--lines-after K] [--no-big]

The long schedule: schedules/curriculum.toml with `--set tokens.train_steps=2000000`, the anneal
stage at step 1,500,000 (where the WSD decay starts too) and the SFT stage at 1,900,000. Two run
folders resume it, one at step 10 and one at step 1,000,000. Each holds one committed checkpoint
of a real state — `nanoflow.init_state`, one `train_step` so that the AdamW moments exist, then the
same model and optimizer wrapped by `TrainState.create(step=S, ...)` (AdamW's step counts set to S
too) and saved through `nanoflow.parallel.shards.state_blocks` and `nanoflow.io.save_checkpoint`,
exactly as the loop saves — and the metrics.jsonl such a run leaves: one line per step, S lines,
plus K more (default 37) from an attempt that was killed after the checkpoint, which the resume
drops (1,000,037 lines, about 190 MB, for the late run).

Each measurement is a fresh process running exactly what `bin/train CONFIG --set ...` runs
(`nanoflow.commands.cli.train_main`), with nanoflow.training.loop's functions wrapped to note the moment each phase
ends; it exits as soon as its first step has completed (before writing anything, so every round
starts from the same files; the parent also restores the killed attempt's metrics lines). The
clock (CLOCK_MONOTONIC, shared by all processes) starts just before the parent spawns the process.
Early and late alternate, the order flipping every round; medians over the rounds.

Also measured, in the same processes: the time the resume spends choosing the checkpoint
(`Checkpointer._checkpoints_to_try`: listing, metadata, file sizes) and restoring it (`Checkpointer._restore_from`: the model
and optimizer built, every shard read by byte range, its XXH3-128 checked, and copied in), against the raw read
of the same files (open + one readinto each, as fast as Python reads a file), timed in the same
process right after its first step. The curriculum's model gives a 10 MB checkpoint; unless
--no-big, the same is measured for a 28.5 M-parameter model (768 hidden, 2048 intermediate, 4
layers: a 342 MB checkpoint, as in bench/checkpoint_io.py) whose first step is one sequence of 64.
Target: late / early ≤ 1.2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..")
sys.path.insert(0, REPO)  # this checkout's nanoflow, also without `pip install -e .`
from benchlib import SMOKE_SHAPE, parse  # noqa: E402  (bench/benchlib.py)

CONFIG = os.path.join(REPO, "schedules", "curriculum.toml")
LATE = 1_000_000
EARLY = 10
LONG_SCHEDULE = [
    "tokens.train_steps=2000000",
    "data_stages.anneal.start_training_step=1500000",
    "data_stages.sft.start_training_step=1900000",
    "optimizer.learning_rate_scheduler.lr_decay_starting_step=1500000",
    "checkpoints.checkpoint_interval=1000",
]
BIG_MODEL = [
    "model.hidden_size=768", "model.intermediate_size=2048", "model.num_hidden_layers=4",
    "model.num_attention_heads=8", "model.num_key_value_heads=8",
    "tokens.sequence_length=64", "tokens.micro_batch_size=1", "tokens.batch_accumulation_per_replica=1",
]
PHASES = [  # (label, the mark that ends it), in the order they happen
    ("interpreter start, imports (torch, torch._dynamo, nanoflow)", "imported"),
    ("config, tokenizer, topology", "start_state_begins"),
    ("choose the checkpoint (listing, metadata, file sizes)", "checkpoint_chosen"),
    ("restore: build the model and optimizer, read and check the shards, copy them in", "start_state_done"),
    ("progress display", "progress_ready"),
    ("metrics.jsonl: drop the killed attempt's lines", "metrics_log_ready"),
    ("TensorBoard writer", "tensorboard_ready"),
    ("open the stage's data (seek to the step)", "stage_opened"),
    ("first batch (batch_at)", "first_batch"),
    ("first train_step", "first_step"),
]


# ---------------------------------------------------------------------------------------------
# The measured process

def worker(argv: list[str]) -> None:
    """Run bin/train's main with timers; print the marks (CLOCK_MONOTONIC) once the first step is done."""
    marks = {}
    import torch._dynamo  # noqa: F401 - torch.optim imports it when the first optimizer is built (0.4 s); done

    # here, up front, so that the restore phase shows the restore's own work. The total is the same.
    import nanoflow.commands.cli as cli
    import nanoflow.training.loop as loop
    marks["imported"] = time.monotonic()

    def after(owner, name, mark, result_hook=None, first_only=True):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if name == "restore":
                marks.setdefault("start_state_begins", time.monotonic())
            result = original(*args, **kwargs)
            if not (first_only and mark in marks):
                marks[mark] = time.monotonic()
            return result_hook(result) if result_hook is not None else result

        setattr(owner, name, timed)

    def on_loader(loader):
        after(loader, "batch_at", "first_batch")
        return loader

    after(loop.Checkpointer, "_checkpoints_to_try", "checkpoint_chosen")
    after(loop.Checkpointer, "_restore_from", "restored")
    after(loop.Checkpointer, "restore", "start_state_done")
    after(loop.Progress, "__init__", "progress_ready")
    after(loop.MetricsLog, "__init__", "metrics_log_ready")
    after(loop.TensorBoardLog, "__enter__", "tensorboard_ready")
    after(loop, "open_stage", "stage_opened", result_hook=on_loader)
    step_of_loop = loop.train_step

    def first_step(state, batch):
        step_of_loop(state, batch)
        marks["first_step"] = time.monotonic()
        raw = raw_read_seconds(state.config.checkpoints.checkpoints_path)
        print(json.dumps({"marks": marks, "raw_read": raw}), flush=True)
        os._exit(0)  # before the step is logged or saved: every round finds the same files

    loop.train_step = first_step
    cli.train_main(argv)
    raise SystemExit("the run ended without a first step")


def raw_read_seconds(run: str) -> dict:
    """Open and readinto every file of the run's latest checkpoint, as fast as Python reads a file (warm cache)."""
    with open(os.path.join(run, "latest.txt")) as f:
        folder = os.path.join(run, f.read().strip())
    with open(os.path.join(folder, "checkpoint_metadata.json")) as f:
        names = list(json.load(f)["files"])
    start, size = time.monotonic(), 0
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            buffer = bytearray(os.fstat(f.fileno()).st_size)
            f.readinto(buffer)
            size += len(buffer)
    return {"seconds": time.monotonic() - start, "bytes": size}


# ---------------------------------------------------------------------------------------------
# Fixtures

def metrics_line(step: int) -> str:
    """A metrics.jsonl line as the loop writes it, of realistic length."""
    return (f'{{"step": {step}, "stage": "pretrain", "loss": 1.2345678901234567, "lr": 0.0029999999999999996, '
            f'"grad_norm": 0.31234567890123456, "tokens": 4096, "target_tokens": 4096, '
            f'"elapsed": {step * 0.2345:.3f}}}\n')


def write_metrics(path: str, last: int, chunk: int = 100_000) -> None:
    with open(path, "w") as f:
        for first in range(1, last + 1, chunk):
            f.write("".join(metrics_line(s) for s in range(first, min(first + chunk, last + 1))))


def restore_killed_attempt(path: str, step: int, lines_after: int) -> None:
    """Put back the lines of steps after `step` that the previous round's resume dropped (or left)."""
    with open(path, "r+b") as f:
        f.seek(0, os.SEEK_END)
        end, back = f.tell(), min(f.tell(), 1 << 16)
        f.seek(end - back)
        tail = f.read()
        # cut after the line of `step` (the last lines are steps ≤ step + lines_after, in order)
        marker = f'{{"step": {step}, '.encode()
        at = tail.rfind(marker)
        if at < 0:
            raise SystemExit(f"{path}: no line of step {step} near the end")
        f.truncate(end - back + tail.index(b"\n", at) + 1)
        f.seek(0, os.SEEK_END)
        f.write("".join(metrics_line(s) for s in range(step + 1, step + 1 + lines_after)).encode())


def make_run(folder: str, step: int, extra: list[str], lines_after: int) -> tuple[str, list[str]]:
    """A run folder holding a committed checkpoint of a real state at `step`, and its metrics.jsonl."""
    import torch

    import nanoflow
    from nanoflow.checkpoint.checkpointer import checkpoint_info
    from nanoflow.io import save_checkpoint
    from nanoflow.parallel.shards import state_blocks

    overrides = LONG_SCHEDULE + extra + [f'checkpoints.checkpoints_path="{folder}"']
    config = nanoflow.load_config(CONFIG, overrides)
    state = nanoflow.init_state(config)
    tokens = config.stage_tokens(0)
    rows = tokens.micro_batch_size * tokens.batch_accumulation_per_replica
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 257, (rows, tokens.sequence_length + 1), generator=generator)
    state, _ = nanoflow.train_step(state, {"input_ids": ids[:, :-1], "labels": ids[:, 1:]})  # moments exist now
    for moments in state.optimizer.state.values():
        moments["step"].fill_(step)
    state = nanoflow.TrainState.create(step=step, model=state.model, optimizer=state.optimizer, lr_origin=0,
                                       run=state.run)
    groups, info = state_blocks(state.model, state.optimizer, state.topology), checkpoint_info(state)
    save_checkpoint(folder, step, groups, info)
    write_metrics(os.path.join(folder, "metrics.jsonl"), step + lines_after)
    return folder, overrides


# ---------------------------------------------------------------------------------------------
# The parent

def measure(overrides: list[str]) -> dict:
    """One fresh process resuming the run; the marks relative to its spawn."""
    command = [sys.executable, __file__, "--worker", CONFIG] + [a for o in overrides for a in ("--set", o)]
    start = time.monotonic()
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    if out.returncode != 0 or not out.stdout.strip():
        raise SystemExit(f"the resumed process failed ({out.returncode}):\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    marks = {k: v - start for k, v in result["marks"].items()}
    return {"marks": marks, "raw_read": result["raw_read"]}


def phases(marks: dict) -> dict:
    out, previous = {}, 0.0
    for label, mark in PHASES:
        out[label] = marks[mark] - previous
        previous = marks[mark]
    return out


def median_of(results: list[dict], key) -> float:
    return statistics.median(key(r) for r in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of early + late (default 5)")
    parser.add_argument("--lines-after", type=int, default=37,
                        help="metrics lines left after the checkpoint by a killed attempt (default 37)")
    parser.add_argument("--no-big", action="store_true", help="skip the 28.5 M-parameter checkpoint-read measurement")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--late", type=int, default=LATE, help=f"the late resume's step (default {LATE:,})")
    args = parse(parser, None, rounds=1, no_big=True, late=1000)
    if args.worker is not None:
        return worker(args.worker)
    late_step = args.late

    import torch
    date = datetime.date.today().isoformat()
    print(f"{date}  torch {torch.__version__}  {os.cpu_count()} CPU cores "
          f"({platform.processor() or platform.machine()})  load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="resume-bench-") as folder:
        started = time.perf_counter()
        shape = SMOKE_SHAPE if args.smoke else []
        runs = {step: make_run(os.path.join(folder, f"at{step}"), step, shape, args.lines_after)
                for step in (EARLY, late_step)}
        sizes = {step: os.path.getsize(os.path.join(runs[step][0], "metrics.jsonl")) for step in runs}
        print(f"fixtures in {time.perf_counter() - started:.1f}s: metrics.jsonl of {sizes[EARLY]:,} B (step {EARLY}) "
              f"and {sizes[late_step] / 1e6:,.0f} MB (step {late_step:,}), {args.lines_after} lines after the checkpoint each")
        results = {EARLY: [], late_step: []}
        for round_ in range(args.rounds):
            for step in ((EARLY, late_step) if round_ % 2 == 0 else (late_step, EARLY)):
                restore_killed_attempt(os.path.join(runs[step][0], "metrics.jsonl"), step, args.lines_after)
                results[step].append(measure(runs[step][1]))
            print(f"round {round_ + 1}: to first step {results[EARLY][-1]['marks']['first_step']:.2f}s (step "
                  f"{EARLY}), {results[late_step][-1]['marks']['first_step']:.2f}s (step {late_step:,})")

        early = median_of(results[EARLY], lambda r: r["marks"]["first_step"])
        late = median_of(results[late_step], lambda r: r["marks"]["first_step"])
        paired = statistics.median(b["marks"]["first_step"] / a["marks"]["first_step"]
                                   for a, b in zip(results[EARLY], results[late_step], strict=True))
        print(f"\ntime from process start to the first completed step (median of {args.rounds}):")
        print(f"  resume at step {EARLY}: {early:.3f} s;  at step {late_step:,}: {late:.3f} s;  "
              f"late / early {late / early:.3f} (median of paired rounds {paired:.3f}; target ≤ 1.2)\n")
        print(f"| phase (median s) | resume at {EARLY} | resume at {late_step:,} |")
        print("|---|---:|---:|")
        for label, _ in PHASES:
            early_s, late_s = (median_of(results[s], lambda r, label=label: phases(r["marks"])[label])
                               for s in (EARLY, late_step))
            print(f"| {label} | {early_s:.3f} | {late_s:.3f} |")
        print(f"| **to the first completed step** | **{early:.3f}** | **{late:.3f}** |")

        rows = [("curriculum model", results[EARLY] + results[late_step])]
        if not args.no_big:
            big, overrides = make_run(os.path.join(folder, "big"), late_step, BIG_MODEL, args.lines_after)
            big_results = []
            for _ in range(3):
                restore_killed_attempt(os.path.join(big, "metrics.jsonl"), late_step, args.lines_after)
                big_results.append(measure(overrides))
            rows.append(("28.5 M parameters", big_results))
        print("\n| checkpoint | MB | raw read s (MB/s) | choose s | read + check + restore s | "
              "choose … restore s | × raw |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, rs in rows:
            size = rs[0]["raw_read"]["bytes"]
            raw = median_of(rs, lambda r: r["raw_read"]["seconds"])
            chosen = median_of(rs, lambda r: r["marks"]["checkpoint_chosen"] - r["marks"]["start_state_begins"])
            restored = median_of(rs, lambda r: r["marks"]["restored"] - r["marks"]["checkpoint_chosen"])
            total = median_of(rs, lambda r: r["marks"]["restored"] - r["marks"]["start_state_begins"])
            print(f"| {name} | {size / 1e6:.1f} | {raw:.4f} ({size / 1e6 / raw:,.0f}) | {chosen:.4f} | "
                  f"{restored:.4f} | {total:.4f} | {total / raw:.1f} |")
        print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
