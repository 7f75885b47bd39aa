"""`bin/verify-resume`: prove on your own config that a killed run resumes bit for bit.

Trains the config once straight through, then again while killing it with SIGKILL at random
moments — during steps and in the middle of checkpoint writes, at random byte offsets — and
rerunning the same command after each kill, as an operator would. The two final checkpoints
must agree exactly: weights, AdamW moments and RNG state.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from nanoflow import io

TRAIN = str(Path(__file__).resolve().parent.parent / "bin" / "train")


def _train_command(config: str, overrides: list[str], run: Path) -> list[str]:
    sets = [a for o in overrides for a in ("--set", o)]
    return [sys.executable, TRAIN, config, *sets, "--set", f'checkpoints.checkpoints_path="{run}"']


def _checkpoint_bytes(run: Path) -> int:
    """Bytes one save writes, read off the straight run's final checkpoint metadata."""
    meta = io.read_metadata(str(run))
    return sum(f["bytes"] for f in meta["files"].values()) + len(str(meta))


def first_difference(a: io.Checkpoint, b: io.Checkpoint) -> str | None:
    """The first tensor that differs between two checkpoints, or None if they are identical."""
    for group in ("model", "optimizer", "rng"):
        names = sorted(set(a.groups[group]) | set(b.groups[group]))
        for name in names:
            x, y = a.groups[group].get(name), b.groups[group].get(name)
            if x is None or y is None:
                return f"{group}/{name} is missing from the {'first' if x is None else 'second'} run"
            if x.shape != y.shape or not torch.equal(x, y):
                diff = (x.double() - y.double()).abs().max().item() if x.shape == y.shape else "shape"
                return f"{group}/{name} differs (max abs difference {diff})"
    if a.metadata["step"] != b.metadata["step"]:
        return f"the runs ended at steps {a.metadata['step']} and {b.metadata['step']}"
    return None


def verify_resume(config: str, overrides: list[str], workdir: Path, *, kills: int = 6, seed: int = 0,
                  log=print) -> bool:
    rng = random.Random(seed)
    straight, interrupted = workdir / "straight", workdir / "interrupted"
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    log(f"straight run → {straight}")
    started = time.perf_counter()
    done = subprocess.run(_train_command(config, overrides, straight) + ["--fresh"], **quiet)
    duration = time.perf_counter() - started
    if done.returncode != 0:
        log(f"FAIL: the straight run failed:\n{done.stderr}")
        return False
    save_bytes = _checkpoint_bytes(straight)

    command = _train_command(config, overrides, interrupted)
    attempt = 0
    while True:
        attempt += 1
        env, kill_delay, how = dict(os.environ), None, "no kill"
        if attempt <= kills and attempt % 2:
            offset = rng.randrange(save_bytes * 2)
            env["NANOFLOW_KILL_AFTER_BYTES"] = str(offset)
            how = f"kill -9 after {offset} checkpoint bytes"
        elif attempt <= kills:
            kill_delay = rng.uniform(0.2, duration)
            how = f"kill -9 after {kill_delay:.2f}s"
        process = subprocess.Popen(command, env=env, **quiet)
        if kill_delay is not None:
            try:
                process.wait(timeout=kill_delay)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGKILL)
        _, stderr = process.communicate()
        resumed = io.latest(str(interrupted))
        log(f"attempt {attempt}: {how}: exit {process.returncode}; latest committed: {resumed or 'none'}")
        if process.returncode == 0:
            break
        if process.returncode != -signal.SIGKILL:
            log(f"FAIL: the run failed by itself:\n{stderr}")
            return False
        if attempt > kills + 3:
            log("FAIL: the interrupted run does not complete")
            return False

    difference = first_difference(io.read_checkpoint(str(straight)), io.read_checkpoint(str(interrupted)))
    if difference is None:
        log(f"PASS: after {attempt - 1} kills the resumed run ends bit-identical to the straight run "
            "(weights, optimizer moments, RNG)")
        return True
    log(f"FAIL: {difference}")
    return False
