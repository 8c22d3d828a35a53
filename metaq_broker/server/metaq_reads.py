"""MetaQ ``get`` and ``offset`` answers from a partition's log: byte positions to logical offsets and back.

A MetaQ consumer asks for a byte position (docs/metaq-protocol.md, "Offsets"). The batch holding it is
found from the position (``Positions.offset_at``: the end of the last reply served, remembered per
partition, answers a consumer reading on in one dictionary look-up; any other position a binary search
over offsets, ``metaq_positions.offset_at``, a batch read per step); the store's read from there gives the
whole batches of a ``Window`` (``protocol/metaq/offsets.py``: every message's position from its batch's
``byte_base`` and the MetaQ sizes, computed with numpy per batch), ``answer_get`` says what to send, and
``encode_message_set`` turns the served offsets' decoded columns into MetaQ's layout. Nothing here loops
in Python per message (but for ``zlib.crc32``, one call per message, in ``encode_message_set``).

Lock order: ``Positions._lock`` alone (the remembered positions); nothing is taken under it."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

import numpy as np

from metaq_broker.protocol import records
from metaq_broker.protocol.metaq import offsets as mq_offsets
from metaq_broker.protocol.metaq.messages import encode_message_set
from metaq_broker.server import metaq_positions

REMEMBERED = 4096  # reply ends remembered (position -> offset), over all partitions


class Positions:
    """Where reply ends lie: (topic, partition, log identity, position) -> logical offset, most recent kept."""

    def __init__(self, size: int = REMEMBERED):
        self._ends: OrderedDict = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def remember(self, part, position: int, offset: int) -> None:
        key = (part.topic, part.partition, part.identity, position)
        with self._lock:
            self._ends[key] = offset
            self._ends.move_to_end(key)
            while len(self._ends) > self._size:
                self._ends.popitem(last=False)

    def offset_at(self, part, position: int) -> int:
        """The logical offset of the message holding ``position`` (or the next one), clamped to
        [log start, last stable offset]."""
        with self._lock:
            offset = self._ends.get((part.topic, part.partition, part.identity, position))
        if offset is not None and part.earliest_offset <= offset <= part.last_stable_offset:
            return offset
        return metaq_positions.offset_at(part, -1, position)


def window(part, result) -> Optional[mq_offsets.Window]:
    """The ``Window`` of a store read's whole batches (``FetchResult``); None when it holds none."""
    u8 = result.data
    if not len(u8):
        return None
    positions = result.batch_positions
    _, counts, _, _, metaq_bytes, byte_base = records.index_columns(u8, positions)
    base_offsets = records.headers_at(u8, positions)["base_offset"].astype(np.int64)
    if byte_base[0] < 0:  # a version 2 batch first: where it lies is found in its segment
        anchor = metaq_positions.version2_start(part, int(base_offsets[0]))
    else:
        anchor = int(byte_base[0])
    starts = records.stream_ends(byte_base, metaq_bytes, anchor) - metaq_bytes
    shown = records.committed_positions(u8, positions, result.aborted)
    hidden = ~np.isin(positions, shown)
    return mq_offsets.Window(base_offsets, starts, counts, records.metaq_message_sizes(u8, positions), hidden)


def at_end(position: int, end: int) -> mq_offsets.Answer:
    """``get`` at or beyond the visible end ``end``: 404, but 301 to it from Long.MAX_VALUE (MetaQ's
    alwaysConsumeFromMaxOffset)."""
    return mq_offsets.Moved(end) if position == mq_offsets.INT64_MAX else mq_offsets.NotFound()


def visible_end(part, last_stable: int) -> int:
    """The byte position of the last stable offset: MetaQ's "max offset" for readers."""
    return metaq_positions.stream_position(part, last_stable)


def message_set(result, served: mq_offsets.Serve) -> bytes:
    """The bytes of a ``Serve`` answer from the read that holds its offsets."""
    count = served.count or 1
    rows = records.decode(result.data, served.offset, served.offset + count, verify=True,
                          aborted=result.aborted)
    if rows.num_rows != count:
        raise ValueError(f"offsets {served.offset}..{served.offset + count - 1} decode to {rows.num_rows} messages")
    out = encode_message_set(rows.column("value"), rows.column("attribute"),
                             rows.column("flag").to_numpy(zero_copy_only=False),
                             rows.column("msgId").to_numpy(zero_copy_only=False))
    if served.count and len(out) != served.nbytes:
        raise ValueError(f"offsets {served.offset}..{served.offset + count - 1} encode to {len(out)} bytes, their "
                         f"positions say {served.nbytes}")
    return out.to_pybytes()[:served.nbytes]
