"""The local run folder (checkpoints_path, or runs/s3/<bucket>/<prefix> for S3 checkpoints): checked at start-up, before any
checkpoint is read or any step trained, so a folder nanoflow cannot write is an error naming it (exit status 2)
rather than a traceback at the first save an hour in."""

from __future__ import annotations

import os
import shutil
import tempfile

from nanoflow.errors import RunFolderError


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

