"""The order in which a stage reads its samples: a pure function of (seed, stage name, sample index).

Global sample g of a stage with n source samples belongs to epoch g // n and is source sample
perm_epoch(g % n), where perm_epoch is a keyed pseudo-random permutation of range(n). The
permutation is a Feistel network over the smallest even-bit power of two >= n, with cycle walking
to stay inside range(n), so one lookup costs O(1) time and memory: nothing is shuffled or stored,
a resume seeks to any g directly, and the order never depends on rank, world size or on how many
steps a process has replayed.

Round keys come from blake2b of (seed, stage name, epoch); Python's hash() would differ between
processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

ROUNDS = 8
_KEY_BYTES = 8 * ROUNDS   # one 64-bit key per round; blake2b gives at most 64 bytes
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _round_keys(seed: int, stage_name: str, epoch: int) -> np.ndarray:
    message = f"nanoflow.sample_order\0{seed}\0{stage_name}\0{epoch}".encode()
    digest = hashlib.blake2b(message, digest_size=_KEY_BYTES).digest()
    return np.frombuffer(digest, dtype="<u8").astype(np.uint64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit flips about half of the output bits."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


class SampleOrder:
    """The source index of every global sample g >= 0 of one stage; see the module docstring."""

    def __init__(self, seed: int, stage_name: str, n: int):
        if n < 1:
            raise ValueError(f'stage "{stage_name}": cannot order {n} samples; a source needs at least one')
        self.seed, self.stage_name, self.n = int(seed), stage_name, int(n)
        # A balanced Feistel network needs an even number of bits; at least 2 so both halves exist.
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2
        self._half_bits = np.uint64(bits // 2)
        self._half_mask = np.uint64((1 << (bits // 2)) - 1)

    def __getitem__(self, g: int) -> int:
        return int(self.take(np.array([g]))[0])

    def take(self, gs: range | Iterable[int] | np.ndarray) -> np.ndarray:
        """Source indices (int64) of the global samples `gs`, vectorised."""
        gs = np.asarray(gs if not isinstance(gs, range) else np.arange(gs.start, gs.stop, gs.step), dtype=np.int64)
        if gs.size and gs.min() < 0:
            raise IndexError(f'stage "{self.stage_name}": sample indices must be >= 0, got {int(gs.min())}')
        epochs, positions = np.divmod(gs, self.n)
        out = np.empty_like(gs)
        # A batch spans one or two epochs, so this loop is short.
        for epoch in np.unique(epochs):
            where = epochs == epoch
            out[where] = self._permute(positions[where].astype(np.uint64), _round_keys(self.seed, self.stage_name, int(epoch)))
        return out

    def _permute(self, x: np.ndarray, keys: np.ndarray) -> np.ndarray:
        x = self._feistel(x, keys)
        # Cycle walking: the network permutes the whole power-of-two domain; re-applying it to values
        # that landed outside range(n) follows their cycle back into range(n), keeping a bijection.
        outside = x >= self.n
        while outside.any():
            x[outside] = self._feistel(x[outside], keys)
            outside = x >= self.n
        return x.astype(np.int64)

    def _feistel(self, x: np.ndarray, keys: np.ndarray) -> np.ndarray:
        left, right = x >> self._half_bits, x & self._half_mask
        with np.errstate(over="ignore"):   # the mixing multiplies wrap around 2**64 on purpose
            for key in keys:
                left, right = right, left ^ (_mix(right ^ key) & self._half_mask)
        return (left << self._half_bits) | right

    def __repr__(self) -> str:
        return f"SampleOrder(seed={self.seed}, stage_name={self.stage_name!r}, n={self.n})"


def sample_order(seed: int, stage_name: str, n: int) -> SampleOrder:
    """The reading order of a stage with `n` source samples: `order[g]` is the source index of global sample g."""
    return SampleOrder(seed, stage_name, n)
