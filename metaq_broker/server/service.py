"""The gRPC service: a thin layer that turns requests into MessageStore calls and metaq errors into
gRPC status codes. Record bytes pass through untouched (producers send encoded batch bodies, fetches
return stored batches), so the broker does no per-message work."""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time

import grpc
from kazoo.exceptions import KazooException

from metaq_broker import __version__
from metaq_broker.errors import (ConfigError, InvalidOffsetError, InvalidPartitionError, MetaqError,
                                 NotAcknowledgedError, NotMasterError, PartitionClosedError, TransactionError)
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.proto import metaq_pb2_grpc as pb_grpc
from metaq_broker.protocol import lookup as lookup_protocol
from metaq_broker.protocol import rawfetch, rawput, records
from metaq_broker.protocol.dataport import MAX_PUT_BYTES
from metaq_broker.protocol.status import code_of
from metaq_broker.security.acl import CLUSTER
from metaq_broker.security.tls import ANONYMOUS
from metaq_broker.server.config import topic_ini_values
from metaq_broker.server import lookup
from metaq_broker.server.disk import DiskState, is_disk_full
from metaq_broker.server.stats import BrokerStats
from metaq_broker.zk import groups as zk_groups
from metaq_broker.zk.decisions import parse_coordinator
from metaq_broker.zk.paths import ZkPaths, check_component

log = logging.getLogger(__name__)

def rpc(method):
    """Run a handler with the caller's principal (``BrokerAuth``; authentication fails here); turn a metaq
    error into a status with its message, log anything unexpected; report its duration to
    ``self.observe`` (the metrics' latency histogram) when metrics are on."""
    @functools.wraps(method)
    def handler(self, request, context):
        start = time.perf_counter()
        try:
            principal = self.auth.grpc_principal(context) if self.auth is not None else ANONYMOUS
            return method(self, request, context, principal)
        except (MetaqError, records.RecordFormatError) as e:
            context.abort(code_of(e), str(e))
        except Exception as e:  # noqa: BLE001 - a bad request must never take the broker down
            if is_disk_full(e):  # a full disk is no bug: RESOURCE_EXHAUSTED and one warning, no traceback
                e = self.disk.error(e)
                context.abort(code_of(e), str(e))
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__} failed: {type(e).__name__}: {e}")
        finally:
            if self.observe is not None:
                self.observe(method.__name__, time.perf_counter() - start)
    return handler


def _pb_producer(request: pb.PutRequest):
    """(id, epoch, base sequence) of a ``PutRequest`` from an idempotent producer, else None."""
    given = [request.HasField(f) for f in ("producer_id", "producer_epoch", "base_sequence")]
    if not any(given):
        return None
    if not all(given):
        raise records.RecordFormatError("producer_id, producer_epoch and base_sequence go together", 0)
    return rawput.check_producer(request.producer_id, request.producer_epoch, request.base_sequence)


class BrokerService(pb_grpc.BrokerServicer):
    max_put_bytes = MAX_PUT_BYTES  # the largest put request taken (the broker sets it: Broker.max_put_bytes)

    def __init__(self, store, broker_id: int, max_transfer_size: int, max_fetch_wait_ms: int,
                 create_topic, stats: BrokerStats, observe=None, transactions=None, disk=None, auth=None,
                 paths: ZkPaths = ZkPaths(), group=None, replicas=None, producer_ids=None):
        self.store = store
        self.producer_ids = producer_ids  # server.producer_ids.ProducerIds: InitProducerId
        self.group = group  # server.member_role.GroupMember: only the master serves clients (None: no ZooKeeper)
        self.replicas = replicas  # server.replica_manager.ReplicaManager: acknowledgements wait for it
        self.auth = auth  # server.auth.BrokerAuth, or None: every caller may do everything
        self.paths = paths  # where transactions' coordinators (the sinks' decision records) lie
        self.disk = disk or DiskState(store.data_path)  # whether the last write found the disk full
        self.transactions = transactions  # store.transactions.TransactionManager
        self.broker_id = broker_id
        self.max_transfer_size = max_transfer_size
        self.max_fetch_wait_ms = max_fetch_wait_ms
        self._create_topic = create_topic  # the broker persists and registers new topics
        self.stats = stats
        self.observe = observe  # (method name, seconds) -> None, or None without metrics
        self._closed = set()  # (topic, partition) closed by an operator
        self._closed_lock = threading.Lock()
        self._round_robin = itertools.count()
        self._addresses: dict = {}  # replicaId -> (address, data address) last seen in its member node
        self.own_addresses = ("", "")  # this broker's (address, data address), set once it listens
        self._last_nodes: tuple = ({}, set())  # DescribeGroup's last ZooKeeper read of members and starting
        self.settle_ahead = None  # TransactionResolver.settle_ahead, once the broker has a resolver

    # -- helpers --------------------------------------------------------------------------------------
    def _gate(self, admit: bool = True) -> None:
        """Refuse (``not master:``) unless this member is the group's master with a valid lease; ``admit``:
        a new call (refused too while a stopping master hands over), else an acknowledgement of one taken."""
        if self.group is not None:
            (self.group.check_master if admit else self.group.check_lease)()

    def _allow(self, principal: str, operation: str, resource_type: str, name: str) -> None:
        if self.auth is not None:
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

    def _describe(self, topic: str) -> pb.TopicDescription:
        config = self.store.topic_config(topic)
        parts = []
        for p in self.store.partitions(topic):
            parts.append(pb.PartitionDescription(
                partition=p.partition, name=self._name(p.partition), earliest=p.earliest_offset,
                latest=p.last_stable_offset, bytes=p.size_bytes, segments=len(p.segments()),
                closed=(topic, p.partition) in self._closed))
        return pb.TopicDescription(topic=topic, broker_id=self.broker_id, partitions=parts,
                                   config=topic_ini_values(config))

    # -- data -----------------------------------------------------------------------------------------
    @rpc
    def Put(self, request, context, principal):
        return self.put(request, principal)

    def admit_put(self, principal: str, topic: str, xid: str) -> None:
        """What a put's header alone decides, checked by the data port before it reads the body: the
        caller may write the topic (and the transaction's sink), the topic exists, this member takes puts."""
        self._allow(principal, "Write", "topic", topic)
        if xid:
            self._allow_sink(principal, xid)
        self.store.topic_config(topic)
        self._gate()

    def put(self, request, principal: str) -> pb.PutResponse:
        """What every produce path (gRPC ``Put``/``PutRaw`` and the data port's PUT) does: the request is a
        ``PutRequest`` or a ``PutRaw`` request's bytes (``rawput``: the body stays a view of them).

        Refusals before the append stored nothing (``not master:``, ``not enough in-sync replicas``: the
        client sends again); any refusal after it is ``not acknowledged: ... may or may not be stored``,
        never ``not master:``, since the batch is in the log and a resend would store it twice."""
        if not isinstance(request, pb.PutRequest):
            request = rawput.unpack(request)
            producer = request.producer
        else:
            producer = _pb_producer(request)
        topic, partition = request.topic, request.partition
        self.admit_put(principal, topic, request.xid)
        config = self.store.topic_config(topic)
        acks_all = request.acks == 0 and not request.xid  # a transaction waits at its prepare
        if partition == -1:
            open_parts = [p for p in range(config.num_partitions) if (topic, p) not in self._closed]
            if not open_parts:
                raise PartitionClosedError(f"every partition of topic {topic!r} is closed")
            partition = open_parts[next(self._round_robin) % len(open_parts)]
        self.store.partition(topic, partition)  # counters exist only for real partitions
        counters = self.stats.partition(topic, self._name(partition))
        try:
            log_ = self._open_partition(topic, partition)
            b = request.batch
            body = records.parse_body(b.count, b.attributes, b.body, b.body_crc)
            if producer is not None and request.xid:
                raise records.RecordFormatError("a transaction's put carries no producer id: the transaction "
                                                "itself is all or nothing", 0)
            if (acks_all or request.xid) and self.replicas is not None:
                self.replicas.check_enough(topic)  # a transaction's batches need the set its prepare waits for
            self._gate(admit=False)  # the lease, just before the append: a master frozen since the gate stops here
            if request.xid:  # in the log, flagged with its transaction: invisible until the commit marker
                result = self._transactions().put(request.xid, topic, partition, body)
            else:  # an idempotent producer's batch stored before is answered with its offsets (duplicate)
                result = log_.append_body(body, producer)
            if self.replicas is not None and not request.xid:
                where = f"the batch at offsets {result.base_offset}-{result.base_offset + result.count - 1} of " \
                        f"{topic}-{partition}"
                with self._after_append(where):
                    if acks_all:
                        self.replicas.await_hw(topic, partition, result.base_offset + result.count)
                    self._gate(admit=False)  # a master that lost its lease meanwhile must not acknowledge
        except BaseException as e:
            counters.record_failure("put")
            if is_disk_full(e):  # here, not in ``rpc``: the data port's PUT comes this way too
                raise self.disk.error(e, self.store.data_path / f"{topic}-{partition}") from None
            raise
        self.disk.ok()
        counters.record_put(result.count, len(request.batch.body))
        return pb.PutResponse(topic=topic, partition=partition, base_offset=result.base_offset, count=result.count,
                              base_msg_id=result.base_msg_id, timestamp_ms=result.timestamp,
                              fsynced=result.fsynced, duplicate=result.duplicate)

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

    def read(self, topic: str, partition: int, offset: int, max_bytes: int, max_messages: int, max_wait_ms: int,
             is_active, locate: bool = False, *, principal: str):
        """What every fetch path (gRPC ``Fetch``/``FetchRaw`` and the data port) returns: (FetchResult, or
        FileRange with ``locate``, and the partition), with the checks, counters and long-poll wait (while
        ``is_active()``) they share."""
        self._allow(principal, "Read", "topic", topic)
        self._gate()
        self.store.partition(topic, partition)
        counters = self.stats.partition(topic, self._name(partition))
        try:
            log_ = self._open_partition(topic, partition)
            if max_bytes < 0 or max_messages < 0 or max_wait_ms < 0:
                raise InvalidOffsetError("max_bytes, max_messages and max_wait_ms must not be negative")
            max_bytes = min(max_bytes or (1 << 20), self.max_transfer_size)
            wait_ms = min(max_wait_ms, self.max_fetch_wait_ms)
            read = log_.locate if locate else log_.read
            result = read(offset, max_bytes, max_messages or None)
            if result.end_offset == result.start_offset and wait_ms:
                deadline = time.monotonic() + wait_ms / 1000
                while is_active() and time.monotonic() < deadline:
                    if log_.wait_for_data(offset, min(0.5, deadline - time.monotonic())):
                        result = read(offset, max_bytes, max_messages or None)
                        break
        except BaseException:
            counters.record_failure("get")
            raise
        counters.record_get(result.end_offset - result.start_offset,
                            result.length if locate else result.data.size)
        return result, log_

    def _read_request(self, request, context, principal):
        return self.read(request.topic, request.partition, request.offset, request.max_bytes, request.max_messages,
                         request.max_wait_ms, context.is_active, principal=principal)

    @rpc
    def Fetch(self, request, context, principal):
        result, log_ = self._read_request(request, context, principal)
        return pb.FetchResponse(start_offset=result.start_offset, end_offset=result.end_offset,
                                records=result.data.tobytes(), batch_positions=result.batch_positions.tolist(),
                                earliest_offset=log_.earliest_offset, latest_offset=log_.last_stable_offset,
                                aborted=result.aborted.astype(records.ABORTED_DTYPE, copy=False).tobytes(),
                                partition_id=log_.identity)

    @rpc
    def FetchRaw(self, request, context, principal):
        """``Fetch`` answered as a struct header and the record bytes (``rawfetch``): no protobuf copies."""
        result, log_ = self._read_request(request, context, principal)
        return rawfetch.pack(result.start_offset, result.end_offset, log_.earliest_offset, log_.last_stable_offset,
                             result.data, result.aborted)

    def raw_handler(self) -> grpc.GenericRpcHandler:
        """Serves ``FetchRaw`` and ``PutRaw`` beside the generated methods of the same service, which they do
        not shadow. ``PutRaw`` hands ``Put`` the request's bytes as gRPC received them."""
        fetch = grpc.unary_unary_rpc_method_handler(self.FetchRaw, request_deserializer=pb.FetchRequest.FromString)
        put = grpc.unary_unary_rpc_method_handler(self.Put, response_serializer=pb.PutResponse.SerializeToString)
        return grpc.method_handlers_generic_handler(rawfetch.SERVICE, {rawfetch.METHOD: fetch, rawput.METHOD: put})

    @rpc
    def Lookup(self, request, context, principal):
        """Messages by key or message id (``protocol.lookup``), answered by ``server.lookup`` from the
        topic's partitions asked for (all open ones by default): Read on the topic, as a fetch."""
        req = lookup_protocol.unpack_request(request)
        self._allow(principal, "Read", "topic", req.topic)
        self._gate()
        if req.partitions is None:
            parts = [(p.partition, p) for p in self.store.partitions(req.topic)
                     if (req.topic, p.partition) not in self._closed]
        else:
            parts = [(n, self._open_partition(req.topic, n)) for n in req.partitions]
        return lookup.answer(parts, req, self.max_transfer_size)

    def lookup_handler(self) -> grpc.GenericRpcHandler:
        """Serves ``Lookup`` (not in metaq.proto: a JSON request, an Arrow reply) beside the generated
        methods."""
        return grpc.method_handlers_generic_handler(lookup_protocol.SERVICE, {
            lookup_protocol.METHOD: grpc.unary_unary_rpc_method_handler(self.Lookup)})

    @rpc
    def GetOffsets(self, request, context, principal):
        out = []
        self._gate()
        for q in request.queries:
            self._allow(principal, "Describe", "topic", q.topic)
            p = self.store.partition(q.topic, q.partition)
            hw = p.high_watermark
            item = pb.PartitionOffsets(topic=q.topic, partition=q.partition, earliest=p.earliest_offset,
                                       latest=p.last_stable_offset, log_end_offset=p.visible_end, for_timestamp=-1,
                                       after_bytes=-1, high_watermark=p.visible_end if hw is None else hw,
                                       partition_id=p.identity)
            if q.HasField("timestamp_ms"):
                item.for_timestamp = p.offset_for_timestamp(q.timestamp_ms)
            if q.HasField("max_bytes") or q.HasField("from_offset"):
                if not (q.HasField("max_bytes") and q.HasField("from_offset")):
                    raise InvalidOffsetError("from_offset and max_bytes go together")
                item.after_bytes = p.offset_after_bytes(q.from_offset, q.max_bytes)
            out.append(item)
        return pb.GetOffsetsResponse(offsets=out)

    @rpc
    def InitProducerId(self, request, context, principal):
        """A producer id (new, or the one given with its epoch bumped): Kafka 3's rule for who may ask, Write
        on any topic (KIP-679), since an id lets its holder write nothing it could not write without."""
        if self.auth is not None:
            self.auth.authorize_write_somewhere(principal, "an idempotent producer's id needs Write on some topic")
        self._gate()
        if self.producer_ids is None:
            raise ConfigError("this broker gives out no producer ids")
        if request.HasField("producer_epoch") and not request.HasField("producer_id"):
            raise InvalidOffsetError("producer_epoch without producer_id")
        pid, epoch = self.producer_ids.init(request.producer_id if request.HasField("producer_id") else None,
                                            request.producer_epoch if request.HasField("producer_epoch") else None)
        return pb.InitProducerIdResponse(producer_id=pid, producer_epoch=epoch)

    # -- admin ----------------------------------------------------------------------------------------
    @rpc
    def ListTopics(self, request, context, principal):
        """The topics the caller may Describe (all of them without ACLs), as Kafka's metadata does."""
        return pb.ListTopicsResponse(broker_id=self.broker_id, topics=[
            pb.TopicSummary(topic=t, num_partitions=self.store.topic_config(t).num_partitions)
            for t in self.store.topics() if self.auth is None or self.auth.allows(principal, "Describe", "topic", t)])

    @rpc
    def DescribeTopic(self, request, context, principal):
        self._allow(principal, "Describe", "topic", request.topic)
        return self._describe(request.topic)

    @rpc
    def CreateTopic(self, request, context, principal):
        if self.auth is not None:  # as Kafka: Create on the cluster, or on the topic
            self.auth.authorize_any(principal, "Create", [("cluster", CLUSTER), ("topic", request.topic)])
        if request.num_partitions < 0:
            raise ConfigError(f"num_partitions must not be negative, got {request.num_partitions}")
        self._create_topic(request.topic, request.num_partitions or None, dict(request.config))
        return self._describe(request.topic)

    @rpc
    def ClosePartitions(self, request, context, principal):
        self._allow(principal, "Alter", "topic", request.topic)
        n = self.store.topic_config(request.topic).num_partitions
        if not 0 <= request.start <= request.end < n:
            raise InvalidPartitionError(f"partitions {request.start}..{request.end} are not within 0..{n - 1} "
                                        f"of topic {request.topic!r}")
        with self._closed_lock:
            self._closed |= {(request.topic, p) for p in range(request.start, request.end + 1)}
        log.info("closed partitions %d..%d of %s", request.start, request.end, request.topic)
        return self._describe(request.topic)

    @rpc
    def OpenPartitions(self, request, context, principal):
        self._allow(principal, "Alter", "topic", request.topic)
        self.store.topic_config(request.topic)
        with self._closed_lock:
            self._closed = {tp for tp in self._closed if tp[0] != request.topic}
        log.info("opened all partitions of %s", request.topic)
        return self._describe(request.topic)

    @rpc
    def Stats(self, request, context, principal):
        self._allow(principal, "Describe", *(("topic", request.topic) if request.topic else ("cluster", CLUSTER)))
        if request.topic:
            self.store.topic_config(request.topic)
        return pb.StatsResponse(broker_id=self.broker_id, version=__version__, uptime_seconds=self.stats.uptime(),
                                partitions=self.stats.snapshot(request.topic or None))

    # -- transactions ---------------------------------------------------------------------------------
    def _transactions(self):
        self._gate()
        if self.transactions is None:
            raise TransactionError("this broker does not support transactions")
        return self.transactions

    @staticmethod
    def _reply(xid: str, state: str, messages: int = 0) -> pb.TransactionReply:
        return pb.TransactionReply(xid=xid, state=state, messages=messages)

    @rpc
    def BeginTransaction(self, request, context, principal):
        self._allow_sink(principal, request.xid)
        if request.timeout_ms < 0:
            raise TransactionError(f"timeout_ms must not be negative, got {request.timeout_ms}")
        coordinator = parse_coordinator(request.coordinator)
        if coordinator:
            self._check_coordinator(request.xid, coordinator["path"])
        t = self._transactions().begin(request.xid, request.timeout_ms / 1000 or None, request.coordinator)
        return self._reply(t.xid, t.state)

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
        if self.auth is None or not self.auth.enabled:
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

    @rpc
    def PrepareTransaction(self, request, context, principal):
        self._allow_sink(principal, request.xid)
        manager = self._transactions()
        t = manager.get(request.xid)
        if t is not None and t.state == "open" and self.replicas is not None:
            for topic in sorted({topic for topic, _ in t.partitions}):
                self.replicas.check_enough(topic)  # refused before the PREPARE record: nothing written
        t = manager.prepare(request.xid)
        self._await_replicated(t.partitions)
        self.disk.ok()
        return self._reply(t.xid, t.state, t.messages)

    @rpc
    def CommitTransaction(self, request, context, principal):
        self._allow_sink(principal, request.xid)
        return self._reply(request.xid, self._settle(self._transactions().commit, request.xid))

    @rpc
    def RollbackTransaction(self, request, context, principal):
        self._allow_sink(principal, request.xid)
        return self._reply(request.xid, self._settle(self._transactions().rollback, request.xid))

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
            self._gate(admit=False)

    def _settle(self, settle, xid: str) -> str:
        """``settle(xid)`` (commit or rollback). A full disk after the decision was journalled is still a
        DiskFullError, saying that the broker finishes the settlement itself (``expire``) once space returns."""
        t = self.transactions.get(xid)
        partitions = list(t.partitions) if t is not None else []
        try:
            state = settle(xid)
        except OSError as e:
            if is_disk_full(e) and self.transactions.state(xid) in ("committing", "aborting"):
                raise self.disk.error(e, note="the outcome is recorded: the broker finishes it by itself once space "
                                              "is freed (sending it again is safe too)") from None
            raise
        if self.settle_ahead is not None:  # older in-doubt ones of these partitions with a recorded decision
            self.settle_ahead(partitions)
        self._await_replicated(partitions)
        self.disk.ok()
        return state

    @rpc
    def RecoverTransactions(self, request, context, principal):
        self._allow(principal, "Describe", "cluster", CLUSTER)
        now = time.time()
        return pb.RecoverTransactionsResponse(transactions=[
            pb.PreparedTransaction(xid=t.xid, coordinator=t.coordinator, messages=t.messages,
                                   prepared_seconds_ago=now - t.prepared_at)
            for t in self._transactions().prepared()])

    # -- replication ----------------------------------------------------------------------------------
    @rpc
    def DescribeGroup(self, request, context, principal):
        """The group's members as its master sees them: ZooKeeper's state and member nodes, each replica's
        lag from its last fetch request. A replica answers ``not master:`` (clients ask the master); a
        broker without ZooKeeper is a group of one (its addresses tell a static-list client the data port)."""
        self._allow(principal, "Describe", "cluster", CLUSTER)
        if self.group is None or self.replicas is None:
            address, data_address = self.own_addresses
            return pb.DescribeGroupResponse(broker_id=self.broker_id, members=[pb.GroupMemberInfo(
                address=address, data_address=data_address, role="master", in_sync=True, lag_offsets=0,
                last_caught_up_ms_ago=0)])
        self._gate()
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
            info = pb.GroupMemberInfo(replica_id=r, uuid=isr.get(r) or (prog or {}).get("uuid", ""),
                                      address=address, data_address=data_address, role=role, in_sync=r in isr,
                                      lag_offsets=-1, last_caught_up_ms_ago=-1)
            if r == me:
                info.lag_offsets, info.last_caught_up_ms_ago = 0, 0
            elif prog is not None:
                info.lag_offsets, info.journal_lag = prog["lag"], prog["journal_lag"]
                if prog["caught_up_ago"] is not None:
                    info.last_caught_up_ms_ago = int(prog["caught_up_ago"] * 1000)
            members.append(info)
        return pb.DescribeGroupResponse(broker_id=self.broker_id, epoch=seen["epoch"], master=me,
                                        unclean=bool(state is not None and state.unclean), members=members)

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
