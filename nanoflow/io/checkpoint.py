"""Checkpoints: the layout, finding the committed ones, and writing them (reader.py reads them back).

Layout (nanotron's, with a commit marker):

    <run>/latest.txt                        "300", written last, after the step is committed
    <run>/300/.nanoflow-save                written FIRST: this folder is a save of nanoflow's
    <run>/300/model/rank00000.safetensors   weights by HF name: this rank's block of each tensor
    <run>/300/optimizer/rank00000.safetensors  AdamW moments and step counts, by the same names
    <run>/300/checkpoint_metadata.json      written LAST: the commit marker, sealed (marker.py)

The metadata lists every file with its size and the XXH3-128 checksum of its header, every tensor
with its global shape and the boxes (file, key, offset, shape, XXH3-128 of its bytes) it was written
in, the schedule position, the topology, the resolved config and the versions, and carries its own
checksum. A step folder without it is incomplete and never loaded.

Every object is written whole: locally to a temporary name, flushed and renamed; on S3 each PUT
(or multipart upload) lands entirely or not at all. Replacing a committed step (a run branched
from an older checkpoint) writes new file names beside the old ones, commits by replacing the
metadata, and only then deletes the old files — no committed checkpoint is lost before a newer
one is committed. nanoflow deletes only what it provably wrote: files with its own names, inside
step folders that hold its .nanoflow-save marker (and latest.txt's temporaries); a folder of the
user's inside the run folder, or a file of the user's inside a step folder, is never touched.
Endpoint and credentials come from the standard AWS environment and are never written anywhere.
"""

from __future__ import annotations

import datetime
import logging
import platform
import secrets

import attrs
import torch

from nanoflow.io.files import refuse_link
from nanoflow.io.marker import (
    CHECKSUM,
    FORMAT,
    METADATA,
    CheckpointError,
    DamagedCheckpointError,
    _digest,
    check_metadata,
    committed_at,
    read_marker,
    sealed,
    step_of,
)
from nanoflow.io.retention import LATEST, SAVE_MARKER, plan_clean_up, saves, step_folders
from nanoflow.io.store import Store, StoreError
from nanoflow.io.tensorfile import tensor_chunks
from nanoflow.version import __version__

log = logging.getLogger(__name__)

__all__ = ["CHECKSUM", "FORMAT", "LATEST", "METADATA", "SAVE_MARKER", "Block", "CheckpointError",
           "DamagedCheckpointError", "checkpoints_to_try", "commit", "first_readable", "latest", "new_save",
           "no_intact_checkpoint",
           "read_metadata", "save_checkpoint", "write_files"]



# ---------------------------------------------------------------------------------------------
# Finding committed checkpoints

def latest(path: str) -> str | None:
    """The committed step folder a run folder resumes from (or the step folder itself); None if there is none.

    That is the most recently committed intact checkpoint; see checkpoints_to_try. Only sizes are
    checked here; checksums of the tensor files are checked as their bytes are read.
    """
    folders = checkpoints_to_try(path)
    return folders[0] if folders else None


def checkpoints_to_try(path: str) -> list[str]:
    """The committed step folders of a run folder whose marker checks out and whose files are all there,
    in the order to try them: the most recently committed first (a logged warning names any skipped,
    and a latest.txt that names another). None for a folder with nothing committed; committed
    checkpoints none of which is intact are an error, never "none". For a step folder: just it, or a
    CheckpointError saying what is wrong with it. Storage that cannot be listed is a CheckpointError."""
    try:
        return _checkpoints_to_try(Store(path))
    except StoreError as e:
        raise CheckpointError(str(e)) from e


def _checkpoints_to_try(store: Store) -> list[str]:
    if store.exists(METADATA):  # a step folder
        _check_files(store, read_marker(store, "", store.root), "")
        return [store.root]
    objects = store.objects()
    pointer = _latest_pointer(store, objects)
    found, skipped, damaged = {}, [], False
    for step in sorted(step_folders(objects), reverse=True):
        folder = str(step)
        if f"{folder}/{METADATA}" not in objects:
            if f"{folder}/{SAVE_MARKER}" in objects:  # a save of nanoflow's that never committed
                skipped.append(f"{store.url(folder)} is incomplete (no {METADATA})")
            continue  # (not nanoflow's: none of its business)
        try:
            meta = read_marker(store, folder)
            _check_files(store, meta, folder, objects)
            found[step] = committed_at(meta)
            _remember(store, folder, objects[f"{folder}/{METADATA}"][1], found[step])
        except CheckpointError as e:
            skipped.append(str(e))
            damaged |= isinstance(e, DamagedCheckpointError)
    # Commit order, not step order: after a --fresh start or a resume from an older step, the higher steps
    # of the abandoned history come after the new run's own.
    order = sorted(found, key=lambda s: (found[s], s), reverse=True)
    if pointer is not None and order and pointer != order[0]:
        skipped.append(f"{store.url(LATEST)} names step {pointer}, but " + (
            f"step {order[0]} was committed after it (a save stopped between its commit and {LATEST})"
            if pointer in found else f"step {pointer} is no intact committed checkpoint"))
    # Committed once (a damaged marker, or latest.txt naming a step: a sync that dropped every *.json), so never
    # treated as "nothing here": a fresh start over it would delete the old tensor files as an unfinished save's.
    if (damaged or pointer is not None) and not found:
        said = f" ({store.url(LATEST)} names step {pointer})" if pointer is not None else ""
        raise DamagedCheckpointError(f"{store.root} holds committed checkpoints{said}, but none is intact: "
                                     + ("; ".join(skipped) or "no step folder of theirs is left"))
    if skipped:
        heading = f"using {store.url(str(order[0]))}" if order else "no intact checkpoint"
        log.warning(f"{store.root}: {heading}; skipped: " + "; ".join(skipped))
    return [store.url(str(s)) for s in order]


def first_readable(path: str, use):
    """use(folder) for the first of checkpoints_to_try(path) it succeeds on: one found damaged while `use` reads
    it (DamagedCheckpointError) gives way to the next, and one logged warning names those passed over. A step
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
            log.warning(f"{Store(path).root}: using {folder}; skipped: " + "; ".join(damaged))
        return result
    raise no_intact_checkpoint(path, damaged)


def no_intact_checkpoint(path: str, damaged: list[str]) -> DamagedCheckpointError:
    """The error of a run folder none of whose committed checkpoints reads back intact (`damaged`: why each not)."""
    return DamagedCheckpointError(f"{path}: no checkpoint reads back intact: " + "; ".join(damaged))


def _latest_pointer(store: Store, objects: dict) -> int | None:
    if LATEST not in objects:
        return None
    try:
        text = store.read(LATEST).decode(errors="replace").strip()
    except StoreError as e:
        log.warning(f"ignoring {LATEST}: {e}")
        return None
    step = step_of(text)
    if step is None:
        log.warning(f"{store.url(LATEST)} holds {text[:40]!r}, not a step number; ignoring it")
    return step


def _check_files(store: Store, meta: dict, folder: str, objects: dict | None = None) -> None:
    """Cheap integrity check: every listed file is present with its recorded size (hashes are checked on read)."""
    for name, entry in meta["files"].items():
        relative = f"{folder}/{name}" if folder else name
        size = store.size(relative) if objects is None else objects.get(relative, (None,))[0]
        if size != entry["bytes"]:
            state = "missing" if size is None else f"{size} bytes, not the {entry['bytes']} recorded"
            raise DamagedCheckpointError(f"{store.url(folder)}: {name} is {state}")


def read_metadata(path: str) -> dict:
    """The metadata of a step folder, or of the checkpoint a run folder resumes from."""
    folder = latest(path)
    if folder is None:
        raise CheckpointError(f"{path} holds no committed checkpoint")
    return read_marker(Store(folder), "", folder)


# When each marker seen in this process was committed, by (its url, its store stamp): a save reads only the
# markers it has not seen, so it costs the same requests whatever the number of checkpoints kept.
_COMMITTED: dict[tuple[str, str], datetime.datetime] = {}


def _remember(store: Store, folder: str, stamp: str, when: datetime.datetime) -> None:
    _COMMITTED[(store.url(f"{folder}/{METADATA}"), stamp)] = when


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
                    keep: int | None = None) -> str:
    """Commit `groups` ({"model": {...}, "optimizer": {...}}) as step `step` under `root`, from one process.

    Plain tensors are whole blocks. `info` goes into the metadata as is (schedule position, config …);
    its "training" record says how many steps were completed (`step`). Returns the step folder. A
    cleanup that fails after the commit is a logged warning: the commit stands. With several
    ranks, nanoflow.checkpoint.checkpointer runs the three phases below with the collectives between them.
    """
    _check_info(step, info)
    suffix = new_save(root, step, groups)
    return commit(root, step, [write_files(root, step, groups, suffix, rank=0)], info, keep=keep)


def _check_info(step: int, info: dict) -> None:
    if info.get("training", {}).get("completed") != step:
        raise ValueError(f'info["training"]["completed"] must be the step saved ({step})')


def new_save(root: str, step: int, groups=()) -> str:
    """Phase 1, on one rank (0): mark step `step`'s folder as a save of nanoflow's; the suffix every rank's
    file names take (beside a committed step, fresh names, so that it stays loadable until the new
    metadata lands). A group folder (`groups`: model, optimizer …) that is a link is refused here, before any
    rank writes (every rank's writer refuses it too: nanoflow.io.files)."""
    store, folder = Store(root), str(step)
    if store.is_link(folder):
        raise CheckpointError(f"{store.url(folder)} is a symlink nanoflow did not make: refusing to write step {step} "
                              "through it; move that step folder back (or away) and run again")
    for group in groups:
        if store.is_link(f"{folder}/{group}"):
            refuse_link(store.url(f"{folder}/{group}"))
    suffix = f".{secrets.token_hex(4)}" if store.exists(f"{folder}/{METADATA}") else ""
    store.write(f"{folder}/{SAVE_MARKER}", f"a save of step {step} by nanoflow\n".encode())
    return suffix


def write_files(root: str, step: int, groups: dict[str, dict[str, Block | torch.Tensor]], suffix: str,
                rank: int) -> tuple[dict, dict]:
    """Phase 2, on every rank: write this rank's blocks, one file per group; (files, index) for commit."""
    store, folder = Store(root), str(step)
    files, index = {}, {}
    for group, tensors in groups.items():
        blocks = {k: v if isinstance(v, Block) else Block.whole(v) for k, v in tensors.items()}
        if not blocks:
            continue
        name = f"{group}/rank{rank:05d}{suffix}.safetensors"
        header, data = tensor_chunks({k: b.data for k, b in blocks.items()})
        size = store.write(f"{folder}/{name}", [header, *data.values()])
        # A checksum for the header and one for each shard (rather than one for the file): a reader of
        # only some shards checks every byte it uses, and a reader of all of them checks the whole file.
        files[name] = {"bytes": size, "header_" + CHECKSUM: _digest(header)}
        index[group] = {k: {"shape": list(b.shape), "dtype": str(b.data.dtype).removeprefix("torch."),
                            "shards": [{"file": name, "key": k, "offset": list(b.offset), "shape": list(b.data.shape),
                                        CHECKSUM: _digest(data[k])}]} for k, b in blocks.items()}
    return files, index


def commit(root: str, step: int, gathered: list[tuple[dict, dict]], info: dict, *, keep: int | None = None) -> str:
    """Phase 3, on one rank (0), once every rank's write_files has returned (`gathered`, in rank order):
    write the metadata — the commit — then latest.txt, and clean up. Returns the step folder."""
    _check_info(step, info)
    store, folder = Store(root), str(step)
    files, index = {}, {}
    for rank_files, rank_index in gathered:
        files.update(rank_files)
        for group, entries in rank_index.items():
            for k, entry in entries.items():
                index.setdefault(group, {}).setdefault(k, {**entry, "shards": []})["shards"] += entry["shards"]
    created = datetime.datetime.now(datetime.timezone.utc)
    meta = {
        "format": FORMAT,
        "step": step,
        "files": files,
        "tensors": index,
        **info,
        "versions": {"nanoflow": __version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "created": created.isoformat(timespec="microseconds"),
    }
    body = sealed(meta)
    check_metadata(body, store.url(f"{folder}/{METADATA}"), folder)  # what is committed must read back
    objects = store.objects()  # every rank has written: what was there before the commit, to clean up after it
    store.write(f"{folder}/{METADATA}", body)   # the commit
    _remember(store, folder, store.written_stamp(f"{folder}/{METADATA}", body), created)
    try:
        store.write(LATEST, f"{step}\n".encode())
        _clean_up(store, objects, folder, {*files, METADATA, SAVE_MARKER}, keep)
    except StoreError as e:
        log.warning(f"step {step} is committed, and stands; but cleaning up after it failed: {e}")
    return store.url(folder)


def _clean_up(store: Store, objects: dict, newest: str, written: set[str], keep: int | None) -> None:
    """After `newest` committed, carry out retention.plan_clean_up against the store (`objects`: its listing
    from just before the commit)."""
    step = int(newest)
    ours = saves(objects)
    # A step folder moved elsewhere and linked back is read and resumed from, but nothing is deleted through the link
    linked = {s for s in ours if s != step and store.is_link(str(s))}
    times = None
    if keep is not None:
        times = _commit_times(store, objects, [s for s, names in ours.items() if METADATA in names and s != step])
    plan = plan_clean_up(objects, step, written, keep, linked=linked, committed_at=times)
    for s in plan.left_linked:
        log.warning(f"{store.url(str(s))} is due for deletion but is a symlink: left as it is (nanoflow deletes "
                    "nothing through a link it did not make)")
    store.delete(list(plan.stray))
    # S3 parts of a killed save (every rank of this one has finished writing); nothing of another run's.
    store.abort_unfinished_uploads(lambda path: path == LATEST or step_of(path.partition("/")[0]) is not None)
    for batch in (plan.markers, plan.files, plan.save_markers):
        store.delete(list(batch))
    for s in plan.doomed:
        store.remove_empty_folder(str(s))


_NEVER = datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)


def _commit_times(store: Store, objects: dict, steps: list[int]) -> dict[int, datetime.datetime] | None:
    """When each of `steps` was committed; _NEVER (the first to go) for a marker that is damaged. None when
    one cannot be read now, so that nothing is deleted on a guess. Markers seen before are not read again."""
    times = {}
    for step in steps:
        key = (store.url(f"{step}/{METADATA}"), objects[f"{step}/{METADATA}"][1])
        if key not in _COMMITTED:
            try:
                _COMMITTED[key] = committed_at(read_marker(store, str(step)))
            except DamagedCheckpointError as e:
                if isinstance(e.__cause__, StoreError):
                    log.warning(f"{e}; deleting no old checkpoint this time")
                    return None
                _COMMITTED[key] = _NEVER
        times[step] = _COMMITTED[key]
    return times
