"""What producers, consumers and admins share: where brokers and partitions are (ZooKeeper or a static
broker list), and connections to them. A partition is named ``<brokerId>-<n>`` as in MetaQ."""
from __future__ import annotations

import json
import logging
import time
from typing import Iterable, Mapping, Optional, Union

from metaq_broker.client.cluster import ClusterView
from metaq_broker.client.connection import BrokerConnection, ConnectionPool
from metaq_broker.errors import (AuthenticationError, InvalidOffsetError, InvalidPartitionError, MetaqError,
                                 NotMasterError, UnknownTopicError)
from metaq_broker.protocol.services import groups_path
from metaq_broker.protocol.status import STORED_NOTHING, BrokerError, BrokerUnavailableError
from metaq_broker.names import parse_partition_name, partition_name
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.security.settings import ClientSecurity

log = logging.getLogger(__name__)

RESEND_WAIT = 0.1  # seconds between sends of a call its broker group refused while it has no master

BrokerList = Union[None, str, Mapping[int, str]]
Security = Union[None, ClientSecurity, Mapping[str, str]]


def client_security(security: Security) -> ClientSecurity:
    """``ClientSecurity`` from itself, from Kafka-style keys (``security.protocol``, ``ssl.*``, ``sasl.*``,
    ``zk.*``) or from None (PLAINTEXT)."""
    return security if isinstance(security, ClientSecurity) else ClientSecurity.from_properties(security or {})


def parse_broker_list(brokers: BrokerList) -> Optional[dict]:
    """``"1=host:port,2=host:port"`` or ``{1: "host:port"}`` or ``"host:port"`` (a single broker, id asked
    from the broker itself)."""
    if brokers is None or isinstance(brokers, Mapping):
        return None if brokers is None else {int(k): v for k, v in brokers.items()}
    out = {}
    for item in str(brokers).split(","):
        item = item.strip()
        if "=" in item:
            bid, addr = item.split("=", 1)
            out[int(bid)] = addr.strip()
        elif item:
            out[-1 - len(out)] = item  # id unknown until asked
    return out


class ClientBase:
    def __init__(self, zk_connect: Optional[str] = None, zk_root: str = "/meta", brokers: BrokerList = None,
                 timeout: float = 30.0, security: Security = None):
        if (zk_connect is None) == (brokers is None):
            raise ValueError("give exactly one of zk_connect (ZooKeeper) or brokers (a static broker list)")
        self.security = client_security(security)
        self.pool = ConnectionPool(timeout, self.security)
        self.identities: dict = {}  # (topic, partition name) -> the partition log's identity, as last seen
        static = parse_broker_list(brokers)
        if static is not None:
            static = self._resolve_ids(static)
        self.cluster = ClusterView(zk_connect=zk_connect, root=zk_root, brokers=static,
                                   static_topics=self._static_topics if static else None,
                                   static_data=self._static_data_address if static else None,
                                   zk_security=self.security.zk)
        self.cluster.on_moved(lambda _bid, old, _old_data: self.pool.retire(old))

    def _resolve_ids(self, static: dict) -> dict:
        resolved = {}
        for bid, addr in static.items():
            if bid < 0:
                bid = self.pool.get(addr).call("ListTopics", pb.ListTopicsRequest(), retries=3).broker_id
            resolved[bid] = addr
        return resolved

    def _static_data_address(self, broker_id: int) -> Optional[str]:
        """A static list's broker has no registration to read its data port from: ask it (``DescribeGroup``:
        the master's member row) and use the port at the host the list names, which is known to reach it."""
        address = self.cluster.brokers().get(broker_id)
        if address is None:
            return None
        try:
            reply = self.pool.get(address).call("DescribeGroup", pb.DescribeGroupRequest(),
                                                timeout=min(self.pool.timeout, 5.0), wait_for_ready=False)
        except MetaqError as e:  # down, not the master, no Describe permission: gRPC until asked again
            log.debug("broker %d at %s: no data port learned (%s)", broker_id, address, e)
            return None
        ports = [m.data_address.rpartition(":")[2] for m in reply.members if m.role == "master"]
        return f"{address.rpartition(':')[0]}:{ports[0]}" if ports and ports[0] else None

    def _static_topics(self) -> dict:
        """{topic: [(brokerId, n)]}, asked from every broker of a static list."""
        out: dict = {}
        for bid, addr in sorted(self.cluster.brokers().items()):
            for t in self.pool.get(addr).call("ListTopics", pb.ListTopicsRequest(), retries=3).topics:
                out.setdefault(t.topic, []).extend((bid, n) for n in range(t.num_partitions))
        return out

    # -- routing --------------------------------------------------------------------------------------
    def partitions(self, topic: str) -> list:
        """The topic's partitions on live brokers, as ``<brokerId>-<n>`` names, in a stable order. When all
        of its brokers went down while this client ran (a failover: a group between masters), waits for one
        up to the client's timeout."""
        deadline = time.monotonic() + self.pool.timeout
        while not (parts := self.cluster.topic_partitions(topic)):
            if time.monotonic() + RESEND_WAIT > deadline or not any(
                    self.cluster.known(b) for b, _ in self.cluster.registered_partitions(topic)):
                raise UnknownTopicError(f"topic {topic!r} is not on any live broker")
            time.sleep(RESEND_WAIT)
        return [partition_name(b, n) for b, n in parts]

    def registered_partitions(self, topic: str) -> list:
        """All of the topic's partitions as ``<brokerId>-<n>`` names, also those of brokers that are down
        now (``ClusterView.registered_partitions``); key hashing uses these, so keys never move."""
        parts = self.cluster.registered_partitions(topic)
        if not parts:
            raise UnknownTopicError(f"topic {topic!r} is not registered by any broker")
        return [partition_name(b, n) for b, n in parts]

    def connection(self, broker_id: int) -> BrokerConnection:
        addr = self.cluster.brokers().get(broker_id)
        if addr is None:
            raise InvalidPartitionError(f"broker {broker_id} is not alive (not registered)")
        protocol = self.cluster.security_protocol(broker_id)
        if protocol is not None and protocol != self.security.protocol:
            raise AuthenticationError(f"broker {broker_id} at {addr} takes security.protocol {protocol}; this client "
                                      f"is set to {self.security.protocol}")
        return self.pool.get(addr)

    def call(self, broker_id: int, method: str, request, timeout: Optional[float] = None, retries: int = 0,
             deadline: Optional[float] = None):
        """``method`` on broker ``broker_id``, that is on its group's current master. While the group has no
        master (an election, a restart) or the member called answers ``not master:`` or ``not enough
        in-sync replicas`` (it did nothing), the call is sent again, each time to wherever
        ``/brokers/ids/<b>`` points then, until the client's timeout; ``retries`` as for
        ``BrokerConnection.call`` (transient errors, idempotent calls only). With ``deadline`` (a
        ``time.monotonic()``) the whole call ends by then: each send waits only what is left, and transient
        errors are raised, not retried (the caller, bounded by the same deadline, decides)."""
        bounded = deadline is not None
        deadline = time.monotonic() + self.pool.timeout if deadline is None else deadline
        while True:
            conn = None
            try:
                conn = self.connection(broker_id)
                if not bounded:
                    return conn.call(method, request, timeout, retries)
                left = max(deadline - time.monotonic(), 0.05)
                return conn.call(method, request, min(timeout or left, left), 0)
            except InvalidPartitionError:
                if not self.cluster.known(broker_id):
                    raise
                error = None
            except STORED_NOTHING as e:
                if isinstance(e, NotMasterError) and self.cluster.zk is None:
                    raise  # a static broker list names no other member to find the master at
                error = e
            except BrokerError as e:
                if conn is None or not conn.retired:
                    raise
                error = e  # the master moved while the call waited on the old one (``ConnectionPool.retire``)
            if time.monotonic() + RESEND_WAIT > deadline:
                if error is None:
                    raise InvalidPartitionError(f"broker {broker_id} has no master (none registered within "
                                                f"{self.pool.timeout:g}s)")
                raise error
            time.sleep(RESEND_WAIT)

    def _master_of(self, broker_id: int) -> Optional[tuple]:
        """(connection, data port address) of the broker group's master now; None while it has none (or
        this client has a static broker list: nothing to look it up in)."""
        if self.cluster.zk is None or broker_id not in self.cluster.brokers():
            return None
        return self.connection(broker_id), self.data_address(broker_id)

    def data_address(self, broker_id: int) -> Optional[str]:
        """``"host:dataPort"`` of the broker's data port (puts and bulk fetches, ``client.dataconn``), or None
        when it has none or cannot be asked now (then gRPC carries everything)."""
        return self.cluster.data_address(broker_id)

    def route(self, partition: str):
        """(connection, partition number on that broker) for a ``<brokerId>-<n>`` name."""
        bid, n = _parse(partition)
        return self.connection(bid), n

    def check_partition(self, topic: str, partition: str) -> tuple:
        """(brokerId, n) of a ``<brokerId>-<n>`` name of a live broker, or of one that is down but registered
        ``topic``'s partition (topic entries stay) or seen by this client (``ClusterView.known``: between
        masters); InvalidPartitionError at once for any other."""
        bid, n = _parse(partition)
        if bid not in self.cluster.brokers() and not (
                self.cluster.zk is not None and (bid, n) in self.cluster.registered_partitions(topic)
                or self.cluster.known(bid)):
            raise InvalidPartitionError(f"broker {bid} is not alive (not registered)")
        return bid, n

    # -- group offsets and decision records through a broker ------------------------------------------
    @property
    def group_offsets_via_broker(self) -> bool:
        """Whether this client keeps group offsets and the exactly-once sink's decision records through a
        broker, which checks the group's or sink's ACL and writes ZooKeeper with its own identity
        (server/group_offsets_service.py, server/sinks.py): a secured client (SSL, SASL_SSL) always, so that its ACLs
        hold; a PLAINTEXT one when it holds no ZooKeeper identity and the brokers protect ZooKeeper
        (zk.auth). Otherwise it writes ZooKeeper itself (an open ZooKeeper, or the clients' identity)."""
        if self.security.protocol != "PLAINTEXT":
            return True
        return self.security.zk.digest is None and self.cluster.zk is not None and self.cluster.zk_protected()

    def broker_group_call(self, method: str, request: dict) -> dict:
        """``metaq.v1.Groups/<method>`` (``protocol.services``) on the first live broker that answers."""
        return self.broker_json_call(groups_path(method), request)["offsets"]

    def broker_json_call(self, path: str, request: dict, timeout: Optional[float] = None) -> dict:
        """A JSON method (``protocol.services``: ``/service/method``) on the first live broker that answers
        (``timeout``: each call's, default the client's)."""
        brokers = sorted(self.cluster.brokers())
        if not brokers:
            raise InvalidPartitionError(f"no live broker to call {path} on")
        error = None
        for bid in brokers:
            try:
                return json.loads(self.call(bid, path, json.dumps(request).encode(), timeout))
            except BrokerUnavailableError as e:
                error = e
        raise error

    def topic_config(self, topic: str, broker_id: int) -> dict:
        """The topic's settings on broker ``broker_id`` (its INI keys and values, ``DescribeTopic``)."""
        return dict(self.call(broker_id, "DescribeTopic", pb.TopicRequest(topic=topic), retries=3).config)

    # -- offsets --------------------------------------------------------------------------------------
    def offset_bounds(self, topic: str, partitions: Optional[Iterable[str]] = None,
                      timestamp_ms: Optional[int] = None) -> dict:
        """{partition: (earliest, last stable offset, log end[, offset for timestamp])}, one GetOffsets call
        per broker. Readers stop at the last stable offset; the log end is past it while a transaction
        is open (its batches and markers are written, not yet settled)."""
        by_broker: dict = {}
        for name in partitions or self.partitions(topic):
            bid, n = parse_partition_name(name)
            by_broker.setdefault(bid, []).append(n)
        out = {}
        at = {} if timestamp_ms is None else {"timestamp_ms": timestamp_ms}
        for bid, numbers in by_broker.items():
            r = self.call(bid, "GetOffsets", pb.GetOffsetsRequest(queries=[
                pb.OffsetQuery(topic=topic, partition=n, **at) for n in numbers]), retries=3)
            for o in r.offsets:
                name = partition_name(bid, o.partition)
                out[name] = (o.earliest, o.latest, o.log_end_offset) + (
                    () if timestamp_ms is None else (o.for_timestamp,))
                self.identities[(topic, name)] = o.partition_id  # "" from a broker that predates them
        return out

    def offsets_for_create_times(self, topic: str, partitions: Optional[Iterable[str]] = None,
                                 since_ms: Optional[int] = None, until_ms: Optional[int] = None) -> dict:
        """{partition: (start, end)}: offsets outside which no message has a create time (its store time
        when it has none) in [since_ms, until_ms] (None: unbounded; one of them is needed), from the
        brokers' time indexes; one GetOffsets call per broker. Not exact (a reader filters the rows); None
        for a partition whose broker predates the question (read it whole)."""
        if since_ms is None and until_ms is None:
            raise InvalidOffsetError("a create-time range needs since_ms or until_ms")
        if since_ms is not None and until_ms is not None and since_ms > until_ms:
            raise InvalidOffsetError(f"since_ms {since_ms} is after until_ms {until_ms}")
        by_broker: dict = {}
        for name in partitions or self.partitions(topic):
            bid, n = parse_partition_name(name)
            by_broker.setdefault(bid, []).append(pb.OffsetQuery(
                topic=topic, partition=n, create_time_from_ms=since_ms, create_time_to_ms=until_ms))
        out = {}
        for bid, queries in by_broker.items():
            for o in self.call(bid, "GetOffsets", pb.GetOffsetsRequest(queries=queries), retries=3).offsets:
                out[partition_name(bid, o.partition)] = (o.create_time_start, o.create_time_end) \
                    if o.HasField("create_time_start") and o.HasField("create_time_end") else None
        return out

    def offsets(self, topic: str, partitions: Optional[Iterable[str]] = None, timestamp_ms: Optional[int] = None) -> dict:
        """{partition: (earliest, latest[, offset for timestamp])}: ``offset_bounds`` without the log end
        (latest is the last stable offset, where readers stop)."""
        return {p: b[:2] + b[3:] for p, b in self.offset_bounds(topic, partitions, timestamp_ms).items()}

    def offsets_after_bytes(self, budgets: dict) -> dict:
        """{(topic, partition): offset}: for each ``(topic, partition): (from_offset, max_bytes)``, the first
        offset past ``max_bytes`` of messages from ``from_offset`` on (the broker's offset index); one
        GetOffsets call per broker."""
        by_broker: dict = {}
        for (topic, name), (start, max_bytes) in budgets.items():
            bid, n = parse_partition_name(name)
            by_broker.setdefault(bid, []).append(pb.OffsetQuery(topic=topic, partition=n, from_offset=start,
                                                                max_bytes=max_bytes))
        out = {}
        for bid, queries in by_broker.items():
            reply = self.call(bid, "GetOffsets", pb.GetOffsetsRequest(queries=queries), retries=3)
            for o in reply.offsets:
                out[(o.topic, partition_name(bid, o.partition))] = o.after_bytes
        return out

    def close(self) -> None:
        self.cluster.close()
        self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _parse(partition: str) -> tuple:
    try:
        return parse_partition_name(partition)
    except ValueError as e:
        raise InvalidPartitionError(str(e)) from None
