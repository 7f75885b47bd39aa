"""Checkpoints: the only module that reads or writes checkpoint bytes, on a local disk or on S3.

Layout (nanotron's, with a commit marker):

    <run>/latest.txt                        "300", written last, after the step is committed
    <run>/300/model/rank00000.safetensors   weights by HF name: this rank's block of each tensor
    <run>/300/optimizer/rank00000.safetensors  AdamW moments and step counts, by the same names
    <run>/300/rng.safetensors               generator state
    <run>/300/checkpoint_metadata.json      written LAST: the commit marker

The metadata lists every file with its size and XXH3-128 checksum, every tensor with its global shape and
the boxes (file, offset, shape) it was written in, the schedule position, the topology, the
resolved config and the versions. A step folder without it is incomplete and never loaded.

Every object is written whole: locally to a temporary name, flushed and renamed; on S3 each PUT
(or multipart upload) lands entirely or not at all. Replacing a committed step (a run branched
from an older checkpoint) writes new file names beside the old ones, commits by replacing the
metadata, and only then deletes the old files — no committed checkpoint is lost before a newer
one is committed. Endpoint and credentials come from the standard AWS environment
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID …) and are never written anywhere.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import secrets
import warnings

import attrs
import torch
from nanoflow.io.store import Store, StoreError
from nanoflow.io.tensorfile import TensorFileError, new_checksum, parse, tensor_chunks

METADATA = "checkpoint_metadata.json"
CHECKSUM = "xxh3_128"  # the per-file checksum recorded in the metadata
LATEST = "latest.txt"
FORMAT = "nanoflow-checkpoint/1"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, damaged, or not what was asked for."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped in favour of an older intact one."""


def _read(store: Store, relative: str) -> bytes:
    try:
        return store.read(relative)
    except StoreError as e:
        raise CheckpointError(str(e)) from e


# ---------------------------------------------------------------------------------------------
# Finding committed checkpoints

def _step_of(name: str) -> int | None:
    return int(name) if name.isdigit() else None


def latest(path: str) -> str | None:
    """The newest intact committed step folder of a run folder, or the step folder itself; None if there is none.

    latest.txt is followed when it names an intact checkpoint; otherwise the newest intact one is
    taken, with a CheckpointWarning naming what was skipped.
    """
    store = Store(path)
    if store.exists(METADATA):  # a step folder
        _check_files(store, _read_metadata(store, ""), "")
        return store.root
    return _first_usable(store, lambda folder: folder)


def _first_usable(store: Store, use):
    """`use(folder)` of the first committed step that is intact and usable, latest.txt's first, then newest first."""
    pointer = _latest_pointer(store)
    steps = sorted((s for s in map(_step_of, store.folders()) if s is not None), reverse=True)
    skipped = []
    for step in ([pointer] if pointer is not None else []) + [s for s in steps if s != pointer]:
        try:
            _check_files(store, _read_metadata(store, str(step)), str(step))
            result = use(store.url(str(step)))
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        if skipped:
            warnings.warn(f"{store.root}: resuming from step {step}; skipped: " + "; ".join(skipped),
                          CheckpointWarning, stacklevel=3)
        return result
    if skipped:
        warnings.warn(f"{store.root}: no intact checkpoint; skipped: " + "; ".join(skipped), CheckpointWarning,
                      stacklevel=3)
    return None


def _latest_pointer(store: Store) -> int | None:
    if not store.exists(LATEST):
        return None
    text = _read(store, LATEST).decode(errors="replace").strip()
    if not text.isdigit():
        warnings.warn(f"{store.url(LATEST)} holds {text[:40]!r}, not a step number; ignoring it",
                      CheckpointWarning, stacklevel=3)
        return None
    return int(text)


def _read_metadata(store: Store, folder: str) -> dict:
    relative = f"{folder}/{METADATA}" if folder else METADATA
    if not store.exists(relative):
        raise CheckpointError(f"{store.url(folder)} is incomplete (no {METADATA})")
    try:
        meta = json.loads(_read(store, relative))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{store.url(relative)} is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{store.url(relative)} is not a {FORMAT} checkpoint")
    return meta


def _check_files(store: Store, meta: dict, folder: str) -> None:
    """Cheap integrity check: every listed file is present with its recorded size (hashes are checked on read)."""
    for name, entry in meta["files"].items():
        size = store.size(f"{folder}/{name}" if folder else name)
        if size != entry["bytes"]:
            state = "missing" if size is None else f"{size} bytes, expected {entry['bytes']}"
            raise CheckpointError(f"{store.url(folder)}: {name} is {state}")


def read_metadata(path: str) -> dict:
    """The metadata of a step folder, or of the latest intact checkpoint of a run folder."""
    folder = _require(path)
    return _read_metadata(Store(folder), "")


def _require(path: str) -> str:
    folder = latest(path)
    if folder is None:
        raise CheckpointError(f"{path} holds no committed checkpoint")
    return folder


# ---------------------------------------------------------------------------------------------
# Writing

@attrs.frozen
class Block:
    """One rank's piece of a tensor: `data` sits at `offset` inside a tensor of global `shape`."""

    data: torch.Tensor
    shape: tuple[int, ...]
    offset: tuple[int, ...]

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> Block:
        return cls(tensor, tuple(tensor.shape), (0,) * tensor.dim())


def save_checkpoint(root: str, step: int, groups: dict[str, dict[str, Block | torch.Tensor]], info: dict, *,
                    keep: int | None = None, topology=None) -> str:
    """Commit `groups` ({"model": {...}, "optimizer": {...}, "rng": {...}}) as step `step` under `root`.

    Called on every rank with the blocks that rank owns (plain tensors are whole blocks); each rank
    writes its own files, rank 0 writes the metadata — the commit — then latest.txt. Returns the
    step folder. `info` goes into the metadata as is (schedule position, config …).
    """
    from nanoflow.parallel import SINGLE, barrier, broadcast_object, gather_objects

    topology = topology or SINGLE
    store, folder = Store(root), str(step)
    # Beside a committed step, write under fresh names so it stays loadable until the new metadata lands.
    suffix = broadcast_object(f".{secrets.token_hex(4)}" if topology.is_main and store.exists(
        f"{folder}/{METADATA}") else "", topology)
    files, index = {}, {}
    for group, tensors in groups.items():
        blocks = {k: v if isinstance(v, Block) else Block.whole(v) for k, v in tensors.items()}
        if not blocks:
            continue
        name = f"{group}/rank{topology.rank:05d}{suffix}.safetensors"
        checksum = new_checksum()
        size = store.write(f"{folder}/{name}", tensor_chunks({k: b.data for k, b in blocks.items()}), checksum)
        files[name] = {"bytes": size, CHECKSUM: checksum.hexdigest()}
        index[group] = {k: {"shape": list(b.shape), "dtype": str(b.data.dtype).removeprefix("torch."),
                            "shards": [{"file": name, "key": k, "offset": list(b.offset),
                                        "shape": list(b.data.shape)}]} for k, b in blocks.items()}
    gathered = gather_objects((files, index), topology)
    if topology.is_main:
        files, index = {}, {}
        for rank_files, rank_index in gathered:
            files.update(rank_files)
            for group, entries in rank_index.items():
                for k, entry in entries.items():
                    index.setdefault(group, {}).setdefault(k, {**entry, "shards": []})["shards"] += entry["shards"]
        meta = {
            "format": FORMAT,
            "step": step,
            "files": files,
            "tensors": index,
            **info,
            "versions": {"nanoflow": _nanoflow_version(), "torch": torch.__version__,
                         "python": platform.python_version()},
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        store.write(f"{folder}/{METADATA}", json.dumps(meta, indent=1).encode())   # the commit
        store.write(LATEST, f"{step}\n".encode())
        # Now that the new metadata is committed: the replaced step's files, and any left by a killed write.
        listed = {f"{folder}/{name}" for name in files} | {f"{folder}/{METADATA}"}
        store.delete([f for f in store.files(folder) if f not in listed])
        _retain(store, keep, step)
    barrier(topology)  # no rank runs ahead of a save that has not committed
    return store.url(folder)


def _retain(store: Store, keep: int | None, newest: int) -> None:
    """Delete incomplete step folders, and committed ones beyond the `keep` newest (never the one latest.txt names)."""
    steps = [s for s in map(_step_of, store.folders()) if s is not None]
    committed = [s for s in steps if store.exists(f"{s}/{METADATA}")]
    doomed = [s for s in steps if s not in committed]
    if keep is not None:
        doomed += [s for s in sorted(committed, reverse=True)[keep:] if s != newest]
    store.delete([name for name in store.root_files() if name.startswith(f"{LATEST}.tmp-")])  # left by a kill
    for step in doomed:
        # The marker goes first, so a folder half-deleted by a crash reads as incomplete, never as damaged data.
        files = store.files(str(step))
        marker = f"{step}/{METADATA}"
        store.delete([f for f in files if f == marker])
        store.delete([f for f in files if f != marker])
        store.remove_empty_folder(str(step))


def _nanoflow_version() -> str:
    from nanoflow import __version__
    return __version__


# ---------------------------------------------------------------------------------------------
# Reading

class CheckpointReader:
    """One committed step folder. Reads any box of any saved tensor, loading only the files that
    hold part of it; every file is checked against its recorded size and checksum when loaded."""

    def __init__(self, folder: str):
        self.store = Store(folder)
        self.path = self.store.root
        self.metadata = _read_metadata(self.store, "")
        self._files: dict[str, dict[str, torch.Tensor]] = {}

    def names(self, group: str) -> list[str]:
        return list(self._entries(group))

    def shape(self, group: str, name: str) -> tuple[int, ...]:
        return tuple(self._entries(group)[name]["shape"])

    def read(self, group: str, name: str, offset=None, shape=None) -> torch.Tensor:
        """The box [offset, offset + shape) of tensor `name` (the whole tensor by default).

        A box saved exactly as asked comes back as a view of the file's buffer; copy it before writing to it.
        """
        entry = self._entries(group).get(name)
        if entry is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in its {group} group")
        shape = tuple(entry["shape"]) if shape is None else tuple(shape)
        offset = (0,) * len(shape) if offset is None else tuple(offset)
        if len(shape) != len(entry["shape"]) or any(o + n > m for o, n, m in zip(offset, shape, entry["shape"])):
            raise CheckpointError(f"{self.path}: {group} tensor {name} has shape {entry['shape']}; the box at "
                                  f"{list(offset)} of shape {list(shape)} does not fit it")
        for shard in entry["shards"]:
            if tuple(shard["offset"]) == offset and tuple(shard["shape"]) == shape:  # saved as asked: no copy
                return self._load(shard["file"])[shard["key"]]
        box, covered = torch.empty(shape, dtype=getattr(torch, entry["dtype"])), 0
        for shard in entry["shards"]:
            lo = [max(o, so) for o, so in zip(offset, shard["offset"])]
            hi = [min(o + n, so + sn) for o, n, so, sn in zip(offset, shape, shard["offset"], shard["shape"])]
            if any(l >= h for l, h in zip(lo, hi)):
                continue
            block = self._load(shard["file"])[shard["key"]]
            source = tuple(slice(l - so, h - so) for l, h, so in zip(lo, hi, shard["offset"]))
            target = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offset))
            box[target] = block[source]
            covered += math.prod(h - l for l, h in zip(lo, hi))
        if covered != box.numel():
            raise CheckpointError(f"{self.path}: the saved shards of {group} tensor {name} do not cover "
                                  f"the box at {list(offset)} of shape {list(shape)}")
        return box

    def verify(self) -> CheckpointReader:
        """Load and check every file now, so a damaged checkpoint is found before anything uses it."""
        for name in self.metadata["files"]:
            self._load(name)
        return self

    def _entries(self, group: str) -> dict:
        entries = self.metadata["tensors"].get(group)
        if entries is None:
            raise CheckpointError(f"{self.path}: the checkpoint has no {group!r} tensors")
        return entries

    def _load(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._files:
            expected = self.metadata["files"].get(name)
            if expected is None:
                raise CheckpointError(f"{self.path}: {name} is not listed in {METADATA}")
            data = _read(self.store, name)
            checksum = new_checksum()
            checksum.update(data)
            if len(data) != expected["bytes"] or checksum.hexdigest() != expected[CHECKSUM]:
                raise CheckpointError(f"{self.store.url(name)} is damaged (size or checksum differs from {METADATA})")
            try:
                self._files[name] = parse(data, self.store.url(name))
            except (TensorFileError, KeyError, RuntimeError) as e:
                raise CheckpointError(f"{self.store.url(name)} is not a readable safetensors file: {e}") from None
        return self._files[name]


def open_checkpoint(path: str, *, verify: bool = True) -> CheckpointReader:
    """A reader of a step folder, or of the latest intact checkpoint of a run folder.

    With `verify`, every file is checked up front, and in a run folder a checkpoint found damaged
    is skipped for the next older intact one (with a CheckpointWarning).
    """
    store = Store(path)
    if store.exists(METADATA):
        reader = CheckpointReader(store.root)
        return reader.verify() if verify else reader
    reader = _first_usable(store, lambda folder: CheckpointReader(folder).verify() if verify
                           else CheckpointReader(folder))
    if reader is None:
        raise CheckpointError(f"{path} holds no intact committed checkpoint")
    return reader


@attrs.frozen
class Checkpoint:
    path: str                                   # the step folder
    metadata: dict
    groups: dict[str, dict[str, torch.Tensor]]  # full tensors by group and HF name


def read_checkpoint(path: str, groups: tuple[str, ...] = ("model", "optimizer", "rng")) -> Checkpoint:
    """Full tensors of a step folder (or of the latest intact checkpoint of a run folder), from any layout."""
    reader = open_checkpoint(path)
    return Checkpoint(reader.path, reader.metadata,
                      {group: {name: reader.read(group, name) for name in reader.names(group)} for group in groups})


def read_model(path: str) -> dict[str, torch.Tensor]:
    """Full weights by HF name, from a run folder (its latest intact checkpoint) or a step folder, any layout."""
    reader = open_checkpoint(path)
    return {name: reader.read("model", name) for name in reader.names("model")}
