"""One segment of a partition log: ``<start>.meta`` (header + batches) and its dense index ``<start>.idx``.

``start`` is the segment's position in the partition's logical byte stream (the 20-digit file name), so
segments are contiguous when each one's start plus its size is the next one's start, as in MetaQ. The
header also records the segment's first offset, so the log alone says which offsets it holds; the index
is derived data, checked against the log and rebuilt from it when it is missing or wrong."""
from __future__ import annotations

import os
import struct
import weakref
from pathlib import Path

import numpy as np

from metaq_broker.errors import CorruptLogError
from metaq_broker.protocol.records import crc
from metaq_broker.store.durable import append_or_cut_back, fsync_dir, write_all


LOG_SUFFIX = ".meta"
INDEX_SUFFIX = ".idx"
NAME_DIGITS = 20

SEGMENT_MAGIC = b"MQSEGMT2"  # MQSEGMT1 segments held version 1 batches, with CRC-32 checksums
SEGMENT_HEADER = struct.Struct("<8sqqI")  # magic, base offset, start position, crc of the preceding bytes
SEGMENT_HEADER_SIZE = SEGMENT_HEADER.size + 4  # padded to 32
assert SEGMENT_HEADER_SIZE == 32

# One entry per message: where its batch starts (logical position), the batch's store time, the
# message's own encoded size, and the batch length (so whole-batch byte ranges need no extra lookup).
INDEX_DTYPE = np.dtype([("position", "<i8"), ("timestamp", "<i8"), ("size", "<u4"), ("batch_len", "<u4")])
_ENTRY = np.dtype("V24")  # an entry as 24 opaque bytes: copies of entries are memcpy, not field by field


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


class Segment:
    """A segment file and its index. Only the last segment of a partition is appended to."""

    def __init__(self, directory: Path, start: int, base_offset: int, fd: int, size: int,
                 index: np.ndarray, count: int, mutable: bool):
        self.directory = directory
        self.start = start
        self.base_offset = base_offset
        self.fd = fd
        self.size = size  # bytes in the file, header included
        self._index = index  # entries [0, count) are valid; may have spare capacity while mutable
        self.count = count
        self.mutable = mutable
        self.closed = False
        # The descriptor is closed when the last holder lets go: a reader that took a snapshot can
        # finish reading a segment that retention has just removed.
        self._close_fd = weakref.finalize(self, os.close, fd)

    # -- naming -------------------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self.directory / (segment_name(self.start) + LOG_SUFFIX)

    @property
    def index_path(self) -> Path:
        return self.directory / (segment_name(self.start) + INDEX_SUFFIX)

    @property
    def end(self) -> int:
        """Logical position just past this segment."""
        return self.start + self.size

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.count

    def index(self, upto_count: int | None = None) -> np.ndarray:
        """A view of the valid index entries (the first ``upto_count`` of them)."""
        n = self.count if upto_count is None else min(upto_count, self.count)
        return self._index[:n]

    # -- creation -----------------------------------------------------------------------------------
    @classmethod
    def create(cls, directory: Path, start: int, base_offset: int, capacity: int = 1024) -> "Segment":
        """Create an empty segment; its header and the directory entry are fsynced before it is used.
        ``capacity``: index entries to make room for at once (a roll passes the last segment's count), so
        the index is not grown and copied over and over while the segment fills."""
        path = directory / (segment_name(start) + LOG_SUFFIX)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            write_all(fd, [encode_segment_header(base_offset, start)])
            os.fsync(fd)
            idx_fd = os.open(directory / (segment_name(start) + INDEX_SUFFIX), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.close(idx_fd)
            fsync_dir(directory)
        except BaseException:
            os.close(fd)
            raise
        return cls(directory, start, base_offset, fd, SEGMENT_HEADER_SIZE, np.empty(max(capacity, 1024), INDEX_DTYPE),
                   0, True)

    # -- appending ----------------------------------------------------------------------------------
    def append(self, parts: list, nbytes: int, entries: np.ndarray) -> None:
        """Write a whole batch at the end of the file and add its index entries.

        On a failed write the file is cut back to where it was, so no partial batch stays behind."""
        assert self.mutable
        append_or_cut_back(self.fd, self.path, parts, self.size)
        n = len(entries)
        if self.count + n > len(self._index):
            grown = np.empty(max(2 * len(self._index), self.count + n), INDEX_DTYPE)
            grown[: self.count].view(_ENTRY)[:] = self._index[: self.count].view(_ENTRY)
            self._index = grown  # readers holding the old array still see their (unchanged) entries
        self._index[self.count: self.count + n].view(_ENTRY)[:] = entries.view(_ENTRY)
        self.size += nbytes
        self.count += n  # published last: readers never see entries beyond what is written

    def fsync(self) -> None:
        os.fsync(self.fd)

    def seal(self) -> None:
        """Make the segment immutable: fsync the log, write and fsync the index, map it read-only."""
        if not self.mutable:
            return
        os.fsync(self.fd)
        write_index(self.index_path, self.index())
        self._index = load_index_map(self.index_path, self.count)
        self.mutable = False

    def truncated(self, count: int, size: int) -> "Segment":
        """This segment cut to its first ``count`` messages (``size`` bytes, whole batches), fsynced, and
        appendable again (a replica's truncation). A new object with its own descriptor: readers holding
        this one keep what they took, and its close never writes an index for the cut file. A stale
        ``.idx`` of a sealed segment may stay behind: recovery ignores the tail's, sealing rewrites it."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        index = np.empty(max(1024, 2 * count), INDEX_DTYPE)
        index[:count].view(_ENTRY)[:] = self._index[:count].view(_ENTRY)
        return Segment(self.directory, self.start, self.base_offset, fd, size, index, count, mutable=True)

    # -- reading ------------------------------------------------------------------------------------
    def read(self, position: int, length: int) -> np.ndarray:
        """Read ``length`` bytes at logical ``position`` into a fresh (aligned) numpy buffer."""
        return read_exactly(self.fd, self.path, position - self.start, length)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.mutable:
                self.seal()
        finally:
            self._close_fd()


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


def write_index(path: Path, entries: np.ndarray) -> None:
    """Write an index file whole (to a temporary name, fsync, rename), so it is never half-written."""
    tmp = path.with_suffix(INDEX_SUFFIX + ".tmp")
    with open(tmp, "wb") as f:
        f.write(memoryview(np.ascontiguousarray(entries)).cast("B"))  # from the array: no copy of it first
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def load_index_map(path: Path, count: int) -> np.ndarray:
    if count == 0:
        return np.empty(0, INDEX_DTYPE)
    return np.memmap(path, dtype=INDEX_DTYPE, mode="r", shape=(count,))

