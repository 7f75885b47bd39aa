"""Chat SFT trained whole: the target tokens metrics.jsonl counts are transformers' assistant tokens of the turns
trained (tests/unit/test_chat.py: the rendering and tokenizing)."""

from __future__ import annotations

import json

import pytest
import transformers
from chat_helpers import (
    CHATML_GENERATION,
    CONVERSATIONS,
    chat_tokenizer,
)
from data_helpers import stage, write_config

from nanoflow.config import load_config


@pytest.mark.parametrize("turns", ["all", "last"])
def test_target_tokens_in_metrics_are_transformers_assistant_tokens_of_the_turns_trained(tmp_path, turns):
    from helpers import quiet

    from nanoflow.observe.metrics import read_metrics
    from nanoflow.training.loop import train

    folder = chat_tokenizer(tmp_path / "tok", CHATML_GENERATION)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    row = CONVERSATIONS[1]   # two assistant turns
    mask = hf.apply_chat_template(row, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)["assistant_masks"]
    assert len(mask) <= 129
    runs = "".join("1" if m else "0" for m in mask).split("0")
    per_row = sum(mask[1:]) if turns == "all" else len([r for r in runs if r][-1])   # position 0 is never a target
    (tmp_path / "chat.jsonl").write_text((json.dumps({"messages": row}) + "\n") * 8)
    path = write_config(tmp_path, [stage("sft", 1, {"hf_dataset_or_datasets": "json",
                                                    "hf_data_files": str(tmp_path / "chat.jsonl"),
                                                    "messages_column_name": "messages", "assistant_turns": turns})],
                        tokenizer=str(folder), vocab_size=416, sequence_length=128, micro_batch_size=2,
                        accumulation=2, train_steps=1)
    train(load_config(path), out=quiet(), progress=False)
    (metrics,) = read_metrics(tmp_path / "checkpoints")
    assert metrics["target_tokens"] == 4 * per_row
    assert 0 < per_row and (per_row < sum(mask[1:])) == (turns == "last")   # "last": fewer than every turn's

