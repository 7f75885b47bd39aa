"""What test_average.py and its process-level tests share."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import quiet, tiny
from safetensors.torch import load_file

from nanoflow import io
from nanoflow.training.loop import train

# Pretrain only (the SFT stage out of reach), a checkpoint every 2 steps: steps 2, 4, 6, 8.
STAGES = ["tokens.train_steps=8", "data_stages.sft.start_training_step=100", "checkpoints.checkpoint_interval=2"]


def averaged_run(run: Path) -> Path:
    """Pretrain only, 8 steps, committed at 2, 4, 6 and 8: what the averaging tests average."""
    assert train(tiny(run, *STAGES), out=quiet(), fresh=True).step == 8
    return run


def mean_from_files(step_folders: list[Path], weights: list[float] | None = None) -> dict[str, torch.Tensor]:
    """The expected mean, from the checkpoints' own safetensors files: each tensor assembled from the
    shards the metadata lists (whatever the layout), then averaged in fp64."""
    weights = weights or [1.0] * len(step_folders)
    total = {}
    for folder, weight in zip(step_folders, weights, strict=True):
        meta = json.loads((folder / "checkpoint_metadata.json").read_text())
        files = {}
        for name, entry in meta["tensors"]["model"].items():
            whole = torch.zeros(entry["shape"], dtype=torch.float64)
            for shard in entry["shards"]:
                if shard["file"] not in files:
                    files[shard["file"]] = load_file(folder / shard["file"])
                box = tuple(slice(o, o + n) for o, n in zip(shard["offset"], shard["shape"], strict=True))
                whole[box] = files[shard["file"]][shard["key"]].double()
            total[name] = total.get(name, 0) + weight * whole
    return {name: (t / sum(weights)).float() for name, t in total.items()}


def assert_mean(out: Path | str, expected: dict[str, torch.Tensor]) -> None:
    averaged = io.read_model(str(out))
    assert averaged.keys() == expected.keys()
    for name in expected:
        assert averaged[name].dtype == torch.float32
        assert torch.allclose(averaged[name], expected[name], rtol=0, atol=1e-6), name
