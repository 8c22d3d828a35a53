"""Choosing partitions for messages: a stable, vectorised key hash (the same key always goes to the same
partition, in every process and language-independent of Python's hash seed) and round robin."""
from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa

_PRIME = np.uint64(1099511628211)  # FNV-64 prime, used as the polynomial base
_MIX1 = np.uint64(0xFF51AFD7ED558CCD)  # murmur3 fmix64 constants
_MIX2 = np.uint64(0xC4CEB9FE1A85EC53)


def key_hashes(keys: pa.Array) -> np.ndarray:
    """64-bit hashes of binary keys: sum(byte_i * P^i) mod 2^64 per key, then murmur's finaliser.
    Null keys hash like empty keys. All numpy, no Python loop per key."""
    keys = keys.cast(pa.binary()) if not pa.types.is_binary(keys.type) else keys
    n = len(keys)
    offsets = np.frombuffer(keys.buffers()[1], dtype=np.int32, count=keys.offset + n + 1)[keys.offset:].astype(np.int64)
    lengths = np.diff(offsets)
    if keys.null_count:
        lengths = np.where(keys.is_valid().to_numpy(zero_copy_only=False), lengths, 0)
    data = np.frombuffer(keys.buffers()[2], dtype=np.uint8) if keys.buffers()[2] is not None else np.empty(0, np.uint8)
    total = int(lengths.sum())
    h = lengths.astype(np.uint64)
    if total:
        starts = offsets[:-1]
        out_starts = np.cumsum(lengths) - lengths
        byte_pos = np.repeat(starts - out_starts, lengths) + np.arange(total)
        within = np.arange(total) - np.repeat(out_starts, lengths)
        with np.errstate(over="ignore"):
            weights = _powers(int(lengths.max()))[within]
            terms = data[byte_pos].astype(np.uint64) * weights
            nonempty = lengths > 0
            h[nonempty] += np.add.reduceat(terms, out_starts[nonempty])
    with np.errstate(over="ignore"):
        h ^= h >> np.uint64(33)
        h *= _MIX1
        h ^= h >> np.uint64(33)
        h *= _MIX2
        h ^= h >> np.uint64(33)
    return h


def _powers(n: int) -> np.ndarray:
    """P^0 .. P^(n-1) mod 2^64 (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        return np.concatenate([np.ones(1, np.uint64), np.cumprod(np.full(n - 1, _PRIME, dtype=np.uint64))])


def partitions_for_keys(keys: pa.Array, num_partitions: int) -> np.ndarray:
    return (key_hashes(keys) % np.uint64(num_partitions)).astype(np.int64)


class RoundRobin:
    def __init__(self):
        self._counter = itertools.count()

    def next(self, num_partitions: int) -> int:
        return next(self._counter) % num_partitions
