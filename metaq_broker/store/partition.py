"""A partition: an append-only log of segments with a sparse offset index (MetaQ's MessageStore).

Concurrency: appends are serialised by one lock; reads take no lock. A reader takes a snapshot (the
segment tuple and the visible end, both replaced whole, never mutated) and reads index entries
and bytes below that end, which no writer touches again. Under group commit the visible end moves only
after an fsync, so a reader never sees a message that was not acknowledged, and never a partial batch.

Transactions write into the log too (Kafka's design): their batches are appended as they arrive, flagged
with the transaction's number, and a marker batch settles them. Readers stop at the last stable offset
(the first batch of the oldest unsettled transaction) and skip aborted batches and markers
(``partition_txns``).

Idempotent producers (``producer_state``): an append stamped with a producer id, epoch and sequence is
checked against the producer's last batches under the write lock, and a batch sent again is answered with
the offsets it got the first time. Every batch carries its first message's position in the partition's
MetaQ message stream (``byte_base``, docs/storage-format.md section 3.5), kept running in ``_metaq_end``.
The log's identity (``identity``) is made with it and copied by replicas.

Replication (docs/design/replication-plan.md) adds: an epoch marker before a master epoch's first append
(``begin_epoch``, the ``epochs`` file), a verbatim copy of a master's batches (``append_replicated``), cuts
(``truncate_to``, ``reset_to``), reads up to the log end offset for replicas (``locate(end=log_end_offset)``),
and a high watermark capping what readers see (``set_high_watermark``).
"""
from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pyarrow as pa

from metaq_broker.errors import (CorruptLogError, InvalidOffsetError, MessageTooLargeError, NoKeyIndexError,
                                 OffsetOutOfRangeError, StoreClosedError)
from metaq_broker.ids import MessageIdAllocator
from metaq_broker.protocol import records
from metaq_broker.store import epochs as epoch_file
from metaq_broker.store import identity as identity_file
from metaq_broker.store import offset_index
from metaq_broker.store.config import TopicConfig
from metaq_broker.store.durable import fsync_dir
from metaq_broker.store.epochs import EpochFile
from metaq_broker.store.partition_txns import PartitionTxns, has_markers
from metaq_broker.store.producer_state import ProducerStates, Stored, last_sequence
from metaq_broker.store.log_loader import LoadedLog, load, read_batches, save_snapshots, stream_columns, stream_end
from metaq_broker.store.recovery import ARCHIVE_DIR, batch_table, scan_segment, walk_batches
from metaq_broker.store.retention import archive_segment, removal_reason
from metaq_broker.store.segment import Segment, batch_starts, segment_for

NO_PRODUCER = (records.NO_PRODUCER,) * 3
MAX_SEGMENT_OFFSETS = (1 << 32) - 1  # a segment's offsets, relative to its base, fit the key index's u32

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AppendResult:
    """Where an appended batch landed: offsets [base_offset, base_offset + count), ids likewise."""

    base_offset: int
    count: int
    base_msg_id: int
    timestamp: int  # store time, ms since the epoch
    fsynced: bool = True  # an fsync covering the batch completed before the append returned
    duplicate: bool = False  # an idempotent producer's batch stored before: these are its first offsets

    @property
    def offsets(self) -> np.ndarray:
        return np.arange(self.base_offset, self.base_offset + self.count, dtype=np.int64)

    @property
    def msg_ids(self) -> np.ndarray:
        return np.arange(self.base_msg_id, self.base_msg_id + self.count, dtype=np.int64)


@dataclass(frozen=True)
class FetchResult:
    """Whole batches covering offsets [start_offset, end_offset). ``data`` may begin before start_offset
    and end after end_offset (batches are never cut); ``decode()`` keeps just the asked-for range."""

    start_offset: int
    end_offset: int
    data: np.ndarray  # uint8
    aborted: np.ndarray = field(default_factory=lambda: records.NO_ABORTED)  # their batches are skipped

    @cached_property
    def batch_positions(self) -> np.ndarray:
        """Where each batch starts in data: from their length fields, when asked (a verified decode walks
        the batches itself)."""
        return batch_starts(self.data)

    def decode(self, verify: bool = True) -> pa.RecordBatch:
        return records.decode(self.data, self.start_offset, self.end_offset, verify=verify,  # verify walks itself
                              positions=None if verify else self.batch_positions, aborted=self.aborted)


@dataclass(frozen=True)
class FileRange:
    """Where the bytes that ``read`` would return lie in a segment file (``locate``): ``length`` bytes at
    ``position`` of ``path``, whole batches covering offsets [start_offset, end_offset)."""

    start_offset: int
    end_offset: int
    segment: Optional[Segment]  # held so the descriptor stays open; None when empty
    position: int  # in the file (its header included)
    length: int
    aborted: np.ndarray = field(default_factory=lambda: records.NO_ABORTED)  # as FetchResult.aborted

    @property
    def path(self) -> Optional[Path]:
        return None if self.segment is None else self.segment.path

    def dup_fd(self) -> int:
        """A descriptor of the segment file, valid however the partition changes (the caller closes it).
        StoreClosedError once the partition has been closed; CorruptLogError, as ``read`` would raise it,
        when the file is shorter than the range."""
        fd = os.dup(self.segment.fd)
        try:
            if self.segment.closed:  # set before the segment's own descriptor closes: fd may name another file
                raise StoreClosedError(f"segment {self.segment.path} is closed")
            have = min(max(os.fstat(fd).st_size - self.position, 0), self.length)
            if have < self.length:
                path = self.segment.path
                raise CorruptLogError(f"{path}: file ends at byte {self.position + have}, {self.length - have} "
                                      f"bytes short", path, self.position + have)
        except BaseException:
            os.close(fd)
            raise
        return fd


@dataclass(frozen=True)
class SegmentInfo:
    path: Path
    start: int
    size: int
    base_offset: int
    count: int
    last_timestamp: Optional[int]
    index_entries: int = 0  # entries of its sparse offset index


class PartitionLog:
    """One topic partition stored as ``<data>/<topic>-<n>/<20-digit start position>.meta`` segments."""

    # The offsets, with Kafka's names, from the lowest, and the lock under which each one moves:
    #
    #   earliest_offset     the first offset held (Kafka's log start offset): the first segment's base.
    #                       ``_segments`` is replaced whole under ``_write_lock`` (roll, retention, cuts).
    #   last_stable_offset  readers read below it (Kafka's LSO): the least of the visible end, the first
    #                       batch of the oldest unsettled transaction (``txns``, changed under
    #                       ``_write_lock``) and the high watermark. Derived, no field.
    #   high_watermark      ``_hw``: a replicated group's cap, what every in-sync member holds; None without
    #                       replication or while the master alone is in sync. ``_write_lock``.
    #   visible_end         ``_visible_end``: the end readers may see before the transaction and replication
    #                       caps, transaction batches and markers included. Kafka has no such offset: it
    #                       shows a batch once written, MetaQ's group commit only once an fsync covers it
    #                       (acknowledged then). So it moves with the recovery point under group commit
    #                       (``_flush_cond``, by the fsync's leader) and with the log end offset under
    #                       unflushThreshold > 0 (``_write_lock``, by the append).
    #   recovery_point      ``_recovery_point``: one past the last fsynced batch (Kafka's recovery point:
    #                       recovery after a crash starts there). ``_flush_cond`` (group commit's leader) or
    #                       ``_write_lock`` (an fsync of ``flush``, ``make_durable``, unflushThreshold).
    #   log_end_offset      ``_log_end_offset``: the next offset to be written (Kafka's LEO), fsynced or not;
    #                       a replica's copy reads up to it. ``_write_lock``.
    #
    # earliest <= LSO <= visible end <= LEO, recovery point <= LEO. A cut (``truncate_to``, ``reset_to``)
    # brings the LEO, the recovery point, the visible end and a high watermark above it down to the cut,
    # under ``_write_lock`` (and ``_flush_cond``). Readers take no lock: they read the ends first, then
    # ``_segments``, which then holds every offset below them. Lock order: ``_write_lock``, then
    # ``_flush_cond``, then ``_data_cond`` (waiters for data only), then a watcher's event (``watch``); a
    # group commit's leader releases ``_flush_cond`` before it takes ``_write_lock``. A segment's key index
    # lock comes after ``_write_lock`` and a segment's ``_keys_lock`` and takes none itself (the indexer
    # thread and lookups hold only it). Under ``_write_lock`` too: ``_metaq_end``, ``_last_ts``,
    # ``_unflushed``, ``producers``, ``_epochs`` and ``_next_epoch``, ``_identity``, ``_closed``, and queuing
    # a batch's keys on the active segment's key index (``KeyIndex.defer``).

    def __init__(self, loaded: LoadedLog, topic: str, partition: int, config: TopicConfig,
                 ids: MessageIdAllocator, clock=time.time, on_written: Optional[Callable[[], None]] = None):
        """A log over what ``log_loader.load`` returned; ``open`` loads and constructs."""
        self.directory = loaded.directory
        self.topic, self.partition, self.config = topic, partition, config
        self.name = f"{topic}-{partition}"
        self._ids = ids
        self._clock = clock
        self._write_lock = threading.Lock()
        self._flush_cond = threading.Condition()
        self._flush_in_progress = False
        self._failed: Optional[BaseException] = None
        self._closed = False
        self._closing = False
        self._data_cond = threading.Condition()  # notified whenever the visible end or the HW moves
        self._watchers: set = set()  # events set with it (``watch``): a wait on several partitions at once
        self._on_written = on_written  # told after every append (the store's wait_written)
        self._hw: Optional[int] = None  # readers' cap (replication); None: none
        self._next_epoch: Optional[tuple] = None  # (epoch, replica id) whose marker the next append writes
        self._epochs_dirty = loaded.epochs_dirty  # an epochs save failed: retried before the next roll or close
        self._truncations = 0  # bumped by truncate_to/reset_to: a group-commit leader's target is stale then
        self._identity = loaded.identity
        self._segments: tuple = loaded.segments
        self._log_end_offset = loaded.segments[-1].next_offset
        self._last_ts = loaded.last_timestamp
        self._visible_end = self._log_end_offset  # everything loaded is on disk
        self._recovery_point = self._log_end_offset
        self.txns = loaded.txns
        self.producers = loaded.producers
        self._epochs = loaded.epochs
        self._metaq_end = loaded.metaq_end
        self._unflushed = 0
        self._last_flush = clock()
        self.fsync_count, self.fsync_seconds = 0, 0.0  # data fsyncs of appends, for the broker's metrics
        self._keys_due: list = []  # sealed segments whose key index is still to be written (``_write_keys_due``)

    @classmethod
    def open(cls, directory, topic: str, partition: int, config: TopicConfig,
             ids: Optional[MessageIdAllocator] = None, clock=time.time, repair: bool = False,
             on_written: Optional[Callable[[], None]] = None) -> "PartitionLog":
        """Load partition ``topic``-``partition`` from ``directory`` (``log_loader.load``: recovery,
        transaction and producer state, epochs, identity) and return the log over it. ``repair``: let
        recovery cut a damaged tail followed by valid batches."""
        ids = ids or MessageIdAllocator()
        loaded = load(directory, f"{topic}-{partition}", config, ids, clock, repair)
        return cls(loaded, topic, partition, config, ids, clock, on_written)

    def _batches(self, start: int, stop: int):
        """``log_loader.read_batches`` over this log's segments."""
        return read_batches(self._segments, start, stop)

    def _save_txns(self) -> None:
        """Write the transaction and the producers' snapshots as of the log end offset."""
        save_snapshots(self.directory, self.txns, self.producers, self._log_end_offset, self.earliest_offset,
                       max(int(self._clock() * 1000), self._last_ts))

    # -- state ----------------------------------------------------------------------------------------
    @property
    def identity(self) -> str:
        """This log's identity: 32 hex digits made with it (``store/identity.py``)."""
        return self._identity.id

    def producer_ids(self) -> list:
        """The idempotent producers' ids this partition keeps state for (under the write lock)."""
        with self._write_lock:
            return self.producers.ids()

    @property
    def identity_adopted(self) -> bool:
        """The identity was not made with this log (an older data directory's, or taken over from a
        master): a replica takes its master's then instead of starting over."""
        return self._identity.adopted

    def adopt_identity(self, value: str) -> None:
        """Take ``value`` as this log's identity, keeping the data (a replica whose identity was adopted,
        following its master). Durable before it returns."""
        identity_file.check_id(value)
        with self._write_lock:
            if value != self._identity.id:
                new = identity_file.Identity(value, int(self._clock() * 1000), True)
                identity_file.write(self.directory, new)
                log.info("%s: takes identity %s (was %s)", self.name, value, self._identity.id)
                self._identity = new

    @property
    def metaq_end(self) -> int:
        """Where the next batch starts in the partition's MetaQ message stream (``byte_base``)."""
        return self._metaq_end

    @property
    def earliest_offset(self) -> int:
        return self._segments[0].base_offset

    @property
    def last_stable_offset(self) -> int:
        """Readers read below it (Kafka's LSO, the end a read_committed consumer sees): the visible end,
        stopped at the first batch of the oldest unsettled transaction, and at the high watermark when one
        is set."""
        visible = self._visible_end  # read first: every transactional batch below it is in txns by now
        first, hw = self.txns.first_unstable(), self._hw
        return min(visible, visible if first is None else first, visible if hw is None else hw)

    @property
    def high_watermark(self) -> Optional[int]:
        """The readers' cap (``set_high_watermark``); None: none."""
        return self._hw

    @property
    def visible_end(self) -> int:
        """One past the last published batch, unsettled transactions and markers included: fsynced under
        group commit, written under unflushThreshold > 0."""
        return self._visible_end

    @property
    def recovery_point(self) -> int:
        """One past the last fsynced batch (Kafka's recovery point)."""
        return self._recovery_point

    @property
    def log_end_offset(self) -> int:
        """The next offset to be written (Kafka's LEO): one past the last written batch, fsynced or not;
        where a replica's copy reads up to."""
        return self._log_end_offset

    @property
    def epochs(self) -> EpochFile:
        """This partition's leader epochs (read only: ``end_offset_for``, ``epoch_at``)."""
        return self._epochs

    @property
    def last_epoch(self) -> int:
        """The epoch of the last batch written; 0 for none, or a log from before replication."""
        latest = self._epochs.latest
        return 0 if latest is None else latest.epoch

    def epoch_before(self, offset: int) -> int:
        """The epoch of the batch just before ``offset`` (a replica's fetch says it); 0 for none."""
        return self._epochs.epoch_at(offset - 1) if offset > 0 else 0

    def aborted_in(self, start: int, end: int) -> np.ndarray:
        """The aborted transactions with batches in offsets [start, end) (``records.ABORTED_DTYPE``)."""
        return self.txns.aborted_in(start, end)

    @property
    def size_bytes(self) -> int:
        return sum(s.size for s in self._segments)

    def segments(self) -> list:
        segs = self._segments
        return [SegmentInfo(s.path, s.start, s.size, s.base_offset, s.count, s.last_timestamp, len(s.entries()))
                for s in segs]

    def _check_open(self):
        if self._closed:
            raise StoreClosedError(f"partition {self.name} is closed")
        if self._failed is not None:
            raise StoreClosedError(f"partition {self.name} stopped after a disk error ({self._failed}); "
                                   f"reopen it to recover")

    # -- appending ------------------------------------------------------------------------------------
    def append(self, values, keys=None, attributes=None, flags=None, headers=None,
               producer: Optional[tuple] = None, timestamps=None) -> AppendResult:
        """Append one batch (columns as ``records.encode_body`` takes them); returns its offsets and message
        ids once the topic's flush policy is met (group commit: after an fsync covering it). ``producer``:
        see ``append_body``."""
        return self.append_body(records.encode_body(values, keys, attributes, flags, headers, timestamps), producer)

    def append_body(self, body: records.EncodedBody, producer: Optional[tuple] = None,
                    durable: bool = True) -> AppendResult:
        """``producer``: (id, epoch, base sequence) of an idempotent producer's batch. A batch it already
        stored here is not appended again: the result is the first one's (``duplicate``), returned once
        durable as an append's would be; a gap or an old epoch raises (``ProducerStates.check``).
        ``durable`` False: returned once written, before group commit's fsync; the caller then waits with
        ``make_durable`` (a connection appends its next requests meanwhile: one fsync covers them all)."""
        return self.append_bodies([body], producer=producer, durable=durable)[0]

    def append_bodies(self, bodies: list, txn: int = 0, flags: int = 0, commit: bool = False,
                      producer: Optional[tuple] = None, durable: bool = True) -> list:
        """Append batches back to back; readers see all of them or none (one write-lock hold, one
        publish). With ``flags`` TRANSACTIONAL the batches belong to transaction number ``txn``: readers
        see them once its commit marker follows (``append_marker``), and the append returns once written,
        not fsynced (the transaction's prepare makes it durable: ``make_durable``). Without ``flags``,
        ``txn`` is only stamped in the headers (``journal_v1.finish_commit`` ending an old commit). CONTROL
        is ``append_marker``'s (``commit`` says which marker). ``producer``: one body only (``append_body``);
        ``durable``: as ``append_body``'s."""
        for body in bodies:
            self.check_size(body)
        if producer is not None and (len(bodies) != 1 or flags):
            raise ValueError("an idempotent producer's append is one plain batch")
        transactional = bool(flags & records.TRANSACTIONAL)
        stored = None
        with self._write_lock:
            self._check_open()
            ts = max(int(self._clock() * 1000), self._last_ts)
            if producer is not None:
                stored = self.producers.check(producer[0], producer[1], producer[2], bodies[0].count, ts)
            if stored is None:
                results, end = self._append_locked(bodies, txn, flags, commit, producer, ts)
        if stored is not None:  # sent again: answered with the first one's offsets, once it is as durable
            end = stored.base_offset + stored.count
            if self.config.group_commit and durable:
                self._await_durable(end)
            log.debug("%s: a batch sent again (offsets %d-%d): answered with its first offsets", self.name,
                      stored.base_offset, end - 1)
            return [AppendResult(stored.base_offset, stored.count, stored.base_msg_id, stored.timestamp,
                                 self._recovery_point >= end, duplicate=True)]
        self._written()
        self._write_keys_due()
        if self.config.group_commit and not transactional and durable:
            self._await_durable(end)
        return results

    def _append_locked(self, bodies: list, txn: int, flags: int, commit: bool, producer: Optional[tuple],
                       ts: int) -> tuple:
        """``append_bodies`` under the write lock: (results, the log end offset)."""
        transactional = bool(flags & records.TRANSACTIONAL)
        results = []
        marker = None if self._next_epoch is None else self._due_epoch_marker()
        for body in bodies:
            items = [(body, txn, flags, commit, producer)]
            if marker is not None:  # in the same write as the epoch's first batch
                items.insert(0, (records.encode_body([records.epoch_marker(*marker)]), 0, records.CONTROL,
                                 False, None))
            placed = self._write_locked(items, ts)
            if marker is not None:
                self._next_epoch = None
                self._add_epochs([epoch_file.Epoch(marker[0], marker[1], placed[0][0])])
                marker = None
            base, msg_id = placed[-1]
            results.append(AppendResult(base, body.count, msg_id, ts, self.config.group_commit and not transactional))
        end = self._log_end_offset
        self._last_ts = ts
        if not self.config.group_commit:
            self._unflushed += sum(b.count for b in bodies)
            now = self._clock()
            if not transactional and (self._unflushed >= self.config.unflush_threshold
                                      or (now - self._last_flush) * 1000 >= self.config.unflush_interval_ms):
                self._fsync_active_locked()
                results = [replace(r, fsynced=True) for r in results]
            self._publish(end)  # acknowledged after the page-cache write (or the fsync above)
        return results, end

    def _write_locked(self, items: list, ts: int) -> list:
        """Write batches ``(body, txn, flags, commit, producer)`` back to back in one write (rolling first
        if they would overflow a non-empty segment), index them, take in their transactions and producers.
        Returns each one's (base offset, base message id)."""
        seg = self._segments[-1]
        nbytes = 0
        for item in items:
            nbytes += records.HEADER_SIZE + item[0].size
        count = sum(item[0].count for item in items)
        if seg.count and (seg.size + nbytes > self.config.max_segment_size
                          or self._log_end_offset + count - seg.base_offset > MAX_SEGMENT_OFFSETS):
            seg = self._roll()
        parts, batches, placed = [], [], []
        offset, position, metaq_end = self._log_end_offset, seg.end, self._metaq_end
        for body, txn, flags, _, producer in items:
            msg_id = self._ids.allocate(body.count)
            header = records.encode_header(body, offset, msg_id, ts, txn, flags, producer or NO_PRODUCER, metaq_end)
            metaq_end += body.metaq_bytes
            n = records.HEADER_SIZE + body.size
            parts.append(header)
            parts += body.parts
            low, high = _skews(body, ts)
            batches.append((offset, position, ts, n, body.count, int(body.message_sizes.sum(dtype=np.int64)), msg_id,
                            low, high))
            placed.append((offset, msg_id))
            offset, position = offset + body.count, position + n
        seg.append(parts, nbytes, batches)
        keys = seg.keys
        for (base, msg_id), (body, txn, flags, commit, producer) in zip(placed, items):
            if keys is not None:  # queued before the batch is published: a lookup applies it first
                keys.defer(base, body.count, None if flags & records.CONTROL else body)
            if flags & records.CONTROL:
                if txn:  # txn 0: an epoch marker, which settles nothing
                    self.txns.on_marker(txn, base, commit)
            elif flags & records.TRANSACTIONAL:
                self.txns.on_batch(txn, base)
            elif producer is not None:
                pid, epoch, seq = producer
                self.producers.on_batch(pid, epoch, Stored(seq, last_sequence(seq, body.count), base, body.count,
                                                           msg_id, ts))
        self._log_end_offset, self._metaq_end = offset, metaq_end
        return placed

    def _written(self) -> None:
        if self._on_written is not None:
            self._on_written()

    # -- epochs ---------------------------------------------------------------------------------------
    def begin_epoch(self, epoch: int, replica_id: int) -> None:
        """This member is master in ``epoch``: the next append here (any path) first writes the epoch's
        marker, in the same write-lock hold, write and fsync, and records it in ``epochs``. Lazy, so an idle
        partition writes nothing; a no-op if the log already has this epoch or a later one."""
        if not 0 < epoch <= epoch_file.MAX_EPOCH or not 0 <= replica_id < 2 ** 32:
            raise ValueError(f"epoch {epoch}, replica {replica_id}: out of range")
        with self._write_lock:
            if epoch > max(self.last_epoch, self._next_epoch[0] if self._next_epoch else 0):
                self._next_epoch = (epoch, replica_id)

    def _due_epoch_marker(self) -> Optional[tuple]:
        """(epoch, replica id) if the next append must write an epoch marker (copied data may have brought
        that epoch meanwhile)."""
        if self._next_epoch is not None and self._next_epoch[0] <= self.last_epoch:
            self._next_epoch = None
        return self._next_epoch

    def _add_epochs(self, found: list) -> None:
        """Record epoch markers just written in ``epochs`` (under the write lock). A failed save leaves
        them in memory, saved again before the next roll or close; recovery finds them in the log too."""
        try:
            if self._epochs.add_missing(found) or self._epochs_dirty:
                self._epochs.save()
                self._epochs_dirty = False
        except OSError as e:
            log.warning("%s: could not write its epochs file (%s); retrying at the next roll", self.name, e)
            self._epochs_dirty = True

    def append_marker(self, txn: int, commit: bool) -> int:
        """Settle transaction ``txn`` here: append its commit or abort marker (one message, which no reader
        returns) and return once it is durable. Returns the marker's offset. From the moment it is written
        the last stable offset no longer waits for ``txn``; after an abort, readers skip its batches."""
        body = records.encode_body([records.COMMIT_MARKER if commit else records.ABORT_MARKER])
        result = self.append_bodies([body], txn, records.CONTROL, commit)[0]
        if not self.config.group_commit:
            self.make_durable(result.base_offset + 1)
        return result.base_offset

    def make_durable(self, offset: int) -> None:
        """Return once everything below ``offset`` is fsynced (and so visible up to the last stable
        offset): a transaction's prepare, for its batches."""
        if self.config.group_commit:
            self._await_durable(offset)
            return
        with self._write_lock:
            self._check_open()
            if self._recovery_point < offset:
                self._fsync_active_locked()

    def check_size(self, body: records.EncodedBody) -> None:
        if body.max_message_size > self.config.max_message_size:
            big = int(np.argmax(body.message_sizes))
            raise MessageTooLargeError(
                f"message {big} of the batch is {body.max_message_size} bytes (key + value + attribute); "
                f"the limit for topic {self.topic} is {self.config.max_message_size}")

    def _roll(self) -> Segment:
        old = self._segments[-1]
        if self._epochs_dirty:  # before the snapshot: recovery looks for missing markers only after it
            self._epochs.save()
            self._epochs_dirty = False
        self._save_txns()  # first: recovery then needs to scan only from the new segment on
        old.seal()  # fsyncs the log and writes the index: all of it is durable now
        if old.keys is not None:  # its key index is written once the write lock is let go
            self._keys_due.append(old)
        n = len(old.entries())
        new = Segment.create(self.directory, old.end, self._log_end_offset, self.config.index_interval_bytes,
                             n + n // 8, self.config.key_index)
        self._segments = self._segments + (new,)
        self._unflushed = 0
        log.debug("%s: rolled to segment %s at offset %d", self.name, new.path.name, new.base_offset)
        return new

    def _write_keys_due(self) -> None:
        """Write the key indexes of segments sealed by this thread's appends, outside the write lock: the
        next append need not wait for them. Until written, lookups use them from memory; a crash before
        leaves the file missing, and the first lookup that needs it rebuilds it from the log."""
        if not self._keys_due:
            return
        with self._write_lock:
            due, self._keys_due = self._keys_due, []
        for seg in due:
            seg.write_keys()

    def _fsync(self, seg: Segment) -> None:
        """``seg.fsync()``, counted and timed for the broker's metrics."""
        t = time.perf_counter()
        seg.fsync()
        self.fsync_count, self.fsync_seconds = self.fsync_count + 1, self.fsync_seconds + time.perf_counter() - t

    def _fsync_active_locked(self) -> None:
        try:
            self._fsync(self._segments[-1])
        except OSError as e:
            self._failed = e
            raise
        self._unflushed = 0
        self._last_flush = self._clock()
        self._recovery_point = self._log_end_offset

    def _await_durable(self, offset: int) -> None:
        """Group commit: whoever finds no fsync running becomes the leader and fsyncs everything written
        so far; the others wait for it. One fsync acknowledges every append that was waiting."""
        with self._flush_cond:
            while self._recovery_point < offset:
                if self._failed is not None:
                    raise StoreClosedError(f"partition {self.name}: fsync failed ({self._failed}); "
                                           f"the append at offset {offset} was not acknowledged")
                if offset > self._log_end_offset:
                    raise StoreClosedError(f"partition {self.name} was truncated to offset {self._log_end_offset} "
                                           f"(replication); the append at offset {offset} was not acknowledged")
                if self._flush_in_progress or self._closing:
                    # While closing, close() itself fsyncs and then releases every waiter.
                    self._flush_cond.wait()
                    continue
                self._flush_in_progress = True
                self._flush_cond.release()
                error = None
                try:
                    with self._write_lock:
                        target, seg, cuts = self._log_end_offset, self._segments[-1], self._truncations
                    self._fsync(seg)  # earlier segments were fsynced when they were sealed
                except BaseException as e:  # noqa: BLE001 - handed to every waiter below
                    error = e
                finally:
                    self._flush_cond.acquire()
                    self._flush_in_progress = False
                if error is not None:
                    self._failed = error
                    self._flush_cond.notify_all()
                    raise StoreClosedError(f"partition {self.name}: fsync failed ({error})") from error
                if target > self._recovery_point and cuts == self._truncations:
                    self._recovery_point = target
                    self._publish(target)
                self._flush_cond.notify_all()

    def _publish(self, offset: int) -> None:
        """Make messages below ``offset`` visible to readers and wake those waiting for data."""
        if offset > self._visible_end:
            self._visible_end = offset
            self._wake_readers()

    def _wake_readers(self) -> None:
        with self._data_cond:
            self._data_cond.notify_all()
            for event in self._watchers:
                event.set()

    def watch(self, event: threading.Event) -> None:
        """Set ``event`` whenever ``wait_for_data``'s waiters are woken (until ``unwatch``): one event
        watched on several partitions lets one thread wait for data on any of them (a Kafka Fetch)."""
        with self._data_cond:
            self._watchers.add(event)

    def unwatch(self, event: threading.Event) -> None:
        with self._data_cond:
            self._watchers.discard(event)

    def wait_for_data(self, offset: int, timeout: float) -> bool:
        """Block until a message at ``offset`` or later is readable (or ``timeout`` seconds pass, or the
        partition closes); True when there is data. Lets a consumer at the last stable offset long-poll."""
        deadline = time.monotonic() + timeout
        with self._data_cond:
            while self.last_stable_offset <= offset and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._data_cond.wait(left)
        return self.last_stable_offset > offset

    def flush(self) -> None:
        """fsync whatever is written; afterwards every acknowledged message is durable."""
        with self._write_lock:
            self._check_open()
            self._fsync_active_locked()
            target, cuts = self._log_end_offset, self._truncations
        with self._flush_cond:
            if cuts == self._truncations:
                self._recovery_point = max(self._recovery_point, target)
                self._publish(target)
            self._flush_cond.notify_all()

    def flush_if_due(self, now: Optional[float] = None) -> bool:
        """For ``unflushThreshold > 0``: fsync once ``unflushInterval`` has passed with data unflushed."""
        now = self._clock() if now is None else now
        if self._closed or not self._unflushed or (now - self._last_flush) * 1000 < self.config.unflush_interval_ms:
            return False
        with self._write_lock:
            if self._closed or not self._unflushed:
                return False
            self._fsync_active_locked()
        return True

    # -- replication: copy, cut, cap ------------------------------------------------------------------
    def append_replicated(self, data, batch_positions: Optional[np.ndarray] = None) -> int:
        """Append a master's batches verbatim (offsets, ids, timestamps, transaction numbers, flags), as
        its segment file holds them: whole batches from ``log_end_offset`` on. Every batch's checksums and
        the offsets' continuity are checked first; on any mismatch CorruptLogError and nothing written.
        Rolls segments as ``append`` does. Not fsynced: the caller's ``make_durable(log_end_offset)`` (or
        ``flush``) does, and ``recovery_point`` covers the copy then. Returns the new log end offset."""
        u8 = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
        if not len(u8):
            return self._log_end_offset
        what = f"{self.name}: replicated data"
        positions, _, _ = walk_batches(u8, 0, None, what, lookahead=False, strict=True)  # CRCs, outside the lock
        if batch_positions is not None and not np.array_equal(positions, batch_positions):
            raise CorruptLogError(f"{what}: batches start at {positions[:8].tolist()}..., not at the positions "
                                  f"given", what, 0)
        h = records.headers_at(u8, positions)
        ends = positions + h["batch_len"].astype(np.int64)  # where each batch ends in data
        batches = batch_table(u8, positions, 0)
        _, _, metaq, byte_base = stream_columns(u8, positions)
        with self._write_lock:
            self._check_open()
            if int(h["base_offset"][0]) != self._log_end_offset:
                raise CorruptLogError(f"{what}: begins at offset {int(h['base_offset'][0])}, the log ends at "
                                      f"{self._log_end_offset}", what, 0)
            found, i = [], 0
            nexts = h["base_offset"] + h["count"].astype(np.int64)  # each batch's next offset
            while i < len(positions):  # a step per segment written, not per batch
                seg = self._segments[-1]
                room = self.config.max_segment_size - seg.size
                j = min(int(np.searchsorted(ends, int(positions[i]) + room, "right")),
                        int(np.searchsorted(nexts, seg.base_offset + MAX_SEGMENT_OFFSETS, "right")))
                if j <= i:
                    if seg.count:
                        self._roll()
                        continue
                    j = i + 1  # a batch larger than a segment goes alone into one, as append does
                lo, hi = int(positions[i]), int(ends[j - 1])
                run = batches[i:j].copy()
                run["position"] += seg.end - lo
                # version 2 batches continue the stream as recovery computes it (_stream_end)
                anchor = self._metaq_end if seg.count else records.METAQ_ANCHOR * seg.start
                seg.append([u8[lo:hi]], hi - lo, run)
                if seg.keys is not None:
                    seg.keys.add_batches(u8, positions[i:j], int(nexts[j - 1]))
                self._metaq_end = int(records.stream_ends(byte_base[i:j], metaq[i:j], anchor)[-1])
                self.txns.scan(u8, positions[i:j])
                self.producers.scan(u8, positions[i:j])
                found += epoch_file.markers(u8, positions[i:j])
                self._log_end_offset = int(h["base_offset"][j - 1]) + int(h["count"][j - 1])
                i = j
            self._add_epochs(found)
            self._ids.observe(int(h["base_msg_id"][-1]) + int(h["count"][-1]) - 1)
            self._last_ts = max(self._last_ts, int(h["timestamp"].max()))
            end = self._log_end_offset
            if not self.config.group_commit:
                self._unflushed += int(batches["count"].sum())
                self._publish(end)  # as append: visible once written under unflushThreshold > 0
        self._written()
        self._write_keys_due()
        return end

    def truncate_to(self, offset: int) -> int:
        """Cut the log back to ``offset``, rounded down to a batch start (a replica whose tail the master
        does not hold: plan section 6). Later segments go, the new tail is cut and fsynced with its
        directory before this returns (a crash cannot bring the tail back), ``epochs`` and transaction
        state follow, and the visible end, the recovery point and the HW cap drop to the cut. Transaction state
        is rebuilt by a header scan from the earliest offset (no per-segment snapshot exists yet), saved
        before the cut so that a crash half way leaves a snapshot valid for either log. Returns the new end."""
        self._check_offset(offset)
        with self._write_lock:
            self._check_open()
            segs = list(self._segments)
            if offset >= self._log_end_offset:
                return self._log_end_offset
            offset = max(offset, segs[0].base_offset)
            i = bisect.bisect_right([s.base_offset for s in segs], offset) - 1
            seg = segs[i]
            cut = seg.batch_at(offset, self._log_end_offset).offset
            self._rebuild_txns(cut, producers=True)
            self._epochs.truncate(cut)
            for dropped in reversed(segs[i + 1:]):  # newest first: a crash leaves a contiguous prefix
                _remove_files(dropped)
            tail = seg.truncated(cut, self.config.key_index)
            self._segments = tuple(segs[:i]) + (tail,)
            fsync_dir(self.directory)
            self._cut_ends(cut)
            self._metaq_end = stream_end(self._segments)
            log.warning("%s: truncated to offset %d (replication)", self.name, cut)
        return cut

    def reset_to(self, offset: int, identity: Optional[str] = None, epoch: int = 0) -> None:
        """Drop every segment: the partition becomes empty, its next offset ``offset`` (a replica below the
        master's earliest offset, or a wiped one). Transaction and producer state are cleared and the epochs
        say the log goes on at ``offset`` with ``epoch`` (the master's epoch there), a HW cap set moves to
        ``offset``; a reopen keeps it. A crash half way leaves a prefix of the old log with a snapshot that
        rescans it all. ``identity``: the master's log's, taken as this one's once the old log is gone (a
        crash before keeps the old identity, so the replica starts over again)."""
        self._check_offset(offset)
        if identity is not None:
            identity_file.check_id(identity)
        with self._write_lock:
            self._check_open()
            segs, max_txn = self._segments, self.txns.max_txn
            self.txns = PartitionTxns(None if self._hw is None else offset)
            self.txns.max_txn = max_txn
            self.txns.save(self.directory, 0, 0)  # valid for any prefix of the old log: it is scanned whole
            self.producers = ProducerStates(self.name, self.config.producer_id_expiration_ms)
            self.producers.save(self.directory, 0, 0)
            self._epochs.reset(epoch, offset)
            self._epochs_dirty = False
            for dropped in reversed(segs):
                _remove_files(dropped)
            fsync_dir(self.directory)
            self._segments = (Segment.create(self.directory, segs[-1].end, offset, self.config.index_interval_bytes,
                                             keyed=self.config.key_index),)
            self._cut_ends(offset)
            self._metaq_end = records.METAQ_ANCHOR * segs[-1].end
            if identity is not None and identity != self._identity.id:
                self._identity = identity_file.Identity(identity, int(self._clock() * 1000), False)
                identity_file.write(self.directory, self._identity)
            self._hw = None if self._hw is None else offset  # a cap set stays set, at the empty log's end
            self._save_txns()
            log.warning("%s: emptied, next offset %d (replication)", self.name, offset)

    def _rebuild_txns(self, end: int, producers: bool = False) -> None:
        """Transaction state for the log below ``end`` (a cut, or the first HW cap), saved as of ``end``;
        with ``producers`` the producers' state too (a cut: their batches past it are gone)."""
        hw = None if self._hw is None else min(self._hw, end)
        fresh = self.txns.truncated(end, self.earliest_offset, hw)
        states = ProducerStates(self.name, self.config.producer_id_expiration_ms) if producers else None
        for u8, positions in self._batches(self.earliest_offset, end):
            fresh.scan(u8, positions)
            if states is not None:
                states.scan(u8, positions)
        self.txns = fresh
        fresh.save(self.directory, end, self.earliest_offset)
        if states is not None:
            self.producers = states
            states.save(self.directory, end, max(int(self._clock() * 1000), self._last_ts))

    def _cut_ends(self, end: int) -> None:
        """After a cut (write lock held): every end is ``end``, all below it fsynced (sealed segments, and
        the tail by the cut); group-commit leaders of the old log find their target stale
        (``_truncations``), waiters of cut appends fail."""
        self._log_end_offset = end
        self._unflushed = 0
        if self._hw is not None:
            self._hw = min(self._hw, end)
        with self._flush_cond:
            self._truncations += 1
            self._recovery_point = self._visible_end = end
            self._flush_cond.notify_all()
        self._wake_readers()

    def set_high_watermark(self, hw: Optional[int]) -> None:
        """Cap readers at ``hw`` (replication: what every in-sync member has); None removes the cap.
        Never lowers it (only ``truncate_to``/``reset_to`` do). A transaction counts as unsettled until
        its marker is below the cap. The first cap re-reads transaction state if markers lie at or above
        it (they settled at open, before any cap): a header scan of the log, once."""
        if hw is not None and self._hw is not None and hw <= self._hw:
            return  # the common call, without the write lock
        with self._write_lock:
            self._set_hw_locked(hw)
        self._wake_readers()

    def cap_at_visible(self) -> int:
        """Cap readers exactly where they are now and return that offset: the switch from no cap (a group
        whose only in-sync member is its master) to an explicit one, with no publish in between, so the
        last stable offset readers see never moves down."""
        with self._write_lock:
            with self._flush_cond:  # publishes happen under this (group commit) or the write lock
                visible = self._visible_end
                self._set_hw_locked(visible if self._hw is None else max(self._hw, visible))
                return self._hw

    def _set_hw_locked(self, hw: Optional[int]) -> None:
        if self._closed or (hw is not None and self._hw is not None and hw <= self._hw):
            return
        start = max(self.earliest_offset, hw or 0)
        if hw is not None and self._hw is None and any(
                has_markers(u8, pos) for u8, pos in self._batches(start, self._log_end_offset)):
            self._hw = hw
            self._rebuild_txns(self._log_end_offset)
        else:
            self.txns.advance(hw)
            self._hw = hw

    # -- reading --------------------------------------------------------------------------------------
    @staticmethod
    def _check_offset(offset) -> None:
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
            raise InvalidOffsetError(f"offset must be an integer, got {offset!r}")
        if offset < 0:
            raise InvalidOffsetError(f"offset {offset} is negative")

    def _snapshot(self, offset: int, end: Optional[int] = None):
        """(segments, end readable): end is the last stable offset unless given (then at most the log end
        offset). An offset between it and the visible end is valid (a reader waiting for a transaction to settle)
        and reads nothing. The ends are read before the segments, which then hold every offset below them."""
        visible = self._visible_end
        stable = self.last_stable_offset if end is None else min(end, self._log_end_offset)
        segs = self._segments
        if segs[0].closed:
            raise StoreClosedError(f"partition {self.name} is closed")
        if offset < segs[0].base_offset or offset > max(visible, stable):
            raise OffsetOutOfRangeError(f"{self.name}", offset, segs[0].base_offset, stable)
        return segs, max(stable, min(offset, visible))

    def _plan_read(self, offset: int, max_bytes: int, max_messages: Optional[int], end: Optional[int] = None):
        """What ``read`` and ``locate`` return: None at the end (the last stable offset unless ``end``),
        else (segment, logical position, length, message count)."""
        self._check_offset(offset)
        if not isinstance(max_bytes, (int, np.integer)) or max_bytes < 1:
            raise InvalidOffsetError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        if max_messages is not None and (not isinstance(max_messages, (int, np.integer)) or max_messages < 1):
            raise InvalidOffsetError(f"max_messages must be a positive integer, got {max_messages!r}")
        segs, end = self._snapshot(offset, end)
        if offset >= end:
            return None
        seg = segment_for(segs, offset)
        first, length, stop = seg.plan(offset, end, int(max_bytes),
                                       end if max_messages is None else min(end, offset + int(max_messages)))
        return seg, first, length, stop - offset

    def read(self, offset: int, max_bytes: int = 1 << 20, max_messages: Optional[int] = None,
             end: Optional[int] = None) -> FetchResult:
        """Whole batches from ``offset`` on, within one segment, up to ``max_bytes`` (at least one batch,
        so a consumer always progresses) and ``max_messages``. Empty at the last stable offset. ``end`` (at most
        ``log_end_offset``) replaces the last stable offset as the end: a replica's copy reads written batches
        not yet fsynced or visible, whole ones only."""
        plan = self._plan_read(offset, max_bytes, max_messages, end)
        if plan is None:
            return FetchResult(offset, offset, np.empty(0, np.uint8))
        seg, first, length, n = plan
        return FetchResult(offset, offset + n, seg.read(first, length), self.aborted_in(offset, offset + n))

    def locate(self, offset: int, max_bytes: int = 1 << 20, max_messages: Optional[int] = None,
               end: Optional[int] = None) -> FileRange:
        """Where the bytes ``read`` would return with the same arguments are in the segment file, for a
        caller that sends them from the file itself (the broker's data port, with ``sendfile``)."""
        plan = self._plan_read(offset, max_bytes, max_messages, end)
        if plan is None:
            return FileRange(offset, offset, None, 0, 0)
        seg, first, length, n = plan
        return FileRange(offset, offset + n, seg, first - seg.start, length, self.aborted_in(offset, offset + n))

    def read_arrow(self, offset: int, end_offset: Optional[int] = None, max_bytes: int = 1 << 20) -> pa.RecordBatch:
        """Read and decode (checksums verified) messages from ``offset``, stopping at ``end_offset``."""
        if end_offset is not None:
            self._check_offset(end_offset)
            if end_offset <= offset:
                self._check_offset(offset)
                self._snapshot(offset)
                return records.empty_batch()
        max_messages = None if end_offset is None else end_offset - offset
        result = self.read(offset, max_bytes, max_messages)
        try:
            return result.decode(verify=True)
        except records.RecordFormatError as e:
            seg = segment_for(self._segments, offset)
            file_pos = seg.batch_at(offset, result.end_offset).position - seg.start + e.position
            raise CorruptLogError(f"{seg.path}: damaged batch at byte {file_pos} ({e}; reading offset {offset})",
                                  seg.path, file_pos) from None

    def timestamp_at(self, offset: int) -> int:
        """Store time (ms) of the message at ``offset``: its batch's header, found through the index."""
        end = self.last_stable_offset
        segs = self._segments
        if not segs[0].base_offset <= offset < end:
            raise OffsetOutOfRangeError(f"{self.name}", offset, segs[0].base_offset, end)
        return segment_for(segs, offset).batch_at(offset, end).timestamp

    def offset_for_timestamp(self, timestamp_ms: int, end: Optional[int] = None) -> int:
        """The first offset stored at or after ``timestamp_ms``; the last stable offset (or ``end``, at most
        the log end offset) if there is none."""
        end = self.last_stable_offset if end is None else min(end, self._log_end_offset)
        for seg in self._segments:
            if seg.base_offset >= end:
                break
            if not seg.mutable and seg.last_timestamp is not None and seg.last_timestamp < timestamp_ms:
                continue  # a sealed segment stored wholly before
            found = seg.first_at_or_after(timestamp_ms, end)
            if found is not None:
                return found
        return end

    def offsets_for_create_times(self, since_ms: Optional[int], until_ms: Optional[int],
                                 end: Optional[int] = None) -> tuple:
        """[low, high): the offsets below the last stable offset (or ``end``) outside which no message has a
        create time in [since_ms, until_ms] (None: unbounded; a message without one counts its store time).
        Answered through the time index, which orders store times: per segment, its skew bounds
        (``offset_index.store_time_bounds``) say which store times such a message can have. Not exact
        (whole batches, bounds that may be wide): a range to read and filter, never one that misses a
        match. low is the first offset no earlier message of which qualifies; high the offset after which
        none does."""
        end = self.last_stable_offset if end is None else min(end, self._log_end_offset)
        segs = tuple(s for s in self._segments if s.base_offset < end and s.count)  # skews read after end
        earliest = self._segments[0].base_offset
        low = earliest if since_ms is None else end
        for seg in segs if since_ms is not None else ():
            at = offset_index.store_time_bounds(since_ms, None, *seg.skew)[0]
            if not seg.mutable and seg.last_timestamp < at:
                continue  # a sealed segment stored wholly before any qualifying message
            found = seg.first_at_or_after(at, end)
            if found is not None:
                low = found
                break
        if until_ms is None:
            return low, end
        high = earliest
        for seg in reversed(segs):
            after = offset_index.store_time_bounds(None, until_ms, *seg.skew)[1]
            found = seg.first_at_or_after(after + 1, end) if after < (1 << 63) - 1 else None
            if found is None or found > seg.base_offset:  # the segment's messages up to found may qualify
                high = min(seg.next_offset, end) if found is None else found
                break
        return low, max(low, high)

    def _ranges(self, start: int, stop: int):
        """(segment, first, end, the snapshot's end) for the segments holding offsets [start, stop)."""
        segs, end = self._snapshot(start)
        end = max(end, self._visible_end)  # sizes of unsettled messages are known too
        if stop > end:
            raise OffsetOutOfRangeError(self.name, stop, segs[0].base_offset, end)
        for seg in segs:
            lo, hi = max(start, seg.base_offset), min(stop, seg.next_offset)
            if lo < hi:
                yield seg, lo, hi, end

    def range_bytes(self, start: int, stop: int) -> int:
        """Bytes of the messages in [start, stop) (keys, values, attributes and column entries), exact: the
        index holds the bytes before each entry, and the batches at either end say the rest."""
        self._check_offset(start)
        self._check_offset(stop)
        return sum(seg.bytes_before(hi, end) - seg.bytes_before(lo, end)
                   for seg, lo, hi, end in self._ranges(start, max(start, stop)))

    def offset_after_bytes(self, start: int, max_bytes: int, stop: Optional[int] = None) -> int:
        """The furthest offset ``o`` with range_bytes(start, o) <= max_bytes (for byte-based read limits)."""
        self._check_offset(start)
        if stop is not None:
            self._check_offset(stop)
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)) or max_bytes < 0:
            raise InvalidOffsetError(f"max_bytes must be a non-negative integer, got {max_bytes!r}")
        stop = self.last_stable_offset if stop is None else stop
        taken, offset = 0, start
        for seg, lo, hi, end in self._ranges(start, max(start, stop)):
            before = seg.bytes_before(lo, end)
            have = seg.bytes_before(hi, end) - before
            if taken + have > max_bytes:
                return seg.offset_at_bytes(before + int(max_bytes) - taken, hi)
            taken, offset = taken + have, hi
        return offset

    def offset_for_msg_id(self, msg_id: int, end: Optional[int] = None) -> Optional[int]:
        """The offset of the message whose id is ``msg_id``, if it is below the last stable offset (or
        ``end``, at most the log end offset); None otherwise (exactly one answer or none: ids are unique in
        a partition)."""
        if isinstance(msg_id, bool) or not isinstance(msg_id, (int, np.integer)):
            raise InvalidOffsetError(f"a message id must be an integer, got {msg_id!r}")
        end = self.last_stable_offset if end is None else min(end, self._log_end_offset)
        for seg in self._segments:
            if seg.count and seg.first_msg_id <= msg_id <= seg.last_msg_id:
                return seg.offset_for_msg_id(int(msg_id), end)
        return None

    def key_indexes(self, lo: int, hi: int) -> list:
        """The key indexes of the segments holding offsets [lo, hi), oldest first (a sealed segment's read
        from its file, or rebuilt, the first time: ``Segment.key_index``). InvalidQueryError for a topic
        without a key index."""
        if not self.config.key_index:
            raise NoKeyIndexError(f"topic {self.topic} keeps no key index (keyIndex=false): lookups by key need "
                                  f"keyIndex=true; lookups by message id need none")
        return [seg.key_index() for seg in self._segments if seg.next_offset > lo and seg.base_offset < hi]

    def position(self, offset: int) -> int:
        """Logical byte position of the batch holding ``offset`` (the segments' end from the visible end on)."""
        self._check_offset(offset)
        segs, _ = self._snapshot(offset)
        visible = self._visible_end
        if offset >= visible:
            return segs[-1].end
        return segment_for(segs, offset).batch_at(offset, visible).position

    def verify(self) -> list:
        """Check every batch of every segment (checksums and offset continuity), that message ids grow with
        offsets, and that each segment's index is the one its batches make; return the problems."""
        problems, last_id = [], -1
        for seg in self._segments:
            try:
                batches, _, _ = scan_segment(seg.fd, seg.path, seg.start, seg.size, seg.base_offset,
                                             lookahead=False, strict=True)
            except CorruptLogError as e:
                problems.append(str(e))
                continue
            if len(batches):  # each batch's first id above the previous batch's last (ids are positive)
                lasts = batches["msg_id"] + batches["count"] - 1
                back = np.flatnonzero(batches["msg_id"] <= np.r_[last_id, lasts[:-1]])
                if len(back):
                    problems.append(f"{seg.path}: message ids go back at offset {int(batches['offset'][back[0]])}; "
                                    f"lookups by message id assume they grow with offsets")
                last_id = int(lasts[-1])
            entries, _ = offset_index.entries_for(batches, seg.start, seg.interval, -1, 0)
            summary = offset_index.summary_of(batches, seg.base_offset, seg.start, seg.size, seg.interval)
            if seg.skew[0] > summary.min_skew or seg.skew[1] < summary.max_skew:
                problems.append(f"{seg.index_path}: its skew bounds {seg.skew} do not hold its messages' "
                                f"({summary.min_skew}, {summary.max_skew}); remove the file and reopen the partition "
                                f"to rebuild it")
                continue
            summary = replace(summary, min_skew=seg.skew[0], max_skew=seg.skew[1])  # wider is sound
            if summary != seg.summary() or not np.array_equal(entries, seg.entries()):
                problems.append(f"{seg.index_path}: the index does not match the log ({seg.summary()} has "
                                f"{len(seg.entries())} entries; the log makes {summary} with {len(entries)}); "
                                f"remove the file and reopen the partition to rebuild it")
                continue  # the key index is checked by walking the log from the offset index's entries
            problem = None if seg.mutable else seg.keys_problem()
            if problem:
                problems.append(f"{seg.keys_path} {problem}; metaq log reindex rebuilds it (or a lookup, when it "
                                f"first needs it)")
        return problems

    def rebuild_key_indexes(self) -> int:
        """Write every sealed segment's key index again from its log (``metaq log reindex``: for an index
        lost or damaged, before the first lookups need it); the tail's is rebuilt at every open. Returns
        the entries written."""
        if not self.config.key_index:
            raise NoKeyIndexError(f"topic {self.topic} keeps no key index (keyIndex=false)")
        with self._write_lock:
            return sum(seg.rebuild_keys().size for seg in self._segments if not seg.mutable)

    # -- retention ------------------------------------------------------------------------------------
    def apply_retention(self, now_ms: Optional[int] = None) -> list:
        """Remove (or archive, then remove) the oldest segments that the delete policy or the size bound
        makes due (``retention.removal_reason``). The active segment is never removed. Returns the
        removed segments' infos."""
        now_ms = int(self._clock() * 1000) if now_ms is None else now_ms
        policy = self.config.delete_policy
        removed = []
        with self._write_lock:
            if self._closed:
                return removed
            segs = list(self._segments)
            total = sum(s.size for s in segs)
            # Never a segment holding an unsettled transaction's batches: its outcome may still be commit.
            while len(segs) > 1 and not segs[0].mutable and segs[0].next_offset <= self.last_stable_offset:
                seg = segs[0]
                reason = removal_reason(seg, total, self.config, now_ms)
                if reason is None:
                    break
                info = SegmentInfo(seg.path, seg.start, seg.size, seg.base_offset, seg.count, seg.last_timestamp,
                                   len(seg.entries()))
                if policy.action == "archive":
                    archive_segment(seg, self.directory / ARCHIVE_DIR)
                segs.pop(0)
                total -= seg.size
                self._segments = tuple(segs)
                _remove_files(seg)
                # Readers holding the segment keep reading the unlinked file; its descriptor closes when
                # the last of them lets go.
                removed.append(info)
                log.info("%s: %s segment %s (offsets %d-%d, %d bytes): %s", self.name,
                         "archived" if policy.action == "archive" else "deleted", seg.path.name,
                         info.base_offset, info.base_offset + info.count - 1, info.size, reason)
            if removed:
                fsync_dir(self.directory)
                self._epochs.trim(self.earliest_offset)
        return removed

    # -- closing --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Let in-flight appends finish, fsync, write the active segment's index and close the files.
        Appends still waiting for group commit are acknowledged by the final fsync."""
        with self._flush_cond:
            self._closing = True
            while self._flush_in_progress:  # a leader's fsync must not see its descriptor closed
                self._flush_cond.wait()
        with self._write_lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._epochs_dirty:
                    self._epochs.save()
                self._save_txns()  # the next open scans nothing
            except OSError:
                log.exception("%s: could not write its transaction snapshot while closing", self.name)
            for seg in self._segments:
                try:
                    seg.close()  # the active segment is sealed: fsynced, index written
                except OSError as e:
                    log.exception("%s: could not fsync %s while closing", self.name, seg.path)
                    self._failed = e
            written = self._log_end_offset
        with self._flush_cond:
            if self._failed is None:
                self._recovery_point = written
                self._publish(written)
            self._flush_cond.notify_all()
        self._wake_readers()


def _skews(body: records.EncodedBody, store_ms: int) -> tuple:
    """(least, greatest) create time - store time of a body's messages stored at ``store_ms`` (0: none has a
    create time; unknown for a body with a create-time column but no range given, e.g. made by hand)."""
    if body.create_times is not None:
        return body.create_times[0] - store_ms, body.create_times[1] - store_ms
    return offset_index.UNKNOWN_SKEW if body.attributes & records.HAS_TIMESTAMPS else (0, 0)


def _remove_files(seg: Segment) -> None:
    """Delete a segment's files (retention, cuts): the log first, so a crash leaves indexes without a log,
    which recovery removes, never a log without its index."""
    seg.removed = True
    seg.path.unlink()
    seg.index_path.unlink(missing_ok=True)
    seg.keys_path.unlink(missing_ok=True)
