"""``Lookup``: find messages by key or by message id without reading partitions (docs/protocol.md,
"Lookups"). Served beside metaq.proto's methods under service ``metaq.v1.Broker`` with a generic handler,
as ``FetchRaw``: the request is a small JSON object, checked here field by field; the reply a JSON header
(is the answer complete) and the messages as an Arrow IPC stream, so a client hands them on as Arrow.
Parsing only: no I/O.
"""
from __future__ import annotations

import base64
import binascii
import json
import struct
from dataclasses import dataclass, field
from typing import Optional

import pyarrow as pa

from metaq_broker.errors import InvalidQueryError
from metaq_broker.protocol import records

SERVICE = "metaq.v1.Broker"
METHOD = "Lookup"
PATH = f"/{SERVICE}/{METHOD}"

DEFAULT_MAX_ANSWERS = 64  # RocketMQ's
MAX_ANSWERS = 10_000  # a call's; more take more calls
MAX_PARTITIONS = 10_000  # a topic's on one broker (TopicConfig.num_partitions)
MAX_KEY_BYTES = 1 << 20
READ_COMMITTED, READ_UNCOMMITTED = "read_committed", "read_uncommitted"

# A reply's rows: the messages as a fetch decodes them, with their record headers, their partition on the
# broker and their store time (what time ranges are in; answers are newest first by it).
REPLY_SCHEMA = records.schema(headers=True, timestamp_type=True).append(
    pa.field("partition", pa.int32(), nullable=False)).append(pa.field("storeTime", pa.int64(), nullable=False))
_HEAD = struct.Struct("<I")  # the JSON header's length; then it, then the Arrow IPC stream
_FIELDS = {"topic", "partitions", "key", "msg_id", "since_ms", "until_ms", "max", "isolation", "from", "before"}


@dataclass(frozen=True)
class LookupRequest:
    """By ``key`` (bytes) or by ``msg_id``, exactly one; in ``partitions`` (numbers on this broker; None:
    all of the topic's); stored in [since_ms, until_ms] (either open); at most ``max_answers``; at offsets
    from ``first`` ({partition: offset}) and below ``before`` (likewise: a lookup going on after a reply that
    stopped, or a Spark task's range)."""

    topic: str
    key: Optional[bytes] = None
    msg_id: Optional[int] = None
    partitions: Optional[tuple] = None
    since_ms: Optional[int] = None
    until_ms: Optional[int] = None
    max_answers: int = DEFAULT_MAX_ANSWERS
    read_uncommitted: bool = False
    first: dict = field(default_factory=dict)
    before: dict = field(default_factory=dict)


def pack_request(r: LookupRequest) -> bytes:
    m = {"topic": r.topic, "max": r.max_answers, "isolation": READ_UNCOMMITTED if r.read_uncommitted else READ_COMMITTED}
    if r.key is not None:
        m["key"] = base64.b64encode(bytes(r.key)).decode()
    if r.msg_id is not None:
        m["msg_id"] = r.msg_id
    for name in ("since_ms", "until_ms"):
        if getattr(r, name) is not None:
            m[name] = getattr(r, name)
    if r.partitions is not None:
        m["partitions"] = list(r.partitions)
    for name, bounds in (("from", r.first), ("before", r.before)):
        if bounds:
            m[name] = {str(p): o for p, o in bounds.items()}
    return json.dumps(m).encode()


def _int(m: dict, name: str, lo: int = 0, hi: int = 2 ** 63 - 1) -> Optional[int]:
    v = m.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidQueryError(f"lookup: {name} must be an integer from {lo} to {hi}, got {v!r}")
    return v


def unpack_request(raw: bytes) -> LookupRequest:
    """The request of ``raw``, every field checked; InvalidQueryError names the first one that is wrong."""
    try:
        m = json.loads(bytes(raw))
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidQueryError(f"lookup: the request is not JSON ({e})") from None
    if not isinstance(m, dict):
        raise InvalidQueryError("lookup: the request is not a JSON object")
    unknown = sorted(set(m) - _FIELDS)
    if unknown:
        raise InvalidQueryError(f"lookup: unknown field {unknown[0]!r}")
    topic = m.get("topic")
    if not isinstance(topic, str) or not topic:
        raise InvalidQueryError("lookup: topic must be a topic's name")
    key = m.get("key")
    if key is not None:
        if not isinstance(key, str) or len(key) > 2 * MAX_KEY_BYTES:
            raise InvalidQueryError(f"lookup: key must be base64 of at most {MAX_KEY_BYTES} bytes")
        try:
            key = base64.b64decode(key, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidQueryError("lookup: key is not base64") from None
    msg_id = _int(m, "msg_id")
    if (key is None) == (msg_id is None):
        raise InvalidQueryError("lookup: give a key or a message id, one of them")
    parts = m.get("partitions")
    if parts is not None:
        if not isinstance(parts, list) or not parts or len(parts) > MAX_PARTITIONS:
            raise InvalidQueryError(f"lookup: partitions must be a list of 1 to {MAX_PARTITIONS} numbers")
        parts = tuple(_int({"partition": p}, "partition", 0, MAX_PARTITIONS - 1) for p in parts)
        if None in parts or len(set(parts)) != len(parts):
            raise InvalidQueryError("lookup: partitions must be distinct numbers")
    isolation = m.get("isolation", READ_COMMITTED)
    if isolation not in (READ_COMMITTED, READ_UNCOMMITTED):
        raise InvalidQueryError(f"lookup: isolation must be {READ_COMMITTED} or {READ_UNCOMMITTED}, got {isolation!r}")
    first, before = _offsets(m, "from"), _offsets(m, "before")
    n = _int(m, "max", 1, MAX_ANSWERS)
    return LookupRequest(topic, key, msg_id, parts, _int(m, "since_ms", -(2 ** 63)), _int(m, "until_ms", -(2 ** 63)),
                         DEFAULT_MAX_ANSWERS if n is None else n, isolation == READ_UNCOMMITTED, first, before)


def _offsets(m: dict, name: str) -> dict:
    """{partition: offset} of field ``name`` (partitions as decimal strings, offsets whole numbers)."""
    given = m.get(name, {})
    if not isinstance(given, dict) or len(given) > MAX_PARTITIONS or not all(
            p.isdigit() and len(p) < 6 and isinstance(o, int) and not isinstance(o, bool) and o >= 0
            for p, o in given.items()):
        raise InvalidQueryError(f"lookup: {name} must map partitions (numbers) to offsets")
    return {int(p): o for p, o in given.items()}


def pack_reply(batch: pa.RecordBatch, complete: bool) -> bytes:
    """``batch`` (``REPLY_SCHEMA``) and whether it holds every answer asked for (false: the reply had to
    stop at the broker's transfer size; ask again with ``before``)."""
    head = json.dumps({"complete": complete}).encode()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, REPLY_SCHEMA) as writer:
        writer.write_batch(batch)
    return _HEAD.pack(len(head)) + head + sink.getvalue().to_pybytes()


def unpack_reply(raw) -> tuple:
    """(the answers as one ``REPLY_SCHEMA`` record batch, complete)."""
    view = memoryview(raw)
    (n,) = _HEAD.unpack_from(view)
    head = json.loads(bytes(view[_HEAD.size: _HEAD.size + n]))
    table = pa.ipc.open_stream(pa.py_buffer(view[_HEAD.size + n:])).read_all()
    if table.schema != REPLY_SCHEMA:
        raise ValueError(f"a lookup reply of another schema: {table.schema}")
    batches = table.combine_chunks().to_batches()
    return (batches[0] if batches else pa.RecordBatch.from_pylist([], REPLY_SCHEMA)), bool(head["complete"])
