"""One segment of a partition log: ``<start>.meta`` (header + batches), its sparse offset index
``<start>.index`` (``offset_index``) and, for a topic with a key index, its key index ``<start>.keys``
(``keyindex``).

``start`` is the segment's position in the partition's logical byte stream (the 20-digit file name), so
segments are contiguous when each one's start plus its size is the next one's start, as in MetaQ. The
header also records the segment's first offset, so the log alone says which offsets it holds; the index
is derived data, checked against the log and rebuilt from it when it is missing or wrong.

Every lookup (the batch holding an offset, a fetch's run of whole batches, the first batch at or after a
time, the message bytes before an offset) takes the index entry at or before what it looks for and walks
the batch headers from there: at most one window of ``interval`` bytes, read with one ``pread``."""
from __future__ import annotations

import bisect
import logging
import os
import struct
import threading
import weakref
from dataclasses import fields
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

import numpy as np

from metaq_broker.errors import CorruptLogError
from metaq_broker.protocol import records
from metaq_broker.protocol.records import crc
from metaq_broker.store import keyindex, offset_index
from metaq_broker.store.durable import append_or_cut_back, fsync_dir, write_all
from metaq_broker.store.keyindex import IndexProblem as KeyIndexProblem
from metaq_broker.store.keyindex import KeyIndex
from metaq_broker.store.offset_index import BATCH_DTYPE, ENTRY_DTYPE, Summary

log = logging.getLogger(__name__)

LOG_SUFFIX = ".meta"
INDEX_SUFFIX = offset_index.SUFFIX
KEYS_SUFFIX = keyindex.SUFFIX
READ_CHUNK = 64 << 20  # bytes of batches read at a time by header scans and key index rebuilds
NAME_DIGITS = 20
# Read with a window, so that a batch starting at its very end brings its header along (headers are at most
# this long). A walk reads the fields every batch version has in its first bytes (``records.HEADER``).
_HEADER_ROOM = 128
_BATCH_LEN = struct.Struct("<I")

SEGMENT_MAGIC = b"MQSEGMT2"  # MQSEGMT1 segments held version 1 batches, with CRC-32 checksums
SEGMENT_HEADER = struct.Struct("<8sqqI")  # magic, base offset, start position, crc of the preceding bytes
SEGMENT_HEADER_SIZE = SEGMENT_HEADER.size + 4  # padded to 32
assert SEGMENT_HEADER_SIZE == 32

def segment_name(start: int) -> str:
    return f"{start:0{NAME_DIGITS}d}"


def encode_segment_header(base_offset: int, start: int) -> bytes:
    body = struct.pack("<8sqq", SEGMENT_MAGIC, base_offset, start)
    return body + struct.pack("<I", crc(body)) + b"\0" * 4


def decode_segment_header(raw: bytes, path: Path, start: int) -> int:
    """Return the base offset recorded in a segment header, or raise CorruptLogError."""
    if len(raw) < SEGMENT_HEADER_SIZE:
        raise CorruptLogError(f"{path}: segment header is {len(raw)} of {SEGMENT_HEADER_SIZE} bytes", path, 0)
    magic, base, recorded_start, header_crc = SEGMENT_HEADER.unpack_from(raw)
    if magic == b"MQSEGMT1":
        raise CorruptLogError(f"{path}: segment format 1 (CRC-32 checksums), written by an older metaq; this "
                              f"version reads only {SEGMENT_MAGIC.decode()} (CRC-32C)", path, 0)
    if magic != SEGMENT_MAGIC or crc(raw[:24]) != header_crc:
        raise CorruptLogError(f"{path}: bad segment header (magic or checksum)", path, 0)
    if recorded_start != start:
        raise CorruptLogError(f"{path}: header says the segment starts at {recorded_start}, the name says {start}",
                              path, 0)
    return base




# Where a walk finds each header field in ``records.HEADER``'s tuple (the batch format's own layout).
_LEN, _MAGIC, _COUNT, _BASE, _TIMESTAMP, _MSG_ID = (
    [f.name for f in fields(records.BatchHeader)].index(name)
    for name in ("batch_len", "magic", "count", "base_offset", "timestamp", "base_msg_id"))


class Batch(NamedTuple):
    """One batch, from its header: offsets [offset, offset + count), bytes [position, position + length)."""

    offset: int
    count: int
    position: int  # logical
    length: int
    timestamp: int
    msg_id: int  # of its first message

    @property
    def next_offset(self) -> int:
        return self.offset + self.count

    @property
    def end(self) -> int:
        return self.position + self.length


def batch_header(buf, pos: int = 0) -> Batch:
    """The fields of the batch header at ``buf[pos]`` that every batch version has first (no checks)."""
    h = records.HEADER.unpack_from(buf, pos)
    return Batch(h[_BASE], h[_COUNT], pos, h[_LEN], h[_TIMESTAMP], h[_MSG_ID])


class Segment:
    """A segment file and its sparse index. Only the last segment of a partition is appended to.

    Readers take no lock: they bound every lookup by the end offset of their snapshot (``end``), below
    which every batch is wholly written and every index entry in place (an append writes the file, then
    its entries, then publishes ``_n``; readers read ``_n`` before ``_entries``).

    Its key index (a topic with ``key_index``): ``keys``, built in memory while the segment is appended
    to (the partition queues each batch's keys under its write lock, before publishing them; the indexer
    thread or the next reader of the index applies them: ``KeyIndex.defer``); once sealed (which applies
    the queue), written to ``<start>.keys`` by ``write_keys`` (outside the partition's write lock) and then
    read from the file when first asked (``key_index``), rebuilt from the log if the file is missing or
    damaged.
    ``_keys_lock`` guards that loading and writing."""

    def __init__(self, directory: Path, start: int, base_offset: int, fd: int, size: int, summary: Summary,
                 entries: np.ndarray, mutable: bool, n: Optional[int] = None, keys: Optional[KeyIndex] = None):
        self.directory = directory
        self.start = start
        self._path = directory / (segment_name(start) + LOG_SUFFIX)  # named in every append's error path
        self.base_offset = base_offset
        self.fd = fd
        self.size = size  # bytes in the file, header included
        self.count = summary.next_offset - base_offset
        self.bytes = summary.bytes  # message bytes (keys, values, attributes and column entries)
        self.last_timestamp: Optional[int] = summary.last_timestamp if self.count else None
        self.last_position: Optional[int] = summary.last_position if self.count else None
        self.first_msg_id, self.last_msg_id = summary.first_msg_id, summary.last_msg_id
        self.interval = summary.interval
        # (least, greatest) create time - store time of its messages, or wider (offset_index.Summary); one
        # tuple, replaced whole and only ever widened, so a reader sees bounds holding every batch below its end
        self.skew = (summary.min_skew, summary.max_skew)
        self._entries = entries  # [0, _n) are valid; spare capacity while mutable
        self._n = len(entries) if n is None else n
        self._bucket = (int(offset_index.bucket(entries[self._n - 1]["position"], start, self.interval)) if self._n
                        else -1)
        self.mutable = mutable
        self.closed = False
        self.removed = False  # set by retention and cuts before the files go: no key index is written then
        self.keys = keys  # the key index in memory: the active segment's, or a sealed one's once read
        self._keys_unwritten = False  # sealed, its key index not yet in its file (``write_keys``)
        self._keys_lock = threading.Lock()
        # The descriptor is closed when the last holder lets go: a reader that took a snapshot can
        # finish reading a segment that retention has just removed.
        self._close_fd = weakref.finalize(self, os.close, fd)

    # -- naming -------------------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self._path

    @property
    def index_path(self) -> Path:
        return self.directory / (segment_name(self.start) + INDEX_SUFFIX)

    @property
    def keys_path(self) -> Path:
        return self.directory / (segment_name(self.start) + KEYS_SUFFIX)

    @property
    def end(self) -> int:
        """Logical position just past this segment."""
        return self.start + self.size

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.count

    def summary(self) -> Summary:
        return Summary(self.base_offset, self.start, self.size, self.next_offset, self.bytes,
                       self.last_timestamp or 0, -1 if self.last_position is None else self.last_position,
                       self.first_msg_id, self.last_msg_id, self.interval, *self.skew)

    def entries(self, end: Optional[int] = None) -> np.ndarray:
        """The index entries (of batches below offset ``end``, if given)."""
        n = self._n
        e = self._entries[:n]
        return e if end is None or end >= self.next_offset else e[:int(np.searchsorted(e["offset"], end, "left"))]

    # -- creation -----------------------------------------------------------------------------------
    @classmethod
    def create(cls, directory: Path, start: int, base_offset: int, interval: int = offset_index.DEFAULT_INTERVAL,
               capacity: int = 64, keyed: bool = False) -> "Segment":
        """Create an empty segment; its header and the directory entry are fsynced before it is used.
        ``capacity``: index entries to make room for at once (a roll passes the last segment's count);
        ``keyed``: with a key index."""
        path = directory / (segment_name(start) + LOG_SUFFIX)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            write_all(fd, [encode_segment_header(base_offset, start)])
            os.fsync(fd)
            fsync_dir(directory)
        except BaseException:
            os.close(fd)
            raise
        return cls(directory, start, base_offset, fd, SEGMENT_HEADER_SIZE,
                   offset_index.summary_of(np.empty(0, BATCH_DTYPE), base_offset, start, SEGMENT_HEADER_SIZE, interval),
                   np.empty(max(capacity, 64), ENTRY_DTYPE), True, 0, KeyIndex(base_offset, start) if keyed else None)

    @classmethod
    def from_batches(cls, directory: Path, start: int, base_offset: int, fd: int, size: int, batches: np.ndarray,
                     interval: int) -> "Segment":
        """The active segment holding exactly ``batches`` (BATCH_DTYPE, from recovery's scan), its index built."""
        entries, _ = offset_index.entries_for(batches, start, interval, -1, 0)
        spare = np.empty(max(64, 2 * len(entries)), ENTRY_DTYPE)
        spare[:len(entries)] = entries
        return cls(directory, start, base_offset, fd, size,
                   offset_index.summary_of(batches, base_offset, start, size, interval), spare, True, len(entries))

    # -- appending ----------------------------------------------------------------------------------
    def append(self, parts: list, nbytes: int, batches) -> None:
        """Write whole batches at the end of the file and index them. ``batches``: a BATCH_DTYPE array (a
        replica's copy: indexed vectorised), or a list of (offset, position, timestamp, length, count, bytes,
        msg_id, min_skew, max_skew) tuples (an append's one or two batches: plain arithmetic, cheaper than
        numpy for so few).

        On a failed write the file is cut back to where it was, so no partial batch stays behind."""
        assert self.mutable
        append_or_cut_back(self.fd, self.path, parts, self.size)
        if isinstance(batches, np.ndarray):
            self.skew = offset_index.skew_bounds(batches, self.skew)  # before the batches are published
            new, self._bucket = offset_index.entries_for(batches, self.start, self.interval, self._bucket, self.bytes)
            self._add_entries(new)
            if not self.count:
                self.first_msg_id = int(batches[0]["msg_id"])
            last = batches[-1]
            self.bytes += int(batches["bytes"].sum())
            self.last_timestamp, self.last_position = int(last["timestamp"]), int(last["position"])
            self.last_msg_id = int(last["msg_id"] + last["count"] - 1)
            self.count += int(batches["count"].sum())
        else:
            for offset, position, timestamp, _, count, nbytes_messages, msg_id, low, high in batches:
                if low < self.skew[0] or high > self.skew[1]:
                    self.skew = (min(low, self.skew[0]), max(high, self.skew[1]))
                window = (position - self.start) // self.interval  # offset_index.bucket, inline
                if window > self._bucket:
                    self._add_entries([(offset, position, timestamp, self.bytes)])
                    self._bucket = window
                if not self.count:
                    self.first_msg_id = msg_id
                self.bytes += nbytes_messages
                self.count += count
                self.last_timestamp, self.last_position, self.last_msg_id = timestamp, position, msg_id + count - 1
        self.size += nbytes

    def _add_entries(self, new) -> None:
        if not len(new):
            return
        n = self._n
        if n + len(new) > len(self._entries):
            grown = np.empty(max(2 * n, n + len(new), 64), ENTRY_DTYPE)
            grown[:n] = self._entries[:n]
            self._entries = grown  # readers holding the old array still see their (unchanged) entries
        self._entries[n: n + len(new)] = new
        self._n = n + len(new)  # published after the entries: readers never see one half written

    def fsync(self) -> None:
        os.fsync(self.fd)

    def seal(self) -> None:
        """Make the segment immutable: fsync the log, write and fsync the index, map it read-only. Its key
        index is complete then, and ``write_keys`` writes it; without one, a file left by an earlier
        configuration goes (it may describe other bytes once this segment is cut)."""
        if not self.mutable:
            return
        os.fsync(self.fd)
        entries = self.entries()
        offset_index.write(self.index_path, self.summary(), entries)
        self._entries = offset_index.load(self.index_path, self.base_offset, self.start, self.size,
                                          self.next_offset, self.start + SEGMENT_HEADER_SIZE)[1]
        self.mutable = False
        if self.keys is not None:
            self.keys.cover(self.next_offset)
            self._keys_unwritten = True
        else:
            self.keys_path.unlink(missing_ok=True)

    def write_keys(self) -> None:
        """Write a sealed segment's key index to ``<start>.keys`` (tmp, fsync, rename, directory fsync), then
        let go of the copy in memory: lookups map the file from then on. A failed write (a full disk) is
        logged and left to a later lookup, which rebuilds the file from the log."""
        with self._keys_lock:
            if not self._keys_unwritten:
                return
            self._keys_unwritten = False
            if self.removed:
                return
            try:
                self.keys.write(self.keys_path, self.size)
            except OSError as e:
                log.warning("%s: could not write its key index (%s); a lookup rebuilds it from the log",
                            self.path, e)
            if self.removed:  # retention took the segment meanwhile
                self.keys_path.unlink(missing_ok=True)
            self.keys = None

    def key_index(self) -> KeyIndex:
        """The segment's key index: the one in memory, else its file's (read once, checked), else one
        rebuilt from the log and written (a file missing or damaged: logged). Only for a topic with a key
        index: the active segment of one without has none to give."""
        keys = self.keys
        if keys is not None:
            return keys
        with self._keys_lock:
            if self.keys is None:
                if self.mutable:
                    raise ValueError(f"{self.path}: this segment keeps no key index")
                self.keys = self._read_keys()
            return self.keys

    def _read_keys(self) -> KeyIndex:
        try:
            return KeyIndex.load(self.keys_path, self.base_offset, self.start, self.size, self.next_offset)
        except KeyIndexProblem as e:
            log.warning("%s %s; rebuilding it from the log", self.keys_path, e)
        return self._rebuilt_keys()

    def _rebuilt_keys(self) -> KeyIndex:
        """The key index built from the log, written to its file and mapped from there (kept in memory if
        the write fails)."""
        index = self.build_keys()
        if self.removed:
            return index
        try:
            index.write(self.keys_path, self.size)
            return KeyIndex.load(self.keys_path, self.base_offset, self.start, self.size, self.next_offset)
        except (OSError, KeyIndexProblem) as e:
            log.warning("%s: could not write the rebuilt key index (%s); using it from memory", self.keys_path, e)
            return index

    def rebuild_keys(self) -> KeyIndex:
        """A sealed segment's key index built again from the log and written over its file."""
        with self._keys_lock:
            self._keys_unwritten = False
            self.keys = self._rebuilt_keys()
            return self.keys

    def keys_problem(self) -> Optional[str]:
        """What is wrong with a sealed segment's ``.keys`` file, if there is one: it does not load, or it is
        not the index its log makes. None: no file, or a sound one."""
        if not self.keys_path.exists():
            return None
        try:
            found = KeyIndex.load(self.keys_path, self.base_offset, self.start, self.size, self.next_offset)
        except KeyIndexProblem as e:
            return str(e)
        made = self.build_keys()
        if b"".join(map(bytes, found.encode(self.size))) != b"".join(map(bytes, made.encode(self.size))):
            return f"is not the index its log makes ({found.size} entries; the log makes {made.size})"
        return None

    def build_keys(self) -> KeyIndex:
        """A key index of the segment's batches, from the log: read ``READ_CHUNK`` at a time, their keys
        hashed and chained per chunk (``KeyIndex.add_batches``)."""
        index = KeyIndex(self.base_offset, self.start)
        for u8, positions, next_offset in self.chunks(self.base_offset, self.next_offset):
            index.add_batches(u8, positions, next_offset)
        return index

    def chunks(self, start: int, stop: int):
        """(bytes, batch starts in them, the offset after them) of the written batches holding offsets
        [start, stop) of this segment, ``READ_CHUNK`` at a time."""
        offset = start
        while offset < stop:
            first, length, next_offset = self.plan(offset, stop, READ_CHUNK, stop)
            u8 = self.read(first, length)
            yield u8, batch_starts(u8, self.path), next_offset
            offset = next_offset

    def truncated(self, cut: int, keyed: bool = False) -> "Segment":
        """This segment cut before offset ``cut`` (a batch start), fsynced, and appendable again (a
        replica's truncation). A new object with its own descriptor: readers holding this one keep what
        they took, and its close never writes an index for the cut file. A stale ``.index`` of a sealed
        segment may stay behind: recovery ignores the tail's, sealing rewrites it. Its ``.keys`` goes (a
        later sealing writes it again); ``keyed``: the new object's key index is this one's, cut. The skew
        bounds stay this segment's: wider than the cut part needs, never narrower."""
        keys = None
        if keyed:
            keys = self.key_index().writable_copy()
            keys.truncate(cut)
        if cut > self.base_offset:
            last = self.batch_at(cut - 1, cut)
            size = last.end - self.start
            summary = Summary(self.base_offset, self.start, size, cut, self.bytes_before(cut, cut), last.timestamp,
                              last.position, self.first_msg_id, last.msg_id + last.count - 1, self.interval,
                              *self.skew)
        else:
            size = SEGMENT_HEADER_SIZE
            summary = Summary(self.base_offset, self.start, size, cut, 0, 0, -1, 0, -1, self.interval, *self.skew)
        kept = self.entries(cut)
        entries = np.empty(max(64, 2 * len(kept)), ENTRY_DTYPE)
        entries[:len(kept)] = kept
        self.removed = True  # no key index is written for the bytes this object knows any more
        self.keys_path.unlink(missing_ok=True)
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return Segment(self.directory, self.start, self.base_offset, fd, size, summary, entries, True, len(kept),
                       keys)

    # -- reading ------------------------------------------------------------------------------------
    def read(self, position: int, length: int) -> np.ndarray:
        """Read ``length`` bytes at logical ``position`` into a fresh (aligned) numpy buffer."""
        return read_exactly(self.fd, self.path, position - self.start, length)

    def _span(self, entries: np.ndarray, i: int, end: int) -> Iterator[Batch]:
        """The batches from entry ``i``'s up to the next entry's (or the segment's end), below offset
        ``end``, as the walk reaches them: they all start in entry ``i``'s window, so one ``pread`` brings
        every header. A damaged header raises when the walk reaches it (the batches before it are found)."""
        pos, off = int(entries[i]["position"]), int(entries[i]["offset"])
        stop = int(entries[i + 1]["position"]) if i + 1 < len(entries) else self.start + self.size
        first = pos
        buf = self.read(pos, min(stop - pos, self.interval + _HEADER_ROOM))
        unpack, size = records.HEADER.unpack_from, len(buf) - records.HEADER.size
        while pos < stop and off < end:
            at = pos - first
            h = unpack(buf, at) if at <= size else None
            if h is None or h[_MAGIC] != records.MAGIC or h[_BASE] != off or h[_LEN] < records.HEADER.size \
                    or h[_LEN] % records.ALIGN:
                raise self._damage(buf, at, pos, off, int(entries[i]["offset"]))
            yield Batch(off, h[_COUNT], pos, h[_LEN], h[_TIMESTAMP], h[_MSG_ID])
            pos += h[_LEN]
            off += h[_COUNT]

    def _damage(self, buf: np.ndarray, at: int, pos: int, offset: int, entry_offset: int) -> CorruptLogError:
        """The error for the batch header at ``buf[at]`` (logical ``pos``) that a walk cannot use."""
        try:
            h = records.parse_header(buf, at)
            reason = f"batch has offset {h.base_offset}, expected {offset}"
        except records.RecordFormatError as e:
            reason = str(e).replace(f" at byte {e.position}", "")
        pos -= self.start
        return CorruptLogError(f"{self.path}: damaged batch at byte {pos}, offset {offset} (walking from the index "
                               f"entry at offset {entry_offset}): {reason}", self.path, pos)

    def _holding(self, entries: np.ndarray, offset: int, end: int):
        """(entry index, the span's batches up to and including the one holding ``offset``, the rest of
        the span's batches as an iterator)."""
        i = int(np.searchsorted(entries["offset"], offset, "right")) - 1
        walk = self._span(entries, i, end)
        rows = []
        for b in walk:
            rows.append(b)
            if b.next_offset > offset:
                return i, rows, walk
        raise CorruptLogError(f"{self.path}: offset {offset} is past the batches its index entry leads to", self.path)

    def batch_at(self, offset: int, end: int) -> Batch:
        """The batch holding ``offset`` (base_offset <= offset < end)."""
        return self._holding(self.entries(end), offset, end)[1][-1]

    def plan(self, offset: int, end: int, max_bytes: int, stop: int):
        """A fetch from ``offset``: (logical position, length, end offset) of the longest run of whole
        batches below offset ``stop`` (<= ``end``) whose end is within ``max_bytes`` of the first's start; the
        first batch is taken even when it alone is larger. The end offset is at most ``stop``."""
        entries = self.entries(end)
        i, rows, rest = self._holding(entries, offset, end)
        first = rows[-1]
        limit = first.position + max(max_bytes, first.length)
        j = min(int(np.searchsorted(entries["position"], limit, "right")),
                int(np.searchsorted(entries["offset"], stop, "left"))) - 1
        last_end, last_offset = first.end, first.next_offset
        if j > i:  # every batch before entry j ends within the budget
            last_end, last_offset = int(entries[j]["position"]), int(entries[j]["offset"])
            rest = self._span(entries, j, stop)
        try:
            for b in rest:
                if b.offset >= stop or b.end > limit:
                    break
                last_end, last_offset = b.end, b.next_offset
        except CorruptLogError:
            pass  # the run ends before a damaged header: a fetch from there raises
        return first.position, last_end - first.position, min(last_offset, stop)

    def first_at_or_after(self, timestamp_ms: int, end: int) -> Optional[int]:
        """The offset of the first batch below ``end`` stored at or after ``timestamp_ms`` (None: none)."""
        entries = self.entries(end)
        k = int(np.searchsorted(entries["timestamp"], timestamp_ms, "left"))
        if k == 0:
            return int(entries[0]["offset"]) if len(entries) else None
        for b in self._span(entries, k - 1, end):
            if b.timestamp >= timestamp_ms:
                return b.offset
        return int(entries[k]["offset"]) if k < len(entries) else None

    def offset_for_msg_id(self, msg_id: int, end: int) -> Optional[int]:
        """The offset below ``end`` of the message with id ``msg_id``, or None. Ids increase with offsets and
        are dense in a batch, so no entry per message or batch is needed: a binary search over the batch
        headers at the index entries (one ``pread`` each), then a walk of one window."""
        if not self.count or not self.first_msg_id <= msg_id <= self.last_msg_id:
            return None
        entries = self.entries(end)
        lo, hi = 0, len(entries)  # the batch of entry lo starts at or below msg_id; entry hi's above it
        while hi - lo > 1:
            mid = (lo + hi) // 2
            raw = self.read(int(entries[mid]["position"]), records.HEADER.size)
            lo, hi = (mid, hi) if batch_header(raw).msg_id <= msg_id else (lo, mid)
        for b in self._span(entries, lo, end) if len(entries) else ():
            if b.msg_id + b.count > msg_id:
                return b.offset + msg_id - b.msg_id if b.msg_id <= msg_id else None
        return None

    def _sizes(self, entries: np.ndarray, i: int, rows: list) -> np.ndarray:
        """Each message's bytes from entry ``i``'s batch through the last of ``rows`` (that span's batches):
        one read of those whole batches, their columns read by ``records.index_columns``."""
        first = int(entries[i]["position"])
        buf = self.read(first, rows[-1].end - first)
        try:
            sizes = records.index_columns(buf, np.array([b.position - first for b in rows], np.int64))[0]
        except records.RecordFormatError as e:
            raise CorruptLogError(f"{self.path}: near byte {first - self.start}: {e}", self.path,
                                  first - self.start) from None
        return sizes

    def bytes_before(self, offset: int, end: int) -> int:
        """Message bytes of this segment's offsets below ``offset`` (base_offset <= offset <= end)."""
        if offset <= self.base_offset:
            return 0
        if not self.mutable and offset >= self.next_offset:
            return self.bytes
        entries = self.entries(end)
        i, rows, _ = self._holding(entries, offset - 1, end)
        sizes = self._sizes(entries, i, rows)
        return int(entries[i]["bytes"]) + int(sizes[: offset - int(entries[i]["offset"])].sum(dtype=np.int64))

    def offset_at_bytes(self, target: int, stop: int) -> int:
        """The furthest offset ``o <= stop`` whose ``bytes_before(o)`` is at most ``target`` (>= 0)."""
        entries = self.entries(stop)
        i = int(np.searchsorted(entries["bytes"], target, "right")) - 1
        rows = list(self._span(entries, i, stop))
        cum = np.cumsum(self._sizes(entries, i, rows), dtype=np.int64)
        k = int(np.searchsorted(cum, target - int(entries[i]["bytes"]), "right"))
        return min(int(entries[i]["offset"]) + k, stop)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.mutable:
                self.seal()
            self.write_keys()
        finally:
            self._close_fd()


def segment_for(segments, offset: int) -> Segment:
    """The segment of ``segments`` (in offset order) holding ``offset``: the last one starting at or before
    it (the first for an offset before them all)."""
    return segments[max(bisect.bisect_right([s.base_offset for s in segments], offset) - 1, 0)]


def read_exactly(fd: int, path: Path, file_pos: int, length: int) -> np.ndarray:
    buf = np.empty(length, dtype=np.uint8)
    got = 0
    while got < length:
        n = os.preadv(fd, [memoryview(buf)[got:]], file_pos + got)
        if n == 0:
            raise CorruptLogError(f"{path}: file ends at byte {file_pos + got}, {length - got} bytes short",
                                  path, file_pos + got)
        got += n
    return buf



def batch_starts(buf: np.ndarray, path=None) -> np.ndarray:
    """Where each batch of ``buf`` (whole batches, back to back) starts: its length fields followed,
    one step per batch (checksums are the decoder's)."""
    out, pos, size = [], 0, len(buf)
    unpack = _BATCH_LEN.unpack_from
    while pos < size:
        out.append(pos)
        (length,) = unpack(buf, pos)
        if length < records.ALIGN or length % records.ALIGN:
            raise CorruptLogError(f"{path}: impossible batch length {length} at byte {pos} of a read", path, pos)
        pos += length
    if pos != size:
        raise CorruptLogError(f"{path}: the last batch of a read runs {pos - size} bytes past its end", path, size)
    return np.array(out, dtype=np.int64)
