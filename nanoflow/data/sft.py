"""SFT samples: tokenized rows kept whole, read one a row (padded) or packed several to a window.

A source's rows are tokenized once (prompt + completion + end-of-text, or a conversation rendered with the chat
template: nanoflow.data.chat) into `SFTRows`: every row's tokens, whole, each marked as a target or not. What
a stage reads is decided when it opens, from the rows' lengths alone:

- samples longer than sequence_length + 1 tokens are cut to it, keeping their start ("truncate", the prompt's
  start always stays), or left out ("drop"): `overlong_samples`;
- held_out_samples = N keeps the last N rows out of training (evaluation reads them);
- one sample a row (`SFTExamples`), padded with end-of-text; or, with `packing`, several whole samples a window
  (`PackedSFT`), placed by best-fit decreasing (nanoflow.data.packing): the windows are the samples the stage's
  order permutes, so their count and each one's content are a pure function of the data, and a resume seeks to
  any of them as it seeks to a row.

A sample of n tokens gives n − 1 predictions and needs n − 1 positions: a row holds one of up to
sequence_length + 1 tokens (its last token only a label), and so does a packed window, where each sample starts
at position 0 and attends only to itself (its position ids restart; nanoflow.attention), its last token is the
label of its last position and is not an input, and no position predicts across samples. So a packed window's
loss is the sum of its samples' losses alone, and a sample fits a window exactly when it fits a row. A window's
rest is padding: end-of-text, no targets, positions going on from its last sample's.
"""

from __future__ import annotations

import attrs
import numpy as np

from nanoflow.data.packing import best_fit_decreasing
from nanoflow.data.samples import IGNORE_INDEX, Samples
from nanoflow.data.tokens import StageDataError


@attrs.define
class SFTRows:
    """Tokenized rows, whole: row i's tokens are codes[index[i, 0]:index[i, 1]], each id × 2, + 1 for a target
    (a token the loss is taken on predicting); index[i, 2] is its first target after its first token (or its end)."""

    codes: np.ndarray     # uint32 (or uint64 for vocabularies past 2³¹ ids)
    index: np.ndarray     # [rows, 3] int64: start, end, first target

    @classmethod
    def build(cls, samples, vocab_size: int) -> SFTRows:
        """From (ids, targets) pairs, in order."""
        dtype = np.uint32 if 2 * vocab_size <= 1 << 32 else np.uint64
        pieces, index, at = [], [], 0
        for ids, targets in samples:
            ids = np.asarray(ids, dtype=np.uint64)
            marks = np.asarray(targets, dtype=bool)
            pieces.append((ids * 2 + marks).astype(dtype))
            later = np.flatnonzero(marks[1:])
            index.append((at, at + len(ids), int(later[0]) + 1 if later.size else len(ids)))
            at += len(ids)
        codes = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
        return cls(codes, np.asarray(index, dtype=np.int64).reshape(-1, 3))

    @classmethod
    def join(cls, parts: list[SFTRows]) -> SFTRows:
        """The rows of `parts`, one after another."""
        shifts = np.cumsum([0] + [len(p.codes) for p in parts[:-1]])
        index = [p.index + np.array([s, s, 0]) for p, s in zip(parts, shifts, strict=True)]
        return cls(np.concatenate([p.codes for p in parts]), np.concatenate(index).astype(np.int64))

    def __len__(self) -> int:
        return len(self.index)

    @property
    def lengths(self) -> np.ndarray:
        return self.index[:, 1] - self.index[:, 0]

    def tokens(self, rows: np.ndarray, width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, targets) [len(rows), width] of `rows`: each row's first `width` tokens, then padding (no target)."""
        starts, lengths = self.index[rows, 0], np.minimum(self.lengths[rows], width)
        valid = np.arange(width) < lengths[:, None]
        codes = self.codes[np.where(valid, starts[:, None] + np.arange(width), 0)].astype(np.int64) if len(self.codes) \
            else np.zeros(valid.shape, np.int64)
        return np.where(valid, codes >> 1, pad_id), valid & (codes & 1).astype(bool)


def _labels(ids: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The next token where it is a target, else IGNORE_INDEX (ids/targets [..., n] -> [..., n − 1])."""
    return np.where(targets[..., 1:], ids[..., 1:], IGNORE_INDEX)


@attrs.frozen
class Reading:
    """How a stage reads its SFT rows: the keys of its dataset table and its sequence length."""

    sequence_length: int
    overlong: str = "truncate"   # or "drop"
    packing: bool = False

    @property
    def width(self) -> int:
        return self.sequence_length + 1


def kept_rows(rows: SFTRows, reading: Reading, where: str, held_out: int | None = None,
              tail: bool = False) -> np.ndarray:
    """The rows a stage reads: all but the last `held_out` (or, `tail`, only those), without the over-long ones
    under "drop"; errors name the stage and the numbers."""
    total = len(rows)
    if total == 0:
        raise StageDataError(f"{where}: no rows")
    picked = np.arange(total, dtype=np.int64)
    if held_out:
        if held_out >= total:
            raise StageDataError(f"{where}: held_out_samples = {held_out} leaves nothing to train on: the source has "
                                 f"{total} samples")
        picked = picked[total - held_out:] if tail else picked[:total - held_out]
    if reading.overlong == "drop":
        picked = picked[rows.lengths[picked] <= reading.width]
        if not picked.size:
            raise StageDataError(f"{where}: every sample is longer than sequence_length + 1 = {reading.width} tokens, "
                                 'and overlong_samples = "drop" leaves them all out; raise sequence_length')
    first = rows.index[picked, 2]
    if not (first < np.minimum(rows.lengths[picked], reading.width)).any():
        raise StageDataError(f"{where}: no sample has a token to learn within sequence_length + 1 = {reading.width} "
                             "tokens (every prompt fills the sequence, or no row has a target); raise sequence_length")
    return picked


class SFTExamples:
    """One sample a row: its first sequence_length + 1 tokens, padded with end-of-text (no loss on the padding)."""

    def __init__(self, rows: SFTRows, picked: np.ndarray, sequence_length: int, pad_id: int):
        self.rows, self.picked, self.sequence_length, self.pad_id = rows, picked, sequence_length, pad_id

    def __len__(self) -> int:
        return len(self.picked)

    def sample(self, i: int):
        return self.samples(np.asarray([i])).row(0)

    def samples(self, indices: np.ndarray):
        """The rows `indices`; each is one sample (its padding after it), so no position ids."""
        ids, targets = self.rows.tokens(self.picked[np.asarray(indices, dtype=np.int64)], self.sequence_length + 1,
                                        self.pad_id)
        return Samples(ids[:, :-1], _labels(ids, targets))

    def locate(self, i: int) -> str:
        return f"row {int(self.picked[i])}"

    def close(self) -> None:
        self.rows = self.picked = None  # type: ignore[assignment]  # closed: let go, never read


class PackedSFT:
    """Windows of several whole samples each (the module docstring); window w holds the rows
    picked[members[bounds[w]:bounds[w + 1]]]."""

    def __init__(self, rows: SFTRows, picked: np.ndarray, sequence_length: int, pad_id: int):
        self.rows, self.picked, self.sequence_length, self.pad_id = rows, picked, sequence_length, pad_id
        self.members, self.bounds = best_fit_decreasing(positions(rows.lengths[picked], sequence_length + 1),
                                                        sequence_length)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def sample(self, i: int):
        return self.samples(np.asarray([i])).row(0)

    def samples(self, indices: np.ndarray):
        indices = np.asarray(indices, dtype=np.int64)
        seq, width = self.sequence_length, self.sequence_length + 1
        input_ids = np.full((len(indices), seq), self.pad_id, np.int64)
        labels = np.full((len(indices), seq), IGNORE_INDEX, np.int64)
        position_ids = np.empty((len(indices), seq), np.int64)
        for row, w in enumerate(indices.tolist()):
            members = self.picked[self.members[self.bounds[w]:self.bounds[w + 1]]]
            ids, targets = self.rows.tokens(members, width, self.pad_id)
            at = 0
            for k, n in enumerate(np.minimum(self.rows.lengths[members], width).tolist()):
                if n < 2:
                    continue   # one token: no prediction, no position
                input_ids[row, at:at + n - 1] = ids[k, :n - 1]
                labels[row, at:at + n - 1] = _labels(ids[k, :n], targets[k, :n])
                position_ids[row, at:at + n - 1] = np.arange(n - 1)
                at += n - 1
            last = position_ids[row, at - 1] + 1 if at else 0
            position_ids[row, at:] = np.arange(last, last + seq - at)   # padding: the last sample's document
        return Samples(input_ids, labels, position_ids)

    def locate(self, i: int) -> str:
        members = self.picked[self.members[self.bounds[i]:self.bounds[i + 1]]]
        return f"packed window {i} (rows {', '.join(map(str, members.tolist()))})"

    def close(self) -> None:
        self.rows = self.picked = self.members = self.bounds = None  # type: ignore[assignment]  # closed: let go


def positions(lengths: np.ndarray, width: int) -> np.ndarray:
    """The positions samples of these lengths take, in a row or a packed window: one per prediction, n − 1 for n
    tokens (cut to `width`)."""
    return np.maximum(np.minimum(lengths, width) - 1, 0)


def open_sft(rows: SFTRows, reading: Reading, pad_id: int, where: str, held_out: int | None = None,
             tail: bool = False) -> SFTExamples | PackedSFT:
    """The samples a stage (or, `tail`, an eval set held out of it) reads from `rows`: packed for training when
    the stage packs, else one a row."""
    picked = kept_rows(rows, reading, where, held_out, tail)
    kind = PackedSFT if reading.packing and not tail else SFTExamples
    return kind(rows, picked, reading.sequence_length, pad_id)


@attrs.frozen
class Summary:
    """What --plan says of an SFT source: its samples, the over-long ones, and how much of its windows is padding."""

    samples: int
    overlong: int
    windows_unpacked: int
    windows_packed: int
    padding_unpacked: float    # the share of the windows' positions that are padding, one sample a row
    padding_packed: float      # and packed


def summarize(rows: SFTRows, reading: Reading, held_out: int | None = None) -> Summary:
    """The plan's figures for the rows training reads (held-out rows left out), under `reading`."""
    lengths = rows.lengths[:len(rows) - (held_out or 0)]
    overlong = int((lengths > reading.width).sum())
    if reading.overlong == "drop":
        lengths = lengths[lengths <= reading.width]
    used = positions(lengths, reading.width)
    packed = len(best_fit_decreasing(used, reading.sequence_length)[1]) - 1
    seq, real = reading.sequence_length, int(used.sum())
    return Summary(len(lengths), overlong, len(lengths), packed, 1 - real / max(len(lengths) * seq, 1),
                   1 - real / max(packed * seq, 1))
