"""Local files, created or replaced whole and never through a link: the one way nanoflow writes a file.

`write_atomically(path, chunks, root=...)` writes the bytes under a new temporary name in the file's folder
(created with O_EXCL | O_NOFOLLOW, so nothing already there, a planted link included, is written through),
flushes and fsyncs them and renames the temporary over `path`. `root` is the folder the user named (a run
folder, an output folder), taken as it is, links and all; every folder below it on the way to the file is
opened without following a link (openat with O_NOFOLLOW, made when missing), and the file itself is refused
when it is a link. So a step folder's `model/` linked to a folder elsewhere, or a latest.txt, eval.jsonl or
config.json that is a link, stops the write with a LinkError naming it, before any byte goes anywhere.
`open_to_append` is the same rule for the records a run appends to (metrics.jsonl, eval.jsonl).

Checkpoints, latest.txt, exports, averages, eval.jsonl, figures and token folders all go through here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from nanoflow.errors import LinkError

_CHUNK = 64 << 20   # the most one write() writes


def write_atomically(path: str | os.PathLike, chunks, *, root: str | os.PathLike | None = None,
                     crash_point: bool = False) -> int:
    """Create or replace the local file `path` whole, from `chunks` (bytes, or buffers written one after the
    other), never through a link: under the temporary name PATH.tmp-<pid>, flushed, fsynced, renamed over
    `path`. The folders below `root` (the folder the user named, made when missing, taken as it is) down to the
    file are made when missing and must not be links; nor may `path` be one (LinkError). Without `root`, the
    file's folder must exist, and is taken as it is. Any failure removes the
    temporary again; only a killed process leaves one, which checkpoint cleanup and bin/prepare recognise by
    that name. Returns the bytes written. `crash_point`: checkpoint bytes, counted by NANOFLOW_KILL_AFTER_BYTES."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    chunks = _as_chunks(chunks)
    temporary = f"{name}.tmp-{os.getpid()}"
    with _opened_folder(folder or ".", root) as fd:
        handle = _create(os.path.join(folder, temporary), temporary, fd)
        try:
            with os.fdopen(handle, "wb") as f:
                size = _write_chunks(f, chunks, crash_point)
                f.flush()
                os.fsync(f.fileno())
            _refuse_link(path, name, fd)
            os.replace(temporary, name, src_dir_fd=fd, dst_dir_fd=fd)
            return size
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=fd)
            raise


def open_to_append(path: str | os.PathLike, *, binary: bool = False):
    """The local file `path` opened to read and append (created when missing), never through a link (LinkError);
    the caller closes it. Its folder is taken as it is (the run folder the user named)."""
    path = os.fspath(path)
    try:
        handle = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LinkError(_link_message(path, os.readlink(path) if os.path.islink(path) else None)) from None
        raise
    return os.fdopen(handle, "a+b") if binary else os.fdopen(handle, "a+", encoding="utf-8")


def refuse_link(path: str | os.PathLike) -> None:
    """LinkError when the local `path` is a symlink (a place nanoflow is about to write, or move a file to)."""
    path = os.fspath(path)
    if os.path.islink(path):
        raise LinkError(_link_message(path, os.readlink(path)))


def _link_message(path: str, target: str | None) -> str:
    to = f" (to {target})" if target is not None else ""
    return (f"{path} is a symlink{to} nanoflow did not make; it writes nothing through a link: move the link "
            "away (or name another place) and run again")


@contextlib.contextmanager
def _opened_folder(folder: str, root):
    """A descriptor of `folder`, reached from `root` one folder at a time without following a link, each made
    when missing; `root` itself is opened as named (made when missing). With no root, `folder` is opened as named
    and must exist."""
    if root is not None:
        os.makedirs(root, exist_ok=True)
    root = folder if root is None else os.fspath(root)
    below = os.path.relpath(folder, root)
    parts = [] if below == "." else below.split(os.sep)
    if ".." in parts:
        raise ValueError(f"{folder} is not inside {root}")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        reached = root
        for part in parts:
            reached = os.path.join(reached, part)
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, dir_fd=fd)
            try:
                inner = _open_entry(reached, part, fd, os.O_RDONLY | os.O_DIRECTORY)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    _refuse_link(reached, part, fd)
                raise
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


def _create(path: str, temporary: str, fd: int) -> int:
    """The temporary `path`, created new as the entry `temporary` of the folder open as `fd`: one left by a
    killed writer of the same pid is removed first; a link of that name is refused."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        return _open_entry(path, temporary, fd, flags)
    except FileExistsError:
        _refuse_link(path, temporary, fd)
        os.unlink(temporary, dir_fd=fd)
        return _open_entry(path, temporary, fd, flags)


def _open_entry(path: str, name: str, fd: int, flags: int) -> int:
    """os.open(path) without following a link at its end, once it is shown to be the entry `name` of the folder
    open as `fd`: the folders on its way were checked one by one, and one swapped for a link since then is
    caught here. (Opened by its path rather than relative to `fd`, so that what audits opens sees where.)"""
    handle = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        entry = os.stat(name, dir_fd=fd, follow_symlinks=False)
        opened = os.fstat(handle)
    except BaseException:
        os.close(handle)
        raise
    if (entry.st_dev, entry.st_ino) != (opened.st_dev, opened.st_ino):
        os.close(handle)
        raise LinkError(f"{path}: a folder on its way was replaced while nanoflow wrote it (by a link?); nothing "
                        "was written through it: check the folder and run again")
    return handle


def _refuse_link(path: str, name: str, fd: int) -> None:
    try:
        found = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(found.st_mode):
        raise LinkError(_link_message(path, os.readlink(name, dir_fd=fd)))


def _as_chunks(chunks):
    """One buffer (bytes, a memoryview, a numpy array: anything with the buffer protocol) as a list of it; else
    `chunks` itself, an iterable of buffers. A numpy array iterated would write its elements, a byte each."""
    try:
        memoryview(chunks)
    except TypeError:
        return chunks
    return [chunks]


def _write_chunks(f, chunks, crash_point: bool = True) -> int:
    size = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), _CHUNK):
            piece = view[start:start + _CHUNK]
            if crash_point:
                _crash_point(f, piece)
            f.write(piece)
        size += len(view)
    return size


# The checkpoint bytes this process wrote, for NANOFLOW_KILL_AFTER_BYTES. A fact of the process, not of a run: the
# variable is the process's, and the kill it plans counts every file the process writes, whatever run writes it.
_bytes_written = 0


def _crash_point(f, chunk: memoryview) -> None:
    """Fault injection for the kill -9 tests: with NANOFLOW_KILL_AFTER_BYTES=N, the process writes
    exactly N checkpoint bytes (counted across files) and then kills itself with SIGKILL."""
    global _bytes_written
    limit = os.environ.get("NANOFLOW_KILL_AFTER_BYTES")
    if limit is None:
        return
    allowed = int(limit) - _bytes_written
    if allowed < len(chunk):
        import signal
        f.write(chunk[:max(allowed, 0)])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    _bytes_written += len(chunk)
