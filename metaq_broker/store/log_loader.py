"""Loading a partition from its directory (Kafka's LogLoader): everything a ``PartitionLog`` needs before
its first read or append, in one place and in this order:

1. its identity (``identity.py``), made before the first segment for a new log;
2. its segments (``recovery.py``): names, contiguity, each sealed segment's index checked, rebuilt or
   converted, the tail validated and a torn tail cut; the tail's key index rebuilt from its keys (a sealed
   segment's is read from its file when a lookup first needs it); the flush-mode marker kept in step;
3. transaction and idempotent-producer state: their snapshots, then a header scan of the batches written
   after them (``partition_txns.py``, ``producer_state.py``);
4. the leader epochs (``epochs.py``): entries past the log end dropped, markers missing from the file (or a
   damaged file) found again in the log;
5. where the MetaQ message stream goes on (``stream_end``);
6. the snapshots written again as of the log end offset, and the broker's message ids moved past the
   log's last.

``load`` returns a ``LoadedLog``; the ``PartitionLog`` constructor only takes it. Nothing else runs
concurrently with a load: the log does not exist yet.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from metaq_broker.errors import CorruptLogError
from metaq_broker.ids import MessageIdAllocator
from metaq_broker.protocol import records
from metaq_broker.store import epochs as epoch_file
from metaq_broker.store import identity as identity_file
from metaq_broker.store.config import TopicConfig
from metaq_broker.store.durable import fsync_dir, replace_file
from metaq_broker.store.epochs import EpochFile
from metaq_broker.store.partition_txns import PartitionTxns
from metaq_broker.store.producer_state import ProducerStates
from metaq_broker.store.recovery import recover
from metaq_broker.store.segment import SEGMENT_HEADER_SIZE, batch_header, batch_starts, segment_for

log = logging.getLogger(__name__)

# Present while the partition acknowledges appends before an fsync covers them (unflushThreshold > 0), and
# until the first recovery after switching back to group commit: recovery must then not assume that every
# acknowledged batch was fsynced.
ACKS_BEFORE_FSYNC = "acks-before-fsync"


@dataclass
class LoadedLog:
    """A partition as loaded: what ``PartitionLog`` starts from. Its log end offset is the last segment's
    next offset; everything in it is durable (recovery fsynced the tail)."""

    directory: Path
    identity: identity_file.Identity
    segments: tuple
    txns: PartitionTxns
    producers: ProducerStates
    epochs: EpochFile
    epochs_dirty: bool  # the epochs file could not be written: saved again before the next roll or close
    metaq_end: int  # where the next batch starts in the MetaQ message stream
    last_timestamp: int  # of the last batch (ms), 0 for none


def load(directory, name: str, config: TopicConfig, ids: MessageIdAllocator, clock=time.time,
         repair: bool = False) -> LoadedLog:
    """Load partition ``name`` from ``directory`` (created if missing). ``repair``: recovery may cut a
    damaged tail followed by valid batches (the messages after the damage are lost). Raises
    CorruptLogError for damage it must not repair."""
    directory = Path(directory)
    identity = identity_file.load_or_create(directory)  # before the first segment: a new log's
    acks_before_fsync = not config.group_commit or (directory / ACKS_BEFORE_FSYNC).exists()
    cut = ("repair was asked for: messages after the damage are gone" if repair
           else None if acks_before_fsync
           else "under group commit no fsync covered them, so none was acknowledged")
    segments = tuple(recover(directory, name, cut, config.index_interval_bytes))
    if config.key_index:  # the tail's key index lives in memory: rebuilt from its keys (sealed ones: on use)
        segments[-1].keys = segments[-1].build_keys()
    _record_flush_mode(directory, config)
    active, end = segments[-1], segments[-1].next_offset
    earliest = segments[0].base_offset
    txns = PartitionTxns()
    scan_from = txns.load(directory)
    producers = ProducerStates(name, config.producer_id_expiration_ms)
    producers_from = producers.load(directory)
    epochs, epochs_damaged = _open_epochs(directory, name, end)
    epochs.trim(earliest)  # retention's cut may have come before its trim was saved
    # No snapshot: a directory of the metaq that kept transactions out of the log, or one whose first
    # snapshot could not be written yet (a roll always writes one first): transactional batches can then
    # only be in the active segment, which recovery has just read. Every epoch marker below the snapshot's
    # offset is in the epochs file (saved in the marker's write-lock hold, or retried before the
    # snapshot), so the same scan finds those missing after a crash. The producers' snapshot is written
    # with the transactions' and follows the same rule.
    txns_from, producers_from = (active.base_offset if at is None else max(at, earliest)
                                 for at in (scan_from, producers_from))
    found = []
    for u8, positions in read_batches(segments, min(txns_from, producers_from), end):
        base = records.headers_at(u8, positions)["base_offset"]
        ours = positions[base >= txns_from]
        txns.scan(u8, ours)
        found += epoch_file.markers(u8, ours)
        producers.scan(u8, positions[base >= producers_from])
    if epochs_damaged:
        found = [e for u8, pos in read_batches(segments, earliest, end) for e in epoch_file.markers(u8, pos)]
    epochs_dirty = False
    try:
        if epochs.add_missing(found) or epochs_damaged:
            epochs.save()
            log.info("%s: epochs from the log's markers: %s", name, [(e.epoch, e.start) for e in epochs.entries])
    except OSError as e:  # e.g. a full disk: kept in memory, saved again before the next roll
        log.warning("%s: could not write its epochs file (%s)", name, e)
        epochs_dirty = True
    last_ts = _last_timestamp(segments)
    try:
        save_snapshots(directory, txns, producers, end, earliest, max(int(clock() * 1000), last_ts))
    except OSError as e:  # e.g. a full disk: the next open scans from the older snapshot again
        log.warning("%s: could not write %s (%s)", name, "its transaction snapshot", e)
    last_id = _last_msg_id(segments)
    if last_id is not None:
        ids.observe(last_id)
    return LoadedLog(directory, identity, segments, txns, producers, epochs, epochs_dirty, stream_end(segments),
                     last_ts)


def save_snapshots(directory: Path, txns: PartitionTxns, producers: ProducerStates, end: int, earliest: int,
                   now_ms: int) -> None:
    """Write the transaction and the producers' snapshots as of ``end`` (the log end offset)."""
    txns.save(directory, end, earliest)
    producers.save(directory, end, now_ms)


def read_batches(segments: tuple, start: int, stop: int):
    """(bytes, batch starts in them) of the written batches holding offsets [start, stop), ``READ_CHUNK``
    at a time: the header scans of loading, truncation and the first high watermark."""
    offset = start
    while offset < stop:
        seg = segment_for(segments, offset)
        if seg.next_offset <= offset:
            raise CorruptLogError(f"{seg.path}: no segment holds offset {offset}", seg.path)
        for u8, positions, offset in seg.chunks(offset, min(stop, seg.next_offset)):
            yield u8, positions


def stream_columns(u8: np.ndarray, positions: np.ndarray) -> tuple:
    """(timestamps, lengths, MetaQ bytes, byte_base) of the batches at ``positions``."""
    return records.index_columns(u8, positions)[2:]


def stream_end(segments: tuple) -> int:
    """Where the next batch starts in the MetaQ message stream (docs/storage-format.md, 3.5): the end
    of the last batch; for a version 2 batch computed over its segment (whose first version 2 batch
    starts at METAQ_ANCHOR x the segment's start); METAQ_ANCHOR x the active segment's start when no batch
    is before it but one of version 2 in an earlier segment, or none at all (a new log: 0)."""
    tail = segments[-1]
    last = tail if tail.count else segments[-2] if len(segments) > 1 and segments[-2].count else None
    if last is None:
        return records.METAQ_ANCHOR * tail.start
    final = last.batch_at(last.next_offset - 1, last.next_offset)
    _, _, metaq, byte_base = stream_columns(last.read(final.position, final.length), np.zeros(1, np.int64))
    if byte_base[0] >= 0:
        return int(byte_base[0] + metaq[0])
    if last is not tail:
        return records.METAQ_ANCHOR * tail.start
    first = tail.start + SEGMENT_HEADER_SIZE
    u8 = tail.read(first, tail.end - first)
    _, _, metaq, byte_base = stream_columns(u8, batch_starts(u8, tail.path))
    return int(records.stream_ends(byte_base, metaq, records.METAQ_ANCHOR * tail.start)[-1])


def _record_flush_mode(directory: Path, config: TopicConfig) -> None:
    """Keep ACKS_BEFORE_FSYNC in step with the flush policy. Recovery has just fsynced the tail, so under
    group commit every acknowledged batch is durable from here on and the marker can go."""
    marker = directory / ACKS_BEFORE_FSYNC
    if config.group_commit:
        if marker.exists():
            marker.unlink()
            fsync_dir(directory)
    elif not marker.exists():
        replace_file(marker, b"")


def _open_epochs(directory: Path, name: str, log_end: int) -> tuple:
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


def _last_timestamp(segments) -> int:
    for seg in reversed(segments):
        if seg.count:
            return seg.last_timestamp
    return 0


def _last_msg_id(segments) -> Optional[int]:
    for seg in reversed(segments):
        if seg.count:
            h = batch_header(seg.read(seg.last_position, records.HEADER.size))
            return h.msg_id + h.count - 1
    return None
