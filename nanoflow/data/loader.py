"""The batches of one stage, addressed by global step: a pure function of (data seed, stage, step).

Step s of a stage that starts at step s0 with global batch size B reads the global samples
g in [(s - s0) * B, (s - s0 + 1) * B); sample g is source.sample(order[g]). Data-parallel rank r
of `world` takes the contiguous slice of B // world rows starting at r * (B // world). Nothing
depends on which steps were read before, so a resumed run asks for its next step directly.
"""

from __future__ import annotations

import numpy as np
import torch

from nanoflow.data.order import SampleOrder, sample_order
from nanoflow.data.sources import Source, open_source
from nanoflow.data.tokenizer import Tokenizer
from nanoflow.schedule import Schedule, stage_steps


class StageLoader:
    """Batches of stage `index` (the index `active_stage` returns; `Config.data_stages` is in the same order)."""

    def __init__(self, config, index: int, tokenizer: Tokenizer, schedule: Schedule | None = None,
                 *, cache_dir: str | None = None):
        schedule = Schedule.from_config(config) if schedule is None else schedule
        self.stage = schedule.stages[index]
        self.steps = stage_steps(schedule, index)
        self.source: Source | None = open_source(config.data_stages[index].data.dataset, self.stage.name,
                                                 tokenizer, self.stage.sequence_length, cache_dir)
        self.order: SampleOrder | None = sample_order(config.data_seed(index), self.stage.name, len(self.source))

    def batch_at(self, step: int, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
        """Rank `rank`'s rows of global step `step`: {"input_ids", "labels"}, each [B // world, seq] int64."""
        if step not in self.steps:
            where = f"steps {self.steps.start}..{self.steps.stop - 1}" if self.steps else "no steps (not reached)"
            raise ValueError(f'step {step} is not a step of stage "{self.stage.name}", which trains {where}')
        batch = self.stage.global_batch_size
        if world < 1 or batch % world:
            raise ValueError(f'stage "{self.stage.name}": global batch size {batch} does not split over {world} ranks')
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside 0..{world - 1}")
        rows = batch // world
        return self.samples((step - self.steps.start) * batch + rank * rows, rows)

    def samples(self, start: int, count: int) -> dict[str, torch.Tensor]:
        """The stage's global samples start .. start + count - 1, as one batch."""
        if self.source is None:
            raise RuntimeError(f'the loader of stage "{self.stage.name}" is closed')
        pairs = [self.source.sample(int(i)) for i in self.order.take(range(start, start + count))]
        return {
            "input_ids": torch.from_numpy(np.stack([inputs for inputs, _ in pairs])),
            "labels": torch.from_numpy(np.stack([labels for _, labels in pairs])),
        }

    def close(self) -> None:
        """Drop the tokenized source so its memory can go before the next stage loads."""
        self.source = None
        self.order = None

    def __enter__(self) -> StageLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.source is None else f"{len(self.source)} samples"
        return f"StageLoader(stage={self.stage.name!r}, steps={self.steps.start}..{self.steps.stop - 1}, {state})"


def open_stage(config, index: int, tokenizer: Tokenizer, schedule: Schedule | None = None,
               *, cache_dir: str | None = None) -> StageLoader:
    return StageLoader(config, index, tokenizer, schedule, cache_dir=cache_dir)
