"""Every ZooKeeper path metaq uses, in one place (MetaQ's layout under ``zk.root``)."""
from __future__ import annotations

import re

_PARTITION = re.compile(r"^(\d+)-(\d+)$")


def partition_name(broker_id: int, partition: int) -> str:
    return f"{int(broker_id)}-{int(partition)}"


def parse_partition_name(name: str) -> tuple:
    """``"3-12"`` → ``(3, 12)``."""
    m = _PARTITION.match(str(name))
    if not m:
        raise ValueError(f"partition {name!r} is not of the form <brokerId>-<n>, e.g. '1-0'")
    return int(m.group(1)), int(m.group(2))


def _component(kind: str, value: str) -> str:
    value = str(value)
    if not value or "/" in value or value in (".", ".."):
        raise ValueError(f"{kind} {value!r} cannot be used in a ZooKeeper path")
    return value


class ZkPaths:
    def __init__(self, root: str = "/meta"):
        root = "/" + str(root or "").strip("/")
        self.root = "" if root == "/" else root

    # brokers
    def broker_ids(self) -> str:
        return f"{self.root}/brokers/ids"

    def broker(self, broker_id: int) -> str:
        return f"{self.broker_ids()}/{int(broker_id)}"

    def topics_pub(self) -> str:
        return f"{self.root}/brokers/topics-pub"

    def topic_pub(self, topic: str) -> str:
        return f"{self.topics_pub()}/{_component('topic', topic)}"

    def topic_pub_broker(self, topic: str, broker_id: int) -> str:
        return f"{self.topic_pub(topic)}/{int(broker_id)}-m"

    def topics_sub(self) -> str:
        return f"{self.root}/brokers/topics-sub"

    def topic_sub(self, topic: str) -> str:
        return f"{self.topics_sub()}/{_component('topic', topic)}"

    def topic_sub_broker(self, topic: str, broker_id: int) -> str:
        return f"{self.topic_sub(topic)}/{int(broker_id)}-m"

    # consumer groups
    def consumers(self) -> str:
        return f"{self.root}/consumers"

    def group(self, group: str) -> str:
        return f"{self.consumers()}/{_component('group', group)}"

    def group_ids(self, group: str) -> str:
        return f"{self.group(group)}/ids"

    def group_member(self, group: str, consumer_id: str) -> str:
        return f"{self.group_ids(group)}/{_component('consumer id', consumer_id)}"

    def group_offsets(self, group: str, topic: str) -> str:
        return f"{self.group(group)}/offsets/{_component('topic', topic)}"

    def group_offset(self, group: str, topic: str, partition: str) -> str:
        parse_partition_name(partition)
        return f"{self.group_offsets(group, topic)}/{partition}"

    def group_owners(self, group: str, topic: str) -> str:
        return f"{self.group(group)}/owners/{_component('topic', topic)}"

    def group_owner(self, group: str, topic: str, partition: str) -> str:
        parse_partition_name(partition)
        return f"{self.group_owners(group, topic)}/{partition}"

    # exactly-once sink decisions (the sink issue)
    def sinks(self) -> str:
        return f"{self.root}/sinks"

    def sink_batches(self, sink_id: str) -> str:
        return f"{self.sinks()}/{_component('sink id', sink_id)}/batches"

    def sink_batch(self, sink_id: str, batch_id: int) -> str:
        return f"{self.sink_batches(sink_id)}/{int(batch_id):020d}"
