"""Administration across brokers: topics, partitions, offsets, consumer groups and their lag, stats."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from metaq_broker.client.base import ClientBase
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.zk.group_offsets import GroupStore


@dataclass(frozen=True)
class PartitionInfo:
    topic: str
    partition: str
    broker_id: int
    earliest: int
    latest: int
    bytes: int
    segments: int
    closed: bool


@dataclass(frozen=True)
class GroupLag:
    group: str
    topic: str
    partition: str
    committed: Optional[int]  # None: the group has committed nothing for this partition
    latest: int  # the last stable offset: where readers stop (an open transaction holds back what follows)

    @property
    def lag(self) -> int:
        """Offsets, not messages: transaction markers and aborted messages count too."""
        return self.latest - (self.committed or 0)


class Admin(ClientBase):
    def brokers(self) -> dict:
        return dict(self.cluster.brokers())

    def topics(self) -> dict:
        """{topic: [partition names]} over live brokers."""
        return {t: self.partitions(t) for t in sorted(self.cluster.topics())}

    def describe(self, topic: str) -> list:
        out = []
        for bid in sorted({b for b, _ in self.cluster.topic_partitions(topic)}):
            d = self.connection(bid).call("DescribeTopic", pb.TopicRequest(topic=topic), retries=3)
            out.extend(PartitionInfo(topic, p.name, bid, p.earliest, p.latest, p.bytes, p.segments, p.closed)
                       for p in d.partitions)
        return out

    def topic_config(self, topic: str, broker_id: int) -> dict:
        return dict(self.connection(broker_id).call("DescribeTopic", pb.TopicRequest(topic=topic), retries=3).config)

    def create_topic(self, topic: str, num_partitions: int = 0, broker_ids: Optional[list] = None,
                     config: Optional[dict] = None) -> list:
        """Create ``topic`` on the given brokers (default: every live broker), ``num_partitions`` each
        (0: each broker's numPartitions). Creating an existing topic with the same count is a no-op."""
        ids = sorted(self.cluster.brokers()) if broker_ids is None else broker_ids
        if not ids:
            raise RuntimeError("no live broker to create the topic on")
        for bid in ids:
            self.connection(bid).call("CreateTopic", pb.CreateTopicRequest(
                topic=topic, num_partitions=num_partitions, config={k: str(v) for k, v in (config or {}).items()}))
        return [p for bid in ids for p in self._describe_on(bid, topic)]

    def _describe_on(self, bid: int, topic: str) -> list:
        d = self.connection(bid).call("DescribeTopic", pb.TopicRequest(topic=topic), retries=3)
        return [p.name for p in d.partitions]

    def close_partitions(self, topic: str, broker_id: int, start: int, end: int) -> None:
        self.connection(broker_id).call("ClosePartitions", pb.PartitionRangeRequest(topic=topic, start=start, end=end))

    def open_partitions(self, topic: str, broker_id: int) -> None:
        self.connection(broker_id).call("OpenPartitions", pb.TopicRequest(topic=topic))

    def stats(self, broker_id: int, topic: str = "") -> pb.StatsResponse:
        return self.connection(broker_id).call("Stats", pb.StatsRequest(topic=topic), retries=3)

    def prepared_transactions(self, broker_id: int) -> list:
        """The broker's prepared transactions awaiting an outcome (XA recover)."""
        return list(self.connection(broker_id).call("RecoverTransactions", pb.RecoverTransactionsRequest(),
                                                    retries=3).transactions)

    # -- groups ---------------------------------------------------------------------------------------
    def _groups(self):
        if self.cluster.zk is None:
            raise RuntimeError("consumer groups live in ZooKeeper: create the admin with zk_connect")
        return GroupStore(self.cluster.zk, self.cluster.root)

    def groups(self) -> list:
        return self._groups().groups()

    def group_lag(self, group: str, topic: Optional[str] = None) -> list:
        """Committed offset, latest offset and lag for each partition of each topic the group has
        committed for (or just ``topic``)."""
        store = self._groups()
        rows = []
        for t in [topic] if topic else store.group_topics(group):
            committed = store.fetch(group, t)
            latest = self.offsets(t)
            for p in sorted(set(committed) | set(latest)):
                rows.append(GroupLag(group, t, p, committed.get(p), latest.get(p, (0, 0))[1]))
        return rows
