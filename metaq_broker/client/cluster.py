"""Where brokers and partitions are, for clients: read from ZooKeeper (kept current by watches), or a
static broker list asked over gRPC."""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Optional

from kazoo.exceptions import NoNodeError

from ..registry import new_client
from ..zkpaths import ZkPaths

log = logging.getLogger(__name__)

STATIC_TTL = 1.0  # seconds a static-list topic map is reused before asking the brokers again


class ClusterView:
    def __init__(self, zk_connect: Optional[str] = None, root: str = "/meta", brokers: Optional[dict] = None,
                 static_topics: Optional[Callable[[], dict]] = None, timeout: float = 15.0):
        self.root = root
        self.paths = ZkPaths(root)
        self.zk = None
        self._static = brokers
        self._static_topics = static_topics
        self._static_cache = (0.0, {})
        self._lock = threading.Lock()
        self._brokers: dict = {}
        self._topics: dict = {}  # topic -> [(brokerId, n)], kept by watches
        self._listeners: list = []
        if zk_connect is not None:
            self.zk = new_client(zk_connect)
            self.zk.start(timeout)
            self.zk.ensure_path(self.paths.broker_ids())
            self.zk.ensure_path(self.paths.topics_pub())
            self.zk.ChildrenWatch(self.paths.broker_ids(), self._on_brokers)

    # -- brokers --------------------------------------------------------------------------------------
    def _on_brokers(self, children) -> None:
        found = {}
        for child in children:
            try:
                info = json.loads(self.zk.get(self.paths.broker(int(child)))[0])
                found[int(child)] = f"{info['host']}:{info['port']}"
            except (NoNodeError, ValueError, KeyError):
                continue
        with self._lock:
            self._brokers = found
        self._changed()

    def brokers(self) -> dict:
        """{brokerId: "host:port"} of live brokers."""
        if self.zk is None:
            return dict(self._static)
        with self._lock:
            return dict(self._brokers)

    # -- topics ---------------------------------------------------------------------------------------
    def topics(self) -> list:
        if self.zk is None:
            return sorted(self._static_map())
        return sorted(self.zk.get_children(self.paths.topics_pub()))

    def topic_partitions(self, topic: str) -> list:
        """Sorted (brokerId, partition) pairs of ``topic`` on live brokers."""
        if self.zk is None:
            return list(self._static_map().get(topic, []))
        with self._lock:
            known = topic in self._topics
        if not known:
            self.zk.ensure_path(self.paths.topic_pub(topic))
            self.zk.ChildrenWatch(self.paths.topic_pub(topic), lambda children: self._on_topic(topic, children))
        with self._lock:
            parts = self._topics.get(topic, [])
            alive = set(self._brokers)
        return [(b, n) for b, n in parts if b in alive]

    def _on_topic(self, topic: str, children) -> None:
        parts = []
        for child in children:
            try:
                info = json.loads(self.zk.get(f"{self.paths.topic_pub(topic)}/{child}")[0])
                parts.extend((int(info["brokerId"]), n) for n in range(int(info["numPartitions"])))
            except (NoNodeError, ValueError, KeyError):
                continue
        with self._lock:
            self._topics[topic] = sorted(parts)
        self._changed()

    def _static_map(self) -> dict:
        at, cached = self._static_cache
        if time.monotonic() - at > STATIC_TTL:
            cached = self._static_topics() if self._static_topics else {}
            self._static_cache = (time.monotonic(), cached)
        return cached

    # -- changes --------------------------------------------------------------------------------------
    def on_change(self, callback) -> None:
        self._listeners.append(callback)

    def _changed(self) -> None:
        for cb in list(self._listeners):
            try:
                cb()
            except Exception:  # noqa: BLE001
                log.exception("cluster change listener failed")

    def close(self) -> None:
        if self.zk is not None:
            self.zk.stop()
            self.zk.close()
