"""What test_hf.py and its process-level tests share."""

from __future__ import annotations

import io
from pathlib import Path

import helpers
import torch
import transformers

from nanoflow.run import open_run
from nanoflow.training.loop import train


def checked(tmp_path: Path, *overrides: str):
    """tiny(), through the checks bin/train and --plan run first (an HF init_from folder's config.json among them)."""
    return open_run(tiny(tmp_path, *overrides), join=False).config


def hf_folder(path: Path, *, tied: bool, shard: str | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """An HF Llama folder written by transformers itself, shaped like schedules/tiny.toml's model; its state dict."""
    config = transformers.LlamaConfig(vocab_size=288, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return {k: v.clone() for k, v in model.state_dict().items()}


def tiny(tmp_path: Path, *overrides: str, run: str = "run"):
    return helpers.tiny(tmp_path / run, *overrides)


def trained_run(tmp_path: Path):
    """The tiny schedule trained 3 steps (tied embeddings) in `tmp_path`/run, and its final state."""
    state = train(tiny(tmp_path, "tokens.train_steps=3"), out=io.StringIO())
    return tmp_path / "run", state
