"""A partition's leader epochs (Kafka's leader-epoch checkpoint, KIP-101 and KIP-279): which master epoch
wrote which offsets. A replica that rejoins asks the master where its last epoch ends and cuts its log
there, so a tail only it holds (written by a deposed master, never acknowledged to all) cannot survive a
failover (docs/design/replication-plan.md, sections 3 and 6).

``<topic>-<n>/epochs``, little-endian (docs/storage-format.md): bytes 0-8 magic ``MQEPOCH1``, 8-12 u32
entry count, 12-16 u32 CRC-32C of the entries, then one 16-byte entry per epoch: u32 epoch, u32 the
master's replica id, i64 the epoch's first offset (its marker's). Epochs and start offsets strictly
increase. The file is written whole (``durable.replace_file``): at most once per epoch and partition, or on
a truncation. No file, or offsets before its first entry, mean epoch 0: logs written before replication."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from metaq_broker.errors import CorruptLogError
from metaq_broker.protocol import records
from metaq_broker.protocol.records import crc
from metaq_broker.store.durable import replace_file

FILE_NAME = "epochs"
MAGIC = b"MQEPOCH1"
HEADER = struct.Struct("<8sII")  # magic, count, CRC-32C of the entries
ENTRY = struct.Struct("<IIq")  # epoch, master replica id, start offset
MAX_EPOCH = 2 ** 32 - 1


@dataclass(frozen=True)
class Epoch:
    epoch: int
    replica_id: int  # the master that wrote it
    start: int  # its first offset: the epoch marker's


def encode(entries: list) -> bytes:
    body = b"".join(ENTRY.pack(e.epoch, e.replica_id, e.start) for e in entries)
    return HEADER.pack(MAGIC, len(entries), crc(body)) + body


def decode(data: bytes, path: str = FILE_NAME) -> list:
    """The entries of an epochs file; CorruptLogError naming the file and what is wrong (the caller
    rebuilds the file from the log's epoch markers)."""
    if len(data) < HEADER.size:
        raise CorruptLogError(f"{path}: {len(data)} bytes, shorter than the {HEADER.size}-byte header", path, 0)
    magic, count, checksum = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptLogError(f"{path}: not an epochs file (magic {magic!r})", path, 0)
    body = data[HEADER.size:]
    if len(body) != count * ENTRY.size:
        raise CorruptLogError(f"{path}: {count} entries need {count * ENTRY.size} bytes after the header, "
                              f"found {len(body)}", path, HEADER.size)
    if crc(body) != checksum:
        raise CorruptLogError(f"{path}: the entries fail their CRC-32C", path, HEADER.size)
    entries = [Epoch(*ENTRY.unpack_from(body, i * ENTRY.size)) for i in range(count)]
    _check_order(entries, path)
    return entries


def markers(u8: np.ndarray, positions: np.ndarray) -> list:
    """The epochs whose markers are among the batches at ``positions`` of ``u8`` (in log order): one
    vectorised header read, then a step per marker only."""
    if not len(positions):
        return []
    h = records.headers_at(u8, positions)
    value_at = records.data_starts(u8, positions, h)
    found = []
    for i in np.flatnonzero(((h["attributes"] & records.CONTROL) != 0) & (h["txn"] == 0)).tolist():
        at = int(value_at[i])
        parsed = records.parse_epoch_marker(bytes(u8[at: at + records.EPOCH_MARKER.size]))
        if parsed is not None:
            found.append(Epoch(parsed[0], parsed[1], int(h["base_offset"][i])))
    return found


def _check_order(entries: list, path: str) -> None:
    for before, after in zip(entries, entries[1:]):
        if not (after.epoch > before.epoch and after.start > before.start):
            raise CorruptLogError(f"{path}: epoch {after.epoch} at offset {after.start} does not follow epoch "
                                  f"{before.epoch} at offset {before.start} (both must increase)", path)


class EpochFile:
    """The epochs of one partition, in memory and on disk. Callers hold the partition's write lock."""

    def __init__(self, directory, entries: Optional[list] = None):
        self.path = Path(directory) / FILE_NAME
        self.entries: list = list(entries or [])

    @classmethod
    def load(cls, directory) -> "EpochFile":
        """The partition's file; none yet is no epoch but 0. CorruptLogError if it is damaged."""
        path = Path(directory) / FILE_NAME
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return cls(directory)
        return cls(directory, decode(data, str(path)))

    def save(self) -> None:
        replace_file(self.path, encode(self.entries))

    @property
    def latest(self) -> Optional[Epoch]:
        return self.entries[-1] if self.entries else None

    def append(self, epoch: int, replica_id: int, start: int) -> None:
        """Record that ``epoch`` (mastered by ``replica_id``) begins at ``start``, and save. An epoch or a
        start not above the last one is a bug in the caller (ValueError): epochs only grow."""
        if not 0 < epoch <= MAX_EPOCH or replica_id < 0 or start < 0:
            raise ValueError(f"epoch {epoch}, replica {replica_id}, start offset {start}: out of range")
        last = self.latest
        if last is not None and not (epoch > last.epoch and start > last.start):
            raise ValueError(f"epoch {epoch} at offset {start} cannot follow epoch {last.epoch} at offset "
                             f"{last.start}")
        self.entries.append(Epoch(epoch, replica_id, start))
        self.save()

    def add_missing(self, found: list) -> bool:
        """Add the epochs of markers found in the log (``markers``) that follow the last entry: a crash
        between a marker's write and this file's, or markers copied from the master). True when any was
        added; the caller saves then. Older ones are in the file already and pass by."""
        new = []
        for e in found:
            last = new[-1] if new else self.latest
            if last is None or (e.epoch > last.epoch and e.start > last.start):
                new.append(e)
        self.entries.extend(new)
        return bool(new)

    def truncate(self, log_end: int) -> None:
        """Forget epochs that begin at or after ``log_end`` (the log was cut there, or recovery found it
        ends there); saved when anything changed."""
        kept = [e for e in self.entries if e.start < log_end]
        if len(kept) != len(self.entries):
            self.entries = kept
            self.save()

    def trim(self, earliest: int) -> None:
        """Retention removed the offsets below ``earliest``: forget the epochs wholly below it and move the
        start of the one that covers it up to ``earliest`` (Kafka's truncateFromStart); saved when anything
        changed. Without the move, a replica that must start over at ``earliest`` would be told its log
        parts from this one below ``earliest`` (``end_offset_for`` answers that first start) after every
        reset, and never catch up."""
        first = sum(1 for e in self.entries[1:] if e.start <= earliest)
        kept = self.entries[first:]
        if kept and kept[0].start < earliest:
            kept[0] = Epoch(kept[0].epoch, kept[0].replica_id, earliest)
        if kept != self.entries:
            self.entries = kept
            self.save()

    def reset(self, epoch: int, start: int) -> None:
        """The log was emptied and goes on at ``start`` with a batch of ``epoch`` (a replica starting over
        at its master's earliest offset: the epoch that covers it there, whose marker retention removed).
        Epoch 0 leaves no entry. Saved."""
        self.entries = [Epoch(epoch, 0, start)] if epoch > 0 else []
        self.save()

    def epoch_at(self, offset: int) -> int:
        """The epoch that wrote ``offset`` (0 before the first entry)."""
        epoch = 0
        for e in self.entries:
            if e.start > offset:
                break
            epoch = e.epoch
        return epoch

    def end_offset_for(self, epoch: int, log_end: int) -> tuple:
        """(e', end), what a master answers a replica whose last epoch is ``epoch`` (KIP-279): e' is the
        largest epoch this log holds at or below ``epoch``, ``end`` where e' ends here (the next epoch's
        start, or ``log_end``). The replica cuts to min(end, its own log end) if it holds e', else asks
        again with its largest epoch below e'."""
        held, end = 0, self.entries[0].start if self.entries else log_end
        for i, e in enumerate(self.entries):
            if e.epoch > epoch:
                break
            held = e.epoch
            end = self.entries[i + 1].start if i + 1 < len(self.entries) else log_end
        return held, end
