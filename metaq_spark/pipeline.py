"""The sink's sending side on an executor: Arrow batches from Spark become Puts (``send_arrow``: one call
per topic, a ``topic`` column split with Arrow kernels, no Python loop per row), sent in order from one
background thread (``Pipeline``) so that reading the next batches from Spark overlaps with encoding and
the broker's work on the previous ones."""
from __future__ import annotations

import collections
import threading
from typing import Iterator, Optional

import pyarrow as pa
import pyarrow.compute as pc

from metaq_broker.errors import InvalidMessageError

MAX_PUT_BYTES = 16 << 20  # Arrow batches larger than this go to the brokers in slices
PUT_BYTES = 4 << 20  # smaller Arrow batches queued together go in one Put up to this size
MAX_QUEUED_BYTES = 16 << 20  # Arrow batches read from Spark ahead of the sending thread


def _slices(batch: pa.RecordBatch) -> Iterator[pa.RecordBatch]:
    pieces = -(-batch.nbytes // MAX_PUT_BYTES)
    if pieces <= 1:
        yield batch
        return
    step = -(-batch.num_rows // pieces)
    for start in range(0, batch.num_rows, step):
        yield batch.slice(start, step)


def check_headers(headers, first_row: int = 0) -> None:
    """InvalidMessageError naming the row (``first_row`` + its place in ``headers``, counted in the task)
    of the first header that is null or has a null key: Kafka's header keys are strings, never null (a
    null value is allowed). Arrow kernels, no loop per row."""
    for chunk in headers.chunks if isinstance(headers, pa.ChunkedArray) else [headers]:
        flat = pc.list_flatten(chunk)  # the headers of the non-null rows, in order
        keys = pc.struct_field(flat, "key")  # null also where the header itself is
        if keys.null_count:
            at = pc.index(pc.is_null(keys), True).as_py()
            parents = pc.list_parent_indices(chunk)
            row = parents[at].as_py()
            what = "is null" if flat[at].as_py() is None else "has a null key"
            raise InvalidMessageError(f"the headers column: row {first_row + row} of this task has a header that "
                                      f"{what} (its header {at - pc.index(parents, row).as_py()}); Kafka header "
                                      f"keys are strings, never null (a null header value is allowed)")
        first_row += len(chunk)


def send_arrow(send, batch, index: dict, default_topic: Optional[str], first_row: int = 0) -> int:
    """Send one Arrow batch or table with ``send(topic, values, keys, attributes, flags, partition=...,
    headers=...)``, one call per topic present (a ``topic`` column is split with Arrow kernels). Returns
    the rows sent. ``first_row``: the task's rows sent before this batch (errors name a row by it)."""
    if not batch.num_rows:
        return 0
    col = {name: batch.column(i) for name, i in index.items()}
    if "headers" in col:
        check_headers(col["headers"], first_row)
    topics = col.get("topic")
    if topics is None:
        groups = [(default_topic, None)]
    else:
        if topics.null_count:
            if default_topic is None:
                raise InvalidMessageError("the topic column has nulls and there is no topic option for them")
            topics = pc.fill_null(topics, default_topic)
        names = pc.unique(topics).to_pylist()
        groups = [(names[0], None)] if len(names) == 1 else [(t, pc.equal(topics, t)) for t in names]
    for topic, mask in groups:
        cols = col if mask is None else {k: pc.filter(v, mask) for k, v in col.items()}
        flags = cols.get("flag")
        if flags is not None and flags.null_count:
            flags = pc.fill_null(flags, 0)
        send(topic, cols["value"], cols.get("key"), cols.get("attribute"), flags, partition=cols.get("partition"),
             headers=cols.get("headers"))
    return batch.num_rows


class Pipeline:
    """Sends Arrow batches from one background thread, in order: reading the next batches from Spark
    overlaps with encoding and the broker's work on the previous ones. The batches that queued up while a
    send was under way go in the next one as one Arrow table of up to ``PUT_BYTES`` (its chunks are not
    copied together), so a broker slower than Spark gets fewer, larger Puts: fewer round trips, fsync
    waits and per-call costs. A partition still receives its messages in the order Spark produced them.
    ``submit`` blocks while ``MAX_QUEUED_BYTES`` wait. ``flush`` (``PipelinedSender.flush``) runs in the
    sending thread after the last send."""

    def __init__(self, send, index: dict, topic: Optional[str], flush=None):
        self._send = lambda batch, first_row: send_arrow(send, batch, index, topic, first_row)
        self._flush = flush
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._queued = 0  # bytes in _queue
        self._closing = False
        self._error: Optional[BaseException] = None
        self._skip = False
        self.rows = 0
        self._thread = threading.Thread(target=self._run, name="metaq-sink-sender", daemon=True)
        self._thread.start()

    def _take(self) -> list:
        """The batches queued, up to PUT_BYTES (one whatever its size); [] once closing with none left."""
        with self._cond:
            while not self._queue and not self._closing:
                self._cond.wait()
            taken, size = [], 0
            while self._queue and (not taken or size + self._queue[0].nbytes <= PUT_BYTES):
                taken.append(self._queue.popleft())
                size += taken[-1].nbytes
            self._queued -= size
            self._cond.notify_all()
            return taken

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            self._error = e
            self._cond.notify_all()

    def _run(self) -> None:
        sent = 0  # rows of the task taken so far
        while taken := self._take():
            first_row, sent = sent, sent + sum(b.num_rows for b in taken)
            if self._error is None and not self._skip:
                try:
                    self._send(taken[0] if len(taken) == 1 else pa.Table.from_batches(taken), first_row)
                except BaseException as e:  # noqa: BLE001 - raised in the task's thread
                    self._fail(e)
        if self._flush is not None and self._error is None and not self._skip:
            try:
                self._flush()
            except BaseException as e:  # noqa: BLE001 - raised in the task's thread
                self._fail(e)

    def submit(self, batch: pa.RecordBatch) -> None:
        for piece in _slices(batch):
            with self._cond:
                while self._queued >= MAX_QUEUED_BYTES and self._error is None:
                    self._cond.wait()
                if self._error is not None:
                    raise self._error
                self._queue.append(piece)
                self._queued += piece.nbytes
                self._cond.notify_all()
            self.rows += piece.num_rows

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, kind, value, tb) -> None:
        with self._cond:
            self._skip = kind is not None  # failing: what is queued is not sent
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        if kind is None and self._error is not None:
            raise self._error


def send_all(sender, batches, index: dict, topic: Optional[str]) -> int:
    """Every Arrow batch of ``batches`` (a task's rows from Spark) through a ``Pipeline`` into ``sender``
    (a ``PipelinedSender``, flushed after the last send); returns the rows sent."""
    with Pipeline(sender.send_batch, index, topic, sender.flush) as pipe:
        for batch in batches:
            pipe.submit(batch)
    return pipe.rows
