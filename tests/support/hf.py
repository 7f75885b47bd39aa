"""What test_hf.py and its process-level tests share."""

from __future__ import annotations

import io
import json
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


# ---------------------------------------------------------------------------------------------
# RoPE scaling in an HF folder

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


# hidden 64 / 4 heads: head_dim 16, theta 10000: wavelengths 6.3, 20, 63, ... positions, so with L = 32
# llama3 keeps the first frequency (< L/4), blends the second and divides the rest (> L/1).
SCALED_MODEL = ("model.hidden_size=64", "model.max_position_embeddings=128", "tokens.sequence_length=64")


def toml_table(table: dict) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + "}"


def scaled_hf_folder(path: Path, rope_scaling: dict) -> transformers.LlamaForCausalLM:
    """A random transformers Llama with `rope_scaling`, shaped like tiny.toml with SCALED_MODEL, saved to `path`."""
    config = transformers.LlamaConfig(vocab_size=288, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=dict(rope_scaling),
                                      initializer_range=0.1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(path)
    return model

