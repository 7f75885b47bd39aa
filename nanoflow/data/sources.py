"""Sample sources read through HF `datasets`: packed pretraining text and SFT examples.

A source is tokenized once, when it is built, and then answers `sample(i)` for i in
range(len(source)) with (input_ids, labels), both int64 arrays of sequence_length tokens whose
labels are already shifted by one (label -100: no loss). Which sample is read when is not
decided here (see order.py).
"""

from __future__ import annotations

import glob
import os

import numpy as np

from nanoflow.config import BUILDERS, DatasetArgs
from nanoflow.data.tokenizer import Tokenizer

IGNORE_INDEX = -100     # the label PyTorch's cross-entropy skips
_ROWS_PER_BATCH = 1024  # rows tokenized together: large enough for the tokenizers' batching, small in memory


def expand_data_files(patterns: str | list[str] | None) -> list[str]:
    """Every file matched by the patterns (`**` allowed), sorted and de-duplicated so the order is fixed."""
    if patterns is None:
        return []
    patterns = [patterns] if isinstance(patterns, str) else patterns
    return sorted({path for pattern in patterns for path in glob.glob(pattern, recursive=True) if os.path.isfile(path)})


def describe(stage_name: str, dataset: DatasetArgs) -> str:
    """'stage "sft" (json files /a/b.jsonl)', for error messages."""
    files = expand_data_files(dataset.hf_data_files)
    if files:
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        return f'stage "{stage_name}" ({dataset.hf_dataset_or_datasets} files {shown})'
    return f'stage "{stage_name}" (dataset {dataset.hf_dataset_or_datasets})'


def load_rows(dataset: DatasetArgs, stage_name: str, cache_dir: str | None = None):
    """The stage's rows, without `datasets`' own progress bars (they would tear the run's progress display)."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        return _load_rows(dataset, stage_name, cache_dir)
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _load_rows(dataset: DatasetArgs, stage_name: str, cache_dir: str | None = None):
    """The stage's rows as a `datasets.Dataset`.

    Local files go through a builder ("text" reads each file as one document); a folder written by
    `Dataset.save_to_disk` is loaded as is; any other name is tried on the hub. `datasets` caches
    what it builds under `cache_dir` (default: $HF_DATASETS_CACHE, ~/.cache/huggingface/datasets),
    keyed on the files' paths and modification times, so an edited file is read again.
    """
    import datasets

    name, split = dataset.hf_dataset_or_datasets, dataset.hf_dataset_splits
    options = dict(split=split, cache_dir=cache_dir)
    if dataset.hf_dataset_config_name is not None:
        options["name"] = dataset.hf_dataset_config_name
    if dataset.dataset_overwrite_cache:
        options["download_mode"] = "force_redownload"
    if dataset.dataset_processing_num_proc_per_process > 1:
        options["num_proc"] = dataset.dataset_processing_num_proc_per_process
    files = expand_data_files(dataset.hf_data_files)

    if name in BUILDERS:
        if not files:
            raise FileNotFoundError(f'{describe(stage_name, dataset)}: hf_data_files {dataset.hf_data_files!r} '
                                    "matches no file")
        if name == "text":
            options["sample_by"] = "document"
        return datasets.load_dataset(name, data_files=files, **options)
    if os.path.isdir(name):
        rows = datasets.load_from_disk(name)
        if isinstance(rows, datasets.DatasetDict):
            if split not in rows:
                raise ValueError(f'{describe(stage_name, dataset)}: no split "{split}" in {name} '
                                 f"(splits: {', '.join(rows)})")
            rows = rows[split]
        return rows
    return datasets.load_dataset(name, data_files=files or None, **options)


def _require_columns(rows, columns: list[str], where: str) -> None:
    for column in columns:
        if column not in rows.column_names:
            raise ValueError(f'{where}: no column "{column}"; the columns are {", ".join(rows.column_names)}')


def _texts(rows, column: str, where: str):
    """The column's values, a batch of rows at a time."""
    for batch in rows.select_columns([column]).iter(batch_size=_ROWS_PER_BATCH):
        texts = batch[column]
        for text in texts:
            if not isinstance(text, str):
                raise ValueError(f'{where}: column "{column}" holds {type(text).__name__} values, expected text')
        yield texts


def _token_dtype(tokenizer: Tokenizer) -> type:
    return np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32


class PackedText:
    """Documents joined by end-of-text into one token stream, read as windows of sequence_length + 1
    tokens at stride sequence_length: window i covers tokens [i*seq, i*seq + seq + 1), so consecutive
    windows share one token and every token but the first is a target exactly once."""

    def __init__(self, tokens: np.ndarray, sequence_length: int, where: str = "the source"):
        if tokens.ndim != 1:
            raise ValueError(f"{where}: expected a flat token array, got shape {tokens.shape}")
        if len(tokens) < sequence_length + 1:
            raise ValueError(f"{where}: {len(tokens)} tokens are fewer than one window of sequence_length + 1 = "
                             f"{sequence_length + 1}; add text or shorten the sequence")
        self.tokens = tokens
        self.sequence_length = sequence_length

    @classmethod
    def from_rows(cls, rows, column: str, tokenizer: Tokenizer, sequence_length: int,
                  where: str = "the source") -> PackedText:
        _require_columns(rows, [column], where)
        eos = np.array([tokenizer.eos_id])
        pieces = []
        for texts in _texts(rows, column, where):
            for ids in tokenizer.encode_batch(texts):
                pieces += [ids, eos]
        tokens = np.concatenate(pieces).astype(_token_dtype(tokenizer)) if pieces else np.zeros(0, np.uint32)
        return cls(tokens, sequence_length, where)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.sequence_length

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} is outside 0..{len(self) - 1}")
        start = i * self.sequence_length
        window = self.tokens[start:start + self.sequence_length + 1].astype(np.int64)
        return window[:-1], window[1:]


class SFTExamples:
    """One example per row: prompt + completion + end-of-text, truncated or padded (with
    end-of-text) to sequence_length + 1 tokens. Only completion tokens and the first end-of-text
    are targets: the model learns to answer and to stop, not to write prompts."""

    def __init__(self, tokens: np.ndarray, prompt_lengths: np.ndarray, lengths: np.ndarray):
        # tokens: [rows, seq + 1], padded; prompt_lengths / lengths: tokens of prompt / of real text per row.
        self.tokens, self.prompt_lengths, self.lengths = tokens, prompt_lengths, lengths
        self.sequence_length = tokens.shape[1] - 1

    @classmethod
    def from_rows(cls, rows, prompt_column: str, completion_column: str, tokenizer: Tokenizer,
                  sequence_length: int, where: str = "the source") -> SFTExamples:
        _require_columns(rows, [prompt_column, completion_column], where)
        if len(rows) == 0:
            raise ValueError(f"{where}: no rows")
        width = sequence_length + 1
        tokens = np.full((len(rows), width), tokenizer.eos_id, dtype=_token_dtype(tokenizer))
        prompt_lengths = np.zeros(len(rows), np.int64)
        lengths = np.zeros(len(rows), np.int64)
        row = 0
        batches = zip(_texts(rows, prompt_column, where), _texts(rows, completion_column, where))
        for prompts, completions in batches:
            for prompt, completion in zip(tokenizer.encode_batch(prompts), tokenizer.encode_batch(completions)):
                text = np.concatenate([prompt, completion, [tokenizer.eos_id]])[:width]
                tokens[row, :len(text)] = text
                prompt_lengths[row], lengths[row] = len(prompt), len(text)
                row += 1
        if not (prompt_lengths < lengths).any():
            raise ValueError(f"{where}: every prompt fills the whole sequence of {width} tokens, "
                             "so no example has a token to learn; raise sequence_length")
        return cls(tokens, prompt_lengths, lengths)

    def __len__(self) -> int:
        return len(self.tokens)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = self.tokens[i].astype(np.int64)
        labels = tokens[1:].copy()
        target_positions = np.arange(1, len(tokens))
        labels[(target_positions < self.prompt_lengths[i]) | (target_positions >= self.lengths[i])] = IGNORE_INDEX
        return tokens[:-1], labels


Source = PackedText | SFTExamples


def open_source(dataset: DatasetArgs, stage_name: str, tokenizer: Tokenizer, sequence_length: int,
                cache_dir: str | None = None) -> Source:
    """Load and tokenize one stage's data: SFT examples when prompt and completion columns are set, else packed text."""
    where = describe(stage_name, dataset)
    rows = load_rows(dataset, stage_name, cache_dir)
    if dataset.is_sft:
        return SFTExamples.from_rows(rows, dataset.prompt_column_name, dataset.completion_column_name,
                                     tokenizer, sequence_length, where)
    return PackedText.from_rows(rows, dataset.text_column_name, tokenizer, sequence_length, where)
