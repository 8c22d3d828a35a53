"""The broker's presence in ZooKeeper: an ephemeral ``/brokers/ids/<id>`` node with its address, and its
topics under ``topics-pub`` / ``topics-sub``. Registration comes back by itself after a ZooKeeper
restart or a session expiry; a second broker with the same id is refused."""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Optional

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NodeExistsError, NoNodeError
from kazoo.retry import KazooRetry

from .errors import MetaqError
from .zkpaths import ZkPaths

log = logging.getLogger(__name__)


class BrokerIdInUseError(MetaqError):
    """Another live broker holds this broker id."""


def new_client(zk_connect: str, session_timeout: float = 10.0) -> KazooClient:
    """A kazoo client that keeps reconnecting (forever) and retries commands a few times."""
    return KazooClient(hosts=zk_connect, timeout=session_timeout,
                       connection_retry=KazooRetry(max_tries=-1, max_delay=2.0),
                       command_retry=KazooRetry(max_tries=5, max_delay=2.0))


class BrokerRegistration:
    def __init__(self, zk_connect: str, root: str, broker_id: int, address: dict, topics: dict,
                 session_timeout: float = 10.0):
        self.paths = ZkPaths(root)
        self.broker_id = broker_id
        self.address = address
        self.topics = dict(topics)
        self.client = new_client(zk_connect, session_timeout)
        self.state_history: list = []
        self._lock = threading.Lock()
        self._stopped = False
        self._waited = False
        self.session_timeout = session_timeout

    @property
    def connected(self) -> bool:
        return self.client.state == KazooState.CONNECTED

    def start(self, timeout: float = 15.0) -> "BrokerRegistration":
        """Connect and register. A node left by this broker's previous, crashed process disappears when
        that session times out, so wait that long before calling the id taken."""
        self.client.add_listener(self._on_state)
        try:
            self.client.start(timeout)
            deadline = time.monotonic() + self.session_timeout * 1.5 + 2
            while True:
                try:
                    self._register()
                    break
                except BrokerIdInUseError:
                    if time.monotonic() > deadline:
                        raise
                    if not self._waited:
                        log.warning("broker id %d is registered by another session; waiting up to %.0fs for it "
                                    "to expire (a crashed previous run?)", self.broker_id, deadline - time.monotonic())
                        self._waited = True
                    time.sleep(0.2)
        except BaseException:
            self._close_client()
            raise
        return self

    def _register(self) -> None:
        with self._lock:
            if self._stopped:
                return
            node = self.paths.broker(self.broker_id)
            data = json.dumps(self.address, sort_keys=True).encode()
            try:
                self.client.create(node, data, ephemeral=True, makepath=True)
            except NodeExistsError:
                held, stat = self.client.get(node)
                if stat.ephemeralOwner != self.client.client_id[0]:
                    raise BrokerIdInUseError(
                        f"broker id {self.broker_id} is already registered in ZooKeeper at {node} by a live "
                        f"broker ({held.decode(errors='replace')}); give this broker another brokerId") from None
            for topic, n in self.topics.items():
                self._write_topic(topic, n)
        log.info("registered broker %d in ZooKeeper at %s", self.broker_id, node)

    def _write_topic(self, topic: str, num_partitions: int) -> None:
        data = json.dumps({"numPartitions": num_partitions, "brokerId": self.broker_id}).encode()
        for path in (self.paths.topic_pub_broker(topic, self.broker_id),
                     self.paths.topic_sub_broker(topic, self.broker_id)):
            try:
                self.client.create(path, data, makepath=True)
            except NodeExistsError:
                self.client.set(path, data)

    def add_topic(self, topic: str, num_partitions: int) -> None:
        with self._lock:
            self.topics[topic] = num_partitions
            if self.connected:
                self._write_topic(topic, num_partitions)
            # otherwise the next (re)registration writes it

    def _on_state(self, state) -> None:
        self.state_history.append(state)
        if state == KazooState.CONNECTED and len(self.state_history) > 1:
            # Never block inside the listener: re-register from another thread.
            self.client.handler.spawn(self._reregister)
        elif state == KazooState.LOST and not self._stopped:
            log.warning("ZooKeeper session of broker %d expired; will register again on reconnect", self.broker_id)

    def _reregister(self) -> None:
        try:
            self._register()
        except BrokerIdInUseError as e:
            log.error("%s", e)
        except Exception:  # noqa: BLE001 - the next reconnect tries again
            log.exception("re-registering broker %d failed", self.broker_id)

    def stop(self) -> None:
        """Remove this broker's nodes (only if they are ours) and close the session."""
        with self._lock:
            self._stopped = True
            if self.connected:
                try:
                    node = self.paths.broker(self.broker_id)
                    _, stat = self.client.get(node)
                    if stat.ephemeralOwner == self.client.client_id[0]:
                        self.client.delete(node)
                    for topic in self.topics:
                        for path in (self.paths.topic_pub_broker(topic, self.broker_id),
                                     self.paths.topic_sub_broker(topic, self.broker_id)):
                            try:
                                self.client.delete(path)
                            except NoNodeError:
                                pass
                except NoNodeError:
                    pass
                except Exception:  # noqa: BLE001 - the session ends below anyway
                    log.exception("deregistering broker %d failed", self.broker_id)
        self._close_client()

    def _close_client(self) -> None:
        try:
            self.client.stop()
            self.client.close()
        except Exception:  # noqa: BLE001
            log.debug("closing the ZooKeeper client failed", exc_info=True)
