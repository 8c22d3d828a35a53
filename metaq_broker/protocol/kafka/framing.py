"""Kafka's framing without I/O: every request and response is a big-endian int32 size, then that many
bytes. ``FrameSplitter`` takes bytes as they arrive and hands out whole frames; a listener feeds it what
``recv`` returned and needs nothing else from the stream."""
from __future__ import annotations

import struct
from typing import Optional

import pyarrow as pa

from metaq_broker.errors import MetaqError
from metaq_broker.protocol.kafka import codes

_SIZE = struct.Struct(">i")
# Kafka's socket.request.max.bytes: the largest request a broker reads
DEFAULT_MAX_FRAME = 100 * 1024 * 1024


class FrameTooLargeError(MetaqError):
    """A declared frame size over the cap, or negative: the stream cannot be trusted past it, so the
    connection is closed (Kafka does the same, naming both sizes)."""

    kafka_code = codes.INVALID_REQUEST

    def __init__(self, size: int, cap: int):
        super().__init__(f"a Kafka request declares {size} bytes; this listener accepts at most {cap} "
                         f"(socket.request.max.bytes)" if size >= 0 else
                         f"a Kafka request declares a negative size ({size}): not a Kafka client?")
        self.size, self.cap = size, cap


class FrameSplitter:
    """Incremental: ``feed(data)`` returns the frames completed by ``data``, in order, as memoryviews of
    the bytes without their size prefix (they stay valid). Bytes held back are at most one partial frame,
    and a declared size over ``max_frame`` raises at once, before its bytes are buffered.

    A partial frame whose size is known (up to ``PRESIZE_MAX``) gets a buffer of its size at once: the
    rest of its bytes are copied there as they come, or read straight into it (``room``, then
    ``received``: no copy at all), instead of growing a buffer chunk by chunk and copying what is left
    over after each frame. That buffer comes from Arrow's memory pool, not zeroed (every byte is received
    before the frame is handed out), and the pool keeps its pages: a ``bytearray`` of a 1 MB request was
    zeroed into fresh pages each time, ~250 page faults a request (benchmarks/bench_kafka.py's broker).
    Larger frames (a client's 100 MB request) grow with their bytes, so a size declared alone allocates no
    more than ``PRESIZE_MAX``."""

    PRESIZE_MAX = 16 << 20

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME):
        self.max_frame = max_frame
        self._buf = bytearray()  # the start of the next frames, none of them whole or sized yet
        self._frame: Optional[memoryview] = None  # the partial frame of known size, without its prefix
        self._filled = 0  # its bytes so far

    @property
    def buffered(self) -> int:
        """Bytes received and not yet handed out (a slow sender's partial frame)."""
        return len(self._buf) + (4 + self._filled if self._frame is not None else 0)

    def room(self) -> Optional[memoryview]:
        """Where the rest of the partial frame goes (read into it, then ``received``), or None."""
        return None if self._frame is None else memoryview(self._frame)[self._filled:]

    def received(self, n: int) -> list:
        """``n`` bytes were read into ``room()``: the frame, once whole."""
        self._filled += n
        if self._filled < len(self._frame):
            return []
        frame, self._frame, self._filled = self._frame, None, 0
        return [memoryview(frame)]

    def feed(self, data) -> list:
        frames = []
        if self._frame is not None:
            k = min(len(data), len(self._frame) - self._filled)
            self._frame[self._filled:self._filled + k] = data[:k]
            frames = self.received(k)
            if k == len(data):
                return frames
            data = data[k:]
        buf = self._buf
        buf += data
        spans, pos, n = [], 0, len(buf)
        while n - pos >= 4:
            size = _SIZE.unpack_from(buf, pos)[0]
            if size < 0 or size > self.max_frame:
                raise FrameTooLargeError(size, self.max_frame)
            if n - pos - 4 < size:
                if size <= self.PRESIZE_MAX:  # the rest of it goes straight into its own buffer
                    self._frame = memoryview(pa.allocate_buffer(size)).cast("B")
                    self._filled = n - pos - 4
                    self._frame[:self._filled] = memoryview(buf)[pos + 4:n]
                    pos = n
                break
            spans.append((pos + 4, pos + 4 + size))
            pos += 4 + size
        if not spans:
            if pos:  # all of it went into the sized frame
                self._buf = bytearray()
            return frames
        # The frames are views of this buffer; the rest moves to a new one, so the views stay valid.
        self._buf = buf[pos:]
        view = memoryview(buf)
        return frames + [view[a:b] for a, b in spans]
