"""What test_datatrove.py and its process-level tests share."""

from __future__ import annotations

from pathlib import Path

import numpy as np

EOT = 1   # <EOT> in eot_tokenizer


def documents(count: int = 40, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = "the quick brown fox jumps over lazy dog def return x + 1 = 2 3 and".split()
    return [" ".join(rng.choice(words, rng.integers(3, 30))) for _ in range(count)]


def encode(tokenizer_json: Path, texts: list[str]) -> list[list[int]]:
    """Each text's ids and <EOT>, by the `tokenizers` package itself."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_json))
    return [tok.encode(t, add_special_tokens=False).ids + [EOT] for t in texts]
