"""Where a logical offset lies in a partition's MetaQ message stream, and back, read from the store
(docs/storage-format.md, section 3.5; docs/metaq-protocol.md, Offsets).

A message's MetaQ position is its batch's ``byte_base`` plus the MetaQ sizes of the messages before it in
the batch; a version 2 batch (no ``byte_base``) lies where the batch before it in its segment ends, the
segment's first at 3 x the segment's start. A MetaQ consumer's committed ``<msgId>-<position>`` names the
last message it got and the position after it, so the way back tries that message first; otherwise (or
when the position is not the one after it) a binary search over offsets, one batch read per step.

For the offset bridge (``offset_bridge.py``), not a hot path: each call reads a batch or two (a version 2
batch: its segment up to it, in chunks). The MetaQ listener's byte index will answer the same questions
from the offset index."""
from __future__ import annotations

from typing import Optional

import numpy as np

from metaq_broker.errors import OffsetOutOfRangeError
from metaq_broker.protocol import records

CHUNK_BYTES = 8 << 20  # a version 2 segment is read this much at a time


def position_of(part, offset: int) -> tuple:
    """(MetaQ position of logical ``offset``, id of the message before it or -1): where a MetaQ consumer
    resumes to read ``offset`` next. ``offset`` is clamped to [log start, log end]."""
    offset = max(int(offset), part.earliest_offset)
    return stream_position(part, offset), _msg_id(part, offset - 1) if offset > part.earliest_offset else -1


def stream_position(part, offset: int) -> int:
    """``position_of`` without the id (one read less: the put path asks this once per batch it stores)."""
    offset = max(int(offset), part.earliest_offset)
    end_position = part.metaq_end  # read before the batch: an empty read below means no batch at ``offset`` yet
    try:
        batch = _batch_holding(part, offset)
    except OffsetOutOfRangeError:
        batch = None
    if batch is None:
        return end_position
    start, u8, header = batch
    if offset == header.base_offset:  # a batch's first message: no sizes to add
        return start
    return start + int(records.metaq_message_sizes(u8, np.zeros(1, np.int64))[: offset - header.base_offset].sum())


def offset_at(part, msg_id: int, position: int) -> int:
    """The logical offset a MetaQ consumer's ``<msgId>-<position>`` resumes at: after message ``msg_id`` when
    ``position`` is right after it, else the message holding ``position`` (the one starting there, or the
    one it falls in: nothing is skipped), the log start below it, the last stable offset beyond it."""
    if msg_id >= 0:
        found = part.offset_for_msg_id(msg_id)
        if found is not None and stream_position(part, found + 1) == position:
            return found + 1
    lo, hi = part.earliest_offset, part.last_stable_offset
    if position >= stream_position(part, hi):
        return hi
    while lo < hi:  # the last offset whose position is <= ``position`` (lo's is, or lo is the log start)
        mid = (lo + hi + 1) // 2
        if stream_position(part, mid) <= position:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _batch_holding(part, offset: int) -> Optional[tuple]:
    """(MetaQ position of its first message, its bytes, its header) of the batch holding ``offset``, settled
    or not; None at the log end."""
    r = part.read(offset, 1, end=offset + 1)
    if not len(r.data):
        return None
    u8 = r.data
    header = records.parse_header(u8, 0)
    start = header.byte_base if header.byte_base >= 0 else version2_start(part, header.base_offset)
    return start, u8, header


def version2_start(part, base_offset: int) -> int:
    """Where the version 2 batch at ``base_offset`` starts in the MetaQ stream: its segment's batches from
    the first, each where the one before ends, the first at 3 x the segment's start."""
    seg = next(s for s in reversed(part.segments()) if s.base_offset <= base_offset)
    anchor, offset = 3 * seg.start, seg.base_offset
    while True:
        r = part.read(offset, CHUNK_BYTES, end=base_offset + 1)
        positions = r.batch_positions
        _, counts, _, _, metaq, byte_base = records.index_columns(r.data, positions)
        ends = records.stream_ends(byte_base, metaq, anchor)
        firsts = offset + np.cumsum(counts) - counts
        hit = np.flatnonzero(firsts == base_offset)
        if len(hit):
            return int(ends[hit[0]] - metaq[hit[0]])
        anchor, offset = int(ends[-1]), r.end_offset


def _msg_id(part, offset: int) -> int:
    """The id of the message at ``offset`` (-1 when there is none)."""
    try:
        r = part.read(offset, 1, end=offset + 1)
    except OffsetOutOfRangeError:
        return -1
    if not len(r.data):
        return -1
    header = records.parse_header(r.data, 0)
    return header.base_msg_id + offset - header.base_offset
