"""The data port's wire format (docs/protocol.md), parsed and built without I/O. Every request starts with
its length and kind.

- FETCH: a fixed 32-byte request and the topic, answered with ``rawfetch``'s header (its ``flags`` field
  carrying a status code), the records' length, the aborted list (``rawfetch.pack_aborted``; only on
  status OK), and the records.
- PUT: an 8-byte prefix and a ``PutRaw`` request (``rawput``) as it is, answered with a fixed 48-byte
  reply (status, where the batch went) and, on an error, the message.
- AUTH: a FETCH-shaped 32-byte request whose "topic" is the session token a client got from the broker's
  gRPC ``metaq.v1.Auth/Authenticate`` (SASL_SSL only; the first frame of a connection), answered in the
  fetch reply's layout with the principal as the body, or a refusal.
- REPLICA_FETCH: a group member's copy of its master's log (``protocol/replication.py``).

The broker's listener feeds a ``RequestReader`` and sends what the encoders here build; the client
(``client/dataconn.py``) and a group member's replica fetcher build their requests and read the replies
with the same functions. As h11 keeps HTTP's state apart from httpcore's sockets, nothing here does I/O
(``.importlinter`` forbids sockets in ``protocol``): ``RequestReader`` hands out the buffer its next bytes
go into, so a put's body is received straight into the connection's own buffer, never copied."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import grpc

from metaq_broker.errors import InvalidMessageError, MessageTooLargeError, MetaqError
from metaq_broker.protocol import rawfetch, rawput
from metaq_broker.protocol.records import ALIGN
from metaq_broker.protocol.status import BrokerError, error_of

FETCH, PUT, AUTH = 1, 2, 4  # request kinds (3 is reserved for replication)
REPLICA_FETCH = 3  # a group member's replica fetch (protocol/replication.py)
# Every request: request_len (all of it), kind, a u16 the kind defines (FETCH: the topic's length; PUT: 0;
# AUTH: the token's length)
PREFIX = struct.Struct("<IHH")
# request_len (all of it, topic included), kind, topic_len, partition, offset, max_bytes, max_messages, max_wait_ms
REQUEST = struct.Struct("<IHHiqiii")
assert REQUEST.size == 32
MAX_TOPIC_BYTES = 1024
MAX_TOKEN_BYTES = 4096  # an AUTH frame's session token
MAX_AUTH_REPLY = 64 << 10  # an AUTH reply's body: the principal, or the refusal's message
AUTH_ATTEMPTS = 3  # refused AUTH frames a connection may send before the broker closes it
# rawfetch.HEADER (header_len, status in place of flags, start, end, earliest, latest) + body_len; on status OK
# the aborted list follows (header_len = REPLY.size + its length), then body_len bytes of records
REPLY = struct.Struct("<IIqqqqq")
assert REPLY.size == 48 and REPLY.format[:7] == rawfetch.HEADER.format
OK = 0
# A longer reply header than this is not a data port reply. The aborted list makes it long: 24 bytes for each
# aborted transaction overlapping the reply (at most one per batch in it, plus those open across it).
MAX_REPLY_HEADER = 64 << 20
# reply_len (the error message follows on a status other than OK), status, base_offset, base_msg_id,
# timestamp_ms, partition, count, fsynced (0 or 1), reserved (0)
PUT_REPLY = struct.Struct("<IIqqqiIII")
assert PUT_REPLY.size == 48
MAX_PUT_BYTES = 256 << 20  # as gRPC's message limit on the broker: a PutRaw too large for one is for the other
CONNECT_TIMEOUT = 5.0  # a client gives up on the data port (and uses FetchRaw) after this
DISCARD_CHUNK = 64 << 10  # a refused put's body is read through a buffer of this size and dropped
_PUT_FIXED = rawput.HEADER.size - (REQUEST.size - PREFIX.size)  # a PutRaw header's bytes after a request head


def code_number(code: grpc.StatusCode) -> int:
    return code.value[0]


STATUS_BY_NUMBER = {code_number(c): c for c in grpc.StatusCode}


class ProtocolError(MetaqError):
    """The peer broke the data port's framing; the connection is closed."""


# -- requests, built by clients ----------------------------------------------------------------------

def pack_request(topic: str, partition: int, offset: int, max_bytes: int = 0, max_messages: int = 0,
                 max_wait_ms: int = 0) -> bytes:
    name = topic.encode()
    if len(name) > MAX_TOPIC_BYTES:
        raise ValueError(f"topic name of {len(name)} bytes is over {MAX_TOPIC_BYTES}")
    return REQUEST.pack(REQUEST.size + len(name), FETCH, len(name), partition, offset, max_bytes, max_messages,
                        max_wait_ms) + name


def pack_auth(token: str) -> bytes:
    """The AUTH frame: REQUEST's layout with kind AUTH, the token in place of the topic, the rest 0."""
    data = token.encode()
    if len(data) > MAX_TOKEN_BYTES:
        raise ValueError(f"session token of {len(data)} bytes is over {MAX_TOKEN_BYTES}")
    return REQUEST.pack(REQUEST.size + len(data), AUTH, len(data), 0, 0, 0, 0, 0) + data


def put_request(parts: list) -> list:
    """A PUT request as buffers: the prefix, then the ``PutRaw`` request's ``parts`` (``rawput.pack_parts``)."""
    length = PREFIX.size + sum(len(p) for p in parts)
    if length > MAX_PUT_BYTES:
        raise ValueError(f"put request of {length} bytes is over the data port's {MAX_PUT_BYTES}")
    return [PREFIX.pack(length, PUT, 0), *parts]


# -- replies, built by the broker --------------------------------------------------------------------

def fetch_reply_head(start: int, end: int, earliest: int, latest: int, body_len: int, aborted) -> bytes:
    """A FETCH reply up to its records: the header and the aborted list; ``body_len`` record bytes follow."""
    listed = rawfetch.pack_aborted(aborted)
    return REPLY.pack(REPLY.size + len(listed), OK, start, end, earliest, latest, body_len) + listed


def auth_reply(principal: str) -> bytes:
    """An AUTH frame taken: the principal the session names, as the body of a fetch-shaped reply."""
    body = principal.encode("utf-8", "replace")
    return REPLY.pack(REPLY.size, OK, -1, -1, -1, -1, len(body)) + body


def put_reply(base_offset: int, base_msg_id: int, timestamp_ms: int, partition: int, count: int,
              fsynced: bool) -> bytes:
    return PUT_REPLY.pack(PUT_REPLY.size, OK, base_offset, base_msg_id, timestamp_ms, partition, count,
                          int(fsynced), 0)


def error_reply(kind: int, code: grpc.StatusCode, message: str) -> bytes:
    """A refusal of a request of ``kind``: a PUT's in the put reply's layout, any other in the fetch
    reply's, the message after it."""
    body = message.encode("utf-8", "replace")
    if kind == PUT:
        return PUT_REPLY.pack(PUT_REPLY.size + len(body), code_number(code), -1, -1, -1, -1, 0, 0, 0) + body
    return REPLY.pack(REPLY.size, code_number(code), -1, -1, -1, -1, len(body)) + body


# -- replies, read by clients ------------------------------------------------------------------------

class ReplyHead(NamedTuple):
    """A FETCH (or AUTH) reply's fixed header. ``rest`` bytes follow it: the aborted list (status OK), then
    ``body_len`` bytes of records, or of the refusal's message (or the principal, for AUTH)."""

    header_len: int
    status: int
    start_offset: int
    end_offset: int
    earliest_offset: int
    latest_offset: int
    body_len: int

    @property
    def rest(self) -> int:
        return self.header_len - REPLY.size + self.body_len


def unpack_reply_head(head, address: str, max_header: int = MAX_REPLY_HEADER) -> ReplyHead:
    """The fixed header of a FETCH or AUTH reply; ProtocolError if it cannot be one."""
    h = ReplyHead(*REPLY.unpack(head))
    if not REPLY.size <= h.header_len <= max_header or h.body_len < 0:
        raise ProtocolError(f"data port {address}: bad reply header ({h.header_len}, {h.body_len} bytes)")
    return h


def fetch_reply(head: ReplyHead, rest, address: str) -> rawfetch.FetchReply:
    """The reply ``head`` starts, given the ``rest`` of its bytes (a numpy buffer: the records stay a view of
    it, 8-aligned); a refusal raises the error the gRPC path raises."""
    extra = head.header_len - REPLY.size
    if head.status != OK:
        raise refusal(head.status, rest[extra:], address)
    try:
        aborted = rawfetch.unpack_aborted(rest, 0, extra)
    except ValueError as e:
        raise ProtocolError(f"data port {address}: {e}") from None
    return rawfetch.FetchReply(head.start_offset, head.end_offset, head.earliest_offset, head.latest_offset,
                               memoryview(rest[extra:]), aborted)


class PutReplyHead(NamedTuple):
    """A PUT reply's fixed part; ``reply_len - PUT_REPLY.size`` bytes of refusal message follow it."""

    reply_len: int
    status: int
    base_offset: int
    base_msg_id: int
    timestamp_ms: int
    partition: int
    count: int
    fsynced: int
    reserved: int

    @property
    def rest(self) -> int:
        return self.reply_len - PUT_REPLY.size

    def result(self, message, address: str) -> tuple:
        """(base_offset, base_msg_id, timestamp_ms, partition, count, fsynced); a refusal raises the gRPC
        path's error."""
        if self.status != OK:
            raise refusal(self.status, message, address)
        return self.base_offset, self.base_msg_id, self.timestamp_ms, self.partition, self.count, bool(self.fsynced)


def unpack_put_reply(head, address: str) -> PutReplyHead:
    h = PutReplyHead(*PUT_REPLY.unpack(head))
    if not PUT_REPLY.size <= h.reply_len <= MAX_REPLY_HEADER:
        raise ProtocolError(f"data port {address}: bad put reply of {h.reply_len} bytes")
    return h


def refusal(status: int, message, address: str) -> BrokerError:
    """The error the gRPC path raises for a data port status number and message (``status.error_of``)."""
    code = STATUS_BY_NUMBER.get(status, grpc.StatusCode.UNKNOWN)
    return error_of(code, bytes(message).decode("utf-8", "replace"), address)


# -- requests, read by the broker --------------------------------------------------------------------

@dataclass(frozen=True)
class Fetch:
    topic: str
    partition: int
    offset: int
    max_bytes: int
    max_messages: int
    max_wait_ms: int


@dataclass(frozen=True)
class Auth:
    token: str  # not UTF-8: decoded with replacements (no session has such a token)


@dataclass(frozen=True)
class PutHead:
    """A put's header is in, its body not yet: the listener checks what the header alone decides, then
    calls ``RequestReader.take_body`` (the next event is ``Put``) or ``skip_body``."""

    topic: str
    xid: str
    length: int  # of the PutRaw request: header and body


@dataclass(frozen=True)
class Put:
    request: memoryview  # the PutRaw request, in the buffer given to ``take_body``


@dataclass(frozen=True)
class ReplicaFetchHead:
    """A replica fetch's head is in: the listener authorizes it, then ``take_replica_request`` (the next
    event is ``ReplicaFetch``) or closes the connection."""

    length: int


@dataclass(frozen=True)
class ReplicaFetch:
    request: bytearray  # all of it, head included (``replication.unpack_request``)


Event = Union[Fetch, Auth, PutHead, Put, ReplicaFetchHead, ReplicaFetch]


class RequestError(MetaqError):
    """A request refused by its framing alone. ``kind`` picks the refusal's layout (``error_reply``);
    ``close``: the stream cannot be trusted past it, so the connection is closed after the refusal, else
    the reader has arranged to drop the rest of the request and reads on."""

    def __init__(self, message: str, kind: int, close: bool):
        super().__init__(message)
        self.kind, self.close = kind, close


class MalformedRequest(RequestError, InvalidMessageError):
    """INVALID_ARGUMENT: lengths that do not add up, a kind not taken here, names that are not UTF-8."""


class PutSizeRefused(RequestError, MessageTooLargeError):
    """RESOURCE_EXHAUSTED: a put's declared size is over the broker's limit, or too short for a header."""


_HEAD, _NAME, _TOKEN, _PUT_HEADER, _PUT_NAMES, _PUT_DECIDE, _PUT_BODY, _DISCARD, _REPLICA_DECIDE, \
    _REPLICA_BODY = range(10)


class RequestReader:
    """The data port's requests from a byte stream, one at a time, without I/O. The caller receives into
    ``buffer()`` (never more than the request's next part, so nothing past a request is ever read),
    reports ``received(n)``, and asks ``next_event()`` for a whole event (None: more bytes needed).
    ``next_event`` raises ``RequestError`` for a request refused by its framing (see there).

    ``kinds`` are the request kinds taken (others are refused, ``why_not[kind]`` added to the message);
    ``max_put_bytes`` the broker's put limit; ``max_replica_request`` the largest REPLICA_FETCH request."""

    def __init__(self, kinds=(FETCH, PUT), max_put_bytes: int = MAX_PUT_BYTES, max_replica_request: int = 0,
                 why_not: Optional[dict] = None):
        self.kinds, self.max_put_bytes, self.max_replica_request = frozenset(kinds), max_put_bytes, max_replica_request
        self.why_not = why_not or {}
        self._head = bytearray(REQUEST.size)
        self._fields: tuple = ()
        self._part: Optional[bytearray] = None  # the request's part being received (names, token, header)
        self._header = bytearray(rawput.HEADER.size)
        self._scratch: Optional[memoryview] = None
        self._left = 0  # _DISCARD: bytes still to drop
        self._reset()

    def _reset(self) -> None:
        self._state, self._view, self._filled = _HEAD, memoryview(self._head), 0

    def _expect(self, state: int, view, filled: int = 0) -> None:
        self._state, self._view, self._filled = state, memoryview(view), filled

    @property
    def idle(self) -> bool:
        """No byte of a request is in: the stream is between requests."""
        return self._state == _HEAD and self._filled == 0

    @property
    def has_head(self) -> bool:
        """The current request's fixed 32-byte head is in (it may be answered in its own layout)."""
        return self._state != _HEAD or self._filled == REQUEST.size

    @property
    def kind(self) -> int:
        """The current request's kind, once its head is in."""
        return PREFIX.unpack_from(self._head)[1]

    def buffer(self) -> memoryview:
        """Where the next bytes go: a view of what the current part still needs."""
        if self._state in (_PUT_DECIDE, _REPLICA_DECIDE):
            raise RuntimeError("a PutHead or ReplicaFetchHead awaits its decision")
        return self._view[self._filled:]

    def received(self, n: int) -> None:
        self._filled += n

    def next_event(self) -> Optional[Event]:
        while self._state not in (_PUT_DECIDE, _REPLICA_DECIDE) and self._filled == len(self._view):
            event = self._part_done()
            if event is not None:
                return event
        return None

    def take_body(self, view: memoryview) -> None:
        """After ``PutHead``: receive the PutRaw request into ``view`` (its ``length`` bytes)."""
        assert self._state == _PUT_DECIDE and len(view) == self._fields[0]
        header_len = len(self._header) + len(self._part)
        view[:len(self._header)] = self._header
        view[len(self._header):header_len] = self._part
        self._expect(_PUT_BODY, view, header_len)

    def skip_body(self) -> None:
        """After ``PutHead``: read the body past, through a small buffer, and drop it."""
        assert self._state == _PUT_DECIDE
        self._discard(self._fields[0] - len(self._header) - len(self._part))

    def take_replica_request(self) -> None:
        """After ``ReplicaFetchHead``: receive the whole request."""
        assert self._state == _REPLICA_DECIDE
        body = bytearray(self._fields[0])
        body[:REQUEST.size] = self._head
        self._expect(_REPLICA_BODY, body, REQUEST.size)

    def _discard(self, n: int) -> None:
        if n <= 0:
            self._reset()
            return
        if self._scratch is None:
            self._scratch = memoryview(bytearray(DISCARD_CHUNK))
        self._left = n
        self._expect(_DISCARD, self._scratch[:min(n, DISCARD_CHUNK)])

    def _part_done(self) -> Optional[Event]:
        state = self._state
        if state == _HEAD:
            return self._head_done()
        if state == _NAME:
            topic = self._decode(self._part, FETCH, "the topic name is not UTF-8")
            self._reset()
            return Fetch(topic, *self._fields)
        if state == _TOKEN:
            self._reset()
            return Auth(self._part.decode("utf-8", "replace"))
        if state == _PUT_HEADER:
            return self._put_header_done()
        if state == _PUT_NAMES:
            request_len, topic_len, xid_len = self._fields
            names = self._part
            try:
                topic, xid = names[:topic_len].decode(), names[topic_len:topic_len + xid_len].decode()
            except UnicodeDecodeError:
                self._discard(request_len - len(self._header) - len(names))
                raise MalformedRequest("PutRaw request: topic or xid is not UTF-8", PUT, close=False) from None
            self._state = _PUT_DECIDE
            return PutHead(topic, xid, request_len)
        if state == _PUT_BODY:
            view = self._view
            self._reset()
            return Put(view)
        if state == _DISCARD:
            self._left -= len(self._view)
            if self._left:
                self._expect(_DISCARD, self._scratch[:min(self._left, DISCARD_CHUNK)])
            else:
                self._reset()
            return None
        if state == _REPLICA_BODY:
            body = self._view.obj
            self._reset()
            return ReplicaFetch(body)
        raise AssertionError(f"state {state}")

    def _head_done(self) -> Optional[Event]:
        length, kind, topic_len, *fields = REQUEST.unpack(self._head)
        if kind in self.kinds:
            if kind == PUT:
                limit = self.max_put_bytes
                if not PREFIX.size + rawput.HEADER.size <= length <= limit:
                    raise PutSizeRefused(
                        f"data port put of {length} bytes is over this broker's limit of {limit} (the largest of "
                        f"maxTransferSize, maxMessageSize and {rawput.SPLIT_BYTES}, plus {rawput.HEADER_ALLOWANCE} "
                        f"for the header); closing the connection" if length > limit else
                        f"data port put of {length} bytes is too short to hold a PutRaw request; closing the "
                        f"connection", PUT, close=True)
                self._fields = (length - PREFIX.size,)
                self._header[:REQUEST.size - PREFIX.size] = self._head[PREFIX.size:]
                self._expect(_PUT_HEADER, self._header, REQUEST.size - PREFIX.size)
                return None
            if kind == REPLICA_FETCH and REQUEST.size <= length <= self.max_replica_request:
                self._fields = (length,)
                self._state = _REPLICA_DECIDE
                return ReplicaFetchHead(length)
            limit = MAX_TOPIC_BYTES if kind == FETCH else MAX_TOKEN_BYTES
            if kind in (FETCH, AUTH) and topic_len <= limit and length == REQUEST.size + topic_len:
                self._fields = tuple(fields)
                self._part = bytearray(topic_len)
                self._expect(_NAME if kind == FETCH else _TOKEN, self._part)
                return None
        raise MalformedRequest(f"malformed data port request (kind {kind}, {length} bytes, topic of {topic_len} "
                               f"bytes){self.why_not.get(kind, '')}; closing the connection", kind, close=True)

    def _put_header_done(self) -> None:
        request_len = self._fields[0]
        header_len, _, _, _, _, _, topic_len, xid_len, _ = rawput.HEADER.unpack(self._header)
        if not rawput.HEADER.size + topic_len + xid_len <= header_len <= request_len or header_len % ALIGN:
            self._discard(request_len - rawput.HEADER.size)  # the frame's length still holds
            raise MalformedRequest(f"PutRaw request header says the body starts at byte {header_len} of "
                                   f"{request_len}", PUT, close=False)
        self._fields = (request_len, topic_len, xid_len)
        self._part = bytearray(header_len - rawput.HEADER.size)
        self._expect(_PUT_NAMES, self._part)
        return None

    def _decode(self, data: bytearray, kind: int, why: str) -> str:
        try:
            return data.decode()
        except UnicodeDecodeError:
            self._reset()
            raise MalformedRequest(why, kind, close=False) from None
