"""What does a nanoflow checkpoint cost to write and read, next to torch.save / torch.load of the same tensors?

    python bench/checkpoint_io.py [--rounds N] [--threads T] [--dir DIR] [--hidden H --intermediate I --layers L]

The state: the curriculum's Llama (schedules/curriculum.toml) made bigger (by default 768 hidden,
2048 intermediate, 4 layers: about 28 M parameters), created with `nanoflow.init_state`, with AdamW
moments made by one optimizer step on random gradients, and turned into checkpoint blocks by
`nanoflow.parallel.shards.state_blocks` and `nanoflow.checkpoint.checkpointer.checkpoint_info` — exactly what the Checkpointer writes
(params + exp_avg + exp_avg_sq ≈ 340 MB).

Timed, interleaved in each round (the saves in each of their six orders in turn, the loads alternating,
so drift in the machine and what the disk was just given hit every side alike), on one local disk (`--dir`, default a fresh temporary folder under /tmp):

  save:  nanoflow.io.save_checkpoint (safetensors streamed from the tensors' memory, XXH3-128 of every
         header and shard, temporary file + fsync + rename, metadata, latest.txt) | torch.save of the same tensors as {group: {name: tensor}}
         | torch.save followed by flush + os.fsync (the fair comparison: nanoflow fsyncs every file)
  load:  nanoflow.io.read_checkpoint of the step folder (every file's size, every header and shard checksum checked)
         | torch.load(weights_only=True) of the torch.save file

Every timed operation starts after os.sync(), so no operation pays for the writeback of an earlier
one. Both loads read files that were just written (warm page cache: this measures CPU and memory
copies, not the disk). Where io.py's time goes is measured in the same runs: its real functions are
wrapped with timers (header and tensor views, checksum, write to the temporary file, fsync, rename;
read by byte ranges, checksum, tensor views, assembling boxes), which costs microseconds. Prints medians, ratios (targets: save ≤ 1.5×, load ≤ 1.2× torch's time) and Markdown
tables.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch  # noqa: E402
from benchlib import filesystem, load_average, parse, state_with_moments  # noqa: E402  (bench/benchlib.py; puts the repo on sys.path)

import nanoflow.io.checkpoint as checkpoint_module  # noqa: E402
import nanoflow.io.files as files_module  # noqa: E402
import nanoflow.io.marker as marker_module  # noqa: E402
import nanoflow.io.reader as reader_module  # noqa: E402
import nanoflow.io.store as store_module  # noqa: E402
import nanoflow.io.tensorfile as tensorfile_module  # noqa: E402
from nanoflow.checkpoint.checkpointer import checkpoint_info  # noqa: E402
from nanoflow.io import read_checkpoint, save_checkpoint  # noqa: E402
from nanoflow.parallel.shards import state_blocks  # noqa: E402

MB = 1e6


def build_state(hidden: int, intermediate: int, layers: int):
    config, state = state_with_moments(hidden, intermediate, layers)
    groups, info = state_blocks(state.model, state.optimizer, state.topology), checkpoint_info(state)
    tensors = {group: {name: block.data for name, block in blocks.items()} for group, blocks in groups.items()}
    return config, groups, info, tensors


def nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for group in tensors.values() for t in group.values())


def timed(fn) -> float:
    os.sync()  # every operation starts with no dirty pages waiting: earlier writes do not slow it down
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def torch_save(path: str, tensors: dict, fsync: bool) -> None:
    with open(path, "wb") as f:
        torch.save(tensors, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# Breakdown: io.py's own functions wrapped with timers (module attributes swapped back afterwards)

class Timers:
    def __init__(self):
        self.seconds = collections.defaultdict(float)
        self.active = None   # the phase being timed, so nested calls are not counted twice

    def wrap(self, name: str, fn):
        timers = self

        def timed_call(*args, **kwargs):
            if timers.active is not None:
                return fn(*args, **kwargs)
            timers.active = name
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.seconds[name] += time.perf_counter() - start
                timers.active = None

        return timed_call


@contextlib.contextmanager
def patched(obj, name: str, value):
    original = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, original)


class TimedChecksum:
    """new_checksum()'s object with its update() timed under the "checksum" phase."""

    def __init__(self, timers, inner):
        self.timers, self.inner = timers, inner

    def update(self, data):
        start = time.perf_counter()
        self.inner.update(data)
        self.timers.seconds["checksum (xxh3-128)"] += time.perf_counter() - start

    def hexdigest(self):
        return self.inner.hexdigest()


def save_breakdown(root: str, step: int, groups: dict, info: dict) -> dict[str, float]:
    """save_checkpoint with its parts timed: header + tensor views, checksum, write, fsync, rename."""
    t = Timers()
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(checkpoint_module, "tensor_chunks",
                                    t.wrap("header + tensor views", checkpoint_module.tensor_chunks)))
        stack.enter_context(patched(marker_module, "new_checksum",
                                    lambda: TimedChecksum(t, tensorfile_module.new_checksum())))
        stack.enter_context(patched(files_module, "_write_chunks", t.wrap("write", files_module._write_chunks)))
        stack.enter_context(patched(os, "fsync", t.wrap("fsync", os.fsync)))
        stack.enter_context(patched(os, "replace", t.wrap("rename", os.replace)))
        total = timed(lambda: save_checkpoint(root, step, groups, info))
    parts = dict(t.seconds)
    parts["other (metadata JSON, listing, retention)"] = total - sum(parts.values())
    parts["total"] = total
    return parts


def load_breakdown(folder: str) -> dict[str, float]:
    """read_checkpoint with its parts timed: read (byte ranges), checksum, tensor views, assemble (boxes)."""
    t = Timers()
    reader_read = reader_module.CheckpointReader.read
    inner = collections.defaultdict(float)

    def read_box(self, *args, **kwargs):  # CheckpointReader.read, less the file loads it triggers
        before = sum(t.seconds.values())
        start = time.perf_counter()
        result = reader_read(self, *args, **kwargs)
        inner["assemble"] += time.perf_counter() - start - (sum(t.seconds.values()) - before)
        return result

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(store_module.Store, "read_range",
                                    t.wrap("read (byte ranges)", store_module.Store.read_range)))
        stack.enter_context(patched(marker_module, "new_checksum",
                                    lambda: TimedChecksum(t, tensorfile_module.new_checksum())))
        stack.enter_context(patched(reader_module, "tensor_at", t.wrap("tensor views", reader_module.tensor_at)))
        stack.enter_context(patched(reader_module.CheckpointReader, "read", read_box))
        total = timed(lambda: read_checkpoint(folder))
    parts = dict(t.seconds)
    parts["assemble (boxes)"] = inner["assemble"]
    parts["other (metadata, listing, size checks)"] = total - sum(parts.values())
    parts["total"] = total
    return parts


# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:  # noqa: C901 - a benchmark's options, rounds and report, read top to bottom
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="rounds after the warm-up (a multiple of 6 balances "
                        "the saves' orders)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--dir", default="/tmp", help="where the files are written (a fresh folder inside it)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    args = parse(parser, argv, rounds=1, hidden=64, intermediate=128, layers=1)
    if args.threads:
        torch.set_num_threads(args.threads)

    started = time.perf_counter()
    config, groups, info, tensors = build_state(args.hidden, args.intermediate, args.layers)
    size = nbytes(tensors)
    step = info["training"]["completed"]   # the step the state has trained (the checkpoint's name)
    params = sum(p.numel() for p in tensors["model"].values())
    work = tempfile.mkdtemp(prefix="nanoflow-bench-io-", dir=args.dir)
    print(f"state: {params / 1e6:.1f} M parameters, {len(tensors['optimizer'])} optimizer tensors, "
          f"{size / MB:.0f} MB in all; files in {work}", flush=True)

    times = collections.defaultdict(list)
    save_parts, load_parts = collections.defaultdict(list), collections.defaultdict(list)
    checked = False
    try:
        for round_ in range(args.rounds + 1):  # round 0 warms up and is not counted
            root = os.path.join(work, f"nanoflow-{round_}")
            torch_file, torch_fsync_file = (os.path.join(work, f"torch-{round_}{s}.pt") for s in ("", "-fsync"))
            parts = {}  # the nanoflow sides run instrumented: their totals are the timings, their parts the breakdown
            # Each lambda runs in this round, before the names it reads are rebound: the defaults say so.
            saves = [("nanoflow save", lambda parts=parts, root=root: parts.update(save=save_breakdown(root, step, groups, info))),
                     ("torch.save", lambda f=torch_file: torch_save(f, tensors, fsync=False)),
                     ("torch.save + fsync", lambda f=torch_fsync_file: torch_save(f, tensors, fsync=True))]
            loads = [("nanoflow load", lambda parts=parts, root=root: parts.update(load=load_breakdown(os.path.join(root, str(step))))),
                     ("torch.load", lambda f=torch_file: torch.load(f, weights_only=True))]
            # Every order of the three saves, in turn (each save first, second and third as often, after each of
            # the others as often: a write's cost depends on what the disk and the page cache were just given);
            # the two loads alternate.
            shift = round_ % 3
            saves = saves[shift:] + saves[:shift]
            if (round_ // 3) % 2:
                saves.reverse()
            if round_ % 2:
                loads.reverse()
            for name, fn in saves + loads:
                seconds = timed(fn)
                if round_:
                    times[name].append(seconds)
            if round_:
                times["nanoflow save"][-1], times["nanoflow load"][-1] = parts["save"]["total"], parts["load"]["total"]
                for part, seconds in parts["save"].items():
                    save_parts[part].append(seconds)
                for part, seconds in parts["load"].items():
                    load_parts[part].append(seconds)
            if not checked:  # both sides really hold the same tensors
                loaded, ours = torch.load(torch_file, weights_only=True), read_checkpoint(os.path.join(root, str(step)))
                for group in tensors:
                    for name, tensor in tensors[group].items():
                        assert torch.equal(loaded[group][name], tensor) and torch.equal(ours.groups[group][name], tensor)
                checked = True
            shutil.rmtree(root)
            for path in (torch_file, torch_fsync_file):
                os.remove(path)
            done = ", ".join(f"{name} {times[name][-1]:.2f}s" for name in times) if round_ else "warm-up"
            print(f"round {round_}: {done}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    median = {name: statistics.median(values) for name, values in times.items()}
    spread = {name: (min(values), max(values)) for name, values in times.items()}
    ratio_save = median["nanoflow save"] / median["torch.save"]
    ratio_save_fsync = median["nanoflow save"] / median["torch.save + fsync"]
    ratio_load = median["nanoflow load"] / median["torch.load"]
    paired = {pair: statistics.median(a / b for a, b in zip(times[pair[0]], times[pair[1]], strict=True))
              for pair in (("nanoflow save", "torch.save"), ("nanoflow save", "torch.save + fsync"),
                           ("nanoflow load", "torch.load"))}
    print()
    print(f"- date: {datetime.date.today().isoformat()}")
    print(f"- machine: {os.cpu_count()} CPU cores ({platform.machine()}), {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}, Python {platform.python_version()}")
    print(f"- state: {params / 1e6:.1f} M parameters (hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{args.layers} layers); model + exp_avg + exp_avg_sq + steps + RNG = {size / MB:.0f} MB")
    print(f"- files: {args.dir} ({filesystem(args.dir)}); {args.rounds} rounds after a warm-up round; "
          f"{time.perf_counter() - started:.0f} s in all; {load_average()} at the end")
    print()
    print("| operation | median s | min–max s | MB/s | nanoflow / torch |")
    print("|---|---:|---:|---:|---:|")
    rows = [("nanoflow save", None), ("torch.save", None), ("torch.save + fsync", None),
            ("nanoflow load", None), ("torch.load", None)]
    for name, _ in rows:
        lo, hi = spread[name]
        if name == "nanoflow save":
            versus = f"{ratio_save:.2f} (vs torch.save), {ratio_save_fsync:.2f} (vs + fsync)"
        elif name == "nanoflow load":
            versus = f"{ratio_load:.2f}"
        else:
            versus = ""
        print(f"| {name} | {median[name]:.3f} | {lo:.3f}–{hi:.3f} | {size / MB / median[name]:,.0f} | {versus} |")
    print()
    for title, parts in (("save_checkpoint", save_parts), ("read_checkpoint", load_parts)):
        total = statistics.median(parts["total"])
        print(f"| {title} part | median s | share |")
        print("|---|---:|---:|")
        for part, values in parts.items():
            value = statistics.median(values)
            print(f"| {part} | {value:.3f} | {value / total:.0%} |")
        print()
    print("median of each round's own ratio: " + ", ".join(f"{a} / {b} {r:.2f}" for (a, b), r in paired.items()))
    print(f"targets: save ≤ 1.5× torch.save: {ratio_save:.2f} {'ok' if ratio_save <= 1.5 else 'MISSED'}; "
          f"load ≤ 1.2× torch.load: {ratio_load:.2f} {'ok' if ratio_load <= 1.2 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
