"""The batches of one stage, addressed by global step: a pure function of (data seed, stage, step).

Step s of a stage that starts at step s0 with global batch size B reads the global samples
g in [(s - s0) * B, (s - s0 + 1) * B). Data-parallel rank r of `world` takes the contiguous slice
of B // world rows starting at r * (B // world). Sample g is found in O(1):

1. the blend (blend.py) names its source k and its index j among source k's samples, from the
   stage's weights alone (one source: k = 0, j = g), or, for a moving mixture (dataset_weights_end),
   from its start and end weights and the stage's length in samples;
2. j is shifted by the samples of source k that earlier stages already read, when the stage
   continues one of them (`continue_from`, see `source_position`);
3. the source's permutation (order.py) maps j to a sample of the source: epoch j // n, position
   perm_epoch(j % n), so an exhausted source wraps around in a fresh order.

Nothing depends on which steps were read before, on the rank, or on worker timing, so a resumed
run asks for its next step directly and gets the bytes an uninterrupted run got.

With `num_loading_workers = N > 0`, N background threads build the next N steps' batches while
the current step trains (the copies out of memory-mapped files release the GIL). A batch is still
a pure function of its step: the workers only decide when it is built. An error in a worker is
raised by `batch_at` in the caller, naming the stage, the sample, the source and the file.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import attrs
import numpy as np
import torch

from nanoflow.data.blend import Blend, MovingBlend, make_blend
from nanoflow.data.order import SampleOrder, sample_order
from nanoflow.data.sources import NamedSource, Source, open_sources, source_inputs
from nanoflow.data.tokenizer import Tokenizer
from nanoflow.data.tokens import StageDataError, TokenFolder
from nanoflow.errors import SampleReadError
from nanoflow.schedule import Schedule, stage_steps

log = logging.getLogger(__name__)


@attrs.define
class OrderedSource:
    """One source of a stage and where its reading order starts."""

    named: NamedSource
    order: SampleOrder      # keyed by the stage (and source) that first read the source
    offset: int             # source-local samples already read by earlier stages (continue_from); 0 otherwise

    @property
    def source(self) -> Source:
        return self.named.source


def stage_samples(schedule: Schedule, index: int) -> int:
    """The samples stage `index` reads over all its steps: the length its mixture moves over."""
    return len(stage_steps(schedule, index)) * schedule.stages[index].global_batch_size


def _stage_blend(config, schedule: Schedule, index: int, inputs) -> Blend | MovingBlend:
    """The blend of stage `index`; token folders without dataset_weights weigh their sample counts."""
    if all(w is not None for _, w, _, _ in inputs):
        weights = [w for _, w, _, _ in inputs]
    else:
        seq = schedule.stages[index].sequence_length
        held_out = config.data_stages[index].data.dataset.held_out_samples or 0   # as open_sources' training part
        weights = [max(0, (len(TokenFolder(folder)) - 1) // seq - held_out) for _, _, _, folder in inputs]
    ends = None if any(e is None for _, _, e, _ in inputs) else [e for _, _, e, _ in inputs]
    return make_blend(weights, ends, stage_samples(schedule, index))


def orders_by_source_key(config, index: int) -> bool:
    """Whether stage `index` draws each source's sample order from the source's key, which holds its location
    (a path, for local data): a stage of several sources does; a one-source stage's order is its name's."""
    return len(source_inputs(config.data_stages[index].data.dataset)) > 1


def _order_name(config, index: int, key: str) -> str:
    """The key of a source's permutation: the stage's name for a single source (so the order of a
    one-source stage does not depend on how its source is spelled), else stage name + source key."""
    name = config.data_stages[index].name
    return f"{name}\0{key}" if orders_by_source_key(config, index) else name


def source_position(config, schedule: Schedule, index: int, key: str) -> tuple[int, str, int]:
    """(seed, order name, offset) of the source `key` in stage `index`.

    Without continue_from: the stage's data seed, its own order, offset 0. With continue_from =
    "earlier": the source's position after the earlier stage, when that stage (or a stage it
    continues, and so on up the chain) reads the source. That position keeps the seed and order
    of the stage that first read the source, and its offset is the sum, over the stages of the
    chain that read it, of the samples of the source each reads over all of its steps in the
    schedule: the stage's blend (moving or not).counts(its steps × its global batch size). So the offset is a
    pure function of the config and the schedule, and the later stage reads on exactly where the
    earlier ones stopped, in the same permutation, with no sample read twice before the epoch ends.
    """
    earlier = config.data_stages[index].data.continue_from
    if earlier is not None:
        position = _position_after(config, schedule, schedule.index(earlier), key)
        if position is not None:
            return position
    return config.data_seed(index), _order_name(config, index, key), 0


def _position_after(config, schedule: Schedule, index: int, key: str) -> tuple[int, str, int] | None:
    """Where source `key` stands after stage `index` has run all its steps; None when neither that stage
    nor the stages it continues read the source."""
    inputs = source_inputs(config.data_stages[index].data.dataset)
    keys = [k for k, _, _, _ in inputs]
    if key in keys:
        seed, name, offset = source_position(config, schedule, index, key)
        consumed = _stage_blend(config, schedule, index, inputs).counts(stage_samples(schedule, index))
        consumed = consumed[keys.index(key)]
        return seed, name, offset + consumed
    earlier = config.data_stages[index].data.continue_from
    return None if earlier is None else _position_after(config, schedule, schedule.index(earlier), key)


class StageLoader:
    """Batches of stage `index` (the index `active_stage` returns; `Config.data_stages` is in the same order)."""

    def __init__(self, config, index: int, tokenizer: Tokenizer, schedule: Schedule, *, cache_dir: str | None = None):
        self.stage = schedule.stages[index]
        self.steps = stage_steps(schedule, index)
        self.vocab_size = config.model.vocab_size
        self.parts: list[OrderedSource] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[tuple[int, int, int], Future] = {}
        self._wrapped: set[int] = set()
        data = config.data_stages[index].data
        self.workers = data.num_loading_workers
        self.document_masking = config.stage_tokens(index).document_masking
        named = open_sources(data.dataset, self.stage.name, tokenizer, self.stage.sequence_length, cache_dir,
                             self.vocab_size, config.tokenizer.accept_recorded_names or (),
                             document_masking=self.document_masking)
        try:
            weights = [len(n.source) if n.weight is None else n.weight for n in named]
            ends = None if any(n.weight_end is None for n in named) else [n.weight_end for n in named]
            self.blend = make_blend(weights, ends, stage_samples(schedule, index))
            self.parts = []
            for n in named:
                seed, order_name, offset = source_position(config, schedule, index, n.key)
                self.parts.append(OrderedSource(n, sample_order(seed, order_name, len(n.source)), offset))
            batch = self.stage.global_batch_size
            for part, start, end in zip(self.parts, self.blend.weights, self.blend.weights_end, strict=True):
                need = min(batch, math.ceil(batch * max(start, end)))   # a moving share peaks at an end
                if len(part.source) < need:
                    raise StageDataError(
                        f'stage "{self.stage.name}" ({part.named.label}): {len(part.source)} samples of sequence_length '
                        f"{self.stage.sequence_length}, fewer than the {need} that each global batch of {batch} reads "
                        "from it, so one batch would repeat samples; add data, or lower the batch size"
                        + (" or its weight" if len(self.parts) > 1 else ""))
        except BaseException:
            for n in named:
                n.source.close()
            self.parts = None
            raise

    # -- batches --

    def _span(self, step: int, rank: int, world: int) -> tuple[int, int]:
        if step not in self.steps:
            where = f"steps {self.steps.start}..{self.steps.stop - 1}" if self.steps else "no steps (not reached)"
            raise ValueError(f'step {step} is not a step of stage "{self.stage.name}", which trains {where}')
        batch = self.stage.global_batch_size
        if world < 1 or batch % world:
            raise ValueError(f'stage "{self.stage.name}": global batch size {batch} does not split over {world} ranks')
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside 0..{world - 1}")
        rows = batch // world
        return (step - self.steps.start) * batch + rank * rows, rows

    def batch_at(self, step: int, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
        """Rank `rank`'s rows of global step `step`: {"input_ids", "labels"}, each [B // world, seq] int64, and
        and "position_ids" (restarting at 0 at each document; 0..seq-1 for a row of one) when the stage masks
        documents or a source of the batch packs several into a row."""
        self._check_open()
        start, count = self._span(step, rank, world)
        if not self.workers:
            batch, epochs = self._build(start, count)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=f"nanoflow-data-{self.stage.name}")
            future = self._pending.pop((step, rank, world), None) or self._pool.submit(self._build, start, count)
            for key in [k for k in self._pending if k[0] <= step or k[1:] != (rank, world)]:
                self._pending.pop(key).cancel()    # a caller that jumped: those batches are not wanted
            for ahead in range(step + 1, min(step + 1 + self.workers, self.steps.stop)):
                if (ahead, rank, world) not in self._pending:
                    self._pending[(ahead, rank, world)] = self._pool.submit(self._build, *self._span(ahead, rank, world))
            batch, epochs = future.result()       # a worker's exception is raised here, in the caller
        self._report_wraps(epochs)
        return batch

    def samples(self, start: int, count: int) -> dict[str, torch.Tensor]:
        """The stage's global samples start .. start + count - 1, as one batch."""
        self._check_open()
        batch, epochs = self._build(start, count)
        self._report_wraps(epochs)
        return batch

    def _check_open(self) -> None:
        if self.parts is None:
            raise RuntimeError(f'the loader of stage "{self.stage.name}" is closed')

    def _build(self, start: int, count: int) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
        """The batch of global samples start .. start + count - 1, and the last epoch it reaches in each source."""
        parts, seq = self.parts, self.stage.sequence_length
        if parts is None:
            raise RuntimeError(f'the loader of stage "{self.stage.name}" is closed')
        gs = np.arange(start, start + count, dtype=np.int64)
        which, local = self.blend.assign(gs)
        inputs = np.empty((count, seq), np.int64)
        labels = np.empty((count, seq), np.int64)
        position_ids = np.tile(np.arange(seq), (count, 1)) if self.document_masking else None
        epochs = {}
        for k, part in enumerate(parts):
            rows = np.flatnonzero(which == k)
            if not rows.size:
                continue
            positions = local[rows] + part.offset
            indices = part.order.take(positions)
            epochs[k] = int(positions.max()) // len(part.source)
            try:
                read = part.source.samples(indices)
            except Exception:   # find the sample that fails, to name it
                for row, i in zip(rows.tolist(), indices.tolist(), strict=True):
                    try:
                        part.source.sample(i)
                    except Exception as e:
                        raise SampleReadError(self._where(part, int(gs[row]), i) + f": {type(e).__name__}: {e}") from e
                raise
            inputs[rows], labels[rows] = read.input_ids, read.labels
            if read.position_ids is not None:   # else one document a row (an SFT row): positions 0..seq-1
                if position_ids is None:
                    position_ids = np.tile(np.arange(seq), (count, 1))
                position_ids[rows] = read.position_ids
            top = max(int(inputs[rows].max()), int(labels[rows].max()))
            if top >= self.vocab_size:
                row = next(r for r in rows.tolist() if max(inputs[r].max(), labels[r].max()) >= self.vocab_size)
                i = int(indices[rows.tolist().index(row)])
                raise SampleReadError(self._where(part, int(gs[row]), i) + f": token id {top} is outside "
                                f"model.vocab_size = {self.vocab_size} (was the data tokenized for another model?)")
        batch = {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels)}
        if position_ids is not None:
            batch["position_ids"] = torch.from_numpy(position_ids)
        return batch, epochs

    def _where(self, part: OrderedSource, g: int, i: int) -> str:
        return f'stage "{self.stage.name}": sample {g} ({part.named.label}, {part.source.locate(i)})'

    def _report_wraps(self, epochs: dict[int, int]) -> None:
        """Say once per source, the first time a batch reaches past its first epoch, that it wrapped around."""
        for k, epoch in epochs.items():
            if epoch > 0 and k not in self._wrapped:
                self._wrapped.add(k)
                part = self.parts[k]
                log.info(f'stage "{self.stage.name}": {part.named.label} wrapped around '
                         f"({len(part.source):,} samples an epoch); now reading epoch {epoch + 1}, each epoch in a "
                         "fresh order (said once per source)")

    # -- lifetime --

    def close(self) -> None:
        """Stop and join the workers, then drop the sources (and their memory maps) before the next stage loads."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self.parts is not None:
            for part in self.parts:
                part.source.close()
        self.parts = None

    def __enter__(self) -> StageLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.parts is None:
            state = "closed"
        else:
            state = ", ".join(f"{p.named.label}: {len(p.source)} samples × {w:.3g}"
                              for p, w in zip(self.parts, self.blend.weights, strict=True))
        return f"StageLoader(stage={self.stage.name!r}, steps={self.steps.start}..{self.steps.stop - 1}, {state})"


def open_stage(config, index: int, tokenizer: Tokenizer, schedule: Schedule, *,
               cache_dir: str | None = None) -> StageLoader:
    """The loader of stage `index` of `schedule` (the config's stage schedule: a run's is nanoflow.run.Run.schedule)."""
    return StageLoader(config, index, tokenizer, schedule, cache_dir=cache_dir)


def check_stages(config, indices: Iterable[int], tokenizer: Tokenizer, schedule: Schedule, *,
                 cache_dir: str | None = None) -> None:
    """Open, and close again, the data of each of these stages; the problems of all of them (a missing column, a
    short or truncated file, a folder of another tokenizer) are raised together, as one StageDataError."""
    problems = []
    for index in indices:
        try:
            open_stage(config, index, tokenizer, schedule, cache_dir=cache_dir).close()
        except StageDataError as e:
            problems.append(e)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise StageDataError(f"{len(problems)} stages cannot train on their data:\n  - "
                             + "\n  - ".join(str(e) for e in problems))
