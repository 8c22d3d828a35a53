"""Reading: the batch and the stream reader Spark drives (offsets, read limits, AvailableNow), and on the
executors each task's read of its range through the client's fetcher, yielded as Arrow batches (no Python
loop per message)."""
from __future__ import annotations

import itertools
import logging
import time
import uuid
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)

from metaq_broker.client.connection import ConnectionPool
from metaq_broker.client.dataconn import DataConnectionPool
from metaq_broker.client.fetcher import PartitionFetcher
from metaq_broker.names import parse_partition_name
from metaq_broker.protocol import records
from metaq_broker.protocol.lookup import MAX_ANSWERS, LookupRequest, pack_request, unpack_reply
from metaq_broker.protocol.lookup import PATH as LOOKUP_PATH
from metaq_broker.protocol.status import BrokerUnavailableError, RemoteOffsetOutOfRangeError
from metaq_spark.group_commit import IDENTITIES, MARKER, RECORDER, RESTARTS, identities_in, mark, unmark
from metaq_spark.options import LATEST, SourceOptions
from metaq_spark.pushdown import Pushed, push
from metaq_spark.planning import (DataLossError, MetaqPartition, Planner, UnsettledTransactionError, _proportional,
                                  _sorted, check_data_loss, check_identities, plan_partitions, resolve_start)

log = logging.getLogger(__name__)

_POOLS: dict = {}  # ClientSecurity -> connections reused by every task of one Python worker

_DATA_POOL: Optional[DataConnectionPool] = None  # data port connections, likewise


def _pool(security) -> ConnectionPool:
    pool = _POOLS.get(security)
    if pool is None:
        pool = _POOLS.setdefault(security, ConnectionPool(security=security))
    return pool


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


# The Arrow type Spark expects of the headers column (datasource.HEADERS_FIELD): its names and nullability
_SPARK_HEADERS = pa.list_(pa.field("element", pa.struct([("key", pa.string()), ("value", pa.binary())])))

def _spark_headers(col: pa.Array) -> pa.Array:
    """Record headers as Spark's Kafka source gives them: null for a message without any."""
    col = col.cast(_SPARK_HEADERS)
    offsets = col.offsets.to_numpy()
    empty = (np.diff(offsets) == 0) | (col.is_null().to_numpy(zero_copy_only=False) if col.null_count else False)
    if not empty.any():
        return col
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), col.values, type=_SPARK_HEADERS,
                                    mask=pa.array(empty))


_BUILD = {
    "key": lambda b, topic, partition: b.column("key"),
    "value": lambda b, topic, partition: b.column("value"),
    "topic": lambda b, topic, partition: _constant_strings(topic, b.num_rows),
    "partition": lambda b, topic, partition: _constant_strings(partition, b.num_rows),
    "offset": lambda b, topic, partition: b.column("offset"),
    "timestamp": lambda b, topic, partition: b.column("timestamp").cast(pa.timestamp("us", tz="UTC")),
    "timestampType": lambda b, topic, partition: b.column("timestampType"),
    "msgId": lambda b, topic, partition: b.column("msgId"),
    "flag": lambda b, topic, partition: b.column("flag"),
    "attribute": lambda b, topic, partition: b.column("attribute"),
    "headers": lambda b, topic, partition: _spark_headers(b.column("headers")),  # only with includeHeaders
}
HEADERS = "headers"
COLUMNS = tuple(c for c in _BUILD if c != HEADERS)  # the source's schema, in order (datasource.SCHEMA)


def to_spark(batch: pa.RecordBatch, topic: str, partition: str, columns=COLUMNS) -> pa.RecordBatch:
    """The decoded batch as the query's rows: ``columns`` of the source's schema (all of them, or those of
    a schema the user gave: Spark converts every column it is handed, so fewer columns cost less)."""
    return pa.RecordBatch.from_arrays([_BUILD[c](batch, topic, partition) for c in columns], names=list(columns))


def read_partition(part: MetaqPartition) -> Iterator[pa.RecordBatch]:
    """Every committed message of [start, end) of one partition, or an error: never a silently short
    range. The range is one of offsets: transaction markers and aborted transactions are gaps in it, so
    the read moves by each reply's end offset, never by rows. The next fetch is in flight while the
    current batch is decoded and handed to Spark."""
    _, number = parse_partition_name(part.partition)
    pool = _pool(part.security)
    with PartitionFetcher(pool.get(part.address), part.topic, part.partition, number,
                          part.fetch_timeout_ms / 1000, part.fetch_max_bytes, _data_pool(), part.data_address,
                          "fetchTimeoutMs", _members_in_turn(pool, part)) as fetcher:
        if not _same_log(part, fetcher):
            return
        if part.keys is None and part.msg_ids is None:
            yield from _read_partition(part, fetcher)
        else:
            yield from _look_up(part, fetcher, number)
        _same_log(part, fetcher)  # a wipe while the range was read: the rows may be the new log's


def _same_log(part: MetaqPartition, fetcher: PartitionFetcher) -> bool:
    """Is the partition still the log the range was planned in (its identity)? Not: DataLossError naming
    both identities, or with failOnDataLoss=false a warning and False (the range is not read)."""
    if not part.identity:
        return True
    fetcher.offsets()
    if not fetcher.identity or fetcher.identity == part.identity:
        return True
    message = (f"{part.topic} {part.partition} is another log now (identity {fetcher.identity}; the batch was "
               f"planned in {part.identity}: its broker's data directory was wiped, or the topic was made again); "
               f"offsets {part.start} to {part.end - 1} of the old log cannot be read")
    if part.fail_on_data_loss:
        raise DataLossError(message + "; set failOnDataLoss=false to go on with the new log")
    log.warning("%s; skipping them, the next batch reads the new log", message)
    return False


def _members_in_turn(pool: ConnectionPool, part: MetaqPartition):
    """The fetcher's ``reroute`` for a replicated group: its members one after the other, from the one
    the partition was planned with (the master then); None for a group of one (it waits for its broker)."""
    members = ((part.address, part.data_address),) + tuple(part.other_members)
    if len(members) == 1:
        return None
    turn = itertools.count(1)

    def reroute():
        address, data_address = members[next(turn) % len(members)]
        return pool.get(address), data_address
    return reroute


def _read_partition(part: MetaqPartition, fetcher: PartitionFetcher) -> Iterator[pa.RecordBatch]:
    offset = part.start
    pending = fetcher.send(offset, part.end - offset) if offset < part.end else None
    while pending is not None:
        try:
            r = fetcher.receive(pending)
        except RemoteOffsetOutOfRangeError as e:
            earliest, _, _ = fetcher.offsets()
            if offset >= earliest:  # above the last stable offset
                if not _await_stable(part, fetcher, offset, e):
                    return
                pending = fetcher.send(offset, part.end - offset)
                continue
            message = (f"offsets {offset} to {min(earliest, part.end) - 1} of {part.topic} {part.partition} "
                       f"are gone (retention removed them)")
            if part.fail_on_data_loss:
                raise DataLossError(message + "; set failOnDataLoss=false to skip them") from e
            log.warning("%s; skipping to %d", message, earliest)
            offset = earliest
            pending = fetcher.send(offset, part.end - offset) if offset < part.end else None
            continue
        if r.end_offset <= offset:
            if r.latest_offset <= offset:
                if not _await_stable(part, fetcher, offset):
                    return
                pending = fetcher.send(offset, part.end - offset)
                continue
            raise DataLossError(f"{part.topic} {part.partition}: no message at offset {offset}, but the batch "
                                f"needs up to {part.end} (the partition's latest is {r.latest_offset})")
        offset = r.end_offset
        pending = fetcher.send(offset, part.end - offset) if offset < part.end else None
        columns = part.columns or COLUMNS
        batch = records.decode(r.records, r.start_offset, r.end_offset, verify=True, aborted=r.aborted,
                               headers=HEADERS in columns, timestamp_type="timestampType" in columns)
        if batch.num_rows:  # none: the reply held only markers and aborted messages
            yield to_spark(batch, part.topic, part.partition, columns)


def _look_up(part: MetaqPartition, fetcher: PartitionFetcher, number: int) -> Iterator[pa.RecordBatch]:
    """The messages of the range [start, end) with a pushed key or message id: the broker's lookups
    (``Lookup``, a call per key or id, going on where a full reply stopped), never a read of the range.
    As a range read, it fails (or with failOnDataLoss=false warns) when retention took offsets it needs or
    the partition now ends below the range, and waits for transactions open in it to settle."""
    earliest, latest, _ = fetcher.offsets()
    start = part.start
    if earliest > start:
        message = (f"offsets {start} to {min(earliest, part.end) - 1} of {part.topic} {part.partition} are gone "
                   f"(retention removed them)")
        if part.fail_on_data_loss:
            raise DataLossError(message + "; set failOnDataLoss=false to skip them")
        log.warning("%s; skipping to %d", message, earliest)
        start = earliest
    end = part.end
    while latest < end:  # as a range read: wait for open transactions, or the partition lost its tail
        if not _await_stable(part, fetcher, latest):
            end = latest
            break
        latest = fetcher.offsets()[1]
    if start >= end:
        return
    columns = part.columns or COLUMNS
    what = [("key", k) for k in sorted(part.keys)] if part.keys is not None else \
        [("msg_id", m) for m in sorted(part.msg_ids)]
    found = []
    for name, value in what:
        before = end
        while True:
            request = LookupRequest(part.topic, partitions=(number,), max_answers=MAX_ANSWERS, first={number: start},
                                    before={number: before}, **{name: value})
            batch, complete = _lookup_call(part, request)
            if not batch.num_rows:
                break
            found.append(batch)
            before = int(pc.min(batch.column("offset")).as_py())
            if complete and batch.num_rows < MAX_ANSWERS:  # else: stopped by size or count, go on below
                break
    if found:
        table = pa.Table.from_batches(found)
        table = table.take(pc.sort_indices(table, sort_keys=[("offset", "ascending")])).combine_chunks()
        for batch in table.to_batches():
            yield to_spark(batch, part.topic, part.partition, columns)


def _lookup_call(part: MetaqPartition, request: LookupRequest) -> tuple:
    """One ``Lookup`` on the partition's broker group, at its master: while the member asked is not it (a
    failover), the next member is asked, until fetchTimeoutMs."""
    deadline = time.monotonic() + part.fetch_timeout_ms / 1000
    members = [part.address] + [address for address, _ in part.other_members]
    for turn in itertools.count():
        try:
            return unpack_reply(_pool(part.security).get(members[turn % len(members)]).call(
                LOOKUP_PATH, pack_request(request), retries=3))
        except BrokerUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _await_stable(part: MetaqPartition, fetcher: PartitionFetcher, offset: int, cause=None) -> bool:
    """The range goes on past the partition's last stable offset. Within the log end a transaction still
    open holds it back: wait for it to settle (up to fetchTimeoutMs, then UnsettledTransactionError), and
    True once it has. Past the log end the partition lost messages (``_lost_tail``): False."""
    deadline = time.monotonic() + part.fetch_timeout_ms / 1000
    while True:
        _, latest, log_end = fetcher.offsets()
        if latest > offset:
            return True
        if log_end <= offset:
            _lost_tail(part, offset, latest, cause)
            return False
        if time.monotonic() >= deadline:
            raise UnsettledTransactionError(
                f"{part.topic} {part.partition}: the batch needs offsets {offset} to {part.end - 1}, but a "
                f"transaction still open after fetchTimeoutMs={part.fetch_timeout_ms} holds them back (the "
                f"partition's last stable offset is {latest}, its log end {log_end}); readers see committed "
                f"messages only") from cause
        time.sleep(0.2)


def _lost_tail(part: MetaqPartition, offset: int, latest: int, cause=None) -> None:
    """The partition now ends below the range the batch was planned with: its broker lost messages (a
    wiped data directory, an unflushed tail lost in a crash). An error naming both offsets, or with
    failOnDataLoss=false a warning and the rest of the range skipped."""
    message = (f"{part.topic} {part.partition} went backwards: the batch needs offsets {offset} to {part.end - 1} "
               f"but the partition's latest offset is {latest} (its broker lost messages)")
    if part.fail_on_data_loss:
        raise DataLossError(message + "; set failOnDataLoss=false to skip them") from cause
    log.warning("%s; skipping them, some data may have been missed", message)


def _sorted_ids(ids: dict) -> dict:
    return {t: {p: ids[t][p] for p in sorted(ids[t], key=parse_partition_name)} for t in sorted(ids) if ids[t]}


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
    pushed = Pushed()  # what pushed filters select (MetaqFilteringBatchReader): nothing is filtered here

    def __init__(self, opts: SourceOptions):
        self.opts = opts

    def partitions(self):
        ranges = self.planner.initial_ranges()
        start = check_data_loss(self.opts, resolve_start(self.opts, self.planner, ranges), ranges)
        identities = self.planner.identities(start)
        if self.opts.ending_timestamp is not None:
            end = {t: self.planner.offsets_at(t, list(ps), self.opts.ending_timestamp) for t, ps in start.items()}
        elif isinstance(self.opts.ending, dict):
            end = {t: {p: (ranges[t][p][1] if o == LATEST else o) for p, o in ps.items() if p in ranges.get(t, {})}
                   for t, ps in self.opts.ending.items()}
        else:
            end = {t: {p: r[1] for p, r in ps.items()} for t, ps in ranges.items()}
        start, end = self._narrowed(start, _sorted(end))
        pushed = self.pushed
        keys = None if pushed.keys is None else tuple(sorted(pushed.keys))
        msg_ids = None if pushed.msg_ids is None else tuple(sorted(pushed.msg_ids))
        return plan_partitions(self.opts, self.planner, start, end, identities, keys=keys, msg_ids=msg_ids) or \
            [InputPartition(None)]

    def _narrowed(self, start: dict, end: dict) -> tuple:
        """(start, end) of the topics, partitions and offsets the pushed filters leave (all without any);
        ``timestamp`` filters narrow each range to the offsets its broker's time index says can match."""
        pushed = self.pushed
        if pushed.empty:
            return {}, {}
        lo, hi = pushed.offsets
        narrowed_start, narrowed_end = {}, {}
        for t, ps in end.items():
            if pushed.topics is not None and t not in pushed.topics:
                continue
            for p, e in ps.items():
                if p in start.get(t, {}) and (pushed.partitions is None or p in pushed.partitions):
                    s = max(start[t][p], lo)
                    narrowed_start.setdefault(t, {})[p], narrowed_end.setdefault(t, {})[p] = s, max(s, min(e, hi))
        if pushed.create_times != (None, None):
            for t, ps in narrowed_end.items():
                ranges = self.planner.create_time_ranges(t, list(ps), *pushed.create_times)
                for p, r in ranges.items():
                    if r is None:  # a broker from before create-time ranges: read the range whole
                        continue
                    s, e = narrowed_start[t][p], ps[p]
                    narrowed_start[t][p] = max(s, min(r[0], e))
                    ps[p] = max(narrowed_start[t][p], min(e, r[1]))
                    log.info("timestamp filters narrow %s %s from offsets [%d, %d) to [%d, %d)", t, p, s, e,
                             narrowed_start[t][p], ps[p])
        return narrowed_start, narrowed_end

    def read(self, partition):
        if partition.value is None:
            return iter(())
        return read_partition(partition)


class MetaqFilteringBatchReader(MetaqBatchReader):
    """A batch reader that answers pushed filters itself (``pushdown``): only made when Spark will call
    ``pushFilters`` (a reader that defines it fails a query on a session without
    spark.sql.python.filterPushdown.enabled, so without it queries get the plain ``MetaqBatchReader``)."""

    def pushFilters(self, filters):
        topics = list(self.planner.partitions(registered=True))
        self.pushed, kept = push(filters, key_index=bool(topics) and self.planner.keeps_key_index(topics))
        if self.pushed.shown:
            log.info("metaq answers these filters itself: %s", ", ".join(self.pushed.shown))
        if self.pushed.narrowing:
            log.info("metaq narrows its offset ranges by these filters, which Spark applies too: %s",
                     ", ".join(self.pushed.narrowing))
        return kept


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

    def _mark(self, offsets: dict, start: Optional[dict] = None, restarts: Optional[dict] = None) -> dict:
        """The offsets Spark checkpoints: the group marker, the identities of the logs they are of, and
        the partitions this batch reads a new log of from its earliest (``RESTARTS``)."""
        ids = self.planner.identities(offsets)
        ids = {t: {p: i for p, i in ps.items() if i} for t, ps in ids.items()}
        extra = {**({IDENTITIES: _sorted_ids(ids)} if any(ids.values()) else {}),
                 **({RESTARTS: _sorted(restarts)} if restarts else {})}
        marked = mark(offsets, self.opts.zk_connect, self.opts.zk_root,
                      self._group_of(start) if self.opts.commit_offsets else None,
                      secured=self.planner.consumer.group_offsets_via_broker or self.opts.security.zk.digest is not None)
        return {**{k: v for k, v in marked.items() if k == MARKER}, **extra, **unmark(marked)}

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
        # A partition that is another log now (a wiped data directory) is read from the new log's earliest.
        restarts = check_identities(self.opts, identities_in(marked), self.planner.identities(start), ranges)
        # A partition whose broker is down for a moment is not lost: it just has nothing new now.
        paused = {(t, p): o for t, ps in start.items() for p, o in ps.items()
                  if p not in ranges.get(t, {}) and not self.planner.broker_alive(p)}
        checked = check_data_loss(self.opts, _sorted({t: {p: restarts.get(t, {}).get(p, o) for p, o in ps.items()
                                                          if (t, p) not in paused}
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
        return self._mark(target, marked, restarts)

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
        budgets = {(t, p): (start[t][p], max(1, max_bytes * n // total)) for (t, p), n in waiting.items() if n}
        for (t, p), after in self.planner.consumer.offsets_after_bytes(budgets).items():
            out[t][p] = min(target[t][p], max(after, start[t][p]))
        if all(out[t][p] == start[t][p] for t, ps in start.items() for p in ps):
            # Progress: a single message larger than the budget still gets read.
            (t, p) = max(waiting, key=waiting.get)
            out[t][p] = start[t][p] + 1
        return out

    def reportLatestOffset(self) -> Optional[dict]:
        return self._latest

    def partitions(self, start: dict, end: dict):
        restarts = end.get(RESTARTS) if isinstance(end, dict) else None
        return plan_partitions(self.opts, self.planner, unmark(start), unmark(end), identities_in(end), restarts)

    def read(self, partition):
        return read_partition(partition)

    def commit(self, end: dict) -> None:
        """Record the batch's end offsets for the group (Spark calls this one batch late; the listener
        of ``group_commit`` records the last batch too, and whichever writes last, offsets only move
        forward). Never fails or stalls the stream. A secured query commits through a broker, which
        checks the group's ACLs (``Consumer.commit``)."""
        if not self.opts.commit_offsets:
            return
        group, offsets, ids = self._group_of(end), unmark(end), identities_in(end)
        consumer = self.planner.consumer
        if consumer.group_offsets_via_broker:
            try:
                for topic, parts in offsets.items():
                    consumer.commit(topic, parts, forward_only=True, identities=ids.get(topic, {}), group=group)
            except Exception as e:  # noqa: BLE001 - reported, never fatal (as RECORDER.record)
                log.warning("could not record offsets of group %s through the brokers: %s", group, e)
            return
        RECORDER.record(self.opts.zk_connect, self.opts.zk_root, group, offsets, self.opts.security.zk, ids)

    def stop(self) -> None:
        if self._planner is not None:
            self._planner.close()
            self._planner = None
