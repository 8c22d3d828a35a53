"""A segment's key index, ``<start>.keys``: RocketMQ's IndexFile adapted to a partition's segments.

As in RocketMQ: a header, a table of hash slots, and entries chained from their slot by the number of the
previous entry in the same slot, newest first; a query walks one chain. Adapted:

* one file per log segment, so retention removes it with its segment, a replica's truncation cuts only
  the tail's, and a lost or damaged one is rebuilt from its segment alone;
* an entry holds no time: store times never decrease along a partition's offsets, so the partition's time
  index turns a time range into an offset range first (``offset_range``), and a chain, walked newest first,
  stops at the first entry below it. An entry is 12 bytes (RocketMQ's 20): 32 bits of the key's 64-bit
  hash, the previous entry's number, and the offset relative to the segment's base;
* a batch's keys are hashed by one compiled loop (numba), and chained by another when the index is read
  (``KeyIndex._ready``): numpy took 90-180 ns a key (a dozen passes over the words, one sort of the
  slots), as much as the append itself, where the goal is an append rate with the index at least 0.9 of
  the rate without (benchmarks/bench_key_index.py); one loop hashing and chaining per batch took 50-100
  ns a key once the table outgrew the caches; the table grows fourfold (a rebuild) when the chains
  average more than four entries;
* false hash matches are removed by comparing the real key, read from the log at the answer's offset
  (``lookup``'s ``read_keys``);
* an append only queues its batch's keys (``defer``: a copy of the key bytes, under the partition's write
  lock, before the batch is published); one thread per process (``_Indexer``) hashes them while the
  appender writes, fsyncs and replies, and every reader of the index (a lookup, sealing,
  truncation, a write of the file) first applies what is queued, in order, under the index's lock. So a
  lookup finds every message a reader could read when it began, the append path waits for no hashing
  (45-100 ns a key under the write lock before), and a queue longer than ``MAX_LAG_KEYS``
  is applied by the appender itself.

Message ids need no index of their own: ids grow with offsets and are dense in a batch, so the offset
index finds them (``PartitionLog.offset_for_msg_id``).

Pure apart from the indexer thread: arrays and the file's bytes; the log is read by the caller.
docs/storage-format.md, section 15.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import struct
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import pyarrow as pa

from metaq_broker.errors import InvalidQueryError
from metaq_broker.protocol import records
from metaq_broker.protocol.records import crc
from metaq_broker.store.durable import fsync_dir
from metaq_broker.store.offset_index import IndexProblem, read_header

SUFFIX = ".keys"
MAGIC = b"MQKEYIX1"
HEADER = struct.Struct("<8sqqqqIIII")  # then a u32 CRC-32C of these 56 bytes, and zeros to 64
HEADER_SIZE = 64

MIN_SLOT_BITS, MAX_SLOT_BITS = 10, 24  # 2^10 slots at first, four times as many when chains average > LOAD
LOAD = 4  # RocketMQ: 20 M entries, 5 M slots
DEFAULT_MAX_ANSWERS = 64
_WALK_STEPS = 4096  # chain steps before a lookup scans the segment's entries in the range instead
_MASK = (1 << 64) - 1
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_NO_LOCK = contextlib.nullcontext()
_EMPTY = np.zeros(1, np.uint8)  # the data of a column of empty keys
_BINARY = pa.binary()
MAX_LAG_KEYS = 1 << 18  # keys queued by appends and not yet indexed, at most (then the appender indexes them)

log = logging.getLogger(__name__)


def hash_key(key: bytes) -> int:
    """The key's 64-bit hash: over its little-endian 8-byte words ``x_j`` (the last zero-padded), with
    ``y_j = ((x_j + (j + 1)·φ)·M1) mod 2^64``, the sum ``len·φ + Σ (y_j ^ (y_j >> 32))`` modulo 2^64, mixed by
    splitmix64's finaliser (φ, M1 and its constants as in splitmix64). An index keeps its high 32 bits;
    ``_hash_keys`` computes the same for a batch."""
    key = bytes(key)
    total = len(key) * _GOLDEN
    for j in range(0, len(key), 8):
        y = ((int.from_bytes(key[j: j + 8], "little") + (j // 8 + 1) * _GOLDEN) * _M1) & _MASK
        total += y ^ (y >> 32)
    z = total & _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _hash_keys(data, starts, lengths, rels, hashes, offs, n):  # pragma: no cover - run compiled (``_kernels``)
    """Entries n, n + 1, ... (0-based) for the keys ``data[starts[i]:][:lengths[i]]`` (a length below 0: no
    key, no entry) of the messages at relative offsets ``rels[i]``: the high 32 bits of each key's
    ``hash_key`` and the offset, not yet chained (``_chain`` does, when the index is read). Returns the new
    entry count. Touches nothing at random."""
    golden, m1, m2 = np.uint64(_GOLDEN), np.uint64(_M1), np.uint64(_M2)  # local: numba folds them once
    eight, one = np.uint64(8), np.uint64(1)
    for i in range(starts.shape[0]):
        if lengths[i] < 0:
            continue
        a = np.int64(starts[i])
        b = a + np.int64(lengths[i])
        total, place, j = np.uint64(b - a) * golden, one, a
        while j < b:
            x, shift_in = np.uint64(0), np.uint64(0)
            for k in range(j, min(j + 8, b)):
                x |= np.uint64(data[k]) << shift_in
                shift_in += eight
            y = (x + place * golden) * m1
            total += y ^ (y >> np.uint64(32))
            place += one
            j += 8
        total = (total ^ (total >> np.uint64(30))) * m1
        total = (total ^ (total >> np.uint64(27))) * m2
        hashes[n], offs[n] = np.uint32((total ^ (total >> np.uint64(31))) >> np.uint64(32)), rels[i]
        n += 1
    return n


def _chain(h32, rels, slots, shift, hashes, prevs, offs, n):  # pragma: no cover - run compiled (``_kernels``)
    """Chain entries n + 1, n + 2, ... (1-based) with hashes ``h32`` and relative offsets ``rels`` behind
    their slots' heads (``_hash_keys``' entries, or a rebuild's: growth, truncation); returns the count."""
    for i in range(h32.shape[0]):
        s = h32[i] >> shift
        hashes[n], prevs[n], offs[n] = h32[i], slots[s], rels[i]
        n += 1
        slots[s] = n
    return n


_KERNELS = None


def _kernels():
    """(_hash_keys, _chain), compiled on first use and cached on disk by numba."""
    global _KERNELS
    if _KERNELS is None:
        import numba  # lazy: a second to import and compile; lookups (hash_key, chain walks) need neither
        _KERNELS = tuple(numba.njit(cache=True, nogil=True)(f) for f in (_hash_keys, _chain))
    return _KERNELS


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

    Appending only hashes: entries [``_chained``, ``_n``) are hashed, not yet in the slots' chains. Whatever
    reads the chains (a lookup, the file's bytes, ``columns``) chains them first, with the table size
    ``_bits_for`` gives for the entry count (rebuilt when that changed): the same bytes as chaining per
    batch, but the table's random reads and writes come in one tight pass, mostly once per segment (at
    sealing), not batch by batch into a table that the appends' own data pushed out of the caches.

    A writable index serialises ``add``, ``truncate`` and ``candidates`` with its own lock (chains are
    rewritten in place as they grow); a loaded one never changes and takes none."""

    def __init__(self, base_offset: int, start: int, max_slot_bits: int = MAX_SLOT_BITS, capacity: int = 1024):
        """``max_slot_bits`` caps the table (tests make every key collide with 0: one slot)."""
        self.base_offset, self.start, self._next_offset = base_offset, start, base_offset
        self._max_bits = max_slot_bits
        self._bits = slot_bits = _bits_for(0, max_slot_bits)
        self._slots = np.zeros(1 << slot_bits, np.uint32)
        self._hash, self._prev, self._off = (np.zeros(capacity, np.uint32) for _ in range(3))
        self._n = self._chained = 0  # entries; entries in the chains (``_bits`` is ``_bits_for`` of it)
        self._lock: Optional[threading.Lock] = threading.Lock()
        # Appends queued by ``defer`` and not yet applied, oldest first: (first offset, a copy of the key
        # bytes, where each key starts in them (None: back to back), their lengths, next offset); the bytes
        # None for a batch without keys. Appended by the partition's writer, applied and removed under
        # ``_lock``; the keys counted on each side by its one writer.
        self._pending: collections.deque = collections.deque()
        self._queued_keys = self._applied_keys = 0
        self._scheduled = False  # on the indexer's queue

    @property
    def next_offset(self) -> int:
        """The index covers the segment's offsets below this, every queued append applied."""
        self.catch_up()
        return self._next_offset

    @property
    def size(self) -> int:
        """Entries: messages with a key (every queued append applied)."""
        self.catch_up()
        return self._n

    @property
    def slot_bits(self) -> int:
        with self._lock or _NO_LOCK:
            self._ready()
            return self._bits

    def columns(self) -> tuple:
        """(hashes, previous entries, relative offsets) of the entries (every queued append applied)."""
        with self._lock or _NO_LOCK:
            self._ready()
            n = self._n
            return self._hash[:n], self._prev[:n], self._off[:n]

    def _ready(self) -> None:
        """Under ``_lock``: every queued append applied and every entry chained."""
        self._apply_pending()
        n, chained = self._n, self._chained
        if chained == n:
            return
        bits = _bits_for(n, self._max_bits)
        if bits != self._bits:
            self._rebuild(n, bits)
        else:
            _kernels()[1](self._hash[chained:n], self._off[chained:n], self._slots, np.uint32(32 - bits), self._hash,
                          self._prev, self._off, chained)
            self._chained = n

    # -- building ---------------------------------------------------------------------------------------
    def add(self, offsets, keys, next_offset: Optional[int] = None) -> None:
        """Index the non-null ``keys`` (an Arrow binary array, or a sequence of bytes and None) of messages at
        ``offsets``: the first of consecutive offsets (an append's batch), or an increasing array of them
        (decoded messages, markers left out); at or after everything indexed so far. Afterwards the index
        covers offsets below ``next_offset`` (default: one past the last message)."""
        if not isinstance(keys, pa.Array):
            keys = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else pa.array(keys, _BINARY)
        if keys.type != _BINARY:
            keys = keys.cast(_BINARY)
        spans = records.body_keys(records.EncodedBody(len(keys), 0, [], 0, 0, None, 0, 0, keys))
        self.add_spans(offsets, *spans, next_offset=next_offset)

    def add_batches(self, u8: np.ndarray, positions: np.ndarray, next_offset: int) -> None:
        """Index the keys of the whole batches at ``positions`` of ``u8`` (``records.key_spans``: a replica's
        copy, a rebuild from the log), markers left out; afterwards the index covers below ``next_offset``."""
        found = records.key_spans(u8, positions)
        if found is None:
            self.cover(next_offset)
        else:
            offsets, starts, lengths = found
            self.add_spans(offsets, u8, starts, lengths, next_offset)

    def cover(self, next_offset: int) -> None:
        """The index covers offsets below ``next_offset`` (messages without keys, markers)."""
        with self._writing():
            self._apply_pending()
            self._next_offset = max(self._next_offset, next_offset)

    def defer(self, base_offset: int, count: int, body: Optional[records.EncodedBody] = None) -> None:
        """Index an appended batch of ``count`` messages at ``base_offset`` (its keys: ``records.body_keys``;
        a body of None, a marker: none) later: by the indexer thread, or by whoever reads the index first.
        Keeps a copy of the key bytes (a receive buffer may be used again). Callers serialise (the
        partition's write lock) and call in offset order."""
        self._writing()
        keys = None if body is None else body.keys
        if keys is None:
            self._pending.append((base_offset, None, None, None, base_offset + count))
            return
        if isinstance(keys, pa.Array):  # its bytes may be a view of a buffer used again: copied
            data, starts, lengths = records.body_keys(body)
            lo, hi = (int(starts[0]), int(starts[-1]) + max(int(lengths[-1]), 0)) if len(starts) else (0, 0)
            data, starts = data[lo:hi].copy(), starts - lo
        else:  # parsed from a receive buffer: key bytes back to back from ``at``; starts summed when applied
            lengths, at = keys
            data = np.frombuffer(body.parts[0], np.uint8, int(np.maximum(lengths, 0).sum()), at).copy()
            starts = None
        self._pending.append((base_offset, data, starts, lengths.copy(), base_offset + count))
        self._queued_keys += len(lengths)
        if self._queued_keys - self._applied_keys > MAX_LAG_KEYS:  # the indexer is behind: catch up here
            self.catch_up()
        elif not self._scheduled:
            self._scheduled = True
            _INDEXER.schedule(self)

    def catch_up(self) -> None:
        """Apply every queued append (``defer``), in order."""
        if self._pending:
            with self._lock:
                self._apply_pending()

    def _apply_pending(self) -> None:
        """``catch_up`` under ``_lock``. An append is taken off the queue only once applied: one that
        fails stays, and every later reader fails on it too rather than answer without it."""
        pending = self._pending
        while pending:
            base_offset, data, starts, lengths, next_offset = pending[0]
            if data is None:
                self._next_offset = max(self._next_offset, next_offset)
            else:
                if starts is None:
                    sized = np.maximum(lengths, 0)
                    starts = np.cumsum(sized) - sized
                self._add_spans(base_offset, data, starts, lengths, next_offset)
                self._applied_keys += len(lengths)
            pending.popleft()

    def add_spans(self, offsets, data: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                  next_offset: Optional[int] = None) -> None:
        """``add`` for keys given as spans of ``data`` (``records.body_keys``): key i is
        ``data[starts[i]:][:lengths[i]]``, none where the length is below 0."""
        with self._writing():
            self._apply_pending()
            self._add_spans(offsets, data, starts, lengths, next_offset)

    def _add_spans(self, offsets, data: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                   next_offset: Optional[int]) -> None:
        """``add_spans`` under ``_lock``."""
        n = len(starts)
        if isinstance(offsets, (int, np.integer)):
            rels, last = np.arange(n, dtype=np.int64) + (int(offsets) - self.base_offset), int(offsets) + n - 1
        else:
            offsets = np.asarray(offsets, np.int64)
            if len(offsets) != n:
                raise ValueError(f"{len(offsets)} offsets for {n} keys")
            rels, last = offsets - self.base_offset, int(offsets[-1]) if n else None
        keyed = np.flatnonzero(lengths >= 0)
        if len(keyed):
            first, final = int(rels[keyed[0]]), int(rels[keyed[-1]])
            if self.base_offset + first < self._next_offset or final >= 1 << 32:
                raise ValueError(f"offsets {self.base_offset + first}..{self.base_offset + final} cannot follow "
                                 f"this index's (base offset {self.base_offset}, {self._n} entries)")
            self._make_room(len(keyed))
            self._n = _kernels()[0](data if len(data) else _EMPTY, starts, lengths, rels, self._hash, self._off,
                                    self._n)
        cover = next_offset if next_offset is not None else None if last is None else last + 1
        if cover is not None:
            self._next_offset = max(self._next_offset, cover)

    def _writing(self):
        if self._lock is None:
            raise ValueError("a key index read from its file does not change (writable_copy makes one that does)")
        return self._lock

    def _make_room(self, m: int) -> None:
        """Room for ``m`` more entries in the columns."""
        n = self._n
        if n + m >= 1 << 32:
            raise ValueError("a segment's key index holds fewer than 2^32 entries")
        if n + m > len(self._hash):
            self._hash, self._prev, self._off = (_grown(a, n, max(2 * len(a), n + m))
                                                 for a in (self._hash, self._prev, self._off))

    def _rebuild(self, n: int, bits: int) -> None:
        """Slots and chains for the first ``n`` entries, with 2^bits slots (growth, truncation): the same
        bytes as if the table had had that size from the start."""
        slots = np.zeros(1 << bits, np.uint32)
        _kernels()[1](self._hash[:n], self._off[:n], slots, np.uint32(32 - bits), self._hash, self._prev,
                      self._off, 0)
        self._bits, self._slots, self._n, self._chained = bits, slots, n, n

    def truncate(self, offset: int) -> None:
        """Forget every message at or after ``offset`` (a replica's cut of its tail)."""
        with self._writing():
            self._apply_pending()
            k = int(np.searchsorted(self._off[: self._n], max(offset - self.base_offset, 0), "left"))
            if k < self._chained:  # chains through the cut entries: made again without them
                self._rebuild(k, _bits_for(k, self._max_bits))
            self._n = min(self._n, k)
            self._next_offset = min(self._next_offset, max(offset, self.base_offset))

    # -- looking up -------------------------------------------------------------------------------------
    def candidates(self, key_hash: int, lo: int, hi: int, limit: int) -> list:
        """Offsets in [lo, hi) of messages whose key hashes like ``key_hash`` (a 64-bit ``hash_key``),
        newest first, at most ``limit``. Some keys may only share the hash: ``lookup`` compares them."""
        with self._lock or _NO_LOCK:
            self._ready()
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
    def encode(self, segment_size: int = 0) -> list:
        """The file's bytes, as parts for one write: header, slots, then the three entry columns.
        ``segment_size``: bytes of the segment file it describes (a load checks them)."""
        with self._lock or _NO_LOCK:
            self._ready()
            n = self._n
            columns = [np.array(self._slots)] + [np.array(c[:n]) for c in (self._hash, self._prev, self._off)]
            bits, next_offset = self._bits, self._next_offset
        head = HEADER.pack(MAGIC, self.base_offset, self.start, next_offset, segment_size, bits, n,
                           crc(memoryview(columns[0]).cast("B")),
                           _crcs(memoryview(c).cast("B") for c in columns[1:]))
        head += struct.pack("<I", crc(head))
        return [head + b"\0" * (HEADER_SIZE - len(head))] + [memoryview(c).cast("B") for c in columns]

    def write(self, path: Path, segment_size: int = 0) -> None:
        """Write the index whole (temporary name, fsync, rename, fsync of the directory)."""
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            for part in self.encode(segment_size):
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)

    @classmethod
    def load(cls, path: Path, base_offset: int, start: int, segment_size: Optional[int] = None,
             segment_next: Optional[int] = None) -> "KeyIndex":
        """A sealed segment's index from its file, checked (checksums, chains that point back, offsets in
        order; the segment's size and next offset when given), memory-mapped read-only. IndexProblem says
        what is wrong."""
        raw, file_size = read_header(path, HEADER_SIZE)
        magic, base, seg_start, next_offset, size, bits, n, slots_crc, entries_crc = HEADER.unpack_from(raw)
        if magic != MAGIC or crc(raw[:HEADER.size]) != struct.unpack_from("<I", raw, HEADER.size)[0]:
            raise IndexProblem("has a bad header (magic or checksum)")
        if (base, seg_start) != (base_offset, start):
            raise IndexProblem(f"belongs to offset {base}, start {seg_start}; the segment is offset {base_offset}, "
                               f"start {start}")
        if (segment_size is not None and size != segment_size) or (segment_next is not None and
                                                                     next_offset != segment_next):
            raise IndexProblem(f"describes a segment of {size} bytes up to offset {next_offset}; the segment has "
                               f"{segment_size} bytes up to offset {segment_next}")
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
        index._n, index._chained, index._next_offset, index._lock = n, n, next_offset, None
        return index

    def writable_copy(self) -> "KeyIndex":
        """An in-memory copy that ``add`` and ``truncate`` may change (a sealed segment made the tail again)."""
        columns = self.columns()  # every entry chained
        n = len(columns[0])
        copy = KeyIndex(self.base_offset, self.start, self._max_bits, max(1024, 2 * n))
        copy._bits, copy._slots = self._bits, np.array(self._slots)
        for mine, theirs in zip(columns, (copy._hash, copy._prev, copy._off)):
            theirs[:n] = mine
        copy._n = copy._chained = n
        copy._next_offset = self._next_offset
        return copy


class _Indexer:
    """The thread that applies the appends queued on key indexes (``KeyIndex.defer``), one per process,
    started with the first: its compiled kernel releases the GIL, so it hashes while the appending thread
    writes, fsyncs (both without the GIL) and replies. A daemon: what it has not applied at exit is in the
    log, from which the next start rebuilds the tail's index."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pid = None
        self._start = threading.Lock()

    def schedule(self, index: KeyIndex) -> None:
        if self._pid != os.getpid():  # the first use, or a forked child (which has no thread of its parent's)
            with self._start:
                if self._pid != os.getpid():
                    self._queue = queue.SimpleQueue()
                    threading.Thread(target=self._run, args=(self._queue,), name="metaq-key-indexer",
                                     daemon=True).start()
                    self._pid = os.getpid()
        self._queue.put(index)

    @staticmethod
    def _run(work: queue.SimpleQueue) -> None:
        while True:
            index = work.get()
            index._scheduled = False  # before applying: an append queued meanwhile schedules it again
            try:
                index.catch_up()
            except Exception:  # noqa: BLE001 - the append stays queued: every reader of the index fails on it
                log.exception("applying appends to the key index of offset %d failed", index.base_offset)


_INDEXER = _Indexer()


def _crcs(parts) -> int:
    value = 0
    for part in parts:
        value = crc(part, value)
    return value


def _grown(column: np.ndarray, n: int, capacity: int) -> np.ndarray:
    """``column``'s first ``n`` values in a new array of ``capacity`` (twofold growth: few copies, at most
    half of it unused)."""
    out = np.empty(capacity, np.uint32)
    out[:n] = column[:n]
    return out


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
