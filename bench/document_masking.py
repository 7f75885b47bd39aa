"""Attention within documents (nanoflow.attention) against plain causal SDPA over the whole row, and against
SDPA with a boolean document mask (the obvious way), at several sequence lengths and document lengths.

    python bench/document_masking.py [--seq 1024,4096,8192] [--docs 100,500,4000] [--rounds 3] [--threads 1]

Each cell: q, k, v of 4 heads × 32 dims (float32) over `--tokens` positions (rows of `seq`), forward +
backward; the documents' lengths are drawn around the given mean (exponentially, seeded) and packed into
the rows the way windows cut a token stream, so a document may be cut by a row's edge. q, k and v reach the
kernel as the model hands them over: token-major views, made in the call (from leaves, by a product that
keeps nothing), held by nothing but the kernel and what autograd saves. The masked time
includes working out where the documents lie from position_ids (once per forward in the model, here once
per call). Rounds interleaved (the order reversed every other round) after one warm-up round; the median
time. Memory: in one process started with MALLOC_MMAP_THRESHOLD_ (freed tensors leave the resident set),
the resident set's peak reset before each call; peak − before, the least of the rounds. Ratios are to causal.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # this checkout's nanoflow, also without `pip install -e .`
from benchlib import load_average, machine_line, parse, status  # noqa: E402  (bench/benchlib.py)

MB = 1e6
HEADS, HEAD_DIM = 4, 32


def reset_peak() -> int:
    """Sets the peak resident set to the current one (Linux's clear_refs 5) and returns it."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def packed_position_ids(rows: int, seq: int, mean: int, seed: int = 0):
    """position_ids [rows, seq] of documents of about `mean` tokens packed one after another and cut into rows."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    total = rows * seq
    lengths = []
    while sum(lengths) < total:
        lengths.append(max(1, int(rng.exponential(mean))))
    starts = np.zeros(total, dtype=bool)
    starts[np.cumsum(lengths)[:-1][np.cumsum(lengths)[:-1] < total]] = True
    starts = starts.reshape(rows, seq)
    starts[:, 0] = True
    index = np.arange(seq)
    return torch.from_numpy(index - np.maximum.accumulate(np.where(starts, index, 0), axis=1))


def kernels():
    import torch
    import torch.nn.functional as F

    from nanoflow.attention import Documents, causal_attention

    def causal(q, k, v, position_ids):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def masked(q, k, v, position_ids):
        return causal_attention(q, k, v, Documents.from_position_ids(position_ids))

    def boolean(q, k, v, position_ids):
        starts = position_ids == 0
        starts[:, 0] = True
        document = starts.cumsum(1)
        seq = position_ids.shape[1]
        mask = (document[:, :, None] == document[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])

    return {"causal": causal, "masked": masked, "boolean mask": boolean}


def measure(seq: int, mean: int, args) -> dict:
    import torch

    rows = max(1, args.tokens // seq)
    position_ids = packed_position_ids(rows, seq, mean)
    generator = torch.Generator().manual_seed(0)
    leaves = [torch.randn(rows, seq, HEADS, HEAD_DIM, generator=generator).requires_grad_() for _ in range(3)]
    upstream = torch.randn(rows, HEADS, seq, HEAD_DIM, generator=generator)
    paths = kernels()
    times, peaks = {name: [] for name in paths}, {name: [] for name in paths}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name in (list(paths) if round_ % 2 else list(paths)[::-1]):
            for leaf in leaves:
                leaf.grad = None
            before = reset_peak()
            started = time.perf_counter()
            out = paths[name](*(leaf.transpose(1, 2) * 1.0 for leaf in leaves), position_ids)
            (out * upstream).sum().backward()
            del out
            elapsed = time.perf_counter() - started
            if round_:
                times[name].append(elapsed)
                peaks[name].append(status("VmHWM") - before)
    documents = int((position_ids == 0).sum()) + int((position_ids[:, 0] != 0).sum())
    return {"rows": rows, "documents": documents,
            **{name: (statistics.median(times[name]), min(peaks[name])) for name in paths}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", default="1024,4096,8192", help="sequence lengths")
    parser.add_argument("--docs", default="100,500,4000", help="mean document lengths")
    parser.add_argument("--tokens", type=int, default=8192, help="positions a call attends over (rows × seq)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parse(parser, seq="128,256", docs="16,64", tokens=512, rounds=1)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # freed tensors must leave the resident set
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        return subprocess.run([sys.executable, *sys.argv], env=env, check=False).returncode
    import torch

    torch.set_num_threads(args.threads)
    print(f"{machine_line()}; {load_average()} at the start")
    print(f"{HEADS} heads × {HEAD_DIM}, float32, forward + backward over {args.tokens:,} positions a call, "
          f"{args.rounds} rounds\n")
    print("| seq | docs ~ | rows | documents | causal s | masked s | masked / causal | boolean mask s "
          "| boolean / causal | causal MB | masked MB | boolean MB | masked / causal MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    worst = (0.0, 0.0)
    for seq in (int(s) for s in args.seq.split(",")):
        for mean in (int(d) for d in args.docs.split(",")):
            r = measure(seq, mean, args)
            (tc, mc), (tm, mm), (tb, mb) = r["causal"], r["masked"], r["boolean mask"]
            worst = (max(worst[0], tm / tc), max(worst[1], mm / max(mc, 1)))
            print(f"| {seq:,} | {mean:,} | {r['rows']} | {r['documents']} | {tc:.3f} | {tm:.3f} | {tm / tc:.2f} "
                  f"| {tb:.3f} | {tb / tc:.2f} | {mc / MB:,.1f} | {mm / MB:,.1f} | {mb / MB:,.1f} "
                  f"| {mm / max(mc, 1):.2f} |", flush=True)
    print(f"\nmasked / causal, the worst cell: time {worst[0]:.2f}×, peak memory {worst[1]:.2f}×")
    print(f"{load_average()} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
