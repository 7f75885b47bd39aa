"""`bin/verify-resume`: prove on your own config that a killed run resumes bit for bit.

Trains the config once straight through, then again while killing it with SIGKILL at random
moments — during steps and in the middle of checkpoint writes, at random byte offsets — and
rerunning the same command after each kill, as an operator would. The two final checkpoints
must agree exactly: weights and AdamW moments (nothing in training draws randomness, so there is no
RNG state to compare: the data order is a pure function of the seed). Both train with
`[general] deterministic = true` (a later `--set general.deterministic=false` turns it off).

`--kills N` performs exactly N kills, planned in run order: half inside saves (stratified over
every save of the run, each at a random byte before that save's commit), half inside steps
(stratified over the whole run, each as soon as the attempt reports the step before). A kill
whose moment the resumed run has already passed is moved to the next moment it still reaches.
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import torch

from nanoflow import console, io
from nanoflow.schedule import is_save_step

log = logging.getLogger(__name__)

TRAIN = str(Path(__file__).resolve().parents[2] / "bin" / "train")   # nanoflow/commands/ → the repository


def _train_command(config: str, overrides: list[str], run: Path) -> list[str]:
    """bin/train on `config` into `run`, deterministic: on a GPU the fastest kernels are not bit-reproducible
    from run to run, and a resumed run can only equal a straight one if each computes the same bits."""
    sets = [a for o in ["general.deterministic=true", *overrides] for a in ("--set", o)]
    return [sys.executable, TRAIN, config, *sets, "--set", f'checkpoints.checkpoints_path="{run}"']


def _save_bytes(run: Path) -> tuple[int, int]:
    """(bytes one save writes, of which before its commit), read off the straight run's final checkpoint:
    its tensor files and metadata (the commit), then latest.txt."""
    folder = Path(io.latest(str(run)))
    meta = io.read_metadata(str(folder))
    before_commit = sum(f["bytes"] for f in meta["files"].values()) + (folder / "checkpoint_metadata.json").stat().st_size
    return before_commit + len(f"{meta['step']}\n"), before_commit


def save_steps(interval: int, train_steps: int) -> list[int]:
    """The steps a run saves at (nanoflow.schedule.is_save_step): every interval, and the last."""
    return [step for step in range(1, train_steps + 1) if is_save_step(step, interval, train_steps)]


@attrs.frozen
class Kill:
    """A planned kill -9: during the save of step `step` after `offset` of its bytes ("save"), or while
    training the step after `step` ("step"), as soon as the run reports `step` done."""

    kind: str
    step: int
    offset: int = 0

    @property
    def position(self) -> float:
        return self.step + (0.5 if self.kind == "save" else 0.0)


def plan_kills(kills: int, saves: list[int], train_steps: int, save_bytes: int, rng: random.Random) -> list[Kill]:
    """`kills` kills in run order, half in saves (stratified over every save, at any byte before the commit),
    half in steps (stratified over the whole run), so a large count covers every save and every stretch."""
    margin = min(4096, save_bytes // 10)   # metadata sizes differ by a few bytes from save to save
    in_steps = kills // 2 if train_steps > 1 else 0
    in_saves = kills - in_steps
    shift = rng.randrange(max(1, len(saves) // max(in_saves, 1)))   # 0 when there are kills for every save
    plan = [Kill("save", saves[j * len(saves) // in_saves + shift], rng.randrange(save_bytes - margin))
            for j in range(in_saves)]
    plan += [Kill("step", 1 + int((j + rng.random()) * (train_steps - 1) / in_steps)) for j in range(in_steps)]
    return sorted(plan, key=lambda k: k.position)


def _aimed(kill: Kill, committed: int, saves: list[int], train_steps: int) -> Kill:
    """The kill moved to where the run, resumed after step `committed`, still goes: a step after it, or its
    next save (the same bytes into it)."""
    if kill.kind == "step" and committed < kill.step < train_steps:
        return kill
    if kill.kind == "step" and committed + 1 < train_steps:
        return Kill("step", committed + 1)
    ahead = [s for s in saves if s > committed]
    return kill if kill.kind == "save" and kill.step in ahead else Kill("save", ahead[0], kill.offset)


def _committed(run: Path) -> int:
    """The run's latest committed step (0 for none); the unfinished saves the kills leave are expected, not news."""
    with console.silenced("nanoflow.io.checkpoint"):
        folder = io.latest(str(run))
    return int(Path(folder).name) if folder else 0


STEP_LINE = re.compile(r"^step\s+(\d+)/\d+\s")


def first_difference(a: io.Checkpoint, b: io.Checkpoint) -> str | None:
    """The first tensor that differs between two checkpoints, or None if they are identical."""
    for group in ("model", "optimizer", *sorted(set(a.groups) | set(b.groups) - {"model", "optimizer"})):
        names = sorted(set(a.groups.get(group, {})) | set(b.groups.get(group, {})))
        for name in names:
            x, y = a.groups.get(group, {}).get(name), b.groups.get(group, {}).get(name)
            if x is None or y is None:
                return f"{group}/{name} is missing from the {'first' if x is None else 'second'} run"
            if x.shape != y.shape or not torch.equal(x, y):
                diff = (x.double() - y.double()).abs().max().item() if x.shape == y.shape else "shape"
                return f"{group}/{name} differs (max abs difference {diff})"
    if a.metadata["step"] != b.metadata["step"]:
        return f"the runs ended at steps {a.metadata['step']} and {b.metadata['step']}"
    return None


def verify_resume(config: str, overrides: list[str], workdir: Path, *, kills: int = 6, seed: int = 0) -> bool:
    from nanoflow.config import load_config

    settings = load_config(config, overrides)
    train_steps, saves = settings.tokens.train_steps, save_steps(settings.checkpoints.checkpoint_interval,
                                                                 settings.tokens.train_steps)
    rng = random.Random(seed)
    straight, interrupted = workdir / "straight", workdir / "interrupted"

    log.info(f"straight run → {straight} (its {train_steps} steps, then {kills} kill{'s' * (kills != 1)} and a "
             "resume after each; each attempt is said when it ends)")
    began = time.monotonic()
    done = subprocess.run(_train_command(config, overrides, straight) + ["--fresh"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        log.info(f"FAIL: the straight run failed:\n{done.stderr}")
        return False
    log.info(f"straight run: {train_steps} steps done in {time.monotonic() - began:.0f}s")
    per_save, before_commit = _save_bytes(straight)
    plan = plan_kills(kills, saves, train_steps, before_commit, rng)

    # Every step reported on its own line, so a kill "in step N" waits for this attempt's own report of N - 1.
    command = _train_command(config, overrides, interrupted) + ["--set", "logging.iteration_step_info_interval=1"]
    performed = 0
    for attempt, planned in enumerate([*plan, None], 1):
        committed = _committed(interrupted)
        env, how = dict(os.environ), "no kill"
        kill = None if planned is None else _aimed(planned, committed, saves, train_steps)
        if kill is not None and kill.kind == "save":
            offset = sum(per_save for s in saves if committed < s < kill.step) + kill.offset
            env["NANOFLOW_KILL_AFTER_BYTES"] = str(offset)
            how = f"kill -9 in the save of step {kill.step}, {kill.offset} bytes in"
        elif kill is not None:
            how = f"kill -9 in step {kill.step + 1}"
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = []
        assert process.stdout is not None   # stdout=PIPE
        for line in process.stdout:
            output.append(line)
            match = STEP_LINE.match(line)
            if kill is not None and kill.kind == "step" and match and int(match.group(1)) >= kill.step:
                process.send_signal(signal.SIGKILL)
                break
        output.append(process.communicate()[0] or "")
        log.info(f"attempt {attempt}: {how}: exit {process.returncode}; latest committed: step {_committed(interrupted)}")
        if process.returncode == -signal.SIGKILL:
            performed += 1
            continue
        if process.returncode != 0:
            log.info(f"FAIL: the run failed by itself:\n{''.join(output)}")
            return False
        if kill is not None:
            log.info(f"FAIL: the run finished before kill {performed + 1} of {kills} could land ({how})")
            return False
        break

    # Every group saved (the weight EMA too, with ema_decay), so a missing or different EMA fails.
    groups = tuple(io.read_metadata(str(straight))["tensors"])
    difference = first_difference(io.read_checkpoint(str(straight), groups),
                                  io.read_checkpoint(str(interrupted), tuple(io.read_metadata(str(interrupted))["tensors"])))
    if difference is None:
        log.info(f"PASS: after {performed} kills the resumed run ends bit-identical to the straight run "
                 "(weights and optimizer moments" + (", weight EMA" if "ema" in groups else "") + ")")
        return True
    log.info(f"FAIL: {difference}")
    return False
