"""The loss paths side by side: plain full-logits cross-entropy, the fused linear cross-entropy and
the former chunked loss (the head's matmul redone in backward), at several vocabularies and threads.

    python bench/loss.py [--vocab 288,50304,128256] [--threads 1,2] [--rounds 3] [--batch 8 --sequence 256]

Time: forward + backward of the whole model (Llama, 256 hidden, 688 intermediate, 4 layers, 4 heads)
on `--batch` × `--sequence` tokens, with each loss, rounds interleaved (the order reversed every
other round), after one warm-up round; the medians of wall and CPU seconds. Memory: the loss alone (the
final hidden states and the head as leaves, forward + backward), in a process of its own started with
MALLOC_MMAP_THRESHOLD_ so that freed tensors leave the resident set (not timed: there every tensor is a
mapping of its own), the resident set's peak reset before each measurement; peak − before, the least of
the rounds. Ratios are to the plain path.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # this checkout's nanoflow, also without `pip install -e .`
from benchlib import status  # noqa: E402  (bench/benchlib.py)

MB = 1e6



def reset_peak() -> int:
    """Sets the peak resident set to the current one (Linux's clear_refs 5) and returns it."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def recomputed_loss():
    """The former chunked loss: the forward keeps each position's log-sum-exp, the backward computes the
    chunk's logits again (four matmuls a chunk instead of three). Kept here to measure against."""
    import torch

    from nanoflow.loss import _compute_dtype, chunk_positions

    class Recomputed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, labels, positions):
            dtype = _compute_dtype(hidden, weight)
            total, lses = torch.zeros(()), []
            with torch.autocast("cpu", enabled=False):
                for start in range(0, hidden.shape[0], positions):
                    logits = (hidden[start:start + positions].to(dtype) @ weight.to(dtype).t()).float()
                    lse = torch.logsumexp(logits, -1)
                    total += (lse - logits.gather(1, labels[start:start + positions, None])[:, 0]).sum()
                    lses.append(lse)
            ctx.save_for_backward(hidden, weight, labels, torch.cat(lses))
            ctx.positions, ctx.dtype = positions, dtype
            return total

        @staticmethod
        def backward(ctx, grad_total):
            hidden, weight, labels, lses = ctx.saved_tensors
            positions, dtype = ctx.positions, ctx.dtype
            grad_hidden = torch.empty_like(hidden)
            grad_weight = torch.zeros(weight.shape)
            w = weight.to(dtype)
            with torch.autocast("cpu", enabled=False):
                for start in range(0, hidden.shape[0], positions):
                    h = hidden[start:start + positions].to(dtype)
                    grad = (h @ w.t()).float().sub_(lses[start:start + positions, None]).exp_()
                    grad.scatter_add_(1, labels[start:start + positions, None], torch.full((h.shape[0], 1), -1.0))
                    grad = (grad * grad_total).to(dtype)
                    grad_hidden[start:start + positions] = grad @ w
                    grad_weight += (grad.t() @ h).float()
            return grad_hidden, grad_weight.to(weight.dtype), None, None

    def loss(hidden, weight, labels, ignore_index):  # no target is ignored in this benchmark
        return Recomputed.apply(hidden.flatten(0, -2), weight, labels.flatten(),
                                chunk_positions(weight.shape[0], hidden.device))

    return loss


def paths():
    from nanoflow.loss import cross_entropy_sum, plain_cross_entropy_sum

    return {"plain": plain_cross_entropy_sum, "fused": cross_entropy_sum, "chunked": recomputed_loss()}


def model_for(vocab: int, sequence: int):
    import torch

    from nanoflow.config.families import complete
    from nanoflow.config.schema import ModelArgs
    from nanoflow.model import Llama

    cfg = complete(ModelArgs(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max(sequence, 256)))
    model = Llama(cfg)
    model.reset_parameters(torch.Generator().manual_seed(0))
    return model


def measure_time(vocab: int, args) -> dict:
    """Each loss's median forward + backward time of the whole model: wall and CPU seconds."""
    import torch

    losses = paths()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (args.batch, args.sequence), generator=generator)
    labels = torch.randint(0, vocab, (args.batch, args.sequence), generator=generator)
    model = model_for(vocab, args.sequence)
    times = {name: [] for name in losses}
    cpu = {name: [] for name in losses}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name in (list(losses) if round_ % 2 else list(losses)[::-1]):
            model.zero_grad(set_to_none=True)
            started, started_cpu = time.perf_counter(), time.process_time()
            hidden = model.model(ids)
            losses[name](hidden, model.lm_head.weight, labels, -100).backward()
            if round_:
                times[name].append(time.perf_counter() - started)
                cpu[name].append(time.process_time() - started_cpu)
    return {name: (statistics.median(times[name]), statistics.median(cpu[name])) for name in losses}


def measure_memory(vocab: int, args) -> dict:
    """Each loss's own peak resident set (the least of the rounds), in a process whose freed tensors leave
    the set (MALLOC_MMAP_THRESHOLD_: every tensor its own mapping, so this process is not timed)."""
    import torch

    losses = paths()
    generator = torch.Generator().manual_seed(1)
    flat = torch.randint(0, vocab, (args.batch * args.sequence,), generator=generator)
    hidden = torch.randn(args.batch * args.sequence, 256, generator=generator).requires_grad_()
    weight = (torch.randn(vocab, 256, generator=generator) * 0.02).requires_grad_()
    peaks = {name: [] for name in losses}
    for round_ in range(args.rounds):
        for name in (list(losses) if round_ % 2 else list(losses)[::-1]):
            hidden.grad = weight.grad = None
            before = reset_peak()
            losses[name](hidden, weight, flat, -100).backward()
            peaks[name].append(status("VmHWM") - before)
    return {name: min(peaks[name]) for name in losses}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", default="288,50304,128256")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=256)
    parser.add_argument("--smoke", action="store_true", help="vocab 288 and 2,048, 1 thread, 1 round, 2 × 32 (a smoke test)")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.vocab, args.threads, args.rounds, args.batch, args.sequence = "288,2048", "1", 1, 2, 32
    import torch

    vocabs = [int(v) for v in args.vocab.split(",")]
    if args.memory_child:   # one JSON line: vocabulary → {loss: bytes}
        print(json.dumps({vocab: measure_memory(vocab, args) for vocab in vocabs}))
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}   # freed tensors must leave the resident set
    child = subprocess.run([sys.executable, *sys.argv, "--memory-child", "--threads", "1"], env=env, check=False,
                           capture_output=True, text=True)
    if child.returncode:
        raise SystemExit(f"the memory measurement's process failed:\n{child.stderr[-3000:]}")
    memory = {int(vocab): peaks for vocab, peaks in json.loads(child.stdout.splitlines()[-1]).items()}
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
          f"load average {os.getloadavg()[0]:.1f} at the start; {args.batch} × {args.sequence} positions, float32, "
          f"{args.rounds} rounds; time: wall seconds, medians (CPU seconds: the last columns)\n")
    print("| threads | vocab | plain s | fused s | chunked s | fused / plain | chunked / plain "
          "| plain MB | fused MB | chunked MB | fused / plain | chunked / plain "
          "| fused / plain, CPU s | chunked / plain, CPU s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for vocab in vocabs:
            r = measure_time(vocab, args)
            (tp, cp), (tf, cf), (tc, cc) = r["plain"], r["fused"], r["chunked"]
            mp, mf, mc = (memory[vocab][name] for name in ("plain", "fused", "chunked"))
            print(f"| {threads} | {vocab:,} | {tp:.3f} | {tf:.3f} | {tc:.3f} | {tf / tp:.2f} | {tc / tp:.2f} "
                  f"| {mp / MB:,.0f} | {mf / MB:,.0f} | {mc / MB:,.0f} | {mf / mp:.3f} | {mc / mp:.3f} "
                  f"| {cf / cp:.2f} | {cc / cp:.2f} |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
