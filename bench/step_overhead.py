"""What does nanoflow's train_step cost over a bare hand-written PyTorch training step?

    python bench/step_overhead.py [--steps N] [--compile]

Both sides run in this one process on the same work: the curriculum's model (schedules/curriculum.toml),
its pretrain stage's batch (16 × 256, split into micro-batches of 8 × 2 — read from
`config.stage_tokens(0)`), one fixed random batch, AdamW with the same hyper-parameters and
param groups, the loss summed per micro-batch over the total target tokens, global-norm clipping.
After a warm-up of both sides, the steps are interleaved (nanoflow, bare, bare, nanoflow, …: the
order flips every round) so drift in the machine's speed hits both sides alike. Prints the median
tokens/s of each side, the ratio nanoflow / bare (target ≥ 0.97) and a Markdown table row.

--compile also runs the comparison compiled: nanoflow's side with `[model] compile = true` (on one
process the kernel compiles the whole forward, loss included, as one graph), the bare side with the whole
model compiled in place (`model.compile()`) (skipped, with the reason, when torch.compile does not work on
this machine).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # works without `pip install -e .`

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from benchlib import SMOKE_SHAPE, parse  # noqa: E402  (bench/benchlib.py)

import nanoflow  # noqa: E402
from nanoflow.model import Llama  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "schedules", "curriculum.toml")
IGNORE_INDEX = -100


def load_config(measured_steps: int, shape: list[str], compile_model: bool = False):
    # Enough steps for warm-up and measurement, all in the pretrain stage: the later stages are pushed
    # past train_steps ("not reached"), so every step has the pretrain stage's batch shape.
    steps = measured_steps + 100
    return nanoflow.load_config(CONFIG, overrides=[*shape,
        f"tokens.train_steps={steps}",
        f"data_stages.anneal.start_training_step={steps + 1}",
        f"data_stages.sft.start_training_step={steps + 2}",
        f"model.compile={str(compile_model).lower()}",
    ])


class Nanoflow:
    """nanoflow's side: TrainState threaded through train_step."""

    name = "nanoflow"

    def __init__(self, config):
        self.state = nanoflow.init_state(config)   # with [model] compile = true, the forward compiled whole
        self.weights = {k: v.detach().clone() for k, v in self.state.model.state_dict().items()}

    def step(self, batch) -> None:
        self.state, _ = nanoflow.train_step(self.state, batch)


class Bare:
    """The same step written by hand: forward/backward per micro-batch, clip, AdamW step, zero_grad."""

    name = "bare"

    def __init__(self, config, weights: dict):
        self.micro = config.stage_tokens(0).micro_batch_size
        self.clip = config.optimizer.max_grad_norm  # None: no clipping
        model = Llama(config.model)
        model.load_state_dict(weights)  # the same initial weights as nanoflow's side
        params = list(model.parameters())  # a tied weight appears once
        factory = config.optimizer.optimizer_factory
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.ndim >= 2], "weight_decay": config.optimizer.weight_decay},
             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
            lr=config.optimizer.learning_rate_scheduler.learning_rate,
            betas=(factory.adam_beta1, factory.adam_beta2), eps=factory.adam_eps)
        if config.model.compile:
            model.compile()  # the whole model, in place: what a PyTorch user writes
        self.model = model

    def step(self, batch) -> None:
        input_ids, labels = batch["input_ids"], batch["labels"]
        target_tokens = int((labels != IGNORE_INDEX).sum())
        for ids, targets in zip(input_ids.split(self.micro), labels.split(self.micro), strict=True):
            logits = self.model(ids)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum") / target_tokens
            loss.backward()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def compare(config, batch, *, steps: int, warmup: int) -> dict:
    a = Nanoflow(config)
    b = Bare(config, a.weights)
    tokens = batch["input_ids"].numel()
    for side in (a, b):
        for _ in range(warmup):
            side.step(batch)
    rates = {a.name: [], b.name: []}
    for round_ in range(steps):
        for side in ((a, b) if round_ % 2 == 0 else (b, a)):
            start = time.perf_counter()
            side.step(batch)
            rates[side.name].append(tokens / (time.perf_counter() - start))
    nano, bare = statistics.median(rates["nanoflow"]), statistics.median(rates["bare"])
    paired = statistics.median(x / y for x, y in zip(rates["nanoflow"], rates["bare"], strict=True))
    return {"nanoflow": nano, "bare": bare, "ratio": nano / bare, "paired": paired,
            "spread": {k: (min(v), max(v)) for k, v in rates.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="measured steps per side (default 60)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per side (default 3)")
    parser.add_argument("--compile", action="store_true", help="also compare with torch.compile on both sides")
    args = parse(parser, None, steps=2, warmup=1)

    shape = SMOKE_SHAPE if args.smoke else []
    config = load_config(args.steps + args.warmup, shape)
    tokens = config.stage_tokens(0)
    rows = tokens.micro_batch_size * tokens.batch_accumulation_per_replica * config.parallelism.dp
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 257, (rows, tokens.sequence_length), generator=generator),
             "labels": torch.randint(0, 257, (rows, tokens.sequence_length), generator=generator)}

    date = datetime.date.today().isoformat()
    threads = torch.get_num_threads()
    machine = f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), {threads} torch threads"
    print(f"{date}  torch {torch.__version__}  {machine}  load average {os.getloadavg()[0]:.1f}")
    print(f"model: {config.model.num_hidden_layers} layers × {config.model.hidden_size} hidden, "
          f"{sum(p.numel() for p in Llama(config.model).parameters()):,} parameters; batch {rows} × "
          f"{tokens.sequence_length} as {tokens.batch_accumulation_per_replica} micro-batches of "
          f"{tokens.micro_batch_size}; {args.warmup} warm-up + {args.steps} measured steps per side, interleaved\n")

    variants = [("eager", False)] + ([("compile", True)] if args.compile else [])
    table = []
    for variant, compile_model in variants:
        start = time.perf_counter()
        try:
            result = compare(load_config(args.steps + args.warmup, shape, compile_model), batch, steps=args.steps,
                             warmup=args.warmup)
        except Exception as e:  # torch.compile needs a working C++ toolchain and inductor support on this CPU
            if not compile_model:
                raise
            print(f"{variant}: skipped, torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        lo_n, hi_n = result["spread"]["nanoflow"]
        lo_b, hi_b = result["spread"]["bare"]
        print(f"{variant}: nanoflow {result['nanoflow']:,.0f} tok/s (min {lo_n:,.0f}, max {hi_n:,.0f})  "
              f"bare {result['bare']:,.0f} tok/s (min {lo_b:,.0f}, max {hi_b:,.0f})  "
              f"ratio {result['ratio']:.3f} (median of paired rounds {result['paired']:.3f})  "
              f"[{time.perf_counter() - start:.0f}s]")
        table.append(f"| {date} | {variant} | torch {torch.__version__}, {threads} threads | "
                     f"{result['nanoflow']:,.0f} | {result['bare']:,.0f} | {result['ratio']:.3f} |")

    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (this benchmark included)")
    print("\n| date | variant | torch, threads | nanoflow tok/s | bare tok/s | nanoflow / bare |")
    print("|---|---|---|---:|---:|---:|")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
