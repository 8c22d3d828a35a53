"""Kafka's framing without I/O: every request and response is a big-endian int32 size, then that many
bytes. ``FrameSplitter`` takes bytes as they arrive and hands out whole frames; a listener feeds it what
``recv`` returned and needs nothing else from the stream."""
from __future__ import annotations

import struct

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
    the bytes without their size prefix (no copy; they stay valid). Bytes held back are at most one
    partial frame, and a declared size over ``max_frame`` raises at once, before its bytes are buffered."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME):
        self.max_frame = max_frame
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes received and not yet handed out (a slow sender's partial frame)."""
        return len(self._buf)

    def feed(self, data) -> list:
        buf = self._buf
        buf += data
        frames, pos, n = [], 0, len(buf)
        while n - pos >= 4:
            size = _SIZE.unpack_from(buf, pos)[0]
            if size < 0 or size > self.max_frame:
                raise FrameTooLargeError(size, self.max_frame)
            if n - pos - 4 < size:
                break
            frames.append((pos + 4, pos + 4 + size))
            pos += 4 + size
        if not frames:
            return []
        # The frames are views of this buffer; the rest moves to a new one, so the views stay valid.
        self._buf = bytearray(buf[pos:])
        view = memoryview(buf)
        return [view[a:b] for a, b in frames]
