"""What a stage's data is, as plain JSON: recorded in every checkpoint for the stages that have begun, and
compared on resume, so a run never continues its "exact" resume on other data without being told.

A stage's fingerprint holds the tokenizer's content hash, general.seed, the stage's data seed, and
for each source what it reads (columns, splits, weight, end weight) and the identity of each of its files:
the size, plus a content hash when the source's files total at most HASH_LIMIT bytes, else the
modification time (hashing a multi-gigabyte corpus on every resume would cost minutes). A token folder's
`.ds`, `.ds.index` and `.ds.metadata` files are files like any other; a hub dataset is identified
by the fingerprint `datasets` gives it. A moving mixture (dataset_weights_end) also records the samples
its shares move over, so a resume whose schedule stretches or shortens a begun moving stage is told.

`fingerprint_changes` compares two fingerprints and does no IO.
"""

from __future__ import annotations

import glob
import hashlib
import os

from nanoflow.config import Config, NanosetDatasetsArgs
from nanoflow.data.hf_datasets import hf_specs, load_rows, tokenizer_fingerprint
from nanoflow.data.loader import stage_samples
from nanoflow.data.tokenizer import Tokenizer
from nanoflow.data.tokens import SUFFIX
from nanoflow.errors import NanoflowError
from nanoflow.schedule import Schedule

HASH_LIMIT = 256 << 20   # a source of up to 256 MiB is identified by its files' content, a larger one by sizes and mtimes


class DataChangedError(NanoflowError, ValueError):
    """A stage that has begun would resume on other data, another tokenizer or another seed (exit status 2)."""


def file_identity(path: str, by_content: bool = True) -> dict:
    """{"bytes": size, "sha256": ...}, or {"bytes": size, "mtime_ns": ...} when not `by_content`."""
    stat = os.stat(path)
    if not by_content:
        return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
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
    elif spec.kind == "saved":
        entry["files"] = _files(os.path.join(d, f) for d, _, fs in os.walk(spec.name) for f in fs)
    else:   # a hub dataset: `datasets`' own fingerprint of the rows (from its cache when offline)
        entry["hub"] = load_rows(spec, stage_name)._fingerprint
    return entry


def stage_fingerprint(config: Config, index: int, tokenizer: Tokenizer) -> dict:
    """The fingerprint of stage `index`'s data (see the module docstring)."""
    stage = config.data_stages[index]
    dataset = stage.data.dataset
    if isinstance(dataset, NanosetDatasetsArgs):
        weights = dataset.dataset_weights or [None] * len(dataset.folders)
        sources = {os.path.abspath(f): _token_folder(f, w) for f, w in zip(dataset.folders, weights)}
    else:
        sources = {spec.name: _hf_source(spec, stage.name) for spec in hf_specs(dataset)}
    fingerprint = {"tokenizer": tokenizer_fingerprint(tokenizer), "general.seed": config.general.seed,
                   "data.seed": config.data_seed(index), "sources": sources}
    ends = dataset.weights_end()
    if ends is not None:   # a moving mixture: its end weights and the samples it moves over decide the order too
        for entry, end in zip(sources.values(), ends):
            entry["weight_end"] = end
        fingerprint["mixture_samples"] = stage_samples(Schedule.from_config(config), index)
    if dataset.held_out_samples:  # what training reads, and in which order, depends on it (absent: as before)
        fingerprint["held_out_samples"] = dataset.held_out_samples
    return fingerprint


class Fingerprints:
    """The fingerprints of a run's stages, each computed once (files are hashed once per run, not per save)."""

    def __init__(self, config: Config, tokenizer: Tokenizer):
        self.config, self.tokenizer = config, tokenizer
        self._by_name: dict[str, dict] = {}

    def of(self, stage_names) -> dict:
        """{stage name: fingerprint} of the named stages the config has (a name it lacks is left out)."""
        indexes = {s.name: i for i, s in enumerate(self.config.data_stages)}
        for name in stage_names:
            if name in indexes and name not in self._by_name:
                self._by_name[name] = stage_fingerprint(self.config, indexes[name], self.tokenizer)
        return {name: self._by_name[name] for name in stage_names if name in indexes}


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


def fingerprint_changes(saved: dict, current: dict) -> list[str]:
    """One line per difference between a checkpoint's fingerprints and the current ones, by stage:
    'stage "pretrain": data.seed: was 7, now 8'. Only the stages `saved` holds are compared."""
    changes = []
    for name, fingerprint in saved.items():
        lines: list[str] = []
        _walk(fingerprint, current.get(name, {}), (), lines)
        changes += [f'stage "{name}": {line}' for line in lines]
    return changes
