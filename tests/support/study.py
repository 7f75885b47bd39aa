"""What test_study.py and test_sweep_process.py share: the WSD-vs-cosine study's base config, made small, and a
study file written from a few runs and averages."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import REPO

BASE = REPO / "schedules" / "wsd_vs_cosine" / "base.toml"
SMALL = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
         "model.num_attention_heads=2", "model.num_key_value_heads=1", "tokens.micro_batch_size=2",
         "tokens.sequence_length=32", "checkpoints.checkpoint_interval=2",
         "optimizer.learning_rate_scheduler.lr_warmup_steps=2", "evaluation.interval=4"]


def write_study(path: Path, runs: list[tuple[str, dict]], averages: list[dict] = (), *, runs_dir: str = "runs",
                base: Path = BASE, common: list[str] = SMALL) -> Path:
    """A study file at `path`: each run (name, its keys besides name; `set` gets `common` in front) and average."""
    text = f"base = {json.dumps(str(base))}\nruns_dir = {json.dumps(runs_dir)}\n"
    for name, keys in runs:
        text += f"\n[[runs]]\nname = {json.dumps(name)}\n"
        if "branch" in keys:
            text += f"branch = {{from = {json.dumps(keys['branch'][0])}, at = {keys['branch'][1]}}}\n"
        text += f"set = {json.dumps(list(common) + list(keys.get('set', [])))}\n"
    for average in averages:
        text += "\n[[averages]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in average.items())
    path.write_text(text)
    return path
