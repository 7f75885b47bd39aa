"""Causal self-attention that stays within documents: PyTorch's own causal SDPA, run per document.

A packed row holds several documents. `position_ids` [rows, seq] say where each begins: at every
position 0, and at each row's first token (the convention of transformers' DataCollatorWithFlattening
and of flash-attention's varlen kernels, whose cu_seqlens are read from position_ids the same way).
A token attends to the earlier tokens of its own document only.

No mask is built. Each document is a slice of its row (a view, no copy), attended to with causal SDPA
(is_causal=True: the fused kernel); the outputs are joined with one concatenation per row. The work is
the sum of the documents' squared lengths instead of a row's squared length, and no [seq, seq] mask is
held. Consecutive rows that hold one document each take one causal SDPA call together, and a batch of
such rows only is plain causal SDPA, unchanged. (Batching documents of equal length into one call, through
a gather and a scatter of q, k, v and the output, was measured too: BENCHMARKS.md, "Document masking".)

Grouped heads go to SDPA as they are (enable_gqa), except where that would take the math kernel and k and v
repeated to every query head a fused one (on CUDA: float32, or flash and cuDNN ruled out): then they are
repeated first (grouped_heads_plan, at the end of this module).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch
import torch.nn.functional as F


@attrs.frozen
class Documents:
    """The lengths of each row's documents, in order, worked out once per forward and used by every layer."""

    lengths: tuple[tuple[int, ...], ...]

    @property
    def whole_rows(self) -> bool:
        """Whether every row is one document (then attention is plain causal attention)."""
        return all(len(row) == 1 for row in self.lengths)

    @property
    def count(self) -> int:
        return sum(len(row) for row in self.lengths)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> Documents:
        """The documents position_ids [rows, seq] describe: one starts at each 0 and at each row's start.
        Reads position_ids on the host (free when they are on the CPU, as the loaders give them)."""
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [rows, seq], got shape {list(position_ids.shape)}")
        starts = position_ids.detach().cpu().numpy() == 0
        starts[:, 0] = True
        seq = starts.shape[1]
        return cls(tuple(tuple(np.diff(np.append(np.flatnonzero(row), seq)).tolist()) for row in starts))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     documents: Documents | None = None) -> torch.Tensor:
    """q [rows, heads, seq, head_dim], k and v [rows, kv_heads, seq, head_dim] -> [rows, heads, seq, head_dim]:
    causal attention, within each document when `documents` says where they lie. Query head h reads kv head
    h // (heads // kv_heads) (enable_gqa, the same as transformers' repeat_kv)."""
    if documents is None or documents.whole_rows:
        return _sdpa(q, k, v)
    return _per_document(q, k, v, documents)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if k.shape[1] != q.shape[1] and _expands(q, k):
        group = q.shape[1] // k.shape[1]   # query head h reads kv head h // group, as enable_gqa reads it
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@torch.compiler.disable   # its calls follow each batch's documents: a compiled layer calls it as it is
def _per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents) -> torch.Tensor:
    if q.shape[0] != len(documents.lengths) or any(sum(row) != q.shape[2] for row in documents.lengths):
        raise ValueError(f"documents of {len(documents.lengths)} rows given to attention over "
                         f"{q.shape[0]} rows of {q.shape[2]} positions")
    # Blocks of rows: a run of rows that are one document each (one call), or one row of several documents.
    blocks: list[tuple[int, tuple[int, ...] | None]] = []   # (rows, the row's documents' lengths; None: a run)
    for row in documents.lengths:
        if len(row) == 1 and blocks and blocks[-1][1] is None:
            blocks[-1] = (blocks[-1][0] + 1, None)
        else:
            blocks.append((1, None if len(row) == 1 else row))
    sizes = [rows for rows, _ in blocks]
    outputs = []
    for (_, block), qs, ks, vs in zip(blocks, q.split(sizes), k.split(sizes), v.split(sizes), strict=True):
        if block is None:
            outputs.append(_sdpa(qs, ks, vs))
        else:   # each document a slice of the row's positions (views: split's backward is one concatenation)
            parts = zip(qs.split(block, 2), ks.split(block, 2), vs.split(block, 2), strict=True)
            outputs.append(torch.cat([_sdpa(a, b, c) for a, b, c in parts], dim=2))
    return torch.cat(outputs)


# Grouped-query attention and SDPA's kernels, in torch 2.13 (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
# can_use_*_attention: each kernel's dense check is check_batch_size_and_num_heads_dense<supports_gqa, ...>):
# flash takes grouped heads (supports_gqa = true), cuDNN too (<true, false>: k and v may even differ, since
# pytorch#150337), the memory-efficient kernel does not (<false>: grouped heads are refused; pytorch#191085 adds
# them after 2.13) and the math kernel takes anything. So where flash and cuDNN cannot run (float32, head_dim over
# their limits, cuDNN under deterministic algorithms, GPUs outside their range), a grouped call falls to the math
# kernel, which holds [heads × seq × seq] scores, while the same call with k and v repeated to every query head
# runs the memory-efficient kernel: the same attention (each query head reads its own group's k and v either way).

def expand_grouped_heads(grouped: str, expanded: str) -> bool:
    """Whether to repeat k and v to every query head before SDPA, given the kernel SDPA picks for the grouped call
    (`enable_gqa`, kv heads as they are) and for the same call with kv heads repeated: only when that turns the math
    kernel into a fused one (the repeat costs a copy of k and v, which the fused kernels save many times over)."""
    return grouped == "math" and expanded != "math"


def kernel_choices(heads: int, kv_heads: int, head_dim: int, length: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[str, str]:
    """The kernels torch's dispatcher picks for causal attention of these shapes, under the current SDPA settings
    (sdpa_kernel's context, deterministic algorithms): for the grouped call and for k and v repeated to `heads`."""
    def probe(count: int) -> torch.Tensor:
        return torch.zeros(1, count, length, head_dim, dtype=dtype, device=device, requires_grad=True)

    def name(choice: int) -> str:   # SDPBackend's member, lower case: "flash_attention", "math", ...
        from torch.nn.attention import SDPBackend

        return next((n.lower() for n, b in SDPBackend.__members__.items() if int(b.value) == int(choice)), str(choice))

    query = probe(heads)
    grouped = torch._fused_sdp_choice(query, probe(kv_heads), probe(kv_heads), is_causal=True,
                                      enable_gqa=kv_heads != heads)
    return name(grouped), name(torch._fused_sdp_choice(query, probe(heads), probe(heads), is_causal=True))


_EXPANDS: dict[tuple, bool] = {}   # expand_grouped_heads's answer, by device, dtype, heads and determinism
PROBE_LENGTH = 256   # the kernels' rules look at the sequence length only below a few dozen positions


def grouped_heads_plan(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                       length: int = PROBE_LENGTH) -> tuple[str, bool]:
    """(the kernel causal attention of these shapes runs, whether k and v are repeated to every query head for it),
    asked of torch's dispatcher under the current SDPA settings and remembered for the forwards that follow."""
    key = (device.type, dtype, heads, kv_heads, head_dim, torch.are_deterministic_algorithms_enabled())
    grouped, expanded = kernel_choices(heads, kv_heads, head_dim, length, dtype, device)
    expands = kv_heads != heads and expand_grouped_heads(grouped, expanded)
    _EXPANDS[key] = expands
    return (expanded if expands else grouped), expands


def _expands(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether this grouped call repeats k and v (grouped_heads_plan, asked once per shape of heads). A CPU is not
    asked (its flash kernel takes grouped heads: nanoflow.parallel.runtime.attention_kernel's answer for it at
    start-up says so). Inside a compiled region: the answer given before compiling, or no repeat."""
    key = (q.device.type, q.dtype, q.shape[1], k.shape[1], q.shape[-1], torch.are_deterministic_algorithms_enabled())
    if key in _EXPANDS:
        return _EXPANDS[key]
    if q.device.type == "cpu" or torch.compiler.is_compiling():
        return False
    return grouped_heads_plan(q.shape[1], k.shape[1], q.shape[-1], q.dtype, q.device)[1]
