"""Where a data source a config names lies, and whether it is there: the one definition that the check before
the run (config/data_checks.py) and the loader (nanoflow.data) both use, so that nothing the check accepts is refused
by the loader, and nothing the loader reads is refused by the check.

A source is local files read through a builder, a folder written by `save_to_disk`, a token folder, or a hub
dataset (which only loading it can find). Config loading has made every local path absolute (config/load.py),
so a name that is not absolute is a hub id. Nothing here reads data: it globs, stats and reads the small JSON
file `save_to_disk` writes beside the data.
"""

from __future__ import annotations

import glob
import json
import os

import attrs

BUILDERS = ("text", "json", "csv", "parquet", "arrow")   # HF datasets builders over local files
EXTENSION_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
TOKEN_SUFFIX = ".ds"                  # a token file, as datatrove and bin/prepare name them
SAVED_DICT = "dataset_dict.json"      # what `DatasetDict.save_to_disk` writes: {"splits": [...]}
SAVED_DATASET = "state.json"          # what `Dataset.save_to_disk` writes (beside dataset_info.json)
FILES_SPLIT = "train"                 # `datasets` puts a list of data files in this one split
NAME, FILES = "hf_dataset_or_datasets", "hf_data_files"   # the keys a problem is found in
NAME_MAX = 255                        # the longest file name, in bytes, where the file system does not say (POSIX)


def overlong_part(path: str) -> str | None:
    """Why `path` can name no file (the ENAMETOOLONG of every call that would look it up): a component longer than
    the file system of the folder it would be in allows, with that path shortened; None when there is none."""
    sizes = [(part, len(os.fsencode(part))) for part in path.split(os.sep)]
    longest = max(size for _, size in sizes)
    if longest <= NAME_MAX or longest <= (limit := _name_max(path)):
        return None
    shown = os.sep.join(part if size <= limit else f"{part[:12]}…" for part, size in sizes)
    return f"{shown}: a path component of {longest} bytes, longer than a file name can be ({limit} bytes at most)"


def _name_max(path: str) -> int:
    """The longest file name the file system under `path` takes (its nearest folder that exists), in bytes."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(folder) and folder != os.path.dirname(folder):
        folder = os.path.dirname(folder)
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):   # no pathconf (Windows), or no answer for this file system
        return NAME_MAX


def matching_files(pattern: str) -> list[str]:
    """The regular files a local path or glob (`**` allowed) matches: what a stage reads of it (a folder or a
    named pipe that matches is not read)."""
    return [path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path)]


def expand_data_files(patterns: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """Every file matched by the patterns, sorted and de-duplicated so the order is fixed."""
    if patterns is None:
        return []
    patterns = [patterns] if isinstance(patterns, str) else patterns
    return sorted({path for pattern in patterns for path in matching_files(pattern)})


# Compressions `datasets` decompresses file by file (by the suffix, as it reads `data_files`), with the package each
# needs beyond the standard library; the builder is then the inner name's (docs.jsonl.gz: json, row by row).
COMPRESSIONS = {".gz": None, ".bz2": None, ".xz": None, ".zst": "zstandard", ".lz4": "lz4"}
# Archives hold several files, which a stage names one by one: extracted, never read as one document.
ARCHIVES = (".zip", ".tar", ".tgz", ".tar.gz", ".tar.bz2", ".tar.xz", ".tar.zst", ".7z", ".rar")


def compression_of(path: str) -> str | None:
    """The compression suffix of a local file (".gz", ".zst" …), None for an uncompressed one."""
    suffix = os.path.splitext(path)[1].lower()
    return suffix if suffix in COMPRESSIONS else None


def archive_of(path: str) -> str | None:
    """The archive suffix of a local file (".zip", ".tar.gz" …), None for any other file."""
    return next((suffix for suffix in ARCHIVES if path.lower().endswith(suffix)), None)


def builder_for(path: str) -> str:
    """The `datasets` builder that reads a local file, by its extension — a compressed file's by the extension
    inside (docs.jsonl.gz: json) —; anything else is text."""
    if compression_of(path) is not None:
        path = os.path.splitext(path)[0]
    return EXTENSION_BUILDERS.get(os.path.splitext(path)[1].lower(), "text")


@attrs.frozen
class Location:
    """One HF source of a stage, as found on disk (or not)."""

    kind: str                        # "files", "saved" (a save_to_disk folder), "hub"
    builder: str | None = None       # for "files": the builder that reads them
    files: tuple[str, ...] = ()      # for "files": every file, sorted
    splits: tuple[str, ...] | None = None   # the splits it has, where the disk tells (None: unknown)
    # Why it cannot be read, as (config key, message) pairs; none: it is there (a hub id: as far as can be told).
    problems: tuple[tuple[str, str], ...] = ()

    def messages(self) -> list[str]:
        return [f"{key}: {message}" for key, message in self.problems]


def _no_file_problem(pattern: str) -> str:
    if (overlong := overlong_part(pattern)) is not None:
        return overlong
    if glob.glob(pattern, recursive=True):
        return f"{pattern} matches no file, only folders or other things that are not regular files"
    return f"{pattern} matches no file"


def saved_folder(folder: str) -> Location:
    """A folder named as an HF dataset: it must be one `save_to_disk` wrote (what `datasets.load_from_disk` reads)."""
    if os.path.isfile(os.path.join(folder, SAVED_DICT)):
        try:
            with open(os.path.join(folder, SAVED_DICT)) as f:
                splits = tuple(json.load(f)["splits"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            return Location("saved", problems=((NAME, f"{folder}: {SAVED_DICT} cannot be read "
                                                      f"({type(e).__name__}: {e})"),))
        return Location("saved", splits=splits)
    if os.path.isfile(os.path.join(folder, SAVED_DATASET)):
        return Location("saved")   # one table without named splits
    hint = (f"; it holds token files (*{TOKEN_SUFFIX}): name it in dataset_folder"
            if token_folder_problem(folder) is None
            else f"; to read the files in it, name them with a glob such as {os.path.join(folder, '*.txt')}")
    return Location("saved", problems=((NAME, f"{folder} is a folder, but not one written by save_to_disk (it has "
                                              f"neither {SAVED_DICT} nor {SAVED_DATASET}){hint}"),))


def locate(name: str, data_files=None, in_table: bool = False) -> Location:
    """Where the HF source `name` lies: the value of hf_dataset_or_datasets (with its hf_data_files), or a key of
    a {name = weight} table (`in_table`), where a local path or glob names the files themselves."""
    if name not in BUILDERS and (overlong := overlong_part(name)) is not None:   # no file, and no hub id either
        return Location("files", problems=((NAME, overlong),))
    if name in BUILDERS:
        if in_table:
            return Location("files", name, problems=((NAME, f'"{name}" needs files; in a table, name the files '
                                                            f'themselves (e.g. "corpus/*.txt" = 1.0)'),))
        if not data_files:
            return Location("files", name, problems=((FILES, f'the "{name}" builder needs hf_data_files'),))
        return _files(name, data_files, FILES)
    if os.path.isdir(name):
        return saved_folder(name)
    if not os.path.isabs(name):   # a hub id; its hf_data_files are still local, and none found is never "all"
        local = _files(None, data_files, FILES) if data_files else Location("files")
        return Location("hub", files=local.files, problems=local.problems)
    if not in_table:
        if matching_files(name):
            return Location("files", problems=((NAME, f"{name} names files: write hf_dataset_or_datasets = "
                                                      f'"{builder_for(name)}" and hf_data_files = "{name}" '
                                                      "(or a table)"),))
        return Location("files", problems=((NAME, f"{name} does not exist (a local path, so not tried on the hub)"),))
    located = _files(None, name, NAME)
    if not located.problems:
        builders = sorted({builder_for(f) for f in located.files})
        if len(builders) > 1:
            return attrs.evolve(located, problems=((NAME, f"{name} matches files of several kinds "
                                                          f"({', '.join(builders)}); give each kind its own entry"),))
        located = attrs.evolve(located, builder=builders[0])
    return located


def _files(builder: str | None, patterns, key: str) -> Location:
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    problems = tuple((key, _no_file_problem(p)) for p in patterns if not matching_files(p))
    files = tuple(expand_data_files(patterns))
    problems += tuple((key, f"{path} is an archive ({archive_of(path)}): extract it and name the files in it")
                      for path in files if archive_of(path) is not None)
    return Location("files", builder, files, (FILES_SPLIT,), problems)


def token_folder_problem(folder: str) -> str | None:
    """Why `folder` is not a token folder (bin/prepare's or datatrove's *.ds files); None if it is one."""
    if (overlong := overlong_part(folder)) is not None:
        return overlong
    if not os.path.exists(folder):
        return f"{folder} does not exist"
    if not os.path.isdir(folder):
        return f"{folder} is not a folder"
    if not glob.glob(os.path.join(glob.escape(folder), "*" + TOKEN_SUFFIX)):
        return f"{folder} holds no token files (*{TOKEN_SUFFIX}); write them with bin/prepare"
    return None
