"""The local run folder (checkpoints_path, or runs/s3/<bucket>/<prefix> for S3 checkpoints): checked at start-up, before any
checkpoint is read or any step trained, so a folder nanoflow cannot write is an error naming it (exit status 2)
rather than a traceback at the first save an hour in."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from nanoflow.errors import RunFolderError
from nanoflow.io.store import is_remote

S3_RECORDS = ("runs", "s3")   # an S3 run's local record folder: runs/s3/<bucket>/<prefix>, beside where it was run


def record_folder(checkpoints_path: str) -> Path:
    """The local folder of a run's records (metrics.jsonl, eval.jsonl, TensorBoard): checkpoints_path when it is
    local, else runs/s3/<bucket>/<prefix> here — keyed by the checkpoints' own place, so that two runs on S3
    never share a record, whatever their names (the prefix's parts are plain: config/checks.py refuses empty,
    "." and ".." ones)."""
    if not is_remote(checkpoints_path):
        return Path(checkpoints_path)
    return Path(*S3_RECORDS, *checkpoints_path.removeprefix("s3://").rstrip("/").split("/"))


def checkpoints_of_record(folder: str) -> list[str]:
    """The s3:// runs a local record folder (…/runs/s3/<bucket>/<prefix>) may keep the records of: one for each
    runs/s3 in its path, the outermost first (a prefix may itself hold runs/s3); none for any other folder."""
    parts = Path(os.path.abspath(folder)).parts
    return ["s3://" + "/".join(parts[i + 2:]) for i in range(len(parts) - 2) if parts[i:i + 2] == S3_RECORDS]


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def check_folder(path: str) -> None:
    """`path` is a folder, created when missing (before any checkpoint is read from it)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise RunFolderError(f"checkpoints.checkpoints_path = {path} is a file, not a folder; name a folder "
                             "(it is created when missing)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise RunFolderError(f"cannot create the run folder {path}: {_reason(e)}") from None


def check_room(path: str, needed: int = 0) -> None:
    """This process can create (and remove) a file in the folder `path`, which has room for `needed` more
    bytes: one more checkpoint, written whole before any older one goes."""
    try:
        handle, probe = tempfile.mkstemp(dir=path, prefix=".nanoflow-write-test-")
        os.close(handle)
        os.unlink(probe)
    except OSError as e:
        raise RunFolderError(f"cannot write into the run folder {path}: {_reason(e)} (a read-only file system, "
                             "or a folder of another user?)") from None
    free = shutil.disk_usage(path).free
    if free < needed:
        raise RunFolderError(f"{path}: {free:,} bytes free, but the next checkpoint needs about {needed:,}; free "
                             "some space (or set checkpoints.keep) and run the same command again")

