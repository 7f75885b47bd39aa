"""What does a user wait for to restore weights + AdamW moments, next to torch.load + load_state_dict?

    python bench/restore.py [--rounds N] [--hidden H --intermediate I --layers L] [--dir DIR] [--threads T]

The state: the curriculum's Llama (schedules/curriculum.toml) at the size asked (default 768 hidden,
2048 intermediate, 7 layers: 49.6 M parameters; `--hidden 1024 --intermediate 2816 --layers 12` gives
154 M), made by `nanoflow.init_state`, its AdamW moments made by one step on random gradients. It is
saved twice: as a nanoflow checkpoint (`state_blocks` + `save_checkpoint`, as the Checkpointer saves)
and with torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}).

Timed, in the same process, interleaved round by round (the order flips every round), each from
nothing to a model and optimizer ready to step:

  nanoflow:  what Checkpointer._read_state does — `build_model(init=False)` (meta device, then empty
             memory), `load_weights`, `build_optimizer`, `load_moments` from a CheckpointReader of the
             step folder (every header and shard checked against its XXH3-128).
  torch:     the same `build_model(init=False)` and `build_optimizer`, then torch.load(weights_only=True),
             model.load_state_dict, optimizer.load_state_dict (no checksum).

Both read files just written (warm page cache: CPU and memory copies, not the disk). Not timed on the
nanoflow side: the Checkpointer's choice of checkpoint and its metadata checks (milliseconds; see
bench/resume.py). Prints medians, the ratio (target ≤ 1.3) and the load average before and after.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch  # noqa: E402
from benchlib import load_average, machine_line, parse, state_with_moments  # noqa: E402  (bench/benchlib.py; puts the repo on sys.path)

from nanoflow.build import build_model, build_optimizer  # noqa: E402
from nanoflow.checkpoint.checkpointer import checkpoint_info  # noqa: E402
from nanoflow.io import CheckpointReader, save_checkpoint  # noqa: E402
from nanoflow.parallel.shards import load_moments, load_weights, state_blocks  # noqa: E402


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--dir", default="/tmp", help="where the files are written (a fresh folder inside it)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parse(parser, argv, rounds=1, hidden=64, intermediate=128, layers=1)
    if args.threads:
        torch.set_num_threads(args.threads)
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
        sides = [("nanoflow", lambda: nanoflow_restore(config, folder)), ("torch", lambda: torch_restore(config, torch_file))]
        assert same(sides[0][1](), sides[1][1]()), "the two restores differ"
        print(f"state: {params / 1e6:.1f} M parameters, torch file {size / 1e6:.0f} MB; files in {work}", flush=True)
        times, results = {name: [] for name, _ in sides}, {}
        for round_ in range(args.rounds + 1):  # round 0 warms up and is not counted
            for name, fn in (sides if round_ % 2 else sides[::-1]):
                gc.collect()
                start = time.perf_counter()
                results[name] = fn()
                seconds = time.perf_counter() - start
                if round_:
                    times[name].append(seconds)
            if round_ == args.rounds:  # the timed restores, too, hold the saved state
                assert same(results["nanoflow"], results["torch"]), "the two restores differ"
            results.clear()
            if round_:
                print(f"round {round_}: " + ", ".join(f"{n} {t[-1]:.3f}s" for n, t in times.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    ratio = median["nanoflow"] / median["torch"]
    print()
    print(f"- date: {machine_line()}")
    print(f"- state: {params / 1e6:.1f} M parameters (hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{args.layers} layers), weights + exp_avg + exp_avg_sq; {args.rounds} rounds after a warm-up")
    print(f"- {load_before} before, {load_average()} after")
    print()
    print("| full restore (model + optimizer built, state read) | median s | min–max s |")
    print("|---|---:|---:|")
    for name, label in (("nanoflow", "nanoflow (build_model, load_weights, build_optimizer, load_moments)"),
                        ("torch", "torch.load + load_state_dict (model and optimizer)")):
        print(f"| {label} | {median[name]:.3f} | {min(times[name]):.3f}–{max(times[name]):.3f} |")
    print()
    print(f"nanoflow / torch: {ratio:.2f} (target ≤ 1.3: {'ok' if ratio <= 1.3 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
