"""A partition's idempotent producers (Kafka's ProducerStateManager): for each producer id its epoch and the
sequence numbers, offsets and ids of its last ``MAX_BATCHES`` batches here, so that a batch sent again after
a lost answer is answered with the offsets it got the first time instead of being stored twice.

The state lives in memory and is rebuilt from the log: ``producers.snapshot`` (written with the transaction
snapshot: at a roll, on open and on close) holds it as of an offset, and recovery scans the batch headers
after it (the same header scan that rebuilds transaction state). A replica takes in the batches it copies,
so a new master deduplicates a batch its predecessor stored. Version 2 batches and batches without a
producer id (transactions, markers, non-idempotent producers) carry nothing here.

Rules (Kafka 3's, KIP-360 included): a producer this partition has no state for may start at any sequence
(its state may have expired); a higher epoch starts at sequence 0 and fences the lower ones; within an
epoch, a batch equal to a retained one is a duplicate, the next sequence is appended, anything else is
out of order. Producers idle longer than ``producer.id.expiration.ms`` (the batch store times, default one
day as in Kafka) are forgotten at the next snapshot and when looked up."""
from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

from metaq_broker.errors import CorruptLogError, DuplicateSequenceError, OutOfOrderSequenceError, ProducerFencedError
from metaq_broker.protocol import records
from metaq_broker.store.durable import replace_file

log = logging.getLogger(__name__)

SNAPSHOT = "producers.snapshot"
MAX_BATCHES = 5  # batches remembered per producer and partition, as Kafka (max.in.flight.requests)
SEQUENCE_SPAN = 1 << 31  # sequences are i32 and wrap to 0 after 2^31 - 1, as Kafka's
DEFAULT_EXPIRATION_MS = 86_400_000  # producer.id.expiration.ms


class Stored(NamedTuple):
    """A batch an idempotent producer stored here: its sequences and where it landed."""

    first_seq: int
    last_seq: int
    base_offset: int
    count: int
    base_msg_id: int
    timestamp: int


@dataclass
class _Producer:
    epoch: int
    batches: deque  # of Stored, oldest first, at most MAX_BATCHES
    last_timestamp: int


def last_sequence(first: int, count: int) -> int:
    return (first + count - 1) % SEQUENCE_SPAN


class ProducerStates:
    """The idempotent producers of one partition (callers hold the partition's write lock)."""

    def __init__(self, name: str, expiration_ms: int = DEFAULT_EXPIRATION_MS):
        self.name = name
        self.expiration_ms = expiration_ms
        self._producers: dict = {}  # producer id -> _Producer

    def __len__(self) -> int:
        return len(self._producers)

    def ids(self) -> list:
        """The producer ids this partition keeps state for."""
        return list(self._producers)

    def entry(self, producer_id: int) -> Optional[tuple]:
        """(epoch, [Stored, ...]) of a producer, or None (for tests and the console)."""
        p = self._producers.get(producer_id)
        return None if p is None else (p.epoch, list(p.batches))

    def check(self, producer_id: int, epoch: int, first_seq: int, count: int, now_ms: int) -> Optional[Stored]:
        """Before appending a producer's batch: the batch it duplicates (answer with its offsets, append
        nothing), or None (append it). ProducerFencedError for an older epoch, OutOfOrderSequenceError for
        a gap, DuplicateSequenceError for a batch older than those retained: each names the producer, the
        partition and the sequences."""
        p = self._producers.get(producer_id)
        if p is not None and now_ms - p.last_timestamp > self.expiration_ms:
            del self._producers[producer_id]  # expired: as if never seen
            p = None
        if p is None:
            return None
        who = f"producer {producer_id} (epoch {epoch}) in partition {self.name}"
        if epoch < p.epoch:
            raise ProducerFencedError(f"{who}: epoch {p.epoch} of this producer id has written here since, so "
                                      f"epoch {epoch} is fenced (a newer producer took this id over)")
        if epoch > p.epoch:
            if first_seq != 0:
                raise OutOfOrderSequenceError(f"{who}: a new epoch starts at sequence 0, got {first_seq}")
            return None
        last = last_sequence(first_seq, count)
        for b in p.batches:
            if b.first_seq == first_seq and b.last_seq == last:
                return b
        expected = (p.batches[-1].last_seq + 1) % SEQUENCE_SPAN
        if first_seq == expected:
            return None
        oldest = p.batches[0].first_seq
        if _before(first_seq, oldest):
            raise DuplicateSequenceError(f"{who}: sequences {first_seq}-{last} were stored before the "
                                         f"{MAX_BATCHES} batches kept here (from sequence {oldest}); their offsets "
                                         f"are no longer known")
        raise OutOfOrderSequenceError(f"{who}: got sequences {first_seq}-{last}, expected {expected} next (the "
                                      f"last stored is {p.batches[-1].last_seq})")

    def on_batch(self, producer_id: int, epoch: int, stored: Stored) -> None:
        """Take in a batch of this producer written at ``stored`` (an append, a replica's copy, a scan)."""
        p = self._producers.get(producer_id)
        if p is None or epoch > p.epoch:
            p = self._producers[producer_id] = _Producer(epoch, deque(maxlen=MAX_BATCHES), stored.timestamp)
        elif epoch < p.epoch:
            return  # a fenced epoch's batch (only a copy of another log could hold one): nothing to keep
        p.batches.append(stored)
        p.last_timestamp = max(p.last_timestamp, stored.timestamp)

    def scan(self, u8: np.ndarray, positions: np.ndarray) -> None:
        """Take in the batches at ``positions`` of ``u8`` (in log order): one vectorised header read, then a
        step per batch of an idempotent producer."""
        if not len(positions):
            return
        h = records.headers_at(u8, positions)
        v3 = records.v3_fields(u8, positions, h)
        for i in np.flatnonzero((v3["producer_id"] >= 0) & ((h["attributes"] & records.CONTROL) == 0)).tolist():
            count, seq = int(h["count"][i]), int(v3["base_sequence"][i])
            self.on_batch(int(v3["producer_id"][i]), int(v3["producer_epoch"][i]),
                          Stored(seq, last_sequence(seq, count), int(h["base_offset"][i]), count,
                                 int(h["base_msg_id"][i]), int(h["timestamp"][i])))

    def expire(self, now_ms: int) -> None:
        for pid in [pid for pid, p in self._producers.items() if now_ms - p.last_timestamp > self.expiration_ms]:
            del self._producers[pid]

    def truncate(self, end: int) -> None:
        """Forget batches at or past ``end`` (a cut log); producers left with none are forgotten."""
        for pid, p in list(self._producers.items()):
            kept = [b for b in p.batches if b.base_offset < end]
            if not kept:
                del self._producers[pid]
            elif len(kept) != len(p.batches):
                p.batches = deque(kept, maxlen=MAX_BATCHES)

    # -- the snapshot file ----------------------------------------------------------------------------
    def load(self, directory: Path) -> Optional[int]:
        """Read ``producers.snapshot``; the offset from which the log must be scanned (None: no file)."""
        path = Path(directory) / SNAPSHOT
        if not path.exists():
            return None
        raw = path.read_bytes()
        try:
            crc, body = int(raw[:8], 16), raw[9:]
            if records.crc(body) != crc:
                raise ValueError("checksum mismatch")
            m = json.loads(body)
            producers = {}
            for pid, epoch, last_ts, batches in m["producers"]:
                producers[int(pid)] = _Producer(int(epoch), deque((Stored(*map(int, b)) for b in batches),
                                                                  maxlen=MAX_BATCHES), int(last_ts))
            offset = int(m["offset"])
        except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CorruptLogError(f"{path}: unreadable ({e}); delete it to rebuild the producers' state from the "
                                  f"log's active segment (older batches' producers are then forgotten)", path, 0) from None
        self._producers = producers
        return offset

    def save(self, directory: Path, offset: int, now_ms: int) -> None:
        """Write the state as of ``offset`` (every batch below it taken in), expired producers left out.
        Atomic and fsynced."""
        self.expire(now_ms)
        body = json.dumps({"offset": offset, "producers": [
            [pid, p.epoch, p.last_timestamp, [list(b) for b in p.batches]]
            for pid, p in sorted(self._producers.items())]}).encode()
        replace_file(Path(directory) / SNAPSHOT, b"%08x\n" % records.crc(body) + body)


def _before(a: int, b: int) -> bool:
    """Sequence ``a`` comes before ``b`` (within half the sequence space, so wrapping works)."""
    return 0 < (b - a) % SEQUENCE_SPAN < SEQUENCE_SPAN // 2
