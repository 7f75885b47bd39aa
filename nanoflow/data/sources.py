"""Sample sources: packed pretraining text and SFT examples, from HF `datasets` or from token folders.

A source answers `samples(indices)` with a `Samples` record: input_ids and labels, [len(indices),
sequence_length] int64 arrays whose labels are already shifted by one (label -100: no loss), and
position_ids where a window packs several documents that attend only to themselves (document masking),
else None (positions 0..sequence_length-1). `sample(i)` is the same for one sample, as 1-D arrays.
Which sample is read when is not decided here (see order.py, blend.py and loader.py).

HF sources are tokenized once and the tokens cached on disk (see `tokenized_array`), so a resumed
run, or the next run over the same data, maps them in without tokenizing again. Token folders
(tokens.py) are mapped as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import attrs
import numpy as np

from nanoflow.config import DatasetArgs, NanosetDatasetsArgs
from nanoflow.data.hf_datasets import (
    HFSpec,
    describe,
    hf_specs,
    tokenized_array,
)
from nanoflow.data.tokenizer import Tokenizer
from nanoflow.data.tokens import (
    MANIFEST,
    StageDataError,
    TokenFolder,
    TokenFolderError,
    recorded_tokenizer,
    token_size_for,
)

log = logging.getLogger(__name__)

IGNORE_INDEX = -100     # the label PyTorch's cross-entropy skips


class Samples(NamedTuple):
    """What a source gives for some sample indices (for one sample, `sample(i)`: the same as 1-D arrays)."""

    input_ids: np.ndarray                    # [n, sequence_length] int64
    labels: np.ndarray                       # the next tokens; IGNORE_INDEX where no loss is taken
    position_ids: np.ndarray | None = None   # restarting at 0 at each document; None: 0..sequence_length-1

    def row(self, i: int) -> Samples:
        return Samples(self.input_ids[i], self.labels[i], None if self.position_ids is None else self.position_ids[i])


def mark_documents(input_ids: np.ndarray, labels: np.ndarray, eos_id: int) -> np.ndarray:
    """Document masking of packed windows [n, seq]: the position ids, restarting at 0 after each end-of-text
    token (which ends its document; a window's first token is position 0, a document cut by the window's
    left edge starts there); and, in `labels` (changed in place), IGNORE_INDEX where an end-of-text token
    would predict the next document's first token. nanotron's DataCollatorForCLMWithPositionIds and
    transformers' DataCollatorWithFlattening make the same position ids and label mask."""
    seq = input_ids.shape[1]
    starts = np.zeros(input_ids.shape, dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    index = np.arange(seq)
    position_ids = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    labels[input_ids == eos_id] = IGNORE_INDEX
    return position_ids


# ---------------------------------------------------------------------------------------------
# Sources

class PackedText:
    """Documents joined by end-of-text into one token stream, read as windows of sequence_length + 1
    tokens at stride sequence_length: window i covers tokens [i*seq, i*seq + seq + 1), so consecutive
    windows share one token and every token but the first is a target exactly once.

    The stream is an array (an HF source's cached tokens) or a `TokenFolder` (its files as one stream).
    With `eos_id` (document masking), each window's documents are marked (`mark_documents`).
    """

    def __init__(self, tokens, sequence_length: int, where: str = "the source", eos_id: int | None = None):
        if getattr(tokens, "ndim", 1) != 1:
            raise ValueError(f"{where}: expected a flat token array, got shape {tokens.shape}")
        if len(tokens) < sequence_length + 1:
            raise StageDataError(f"{where}: {len(tokens)} tokens are fewer than one window of sequence_length + 1 = "
                             f"{sequence_length + 1}; add text or shorten the sequence")
        self.tokens = tokens
        self.sequence_length = sequence_length
        self.eos_id = eos_id

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.sequence_length

    def sample(self, i: int) -> Samples:
        return self.samples(np.asarray([i])).row(0)

    def samples(self, indices: np.ndarray) -> Samples:
        """The windows `indices`, gathered in a few numpy operations (which release the GIL) rather than one
        Python call per sample."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            bad = int(indices[(indices < 0) | (indices >= len(self))][0])
            raise IndexError(f"window {bad} is outside 0..{len(self) - 1}")
        starts = indices * self.sequence_length
        if isinstance(self.tokens, TokenFolder):
            windows = self.tokens.gather(starts, self.sequence_length + 1)
        else:
            windows = self.tokens[starts[:, None] + np.arange(self.sequence_length + 1)].astype(np.int64)
        input_ids, labels = windows[:, :-1], windows[:, 1:]
        if self.eos_id is None:
            return Samples(input_ids, labels)
        labels = labels.copy()
        return Samples(input_ids, labels, mark_documents(input_ids, labels, self.eos_id))

    def locate(self, i: int) -> str:
        """Where sample i comes from, for error messages."""
        if isinstance(self.tokens, TokenFolder):
            return f"window {i}: {self.tokens.locate(i * self.sequence_length)}"
        return f"window {i} (tokens {i * self.sequence_length}..{(i + 1) * self.sequence_length})"

    def close(self) -> None:
        if isinstance(self.tokens, TokenFolder):
            self.tokens.close()
        self.tokens = None


class SFTExamples:
    """One (prompt, completion) row per sample: prompt + completion + end-of-text, padded (with
    end-of-text) to sequence_length + 1 tokens. Only completion tokens and the first end-of-text
    are targets: the model learns to answer and to stop, not to write prompts."""

    def __init__(self, tokens: np.ndarray, prompt_lengths: np.ndarray, lengths: np.ndarray):
        # tokens: [rows, seq + 1], padded; prompt_lengths / lengths: tokens of prompt / of real text per row.
        self.tokens, self.prompt_lengths, self.lengths = tokens, prompt_lengths, lengths
        self.sequence_length = tokens.shape[1] - 1

    @classmethod
    def from_table(cls, table: np.ndarray, where: str = "the source") -> SFTExamples:
        """From the [rows, seq + 3] table `tokenize_rows(..., "sft", ...)` makes."""
        if len(table) == 0:
            raise StageDataError(f"{where}: no rows")
        width = table.shape[1] - 2
        examples = cls(table[:, :width], table[:, width], table[:, width + 1])
        if not (examples.prompt_lengths < examples.lengths).any():
            raise StageDataError(f"{where}: every prompt fills the whole sequence of {width} tokens, "
                             "so no example has a token to learn; raise sequence_length")
        return examples

    def __len__(self) -> int:
        return len(self.tokens)

    def sample(self, i: int) -> Samples:
        return self.samples(np.asarray([i])).row(0)

    def samples(self, indices: np.ndarray) -> Samples:
        """The rows `indices`; each is one document (its padding after it), so no position ids."""
        indices = np.asarray(indices, dtype=np.int64)
        tokens = self.tokens[indices].astype(np.int64)
        labels = tokens[:, 1:].copy()
        target_positions = np.arange(1, tokens.shape[1])
        masked = (target_positions < self.prompt_lengths[indices][:, None]) | \
                 (target_positions >= self.lengths[indices][:, None])
        labels[masked] = IGNORE_INDEX
        return Samples(tokens[:, :-1], labels)

    def locate(self, i: int) -> str:
        return f"row {i}"

    def close(self) -> None:
        self.tokens = self.prompt_lengths = self.lengths = None


class SampleRange:
    """Samples start .. stop - 1 of a source, numbered from 0. A source with held_out_samples = N is read by
    training as its head (all but the last N samples) and by evaluation as its tail, so no training batch ever
    holds a held-out sample. (Packed windows share one boundary token: the last training window's final target
    is the first held-out window's first input, which is never a target there.)"""

    def __init__(self, source, start: int, stop: int):
        self.source, self.start, self.stop = source, start, stop
        self.sequence_length = source.sequence_length

    def __len__(self) -> int:
        return self.stop - self.start

    def _check(self, indices: np.ndarray) -> None:
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            bad = int(indices[(indices < 0) | (indices >= len(self))][0])
            raise IndexError(f"sample {bad} is outside 0..{len(self) - 1}")

    def sample(self, i: int) -> Samples:
        self._check(np.asarray([i]))
        return self.source.sample(self.start + i)

    def samples(self, indices: np.ndarray) -> Samples:
        indices = np.asarray(indices, dtype=np.int64)
        self._check(indices)
        return self.source.samples(indices + self.start)

    def locate(self, i: int) -> str:
        return self.source.locate(self.start + i)

    def close(self) -> None:
        self.source.close()


def split_held_out(source, held_out: int | None, tail: bool, where: str):
    """The part of `source` training reads (the head) or evaluation reads (`tail`: the last `held_out` samples)."""
    if not held_out:
        return source
    samples = len(source)   # before closing: a closed source has no length
    if held_out >= samples:
        source.close()
        raise StageDataError(f"{where}: held_out_samples = {held_out} leaves nothing to train on: the source has "
                             f"{samples} samples")
    cut = samples - held_out
    return SampleRange(source, cut, len(source)) if tail else SampleRange(source, 0, cut)


Source = PackedText | SFTExamples | SampleRange


@attrs.define
class NamedSource:
    """One source of a stage, with what the loader needs to blend it and to report on it."""

    label: str                 # "dataset_folder /data/code", "text files a.txt, b.txt": for messages
    key: str                   # identifies the source across stages (continue_from)
    weight: float | None       # None: in proportion to its size (token folders without dataset_weights)
    source: Source
    weight_end: float | None = None   # its weight at the stage's end (dataset_weights_end); None: a static blend


def open_hf_source(spec: HFSpec, stage_name: str, tokenizer: Tokenizer, sequence_length: int,
                   cache_dir: str | None = None, document_masking: bool = False) -> Source:
    where = describe(stage_name, spec)
    if spec.dataset.is_sft:
        return SFTExamples.from_table(tokenized_array(spec, "sft", tokenizer, sequence_length, stage_name, cache_dir),
                                      where)
    return PackedText(tokenized_array(spec, "packed", tokenizer, sequence_length, stage_name, cache_dir),
                      sequence_length, where, tokenizer.eos_id if document_masking else None)


def check_folder_tokenizer(tokens: TokenFolder, tokenizer: Tokenizer, where: str,
                           accepted_names: Sequence[str] = ()) -> None:
    """Whether `tokens` was written with `tokenizer`, decided by what the recorded tokenizer is (its content hash),
    not by how it was named; a name that cannot be resolved here passes only when listed in accepted_names."""
    recorded = recorded_tokenizer(tokens)
    shown = f'"{tokens.tokenizer_name}"'
    again = f"bin/prepare --tokenizer {tokenizer.name}" + (
        f' --eos-token "{tokenizer.eos_token}"' if tokenizer.args.eos_token is not None else "")
    if recorded is None:
        if tokens.tokenizer_name in accepted_names:
            message = (f"{where}: tokenized with {shown}, which cannot be resolved here; taken as this run's "
                       f"tokenizer {tokenizer.name} because tokenizer.accept_recorded_names lists it")
            log.info(f"note: {message}")
            return
        raise TokenFolderError(
            f"{where}: tokenized with {shown}, a name that cannot be resolved on this machine (no such file or "
            f"folder, not in the local HF cache), so nanoflow cannot check that it is this run's tokenizer "
            f"({tokenizer.name}). If it is, add it to [tokenizer] accept_recorded_names = [{shown}]; if not, "
            f"tokenize the data again with {again}")
    if recorded["fingerprint"] != tokenizer.fingerprint:
        what = ("the built-in byte tokenizer" if recorded["fingerprint"] == "bytes"
                else f"{recorded['how']}: content {recorded['fingerprint'][:19]}")
        ours = "" if tokenizer.fingerprint == "bytes" else f" (content {tokenizer.fingerprint[:19]})"
        raise TokenFolderError(
            f"{where}: tokenized with {shown} ({what}), which is not this run's tokenizer {tokenizer.name}{ours}; "
            f"set tokenizer.tokenizer_name_or_path to the tokenizer the folder was written with, or tokenize the "
            f"data again with {again}")
    if recorded["eos_id"] is not None and recorded["eos_id"] != tokenizer.eos_id:
        raise TokenFolderError(
            f"{where}: its documents end with token id {recorded['eos_id']} ({MANIFEST}), but this run's end-of-text "
            f'token "{tokenizer.eos_token}" is id {tokenizer.eos_id}; set tokenizer.eos_token to match, or tokenize '
            "the data again")


# A token folder's first tokens are checked against the model's vocabulary when it is opened (so a
# folder from another tokenizer fails before step 1); every batch is checked again as it is read.
_CHECKED_AT_OPEN = 1 << 16


def open_token_folder(folder: str, stage_name: str, tokenizer: Tokenizer, sequence_length: int,
                      vocab_size: int | None = None, accepted_names: Sequence[str] = (),
                      document_masking: bool = False) -> PackedText:
    """A token folder as packed windows, after checking that it was written for this run's tokenizer and model."""
    where = f'stage "{stage_name}" (dataset_folder {folder})'
    try:
        tokens = TokenFolder(folder, where)
    except TokenFolderError as e:
        raise TokenFolderError(str(e)) from None
    check_folder_tokenizer(tokens, tokenizer, where, accepted_names)
    expected = token_size_for(tokenizer.vocab_size)
    if tokens.token_size != expected:
        raise TokenFolderError(f"{where}: stores {tokens.token_size}-byte tokens, but the tokenizer's vocabulary of "
                               f"{tokenizer.vocab_size} ids is stored in {expected}-byte tokens")
    if vocab_size is not None:
        for file in tokens.files:
            head = file.map[:_CHECKED_AT_OPEN]
            if head.size and int(head.max()) >= vocab_size:
                raise TokenFolderError(f"{where}: {file.path} holds token id {int(head.max())}, outside "
                                       f"model.vocab_size = {vocab_size}")
        tokens.close()
    return PackedText(tokens, sequence_length, where, tokenizer.eos_id if document_masking else None)


def source_inputs(dataset: DatasetArgs | NanosetDatasetsArgs) -> list[tuple[str, float | None, float | None, str | None]]:
    """(source key, weight or None, end weight or None, token folder or None) of each source a stage reads, in
    config order, sources of weight 0 at the start and at the end left out (they would never be read). Config
    only: nothing is opened. `open_sources` opens exactly these, and the loader's blend arithmetic reads them,
    so the two cannot drift apart."""
    if isinstance(dataset, NanosetDatasetsArgs):
        keys, folders = [dataset.source_key(f) for f in dataset.folders], list(dataset.folders)
        weights = dataset.dataset_weights or [None] * len(folders)
    else:
        names = dataset.weighted_names()
        keys, folders, weights = [dataset.source_key(n) for n, _ in names], [None] * len(names), [w for _, w in names]
    ends = dataset.weights_end() or [None] * len(keys)
    return [(k, w, e, f) for k, w, e, f in zip(keys, weights, ends, folders, strict=True) if w != 0 or e not in (None, 0)]


def open_sources(dataset: DatasetArgs | NanosetDatasetsArgs, stage_name: str, tokenizer: Tokenizer,
                 sequence_length: int, cache_dir: str | None = None, vocab_size: int | None = None,
                 accepted_names: Sequence[str] = (), held_out: bool = False,
                 document_masking: bool = False) -> list[NamedSource]:
    """Every source of one stage (`source_inputs`), opened (HF ones tokenized or taken from the cache), in
    config order. `accepted_names`: tokenizer.accept_recorded_names. With held_out_samples = N, each source
    is its samples but the last N, or with `held_out` those N only. With `document_masking`, packed windows
    carry position ids and mask the predictions across documents (`mark_documents`)."""
    inputs, n = source_inputs(dataset), dataset.held_out_samples

    def split(label: str, source):
        return split_held_out(source, n, held_out, f'stage "{stage_name}" ({label})')

    if isinstance(dataset, NanosetDatasetsArgs):
        return [NamedSource(f"dataset_folder {folder}", key, weight,
                            split(f"dataset_folder {folder}",
                                 open_token_folder(folder, stage_name, tokenizer, sequence_length, vocab_size,
                                                   accepted_names, document_masking)), end)
                for key, weight, end, folder in inputs]
    try:
        specs = {spec.key: spec for spec in hf_specs(dataset)}
    except ValueError as e:
        raise StageDataError(f'stage "{stage_name}": {e}') from None
    return [NamedSource(specs[key].label, key, weight,
                        split(specs[key].label, open_hf_source(specs[key], stage_name, tokenizer, sequence_length,
                                                              cache_dir, document_masking)), end)
            for key, weight, end, _ in inputs]
