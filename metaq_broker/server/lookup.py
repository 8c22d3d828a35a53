"""Answering ``Lookup`` (``protocol/lookup.py``) from this broker's partitions: each partition's answers
(``store/lookup.py``), merged newest first by store time, at most the number asked for and at most a
fetch's bytes (``maxTransferSize``; at least one answer), in one Arrow batch."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from metaq_broker.protocol.lookup import REPLY_SCHEMA, LookupRequest, pack_reply
from metaq_broker.store import lookup as store_lookup

_NEWEST_FIRST = [("storeTime", "descending"), ("partition", "ascending"), ("offset", "descending")]


def answer(partitions: list, request: LookupRequest, max_bytes: int) -> bytes:
    """The reply to ``request`` from ``partitions`` ([(number, PartitionLog)], the ones asked for)."""
    tables = []
    for number, log in partitions:
        first, before = request.first.get(number), request.before.get(number)
        if request.key is not None:
            found = store_lookup.by_key(log, request.key, request.since_ms, request.until_ms, request.max_answers,
                                        request.read_uncommitted, first, before)
        else:
            found = store_lookup.by_msg_id(log, request.msg_id, request.read_uncommitted, first, before)
        n = found.batch.num_rows
        if n:
            tables.append(pa.Table.from_batches([found.batch]).append_column(
                REPLY_SCHEMA.field("partition"), pa.array(np.full(n, number, np.int32))).append_column(
                REPLY_SCHEMA.field("storeTime"), pa.array(found.store_ms, pa.int64())))
    if not tables:
        return pack_reply(pa.RecordBatch.from_pylist([], REPLY_SCHEMA), True)
    table = pa.concat_tables(tables)
    if request.msg_id is not None:  # a message id's answer, within the time range when one is given
        store = table.column("storeTime")
        keep = pc.and_(pc.greater_equal(store, request.since_ms if request.since_ms is not None else -(2 ** 63)),
                       pc.less_equal(store, request.until_ms if request.until_ms is not None else 2 ** 63 - 1))
        table = table.filter(keep)
    table = table.take(pc.sort_indices(table, sort_keys=_NEWEST_FIRST))[: request.max_answers]
    sizes = np.cumsum(sum(pc.fill_null(pc.binary_length(table.column(c)), 0).to_numpy(zero_copy_only=False)
                          for c in ("key", "value")), dtype=np.int64) if table.num_rows else np.zeros(0, np.int64)
    fits = max(1, int(np.searchsorted(sizes, max_bytes, "right")))
    complete = fits >= table.num_rows
    table = table.slice(0, fits).combine_chunks()
    batches = table.to_batches()
    return pack_reply(batches[0] if batches else pa.RecordBatch.from_pylist([], REPLY_SCHEMA), complete)
