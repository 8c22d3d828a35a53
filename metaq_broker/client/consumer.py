"""The consumer: fetch any partition from any offset and decode to Arrow (checksums verified on the
client, end to end) or to message objects; keep a group's offsets in ZooKeeper; and, outside Spark,
share a group's partitions among its members with MetaQ's ids/owners scheme."""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Iterable, Optional, Union

import pyarrow as pa
import pyarrow.compute as pc

from metaq_broker.client.base import ClientBase
from metaq_broker.client.fetcher import PartitionFetcher
from metaq_broker.errors import AuthenticationError, InvalidQueryError
from metaq_broker.names import parse_partition_name, partition_name
from metaq_broker.protocol import lookup as lookup_protocol
from metaq_broker.protocol import records
from metaq_broker.protocol.lookup import DEFAULT_MAX_ANSWERS, MAX_ANSWERS, LookupRequest
from metaq_broker.protocol.services import COMMIT_OFFSETS, FETCH_OFFSETS
from metaq_broker.zk.group_offsets import GroupStore
from metaq_broker.zk.session import negotiated_timeout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Message:
    topic: str
    partition: str
    offset: int
    key: Optional[bytes]
    value: Optional[bytes]  # None: a null value (a Kafka tombstone)
    timestamp: datetime  # its create time where the producer gave one, else its store time (timestamp_type)
    msg_id: int
    flag: int
    attribute: Optional[str]
    timestamp_type: int = records.LOG_APPEND_TIME  # records.CREATE_TIME (0) or LOG_APPEND_TIME (1), as Kafka's


@dataclass(frozen=True)
class Fetched:
    """Messages [start_offset, next_offset) of one partition, and the partition's range at fetch time
    (``latest``: its last stable offset). Only committed messages: transaction markers and aborted
    transactions leave gaps in the offsets, so ``batch`` may have fewer rows than the range has offsets,
    none at all, and a reader moves on to ``next_offset`` whatever it holds."""

    topic: str
    partition: str
    batch: pa.RecordBatch  # records.schema(timestamp_type=True): SCHEMA and timestampType
    start_offset: int
    next_offset: int
    earliest: int
    latest: int

    def messages(self) -> list:
        d = self.batch.to_pydict()
        return [Message(self.topic, self.partition, *row) for row in zip(
            d["offset"], d["key"], d["value"], d["timestamp"], d["msgId"], d["flag"], d["attribute"],
            d["timestampType"])]


def _ms(value, name: str) -> Optional[int]:
    """A time bound as ms since the epoch: an int, or a datetime (naive ones are local time)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return int(value.timestamp() * 1000)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidQueryError(f"{name} must be ms since the epoch or a datetime, got {value!r}")
    return value


_LOOKUP_SCHEMA = pa.schema([f for f in lookup_protocol.REPLY_SCHEMA if f.name != "partition"]).insert(
    2, pa.field("partition", pa.string(), nullable=False))


class Consumer(ClientBase):
    def __init__(self, zk_connect: Optional[str] = None, zk_root: str = "/meta", brokers=None,
                 group: Optional[str] = None, timeout: float = 30.0, security=None):
        super().__init__(zk_connect, zk_root, brokers, timeout, security)
        self.group = group
        self._groups = None
        self.consumer_id = f"{uuid.uuid4().hex[:12]}"
        self._owned: dict = {}  # topic -> partitions this member owns
        self.positions: dict = {}  # (topic, partition) -> next offset to fetch

    # -- reading --------------------------------------------------------------------------------------
    def fetch(self, topic: str, partition: str, offset: int, max_bytes: int = 1 << 20,
              max_messages: Optional[int] = None, max_wait_ms: int = 0, headers: bool = False) -> Fetched:
        """Whole batches from ``offset`` on, within ``max_bytes`` and ``max_messages`` (``FetchRaw``, with the
        fetch policy of ``fetcher.PartitionFetcher``); waits up to ``max_wait_ms`` at the log end. Bulk
        readers (the Spark source) add the broker's data port. ``headers``: the batch has a ``headers``
        column too (Kafka record headers, ``records.schema(headers=True, ...)``)."""
        conn, number = self.route(partition)
        r = PartitionFetcher(conn, topic, partition, number, conn.timeout, max_bytes,
                             reroute=functools.partial(self._master_of, parse_partition_name(partition)[0]),
                             wait_for_master=self.cluster.zk is not None).fetch(
            offset, max_messages or 0, max_wait_ms)
        batch = records.decode(r.records, r.start_offset, r.end_offset, verify=True, aborted=r.aborted,
                               headers=headers, timestamp_type=True)
        return Fetched(topic, partition, batch, r.start_offset, r.end_offset, r.earliest_offset, r.latest_offset)

    def read_range(self, topic: str, partition: str, start: int, end: int, max_bytes: int = 8 << 20) -> pa.Table:
        """Every committed message of [start, end) as one Arrow table (several fetches when needed); ``end``
        at most the last stable offset."""
        batches, offset = [], start
        while offset < end:
            f = self.fetch(topic, partition, offset, max_bytes, max_messages=end - offset)
            if f.next_offset == offset:
                raise records.RecordFormatError(f"{topic} {partition}: no messages at {offset}, latest is {f.latest}", 0)
            batches.append(f.batch)
            offset = f.next_offset
        return pa.Table.from_batches(batches, schema=records.schema(timestamp_type=True))

    # -- lookups ----------------------------------------------------------------------------------------
    def lookup(self, topic: str, key=None, msg_id: Optional[int] = None, start_ms=None, end_ms=None,
               max_messages: int = DEFAULT_MAX_ANSWERS, partitions: Optional[Iterable[str]] = None,
               read_uncommitted: bool = False) -> list:
        """The messages of ``topic`` whose key is ``key`` (bytes, or str as UTF-8), newest first, at most
        ``max_messages``; or the message with id ``msg_id`` (ids are unique per broker: one answer from each
        broker at most, and in practice one or none). ``start_ms``/``end_ms`` (ms since the epoch or
        datetimes, either open) bound their store times. Only committed messages unless ``read_uncommitted``;
        ``partitions`` (``<brokerId>-<n>`` names): only these. Answered by the brokers' key indexes
        (``Lookup``), never by reading the topic. Returns ``Message`` objects; ``lookup_arrow`` the same
        as Arrow."""
        table = self.lookup_arrow(topic, key, msg_id, start_ms, end_ms, max_messages, partitions, read_uncommitted)
        d = table.to_pydict()
        return [Message(topic, *row) for row in zip(
            d["partition"], d["offset"], d["key"], d["value"], d["timestamp"], d["msgId"], d["flag"],
            d["attribute"], d["timestampType"])]

    def lookup_arrow(self, topic: str, key=None, msg_id: Optional[int] = None, start_ms=None, end_ms=None,
                     max_messages: int = DEFAULT_MAX_ANSWERS, partitions: Optional[Iterable[str]] = None,
                     read_uncommitted: bool = False) -> pa.Table:
        """``lookup`` as one Arrow table: a fetch's columns with record headers, ``partition``
        (``<brokerId>-<n>``) and ``storeTime`` (ms), newest first."""
        if isinstance(key, str):
            key = key.encode()
        if (key is None) == (msg_id is None):
            raise InvalidQueryError("give a key or a message id, one of them")
        if key is not None and not isinstance(key, (bytes, bytearray, memoryview)):
            raise InvalidQueryError(f"a key is bytes or str, got {type(key).__name__}")
        if msg_id is not None and (isinstance(msg_id, bool) or not isinstance(msg_id, int)):
            raise InvalidQueryError(f"a message id is an integer, got {msg_id!r}")
        since, until = _ms(start_ms, "start_ms"), _ms(end_ms, "end_ms")
        if since is not None and until is not None and since > until:
            raise InvalidQueryError(f"start_ms ({since} ms) is after end_ms ({until} ms): no message can be in that "
                                    f"time range")
        if isinstance(max_messages, bool) or not isinstance(max_messages, int) or not 1 <= max_messages <= MAX_ANSWERS:
            raise InvalidQueryError(f"max_messages must be an integer from 1 to {MAX_ANSWERS}, got {max_messages!r}")
        by_broker: dict = {}
        for name in (list(partitions) if partitions is not None else self.partitions(topic)):
            bid, n = parse_partition_name(name)
            by_broker.setdefault(bid, []).append(n)
        tables = []
        for bid, numbers in sorted(by_broker.items()):
            request = LookupRequest(topic, None if key is None else bytes(key), msg_id,
                                    None if partitions is None else tuple(numbers), since, until, max_messages,
                                    read_uncommitted)
            tables += [t.append_column("broker", pa.array([bid] * t.num_rows, pa.int32()))
                       for t in self._lookup_broker(bid, request)]
        if not tables:
            return _LOOKUP_SCHEMA.empty_table()
        table = pa.concat_tables(tables)
        table = table.take(pc.sort_indices(table, sort_keys=[("storeTime", "descending"), ("broker", "ascending"),
                                                             ("partition", "ascending"), ("offset", "descending")]))
        table = table.slice(0, max_messages)
        names = [partition_name(b, n) for b, n in zip(table.column("broker").to_pylist(),
                                                      table.column("partition").to_pylist())]
        return table.drop_columns(["broker", "partition"]).append_column("partition", pa.array(names, pa.string())) \
            .select(_LOOKUP_SCHEMA.names)

    def _lookup_broker(self, bid: int, request: LookupRequest) -> list:
        """Broker ``bid``'s answers, as tables, asking again from where a reply had to stop (its size)."""
        out, left = [], request.max_answers
        while True:
            batch, complete = lookup_protocol.unpack_reply(self.call(bid, lookup_protocol.PATH,
                                                                     lookup_protocol.pack_request(request), retries=3))
            out.append(pa.Table.from_batches([batch]))
            left -= batch.num_rows
            if complete or left <= 0 or not batch.num_rows:
                return out
            before = dict(request.before)
            for p, o in zip(batch.column("partition").to_pylist(), batch.column("offset").to_pylist()):
                before[p] = min(o, before.get(p, o))
            request = dataclasses.replace(request, max_answers=left, before=before)

    # -- group offsets (ZooKeeper) --------------------------------------------------------------------
    def _group_store(self):
        if self._groups is None:
            if self.cluster.zk is None:
                raise RuntimeError("group offsets live in ZooKeeper: create the consumer with zk_connect")
            self._groups = GroupStore(self.cluster.zk, self.cluster.root)
        return self._groups

    def commit(self, topic: str, offsets: dict, forward_only: bool = False, identities: Optional[dict] = None,
               group: Optional[str] = None) -> dict:
        """Record ``{partition: next offset}`` as the group's position in ZooKeeper (``forward_only``: never
        lower a recorded offset, see ``GroupStore.commit``), through a broker when this client is secured
        (``group_offsets_via_broker``); returns what was written. ``identities``: ``{partition: identity}``
        of the logs the offsets are for (default: as this client last saw them, ``offset_bounds``).
        ``group``: another group's than this consumer's own (a Spark query's, chosen by the query)."""
        offsets = {p: int(o) for p, o in offsets.items()}
        identities = self._identities_of(topic, offsets) if identities is None else identities
        if self.group_offsets_via_broker:
            return self.broker_group_call(COMMIT_OFFSETS, {"group": self._group_name(group), "topic": topic,
                                                            "offsets": offsets, "forward_only": forward_only,
                                                            "identities": identities})
        return self._group_store().commit(self._group_name(group), topic, offsets, forward_only=forward_only,
                                          identities=identities)

    def committed(self, topic: str, identities: Optional[dict] = None) -> dict:
        """The group's committed offsets of ``topic``, leaving out those recorded for another log of their
        partition than ``identities`` (default: the logs as this client last saw them)."""
        identities = self._identities_of(topic) if identities is None else identities
        if self.group_offsets_via_broker:
            return self.broker_group_call(FETCH_OFFSETS, {"group": self._group_name(), "topic": topic,
                                                           "identities": identities})
        return self._group_store().fetch(self._group_name(), topic, identities=identities)

    def _identities_of(self, topic: str, partitions=None) -> dict:
        return {p: i for (t, p), i in self.identities.items() if t == topic and i and (partitions is None or p in partitions)}

    def _group_name(self, group: Optional[str] = None) -> str:
        """``group``, else this consumer's; ValueError if neither names one."""
        if not (group or self.group):
            raise ValueError("this consumer has no group")
        return group or self.group

    # -- balanced group consumption -------------------------------------------------------------------
    def subscribe(self, topic: str, start: str = "committed") -> list:
        """Join the group for ``topic`` and take this member's share of its partitions (MetaQ's range
        assignment over ids/owners). Positions start from the committed offsets (earliest where none),
        or ``earliest``/``latest``. Returns the owned partitions; call again to rebalance. Members and
        owners are ephemeral nodes of this client's own ZooKeeper session: with a protected ZooKeeper it
        needs the clients' identity (zk.auth set to the brokers' zk.client.auth, docs/security.md)."""
        if self.security.zk.digest is None and self.cluster.zk_protected():
            raise AuthenticationError(
                f"group {self.group}: balanced consumption (subscribe) keeps its members in ZooKeeper, which the "
                f"brokers protect (zk.auth): give this client the clients' ZooKeeper identity, zk.auth set to the "
                f"brokers' zk.client.auth; or assign partitions and commit offsets (through the brokers) instead")
        groups = self._group_store()
        self._group_name()  # ValueError without a group
        self._owned.setdefault(topic, [])
        groups.join(self.group, self.consumer_id, sorted(self._owned))  # every topic this member follows
        share = groups.assign(self.group, self.consumer_id, topic, self.partitions(topic))
        for p in set(self._owned.get(topic, [])) - set(share):
            groups.release(self.group, topic, p, self.consumer_id)
        owned = [p for p in share if groups.claim(self.group, topic, p, self.consumer_id)]
        self._owned[topic] = owned
        ranges = self.offsets(topic, owned) if owned else {}  # first: committed() checks the logs' identities
        committed = self.committed(topic) if start == "committed" else {}
        for p in owned:
            if (topic, p) in self.positions:
                continue
            earliest, latest = ranges[p][:2]
            self.positions[(topic, p)] = (committed.get(p, earliest) if start == "committed" else
                                          earliest if start == "earliest" else latest)
        return owned

    def poll(self, topic: str, max_bytes: int = 1 << 20, max_wait_ms: int = 500) -> list:
        """Fetch once from each owned partition at its position; advance the positions."""
        out = []
        for p in self._owned.get(topic, []):
            pos = self.positions[(topic, p)]
            f = self.fetch(topic, p, pos, max_bytes, max_wait_ms=max_wait_ms if len(self._owned[topic]) == 1 else 0)
            if f.batch.num_rows:
                out.append(f)
            self.positions[(topic, p)] = f.next_offset
        return out

    def commit_positions(self, topic: str) -> None:
        owned = self._owned.get(topic, [])
        if owned:
            self.commit(topic, {p: self.positions[(topic, p)] for p in owned})

    def close(self) -> None:
        if self._owned:  # joined the group (subscribe): leave it, within the session's time
            self._groups.leave(self.group, self.consumer_id, self._owned,
                               timeout=negotiated_timeout(self.cluster.zk) or 10.0)
        super().close()


class GroupMember:
    """A consumer's share of its group's partitions of one topic (``Consumer.subscribe``), kept as members
    come and go: ``partitions`` it owns and ``positions`` ``{partition: next offset}`` that the caller
    reads from and advances. ``rebalance_if_due`` (every ``interval`` seconds) commits the positions
    first, so that no partition passes to another member behind what this one read, then takes the share
    again with positions from the group's committed offsets. ``commit`` records the positions.

    ``start``: None for the group's committed offsets (earliest where it has none), ``"earliest"``,
    ``"latest"``, or an offset to read every owned partition from (the first share only)."""

    REBALANCE_S = 5.0

    def __init__(self, consumer: Consumer, topic: str, start: Union[None, str, int] = None,
                 interval: float = REBALANCE_S, clock: Callable[[], float] = time.monotonic):
        if start is not None and start not in ("earliest", "latest") and not isinstance(start, int):
            raise ValueError(f"start must be None, 'earliest', 'latest' or an offset, got {start!r}")
        self.consumer, self.topic, self.interval, self._clock = consumer, topic, interval, clock
        self.partitions, self.positions = self._join(start)

    def _join(self, start) -> tuple:
        for key in [k for k in self.consumer.positions if k[0] == self.topic]:
            del self.consumer.positions[key]  # taken again from the group's committed offsets
        owned = self.consumer.subscribe(self.topic, start if start in ("earliest", "latest") else "committed")
        self._due = self._clock() + self.interval
        return owned, {p: start if isinstance(start, int) else self.consumer.positions[(self.topic, p)]
                       for p in owned}

    def commit(self) -> None:
        self.consumer.commit(self.topic, self.positions)

    def rebalance_if_due(self) -> bool:
        """Commit, then take the share again, once ``interval`` has passed since the last time; True if it
        did (``partitions`` and ``positions`` are new objects then)."""
        if self._clock() < self._due:
            return False
        self.commit()
        self.partitions, self.positions = self._join(None)
        return True
