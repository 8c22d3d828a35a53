"""MetaQ byte positions to metaq's logical offsets and back.

A MetaQ consumer counts in bytes: its next position is the one it asked for plus the bytes of the whole
messages it got, in MetaQ's layout (``messages``). metaq keeps with each batch its ``byte_base``: the
position of its first message in the partition's MetaQ stream, where every message (markers and
transactional ones included) occupies its MetaQ size. So a message's position is its batch's
``byte_base`` plus the sizes of the messages before it in the batch, and the map is exact in both
directions for every message start, with no per-message state kept anywhere.

A reader sees only the messages at logical offsets in [log start, last stable offset) that are neither
in a control batch nor in an aborted transaction's batch. A ``get`` at such a message's position is
served; any other position gets ``Moved`` to the next visible position (rounding a position inside a
visible message down to its start, so nothing is skipped), or ``NotFound`` at and beyond the visible end.
A ``value`` reply never spans a hidden message or a gap, so the client's sum of sizes lands on the next
message's position.

The functions work on a *window*: consecutive batches of the partition (``Window``), given by the caller
from its index. It must hold the batch of the position asked for, or, when no batch holds it (below the
log start, or between two batches), the first batch after it. A search for the next visible message that runs off the
window's end answers ``Moved`` to the window's end: a batch start, from which the client's next ``get``
continues (so long hidden ranges cost a 301 per window, never an unbounded scan).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class Serve:
    """Send the messages at logical offsets [offset, offset + count), which start at byte ``position``
    and take ``nbytes``; ``count`` 0: the first message alone exceeds the size asked for, and MetaQ sends
    its first ``nbytes`` (= maxSize) bytes, a partial message, so the client doubles its maxSize."""
    offset: int
    count: int
    position: int
    nbytes: int


@dataclass(frozen=True)
class Moved:
    """Answer 301 with ``position``."""
    position: int


@dataclass(frozen=True)
class NotFound:
    """Answer 404: nothing at that position yet."""


Answer = Union[Serve, Moved, NotFound]


class Window:
    """Consecutive batches of one partition: per batch ``base_offset``, ``byte_base``, ``counts`` and
    ``hidden`` (a control batch or an aborted transaction's), and every message's MetaQ size in
    ``sizes``. Per-message positions and offsets are computed with numpy, once."""

    def __init__(self, base_offset, byte_base, counts, sizes, hidden=None):
        self.base_offset = np.asarray(base_offset, dtype=np.int64)
        self.byte_base = np.asarray(byte_base, dtype=np.int64)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        nb = len(self.base_offset)
        self.hidden = np.zeros(nb, bool) if hidden is None else np.asarray(hidden, dtype=bool)
        if not (len(self.byte_base) == len(self.counts) == len(self.hidden) == nb) or nb == 0:
            raise ValueError("a window needs at least one batch, and one entry per batch in every array")
        if (self.counts < 1).any() or int(self.counts.sum()) != len(self.sizes) or (self.sizes < 20).any():
            raise ValueError("counts must be positive and add up to the number of sizes; sizes are at least 20")
        if (np.diff(self.base_offset) != self.counts[:-1]).any():
            raise ValueError("batches must be consecutive: each base offset is the previous one plus its count")
        first = np.cumsum(self.counts) - self.counts
        batch = np.repeat(np.arange(nb), self.counts)
        within = np.cumsum(self.sizes) - self.sizes
        self.starts = self.byte_base[batch] + within - within[first][batch]
        self.offsets = self.base_offset[batch] + np.arange(len(self.sizes)) - first[batch]
        self.ends = self.starts + self.sizes
        if (np.diff(self.starts) < self.sizes[:-1]).any():
            raise ValueError("batches overlap in the byte stream: each byte_base must be at or after the "
                             "previous batch's end")
        self._batch = batch

    @property
    def first_offset(self) -> int:
        return int(self.base_offset[0])

    @property
    def end_offset(self) -> int:
        return int(self.offsets[-1]) + 1

    @property
    def start_position(self) -> int:
        return int(self.starts[0])

    @property
    def end_position(self) -> int:
        """The byte after the window's last message."""
        return int(self.ends[-1])

    def position_of(self, offset: int) -> int:
        """The byte position of logical ``offset`` (``end_offset``: the window's end position)."""
        if offset == self.end_offset:
            return self.end_position
        i = offset - self.first_offset
        if not 0 <= i < len(self.sizes):
            raise ValueError(f"offset {offset} is outside the window [{self.first_offset}, {self.end_offset}]")
        return int(self.starts[i])

    def offset_of(self, position: int) -> Optional[int]:
        """The logical offset of the message starting exactly at ``position``; None for any other position."""
        i = int(np.searchsorted(self.starts, position))
        return int(self.offsets[i]) if i < len(self.starts) and self.starts[i] == position else None

    def visible(self, log_start: int, last_stable: int, lo: int = 0, hi: Optional[int] = None) -> np.ndarray:
        """Which of messages [lo, hi) a reader sees (only the slice is computed: answers stay O(reply))."""
        o = self.offsets[lo:hi]
        return ~self.hidden[self._batch[lo:hi]] & (o >= log_start) & (o < last_stable)


def answer_get(w: Window, position: int, max_bytes: int, log_start: int, last_stable: int,
               visible_end: int, tell_max: bool = False) -> Answer:
    """How to answer ``get`` at byte ``position`` with at most ``max_bytes`` (> 0) bytes.

    ``log_start`` and ``last_stable`` bound the readable logical offsets; ``visible_end`` is the byte
    position of ``last_stable`` (the MetaQ "max offset"). At or beyond it: NotFound, or, beyond it with
    ``tell_max`` (MetaQ's updateConsumerOffsets) or at Long.MAX_VALUE (alwaysConsumeFromMaxOffset),
    Moved to it."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if position >= visible_end:
        if position > visible_end and (tell_max or position == INT64_MAX):
            return Moved(visible_end)
        return NotFound()
    i = _first_candidate(w, position)
    if w.starts[i] == position and w.visible(log_start, last_stable, i, i + 1)[0]:
        return _serve(w, i, max_bytes, log_start, last_stable)
    return Moved(_next_visible(w, i, log_start, last_stable, visible_end))


def nearest_position(w: Window, position: int, log_start: int, last_stable: int, visible_end: int) -> int:
    """The answer to ``offset``: ``position`` itself when a visible message starts there, else where a
    ``get`` would be moved to, clamped to ``visible_end``."""
    if position >= visible_end:
        return visible_end
    i = _first_candidate(w, position)
    if w.starts[i] == position and w.visible(log_start, last_stable, i, i + 1)[0]:
        return position
    return _next_visible(w, i, log_start, last_stable, visible_end)


def _first_candidate(w: Window, position: int) -> int:
    """Index of the message holding ``position``, or of the next message when none does (a position
    below the window is the caller's promise that nothing readable lies between it and the window)."""
    if position >= w.end_position:
        raise ValueError(f"position {position} lies after the window's end {w.end_position} but before the "
                         f"visible end: the window must hold its batch")
    return int(np.searchsorted(w.ends, position, side="right"))


def _next_visible(w: Window, i: int, log_start: int, last_stable: int, visible_end: int) -> int:
    """The position of the first visible message at index ``i`` or later, looked for in growing
    slices; the window's end (or the visible end, if sooner) when there is none in the window."""
    step = 64
    while i < len(w.sizes):
        later = np.flatnonzero(w.visible(log_start, last_stable, i, i + step))
        if len(later):
            return int(w.starts[i + later[0]])
        i, step = i + step, step * 4
    return min(w.end_position, visible_end)


def _serve(w: Window, i: int, max_bytes: int, log_start: int, last_stable: int) -> Serve:
    """Messages from index ``i`` while visible, contiguous in bytes and within ``max_bytes``."""
    hi = max(int(np.searchsorted(w.ends, w.starts[i] + max_bytes, side="right")), i + 1)  # all that could fit
    run = w.visible(log_start, last_stable, i + 1, hi) & (w.starts[i + 1: hi] == w.ends[i: hi - 1])
    stop = np.flatnonzero(~run)
    k = i + 1 + (int(stop[0]) if len(stop) else len(run))  # messages [i, k) are one contiguous visible run
    fits = int(np.searchsorted(w.ends[i:k] - w.starts[i], max_bytes, side="right"))
    if fits == 0:
        return Serve(int(w.offsets[i]), 0, int(w.starts[i]), max_bytes)
    j = i + fits
    return Serve(int(w.offsets[i]), fits, int(w.starts[i]), int(w.ends[j - 1] - w.starts[i]))
