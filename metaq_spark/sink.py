"""``df.writeStream.format("metaq")`` and ``df.write.format("metaq")``: the exactly-once sink.

Each task writes its rows in one broker transaction per broker it touches, named
``<sinkId>/<batchId>/<run>/<partitionId>-<taskAttemptId>@<brokerId>`` and begun with the coordinator
``{"path": <decision record>, "run": <run>}``, and prepares them. The driver's ``commit`` then records the
decision for the batch in ZooKeeper (``<zk.root>/sinks/<sinkId>/batches/<batchId>``, listing the
transactions to commit; ``metaq_broker.zk.decisions``), through a broker when the query is secured
(``client.decisions``: no ZooKeeper identity needed), and commits them. A batch replayed after a driver
crash finds the earlier run's decision, finishes its commits and rolls back its own transactions, so
nothing is written twice; a broker holding an in-doubt transaction settles it from the same record. The
record names the query that committed it: a decision by another query (the same sinkId reused) is not a
replay, and the batch fails naming both rather than being dropped. A batch write's record is
``sinks/write.<sinkId>`` (a rerun after a crash finishes the recorded commit) or ``write.<run>`` without
a sinkId (each run a new, atomic write); docs/transactions.md has the promises.

Spark creates a new writer for every micro-batch and again, from scratch, for the driver's commit and
abort, so nothing is kept in memory: the run id and the record's path travel in the commit messages.
The sink id is the ``sinkId`` option, else ``<last component of checkpointLocation>-<query id>``: Spark
keeps the query id in the checkpoint, so a restarted query keeps its sink id and a fresh checkpoint at the
same path gets a new one. Rows go to brokers as Arrow columns (``Producer.encode_batches``): no Python loop per row.

This module holds the writers: each task's write on an executor, the driver's decision and clean-up. The
options are ``options.parse_sink``'s, the sending thread is ``pipeline``'s, and the records are kept by
``client.decisions`` with the rules and housekeeping of ``zk.decisions``."""
from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import uuid
from dataclasses import dataclass
from typing import Iterator, List, Optional

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import ArrayType, BinaryType, ByteType, IntegerType, ShortType, StringType, StructType

from metaq_broker.client.decisions import SinkDecisions
from metaq_broker.client.producer import PipelinedSender, Producer
from metaq_broker.client.settle import COMMIT, rollback_quietly, settle
from metaq_broker.zk import decisions as txn_decisions
from metaq_broker.zk.decisions import BATCH_WRITE_PREFIX
from metaq_broker.zk.paths import ZkPaths
from metaq_spark.options import OptionError, SinkOptions, parse_sink
from metaq_spark.pipeline import send_all

log = logging.getLogger(__name__)

BATCH_RECORD_HORIZON_S = 7 * 86_400  # leftover decision records of crashed batch writes older than this go
SETTLE_WAIT_S = 120.0  # how long the driver waits for a broker that is down to take a commit

COLUMNS = {  # column -> (allowed Spark types, how the message uses it)
    "value": ((BinaryType, StringType), "binary or string, required"),
    "key": ((BinaryType, StringType), "binary or string"),
    "partition": ((StringType,), "string <brokerId>-<n>"),
    "attribute": ((StringType,), "string"),
    "flag": ((IntegerType, ShortType, ByteType), "int"),
    "topic": ((StringType,), "string"),
    "headers": ((ArrayType,), "array<struct<key: string, value: binary>>"),
}
HEADERS_SIMPLE_STRING = "array<struct<key:string,value:binary>>"  # Kafka sink's type, nullability left out


def _type_ok(name: str, data_type) -> bool:
    """Is ``data_type`` one the sink takes for column ``name``? ``headers`` must be Kafka's type (nulls
    allowed anywhere: a header key's null is refused for its row when the row is written)."""
    if name == "headers":
        return data_type.simpleString() == HEADERS_SIMPLE_STRING
    return isinstance(data_type, COLUMNS[name][0])


class SinkIdConflictError(RuntimeError):
    """Another query already committed this batch id under the same sink id: its decision is not ours to
    replay, and rolling our batch back would drop it."""


class SinkSchemaError(ValueError):
    """The DataFrame written to metaq has a column the sink does not take, or one of the wrong type."""


def check_schema(schema: StructType, opts: SinkOptions) -> dict:
    """{column: index} of the columns the sink uses; SinkSchemaError naming the column otherwise."""
    allowed = ", ".join(f"{c} ({what})" for c, (_, what) in COLUMNS.items())
    index = {}
    for i, f in enumerate(schema.fields):
        name = f.name.lower()
        if name not in COLUMNS:
            raise SinkSchemaError(f"column {f.name!r} is not written by the metaq sink; the columns are: {allowed}")
        if name in index:
            raise SinkSchemaError(f"column {f.name!r} appears twice")
        what = COLUMNS[name][1]
        if not _type_ok(name, f.dataType):
            raise SinkSchemaError(f"column {f.name!r} has type {f.dataType.simpleString()}; the metaq sink "
                                  f"needs {what}")
        index[name] = i
    if "value" not in index:
        raise SinkSchemaError(f"the metaq sink needs a column 'value' (binary or string); got "
                              f"{', '.join(schema.fieldNames()) or 'no columns'}")
    if "topic" not in index and opts.topic is None:
        raise SinkSchemaError("no topic: give the option topic, or a string column 'topic'")
    return index


def default_sink_id(checkpoint: str, query_id: str) -> str:
    """``<last component of the checkpoint path, 24 chars at most>-<query id>``. Spark keeps the query id
    in the checkpoint: a query restarted from it keeps its sink id, a new checkpoint (even at the same
    path) gets a new one. No path normalisation: executors may not share the driver's working directory."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", checkpoint.strip().rstrip("/").rsplit("/", 1)[-1])[:24].strip(".")
    if not re.fullmatch(r"[0-9a-f-]{36}", query_id or ""):  # not seen with Spark 4.3; keep a stable name
        query_id = hashlib.sha256(checkpoint.encode()).hexdigest()[:36]
    return f"{name or 'query'}-{query_id}"


@dataclass
class SinkCommitMessage(WriterCommitMessage):
    run: str
    path: str  # the decision record the transactions name ("" for at-least-once)
    owner: dict  # {"query": <Spark query id>, "checkpoint": <location>} of a stream; {} for a batch write
    xids: list  # [[brokerId, xid], ...] prepared by the task
    rows: int
    sink: str = ""  # the sink id of the record (its node under <root>/sinks)


# -- shared clients (one per Python process) -----------------------------------------------------------

_PRODUCERS: dict = {}
_LOCK = threading.Lock()


def _producer(opts: SinkOptions):
    """One Producer per Python worker, cluster and delivery timeout, reused by every task the worker runs."""
    key = (opts.zk_connect, opts.zk_root, opts.security, opts.delivery_timeout_ms)
    with _LOCK:
        p = _PRODUCERS.get(key)
        if p is None:
            p = _PRODUCERS[key] = Producer(zk_connect=opts.zk_connect, zk_root=opts.zk_root, security=opts.security,
                                           timeout=opts.delivery_timeout_ms / 1000)
        return p


def _decisions(opts: SinkOptions) -> SinkDecisions:
    """The decision records, kept through the shared Producer's brokers or its ZooKeeper session."""
    return SinkDecisions(_producer(opts))


class _Writer:
    """What the batch and the streaming writer share: the options, the columns, the run id."""

    streaming = False

    def __init__(self, opts: SinkOptions, schema: StructType):
        self.opts = opts
        self.index = check_schema(schema, opts)
        self.run = uuid.uuid4().hex  # per writer; Spark makes a writer per micro-batch

    # -- executor side ---------------------------------------------------------------------------------
    def _where(self):
        """(sink id, batch id, owner, TaskContext) of the task running now. A batch write with a sinkId
        has a fixed record (a rerun after a crash finds its decision); without, a new one per run."""
        ctx = TaskContext.get()
        if not self.streaming:  # one record per write, removed after it
            return BATCH_WRITE_PREFIX + (self.opts.sink_id or self.run), 0, {}, ctx
        batch_id = int(ctx.getLocalProperty("streaming.sql.batchId"))
        query = ctx.getLocalProperty("sql.streaming.queryId") or ""
        sink_id = self.opts.sink_id
        if sink_id is None:
            if not self.opts.checkpoint:
                raise OptionError("the metaq sink needs a checkpointLocation or a sinkId option")
            sink_id = default_sink_id(self.opts.checkpoint, query)
        return sink_id, batch_id, {"query": query, "checkpoint": self.opts.checkpoint or ""}, ctx

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommitMessage:
        producer = _producer(self.opts)
        if not self.opts.exactly_once:  # Puts pipelined: one in flight per partition
            sender = PipelinedSender(producer)
            try:
                rows = send_all(sender, iterator, self.index, self.opts.topic)
            finally:
                sender.close()
            return SinkCommitMessage(self.run, "", {}, [], rows)
        sink_id, batch_id, owner, ctx = self._where()
        path = ZkPaths(self.opts.zk_root).sink_batch(sink_id, batch_id)
        # taskAttemptId is unique in the application, also across stage re-attempts; the run keeps
        # attempts of a replayed batch (a new driver) apart.
        prefix = f"{sink_id}/{batch_id}/{self.run}/{ctx.partitionId()}-{ctx.taskAttemptId()}"
        txn = producer.transaction(prefix, self.opts.timeout_ms, json.dumps({"path": path, "run": self.run}))
        sender = PipelinedSender(producer, transaction=txn)  # one Put in flight per partition, as above
        try:
            rows = send_all(sender, iterator, self.index, self.opts.topic)
            xids = txn.prepare()
        except BaseException:
            sender.close()
            for bid, xid in list(txn.xids.items()):  # Spark retries the task under new xids
                rollback_quietly(producer, bid, xid)
            raise
        return SinkCommitMessage(self.run, path, owner, xids, rows, sink_id)

    # -- driver side -----------------------------------------------------------------------------------
    def _commit(self, messages: List[Optional[SinkCommitMessage]], batch_id: int) -> None:
        """Decide, then commit; a replay commits the earlier run's decision and drops its own."""
        done = [m for m in messages if m is not None]
        if not self.opts.exactly_once or not done:
            return  # no task reported (nothing ran): brokers settle any leftovers from the record
        run, path = _one(done)
        sink, owner = done[0].sink, done[0].owner
        own = sorted({(int(b), x) for m in done for b, x in m.xids})
        producer = _producer(self.opts)
        records = _decisions(self.opts)
        try:
            decision = records.decide_commit(sink, batch_id, run, [list(x) for x in own], owner)
        except txn_decisions.TransactionsAbortedError as e:
            now = f"{self.opts.timeout_ms} ms" if self.opts.timeout_ms else \
                "unset, so the brokers' transactionTimeout"
            raise txn_decisions.TransactionsAbortedError(
                f"{e}. Raise the sink option transactionTimeoutMs (now {now}) above the time a batch takes; "
                f"the brokers refuse more than their transactionMaxTimeout (default 900000 ms)") from None
        if decision.run != run and _other_query(decision.owner, owner):
            raise SinkIdConflictError(
                f"sink id {sink!r}: batch {batch_id} was already committed by another query "
                f"(id {decision.owner.get('query')}, checkpoint {decision.owner.get('checkpoint') or 'unknown'}); "
                f"this query (id {owner.get('query')}, checkpoint {owner.get('checkpoint') or 'unknown'}) would "
                f"drop its batch. Give this query its own sinkId option, or delete that sink's decision records "
                f"({records.paths.sink_batches(sink)}) if that query is gone for good")
        settle(producer, decision.xids, COMMIT, SETTLE_WAIT_S)
        if decision.run != run:
            log.info("batch %d was committed by an earlier run (%s); dropping this run's %d transactions",
                     batch_id, decision.run, len(own))
            for bid, xid in own:
                rollback_quietly(producer, bid, xid)
        self._clean(records, sink, batch_id)

    def _abort(self, messages: List[Optional[SinkCommitMessage]], batch_id: int) -> None:
        """Roll back this run's transactions, unless a commit decision for them is in force (Spark calls
        abort also when commit failed part-way: then they stay, to be committed)."""
        done = [m for m in messages if m is not None]
        if not self.opts.exactly_once or not done:
            return  # failed tasks rolled back their own; brokers time out any others
        run, _ = _one(done)
        producer = _producer(self.opts)
        records = _decisions(self.opts)
        decision = records.decide_abort(done[0].sink, batch_id, run)
        left = 0
        for m in done:
            for bid, xid in m.xids:
                if not decision.commits(int(bid), xid):
                    left += not rollback_quietly(producer, int(bid), xid)
        if not self.streaming and left == 0 and decision.outcome == "abort":
            _housekeeping(records.forget_sink, done[0].sink)

    def _clean(self, records: SinkDecisions, sink: str, batch_id: int) -> None:
        raise NotImplementedError


def _other_query(decided: dict, ours: dict) -> bool:
    """Was the decision made by a different streaming query (not an earlier run of ours)?"""
    return bool(decided.get("query")) and bool(ours.get("query")) and decided["query"] != ours["query"]


def _one(messages: list) -> tuple:
    runs = {(m.run, m.path) for m in messages}
    if len(runs) != 1:
        raise RuntimeError(f"commit messages of one batch name different runs or records: {sorted(runs)}")
    return runs.pop()


def _housekeeping(step, *args) -> None:
    """Run ``step`` (deleting old decision records); a failure is logged, never fails a write."""
    try:
        step(*args)
    except Exception as e:  # noqa: BLE001 - housekeeping never fails a write
        log.warning("could not clean up decision records (%s%s): %s", step.__name__, args, e)


class MetaqStreamWriter(_Writer, DataSourceStreamArrowWriter):
    streaming = True

    def commit(self, messages, batchId: int) -> None:
        self._commit(messages, batchId)

    def abort(self, messages, batchId: int) -> None:
        self._abort(messages, batchId)

    def _clean(self, records: SinkDecisions, sink: str, batch_id: int) -> None:
        """Only the last batch can be replayed (Spark wrote batch N-1 to its commit log before running
        N): keep the records of N and N-1, delete older ones (also those a broker recreated to abort)."""
        _housekeeping(records.forget_below, sink, batch_id - 1)


class MetaqBatchWriter(_Writer, DataSourceArrowWriter):
    def commit(self, messages) -> None:
        self._commit(messages, 0)

    def abort(self, messages) -> None:
        self._abort(messages, 0)

    def _clean(self, records: SinkDecisions, sink: str, batch_id: int) -> None:
        """Delete this write's own sink node, and leftovers of batch writes whose driver died after the
        decision (older than BATCH_RECORD_HORIZON_S: by then their brokers have long settled)."""
        _housekeeping(records.forget_sink, sink)
        _housekeeping(records.sweep_batch_writes, BATCH_RECORD_HORIZON_S)


def writer(options, schema: StructType, streaming: bool):
    opts = parse_sink(options, streaming)
    return (MetaqStreamWriter if streaming else MetaqBatchWriter)(opts, schema)
