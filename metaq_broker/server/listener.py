"""A broker port's connections: accepting, TLS, the login, a thread per logged-in connection with request
deadlines and an idle limit. Every listener (the data port, the Kafka listener; next the MetaQ listener) is
one ``Listener`` with its own framing plugged in (``Framing``), which turns bytes into the request
handler's calls: a new listener adds framing, not a second broker.

Two stages, so that nobody holds a thread or a buffer of the broker's before it is authenticated. One
thread (``metaq-<name>-accept``) accepts, runs the TLS handshakes without blocking and drives each new
connection's login (``Framing.login``: a ``Login`` that says which bytes it needs next, is fed them as they
come and answers with a reply, the end of the login or a refusal). At most ``Limits.max_unauthenticated``
connections are in that stage at once (more are closed as they are accepted) and each gets
``Limits.login_timeout_s`` from its accept; a failed handshake is logged at debug level only. Only then
does the connection get a thread of its own, which runs ``Framing.serve(conn, login)``: it reads through
``Connection``, under which a request must arrive whole within ``Limits.request_timeout_s`` of its first
byte, and a connection idle for ``Limits.idle_timeout_s`` is closed (the client's pool sees it and connects
again). On plain TCP these are the kernel's timeouts (``SO_RCVTIMEO``, ``SO_SNDTIMEO``) on a blocking
socket, checked between reads, not Python's socket timeouts, which poll before every read (and
``sendfile`` needs a blocking socket); OpenSSL retries a kernel timeout without end, so a TLS connection
uses Python's.

A protocol whose parsing needs compiled kernels (the Kafka and MetaQ listeners: numba's import and cache
load, a second of CPU) passes ``warm_up`` to ``start``: it runs in a thread of its own at the first accepted
connection, so a broker that no client of the protocol reaches never pays for it, and the first client's
opening requests (ApiVersions, Metadata, the login) overlap it; a request needing the kernels sooner waits
for them (Python's import lock, numba's compile lock).

A connection logged in with a session (SASL) is shut down by the accepting thread as soon as the broker
learns that its user was changed or removed (``sessions.watch_sessions``: the user cache's ZooKeeper
watch) or when the session expires.

``Connection.send_range`` sends a reply's header and a range of a segment file: ``sendfile`` on plain TCP;
TLS cannot ``sendfile`` (the kernel would send the file's bytes unencrypted), so there the range is read
with ``os.preadv`` into a buffer the connection reuses, in chunks of ``TLS_CHUNK``, and each chunk sent,
passing through user space once, with no work per message.

Lock order: ``Listener._lock`` only (the registry of connections); no other lock is taken under it.
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
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from metaq_broker.errors import AuthenticationError
from metaq_broker.security.tls import ANONYMOUS

log = logging.getLogger(__name__)

_SENDFILE_CHUNK = 1 << 30
TLS_CHUNK = 1 << 20  # a TLS connection's read buffer: file bytes go file -> buffer -> TLS in this size
REPLY_TIMEOUT_S = 1.0  # the accepting thread's wait to send a short answer (a login's reply, a refusal)
REFUSAL_LOG_S = 60.0  # a repeated refusal (a full stage of new connections, ...) is logged at most this often
_TICK_S = 0.5  # with sessions the accepting thread looks for expired ones this often
_MSG_MORE = getattr(socket, "MSG_MORE", 0)
# A receive timeout passing: SO_RCVTIMEO on a blocking socket (EAGAIN), Python's on a TLS one
_TIMED_OUT = (BlockingIOError, ssl.SSLWantReadError, TimeoutError)


@dataclass(frozen=True)
class Limits:
    login_timeout_s: float  # accept to logged in: TLS handshake and the login's bytes
    max_unauthenticated: int  # connections in that stage at once; more are closed as they are accepted
    request_timeout_s: float  # a request's bytes must all arrive within this of its first
    idle_timeout_s: float  # a logged-in connection that sends no request for this long is closed
    send_timeout_s: float  # a reply the client does not take in for this long ends the connection


class ConnectionEnded(Exception):
    """The client closed the connection, went silent inside a request or was too slow, or a reply could not
    be sent whole: the connection is closed with nothing more to answer."""


@dataclass(frozen=True)
class Step:
    """A login's answer to the bytes it was fed: ``reply`` to send now, then go on reading, or the login is
    done (``logged_in``: the connection's principal is set) or refused (``close``)."""

    reply: bytes = b""
    logged_in: bool = False
    close: bool = False


GO_ON = Step()


class Login(Protocol):
    def buffer(self) -> memoryview:
        """Where the next bytes go: never more than the login needs (nothing past it is read here)."""

    def received(self, n: int) -> Step:
        """``n`` bytes arrived in the last buffer."""


class Framing(Protocol):
    """A listener's protocol: the login of a new connection, driven by the accepting thread without
    blocking, then the requests of a logged-in one, served on its own thread."""

    def login(self, conn: "Connection") -> Login: ...

    def serve(self, conn: "Connection", login: Login) -> None: ...


class Connection:
    """One accepted connection: its socket (TLS or not), peer, principal (ANONYMOUS until a login names
    another), session (SASL: ``BrokerAuth.Session`` and token, for ending it), and blocking reads and
    sends under the listener's limits (on the connection's own thread, after the login)."""

    def __init__(self, listener: "Listener", sock: socket.socket, peer, tls: bool):
        self._listener, self.sock, self.peer, self.tls = listener, sock, peer, tls
        self.limits = listener.limits
        self.principal = ANONYMOUS
        self.session, self.token = None, ""
        self.ended = False  # shut down by the accepting thread (session ended, broker stopping)
        self._read_buffer: Optional[memoryview] = None  # TLS only: TLS_CHUNK bytes, file ranges pass through it

    def peer_certificate(self) -> Optional[bytes]:
        """The client certificate (DER) of a TLS connection that presented one."""
        return self.sock.getpeercert(binary_form=True) if self.tls else None

    @property
    def active(self) -> bool:
        """False once the listener stops or the session ended: a long poll ends early."""
        return not (self._listener.stopping or self.ended)

    def wait_request(self, view: memoryview) -> int:
        """The first bytes of the next request, into ``view``: 0 when the client closed, was idle for
        ``idle_timeout_s`` (looked at each time the receive timeout passes) or the listener is stopping."""
        sock, idle_since = self.sock, time.monotonic()
        if self.tls:
            sock.settimeout(self.limits.idle_timeout_s)
        while True:
            try:
                return sock.recv_into(view)
            except _TIMED_OUT:
                if not self.active or time.monotonic() - idle_since >= self.limits.idle_timeout_s:
                    log.debug("%s: a connection of %s was idle for %.0fs; closed", self._listener.name,
                              self.principal, time.monotonic() - idle_since)
                    return 0

    def deadline(self) -> float:
        """When the request whose first bytes just came must be in whole."""
        return time.monotonic() + self.limits.request_timeout_s

    def recv_some(self, view: memoryview, deadline: float) -> int:
        """Some bytes of a request (at least one) into ``view`` by ``deadline`` (checked after the read,
        and by the receive timeout); ConnectionEnded when the client closes, goes silent or is too slow."""
        if self.tls:
            self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            k = self.sock.recv_into(view)
        except _TIMED_OUT:
            raise ConnectionEnded(f"{len(view)} bytes of a request did not come within "
                                  f"{self.limits.request_timeout_s:.0f}s") from None
        if k == 0:
            raise ConnectionEnded("connection closed inside a request")
        if k < len(view) and time.monotonic() > deadline:
            raise ConnectionEnded(f"a request took over {self.limits.request_timeout_s:.0f}s to arrive")
        return k

    def read_next(self, view: memoryview, inside: bool, deadline: float) -> tuple:
        """(bytes read into ``view``, the current request's deadline): inside a request (``inside``) its rest
        by ``deadline``; else the next request's first bytes, whose deadline starts now. 0 bytes: the client
        closed or was idle (``wait_request``)."""
        if inside:
            return self.recv_some(view, deadline), deadline
        n = self.wait_request(view)
        return n, (self.deadline() if n else deadline)

    def replying(self) -> None:
        """A request is in: a TLS connection's reply may take ``send_timeout_s`` (a plain one has
        SO_SNDTIMEO)."""
        if self.tls:
            self.sock.settimeout(self.limits.send_timeout_s)

    def send(self, data) -> None:
        self.sock.sendall(data)

    def send_range(self, header, fd: int, position: int, length: int, path) -> None:
        """``header``, then ``length`` bytes of ``fd`` from ``position``. Plain TCP: the header corked
        (``MSG_MORE``), the range by ``sendfile``. TLS, which ``sendfile`` would bypass: through the
        connection's buffer, ``preadv`` a chunk and ``sendall`` it (the header rides in the first chunk)."""
        sock, left = self.sock, length
        if not self.tls:
            sock.sendall(header, _MSG_MORE if left else 0)
            while left:
                n = os.sendfile(sock.fileno(), fd, position, min(left, _SENDFILE_CHUNK))
                if n == 0:  # the file is shorter than its index says: the client sees a cut reply
                    raise ConnectionEnded(f"{path} ends at byte {position}, {left} bytes short")
                position += n
                left -= n
            return
        if self._read_buffer is None:
            self._read_buffer = memoryview(bytearray(TLS_CHUNK))
        view = self._read_buffer
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
                    raise ConnectionEnded(f"{path} ends at byte {position + got}, {left - got} bytes short")
                got += k
            sock.sendall(view[:fill + n])
            position += n
            left -= n
            fill = 0
        if fill:  # an empty range
            sock.sendall(view[:fill])


class _New:
    """A connection in the login stage, driven by the accepting thread without blocking."""

    def __init__(self, conn: Connection, deadline: float, handshaking: bool):
        self.conn, self.deadline, self.handshaking = conn, deadline, handshaking
        self.login: Optional[Login] = None


class Listener:
    """Listens on ``host:port`` (0: any free port) as soon as it is made, so its port is known before it
    serves; ``start(framing)`` serves. ``context`` (an ``ssl.SSLContext``, None: plain TCP) makes every
    connection TLS. ``sessions`` (``BrokerAuth``, with SASL) ends the connections of ended sessions."""

    def __init__(self, name: str, host: str, port: int, limits: Limits, context: Optional[ssl.SSLContext] = None,
                 sessions=None):
        self.name, self.limits, self._context, self._sessions = name, limits, context, sessions
        self._listener = socket.create_server((host, port), backlog=128)  # SO_REUSEADDR: a restart rebinds
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._framing: Optional[Framing] = None
        self._warm_up: Optional[Callable[[], None]] = None  # run at the first connection, then None
        self._conns: dict = {}  # Connection -> its thread
        self._new: dict = {}  # socket -> _New (the accepting thread's only)
        self._lock = threading.Lock()
        self.stopping = False
        self._changed_users: set = set()  # users whose sessions may have ended, for the accepting thread
        self._logged: dict = {}  # what was last logged when
        self.refused_connections = 0  # closed at accept: too many not logged in yet (for tests, metrics)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"metaq-{name}-accept", daemon=True)

    def start(self, framing: Framing, warm_up: Optional[Callable[[], None]] = None) -> "Listener":
        self._framing, self._warm_up = framing, warm_up
        if self._sessions is not None:
            self._sessions.watch_sessions(self._user_changed)
        self._acceptor.start()
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, let each connection finish the request it is serving (up to ``grace`` seconds),
        close every connection and free the port. Returns only once no reply is being sent: what the
        replies read (the store) may then be closed."""
        with self._lock:
            if self.stopping:
                return
            self.stopping = True
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
        """Connections accepted and not logged in yet (for tests and metrics)."""
        return len(self._new)

    def connections(self) -> int:
        """Connections logged in and served by a thread (for tests and metrics)."""
        return len(self._conns)

    def log_once(self, what, level: int, message: str, *args) -> None:
        """``message`` at most once every REFUSAL_LOG_S for ``what`` (a refusal a client may repeat)."""
        now = time.monotonic()
        if now - self._logged.get(what, -REFUSAL_LOG_S) >= REFUSAL_LOG_S:
            self._logged[what] = now
            log.log(level, message, *args)

    # -- the accepting thread: accept, TLS handshake, the login ---------------------------------------
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # already awake (the pipe is full) or closed

    def _user_changed(self, user: str) -> None:
        """``sessions.watch_sessions``: on ZooKeeper's event thread; the accepting thread checks."""
        with self._lock:
            self._changed_users.add(user)
        self._wake()

    def _accept_loop(self) -> None:
        try:
            while not self.stopping:
                self._step()
        except Exception:  # noqa: BLE001 - logged; this port stops accepting, the others still serve
            log.exception("%s: the accepting thread failed", self.name)
        finally:
            self._close_accepting()

    def _step(self) -> None:
        now = time.monotonic()
        waits = [n.deadline - now for n in self._new.values()] + ([_TICK_S] if self._sessions is not None else [])
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
            log.debug("%s: %s not logged in within %.0fs; closed", self.name, new.conn.peer,
                      self.limits.login_timeout_s)
            self._drop(new)
        self._end_sessions()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors: the listener stays readable; try again soon
                self.log_once("accept", logging.WARNING, "%s: accept failed: %s", self.name, e)
                time.sleep(0.05)
                return
            if len(self._new) >= self.limits.max_unauthenticated:
                self.refused_connections += 1
                self.log_once("full", logging.WARNING, "%s: %d connections are not logged in yet; refusing new "
                              "ones (%d so far)", self.name, self.limits.max_unauthenticated,
                              self.refused_connections)
                sock.close()
                continue
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._context is not None:
                    sock = self._context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except (OSError, ValueError) as e:
                log.debug("%s: connection from %s failed: %s", self.name, peer, e)
                sock.close()
                continue
            if self._warm_up is not None:
                threading.Thread(target=self._warm, args=(self._warm_up,), name=f"metaq-{self.name}-warm-up",
                                 daemon=True).start()
                self._warm_up = None
            new = _New(Connection(self, sock, peer, self._context is not None),
                       time.monotonic() + self.limits.login_timeout_s, self._context is not None)
            self._new[sock] = new
            self._selector.register(sock, selectors.EVENT_READ, new)
            self._advance(new)

    def _warm(self, warm_up: Callable[[], None]) -> None:
        started = time.monotonic()
        try:
            warm_up()
        except Exception:  # the requests that need the kernels load them themselves and report what fails
            log.exception("%s: warming up failed", self.name)
        else:
            log.info("%s: compiled kernels loaded in %.1f s", self.name, time.monotonic() - started)

    def _advance(self, new: _New) -> None:
        """Take the connection as far as its bytes allow: the handshake, then the login."""
        sock = new.conn.sock
        try:
            if new.handshaking:
                sock.do_handshake()
                new.handshaking = False
            if new.login is None:
                new.login = self._framing.login(new.conn)
            while True:
                n = sock.recv_into(new.login.buffer())
                if n == 0:
                    raise ConnectionEnded("connection closed")
                step = new.login.received(n)
                if step.reply:
                    self._send_now(sock, step.reply)
                if step.close:
                    self._drop(new)
                    return
                if step.logged_in:
                    self._hand_over(new)
                    return
        except ssl.SSLWantReadError:
            self._selector.modify(sock, selectors.EVENT_READ, new)
        except ssl.SSLWantWriteError:
            self._selector.modify(sock, selectors.EVENT_WRITE, new)
        except BlockingIOError:
            pass
        except (OSError, ValueError, ConnectionEnded, AuthenticationError) as e:  # a failed handshake, a reset
            log.debug("%s: connection from %s failed before login: %s", self.name, new.conn.peer, e)
            self._drop(new)

    def _send_now(self, sock, data: bytes) -> None:
        """A short answer from the accepting thread, waiting at most REPLY_TIMEOUT_S for room to send it."""
        sock.settimeout(REPLY_TIMEOUT_S)
        try:
            sock.sendall(data)
        finally:
            sock.setblocking(False)

    def _drop(self, new: _New) -> None:
        sock = new.conn.sock
        self._new.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _hand_over(self, new: _New) -> None:
        """The connection is logged in: from now on its own thread serves it."""
        conn = new.conn
        self._new.pop(conn.sock, None)
        self._selector.unregister(conn.sock)
        conn.sock.setblocking(True)
        if not conn.tls:  # plain TCP: the kernel's timeouts (a TLS connection sets Python's)
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.limits.send_timeout_s))
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.limits.request_timeout_s))
        thread = threading.Thread(target=self._serve, args=(conn, new.login), name=f"metaq-{self.name}", daemon=True)
        with self._lock:
            if self.stopping:
                conn.sock.close()
                return
            self._conns[conn] = thread
        thread.start()

    def _end_sessions(self) -> None:
        """Shut down the connections whose session expired or whose user was changed or removed."""
        if self._sessions is None:
            return
        with self._lock:
            changed, self._changed_users = self._changed_users, set()
            conns = [c for c in self._conns if c.session is not None and not c.ended]
        now = self._sessions.now()
        for conn in conns:
            if conn.session.expires > now and conn.session.user not in changed:
                continue
            try:
                self._sessions.session(conn.token)
                continue
            except AuthenticationError as e:
                log.info("%s: closing a connection of %s: %s", self.name, conn.principal, e)
            conn.ended = True
            _shutdown(conn.sock, socket.SHUT_RDWR)

    def _close_accepting(self) -> None:
        for new in list(self._new.values()):
            self._drop(new)
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        self._selector.close()

    # -- a connection's thread ------------------------------------------------------------------------
    def _serve(self, conn: Connection, login: Login) -> None:
        try:
            self._framing.serve(conn, login)
        except (OSError, ConnectionEnded):
            pass  # the client went away, was too slow, or broke the framing: nothing to answer
        except Exception:  # noqa: BLE001 - a bad connection must never take the broker down
            log.exception("%s: a connection failed", self.name)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.sock.close()


def _timeval(seconds: float) -> bytes:
    return struct.pack("@ll", int(seconds), int(seconds % 1 * 1e6))


def _shutdown(sock: socket.socket, how: int) -> None:
    """The socket's shutdown, also for a TLS socket in use by another thread: the OS call only, its TLS
    state untouched (``SSLSocket.shutdown`` would drop it under that thread)."""
    try:
        socket.socket.shutdown(sock, how)
    except OSError:
        pass
