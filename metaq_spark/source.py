"""``spark.readStream.format("metaq")`` and ``spark.read.format("metaq")``.

Offsets are ``{"topic": {"<brokerId>-<n>": next offset}}`` with sorted keys, so Spark's checkpoint is
the truth and a replayed batch reads exactly the same rows. The driver plans with one offsets call per
broker and topic; each task fetches its range from the partition's broker through the client library
and yields Arrow batches (no Python loop per message)."""
from __future__ import annotations

import logging
import time
import uuid
from typing import Iterator, Optional

import grpc
import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (ReadAllAvailable, ReadLimit, ReadMaxBytes, ReadMaxRows, ReadMinRows,
                                              SupportsTriggerAvailableNow)

from metaq_broker import records
from metaq_broker.client.connection import BrokerError, ConnectionPool, RemoteOffsetOutOfRangeError, to_error
from metaq_broker.client.dataconn import DataConnectionPool
from metaq_broker.dataport import ProtocolError
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.zkpaths import parse_partition_name

from .group_commit import MARKER, RECORDER, mark, unmark
from .options import EARLIEST, LATEST, OptionError, SourceOptions, parse

log = logging.getLogger(__name__)

SCHEMA = ("key binary, value binary, topic string, partition string, offset long, timestamp timestamp, "
          "msgId long, flag int, attribute string")


class DataLossError(RuntimeError):
    """Offsets the query needs are gone (retention removed them, a partition vanished, or its broker lost
    messages the query had already passed)."""


class PartitionUnavailableError(RuntimeError):
    """A partition's broker is registered but down, so its starting offset cannot be chosen."""


def _names(partitions) -> str:
    """``[(topic, partition)]`` as "topic 1-0 (broker 1), ..." for messages."""
    return ", ".join(f"{t} {p} (broker {parse_partition_name(p)[0]})" for t, p in partitions)


class MetaqDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "metaq"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema) -> "MetaqBatchReader":
        return MetaqBatchReader(parse(self.options, streaming=False))

    def streamReader(self, schema) -> "MetaqStreamReader":
        return MetaqStreamReader(parse(self.options, streaming=True))

    def writer(self, schema, overwrite: bool):
        """``df.write.format("metaq")``: see ``metaq_spark.sink``."""
        from .sink import writer
        return writer(self.options, schema, streaming=False)

    def streamWriter(self, schema, overwrite: bool):
        """``df.writeStream.format("metaq")``: exactly once by default, see ``metaq_spark.sink``."""
        from .sink import writer
        return writer(self.options, schema, streaming=True)


# -- driver side --------------------------------------------------------------------------------------

class Planner:
    """What the driver asks the cluster: the subscribed partitions, their offset ranges, addresses."""

    def __init__(self, opts: SourceOptions):
        from metaq_broker.client.consumer import Consumer
        self.opts = opts
        self.consumer = Consumer(zk_connect=opts.zk_connect, zk_root=opts.zk_root, group=opts.group)

    def partitions(self, registered: bool = False) -> dict:
        """{topic: [partition names]} subscribed: on live brokers, or (``registered``) every partition the
        topics have, also those whose broker is down now (assign: as given)."""
        if self.opts.assign is not None:
            return {t: list(ps) for t, ps in self.opts.assign.items()}
        match = self.opts.topic_matcher()
        listing = self.consumer.cluster.registered_partitions if registered else self.consumer.cluster.topic_partitions
        out = {}
        for topic in self.consumer.cluster.topics():
            if match(topic):
                parts = [f"{b}-{n}" for b, n in listing(topic)]
                if parts:
                    out[topic] = parts
        return out

    def ranges(self, timestamp_ms: Optional[int] = None) -> dict:
        """{topic: {partition: (earliest, latest[, for_timestamp])}} of partitions on live brokers; one
        call per broker and topic."""
        return {t: self.consumer.offsets(t, ps, timestamp_ms=timestamp_ms) for t, ps in self.partitions().items()}

    def initial_ranges(self) -> dict:
        """``ranges()`` of every registered partition of the subscription, for a query's first offsets: a
        partition whose broker is registered but down is waited for (up to ``fetchTimeoutMs``), as its
        offsets cannot be chosen without it; then the query fails naming it (``failOnDataLoss=false``: it
        is left out with a warning and read from its earliest offset once its broker is back)."""
        deadline = time.monotonic() + self.opts.fetch_timeout_ms / 1000
        warned = False
        while True:
            wanted = self.partitions(registered=True)
            self._check_assigned(wanted)
            down = sorted({(t, p) for t, ps in wanted.items() for p in ps if not self.broker_alive(p)})
            if not down or time.monotonic() > deadline:
                break
            if not warned:
                log.warning("waiting up to fetchTimeoutMs=%d for the brokers of %s to choose the starting offsets",
                            self.opts.fetch_timeout_ms, _names(down))
                warned = True
            time.sleep(0.2)
        if down:
            message = (f"cannot choose the starting offsets of {_names(down)}: their brokers are registered but "
                       f"have been down for fetchTimeoutMs={self.opts.fetch_timeout_ms}")
            if self.opts.fail_on_data_loss:
                raise PartitionUnavailableError(message + "; start them, or set failOnDataLoss=false to start "
                                                "without these partitions (read from their earliest once back)")
            log.warning("%s; starting without them", message)
            wanted = {t: [p for p in ps if (t, p) not in down] for t, ps in wanted.items()}
        return {t: self.consumer.offsets(t, ps) for t, ps in wanted.items() if ps}

    def _check_assigned(self, wanted: dict) -> None:
        """An assigned partition that the topic does not have is a bad option, not a broker to wait for."""
        if self.opts.assign is None:
            return
        for topic, parts in wanted.items():
            have = {f"{b}-{n}" for b, n in self.consumer.cluster.registered_partitions(topic)}
            missing = [p for p in parts if p not in have]
            if missing:
                raise OptionError(f"option assign: topic {topic} has no partition {', '.join(missing)}"
                                  + (f" (it has {', '.join(sorted(have, key=parse_partition_name))})" if have
                                     else " (no broker registered the topic)"))

    def broker_alive(self, partition: str) -> bool:
        return parse_partition_name(partition)[0] in self.consumer.cluster.brokers()

    def address(self, partition: str, wait: float = 30.0) -> str:
        """The partition's broker address; waits a while for a broker that is restarting."""
        bid, _ = parse_partition_name(partition)
        deadline = time.monotonic() + wait
        while (addr := self.consumer.cluster.brokers().get(bid)) is None:
            if time.monotonic() > deadline:
                raise DataLossError(f"broker {bid} of partition {partition} has not been alive for {wait:.0f}s")
            time.sleep(0.2)
        return addr

    def data_address(self, partition: str) -> Optional[str]:
        """The partition's broker's data port, if it registered one (else tasks fetch with FetchRaw)."""
        return self.consumer.cluster.data_address(parse_partition_name(partition)[0])

    def offsets_at(self, topic: str, partitions, timestamp_ms: int) -> dict:
        """{partition: first offset at or after ``timestamp_ms``} (the latest where there is none)."""
        return {p: r[2] for p, r in self.consumer.offsets(topic, partitions, timestamp_ms=timestamp_ms).items()}

    def close(self) -> None:
        self.consumer.close()


def _sorted(offsets: dict) -> dict:
    return {t: {p: int(offsets[t][p]) for p in sorted(offsets[t], key=parse_partition_name)}
            for t in sorted(offsets) if offsets[t]}


def resolve_start(opts: SourceOptions, planner: Planner, ranges: dict) -> dict:
    """Starting offsets of every partition in ``ranges`` (``Planner.initial_ranges``) from startingOffsets /
    startingTimestamp / startingOffsetsByTimestamp; a partition these do not name starts at its earliest."""
    out = {t: {p: r[0] for p, r in parts.items()} for t, parts in ranges.items()}
    if opts.starting_timestamp is not None or opts.starting_by_timestamp is not None:
        for topic, parts in ranges.items():
            if opts.starting_timestamp is not None:
                wanted = {p: opts.starting_timestamp for p in parts}
            else:
                wanted = {p: ts for p, ts in opts.starting_by_timestamp.get(topic, {}).items() if p in parts}
            for ts in sorted(set(wanted.values())):  # one call per broker for each distinct time
                same = [p for p, t in wanted.items() if t == ts]
                for p, offset in planner.offsets_at(topic, same, ts).items():
                    if offset >= ranges[topic][p][1] and opts.timestamp_strategy == "error":
                        raise OptionError(f"no message at or after timestamp {ts} in {topic} {p} "
                                          f"(startingOffsetsByTimestampStrategy=error)")
                    out[topic][p] = offset
        return _sorted(out)
    committed = {}
    if opts.starting == "group":
        committed = {t: planner.consumer.committed(t) for t in ranges}
    for topic, parts in ranges.items():
        for p, (earliest, latest) in parts.items():
            if isinstance(opts.starting, dict):
                if topic not in opts.starting or p not in opts.starting[topic]:
                    if opts.assign is None:
                        continue  # documented: from its earliest
                    raise OptionError(f"option startingOffsets: no offset for assigned {topic} {p}")
                want = opts.starting[topic][p]
                value = earliest if want == EARLIEST else latest if want == LATEST else want
            elif opts.starting == "latest":
                value = latest
            elif opts.starting == "group":
                value = committed[topic].get(p, earliest)
            else:
                value = earliest
            out[topic][p] = value
    return _sorted(out)


def check_data_loss(opts: SourceOptions, start: dict, ranges: dict) -> dict:
    """Offsets the query needs that the partition no longer has fail the query, or with
    failOnDataLoss=false move, with a warning, to where the partition's messages are: below its earliest
    (retention removed them) up to the earliest; above its latest (its broker lost messages the query had
    passed: a wiped data directory, a tail lost under ``unflushThreshold>0``) down to the latest, as
    Kafka's source does, so that messages written from then on are read."""
    fixed = {t: dict(ps) for t, ps in start.items()}
    for topic, parts in start.items():
        for p, offset in parts.items():
            have = ranges.get(topic, {}).get(p)
            if have is None:
                message = f"partition {p} of topic {topic} is gone (needed from offset {offset})"
                if opts.fail_on_data_loss:
                    raise DataLossError(message + "; set failOnDataLoss=false to continue without it")
                log.warning("%s; continuing without it", message)
                del fixed[topic][p]
            elif offset < have[0]:
                message = (f"offsets {offset} to {have[0] - 1} of {topic} {p} are gone (retention removed them); "
                           f"the earliest available is {have[0]}")
                if opts.fail_on_data_loss:
                    raise DataLossError(message + "; set failOnDataLoss=false to continue from there")
                log.warning("%s; continuing from %d", message, have[0])
                fixed[topic][p] = have[0]
            elif offset > have[1]:
                message = (f"{topic} {p} went backwards: the query is at offset {offset} but the partition's latest "
                           f"offset is {have[1]} (its broker lost messages: a wiped data directory, or an unflushed "
                           f"tail lost in a crash)")
                if opts.fail_on_data_loss:
                    raise DataLossError(message + f"; set failOnDataLoss=false to continue from offset {have[1]}")
                log.warning("%s; the offset was changed from %d to %d, some data may have been missed",
                            message, offset, have[1])
                fixed[topic][p] = have[1]
    return _sorted(fixed)


class MetaqPartition(InputPartition):
    def __init__(self, topic: str, partition: str, address: str, start: int, end: int, fetch_max_bytes: int,
                 fail_on_data_loss: bool, fetch_timeout_ms: int, data_address: Optional[str] = None):
        super().__init__((topic, partition, start, end))
        self.topic, self.partition, self.address = topic, partition, address
        self.data_address = data_address  # the broker's data port ("host:port"), None: FetchRaw only
        self.start, self.end = start, end
        self.fetch_max_bytes = fetch_max_bytes
        self.fail_on_data_loss = fail_on_data_loss
        self.fetch_timeout_ms = fetch_timeout_ms


def plan_partitions(opts: SourceOptions, planner: Planner, start: dict, end: dict) -> list:
    """One Spark partition per MetaQ partition range, split further to reach minPartitions. Only the
    offsets given count (a replay reads the same rows): a partition missing from ``start`` has no range
    yet (``latestOffset`` records its start first), and one whose end is below its start (its broker lost
    messages, failOnDataLoss=false) reads nothing."""
    ranges = [(t, p, start[t][p], e) for t, parts in end.items() for p, e in parts.items()
              if p in start.get(t, {}) and e > start[t][p]]
    total = sum(e - s for _, _, s, e in ranges)
    pieces = []
    for t, p, s, e in ranges:
        n = 1
        if opts.min_partitions and total and opts.min_partitions > len(ranges):
            n = max(1, round(opts.min_partitions * (e - s) / total))
        bounds = np.linspace(s, e, n + 1).astype(np.int64)
        addr, data_addr = planner.address(p), planner.data_address(p)
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                pieces.append(MetaqPartition(t, p, addr, int(a), int(b), opts.fetch_max_bytes, opts.fail_on_data_loss,
                                             opts.fetch_timeout_ms, data_addr))
    return pieces


# -- executor side ------------------------------------------------------------------------------------

_POOL: Optional[ConnectionPool] = None  # connections reused by every task of one Python worker
_DATA_POOL: Optional[DataConnectionPool] = None  # data port connections, likewise


def _pool() -> ConnectionPool:
    global _POOL
    if _POOL is None:
        _POOL = ConnectionPool()
    return _POOL


def _data_pool() -> DataConnectionPool:
    global _DATA_POOL
    if _DATA_POOL is None:
        _DATA_POOL = DataConnectionPool()
    return _DATA_POOL


def _constant_strings(value: str, n: int) -> pa.Array:
    """A string column holding ``value`` n times, built from buffers (no per-row Python)."""
    data = value.encode()
    offsets = np.arange(n + 1, dtype=np.int32) * len(data)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data * n)])


def to_spark(batch: pa.RecordBatch, topic: str, partition: str) -> pa.RecordBatch:
    n = batch.num_rows
    return pa.RecordBatch.from_arrays(
        [batch.column("key"), batch.column("value"), _constant_strings(topic, n), _constant_strings(partition, n),
         batch.column("offset"), batch.column("timestamp").cast(pa.timestamp("us", tz="UTC")),
         batch.column("msgId"), batch.column("flag"), batch.column("attribute")],
        names=["key", "value", "topic", "partition", "offset", "timestamp", "msgId", "flag", "attribute"])


_RESEND = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}  # the broker is down or restarting


def _fetch(conn, part: MetaqPartition, number: int, offset: int, data=None):
    """Send the fetch of [offset, end) of the partition; ``_reply`` awaits it. With ``data`` (the broker's
    data port, ``_DataPort``) it goes there, else (or when that cannot be sent) as gRPC FetchRaw."""
    request = pb.FetchRequest(topic=part.topic, partition=number, offset=offset, max_bytes=part.fetch_max_bytes,
                              max_messages=part.end - offset)
    if data is not None and data.send(request):
        return request, None
    return request, conn.future("FetchRaw", request, timeout=part.fetch_timeout_ms / 1000)


def _named(error, part: MetaqPartition, request, conn, late: str = ""):
    return type(error)(error.code, f"{part.topic} {part.partition} at offset {request.offset}: {error.details}{late}",
                       conn.address)


def _reply(conn, part: MetaqPartition, request, future, data=None):
    """The fetch reply. While the broker is down or restarting the fetch is sent again (each call waits
    for the connection) for up to ``fetchTimeoutMs`` from when the task started waiting for it; then, or on
    any other refusal, the error names the partition, the offset and the broker. A fetch sent to the data
    port (``future`` None) that finds the port gone is sent again as FetchRaw within the same deadline."""
    deadline = time.monotonic() + part.fetch_timeout_ms / 1000
    if future is None:
        try:
            return data.receive()
        except BrokerError as e:
            if e.code not in _RESEND:
                raise _named(e, part, request, conn) from None
            data.drop(e)  # the broker is stopping: wait for it over gRPC
        future = conn.future("FetchRaw", request, timeout=max(deadline - time.monotonic(), 0.001))
    while True:
        try:
            return future.result()
        except grpc.RpcError as e:
            left = deadline - time.monotonic()
            if e.code() not in _RESEND or left <= 0:
                late = f" (still failing after fetchTimeoutMs={part.fetch_timeout_ms})" if e.code() in _RESEND else ""
                raise _named(to_error(e, conn.address), part, request, conn, late) from None
        time.sleep(min(0.05, left))
        future = conn.future("FetchRaw", request, timeout=max(deadline - time.monotonic(), 0.001))


class _DataPort:
    """A task's use of its broker's data port: one pooled connection, given up for the rest of the task
    (which goes on with FetchRaw) as soon as it fails, so a broker that restarts on another port or a port
    the executor cannot reach costs one failed attempt."""

    def __init__(self, part: MetaqPartition):
        self.part = part
        self.conn = _data_pool().acquire(part.data_address)

    def send(self, request) -> bool:
        if self.conn is None:
            return False
        try:
            self.conn.send(request.topic, request.partition, request.offset, request.max_bytes, request.max_messages,
                           timeout=self.part.fetch_timeout_ms / 1000)
            return True
        except OSError as e:
            self.drop(e)
            return False

    def receive(self):
        """The reply; OSError and ProtocolError (the connection broke) become an UNAVAILABLE BrokerError."""
        try:
            return self.conn.receive(timeout=self.part.fetch_timeout_ms / 1000)
        except (OSError, ProtocolError) as e:
            raise BrokerError(grpc.StatusCode.UNAVAILABLE, f"data port: {type(e).__name__}: {e}",
                              self.conn.address) from None

    def drop(self, reason) -> None:
        if self.conn is not None:
            log.info("%s %s: data port %s failed (%s); fetching with FetchRaw", self.part.topic,
                     self.part.partition, self.conn.address, reason)
            self.conn.close()
            self.conn = None

    def close(self) -> None:
        if self.conn is not None:
            _data_pool().release(self.conn)  # closed instead when a reply is still pending
            self.conn = None


def read_partition(part: MetaqPartition) -> Iterator[pa.RecordBatch]:
    """Every message of [start, end) of one partition, or an error: never a silently short range. The
    next fetch is in flight while the current batch is decoded and handed to Spark."""
    conn = _pool().get(part.address)
    data = _DataPort(part) if getattr(part, "data_address", None) else None
    try:
        yield from _read_partition(part, conn, data)
    finally:
        if data is not None:
            data.close()


def _read_partition(part: MetaqPartition, conn, data) -> Iterator[pa.RecordBatch]:
    _, number = parse_partition_name(part.partition)
    offset = part.start
    pending = _fetch(conn, part, number, offset, data) if offset < part.end else None
    while pending is not None:
        try:
            r = _reply(conn, part, *pending, data)
        except RemoteOffsetOutOfRangeError as e:
            have = conn.call("GetOffsets", pb.GetOffsetsRequest(queries=[
                pb.OffsetQuery(topic=part.topic, partition=number)]), retries=5).offsets[0]
            if offset >= have.earliest:  # above the log end
                _lost_tail(part, offset, have.latest, e)
                return
            message = (f"offsets {offset} to {min(have.earliest, part.end) - 1} of {part.topic} {part.partition} "
                       f"are gone (retention removed them)")
            if part.fail_on_data_loss:
                raise DataLossError(message + "; set failOnDataLoss=false to skip them") from e
            log.warning("%s; skipping to %d", message, have.earliest)
            offset = have.earliest
            pending = _fetch(conn, part, number, offset, data) if offset < part.end else None
            continue
        if r.end_offset <= offset:
            if r.latest_offset <= offset:
                _lost_tail(part, offset, r.latest_offset)
                return
            raise DataLossError(f"{part.topic} {part.partition}: no message at offset {offset}, but the batch "
                                f"needs up to {part.end} (the partition's latest is {r.latest_offset})")
        offset = r.end_offset
        pending = _fetch(conn, part, number, offset, data) if offset < part.end else None
        yield to_spark(records.decode(r.records, r.start_offset, r.end_offset, verify=True), part.topic,
                       part.partition)


def _lost_tail(part: MetaqPartition, offset: int, latest: int, cause=None) -> None:
    """The partition now ends below the range the batch was planned with: its broker lost messages (a
    wiped data directory, an unflushed tail lost in a crash). An error naming both offsets, or with
    failOnDataLoss=false a warning and the rest of the range skipped."""
    message = (f"{part.topic} {part.partition} went backwards: the batch needs offsets {offset} to {part.end - 1} "
               f"but the partition's latest offset is {latest} (its broker lost messages)")
    if part.fail_on_data_loss:
        raise DataLossError(message + "; set failOnDataLoss=false to skip them") from cause
    log.warning("%s; skipping them, some data may have been missed", message)


# -- readers ------------------------------------------------------------------------------------------

class _PlannerMixin:
    """Keeps the driver's ZooKeeper/gRPC clients out of what Spark pickles for the executors."""

    _planner: Optional[Planner] = None

    @property
    def planner(self) -> Planner:
        if self._planner is None:
            self._planner = Planner(self.opts)
        return self._planner

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_planner"] = None
        return state


class MetaqBatchReader(_PlannerMixin, DataSourceReader):
    def __init__(self, opts: SourceOptions):
        self.opts = opts

    def partitions(self):
        ranges = self.planner.initial_ranges()
        start = check_data_loss(self.opts, resolve_start(self.opts, self.planner, ranges), ranges)
        if self.opts.ending_timestamp is not None:
            end = {t: self.planner.offsets_at(t, list(ps), self.opts.ending_timestamp) for t, ps in start.items()}
        elif isinstance(self.opts.ending, dict):
            end = {t: {p: (ranges[t][p][1] if o == LATEST else o) for p, o in ps.items() if p in ranges.get(t, {})}
                   for t, ps in self.opts.ending.items()}
        else:
            end = {t: {p: r[1] for p, r in ps.items()} for t, ps in ranges.items()}
        return plan_partitions(self.opts, self.planner, start, _sorted(end)) or [InputPartition(None)]

    def read(self, partition):
        if partition.value is None:
            return iter(())
        return read_partition(partition)


class MetaqStreamReader(_PlannerMixin, DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, opts: SourceOptions):
        self.opts = opts
        self._available_now: Optional[dict] = None
        self._last_trigger = time.monotonic()
        self._latest: Optional[dict] = None
        self._group: Optional[str] = opts.group

    def _group_of(self, offsets: Optional[dict]) -> str:
        """The query's group: the option, else the one recorded in the checkpoint's offsets (so a restart
        keeps it), else a new one of this query's own (``SourceOptions.default_group``)."""
        if self._group is None:
            carried = (offsets or {}).get(MARKER)
            self._group = carried["group"] if isinstance(carried, dict) and carried.get("group") else \
                self.opts.default_group(uuid.uuid4().hex[:12])
            log.info("the query's offsets are recorded for consumer group %s", self._group)
        return self._group

    def _mark(self, offsets: dict, start: Optional[dict] = None) -> dict:
        return mark(offsets, self.opts.zk_connect, self.opts.zk_root,
                    self._group_of(start) if self.opts.commit_offsets else None)

    def initialOffset(self) -> dict:
        ranges = self.planner.initial_ranges()
        return self._mark(check_data_loss(self.opts, resolve_start(self.opts, self.planner, ranges), ranges))

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_offsets is not None:
            return ReadMaxRows(self.opts.max_offsets)
        if self.opts.max_bytes is not None:
            return ReadMaxBytes(self.opts.max_bytes)
        if self.opts.min_offsets is not None:
            return ReadMinRows(self.opts.min_offsets)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._available_now = {t: {p: r[1] for p, r in ps.items()} for t, ps in self.planner.ranges().items()}

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """The next batch's end. Partitions that appeared since the last batch enter at their earliest
        offset and are read from the next batch on, so every range read starts at a checkpointed offset."""
        marked, start = start, unmark(start)
        ranges = self.planner.ranges()
        self._latest = _sorted({t: {p: r[1] for p, r in ps.items()} for t, ps in ranges.items()})
        # A partition whose broker is down for a moment is not lost: it just has nothing new now.
        paused = {(t, p): o for t, ps in start.items() for p, o in ps.items()
                  if p not in ranges.get(t, {}) and not self.planner.broker_alive(p)}
        checked = check_data_loss(self.opts, _sorted({t: {p: o for p, o in ps.items() if (t, p) not in paused}
                                                      for t, ps in start.items()}), ranges)
        for (t, p), o in paused.items():
            checked.setdefault(t, {})[p] = o
        checked = _sorted(checked)
        cap = self._available_now or self._latest
        target = {t: {p: max(s, min(cap.get(t, {}).get(p, s), ranges.get(t, {}).get(p, (s, s))[1]))
                      for p, s in ps.items()} for t, ps in checked.items()}
        if not isinstance(limit, ReadAllAvailable):
            target = self._limit(checked, target, limit)
        for t, ps in ranges.items():
            for p, r in ps.items():
                if p not in start.get(t, {}):
                    target.setdefault(t, {})[p] = r[0]
        target = _sorted(target)
        if target != start:
            self._last_trigger = time.monotonic()
        return self._mark(target, marked)

    def _limit(self, start: dict, target: dict, limit: ReadLimit) -> dict:
        waiting = {(t, p): target[t][p] - s for t, ps in start.items() for p, s in ps.items()}
        total = sum(waiting.values())
        if isinstance(limit, ReadMinRows) or self.opts.min_offsets is not None:
            min_rows = limit.min_rows if isinstance(limit, ReadMinRows) else self.opts.min_offsets
            overdue = (time.monotonic() - self._last_trigger) * 1000 >= self.opts.max_trigger_delay_ms
            if total < min_rows and not overdue and self._available_now is None:
                return start
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else self.opts.max_offsets
        if max_rows is not None and total > max_rows:
            target = _proportional(start, waiting, max_rows)
            waiting = {(t, p): target[t][p] - s for t, ps in start.items() for p, s in ps.items()}
        max_bytes = limit.max_bytes if isinstance(limit, ReadMaxBytes) else self.opts.max_bytes
        if max_bytes is not None:
            target = self._byte_limit(start, target, waiting, max_bytes)
        return target

    def _byte_limit(self, start: dict, target: dict, waiting: dict, max_bytes: int) -> dict:
        total = sum(waiting.values())
        if not total:
            return target
        out = {t: dict(ps) for t, ps in target.items()}
        by_broker: dict = {}  # one GetOffsets call per broker
        for (t, p), n in waiting.items():
            if n:
                bid, number = parse_partition_name(p)
                share = max(1, max_bytes * n // total)
                by_broker.setdefault(bid, []).append(
                    pb.OffsetQuery(topic=t, partition=number, from_offset=start[t][p], max_bytes=share))
        for bid, queries in by_broker.items():
            reply = self.planner.consumer.connection(bid).call("GetOffsets", pb.GetOffsetsRequest(queries=queries),
                                                              retries=3)
            for o in reply.offsets:
                p = f"{bid}-{o.partition}"
                out[o.topic][p] = min(target[o.topic][p], max(o.after_bytes, start[o.topic][p]))
        if all(out[t][p] == start[t][p] for t, ps in start.items() for p in ps):
            # Progress: a single message larger than the budget still gets read.
            (t, p) = max(waiting, key=waiting.get)
            out[t][p] = start[t][p] + 1
        return out

    def reportLatestOffset(self) -> Optional[dict]:
        return self._latest

    def partitions(self, start: dict, end: dict):
        return plan_partitions(self.opts, self.planner, unmark(start), unmark(end))

    def read(self, partition):
        return read_partition(partition)

    def commit(self, end: dict) -> None:
        """Record the batch's end offsets for the group (Spark calls this one batch late; the listener
        of ``group_commit`` records the last batch too, and whichever writes last, offsets only move
        forward). Never fails or stalls the stream."""
        if self.opts.commit_offsets:
            RECORDER.record(self.opts.zk_connect, self.opts.zk_root, self._group_of(end), unmark(end))

    def stop(self) -> None:
        if self._planner is not None:
            self._planner.close()
            self._planner = None


def _proportional(start: dict, waiting: dict, budget: int) -> dict:
    """Split ``budget`` rows across partitions in proportion to what each has waiting."""
    total = sum(waiting.values())
    keys = sorted(waiting)
    exact = np.array([budget * waiting[k] / total for k in keys])
    share = np.floor(exact).astype(np.int64)
    left = budget - int(share.sum())
    for i in np.argsort(-(exact - share), kind="stable")[:left]:
        share[i] += 1
    out = {t: dict(ps) for t, ps in start.items()}
    for (t, p), s in zip(keys, share):
        out[t][p] = start[t][p] + int(min(s, waiting[(t, p)]))
    return out
