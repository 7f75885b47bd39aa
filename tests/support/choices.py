"""What the multiple-choice eval tests share: rows of context, choices and answer, and a run that scores them."""

from __future__ import annotations

import json
from pathlib import Path

from support.evaluation import write_run

# Sums and words, HellaSwag-shaped: choices of unequal lengths (acc and acc_norm can differ), a context ending in a
# space (lm-eval moves it to the continuation), an empty context, an answer given as text, and a non-ASCII choice
# (acc_norm divides by characters, not bytes).
ROWS = [{"ctx": f"{a}+{b}=", "options": [str(a + b), str(a + b + 1), str(a * b + 10)], "label": (a + b) % 3}
        for a in range(1, 6) for b in range(1, 4)] + [
    {"ctx": "the quick brown fox ", "options": ["jumps", "jumps over the lazy dog", "sleeps"], "label": 1},
    {"ctx": "", "options": ["the quick brown fox", "a slow green turtle"], "label": 0},
    {"ctx": "café au", "options": ["lait", "laît ça", "thé"], "label": "lait"},
]

EVALUATION = """
[evaluation]
interval = {interval}
[[evaluation.datasets]]
name = "choices"
metric = "multiple_choice"
max_samples = {max_samples}
sequence_length = 48
micro_batch_size = 4
context_column_name = "ctx"
choices_column_name = "options"
answer_column_name = "label"
[evaluation.datasets.dataset]
hf_dataset_or_datasets = "json"
hf_data_files = "choices.jsonl"
"""

# The same rows as an lm-evaluation-harness task over the same local file.
TASK = """task: nanoflow_choices
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: ctx
doc_to_choice: options
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write_choice_run(folder: Path, *, steps: int = 4, interval: int = 2, max_samples: int = 100) -> Path:
    """A short run (tests/support/evaluation.py's) evaluated only on the multiple-choice rows."""
    config = write_run(folder, steps=steps, sft_start=steps + 1, interval=interval, evaluation=False)
    (folder / "choices.jsonl").write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in ROWS))
    config.write_text(config.read_text() + EVALUATION.format(interval=interval, max_samples=max_samples))
    return config


def write_task(folder: Path) -> Path:
    path = folder / "nanoflow_choices.yaml"
    path.write_text(TASK.format(data=json.dumps(str(folder / "choices.jsonl"))))
    return path
