"""``FetchRaw``: ``Fetch`` with the record bytes kept out of protobuf.

A ``FetchResponse`` costs extra copies of every record byte (the broker serialises them into the message,
the client parses them out), and fetching is most of what a consumer does. ``FetchRaw`` takes the same
``FetchRequest`` but answers with a 40-byte header packed with ``struct``, the aborted transactions
overlapping the reply (so the client can leave their batches out), and the stored batches as they are on
disk; the client decodes from a view of the bytes gRPC received. Its reply is not a
protobuf message, so it is not in metaq.proto: the broker serves it under service ``metaq.v1.Broker`` with
a generic handler. docs/protocol.md gives the layout.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from metaq_broker.protocol.records import ABORTED_DTYPE, NO_ABORTED

SERVICE = "metaq.v1.Broker"
METHOD = "FetchRaw"
PATH = f"/{SERVICE}/{METHOD}"

# header length (where the records start), flags (0), start_offset, end_offset, earliest, latest (the last
# stable offset); then the aborted list (ABORTED: count, reserved 0; count x ABORTED_DTYPE), then records
HEADER = struct.Struct("<IIqqqq")
assert HEADER.size == 40
ABORTED = struct.Struct("<II")
assert ABORTED_DTYPE.itemsize == 24  # so the records after the list stay 8-aligned


class FetchReply(NamedTuple):
    """The fields of a ``FetchResponse`` that a consumer uses; ``records`` is a view, not a copy.
    ``aborted`` (``records.ABORTED_DTYPE``) goes to ``records.decode`` with them."""

    start_offset: int
    end_offset: int
    earliest_offset: int
    latest_offset: int
    records: memoryview
    aborted: np.ndarray = NO_ABORTED


def pack_aborted(aborted) -> bytes:
    """The aborted list as it follows a fetch reply's fixed header: count, 0, then the entries."""
    entries = np.ascontiguousarray(aborted, dtype=ABORTED_DTYPE)
    return ABORTED.pack(len(entries), 0) + entries.tobytes()


def unpack_aborted(buf, pos: int, end: int) -> np.ndarray:
    """The aborted list at ``buf[pos:end]`` (the header's bytes past its fixed fields; none from a broker
    that sends no list), a view of ``buf``."""
    if end - pos < ABORTED.size:
        return NO_ABORTED
    count, _ = ABORTED.unpack_from(buf, pos)
    if pos + ABORTED.size + count * ABORTED_DTYPE.itemsize > end:
        raise ValueError(f"fetch reply header of {end} bytes cannot hold {count} aborted transactions")
    return np.frombuffer(buf, ABORTED_DTYPE, count, pos + ABORTED.size)


def pack(start_offset: int, end_offset: int, earliest: int, latest: int, records, aborted=NO_ABORTED) -> bytes:
    listed = pack_aborted(aborted)
    return b"".join((HEADER.pack(HEADER.size + len(listed), 0, start_offset, end_offset, earliest, latest), listed,
                     records))


def unpack(reply: bytes) -> FetchReply:
    if len(reply) < HEADER.size:
        raise ValueError(f"FetchRaw reply of {len(reply)} bytes is shorter than its {HEADER.size}-byte header")
    size, _, start, end, earliest, latest = HEADER.unpack_from(reply)
    if not HEADER.size <= size <= len(reply):
        raise ValueError(f"FetchRaw reply header says the records start at byte {size} of {len(reply)}")
    return FetchReply(start, end, earliest, latest, memoryview(reply)[size:], unpack_aborted(reply, HEADER.size, size))
