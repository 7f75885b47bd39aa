"""Blending: which source each global sample of a stage reads, in O(1) and with no per-sample index.

The weights are rounded to integers out of 2**20 (a relative error below 1e-6) and the sources
are the leaves of a balanced binary tree. Each inner node splits the samples that reach it
between its two subtrees, of integer weights a (left) and b - a (right), by a Beatty sequence:
of the first m samples that reach the node,

    L(m) = floor((m * a + b // 2) / b)

go left, so sample number m goes left exactly when L(m + 1) > L(m), and becomes sample L(m) of
the left subtree (or m - L(m) of the right one). So the samples of each source are numbered
0, 1, 2, ... in the order they are read, with no gaps: that number, the source-local index, is
what the source's own epoch-by-epoch permutation (order.py) is applied to.

Mixture: over any window of W consecutive samples, a node sends W * a / b of them left, give or
take less than one; the window's left share is again a run of consecutive samples of the left
subtree, so the error adds up at most once per level. A source's count in any window is within
depth (= ceil(log2 k) for k sources) samples of W × its weight, e.g. within 3 samples of 10,000 for
8 sources, whatever the window's position. Nothing is random here: the data order comes from the
per-source permutations, and the mixture of every batch is as close to the weights as whole
samples allow.

Everything is integer arithmetic on int64, written so that nothing overflows for any sample
index below 2**62.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

RESOLUTION = 1 << 20
MAX_INDEX = 1 << 62


def integer_weights(weights: Sequence[float]) -> list[int]:
    """The weights as integers summing to about RESOLUTION; every positive weight gets at least 1."""
    weights = [float(w) for w in weights]
    if not weights:
        raise ValueError("a blend needs at least one source")
    if any(not math.isfinite(w) or w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(f"blend weights must be finite, >= 0 and not all zero, got {weights}")
    total = sum(weights)
    return [0 if w == 0 else max(1, round(w / total * RESOLUTION)) for w in weights]


class _Node:
    __slots__ = ("left", "right", "a", "b", "leaf")

    def __init__(self, leaves: list[tuple[int, int]]):
        """leaves: (source index, integer weight)."""
        if len(leaves) == 1:
            self.leaf, self.left, self.right = leaves[0][0], None, None
            self.a = self.b = leaves[0][1]
            return
        self.leaf = None
        middle = len(leaves) // 2
        self.left, self.right = _Node(leaves[:middle]), _Node(leaves[middle:])
        self.a = sum(w for _, w in leaves[:middle])
        self.b = self.a + sum(w for _, w in leaves[middle:])

    def lefts(self, m: np.ndarray) -> np.ndarray:
        """L(m): how many of the node's first m samples go left (exact integers, no overflow)."""
        q, r = np.divmod(m, self.b)
        return q * self.a + (r * self.a + self.b // 2) // self.b


class Blend:
    """The source of each global sample g >= 0 of a stage, and its index among that source's samples."""

    def __init__(self, weights: Sequence[float]):
        self.integer_weights = integer_weights(weights)
        self.weights = tuple(w / sum(self.integer_weights) for w in self.integer_weights)
        leaves = [(i, w) for i, w in enumerate(self.integer_weights) if w > 0]
        self._root = _Node(leaves)

    def __len__(self) -> int:
        return len(self.integer_weights)

    def assign(self, gs) -> tuple[np.ndarray, np.ndarray]:
        """(source index, source-local index) of each global sample in `gs`, both int64 arrays."""
        gs = np.asarray(gs, dtype=np.int64).reshape(-1)
        if gs.size and (gs.min() < 0 or gs.max() >= MAX_INDEX):
            raise IndexError(f"sample indices must be in 0..2**62, got {int(gs.min())}..{int(gs.max())}")
        sources = np.empty_like(gs)
        local = np.empty_like(gs)
        stack = [(self._root, np.arange(gs.size), gs)]
        while stack:
            node, where, m = stack.pop()
            if node.leaf is not None:
                sources[where], local[where] = node.leaf, m
                continue
            before = node.lefts(m)
            left = node.lefts(m + 1) > before
            stack.append((node.left, where[left], before[left]))
            stack.append((node.right, where[~left], (m - before)[~left]))
        return sources, local

    def counts(self, n: int) -> list[int]:
        """How many of the global samples 0 .. n - 1 each source reads."""
        if not 0 <= n < MAX_INDEX:
            raise ValueError(f"n must be in 0..2**62, got {n}")
        counts = [0] * len(self.integer_weights)
        stack = [(self._root, n)]
        while stack:
            node, m = stack.pop()
            if node.leaf is not None:
                counts[node.leaf] = m
                continue
            lefts = int(node.lefts(np.int64(m)))
            stack += [(node.left, lefts), (node.right, m - lefts)]
        return counts

    def __repr__(self) -> str:
        return f"Blend({', '.join(f'{w:.6g}' for w in self.weights)})"
