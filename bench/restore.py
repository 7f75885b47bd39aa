"""What does a user wait for to restore weights + AdamW moments, next to torch.load + load_state_dict?

    python bench/restore.py [--rounds N] [--hidden H --intermediate I --layers L] [--dir DIR] [--threads T]
                            [--cold] [--one-process]

The state: the curriculum's Llama (schedules/curriculum.toml) at the size asked (default 768 hidden,
2048 intermediate, 7 layers: 49.8 M parameters; `--hidden 1024 --intermediate 2816 --layers 12` gives
154.5 M), made by `nanoflow.init_state`, its AdamW moments made by one step on random gradients. It is
saved twice: as a nanoflow checkpoint (`state_blocks` + `save_checkpoint`, as the Checkpointer saves)
and with torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}).

Timed, in the same process, interleaved round by round (the order flips every round; an even number of
rounds gives both orders alike), each from nothing to a model and optimizer ready to step:

  nanoflow:  what Checkpointer._read_state does — `build_model(init=False)` (meta device, then empty
             memory), `load_weights`, `build_optimizer`, `load_moments` from a CheckpointReader of the
             step folder (every header and shard checked against its XXH3-128).
  torch:     the same `build_model(init=False)` and `build_optimizer`, then torch.load(weights_only=True),
             model.load_state_dict, optimizer.load_state_dict (no checksum).

Each restore runs in a process of its own (imports done, then the one restore timed), as a resuming
run does: both sides take every page of their tensors fresh from the kernel. With --one-process, all
restores run in this process: each side's state is checked against a reference restore (held
throughout, untimed) and freed before the other side's restore starts (holding it would make whichever
side runs second take fresh pages from the kernel while the first reuses freed memory: an order effect
of its own, which the flipped order only halves); even so, how much freed memory the allocator hands
back to a restore varies from round to round, and the figures with it.
Page cache: warm by default (files just written, both read from memory); with --cold, each side's
files are fsynced and dropped from the page cache (posix_fadvise DONTNEED) before each of its
restores, so both read from the disk.

Not timed on the nanoflow side: the Checkpointer's choice of checkpoint and its metadata checks
(milliseconds; see bench/resume.py). Prints each round's wall and CPU seconds (getrusage: user + system,
all threads) and minor page faults, the medians, the ratio of medians and the median of the paired
per-round ratios (target ≤ 1.3), and the load average before and after.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch  # noqa: E402
from benchlib import curriculum_at, load_average, machine_line, parse, state_with_moments  # noqa: E402  (bench/benchlib.py; puts the repo on sys.path)

from nanoflow.build import build_model, build_optimizer  # noqa: E402
from nanoflow.checkpoint.checkpointer import checkpoint_info  # noqa: E402
from nanoflow.io import CheckpointReader, save_checkpoint  # noqa: E402
from nanoflow.parallel.shards import load_moments, load_weights, state_blocks  # noqa: E402

SIDES = ("nanoflow", "torch")


def nanoflow_restore(config, folder: str):
    reader = CheckpointReader(folder)
    model = build_model(config, init=False)
    load_weights(model, reader, folder)
    optimizer = build_optimizer(model, config.optimizer)
    load_moments(model, optimizer, reader)
    return model, optimizer


def torch_restore(config, path: str):
    model = build_model(config, init=False)
    optimizer = build_optimizer(model, config.optimizer)
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    return model, optimizer


def same(a, b) -> bool:
    (model_a, opt_a), (model_b, opt_b) = a, b
    weights = all(torch.equal(x, y) for x, y in zip(model_a.state_dict().values(), model_b.state_dict().values(), strict=True))
    moments = all(torch.equal(opt_a.state[p][k], opt_b.state[q][k])
                  for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True) for k in ("exp_avg", "exp_avg_sq"))
    return weights and moments


def drop_from_page_cache(paths: list[str]) -> None:
    """Written back and evicted, so that the next read of these files comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(restore):
    """(restored state, wall s, CPU s of the process's threads, minor page faults) of one restore."""
    gc.collect()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    restored = restore()
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return restored, wall, cpu, after.ru_minflt - before.ru_minflt


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def in_a_fresh_process(args, name: str, path: str) -> tuple[float, float, int]:
    """(wall s, CPU s, minor faults) of one restore, the first in a process of its own."""
    command = [sys.executable, os.path.abspath(__file__), "--child", name, path, "--hidden", str(args.hidden),
               "--intermediate", str(args.intermediate), "--layers", str(args.layers)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the {name} restore in its own process failed:\n{done.stderr[-3000:]}")
    measured = json.loads(done.stdout.splitlines()[-1])
    return measured["wall"], measured["cpu"], measured["faults"]


def child(args) -> int:
    name, path = args.child
    config = curriculum_at(args.hidden, args.intermediate, args.layers)
    restore = nanoflow_restore if name == "nanoflow" else torch_restore
    _, wall, cpu, faults = timed(lambda: restore(config, path))
    print(json.dumps({"wall": wall, "cpu": cpu, "faults": faults}))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--dir", default="/tmp", help="where the files are written (a fresh folder inside it)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--cold", action="store_true", help="drop each side's files from the page cache before it reads")
    parser.add_argument("--one-process", action="store_true", help="every restore in this process (faster, "
                        "but the allocator's leftovers make the figures vary)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # (side, path): one restore in its own process
    args = parse(parser, argv, rounds=2, hidden=64, intermediate=128, layers=1)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        return child(args)
    load_before = load_average()
    config, state = state_with_moments(args.hidden, args.intermediate, args.layers)
    params = sum(p.numel() for p in state.model.parameters())
    work = tempfile.mkdtemp(prefix="nanoflow-bench-restore-", dir=args.dir)
    try:
        step = state.step
        save_checkpoint(work, step, state_blocks(state.model, state.optimizer, state.topology), checkpoint_info(state))
        folder, torch_file = os.path.join(work, str(step)), os.path.join(work, "state.pt")
        torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()}, torch_file)
        size = os.path.getsize(torch_file)
        del state
        paths = {"nanoflow": folder, "torch": torch_file}
        files = {"nanoflow": [os.path.join(where, name) for where, _, names in os.walk(folder) for name in names],
                 "torch": [torch_file]}
        restores = {"nanoflow": nanoflow_restore, "torch": torch_restore}
        reference = restores["nanoflow"](config, folder)
        assert same(reference, restores["torch"](config, torch_file)), "the two restores differ"
        if not args.one_process:
            del reference  # the children's restores run the same functions, checked equal here

        def measure(name: str) -> tuple[float, float, int]:
            if not args.one_process:
                return in_a_fresh_process(args, name, paths[name])
            restored, wall, cpu, faulted = timed(lambda: restores[name](config, paths[name]))
            assert same(restored, reference), f"{name}'s restore differs from the saved state"
            return wall, cpu, faulted  # `restored` freed before the other side's restore: see the docstring

        cache = "cold: each side's files dropped from the page cache before it reads" if args.cold \
            else "warm: files just written"
        where = "one process" if args.one_process else "each restore in a fresh process"
        print(f"state: {params / 1e6:.1f} M parameters, torch file {size / 1e6:.0f} MB; files in {work}; "
              f"page cache {cache}; {where}", flush=True)
        walls, cpus, faults = ({name: [] for name in SIDES} for _ in range(3))
        for round_ in range(args.rounds + 1):  # round 0 warms up and is not counted
            for name in (SIDES if round_ % 2 else SIDES[::-1]):
                if args.cold:
                    drop_from_page_cache(files[name])
                wall, cpu, faulted = measure(name)
                if round_:
                    walls[name].append(wall)
                    cpus[name].append(cpu)
                    faults[name].append(faulted)
            if round_:
                first = "nanoflow" if round_ % 2 else "torch"
                print(f"round {round_} ({first} first): " + ", ".join(
                    f"{n} {walls[n][-1]:.3f} s ({cpus[n][-1]:.3f} CPU s, {faults[n][-1]:,} faults)" for n in SIDES)
                    + f"; nanoflow / torch {walls['nanoflow'][-1] / walls['torch'][-1]:.2f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall_ratio = statistics.median(walls["nanoflow"]) / statistics.median(walls["torch"])
    paired = statistics.median(n / t for n, t in zip(walls["nanoflow"], walls["torch"], strict=True))
    cpu_ratio = statistics.median(cpus["nanoflow"]) / statistics.median(cpus["torch"])
    cpu_paired = statistics.median(n / t for n, t in zip(cpus["nanoflow"], cpus["torch"], strict=True))
    print()
    print(f"- date: {machine_line()}")
    print(f"- state: {params / 1e6:.1f} M parameters (hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{args.layers} layers), weights + exp_avg + exp_avg_sq; {args.rounds} rounds after a warm-up; "
          f"page cache {'cold' if args.cold else 'warm'}; {where}")
    print(f"- {load_before} before, {load_average()} after")
    print()
    print("| full restore (model + optimizer built, state read) | wall s, median (min–max) | CPU s, median (min–max) "
          "| minor faults, median |")
    print("|---|---:|---:|---:|")
    for name, label in (("nanoflow", "nanoflow (build_model, load_weights, build_optimizer, load_moments)"),
                        ("torch", "torch.load + load_state_dict (model and optimizer)")):
        print(f"| {label} | {spread(walls[name])} | {spread(cpus[name])} | {statistics.median(faults[name]):,.0f} |")
    print()
    print(f"nanoflow / torch: {paired:.2f} median of paired rounds, {wall_ratio:.2f} by medians; CPU s: "
          f"{cpu_paired:.2f} paired, {cpu_ratio:.2f} by medians (target ≤ 1.3: {'ok' if paired <= 1.3 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
