"""Opening a partition's segments after a clean stop or a crash (Kafka's LogLoader): names and contiguity,
sealed segments checked against their index (rebuilt from the log when missing or wrong), and the tail
segment validated batch by batch, with what was never acknowledged cut off. docs/storage-format.md,
section 8, has the rules."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import numpy as np

from metaq_broker.errors import CorruptLogError
from metaq_broker.protocol import records
from metaq_broker.store.durable import make_dirs
from metaq_broker.store.epochs import EpochFile
from metaq_broker.store.segment import (INDEX_DTYPE, INDEX_SUFFIX, LOG_SUFFIX, NAME_DIGITS, SEGMENT_HEADER_SIZE,
                                        Segment, decode_segment_header, load_index_map, read_exactly, segment_name,
                                        write_index)

log = logging.getLogger(__name__)

ARCHIVE_DIR = "archive"


def _parse_segment_name(name: str) -> Optional[int]:
    stem = name[: -len(LOG_SUFFIX)]
    if len(stem) == NAME_DIGITS and stem.isdigit():
        return int(stem)
    return None


def recover(directory: Path, name: str, cut: Optional[str]) -> list:
    """Open a partition's segments: check names and contiguity, check or rebuild each sealed segment's
    index, validate the tail segment batch by batch and cut a torn tail off. Damage in the tail followed
    by valid batches is cut too when ``cut`` says why nothing acknowledged is lost, else refused."""
    make_dirs(directory)
    starts = []
    for entry in directory.iterdir():
        if entry.name.endswith(LOG_SUFFIX) and entry.is_file():
            start = _parse_segment_name(entry.name)
            if start is None:
                raise CorruptLogError(f"{entry}: a segment file must be named by its 20-digit start position", entry)
            starts.append(start)
        elif entry.name.endswith(INDEX_SUFFIX + ".tmp"):
            log.info("%s: removing %s left by an interrupted index write", name, entry.name)
            entry.unlink()
    starts.sort()
    for entry in directory.iterdir():  # indexes whose segment is gone (e.g. a crash during deletion)
        if entry.name.endswith(INDEX_SUFFIX) and _parse_segment_name(entry.name[: -len(INDEX_SUFFIX)] + LOG_SUFFIX) \
                not in starts:
            log.info("%s: removing index %s, whose segment is gone", name, entry.name)
            entry.unlink()
    for tmp in (directory / ARCHIVE_DIR).glob("*.gz.tmp"):  # an archive interrupted by a crash
        log.info("%s: removing unfinished archive %s", name, tmp.name)
        tmp.unlink()
    if not starts:
        return [Segment.create(directory, 0, 0)]

    paths = [directory / (segment_name(start) + LOG_SUFFIX) for start in starts]
    for prev, path, start in zip(paths, paths[1:], starts[1:]):
        prev_end = int(prev.stem) + prev.stat().st_size
        if prev_end != start:
            raise CorruptLogError(f"{name}: segments are not contiguous: {prev.name} ends at {prev_end} "
                                  f"but the next segment is {path.name}", path)
    headers = []
    for i, start in enumerate(starts):
        path = directory / (segment_name(start) + LOG_SUFFIX)
        with open(path, "rb") as f:
            raw = f.read(SEGMENT_HEADER_SIZE)
        last = i == len(starts) - 1
        try:
            headers.append(decode_segment_header(raw, path, start))
        except CorruptLogError:
            if not last or len(raw) == SEGMENT_HEADER_SIZE and os.path.getsize(path) > SEGMENT_HEADER_SIZE:
                raise
            # A torn segment creation: the header is fsynced before any batch goes in, so nothing was
            # written to this file. Start it again.
            if i == 0 and start != 0:
                raise
            log.warning("%s: segment %s has a torn header and no data; recreating it", name, path.name)
            path.unlink()
            headers.append(None)

    segments = []
    for i, start in enumerate(starts):
        path = directory / (segment_name(start) + LOG_SUFFIX)
        last = i == len(starts) - 1
        base = headers[i]
        if base is None:
            prev = segments[-1] if segments else None
            segments.append(Segment.create(directory, start, prev.next_offset if prev else 0))
            continue
        if segments:
            prev = segments[-1]
            if prev.next_offset != base:
                raise CorruptLogError(f"{name}: {prev.path.name} ends at offset {prev.next_offset} but "
                                      f"{path.name} starts at offset {base}", path)
        if last:
            segments.append(_open_tail(directory, path, start, base, name, cut))
        else:
            segments.append(_open_sealed(directory, path, start, base, headers[i + 1], name))
    return segments


def _open_sealed(directory: Path, path: Path, start: int, base: int, next_base: Optional[int], name: str) -> Segment:
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    expected = None if next_base is None else next_base - base
    idx_path = path.with_suffix(INDEX_SUFFIX)
    index, problem = None, None
    idx_size = idx_path.stat().st_size if idx_path.exists() else None
    if idx_size is None:
        problem = "missing"
    elif expected is not None and idx_size != expected * INDEX_DTYPE.itemsize:
        problem = f"has {idx_size // INDEX_DTYPE.itemsize} entries, the log holds {expected}"
    else:
        index = load_index_map(idx_path, idx_size // INDEX_DTYPE.itemsize)
        problem = _index_problem(index, start, size)
    if problem:
        log.warning("%s: index of %s %s; rebuilding it from the log", name, path.name, problem)
        entries, good_end, _ = scan_segment(fd, path, start, size, base, lookahead=False, strict=True)
        if expected is not None and len(entries) != expected:
            os.close(fd)
            raise CorruptLogError(f"{path}: holds {len(entries)} messages but the next segment starts "
                                  f"{expected} offsets later", path)
        write_index(idx_path, entries)
        index = load_index_map(idx_path, len(entries))
    seg = Segment(directory, start, base, fd, size, index, len(index), mutable=False)
    return seg


def _index_problem(index: np.ndarray, start: int, size: int) -> Optional[str]:
    if len(index) == 0:
        return "is empty"
    pos, blen = index["position"], index["batch_len"].astype(np.int64)
    if pos[0] != start + SEGMENT_HEADER_SIZE:
        return "does not start at the first batch"
    if (np.diff(pos) < 0).any() or (np.diff(index["timestamp"]) < 0).any():
        return "is out of order"
    if pos[-1] + blen[-1] != start + size:
        return "does not end at the end of the log"
    boundary = np.flatnonzero(pos[1:] != pos[:-1])
    if ((pos[boundary] + blen[boundary]) != pos[boundary + 1]).any():
        return "has batches that do not follow one another"
    return None


def _open_tail(directory: Path, path: Path, start: int, base: int, name: str, cut: Optional[str]) -> Segment:
    fd = os.open(path, os.O_RDWR)
    size = os.fstat(fd).st_size
    entries, good_end, reason = scan_segment(fd, path, start, size, base, lookahead=cut is None, strict=False)
    if good_end < size:
        os.ftruncate(fd, good_end)
        log.warning("%s: recovery truncated %d bytes at the tail of %s (from byte %d, offset %d: %s); %s", name,
                    size - good_end, path.name, good_end, base + len(entries), reason,
                    cut or "only a torn, unacknowledged tail was cut")
        size = good_end
    # What recovery keeps becomes readable now, so it must be durable now: after a process crash the
    # tail may hold written but never fsynced batches.
    os.fsync(fd)
    capacity = max(1024, 2 * len(entries))
    index = np.empty(capacity, INDEX_DTYPE)
    index[: len(entries)] = entries
    return Segment(directory, start, base, fd, size, index, len(entries), mutable=True)


def scan_segment(fd: int, path: Path, start: int, size: int, base: int, lookahead: bool, strict: bool):
    """Validate a segment batch by batch (checksums, offsets continuing from ``base``).

    Returns (index entries, end of the last good batch, why the scan stopped). ``strict`` raises at the
    first bad batch. Otherwise a bad batch ends the log (a torn tail), except that with ``lookahead`` a
    valid batch after the damage raises instead: cutting there would drop messages that may have been
    acknowledged."""
    buf = read_exactly(fd, path, 0, size)
    positions, pos, reason = walk_batches(buf, SEGMENT_HEADER_SIZE, base, path, lookahead, strict)
    return index_entries(buf, positions, start), pos, reason


def walk_batches(buf: np.ndarray, pos: int, expected: Optional[int], path, lookahead: bool, strict: bool):
    """Check the batches of ``buf`` from byte ``pos`` on, one step per batch: both checksums, and offsets
    continuing from ``expected`` (None: from the first batch's own). Returns (batch positions, end of the
    last good batch, why the walk stopped or None); ``strict`` and ``lookahead`` as in ``scan_segment``.
    Recovery and a replica's verbatim copy (``PartitionLog.append_replicated``) share it."""
    size = len(buf)
    positions, reason = [], None
    while pos < size:
        try:
            h = records.check_batch(buf, pos)
            if expected is None:
                expected = h.base_offset
            if h.base_offset != expected:
                raise records.RecordFormatError(f"batch at byte {pos} has offset {h.base_offset}, expected {expected}",
                                                pos)
        except records.RecordFormatError as e:
            reason = str(e)
            if strict:
                raise CorruptLogError(f"{path}: {e}", path, pos) from None
            if lookahead and _valid_batch_after(buf, pos, expected):
                raise CorruptLogError(
                    f"{path}: damaged batch at byte {pos} ({e}) is followed by valid batches; refusing to cut "
                    f"off messages that may have been acknowledged (this partition acknowledged before fsync: "
                    f"unflushThreshold > 0). Open with repair=True (metaq-broker --repair) to truncate at byte "
                    f"{pos}, losing what follows.",
                    path, pos) from None
            break
        positions.append(pos)
        expected = h.next_offset
        pos += h.batch_len
    return np.array(positions, dtype=np.int64), pos, reason


def index_entries(buf: np.ndarray, positions: np.ndarray, start: int, stream: bool = False):
    """Offset-index entries of the batches at ``positions`` of ``buf`` (vectorised), ``buf[0]`` lying at
    logical position ``start``. ``stream``: also each batch's MetaQ bytes and ``byte_base`` (-1 in version
    2), from the same pass (``records.index_columns``)."""
    if not len(positions):
        empty = np.empty(0, INDEX_DTYPE)
        return (empty, np.empty(0, np.int64), np.empty(0, np.int64)) if stream else empty
    sizes, counts, ts, blens, metaq, byte_base = records.index_columns(buf, positions)
    entries = np.empty(len(sizes), INDEX_DTYPE)
    entries["position"] = np.repeat(positions + start, counts)
    entries["timestamp"] = np.repeat(ts, counts)
    entries["size"] = sizes
    entries["batch_len"] = np.repeat(blens, counts)
    return (entries, metaq, byte_base) if stream else entries


def open_epochs(directory: Path, name: str, log_end: int) -> tuple:
    """The partition's ``epochs`` file in line with the recovered log: entries at or past its end go (their
    markers were cut with a torn tail, or a truncation stopped half way). Returns (file, damaged): a
    damaged file comes back empty, for the caller to rebuild from the log's epoch markers."""
    try:
        epochs = EpochFile.load(directory)
    except CorruptLogError as e:
        log.warning("%s: %s; rebuilding it from the epoch markers in the log", name, e)
        return EpochFile(directory), True
    if epochs.latest is not None and epochs.latest.start >= log_end:
        log.warning("%s: epochs from offset %d on are past the log end %d; forgetting them", name,
                    epochs.latest.start, log_end)
        epochs.truncate(log_end)
    return epochs, False


def _valid_batch_after(buf: np.ndarray, bad_pos: int, expected_offset: int) -> bool:
    """Is there a whole, checksum-valid batch with a later offset anywhere after ``bad_pos``?"""
    starts = np.arange(bad_pos + records.ALIGN, len(buf) - records.BASE_HEADER_SIZE + 1, records.ALIGN)
    magic = records.MAGIC.to_bytes(2, "little")
    candidates = starts[(buf[starts + 8] == magic[0]) & (buf[starts + 9] == magic[1])]
    for p in candidates.tolist():
        try:
            h = records.check_batch(buf, p)
        except records.RecordFormatError:
            continue
        if h.base_offset >= expected_offset:
            return True
    return False


def last_timestamp(segments) -> int:
    for seg in reversed(segments):
        if seg.count:
            return int(seg.index()[-1]["timestamp"])
    return 0


def last_msg_id(segments) -> Optional[int]:
    for seg in reversed(segments):
        if seg.count:
            last = seg.index()[-1]
            raw = seg.read(int(last["position"]), min(records.HEADER_SIZE, int(last["batch_len"])))
            h = records.parse_header(raw)
            return h.base_msg_id + h.count - 1
    return None
