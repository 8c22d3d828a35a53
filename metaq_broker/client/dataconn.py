"""Client side of the broker's data port (``metaq_broker.server.data_server``): fetches over a persistent TCP
connection, each reply received straight into a buffer of its own (``recv_into``, no further copies), and
returned as the ``rawfetch.FetchReply`` that ``FetchRaw`` gives (the aborted transactions with it), so
decoding is the same. Puts send a ``PutRaw`` request's buffers with one scatter-gather write.

A refusal (unknown topic, offset out of range, closed partition...) raises the same ``BrokerError``
subclass as over gRPC, naming the same status code, and leaves the connection usable. A broken connection
raises ``OSError`` (or ``dataport.ProtocolError``) and is closed; it connects again on its next use. Callers
that must ride out a broker restart (the Spark source) fall back to gRPC ``FetchRaw``, which knows how to
wait for a broker.
"""
from __future__ import annotations

import socket
import threading
from typing import Optional

import grpc
import numpy as np

from metaq_broker.protocol import rawfetch
from metaq_broker.protocol.dataport import (CONNECT_TIMEOUT, OK, PUT_REPLY, REPLY, STATUS_BY_NUMBER, ProtocolError,
                                            pack_request, put_request, recv_exact, send_all)
from metaq_broker.protocol.status import error_of

# A longer header than this is not a data port reply. The aborted list makes it long: 24 bytes for each
# aborted transaction overlapping the reply (at most one per batch in it, plus those open across it).
MAX_HEADER = 64 << 20


class DataConnection:
    """One connection to one broker's data port, used by one caller at a time. ``send`` may run ahead of
    ``receive`` (replies come in request order), so the next fetch is on its way while a reply is decoded."""

    def __init__(self, address: str, timeout: float = 30.0):
        self.address = address
        host, _, port = address.rpartition(":")
        self._target = (host.strip("[]"), int(port))
        self.timeout = timeout
        self.sock: Optional[socket.socket] = None
        self.outstanding = 0  # requests sent whose replies are not yet received
        self.connects = 0  # connections made (a test sees reuse)
        self._head = bytearray(REPLY.size)

    def connect(self, timeout: Optional[float] = None) -> None:
        """Connect if not connected. Nothing is sent, so a caller may fall back to gRPC when this fails."""
        if self.sock is None:
            timeout = self.timeout if timeout is None else timeout
            sock = socket.create_connection(self._target, timeout=min(CONNECT_TIMEOUT, timeout))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock, self.outstanding = sock, 0
            self.connects += 1

    def _send(self, parts: list, timeout: Optional[float]) -> None:
        try:
            self.connect(timeout)
            self.sock.settimeout(self.timeout if timeout is None else timeout)
            send_all(self.sock, parts)
        except BaseException:
            self.close()
            raise
        self.outstanding += 1

    def send(self, topic: str, partition: int, offset: int, max_bytes: int = 0, max_messages: int = 0,
             max_wait_ms: int = 0, timeout: Optional[float] = None) -> None:
        """Send one fetch (connecting first if need be)."""
        self._send([pack_request(topic, partition, offset, max_bytes, max_messages, max_wait_ms)], timeout)

    def send_put(self, parts: list, timeout: Optional[float] = None) -> None:
        """Send one put: ``parts`` of a ``PutRaw`` request (``rawput.pack_parts``), not joined."""
        self._send(put_request(parts), timeout)

    def receive_put(self, timeout: Optional[float] = None) -> tuple:
        """The reply to the oldest request sent, a put: (base_offset, base_msg_id, timestamp_ms, partition,
        count, fsynced); a refusal raises the gRPC path's error."""
        self._check_awaiting()
        head = bytearray(PUT_REPLY.size)
        try:
            self.sock.settimeout(self.timeout if timeout is None else timeout)
            self._recv(memoryview(head))
            reply_len, status, *fields, _ = PUT_REPLY.unpack(head)
            if not PUT_REPLY.size <= reply_len <= MAX_HEADER:
                raise ProtocolError(f"data port {self.address}: bad put reply of {reply_len} bytes")
            message = bytearray(reply_len - PUT_REPLY.size)
            if message:
                self._recv(memoryview(message))
        except BaseException:
            self.close()
            raise
        self.outstanding -= 1
        if status != OK:
            raise self._refusal(status, message)
        return tuple(fields[:5]) + (bool(fields[5]),)

    def receive(self, timeout: Optional[float] = None) -> rawfetch.FetchReply:
        """The reply to the oldest request sent. ``timeout`` bounds each wait for bytes."""
        self._check_awaiting()
        try:
            self.sock.settimeout(self.timeout if timeout is None else timeout)
            self._recv(memoryview(self._head))
            header_len, status, start, end, earliest, latest, body_len = REPLY.unpack(self._head)
            if not REPLY.size <= header_len <= MAX_HEADER or body_len < 0:
                raise ProtocolError(f"data port {self.address}: bad reply header ({header_len}, {body_len} bytes)")
            # The rest of the header (the aborted list) and the body in one buffer, received at once; the
            # header's length is a multiple of 8, so the records stay 8-aligned.
            extra = header_len - REPLY.size
            buf = np.empty(extra + body_len, np.uint8)
            if len(buf):
                self._recv(memoryview(buf))
            try:
                aborted = rawfetch.unpack_aborted(buf, 0, extra) if status == OK else None
            except ValueError as e:
                raise ProtocolError(f"data port {self.address}: {e}") from None
        except BaseException:
            self.close()
            raise
        self.outstanding -= 1
        body = buf[extra:]
        if status != OK:
            raise self._refusal(status, body.tobytes())
        return rawfetch.FetchReply(start, end, earliest, latest, memoryview(body), aborted)

    def _check_awaiting(self) -> None:
        if self.sock is None or not self.outstanding:
            raise ProtocolError(f"data port {self.address}: no request awaits a reply")

    def _recv(self, view: memoryview) -> None:
        """Fill ``view``; a connection closed before its first byte is ConnectionResetError."""
        if not recv_exact(self.sock, view):
            raise ConnectionResetError(f"data port {self.address} closed the connection")

    def _refusal(self, status: int, message) -> Exception:
        """The error the gRPC path raises for this status and message."""
        code = STATUS_BY_NUMBER.get(status, grpc.StatusCode.UNKNOWN)
        return error_of(code, bytes(message).decode("utf-8", "replace"), self.address)

    def fetch(self, topic: str, partition: int, offset: int, max_bytes: int = 0, max_messages: int = 0,
              max_wait_ms: int = 0, timeout: Optional[float] = None) -> rawfetch.FetchReply:
        """``send`` then ``receive``. A connection that was idle and turns out broken (the broker restarted)
        is replaced once; fetching is read-only, so sending again is safe."""
        for attempt in (0, 1):
            reused = self.sock is not None
            try:
                self.send(topic, partition, offset, max_bytes, max_messages, max_wait_ms, timeout)
                return self.receive(timeout)
            except (OSError, ProtocolError):
                if attempt or not reused:
                    raise
        raise AssertionError("unreachable")

    def alive(self) -> bool:
        """False when the broker has closed the connection (checked without blocking)."""
        if self.sock is None:
            return True
        if self.outstanding:
            return False
        try:
            self.sock.settimeout(0)
            self.sock.recv(1, socket.MSG_PEEK)  # b"": closed; any byte: nobody asked for it
        except BlockingIOError:
            return True  # nothing to read: still connected
        except OSError:
            pass
        return False

    def close(self) -> None:
        sock, self.sock, self.outstanding = self.sock, None, 0
        if sock is not None:
            sock.close()

    def __enter__(self) -> "DataConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DataConnectionPool:
    """Idle data connections by address. ``acquire`` hands one to a single caller (a fresh one when none
    is idle or the idle ones were closed by the broker); ``release`` keeps it for the next caller when it
    has no reply pending, else closes it."""

    def __init__(self, timeout: float = 30.0):
        self.timeout = timeout
        self._idle: dict = {}
        self._lock = threading.Lock()

    def acquire(self, address: str) -> DataConnection:
        while True:
            with self._lock:
                idle = self._idle.get(address)
                conn = idle.pop() if idle else None
            if conn is None:
                return DataConnection(address, self.timeout)
            if conn.alive():
                return conn
            conn.close()

    def release(self, conn: DataConnection) -> None:
        if conn.sock is None or conn.outstanding:
            conn.close()
            return
        with self._lock:
            self._idle.setdefault(conn.address, []).append(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
