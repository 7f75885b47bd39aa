"""Tokenizers: the built-in byte tokenizer, and any HF `tokenizers` tokenizer.json (alone, or in an HF model or
tokenizer folder beside its tokenizer_config.json).

Both give `eos_id`/`eos_token`, `bos_id`/`bos_token` (None when there is none), `vocab_size`, `name`,
`fingerprint` (what the tokenizer is, for caches and token folders), `args` (the [tokenizer] section that
loads it again, e.g. in a worker process), `encode(text) -> list[int]`, `encode_batch(texts) -> list of int
arrays` (the fast path the sources use), `decode(ids) -> str` (special tokens left out) and
`special_tokens() -> {id: text}`.

Special tokens, first found wins: `[tokenizer] eos_token` / `bos_token`; a folder's tokenizer_config.json
(`eos_token` / `bos_token`, strings or AddedToken tables); a special token of tokenizer.json spelled as in
EOS_TOKENS / BOS_TOKENS. A token named by the config or by tokenizer_config.json that is not in the
vocabulary is an error. nanoflow ends every document with the end-of-text token and adds no BOS; the BOS
is what an exported folder declares.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence

import numpy as np

from nanoflow.config import Config, TokenizerArgs
from nanoflow.errors import MissingExtraError, TokenizerError

# Spellings of "end of text" and "beginning of text" in common tokenizer.json files, most common first.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>")
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


class ByteTokenizer:
    """ids 0..255 are the UTF-8 bytes of the text; 256 ("<|endoftext|>") ends a document. No BOS."""

    eos_id = 256
    eos_token = "<|endoftext|>"
    bos_id = None
    bos_token = None
    vocab_size = 257
    name = "bytes"
    fingerprint = "bytes"
    path = None          # no tokenizer.json
    args = TokenizerArgs()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # Special ids are not text; a window cut mid-character decodes with replacement characters.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def special_tokens(self) -> dict[int, str]:
        return {self.eos_id: self.eos_token}

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken table {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    """A `tokenizers` tokenizer.json. Texts are encoded without the tokenizer's own special tokens
    (no BOS); the sources add the end-of-text token themselves.

    `path` is the tokenizer.json; `folder_config`, a folder's parsed tokenizer_config.json (or {}).
    """

    def __init__(self, path: str | os.PathLike, *, eos_token: str | None = None, bos_token: str | None = None,
                 name: str | None = None, folder_config: dict | None = None, config_path: str | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise MissingExtraError(f"loading the tokenizer {path}", "tokenizers", "tokenizers") from None
        self.path = os.fspath(path)
        self.name = name or self.path
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
            self._tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
        except OSError as e:
            raise TokenizerError(f"tokenizer {self.path}: cannot be read ({e.strerror or e})") from None
        except Exception as e:  # noqa: BLE001 - `tokenizers` raises bare Exceptions for a malformed file
            raise TokenizerError(f"tokenizer {self.path}: not a tokenizer.json the `tokenizers` package can load "
                                 f"({e})") from None
        self.fingerprint = "sha256:" + hashlib.sha256(raw).hexdigest()
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.args = TokenizerArgs(tokenizer_name_or_path=self.name, eos_token=eos_token, bos_token=bos_token)
        folder_config = folder_config or {}
        self.eos_token, self.eos_id = self._special("eos", eos_token, folder_config, config_path, EOS_TOKENS)
        self.bos_token, self.bos_id = self._special("bos", bos_token, folder_config, config_path, BOS_TOKENS)

    def _specials(self) -> dict[str, int]:
        return {token.content: token_id for token_id, token in self._tokenizer.get_added_tokens_decoder().items()
                if token.special}

    def _special(self, kind: str, stated: str | None, folder_config: dict, config_path: str | None,
                 spellings: tuple[str, ...]) -> tuple[str | None, int | None]:
        """(token, id) of the EOS or BOS: stated in [tokenizer], else in tokenizer_config.json, else by spelling."""
        named = [(stated, f"tokenizer.{kind}_token")]
        if config_path is not None:
            named.append((_token_content(folder_config.get(f"{kind}_token")), f"{config_path}: {kind}_token"))
        for token, where in named:
            if token is None:
                continue
            token_id = self._tokenizer.token_to_id(token)
            if token_id is None:
                specials = sorted(self._specials())
                raise TokenizerError(f'{where} = "{token}" is not in the vocabulary of {self.path} '
                                     f"({self.vocab_size} ids; its special tokens: {', '.join(specials) or '(none)'})")
            return token, token_id
        specials = self._specials()
        for token in spellings:
            if token in specials:
                return token, specials[token]
        if kind == "bos":
            return None, None
        raise TokenizerError(f"{self.path}: found no end-of-text token among the special tokens "
                             f"{sorted(specials) or '(none)'} (looked for {', '.join(spellings)}); name it with "
                             '[tokenizer] eos_token = "..." (bin/prepare --eos-token)')

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def special_tokens(self) -> dict[int, str]:
        return {token_id: token for token, token_id in self._specials().items()}

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, eos={self.eos_token!r})"


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(source: str | os.PathLike | TokenizerArgs = "bytes", *, eos_token: str | None = None,
                   bos_token: str | None = None) -> Tokenizer:
    """The tokenizer a [tokenizer] section (or a name and its special tokens) describes: "bytes" for the built-in
    byte tokenizer; a tokenizer.json; or an HF model or tokenizer folder holding tokenizer.json, whose
    tokenizer_config.json, when there is one, names the special tokens."""
    if isinstance(source, TokenizerArgs):
        source, eos_token, bos_token = source.tokenizer_name_or_path, source.eos_token, source.bos_token
    name = os.fspath(source)
    if name == "bytes":
        if eos_token not in (None, ByteTokenizer.eos_token) or bos_token is not None:
            raise TokenizerError(f'the byte tokenizer has one special token, "{ByteTokenizer.eos_token}" (id 256), '
                                 f"and no BOS; unset tokenizer.eos_token / tokenizer.bos_token")
        return ByteTokenizer()
    if os.path.isdir(name):
        path = os.path.join(name, TOKENIZER_JSON)
        if not os.path.isfile(path):
            raise TokenizerError(f"tokenizer {name}: a folder without a {TOKENIZER_JSON} (nanoflow reads the fast "
                                 "tokenizer file that HF model and tokenizer folders hold)")
        config_path = os.path.join(name, TOKENIZER_CONFIG)
        folder_config = _read_tokenizer_config(config_path) if os.path.isfile(config_path) else None
        return HFTokenizer(path, eos_token=eos_token, bos_token=bos_token, name=name, folder_config=folder_config,
                           config_path=config_path if folder_config is not None else None)
    if not os.path.isfile(name):
        raise TokenizerError(f'tokenizer {name}: no such tokenizer.json or folder (use "bytes" for the byte tokenizer)')
    return HFTokenizer(name, eos_token=eos_token, bos_token=bos_token)


def _read_tokenizer_config(path: str) -> dict:
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return config


def load_run_tokenizer(config: Config) -> Tokenizer:
    """The run's tokenizer, checked against the model: what `bin/train --plan` and training both call, so a
    tokenizer the model cannot embed stops both, before any step."""
    tokenizer = load_tokenizer(config.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise TokenizerError(f"model.vocab_size = {config.model.vocab_size} is smaller than the tokenizer's "
                             f"vocabulary ({tokenizer.vocab_size} ids, {tokenizer.name}); raise model.vocab_size "
                             f"to at least {tokenizer.vocab_size}")
    return tokenizer
