"""The broker's storage facade (MetaQ's MessageStoreManager): topics and their partitions under one
data directory, one message-id allocator for the broker, and a background thread for timed flushes
(``unflushInterval``) and retention."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from metaq_broker.errors import InvalidPartitionError, InvalidTopicError, StoreClosedError, UnknownTopicError
from metaq_broker.ids import MessageIdAllocator
from metaq_broker.store.config import TopicConfig, validate_topic_name
from metaq_broker.store.durable import finish_removals, make_dirs, remove_dir
from metaq_broker.store.partition import AppendResult, FetchResult, PartitionLog

TRANSACTIONS_DIRECTORY = "transactions"  # the broker's transaction journal lives beside the partitions

log = logging.getLogger(__name__)


class MessageStore:
    """All partitions of all topics under ``data_path`` (``<data_path>/<topic>-<n>/``).

    ``topics`` configures topics (creating missing partitions); topics found on disk but not configured
    are opened with ``default_config`` so that no stored data is ever hidden."""

    def __init__(self, data_path, topics: Optional[Mapping[str, TopicConfig]] = None,
                 default_config: TopicConfig = TopicConfig(), clock=time.time,
                 background_interval: Optional[float] = 1.0, retention_interval: float = 300.0,
                 repair: bool = False):
        self.data_path = Path(data_path)
        make_dirs(self.data_path)
        self.default_config = default_config
        self._clock = clock
        self._repair = repair
        self._ids = MessageIdAllocator(clock=clock)
        self._lock = threading.RLock()
        self._configs: dict = {}
        self._partitions: dict = {}
        self._closed = False
        self._epoch: Optional[tuple] = None  # (epoch, replica id) of begin_epoch: topics created later too
        self._written = 0  # bumped on every append anywhere (wait_written)
        self._written_cond = threading.Condition()
        for name in finish_removals(self.data_path):  # a topic's deletion cut short by a crash: finished
            log.warning("removed %s: a deleted topic's partition whose removal a stop or crash cut short", name)
        on_disk: dict = {}
        for entry in sorted(self.data_path.iterdir()):
            if not entry.is_dir() or entry.name == TRANSACTIONS_DIRECTORY:
                continue
            topic, sep, num = entry.name.rpartition("-")
            if not sep or not num.isdigit() or str(int(num)) != num:
                log.warning("ignoring %s in the data directory: not a <topic>-<partition> directory", entry)
                continue
            try:
                validate_topic_name(topic)
            except InvalidTopicError as e:
                log.warning("ignoring %s: %s", entry, e)
                continue
            on_disk.setdefault(topic, set()).add(int(num))
        topics = dict(topics or {})
        for topic in topics:  # check every name before creating anything
            validate_topic_name(topic)
        for topic, config in topics.items():
            self._open_topic(topic, config, on_disk.pop(topic, set()))
        for topic, parts in on_disk.items():
            self._open_topic(topic, default_config, parts)
        self._stop = threading.Event()
        self._retention_interval = retention_interval
        self._thread = None
        if background_interval:
            self._thread = threading.Thread(target=self._background, args=(background_interval,),
                                            name="metaq-store-maintenance", daemon=True)
            self._thread.start()

    def _open_topic(self, topic: str, config: TopicConfig, existing: set) -> None:
        count = max([config.num_partitions] + [p + 1 for p in existing])
        if count != config.num_partitions:
            log.warning("topic %s has %d partitions on disk, more than num_partitions=%d; keeping them all",
                        topic, count, config.num_partitions)
            config = config.with_(num_partitions=count)
        for p in range(count):
            self._partitions[(topic, p)] = self._open_partition(topic, p, config)
        self._configs[topic] = config  # last: a topic is listed once all its partitions are open

    def _open_partition(self, topic: str, p: int, config: TopicConfig) -> PartitionLog:
        part = PartitionLog.open(self.data_path / f"{topic}-{p}", topic, p, config, self._ids, self._clock,
                                 self._repair, on_written=self.notify_written)
        if self._epoch is not None:
            part.begin_epoch(*self._epoch)
        return part

    # -- topics ---------------------------------------------------------------------------------------
    def topics(self) -> list:
        return sorted(self._configs)

    def topic_config(self, topic: str) -> TopicConfig:
        try:
            return self._configs[topic]
        except KeyError:
            raise UnknownTopicError(f"unknown topic {topic!r}") from None

    def create_topic(self, topic: str, config: Optional[TopicConfig] = None) -> TopicConfig:
        """Create a topic with its partitions; an existing topic is an error unless it has the same
        number of partitions (then this is a no-op)."""
        validate_topic_name(topic)
        config = config or self.default_config
        with self._lock:
            self._check_open()
            if topic in self._configs:
                have = self._configs[topic].num_partitions
                if have != config.num_partitions:
                    raise InvalidTopicError(f"topic {topic!r} already exists with {have} partitions")
                return self._configs[topic]
            self._open_topic(topic, config, set())
            return self._configs[topic]

    def add_partitions(self, topic: str, num_partitions: int) -> TopicConfig:
        """Grow ``topic`` to ``num_partitions``: the new partitions empty, the ones it has kept as they are
        (a partition is never renumbered). Fewer than it has is refused; as many is a no-op."""
        with self._lock:
            self._check_open()
            config = self.topic_config(topic)
            have = config.num_partitions
            if num_partitions < have:
                raise InvalidTopicError(f"topic {topic!r} has {have} partitions; a topic does not shrink "
                                        f"(asked for {num_partitions})")
            grown = config.with_(num_partitions=num_partitions)
            for p in range(have, num_partitions):  # published only once all are open (the config last)
                self._partitions[(topic, p)] = self._open_partition(topic, p, grown)
            self._configs[topic] = grown
            return grown

    def delete_topic(self, topic: str) -> int:
        """Delete ``topic``: no longer listed, its partitions closed (appends under way finish first, later
        ones fail as on a closed log), then each partition directory removed crash-safely (``remove_dir``:
        after a crash a ``*.deleted`` directory is finished off on open, never opened). Returns how many
        partitions were removed; an unknown topic is UnknownTopicError."""
        with self._lock:
            self._check_open()
            config = self._configs.pop(topic, None)
            if config is None:
                raise UnknownTopicError(f"unknown topic {topic!r}")
            parts = [self._partitions.pop((topic, p)) for p in range(config.num_partitions)]
        for part in parts:
            part.close()
        for part in parts:
            remove_dir(part.directory)
        log.info("deleted topic %s: %d partition directories removed", topic, len(parts))
        return len(parts)

    def partition(self, topic: str, partition: int) -> PartitionLog:
        if isinstance(partition, (int, np.integer)) and not isinstance(partition, bool):
            try:
                return self._partitions[(topic, partition)]
            except (KeyError, TypeError):
                pass
        self._check_open()
        config = self.topic_config(topic)
        raise InvalidPartitionError(f"topic {topic!r} has partitions 0 to {config.num_partitions - 1}; "
                                    f"there is no partition {partition!r}")

    def partitions(self, topic: str) -> list:
        return [self.partition(topic, p) for p in range(self.topic_config(topic).num_partitions)]

    def all_partitions(self) -> list:
        """Every partition of every topic, in topic then partition order: those of listed topics only (a
        topic still opening or deleted meanwhile is left out)."""
        counts = {t: c.num_partitions for t, c in list(self._configs.items())}
        return [p for (t, n), p in sorted(list(self._partitions.items()), key=lambda kv: kv[0])
                if n < counts.get(t, 0)]

    # -- data -----------------------------------------------------------------------------------------
    def append(self, topic: str, partition: int, values, keys=None, attributes=None, flags=None) -> AppendResult:
        return self.partition(topic, partition).append(values, keys, attributes, flags)

    def read(self, topic: str, partition: int, offset: int, max_bytes: int = 1 << 20,
             max_messages: Optional[int] = None) -> FetchResult:
        return self.partition(topic, partition).read(offset, max_bytes, max_messages)

    # -- replication ----------------------------------------------------------------------------------
    def begin_epoch(self, epoch: int, replica_id: int) -> None:
        """This broker is master in ``epoch``: every partition, and those of topics created later, writes
        the epoch's marker with its next append (``PartitionLog.begin_epoch``)."""
        with self._lock:
            self._epoch = (epoch, replica_id)
            parts = list(self._partitions.values())
        for p in parts:
            p.begin_epoch(epoch, replica_id)

    def notify_written(self) -> None:
        """Something was written (any partition's append, or the transaction journal): wake wait_written."""
        with self._written_cond:
            self._written += 1
            self._written_cond.notify_all()

    def wait_written(self, seen: int, timeout: float) -> int:
        """The write counter once it differs from ``seen`` or ``timeout`` seconds pass: a master's reply to
        a replica at the log end long-polls on it."""
        with self._written_cond:
            self._written_cond.wait_for(lambda: self._written != seen, timeout)
            return self._written

    # -- maintenance ----------------------------------------------------------------------------------
    def flush_due(self, now: Optional[float] = None) -> int:
        """fsync partitions whose unflushed data is older than their ``unflushInterval``."""
        return sum(p.flush_if_due(now) for p in list(self._partitions.values()))

    def run_retention(self, now_ms: Optional[int] = None) -> list:
        removed = []
        for p in list(self._partitions.values()):
            removed.extend(p.apply_retention(now_ms))
        return removed

    def _background(self, interval: float) -> None:
        next_retention = self._clock() + self._retention_interval
        while not self._stop.wait(self._tick(interval)):
            try:
                self.flush_due()
                if self._clock() >= next_retention:
                    next_retention = self._clock() + self._retention_interval
                    self.run_retention()
            except Exception:  # noqa: BLE001 - keep maintaining the other partitions
                log.exception("store maintenance failed")

    def _tick(self, interval: float) -> float:
        """Wake at least twice per shortest ``unflushInterval``, so idle partitions meet it too."""
        intervals = [c.unflush_interval_ms / 1000 for c in self._configs.values() if not c.group_commit]
        return max(0.01, min([interval] + [i / 2 for i in intervals]))

    def _check_open(self):
        if self._closed:
            raise StoreClosedError("the message store is closed")

    def close(self) -> None:
        """Stop maintenance, then fsync and close every partition."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for p in self._partitions.values():
            p.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
