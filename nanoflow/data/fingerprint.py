"""What a stage's data is, as plain JSON: recorded in every checkpoint for the stages that have begun, and
compared on resume, so a run never continues its "exact" resume on other data without being told.

A stage's fingerprint holds the tokenizer's content hash, general.seed, the stage's data seed, and
for each source what it reads (columns, splits, weight, end weight) and the identity of each of its files:
the size, plus a content hash when the source's files total at most HASH_LIMIT bytes, else the
modification time (hashing a multi-gigabyte corpus on every resume would cost minutes). A file's path is
recorded, but its identity is what it holds: a source whose files moved or were copied elsewhere with the
same bytes (same sizes and hashes, in the same order) is the same data, and a resume says where it now lies —
unless the stage blends several sources, whose sample orders are drawn from their keys (locations
included: nanoflow.data.loader.orders_by_source_key), so a source moved there would be read in another order
and is refused. A token folder's
`.ds`, `.ds.index` and `.ds.metadata` files are files like any other; a hub dataset is identified
by the fingerprint `datasets` gives it. A moving mixture (dataset_weights_end) also records the samples
its shares move over, so a resume whose schedule stretches or shortens a begun moving stage is told.

An eval set is fingerprinted alike (`eval_fingerprint`): its data (its own, or the stage's it is held out of),
the tokenizer and what cuts and picks its samples; eval.jsonl's rows carry its `short_digest`.

`compare_fingerprints` and `fingerprint_changes` compare two fingerprints and do no IO.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

from nanoflow.config import Config, EvalDatasetArgs, NanosetDatasetsArgs
from nanoflow.data.hf_datasets import hf_specs, load_rows, tokenizer_fingerprint
from nanoflow.data.loader import orders_by_source_key, stage_samples
from nanoflow.data.tokenizer import Tokenizer
from nanoflow.data.tokens import SUFFIX
from nanoflow.errors import DataChangedError, StageDataError  # noqa: F401 - DataChangedError: imported from here
from nanoflow.schedule import Schedule

HASH_LIMIT = 256 << 20   # a source of up to 256 MiB is identified by its files' content, a larger one by sizes and mtimes


def file_identity(path: str, by_content: bool = True) -> dict:
    """{"bytes": size, "sha256": ...}, or {"bytes": size, "mtime_ns": ...} when not `by_content`. A file that
    cannot be read is a StageDataError naming it."""
    try:
        stat = os.stat(path)
        if not by_content:
            return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    except OSError as e:
        raise StageDataError(f"{path}: cannot be read: {e.strerror or e}") from None
    return {"bytes": stat.st_size, "sha256": digest.hexdigest()}


def _files(paths) -> dict:
    """Each file's identity, by content when the files total at most HASH_LIMIT bytes: the cost of a resume
    stays bounded whatever the corpus size, and the choice only flips when the sizes change anyway."""
    paths = sorted(paths)
    by_content = sum(os.path.getsize(p) for p in paths) <= HASH_LIMIT
    return {os.path.abspath(p): file_identity(p, by_content) for p in paths}


def _token_folder(folder: str, weight) -> dict:
    names = sorted(glob.glob(os.path.join(glob.escape(folder), "*" + SUFFIX)))
    paths = [p + suffix for p in names for suffix in ("", ".index", ".metadata") if os.path.exists(p + suffix)]
    return {"weight": weight, "files": _files(paths)}


def _hf_source(spec, stage_name: str) -> dict:
    dataset = spec.dataset
    entry = {"weight": spec.weight, "columns": list(dataset.columns), "splits": [spec.split],   # the split trained on
             "config_name": dataset.hf_dataset_config_name}
    if spec.builder is not None:
        entry["builder"], entry["files"] = spec.builder, _files(spec.files)
        if dataset.sample_by != "document":   # absent: as before
            entry["sample_by"] = dataset.sample_by
    elif spec.kind == "saved":
        entry["files"] = _files(os.path.join(d, f) for d, _, fs in os.walk(spec.name) for f in fs)
    else:   # a hub dataset: `datasets`' own fingerprint of the rows (from its cache when offline)
        entry["hub"] = load_rows(spec, stage_name)._fingerprint
    return entry


def _sources_of(dataset, label: str) -> dict:
    """{source key: what it reads and the identity of its files} of a stage's (or an eval set's) dataset."""
    if isinstance(dataset, NanosetDatasetsArgs):
        weights = dataset.dataset_weights or [None] * len(dataset.folders)
        return {os.path.abspath(f): _token_folder(f, w) for f, w in zip(dataset.folders, weights, strict=True)}
    return {spec.name: _hf_source(spec, label) for spec in hf_specs(dataset)}


def stage_fingerprint(config: Config, index: int, tokenizer: Tokenizer, schedule: Schedule) -> dict:
    """The fingerprint of stage `index`'s data (see the module docstring)."""
    stage = config.data_stages[index]
    dataset = stage.data.dataset
    sources = _sources_of(dataset, stage.name)
    fingerprint = {"tokenizer": tokenizer_fingerprint(tokenizer), "general.seed": config.general.seed,
                   "data.seed": config.data_seed(index), "sources": sources}
    ends = dataset.weights_end()
    if ends is not None:   # a moving mixture: its end weights and the samples it moves over decide the order too
        for entry, end in zip(sources.values(), ends, strict=True):
            entry["weight_end"] = end
        fingerprint["mixture_samples"] = stage_samples(schedule, index)
    if dataset.held_out_samples:  # what training reads, and in which order, depends on it (absent: as before)
        fingerprint["held_out_samples"] = dataset.held_out_samples
    if config.stage_tokens(index).document_masking:   # the positions and targets of its windows (absent: off)
        fingerprint["document_masking"] = True
    return fingerprint


def eval_fingerprint(config: Config, entry: EvalDatasetArgs, tokenizer: Tokenizer) -> dict:
    """The fingerprint of an eval set: what decides the samples it scores — its data (its own, or the stage's it
    is held out of) as a stage's is fingerprinted, the tokenizer, and how the samples are cut and picked."""
    if entry.held_out_of is not None:
        dataset = next(s for s in config.data_stages if s.name == entry.held_out_of).data.dataset
    else:
        dataset = entry.dataset
    fingerprint = {"tokenizer": tokenizer_fingerprint(tokenizer), "sources": _sources_of(dataset, f"evaluation {entry.name}"),
                   "sequence_length": config.eval_sequence_length(entry), "max_samples": entry.max_samples}
    if entry.held_out_of is not None:
        fingerprint["held_out_samples"] = dataset.held_out_samples
    if config.eval_document_masking(entry):
        fingerprint["document_masking"] = True
    return fingerprint


def short_digest(fingerprint: dict) -> str:
    """16 hex digits of SHA-256 over what `fingerprint` holds, its files' paths left out (a set whose files moved,
    the same bytes, keeps its digest): what eval.jsonl's rows carry as "data_fingerprint"."""
    held = {**fingerprint, "sources": [_held(entry) for _, entry in sorted(fingerprint.get("sources", {}).items())]}
    return hashlib.sha256(json.dumps(held, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


class Fingerprints:
    """The fingerprints of a run's stages and eval sets, each computed once (files are hashed once per run, not per
    save)."""

    def __init__(self, config: Config, tokenizer: Tokenizer, schedule: Schedule):
        self.config, self.tokenizer, self.schedule = config, tokenizer, schedule
        self._by_name: dict[str, dict] = {}
        self._evals: dict[str, dict] | None = None

    def evals(self) -> dict:
        """{eval set name: fingerprint} of the config's eval sets (none without [evaluation])."""
        if self._evals is None:
            entries = self.config.evaluation.datasets if self.config.evaluation is not None else ()
            self._evals = {e.name: eval_fingerprint(self.config, e, self.tokenizer) for e in entries}
        return self._evals

    def compare_evals(self, saved: dict) -> tuple[list[str], list[str]]:
        """compare_fingerprints of the eval sets `saved` holds that the config still has (one removed is no change:
        its rows stay what they were), by eval set."""
        current = self.evals()
        return compare_fingerprints({n: f for n, f in saved.items() if n in current}, current, kind="eval set")

    def of(self, stage_names) -> dict:
        """{stage name: fingerprint} of the named stages the config has (a name it lacks is left out)."""
        indexes = {s.name: i for i, s in enumerate(self.config.data_stages)}
        for name in stage_names:
            if name in indexes and name not in self._by_name:
                self._by_name[name] = stage_fingerprint(self.config, indexes[name], self.tokenizer, self.schedule)
        return {name: self._by_name[name] for name in stage_names if name in indexes}

    def compare(self, saved: dict) -> tuple[list[str], list[str]]:
        """compare_fingerprints(saved, the current fingerprints of the stages `saved` holds)."""
        indexes = {s.name: i for i, s in enumerate(self.config.data_stages)}
        located = {name for name in saved if name in indexes and orders_by_source_key(self.config, indexes[name])}
        return compare_fingerprints(saved, self.of(list(saved)), located=located)


# ---------------------------------------------------------------------------------------------
# Comparing (pure)

def _shown(value) -> str:
    if isinstance(value, dict) and "bytes" in value:
        rest = f"sha256 {value['sha256'][:12]}…" if "sha256" in value else f"modified at {value.get('mtime_ns')} ns"
        return f"{value['bytes']} bytes, {rest}"
    if isinstance(value, str):
        return value[:19] + "…" if value.startswith("sha256:") else value
    return repr(value) if not isinstance(value, dict) else "{…}"


def _label(path: tuple[str, ...]) -> str:
    words, i = [], 0
    while i < len(path):
        if path[i] == "sources" and i + 1 < len(path):
            words.append(f"source {path[i + 1]}")
            i += 2
        elif path[i] == "files" and i + 1 < len(path):
            words.append(f"file {path[i + 1]}")
            i += 2
        else:
            words.append(path[i])
            i += 1
    return " ".join(words)


def _walk(saved, current, path: tuple[str, ...], out: list[str]) -> None:
    if isinstance(saved, dict) and isinstance(current, dict) and not ("bytes" in saved and "bytes" in current):
        for key in sorted(set(saved) | set(current), key=str):
            if key not in current:
                out.append(f"{_label(path + (key,))}: no longer read (was {_shown(saved[key])})")
            elif key not in saved:
                out.append(f"{_label(path + (key,))}: new (now {_shown(current[key])})")
            else:
                _walk(saved[key], current[key], path + (key,), out)
    elif saved != current:
        out.append(f"{_label(path)}: was {_shown(saved)}, now {_shown(current)}")


def _held(entry):
    """A source's entry as what it holds: its files' identities in the order of their paths, without the paths."""
    if isinstance(entry, dict) and isinstance(entry.get("files"), dict):
        return {**entry, "files": [entry["files"][path] for path in sorted(entry["files"])]}
    return entry


def _sizes(entry):
    """_held(entry) with each file's size only, when its files are identified by modification time (a large
    source), else None: what can still be compared of a large source copied without its times."""
    held = _held(entry)
    if not isinstance(held, dict) or not held.get("files") or \
            not all(isinstance(f, dict) and "mtime_ns" in f for f in held["files"]):
        return None
    return {**held, "files": [f.get("bytes") for f in held["files"]]}


def _copied_without_times(key: str) -> str:
    return (f"source {key}: the same file sizes, but a source over {HASH_LIMIT >> 20} MiB is identified by size and "
            "modification time, so a copy that did not keep the times (cp without -p) counts as changed: copy it "
            "with cp -p or rsync -a, or resume with ignore_fingerprint_mismatch = true if the bytes are the same")


def _folder_of(files: dict) -> str:
    paths = sorted(files)
    return paths[0] if len(paths) == 1 else os.path.commonpath(paths)


def _files_moved(key: str, saved: dict, current: dict) -> str:
    """'source text: file /a/x.txt is now read from /b/x.txt, the same bytes' (or its N files, for several)."""
    was, now = saved.get("files") or {}, current.get("files") or {}
    if len(now) == 1:
        return f"source {key}: file {_folder_of(was)} is now read from {_folder_of(now)}, the same bytes"
    return f"source {key}: its {len(now)} files are now read from {_folder_of(now)} (were in {_folder_of(was)}), " \
        "the same bytes"


def _sources(saved: dict, current: dict, located: bool, out: list[str], moves: list[str]) -> None:
    """Compare two stages' {source key: entry}: a source is matched by its key, else by what it holds."""
    gone = [key for key in saved if key not in current]
    new = [key for key in current if key not in saved]
    for key in (k for k in saved if k in current):
        if saved[key] == current[key]:
            continue
        if _held(saved[key]) == _held(current[key]):   # the same key (the order's too), the files elsewhere
            moves.append(_files_moved(key, saved[key], current[key]))
        else:
            _walk(saved[key], current[key], ("sources", key), out)
            if _sizes(saved[key]) is not None and _sizes(saved[key]) == _sizes(current[key]) and \
                    set(saved[key]["files"]) != set(current[key]["files"]):   # elsewhere, not touched in place
                out.append(_copied_without_times(key))
    for key in gone:
        now = next((k for k in new if _held(current[k]) == _held(saved[key])), None)
        if now is None:
            _walk({key: saved[key]}, {}, ("sources",), out)
            if _sizes(saved[key]) is not None and any(_sizes(current[k]) == _sizes(saved[key]) for k in new):
                out.append(_copied_without_times(key))
            continue
        new.remove(now)
        if located:
            out.append(f"source {key} is now read from {now}, the same bytes, but in a stage of several sources each "
                       "one's sample order is drawn from its location: resuming would read it in another order "
                       f"(put it back at {key}, or link that path to it)")
        else:
            moves.append(f"source {key} is now read from {now}, the same bytes")
    for key in new:
        _walk({}, {key: current[key]}, ("sources",), out)


# Keys recorded only when not at their default (so fingerprints written before them compare equal): a side that
# lacks one holds the default, and a change reads "was false, now true" rather than a key appearing.
_DEFAULTS = {"document_masking": False}


def _with_defaults(saved, current):
    if not (isinstance(saved, dict) and isinstance(current, dict)):
        return saved, current
    present = {k: v for k, v in _DEFAULTS.items() if k in saved or k in current}
    return {**present, **saved}, {**present, **current}


def compare_fingerprints(saved: dict, current: dict, located=(), kind: str = "stage") -> tuple[list[str], list[str]]:
    """(changes, moves) between a checkpoint's fingerprints and the current ones, one line each, by stage (or eval
    set: `kind`): a change ('stage "pretrain": data.seed: was 7, now 8') refuses the resume; a move (the same bytes
    read from elsewhere) is said. `located`: the stages whose sample orders depend on where their sources lie (a
    source moved there is a change). Only the stages `saved` holds are compared."""
    changes, moves = [], []
    for name, fingerprint in saved.items():
        now = current.get(name, {})
        fingerprint, now = _with_defaults(fingerprint, now)
        lines: list[str] = []
        stage_moves: list[str] = []
        if isinstance(fingerprint, dict) and isinstance(now, dict) and \
                isinstance(fingerprint.get("sources"), dict) and isinstance(now.get("sources"), dict):
            _walk({k: v for k, v in fingerprint.items() if k != "sources"},
                  {k: v for k, v in now.items() if k != "sources"}, (), lines)
            _sources(fingerprint["sources"], now["sources"], name in located, lines, stage_moves)
        else:
            _walk(fingerprint, now, (), lines)
        changes += [f'{kind} "{name}": {line}' for line in lines]
        moves += [f'{kind} "{name}": {line}' for line in stage_moves]
    return changes, moves


def fingerprint_changes(saved: dict, current: dict, located=()) -> list[str]:
    """The changes of compare_fingerprints: what refuses a resume."""
    return compare_fingerprints(saved, current, located)[0]
