"""Causal self-attention that stays within documents: PyTorch's own causal SDPA, run per document.

A packed row holds several documents. `position_ids` [rows, seq] say where each begins: at every
position 0, and at each row's first token (the convention of transformers' DataCollatorWithFlattening
and of flash-attention's varlen kernels, whose cu_seqlens are read from position_ids the same way).
A token attends to the earlier tokens of its own document only.

No mask is built. The documents of all rows are cut out of the token stream and grouped by length;
each group is one batch [documents, heads, length, head_dim] for causal SDPA (is_causal=True, the
fused kernel), and one index puts the outputs back in place. The work is the sum of the documents'
squared lengths instead of a row's squared length, and no [seq, seq] mask is held per row. A batch
whose rows hold one document each takes plain causal SDPA on the rows, unchanged.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch
import torch.nn.functional as F


@attrs.frozen
class Documents:
    """Where a batch's documents lie, worked out once per forward (on the host) and used by every layer.

    `order` lists the batch's token indices (row-major over [rows, seq]) document by document, the
    documents sorted by length; `groups` is (documents, length) of each run of equal lengths in that
    order; `inverse` puts them back. `order` is None when every row is one document.
    """

    rows: int
    seq: int
    groups: tuple[tuple[int, int], ...]
    order: torch.Tensor | None
    inverse: torch.Tensor | None

    @property
    def whole_rows(self) -> bool:
        return self.order is None

    @property
    def count(self) -> int:
        return sum(n for n, _ in self.groups)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor, device: torch.device | None = None) -> Documents:
        """The documents position_ids [rows, seq] describe: one starts at each 0 and at each row's start.
        Reads position_ids on the host (free when they are on the CPU, as the loaders give them)."""
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [rows, seq], got shape {list(position_ids.shape)}")
        rows, seq = position_ids.shape
        starts = position_ids.detach().cpu().numpy() == 0
        starts[:, 0] = True
        first = np.flatnonzero(starts.reshape(-1))                       # each document's first token
        lengths = np.diff(np.append(first, rows * seq))
        if len(first) == rows:                                           # one document a row
            return cls(rows, seq, ((rows, seq),), None, None)
        by_length = np.argsort(lengths, kind="stable")
        first, lengths = first[by_length], lengths[by_length]
        values, counts = np.unique(lengths, return_counts=True)
        # token t of sorted document d is first[d] + t: repeat each start over its length and add 0, 1, …
        offsets = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        order = np.repeat(first, lengths) + offsets
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        groups = tuple((int(n), int(length)) for length, n in zip(values, counts, strict=True))
        return cls(rows, seq, groups, torch.from_numpy(order).to(device), torch.from_numpy(inverse).to(device))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     documents: Documents | None = None) -> torch.Tensor:
    """q [rows, heads, seq, head_dim], k and v [rows, kv_heads, seq, head_dim] -> [rows, heads, seq, head_dim]:
    causal attention, within each document when `documents` says where they lie. Query head h reads kv head
    h // (heads // kv_heads) (enable_gqa, the same as transformers' repeat_kv)."""
    if documents is None or documents.whole_rows:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return _per_document(q, k, v, documents)


@torch.compiler.disable   # its shapes change with every batch: a compiled layer calls it as it is
def _per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents) -> torch.Tensor:
    rows, heads, seq, head_dim = q.shape
    if (rows, seq) != (documents.rows, documents.seq):
        raise ValueError(f"documents of a [{documents.rows}, {documents.seq}] batch given to attention over "
                         f"[{rows}, {seq}]")
    sizes = [n * length for n, length in documents.groups]

    def by_document(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # [rows, h, seq, d] -> tokens in document order [rows × seq, h, d], cut into the groups
        tokens = x.transpose(1, 2).reshape(rows * seq, x.shape[1], head_dim)
        return tokens[documents.order].split(sizes)

    outputs = []
    for (n, length), qs, ks, vs in zip(documents.groups, by_document(q), by_document(k), by_document(v), strict=True):
        # n documents of `length` tokens: one batch [n, h, length, d] for the fused causal kernel
        qs, ks, vs = (x.view(n, length, x.shape[1], head_dim).transpose(1, 2) for x in (qs, ks, vs))
        y = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        outputs.append(y.transpose(1, 2).reshape(n * length, heads, head_dim))
    return torch.cat(outputs)[documents.inverse].view(rows, seq, heads, head_dim).transpose(1, 2)
