"""How close a resume on another parallel layout comes to the run trained straight.

    python bench/layouts.py [--steps 4]

schedules/tiny.toml (the SFT stage out of reach, global batch 8) is trained straight on one process and at
dp=2 × tp=2 under torchrun (gloo, one thread a process), saving after step 2. dp=2 × tp=2's step-2 checkpoint is
then resumed on dp=1, dp=2, tp=2 and again on dp=2 × tp=2. Printed per resumed layout: the largest difference of
any weight, of any AdamW moment, and of any step's loss from the straight one-process run, and from the straight
run on the layout it resumed on (0 there: a resume on its own layout is bit for bit). The checkpoint itself reads
back exactly on any layout (tests/e2e/test_parallel.py); what differs is the order in which each layout adds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchlib import REPO, load_average, machine_line, parse

CONFIG = os.path.join(REPO, "schedules", "tiny.toml")
LAYOUTS = {"dp1": (1, 1), "dp2": (2, 1), "tp2": (1, 2), "dp2tp2": (2, 2)}


def train(layout: str, folder: str, steps: int, *extra: str) -> None:
    dp, tp = LAYOUTS[layout]
    overrides = [f"tokens.train_steps={steps}", "data_stages.sft.start_training_step=100", "tokens.micro_batch_size=2",
                 "tokens.global_batch_size=8", "data_stages.sft.micro_batch_size=2", "checkpoints.checkpoint_interval=2",
                 "optimizer.optimizer_factory.adam_eps=1e-6", f"parallelism.dp={dp}", f"parallelism.tp={tp}",
                 f"checkpoints.checkpoints_path={json.dumps(folder)}", *extra]
    launcher = [sys.executable] if dp * tp == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                     "--nproc_per_node", str(dp * tp)]
    command = [*launcher, os.path.join(REPO, "bin", "train"), CONFIG, *[a for o in overrides for a in ("--set", o)]]
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{layout} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


def losses(folder: str) -> dict[int, float]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return {row["step"]: row["loss"] for row in map(json.loads, f)}


def largest(a: dict, b: dict) -> float:
    return max((x.double() - b[name].double()).abs().max().item() for name, x in a.items())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps of each run (the resume is after step 2)")
    args = parse(parser, argv, steps=4)
    layouts, source = (("dp1", "dp2"), "dp2") if args.smoke else (tuple(LAYOUTS), "dp2tp2")   # --smoke: 2 processes
    from nanoflow import io  # after benchlib, which puts this checkout first on sys.path
    print(f"# {machine_line()}; {load_average()}")
    with tempfile.TemporaryDirectory(prefix="bench-layouts-") as work:
        straight = {}
        for layout in layouts:
            straight[layout] = os.path.join(work, f"straight-{layout}")
            train(layout, straight[layout], args.steps)
        start = os.path.join(straight[source], "2")
        reference = io.read_checkpoint(straight["dp1"])
        print(f"# tiny.toml, {args.steps} steps, {source}'s step 2 resumed on each layout; max |Δ| from the "
              "straight run on one process, and from the straight run on the same layout")
        for layout in layouts:
            folder = os.path.join(work, f"resumed-{layout}")
            train(layout, folder, args.steps, f"checkpoints.resume_checkpoint_path={json.dumps(start)}")
            resumed, own = io.read_checkpoint(folder), io.read_checkpoint(straight[layout])
            steps = [s for s in losses(folder) if s > 2]
            loss = max(abs(losses(folder)[s] - losses(straight["dp1"])[s]) for s in steps)
            print(f"resumed on {layout}: weights {largest(resumed.groups['model'], reference.groups['model']):.2e}, "
                  f"moments {largest(resumed.groups['optimizer'], reference.groups['optimizer']):.2e}, "
                  f"loss {loss:.2e} from one process's run; weights "
                  f"{largest(resumed.groups['model'], own.groups['model']):.2e} from {layout}'s own", flush=True)


if __name__ == "__main__":
    main()
