"""What does evaluation cost? Eval tokens/s against training tokens/s, and evaluation's share of a run's wall time.

    python bench/evaluation.py [--rounds N] [--warmup W] [--steps S --interval I --samples M]
                               [--vocab V --vocab-rounds R] [--vocab-only]

1. Throughput: the curriculum's model (schedules/curriculum.toml) and its pretrain batch (16 × 256 tokens), one
   fixed random batch. A training step (nanoflow.train_step: forward, backward, AdamW) and an evaluation of the
   same 16 × 256 tokens (nanoflow.evaluation.score: forward only, under inference_mode, micro-batches of 8)
   alternate round by round (the order flips every round), after a warm-up of both. Prints the median tokens/s
   of each and the ratio eval / train (expected ≥ 2.5: a forward costs about a third of forward + backward).
2. Share: `train()` on the curriculum for S steps with an eval set of M windows of its pretrain data evaluated
   every I steps (and at the end); the time spent in evaluation over the loop's wall time.
3. A large vocabulary (--vocab, 128,256): the curriculum's model with that vocabulary scores one micro-batch of
   8 × 256 tokens by `score` (a chunk of logits at a time, nanoflow.loss.token_scores) and by the scoring it
   replaced (the micro-batch's whole logits, `model(x)`, then F.cross_entropy and argmax over them), alternating
   round by round, in one thread; the median of each one's CPU seconds, their losses, and the largest tensor each
   makes (one more pass of each under a dispatch mode that records every operator's output).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # works without `pip install -e .`

import attrs  # noqa: E402
import torch  # noqa: E402
from benchlib import SMOKE_SHAPE, parse  # noqa: E402  (bench/benchlib.py)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from nanoflow import evaluation  # noqa: E402
from nanoflow.build import init_state  # noqa: E402
from nanoflow.config import EvalDatasetArgs, EvaluationArgs, load_config  # noqa: E402
from nanoflow.evaluation import EvalSet, score  # noqa: E402
from nanoflow.parallel.mesh import SINGLE  # noqa: E402
from nanoflow.step import train_step  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "schedules", "curriculum.toml")


def throughput(rounds: int, shape: list[str], warmup: int) -> tuple[float, float]:
    """Median training and eval tokens/s on the curriculum's pretrain batch."""
    config = load_config(CONFIG, [*shape, f"tokens.train_steps={10 * rounds}"])
    tokens = config.stage_tokens(0)
    rows = tokens.micro_batch_size * tokens.batch_accumulation_per_replica
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.model.vocab_size, (rows, tokens.sequence_length + 1), generator=generator)
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    eval_set = EvalSet("bench", "loss", batch["input_ids"], batch["labels"], tokens.micro_batch_size)
    state = init_state(config, SINGLE)
    train_times, eval_times = [], []

    def train_once():
        nonlocal state
        start = time.perf_counter()
        state, _ = train_step(state, batch)
        return time.perf_counter() - start

    def eval_once():
        start = time.perf_counter()
        score(state.model, eval_set, SINGLE)
        return time.perf_counter() - start

    for _ in range(warmup):
        train_once(), eval_once()
    for r in range(rounds):
        first, second = (train_once, eval_once) if r % 2 == 0 else (eval_once, train_once)
        a, b = first(), second()
        (train_times, eval_times)[first is eval_once].append(a)
        (train_times, eval_times)[second is eval_once].append(b)
    per_batch = rows * tokens.sequence_length
    return per_batch / statistics.median(train_times), per_batch / statistics.median(eval_times)


def share(steps: int, interval: int, samples: int, shape: list[str]) -> tuple[float, float, int, int]:
    """(seconds in evaluation, the loop's wall seconds, evaluations, their sequence length) of a curriculum run of
    `steps` steps."""
    from nanoflow.training.loop import train

    with tempfile.TemporaryDirectory(prefix="bench-eval-") as folder:
        config = load_config(CONFIG, [*shape, f"tokens.train_steps={steps}", f'checkpoints.checkpoints_path="{folder}"',
                                      f"checkpoints.checkpoint_interval={steps}"])
        pretrain = config.data_stages[0].data.dataset
        config = attrs.evolve(config, evaluation=EvaluationArgs(interval=interval, datasets=(
            EvalDatasetArgs(name="pretrain", dataset=pretrain, max_samples=samples),)))
        spent, calls = [0.0], [0]
        original = evaluation.Evaluator.maybe_run

        def timed(self, state):
            start = time.perf_counter()
            rows = original(self, state)
            if rows:
                spent[0] += time.perf_counter() - start
                calls[0] += 1
            return rows

        evaluation.Evaluator.maybe_run = timed
        try:
            start = time.perf_counter()
            train(config, fresh=True, out=io.StringIO())
            wall = time.perf_counter() - start
        finally:
            evaluation.Evaluator.maybe_run = original
    return spent[0], wall, calls[0], config.eval_sequence_length(config.evaluation.datasets[0])


class LargestOutput(TorchDispatchMode):
    """The most bytes any operator's output holds while the mode is on."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def large_vocabulary(vocab: int, rounds: int, shape: list[str]) -> dict:
    """{"chunked", "whole"}: (median seconds, loss, largest tensor's bytes) of scoring one micro-batch at `vocab`."""
    import torch.nn.functional as F

    from nanoflow.build import build_model
    from nanoflow.data.sources import IGNORE_INDEX

    config = load_config(CONFIG, [*shape, f"model.vocab_size={vocab}"])
    tokens = config.stage_tokens(0)
    model = build_model(config, SINGLE)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (tokens.micro_batch_size, tokens.sequence_length + 1), generator=generator)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    eval_set = EvalSet("bench", "exact_match", x, y, tokens.micro_batch_size)

    def chunked() -> float:
        return score(model, eval_set, SINGLE)["loss"]

    def whole() -> float:   # the scoring before token_scores: the micro-batch's logits, all of them
        with torch.inference_mode():
            logits = model(x).float()
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
            ((logits.argmax(dim=-1) == y).all(dim=1)).sum()
        return float(loss) / y.numel()

    ways = {"chunked": chunked, "whole": whole}
    times: dict[str, list[float]] = {name: [] for name in ways}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # one thread, timed by its own CPU time: what other processes do on the cores is left out
    try:
        losses = {name: way() for name, way in ways.items()}   # also the warm-up
        for r in range(rounds):
            for name in ("chunked", "whole") if r % 2 == 0 else ("whole", "chunked"):
                start = time.thread_time()
                ways[name]()
                times[name].append(time.thread_time() - start)
    finally:
        torch.set_num_threads(threads)
    result = {}
    for name, way in ways.items():
        with LargestOutput() as mode:
            way()
        result[name] = (statistics.median(times[name]), losses[name], mode.largest)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds of each before the timed ones")
    parser.add_argument("--vocab", type=int, default=128_256, help="the vocabulary of the third measurement")
    parser.add_argument("--vocab-rounds", type=int, default=6, help="rounds of each scoring at --vocab")
    parser.add_argument("--vocab-only", action="store_true", help="the third measurement alone")
    args = parse(parser, None, rounds=1, steps=2, interval=1, samples=2, warmup=1, vocab=4096, vocab_rounds=1)
    shape = SMOKE_SHAPE if args.smoke else []
    if not args.smoke:   # --smoke keeps benchlib's one thread
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    if not args.vocab_only:
        train_rate, eval_rate = throughput(args.rounds, shape, args.warmup)
        print(f"training {train_rate:,.0f} tok/s, evaluation {eval_rate:,.0f} tok/s: eval / train = "
              f"{eval_rate / train_rate:.2f} (median of {args.rounds} rounds, threads {torch.get_num_threads()})")
        spent, wall, calls, sequence = share(args.steps, args.interval, args.samples, shape)
        print(f"{args.steps} steps, {calls} evaluations of {args.samples} × {sequence} tokens (every {args.interval} "
              f"steps): {spent:.1f} s of {wall:.1f} s in evaluation = {100 * spent / wall:.1f} % of the wall time")
    found = large_vocabulary(args.vocab, args.vocab_rounds, shape)
    (chunked_s, chunked_loss, chunked_bytes), (whole_s, whole_loss, whole_bytes) = found["chunked"], found["whole"]
    print(f"vocabulary {args.vocab:,}, one micro-batch, 1 thread: chunked {chunked_s:.3f} CPU s, whole logits "
          f"{whole_s:.3f} CPU s: "
          f"chunked / whole = {chunked_s / whole_s:.2f} (median of {args.vocab_rounds} rounds); largest tensor "
          f"{chunked_bytes / 2**20:,.1f} MiB against {whole_bytes / 2**20:,.1f} MiB = {chunked_bytes / whole_bytes:.3f}; "
          f"losses {chunked_loss:.6f} and {whole_loss:.6f}")


if __name__ == "__main__":
    main()
