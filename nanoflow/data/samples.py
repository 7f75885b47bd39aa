"""What a source gives for some sample indices: `Samples` (nanoflow.data.sources has every kind of source)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

IGNORE_INDEX = -100     # the label PyTorch's cross-entropy skips


class Samples(NamedTuple):
    """What a source gives for some sample indices (for one sample, `sample(i)`: the same as 1-D arrays)."""

    input_ids: np.ndarray                    # [n, sequence_length] int64
    labels: np.ndarray                       # the next tokens; IGNORE_INDEX where no loss is taken
    position_ids: np.ndarray | None = None   # restarting at 0 at each document; None: 0..sequence_length-1

    def row(self, i: int) -> Samples:
        return Samples(self.input_ids[i], self.labels[i], None if self.position_ids is None else self.position_ids[i])
