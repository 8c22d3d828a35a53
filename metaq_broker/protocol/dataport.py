"""The data port's wire format (docs/protocol.md). Every request starts with its length and kind.

- FETCH: a fixed 32-byte request and the topic, answered with ``rawfetch``'s header (its ``flags`` field
  carrying a status code), the records' length, the aborted list (``rawfetch.pack_aborted``; only on
  status OK), and the records.
- PUT: an 8-byte prefix and a ``PutRaw`` request (``rawput``) as it is, answered with a fixed 48-byte
  reply (status, where the batch went) and, on an error, the message.
- AUTH: a FETCH-shaped 32-byte request whose "topic" is the session token a client got from the broker's
  gRPC ``metaq.v1.Auth/Authenticate`` (SASL_SSL only; the first frame of a connection), answered in the
  fetch reply's layout with the principal as the body, or a refusal.

No sockets are opened here: the broker's data server and the client's data connection both frame with it."""
from __future__ import annotations

import socket
import ssl
import struct

import grpc

from metaq_broker.errors import MetaqError
from metaq_broker.protocol import rawfetch
from metaq_broker.protocol.status import error_of

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
# reply_len (the error message follows on a status other than OK), status, base_offset, base_msg_id,
# timestamp_ms, partition, count, fsynced (0 or 1), reserved (0)
PUT_REPLY = struct.Struct("<IIqqqiIII")
assert PUT_REPLY.size == 48
MAX_PUT_BYTES = 256 << 20  # as gRPC's message limit on the broker: a PutRaw too large for one is for the other
CONNECT_TIMEOUT = 5.0  # a client gives up on the data port (and uses FetchRaw) after this


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


def authenticate(sock: socket.socket, token, recv, address: str) -> str:
    """The AUTH exchange, a connection's first: the frame with ``token(False)``, and once more with
    ``token(True)`` (renewed: the broker restarted and forgot its sessions) when refused UNAUTHENTICATED.
    The principal the broker names; a refusal as the error the gRPC path raises (``status.error_of``).
    ``recv(view)`` fills a view or raises (the connection closed, a TLS alert)."""
    for renew in (False, True):
        send_all(sock, [pack_auth(token(renew))])
        head = bytearray(REPLY.size)
        recv(memoryview(head))
        header_len, status, *_, body_len = REPLY.unpack(head)
        if header_len != REPLY.size or not 0 <= body_len <= MAX_AUTH_REPLY:
            raise ProtocolError(f"data port {address}: bad AUTH reply ({header_len}, {body_len} bytes)")
        body = bytearray(body_len)
        if body_len:
            recv(memoryview(body))
        message = body.decode("utf-8", "replace")
        if status == OK:
            return message
        code = STATUS_BY_NUMBER.get(status, grpc.StatusCode.UNKNOWN)
        if renew or code != grpc.StatusCode.UNAUTHENTICATED:
            raise error_of(code, message, address)
    raise AssertionError("unreachable")


def put_request(parts: list) -> list:
    """A PUT request as buffers: the prefix, then the ``PutRaw`` request's ``parts`` (``rawput.pack_parts``)."""
    length = PREFIX.size + sum(len(p) for p in parts)
    if length > MAX_PUT_BYTES:
        raise ValueError(f"put request of {length} bytes is over the data port's {MAX_PUT_BYTES}")
    return [PREFIX.pack(length, PUT, 0), *parts]


def code_number(code: grpc.StatusCode) -> int:
    return code.value[0]


STATUS_BY_NUMBER = {code_number(c): c for c in grpc.StatusCode}


class ProtocolError(MetaqError):
    """The peer broke the data port's framing; the connection is closed."""


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False if the peer closed before the first byte, ProtocolError if it
    closed part-way."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return False
            raise ProtocolError(f"connection closed after {got} of {n} bytes")
        got += k
    return True


COALESCE = 64 << 10  # on TLS, smaller parts are joined so that they share TLS records


def send_all(sock: socket.socket, parts: list) -> None:
    """Send ``parts`` in order with scatter-gather writes (no join, no copy in Python), however the
    kernel splits them. A TLS socket has no ``sendmsg``: there, runs of small parts are joined into one
    buffer (a record each, not one per header) and large parts are written as they are."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    if isinstance(sock, ssl.SSLSocket):
        small: list = []
        for view in views:
            if len(view) < COALESCE:
                small.append(view)
                continue
            if small:
                sock.sendall(b"".join(small))
                small = []
            sock.sendall(view)
        if small:
            sock.sendall(b"".join(small))
        return
    while views:
        sent = sock.sendmsg(views[:512])  # well under IOV_MAX
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0
