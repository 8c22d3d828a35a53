"""A segment's sparse offset index, ``<start>.index`` (Kafka's ``.index`` and ``.timeindex`` in one file).

One entry for the first batch that starts in each ``interval``-byte window of the segment (Kafka's
index.interval.bytes, default 4 KiB), never one per message: the batch headers in the log say where each
message is, so a lookup takes the entry at or before what it looks for and walks at most a window's worth
of batch headers (``Segment``). An entry holds the batch's offset, logical position and store time (store
times never decrease in a partition, so the same entries are the time index) and the message bytes of the
segment before it (so byte budgets stay exact without a size per message). Which batches get an entry is
a function of batch positions alone, so an index rebuilt from the log equals the one written while
appending, whatever the appends' sizes were: ``metaq log verify`` compares them. The header also bounds the
segment's create-time skew (``create time - store time`` of its messages, 0 for one without a create
time), so that create times can be looked up through the same store-time entries (``store_time_bounds``).

Pure: arrays and the file's bytes; no reading of the log. docs/storage-format.md, section 5, has the layout.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from metaq_broker.protocol.records import crc
from metaq_broker.store.durable import fsync_dir

SUFFIX = ".index"
DENSE_SUFFIX = ".idx"  # the dense index (one 24-byte entry per message) of metaq before the sparse one
DEFAULT_INTERVAL = 4096

ENTRY_DTYPE = np.dtype([("offset", "<i8"), ("position", "<i8"), ("timestamp", "<i8"), ("bytes", "<i8")])
# What a segment is told about each batch it takes (appends, a replica's copy, a scan of the log).
BATCH_DTYPE = np.dtype([("offset", "<i8"), ("position", "<i8"), ("timestamp", "<i8"), ("length", "<i8"),
                        ("count", "<i8"), ("bytes", "<i8"), ("msg_id", "<i8"), ("min_skew", "<i8"),
                        ("max_skew", "<i8")])
# The dense index of earlier versions, read once to convert a data directory they wrote.
DENSE_DTYPE = np.dtype([("position", "<i8"), ("timestamp", "<i8"), ("size", "<u4"), ("batch_len", "<u4")])

MAGIC = b"MQINDEX2"
HEADER = struct.Struct("<8sqqqqqqqqqqqIII")  # then a u32 CRC-32C of these 108 bytes
HEADER_SIZE = HEADER.size + 4
MAGIC_V1 = b"MQINDEX1"  # the same header without the skew bounds (read as unknown bounds)
HEADER_V1 = struct.Struct("<8sqqqqqqqqqIII")
HEADER_V1_SIZE = HEADER_V1.size + 4
assert HEADER_SIZE == 112 and HEADER_V1_SIZE == 96 and ENTRY_DTYPE.itemsize == 32

# Skew bounds of a segment whose messages were never looked at (an index of an earlier version, a dense one):
# wider than any real skew (create and store times lie in [0, 2^62)), so they narrow nothing.
UNKNOWN_SKEW = (-(1 << 62), 1 << 62)


@dataclass(frozen=True)
class Summary:
    """What an index file says about its whole segment, beyond the entries."""

    base_offset: int
    start: int
    size: int  # bytes of the segment file, its header included
    next_offset: int
    bytes: int  # message bytes (index ``size`` of docs/storage-format.md section 5) of the whole segment
    last_timestamp: int  # of its last batch (0: no batch)
    last_position: int  # logical position of its last batch (-1: no batch)
    first_msg_id: int  # of its first message (0: none)
    last_msg_id: int  # of its last message (-1: none)
    interval: int
    # Bounds of ``create time - store time`` over its messages (0 for one without a create time); they always
    # hold 0, may be wider than the messages need (UNKNOWN_SKEW: not known), never narrower.
    min_skew: int = 0
    max_skew: int = 0


def skew_bounds(batches: np.ndarray, bounds: tuple = (0, 0)) -> tuple:
    """``bounds`` widened to hold the skews of ``batches`` (BATCH_DTYPE)."""
    if not len(batches):
        return bounds
    return min(bounds[0], int(batches["min_skew"].min())), max(bounds[1], int(batches["max_skew"].max()))


def store_time_bounds(since_ms: Optional[int], until_ms: Optional[int], min_skew: int, max_skew: int) -> tuple:
    """For create times in [since_ms, until_ms] (None: unbounded), the store times such messages of a segment
    with these skew bounds can have: (lowest, highest), clamped to i64 (None: unbounded)."""
    lo = None if since_ms is None else _clamp(since_ms - max_skew)
    hi = None if until_ms is None else _clamp(until_ms - min_skew)
    return lo, hi


def _clamp(ms: int) -> int:
    return max(-(1 << 63), min(ms, (1 << 63) - 1))


class IndexProblem(Exception):
    """An index file that cannot be used as it is (the caller rebuilds it from the log)."""


def bucket(position, start: int, interval: int):
    """The window of ``interval`` bytes of the segment starting at ``start`` that ``position`` lies in."""
    return (position - start) // interval


def entries_for(batches: np.ndarray, start: int, interval: int, last_bucket: int, bytes_before: int):
    """Entries for ``batches`` (BATCH_DTYPE, in log order) appended to a segment whose last entry lies in
    window ``last_bucket`` (-1: none yet) and which holds ``bytes_before`` message bytes before them.
    Returns (entries, the window of the last entry now). Vectorised: no step per batch."""
    b = bucket(batches["position"], start, interval)
    take = b > np.r_[last_bucket, b[:-1]]  # positions grow, so windows never go back
    chosen = batches[take]
    out = np.empty(len(chosen), ENTRY_DTYPE)
    out["offset"], out["position"], out["timestamp"] = chosen["offset"], chosen["position"], chosen["timestamp"]
    out["bytes"] = (bytes_before + np.cumsum(batches["bytes"]) - batches["bytes"])[take]
    return out, (int(b[take][-1]) if len(chosen) else last_bucket)


def summary_of(batches: np.ndarray, base_offset: int, start: int, size: int, interval: int) -> Summary:
    """The summary of a segment holding exactly ``batches``."""
    if not len(batches):
        return Summary(base_offset, start, size, base_offset, 0, 0, -1, 0, -1, interval)
    last = batches[-1]
    return Summary(base_offset, start, size, int(last["offset"] + last["count"]), int(batches["bytes"].sum()),
                   int(last["timestamp"]), int(last["position"]), int(batches[0]["msg_id"]),
                   int(last["msg_id"] + last["count"] - 1), interval, *skew_bounds(batches))


def encode(summary: Summary, entries: np.ndarray) -> list:
    """The file's bytes, as parts for one write: header, entries."""
    entries = np.ascontiguousarray(entries, ENTRY_DTYPE)
    s = summary
    head = HEADER.pack(MAGIC, s.base_offset, s.start, s.size, s.next_offset, s.bytes, s.last_timestamp,
                       s.last_position, s.first_msg_id, s.last_msg_id, s.min_skew, s.max_skew, s.interval,
                       len(entries), crc(memoryview(entries).cast("B")))
    return [head + struct.pack("<I", crc(head)), memoryview(entries).cast("B")]


def write(path: Path, summary: Summary, entries: np.ndarray) -> None:
    """Write an index file whole (temporary name, fsync, rename, fsync of the directory): never half-written."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for part in encode(summary, entries):
            f.write(part)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_header(path: Path, header_size: int) -> tuple:
    """(an index file's first ``header_size`` bytes, its size); IndexProblem if it is missing or shorter
    (the offset and key indexes both start so)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(header_size)
            file_size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise IndexProblem("is missing") from None
    if len(raw) < header_size:
        raise IndexProblem(f"is {len(raw)} bytes, shorter than its header")
    return raw, file_size


def load(path: Path, base_offset: int, start: int, size: int, next_offset: Optional[int], first_position: int):
    """Read and check an index file against its segment (``size`` bytes, its first batch at
    ``first_position``; the next segment's base offset if known). Returns (Summary, entries memory-mapped
    read-only); raises IndexProblem saying what is wrong."""
    raw, file_size = read_header(path, HEADER_V1_SIZE)
    header, header_size = (HEADER_V1, HEADER_V1_SIZE) if raw[:8] == MAGIC_V1 else (HEADER, HEADER_SIZE)
    if raw[:8] == MAGIC:
        raw, file_size = read_header(path, HEADER_SIZE)
    if raw[:8] not in (MAGIC, MAGIC_V1) or crc(raw[:header.size]) != struct.unpack_from("<I", raw, header.size)[0]:
        raise IndexProblem("has a bad header (magic or checksum)")
    fields = header.unpack_from(raw)
    if header is HEADER_V1:  # no skew bounds: unknown
        summary, n, entries_crc = Summary(*fields[1:11], *UNKNOWN_SKEW), fields[11], fields[12]
    else:
        summary = Summary(*fields[1:10], fields[12], fields[10], fields[11])
        n, entries_crc = fields[13], fields[14]
    if (summary.base_offset, summary.start, summary.size) != (base_offset, start, size):
        raise IndexProblem(f"describes offset {summary.base_offset}, start {summary.start}, {summary.size} bytes; "
                           f"the segment is offset {base_offset}, start {start}, {size} bytes")
    if next_offset is not None and summary.next_offset != next_offset:
        raise IndexProblem(f"ends at offset {summary.next_offset}, the next segment starts at {next_offset}")
    if file_size != header_size + n * ENTRY_DTYPE.itemsize:
        raise IndexProblem(f"is {file_size} bytes, its header counts {n} entries")
    if summary.interval < 1:
        raise IndexProblem(f"has interval {summary.interval}")
    if not summary.min_skew <= 0 <= summary.max_skew:
        raise IndexProblem(f"has skew bounds {summary.min_skew}..{summary.max_skew}, which do not hold 0")
    entries = (np.memmap(path, ENTRY_DTYPE, mode="r", offset=header_size, shape=(n,)) if n
               else np.empty(0, ENTRY_DTYPE))
    if crc(memoryview(np.ascontiguousarray(entries)).cast("B")) != entries_crc:
        raise IndexProblem("entries fail their checksum")
    problem = shape_problem(summary, entries, first_position)
    if problem:
        raise IndexProblem(problem)
    return summary, entries


def shape_problem(s: Summary, entries: np.ndarray, first_position: int) -> Optional[str]:
    """What makes ``entries`` impossible for a segment described by ``s`` (None: nothing)."""
    count = s.next_offset - s.base_offset
    if count < 0 or s.bytes < 0:
        return "has a negative message count or size"
    if not len(entries):
        return "is empty, the segment is not" if count else None
    if not count:
        return "has entries for an empty segment"
    off, pos, ts, nb = (entries[f].astype(np.int64) for f in ("offset", "position", "timestamp", "bytes"))
    if off[0] != s.base_offset or pos[0] != first_position or nb[0] != 0:
        return "does not start at the first batch"
    if (np.diff(off) <= 0).any() or (np.diff(pos) <= 0).any() or (np.diff(ts) < 0).any() or (np.diff(nb) <= 0).any():
        return "is out of order"
    if off[-1] >= s.next_offset or pos[-1] > s.last_position or nb[-1] >= s.bytes or ts[-1] > s.last_timestamp:
        return "has entries past the end of its segment"
    b = bucket(pos, s.start, s.interval)
    if (np.diff(b) <= 0).any():
        return "has two entries in one window"
    return None


def from_dense(dense: np.ndarray, base_offset: int) -> np.ndarray:
    """The batches (BATCH_DTYPE) that a dense index of earlier versions describes (vectorised)."""
    if not len(dense):
        return np.empty(0, BATCH_DTYPE)
    pos = dense["position"]
    first = np.flatnonzero(np.r_[True, pos[1:] != pos[:-1]])
    counts = np.diff(np.r_[first, len(dense)])
    out = np.empty(len(first), BATCH_DTYPE)
    out["offset"] = base_offset + first
    out["position"], out["timestamp"] = pos[first], dense["timestamp"][first]
    out["length"], out["count"] = dense["batch_len"][first], counts
    out["bytes"] = np.add.reduceat(dense["size"].astype(np.int64), first)
    out["msg_id"] = -1  # not in a dense index: the caller reads the first and last batches' from the log
    out["min_skew"], out["max_skew"] = UNKNOWN_SKEW  # nor are create times
    return out


def dense_problem(dense: np.ndarray, start: int, size: int, first_position: int) -> Optional[str]:
    """The checks earlier versions made of a dense index before trusting it (None: it is usable)."""
    if len(dense) == 0:
        return "is empty"
    pos, blen = dense["position"], dense["batch_len"].astype(np.int64)
    if pos[0] != first_position:
        return "does not start at the first batch"
    if (np.diff(pos) < 0).any() or (np.diff(dense["timestamp"]) < 0).any():
        return "is out of order"
    if pos[-1] + blen[-1] != start + size:
        return "does not end at the end of the log"
    boundary = np.flatnonzero(pos[1:] != pos[:-1])
    if ((pos[boundary] + blen[boundary]) != pos[boundary + 1]).any():
        return "has batches that do not follow one another"
    return None
