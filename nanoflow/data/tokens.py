"""Token folders: the pre-tokenized layout HF datatrove's DocumentTokenizer writes and nanotron's Nanoset reads.

A folder holds one or more token files, read in sorted name order (only the folder itself, not
sub-folders, as nanotron does), each a triple:

    NAME.ds            the token ids of every document, one after the other: raw little-endian
                       uint16 when the vocabulary fits in 65,536 ids, else uint32 (no header)
    NAME.ds.index      uint64 little-endian: the end offset, in tokens, of each document
    NAME.ds.metadata   text: "TOKENIZER|TOKEN_SIZE" on the first line (older datatrove writes only
                       the tokenizer name, meaning 2-byte tokens), then the token count, then the
                       count written for humans ("1.2 MT")

Each document already ends with the end-of-text token. nanoflow reads a folder as one token stream
(the files concatenated) cut into windows of sequence_length + 1 tokens at stride sequence_length,
like the packed HF text sources; datatrove's own reader cuts each file separately at stride
sequence_length + 1, so the same folder gives a few more, slightly different windows here.

Writing is all-or-nothing per file: the three files are written under temporary names and renamed
into place, the metadata last, so a folder never shows a half-written token file under its name.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from bisect import bisect_right
from collections.abc import Iterable

import numpy as np

from nanoflow.config import token_folder_problem
from nanoflow.config.locations import TOKEN_SUFFIX
from nanoflow.errors import StageDataError, TokenFolderError  # noqa: F401 - StageDataError: imported from here
from nanoflow.io.store import write_atomically

SUFFIX = TOKEN_SUFFIX
MANIFEST = "prepare.json"   # what bin/prepare records beside the token files it writes (data/prepare.py)


def token_size_for(vocab_size: int) -> int:
    """Bytes per token id: 2 while every id fits in uint16, as datatrove decides."""
    return 2 if vocab_size <= 1 << 16 else 4


def token_dtype(token_size: int) -> np.dtype:
    if token_size not in (2, 4):
        raise ValueError(f"token size must be 2 or 4 bytes, got {token_size}")
    return np.dtype("<u2" if token_size == 2 else "<u4")


def recorded_name(tokenizer) -> str:
    """The tokenizer name bin/prepare records in .ds.metadata: "bytes", or the tokenizer's absolute path (its
    tokenizer.json or its folder), as datatrove records the name or path it was given."""
    return "bytes" if tokenizer.name == "bytes" else os.path.abspath(tokenizer.name)


def _content_hash(path: str) -> str:
    with open(path, "rb") as f:
        return "sha256:" + hashlib.sha256(f.read()).hexdigest()


def _hub_cached_tokenizer(name: str) -> str | None:
    """The tokenizer.json of hub repository `name` in the local HF cache, if it is there (no network)."""
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "tokenizer.json")
    except Exception:  # noqa: BLE001 - not a valid repository name, or no huggingface_hub: not resolvable
        return None
    return found if isinstance(found, str) and os.path.isfile(found) else None


def recorded_tokenizer(folder: TokenFolder) -> dict | None:
    """What the tokenizer a folder was written with is, when this machine can tell: {"fingerprint", "how",
    "eos_id" (or None)}. From the folder's prepare.json (bin/prepare records the tokenizer's content hash),
    else from the recorded name: "bytes", a local tokenizer.json or a folder holding one, or a hub name whose
    tokenizer.json is in the local HF cache. None: the name cannot be resolved here."""
    manifest_path = os.path.join(folder.folder, MANIFEST)
    if os.path.isfile(manifest_path):
        try:
            with open(manifest_path) as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            manifest = {}
        if isinstance(manifest, dict) and isinstance(manifest.get("tokenizer_fingerprint"), str):
            return {"fingerprint": manifest["tokenizer_fingerprint"], "how": MANIFEST, "eos_id": manifest.get("eos_id")}
    name = folder.tokenizer_name
    if name == "bytes":
        return {"fingerprint": "bytes", "how": "the built-in name", "eos_id": None}
    path = os.path.join(name, "tokenizer.json") if os.path.isdir(name) else name
    if not os.path.isfile(path):
        path = _hub_cached_tokenizer(name)
    if path is None:
        return None
    try:
        return {"fingerprint": _content_hash(path), "how": path, "eos_id": None}
    except OSError:
        return None


def _humanize(count: int) -> str:
    for unit, scale in (("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}T"
    return f"{count} T"


def write_token_file(folder: str | os.PathLike, name: str, documents: Iterable[np.ndarray], *,
                     tokenizer_name: str, token_size: int) -> dict:
    """Write the documents (token id arrays, each already ending with end-of-text) as NAME.ds and its sidecars.

    Returns {"tokens", "documents", "blake2b"} (blake2b of the .ds bytes, to verify a read-back).
    The .ds file streams to disk; only the document ends are kept in memory.
    """
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    dtype = token_dtype(token_size)
    limit = 1 << (8 * token_size)
    ends, total = [], 0
    digest = hashlib.blake2b(digest_size=16)

    def chunks():
        nonlocal total
        for document in documents:
            document = np.asarray(document)
            if document.size and (document.min() < 0 or document.max() >= limit):
                raise ValueError(f"{name}{SUFFIX}: token id {int(document.max())} does not fit in {token_size} bytes")
            data = document.astype(dtype).tobytes()
            digest.update(data)
            total += document.size
            ends.append(total)
            yield data

    path = os.path.join(folder, name + SUFFIX)
    write_atomically(path, chunks())
    write_atomically(path + ".index", np.asarray(ends, dtype="<u8").tobytes())
    write_atomically(path + ".metadata", f"{tokenizer_name}|{token_size}\n{total}\n{_humanize(total)}".encode())
    return {"tokens": total, "documents": len(ends), "blake2b": digest.hexdigest()}


def file_digest(path: str) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def read_token_format(path: str) -> tuple[str, int]:
    """(tokenizer name, token size) from PATH.ds.metadata."""
    metadata = path + ".metadata"
    try:
        with open(metadata) as f:
            first = f.readline().strip()
    except FileNotFoundError:
        raise TokenFolderError(f"{path}: no {os.path.basename(metadata)} beside it; it names the tokenizer and the "
                               "token size, without which the file cannot be read") from None
    except OSError as e:
        raise _unreadable(metadata, e) from None
    name, sep, size = first.rpartition("|")
    if not sep:                      # older datatrove: the tokenizer name alone, 2-byte tokens
        return first, 2
    if size not in ("2", "4"):
        raise TokenFolderError(f"{metadata}: token size {size!r} on its first line; expected 2 or 4")
    return name, int(size)


def _unreadable(path: str, error: OSError) -> TokenFolderError:
    return TokenFolderError(f"{path}: cannot be read: {error.strerror or error}")


def _check_readable(path: str) -> None:
    """Open `path` for reading and close it: a file the user may not read is named now, at start-up, not by a
    traceback from the first read (a memory map opens it only then)."""
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise _unreadable(path, e) from None


class TokenFile:
    """One NAME.ds file, memory-mapped and checked against its index and metadata."""

    def __init__(self, path: str):
        self.path = path
        self.tokenizer_name, self.token_size = read_token_format(path)
        _check_readable(path)
        size = os.path.getsize(path)
        if size % self.token_size:
            raise TokenFolderError(f"{path}: {size} bytes is not a whole number of {self.token_size}-byte tokens; "
                                   "the file is truncated (prepare it again)")
        self.tokens = size // self.token_size
        index = path + ".index"
        if os.path.exists(index):
            _check_readable(index)
            index_size = os.path.getsize(index)
            ends = np.memmap(index, dtype="<u8", mode="r") if index_size >= 8 else np.zeros(0, np.uint64)
            if index_size % 8 or (ends.size and (int(ends[-1]) != self.tokens or (np.diff(ends.astype(np.int64)) < 0)
                                                 .any())) or (not ends.size and self.tokens):
                last = int(ends[-1]) if ends.size else 0
                raise TokenFolderError(f"{path}: its index does not match it (the index ends at token {last}, "
                                       f"the file holds {self.tokens} tokens); one of them is truncated or stale")
            self.documents = int(ends.size)
            del ends
        else:
            self.documents = None
        self._map = None

    @property
    def map(self) -> np.ndarray:
        # A mapped file cut short under the run kills the process (SIGBUS) on the next read past its new end;
        # one stat per read turns that into an error that names the file (and the loader, the sample).
        size = os.path.getsize(self.path) if self.tokens else 0
        if size != self.tokens * self.token_size:
            raise TokenFolderError(f"{self.path}: {size} bytes now, {self.tokens * self.token_size} when the run "
                                   "opened it: the file changed under the run (truncated or rewritten)")
        if self._map is None:
            try:
                self._map = (np.memmap(self.path, dtype=token_dtype(self.token_size), mode="r") if self.tokens
                             else np.zeros(0, token_dtype(self.token_size)))
            except OSError as e:   # its permissions changed under the run
                raise _unreadable(self.path, e) from None
        return self._map

    def close(self) -> None:
        self._map = None


class TokenFolder:
    """The token files of a folder as one stream: `len(folder)` tokens, `folder[a:b]` an int64 copy."""

    def __init__(self, folder: str | os.PathLike, where: str = "the token folder"):
        self.folder = os.fspath(folder)
        problem = token_folder_problem(self.folder)   # what the check before the run asks too
        if problem is not None:
            raise TokenFolderError(f"{where}: {problem}")
        paths = sorted(glob.glob(os.path.join(glob.escape(self.folder), "*" + SUFFIX)))
        try:
            self.files = [TokenFile(p) for p in paths]
        except TokenFolderError as e:
            raise TokenFolderError(f"{where}: {e}") from None
        kinds = {(f.tokenizer_name, f.token_size) for f in self.files}
        if len(kinds) > 1:
            shown = "; ".join(f"{os.path.basename(f.path)}: {f.tokenizer_name}|{f.token_size}" for f in self.files[:6])
            raise TokenFolderError(f"{where}: {self.folder} mixes tokenizers or token sizes ({shown})")
        (self.tokenizer_name, self.token_size), = kinds
        self.starts = np.cumsum([0] + [f.tokens for f in self.files]).tolist()   # token offset of each file
        if self.starts[-1] == 0:
            raise TokenFolderError(f"{where}: the token files in {self.folder} are all empty")

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, step = window.indices(len(self))
        if step != 1:
            raise ValueError("token folders are read in contiguous ranges")
        first = bisect_right(self.starts, start) - 1
        pieces = []
        while start < stop:
            file = self.files[first]
            local = start - self.starts[first]
            take = min(stop - start, file.tokens - local)
            pieces.append(file.map[local:local + take])
            start += take
            first += 1
        if len(pieces) == 1:
            return pieces[0].astype(np.int64)
        return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """[len(starts), length] int64: the stream's tokens starts[i] .. starts[i] + length - 1 for each i.
        Windows inside one file are read with one fancy index per file; the few that cross a file
        boundary are stitched one by one."""
        starts = np.asarray(starts, dtype=np.int64)
        out = np.empty((len(starts), length), np.int64)
        boundaries = np.asarray(self.starts, dtype=np.int64)
        first = np.searchsorted(boundaries, starts, side="right") - 1
        last = np.searchsorted(boundaries, starts + length - 1, side="right") - 1
        offsets = np.arange(length)
        for k in np.unique(first):
            rows = np.flatnonzero((first == k) & (last == k))
            if rows.size:
                out[rows] = self.files[k].map[(starts[rows] - boundaries[k])[:, None] + offsets]
        for row in np.flatnonzero(first != last):
            out[row] = self[int(starts[row]):int(starts[row]) + length]
        return out

    def locate(self, token: int) -> str:
        """'NAME.ds at token T': where token `token` of the stream lives, for error messages."""
        index = min(bisect_right(self.starts, token) - 1, len(self.files) - 1)
        return f"{self.files[index].path} at token {token - self.starts[index]}"

    def close(self) -> None:
        for file in self.files:
            file.close()

    def __repr__(self) -> str:
        return f"TokenFolder({self.folder!r}, {len(self.files)} files, {len(self):,} tokens, " \
               f"{self.tokenizer_name}|{self.token_size})"
