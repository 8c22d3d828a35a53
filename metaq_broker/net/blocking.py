"""Blocking socket I/O that the client's data connections and a group member's replica fetcher share:
fill a buffer, send buffers with scatter-gather writes, the data port's AUTH exchange, a replica fetch's
reply. What goes over the wire is built and parsed in ``protocol/`` (which has no sockets); this module
moves the bytes."""
from __future__ import annotations

import socket
import ssl
from typing import Callable, Optional

import grpc
import numpy as np

from metaq_broker.protocol import dataport
from metaq_broker.protocol import replication as rp
from metaq_broker.protocol.dataport import REPLY, ProtocolError

COALESCE = 64 << 10  # on TLS, smaller parts are joined so that they share TLS records


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


def authenticate(sock: socket.socket, token: Callable[[bool], str], recv: Callable[[memoryview], None],
                 address: str) -> str:
    """The AUTH exchange, a connection's first: the frame with ``token(False)``, and once more with
    ``token(True)`` (renewed: the broker restarted and forgot its sessions) when refused UNAUTHENTICATED.
    The principal the broker names; a refusal as the error the gRPC path raises (``status.error_of``).
    ``recv(view)`` fills a view or raises (the connection closed, a TLS alert)."""
    for renew in (False, True):
        send_all(sock, [dataport.pack_auth(token(renew))])
        raw = bytearray(REPLY.size)
        recv(memoryview(raw))
        head = dataport.unpack_reply_head(raw, address, max_header=REPLY.size)
        if head.body_len > dataport.MAX_AUTH_REPLY:
            raise ProtocolError(f"data port {address}: bad AUTH reply ({head.header_len}, {head.body_len} bytes)")
        body = bytearray(head.body_len)
        if head.body_len:
            recv(memoryview(body))
        if head.status == dataport.OK:
            return body.decode("utf-8", "replace")
        error = dataport.refusal(head.status, body, address)
        if renew or error.code != grpc.StatusCode.UNAUTHENTICATED:
            raise error
    raise AssertionError("unreachable")


def read_replica_reply(sock, view_alloc: Optional[Callable[[int], object]] = None,
                       max_body: int = rp.MAX_REPLY_BODY) -> tuple:
    """(ReplyHead, journal frames, sections) of a replica fetch, read from ``sock``. The body is received
    with one buffer from ``view_alloc(n)`` (a writable buffer of at least n bytes, e.g. one the fetcher
    reuses; default a fresh one), and the sections' records are views of it, so they are valid until that
    buffer is reused. A refusal returns its head (with the message), no journal and no sections.
    ProtocolError on malformed replies or a connection closed before or during one."""
    head_buf = bytearray(rp.REPLY_HEAD.size)
    if not recv_exact(sock, memoryview(head_buf)):
        raise ProtocolError("connection closed before the replica fetch reply")
    head = rp.unpack_reply_head(head_buf)
    extra = rp.REPLY_HEAD.unpack_from(head_buf)[0] - rp.REPLY_HEAD.size
    if extra:  # head fields added later: skipped
        if extra > rp.MAX_MESSAGE_BYTES:
            raise ProtocolError(f"replica fetch reply head of {extra + rp.REPLY_HEAD.size} bytes")
        _recv_reply(sock, memoryview(bytearray(extra)))
    if head.status != dataport.OK:
        message = bytearray(head.body_len)
        _recv_reply(sock, memoryview(message))
        head.message = message.decode("utf-8", "replace")
        return head, b"", []
    if head.body_len > max_body:
        raise ProtocolError(f"replica fetch reply body of {head.body_len} bytes is over {max_body}")
    if view_alloc is None:
        body = memoryview(np.empty(head.body_len, np.uint8))
    else:
        body = memoryview(view_alloc(head.body_len)).cast("B")[:head.body_len]
        if len(body) < head.body_len:
            raise ValueError(f"view_alloc gave {len(body)} bytes for a reply body of {head.body_len}")
    _recv_reply(sock, body)
    journal, sections = rp.unpack_body(head, body)
    return head, journal, sections


def _recv_reply(sock, view: memoryview) -> None:
    if len(view) and not recv_exact(sock, view):
        raise ProtocolError(f"connection closed before {len(view)} bytes of the replica fetch reply")
