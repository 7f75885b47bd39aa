"""Packing SFT samples: real tokens trained per second on the default curriculum's SFT stage, one sample a row
(the stage as it is) against packed windows.

    python bench/sft_packing.py [--rounds 5] [--threads 1]

The curriculum's model and SFT stage (schedules/curriculum.toml: "Q: reverse qhm\\nA:" → " mhq", 22 tokens a
sample, so 21 positions of a 32-token row; 64 rows a step), and the same stage with packing = true at sequence
length 32, 64 and 256, the rows a step chosen so every setting trains 2,048 positions a step. Each setting's
batches are read by the stage's own loader (its first steps), and each step is one train_step on them. A
sample's real tokens are the positions it takes (n − 1 for n tokens); the rest of a row is padding. Rounds
interleaved (the order reversed every other round) after one warm-up step of each; the median time a step.
Prints a Markdown table: samples a step, padding, seconds a step, real tokens per second, and its ratio to one
sample a row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # this checkout's nanoflow, also without `pip install -e .`
from benchlib import SMOKE_MODEL, load_average, machine_line, parse  # noqa: E402  (bench/benchlib.py)

CONFIG = os.path.join(HERE, "..", "schedules", "curriculum.toml")
POSITIONS = 2048   # a step's positions in every setting: the stage's 64 rows × 32
SETTINGS = [("one sample a row", 32, False), ("packed", 32, True), ("packed", 64, True), ("packed", 256, True)]


def config_of(seq: int, packing: bool, model: list[str]):
    import nanoflow

    # The SFT stage alone: it starts at step 1 (the earlier stages pushed out of the run's steps would only be read).
    return nanoflow.load_config(CONFIG, overrides=[
        *model, "tokens.train_steps=2000", "data_stages.pretrain.start_training_step=1",
        "data_stages.anneal.start_training_step=998", "data_stages.sft.start_training_step=999",
        f"data_stages.sft.sequence_length={seq}", f"data_stages.sft.micro_batch_size={POSITIONS // seq}",
        "data_stages.sft.batch_accumulation_per_replica=1", f"data_stages.sft.data.dataset.packing={str(packing).lower()}",
    ])


def real_positions(batch) -> int:
    """The positions samples take: each sample's from its start to its last target (its end-of-text)."""
    import torch

    labels = batch["labels"]
    starts = batch.get("position_ids", torch.arange(labels.shape[1]).expand_as(labels)) == 0
    total = 0
    for row_labels, row_starts in zip(labels.tolist(), starts.tolist(), strict=True):
        bounds = [i for i, s in enumerate(row_starts) if s] + [len(row_labels)]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            targets = [i for i in range(a, b) if row_labels[i] != -100]
            total += targets[-1] + 1 - a if targets else 0
    return total


def setting(seq: int, packing: bool, model: list[str], steps: int):
    """(state, batches, samples a step, real positions a step) of one setting."""
    import nanoflow
    from nanoflow.data import load_run_tokenizer, open_stage
    from nanoflow.schedule import Schedule

    config = config_of(seq, packing, model)
    schedule = Schedule.from_config(config)
    with open_stage(config, 2, load_run_tokenizer(config), schedule) as loader:
        batches = [loader.batch_at(999 + k) for k in range(steps)]
    samples = statistics.mean(int((b["position_ids"] == 0).sum()) if "position_ids" in b else len(b["input_ids"])
                              for b in batches)
    real = statistics.mean(real_positions(b) for b in batches)
    # A fresh model, its state moved on to the step before the SFT stage's first: each round trains the next step.
    return nanoflow.init_state(config).advance(998), batches, samples, real


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parse(parser, argv, rounds=1)
    import torch

    from nanoflow import train_step

    torch.set_num_threads(args.threads)
    model = SMOKE_MODEL if args.smoke else []
    sides = [[name, seq, packing, *setting(seq, packing, model, args.rounds + 1)] for name, seq, packing in SETTINGS]
    times = {i: [] for i in range(len(sides))}
    order = list(range(len(sides)))
    for round_ in range(args.rounds + 1):      # round 0: the warm-up
        for i in (order if round_ % 2 else order[::-1]):
            side = sides[i]
            batch = side[4][round_]
            start = time.perf_counter()
            side[3], _ = train_step(side[3], batch)
            if round_:
                times[i].append(time.perf_counter() - start)
    print(f"# {machine_line()}; {load_average()}")
    print("| setting | sequence | rows a step | samples a step | padding | s a step | real tokens/s | × one a row |")
    print("|---|---|---|---|---|---|---|---|")
    rates = [side[6] / statistics.median(times[i]) for i, side in enumerate(sides)]
    for (name, seq, _, _, batches, samples, real), rate, i in zip(sides, rates, times, strict=True):
        print(f"| {name} | {seq} | {len(batches[0]['input_ids'])} | {samples:.1f} | {1 - real / POSITIONS:.1%} | "
              f"{statistics.median(times[i]):.3f} | {rate:,.0f} | {rate / rates[0]:.2f} |")
    print(f"best packed / one a row = {max(rates[1:]) / rates[0]:.2f}")


if __name__ == "__main__":
    main()
