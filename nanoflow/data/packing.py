"""Packing whole samples into windows: best-fit decreasing, a pure function of the sizes and the capacity.

Samples are placed largest first (ties: the lower index first); each goes into the window whose free room is the
smallest that still holds it (ties: the window opened last), or into a new window when none does. No sample is
split, no window holds more than the capacity, and the same sizes always give the same windows — so a packed
stage's windows, their count and their order are fixed by its data, and a resume reads the windows an unbroken
run read. Best-fit decreasing uses at most 11/9 of the fewest windows possible (plus one).
"""

from __future__ import annotations

import bisect

import numpy as np


def best_fit_decreasing(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(members, bounds): window w holds the samples members[bounds[w]:bounds[w + 1]] (indices into `sizes`,
    largest first). Every sample is in exactly one window; a window's sizes sum to at most `capacity`."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if capacity < 1:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if sizes.size and (sizes.min() < 0 or sizes.max() > capacity):
        bad = int(np.flatnonzero((sizes < 0) | (sizes > capacity))[0])
        raise ValueError(f"sample {bad} has size {int(sizes[bad])}, outside 0..{capacity}")
    order = np.argsort(-sizes, kind="stable")   # largest first; equal sizes in index order
    free_values: list[int] = []                 # the distinct free rooms of open windows, sorted
    by_free: dict[int, list[int]] = {}          # free room -> the windows with it, the last opened last
    window_of = np.empty(len(sizes), dtype=np.int64)
    windows = 0
    for i, size in zip(order.tolist(), sizes[order].tolist(), strict=True):
        k = bisect.bisect_left(free_values, size)
        if k == len(free_values):   # no open window has room: open one
            window, free = windows, capacity
            windows += 1
        else:
            free = free_values[k]
            stack = by_free[free]
            window = stack.pop()
            if not stack:
                del by_free[free], free_values[k]
        window_of[i] = window
        free -= size
        if free not in by_free:
            by_free[free] = []
            bisect.insort(free_values, free)
        by_free[free].append(window)
    # members grouped by window, each window's in placement order (largest first)
    placed = order[np.argsort(window_of[order], kind="stable")]
    counts = np.bincount(window_of, minlength=windows)
    return placed, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
