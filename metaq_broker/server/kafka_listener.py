"""The Kafka listener: Kafka's wire protocol on ``kafkaPort``, one more framing on a ``Listener``
(``listener.py``: accepting, TLS, the login stage, a thread per connection, deadlines) that calls the one
``RequestHandler`` (``handler.py``): a new listener adds framing, not a second broker.

Per request: ``protocol/kafka/protocol.py`` parses the frame, a method here turns the body into the
handler's calls (or the cluster snapshot's answers, ``kafka_metadata.py``, or the group coordinator's,
``kafka_groups.py``), and the answer is encoded at the version asked for. A failure is answered with
``codes.code_of(handler.refusal(...))`` in the fields the answer has for it; a frame that cannot be read
closes the connection (Kafka does the same). Requests of one connection are answered in order, as
Kafka's broker answers them; a Produce request is appended as it is read and its answer waits for the
acknowledgement while the next requests are read and appended (``kafka_pipeline.py``), so a client's
pipelined requests share one group commit.

Records: a Produce partition's Kafka batches become one metaq batch (``protocol/kafka/records.decode``,
then ``protocol/records.encode_body``: columns, no loop per record) stored by
``RequestHandler.append_encoded`` and ``acknowledge``; a Fetch's metaq batches are decoded (aborted
transactions and markers left out) and written as Kafka batches
(``protocol/kafka/records.encode``), one per run of messages with the same timestamp type (and, for
LogAppendTime, the same store time). Offsets metaq leaves out at the end of a fetched range (markers,
aborted transactions) are covered by one Kafka control batch, which every Kafka consumer skips, so a
consumer moves past them instead of asking for the same offset again. docs/kafka.md gives the mapping.

Lock order: none held across calls; each connection's state is its own thread's, but for its produce
requests in flight (``kafka_pipeline.InFlight``, which has its own).
"""
from __future__ import annotations

import logging
import struct
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Callable, Optional

import numpy as np
import pyarrow as pa

from metaq_broker.errors import (AuthenticationError, ConfigError, InvalidPartitionError, NotMasterError,
                                 UnknownTopicError)
from metaq_broker.names import parse_partition_name
from metaq_broker.protocol import rawput
from metaq_broker.protocol import records as mrecords
from metaq_broker.protocol.kafka import codes
from metaq_broker.protocol.kafka import records as krecords
from metaq_broker.protocol.kafka.framing import FrameSplitter, FrameTooLargeError
from metaq_broker.protocol.kafka.protocol import (KafkaRequestError, Request, api_versions_response,
                                                  encode_response, error_response, read_request)
from metaq_broker.security.acl import CLUSTER
from metaq_broker.server import kafka_admin, kafka_metadata
from metaq_broker.zk.kafka_cluster import node_id
from metaq_broker.zk.kafka_partitions import uuid_to_str
from metaq_broker.server.handler import FetchRequest, OffsetQuery, RequestHandler
from metaq_broker.server.kafka_pipeline import InFlight
from metaq_broker.server.listener import GO_ON, Connection, Limits, Listener, Step
from metaq_broker.store import validate_topic_name

log = logging.getLogger(__name__)

# The Kafka listener's limits (docs/security.md, "Limits"): Kafka's connections.max.idle.ms is 10 minutes
LOGIN_TIMEOUT_S = 10.0
MAX_UNAUTHENTICATED = 64
REQUEST_TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 600.0
SEND_TIMEOUT_S = 60.0
LIMITS = Limits(LOGIN_TIMEOUT_S, MAX_UNAUTHENTICATED, REQUEST_TIMEOUT_S, IDLE_TIMEOUT_S, SEND_TIMEOUT_S)
READ_CHUNK = 256 << 10  # bytes read per recv
DIRECT_READ = 64 << 10  # a partial request with at least this much to come is read into its own buffer
SASL_MAX_FRAME = 64 << 10  # a request before the login (ApiVersions, SASL) is small: no buffer grows larger
EARLIEST, LATEST, MAX_TIMESTAMP, EARLIEST_LOCAL = -2, -1, -3, -4  # ListOffsets' special timestamps
READ_COMMITTED = 1
PRODUCE = 0  # the api key of Produce: appended at once, answered once acknowledged (kafka_pipeline.py)
_CONTROL_KEY = struct.pack(">hh", 0, 1)  # a control record: version 0, type 1 (COMMIT)
_CONTROL_VALUE = struct.pack(">hi", 0, 0)  # version 0, coordinator epoch 0


def kafka_listener(host: str, port: int, auth, request_timeout_s: float = REQUEST_TIMEOUT_S) -> Listener:
    """The Kafka listener on ``host:port`` (0: any free port), listening, not serving yet: TLS unless the
    broker's ``security.protocol`` is PLAINTEXT."""
    limits = replace(LIMITS, request_timeout_s=request_timeout_s)  # the broker's requestTimeout
    return Listener("kafka", host, port, limits, auth.data_port_context(),
                    sessions=auth if auth.security.uses_sasl else None)


class KafkaServer:
    """Kafka's framing on ``listener`` (``kafka_listener``). ``cluster()`` gives the current
    ``ClusterSnapshot`` (``KafkaClusterCache.snapshot``, or a static one without ZooKeeper); ``groups`` is
    the broker's ``KafkaGroups`` (None without ZooKeeper: no consumer groups); ``config`` the broker's
    ``BrokerConfig``, which DescribeConfigs of the broker describes."""

    def __init__(self, handler: RequestHandler, listener: Listener, cluster: Callable, groups=None,
                 auto_create: bool = False, config=None, deletions=None):
        self.handler = handler
        self.listener = listener
        self.port = listener.port
        self.cluster = cluster
        self.groups = groups
        self.auto_create = auto_create  # autoCreateTopics: Metadata creates the unknown topics it names
        self.broker_id = handler.broker_id
        self.node_id = node_id(self.broker_id, config.replica_id if config is not None else 0)  # this member's
        self.config = config  # the broker's BrokerConfig: DescribeConfigs of the broker resource
        self.deletions = deletions  # the broker's TopicDeletions (None without ZooKeeper: deleted at once)
        security = handler.auth.security
        self._sasl = security.uses_sasl
        self._certificates = security.client_auth == "required"
        self.max_frame = max(handler.limits.max_put_bytes, 1 << 20)
        self._apis = {0: self.produce, 1: self.fetch, 2: self.list_offsets, 3: self.metadata,
                      8: self._group_call("offset_commit"), 9: self._group_call("offset_fetch"),
                      10: self.find_coordinator, 11: self.join_group, 12: self._group_call("heartbeat"),
                      13: self._group_call("leave_group"), 14: self.sync_group,
                      15: self._group_call("describe_groups"), 16: self._group_call("list_groups"),
                      17: self.sasl_again, 18: self.api_versions, 19: self.create_topics,
                      20: self.delete_topics,
                      22: self.init_producer_id, 23: self.offset_for_leader_epoch, 32: self.describe_configs,
                      36: self.sasl_again, 37: self.create_partitions,
                      42: self._group_call("delete_groups"), 60: self.describe_cluster}

    def start(self) -> "KafkaServer":
        self.listener.start(self, krecords.warm_up)  # the compiled record walks, at the first connection
        return self

    def stop(self, grace: float = 5.0) -> None:
        self.listener.stop(grace)

    # -- Framing --------------------------------------------------------------------------------------
    def login(self, conn: Connection) -> "_Login":
        return _Login(self, conn)

    def serve(self, conn: Connection, login: "_Login") -> None:
        splitter, frames = login.splitter, login.frames
        buf = memoryview(bytearray(READ_CHUNK))
        deadline = conn.deadline()
        in_flight = InFlight(f"metaq-kafka-{conn.peer}", conn.sock, threaded=not conn.tls)
        try:
            while conn.active:
                for frame in frames:
                    if not self._serve_one(conn, frame, in_flight):
                        return
                if frames and splitter.buffered:  # a request's first bytes came with the last read
                    deadline = conn.deadline()
                in_flight.before_read()
                room = splitter.room()  # a large request's rest is read straight into its own buffer
                into = room if room is not None and len(room) >= DIRECT_READ else buf
                n, deadline = conn.read_next(into, splitter.buffered, deadline)  # buffered: that request's rest
                if not n:
                    return
                frames = splitter.received(n) if into is room else splitter.feed(buf[:n])
        except FrameTooLargeError as e:
            self.listener.log_once(("frame", conn.peer[0]), logging.WARNING, "kafka: closing a connection from %s: "
                                   "%s", conn.peer, e)
        finally:
            in_flight.close()

    def _serve_one(self, conn: Connection, frame, in_flight: InFlight) -> bool:
        """Answer one request frame; False: close the connection. A Produce request is appended now and
        answered by ``in_flight`` once acknowledged (``kafka_pipeline``); any other waits for the answers
        before it."""
        start = time.perf_counter()
        try:
            request = read_request(frame)
        except KafkaRequestError as e:
            self.listener.log_once(("request", conn.peer[0]), logging.INFO, "kafka: %s from %s", e, conn.peer)
            if e.reply is None:
                return False
            in_flight.drain()
            conn.send(b"".join(e.reply))
            return True
        conn.replying()
        if request.api_key == PRODUCE:
            try:
                finish = self.append_produce(conn, request)
            except Exception as e:  # noqa: BLE001 - answered in its place, in the request's layout
                refused = self._refused(request, e)
                finish = lambda: refused  # noqa: E731

            def answer(send: bool) -> None:
                body = self._guarded(request, finish)
                self.handler.observe("KafkaProduce", time.perf_counter() - start)
                if send and request.expects_response:
                    conn.send(b"".join(encode_response(request, body)))
            in_flight.add(answer)
            return True
        in_flight.drain()
        body = self.answer(conn, request)
        self.handler.observe(f"Kafka{request.api.name}", time.perf_counter() - start)
        if request.expects_response:
            conn.send(b"".join(encode_response(request, body)))
        return True

    def answer(self, conn: Connection, request: Request) -> dict:
        """The response body to ``request``: its API's method, or the error it raised in the answer's error
        fields (``handler.refusal`` logs what is unexpected)."""
        return self._guarded(request, lambda: self._apis.get(request.api_key, self.unsupported)(conn, request))

    def _guarded(self, request: Request, call: Callable):
        """``call()``, or the error it raised as ``request``'s answer."""
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - every failure is answered in the request's layout
            return self._refused(request, e)

    def _refused(self, request: Request, e: Exception) -> dict:
        error = self.handler.refusal(e, f"Kafka {request.api.name}")
        return error_response(request, codes.code_of(error), str(error))

    # -- helpers --------------------------------------------------------------------------------------
    def _allows(self, conn: Connection) -> Callable:
        auth, principal = self.handler.auth, conn.principal
        return lambda operation, resource_type, name: auth.allows(principal, operation, resource_type, name)

    def _local(self, snap, topic: Optional[str], number: int) -> int:
        """metaq's partition ``n`` of this broker for Kafka's partition ``number`` of ``topic``; raises what
        a client must be told (unknown, or led by another broker)."""
        if topic is None:
            raise UnknownTopicError("unknown topic id")
        tmap = snap.maps.get(topic)
        name = tmap.name_of(number) if tmap is not None else None
        if name is None:
            if topic not in self.handler.store.topics() and topic not in snap.topics:
                raise UnknownTopicError(f"unknown topic {topic!r}")
            raise InvalidPartitionError(f"topic {topic!r} has no partition {number}")
        broker_id, n = parse_partition_name(name)
        if broker_id != self.broker_id:
            raise NotMasterError(f"not master: partition {number} of {topic!r} is broker {broker_id}'s "
                                 f"({name}), not this one's ({self.broker_id})")
        return n

    @staticmethod
    def _topic_name(snap, t: dict, key: str, version: int, by_id_from: int) -> Optional[str]:
        return t[key] if version < by_id_from else snap.topic_by_id(t["topic_id"])

    def _code(self, e: BaseException, what: str) -> tuple:
        error = self.handler.refusal(e, what)
        return codes.code_of(error), str(error)

    # -- ApiVersions, Metadata, DescribeCluster, SASL after login --------------------------------------
    def api_versions(self, conn, request: Request) -> dict:
        return api_versions_response(request)

    def unsupported(self, conn, request: Request) -> dict:
        return error_response(request, codes.UNSUPPORTED_VERSION,
                              f"{request.api.name} is not supported by this broker yet (docs/kafka.md)")

    def sasl_again(self, conn, request: Request) -> dict:
        return error_response(request, codes.ILLEGAL_SASL_STATE, "this connection is authenticated already"
                              if self._sasl else "this listener takes no SASL (security.protocol has none)")

    def metadata(self, conn, request: Request) -> dict:
        snap = self.cluster()
        asked = request.body["topics"]
        created = self._auto_create(conn, snap, asked) if asked and request.body.get(
            "allow_auto_topic_creation", True) else set()
        answer = kafka_metadata.metadata(snap, asked)
        allows = self._allows(conn)
        topics = []
        for t in answer["topics"]:
            if t["name"] in created and t["error_code"] == codes.UNKNOWN_TOPIC_OR_PARTITION:
                t = {**t, "error_code": codes.LEADER_NOT_AVAILABLE}  # created, not numbered yet: the client retries
            if t["error_code"] in (codes.UNKNOWN_TOPIC_OR_PARTITION, codes.INVALID_TOPIC_EXCEPTION) \
                    or allows("Describe", "topic", t["name"]):
                topics.append(t)
            elif asked is not None:  # a topic named but not describable: refused; unnamed ones are left out
                topics.append({**t, "error_code": codes.TOPIC_AUTHORIZATION_FAILED, "partitions": []})
        answer["topics"] = topics
        return answer

    def _auto_create(self, conn, snap, asked) -> set:
        """With ``autoCreateTopics``: create the named topics no broker has, here, with the broker's
        numPartitions (Create on the cluster or the topic, as CreateTopics); the names created."""
        if not self.auto_create:
            return set()
        created = set()
        for t in asked:
            name = t.get("name")
            if not name or name in snap.topics or name in self.handler.store.topics():
                continue
            try:
                self.handler.create_topic(conn.principal, name, 0, {}, automatic=True)
                created.add(name)
                log.info("kafka: created topic %s for a Metadata request of %s (autoCreateTopics)", name, conn.peer)
            except Exception as e:  # noqa: BLE001 - the topic is answered as unknown (or refused) below
                log.info("kafka: could not create topic %r for %s: %s", name, conn.principal, e)
        return created

    def describe_cluster(self, conn, request: Request) -> dict:
        self.handler.auth.authorize(conn.principal, "Describe", "cluster", CLUSTER)
        return kafka_metadata.describe_cluster(self.cluster(), request.body.get("endpoint_type", 1))

    # -- producing ------------------------------------------------------------------------------------
    def init_producer_id(self, conn, request: Request) -> dict:
        b = request.body
        if b["transactional_id"] is not None:
            log.info("kafka: refused InitProducerId with transactional.id %r from %s: %s", b["transactional_id"],
                     conn.peer, kafka_metadata.TRANSACTIONS_REFUSED)
            return {"throttle_time_ms": 0, "error_code": codes.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                    "producer_id": -1, "producer_epoch": -1}
        pid, epoch = b.get("producer_id", -1), b.get("producer_epoch", -1)
        pid, epoch = self.handler.init_producer_id(conn.principal, pid if pid >= 0 else None,
                                                   epoch if epoch >= 0 and pid >= 0 else None)
        return {"throttle_time_ms": 0, "error_code": codes.NONE, "producer_id": pid, "producer_epoch": epoch}

    def produce(self, conn, request: Request) -> dict:
        return self.append_produce(conn, request)()

    def append_produce(self, conn, request: Request) -> Callable[[], dict]:
        """Append a Produce request's batches now, partition by partition in the request's order; the call
        returned waits for their acknowledgements (``RequestHandler.acknowledge``) and gives the answer."""
        b = request.body
        if b["transactional_id"] is not None:
            refused = error_response(request, codes.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                                     kafka_metadata.TRANSACTIONS_REFUSED)
            return lambda: refused
        acks = b["acks"]
        if acks not in (0, 1, -1):
            refused = error_response(request, codes.INVALID_REQUIRED_ACKS,
                                     f"acks {acks}: Kafka's acks are 0, 1 and -1 (all)")
            return lambda: refused
        acks = rawput.ACKS_ALL if acks == -1 else rawput.ACKS_ONE  # acks=0 waits too; nobody is told
        snap = self.cluster()
        responses, appended = [], []
        for t in b["topic_data"]:
            topic = self._topic_name(snap, t, "name", request.api_version, 13)
            parts = []
            for p in t["partition_data"]:
                out = {"index": p["index"], "error_code": codes.NONE, "base_offset": -1, "log_append_time_ms": -1,
                       "log_start_offset": -1, "record_errors": [], "error_message": None}
                try:
                    appended.append((out,) + self._append_partition(conn, snap, topic, p["index"], p["records"], acks))
                except Exception as e:  # noqa: BLE001 - each partition gets its own answer
                    out["error_code"], out["error_message"] = self._code(e, "Kafka Produce")
                parts.append(out)
            responses.append({"name": t.get("name", ""), "topic_id": t.get("topic_id", bytes(16)),
                              "partition_responses": parts})

        def acknowledged() -> dict:
            for out, done, log_append in appended:
                try:
                    r = self.handler.acknowledge(done)
                    out.update(base_offset=r.base_offset, log_append_time_ms=r.timestamp_ms if log_append else -1)
                except Exception as e:  # noqa: BLE001 - each partition gets its own answer
                    out["error_code"], out["error_message"] = self._code(e, "Kafka Produce")
            return {"responses": responses, "throttle_time_ms": 0}
        return acknowledged

    def _append_partition(self, conn, snap, topic, index: int, data, acks: int) -> tuple:
        """(``Appended``, whether the batches ask for LogAppendTime) of one partition's records."""
        n = self._local(snap, topic, index)
        if data is None:
            raise krecords.KafkaRecordError("a partition without records", codes.INVALID_RECORD)
        batches = krecords.decode(data)
        body, producer = to_metaq(batches)
        appended = self.handler.append_encoded(conn.principal, rawput.Request(topic, n, "", None, acks, producer), body)
        return appended, bool(batches.attributes_any & krecords.TIMESTAMP_TYPE)

    # -- fetching -------------------------------------------------------------------------------------
    def fetch(self, conn, request: Request) -> dict:
        b, version = request.body, request.api_version
        snap = self.cluster()
        committed = b.get("isolation_level", 0) == READ_COMMITTED
        budget = b.get("max_bytes") or (1 << 20)
        asked = []  # (topic entry index, partition dict, topic, local partition or the error's answer)
        responses = []
        for t in b["topics"]:
            topic = self._topic_name(snap, t, "topic", version, 13)
            responses.append({"topic": t.get("topic", ""), "topic_id": t.get("topic_id", bytes(16)), "partitions": []})
            for p in t["partitions"]:
                try:
                    if topic is None:
                        raise _Refused(codes.UNKNOWN_TOPIC_ID, "unknown topic id")
                    local = self._local(snap, topic, p["partition"])
                except _Refused as e:
                    local = e
                except Exception as e:  # noqa: BLE001
                    local = _Refused(*self._code(e, "Kafka Fetch"))
                asked.append((len(responses) - 1, p, topic, local))
        deadline = time.monotonic() + max(b["max_wait_ms"], 0) / 1000
        min_bytes = max(b["min_bytes"], 0)
        waiting = [i for i, a in enumerate(asked) if not isinstance(a[3], _Refused)]
        while True:
            results = self._fetch_round(conn, asked, committed, budget)
            got = sum(r[1] for r in results)
            left_ms = int((deadline - time.monotonic()) * 1000)
            if got >= max(min_bytes, 1) or left_ms <= 0 or not waiting or not conn.active \
                    or any(r[0]["error_code"] for r in results):
                break
            # Not enough yet: one wait on every asked partition for data past what this round saw
            wanted = [(asked[i][2], asked[i][3], max(asked[i][1]["fetch_offset"], results[i][0]["high_watermark"]))
                      for i in waiting]
            try:
                self.handler.wait_for_any(conn.principal, wanted, left_ms, lambda: conn.active)
            except Exception:  # noqa: BLE001 - answered by the next round's fetch of that partition
                pass
        for (t_index, _, _, _), (entry, _) in zip(asked, results):
            responses[t_index]["partitions"].append(entry)
        return {"throttle_time_ms": 0, "error_code": codes.NONE, "session_id": 0, "responses": responses}

    def _fetch_round(self, conn, asked: list, committed: bool, budget: int) -> list:
        """Each asked partition's (answer, record bytes), in order, within the request's ``max_bytes``
        (the first partition with records gets at least one batch, as Kafka's KIP-74)."""
        results = []
        for _, p, topic, local in asked:
            entry = self._fetch_partition(conn, topic, local, p, committed, max(budget, 1)) if budget > 0 \
                else (self._empty_partition(p, committed), 0)
            budget -= entry[1]
            results.append(entry)
        return results

    @staticmethod
    def _empty_partition(p: dict, committed: bool) -> dict:
        return {"partition_index": p["partition"], "error_code": codes.NONE, "high_watermark": -1,
                "last_stable_offset": -1, "log_start_offset": -1,
                "aborted_transactions": [] if committed else None, "preferred_read_replica": -1, "records": b""}

    def _fetch_partition(self, conn, topic, local, p: dict, committed: bool, budget: int) -> tuple:
        """(the partition's answer, its record bytes)."""
        out = self._empty_partition(p, committed)
        if isinstance(local, _Refused):
            out["error_code"] = local.code
            return out, 0
        try:
            max_bytes = max(min(p["partition_max_bytes"], budget), 1)
            f = self.handler.fetch(conn.principal, FetchRequest(topic, local, p["fetch_offset"], max_bytes),
                                   lambda: conn.active)
        except Exception as e:  # noqa: BLE001
            out["error_code"] = self._code(e, "Kafka Fetch")[0]
            return out, 0
        out.update(high_watermark=f.last_stable_offset, last_stable_offset=f.last_stable_offset,
                   log_start_offset=f.earliest_offset)
        result = f.records
        if result.end_offset > result.start_offset:
            data = to_kafka(result)
            out["records"] = data
            return out, len(data)
        return out, 0

    def list_offsets(self, conn, request: Request) -> dict:
        b = request.body
        snap = self.cluster()
        committed = b.get("isolation_level", 0) == READ_COMMITTED
        topics = []
        for t in b["topics"]:
            parts = []
            for p in t["partitions"]:
                parts.append(self._list_offset(conn, snap, t["name"], p, committed))
            topics.append({"name": t["name"], "partitions": parts})
        return {"throttle_time_ms": 0, "topics": topics}

    def _list_offset(self, conn, snap, topic: str, p: dict, committed: bool) -> dict:
        out = {"partition_index": p["partition_index"], "error_code": codes.NONE, "old_style_offsets": [],
               "timestamp": -1, "offset": -1, "leader_epoch": -1}
        try:
            n = self._local(snap, topic, p["partition_index"])
            ts = p["timestamp"]
            query = OffsetQuery(topic, n, timestamp_ms=ts if ts >= 0 else None)
            o = self.handler.offsets(conn.principal, [query])[0]
            if ts in (EARLIEST, EARLIEST_LOCAL) or ts < MAX_TIMESTAMP:
                offset = o.earliest
            elif ts in (LATEST, MAX_TIMESTAMP):
                offset = o.latest  # metaq's readers read below the last stable offset, at either isolation
            else:
                offset = o.for_timestamp if o.for_timestamp < o.latest else -1
                if offset >= 0:
                    out["timestamp"] = self._timestamp_at(conn, topic, n, offset, ts)
            out["offset"] = offset
        except Exception as e:  # noqa: BLE001
            out["error_code"] = self._code(e, "Kafka ListOffsets")[0]
        return out

    def _timestamp_at(self, conn, topic: str, n: int, offset: int, asked: int) -> int:
        """The timestamp of the message at ``offset`` (Kafka answers it with the offset found)."""
        f = self.handler.fetch(conn.principal, FetchRequest(topic, n, offset, 1, 1, 0), lambda: True)
        rb = f.records.decode()
        return int(rb.column("timestamp").cast(pa.int64())[0].as_py()) if rb.num_rows else asked

    def offset_for_leader_epoch(self, conn, request: Request) -> dict:
        """A consumer's check after a leader change (KIP-320): metaq numbers offsets in one log per partition
        on every member, so the end offset asked for is the log's end (no divergence to report)."""
        snap = self.cluster()
        topics = []
        for t in request.body["topics"]:
            parts = []
            for p in t["partitions"]:
                out = {"partition": p["partition"], "error_code": codes.NONE, "leader_epoch": -1, "end_offset": -1}
                try:
                    n = self._local(snap, t["topic"], p["partition"])
                    o = self.handler.offsets(conn.principal, [OffsetQuery(t["topic"], n)])[0]
                    out.update(leader_epoch=p["leader_epoch"], end_offset=o.log_end_offset)
                except Exception as e:  # noqa: BLE001
                    out["error_code"] = self._code(e, "Kafka OffsetForLeaderEpoch")[0]
                parts.append(out)
            topics.append({"topic": t["topic"], "partitions": parts})
        return {"throttle_time_ms": 0, "topics": topics}

    # -- topics ---------------------------------------------------------------------------------------
    def create_topics(self, conn, request: Request) -> dict:
        b = request.body
        out = []
        for t in b["topics"]:
            name = t["name"]
            entry = {"name": name, "topic_id": bytes(16), "error_code": codes.NONE, "error_message": None,
                     "num_partitions": -1, "replication_factor": -1, "configs": None}
            try:
                if t["assignments"]:
                    raise _Refused(codes.INVALID_REQUEST, "metaq places a topic's partitions on the broker that "
                                                          "creates it: manual replica assignments are not taken")
                if name in self.handler.store.topics():
                    raise _Refused(codes.TOPIC_ALREADY_EXISTS, f"topic {name!r} already exists")
                configs = {c["name"]: c["value"] for c in t["configs"]}
                count = t["num_partitions"]
                if b.get("validate_only"):
                    self.handler.auth.authorize_any(conn.principal, "Create", [("cluster", CLUSTER),
                                                                               ("topic", name)])
                    validate_topic_name(name)
                else:
                    desc = self.handler.create_topic(conn.principal, name, max(count, 0), configs)
                    entry.update(num_partitions=len(desc.partitions), replication_factor=1)
            except _Refused as e:
                entry.update(error_code=e.code, error_message=e.message)
            except Exception as e:  # noqa: BLE001
                entry["error_code"], entry["error_message"] = self._code(e, "Kafka CreateTopics")
            out.append(entry)
        return {"throttle_time_ms": 0, "topics": out}

    def delete_topics(self, conn, request: Request) -> dict:
        """Delete topics (``handler.delete_topic``: Delete on each; the deletion recorded, carried out by every
        broker), then wait up to the request's timeout_ms for them to be gone from every broker: one that takes
        longer is answered REQUEST_TIMED_OUT and deleted all the same, as Kafka does. By topic id from v6."""
        b, snap = request.body, self.cluster()
        out = kafka_admin.deletions_asked(b, request.api_version)
        recorded = []
        for entry in out:
            try:
                name = entry["name"]
                if name is None:
                    name = entry["name"] = snap.topic_by_id(entry["topic_id"])
                    if name is None:
                        raise _Refused(codes.UNKNOWN_TOPIC_ID, f"unknown topic id {uuid_to_str(entry['topic_id'])}")
                elif name in snap.maps:
                    entry["topic_id"] = snap.maps[name].topic_id
                self.handler.delete_topic(conn.principal, name)
                recorded.append(entry)
            except _Refused as e:
                entry.update(error_code=e.code, error_message=e.message)
            except ConfigError as e:  # a topic of some broker's server.ini, or one that cannot be deleted now
                entry.update(error_code=codes.INVALID_REQUEST, error_message=str(e))
            except Exception as e:  # noqa: BLE001
                entry["error_code"], entry["error_message"] = self._code(e, "Kafka DeleteTopics")
        wait_s = min(b["timeout_ms"], kafka_admin.DELETE_WAIT_MAX_S * 1000) / 1000
        if recorded and self.deletions is not None and wait_s > 0:
            left = self._await_gone([e["name"] for e in recorded], wait_s)
            for entry in recorded:
                if entry["name"] in left:
                    entry.update(error_code=codes.REQUEST_TIMED_OUT,
                                 error_message=f"the deletion of {entry['name']!r} is recorded but not done within "
                                               f"{b['timeout_ms']} ms (a broker that has it is down or busy?): it "
                                               f"goes on")
        return {"throttle_time_ms": 0, "responses": out}

    def _await_gone(self, names: list, wait_s: float) -> set:
        """Wait up to ``wait_s`` for the deletions of ``names`` to be done and this listener's view of the
        cluster to have none of them; the names still there."""
        deadline = time.monotonic() + wait_s
        left = self.deletions.wait_done(names, wait_s)
        while True:
            snap = self.cluster()
            left |= {n for n in names if n in snap.topics or n in snap.maps}
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.05)
            left = self.deletions.wait_done(names, 0)

    def create_partitions(self, conn, request: Request) -> dict:
        """Grow topics (``kafka_admin.partitions_to_add``): the new partitions on this broker, the one Kafka's
        clients send it to (the controller). Alter on the topic."""
        b, snap, out = request.body, self.cluster(), []
        for t in b["topics"]:
            name = t["name"]
            entry = {"name": name, "error_code": codes.NONE, "error_message": None}
            try:
                self.handler.auth.authorize(conn.principal, "Alter", "topic", name)
                here = self.handler.store.topic_config(name).num_partitions \
                    if name in self.handler.store.topics() else None
                add = kafka_admin.partitions_to_add(snap, name, t["count"], t["assignments"], self.broker_id, here)
                self.handler.add_partitions(conn.principal, name, (here or 0) + add, b["validate_only"])
            except _Refused as e:
                entry.update(error_code=e.code, error_message=e.message)
            except Exception as e:  # noqa: BLE001
                entry["error_code"], entry["error_message"] = self._code(e, "Kafka CreatePartitions")
            out.append(entry)
        return {"throttle_time_ms": 0, "results": out}

    def describe_configs(self, conn, request: Request) -> dict:
        """A topic's settings under metaq's names (what ``[topic=...]`` takes), and under Kafka's where one
        means the same (``KAFKA_TOPIC_CONFIGS``); this broker's settings (``kafka_admin.broker_settings``:
        secrets sensitive, without their values), DescribeConfigs on the cluster."""
        results = []
        for r in request.body["resources"]:
            out = {"error_code": codes.NONE, "error_message": None, "resource_type": r["resource_type"],
                   "resource_name": r["resource_name"], "configs": []}
            try:
                keys = r["configuration_keys"]
                if r["resource_type"] == RESOURCE_BROKER:
                    out["configs"] = self._broker_configs(conn, r["resource_name"], keys)
                elif r["resource_type"] != RESOURCE_TOPIC:
                    raise _Refused(codes.INVALID_REQUEST, f"metaq describes topics (2) and brokers (4) only, not "
                                                          f"resource type {r['resource_type']}")
                else:
                    config = self.handler.describe_topic(conn.principal, r["resource_name"]).config
                    values = {**config, **kafka_topic_configs(config)}
                    out["configs"] = [{"name": k, "value": v, "read_only": True, "is_default": False,
                                       "config_source": CONFIG_SOURCE_TOPIC, "is_sensitive": False, "synonyms": [],
                                       "config_type": 0, "documentation": None}
                                      for k, v in sorted(values.items()) if keys is None or k in keys]
            except _Refused as e:
                out.update(error_code=e.code, error_message=e.message)
            except Exception as e:  # noqa: BLE001
                out["error_code"], out["error_message"] = self._code(e, "Kafka DescribeConfigs")
            results.append(out)
        return {"throttle_time_ms": 0, "results": results}

    def _broker_configs(self, conn, name: str, keys) -> list:
        """The configs of broker resource ``name``: this member's node id, its broker id or "" (the one
        answering)."""
        if name not in ("", str(self.broker_id), str(self.node_id)):
            raise _Refused(codes.INVALID_REQUEST, f"this is broker {self.broker_id}: it describes its own settings "
                                                  f"only, not broker {name!r}'s; ask that broker")
        if self.config is None:
            raise _Refused(codes.INVALID_REQUEST, "this listener was started without the broker's configuration")
        self.handler.auth.authorize(conn.principal, "DescribeConfigs", "cluster", CLUSTER)
        return kafka_admin.describe_configs_entries(kafka_admin.broker_settings(self.config, self.port), keys)

    # -- consumer groups ------------------------------------------------------------------------------
    def _no_groups(self, request: Request) -> dict:
        return error_response(request, codes.INVALID_REQUEST, kafka_metadata.GROUPS_WITHOUT_ZOOKEEPER)

    def _group_call(self, method: str):
        def call(conn, request: Request) -> dict:
            if self.groups is None:
                return self._no_groups(request)
            return getattr(self.groups, method)(request.body, request.api_version, allows=self._allows(conn))
        return call

    def find_coordinator(self, conn, request: Request) -> dict:
        if self.groups is None:
            return kafka_metadata.find_coordinator_response(self.cluster(), request.body, request.api_version,
                                                            groups=False)
        return self.groups.find_coordinator(request.body, request.api_version, allows=self._allows(conn))

    def join_group(self, conn, request: Request) -> dict:
        if self.groups is None:
            return self._no_groups(request)
        return _wait(conn, self.groups.join_group(request.body, request.api_version, request.client_id,
                                                  str(conn.peer[0]), allows=self._allows(conn)))

    def sync_group(self, conn, request: Request) -> dict:
        if self.groups is None:
            return self._no_groups(request)
        return _wait(conn, self.groups.sync_group(request.body, request.api_version, allows=self._allows(conn)))


_Refused = kafka_admin.Refused


def _wait(conn: Connection, future) -> dict:
    """A parked JoinGroup or SyncGroup: its answer once the coordinator gives it (the connection's thread
    waits, as Kafka's broker holds the request), or nothing once the connection or the listener ends."""
    while True:
        try:
            return future.result(timeout=0.5)
        except FutureTimeout:
            if not conn.active:
                raise ConnectionError("the listener is stopping") from None


RESOURCE_TOPIC, RESOURCE_BROKER = 2, 4  # DescribeConfigs' resource types
CONFIG_SOURCE_TOPIC = 1  # DYNAMIC_TOPIC_CONFIG: set for this topic


def kafka_topic_configs(config: dict) -> dict:
    """Kafka's names for the topic settings (INI values) that mean the same in metaq."""
    out = {"max.message.bytes": config["maxMessageSize"], "retention.bytes": config["retentionBytes"],
           "min.insync.replicas": config["minInSyncReplicas"], "segment.bytes": config["maxSegmentSize"],
           "cleanup.policy": "delete"}
    policy = config["deletePolicy"].split(",")
    if len(policy) == 2 and policy[1].strip().isdigit():
        out["retention.ms"] = str(int(policy[1]) * 3_600_000)
    return out


# -- records, per batch -----------------------------------------------------------------------------

def to_metaq(batches: krecords.Batches) -> tuple:
    """(``EncodedBody``, the idempotent producer's (id, epoch, base sequence) or None) of a Produce
    partition's decoded Kafka batches: one metaq batch (``Batches.metaq_body``), stored as it is
    (``RequestHandler.append_encoded``: not parsed again). Transactional and control
    batches are refused (Kafka transactions are not supported)."""
    h = batches.header
    if batches.attributes_any & (krecords.TRANSACTIONAL | krecords.CONTROL):
        raise krecords.KafkaRecordError(kafka_metadata.TRANSACTIONS_REFUSED, codes.INVALID_RECORD)
    producer = None
    pids = h["producer_id"]
    if pids[0] >= 0:
        seqs = h["base_sequence"].astype(np.int64)
        if (pids != pids[0]).any() or (h["producer_epoch"] != h["producer_epoch"][0]).any() \
                or (len(seqs) > 1 and (seqs[1:] != (seqs[:-1] + batches.counts[:-1]) % (1 << 31)).any()):
            raise krecords.KafkaRecordError("the batches of one partition come from different producers or "
                                            "their sequences are not consecutive", codes.INVALID_RECORD)
        producer = rawput.check_producer(int(pids[0]), int(h["producer_epoch"][0]), int(seqs[0]))
    body = batches.metaq_body(create_times=not batches.attributes_any & krecords.TIMESTAMP_TYPE)
    return body, producer


def to_kafka(result) -> memoryview:
    """Kafka record batches of a fetch's metaq batches (``FetchResult``), aborted transactions and markers
    left out: a batch per run of the same timestamp type (and, for LogAppendTime, the same store time),
    then a control batch at the range's last offset if metaq left that offset out, so the consumer's next
    fetch starts past it."""
    rb = mrecords.decode(result.data, result.start_offset, result.end_offset, aborted=result.aborted,
                         headers=True, timestamp_type=True)
    last = result.end_offset - 1
    parts = []
    if rb.num_rows:
        offsets = rb.column("offset").to_numpy()
        ts = rb.column("timestamp").cast(pa.int64()).to_numpy()
        tt = rb.column("timestampType").to_numpy()
        change = (tt[1:] != tt[:-1]) | ((tt[1:] == mrecords.LOG_APPEND_TIME) & (ts[1:] != ts[:-1]))
        starts = np.concatenate(([0], np.flatnonzero(change) + 1))
        parts.append(krecords.encode(offsets, ts, rb.column("key"), rb.column("value"), rb.column("headers"),
                                     batch_starts=starts, attributes=np.where(
                                         tt[starts] == mrecords.LOG_APPEND_TIME, krecords.TIMESTAMP_TYPE, 0)))
        if int(offsets[-1]) >= last:
            return parts[0]
        stamp = int(ts[-1])
    else:
        stamp = mrecords.now_ms()
    parts.append(krecords.encode([last], [stamp], [_CONTROL_KEY], [_CONTROL_VALUE], attributes=
                                 krecords.TRANSACTIONAL | krecords.CONTROL, producer_id=-1, producer_epoch=-1))
    return memoryview(b"".join(parts))


# -- the login --------------------------------------------------------------------------------------

class _Login:
    """A new connection's login, fed by the accepting thread. Without SASL the first bytes log it in (as
    its client certificate's principal with ``ssl.client.auth=required``, else ANONYMOUS). With SASL_SSL
    it is Kafka's SASL exchange (KIP-152): ApiVersions answered, then SaslHandshake v1 naming a mechanism
    the broker enables, then SaslAuthenticate rounds (PLAIN: one; SCRAM-SHA-256: two) checked by the
    handler against metaq's users; any other request, a failed round, or a v0 handshake (raw tokens, not
    spoken here) is answered where Kafka answers and the connection closed. ``frames`` then holds the
    requests that came after the login and ``splitter`` the rest."""

    def __init__(self, server: KafkaServer, conn: Connection):
        self.server, self.conn = server, conn
        self.splitter = FrameSplitter(server.max_frame if not server._sasl else SASL_MAX_FRAME)
        self.frames: list = []
        self._buf = memoryview(bytearray(4096))
        self._mechanism: Optional[str] = None
        self._handshake: Optional[str] = None  # the SCRAM exchange's id at the handler

    def buffer(self) -> memoryview:
        return self._buf

    def received(self, n: int) -> Step:
        try:
            frames = self.splitter.feed(self._buf[:n])
        except FrameTooLargeError as e:
            log.debug("kafka: connection from %s refused: %s", self.conn.peer, e)
            return Step(close=True)
        if self.server._certificates and not self.server._sasl:
            try:
                self.conn.principal = self.server.handler.principal_of_certificate(self.conn.peer_certificate())
            except AuthenticationError as e:
                log.info("kafka: connection from %s refused: %s", self.conn.peer, e)
                return Step(close=True)
        if not self.server._sasl:
            self.frames = frames
            self.splitter.max_frame = self.server.max_frame
            return Step(logged_in=True)
        replies = []
        for i, frame in enumerate(frames):
            reply, outcome = self._sasl_step(frame)
            if reply:
                replies.append(reply)
            if outcome is not None:
                if outcome:
                    self.frames = frames[i + 1:]
                    self.splitter.max_frame = self.server.max_frame
                return Step(b"".join(replies), logged_in=outcome, close=not outcome)
        return Step(b"".join(replies)) if replies else GO_ON

    def _sasl_step(self, frame) -> tuple:
        """(bytes to answer, None: go on / True: logged in / False: close)."""
        try:
            request = read_request(frame)
        except KafkaRequestError as e:
            log.info("kafka: connection from %s before login: %s", self.conn.peer, e)
            go_on = e.reply is not None and e.kafka_code == codes.UNSUPPORTED_VERSION  # e.g. ApiVersions v5
            return (b"".join(e.reply) if e.reply else b""), (None if go_on else False)
        key, body = request.api_key, request.body

        def answer(b: dict) -> bytes:
            return b"".join(encode_response(request, b))
        if key == 18:
            return answer(api_versions_response(request)), None
        if key == 17 and self._mechanism is None:
            mechanisms = list(self.server.handler.auth.security.mechanisms)
            if request.api_version < 1:
                return answer({"error_code": codes.ILLEGAL_SASL_STATE, "mechanisms": mechanisms}), False
            if body["mechanism"] not in mechanisms:
                log.info("kafka: %s asked for SASL mechanism %r; enabled: %s", self.conn.peer, body["mechanism"],
                         ", ".join(mechanisms))
                return answer({"error_code": codes.UNSUPPORTED_SASL_MECHANISM, "mechanisms": mechanisms}), False
            self._mechanism = body["mechanism"]
            return answer({"error_code": codes.NONE, "mechanisms": mechanisms}), None
        if key == 36 and self._mechanism is not None:
            return self._authenticate(request, answer)
        log.info("kafka: %s sent %s before authenticating; closing the connection", self.conn.peer, request.api.name)
        return answer(error_response(request, codes.ILLEGAL_SASL_STATE if key in (17, 36) else
                                     codes.SASL_AUTHENTICATION_FAILED,
                                     "authenticate first: SaslHandshake v1, then SaslAuthenticate")), False

    def _authenticate(self, request: Request, answer) -> tuple:
        handler = self.server.handler
        try:
            step = {"mechanism": self._mechanism, "message": bytes(request.body["auth_bytes"]).decode("utf-8")}
            if self._handshake is not None:
                step["handshake"] = self._handshake
            result = handler.authenticate(step)
            token = result.get("session")
            if token is None:  # SCRAM's first round: the server's challenge
                self._handshake = result.get("handshake")
                return answer({"error_code": codes.NONE, "error_message": None,
                               "auth_bytes": result["message"].encode(), "session_lifetime_ms": 0}), None
            session = handler.session(token)
        except (AuthenticationError, UnicodeDecodeError, ValueError, KeyError) as e:
            self.server.listener.log_once(("sasl", self.conn.peer[0]), logging.INFO,
                                          "kafka: SASL %s login from %s failed: %s", self._mechanism, self.conn.peer, e)
            message = str(e) if isinstance(e, AuthenticationError) else f"malformed SASL message: {e}"
            return answer({"error_code": codes.SASL_AUTHENTICATION_FAILED, "error_message": message,
                           "auth_bytes": b"", "session_lifetime_ms": 0}), False
        self.conn.principal, self.conn.session, self.conn.token = session.principal, session, token
        return answer({"error_code": codes.NONE, "error_message": None, "auth_bytes": result["message"].encode(),
                       "session_lifetime_ms": 0}), True
