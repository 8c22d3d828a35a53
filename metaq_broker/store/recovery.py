"""Opening a partition's segments after a clean stop or a crash (the segments' step of ``log_loader``):
names and contiguity, sealed segments checked against their sparse index (rebuilt from the log when
missing or wrong, converted from the dense index of earlier versions), and the tail segment validated
batch by batch, with what was never acknowledged cut off. docs/storage-format.md, section 8, has the
rules."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import numpy as np

from metaq_broker.errors import CorruptLogError
from metaq_broker.protocol import records
from metaq_broker.store import offset_index
from metaq_broker.store.durable import fsync_dir, make_dirs
from metaq_broker.store.offset_index import BATCH_DTYPE, DENSE_SUFFIX, IndexProblem
from metaq_broker.store.segment import (INDEX_SUFFIX, KEYS_SUFFIX, LOG_SUFFIX, NAME_DIGITS, SEGMENT_HEADER_SIZE,
                                        Segment, batch_header, decode_segment_header, read_exactly, segment_name)

log = logging.getLogger(__name__)

ARCHIVE_DIR = "archive"


def _parse_segment_name(name: str) -> Optional[int]:
    stem = name[: -len(LOG_SUFFIX)]
    if len(stem) == NAME_DIGITS and stem.isdigit():
        return int(stem)
    return None


def recover(directory: Path, name: str, cut: Optional[str], interval: int = offset_index.DEFAULT_INTERVAL) -> list:
    """Open a partition's segments: check names and contiguity, check, rebuild or convert each sealed
    segment's index, validate the tail segment batch by batch and cut a torn tail off. Damage in the tail
    followed by valid batches is cut too when ``cut`` says why nothing acknowledged is lost, else refused.
    ``interval``: bytes between index entries of indexes built now (a found index keeps its own)."""
    make_dirs(directory)
    starts = []
    for entry in directory.iterdir():
        if entry.name.endswith(LOG_SUFFIX) and entry.is_file():
            start = _parse_segment_name(entry.name)
            if start is None:
                raise CorruptLogError(f"{entry}: a segment file must be named by its 20-digit start position", entry)
            starts.append(start)
        elif entry.name.endswith((INDEX_SUFFIX + ".tmp", DENSE_SUFFIX + ".tmp", KEYS_SUFFIX + ".tmp")):
            log.info("%s: removing %s left by an interrupted index write", name, entry.name)
            entry.unlink()
    starts.sort()
    for entry in directory.iterdir():  # indexes whose segment is gone (e.g. a crash during deletion)
        for suffix in (INDEX_SUFFIX, DENSE_SUFFIX, KEYS_SUFFIX):
            if entry.name.endswith(suffix) and _parse_segment_name(entry.name[: -len(suffix)] + LOG_SUFFIX) \
                    not in starts:
                log.info("%s: removing index %s, whose segment is gone", name, entry.name)
                entry.unlink()
    for tmp in (directory / ARCHIVE_DIR).glob("*.gz.tmp"):  # an archive interrupted by a crash
        log.info("%s: removing unfinished archive %s", name, tmp.name)
        tmp.unlink()
    if not starts:
        return [Segment.create(directory, 0, 0, interval)]

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
            segments.append(Segment.create(directory, start, prev.next_offset if prev else 0, interval))
            continue
        if segments:
            prev = segments[-1]
            if prev.next_offset != base:
                raise CorruptLogError(f"{name}: {prev.path.name} ends at offset {prev.next_offset} but "
                                      f"{path.name} starts at offset {base}", path)
        if last:
            segments.append(_open_tail(directory, path, start, base, name, cut, interval))
        else:
            segments.append(_open_sealed(directory, path, start, base, headers[i + 1], name, interval))
    dense = [p for p in (directory / (segment_name(start) + DENSE_SUFFIX) for start in starts) if p.exists()]
    for path in dense:  # every segment has its sparse index now (the tail's is built in memory)
        log.info("%s: removing %s, a dense index of an earlier version", name, path.name)
        path.unlink()
    if dense:
        fsync_dir(directory)
    return segments


def _open_sealed(directory: Path, path: Path, start: int, base: int, next_base: Optional[int], name: str,
                 interval: int) -> Segment:
    """A sealed segment with its index: the ``.index`` found, if sound; else one converted from an earlier
    version's dense ``.idx`` (checked as that version checked it); else one rebuilt by a strict scan."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        idx_path = path.with_suffix(INDEX_SUFFIX)
        first = start + SEGMENT_HEADER_SIZE
        try:
            summary, entries = offset_index.load(idx_path, base, start, size, next_base, first)
            return Segment(directory, start, base, fd, size, summary, entries, mutable=False)
        except IndexProblem as e:
            problem = str(e)
        dense = path.with_suffix(DENSE_SUFFIX)
        batches = None if idx_path.exists() else _converted(dense, start, base, size, next_base)
        if batches is not None:
            log.info("%s: converting the dense index of %s to a sparse one", name, path.name)
            for row in (0, -1):  # the summary's first and last message ids, from those batches' headers
                raw = read_exactly(fd, path, int(batches["position"][row]) - start, records.HEADER.size)
                batches["msg_id"][row] = batch_header(raw).msg_id
        else:
            log.warning("%s: index of %s %s; rebuilding it from the log", name, path.name, problem)
            batches, _, _ = scan_segment(fd, path, start, size, base, lookahead=False, strict=True)
            if next_base is not None and int(batches["count"].sum()) != next_base - base:
                raise CorruptLogError(f"{path}: holds {int(batches['count'].sum())} messages but the next segment "
                                      f"starts {next_base - base} offsets later", path)
        entries, _ = offset_index.entries_for(batches, start, interval, -1, 0)
        offset_index.write(idx_path, offset_index.summary_of(batches, base, start, size, interval), entries)
        summary, entries = offset_index.load(idx_path, base, start, size, next_base, first)
        return Segment(directory, start, base, fd, size, summary, entries, mutable=False)
    except BaseException:
        os.close(fd)
        raise


def _converted(dense_path: Path, start: int, base: int, size: int, next_base: Optional[int]) -> Optional[np.ndarray]:
    """The batches an earlier version's dense index describes, if it is there and passes that version's
    checks (None: it is not; the log is scanned instead). Nothing is read from the log: as before, a
    sealed segment with a sound index is not checksummed on open."""
    try:
        dense = np.fromfile(dense_path, offset_index.DENSE_DTYPE)
    except (FileNotFoundError, ValueError):
        return None
    if next_base is not None and len(dense) != next_base - base:
        return None
    if offset_index.dense_problem(dense, start, size, start + SEGMENT_HEADER_SIZE):
        return None
    return offset_index.from_dense(dense, base)


def _open_tail(directory: Path, path: Path, start: int, base: int, name: str, cut: Optional[str],
               interval: int) -> Segment:
    fd = os.open(path, os.O_RDWR)
    size = os.fstat(fd).st_size
    batches, good_end, reason = scan_segment(fd, path, start, size, base, lookahead=cut is None, strict=False)
    if good_end < size:
        os.ftruncate(fd, good_end)
        log.warning("%s: recovery truncated %d bytes at the tail of %s (from byte %d, offset %d: %s); %s", name,
                    size - good_end, path.name, good_end, base + int(batches["count"].sum()), reason,
                    cut or "only a torn, unacknowledged tail was cut")
        size = good_end
    # What recovery keeps becomes readable now, so it must be durable now: after a process crash the
    # tail may hold written but never fsynced batches.
    os.fsync(fd)
    return Segment.from_batches(directory, start, base, fd, size, batches, interval)


def scan_segment(fd: int, path: Path, start: int, size: int, base: int, lookahead: bool, strict: bool):
    """Validate a segment batch by batch (checksums, offsets continuing from ``base``).

    Returns (its batches, BATCH_DTYPE; end of the last good batch; why the scan stopped). ``strict`` raises
    at the first bad batch. Otherwise a bad batch ends the log (a torn tail), except that with ``lookahead`` a
    valid batch after the damage raises instead: cutting there would drop messages that may have been
    acknowledged."""
    buf = read_exactly(fd, path, 0, size)
    positions, pos, reason = walk_batches(buf, SEGMENT_HEADER_SIZE, base, path, lookahead, strict)
    return batch_table(buf, positions, start), pos, reason


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


def batch_table(buf: np.ndarray, positions: np.ndarray, start: int) -> np.ndarray:
    """The batches at ``positions`` of ``buf`` (checked, offsets contiguous), ``buf[0]`` lying at logical
    position ``start``, as a segment indexes them (BATCH_DTYPE). Vectorised over the batches."""
    out = np.empty(len(positions), BATCH_DTYPE)
    if not len(positions):
        return out
    sizes, counts, ts, lengths, _, _, min_skew, max_skew = records.index_table(buf, positions)
    first_message = np.cumsum(counts) - counts
    out["offset"] = records.parse_header(buf, int(positions[0])).base_offset + first_message
    out["position"], out["timestamp"], out["length"], out["count"] = positions + start, ts, lengths, counts
    out["min_skew"], out["max_skew"] = min_skew, max_skew
    out["bytes"] = np.add.reduceat(sizes, first_message)
    out["msg_id"] = buf[positions[:, None] + np.arange(records.HEADER.size)].reshape(-1).view(
        records.HEADER_DTYPE)["base_msg_id"]  # the fields every batch version has first
    return out


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
