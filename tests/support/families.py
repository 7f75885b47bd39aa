"""What test_families.py and its whole-run tests share: the families' config classes and shapes, the ids and logits."""

from __future__ import annotations

import torch
import transformers

CLASSES = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "mistral": transformers.MistralConfig, "smollm3": transformers.SmolLM3Config,
           "olmo2": transformers.Olmo2Config}


# tiny.toml's vocabulary (the byte tokenizer's 257 ids fit), GQA, 4 layers; no special ids (SmolLM3's defaults are
# beyond this vocabulary)
SIZES = dict(vocab_size=288, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.1,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)


# Each family with the shapes its released configs have that set it apart.
SHAPES = {
    "llama-biases": ("llama", dict(attention_bias=True, head_dim=16)),
    "qwen2.5": ("qwen2", dict(sliding_window=131072, use_sliding_window=False, max_window_layers=21,
                              tie_word_embeddings=True, rope_theta=1000000.0)),     # Qwen2.5-0.5B's layout
    "qwen3": ("qwen3", dict(head_dim=16, tie_word_embeddings=True)),               # Qwen3-0.6B: head_dim ≠ hidden/heads
    "qwen3-biases-untied": ("qwen3", dict(head_dim=4, attention_bias=True)),
    "mistral": ("mistral", dict(head_dim=12, sliding_window=None)),                # Mistral-Nemo: head_dim stated
    "mistral-window": ("mistral", dict(sliding_window=4096)),
    "smollm3-list": ("smollm3", dict(no_rope_layers=[1, 0, 1, 0], no_rope_layer_interval=3)),   # the list wins
    "smollm3-interval": ("smollm3", dict(no_rope_layer_interval=2, tie_word_embeddings=False)),
    "olmo2": ("olmo2", dict(rope_theta=500000.0)),                                  # OLMo-2-1B's layout
    "olmo2-biases-head_dim": ("olmo2", dict(attention_bias=True, head_dim=4, tie_word_embeddings=True)),
}


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


IDS = torch.randint(0, 288, (2, 64), generator=torch.Generator().manual_seed(1))   # every position up to 64


FRESH = {
    "qwen2": ['model.model_type="qwen2"'],
    "qwen3": ['model.model_type="qwen3"', "model.head_dim=16", "model.attention_bias=true"],
    "smollm3": ['model.model_type="smollm3"', "model.num_hidden_layers=4", "model.no_rope_layer_interval=2"],
    "olmo2": ['model.model_type="olmo2"', "model.attention_bias=true"],
}

