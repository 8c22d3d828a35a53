"""``PutRaw``: ``Put`` with the batch body kept out of protobuf.

A ``PutRequest`` costs the producer two extra copies of every body byte (into the message, then out to
the serialised string) and the broker one or two more (parsing it, reading ``batch.body``). ``PutRaw``
sends a 32-byte header packed with ``struct``, the topic and the xid, then the body as ``encode_body``
made it; the producer joins them in one copy and the broker checks and stores the body from a view of
the bytes gRPC received. The reply is a protobuf ``PutResponse``. Like ``FetchRaw`` it is not in
metaq.proto: the broker serves it with a generic handler. docs/protocol.md gives the layout.
"""
from __future__ import annotations

import struct
from typing import NamedTuple, Optional

from metaq_broker.protocol.records import ALIGN, RecordFormatError

SERVICE = "metaq.v1.Broker"
METHOD = "PutRaw"
PATH = f"/{SERVICE}/{METHOD}"

# header length (where the body starts, 8-aligned), flags, partition, count, attributes, body_crc,
# topic length, xid length, reserved (0)
HEADER = struct.Struct("<IIiIIIHHI")
assert HEADER.size == 32
MAX_NAME_BYTES = 0xFFFF

# flags bit 0: acknowledge once the master alone stored the batch. Clear (as every older client sends it)
# is acks=all. Bit 1: an idempotent producer's batch: ``PRODUCER`` follows the topic and the xid (inside
# header_len, so a broker that predates it stores the batch as a plain one). Other bits are ignored.
FLAG_ACKS_ONE = 1
FLAG_PRODUCER = 2
PRODUCER = struct.Struct("<qhHi")  # producer id, epoch, 0, base sequence
# Request.acks values, the same as PutRequest.acks
ACKS_ALL, ACKS_ONE = 0, 1


def acks_code(acks) -> int:
    """``"all"`` (or Kafka's -1) -> ACKS_ALL, ``"1"`` -> ACKS_ONE; ValueError otherwise (acks=0, Kafka's
    "no acknowledgement", is not offered: a put always waits for the master's store)."""
    if acks in ("all", "-1", -1):
        return ACKS_ALL
    if acks in ("1", 1) and not isinstance(acks, bool):
        return ACKS_ONE
    raise ValueError(f"acks {acks!r}: expected 'all' (the master and every in-sync replica) or '1' (the master)")


class Batch(NamedTuple):
    """The fields of a ``MessageBatch``; ``body`` is a view of the request, not a copy."""

    count: int
    attributes: int
    body: memoryview
    body_crc: int


class Request(NamedTuple):
    """What ``Put`` reads of a ``PutRequest``, unpacked from a ``PutRaw`` request."""

    topic: str
    partition: int
    xid: str
    batch: Batch
    acks: int = ACKS_ALL  # ACKS_ALL or ACKS_ONE, as PutRequest.acks
    producer: Optional[tuple] = None  # (id, epoch, base sequence) of an idempotent producer's batch


def pack_parts(topic: str, partition: int, xid: str, count: int, attributes: int, body_crc: int,
               parts: list, acks="all", producer: Optional[tuple] = None) -> list:
    """The request as buffers: the header with the names (and ``producer``'s (id, epoch, base sequence)
    when given) padded to 8, then the body's ``parts`` (``EncodedBody.parts``) as they are, for a
    scatter-gather send with no copy. ``acks``: see acks_code."""
    flags = FLAG_ACKS_ONE if acks_code(acks) == ACKS_ONE else 0
    topic_b, xid_b = topic.encode(), xid.encode()
    if len(topic_b) > MAX_NAME_BYTES or len(xid_b) > MAX_NAME_BYTES:
        raise ValueError(f"topic or xid longer than {MAX_NAME_BYTES} bytes")
    extra = b""
    if producer is not None:
        flags |= FLAG_PRODUCER
        extra = PRODUCER.pack(producer[0], producer[1], 0, producer[2])
    header_len = HEADER.size + len(topic_b) + len(xid_b) + len(extra)
    pad = (-header_len) % ALIGN
    head = HEADER.pack(header_len + pad, flags, partition, count, attributes, body_crc, len(topic_b), len(xid_b), 0)
    return [head + topic_b + xid_b + extra + b"\0" * pad, *parts]


def pack(topic: str, partition: int, xid: str, count: int, attributes: int, body_crc: int, parts: list,
         acks="all", producer: Optional[tuple] = None) -> bytes:
    """The request for a body given as ``parts`` (``EncodedBody.parts``): one join, the only copy."""
    return b"".join(pack_parts(topic, partition, xid, count, attributes, body_crc, parts, acks, producer))


def unpack(request) -> Request:
    """Raises RecordFormatError (the broker answers INVALID_ARGUMENT) for a request that does not add up."""
    view = memoryview(request).cast("B")
    if len(view) < HEADER.size:
        raise RecordFormatError(f"PutRaw request of {len(view)} bytes is shorter than its {HEADER.size}-byte header", 0)
    header_len, flags, partition, count, attributes, body_crc, topic_len, xid_len, _ = HEADER.unpack_from(view)
    names_end = HEADER.size + topic_len + xid_len
    if not names_end <= header_len <= len(view) or header_len % ALIGN:
        raise RecordFormatError(f"PutRaw request header says the body starts at byte {header_len} of {len(view)}", 0)
    try:
        topic = str(view[HEADER.size:HEADER.size + topic_len], "utf-8")
        xid = str(view[HEADER.size + topic_len:names_end], "utf-8")
    except UnicodeDecodeError:
        raise RecordFormatError("PutRaw request: topic or xid is not UTF-8", 0) from None
    acks = ACKS_ONE if flags & FLAG_ACKS_ONE else ACKS_ALL
    producer = None
    if flags & FLAG_PRODUCER:
        if names_end + PRODUCER.size > header_len:
            raise RecordFormatError(f"PutRaw request says it carries a producer but its header ends at byte "
                                    f"{header_len}", 0)
        pid, epoch, _, seq = PRODUCER.unpack_from(view, names_end)
        producer = check_producer(pid, epoch, seq)
    return Request(topic, partition, xid, Batch(count, attributes, view[header_len:], body_crc), acks, producer)


def check_producer(pid: int, epoch: int, seq: int) -> tuple:
    """(id, epoch, base sequence) if they can be an idempotent producer's; RecordFormatError otherwise."""
    if pid < 0 or not 0 <= epoch < 0x7FFF or seq < 0:
        raise RecordFormatError(f"producer id {pid}, epoch {epoch}, sequence {seq}: the id and the sequence must "
                                f"not be negative, the epoch 0 to 32766", 0)
    return pid, epoch, seq


# How large a put may be. A producer cuts a partition's messages into bodies of at most SPLIT_BYTES
# (a single larger message goes alone); a broker refuses, before reading its body, a put request over
# max(maxTransferSize, the largest maxMessageSize, SPLIT_BYTES) + HEADER_ALLOWANCE bytes (the header, the
# topic and the xid), on the data port and over gRPC alike (server/broker.py, ``max_put_bytes``).
SPLIT_BYTES = 4 << 20
HEADER_ALLOWANCE = 256 << 10
