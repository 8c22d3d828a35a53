"""The replica fetch: data-port request kind 3 (``REPLICA_FETCH``), a group member pulling from its master
(docs/protocol.md, "Replica fetch"; plan §4). Little-endian and 8-aligned throughout.

- Request: a 56-byte head, then per partition a 32-byte entry and its topic padded to 8.
- Reply: a 48-byte head; on a status other than 0 the refusal's message (UTF-8, ``body_len`` bytes) follows
  it and nothing else. On status 0: the transaction journal's frames (``journal_len`` bytes, padded to 8),
  then one section per requested partition, in the request's order. A section is exactly a data-port FETCH
  reply (``dataport.REPLY``, the aborted list, the records) whose ``header_len`` also covers a 32-byte
  ``TRAILER`` after the aborted list. ``body_len`` counts every byte after the head.

Record batches are multiples of 8 bytes, so every section starts 8-aligned. No I/O here: the master's data
port sends what this builds, and a replica reads the reply with ``net.blocking.read_replica_reply``."""
from __future__ import annotations

import struct
import uuid as uuid_module
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

from metaq_broker.protocol import rawfetch
from metaq_broker.protocol.dataport import MAX_TOPIC_BYTES, OK, REPLICA_FETCH, REPLY, ProtocolError
from metaq_broker.protocol.records import NO_ABORTED

# request_len, kind (3), flags, epoch followed, replicaId, uuid, journal_applied_seq (-1: send a snapshot),
# max_wait_ms, max_bytes, count, 0
REQUEST_HEAD = struct.Struct("<IHHII16sqiiII")
REQUEST_IDENTITIES = 1  # request flag: send each partition log's identity (a master that predates it sends none)
assert REQUEST_HEAD.size == 56
# topic_len, 0, partition, fetch_offset (log end offset), durable_offset (recovery point), last_epoch, 0; then the topic
ENTRY = struct.Struct("<HHiqqII")
assert ENTRY.size == 32
MAX_PARTITIONS = 100_000
MAX_REQUEST_BYTES = REQUEST_HEAD.size + MAX_PARTITIONS * (ENTRY.size + MAX_TOPIC_BYTES)

# header_len (48), status (0 or a gRPC code number), master epoch, sections, body_len (bytes after the head),
# journal_first_seq, journal_last_seq (-1 when none), journal_len, flags
REPLY_HEAD = struct.Struct("<IIIIqqqII")
assert REPLY_HEAD.size == 48
FLAG_JOURNAL_SNAPSHOT = 1  # the journal frames are a snapshot, replacing the replica's journal
FLAG_TOPICS_CHANGED = 2  # the master's topics changed: the replica re-reads them
FLAG_IDENTITIES = 4  # each section's head ends with its partition log's identity (IDENTITY, 16 bytes)
IDENTITY = struct.Struct("<16s")
MAX_MESSAGE_BYTES = 64 << 10  # a refusal's message
MAX_REPLY_BODY = 1 << 30  # read_replica_reply's default bound on body_len

# After a section's aborted list: master log end, HW, section_status, epoch e', truncate_to (DIVERGING) or
# earliest (RESET)
TRAILER = struct.Struct("<qqIIq")
assert TRAILER.size == 32
SECTION_DATA, DIVERGING, RESET, UNKNOWN = 0, 1, 2, 3
SECTION_STATUSES = (SECTION_DATA, DIVERGING, RESET, UNKNOWN)
SECTION_DIVERGING, SECTION_RESET, SECTION_UNKNOWN = DIVERGING, RESET, UNKNOWN  # the same, by their long names
MIN_SECTION_HEAD = REPLY.size + rawfetch.ABORTED.size + TRAILER.size  # 88: no aborted entries

FENCED = "fenced:"  # a refusal's message prefix (FAILED_PRECONDITION): the request's epoch is below the master's


def pad8(n: int) -> int:
    """``n`` rounded up to a multiple of 8."""
    return (n + 7) & ~7


@dataclass
class PartitionFetch:
    topic: str
    partition: int
    fetch_offset: int  # the replica's log end offset
    durable_offset: int  # its recovery point, the fsynced end (<= fetch_offset)
    last_epoch: int  # the epoch of its batch just before fetch_offset


@dataclass
class FetchRequest:
    epoch: int  # the master's epoch the replica follows
    replica_id: int
    uuid: bytes  # the replica's data-dir uuid, 16 bytes
    journal_applied_seq: int  # -1: send a journal snapshot
    max_wait_ms: int
    max_bytes: int
    partitions: list = field(default_factory=list)  # of PartitionFetch
    flags: int = REQUEST_IDENTITIES


def _uuid_bytes(value) -> bytes:
    if isinstance(value, uuid_module.UUID):
        return value.bytes
    value = bytes(value)
    if len(value) != 16:
        raise ValueError(f"a replica's uuid is 16 bytes, not {len(value)}")
    return value


def pack_request(req: FetchRequest) -> bytes:
    """The whole request, head included."""
    if len(req.partitions) > MAX_PARTITIONS:
        raise ValueError(f"replica fetch of {len(req.partitions)} partitions is over {MAX_PARTITIONS}")
    parts = [b""]
    for p in req.partitions:
        name = p.topic.encode()
        if len(name) > MAX_TOPIC_BYTES:
            raise ValueError(f"topic name of {len(name)} bytes is over {MAX_TOPIC_BYTES}")
        parts.append(ENTRY.pack(len(name), 0, p.partition, p.fetch_offset, p.durable_offset, p.last_epoch, 0))
        parts.append(name + bytes(pad8(len(name)) - len(name)))
    length = REQUEST_HEAD.size + sum(len(x) for x in parts)
    parts[0] = REQUEST_HEAD.pack(length, REPLICA_FETCH, req.flags, req.epoch, req.replica_id, _uuid_bytes(req.uuid),
                                 req.journal_applied_seq, req.max_wait_ms, req.max_bytes, len(req.partitions), 0)
    return b"".join(parts)


def unpack_request(buf) -> FetchRequest:
    """The request in ``buf`` (all of it, head included); ProtocolError naming the problem if malformed."""
    view = memoryview(buf).cast("B")
    if len(view) < REQUEST_HEAD.size:
        raise ProtocolError(f"replica fetch of {len(view)} bytes is shorter than its {REQUEST_HEAD.size}-byte head")
    (length, kind, flags, epoch, replica_id, uuid, applied, max_wait_ms, max_bytes, count,
     _) = REQUEST_HEAD.unpack_from(view)
    if kind != REPLICA_FETCH:
        raise ProtocolError(f"request kind {kind} is not a replica fetch ({REPLICA_FETCH})")
    if length != len(view):
        raise ProtocolError(f"replica fetch says it is {length} bytes but {len(view)} were given")
    if count > MAX_PARTITIONS:
        raise ProtocolError(f"replica fetch of {count} partitions is over {MAX_PARTITIONS}")
    if max_wait_ms < 0 or max_bytes < 0 or applied < -1:
        raise ProtocolError(f"replica fetch with max_wait_ms {max_wait_ms}, max_bytes {max_bytes}, "
                            f"journal_applied_seq {applied}: none may be negative (seq -1 asks for a snapshot)")
    partitions = []
    pos = REQUEST_HEAD.size
    for i in range(count):  # per partition, never per message
        if pos + ENTRY.size > length:
            raise ProtocolError(f"replica fetch of {length} bytes ends inside partition entry {i} of {count}")
        topic_len, _, partition, fetch_offset, durable_offset, last_epoch, _ = ENTRY.unpack_from(view, pos)
        pos += ENTRY.size
        if not 0 < topic_len <= MAX_TOPIC_BYTES:
            raise ProtocolError(f"replica fetch entry {i}: topic length {topic_len} is not 1 to {MAX_TOPIC_BYTES}")
        if pos + pad8(topic_len) > length:
            raise ProtocolError(f"replica fetch of {length} bytes ends inside the topic of entry {i}")
        try:
            topic = str(view[pos:pos + topic_len], "utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"replica fetch entry {i}: the topic is not UTF-8") from None
        pos += pad8(topic_len)
        if partition < 0 or not 0 <= durable_offset <= fetch_offset:
            raise ProtocolError(f"replica fetch entry {i} ({topic}-{partition}): partition, fetch_offset "
                                f"{fetch_offset} and durable_offset {durable_offset} must satisfy "
                                f"0 <= durable <= fetch")
        partitions.append(PartitionFetch(topic, partition, fetch_offset, durable_offset, last_epoch))
    if pos != length:
        raise ProtocolError(f"replica fetch has {length - pos} bytes after its {count} partition entries")
    return FetchRequest(epoch, replica_id, bytes(uuid), applied, max_wait_ms, max_bytes, partitions, flags)


@dataclass
class ReplyHead:
    """A reply's head. ``status`` 0 or a gRPC code number; then ``message`` is the refusal, sent as the
    body after the head (``body_len`` = its UTF-8 length, no sections, no journal)."""

    status: int
    message: str = ""
    master_epoch: int = 0
    sections: int = 0
    body_len: int = 0  # status 0: pad8(journal_len) + every section's bytes (``reply_body_len``)
    journal_first_seq: int = -1
    journal_last_seq: int = -1
    journal_len: int = 0
    flags: int = 0


def pack_reply_head(head: ReplyHead) -> bytes:
    """The 48-byte head; on a status other than 0, followed by the message (and ``body_len`` is its length)."""
    if head.status != OK:
        message = head.message.encode("utf-8", "replace")[:MAX_MESSAGE_BYTES]
        return REPLY_HEAD.pack(REPLY_HEAD.size, head.status, head.master_epoch, 0, len(message), -1, -1, 0,
                               0) + message
    return REPLY_HEAD.pack(REPLY_HEAD.size, OK, head.master_epoch, head.sections, head.body_len,
                           head.journal_first_seq, head.journal_last_seq, head.journal_len, head.flags)


def error_reply(status: int, message: str, master_epoch: int = 0) -> bytes:
    """A refusal: the head and the message (``status`` a gRPC code number, e.g. FAILED_PRECONDITION with
    ``FENCED``, UNAVAILABLE with ``status.NOT_MASTER``)."""
    return pack_reply_head(ReplyHead(status, message, master_epoch))


def unpack_reply_head(buf) -> ReplyHead:
    """The head at the start of ``buf``; with a refusal's message when ``buf`` holds it too."""
    view = memoryview(buf).cast("B")
    if len(view) < REPLY_HEAD.size:
        raise ProtocolError(f"replica fetch reply of {len(view)} bytes is shorter than its {REPLY_HEAD.size}-byte head")
    (header_len, status, epoch, sections, body_len, first, last, journal_len,
     flags) = REPLY_HEAD.unpack_from(view)
    if header_len < REPLY_HEAD.size or header_len % 8 or body_len < 0:
        raise ProtocolError(f"bad replica fetch reply head (header_len {header_len}, body_len {body_len})")
    message = ""
    if status != OK:
        if body_len > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"replica fetch refusal of {body_len} bytes is over {MAX_MESSAGE_BYTES}")
        if len(view) >= header_len + body_len:
            message = str(view[header_len:header_len + body_len], "utf-8", "replace")
    elif journal_len > body_len:
        raise ProtocolError(f"replica fetch reply's journal of {journal_len} bytes is over its body of {body_len}")
    return ReplyHead(status, message, epoch, sections, body_len, first, last, journal_len, flags)


def pack_section_head(start: int, end: int, earliest: int, latest: int, body_len: int, aborted: np.ndarray,
                      log_end: int, hw: int, status: int, epoch: int, offset: int,
                      identity: Optional[str] = None) -> bytes:
    """A section's head: the data-port FETCH reply head (status 0), the aborted list and the trailer, then
    (``identity``, 32 hex digits, for a reply with FLAG_IDENTITIES; "" when the master lacks the partition)
    the partition log's identity; ``body_len`` bytes of records follow it. ``offset`` is truncate_to
    (DIVERGING) or earliest (RESET)."""
    listed = rawfetch.pack_aborted(NO_ABORTED if aborted is None else aborted)
    ident = b"" if identity is None else IDENTITY.pack(bytes.fromhex(identity) if identity else b"")
    return b"".join((REPLY.pack(REPLY.size + len(listed) + TRAILER.size + len(ident), OK, start, end, earliest, latest,
                                body_len), listed, TRAILER.pack(log_end, hw, status, epoch, offset), ident))


def reply_body_len(journal_len: int, section_sizes: Iterable[int]) -> int:
    """``body_len`` of a reply: the padded journal and each section's bytes (head and records)."""
    return pad8(journal_len) + sum(section_sizes)


@dataclass
class Section:
    start: int
    end: int  # records hold offsets [start, end)
    earliest: int
    latest: int
    log_end: int  # the master's log end
    hw: int
    status: int  # SECTION_DATA, DIVERGING, RESET or UNKNOWN
    epoch: int  # DIVERGING: e', the master's largest epoch <= the replica's last epoch
    offset: int  # DIVERGING: truncate_to; RESET: the master's earliest
    records: memoryview
    aborted: np.ndarray = field(default_factory=lambda: NO_ABORTED)  # replicas ignore it
    identity: str = ""  # the master's partition log's identity (FLAG_IDENTITIES); "": not sent or unknown


def unpack_section(buf, pos: int = 0, identities: bool = False) -> tuple:
    """(Section, the position after it) for the section at ``buf[pos:]``; its records are a view of ``buf``.
    ``identities``: the reply has FLAG_IDENTITIES (each head ends with the partition's identity)."""
    view = memoryview(buf).cast("B")
    if pos + REPLY.size > len(view):
        raise ProtocolError(f"replica fetch reply ends inside a section head at byte {pos}")
    header_len, status, start, end, earliest, latest, body_len = REPLY.unpack_from(view, pos)
    if status != OK or header_len < MIN_SECTION_HEAD or header_len % 8 or body_len < 0 or body_len % 8:
        raise ProtocolError(f"bad replica fetch section at byte {pos}: status {status}, header_len {header_len}, "
                            f"body_len {body_len}")
    stop = pos + header_len + body_len
    if stop > len(view):
        raise ProtocolError(f"replica fetch section at byte {pos} of {header_len} + {body_len} bytes runs past "
                            f"the reply's {len(view)}")
    ident = IDENTITY.size if identities else 0
    if header_len < MIN_SECTION_HEAD + ident:
        raise ProtocolError(f"bad replica fetch section at byte {pos}: header_len {header_len} has no identity")
    trailer = pos + header_len - TRAILER.size - ident
    identity = view[trailer + TRAILER.size: pos + header_len].hex() if identities else ""
    try:
        aborted = rawfetch.unpack_aborted(view, pos + REPLY.size, trailer)
    except ValueError as e:
        raise ProtocolError(f"replica fetch section at byte {pos}: {e}") from None
    log_end, hw, section_status, epoch, offset = TRAILER.unpack_from(view, trailer)
    if section_status not in SECTION_STATUSES:
        raise ProtocolError(f"replica fetch section at byte {pos}: unknown section status {section_status}")
    return Section(start, end, earliest, latest, log_end, hw, section_status, epoch, offset,
                   view[pos + header_len:stop], aborted, "" if identity == "00" * 16 else identity), stop


def unpack_body(head: ReplyHead, body) -> tuple:
    """(journal frames, sections) from a status-0 reply's body (``head.body_len`` bytes)."""
    view = memoryview(body).cast("B")
    if len(view) != head.body_len:
        raise ProtocolError(f"replica fetch reply body of {len(view)} bytes, its head says {head.body_len}")
    journal = bytes(view[:head.journal_len])
    pos = pad8(head.journal_len)
    sections = []
    for _ in range(head.sections):  # per partition
        section, pos = unpack_section(view, pos, bool(head.flags & FLAG_IDENTITIES))
        sections.append(section)
    if pos != len(view):
        raise ProtocolError(f"replica fetch reply has {len(view) - pos} bytes after its {head.sections} sections")
    return journal, sections
