"""Tokenizers: the built-in byte tokenizer, and any HF `tokenizers` tokenizer.json (alone, or in an HF model or
tokenizer folder beside its tokenizer_config.json).

Both give `eos_id`/`eos_token`, `bos_id`/`bos_token` (None when there is none), `vocab_size`, `name`,
`fingerprint` (what the tokenizer is, for caches and token folders), `args` (the [tokenizer] section that
loads it again, e.g. in a worker process), `encode(text) -> list[int]`, `encode_batch(texts) -> list of int
arrays` (the fast path the sources use), `decode(ids) -> str` (special tokens left out) and
`special_tokens() -> {id: text}`.

A folder's chat template (`chat_template`, None without one) is read as transformers reads it: chat_template.jinja
beside tokenizer_config.json, else tokenizer_config.json's `chat_template` (a string, or a list of named templates
whose "default" is taken); nanoflow.data.chat renders it.

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
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The named special tokens transformers hands a chat template as variables (its SPECIAL_TOKENS_ATTRIBUTES).
TEMPLATE_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


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
    chat_template = None
    chat_template_path = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_with_specials(self, text: str) -> list[int]:
        return self.encode(text)   # its exported tokenizer.json adds nothing either

    def template_tokens(self) -> dict[str, str]:
        return {"eos_token": self.eos_token}   # no chat template to see them: a chat stage needs a tokenizer folder

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
        eos = self._special("eos", eos_token, folder_config, config_path, EOS_TOKENS)
        assert eos[0] is not None and eos[1] is not None   # _special raises where it finds no end-of-text
        self.eos_token, self.eos_id = eos[0], eos[1]
        self.bos_token, self.bos_id = self._special("bos", bos_token, folder_config, config_path, BOS_TOKENS)
        self.chat_template, self.chat_template_path = None, None
        if config_path is not None:
            self.chat_template, self.chat_template_path = _chat_template(os.path.dirname(config_path), folder_config)
        self._named_tokens = {name: token for name in TEMPLATE_TOKEN_NAMES
                              if (token := _token_content(folder_config.get(name))) is not None}

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
                names = sorted(self._specials())
                raise TokenizerError(f'{where} = "{token}" is not in the vocabulary of {self.path} '
                                     f"({self.vocab_size} ids; its special tokens: {', '.join(names) or '(none)'})")
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

    def encode_with_specials(self, text: str) -> list[int]:
        """As transformers encodes by default: with the tokenizer.json's post-processor (a Llama tokenizer's BOS)."""
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` (as `encode`) and each token's (start, end) in characters of `text`."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def special_tokens(self) -> dict[int, str]:
        return {token_id: token for token, token_id in self._specials().items()}

    def template_tokens(self) -> dict[str, str]:
        """The named special tokens a chat template sees (bos_token, eos_token, ...): tokenizer_config.json's, with
        this run's end-of-text and BOS over them, as an export writes them (so its AutoTokenizer renders the same)."""
        named = dict(self._named_tokens, eos_token=self.eos_token)
        if self.bos_token is not None:
            named["bos_token"] = self.bos_token
        return named

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, eos={self.eos_token!r})"


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(source: str | os.PathLike | TokenizerArgs = "bytes", *, eos_token: str | None = None,
                   bos_token: str | None = None) -> Tokenizer:
    """The tokenizer a [tokenizer] section (or a name and its special tokens) describes: "bytes" for the built-in
    byte tokenizer; a tokenizer.json; or an HF model or tokenizer folder holding tokenizer.json, whose
    tokenizer_config.json, when there is one, names the special tokens."""
    if isinstance(source, TokenizerArgs):
        eos_token, bos_token = source.eos_token, source.bos_token
        source = source.tokenizer_name_or_path
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


def _chat_template(folder: str, folder_config: dict) -> tuple[str | None, str | None]:
    """(the folder's chat template, the file it is in), or (None, None): chat_template.jinja first, as
    transformers reads it, then tokenizer_config.json's `chat_template`."""
    jinja = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.isfile(jinja):
        try:
            with open(jinja, encoding="utf-8") as f:
                return f.read(), jinja
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{jinja}: cannot be read ({e})") from None
    where = os.path.join(folder, TOKENIZER_CONFIG)
    template = folder_config.get("chat_template")
    if template is None or isinstance(template, str):
        return template, where if template is not None else None
    if isinstance(template, list):   # named templates, [{"name": ..., "template": ...}]: transformers' default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"], where
        raise TokenizerError(f'{where}: chat_template lists templates {sorted(map(str, named))} but none named '
                             '"default", the one a conversation without tools is rendered with')
    raise TokenizerError(f"{where}: chat_template is a {type(template).__name__}; expected the template's text")


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
    assert config.model.vocab_size is not None   # a complete [model]: open_run completes it first
    if tokenizer.vocab_size > config.model.vocab_size:
        raise TokenizerError(f"model.vocab_size = {config.model.vocab_size} is smaller than the tokenizer's "
                             f"vocabulary ({tokenizer.vocab_size} ids, {tokenizer.name}); raise model.vocab_size "
                             f"to at least {tokenizer.vocab_size}")
    return tokenizer
