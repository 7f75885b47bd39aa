"""Checkpoints: the layout, finding the committed ones, and writing them (reader.py reads them back).

Layout (nanotron's, with a commit marker):

    <run>/latest.txt                        "300", written last, after the step is committed
    <run>/300/model/rank00000.safetensors   weights by HF name: this rank's block of each tensor
    <run>/300/optimizer/rank00000.safetensors  AdamW moments and step counts, by the same names
    <run>/300/rng/rank00000.safetensors     generator state (rank 0's)
    <run>/300/checkpoint_metadata.json      written LAST: the commit marker

The metadata lists every file with its size and the XXH3-128 checksum of its header, every tensor
with its global shape and the boxes (file, key, offset, shape, XXH3-128 of its bytes) it was written
in, the schedule position, the topology, the resolved config and the versions. A step folder
without it is incomplete and never loaded.

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
import platform
import secrets
import warnings

import attrs
import torch

from nanoflow.errors import NanoflowError
from nanoflow.io.store import Store, StoreError
from nanoflow.io.tensorfile import new_checksum, tensor_chunks

METADATA = "checkpoint_metadata.json"
CHECKSUM = "xxh3_128"  # recorded for each file's header and each shard's bytes: together, every byte of a file
LATEST = "latest.txt"
FORMAT = "nanoflow-checkpoint/2"   # 2: checksums per header and per shard (1: per file)


class CheckpointError(NanoflowError, RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, damaged, or not what was asked for."""


class DamagedCheckpointError(CheckpointError):
    """A committed checkpoint whose bytes cannot be read back as recorded: a file missing, short,
    unreadable, or not matching its checksum. An older intact checkpoint may be used instead."""


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
    """The committed step folder a run folder resumes from (or the step folder itself); None if there is none.

    latest.txt is followed when it names a checkpoint whose files are all there; otherwise the most
    recently committed such one is taken, with a CheckpointWarning naming what was skipped. Only
    sizes are checked here; checksums are checked as the bytes are read.
    """
    folders = checkpoints_to_try(path)
    return folders[0] if folders else None


def checkpoints_to_try(path: str) -> list[str]:
    """The committed step folders of a run folder whose files are all there, in the order to try
    them: latest.txt's first, then the most recently committed first (a CheckpointWarning names any
    skipped); none for a folder with nothing committed. Committed checkpoints none of which is
    intact are an error, never "none". For a step folder: just it, or a CheckpointError saying what
    is wrong with it."""
    store = Store(path)
    if store.exists(METADATA):  # a step folder
        _check_files(store, _read_metadata(store, ""), "")
        return [store.root]
    pointer = _latest_pointer(store)
    steps = sorted((s for s in map(_step_of, store.folders()) if s is not None), reverse=True)
    found, skipped, damaged = {}, [], False
    for step in ([pointer] if pointer is not None else []) + [s for s in steps if s != pointer]:
        try:
            meta = _read_metadata(store, str(step))
            _check_files(store, meta, str(step))
            found[step] = _committed_at(meta)
        except CheckpointError as e:
            skipped.append(str(e))
            damaged |= isinstance(e, DamagedCheckpointError)
    # latest.txt's, then the most recently committed: after a --fresh start or a resume from an older step,
    # the higher steps of the abandoned history come after the new run's own.
    found = [store.url(str(s)) for s in sorted(found, key=lambda s: (s == pointer, found[s], s), reverse=True)]
    if damaged and not found:  # committed once, so never treated as "nothing here" (a fresh start over it)
        raise DamagedCheckpointError(f"{store.root} holds committed checkpoints, but none is intact: "
                                     + "; ".join(skipped))
    if skipped:
        heading = f"using {found[0]}" if found else "no intact checkpoint"
        warnings.warn(f"{store.root}: {heading}; skipped: " + "; ".join(skipped), CheckpointWarning, stacklevel=3)
    return found


def first_readable(path: str, use):
    """use(folder) for the first of checkpoints_to_try(path) it succeeds on: one found damaged while
    `use` reads it (DamagedCheckpointError) gives way to the next, with a CheckpointWarning. A step
    folder named on its own has no next: its error is raised."""
    folders = checkpoints_to_try(path)
    if not folders:
        raise CheckpointError(f"{path} holds no intact committed checkpoint")
    damaged = []
    for folder in folders:
        try:
            result = use(folder)
        except DamagedCheckpointError as e:
            if len(folders) == 1:
                raise
            damaged.append(str(e))
            continue
        if damaged:
            warnings.warn(f"{Store(path).root}: using {folder}; skipped: " + "; ".join(damaged),
                          CheckpointWarning, stacklevel=3)
        return result
    raise DamagedCheckpointError(f"{path}: no checkpoint reads back intact: " + "; ".join(damaged))


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
        text = store.read(relative)
    except StoreError as e:  # committed, but not readable now: never to be taken for "nothing committed"
        raise DamagedCheckpointError(str(e)) from e
    try:
        meta = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:  # written whole and renamed: bad JSON is damage, never a torn write
        raise DamagedCheckpointError(f"{store.url(relative)} is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DamagedCheckpointError(f"{store.url(relative)} is not a {FORMAT} checkpoint")
    return meta


def _check_files(store: Store, meta: dict, folder: str) -> None:
    """Cheap integrity check: every listed file is present with its recorded size (hashes are checked on read)."""
    for name, entry in meta["files"].items():
        size = store.size(f"{folder}/{name}" if folder else name)
        if size != entry["bytes"]:
            state = "missing" if size is None else f"{size} bytes, expected {entry['bytes']}"
            raise DamagedCheckpointError(f"{store.url(folder)}: {name} is {state}")


def read_metadata(path: str) -> dict:
    """The metadata of a step folder, or of the checkpoint a run folder resumes from."""
    folder = latest(path)
    if folder is None:
        raise CheckpointError(f"{path} holds no committed checkpoint")
    return _read_metadata(Store(folder), "")


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
        header, data = tensor_chunks({k: b.data for k, b in blocks.items()})
        size = store.write(f"{folder}/{name}", [header, *data.values()])
        # A checksum for the header and one for each shard (rather than one for the file): a reader of
        # only some shards checks every byte it uses, and a reader of all of them checks the whole file.
        files[name] = {"bytes": size, "header_" + CHECKSUM: _digest(header)}
        index[group] = {k: {"shape": list(b.shape), "dtype": str(b.data.dtype).removeprefix("torch."),
                            "shards": [{"file": name, "key": k, "offset": list(b.offset), "shape": list(b.data.shape),
                                        CHECKSUM: _digest(data[k])}]} for k, b in blocks.items()}
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
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds"),
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
    """Delete incomplete step folders, and committed ones beyond the `keep` most recently committed (never
    `newest`, the one just committed). Commit order, not step order: the higher steps of an abandoned
    history (a --fresh start, a resume from an older step) go before the new run's own."""
    steps = [s for s in map(_step_of, store.folders()) if s is not None]
    committed = [s for s in steps if store.exists(f"{s}/{METADATA}")]
    doomed = [s for s in steps if s not in committed]
    if keep is not None:
        try:
            times = {s: _commit_time(store, s) for s in committed}
        except CheckpointError:  # a metadata file that cannot be read now: prune nothing this time
            times = None
        if times is not None:
            order = sorted(committed, key=lambda s: (s == newest, times[s], s), reverse=True)
            doomed += [s for s in order[keep:] if s != newest]
    store.delete([name for name in store.root_files() if name.startswith(f"{LATEST}.tmp-")])  # left by a kill
    try:  # S3 parts of a killed save (every rank of this one has finished writing); nothing of another run's
        store.abort_unfinished_uploads(lambda path: path == LATEST or _step_of(path.partition("/")[0]) is not None)
    except StoreError as e:  # the new checkpoint is committed: say so, and carry on
        warnings.warn(str(e), CheckpointWarning, stacklevel=3)
    for step in doomed:
        # The marker goes first, so a folder half-deleted by a crash reads as incomplete, never as damaged data.
        files = store.files(str(step))
        marker = f"{step}/{METADATA}"
        store.delete([f for f in files if f == marker])
        store.delete([f for f in files if f != marker])
        store.remove_empty_folder(str(step))


_NEVER = datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)


def _commit_time(store: Store, step: int) -> datetime.datetime:
    """When step was committed; _NEVER (the first to go) for metadata that reads back as damaged. Raises
    CheckpointError when it cannot be read at all, so that nothing is deleted on a guess."""
    try:
        return _committed_at(_read_metadata(store, str(step)))
    except DamagedCheckpointError as e:
        if isinstance(e.__cause__, StoreError):
            raise
        return _NEVER


def _committed_at(meta: dict) -> datetime.datetime:
    try:
        return datetime.datetime.fromisoformat(meta["created"])
    except (KeyError, TypeError, ValueError):
        return _NEVER


def _digest(data) -> str:
    checksum = new_checksum()
    checksum.update(data)
    return checksum.hexdigest()


def _nanoflow_version() -> str:
    from nanoflow import __version__
    return __version__
