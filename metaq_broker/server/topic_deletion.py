"""Deleting topics, Kafka's way (DeleteTopics; docs/kafka.md, "Deleting topics"): the broker that takes the
request records the deletion in ZooKeeper (``zk/topic_deletions.py``); every broker, each member of a
replicated group included, follows the records and deletes its own copy (``delete_here``: the broker's,
crash-safe); a group's master then removes its topic entry, and whichever broker finds no entry left
finishes the deletion (the partition map, the groups' offsets, the record). A record is read again after a
restart, a reconnect or a failed step, so a deletion a crash cut short is finished by the next round.

The records are read with a watch and again every ``RETRY_S`` while any is pending (another broker's step,
which sets no watch of ours, may let this one finish) and every ``IDLE_S`` otherwise (a watch lost with the
session). ``is_pending`` answers from the last read: puts to a topic being deleted are refused with it.

Lock order: ``_cond`` alone; nothing is called while it is held."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, Optional

import grpc
from kazoo.exceptions import KazooException

from metaq_broker.protocol.services import DELETE_TOPIC, TOPICS_SERVICE
from metaq_broker.server.json_rpc import json_method
from metaq_broker.server.kafka_admin import DELETE_WAIT_MAX_S
from metaq_broker.zk import topic_deletions, topic_entries
from metaq_broker.zk.paths import ZkPaths

log = logging.getLogger(__name__)

RETRY_S = 0.5  # records read again this often while any is pending
IDLE_S = 5.0  # and this often while none is


def deletion_service(auth, handler, deletions: Callable[[], Optional["TopicDeletions"]]) -> grpc.GenericRpcHandler:
    """``metaq.v1.Topics/DeleteTopic`` (JSON ``{"topic", "timeoutMs"}``), what ``Admin.delete_topic`` and
    ``metaq topics delete`` call: ``handler.delete_topic`` (Delete on the topic), then up to ``timeoutMs``
    (at most ``DELETE_WAIT_MAX_S``, as Kafka's DeleteTopics) for the deletion to be done; answers
    ``{"done": bool}`` (False: recorded, still going on). ``deletions()``: the broker's ``TopicDeletions``
    (None without ZooKeeper: done at once)."""
    def delete(principal: str, m: dict) -> dict:
        topic, timeout_ms = m["topic"], m.get("timeoutMs", 30_000)
        if not isinstance(topic, str) or not isinstance(timeout_ms, int):
            raise ValueError('expected JSON {"topic": <name>, "timeoutMs": <int>}')
        handler.delete_topic(principal, topic)
        waiting = deletions()
        wait_s = min(max(timeout_ms, 0) / 1000, DELETE_WAIT_MAX_S)
        done = waiting is None or not waiting.wait_done([topic], wait_s)
        return {"done": done}
    return grpc.method_handlers_generic_handler(TOPICS_SERVICE, {DELETE_TOPIC: json_method(auth, delete,
                                                                                            "delete topic")})


class TopicDeletions:
    """``zk()``: the broker's ZooKeeper session (None while away); ``topics()``: the topics this member
    stores; ``delete_here(topic)``: delete this member's copy, False while it must wait (the reason logged);
    ``publishes()``: this member writes its group's topic entries (the master)."""

    def __init__(self, zk: Callable, paths: ZkPaths, broker_id: int, *, topics: Callable[[], Iterable[str]],
                 delete_here: Callable[[str], bool], publishes: Callable[[], bool]):
        self._zk, self.paths, self.broker_id = zk, paths, broker_id
        self._topics, self._delete_here, self._publishes = topics, delete_here, publishes
        self._cond = threading.Condition()
        self._pending: frozenset = frozenset()
        self._dirty = True
        self._stopped = False
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "TopicDeletions":
        self._thread = threading.Thread(target=self._run, name="metaq-topic-deletions", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def is_pending(self, topic: str) -> bool:
        return topic in self._pending

    def record(self, zk, topic: str, requested_by: str, acl=None) -> None:
        """Record ``topic``'s deletion (already recorded: nothing to do) and start on it now."""
        topic_deletions.record(zk, self.paths, topic, requested_by, self.broker_id, acl)
        with self._cond:
            self._pending = self._pending | {topic}
        self.wake()

    def wait_done(self, topics: Iterable[str], timeout_s: float) -> set:
        """Wait up to ``timeout_s`` for the deletions of ``topics`` to be finished; those still pending."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                left = {t for t in topics if t in self._pending}
                remaining = deadline - time.monotonic()
                if not left or remaining <= 0 or self._stopped:
                    return left
                self._cond.wait(min(remaining, RETRY_S))

    def wake(self, *_) -> None:
        with self._cond:
            self._dirty = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._dirty and not self._stopped:
                    self._cond.wait(RETRY_S if self._pending else IDLE_S)
                if self._stopped:
                    return
                self._dirty = False
            zk = self._zk()
            if zk is None:
                continue
            try:
                self._round(zk)
            except KazooException as e:  # ZooKeeper away: the next round tries again
                log.debug("topic deletions: %s", e)
            except Exception:  # noqa: BLE001 - keep following the records
                log.exception("topic deletions: a round failed; trying again")

    def _round(self, zk) -> None:
        names = topic_deletions.pending(zk, self.paths, watch=self.wake)
        with self._cond:
            self._pending = frozenset(names)
            self._cond.notify_all()
        here = set(self._topics())
        for topic in names:
            if topic in here and not self._delete_here(topic):
                continue
            if self._publishes():
                topic_entries.delete(zk, self.paths, topic, self.broker_id)
            if topic_deletions.finish(zk, self.paths, topic):
                log.info("the deletion of topic %s is done: no broker has it any more", topic)
                with self._cond:
                    self._pending = self._pending - {topic}
                    self._cond.notify_all()
