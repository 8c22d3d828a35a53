"""The producer: picks partitions (explicit, key hash or round robin), batches, and sends synchronously
(``send_batch``) or asynchronously (``send`` returns a future; a sender thread groups messages into one
batch per partition every ``linger_ms`` or ``batch_size`` messages). ``PipelinedSender`` keeps Puts of
many ``send_batch`` calls in flight, one per partition (the Spark sink's at-least-once writer).

Puts go over the broker's data port where it has one (``start_put``), else as gRPC ``PutRaw``.
Delivery: a put to a broker that is down or restarting waits for it (gRPC wait-for-ready) instead of
failing. The producer is idempotent by default (Kafka 3's ``enable.idempotence=true``): it holds a producer
id from ``InitProducerId`` and stamps each batch with it, its epoch and a sequence number per partition, so
a put cut off by a broken connection or a failover (or answered ``not acknowledged: ... may or may not be
stored``) is sent again with the same sequence until the producer's timeout, and the broker stores it once
(a batch sent again is answered with its first offsets). ``Producer(idempotent=False)`` sends no producer
id and never resends a put that may have been stored. When the broker acknowledges, the message is stored
under the topic's flush policy (``PutResult.fsynced`` says whether an fsync covered it).

Messages are Kafka's: a None value is a null value (a tombstone), sent as such (a missing value column is an
error); ``timestamps`` / ``timestamp`` give create times (Kafka's CreateTime), which consumers then read in
``timestamp``; without, a message's time is the broker's store time (LogAppendTime).

A topic no broker has registered is created on first use where the brokers allow it (``autoCreateTopics``,
Kafka's ``auto.create.topics.enable``): the producer asks the live broker with the lowest id, as Kafka asks
its controller, so the topic lands on that one broker (its group) with its ``numPartitions`` instead of being
spread over brokers by accident; ``metaq topics create`` places it anywhere else. Consumers never create."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional

import grpc
import numpy as np
import pyarrow as pa

from metaq_broker.client.base import RESEND_WAIT, ClientBase
from metaq_broker.client.connection import MasterMovedError
from metaq_broker.client.dataconn import DataConnection, DataConnectionPool
from metaq_broker.client.partitioner import RoundRobin, partitions_for_keys
from metaq_broker.client.settle import COMMIT, ROLLBACK, settle
from metaq_broker.errors import (DuplicateSequenceError, InvalidPartitionError, MetaqError, OutOfOrderSequenceError,
                                 UnknownTopicError)
from metaq_broker.names import parse_partition_name
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.protocol import rawput, records
from metaq_broker.protocol.dataport import ProtocolError
from metaq_broker.protocol.status import (NOT_ACKNOWLEDGED, STORED_NOTHING, BrokerError, BrokerUnavailableError,
                                          RemoteNotAcknowledgedError, to_error)

log = logging.getLogger(__name__)


class PartitionUnavailableError(MetaqError, TimeoutError):
    """A key's partition stayed on a down broker for the producer's whole timeout."""


@dataclass(frozen=True)
class PutResult:
    """One stored batch: offsets [base_offset, base_offset + count) of ``partition``."""

    topic: str
    partition: str
    base_offset: int
    count: int
    base_msg_id: int
    timestamp: int
    fsynced: bool
    duplicate: bool = False  # sent again after a lost answer: the broker had it, these are its first offsets


@dataclass(frozen=True)
class SendResult:
    """Where one message sent with ``Producer.send`` was stored."""

    topic: str
    partition: str
    offset: int
    msg_id: int
    timestamp: int


class _GrpcPut:
    """A ``PutRaw`` in flight over gRPC: the body's parts joined once (a ``PutRequest`` cost two more
    copies, ~1 ms per MB in all). The call waits for a restarting broker (wait-for-ready)."""

    def __init__(self, conn, topic: str, name: str, parts: list, timeout: Optional[float] = None):
        self.conn, self.topic, self.name = conn, topic, name
        request = b"".join(parts)
        self.size = len(request)
        self._future = conn.future("PutRaw", request, timeout=timeout)

    def result(self) -> "PutResult":
        try:
            r = self._future.result()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and self.conn.retired:
                raise BrokerUnavailableError(
                    grpc.StatusCode.UNAVAILABLE, f"the master of {self.name} moved while this put to it of "
                    f"{self.topic!r} waited for an answer: it may or may not be stored", self.conn.address) from None
            raise to_error(e, self.conn.address) from None
        return PutResult(self.topic, self.name, r.base_offset, r.count, r.base_msg_id, r.timestamp_ms, r.fsynced,
                         r.duplicate)

    def cancel(self) -> None:
        self._future.cancel()


def _left(deadline: Optional[float]) -> Optional[float]:
    """Seconds left until ``deadline`` (a ``time.monotonic()``; None: the connection's own timeout), at
    least a moment, so that a wait past it still fails as a timeout rather than never starting."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.05)


class _DataPortPut:
    """A put in flight over the broker's data port (``dataconn``): the parts sent with one scatter-gather
    write, no copy in Python, and no HTTP/2 framing on either side. One per connection at a time."""

    def __init__(self, pool: DataConnectionPool, conn: DataConnection, topic: str, name: str, parts: list,
                 deadline: Optional[float] = None):
        self.pool, self.conn, self.topic, self.name, self.deadline = pool, conn, topic, name, deadline
        self.size = sum(len(p) for p in parts)
        conn.send_put(parts, _left(deadline))  # raises if nothing could be sent: the caller may still use gRPC

    def result(self) -> "PutResult":
        try:
            base_offset, base_msg_id, timestamp, _, count, fsynced = self.conn.receive_put(_left(self.deadline))
        except (OSError, ProtocolError) as e:  # the request was sent: it may or may not be stored
            if self.conn.retired:
                raise BrokerUnavailableError(
                    grpc.StatusCode.UNAVAILABLE, f"the master of {self.name} moved while this put to it of "
                    f"{self.topic!r} waited for an answer: it may or may not be stored", self.conn.address) from None
            raise BrokerUnavailableError(
                grpc.StatusCode.UNAVAILABLE, f"connection lost while putting to {self.name} of {self.topic!r}, "
                f"which may or may not be stored: {e}", self.conn.address) from None
        finally:
            self.pool.release(self.conn)  # closed instead if the reply never came
        return PutResult(self.topic, self.name, base_offset, count, base_msg_id, timestamp, fsynced)

    def cancel(self) -> None:
        self.conn.close()  # the reply is not wanted: the connection cannot serve another put


class _ResendingPut:
    """A put that is sent again while the group answers a refusal that stored nothing (``not master:``
    during a failover, ``not enough in-sync replicas``), until the producer's timeout. An idempotent
    producer's put (``producer.sequences``: its id, epoch and sequence) is also sent again when it may have been
    stored (a lost connection, ``not acknowledged:``, no answer in time): the broker answers a batch it has
    with its first offsets. Without one, such a put is never sent again. Once a send may have stored the
    put, a later refusal that stored nothing does not make it "stored nothing": the put fails as ``not
    acknowledged``. The producer's timeout bounds the whole put: every send, connection and wait in it
    gets what is left of it (``deadline``). It uses the producer through ``put_once``,
    ``sequences``, ``cluster`` and ``pool`` only."""

    def __init__(self, producer: "Producer", topic: str, name: str, body: records.EncodedBody, xid: str,
                 idempotent: bool = False, deadline: Optional[float] = None):
        self.producer, self.topic, self.name, self.body, self.xid = producer, topic, name, body, xid
        self.sequences = producer.sequences if idempotent else None
        self.stamp = self.sequences.stamp(self) if idempotent else None  # (producer id, epoch, base sequence)
        self.deadline = time.monotonic() + producer.pool.timeout if deadline is None else deadline
        self.maybe_stored: Optional[BaseException] = None  # the first answer that left it in doubt
        try:
            self._put = self._start()
        except BaseException:
            self._done(failed=True)
            raise
        self.size = self._put.size

    def _start(self):
        """Send it; while its broker group has no master registered (a failover), wait for one; a send the
        master's move stopped before it left (``MasterMovedError``: stop 39's run failed a put with it) goes
        to the new master."""
        while True:
            try:
                return self.producer.put_once(self.topic, self.name, self.body, self.xid, self.stamp, self.deadline)
            except InvalidPartitionError:
                known = self.producer.cluster.known(parse_partition_name(self.name)[0])
                if not known or time.monotonic() + RESEND_WAIT > self.deadline:
                    raise
            except MasterMovedError:
                if time.monotonic() + RESEND_WAIT > self.deadline:
                    raise
            time.sleep(RESEND_WAIT)

    def result(self) -> "PutResult":
        try:
            while True:
                try:
                    result = self._put.result()
                    self._done(failed=False)
                    return result
                except STORED_NOTHING as e:
                    if self.xid or time.monotonic() + RESEND_WAIT > self.deadline:
                        if self.maybe_stored is not None:
                            raise self._in_doubt(e) from e
                        raise
                    log.info("put to %s of %r refused (%s); sending it again", self.name, self.topic, e)
                except DuplicateSequenceError as e:
                    if self.stamp is None or self.maybe_stored is not None or \
                            time.monotonic() + RESEND_WAIT > self.deadline:
                        raise
                    # Never stored (no send of it was left in doubt): a later sequence of this producer
                    # reached the partition first while it knew nothing of the producer (two threads' first
                    # puts to it race, or its state expired), and took that as where the producer stands.
                    self.stamp = self.sequences.restamp(self)
                    log.info("idempotent put to %s of %r refused as a duplicate (%s) though never stored; sending "
                             "it again as sequence %d", self.name, self.topic, e, self.stamp[2])
                except (BrokerUnavailableError, OutOfOrderSequenceError) as e:
                    if self.stamp is None or time.monotonic() + RESEND_WAIT > self.deadline or (
                            isinstance(e, OutOfOrderSequenceError) and not self.sequences.earlier_in_flight(self)):
                        raise
                    if not isinstance(e, OutOfOrderSequenceError):
                        self.maybe_stored = self.maybe_stored or e
                    log.info("idempotent put to %s of %r (sequence %d) got %s; sending it again", self.name,
                             self.topic, self.stamp[2], e)
                time.sleep(RESEND_WAIT)
                self._put = self._start()
        except BaseException:
            self._done(failed=True)
            raise

    def _in_doubt(self, last: BrokerError) -> RemoteNotAcknowledgedError:
        """The error for a put whose last send stored nothing but an earlier one may have stored it."""
        first = self.maybe_stored
        return RemoteNotAcknowledgedError(
            last.code, f"{NOT_ACKNOWLEDGED} the put to {self.name} of {self.topic!r} may or may not be stored: it "
            f"was sent again after {first}; the last send was refused: {last.details}",
            first.address)

    def _done(self, failed: bool) -> None:
        if self.stamp is not None:
            self.sequences.done(self, failed)

    def cancel(self) -> None:
        self._put.cancel()
        self._done(failed=True)


class Sequences:
    """An idempotent producer's id and epoch (from ``InitProducerId``), each partition's next sequence, and
    the sequences in flight (an out-of-order answer while an earlier one is still in flight is sent
    again). A put that finally fails leaves the sequences unknown: the epoch is then bumped and every
    partition starts again at sequence 0 (Kafka's KIP-360). ``_lock`` guards every field; ``ensure_id``
    holds it across its ``InitProducerId`` call, so one put at a time asks for an id."""

    def __init__(self):
        self.producer_id: Optional[int] = None
        self.epoch: Optional[int] = None
        self._lock = threading.Lock()
        self._next: dict = {}  # (topic, partition name) -> next sequence
        self._in_flight: dict = {}  # (topic, partition name) -> {put: sequence}
        self._stale = False

    def ensure_id(self, call, broker_id: int, deadline: float) -> bool:
        """Take a producer id (or bump the epoch after a failed put) from ``broker_id``'s group with
        ``call`` (``ClientBase.call``), waiting until ``deadline`` while ZooKeeper is away; False if the
        broker does not know ``InitProducerId`` (an older metaq)."""
        with self._lock:
            if self.producer_id is not None and not self._stale:
                return True
            bump = self.producer_id is not None
            request = pb.InitProducerIdRequest(producer_id=self.producer_id, producer_epoch=self.epoch) \
                if bump else pb.InitProducerIdRequest()
            while True:
                try:
                    r = call(broker_id, "InitProducerId", request, retries=3, deadline=deadline)
                    break
                except BrokerUnavailableError:  # ZooKeeper away for a moment: ids cannot be given out
                    if time.monotonic() + RESEND_WAIT > deadline:
                        raise
                    time.sleep(RESEND_WAIT)
                except BrokerError as e:
                    if e.code != grpc.StatusCode.UNIMPLEMENTED:
                        raise
                    return False
            if bump:
                log.info("producer %d: epoch %d -> %d after a failed put; sequences start again at 0",
                         r.producer_id, self.epoch, r.producer_epoch)
            self.producer_id, self.epoch = r.producer_id, r.producer_epoch
            self._next.clear()
            self._stale = False
            return True

    def stamp(self, put: _ResendingPut) -> tuple:
        """(producer id, epoch, the partition's next sequence) for ``put``, now in flight."""
        with self._lock:
            key = (put.topic, put.name)
            seq = self._next.get(key, 0)
            self._next[key] = (seq + put.body.count) % (1 << 31)
            self._in_flight.setdefault(key, {})[put] = seq
            return self.producer_id, self.epoch, seq

    def restamp(self, put: _ResendingPut) -> tuple:
        """``put`` again with the partition's next sequence instead of the one it had (see
        ``_ResendingPut.result``: one that stored nothing and was refused as a duplicate)."""
        with self._lock:
            self._in_flight.get((put.topic, put.name), {}).pop(put, None)
        return self.stamp(put)

    def earlier_in_flight(self, put: _ResendingPut) -> bool:
        """Is a put with an earlier sequence to the same partition still unanswered?"""
        with self._lock:
            mine = put.stamp[2]
            return any(p is not put and p.stamp[1] == put.stamp[1] and 0 < (mine - s) % (1 << 31) < 1 << 30
                       for p, s in self._in_flight.get((put.topic, put.name), {}).items())

    def done(self, put: _ResendingPut, failed: bool) -> None:
        with self._lock:
            waiting = self._in_flight.get((put.topic, put.name), {})
            if waiting.pop(put, None) is not None and failed and put.stamp[1] == self.epoch:
                self._stale = True  # its sequence may or may not be stored: start over in a new epoch


class Producer(ClientBase):
    def __init__(self, zk_connect: Optional[str] = None, zk_root: str = "/meta", brokers=None,
                 partitioner: str = "hash", batch_size: int = 1000, linger_ms: float = 5.0, timeout: float = 30.0,
                 use_data_port: bool = True, security=None, acks="all", idempotent: bool = True):
        if partitioner not in ("hash", "round_robin"):
            raise ValueError(f"partitioner must be 'hash' or 'round_robin', got {partitioner!r}")
        rawput.acks_code(acks)  # ValueError naming the choices
        self.acks = acks  # "all": every in-sync member has it (durable by the flush policy); "1": the master
        self.idempotent = idempotent
        self.sequences = Sequences()  # the producer id and epoch from the first put's broker
        super().__init__(zk_connect, zk_root, brokers, timeout, security)
        self.data_pool = DataConnectionPool(timeout, self.security)  # puts to brokers with a data port
        # A put waiting on a master that then froze ends when the group's master moves, as gRPC calls do.
        self.cluster.on_moved(lambda _bid, _old, old_data: old_data and self.data_pool.retire(old_data))
        self.use_data_port = use_data_port  # False: every put as gRPC PutRaw (benchmarks compare the two)
        self.partitioner = partitioner
        self.batch_size = batch_size
        self.linger = linger_ms / 1000
        self._rr = RoundRobin()
        self._pending: dict = {}  # (topic, partition) -> list of (value, key, attribute, flag, future)
        self._cond = threading.Condition()
        self._closed = False
        self._sender = threading.Thread(target=self._run_sender, name="metaq-producer", daemon=True)
        self._sender.start()

    # -- choosing partitions --------------------------------------------------------------------------
    def partitions(self, topic: str) -> list:
        try:
            return super().partitions(topic)
        except UnknownTopicError as e:
            self._create_on_first_use(topic, e)
            return super().partitions(topic)

    def registered_partitions(self, topic: str) -> list:
        try:
            return super().registered_partitions(topic)
        except UnknownTopicError as e:
            self._create_on_first_use(topic, e)
            return super().registered_partitions(topic)

    def _create_on_first_use(self, topic: str, unknown: UnknownTopicError) -> None:
        """A topic no broker has registered (else ``unknown`` is raised again: its brokers are down): ask the
        live broker with the lowest id to create it (``CreateTopic`` with ``automatic``, done only where that
        broker sets ``autoCreateTopics``; producers racing create it once), then wait until it is registered."""
        brokers = self.cluster.brokers()
        if self.cluster.registered_partitions(topic) or not brokers:
            raise unknown
        creator = min(brokers)
        try:
            self.call(creator, "CreateTopic", pb.CreateTopicRequest(topic=topic, automatic=True))
        except UnknownTopicError as e:  # refused: autoCreateTopics=false there (the broker's words say so)
            raise UnknownTopicError(f"{unknown}: {e.details if isinstance(e, BrokerError) else e}") from None
        log.info("created topic %s on first use on broker %d (autoCreateTopics)", topic, creator)
        deadline = time.monotonic() + self.pool.timeout
        while not self.cluster.registered_partitions(topic):  # ZooKeeper's watch, or a static list asked again
            if time.monotonic() + RESEND_WAIT > deadline:
                raise UnknownTopicError(f"topic {topic!r} was created on broker {creator} but not registered "
                                        f"within {self.pool.timeout:g}s")
            time.sleep(RESEND_WAIT)

    def _assign(self, topic: str, n: int, keys: Optional[pa.Array], partition) -> tuple:
        """(partition names, per-message index into them)."""
        if isinstance(partition, (pa.Array, pa.ChunkedArray)):  # a partition name per message
            if partition.null_count:
                raise InvalidPartitionError("the partition column has nulls")
            encoded = pa.chunked_array([partition]) if isinstance(partition, pa.Array) else partition
            encoded = encoded.cast(pa.string()).combine_chunks().dictionary_encode()
            names = encoded.dictionary.to_pylist()
            live = set(self.partitions(topic))
            for name in names:
                if name not in live:
                    raise InvalidPartitionError(f"partition {name!r} is not a live partition of topic {topic!r} "
                                                f"(live: {', '.join(sorted(live))})")
            return names, encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        if partition is not None:  # a broker down or between masters (a failover) is waited for, as a key's
            self.check_partition(topic, partition)
            self._await_live(topic, [partition], why="")
            return [partition], np.zeros(n, dtype=np.int64)
        if keys is not None and self.partitioner == "hash" and keys.null_count < len(keys):
            names = self.registered_partitions(topic)
            chunks = keys.chunks if isinstance(keys, pa.ChunkedArray) else [keys]
            which = np.concatenate([partitions_for_keys(c, len(names)) for c in chunks if len(c)])
            self._await_live(topic, [names[i] for i in np.unique(which)])
            return names, which
        names = self.partitions(topic)
        return names, np.full(n, self._rr.next(len(names)), dtype=np.int64)

    def _await_live(self, topic: str, names: list,
                    why: str = " (keys keep their partition, they are not sent elsewhere)") -> None:
        """Wait (up to the producer's timeout) until the brokers of these partitions are alive: key-hashed
        ones (a key never moves to another partition) or one the caller named. In the caller, so that
        ``send`` does not hand the wait to the thread that sends every partition's; then it fails."""
        deadline = time.monotonic() + self.pool.timeout
        while True:
            alive = self.cluster.brokers()
            down = [name for name in names if parse_partition_name(name)[0] not in alive]
            if not down:
                return
            if time.monotonic() >= deadline:
                name = min(down)
                raise PartitionUnavailableError(
                    f"partition {name!r} of topic {topic!r} is on broker {parse_partition_name(name)[0]}, "
                    f"which is down: waited {self.pool.timeout:g}s{why}")
            time.sleep(0.05)

    def encode_batches(self, topic: str, values, keys=None, attributes=None, flags=None, partition=None,
                       headers=None, timestamps=None) -> list:
        """[(partition name, encoded body)]: the messages split by partition (``partition`` is one name, an
        Arrow array of a name per message, or None for key hash / round robin), no loop per message; a
        partition's body over ``rawput.SPLIT_BYTES`` is cut into several in order (brokers refuse a put over
        their limit, which is at least that). ``headers``: Kafka record headers, per message a list of
        (str key, bytes value); ``timestamps``: create times, ms since the epoch or datetimes
        (``records.timestamps_column``)."""
        cols = _columns(values, keys, attributes, flags, headers, timestamps)
        n = len(cols["values"])
        names, which = self._assign(topic, n, cols["keys"], partition)
        order = np.argsort(which, kind="stable")
        bounds = np.flatnonzero(np.diff(which[order])) + 1
        out = []
        for group in np.split(order, bounds):
            if not len(group):
                continue
            whole = len(group) == n
            take = None if whole else pa.array(group)
            part = {name: c if c is None or whole else c[group] if isinstance(c, np.ndarray) else c.take(take)
                    for name, c in cols.items()}
            body = records.encode_body(**part)
            out.extend((names[int(which[group[0]])], b) for b in _split(body, part))
        return out

    # -- synchronous ----------------------------------------------------------------------------------
    def start_put(self, topic: str, name: str, body: records.EncodedBody, xid: str = ""):
        """Send one encoded batch to partition ``name`` and return at once; ``.result()`` waits for the
        broker's acknowledgement (a PutResult; ``acks`` says whose), ``.size`` is the request's size. Over
        the broker's data port when it has one and it takes the connection; else ``PutRaw`` over gRPC.
        An idempotent producer stamps it with its id, epoch and the partition's next sequence (not a
        transaction's put: the transaction is all or nothing itself)."""
        deadline = time.monotonic() + self.pool.timeout  # the whole put, the producer id included
        if self.idempotent and not xid:
            self._ensure_producer_id(parse_partition_name(name)[0], deadline)  # may find the broker predates them
        return _ResendingPut(self, topic, name, body, xid, idempotent=self.idempotent and not xid, deadline=deadline)

    # -- idempotence ----------------------------------------------------------------------------------
    @property
    def producer_id(self) -> Optional[int]:
        return self.sequences.producer_id

    @property
    def producer_epoch(self) -> Optional[int]:
        return self.sequences.epoch

    def _ensure_producer_id(self, broker_id: int, deadline: Optional[float] = None) -> None:
        """A broker that does not give out producer ids (an older metaq) makes this producer a plain one,
        with a warning: it would store a batch sent again twice."""
        deadline = time.monotonic() + self.pool.timeout if deadline is None else deadline
        if not self.sequences.ensure_id(self.call, broker_id, deadline):
            log.warning("broker %d does not give out producer ids (an older metaq): this producer is not "
                        "idempotent, and puts that may have been stored are not sent again", broker_id)
            self.idempotent = False

    def put_once(self, topic: str, name: str, body: records.EncodedBody, xid: str = "", stamp: Optional[tuple] = None,
                 deadline: Optional[float] = None):
        """Send one encoded batch once, never again (``start_put`` resends): ``stamp`` is an idempotent
        put's (producer id, epoch, base sequence); every wait in it ends by ``deadline`` (None: each
        connection's own timeout). Returns the put in flight."""
        conn, number = self.route(name)
        parts = rawput.pack_parts(topic, number, xid, body.count, body.attributes, body.crc, body.parts,
                                  acks=self.acks, producer=stamp)
        address = self.data_address(parse_partition_name(name)[0]) if self.use_data_port else None
        if address is not None:
            data = self.data_pool.acquire(address, session=conn.session_token)  # SASL_SSL: the AUTH frame's token
            try:
                return _DataPortPut(self.data_pool, data, topic, name, parts, deadline)
            except (OSError, ProtocolError) as e:  # not sent (the broker is down or restarting): gRPC waits
                log.debug("data port %s: %s; putting with PutRaw", address, e)
        return _GrpcPut(conn, topic, name, parts, _left(deadline))

    def send_batch(self, topic: str, values, keys=None, attributes=None, flags=None, partition=None,
                   headers=None, timestamps=None) -> list:
        """Send many messages now: one batch per partition, sent in parallel. Returns PutResults (one per
        partition used). Messages with a key go by key hash; without, the whole call goes to one
        partition, round robin across calls. ``headers``, ``timestamps``: see ``encode_batches``."""
        puts: list = []
        try:
            results = []
            for name, body in self.encode_batches(topic, values, keys, attributes, flags, partition, headers,
                                                  timestamps):
                earlier = next((p for p in puts if p.name == name), None)
                if earlier is not None:  # a body cut in several: stored in order, one at a time
                    results.append(earlier.result())
                    puts.remove(earlier)
                puts.append(self.start_put(topic, name, body))
            while puts:
                results.append(puts.pop(0).result())
            return results
        finally:
            for put in puts:  # after a failure: the others' replies are not awaited, their connections closed
                put.cancel()

    # -- transactions ---------------------------------------------------------------------------------
    def transaction(self, xid_prefix: str, timeout_ms: int = 0, coordinator: str = "") -> "Transaction":
        """A transaction spanning brokers: one broker transaction per broker touched, named
        ``<xid_prefix>@<brokerId>``. Messages stay invisible until committed."""
        return Transaction(self, xid_prefix, timeout_ms, coordinator)

    # -- asynchronous ---------------------------------------------------------------------------------
    def send(self, topic: str, value, key=None, attribute: Optional[str] = None, flag: int = 0,
             partition: Optional[str] = None, headers=None, timestamp=None) -> Future:
        """Queue one message; the future resolves to a SendResult once its batch is stored. ``value`` None:
        a null value (a tombstone). ``headers``: its Kafka record headers, a list of (str key, bytes value)
        pairs. ``timestamp``: its create time (ms since the epoch, or a datetime); without one its time is
        the store time, unless other messages of its batch have one: then it is stamped now, as Kafka's
        producer stamps a record given none."""
        if self._closed:
            raise RuntimeError("producer is closed")
        keys = None if key is None else pa.array([key.encode() if isinstance(key, str) else key], pa.binary())
        names, which = self._assign(topic, 1, keys, partition)  # as send_batch chooses
        partition = names[int(which[0])]
        fut: Future = Future()
        with self._cond:
            q = self._pending.setdefault((topic, partition), [])
            q.append((value, key, attribute, flag, headers, timestamp, fut))
            if len(q) >= self.batch_size or (len(q) == 1 and len(self._pending) == 1):  # full, or the first
                self._cond.notify()
        return fut

    def _run_sender(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()  # idle: no wake-ups (a producer in every Spark worker) until a send
                if not self._closed:
                    self._cond.wait(self.linger)  # the batch fills; a full one or flush() cuts this short
                batches, self._pending = self._pending, {}
                closed = self._closed
            for (topic, partition), items in batches.items():
                self._send_items(topic, partition, items)
            if closed and not batches:
                return

    def _send_items(self, topic: str, partition: str, items: list) -> None:
        try:
            values, keys, attrs, flags, headers, timestamps, futs = zip(*items)
            stored = self.send_batch(topic, list(values), _given(keys), _given(attrs), list(flags),
                                     partition=partition, headers=_given(headers), timestamps=_given(timestamps))
        except BaseException as e:  # noqa: BLE001 - handed to the callers' futures
            for item in items:
                item[-1].set_exception(e)
            return
        done = 0
        for result in stored:  # one result, or several in order when the batch was cut (encode_batches)
            for i, item in enumerate(items[done:done + result.count]):
                item[-1].set_result(SendResult(topic, partition, result.base_offset + i, result.base_msg_id + i,
                                               result.timestamp))
            done += result.count

    def flush(self, timeout: Optional[float] = None) -> None:
        """Send everything queued and wait until it is acknowledged (or failed)."""
        with self._cond:
            futs = [item[-1] for items in self._pending.values() for item in items]
            self._cond.notify()
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in futs:
            f.exception(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._sender.join()
        self.data_pool.close()
        super().close()


class PipelinedSender:
    """``Producer.send_batch`` that returns once its Puts are sent, before the broker answers, so encoding
    the next batch overlaps with the broker's write and fsync of this one. Never two Puts to one partition
    at once, so each partition stores the batches in the order given; at most ``max_bytes`` of requests in
    flight (one whatever its size). A failed Put raises from a later ``send_batch`` or from ``flush``,
    which waits for all and returns their PutResults; ``close`` cancels what is still in flight. With a
    ``transaction`` the Puts are that transaction's (``Transaction.send_batch``, pipelined)."""

    def __init__(self, producer: Producer, max_bytes: int = 32 << 20, transaction: Optional["Transaction"] = None):
        self.producer, self.max_bytes, self.transaction = producer, max_bytes, transaction
        self._inflight: dict = {}  # (topic, partition name) -> put in flight (Producer.start_put), oldest first
        self._bytes = 0
        self._results: list = []

    def _finish(self, key) -> None:
        put = self._inflight.pop(key)
        self._bytes -= put.size
        self._results.append(put.result())

    def send_batch(self, topic: str, values, keys=None, attributes=None, flags=None, partition=None,
                   headers=None, timestamps=None) -> None:
        for name, body in self.producer.encode_batches(topic, values, keys, attributes, flags, partition, headers,
                                                       timestamps):
            xid = "" if self.transaction is None else self.transaction.xid_on(parse_partition_name(name)[0])
            if (topic, name) in self._inflight:
                self._finish((topic, name))
            while self._inflight and self._bytes + body.size > self.max_bytes:
                self._finish(next(iter(self._inflight)))
            put = self._inflight[(topic, name)] = self.producer.start_put(topic, name, body, xid)
            self._bytes += put.size
            if self.transaction is not None:
                self.transaction.messages += body.count

    def flush(self) -> list:
        while self._inflight:
            self._finish(next(iter(self._inflight)))
        results, self._results = self._results, []
        return results

    def close(self) -> None:
        for put in self._inflight.values():
            put.cancel()
        self._inflight.clear()
        self._bytes = 0


class Transaction:
    def __init__(self, producer: Producer, xid_prefix: str, timeout_ms: int, coordinator: str):
        self.producer, self.prefix = producer, xid_prefix
        self.timeout_ms, self.coordinator = timeout_ms, coordinator
        self.xids: dict = {}  # broker id -> xid begun on it
        self.messages = 0

    def xid_on(self, broker_id: int) -> str:
        """This transaction's xid on ``broker_id``, begun there on first use."""
        xid = self.xids.get(broker_id)
        if xid is None:
            xid = f"{self.prefix}@{broker_id}"
            self.producer.call(broker_id, "BeginTransaction", pb.BeginTransactionRequest(
                xid=xid, timeout_ms=self.timeout_ms, coordinator=self.coordinator))
            self.xids[broker_id] = xid
        return xid

    def send_batch(self, topic: str, values, keys=None, attributes=None, flags=None, partition=None,
                   headers=None, timestamps=None) -> None:
        """Add messages (routed as ``Producer.send_batch`` does); they stay invisible until commit."""
        for name, body in self.producer.encode_batches(topic, values, keys, attributes, flags, partition, headers,
                                                       timestamps):
            self.producer.start_put(topic, name, body, self.xid_on(parse_partition_name(name)[0])).result()
            self.messages += body.count

    def prepare(self) -> list:
        """Prepare (durably) on every broker touched; returns [[brokerId, xid], ...]."""
        for bid, xid in self.xids.items():
            self.producer.call(bid, "PrepareTransaction", pb.TransactionRequest(xid=xid), retries=5)
        return [[bid, xid] for bid, xid in sorted(self.xids.items())]

    def commit(self) -> None:
        settle(self.producer, sorted(self.xids.items()), COMMIT, self.producer.pool.timeout)

    def rollback(self) -> None:
        settle(self.producer, sorted(self.xids.items()), ROLLBACK, self.producer.pool.timeout)


def _split(body: records.EncodedBody, columns: dict) -> list:
    """``body`` as it is, or cut at message boundaries into bodies of at most ``rawput.SPLIT_BYTES`` each
    (a message larger than that alone in its own): one search per piece, no loop per message. ``columns``:
    ``encode_body``'s arguments ``body`` was encoded from."""
    if body.size <= rawput.SPLIT_BYTES or body.count == 1:
        return [body]
    ends = np.cumsum(body.message_sizes, dtype=np.int64)
    limit = rawput.SPLIT_BYTES - records.ALIGN  # room for the padding
    pieces, start = [], 0
    while start < body.count:
        base = int(ends[start - 1]) if start else 0
        stop = max(int(np.searchsorted(ends, base + limit, side="right")), start + 1)
        pieces.append(records.encode_body(**{name: c if c is None else c[start:stop] if isinstance(c, np.ndarray)
                                             else c.slice(start, stop - start) for name, c in columns.items()}))
        start = stop
    return pieces


def _given(column: tuple) -> Optional[list]:
    """A column of queued messages (``send``), or None when no message gave one."""
    return None if all(x is None for x in column) else list(column)


def _columns(values, keys, attributes, flags, headers=None, timestamps=None) -> dict:
    """``encode_body``'s arguments, checked once for the whole call (bad input is an InvalidMessageError):
    values, keys, attributes and headers as Arrow arrays, flags and create times as numpy."""
    value_arr = records.binary_column(values, "value", required=True)
    n = len(value_arr)
    return {"values": value_arr, "keys": records.binary_column(keys, "key"),
            "attributes": records.binary_column(attributes, "attribute"), "flags": records.flags_column(flags, n),
            "headers": records.headers_column(headers, n), "timestamps": records.timestamps_column(timestamps, n)}
