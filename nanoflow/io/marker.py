"""The commit marker, checkpoint_metadata.json: written sealed with its own checksum, and read back only
once its seal, its shape and its step check out.

The seal is the XXH3-128 checksum of the marker's canonical JSON (sorted keys, no spaces) without
the seal itself, stored in it as `metadata_xxh3_128`. Whatever fails a check — bad JSON, a broken
seal, a missing or mistyped field, a step that disagrees with its folder's name — is damage
(DamagedCheckpointError): the checkpoint is skipped in favour of an older intact one, and never
taken for "nothing committed".
"""

from __future__ import annotations

import datetime
import json
import math
import re

import torch

from nanoflow.errors import CheckpointError, DamagedCheckpointError
from nanoflow.io.store import Store, StoreError
from nanoflow.io.tensorfile import new_checksum

METADATA = "checkpoint_metadata.json"
CHECKSUM = "xxh3_128"  # recorded for each file's header and each shard's bytes: together, every byte of a file
SEAL = "metadata_" + CHECKSUM
FORMAT = "nanoflow-checkpoint/3"   # 3: the marker seals itself; 2: checksums per header and shard; 1: per file


_STEP = re.compile(r"0|[1-9][0-9]{0,17}")   # a step number as nanoflow writes it: ASCII digits, below 10**18


def step_of(name: str) -> int | None:
    """The step a folder name or latest.txt stands for; None for anything nanoflow would not have written
    ('²' and '٣' pass str.isdigit, '012' names no folder nanoflow writes, 5,000 digits are no step)."""
    return int(name) if _STEP.fullmatch(name) else None


def sealed(meta: dict) -> bytes:
    """The marker's bytes: `meta` with its seal."""
    return json.dumps({**meta, SEAL: _digest(_canonical(meta))}, indent=1).encode()


def read_marker(store: Store, folder: str, name: str | None = None) -> dict:
    """The checked marker of step folder `folder` of `store` ("" for the store's root). `name` is the
    folder's own name when it is not `folder` (a step folder opened on its own)."""
    relative = f"{folder}/{METADATA}" if folder else METADATA
    where = store.url(relative)
    if not store.exists(relative):
        raise CheckpointError(f"{store.url(folder)} is incomplete (no {METADATA})")
    try:
        text = store.read(relative)
    except StoreError as e:  # committed, but not readable now: never to be taken for "nothing committed"
        raise DamagedCheckpointError(str(e)) from e
    return check_metadata(text, where, folder or name or "")


def check_metadata(text: bytes, where: str, folder_name: str) -> dict:
    """The marker parsed from `text`, once its seal, schema and step check out; DamagedCheckpointError otherwise."""
    try:
        meta = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # written whole and renamed: never a torn write
        raise DamagedCheckpointError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise DamagedCheckpointError(f"{where} is damaged: not a JSON object")
    written = meta.get("format")
    if written != FORMAT:
        if isinstance(written, str) and written.startswith("nanoflow-checkpoint/") and SEAL not in meta:
            raise DamagedCheckpointError(f"{where} is a {written} checkpoint; this nanoflow reads {FORMAT} only "
                                         "(read it with the nanoflow that wrote it, or start over with --fresh)")
        raise DamagedCheckpointError(f"{where} is not a {FORMAT} checkpoint marker")
    seal = meta.pop(SEAL, None)
    if seal != _digest(_canonical(meta)):
        raise DamagedCheckpointError(f"{where} is damaged: its contents differ from the checksum it was sealed "
                                     f"with ({SEAL})" if seal is not None else f"{where} is damaged: no {SEAL}")
    problem = _schema_problem(meta)
    if problem is not None:
        raise DamagedCheckpointError(f"{where} is damaged: {problem}")
    named = step_of(folder_name.rstrip("/").rpartition("/")[2])
    if named is not None and named != meta["step"]:
        raise DamagedCheckpointError(f"{where} is damaged: it records step {meta['step']}, in folder {named}")
    return meta


def committed_at(meta: dict) -> datetime.datetime:
    """When a checked marker was committed."""
    return datetime.datetime.fromisoformat(meta["created"])


def _canonical(meta: dict) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _digest(data) -> str:
    checksum = new_checksum()
    checksum.update(data)
    return checksum.hexdigest()


# ---------------------------------------------------------------------------------------------
# The schema: every field something reads, with its type, before anything is used

_FILE = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _whole_list(value, length: int | None = None) -> bool:
    return isinstance(value, list) and all(map(_whole, value)) and (length is None or len(value) == length)


def _schema_problem(meta: dict) -> str | None:
    """What is wrong with the shape of a sealed marker (a bug of the writer, or a forged seal); None if nothing."""
    if not _whole(meta.get("step")):
        return '"step" is not a step number'
    training = meta.get("training")
    if not isinstance(training, dict) or not _whole(training.get("completed")):
        return '"training" does not say how many steps were completed'
    if training["completed"] != meta["step"]:
        return f'"step" is {meta["step"]} but "training" says {training["completed"]} steps were completed'
    try:
        committed_at(meta)
    except (TypeError, ValueError):
        return '"created" is not a time'
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        return '"files" lists no files'
    for name, entry in files.items():
        if not _FILE.fullmatch(name) or ".." in name.split("/"):
            return f'"files" lists {name!r}, not a file name of a checkpoint'
        if not isinstance(entry, dict) or not _whole(entry.get("bytes")) or \
                not isinstance(entry.get("header_" + CHECKSUM), str):
            return f'"files": {name} has no byte count or no header checksum'
    tensors = meta.get("tensors")
    if not isinstance(tensors, dict) or not tensors or not all(isinstance(e, dict) for e in tensors.values()):
        return '"tensors" lists no tensors'
    claimed: dict = {}   # (file, key): the bytes its shard says it holds; file: their sum
    for group, entries in tensors.items():
        for key, entry in entries.items():
            problem = _tensor_problem(entry, files) or _size_problem(entry, files, claimed)
            if problem is not None:
                return f'"tensors": {group} tensor {key}: {problem}'
    return None


def _size_problem(entry: dict, files: dict, claimed: dict) -> str | None:
    """Declared shapes against the bytes, before any reader allocates a tensor of them: the shards must hold at
    least as many elements as the tensor (its whole box is assembled from them), and each shard's bytes are
    counted against its file's recorded size (which is checked against the file itself when it is listed)."""
    itemsize = getattr(torch, entry["dtype"]).itemsize
    held = 0
    for shard in entry["shards"]:
        count = math.prod(shard["shape"])
        held += count
        if (shard["file"], shard["key"]) not in claimed:   # (a shard listed twice holds its bytes once)
            claimed[shard["file"], shard["key"]] = count * itemsize
            claimed[shard["file"]] = claimed.get(shard["file"], 0) + count * itemsize
        if claimed[shard["file"]] > files[shard["file"]]["bytes"]:
            return (f"its shard {shard['key']} of shape {shard['shape']} does not fit in {shard['file']}, "
                    f"{files[shard['file']]['bytes']} bytes with the shards before it")
    if math.prod(entry["shape"]) > held:
        return f"its shape {entry['shape']} holds more elements than its shards ({held})"
    return None


def _tensor_problem(entry, files: dict) -> str | None:
    if not isinstance(entry, dict) or not _whole_list(entry.get("shape")):
        return "no shape"
    if not isinstance(getattr(torch, str(entry.get("dtype")), None), torch.dtype):
        return f"dtype {entry.get('dtype')!r} is no torch dtype"
    shards, rank = entry.get("shards"), len(entry["shape"])
    if not isinstance(shards, list) or not shards:
        return "no shards"
    for shard in shards:
        if not isinstance(shard, dict) or not isinstance(shard.get("file"), str) or shard["file"] not in files \
                or not isinstance(shard.get("key"), str) \
                or not _whole_list(shard.get("offset"), rank) or not _whole_list(shard.get("shape"), rank) \
                or not isinstance(shard.get(CHECKSUM), str):
            return "a shard without its file, key, offset, shape or checksum"
        if any(o + n > m for o, n, m in zip(shard["offset"], shard["shape"], entry["shape"], strict=True)):
            return f"a shard at {shard['offset']} of shape {shard['shape']} lies outside {entry['shape']}"
    return None
