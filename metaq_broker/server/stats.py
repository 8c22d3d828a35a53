"""MetaQ's broker counters (puts, gets, misses, failures, bytes) per topic and partition, and uptime."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, fields


@dataclass
class PartitionCounters:
    puts: int = 0
    put_messages: int = 0
    put_bytes: int = 0
    put_failures: int = 0
    gets: int = 0
    get_messages: int = 0
    get_bytes: int = 0
    get_misses: int = 0
    get_failures: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_put(self, messages: int, nbytes: int) -> None:
        with self._lock:
            self.puts += 1
            self.put_messages += messages
            self.put_bytes += nbytes

    def record_get(self, messages: int, nbytes: int) -> None:
        with self._lock:
            self.gets += 1
            self.get_messages += messages
            self.get_bytes += nbytes
            if not messages:
                self.get_misses += 1

    def record_failure(self, kind: str) -> None:
        with self._lock:
            setattr(self, f"{kind}_failures", getattr(self, f"{kind}_failures") + 1)


@dataclass(frozen=True)
class PartitionStats:
    """One partition's counters at a moment (``BrokerStats.snapshot``), as ``Stats`` answers them."""

    topic: str
    partition: str  # "<brokerId>-<n>"
    puts: int
    put_messages: int
    put_bytes: int
    put_failures: int
    gets: int
    get_messages: int
    get_bytes: int
    get_misses: int
    get_failures: int


class BrokerStats:
    def __init__(self):
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._counters: dict = {}

    def partition(self, topic: str, partition_name: str) -> PartitionCounters:
        key = (topic, partition_name)
        c = self._counters.get(key)
        if c is None:
            with self._lock:
                c = self._counters.setdefault(key, PartitionCounters())
        return c

    def forget_topic(self, topic: str) -> None:
        """A deleted topic's counters go (one created again under the name counts from zero)."""
        with self._lock:
            self._counters = {k: c for k, c in self._counters.items() if k[0] != topic}

    def uptime(self) -> float:
        return time.monotonic() - self.started

    def snapshot(self, topic=None) -> list:
        """``PartitionStats`` of every partition counted (of ``topic`` only, when given)."""
        names = [f.name for f in fields(PartitionCounters) if not f.name.startswith("_")]
        return [PartitionStats(t, p, **{n: getattr(c, n) for n in names})
                for (t, p), c in sorted(self._counters.items()) if topic is None or t == topic]
