"""Tokenizers: the built-in byte tokenizer, and any HF `tokenizers` tokenizer.json.

Both give `eos_id`, `vocab_size`, `encode(text) -> list[int]`, `encode_batch(texts) -> list of
int arrays` (the fast path the sources use) and `decode(ids) -> str`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np

# Spellings of "end of text" in common tokenizer.json files, most common first.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>")


class ByteTokenizer:
    """ids 0..255 are the UTF-8 bytes of the text; 256 ends a document."""

    eos_id = 256
    vocab_size = 257
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # Special ids are not text; a window cut mid-character decodes with replacement characters.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A `tokenizers` tokenizer.json. Texts are encoded without the tokenizer's own special tokens
    (no BOS); the sources add the end-of-text token themselves."""

    def __init__(self, path: str | os.PathLike):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(f"loading the tokenizer {path} needs the `tokenizers` package: "
                              "pip install tokenizers") from None
        self.name = os.fspath(path)
        self._tokenizer = Tokenizer.from_file(self.name)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos()

    def _find_eos(self) -> int:
        specials = {token.content: token_id for token_id, token in self._tokenizer.get_added_tokens_decoder().items()
                    if token.special}
        for token in EOS_TOKENS:
            if token in specials:
                return specials[token]
        raise ValueError(f"{self.name}: found no end-of-text token among the special tokens "
                         f"{sorted(specials) or '(none)'}; expected one of {', '.join(EOS_TOKENS)}")

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(name_or_path: str | os.PathLike) -> Tokenizer:
    """"bytes" for the built-in byte tokenizer; otherwise a tokenizer.json, or a folder that holds one."""
    if name_or_path == "bytes":
        return ByteTokenizer()
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f'tokenizer {name_or_path}: no such tokenizer.json (use "bytes" for the byte tokenizer)')
    return HFTokenizer(path)
