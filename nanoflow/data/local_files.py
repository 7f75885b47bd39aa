"""Local data files as `datasets` reads them (a stage's files, bin/prepare's inputs, compressed or not): loaded
whole, or just their first row (what --plan reads), and, when `datasets` cannot read them, what is wrong, named by
file and line — never a traceback, never "is it a binary file?" for a compressed file."""

from __future__ import annotations

import errno
import json

from nanoflow.config.locations import COMPRESSIONS, compression_of
from nanoflow.data.tokens import StageDataError


def _shown(files: list[str] | tuple[str, ...]) -> str:
    return ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def load_files(builder: str, files, where: str | None = None, error: type[Exception] = StageDataError, **options):
    """datasets.load_dataset(builder, data_files=files, **options), for a stage's files and bin/prepare's inputs
    alike: what stops it is an `error` whose message (after `where: `, when given) names the file and the cause —
    a file that cannot be read, a bad line, a compressed file whose codec is missing — never a traceback."""
    import datasets

    try:
        return datasets.load_dataset(builder, data_files=list(files), **options)
    except Exception as e:  # noqa: BLE001 - `datasets` raises many kinds here; name the file and line instead
        raise _files_error(e, builder, files, where, error, options.get("cache_dir")) from None


def first_row(builder: str, files, where: str, **options) -> dict | None:
    """The first row `datasets` reads from local files (streaming: nothing else is read, nothing is cached), None
    when they hold none; a StageDataError as load_files raises it when they cannot be read."""
    import datasets

    try:
        return next(iter(datasets.load_dataset(builder, data_files=list(files), streaming=True, **options)), None)
    except Exception as e:  # noqa: BLE001 - as in load_files
        raise _files_error(e, builder, files, where, StageDataError, None) from None


def _files_error(e: Exception, builder: str, files, where: str | None, error: type[Exception],
                 cache_dir: str | None) -> BaseException:
    """The error to raise for `e`, raised by `datasets` reading local files: the stop signal it wrapped, if any, else
    `error` naming the file and the cause."""
    import datasets

    stop = _stop_within(e)
    if stop is not None:   # a Ctrl-C or stop signal that came before the first row, wrapped by `datasets`
        return stop
    prefix = f"{where}: " if where else ""
    problem = next(filter(None, (file_problem(path, builder) for path in files)), None)
    full = None if problem else _disk_error(e)
    if full is not None:   # the files are fine: it is `datasets`' own cache that cannot be written
        cache = cache_dir or str(datasets.config.HF_DATASETS_CACHE)
        return error(
            f"{prefix}`datasets` cannot write its cache under {cache} ({full.strerror or full}"
            + (f": {full.filename}" if full.filename else "") + "); the data files are fine: free space "
            "there, or set HF_DATASETS_CACHE to a folder with room")
    return error(prefix + (problem or f"{_shown(list(files))}: cannot be read: {type(e).__name__}: {e}"))


def _stop_within(error: BaseException) -> BaseException | None:
    """The KeyboardInterrupt or stop signal (a BaseException that is no Exception) `error` was raised over, if any:
    `datasets` turns one that interrupts a split before its first row into a DatasetGenerationError."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if not isinstance(error, Exception):
            return error
        error = error.__cause__ or error.__context__
    return None


# A write that failed for want of room or permission, not because of what was written.
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def _disk_error(error: BaseException) -> OSError | None:
    """The OSError of a full (or read-only) disk behind `error`, which `datasets` wraps in its own exceptions."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _DISK_ERRNOS:
            return error
        error = error.__cause__ or error.__context__
    return None


_COMPRESSION_NAMES = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "Zstandard", ".lz4": "LZ4"}


def _decompressed(path: str) -> tuple[bytes | None, str | None]:
    """(the bytes of a local file, decompressed as `datasets` decompresses it, None) or (None, why it cannot be)."""
    compression = compression_of(path)
    kind = _COMPRESSION_NAMES.get(compression)
    try:
        if compression is None:
            with open(path, "rb") as f:
                return f.read(), None
        if compression in (".gz", ".bz2", ".xz"):
            import bz2
            import gzip
            import lzma

            opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}[compression]
            with opener(path, "rb") as f:
                return f.read(), None
        package = COMPRESSIONS[compression]
        try:
            module = __import__(package)
        except ImportError:
            return None, (f"{path}: a {kind} file; reading it needs the {package} package, which is not "
                          f"installed: pip install {package}")
        with open(path, "rb") as f:
            if package == "zstandard":
                with module.ZstdDecompressor().stream_reader(f) as reader:
                    return reader.read(), None
            import lz4.frame

            return lz4.frame.decompress(f.read()), None
    except OSError as e:
        if e.errno is not None:   # the file itself (no permission, …)
            return None, f"{path}: cannot be read: {e.strerror or e}"
        return None, f"{path}: not a readable {kind} file ({e})"
    except Exception as e:  # noqa: BLE001 - each codec's own error for a damaged stream (EOFError, zlib.error, …)
        return None, f"{path}: not a readable {kind} file ({type(e).__name__}: {e})"


def file_problem(path: str, builder: str) -> str | None:
    """What makes a local text or JSON file unreadable — compressed or not —, naming the file and the line; None if
    nothing is found."""
    data, problem = _decompressed(path)
    if problem is not None:
        return problem
    if builder not in ("text", "json"):
        return None
    if not data.strip():
        return f"{path}: the file is empty" + (" (no JSON rows)" if builder == "json" else "")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return f"{path}, line {line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); is it a binary file?"
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        return f"{path}, line {line}: a NUL byte; this is a binary file, not text"
    if builder == "json":
        try:
            json.loads(text)
            return None   # one JSON document (a list of rows, or a table of columns)
        except ValueError:
            pass
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return f"{path}, line {number}, column {e.colno}: not valid JSON: {e.msg}"
            if not isinstance(row, dict):
                return f"{path}, line {number}: a JSON {type(row).__name__}, expected an object (one row per line)"
    return None
