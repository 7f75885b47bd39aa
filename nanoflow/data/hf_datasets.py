"""HF `datasets` sources: which files or hub datasets a stage names, their rows, and their tokens,
tokenized once and cached on disk so a resumed run (or the next run over the same data) maps them
in without tokenizing again."""

from __future__ import annotations

import hashlib
import io
import json
import os
from concurrent.futures import ProcessPoolExecutor

import attrs
import numpy as np

from nanoflow.config import DatasetArgs, locate_source
from nanoflow.config.locations import builder_for, expand_data_files  # noqa: F401 - also this module's API
from nanoflow.data.local_files import load_files
from nanoflow.data.tokenizer import Tokenizer, load_tokenizer
from nanoflow.data.tokens import (
    StageDataError,
    token_size_for,
)
from nanoflow.io.store import write_atomically

_ROWS_PER_BATCH = 1024  # rows tokenized together: large enough for the tokenizers' batching, small in memory
_CACHE_VERSION = "nanoflow-tokens-1"


def _shown(files: list[str] | tuple[str, ...]) -> str:
    return ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


@attrs.frozen
class HFSpec:
    """One HF dataset of a stage, resolved: local files through a builder, a saved folder, or a hub name."""

    name: str                     # as the config names it (a builder, a folder, a path or glob, a hub name)
    builder: str | None           # "text", "json", ... for local files; None for a saved folder or the hub
    files: tuple[str, ...]
    dataset: DatasetArgs          # splits, config name, columns, processing options
    key: str                      # what identifies the source across stages (DatasetArgs.source_key)
    weight: float
    kind: str = "hub"             # "files", "saved" or "hub": config.Location.kind
    problems: tuple[str, ...] = ()   # why it cannot be read (gone since the check before the run): said on loading

    @property
    def label(self) -> str:
        if self.builder is not None:
            return f"{self.builder} files {_shown(self.files)}"
        return f"dataset {self.name}"

    @property
    def split(self) -> str:
        """The split training reads (DatasetArgs.train_split)."""
        return self.dataset.train_split


def hf_specs(dataset: DatasetArgs) -> list[HFSpec]:
    """The HF datasets a stage names: one, or each entry of a {name = weight} table, each where
    `config.locate_source` finds it (the definition the check before the run uses)."""
    specs = []
    for name, weight in dataset.weighted_names():
        location = locate_source(dataset, name)
        specs.append(HFSpec(name, location.builder, location.files, dataset, dataset.source_key(name), weight,
                            location.kind, tuple(location.messages())))
    return specs


def describe(stage_name: str, dataset: DatasetArgs | HFSpec) -> str:
    """'stage "sft" (json files /a/b.jsonl)', for error messages."""
    if isinstance(dataset, HFSpec):
        return f'stage "{stage_name}" ({dataset.label})'
    if isinstance(dataset.hf_dataset_or_datasets, dict):
        return f'stage "{stage_name}" (datasets {", ".join(dataset.hf_dataset_or_datasets)})'
    return describe(stage_name, hf_specs(dataset)[0])


def load_rows(dataset: DatasetArgs | HFSpec, stage_name: str, cache_dir: str | None = None):
    """The rows of one HF dataset (the first, for a table), without `datasets`' own progress bars
    (they would tear the run's progress display)."""
    import datasets

    spec = dataset if isinstance(dataset, HFSpec) else hf_specs(dataset)[0]
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        return _load_rows(spec, stage_name, cache_dir)
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _load_rows(spec: HFSpec, stage_name: str, cache_dir: str | None = None):
    """The dataset's rows as a `datasets.Dataset`.

    Local files go through a builder ("text" reads each file as one document, or by line or paragraph as
    the stage's sample_by says); a folder written by
    `Dataset.save_to_disk` is loaded as is; any other name is tried on the hub (which `datasets`
    skips when HF_DATASETS_OFFLINE=1, answering from its cache). `datasets` caches what it builds
    under `cache_dir` (default: $HF_DATASETS_CACHE, ~/.cache/huggingface/datasets), keyed on the
    files' paths and modification times, so an edited file is read again. One split is read: the one
    training reads (DatasetArgs.train_split).
    """
    import datasets

    dataset, where = spec.dataset, describe(stage_name, spec)
    if spec.problems:
        raise StageDataError(f"{where}: " + "; ".join(spec.problems))
    options = dict(split=spec.split, cache_dir=cache_dir)
    if dataset.hf_dataset_config_name is not None:
        options["name"] = dataset.hf_dataset_config_name
    if dataset.dataset_overwrite_cache:
        options["download_mode"] = "force_redownload"
    if dataset.dataset_processing_num_proc_per_process > 1:
        options["num_proc"] = dataset.dataset_processing_num_proc_per_process

    if spec.builder is not None:
        if spec.builder == "text":
            options["sample_by"] = dataset.sample_by   # "document" unless the stage says: not datasets' "line"
        return load_files(spec.builder, spec.files, where, **options)
    if spec.kind == "saved":
        rows = datasets.load_from_disk(spec.name)
        if isinstance(rows, datasets.DatasetDict):
            if spec.split not in rows:
                raise StageDataError(f'{where}: no split "{spec.split}" in {spec.name} (splits: {", ".join(rows)})')
            rows = rows[spec.split]
        return rows
    try:   # a hub id (config.locate_source: a local path never gets here, so never minutes of hub retries)
        return datasets.load_dataset(spec.name, data_files=list(spec.files) or None, **options)
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as e:
        raise hub_error(spec, where, e) from None


def hub_error(spec: HFSpec, where: str, error: Exception) -> StageDataError:
    """The error of a hub name that cannot be loaded (offline: not in the cache)."""
    offline = " (HF_DATASETS_OFFLINE is set: only datasets already in the cache can load)" \
        if os.environ.get("HF_DATASETS_OFFLINE", "0") not in ("", "0") else ""
    return StageDataError(f"{where}: cannot load {spec.name!r} from the hub or a local path{offline}: {error}")


def _require_columns(rows, columns: list[str], where: str) -> None:
    missing = missing_column(rows.column_names, columns, where)
    if missing is not None:
        raise missing


def missing_column(present, columns, where: str) -> StageDataError | None:
    """The error of the first of `columns` that a source's columns (`present`) lack, None when it has them all."""
    for column in columns:
        if column not in present:
            return StageDataError(f'{where}: no column "{column}"; the columns are {", ".join(present)}')
    return None


def _texts(rows, column: str, where: str):
    """The column's values, a batch of rows at a time."""
    for batch in rows.select_columns([column]).iter(batch_size=_ROWS_PER_BATCH):
        texts = batch[column]
        for text in texts:
            if not isinstance(text, str):
                raise StageDataError(f'{where}: column "{column}" holds {type(text).__name__} values, expected text')
        yield texts


def _token_dtype(tokenizer: Tokenizer) -> type:
    return np.uint16 if token_size_for(tokenizer.vocab_size) == 2 else np.uint32


# ---------------------------------------------------------------------------------------------
# Tokenizing rows (in this process, or in `num_proc` processes over contiguous shards of the rows)

def _packed_tokens(rows, column: str, tokenizer: Tokenizer, where: str) -> np.ndarray:
    """Every row's text tokenized and followed by end-of-text, as one flat array."""
    eos = np.array([tokenizer.eos_id])
    pieces = []
    for texts in _texts(rows, column, where):
        for ids in tokenizer.encode_batch(texts):
            pieces += [ids, eos]
    return np.concatenate(pieces).astype(_token_dtype(tokenizer)) if pieces else np.zeros(0, _token_dtype(tokenizer))


def _sft_table(rows, prompt_column: str, completion_column: str, tokenizer: Tokenizer, sequence_length: int,
               where: str) -> np.ndarray:
    """[rows, sequence_length + 3] int32: prompt + completion + end-of-text, padded (with end-of-text) or
    truncated to sequence_length + 1 tokens, then the prompt's length and the text's length."""
    width = sequence_length + 1
    table = np.full((len(rows), width + 2), tokenizer.eos_id, dtype=np.int32)
    row = 0
    batches = zip(_texts(rows, prompt_column, where), _texts(rows, completion_column, where), strict=True)
    for prompts, completions in batches:
        for prompt, completion in zip(tokenizer.encode_batch(prompts), tokenizer.encode_batch(completions), strict=True):
            text = np.concatenate([prompt, completion, [tokenizer.eos_id]])[:width]
            table[row, :len(text)] = text
            table[row, width:] = len(prompt), len(text)
            row += 1
    return table


def _tokenize_shard(rows, kind: str, columns: tuple[str, ...], tokenizer: Tokenizer, sequence_length: int,
                    where: str) -> np.ndarray:
    """One contiguous shard of rows: a flat token array ("packed") or its part of the SFT table ("sft")."""
    if kind == "packed":
        return _packed_tokens(rows, columns[0], tokenizer, where)
    return _sft_table(rows, *columns, tokenizer, sequence_length, where)


def _tokenize_shard_in_worker(rows, kind: str, columns: tuple[str, ...], tokenizer_args, sequence_length: int,
                              where: str) -> np.ndarray:
    """_tokenize_shard in a worker process: the tokenizer travels as its [tokenizer] section, the rows as
    `datasets` pickles them (a reference to its memory-mapped Arrow files)."""
    return _tokenize_shard(rows, kind, columns, load_tokenizer(tokenizer_args), sequence_length, where)


def quiet_on_ctrl_c() -> None:
    """In a worker process: Ctrl-C reaches the whole process group, and the main process reports it in
    one line; a worker just ends, instead of printing a KeyboardInterrupt traceback of its own."""
    import signal

    signal.signal(signal.SIGINT, lambda *_: os._exit(130))


def tokenize_rows(rows, kind: str, columns: tuple[str, ...], tokenizer: Tokenizer, sequence_length: int = 0,
                  where: str = "the source", num_proc: int = 1) -> np.ndarray:
    """The rows tokenized: a flat token array ("packed") or the SFT table ("sft"); the result does not
    depend on num_proc (contiguous shards, joined in order)."""
    _require_columns(rows, list(columns), where)
    num_proc = min(num_proc, len(rows))
    if num_proc <= 1:
        return _tokenize_shard(rows, kind, columns, tokenizer, sequence_length, where)
    import multiprocessing

    shards = [rows.shard(num_shards=num_proc, index=i, contiguous=True) for i in range(num_proc)]
    with ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context("spawn"),
                             initializer=quiet_on_ctrl_c) as pool:
        parts = list(pool.map(_tokenize_shard_in_worker, shards, [kind] * num_proc, [columns] * num_proc,
                              [tokenizer.args] * num_proc, [sequence_length] * num_proc, [where] * num_proc))
    return np.concatenate(parts)


# ---------------------------------------------------------------------------------------------
# The token cache

def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """"bytes", or a hash of the tokenizer.json's content (a tokenizer edited in place is a new tokenizer)."""
    return tokenizer.fingerprint


def _file_stats(paths) -> list:
    return [[os.path.abspath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in paths]


def _data_fingerprint(spec: HFSpec, rows_loader) -> list:
    """What the rows depend on: the local files' paths, sizes and modification times, or the hub
    dataset's own fingerprint (which needs the rows, so they are loaded first)."""
    if spec.builder is not None:
        return ["files", spec.builder, _file_stats(spec.files)]
    if spec.kind == "saved":
        found = sorted(os.path.join(d, f) for d, _, fs in os.walk(spec.name) for f in fs)
        return ["saved", _file_stats(found)]
    return ["hub", spec.name, rows_loader()._fingerprint]


def cache_root(cache_dir: str | None = None) -> str:
    """Where tokenized sources are kept: <cache_dir or $HF_DATASETS_CACHE>/nanoflow-tokens."""
    if cache_dir is None:
        import datasets

        cache_dir = str(datasets.config.HF_DATASETS_CACHE)
    return os.path.join(cache_dir, "nanoflow-tokens")


def tokenized_array(spec: HFSpec, kind: str, tokenizer: Tokenizer, sequence_length: int, stage_name: str,
                    cache_dir: str | None = None) -> np.ndarray:
    """The tokenized rows of `spec`, memory-mapped from the cache; tokenized (and cached) on a miss.

    The cache file is keyed by a hash of everything the tokens depend on (the data's fingerprint,
    the tokenizer's content, the columns, the splits, the config name, and for SFT the sequence
    length). It is written under a temporary name and renamed into place, so a concurrent run
    (another rank, another job) or a kill mid-write never leaves a partial file under the key:
    writers race harmlessly to the same content. dataset_overwrite_cache = true tokenizes again.
    """
    rows = None
    where = describe(stage_name, spec)

    def load():
        nonlocal rows
        if rows is None:
            rows = load_rows(spec, stage_name, cache_dir)
        return rows

    dataset = spec.dataset
    columns = dataset.columns
    material = [_CACHE_VERSION, kind, spec.name, [spec.split], dataset.hf_dataset_config_name, list(columns),
                sequence_length if kind == "sft" else None, tokenizer_fingerprint(tokenizer), tokenizer.eos_id,
                _data_fingerprint(spec, load)]
    if spec.builder == "text" and dataset.sample_by != "document":   # other rows, other tokens (the default's key
        material.append(["sample_by", dataset.sample_by])            # stays as it was, and so its caches)
    key = hashlib.sha256(json.dumps(material).encode()).hexdigest()[:32]
    root = cache_root(cache_dir)
    path = os.path.join(root, f"{key}.npy")
    if os.path.exists(path) and not dataset.dataset_overwrite_cache:
        try:
            return np.load(path, mmap_mode="r")
        except (ValueError, OSError):   # unreadable (e.g. a foreign file): tokenize again and replace it
            pass
    array = tokenize_rows(load(), kind, columns, tokenizer, sequence_length, where,
                          dataset.dataset_processing_num_proc_per_process)
    encoded = io.BytesIO()
    np.save(encoded, array)
    try:
        os.makedirs(root, exist_ok=True)
        write_atomically(path, encoded.getbuffer())  # concurrent runs and kills never leave a partial cache file
    except OSError as e:   # a full disk, or a file where the cache folder goes: nothing was left behind
        raise StageDataError(
            f"{where}: cannot write the token cache {path}: {e.strerror or e}"
            + (f" ({e.filename})" if e.filename and e.filename != path else "")
            + f"; the tokens need {encoded.getbuffer().nbytes:,} bytes there: free space, remove what is in the "
            "way, or point HF_DATASETS_CACHE (the cache's parent) to a writable folder with room") from None
    del array
    return np.load(path, mmap_mode="r")
