"""What test_evaluation.py and its process-level tests share."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import SMALL_MODEL_TOML

SUMS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(1, 5) for b in range(1, 3)]

# A two-stage run: packed text that holds its last 10 windows out, then SFT sums; evaluated on both.
CONFIG = SMALL_MODEL_TOML + """
[general]
seed = 3
[tokens]
sequence_length = 32
train_steps = {steps}
micro_batch_size = 2
batch_accumulation_per_replica = 2
[optimizer.learning_rate_scheduler]
learning_rate = 3e-3
[checkpoints]
checkpoints_path = "{run}"
checkpoint_interval = 3
[[data_stages]]
name = "pretrain"
start_training_step = 1
[data_stages.data.dataset]
hf_dataset_or_datasets = "text"
hf_data_files = "corpus.txt"
held_out_samples = 10
[[data_stages]]
name = "sft"
start_training_step = {sft_start}
sequence_length = 16
[data_stages.data.dataset]
hf_dataset_or_datasets = "json"
hf_data_files = "sums.jsonl"
prompt_column_name = "prompt"
completion_column_name = "completion"
"""
EVALUATION = """
[evaluation]
interval = {interval}
[[evaluation.datasets]]
name = "text"
held_out_of = "pretrain"
[[evaluation.datasets]]
name = "sums"
metric = "exact_match"
max_samples = 7
sequence_length = 16
[evaluation.datasets.dataset]
hf_dataset_or_datasets = "json"
hf_data_files = "sums.jsonl"
prompt_column_name = "prompt"
completion_column_name = "completion"
"""

def write_run(folder: Path, *, steps: int = 6, sft_start: int = 5, interval: int | None = 3, run: str = "run",
              evaluation: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.txt").write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {i * 7}"
                                                 for i in range(300)))
    (folder / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in SUMS))
    text = CONFIG.format(steps=steps, sft_start=sft_start, run=run)
    if evaluation:
        text += EVALUATION.format(interval=interval).replace("interval = None\n", "")
    path = folder / f"{run}.toml"
    path.write_text(text)
    return path


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
