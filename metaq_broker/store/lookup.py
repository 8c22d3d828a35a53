"""Finding messages without reading the partition: by key through the segments' key indexes
(``keyindex``), by message id through the offset index, within a store-time range through the time index.

Answers are what a reader would get: a read_committed reader's (below the last stable offset) or, with
``read_uncommitted``, also the messages of open transactions (below the visible end and a replicated
group's high watermark); an aborted transaction's messages and markers never. A key index names
candidates by a 32-bit hash; each is read from the log (its whole batch, decoded once for all the
candidates in it) and kept only if its real key is the one asked for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa

from metaq_broker.errors import InvalidQueryError, OffsetOutOfRangeError
from metaq_broker.protocol import records
from metaq_broker.store import keyindex

SCHEMA = records.schema(headers=True, timestamp_type=True)  # a lookup's rows: a fetch's, with record headers
DEFAULT_MAX_ANSWERS = keyindex.DEFAULT_MAX_ANSWERS


@dataclass(frozen=True)
class Found:
    """One partition's answers, newest first: the messages (``SCHEMA``) and each one's store time, ms
    (what time ranges are in, and what orders answers across partitions)."""

    batch: pa.RecordBatch
    store_ms: tuple

    @property
    def offsets(self) -> list:
        return self.batch.column("offset").to_pylist()


def read_end(log, read_uncommitted: bool) -> int:
    """Where a reader's view ends: the last stable offset, or for read_uncommitted the visible end capped
    by the high watermark (open transactions included, as Kafka's read_uncommitted)."""
    if not read_uncommitted:
        return log.last_stable_offset
    visible, hw = log.visible_end, log.high_watermark  # in this order: the cap is never below what it caps
    return visible if hw is None else min(visible, hw)


class _Rows:
    """Messages of one partition read from its log by offset, a whole batch at a time, each batch read
    and decoded once (checksums verified, aborted transactions and markers left out)."""

    def __init__(self, log, end: int):
        self.log, self.end = log, end
        self._batches = []  # (first offset, next offset, decoded, its offsets, store time)

    def row(self, offset: int) -> Optional[tuple]:
        """(decoded batch, row, store time) of the message at ``offset``; None when a reader would not get
        it (aborted, a marker, gone by retention meanwhile)."""
        for first, after, batch, offsets, store_ms in self._batches:
            if first <= offset < after:
                break
        else:
            try:
                r = self.log.read(offset, 1, 1, end=self.end)
            except OffsetOutOfRangeError:
                return None
            h = records.parse_header(r.data, 0)
            first, after, store_ms = h.base_offset, h.base_offset + h.count, h.timestamp
            batch = records.decode(r.data, verify=True, aborted=self.log.aborted_in(first, after), headers=True,
                                   timestamp_type=True)
            offsets = batch.column("offset").to_numpy()
            self._batches.append((first, after, batch, offsets, store_ms))
        i = int(np.searchsorted(offsets, offset))
        return (batch, i, store_ms) if i < len(offsets) and offsets[i] == offset else None

    def keys(self, offsets: list) -> list:
        """The keys at ``offsets`` (None where a reader gets no message): ``keyindex.lookup``'s check."""
        out = []
        for offset in offsets:
            found = self.row(offset)
            out.append(None if found is None else found[0].column("key")[found[1]].as_py())
        return out

    def found(self, offsets: list) -> Found:
        rows = [self.row(o) for o in offsets]
        rows = [r for r in rows if r is not None]
        if not rows:
            return Found(records.empty_batch(headers=True, timestamp_type=True), ())
        return Found(pa.concat_batches([batch.slice(i, 1) for batch, i, _ in rows]), tuple(ms for _, _, ms in rows))


def by_key(log, key: bytes, since_ms: Optional[int] = None, until_ms: Optional[int] = None,
           max_answers: int = DEFAULT_MAX_ANSWERS, read_uncommitted: bool = False, first: Optional[int] = None,
           before: Optional[int] = None) -> Found:
    """The messages of partition ``log`` whose key is ``key``, stored in [since_ms, until_ms] (either
    open), at offsets from ``first`` and below ``before`` when given (a Spark task's range; a lookup going
    on after a reply that had to stop), newest first, at most ``max_answers``. NoKeyIndexError for a topic without a key index; InvalidQueryError for
    a key that is not bytes, a time range that ends before it starts, a count that is not positive."""
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidQueryError(f"a key is bytes, got {type(key).__name__}")
    end = read_end(log, read_uncommitted)
    lo, hi = keyindex.offset_range(since_ms, until_ms, lambda t: log.offset_for_timestamp(t, end),
                                   log.earliest_offset, end)
    if first is not None:
        lo = max(lo, int(first))
    if before is not None:
        hi = min(hi, int(before))
    hi = max(lo, hi)
    rows = _Rows(log, end)
    answers = keyindex.lookup(log.key_indexes(lo, hi), bytes(key), lo, hi, rows.keys, max_answers)
    return rows.found(answers)


def by_msg_id(log, msg_id: int, read_uncommitted: bool = False, first: Optional[int] = None,
              before: Optional[int] = None) -> Found:
    """The message of partition ``log`` with id ``msg_id``: exactly one or none (ids are unique in a
    broker's partitions); at an offset in [first, before) when given."""
    end = read_end(log, read_uncommitted)
    offset = log.offset_for_msg_id(msg_id, end)
    if offset is not None and not ((first is None or offset >= first) and (before is None or offset < before)):
        offset = None
    rows = _Rows(log, end)
    return rows.found([] if offset is None else [offset])
