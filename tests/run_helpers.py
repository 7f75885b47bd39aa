"""Comparing runs by what they committed: every tensor of a checkpoint or a state, every file of a folder, the metrics."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from nanoflow.parallel.shards import state_blocks


def checkpoint_tensors(step_folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a committed step folder, by group and name (file names may differ between saves)."""
    tensors = {}
    for file in sorted(Path(step_folder).rglob("*.safetensors")):
        group = file.relative_to(step_folder).parts[0]
        for name, tensor in load_file(file).items():
            tensors[f"{group}/{file.name}/{name}"] = tensor
    return tensors


def assert_same_checkpoint(a: Path, b: Path) -> None:
    x, y = checkpoint_tensors(a), checkpoint_tensors(b)
    assert x and sorted(x) == sorted(y), (sorted(x), sorted(y))
    for name in x:
        assert torch.equal(x[name], y[name]), f"{name} differs between {a} and {b}"


def metrics(run: Path) -> dict[int, dict]:
    """metrics.jsonl by step (the last line of a step wins, as the file is kept)."""
    return {m["step"]: m for m in map(json.loads, (Path(run) / "metrics.jsonl").read_text().splitlines())}


def folder_digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too) and the SHA-256 of its bytes."""
    return {os.fspath(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def groups_of(state) -> dict[str, dict[str, torch.Tensor]]:
    """A copy of every tensor of a state, by checkpoint group (model, optimizer) and name."""
    groups = state_blocks(state.model, state.optimizer, state.topology)  # one process: every block is whole
    return {g: {name: b.data.detach().clone() for name, b in blocks.items()} for g, blocks in groups.items()}


def assert_same(got: dict, want: dict, groups=("model", "optimizer")) -> None:
    """torch.equal on every parameter and every AdamW moment (exp_avg, exp_avg_sq, step)."""
    for group in groups:
        assert got[group].keys() == want[group].keys(), group
        differ = [name for name, t in want[group].items()
                  if got[group][name].dtype != t.dtype or not torch.equal(got[group][name], t)]
        assert not differ, f"{group}: {len(differ)} tensors differ, e.g. {differ[:4]}"


def assert_same_training_state(a, b) -> None:
    """Two TrainStates hold the same weights and buffers, the same AdamW state (every entry: moments and step
    counts; torch.equal) and the same position."""
    x, y = a.model.state_dict(), b.model.state_dict()
    assert list(x) == list(y), "the models' tensors differ in names"
    for name in x:
        assert torch.equal(x[name], y[name]), name
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert a.optimizer.state[p].keys() == b.optimizer.state[q].keys(), name
        for key, value in a.optimizer.state[p].items():
            assert torch.equal(value, b.optimizer.state[q][key]), f"{key} of {name}"
    assert (a.step, a.consumed_samples, a.lr_origin) == (b.step, b.consumed_samples, b.lr_origin)
