"""A segment's key index, ``<start>.keys``: RocketMQ's IndexFile adapted to a partition's segments.

As in RocketMQ: a header, a table of hash slots, and entries chained from their slot by the number of the
previous entry in the same slot, newest first; a query walks one chain. Adapted:

* one file per log segment, so retention removes it with its segment, a replica's truncation cuts only
  the tail's, and a lost or damaged one is rebuilt from its segment alone;
* an entry holds no time: store times never decrease along a partition's offsets, so the partition's time
  index turns a time range into an offset range first (``offset_range``), and a chain, walked newest first,
  stops at the first entry below it. An entry is 12 bytes (RocketMQ's 20): 32 bits of the key's 64-bit
  hash, the previous entry's number, and the offset relative to the segment's base;
* slots and chains are built per batch with numpy (``add``: one stable sort of the batch's slots, no step
  per message), and the table grows fourfold (a vectorised rebuild) when the chains average more than four;
* false hash matches are removed by comparing the real key, read from the log at the answer's offset
  (``lookup``'s ``read_keys``).

Message ids need no index of their own: ids grow with offsets and are dense in a batch, so the offset
index finds them (``PartitionLog.offset_for_msg_id``).

Pure: arrays and the file's bytes; the log is read by the caller. docs/storage-format.md, section 13.
"""
from __future__ import annotations

import contextlib
import os
import struct
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import pyarrow as pa

from metaq_broker.errors import InvalidQueryError
from metaq_broker.protocol.records import crc
from metaq_broker.store.durable import fsync_dir

SUFFIX = ".keys"
MAGIC = b"MQKEYIX1"
HEADER = struct.Struct("<8sqqqIIII")  # then a u32 CRC-32C of these 48 bytes, and zeros to 64
HEADER_SIZE = 64

MIN_SLOT_BITS, MAX_SLOT_BITS = 10, 26
LOAD = 4  # entries per slot, on average, before the table grows fourfold (RocketMQ: 20 M entries, 5 M slots)
DEFAULT_MAX_ANSWERS = 64
_WALK_STEPS = 4096  # chain steps before a lookup scans the segment's entries in the range instead

# The key hash (``hash_key``): each 8-byte word salted by its place and multiplied, the words summed with the
# length, the sum mixed by splitmix64's finaliser.
_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
_MASK = (1 << 64) - 1
_NO_LOCK = contextlib.nullcontext()


class IndexProblem(Exception):
    """A key index file that cannot be used as it is (the caller rebuilds it from the log)."""


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place on a uint64 array."""
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


def _mix_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _word_int(word: int, place: int) -> int:
    z = ((word + place * 0x9E3779B97F4A7C15) * 0xBF58476D1CE4E5B9) & _MASK
    return z ^ (z >> 32)


def hash_key(key: bytes) -> int:
    """The key's 64-bit hash: ``mix(len·φ + Σ_j w(word_j, j + 1))`` modulo 2^64, over the key's
    little-endian 8-byte words (the last one zero-padded), where ``w(x, p) = y ^ (y >> 32)`` with
    ``y = (x + p·φ)·M1`` and ``mix`` is splitmix64's finaliser. The same function as ``hash_keys``."""
    key = bytes(key)
    total = len(key) * 0x9E3779B97F4A7C15
    for j in range(0, len(key), 8):
        total += _word_int(int.from_bytes(key[j: j + 8], "little"), j // 8 + 1)
    return _mix_int(total & _MASK)


def _words(words: np.ndarray, places: np.ndarray) -> np.ndarray:
    """``w(word, place)`` of ``hash_key`` over arrays (a new array)."""
    z = words + places * _GOLDEN
    z *= _M1
    z ^= z >> _S32
    return z


def hash_keys(keys: pa.Array):
    """(64-bit ``hash_key`` of each non-null key of an Arrow binary array, their row numbers). Vectorised:
    keys up to 64 bytes as a matrix of words (a step per word column), longer ones as one ragged run of
    words; no step per key."""
    if keys.type != pa.binary():
        keys = keys.cast(pa.binary())
    n = len(keys)
    offsets = np.frombuffer(keys.buffers()[1], np.int32, n + 1, keys.offset * 4).astype(np.int64)
    data = keys.buffers()[2]
    data = np.frombuffer(data, np.uint8) if data is not None else np.zeros(1, np.uint8)
    rows = np.arange(n, dtype=np.int64) if not keys.null_count else np.flatnonzero(np.asarray(keys.is_valid()))
    starts, lengths = offsets[:-1][rows], (offsets[1:] - offsets[:-1])[rows]
    m = len(rows)
    if not m:
        return np.empty(0, np.uint64), rows
    longest = int(lengths.max())
    nwords = (lengths + 7) >> 3
    total = lengths.astype(np.uint64) * _GOLDEN
    if longest <= 64:
        width = (longest + 7) // 8
        if m == n and int(lengths.min()) == longest:  # one length, back to back: a reshape
            padded = np.zeros((m, width * 8), np.uint8)
            padded[:, :longest] = data[starts[0]: starts[0] + longest * m].reshape(m, longest)
        else:
            at = starts[:, None] + np.arange(width * 8)
            padded = data[np.minimum(at, len(data) - 1)]
            padded[np.arange(width * 8) >= lengths[:, None]] = 0
        mixed = _words(padded.view("<u8"), np.arange(1, width + 1, dtype=np.uint64))
        full = int(nwords.min())
        for column in range(width):  # a step per word of the longest key, not per key
            total += mixed[:, column] if column < full else np.where(nwords > column, mixed[:, column], 0)
        return _mix(total), rows
    first_word = np.cumsum(nwords) - nwords
    padded = np.zeros(int(nwords.sum()) * 8, np.uint8)
    byte_in_key = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    padded[np.repeat(first_word * 8, lengths) + byte_in_key] = data[np.repeat(starts, lengths) + byte_in_key]
    places = (np.arange(len(padded) // 8, dtype=np.int64) - np.repeat(first_word, nwords) + 1).astype(np.uint64)
    mixed = _words(padded.view("<u8"), places)
    has = nwords > 0
    total[has] += np.add.reduceat(mixed, first_word[has], dtype=np.uint64)
    return _mix(total), rows


def offset_range(since_ms: Optional[int], until_ms: Optional[int], offset_for_timestamp: Callable[[int], int],
                 earliest: int, end: int) -> tuple:
    """The offsets [lo, hi) stored in [since_ms, until_ms] (either open), through the partition's time index:
    store times never decrease along offsets. ``since_ms`` after ``until_ms`` is an error naming both."""
    for name, value in (("since", since_ms), ("until", until_ms)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
            raise InvalidQueryError(f"{name} must be a time in ms since the epoch, got {value!r}")
    if since_ms is not None and until_ms is not None and since_ms > until_ms:
        raise InvalidQueryError(f"since ({since_ms} ms) is after until ({until_ms} ms): no message can be in "
                                f"that time range")
    lo = earliest if since_ms is None else offset_for_timestamp(int(since_ms))
    hi = end if until_ms is None else offset_for_timestamp(int(until_ms) + 1)
    return lo, max(lo, hi)


class KeyIndex:
    """One segment's key index: built in memory batch by batch (the active segment's), or read from its
    file (a sealed segment's, memory-mapped read-only). Covers the segment's offsets [base_offset,
    next_offset). Entries are numbered from 1 (0 ends a chain) and kept as three columns: the high 32 bits
    of the key's hash (whose top ``slot_bits`` bits pick the slot), the previous entry of the slot, and the
    offset relative to ``base_offset``.

    A writable index serialises ``add``, ``truncate`` and ``candidates`` with its own lock (chains are
    rewritten in place as they grow); a loaded one never changes and takes none."""

    def __init__(self, base_offset: int, start: int, max_slot_bits: int = MAX_SLOT_BITS, capacity: int = 1024):
        """``max_slot_bits`` caps the table (tests make every key collide with 0: one slot)."""
        self.base_offset, self.start, self.next_offset = base_offset, start, base_offset
        self._max_bits = max_slot_bits
        self._bits = slot_bits = _bits_for(0, max_slot_bits)
        self._slots = np.zeros(1 << slot_bits, np.uint32)
        self._hash, self._prev, self._off = (np.zeros(capacity, np.uint32) for _ in range(3))
        self._n = 0
        self._lock: Optional[threading.Lock] = threading.Lock()

    @property
    def size(self) -> int:
        """Entries: messages with a key."""
        return self._n

    @property
    def slot_bits(self) -> int:
        return self._bits

    def columns(self) -> tuple:
        """(hashes, previous entries, relative offsets) of the entries."""
        n = self._n
        return self._hash[:n], self._prev[:n], self._off[:n]

    # -- building ---------------------------------------------------------------------------------------
    def add(self, offsets, keys: pa.Array, next_offset: Optional[int] = None) -> None:
        """Index the non-null ``keys`` of messages at ``offsets``: the first of consecutive offsets (an
        append's batch), or an increasing array of them (decoded messages, markers left out); at or after
        everything indexed so far. Afterwards the index covers offsets below ``next_offset`` (default: one
        past the last message)."""
        hashes, rows = hash_keys(keys)  # outside the lock
        if isinstance(offsets, (int, np.integer)):
            rel, last = rows + (int(offsets) - self.base_offset), int(offsets) + len(keys) - 1
        else:
            offsets = np.asarray(offsets, np.int64)
            if len(offsets) != len(keys):
                raise ValueError(f"{len(offsets)} offsets for {len(keys)} keys")
            rel, last = offsets[rows] - self.base_offset, int(offsets[-1]) if len(offsets) else None
        with self._writing():
            if len(rows):
                if self.base_offset + int(rel[0]) < self.next_offset or rel[-1] >= 1 << 32:
                    raise ValueError(f"offsets {self.base_offset + int(rel[0])}..{self.base_offset + int(rel[-1])} "
                                     f"cannot follow this index's (base offset {self.base_offset}, {self._n} entries)")
                self._insert((hashes >> _S32).astype(np.uint32), rel.astype(np.uint32))
            cover = next_offset if next_offset is not None else None if last is None else last + 1
            if cover is not None:
                self.next_offset = max(self.next_offset, cover)

    def _writing(self):
        if self._lock is None:
            raise ValueError("a key index read from its file does not change (writable_copy makes one that does)")
        return self._lock

    def _insert(self, h32: np.ndarray, rel: np.ndarray, grow: bool = True) -> None:
        """Chain entries (hash columns ``h32``, offsets ``rel``) in: each behind the previous entry of its
        slot, in the batch or before it. One stable sort of the batch's slots (radix, 16 bits at a time)
        groups a slot's entries in order; no step per entry."""
        n, m = self._n, len(h32)
        if n + m >= 1 << 32:
            raise ValueError("a segment's key index holds fewer than 2^32 entries")
        if grow and _bits_for(n + m, self._max_bits) != self._bits:
            self._rebuild(n, _bits_for(n + m, self._max_bits))
        if n + m > len(self._hash):
            grown = max(2 * len(self._hash), n + m)
            self._hash, self._prev, self._off = (np.concatenate([a[:n], np.zeros(grown - n, np.uint32)])
                                                 for a in (self._hash, self._prev, self._off))
        slots, slot = self._slots, h32 >> np.uint32(32 - self._bits)
        if m == 1:
            self._prev[n] = slots[slot[0]]
            slots[slot[0]] = n + 1
        else:
            order = _stable_order(slot, self._bits)
            s = slot[order]
            number = order.astype(np.uint32) + np.uint32(n + 1)  # the entries' numbers, in slot order
            differs = s[1:] != s[:-1]
            first = np.empty(m, bool)
            first[0], first[1:] = True, differs
            prev = np.empty(m, np.uint32)
            prev[1:] = number[:-1]
            prev[first] = slots[s[first]]  # the first of a slot's run follows the slot's old head
            self._prev[n: n + m][order] = prev
            last = np.empty(m, bool)
            last[-1], last[:-1] = True, differs
            slots[s[last]] = number[last]
        self._hash[n: n + m], self._off[n: n + m] = h32, rel
        self._n = n + m

    def _rebuild(self, n: int, bits: int) -> None:
        """Slots and chains for the first ``n`` entries, with 2^bits slots (growth, truncation)."""
        fresh = KeyIndex(self.base_offset, self.start, self._max_bits, max(1024, 2 * n))
        fresh._bits, fresh._slots = bits, np.zeros(1 << bits, np.uint32)
        if n:
            fresh._insert(self._hash[:n].copy(), self._off[:n].copy(), grow=False)
        self._bits, self._slots, self._n = fresh._bits, fresh._slots, fresh._n
        self._hash, self._prev, self._off = fresh._hash, fresh._prev, fresh._off

    def truncate(self, offset: int) -> None:
        """Forget every message at or after ``offset`` (a replica's cut of its tail)."""
        with self._writing():
            k = int(np.searchsorted(self._off[: self._n], max(offset - self.base_offset, 0), "left"))
            if k < self._n:
                self._rebuild(k, _bits_for(k, self._max_bits))
            self.next_offset = min(self.next_offset, max(offset, self.base_offset))

    # -- looking up -------------------------------------------------------------------------------------
    def candidates(self, key_hash: int, lo: int, hi: int, limit: int) -> list:
        """Offsets in [lo, hi) of messages whose key hashes like ``key_hash`` (a 64-bit ``hash_key``),
        newest first, at most ``limit``. Some keys may only share the hash: ``lookup`` compares them."""
        with self._lock or _NO_LOCK:
            n, slots, hashes, prevs, rels = self._n, self._slots, self._hash, self._prev, self._off
            if not n or limit < 1:
                return []
            h32 = key_hash >> 32
            lo_rel, hi_rel = max(lo - self.base_offset, 0), hi - self.base_offset
            if hi_rel <= 0 or lo_rel >= 1 << 32:
                return []
            out, e, steps = [], int(slots[h32 >> (32 - self._bits)]), 0
            while e and len(out) < limit:
                rel = int(rels[e - 1])
                if rel < lo_rel:
                    break
                if rel < hi_rel and int(hashes[e - 1]) == h32:
                    out.append(self.base_offset + rel)
                e, steps = int(prevs[e - 1]), steps + 1
                if steps == _WALK_STEPS and e:  # a long chain: scan the entries of the range instead
                    first = int(np.searchsorted(rels[:e], lo_rel, "left"))
                    more = first + np.flatnonzero((hashes[first:e] == h32) & (rels[first:e] < hi_rel))[::-1]
                    out += (self.base_offset + rels[more[: limit - len(out)]].astype(np.int64)).tolist()
                    break
            return out

    # -- the file -----------------------------------------------------------------------------------------
    def encode(self) -> list:
        """The file's bytes, as parts for one write: header, slots, then the three entry columns."""
        with self._lock or _NO_LOCK:
            columns = [np.array(self._slots)] + [np.array(c) for c in self.columns()]
            n, bits, next_offset = self._n, self._bits, self.next_offset
        head = HEADER.pack(MAGIC, self.base_offset, self.start, next_offset, bits, n,
                           crc(memoryview(columns[0]).cast("B")),
                           _crcs(memoryview(c).cast("B") for c in columns[1:]))
        head += struct.pack("<I", crc(head))
        return [head + b"\0" * (HEADER_SIZE - len(head))] + [memoryview(c).cast("B") for c in columns]

    def write(self, path: Path) -> None:
        """Write the index whole (temporary name, fsync, rename, fsync of the directory)."""
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            for part in self.encode():
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)

    @classmethod
    def load(cls, path: Path, base_offset: int, start: int) -> "KeyIndex":
        """A sealed segment's index from its file, checked (checksums, chains that point back, offsets in
        order), memory-mapped read-only. IndexProblem says what is wrong."""
        try:
            with open(path, "rb") as f:
                raw = f.read(HEADER_SIZE)
                file_size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            raise IndexProblem("is missing") from None
        if len(raw) < HEADER_SIZE:
            raise IndexProblem(f"is {len(raw)} bytes, shorter than its header")
        magic, base, seg_start, next_offset, bits, n, slots_crc, entries_crc = HEADER.unpack_from(raw)
        if magic != MAGIC or crc(raw[:HEADER.size]) != struct.unpack_from("<I", raw, HEADER.size)[0]:
            raise IndexProblem("has a bad header (magic or checksum)")
        if (base, seg_start) != (base_offset, start):
            raise IndexProblem(f"belongs to offset {base}, start {seg_start}; the segment is offset {base_offset}, "
                               f"start {start}")
        if not 0 <= bits <= MAX_SLOT_BITS or file_size != HEADER_SIZE + 4 * (1 << bits) + 12 * n:
            raise IndexProblem(f"is {file_size} bytes for 2^{bits} slots and {n} entries")
        slots = np.memmap(path, np.uint32, "r", HEADER_SIZE, (1 << bits,))
        at = HEADER_SIZE + 4 * (1 << bits)
        columns = [np.memmap(path, np.uint32, "r", at + 4 * n * k, (n,)) if n else np.zeros(0, np.uint32)
                   for k in range(3)]
        if crc(memoryview(slots).cast("B")) != slots_crc or \
                _crcs(memoryview(c).cast("B") for c in columns) != entries_crc:
            raise IndexProblem("fails its checksums")
        hashes, prevs, rels = columns
        if (np.diff(rels.astype(np.int64)) < 0).any() or (n and int(rels[-1]) >= next_offset - base) or (
                prevs >= np.arange(1, n + 1, dtype=np.uint32)).any() or (slots > n).any():
            raise IndexProblem("has entries out of order or chains that do not point back")
        index = cls(base_offset, start, MAX_SLOT_BITS, 0)
        index._bits, index._slots, (index._hash, index._prev, index._off) = bits, slots, columns
        index._n, index.next_offset, index._lock = n, next_offset, None
        return index

    def writable_copy(self) -> "KeyIndex":
        """An in-memory copy that ``add`` and ``truncate`` may change (a sealed segment made the tail again)."""
        copy = KeyIndex(self.base_offset, self.start, self._max_bits, max(1024, 2 * self._n))
        copy._bits, copy._slots = self._bits, np.array(self._slots)
        for mine, theirs in zip(self.columns(), (copy._hash, copy._prev, copy._off)):
            theirs[: self._n] = mine
        copy._n, copy.next_offset = self._n, self.next_offset
        return copy


def _crcs(parts) -> int:
    value = 0
    for part in parts:
        value = crc(part, value)
    return value


def _stable_order(slot: np.ndarray, bits: int) -> np.ndarray:
    """np.argsort(slot, kind="stable") for slots of ``bits`` bits, as one or two 16-bit radix sorts (numpy
    radix-sorts 16-bit keys, and compare-sorts wider ones about ten times slower)."""
    if bits <= 16:
        return np.argsort(slot.astype(np.uint16), kind="stable")
    low = np.argsort((slot & np.uint32(0xFFFF)).astype(np.uint16), kind="stable")
    return low[np.argsort((slot[low] >> np.uint32(16)).astype(np.uint16), kind="stable")]


def _bits_for(n: int, max_bits: int = MAX_SLOT_BITS) -> int:
    """Slot bits for ``n`` entries: MIN_SLOT_BITS, plus 2 (four times the slots) until there are at most LOAD
    entries per slot. A function of ``n`` alone, so an index built batch by batch and one rebuilt from the
    log at once are the same bytes."""
    bits = MIN_SLOT_BITS
    while n > LOAD << bits and bits + 2 <= MAX_SLOT_BITS:
        bits += 2
    return min(bits, max_bits)


def lookup(indexes: Sequence[KeyIndex], key: bytes, lo: int, hi: int, read_keys: Callable[[list], list],
           max_answers: int = DEFAULT_MAX_ANSWERS) -> list:
    """Offsets in [lo, hi) of the messages whose key is ``key``, newest first, at most ``max_answers``.
    ``indexes``: the partition's segments' key indexes, oldest first. ``read_keys(offsets)`` returns the
    keys stored at those offsets (None where a reader would not return the message, e.g. an aborted
    transaction's): candidates whose real key differs (a shared hash) are dropped."""
    if isinstance(max_answers, bool) or not isinstance(max_answers, (int, np.integer)) or max_answers < 1:
        raise InvalidQueryError(f"the number of answers must be a positive integer, got {max_answers!r}")
    key, h, answers = bytes(key), hash_key(key), []
    for index in reversed(indexes):
        if index.next_offset <= lo or len(answers) >= max_answers:
            break
        upper = hi
        while len(answers) < max_answers:
            found = index.candidates(h, lo, upper, max_answers - len(answers))
            if not found:
                break
            answers += [o for o, k in zip(found, read_keys(found)) if k is not None and bytes(k) == key]
            upper = found[-1]
    return answers
