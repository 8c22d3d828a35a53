"""Client side of the broker's data port (``metaq_broker.server.data_server``): fetches over a persistent TCP
connection, each reply received straight into a buffer of its own (``recv_into``, no further copies), and
returned as the ``rawfetch.FetchReply`` that ``FetchRaw`` gives (the aborted transactions with it), so
decoding is the same. Puts send a ``PutRaw`` request's buffers with one scatter-gather write.

A refusal (unknown topic, offset out of range, closed partition...) raises the same ``BrokerError``
subclass as over gRPC, naming the same status code, and leaves the connection usable. A broken connection
raises ``OSError`` (or ``dataport.ProtocolError``) and is closed; it connects again on its next use. Callers
that must ride out a broker restart (the Spark source) fall back to gRPC ``FetchRaw``, which knows how to
wait for a broker.

Security is the client's ``ClientSecurity``: with SSL or SASL_SSL the connection is TLS, the broker's
certificate checked against ``ssl.ca.location`` and the address's host name; with SASL_SSL the first frame
is AUTH with the session token the broker's gRPC connection got (``session``). A failed handshake or a
refused token raises ``AuthenticationError`` at once, never a fallback to gRPC: a certificate or a
password that is wrong is a misconfiguration to be told, and gRPC would meet the same one. A broker that
cannot be reached is still an ``OSError``, as without TLS.
"""
from __future__ import annotations

import functools
import socket
import ssl
import threading
import weakref
from typing import Callable, Optional

import numpy as np

from metaq_broker.errors import AuthenticationError
from metaq_broker.net.blocking import authenticate, recv_exact, send_all
from metaq_broker.protocol import dataport, rawfetch
from metaq_broker.protocol.dataport import CONNECT_TIMEOUT, PUT_REPLY, REPLY, ProtocolError, pack_request, put_request
from metaq_broker.security import tls
from metaq_broker.security.settings import ClientSecurity

DIAGNOSE_WAIT = 0.5  # how long a probe waits for a TLS alert after a fresh connection broke (_diagnose)
# TLS failures that are a connection going away (the broker stopping), not a certificate refused
_CLOSED = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)


@functools.lru_cache(maxsize=16)
def _context(security: ClientSecurity) -> ssl.SSLContext:
    """One context per security setting, shared by its connections (loading the CA file is not free)."""
    return tls.client_context(security)


class DataConnection:
    """One connection to one broker's data port, used by one caller at a time. ``send`` may run ahead of
    ``receive`` (replies come in request order), so the next fetch is on its way while a reply is decoded.
    ``security`` (None: PLAINTEXT) says whether to speak TLS; ``session`` is a callable giving the broker's
    session token (``BrokerConnection.session_token``, with ``renew=True`` for a new one), needed with
    SASL_SSL."""

    def __init__(self, address: str, timeout: float = 30.0, security: Optional[ClientSecurity] = None,
                 session: Optional[Callable[..., Optional[str]]] = None):
        self.address = address
        host, _, port = address.rpartition(":")
        self._target = (host.strip("[]"), int(port))
        self.timeout = timeout
        self.security = security or ClientSecurity()
        self.session = session
        self.principal: Optional[str] = None  # the broker's name for us, after an AUTH (SASL_SSL)
        self.sock: Optional[socket.socket] = None
        self.outstanding = 0  # requests sent whose replies are not yet received
        self.connects = 0  # connections made (a test sees reuse)
        self._head = bytearray(REPLY.size)
        self._answered = False  # a reply came on this connection (else a break may be a refusal in disguise)
        self.retired = False  # cut off because its broker group's master moved (DataConnectionPool.retire)

    def connect(self, timeout: Optional[float] = None) -> None:
        """Connect if not connected (the TLS handshake and the AUTH frame included). An OSError means the
        broker could not be reached and no request was sent, so a caller may fall back to gRPC;
        AuthenticationError means the broker refused us (or we it), and gRPC would not do better."""
        if self.sock is None:
            timeout = self.timeout if timeout is None else timeout
            sock = socket.create_connection(self._target, timeout=min(CONNECT_TIMEOUT, timeout))
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.security.uses_tls:
                    sock = self._handshake(sock)
                if self.security.uses_sasl:
                    try:
                        self._authenticate(sock)
                    except OSError as e:
                        self._diagnose(e)
                        raise
            except BaseException:
                sock.close()
                raise
            self.sock, self.outstanding, self._answered = sock, 0, False
            self.connects += 1

    def _handshake(self, sock: socket.socket) -> ssl.SSLSocket:
        """TLS over ``sock`` (within its connect timeout); a refused handshake is AuthenticationError
        with the reason in words."""
        try:
            return _context(self.security).wrap_socket(sock, server_hostname=self._target[0])
        except _CLOSED:
            raise
        except ssl.SSLError as e:
            raise AuthenticationError(tls.explain(e, self.address)) from None

    def _diagnose(self, error: BaseException) -> None:
        """A TLS connection broke before its first reply: a broker that refused our certificate (TLS 1.3
        tells it only after the handshake, and the alert may be lost to the reset) looks the same as one
        going away. Another handshake, waiting briefly for the broker's verdict, tells them apart: raises
        AuthenticationError for a refusal, else returns (the caller raises ``error``)."""
        if not self.security.uses_tls or isinstance(error, TimeoutError):
            return
        try:
            probe = _context(self.security).wrap_socket(
                socket.create_connection(self._target, timeout=CONNECT_TIMEOUT), server_hostname=self._target[0])
        except (OSError, AuthenticationError):
            return
        try:
            probe.settimeout(DIAGNOSE_WAIT)
            probe.recv(1)  # a broker that accepted us waits for a request: this times out
        except _CLOSED:
            pass
        except ssl.SSLError as e:
            raise AuthenticationError(tls.explain(e, self.address)) from None
        except OSError:
            pass
        finally:
            probe.close()

    def _authenticate(self, sock: ssl.SSLSocket) -> None:
        """Send the AUTH frame; a refused token is renewed once (the broker restarted and forgot its
        sessions) before the refusal is raised."""
        if self.session is None:
            raise AuthenticationError(f"data port {self.address}: SASL_SSL needs the broker's session token "
                                      f"(DataConnection(session=...))")

        def token(renew: bool) -> str:
            found = self.session(renew=True) if renew else self.session()
            if not found:
                raise AuthenticationError(f"data port {self.address}: no session token for SASL_SSL")
            return found
        self.principal = authenticate(sock, token, lambda view: self._recv(view, sock), self.address)

    def _send(self, parts: list, timeout: Optional[float]) -> None:
        try:
            self.connect(timeout)
            self.sock.settimeout(self.timeout if timeout is None else timeout)
            send_all(self.sock, parts)
        except BaseException as e:
            self._broken(e)
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
        raw = bytearray(PUT_REPLY.size)
        try:
            self.sock.settimeout(self.timeout if timeout is None else timeout)
            self._recv(memoryview(raw))
            head = dataport.unpack_put_reply(raw, self.address)
            message = bytearray(head.rest)
            if message:
                self._recv(memoryview(message))
        except BaseException as e:
            self._broken(e)
            raise
        self.outstanding -= 1
        self._answered = True
        return head.result(message, self.address)

    def receive(self, timeout: Optional[float] = None) -> rawfetch.FetchReply:
        """The reply to the oldest request sent. ``timeout`` bounds each wait for bytes."""
        self._check_awaiting()
        try:
            self.sock.settimeout(self.timeout if timeout is None else timeout)
            self._recv(memoryview(self._head))
            head = dataport.unpack_reply_head(self._head, self.address)
            # The rest of the header (the aborted list) and the body in one buffer, received at once; the
            # header's length is a multiple of 8, so the records stay 8-aligned.
            buf = np.empty(head.rest, np.uint8)
            if len(buf):
                self._recv(memoryview(buf))
            if head.status == dataport.OK:
                reply = dataport.fetch_reply(head, buf, self.address)  # ProtocolError: a bad aborted list
        except BaseException as e:
            self._broken(e)
            raise
        self.outstanding -= 1
        self._answered = True
        if head.status != dataport.OK:  # a refusal: the connection serves on
            raise dataport.refusal(head.status, buf[head.header_len - REPLY.size:], self.address)
        return reply

    def _broken(self, error: BaseException) -> None:
        """Close after ``error``; raises AuthenticationError instead if the broker refused our certificate."""
        fresh = self.sock is not None and not self._answered
        self.close()
        if fresh and isinstance(error, OSError):
            self._diagnose(error)

    def _check_awaiting(self) -> None:
        if self.sock is None or not self.outstanding:
            raise ProtocolError(f"data port {self.address}: no request awaits a reply")

    def _recv(self, view: memoryview, sock: Optional[socket.socket] = None) -> None:
        """Fill ``view``; a connection closed before its first byte is ConnectionResetError. A TLS alert
        (the broker refused our certificate: TLS 1.3 tells it after the handshake) is AuthenticationError."""
        try:
            if recv_exact(self.sock if sock is None else sock, view):
                return
        except _CLOSED:
            raise
        except ssl.SSLError as e:
            raise AuthenticationError(tls.explain(e, self.address)) from None
        raise ConnectionResetError(f"data port {self.address} closed the connection")

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
            if isinstance(self.sock, ssl.SSLSocket):  # no MSG_PEEK: a byte read is one nobody asked for anyway
                self.sock.recv(1)  # TLS 1.3 session tickets are taken in, then SSLWantReadError
            else:
                self.sock.recv(1, socket.MSG_PEEK)  # b"": closed; any byte: nobody asked for it
        except (BlockingIOError, ssl.SSLWantReadError):
            return True  # nothing to read: still connected
        except OSError:
            pass
        return False

    def close(self) -> None:
        sock, self.sock, self.outstanding = self.sock, None, 0
        if sock is not None:
            sock.close()

    def cut(self) -> None:
        """From another thread: end a wait for a reply at once (the caller's receive fails with OSError),
        as closing a gRPC channel ends its calls. The plain socket's shutdown, also under TLS."""
        sock = self.sock
        if sock is not None:
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> "DataConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DataConnectionPool:
    """Idle data connections by address and security. ``acquire`` hands one to a single caller (a fresh
    one when none is idle or the idle ones were closed by the broker); ``release`` keeps it for the next
    caller when it has no reply pending, else closes it. ``security`` is the pool's default; ``acquire``
    may name another (a worker's pool shared by queries with different settings). ``retire(address)``
    (a group's master moved away from it) cuts off the connections in use there and drops the idle ones."""

    def __init__(self, timeout: float = 30.0, security: Optional[ClientSecurity] = None):
        self.timeout = timeout
        self.security = security or ClientSecurity()
        self._idle: dict = {}
        self._busy: dict = {}  # address -> connections handed out, not released yet (weakly: some are dropped)
        self._lock = threading.Lock()

    def acquire(self, address: str, session: Optional[Callable[..., Optional[str]]] = None,
                security: Optional[ClientSecurity] = None) -> DataConnection:
        """A connection to ``address``; ``session`` gives the session token its (re)connections send
        (SASL_SSL)."""
        security = security or self.security
        while True:
            with self._lock:
                idle = self._idle.get(address, ())
                i = next((i for i in range(len(idle) - 1, -1, -1) if idle[i].security == security), None)
                conn = idle.pop(i) if i is not None else None
            if conn is None:
                conn = DataConnection(address, self.timeout, security, session)
            elif conn.alive():
                conn.session = session or conn.session
            else:
                conn.close()
                continue
            with self._lock:
                self._busy.setdefault(address, weakref.WeakSet()).add(conn)
            return conn

    def release(self, conn: DataConnection) -> None:
        with self._lock:
            self._busy.get(conn.address, weakref.WeakSet()).discard(conn)
            if conn.sock is not None and not conn.outstanding and not conn.retired:
                self._idle.setdefault(conn.address, []).append(conn)
                return
        conn.close()

    def retire(self, address: str) -> None:
        """The broker group whose master was at ``address`` has a new one: puts waiting there for an answer
        end at once (the master may be frozen, or cut off), flagged ``retired``, and idle connections go."""
        with self._lock:
            idle = self._idle.pop(address, [])
            busy = list(self._busy.get(address, ()))
        for conn in busy:
            conn.retired = True
            conn.cut()
        for conn in idle:
            conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
