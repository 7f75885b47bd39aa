"""How much step time does a checkpoint save cost, [checkpoints] async_save = true against false?

    python bench/async_save.py [--rounds N] [--steps S] [--dir DIR] [--hidden H --intermediate I --layers L]
                              [--threads T]

The state: the curriculum's Llama made bigger (by default 1024 hidden, 2816 intermediate, 10 layers,
16 heads: about 128 M parameters) with its AdamW moments (one step taken first), ≈ 1.5 GB written per
checkpoint. Training is nanoflow.train_step on one fixed random batch (1 × 64 tokens: a short step,
so that a background write spans many of them), and saving is the real nanoflow.Checkpointer
(save, poll after every step as the loop does, finish), each mode in its own run folder on one
local disk (`--dir`), keeping one checkpoint.

Each round, for each mode (the order flips every round): S plain steps (the baseline), then a save
followed by S steps and the commit; the step time lost to the save is (the save segment's wall time)
− (the baseline segment's). os.sync() before every segment, so that no segment pays for the writeback
of an earlier one. Prints the medians and their ratio (target: async ≤ 10 % of sync).

`--threads T` trains with T torch threads (default: torch's, one a core): fewer threads than cores leave
the writing thread a core of its own, as on a GPU box, whose step does not use the host's cores.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # works without `pip install -e .`

import torch  # noqa: E402
from benchlib import parse  # noqa: E402

import nanoflow  # noqa: E402
from nanoflow.checkpoint.checkpointer import Checkpointer  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "schedules", "curriculum.toml")


def model_overrides(args) -> list[str]:
    return [f"model.hidden_size={args.hidden}", f"model.intermediate_size={args.intermediate}",
            f"model.num_hidden_layers={args.layers}", f"model.num_attention_heads={args.heads}",
            f"model.num_key_value_heads={args.heads}", "tokens.sequence_length=64", "tokens.micro_batch_size=1",
            "tokens.batch_accumulation_per_replica=1", "tokens.train_steps=1000000",
            "checkpoints.checkpoint_interval=1000000", "checkpoints.keep=1"]


def segment(state, batch, steps: int, checkpointer: Checkpointer | None = None):
    """(state, seconds, parts) of `steps` steps — after a save of the state first, and through its commit, when
    a checkpointer is given; `parts`: the seconds inside save() (a sync save's whole write; an async save's
    host copy) and inside the final finish() (waiting for a background write that outlasted the steps)."""
    os.sync()
    started, parts = time.perf_counter(), {"save": 0.0, "finish": 0.0}
    if checkpointer is not None:
        checkpointer.save(state)
        parts["save"] = time.perf_counter() - started
    for _ in range(steps):
        state, _ = nanoflow.train_step(state, batch)
        if checkpointer is not None:
            checkpointer.poll()
    if checkpointer is not None:
        waiting = time.perf_counter()
        checkpointer.finish()
        parts["finish"] = time.perf_counter() - waiting
    return state, time.perf_counter() - started, parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="steps after each save (and in each baseline)")
    parser.add_argument("--dir", default=None, help="where the run folders go (default: a temporary folder)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for training (default: torch's)")
    args = parse(parser, None, rounds=1, steps=1, hidden=64, intermediate=128, layers=1, heads=2)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    root = tempfile.mkdtemp(prefix="async-save-", dir=args.dir)
    try:
        configs = {mode: nanoflow.load_config(CONFIG, [*model_overrides(args), f"checkpoints.async_save={async_save}",
                                                       f"checkpoints.checkpoints_path='{root}/{mode}'"])
                   for mode, async_save in (("sync", "false"), ("async", "true"))}
        state = nanoflow.init_state(configs["sync"])
        params = sum(p.numel() for p in state.model.parameters())
        generator = torch.Generator().manual_seed(0)
        batch = {key: torch.randint(0, configs["sync"].model.vocab_size, (1, 64), generator=generator)
                 for key in ("input_ids", "labels")}
        state, _ = nanoflow.train_step(state, batch)  # the AdamW moments exist from here on
        checkpointers = {mode: Checkpointer(config, out=open(os.devnull, "w")) for mode, config in configs.items()}
        print(f"{params / 1e6:.1f} M parameters, {3 * params * 4 / 1e9:.2f} GB a checkpoint; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
              flush=True)
        lost = {"sync": [], "async": []}
        base_steps = []
        with checkpointers["sync"].locked(), checkpointers["async"].locked():
            for checkpointer in checkpointers.values():  # warm-up: the first save allocates what later ones reuse
                state, _, _ = segment(state, batch, 1, checkpointer)
            for round_ in range(args.rounds):
                order = ("sync", "async") if round_ % 2 == 0 else ("async", "sync")
                for mode in order:
                    state, base, _ = segment(state, batch, args.steps)
                    state, saving, parts = segment(state, batch, args.steps, checkpointers[mode])
                    lost[mode].append(saving - base)
                    base_steps.append(base / args.steps)
                    print(f"round {round_ + 1} {mode:5s}: {args.steps} steps {base:.2f} s, with a save {saving:.2f} s "
                          f"→ lost {saving - base:.2f} s (in save() {parts['save']:.2f} s, in the final finish() "
                          f"{parts['finish']:.2f} s)", flush=True)
        sync, asynchronous = statistics.median(lost["sync"]), statistics.median(lost["async"])
        step = statistics.median(base_steps)
        print(f"\nstep time lost to a save (median of {args.rounds}): sync {sync:.2f} s, async {asynchronous:.2f} s; "
              f"async / sync = {asynchronous / sync:.3f} (target ≤ 0.10); a step takes {step:.3f} s")
        print(f"\n| date | state | machine | sync lost | async lost | async / sync |\n|---|---|---|---|---|---|\n"
              f"| {datetime.date.today()} | {params / 1e6:.0f} M parameters + AdamW, {3 * params * 4 / 1e9:.2f} GB | "
              f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
              f"load ≈ {os.getloadavg()[0]:.0f} | {sync:.2f} s | "
              f"{asynchronous:.2f} s | {asynchronous / sync:.3f} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
