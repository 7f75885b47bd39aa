"""Helpers for the tests/test_data_*.py files: token folders with recognisable tokens, and configs built from dicts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from nanoflow.config import load_config
from nanoflow.data import ByteTokenizer, write_token_file

BYTES = ByteTokenizer()
EOS = BYTES.eos_id


def documents(rng: np.random.Generator, count: int, low: int, high: int, length=(5, 60)) -> list[np.ndarray]:
    """`count` documents of token ids in [low, high), each ending with the byte tokenizer's end-of-text."""
    return [np.append(rng.integers(low, high, rng.integers(*length)), EOS) for _ in range(count)]


def write_folder(folder: Path, docs: list[np.ndarray], files: int = 1, tokenizer_name: str = "bytes",
                 token_size: int = 2) -> np.ndarray:
    """Write `docs` as `files` token files (datatrove names) in `folder`; returns the stream they make, in order."""
    chunks = np.array_split(np.arange(len(docs)), files)
    for k, chunk in enumerate(chunks):
        write_token_file(folder, f"{k:05d}_unshuffled", [docs[i] for i in chunk], tokenizer_name=tokenizer_name,
                         token_size=token_size)
    return np.concatenate(docs)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def _table(header: str, values: dict) -> str:
    lines = [header] + [f"{k} = {_toml_value(v)}" for k, v in values.items() if not isinstance(v, dict) or k in
                        ("hf_dataset_or_datasets", "dataset_weights_end")]
    return "\n".join(lines) + "\n"


def stage(name: str, start: int, dataset: dict, *, data: dict | None = None, **overrides) -> dict:
    return {"name": name, "start_training_step": start, **overrides, "data": {**(data or {}), "dataset": dataset}}


def write_config(tmp_path: Path, stages: list[dict], *, sequence_length: int = 16, micro_batch_size: int = 2,
                 accumulation: int = 2, train_steps: int = 20, vocab_size: int = 288, seed: int = 5,
                 tokenizer: str = "bytes", name: str = "run.toml") -> Path:
    """A small run config with these stages (each from `stage`), written to tmp_path/name."""
    text = _table("[general]", {"seed": seed})
    text += _table("[model]", {"vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 1, "num_attention_heads": 4,
                               "max_position_embeddings": max(128, sequence_length)})
    text += _table("[tokenizer]", {"tokenizer_name_or_path": tokenizer})
    text += _table("[tokens]", {"sequence_length": sequence_length, "train_steps": train_steps,
                                "micro_batch_size": micro_batch_size, "batch_accumulation_per_replica": accumulation})
    text += _table("[optimizer.learning_rate_scheduler]", {"learning_rate": 1e-3})
    text += _table("[checkpoints]", {"checkpoints_path": str(tmp_path / "checkpoints")})
    for s in stages:
        top = {k: v for k, v in s.items() if k != "data"}
        text += "\n" + _table("[[data_stages]]", top)
        data = {k: v for k, v in s["data"].items() if k != "dataset"}
        if data:
            text += _table("[data_stages.data]", data)
        text += _table("[data_stages.data.dataset]", s["data"]["dataset"])
    path = tmp_path / name
    path.write_text(text)
    return path


def load(tmp_path: Path, stages: list[dict], overrides=(), **kwargs):
    return load_config(write_config(tmp_path, stages, **kwargs), list(overrides))


EOT_TEXTS = ["def f(x): return x + 1", "1+2=3 and 4+5=9", "the quick brown fox jumps over the lazy dog"]


def eot_tokenizer(path: Path, vocab_size: int = 280) -> Path:
    """A byte-level BPE tokenizer.json, trained here with `tokenizers`, whose specials are <BOT> (id 0) and <EOT>
    (id 1): spellings nanoflow does not know."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<BOT>", "<EOT>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(EOT_TEXTS * 20, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def write_word_level_tokenizer(path: Path, specials: list[str]) -> Path:
    """A word-level tokenizer.json, trained here with `tokenizers` on three lines, with [UNK] and `specials`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    lines = ["the cat sat on the mat", "a dog sat on a log", "the end"]
    tokenizer.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["[UNK]", *specials]))
    tokenizer.save(str(path))
    return path


def zstd_frame(data: bytes) -> bytes:
    """A Zstandard frame of one raw (stored) block, as RFC 8878 lays it out: what any zstd reader decodes to `data`
    (written by hand: the zstandard package is optional)."""
    assert len(data) < 1 << 16   # the content size, single segment: 1 byte below 256, else 2 bytes holding size − 256
    size = bytes([0x20, len(data)]) if len(data) < 256 else bytes([0x60]) + (len(data) - 256).to_bytes(2, "little")
    header = (0xFD2FB528).to_bytes(4, "little") + size
    return header + ((len(data) << 3) | 1).to_bytes(3, "little") + data   # last block, raw
