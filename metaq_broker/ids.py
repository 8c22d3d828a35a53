"""Broker-unique 64-bit message ids, handed out in contiguous ranges (one range per appended batch).

An id is (milliseconds since 2020-01-01) << 20, plus a sequence; the allocator never goes below the
last id it handed out or saw on disk, so ids stay unique and increasing across restarts and clock steps.
A batch stores only its first id; message i of the batch has id base + i."""
import threading
import time

EPOCH_MS = 1_577_836_800_000  # 2020-01-01T00:00:00Z
SEQUENCE_BITS = 20


class MessageIdAllocator:
    def __init__(self, last_id: int = 0, clock=time.time):
        self._last = last_id
        self._clock = clock
        self._lock = threading.Lock()

    def observe(self, last_id: int) -> None:
        """Account for an id already used (found on disk at open)."""
        with self._lock:
            self._last = max(self._last, last_id)

    def allocate(self, count: int) -> int:
        """Reserve ``count`` consecutive ids and return the first."""
        with self._lock:
            time_based = (int(self._clock() * 1000) - EPOCH_MS) << SEQUENCE_BITS
            base = max(self._last + 1, time_based)
            self._last = base + count - 1
            return base
