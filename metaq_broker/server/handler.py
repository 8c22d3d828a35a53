"""The broker's one request handler: what a request does, whichever transport brought it.

gRPC (``service.py``), the data port (``data_server.py``) and the Kafka listener (``kafka_listener.py``),
and next the MetaQ listener, turn their frames into the typed requests below, call the handler with the
caller's principal, and turn its typed results, or the error it raised, into their replies: a new listener
adds framing, not a second broker. The handler holds the broker's core: logins (SASL steps, sessions), ACL
checks, puts (round robin, idempotent producers, acks, the master's lease, "not acknowledged" after an
append), fetches (long poll), offsets, topics, transactions, producer ids and the group's description.

Each call checks the caller's rights first, then that this member serves clients (a replica of a group
answers ``not master:``), then does its work. ``refusal`` is the one function from a failure to what every
transport answers: a metaq error as it is, a full disk as ``DiskFullError`` (counted, logged now and then,
the health service told), anything else logged with its traceback as ``InternalError``; each transport's
one table then gives the code (``protocol/status.py`` for gRPC and the data port, ``protocol/kafka/codes.py``
for Kafka).

Lock order: ``_closed_lock`` alone (the closed partitions); nothing is taken under it."""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from kazoo.exceptions import KazooException

from metaq_broker import __version__
from metaq_broker.errors import (ConfigError, InvalidOffsetError, InvalidPartitionError, InvalidTopicError,
                                 MetaqError, NotAcknowledgedError, NotMasterError, PartitionClosedError,
                                 TransactionError, UnknownTopicError)
from metaq_broker.protocol import rawput, records
from metaq_broker.protocol import replication as rp
from metaq_broker.protocol.records import RecordFormatError
from metaq_broker.security.acl import CLUSTER
from metaq_broker.server import lookup
from metaq_broker.server.config import topic_ini_values
from metaq_broker.server.disk import DiskState, is_disk_full
from metaq_broker.server.stats import BrokerStats
from metaq_broker.store import validate_topic_name
from metaq_broker.store.txn_state import TxnState
from metaq_broker.zk import groups as zk_groups
from metaq_broker.zk.decisions import parse_coordinator
from metaq_broker.zk.paths import ZkPaths, check_component

log = logging.getLogger(__name__)

# What every transport answers as it is: the errors its table names (records' format errors are no MetaqError)
REFUSALS = (MetaqError, RecordFormatError)


class InternalError(MetaqError):
    """A request failed for a reason no table names (a bug, or an unexpected failure of the machine): logged
    with its traceback where it happened, answered INTERNAL (Kafka: UNKNOWN_SERVER_ERROR) with its type and
    message."""


# -- typed requests and results ------------------------------------------------------------------------

@dataclass(frozen=True)
class FetchRequest:
    topic: str
    partition: int
    offset: int
    max_bytes: int = 0  # 0: 1 MiB; never over maxTransferSize
    max_messages: int = 0  # 0: no limit
    max_wait_ms: int = 0  # the long poll at the log end; never over maxFetchWait


@dataclass(frozen=True)
class Fetched:
    """A fetch's answer. ``records``: the store's ``FetchResult`` (the bytes), or with ``locate`` its
    ``FileRange`` (where they lie in a segment file, for ``sendfile``); the partition's offsets as they
    were after the read."""

    records: object
    earliest_offset: int
    last_stable_offset: int
    partition_id: str


@dataclass(frozen=True)
class PutResult:
    topic: str
    partition: int
    base_offset: int
    count: int
    base_msg_id: int
    timestamp_ms: int
    fsynced: bool
    duplicate: bool  # an idempotent producer's batch stored before: its first offsets, nothing new written


@dataclass(frozen=True)
class Appended:
    """A batch written to its partition's log and not acknowledged yet (``RequestHandler.append_encoded``):
    ``RequestHandler.acknowledge`` waits for its fsync and replicas and gives the ``PutResult``."""

    topic: str
    partition: int
    log: object  # the store's PartitionLog
    counters: object  # stats.PartitionCounters
    result: object  # the store's AppendResult
    size: int  # the body's bytes, for the put counters
    acks_all: bool
    transactional: bool  # a transaction's batch: acknowledged at its prepare, nothing waited for here


@dataclass(frozen=True)
class OffsetQuery:
    topic: str
    partition: int
    timestamp_ms: Optional[int] = None  # the first offset at or after this time
    from_offset: Optional[int] = None  # with max_bytes: the offset max_bytes of whole batches after this one
    max_bytes: Optional[int] = None
    create_time_from_ms: Optional[int] = None  # a create-time range (inclusive; PartitionLog.offsets_for_create_times)
    create_time_to_ms: Optional[int] = None


@dataclass(frozen=True)
class PartitionOffsets:
    """Kafka's names (docs/protocol.md, "Offset names"); -1 for what was not asked."""

    topic: str
    partition: int
    earliest: int
    latest: int  # the last stable offset
    log_end_offset: int  # the visible end
    high_watermark: int
    for_timestamp: int
    after_bytes: int
    partition_id: str
    create_time_range: Optional[tuple] = None  # [start, end) holding every message in the create-time range asked


@dataclass(frozen=True)
class TopicSummary:
    topic: str
    num_partitions: int


@dataclass(frozen=True)
class PartitionDescription:
    partition: int
    name: str  # "<brokerId>-<n>"
    earliest: int
    latest: int
    bytes: int
    segments: int
    closed: bool


@dataclass(frozen=True)
class TopicDescription:
    topic: str
    broker_id: int
    partitions: list  # of PartitionDescription
    config: dict  # the topic's settings as INI values


@dataclass(frozen=True)
class StatsReply:
    broker_id: int
    version: str
    uptime_seconds: float
    partitions: list  # of stats.PartitionStats


@dataclass(frozen=True)
class TransactionReply:
    xid: str
    state: str
    messages: int = 0


@dataclass(frozen=True)
class PreparedTransaction:
    xid: str
    coordinator: str
    messages: int
    prepared_seconds_ago: float


@dataclass
class MemberInfo:
    replica_id: int = 0
    uuid: str = ""
    address: str = ""
    data_address: str = ""
    role: str = ""
    in_sync: bool = False
    lag_offsets: int = -1
    last_caught_up_ms_ago: int = -1
    journal_lag: int = 0


@dataclass(frozen=True)
class GroupDescription:
    broker_id: int
    members: list  # of MemberInfo
    epoch: int = 0
    master: int = 0
    unclean: bool = False


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (``BrokerConfig``: maxTransferSize, maxFetchWait; ``Broker.max_put_bytes``)."""

    max_transfer_size: int
    max_fetch_wait_ms: int
    max_put_bytes: int


class RequestHandler:
    """One per broker. ``auth`` (``BrokerAuth``) says who a caller is and what it may do; ``group``
    (``GroupMember``, None without ZooKeeper) whether this member serves clients; ``replicas``
    (``ReplicaManager``, None without ZooKeeper) what acknowledgements wait for; ``create_topic``,
    ``add_partitions``, ``delete_topic``, ``deleting`` and ``settle_ahead`` are the broker's (it persists,
    registers and deletes topics; its resolver settles in-doubt transactions)."""

    def __init__(self, store, broker_id: int, limits: Limits, auth, stats: BrokerStats, disk: DiskState, *,
                 create_topic: Callable, add_partitions: Optional[Callable] = None,
                 delete_topic: Optional[Callable] = None, deleting: Callable[[str], bool] = lambda topic: False,
                 transactions=None, group=None,
                 replicas=None, producer_ids=None,
                 settle_ahead: Optional[Callable] = None, observe: Optional[Callable] = None,
                 paths: ZkPaths = ZkPaths(), own_addresses: tuple = ("", ""), auto_create_topics: bool = False):
        self.store = store
        self.auto_create_topics = auto_create_topics  # autoCreateTopics: clients may create topics on first use
        self.broker_id = broker_id
        self.limits = limits
        self.auth = auth
        self.stats = stats
        self.disk = disk  # whether the last write found the disk full
        self.transactions = transactions  # store.transactions.TransactionManager
        self.group = group
        self.replicas = replicas
        self.producer_ids = producer_ids  # server.producer_ids.ProducerIds: InitProducerId
        self.paths = paths  # where transactions' coordinators (the sinks' decision records) lie
        self.own_addresses = own_addresses  # this broker's (address, data address), as clients reach them
        self._create_topic = create_topic
        self._add_partitions = add_partitions
        self._delete_topic = delete_topic  # the broker's: records a deletion (server/topic_deletion.py)
        self._deleting = deleting  # topic -> whether its deletion is recorded: puts to it are refused
        self._settle_ahead = settle_ahead
        self._observe = observe  # (method name, seconds) -> None, or None without metrics
        self._closed: set = set()  # (topic, partition) closed by an operator
        self._closed_lock = threading.Lock()
        self._round_robin = itertools.count()
        self._addresses: dict = {}  # replicaId -> (address, data address) last seen in its member node
        self._last_nodes: tuple = ({}, set())  # describe_group's last ZooKeeper read of members and starting

    # -- what every transport shares ------------------------------------------------------------------
    def refusal(self, exc: BaseException, method: str) -> MetaqError:
        """The error a failed request is answered with, on every transport (see the module docstring)."""
        if isinstance(exc, REFUSALS):
            return exc
        if is_disk_full(exc):  # no bug: one warning now and then, no traceback
            return self.disk.error(exc, getattr(exc, "metaq_where", None), getattr(exc, "metaq_note", ""))
        log.error("%s failed", method, exc_info=exc)
        return InternalError(f"{method} failed: {type(exc).__name__}: {exc}")

    def observe(self, method: str, seconds: float) -> None:
        """A request's duration, for the metrics' latency histogram (by the transport's method name)."""
        if self._observe is not None:
            self._observe(method, seconds)

    def gate(self, admit: bool = True) -> None:
        """Refuse (``not master:``) unless this member is the group's master with a valid lease; ``admit``:
        a new call (refused too while a stopping master hands over), else an acknowledgement of one taken."""
        if self.group is not None:
            (self.group.check_master if admit else self.group.check_lease)()

    def _allow(self, principal: str, operation: str, resource_type: str, name: str) -> None:
        self.auth.authorize(principal, operation, resource_type, name)

    def _allow_sink(self, principal: str, xid: str) -> None:
        """Transactions belong to a sink: the xid's first component (the Spark sink's ``sinkId``)."""
        self._allow(principal, "Write", "sink", xid.split("/", 1)[0])

    def _name(self, partition: int) -> str:
        return f"{self.broker_id}-{partition}"

    def _open_partition(self, topic: str, partition: int):
        log_ = self.store.partition(topic, partition)
        if (topic, partition) in self._closed:
            raise PartitionClosedError(f"partition {self._name(partition)} of topic {topic!r} is closed")
        return log_

    # -- login ----------------------------------------------------------------------------------------
    def authenticate(self, step: dict) -> dict:
        """One step of a SASL exchange (PLAIN, or SCRAM-SHA-256 in two): ``BrokerAuth.authenticate``; the
        last step's answer carries the session token."""
        return self.auth.authenticate(step)

    def session(self, token: str):
        """The session a token names, if it still holds (``BrokerAuth.Session``); AuthenticationError."""
        return self.auth.session(token)

    def principal_of_certificate(self, cert: Optional[bytes]) -> str:
        return self.auth.principal_of_certificate(cert)

    # -- puts -----------------------------------------------------------------------------------------
    def admit_put(self, principal: str, topic: str, xid: str) -> None:
        """What a put's header alone decides, checked before its body is read: the caller may write the
        topic (and the transaction's sink), the topic exists, this member takes puts."""
        self._allow(principal, "Write", "topic", topic)
        if xid:
            self._allow_sink(principal, xid)
        self.store.topic_config(topic)
        if self._deleting(topic):
            raise UnknownTopicError(f"topic {topic!r} is being deleted: it takes no more messages")
        self.gate()

    def put(self, principal: str, request: rawput.Request) -> PutResult:
        """Store a batch a client encoded (its body checked by ``records.parse_body`` first): ``_append``, then
        ``acknowledge``."""
        return self.acknowledge(self._append(principal, request, None))

    def put_encoded(self, principal: str, request: rawput.Request, body: records.EncodedBody) -> PutResult:
        """``put`` of a body the broker encoded itself from a checked request (the Kafka listener's
        ``to_metaq``), so not parsed again; ``request.batch`` is not read. Every other check is ``put``'s."""
        return self.acknowledge(self.append_encoded(principal, request, body))

    def append_encoded(self, principal: str, request: rawput.Request, body: records.EncodedBody) -> "Appended":
        """``put_encoded``'s first half: the batch checked and written, not acknowledged yet (no fsync or
        replica waited for). A transport that pipelines (the Kafka listener) appends a connection's next
        requests, in order, while ``acknowledge`` waits for this one: one group commit covers them all."""
        return self._append(principal, request, body)

    def _append(self, principal: str, request: rawput.Request, encoded: Optional[records.EncodedBody]) -> "Appended":
        """Write one batch (partition -1: the next open partition in turn); ``acknowledge`` waits for it.
        Refusals here stored nothing (``not master:``, ``not enough in-sync replicas``: the client sends
        again)."""
        topic, partition, producer = request.topic, request.partition, request.producer
        self.admit_put(principal, topic, request.xid)
        config = self.store.topic_config(topic)
        acks_all = request.acks == rawput.ACKS_ALL and not request.xid  # a transaction waits at its prepare
        if partition == -1:
            open_parts = [p for p in range(config.num_partitions) if (topic, p) not in self._closed]
            if not open_parts:
                raise PartitionClosedError(f"every partition of topic {topic!r} is closed")
            partition = open_parts[next(self._round_robin) % len(open_parts)]
        self.store.partition(topic, partition)  # counters exist only for real partitions
        counters = self.stats.partition(topic, self._name(partition))
        with self._counting_failures(counters, topic, partition):
            log_ = self._open_partition(topic, partition)
            if encoded is None:
                b = request.batch
                body = records.parse_body(b.count, b.attributes, b.body, b.body_crc)
            else:
                body = encoded
            if producer is not None and request.xid:
                raise RecordFormatError("a transaction's put carries no producer id: the transaction itself is all "
                                        "or nothing", 0)
            if (acks_all or request.xid) and self.replicas is not None:
                self.replicas.check_enough(topic)  # a transaction's batches need the set its prepare waits for
            self.gate(admit=False)  # the lease, just before the append: a master frozen since the gate stops here
            if request.xid:  # in the log, flagged with its transaction: invisible until the commit marker
                result = self._transactions().put(request.xid, topic, partition, body)
            else:  # an idempotent producer's batch stored before is answered with its offsets (duplicate)
                result = log_.append_body(body, producer, durable=False)
        return Appended(topic, partition, log_, counters, result, body.size, acks_all, bool(request.xid))

    def acknowledge(self, appended: "Appended") -> PutResult:
        """The answer to an appended batch, once it is acknowledged: fsynced (group commit) or written by the
        topic's flush policy, and with acks=all in the group's in-sync set. Any refusal here is ``not
        acknowledged: ... may or may not be stored``, never ``not master:``, since the batch is in the log and
        a resend would store it twice. Called once for every ``Appended`` (under group commit a batch is
        visible only once an fsync covers it), also when nobody waits for the answer any more."""
        a, result = appended, appended.result
        topic, partition, end = a.topic, a.partition, result.base_offset + result.count
        with self._counting_failures(a.counters, topic, partition):
            fsynced = result.fsynced
            if a.log.config.group_commit and not a.transactional:
                a.log.make_durable(end)
                fsynced = True
            if self.replicas is not None and not a.transactional:
                with self._after_append(f"the batch at offsets {result.base_offset}-{end - 1} of {topic}-{partition}"):
                    if a.acks_all:
                        self.replicas.await_hw(topic, partition, end)
                    self.gate(admit=False)  # a master that lost its lease meanwhile must not acknowledge
        self.disk.ok()
        a.counters.record_put(result.count, a.size)
        return PutResult(topic, partition, result.base_offset, result.count, result.base_msg_id, result.timestamp,
                         fsynced, result.duplicate)

    @contextlib.contextmanager
    def _counting_failures(self, counters, topic: str, partition: int):
        """A failed put counted, and a full disk named by the partition's directory."""
        try:
            yield
        except BaseException as e:
            counters.record_failure("put")
            if is_disk_full(e):  # a write through a descriptor names no file: the partition's directory
                e.metaq_where = self.store.data_path / f"{topic}-{partition}"
            raise

    @staticmethod
    @contextlib.contextmanager
    def _after_append(where: str):
        """A refusal of something already written (``not master:`` from a lease that ran out) becomes
        ``not acknowledged``: the client must not take it for "stored nothing" and send it again."""
        try:
            yield
        except NotMasterError as e:
            reason = str(e)[len(NotMasterError.PREFIX):].strip()
            raise NotAcknowledgedError(f"not acknowledged: {where} was written, then {reason}; it may or may not "
                                       f"be stored") from None

    # -- fetches --------------------------------------------------------------------------------------
    def fetch(self, principal: str, request: FetchRequest, is_active: Callable[[], bool],
              locate: bool = False) -> Fetched:
        """Whole batches from ``request.offset``, waiting up to ``max_wait_ms`` (while ``is_active()``: the
        caller is still there) when there are none yet. ``locate``: where they lie instead of the bytes."""
        topic, partition, offset = request.topic, request.partition, request.offset
        self._allow(principal, "Read", "topic", topic)
        self.gate()
        self.store.partition(topic, partition)
        counters = self.stats.partition(topic, self._name(partition))
        try:
            log_ = self._open_partition(topic, partition)
            if request.max_bytes < 0 or request.max_messages < 0 or request.max_wait_ms < 0:
                raise InvalidOffsetError("max_bytes, max_messages and max_wait_ms must not be negative")
            max_bytes = min(request.max_bytes or (1 << 20), self.limits.max_transfer_size)
            max_messages = request.max_messages or None
            wait_ms = min(request.max_wait_ms, self.limits.max_fetch_wait_ms)
            read = log_.locate if locate else log_.read
            result = read(offset, max_bytes, max_messages)
            if result.end_offset == result.start_offset and wait_ms:
                deadline = time.monotonic() + wait_ms / 1000
                while is_active() and time.monotonic() < deadline:
                    if log_.wait_for_data(offset, min(0.5, deadline - time.monotonic())):
                        result = read(offset, max_bytes, max_messages)
                        break
        except BaseException:
            counters.record_failure("get")
            raise
        counters.record_get(result.end_offset - result.start_offset, result.length if locate else result.data.size)
        return Fetched(result, log_.earliest_offset, log_.last_stable_offset, log_.identity)

    def wait_for_any(self, principal: str, wanted: list, max_wait_ms: int, is_active: Callable[[], bool]) -> bool:
        """Wait up to ``max_wait_ms`` (at most the broker's fetch wait, while ``is_active()``) until one of
        ``wanted``'s (topic, partition, offset) has a readable message at ``offset`` or later; True then.
        One wait on all of them, as a Kafka Fetch of several partitions waits; the reads are ``fetch``'s."""
        logs = []
        for topic, partition, offset in wanted:
            self._allow(principal, "Read", "topic", topic)
            self.store.partition(topic, partition)
            logs.append((self._open_partition(topic, partition), offset))
        self.gate()
        deadline = time.monotonic() + min(max_wait_ms, self.limits.max_fetch_wait_ms) / 1000
        event = threading.Event()
        for log_, _ in logs:
            log_.watch(event)
        try:
            while True:
                event.clear()  # before the check: data published after it sets the event again
                if any(log_.last_stable_offset > offset for log_, offset in logs):
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or not is_active():
                    return False
                event.wait(min(0.5, left))
        finally:
            for log_, _ in logs:
                log_.unwatch(event)

    def readable(self, principal: str, topic: str, partition: int):
        """The partition's log, for a transport that answers a read's questions before reading (MetaQ's
        byte positions): the caller may Read the topic, this member serves, the partition is open."""
        self._allow(principal, "Read", "topic", topic)
        self.gate()
        return self._open_partition(topic, partition)

    def lookup(self, principal: str, request) -> bytes:
        """Messages by key or message id (a ``protocol.lookup`` request), answered by ``server.lookup`` from
        the topic's partitions asked for (all open ones by default): Read on the topic, as a fetch."""
        self._allow(principal, "Read", "topic", request.topic)
        self.gate()
        if request.partitions is None:
            parts = [(p.partition, p) for p in self.store.partitions(request.topic)
                     if (request.topic, p.partition) not in self._closed]
        else:
            parts = [(n, self._open_partition(request.topic, n)) for n in request.partitions]
        return lookup.answer(parts, request, self.limits.max_transfer_size)

    def authorize_replica(self, principal: str) -> None:
        """A group member's replica fetch needs ClusterAction on the cluster (Kafka's inter-broker right),
        checked before the request's body is read."""
        self._allow(principal, "ClusterAction", "cluster", CLUSTER)

    def replica_fetch(self, principal: str, request: rp.FetchRequest, is_active: Callable[[], bool]):
        """A group member copying from this master: what ``ReplicaManager.serve_fetch`` answers. The lease
        is checked after the long poll, just before the reply: a master frozen past its session (a new one
        may be elected) answers ``not master:`` instead of data its replicas would take."""
        self.authorize_replica(principal)
        if self.replicas is None:
            raise NotMasterError("not master: this broker is not in a replicated group")
        answer = self.replicas.serve_fetch(request, is_active)
        self.gate(admit=False)
        return answer

    def partition_identity(self, topic: str, partition: int) -> str:
        """The identity of a partition's log ("" when this broker lacks it)."""
        try:
            return self.store.partition(topic, partition).identity
        except MetaqError:
            return ""

    # -- offsets and producer ids ---------------------------------------------------------------------
    def offsets(self, principal: str, queries: list) -> list:
        """``PartitionOffsets`` for each ``OffsetQuery``."""
        out = []
        self.gate()
        for q in queries:
            self._allow(principal, "Describe", "topic", q.topic)
            p = self.store.partition(q.topic, q.partition)
            hw = p.high_watermark
            for_timestamp = after_bytes = -1
            if q.timestamp_ms is not None:
                for_timestamp = p.offset_for_timestamp(q.timestamp_ms)
            if q.max_bytes is not None or q.from_offset is not None:
                if q.max_bytes is None or q.from_offset is None:
                    raise InvalidOffsetError("from_offset and max_bytes go together")
                after_bytes = p.offset_after_bytes(q.from_offset, q.max_bytes)
            create_times = None
            if q.create_time_from_ms is not None or q.create_time_to_ms is not None:
                create_times = p.offsets_for_create_times(q.create_time_from_ms, q.create_time_to_ms)
            out.append(PartitionOffsets(q.topic, q.partition, p.earliest_offset, p.last_stable_offset, p.visible_end,
                                        p.visible_end if hw is None else hw, for_timestamp, after_bytes, p.identity,
                                        create_times))
        return out

    def init_producer_id(self, principal: str, producer_id: Optional[int], epoch: Optional[int]) -> tuple:
        """(id, epoch): a new producer id, or the one given with its epoch bumped. Kafka 3's rule for who
        may ask, Write on any topic (KIP-679), since an id lets its holder write nothing it could not
        write without. A replica answers too when the ids are ZooKeeper's (Kafka clients ask any broker)."""
        self.auth.authorize_write_somewhere(principal, "an idempotent producer's id needs Write on some topic")
        if self.producer_ids is None:
            raise ConfigError("this broker gives out no producer ids")
        if not self.producer_ids.cluster_wide:
            self.gate()
        if epoch is not None and producer_id is None:
            raise InvalidOffsetError("producer_epoch without producer_id")
        return self.producer_ids.init(producer_id, epoch)

    # -- topics ---------------------------------------------------------------------------------------
    def list_topics(self, principal: str) -> list:
        """The topics the caller may Describe (all of them without ACLs), as Kafka's metadata does."""
        return [TopicSummary(t, self.store.topic_config(t).num_partitions) for t in self.store.topics()
                if self.auth.allows(principal, "Describe", "topic", t)]

    def describe_topic(self, principal: str, topic: str) -> TopicDescription:
        self._allow(principal, "Describe", "topic", topic)
        return self._describe(topic)

    def _describe(self, topic: str) -> TopicDescription:
        config = self.store.topic_config(topic)
        parts = [PartitionDescription(p.partition, self._name(p.partition), p.earliest_offset, p.last_stable_offset,
                                      p.size_bytes, len(p.segments()), (topic, p.partition) in self._closed)
                 for p in self.store.partitions(topic)]
        return TopicDescription(topic, self.broker_id, parts, topic_ini_values(config))

    def create_topic(self, principal: str, topic: str, num_partitions: int, config: dict,
                     automatic: bool = False) -> TopicDescription:
        """As Kafka: Create on the cluster, or on the topic. ``num_partitions`` 0: the broker's default.
        ``automatic``: a client's creation on first use (metaq's producer, a Kafka client's Metadata), done
        only where ``autoCreateTopics`` allows it, with the broker's defaults; a topic this broker has
        already is left as it is. Producers racing create it once: each goes through ``_create_topic``, whose
        lock makes the later ones wait until the first has opened every partition (the store lists a topic
        while it still opens them, so asking it first would describe a topic half made)."""
        if automatic and not self.auto_create_topics:
            raise UnknownTopicError(f"unknown topic {topic!r}: broker {self.broker_id} does not create topics on "
                                    f"first use (autoCreateTopics=false); create it with `metaq topics create "
                                    f"{topic}` (or set autoCreateTopics=true on the brokers)")
        self.auth.authorize_any(principal, "Create", [("cluster", CLUSTER), ("topic", topic)])
        if automatic:
            num_partitions, config = 0, {}
        if num_partitions < 0:
            raise ConfigError(f"num_partitions must not be negative, got {num_partitions}")
        try:
            self._create_topic(topic, num_partitions or None, dict(config))
        except InvalidTopicError:
            if not (automatic and topic in self.store.topics()):
                raise  # an invalid name, or an operator's count other than the topic's
        return self._describe(topic)

    def add_partitions(self, principal: str, topic: str, num_partitions: int, validate_only: bool = False) -> None:
        """Kafka's CreatePartitions on this broker: grow its ``topic`` to ``num_partitions`` (a count, not an
        increment: a request repeated or raced grows once), or create it with them here, with the broker's
        defaults, when this broker does not have it yet. Alter on the topic; the group's master only (a
        member grows as it copies the master)."""
        self._allow(principal, "Alter", "topic", topic)
        self.gate()
        if topic in self.store.topics():
            if not validate_only:
                self._add_partitions(topic, num_partitions)  # fewer than it has: refused (a topic never shrinks)
        elif validate_only:
            validate_topic_name(topic)
        else:
            self._create_topic(topic, num_partitions, {})

    def delete_topic(self, principal: str, topic: str) -> None:
        """Kafka's DeleteTopics (and ``metaq topics delete``): Delete on the topic, then the broker records the
        deletion, which every broker carries out (``server/topic_deletion.py``). Any member may take it."""
        self._allow(principal, "Delete", "topic", topic)
        if self._delete_topic is None:
            raise ConfigError("this broker deletes no topics")
        self._delete_topic(topic, principal)

    def topic_deleted(self, topic: str) -> None:
        """``topic`` was deleted here: its closed partitions are forgotten (one created again starts open)."""
        with self._closed_lock:
            self._closed = {tp for tp in self._closed if tp[0] != topic}

    def close_partitions(self, principal: str, topic: str, start: int, end: int) -> TopicDescription:
        """MetaQ's closePartitions: partitions ``start..end`` take no puts or fetches until opened again."""
        self._allow(principal, "Alter", "topic", topic)
        n = self.store.topic_config(topic).num_partitions
        if not 0 <= start <= end < n:
            raise InvalidPartitionError(f"partitions {start}..{end} are not within 0..{n - 1} of topic {topic!r}")
        with self._closed_lock:
            self._closed |= {(topic, p) for p in range(start, end + 1)}
        log.info("closed partitions %d..%d of %s", start, end, topic)
        return self._describe(topic)

    def open_partitions(self, principal: str, topic: str) -> TopicDescription:
        self._allow(principal, "Alter", "topic", topic)
        self.store.topic_config(topic)
        with self._closed_lock:
            self._closed = {tp for tp in self._closed if tp[0] != topic}
        log.info("opened all partitions of %s", topic)
        return self._describe(topic)

    def stats_of(self, principal: str, topic: str = "") -> StatsReply:
        """MetaQ's counters, of one topic or ("") of all."""
        self._allow(principal, "Describe", *(("topic", topic) if topic else ("cluster", CLUSTER)))
        if topic:
            self.store.topic_config(topic)
        return StatsReply(self.broker_id, __version__, self.stats.uptime(), self.stats.snapshot(topic or None))

    # -- transactions ---------------------------------------------------------------------------------
    def _transactions(self):
        self.gate()
        if self.transactions is None:
            raise TransactionError("this broker does not support transactions")
        return self.transactions

    def begin_transaction(self, principal: str, xid: str, timeout_ms: int, coordinator: str) -> TransactionReply:
        self._allow_sink(principal, xid)
        if timeout_ms < 0:
            raise TransactionError(f"timeout_ms must not be negative, got {timeout_ms}")
        parsed = parse_coordinator(coordinator)
        if parsed:
            self._check_coordinator(xid, parsed["path"])
        t = self._transactions().begin(xid, timeout_ms / 1000 or None, coordinator)
        return TransactionReply(t.xid, t.state)

    def _check_coordinator(self, xid: str, path: str) -> None:
        """The broker reads a prepared transaction's decision record, and may write an abort into it: the
        path must be one ZooKeeper takes, and once security is on, exactly the record of the batch the xid
        names (the Spark sink's ``<sinkId>/<batchId>/...`` and ``<root>/sinks/<sinkId>/batches/<batchId>``),
        so a caller can name only its own sink's records."""
        try:
            for component in path.split("/")[1:]:
                check_component("a coordinator path component", component)
        except ValueError as e:
            raise TransactionError(f"coordinator path {path!r}: {e}") from None
        if not self.auth.enabled:
            return
        sink, _, rest = xid.partition("/")
        batch = rest.partition("/")[0]
        try:
            expected = self.paths.sink_batch(sink, int(batch)) if batch.isdigit() else None
        except ValueError:
            expected = None
        if path != expected:
            raise TransactionError(
                f"coordinator path {path!r} is not the decision record of the transaction's batch "
                f"({expected})" if expected else
                f"coordinator path {path!r}: xid {xid!r} names no sink batch (<sinkId>/<batchId>/...), so it "
                f"can have no decision record")

    def prepare_transaction(self, principal: str, xid: str) -> TransactionReply:
        self._allow_sink(principal, xid)
        manager = self._transactions()
        t = manager.get(xid)
        if t is not None and t.state == TxnState.OPEN and self.replicas is not None:
            for topic in sorted({topic for topic, _ in t.partitions}):
                self.replicas.check_enough(topic)  # refused before the PREPARE record: nothing written
        t = manager.prepare(xid)
        self._await_replicated(t.partitions)
        self.disk.ok()
        return TransactionReply(t.xid, t.state, t.messages)

    def commit_transaction(self, principal: str, xid: str) -> TransactionReply:
        self._allow_sink(principal, xid)
        return TransactionReply(xid, self._settle(self._transactions().commit, xid))

    def rollback_transaction(self, principal: str, xid: str) -> TransactionReply:
        self._allow_sink(principal, xid)
        return TransactionReply(xid, self._settle(self._transactions().rollback, xid))

    def _await_replicated(self, partitions) -> None:
        """A transaction call is answered once the in-sync set, at least minInSyncReplicas of each of its
        topics, has its batches or markers and its journal records, whatever the producer's acks: an XA
        participant must not lose a prepare in a failover. Its record is written by then: any refusal
        here is ``not acknowledged`` (sending the call again is safe: prepare, commit and rollback are
        idempotent)."""
        if self.replicas is None:
            return
        with self._after_append("the transaction's record"):
            for topic, partition in sorted(partitions):
                self.replicas.await_hw(topic, partition, self.store.partition(topic, partition).log_end_offset)
            self.replicas.await_journal(self.transactions.journal_seq, [t for t, _ in partitions])
            self.gate(admit=False)

    def _settle(self, settle, xid: str) -> str:
        """``settle(xid)`` (commit or rollback). A full disk after the decision was journalled is still a
        DiskFullError, saying that the broker finishes the settlement itself (``expire``) once space returns."""
        t = self.transactions.get(xid)
        partitions = list(t.partitions) if t is not None else []
        try:
            state = settle(xid)
        except OSError as e:
            if is_disk_full(e) and self.transactions.state(xid) in (TxnState.COMMITTING, TxnState.ABORTING):
                e.metaq_note = "the outcome is recorded: the broker finishes it by itself once space is freed " \
                               "(sending it again is safe too)"
            raise
        if self._settle_ahead is not None:  # older in-doubt ones of these partitions with a recorded decision
            self._settle_ahead(partitions)
        self._await_replicated(partitions)
        self.disk.ok()
        return state

    def recover_transactions(self, principal: str) -> list:
        """The prepared transactions (``PreparedTransaction``), for a coordinator's recovery."""
        self._allow(principal, "Describe", "cluster", CLUSTER)
        now = time.time()
        return [PreparedTransaction(t.xid, t.coordinator, t.messages, now - t.prepared_at)
                for t in self._transactions().prepared()]

    # -- the replicated group -------------------------------------------------------------------------
    def describe_group(self, principal: str) -> GroupDescription:
        """The group's members as its master sees them: ZooKeeper's state and member nodes, each replica's
        lag from its last fetch request. A replica answers ``not master:`` (clients ask the master); a
        broker without ZooKeeper is a group of one (its addresses tell a static-list client the data port)."""
        self._allow(principal, "Describe", "cluster", CLUSTER)
        if self.group is None or self.replicas is None:
            address, data_address = self.own_addresses
            return GroupDescription(self.broker_id, [MemberInfo(address=address, data_address=data_address,
                                                                role="master", in_sync=True, lag_offsets=0,
                                                                last_caught_up_ms_ago=0)])
        self.gate()
        group = self.group
        live, starting = self._member_nodes(group)
        seen = self.replicas.describe()
        state = group.state
        me = group.replica_id
        isr = seen["isr"]
        ids = set(isr) | set(seen["replicas"]) | set(live) | set(starting) | {me}
        ids |= set(state.replicas) if state is not None else set()
        members = []
        for r in sorted(ids):
            address, data_address = self._addresses.get(r, ("", ""))
            prog = seen["replicas"].get(r)
            role = "master" if r == me else "starting" if r in starting else "replica" if r in live else "down"
            info = MemberInfo(r, isr.get(r) or (prog or {}).get("uuid", ""), address, data_address, role, r in isr)
            if r == me:
                info.lag_offsets, info.last_caught_up_ms_ago = 0, 0
            elif prog is not None:
                info.lag_offsets, info.journal_lag = prog["lag"], prog["journal_lag"]
                if prog["caught_up_ago"] is not None:
                    info.last_caught_up_ms_ago = int(prog["caught_up_ago"] * 1000)
            members.append(info)
        return GroupDescription(self.broker_id, members, seen["epoch"], me, bool(state is not None and state.unclean))

    def _member_nodes(self, group) -> tuple:
        """({replicaId: member node}, {replicaIds starting}) from ZooKeeper; what was last seen if it does
        not answer. Addresses are remembered, so a member that went down is still shown where it was."""
        try:
            live = zk_groups.members(group.zk, group.paths, self.broker_id)
            starting = zk_groups.starting(group.zk, group.paths, self.broker_id)
        except KazooException as e:
            log.debug("group %d: members not readable from ZooKeeper now: %s", self.broker_id, e)
            return self._last_nodes
        for r, node in live.items():
            try:
                self._addresses[r] = zk_groups.addresses(node)
            except ValueError:
                log.warning("group %d: unreadable addresses in member %d's node: %r", self.broker_id, r, node)
        self._last_nodes = (live, starting)
        return live, starting
