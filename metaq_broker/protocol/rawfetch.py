"""``FetchRaw``: ``Fetch`` with the record bytes kept out of protobuf.

A ``FetchResponse`` costs extra copies of every record byte (the broker serialises them into the message,
the client parses them out), and fetching is most of what a consumer does. ``FetchRaw`` takes the same
``FetchRequest`` but answers with a 40-byte header packed with ``struct`` followed by the stored batches
as they are on disk, and the client decodes from a view of the bytes gRPC received. Its reply is not a
protobuf message, so it is not in metaq.proto: the broker serves it under service ``metaq.v1.Broker`` with
a generic handler. docs/protocol.md gives the layout.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

SERVICE = "metaq.v1.Broker"
METHOD = "FetchRaw"
PATH = f"/{SERVICE}/{METHOD}"

# header length (where the records start), flags (0), start_offset, end_offset, earliest, latest
HEADER = struct.Struct("<IIqqqq")
assert HEADER.size == 40


class FetchReply(NamedTuple):
    """The fields of a ``FetchResponse`` that a consumer uses; ``records`` is a view, not a copy."""

    start_offset: int
    end_offset: int
    earliest_offset: int
    latest_offset: int
    records: memoryview


def pack(start_offset: int, end_offset: int, earliest: int, latest: int, records) -> bytes:
    return b"".join((HEADER.pack(HEADER.size, 0, start_offset, end_offset, earliest, latest), records))


def unpack(reply: bytes) -> FetchReply:
    if len(reply) < HEADER.size:
        raise ValueError(f"FetchRaw reply of {len(reply)} bytes is shorter than its {HEADER.size}-byte header")
    size, _, start, end, earliest, latest = HEADER.unpack_from(reply)
    if not HEADER.size <= size <= len(reply):
        raise ValueError(f"FetchRaw reply header says the records start at byte {size} of {len(reply)}")
    return FetchReply(start, end, earliest, latest, memoryview(reply)[size:])
