"""Kafka's partition numbers and topic ids, kept in ZooKeeper (docs/kafka.md, "Partition numbers").

Kafka clients number a topic's partitions 0..N-1; metaq names them ``<brokerId>-<n>``. One node per topic,
``<root>/kafka/topics/<topic>``, holds the map as JSON::

    {"version": 1, "topicId": "<22 chars: Kafka's base64 form of a random UUID>",
     "partitions": ["1-0", "1-1", "2-0", ...]}            # list index = Kafka partition number

The list only grows: a partition that appears (a topic created, partitions added on a broker, a broker
joining) is appended, so a number keeps its partition forever and is never given to another one, also when
its broker is gone or forgotten. Appends are writes conditioned on the version read (the node is created
by the first), so brokers numbering at the same time never lose or renumber each other's partitions: a lost
race reads again. A broker numbers its own partitions when it publishes its topic entries
(``server/registration.py``); the topic id is made with the node.

``<root>/kafka/cluster_id`` holds Kafka's cluster id, made once by the first broker that asks.
"""
from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass, field
from typing import Iterable, Optional

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from metaq_broker.errors import MetaqError
from metaq_broker.names import parse_partition_name
from metaq_broker.zk.paths import ZkPaths

ATTEMPTS = 100  # each lost race means another writer's append went in: progress is made either way
MAX_PARTITIONS = 1_000_000  # of one topic in Kafka's numbering; a map past it is refused as damaged


class KafkaMapError(MetaqError):
    """A partition map or cluster id node in ZooKeeper that is not what metaq writes: left as it is."""


def uuid_to_str(raw: bytes) -> str:
    """Kafka's string form of a UUID (``Uuid.toString``): URL-safe base64 without padding, 22 chars."""
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def uuid_from_str(text: str) -> bytes:
    """The 16 bytes of Kafka's string form; ValueError if ``text`` is not one."""
    if not isinstance(text, str) or len(text) != 22:
        raise ValueError(f"a Kafka UUID is 22 base64 characters, got {text!r}")
    try:
        raw = base64.urlsafe_b64decode(text + "==")
    except (ValueError, TypeError):
        raise ValueError(f"a Kafka UUID is 22 base64 characters, got {text!r}") from None
    if len(raw) != 16 or uuid_to_str(raw) != text:
        raise ValueError(f"a Kafka UUID is 22 base64 characters, got {text!r}")
    return raw


def new_uuid() -> bytes:
    """A random UUID, never one Kafka reserves (all zero: no id; ...01: the metadata topic's)."""
    return uuid.uuid4().bytes  # version 4 bits are set: never 0 or 1


@dataclass(frozen=True)
class TopicMap:
    """One topic in Kafka's terms: its id and its partitions by number (``partitions[k]`` is number k)."""

    topic: str
    topic_id: bytes  # 16 bytes
    partitions: tuple  # metaq partition names, index = Kafka partition number
    version: int = -1  # the node's ZooKeeper version this was read at (-1: not read)
    _numbers: dict = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_numbers", {p: k for k, p in enumerate(self.partitions)})

    def number_of(self, partition: str) -> Optional[int]:
        """Kafka's number of a metaq partition name, None if it has none (yet)."""
        return self._numbers.get(partition)

    def name_of(self, number: int) -> Optional[str]:
        """The metaq partition behind Kafka's number, None for a number the topic does not have."""
        return self.partitions[number] if 0 <= number < len(self.partitions) else None

    def to_json(self) -> bytes:
        return json.dumps({"version": 1, "topicId": uuid_to_str(self.topic_id),
                           "partitions": list(self.partitions)}).encode()

    @classmethod
    def from_json(cls, topic: str, data: bytes, version: int = -1) -> "TopicMap":
        """KafkaMapError naming the problem if ``data`` is not a partition map."""
        try:
            d = json.loads(data)
            if not isinstance(d, dict) or d.get("version") != 1:
                raise ValueError("not version 1")
            parts = d["partitions"]
            if not isinstance(parts, list) or len(parts) > MAX_PARTITIONS:
                raise ValueError("partitions is not a list")
            for p in parts:
                parse_partition_name(p)
            if len(set(parts)) != len(parts):
                raise ValueError("a partition has two numbers")
            return cls(topic, uuid_from_str(d["topicId"]), tuple(parts), version)
        except (ValueError, KeyError, TypeError) as e:
            raise KafkaMapError(f"the Kafka partition map of topic {topic!r} is damaged ({e}): "
                                f"{bytes(data[:200])!r}") from None


def read(zk, paths: ZkPaths, topic: str) -> Optional[TopicMap]:
    """The topic's map, None if none of its partitions has a number yet."""
    try:
        data, stat = zk.get(paths.kafka_topic(topic))
    except NoNodeError:
        return None
    return TopicMap.from_json(topic, data, stat.version)


def number(zk, paths: ZkPaths, topic: str, partitions: Iterable[str], acl=None) -> TopicMap:
    """Give each of ``partitions`` (metaq names) a Kafka number if it has none: appended in (brokerId, n)
    order after every number given so far. Returns the map with them all. Raises KafkaMapError for a damaged
    map (never overwritten), MetaqError after ATTEMPTS lost races, kazoo's errors without ZooKeeper."""
    wanted = sorted(set(partitions), key=parse_partition_name)
    path = paths.kafka_topic(topic)
    for _ in range(ATTEMPTS):
        current = read(zk, paths, topic)
        have = set(current.partitions) if current else set()
        missing = [p for p in wanted if p not in have]
        if current is not None and not missing:
            return current
        if current is None:
            new = TopicMap(topic, new_uuid(), tuple(missing))
            try:
                zk.create(path, new.to_json(), acl=acl, makepath=True)
                return TopicMap(topic, new.topic_id, new.partitions, 0)
            except NodeExistsError:
                continue
        new = TopicMap(topic, current.topic_id, current.partitions + tuple(missing))
        try:
            stat = zk.set(path, new.to_json(), version=current.version)
            return TopicMap(topic, new.topic_id, new.partitions, stat.version)
        except (BadVersionError, NoNodeError):
            continue
    raise MetaqError(f"could not number the partitions of topic {topic!r} in {path}: {ATTEMPTS} writes lost to "
                     f"other brokers")


def cluster_id(zk, paths: ZkPaths, acl=None) -> str:
    """Kafka's cluster id of this metaq cluster (root): read, or made by the first caller."""
    path = paths.kafka_cluster_id()
    while True:
        try:
            data, _ = zk.get(path)
        except NoNodeError:
            made = uuid_to_str(new_uuid())
            try:
                zk.create(path, json.dumps({"version": "1", "id": made}).encode(), acl=acl, makepath=True)
                return made
            except NodeExistsError:
                continue
        try:
            return uuid_to_str(uuid_from_str(json.loads(data)["id"]))
        except (ValueError, KeyError, TypeError) as e:
            raise KafkaMapError(f"{path} is not a cluster id ({e}): {bytes(data[:200])!r}") from None
