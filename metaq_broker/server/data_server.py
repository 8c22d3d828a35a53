"""The broker's data port: bulk fetches and puts over plain TCP, fetched record bytes sent from the segment
file with ``sendfile``, put bodies received straight into a buffer the connection reuses.

gRPC in Python costs about a millisecond of CPU per MB fetched, end to end (copies in its Python layer
and HTTP/2 framing), and a Spark task shares its cores with the broker. The data port serves one request,
the same fetch as ``FetchRaw``, on a persistent connection: a fixed 32-byte request and the topic, answered
with ``rawfetch``'s 40-byte header (its ``flags`` field carrying a status code), the records' length, the
aborted transactions overlapping them, and the records copied by the kernel from the page cache to the
socket. docs/protocol.md gives the layout.

A PUT carries a ``PutRaw`` request as it is and is stored by the same ``BrokerService.put``; the reply
comes after the store's acknowledgement (its fsync, by the topic's flush policy), so a connection has one
put in flight and a producer opens one connection per partition it writes at once.

Everything but the transport is the gRPC calls': the same checks, errors (as gRPC status code numbers
and the same messages), counters and long-poll wait. ``dataPort`` = -1 turns the port off; clients then
use ``FetchRaw`` and ``PutRaw``, as they do whenever the data port cannot be reached.

Two stages, so that nobody holds a thread or a buffer of the broker's before it is authenticated. One
thread (``metaq-data-accept``) accepts, runs the TLS handshakes without blocking, and reads each new
connection's first frame: with SASL_SSL it must be AUTH (a session token, checked there, is all a
connection may send first), otherwise any request head. At most ``MAX_UNAUTHENTICATED`` connections are
in that stage at once (more are closed as they are accepted) and each gets ``LOGIN_TIMEOUT_S`` from its
accept; a failed handshake is logged at debug level only. Only then does the connection get a thread of
its own, which serves its requests in order: a request must arrive whole within ``REQUEST_TIMEOUT_S`` of
its first byte, and a connection idle for ``IDLE_TIMEOUT_S`` is closed (the client's pool sees it and
connects again). On plain TCP these are the kernel's timeouts (``SO_RCVTIMEO``, ``SO_SNDTIMEO``) on a
blocking socket, checked between reads, not Python's socket timeouts, which poll before every read (and
``sendfile`` needs a blocking socket); OpenSSL retries a kernel timeout without end, so a TLS connection
uses Python's. A put is checked before its body is read: its declared size against the broker's limit
(``BrokerService.max_put_bytes``: max(maxTransferSize, maxMessageSize, rawput.SPLIT_BYTES) plus the
header's allowance; over it the connection is closed after the refusal), then from its header who may
write the topic (``BrokerService.admit_put``); a refused body is read into a small scratch buffer and
dropped, never stored or kept. A replica fetch is authorized before its request body is read.

The connection's principal is its client certificate's (``BrokerAuth.principal_of_certificate``, the rule
gRPC uses too) or ANONYMOUS; with SASL_SSL it is the session's. A session ends on this port as soon as the
broker learns its user was changed or removed (``BrokerAuth.watch_sessions``: the user cache's ZooKeeper
watch) or when it expires: the accepting thread then shuts the connection down.

TLS cannot ``sendfile`` (the kernel would send the file's bytes unencrypted): a TLS connection reads the
located range with ``os.preadv`` into a buffer it reuses, in chunks of ``TLS_CHUNK``, and ``sendall``s each,
so the bytes pass through user space once, with no work per message. A group member's REPLICA_FETCH takes
the same path (``_send_range``), and needs ClusterAction on the cluster from the connection's principal.

Lock order: ``DataServer._lock`` only (the registry of connections); no other lock is taken under it.
"""
from __future__ import annotations

import logging
import os
import selectors
import socket
import ssl
import struct
import threading
import time
from typing import Optional

import grpc
import numpy as np

from metaq_broker.errors import AuthenticationError, InvalidOffsetError, MetaqError
from metaq_broker.protocol import rawput, records
from metaq_broker.protocol import replication as rp
from metaq_broker.protocol.dataport import (AUTH, AUTH_ATTEMPTS, FETCH, MAX_TOKEN_BYTES, MAX_TOPIC_BYTES, OK,
                                            PREFIX, PUT, PUT_REPLY, REPLICA_FETCH, REPLY, REQUEST, ProtocolError,
                                            code_number)
from metaq_broker.protocol.rawfetch import pack_aborted
from metaq_broker.protocol.status import code_of
from metaq_broker.security import tls
from metaq_broker.security.acl import CLUSTER
from metaq_broker.server.replica_manager import FencedError

log = logging.getLogger(__name__)

_SENDFILE_CHUNK = 1 << 30
TLS_CHUNK = 1 << 20  # a TLS connection's read buffer: record bytes go file -> buffer -> TLS in this size
LOGIN_TIMEOUT_S = 10.0  # accept to authenticated: TLS handshake and AUTH (SASL_SSL), or the first request head
MAX_UNAUTHENTICATED = 64  # connections in that stage at once; more are closed as they are accepted
REQUEST_TIMEOUT_S = 30.0  # a request's bytes (head, topic, put body) must all arrive within this of its first
IDLE_TIMEOUT_S = 600.0  # an authenticated connection that sends no request for this long is closed
REFUSAL_LOG_S = 60.0  # a principal refused the replica fetch, or a full stage of new connections, is logged
# at most this often
KEEP_PUT_BUFFER = 16 << 20  # a connection keeps its put buffer up to this size (puts are <= max_put_bytes)
DRAIN_CHUNK = 64 << 10  # a refused put's body is read through a buffer of this size and dropped
SEND_TIMEOUT_S = 60.0  # a reply the client does not take in for this long (SO_SNDTIMEO) ends the connection
REPLY_TIMEOUT_S = 1.0  # the accepting thread's wait to send a short answer (a refusal, an AUTH reply)
_TICK_S = 0.5  # with SASL_SSL the accepting thread looks for expired sessions this often
_MSG_MORE = getattr(socket, "MSG_MORE", 0)
# A receive timeout passing: SO_RCVTIMEO on a blocking socket (EAGAIN), Python's on a TLS one
_TIMED_OUT = (BlockingIOError, ssl.SSLWantReadError, TimeoutError)


class _Conn:
    """An authenticated connection served by its own thread: its socket (TLS or not), principal, session
    (SASL_SSL: ``BrokerAuth.Session`` and token, for ending it), and the buffers it reuses."""

    def __init__(self, sock: socket.socket, tls_on: bool, principal: str, session=None, token: str = ""):
        self.sock, self.tls, self.principal = sock, tls_on, principal
        self.session, self.token = session, token
        self.ended = False  # shut down by the accepting thread (session ended, broker stopping)
        self.put_buffer = np.empty(0, np.uint8)  # grown to the largest put, then reused: no new pages per put
        self._read_buffer = None  # TLS only: TLS_CHUNK bytes, file ranges pass through it

    def read_buffer(self) -> memoryview:
        if self._read_buffer is None:
            self._read_buffer = memoryview(bytearray(TLS_CHUNK))
        return self._read_buffer


class _New:
    """A connection not yet authenticated, driven by the accepting thread without blocking."""

    def __init__(self, sock: socket.socket, peer, deadline: float, handshaking: bool):
        self.sock, self.peer, self.deadline, self.handshaking = sock, peer, deadline, handshaking
        self.head = bytearray(REQUEST.size)
        self.got = 0
        self.token: Optional[bytearray] = None  # SASL_SSL: the AUTH frame's token, once its head is in
        self.token_got = 0
        self.refused = 0  # AUTH frames refused


class DataServer:
    """Accepts on ``host:port`` (0: any free port). ``service`` is the broker's ``BrokerService``: the
    store, closed partitions, counters, limits and ACL checks are its. ``auth`` (``BrokerAuth``, None:
    PLAINTEXT and anonymous) gives the TLS context, certificate principals and sessions."""

    def __init__(self, service, host: str, port: int, auth=None, replicas=None):
        self.service = service
        self.auth = auth
        self.replicas = replicas  # ReplicaManager: the master's side of REPLICA_FETCH (None: not replicated)
        self._context = auth.data_port_context() if auth is not None else None
        self._sasl = auth is not None and auth.security.uses_sasl
        self._certificates = auth is not None and auth.security.client_auth == "required"
        self._listener = socket.create_server((host, port), backlog=128)  # SO_REUSEADDR: a restart rebinds
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._conns: dict = {}  # _Conn -> its thread
        self._new: dict = {}  # socket -> _New (the accepting thread's only)
        self._lock = threading.Lock()
        self._stopping = False
        self._changed_users: set = set()  # users whose sessions may have ended, for the accepting thread
        self._logged: dict = {}  # what was last logged when (replica refusals by principal, full stage)
        self.refused_connections = 0  # closed at accept: too many unauthenticated ones (for tests, metrics)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        if auth is not None and self._sasl:
            auth.watch_sessions(self._user_changed)
        self._acceptor = threading.Thread(target=self._accept_loop, name="metaq-data-accept", daemon=True)

    def start(self) -> "DataServer":
        self._acceptor.start()
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, let each connection finish the request it is serving (up to ``grace`` seconds),
        close every connection and free the port. Returns only once no reply is being sent: the store may
        then be closed."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            conns = dict(self._conns)
        self._wake()
        if self._acceptor.ident is not None:
            self._acceptor.join(5)
        else:
            self._close_accepting()
        for conn in conns:  # the next read of a request sees the end; a reply in progress goes on
            _shutdown(conn.sock, socket.SHUT_RD)
        deadline = time.monotonic() + grace
        for conn, thread in conns.items():
            thread.join(max(deadline - time.monotonic(), 0))
            if thread.is_alive():  # a client that does not read its reply: cut it off
                _shutdown(conn.sock, socket.SHUT_RDWR)
                thread.join(5)

    def unauthenticated(self) -> int:
        """Connections accepted and not yet authenticated (for tests and metrics)."""
        return len(self._new)

    # -- the accepting thread: accept, TLS handshake, the first frame ----------------------------------
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # already awake (the pipe is full) or closed

    def _user_changed(self, user: str) -> None:
        """``BrokerAuth.watch_sessions``: on ZooKeeper's event thread; the accepting thread checks."""
        with self._lock:
            self._changed_users.add(user)
        self._wake()

    def _accept_loop(self) -> None:
        try:
            while not self._stopping:
                self._step()
        except Exception:  # noqa: BLE001 - logged; the data port stops accepting, gRPC still serves
            log.exception("data port: the accepting thread failed")
        finally:
            self._close_accepting()

    def _step(self) -> None:
        now = time.monotonic()
        waits = [n.deadline - now for n in self._new.values()] + ([_TICK_S] if self._sasl else [])
        for key, _ in self._selector.select(max(min(waits), 0) if waits else None):
            if key.fileobj is self._listener:
                self._accept()
            elif key.fileobj is self._wake_r:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except BlockingIOError:
                    pass
            else:
                self._advance(key.data)
        now = time.monotonic()
        for new in [n for n in self._new.values() if n.deadline <= now]:
            log.debug("data port: %s not authenticated within %.0fs; closed", new.peer, LOGIN_TIMEOUT_S)
            self._drop(new)
        self._end_sessions()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors: the listener stays readable; try again soon
                self._log_once("accept", logging.WARNING, "data port: accept failed: %s", e)
                time.sleep(0.05)
                return
            if len(self._new) >= MAX_UNAUTHENTICATED:
                self.refused_connections += 1
                self._log_once("full", logging.WARNING, "data port: %d connections are not authenticated yet; "
                               "refusing new ones (%d so far)", MAX_UNAUTHENTICATED, self.refused_connections)
                sock.close()
                continue
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._context is not None:
                    sock = self._context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except (OSError, ValueError) as e:
                log.debug("data port: connection from %s failed: %s", peer, e)
                sock.close()
                continue
            new = _New(sock, peer, time.monotonic() + LOGIN_TIMEOUT_S, self._context is not None)
            self._new[sock] = new
            self._selector.register(sock, selectors.EVENT_READ, new)
            self._advance(new)

    def _advance(self, new: _New) -> None:
        """Take the connection as far as its bytes allow: the handshake, then the first frame."""
        sock = new.sock
        try:
            if new.handshaking:
                sock.do_handshake()
                new.handshaking = False
            while True:
                if new.got < REQUEST.size:
                    new.got += self._recv_some(sock, memoryview(new.head)[new.got:])
                    if new.got < REQUEST.size:
                        continue
                if not self._first_frame(new):
                    return
        except ssl.SSLWantReadError:
            self._selector.modify(sock, selectors.EVENT_READ, new)
        except ssl.SSLWantWriteError:
            self._selector.modify(sock, selectors.EVENT_WRITE, new)
        except BlockingIOError:
            pass
        except (OSError, ValueError, ProtocolError) as e:  # a failed handshake, a reset
            log.debug("data port: connection from %s failed before login: %s", new.peer, e)
            self._drop(new)

    @staticmethod
    def _recv_some(sock, view: memoryview) -> int:
        n = sock.recv_into(view)
        if n == 0:
            raise ProtocolError("connection closed")
        return n

    def _first_frame(self, new: _New) -> bool:
        """The first frame's head is in: hand a connection that needs no login over to a thread, answer an
        AUTH frame (its token read first), refuse anything else. True to go on reading (after a refused AUTH)."""
        length, kind, topic_len = PREFIX.unpack_from(new.head)
        if not self._sasl:
            principal = tls.ANONYMOUS
            if self._certificates:
                try:
                    principal = self.auth.principal_of_certificate(new.sock.getpeercert(binary_form=True))
                except AuthenticationError as e:
                    self._refuse(new, kind, grpc.StatusCode.UNAUTHENTICATED, f"{e}; closing the connection")
                    return False
            self._hand_over(new, principal, bytes(new.head))
            return False
        if kind != AUTH or topic_len > MAX_TOKEN_BYTES or length != REQUEST.size + topic_len:
            self._refuse(new, kind, grpc.StatusCode.UNAUTHENTICATED,
                         "authenticate first: the data port of a SASL_SSL broker takes an AUTH frame with the "
                         "session token from metaq.v1.Auth/Authenticate before any request; closing the connection")
            return False
        if new.token is None:
            new.token, new.token_got = bytearray(topic_len), 0
        while new.token_got < topic_len:
            new.token_got += self._recv_some(new.sock, memoryview(new.token)[new.token_got:])
        token = new.token.decode("utf-8", "replace")  # not UTF-8: no session has it, refused below
        try:
            session = self.auth.session(token)
        except AuthenticationError as e:
            self._send_now(new.sock, _error(REPLY, code_number(grpc.StatusCode.UNAUTHENTICATED), str(e)))
            new.refused += 1
            if new.refused >= AUTH_ATTEMPTS:
                self._drop(new)
                return False
            new.got, new.token = 0, None
            return True
        body = session.principal.encode("utf-8", "replace")
        self._send_now(new.sock, REPLY.pack(REPLY.size, OK, -1, -1, -1, -1, len(body)) + body)
        self._hand_over(new, session.principal, None, session, token)
        return False

    def _refuse(self, new: _New, kind: int, code: grpc.StatusCode, message: str) -> None:
        self._send_now(new.sock, _error(PUT_REPLY if kind == PUT else REPLY, code_number(code), message))
        self._drop(new)

    @staticmethod
    def _send_now(sock, data: bytes) -> None:
        """A short answer from the accepting thread, waiting at most REPLY_TIMEOUT_S for room to send it."""
        sock.settimeout(REPLY_TIMEOUT_S)
        try:
            sock.sendall(data)
        finally:
            sock.setblocking(False)

    def _drop(self, new: _New) -> None:
        self._new.pop(new.sock, None)
        try:
            self._selector.unregister(new.sock)
        except (KeyError, ValueError):
            pass
        new.sock.close()

    def _hand_over(self, new: _New, principal: str, head: Optional[bytes], session=None, token: str = "") -> None:
        """The connection is authenticated: from now on its own thread serves it."""
        self._new.pop(new.sock, None)
        self._selector.unregister(new.sock)
        new.sock.setblocking(True)
        if self._context is None:  # plain TCP: the kernel's timeouts (a TLS connection sets Python's)
            new.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(SEND_TIMEOUT_S))
            new.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(REQUEST_TIMEOUT_S))
        conn = _Conn(new.sock, self._context is not None, principal, session, token)
        thread = threading.Thread(target=self._serve, args=(conn, head), name="metaq-data", daemon=True)
        with self._lock:
            if self._stopping:
                new.sock.close()
                return
            self._conns[conn] = thread
        thread.start()

    def _end_sessions(self) -> None:
        """Shut down the connections whose session expired or whose user was changed or removed."""
        if not self._sasl:
            return
        with self._lock:
            changed, self._changed_users = self._changed_users, set()
            conns = [c for c in self._conns if not c.ended]
        now = self.auth.now()
        for conn in conns:
            if conn.session.expires > now and conn.session.user not in changed:
                continue
            try:
                self.auth.session(conn.token)
                continue
            except AuthenticationError as e:
                log.info("data port: closing a connection of %s: %s", conn.principal, e)
            conn.ended = True
            _shutdown(conn.sock, socket.SHUT_RDWR)

    def _close_accepting(self) -> None:
        for new in list(self._new.values()):
            self._drop(new)
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        self._selector.close()

    def _log_once(self, what, level: int, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._logged.get(what, -REFUSAL_LOG_S) >= REFUSAL_LOG_S:
            self._logged[what] = now
            log.log(level, message, *args)

    # -- a connection's thread ------------------------------------------------------------------------
    def _serve(self, conn: _Conn, head: Optional[bytes]) -> None:
        try:
            self._serve_requests(conn, head)
        except (OSError, ProtocolError):
            pass  # the client went away, was too slow, or broke the framing: nothing to answer
        except Exception:  # noqa: BLE001 - a bad connection must never take the broker down
            log.exception("data port connection failed")
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.sock.close()

    def _next_head(self, conn: _Conn, head: bytearray) -> bool:
        """The next request's head: False when the client closed, was idle for IDLE_TIMEOUT_S (looked at
        each time the receive timeout passes) or the broker is stopping; the rest of it must come within
        REQUEST_TIMEOUT_S of its first byte."""
        sock, idle_since = conn.sock, time.monotonic()
        if conn.tls:
            sock.settimeout(IDLE_TIMEOUT_S)
        while True:
            try:
                got = sock.recv_into(head)
                break
            except _TIMED_OUT:
                if self._stopping or conn.ended or time.monotonic() - idle_since >= IDLE_TIMEOUT_S:
                    log.debug("data port: a connection of %s was idle for %.0fs; closed", conn.principal,
                              time.monotonic() - idle_since)
                    return False
        if got == 0:
            return False
        if got < len(head):
            _recv(conn, memoryview(head)[got:], time.monotonic() + REQUEST_TIMEOUT_S)
        return True

    def _serve_requests(self, conn: _Conn, first: Optional[bytes]) -> None:
        head = bytearray(REQUEST.size)  # no request is shorter: a PUT has a 32-byte PutRaw header after its prefix
        while not self._stopping and not conn.ended:
            if first is not None:
                head[:], first = first, None
            elif not self._next_head(conn, head):
                return
            deadline = time.monotonic() + REQUEST_TIMEOUT_S
            length, kind, topic_len, *fields = REQUEST.unpack(head)
            if kind == PUT:
                if not self._receive_put(conn, head, length, deadline):
                    return
                continue
            if kind == REPLICA_FETCH and self.replicas is not None and REQUEST.size <= length <= rp.MAX_REQUEST_BYTES:
                if not self._authorize_replica(conn):
                    return
                body = bytearray(length)
                body[:REQUEST.size] = head
                _recv(conn, memoryview(body)[REQUEST.size:], deadline)
                _replying(conn)
                self._replica_fetch(conn, body)
                continue
            if kind != FETCH or topic_len > MAX_TOPIC_BYTES or length != REQUEST.size + topic_len:
                why = " (this broker takes no AUTH frame)" if kind == AUTH and not self._sasl else \
                    " (already authenticated)" if kind == AUTH else ""
                self._send_error(conn.sock, grpc.StatusCode.INVALID_ARGUMENT,
                                 f"malformed data port request (kind {kind}, {length} bytes, topic of "
                                 f"{topic_len} bytes){why}; closing the connection")
                return
            name = bytearray(topic_len)
            _recv(conn, memoryview(name), deadline)
            _replying(conn)
            self._fetch(conn, name, *fields)

    # -- one request --------------------------------------------------------------------------------
    @staticmethod
    def _answer(sock: socket.socket, method: str, send_error, call):
        """``call()``'s result, or None once a refusal is sent with ``send_error`` as the gRPC service
        would answer it (the error's status, or INTERNAL with a logged traceback)."""
        try:
            return call()
        except (MetaqError, records.RecordFormatError) as e:
            send_error(sock, code_of(e), str(e))
        except Exception as e:  # noqa: BLE001 - answered like the gRPC service's INTERNAL
            log.exception("data port %s failed", method)
            send_error(sock, grpc.StatusCode.INTERNAL, f"{method} failed: {type(e).__name__}: {e}")
        return None

    def _locate(self, principal: str, name: bytearray, partition: int, offset: int, max_bytes: int,
                max_messages: int, max_wait_ms: int) -> tuple:
        """(FileRange, partition, a dup of its segment's fd or -1 when empty) of one fetch."""
        try:
            topic = name.decode()
        except UnicodeDecodeError:
            raise InvalidOffsetError("the topic name is not UTF-8") from None
        where, log_ = self.service.read(topic, partition, offset, max_bytes, max_messages, max_wait_ms,
                                        lambda: not self._stopping, locate=True, principal=principal)
        return where, log_, where.dup_fd() if where.length else -1

    def _fetch(self, conn: _Conn, *request) -> None:
        start = time.perf_counter()
        sock, fd = conn.sock, -1
        try:
            located = self._answer(sock, "FetchData", self._send_error,
                                   lambda: self._locate(conn.principal, *request))
            if located is None:
                return
            where, log_, fd = located
            aborted = pack_aborted(where.aborted)
            header = REPLY.pack(REPLY.size + len(aborted), OK, where.start_offset, where.end_offset,
                                log_.earliest_offset, log_.last_stable_offset, where.length) + aborted
            if not where.length:
                sock.sendall(header)
            else:
                self._send_range(conn, header, fd, where.position, where.length, where.path)
        finally:
            if fd >= 0:
                os.close(fd)
            if self.service.observe is not None:
                self.service.observe("FetchData", time.perf_counter() - start)

    @staticmethod
    def _send_range(conn: _Conn, header, fd: int, position: int, length: int, path) -> None:
        """``header``, then ``length`` bytes of ``fd`` from ``position``. Plain TCP: the header corked
        (``MSG_MORE``), the range by ``sendfile``. TLS, which ``sendfile`` would bypass: through the
        connection's buffer, ``preadv`` a chunk and ``sendall`` it (the header rides in the first chunk)."""
        sock, left = conn.sock, length
        if not conn.tls:
            sock.sendall(header, _MSG_MORE if left else 0)
            while left:
                n = os.sendfile(sock.fileno(), fd, position, min(left, _SENDFILE_CHUNK))
                if n == 0:  # the file is shorter than its index says: the client sees a cut reply
                    raise ProtocolError(f"{path} ends at byte {position}, {left} bytes short")
                position += n
                left -= n
            return
        view = conn.read_buffer()
        fill = len(header)
        if fill <= TLS_CHUNK // 2:
            view[:fill] = header
        else:  # a long aborted list or journal
            sock.sendall(header)
            fill = 0
        while left:
            n = min(left, TLS_CHUNK - fill)
            got = 0
            while got < n:
                k = os.preadv(fd, [view[fill + got:fill + n]], position + got)
                if k == 0:  # the file is shorter than its index says: the client sees a cut reply
                    raise ProtocolError(f"{path} ends at byte {position + got}, {left - got} bytes short")
                got += k
            sock.sendall(view[:fill + n])
            position += n
            left -= n
            fill = 0
        if fill:  # an empty range
            sock.sendall(view[:fill])

    def _replica_fetch(self, conn: _Conn, request: bytearray) -> None:
        """A group member copying from this master (``ReplicaManager.serve_fetch`` decides what): the head,
        the journal frames, then per partition a section head and its records from the segment file. The
        lease is checked after the long poll, just before the reply: a master frozen past its session (a
        new one may be elected) answers ``not master:`` instead of data its replicas would take."""
        sock, fds = conn.sock, []
        try:
            try:
                req = rp.unpack_request(request)
                answer = self.replicas.serve_fetch(req, lambda: not self._stopping)
                self.service._gate(admit=False)  # fenced: a master whose lease ran out (frozen) answers nothing
            except FencedError as e:
                sock.sendall(rp.error_reply(code_number(grpc.StatusCode.FAILED_PRECONDITION), str(e),
                                            self.replicas.epoch))
                return
            except (MetaqError, ProtocolError) as e:
                sock.sendall(rp.error_reply(code_number(code_of(e)), str(e), self.replicas.epoch))
                return
            first, last, frames, snapshot = answer.journal
            heads, ranges = [], []
            identities = bool(req.flags & rp.REQUEST_IDENTITIES)
            for pf, sec in zip(req.partitions, answer.sections):
                where = sec.where
                n = where.length if where is not None else 0
                fd = where.dup_fd() if n else -1
                if fd >= 0:
                    fds.append(fd)
                heads.append(rp.pack_section_head(
                    where.start_offset if where is not None else 0, where.end_offset if where is not None else 0,
                    sec.earliest, sec.latest, n, where.aborted if where is not None else None, sec.log_end, sec.hw,
                    sec.status, sec.epoch, sec.offset, self._identity(pf) if identities else None))
                ranges.append((fd, where.position if n else 0, n, where.path if n else None))
            flags = (rp.FLAG_JOURNAL_SNAPSHOT if snapshot else 0) | (rp.FLAG_TOPICS_CHANGED if answer.topics_changed
                                                                     else 0) | (rp.FLAG_IDENTITIES if identities else 0)
            journal = bytes(frames) + bytes(rp.pad8(len(frames)) - len(frames))
            body_len = len(journal) + sum(len(h) + r[2] for h, r in zip(heads, ranges))
            # Heads gather until a section has records: one send (one TLS record) for them all.
            pending = [rp.pack_reply_head(rp.ReplyHead(0, "", answer.epoch, len(heads), body_len, first, last,
                                                       len(frames), flags)), journal]
            for head, (fd, pos, n, path) in zip(heads, ranges):
                pending.append(head)
                if n:
                    self._send_range(conn, b"".join(pending), fd, pos, n, path)
                    pending = []
            if pending:
                sock.sendall(b"".join(pending))
        finally:
            for fd in fds:
                os.close(fd)

    def _identity(self, pf) -> str:
        """The identity of the partition a replica asked for ("" when this broker lacks it)."""
        try:
            return self.service.store.partition(pf.topic, pf.partition).identity
        except MetaqError:
            return ""

    def _authorize_replica(self, conn: _Conn) -> bool:
        """ClusterAction on the cluster (Kafka's inter-broker right), checked before the request's body is
        read; a refusal is answered, the connection closed (False), and logged once a minute per principal,
        since the member that asks may be misconfigured rather than hostile."""
        if self.auth is None:
            return True
        try:
            self.auth.authorize(conn.principal, "ClusterAction", "cluster", CLUSTER)
            return True
        except MetaqError as e:
            self._log_once(("replica", conn.principal), logging.WARNING,
                           "data port: replica fetch refused: %s (a group member's principal needs ClusterAction "
                           "on the cluster, or to be in super.users)", e)
            conn.sock.sendall(rp.error_reply(code_number(code_of(e)), str(e), self.replicas.epoch))
            return False

    def _receive_put(self, conn: _Conn, head: bytearray, length: int, deadline: float) -> bool:
        """One PUT: its size and, from its header, its topic and xid checked before the body is read; then
        stored and answered. A refusal before the body drops the body unread into memory and keeps the
        connection; False (close it) after a put over the broker's limit or too short for a header."""
        sock = conn.sock
        limit = self.service.max_put_bytes
        if not PREFIX.size + rawput.HEADER.size <= length <= limit:
            self._send_put_error(sock, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"data port put of {length} bytes is over this broker's limit of {limit} (the "
                                 f"largest of maxTransferSize, maxMessageSize and {rawput.SPLIT_BYTES}, plus "
                                 f"{rawput.HEADER_ALLOWANCE} for the header); closing the connection"
                                 if length > limit else f"data port put of {length} bytes is too short to hold a "
                                 f"PutRaw request; closing the connection")
            return False
        request_len = length - PREFIX.size
        fixed = bytearray(rawput.HEADER.size)
        fixed[:REQUEST.size - PREFIX.size] = head[PREFIX.size:]
        _recv(conn, memoryview(fixed)[REQUEST.size - PREFIX.size:], deadline)
        header_len, _, _, _, _, _, topic_len, xid_len, _ = rawput.HEADER.unpack(fixed)
        if not rawput.HEADER.size + topic_len + xid_len <= header_len <= request_len or header_len % records.ALIGN:
            self._send_put_error(sock, grpc.StatusCode.INVALID_ARGUMENT,
                                 f"PutRaw request header says the body starts at byte {header_len} of {request_len}")
            _discard(conn, request_len - rawput.HEADER.size, deadline)  # the frame's length still holds
            return True
        names = bytearray(header_len - rawput.HEADER.size)
        _recv(conn, memoryview(names), deadline)

        def admit():
            try:
                topic, xid = names[:topic_len].decode(), names[topic_len:topic_len + xid_len].decode()
            except UnicodeDecodeError:
                raise records.RecordFormatError("PutRaw request: topic or xid is not UTF-8", 0) from None
            self.service.admit_put(conn.principal, topic, xid)
            return True
        if not self._answer(sock, "PutData", self._send_put_error, admit):
            conn.put_buffer = np.empty(0, np.uint8)
            _discard(conn, request_len - header_len, deadline)
            return True
        if len(conn.put_buffer) < request_len:
            conn.put_buffer = np.empty(request_len, np.uint8)
        view = memoryview(conn.put_buffer)[:request_len]
        view[:rawput.HEADER.size] = fixed
        view[rawput.HEADER.size:header_len] = names
        _recv(conn, view[header_len:], deadline)
        _replying(conn)
        if not self._put(conn, view) or len(conn.put_buffer) > KEEP_PUT_BUFFER:
            conn.put_buffer = np.empty(0, np.uint8)  # after a refusal, or a rare huge put: not kept
        return True

    def _put(self, conn: _Conn, request: memoryview) -> bool:
        start = time.perf_counter()
        sock = conn.sock
        try:
            r = self._answer(sock, "PutData", self._send_put_error, lambda: self.service.put(request, conn.principal))
        finally:  # counted before the answer goes out, as gRPC's puts are: whoever sees the answer sees the count
            if self.service.observe is not None:
                self.service.observe("PutData", time.perf_counter() - start)
        if r is not None:
            sock.sendall(PUT_REPLY.pack(PUT_REPLY.size, OK, r.base_offset, r.base_msg_id, r.timestamp_ms,
                                        r.partition, r.count, int(r.fsynced), 0))
        return r is not None

    @staticmethod
    def _send_put_error(sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
        sock.sendall(_error(PUT_REPLY, code_number(code), message))

    @staticmethod
    def _send_error(sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
        sock.sendall(_error(REPLY, code_number(code), message))


def _error(layout, status: int, message: str) -> bytes:
    """A refusal in a fetch reply's (REPLY) or a put reply's (PUT_REPLY) layout, the message after it."""
    body = message.encode("utf-8", "replace")
    if layout is PUT_REPLY:
        return PUT_REPLY.pack(PUT_REPLY.size + len(body), status, -1, -1, -1, -1, 0, 0, 0) + body
    return REPLY.pack(REPLY.size, status, -1, -1, -1, -1, len(body)) + body


def _recv(conn: _Conn, view: memoryview, deadline: float) -> None:
    """Fill ``view`` by ``deadline`` (checked after each read, and by the receive timeout); ProtocolError
    when the client closes, goes silent or is too slow."""
    sock, got, n = conn.sock, 0, len(view)
    while got < n:
        if conn.tls:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            k = sock.recv_into(view[got:], n - got)
        except _TIMED_OUT:
            raise ProtocolError(f"{n - got} of {n} bytes of a request did not come within {REQUEST_TIMEOUT_S:.0f}s")
        if k == 0:
            raise ProtocolError("connection closed inside a request")
        got += k
        if got < n and time.monotonic() > deadline:
            raise ProtocolError(f"a request took over {REQUEST_TIMEOUT_S:.0f}s to arrive")


def _discard(conn: _Conn, n: int, deadline: float) -> None:
    """Read ``n`` bytes by ``deadline`` through a small buffer and drop them."""
    scratch = memoryview(bytearray(min(n, DRAIN_CHUNK)))
    while n:
        k = min(n, len(scratch))
        _recv(conn, scratch[:k], deadline)
        n -= k


def _replying(conn: _Conn) -> None:
    """A request is in: a TLS connection's reply may take SEND_TIMEOUT_S (a plain one has SO_SNDTIMEO)."""
    if conn.tls:
        conn.sock.settimeout(SEND_TIMEOUT_S)


def _timeval(seconds: float) -> bytes:
    return struct.pack("@ll", int(seconds), int(seconds % 1 * 1e6))


def _shutdown(sock: socket.socket, how: int) -> None:
    """The socket's shutdown, also for a TLS socket in use by another thread: the OS call only, its TLS
    state untouched (``SSLSocket.shutdown`` would drop it under that thread)."""
    try:
        socket.socket.shutdown(sock, how)
    except OSError:
        pass
