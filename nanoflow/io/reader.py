"""Reading checkpoints: any box of any saved tensor, from any layout, fetching only the bytes it needs.

A reader takes each file's header, then just the byte ranges of the saved shards that overlap the
boxes asked for (one range per run of neighbouring tensors; on S3, ranged GETs), and checks every
header and shard against the checksum the metadata records for it before using it. A restore on a
new layout thus reads, on each rank, its part of the checkpoint and not the whole, and the ranks
together check every byte they use. Damage raises DamagedCheckpointError.
"""

from __future__ import annotations

import math

import attrs
import numpy
import torch

from nanoflow.io.checkpoint import (
    CHECKSUM,
    METADATA,
    CheckpointError,
    DamagedCheckpointError,
    _digest,
    first_readable,
    read_marker,
)
from nanoflow.io.store import Store, StoreError
from nanoflow.io.tensorfile import TensorFileError, parse_header, read_head, tensor_at


class CheckpointReader:
    """One committed step folder. Reads any box of any saved tensor by fetching, as byte ranges of
    their files, only the saved shards that overlap it; every shard is checked against the checksum
    recorded for it before it is used. A damaged shard raises DamagedCheckpointError.
    """

    def __init__(self, folder: str):
        self.store = Store(folder)
        self.path = self.store.root
        self.metadata = read_marker(self.store, "", folder)
        self._headers: dict[str, tuple[int, dict]] = {}   # file: (where its data starts, its tensor entries)
        self._fetched: dict[tuple[str, str], list] = {}   # (file, key): [tensor, reads still to serve]
        self._small: dict[str, numpy.ndarray] = {}        # files no bigger than the first read of their header

    def names(self, group: str) -> list[str]:
        return list(self._entries(group))

    def shape(self, group: str, name: str) -> tuple[int, ...]:
        return tuple(self._entries(group)[name]["shape"])

    def read(self, group: str, name: str, offset=None, shape=None) -> torch.Tensor:
        """The box [offset, offset + shape) of tensor `name` (the whole tensor by default).

        A box saved exactly as asked comes back as a view of the buffer it was read into; copy it
        before writing to it.
        """
        entry, offset, shape = self._box(group, name, offset, shape)
        for shard in entry["shards"]:
            if tuple(shard["offset"]) == offset and tuple(shard["shape"]) == shape:  # saved as asked: no copy
                return self._shard(shard)
        box, covered = torch.empty(shape, dtype=getattr(torch, entry["dtype"])), 0
        for shard in _overlapping(entry, offset, shape):
            lo = [max(o, so) for o, so in zip(offset, shard["offset"], strict=True)]
            hi = [min(o + n, so + sn) for o, n, so, sn in zip(offset, shape, shard["offset"], shard["shape"], strict=True)]
            source = tuple(slice(l - so, h - so) for l, h, so in zip(lo, hi, shard["offset"], strict=True))
            target = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offset, strict=True))
            box[target] = self._shard(shard)[source]
            covered += math.prod(h - l for l, h in zip(lo, hi, strict=True))
        if covered != box.numel():
            raise CheckpointError(f"{self.path}: the saved shards of {group} tensor {name} do not cover "
                                  f"the box at {list(offset)} of shape {list(shape)}")
        return box

    def fetch(self, boxes) -> None:
        """Read now, in as few byte ranges as the files allow, every shard the boxes (group, name,
        offset, shape) overlap; `read` then serves them from memory, each dropped after its last use.
        Whoever reads many boxes (a restore, a whole checkpoint) calls this first: a file's wanted
        tensors then come in one request each run of neighbours rather than one per tensor."""
        wanted: dict[tuple[str, str], list] = {}
        for group, name, offset, shape in boxes:
            entry, offset, shape = self._box(group, name, offset, shape)
            exact = [s for s in entry["shards"] if tuple(s["offset"]) == offset and tuple(s["shape"]) == shape]
            for shard in exact[:1] or _overlapping(entry, offset, shape):
                wanted.setdefault((shard["file"], shard["key"]), [shard, 0])[1] += 1
        by_file: dict[str, list] = {}
        for (file, _), (shard, uses) in wanted.items():
            by_file.setdefault(file, []).append((shard, uses))
        for file, shards in by_file.items():
            start, entries = self._header(file)

            def span(item, entries=entries) -> list[int]:  # where a shard's bytes lie, after the header
                return entries[item[0]["key"]]["data_offsets"]

            for run in _neighbours(sorted(shards, key=lambda item: span(item)[0]), span):
                first, last = span(run[0])[0], span(run[-1])[1]
                buffer = self._read_range(file, start + first, last - first)
                for shard, uses in run:
                    at = entries[shard["key"]]["data_offsets"][0] - first
                    self._fetched[(file, shard["key"])] = [self._checked(shard, entries, buffer, at), uses]

    def fill(self, targets) -> None:
        """Fill each target (group, name, offset, shape, tensor) with that box of the saved tensor. A box saved
        exactly as asked, wanted in a CPU tensor of its dtype from a local file, is read straight into the
        tensor's memory and its checksum taken there: no buffer filled, then copied. The others are fetched
        (`fetch`) and copied in. A damaged shard raises DamagedCheckpointError (the tensor then holds junk)."""
        direct: dict[str, list] = {}
        copied = []
        for group, name, offset, shape, tensor in targets:
            entry, offset, shape = self._box(group, name, offset, shape)
            shard = next((s for s in entry["shards"]
                          if tuple(s["offset"]) == offset and tuple(s["shape"]) == shape), None)
            if shard is not None and self._takes_directly(shard, entry, tensor):
                direct.setdefault(shard["file"], []).append((shard, tensor))
            else:
                copied.append((group, name, offset, shape, tensor))
        for file, shards in direct.items():
            self._read_into(file, shards)
        self.fetch(target[:4] for target in copied)
        with torch.no_grad():
            for group, name, offset, shape, tensor in copied:
                tensor.copy_(self.read(group, name, offset, shape))

    def _takes_directly(self, shard: dict, entry: dict, tensor: torch.Tensor) -> bool:
        if self.store.is_s3 or (shard["file"], shard["key"]) in self._fetched:
            return False  # (S3: one ranged GET per run of tensors beats one per tensor)
        self._header(shard["file"])
        return (shard["file"] not in self._small and tensor.device.type == "cpu" and tensor.is_contiguous()
                and tensor.numel() > 0 and tensor.dtype == getattr(torch, entry["dtype"]))

    def _read_into(self, file: str, shards: list) -> None:
        """Each (shard, tensor) of `file` read into the tensor's own bytes, then checked there."""
        start, entries = self._header(file)
        where, pieces = self.store.url(file), []
        for shard, tensor in shards:
            entry = entries.get(shard["key"])
            if entry is None or list(entry["shape"]) != list(shard["shape"]):  # as _checked says
                raise DamagedCheckpointError(f"{where} is damaged: it does not hold {shard['key']} as {METADATA} "
                                             "records it")
            raw = tensor.detach().view(-1).view(torch.uint8).numpy()
            pieces.append((start + entry["data_offsets"][0], memoryview(raw)))
        order = sorted(range(len(pieces)), key=lambda i: pieces[i][0])  # forwards through the file
        try:
            self.store.read_into(file, [pieces[i] for i in order])
        except StoreError as e:
            raise DamagedCheckpointError(str(e)) from e
        for (shard, _), (_, view) in zip(shards, pieces, strict=True):
            if _digest(view) != shard[CHECKSUM]:
                raise DamagedCheckpointError(f"{where} is damaged (the bytes of {shard['key']} differ from their "
                                             f"checksum in {METADATA})")

    def verify(self) -> CheckpointReader:
        """Check every byte of every file now — each header and each shard against its checksum — one
        shard in memory at a time."""
        for entries in self.metadata["tensors"].values():
            for entry in entries.values():
                for shard in entry["shards"]:
                    self._shard(shard)
        return self

    def _entries(self, group: str) -> dict:
        entries = self.metadata["tensors"].get(group)
        if entries is None:
            raise CheckpointError(f"{self.path}: the checkpoint has no {group!r} tensors")
        return entries

    def _box(self, group: str, name: str, offset, shape) -> tuple[dict, tuple[int, ...], tuple[int, ...]]:
        entry = self._entries(group).get(name)
        if entry is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in its {group} group")
        shape = tuple(entry["shape"]) if shape is None else tuple(shape)
        offset = (0,) * len(shape) if offset is None else tuple(offset)
        if len(shape) != len(entry["shape"]) or any(o + n > m for o, n, m in zip(offset, shape, entry["shape"], strict=True)):
            raise CheckpointError(f"{self.path}: {group} tensor {name} has shape {entry['shape']}; the box at "
                                  f"{list(offset)} of shape {list(shape)} does not fit it")
        return entry, offset, shape

    def _shard(self, shard: dict) -> torch.Tensor:
        """One saved shard: fetched before, or read now as its own byte range."""
        key = (shard["file"], shard["key"])
        fetched = self._fetched.get(key)
        if fetched is not None:
            fetched[1] -= 1
            if fetched[1] <= 0:
                del self._fetched[key]
            return fetched[0]
        start, entries = self._header(shard["file"])
        begin, end = entries[shard["key"]]["data_offsets"]
        return self._checked(shard, entries, self._read_range(shard["file"], start + begin, end - begin), 0)

    def _header(self, file: str) -> tuple[int, dict]:
        """(where the tensor bytes start, the tensor entries) of one listed file, read once."""
        if file not in self._headers:
            expected = self.metadata["files"].get(file)
            if expected is None:
                raise CheckpointError(f"{self.path}: {file} is not listed in {METADATA}")
            size = expected["bytes"]
            where = self.store.url(file)
            try:
                length, head = read_head(lambda start, n: self._read_range(file, start, n), size, where)
                if _digest(memoryview(head)[:length]) != expected["header_" + CHECKSUM]:
                    raise TensorFileError(f"its header differs from its checksum in {METADATA}")
                self._headers[file] = (length, parse_header(head, size, where))
                if len(head) == size:  # a small file came whole with its header: its tensors are served from it
                    self._small[file] = head
            except TensorFileError as e:
                raise DamagedCheckpointError(f"{where} is damaged: {e}") from None
        return self._headers[file]

    def _checked(self, shard: dict, entries: dict, buffer, at: int) -> torch.Tensor:
        """The shard's tensor from `buffer` at `at`, once its bytes match the checksum and shape recorded for it."""
        where = self.store.url(shard["file"])
        entry = entries.get(shard["key"])
        # A header that disagrees with the metadata passed its checksum: it was wrong before it was written.
        if entry is None or list(entry["shape"]) != list(shard["shape"]):
            raise DamagedCheckpointError(f"{where} is damaged: it does not hold {shard['key']} as {METADATA} "
                                         "records it")
        begin, end = entry["data_offsets"]
        if _digest(memoryview(buffer)[at:at + end - begin]) != shard[CHECKSUM]:
            raise DamagedCheckpointError(f"{where} is damaged (the bytes of {shard['key']} differ from their "
                                  f"checksum in {METADATA})")
        return tensor_at(buffer, entry, at)

    def _read_range(self, file: str, start: int, length: int):
        if file in self._small:
            return self._small[file][start:start + length]
        try:
            return self.store.read_range(file, start, length)
        except StoreError as e:
            raise DamagedCheckpointError(str(e)) from e


_GAP = 1 << 20           # read through a gap this small between wanted tensors rather than ask again


def _overlapping(entry: dict, offset: tuple[int, ...], shape: tuple[int, ...]) -> list[dict]:
    """The saved shards of a tensor that share at least one element with the box."""
    return [shard for shard in entry["shards"]  # (a scalar's one shard overlaps it: all() of nothing)
            if all(max(o, so) < min(o + n, so + sn)
                   for o, n, so, sn in zip(offset, shape, shard["offset"], shard["shape"], strict=True))
]


def _neighbours(items: list, span) -> list[list]:
    """`items` (sorted by where they start) in runs whose byte spans lie at most _GAP apart."""
    runs: list[list] = []
    for item in items:
        if runs and span(item)[0] - span(runs[-1][-1])[1] <= _GAP:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def open_checkpoint(path: str, *, verify: bool = False) -> CheckpointReader:
    """A reader of a step folder, or of the checkpoint a run folder resumes from (see `latest`).

    Its reads check each shard they use. With `verify`, every header and shard is checked now (one
    shard in memory at a time), and in a run folder a damaged checkpoint gives way to the next one.
    """
    return first_readable(path, lambda folder: CheckpointReader(folder).verify() if verify
                          else CheckpointReader(folder))


@attrs.frozen
class Checkpoint:
    path: str                                   # the step folder
    metadata: dict
    groups: dict[str, dict[str, torch.Tensor]]  # full tensors by group and HF name


def read_checkpoint(path: str, groups: tuple[str, ...] = ("model", "optimizer")) -> Checkpoint:
    """Full tensors of a step folder, or of a run folder's latest intact checkpoint, from any layout."""
    def read(folder: str) -> Checkpoint:
        reader = CheckpointReader(folder)
        reader.fetch((group, name, None, None) for group in groups for name in reader.names(group))
        return Checkpoint(reader.path, reader.metadata, {group: {name: reader.read(group, name)
                                                                 for name in reader.names(group)} for group in groups})
    return first_readable(path, read)


def read_model(path: str) -> dict[str, torch.Tensor]:
    """Full weights by HF name, from a run folder (its latest intact checkpoint) or a step folder, any layout."""
    return read_checkpoint(path, groups=("model",)).groups["model"]
