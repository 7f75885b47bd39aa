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

Moving mixtures (`MovingBlend`, dataset_weights_end): see its docstring. `make_blend` picks the
static Blend whenever the start and end weights round to the same integers, so a stage whose end
weights equal its start weights reads exactly what it read before the end weights existed.
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
            self.leaf: int | None = leaves[0][0]
            self.left: _Node | None = None
            self.right: _Node | None = None
            self.a = self.b = leaves[0][1]
            return
        self.leaf = None
        middle = len(leaves) // 2
        self.left, self.right = _Node(leaves[:middle]), _Node(leaves[middle:])
        self.a = sum(w for _, w in leaves[:middle])
        self.b = self.a + sum(w for _, w in leaves[middle:])

    def lefts(self, m: np.ndarray | np.integer) -> np.ndarray:
        """L(m): how many of the node's first m samples go left (exact integers, no overflow)."""
        q, r = np.divmod(m, self.b)
        return q * self.a + (r * self.a + self.b // 2) // self.b

    def split(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(L(m), whether sample m goes left) for each of the node's sample numbers `m`."""
        before = self.lefts(m)
        return before, self.lefts(m + 1) > before

    def left_count(self, m: int) -> int:
        return int(self.lefts(np.int64(m)))


def _assign(root, gs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source index, source-local index) of each global sample in `gs`: each node's samples split between
    its subtrees, renumbered in each, down to the leaves. The walk of both blends' trees."""
    sources, local = np.empty_like(gs), np.empty_like(gs)
    stack = [(root, np.arange(gs.size), gs)]
    while stack:
        node, where, m = stack.pop()
        if node.leaf is not None:
            sources[where], local[where] = node.leaf, m
            continue
        before, left = node.split(m)
        stack.append((node.left, where[left], before[left]))
        stack.append((node.right, where[~left], (m - before)[~left]))
    return sources, local


def _counts(root, n: int, sources: int) -> list[int]:
    """How many of the global samples 0 .. n - 1 each of `sources` sources reads, by the same walk."""
    if not 0 <= n < MAX_INDEX:
        raise ValueError(f"n must be in 0..2**62, got {n}")
    counts = [0] * sources
    stack = [(root, n)]
    while stack:
        node, m = stack.pop()
        if node.leaf is not None:
            counts[node.leaf] = m
            continue
        lefts = node.left_count(m)
        stack += [(node.left, lefts), (node.right, m - lefts)]
    return counts


class Blend:
    """The source of each global sample g >= 0 of a stage, and its index among that source's samples."""

    def __init__(self, weights: Sequence[float]):
        self.integer_weights = integer_weights(weights)
        self.weights = tuple(w / sum(self.integer_weights) for w in self.integer_weights)
        leaves = [(i, w) for i, w in enumerate(self.integer_weights) if w > 0]
        self._root = _Node(leaves)

    @property
    def weights_end(self) -> tuple[float, ...]:
        """A static blend ends at its start weights."""
        return self.weights

    def assign(self, gs) -> tuple[np.ndarray, np.ndarray]:
        """(source index, source-local index) of each global sample in `gs`, both int64 arrays."""
        gs = np.asarray(gs, dtype=np.int64).reshape(-1)
        if gs.size and (gs.min() < 0 or gs.max() >= MAX_INDEX):
            raise IndexError(f"sample indices must be in 0..2**62, got {int(gs.min())}..{int(gs.max())}")
        return _assign(self._root, gs)

    def counts(self, n: int) -> list[int]:
        """How many of the global samples 0 .. n - 1 each source reads."""
        return _counts(self._root, n, len(self.integer_weights))

    def __repr__(self) -> str:
        return f"Blend({', '.join(f'{w:.6g}' for w in self.weights)})"


class _MovingNode:
    """An inner node of a MovingBlend's tree (or a leaf, when `leaf` is set), in exact Python integers.

    With K = TS·TE (TS, TE: the sums of the start and end integer weights), a set X of sources has
    the start numerator σ = (its start weight)·TE and the end numerator ε = (its end weight)·TS, so
    its share at position u of a stage of N samples is (σ·(N − u) + ε·u) / (K·N), and the number of
    samples it is due after u samples is C(u) = (2σNu + (ε − σ)u²) / (2KN).
    """

    __slots__ = ("leaf", "left", "right", "K", "N", "sA", "eA", "s1", "e1", "hn", "hd")

    def __init__(self, leaves: list[tuple[int, int, int]], TS: int, TE: int, N: int):
        """leaves: (source index, start integer weight, end integer weight)."""
        self.K, self.N = TS * TE, N
        if len(leaves) == 1:
            self.leaf: int | None = leaves[0][0]
            self.left: _MovingNode | None = None
            self.right: _MovingNode | None = None
            return
        self.leaf = None
        middle = len(leaves) // 2
        self.left, self.right = _MovingNode(leaves[:middle], TS, TE, N), _MovingNode(leaves[middle:], TS, TE, N)
        start, end = sum(s for _, s, _ in leaves), sum(e for _, _, e in leaves)
        self.sA, self.eA = start * TE, end * TS
        self.s1 = sum(s for _, s, _ in leaves[:middle]) * TE
        self.e1 = sum(e for _, _, e in leaves[:middle]) * TS
        b = start or end                 # the static Blend's rounding offset (b // 2) / b, so that equal
        self.hn, self.hd = b // 2, b     # start and end weights give exactly its sequence

    def lefts(self, m: int) -> int:
        """L(m) = floor(D(m) + h): how many of the node's first m samples go left, where D(m) = C_left(u) at the
        u where C_node(u) = m. Past C_node(N) (rounding may give a node a sample more than its target by the
        stage's end, and a blend read past its end keeps the end weights) D goes on at the end weights' ratio."""
        K, N, sA, eA, s1, e1, hn, hd = self.K, self.N, self.sA, self.eA, self.s1, self.e1, self.hn, self.hd
        dA, d1 = eA - sA, e1 - s1
        if 2 * K * m > (sA + eA) * N:                    # beyond C_node(N): the end weights' ratio, constant
            rn, rd = (e1, eA) if eA else (s1, sA)
            num = rd * (s1 + e1) * N + rn * (2 * K * m - (sA + eA) * N)
            den = 2 * K * rd
        elif dA == 0:                                     # the node's share is constant: u = K·m / σ
            num = 2 * s1 * sA * N * m + d1 * K * m * m
            den = 2 * N * sA * sA
        else:   # C_left − (d1/dA)·C_node is linear in u, so D = m·d1/dA + c·u/(K·dA), c = σ1·εA − ε1·σA; the root
                # of C_node(u) = m is u = (R − σN)/dA with R = sqrt(σ²N² + 2·dA·K·N·m): D = (P + c·R) / Q
            c = s1 * eA - e1 * sA
            P, Q = K * d1 * dA * m - c * sA * N, K * dA * dA
            t = hd * c
            x = t * t * (sA * sA * N * N + 2 * dA * K * N * m)
            root = math.isqrt(x)
            floor_tR = root if t >= 0 else -(root + (root * root != x))   # floor(t·R), exactly
            return (floor_tR + hd * P + hn * Q) // (hd * Q)
        return (hd * num + hn * den) // (hd * den)

    def split(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(L(m), whether sample m goes left) for each of `m`. A batch is a run of consecutive samples, and so
        is each node's share of it: L, in exact Python integers, is taken once per distinct point."""
        points = np.unique(np.concatenate([m, m + 1]))
        values = np.array([self.lefts(int(p)) for p in points.tolist()], dtype=np.int64)
        before = values[np.searchsorted(points, m)]
        return before, values[np.searchsorted(points, m + 1)] > before

    def left_count(self, m: int) -> int:
        return self.lefts(m)


class MovingBlend:
    """A blend whose shares move linearly, within a stage of N samples, from the start weights at its first
    sample to the end weights at its end; after sample N they stay at the end weights.

    The target: with s_i and e_i the normalised start and end weights, source i's share at position u is
    s_i + (e_i − s_i)·u/N, so after g samples it is due C_i(g) = s_i·g + (e_i − s_i)·g²/(2N) of them.

    The assignment is the static Blend's tree with each inner node's fixed ratio replaced by the moving one:
    a node that has received m samples has received them, in the continuous target, by the position u where
    C_node(u) = m; its left subtree is due D(m) = C_left(u) of them by then, and the node sends the first
    L(m) = floor(D(m) + h) of its samples left (h = (b // 2)/b ∈ [0, 1/2], b its start integer weight).
    D is continuous and nondecreasing with slope C_left'/C_node' ∈ [0, 1], so L rises by 0 or 1 from one
    sample to the next: each sample goes exactly one way, each source's samples are numbered 0, 1, 2, ...
    with no gap, the counts sum to g exactly, and L (a square root, taken with math.isqrt on exact
    integers) gives the source of any g and each source's read position in O(depth), with no index.
    When start and end integer weights are equal, D(m) = a·m/b and L is exactly the static Blend's.

    Bound (proved here): let e_X(g) = n_X(g) − C_X(g), a node's count after g samples minus its target.
    e_root = 0. A child's count is floor(D(n_A) + h) (or n_A minus it, for the right child), and
    D(n_A) = D(C_A(g) + e_A) = C_child(g) + θ·e_A for some θ ∈ [0, 1] (the slope of D), so
    e_child = θ·e_A + r with a rounding error |r| < 1. Hence |e_i(g)| < depth for every source at every g,
    and any window of consecutive samples g1 .. g2 − 1 holds n_i(g2) − n_i(g1) samples of source i, within
    2·depth (= 2·ceil(log2 k)) of its target C_i(g2) − C_i(g1) — the window's length times the mean target
    share over it: within 2 samples for 2 sources, 6 for 8, whatever the window's position or length.
    """

    def __init__(self, weights: Sequence[float], weights_end: Sequence[float], samples: int):
        if len(weights) != len(weights_end):
            raise ValueError(f"{len(weights)} start weights but {len(weights_end)} end weights")
        if not 0 < samples < MAX_INDEX:
            raise ValueError(f"a moving blend needs a stage of 1..2**62 samples, got {samples}")
        self.integer_weights, self.integer_weights_end = integer_weights(weights), integer_weights(weights_end)
        self.samples = samples
        TS, TE = sum(self.integer_weights), sum(self.integer_weights_end)
        self.weights = tuple(w / TS for w in self.integer_weights)
        self.weights_end = tuple(w / TE for w in self.integer_weights_end)
        leaves = [(i, s, e) for i, (s, e) in enumerate(zip(self.integer_weights, self.integer_weights_end, strict=True)) if s or e]
        self.depth = max(0, math.ceil(math.log2(len(leaves))))
        self._root = _MovingNode(leaves, TS, TE, samples)

    def assign(self, gs) -> tuple[np.ndarray, np.ndarray]:
        """(source index, source-local index) of each global sample in `gs`, both int64 arrays."""
        gs = np.asarray(gs, dtype=np.int64).reshape(-1)
        if gs.size and (gs.min() < 0 or gs.max() >= MAX_INDEX - 1):
            raise IndexError(f"sample indices must be in 0..2**62, got {int(gs.min())}..{int(gs.max())}")
        return _assign(self._root, gs)

    def counts(self, n: int) -> list[int]:
        """How many of the global samples 0 .. n - 1 each source reads."""
        return _counts(self._root, n, len(self.integer_weights))

    def __repr__(self) -> str:
        return (f"MovingBlend({', '.join(f'{w:.6g}' for w in self.weights)} -> "
                f"{', '.join(f'{w:.6g}' for w in self.weights_end)} over {self.samples} samples)")


def make_blend(weights: Sequence[float], weights_end: Sequence[float] | None, samples: int) -> Blend | MovingBlend:
    """The blend of a stage of `samples` samples: static unless end weights are given and round to other
    integers than the start weights (a stage of no samples, never read, takes its end weights)."""
    if weights_end is None or integer_weights(weights_end) == integer_weights(weights):
        return Blend(weights)
    return MovingBlend(weights, weights_end, samples) if samples > 0 else Blend(weights_end)

