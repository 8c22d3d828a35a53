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

Security is the broker's (``BrokerAuth``): with SSL or SASL_SSL each accepted socket is wrapped in TLS in
its own thread, the handshake bounded by ``HANDSHAKE_TIMEOUT``, and a failed one is logged at debug level
only (a flood of bad handshakes costs short-lived threads, not a flood of log lines). The connection's
principal is its client certificate's (or ANONYMOUS); with SASL_SSL it is the session's, named by the
AUTH frame that must come first. ``BrokerService`` checks the ACLs with it. TLS cannot ``sendfile``
(the kernel would send the file's bytes unencrypted): a TLS connection reads the located range with
``os.preadv`` into a buffer it reuses, in chunks of ``TLS_CHUNK``, and ``sendall``s each, so the bytes
pass through user space once, with no work per message. A group member's REPLICA_FETCH takes the same
path (``_send_range``), and needs ClusterAction on the cluster from the connection's principal.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

import grpc
import numpy as np

from metaq_broker.errors import AuthenticationError, InvalidOffsetError, MetaqError
from metaq_broker.protocol import records
from metaq_broker.protocol import replication as rp
from metaq_broker.protocol.dataport import (AUTH, AUTH_ATTEMPTS, FETCH, MAX_PUT_BYTES, MAX_TOKEN_BYTES, MAX_TOPIC_BYTES,
                                            OK, PREFIX, PUT, PUT_REPLY, REPLICA_FETCH, REPLY, REQUEST, ProtocolError,
                                            code_number,
                                            recv_exact)
from metaq_broker.protocol.rawfetch import pack_aborted
from metaq_broker.protocol.status import code_of
from metaq_broker.security import tls
from metaq_broker.security.acl import CLUSTER
from metaq_broker.server.replica_manager import FencedError

log = logging.getLogger(__name__)

_SENDFILE_CHUNK = 1 << 30
TLS_CHUNK = 1 << 20  # a TLS connection's read buffer: record bytes go file -> buffer -> TLS in this size
HANDSHAKE_TIMEOUT = 10.0  # a TLS handshake not done by then is dropped
RECHECK_SESSION_S = 60.0  # a SASL connection's session is checked again this often (expired, user removed)
REFUSAL_LOG_S = 60.0  # a principal refused the replica fetch is logged at most this often
KEEP_PUT_BUFFER = 16 << 20  # a connection keeps its put buffer up to this size (the sink's puts are <= 4 MiB)
_MSG_MORE = getattr(socket, "MSG_MORE", 0)


class _Conn:
    """One connection's state: its socket (TLS or not), principal (None until a SASL connection's AUTH),
    and the buffers it reuses."""

    def __init__(self, sock: socket.socket, tls_on: bool, principal):
        self.sock, self.tls, self.principal = sock, tls_on, principal
        self.token, self.checked_at = "", 0.0  # SASL: the session's token, when it was last found valid
        self.put_buffer = np.empty(0, np.uint8)  # grown to the largest put, then reused: no new pages per put
        self._read_buffer = None  # TLS only: TLS_CHUNK bytes, file ranges pass through it

    def read_buffer(self) -> memoryview:
        if self._read_buffer is None:
            self._read_buffer = memoryview(bytearray(TLS_CHUNK))
        return self._read_buffer


class DataServer:
    """Accepts on ``host:port`` (0: any free port); one daemon thread per connection, each serving its
    requests in order. ``service`` is the broker's ``BrokerService``: the store, closed partitions,
    counters, limits and ACL checks are its. ``auth`` (``BrokerAuth``, None: PLAINTEXT and anonymous)
    gives the TLS context and checks session tokens."""

    def __init__(self, service, host: str, port: int, auth=None, replicas=None):
        self.service = service
        self.auth = auth
        self.replicas = replicas  # ReplicaManager: the master's side of REPLICA_FETCH (None: not replicated)
        self._context = auth.data_port_context() if auth is not None else None
        self._sasl = auth is not None and auth.security.uses_sasl
        self._listener = socket.create_server((host, port), backlog=128)  # SO_REUSEADDR: a restart rebinds
        self.port = self._listener.getsockname()[1]
        self._conns: dict = {}  # accepted socket -> thread
        self._lock = threading.Lock()
        self._stopping = False
        self._refusals_logged: dict = {}  # principal -> when a refused replica fetch of it was last logged
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
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
        except OSError:
            pass
        self._listener.close()
        if self._acceptor.ident is not None:
            self._acceptor.join(5)
        # The accepted sockets: a TLS connection serves on a dup of its fd, so shutting these down reaches
        # it without touching its TLS state.
        for sock in conns:  # the next read of a request sees the end; a reply in progress goes on
            _shutdown(sock, socket.SHUT_RD)
        deadline = time.monotonic() + grace
        for sock, thread in conns.items():
            thread.join(max(deadline - time.monotonic(), 0))
            if thread.is_alive():  # a client that does not read its reply: cut it off
                _shutdown(sock, socket.SHUT_RDWR)
                thread.join(5)

    # -- connections ----------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                if self._stopping:
                    return
                log.exception("data port: accept failed")
                time.sleep(0.1)
                continue
            with self._lock:
                if self._stopping:
                    sock.close()
                    return
                thread = threading.Thread(target=self._serve, args=(sock, peer), name="metaq-data", daemon=True)
                self._conns[sock] = thread
            thread.start()

    def _serve(self, raw: socket.socket, peer) -> None:
        sock = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._context is not None:
                sock = self._handshake(raw, peer) or raw
                if sock is raw:
                    return
            if self._sasl:
                principal = None  # until the AUTH frame
            elif sock is not raw:
                principal = tls.principal_of_peer(sock.getpeercert())
            else:
                principal = tls.ANONYMOUS
            self._serve_requests(_Conn(sock, sock is not raw, principal))
        except (OSError, ProtocolError):
            pass  # the client went away or broke the framing: nothing to answer
        except Exception:  # noqa: BLE001 - a bad connection must never take the broker down
            log.exception("data port connection failed")
        finally:
            with self._lock:
                self._conns.pop(raw, None)
            if sock is not raw:
                sock.close()
            raw.close()

    def _handshake(self, raw: socket.socket, peer):
        """The TLS socket over a dup of ``raw``'s fd, handshake done; None (logged at debug level) when
        it fails or takes over HANDSHAKE_TIMEOUT."""
        dup = raw.dup()
        try:
            sock = self._context.wrap_socket(dup, server_side=True, do_handshake_on_connect=False)
        except (OSError, ValueError) as e:
            dup.close()
            log.debug("data port: TLS with %s failed: %s", peer, e)
            return None
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            sock.do_handshake()
            sock.settimeout(None)
        except (OSError, ValueError) as e:  # ssl.SSLError, a timeout, a reset
            sock.close()
            log.debug("data port: TLS handshake with %s failed: %s", peer, e)
            return None
        return sock

    def _serve_requests(self, conn: _Conn) -> None:
        sock = conn.sock
        head = bytearray(REQUEST.size)  # no request is shorter: a PUT has a 32-byte PutRaw header after its prefix
        refused = 0  # AUTH frames refused on this connection
        while not self._stopping and recv_exact(sock, memoryview(head)):
            length, kind, topic_len, *fields = REQUEST.unpack(head)
            if kind == AUTH and self._sasl and conn.principal is None and topic_len <= MAX_TOKEN_BYTES \
                    and length == REQUEST.size + topic_len:
                token = bytearray(topic_len)
                if topic_len and not recv_exact(sock, memoryview(token)):
                    raise ProtocolError("connection closed inside a request")
                conn.principal = self._authenticate(sock, token, conn)
                if conn.principal is None:
                    refused += 1
                    if refused >= AUTH_ATTEMPTS:
                        return
                continue
            if self._sasl and conn.principal is not None and not self._session_valid(conn):
                return  # closed unanswered: the client connects again with a new session, or is told why
            if conn.principal is None:  # SASL_SSL: nothing is served before the AUTH frame
                send = self._send_put_error if kind == PUT else self._send_error
                send(sock, grpc.StatusCode.UNAUTHENTICATED,
                     "authenticate first: the data port of a SASL_SSL broker takes an AUTH frame with the "
                     "session token from metaq.v1.Auth/Authenticate before any request; closing the connection")
                return
            if kind == PUT:
                if not REQUEST.size + records.ALIGN <= length <= MAX_PUT_BYTES:
                    self._send_put_error(sock, grpc.StatusCode.INVALID_ARGUMENT,
                                         f"data port put of {length} bytes (at most {MAX_PUT_BYTES}); closing "
                                         f"the connection")
                    return
                if len(conn.put_buffer) < length:
                    conn.put_buffer = np.empty(length, np.uint8)
                conn.put_buffer[:REQUEST.size] = np.frombuffer(head, np.uint8)
                if not recv_exact(sock, memoryview(conn.put_buffer)[REQUEST.size:length]):
                    raise ProtocolError("connection closed inside a request")
                self._put(conn, memoryview(conn.put_buffer)[PREFIX.size:length])
                if len(conn.put_buffer) > KEEP_PUT_BUFFER:  # a rare huge put: its memory is not kept
                    conn.put_buffer = np.empty(0, np.uint8)
                continue
            if kind == REPLICA_FETCH and self.replicas is not None and REQUEST.size <= length <= rp.MAX_REQUEST_BYTES:
                body = bytearray(length)
                body[:REQUEST.size] = head
                if not recv_exact(sock, memoryview(body)[REQUEST.size:]):
                    raise ProtocolError("connection closed inside a request")
                self._replica_fetch(conn, body)
                continue
            if kind != FETCH or topic_len > MAX_TOPIC_BYTES or length != REQUEST.size + topic_len:
                why = " (this broker takes no AUTH frame)" if kind == AUTH and not self._sasl else \
                    " (already authenticated)" if kind == AUTH else ""
                self._send_error(sock, grpc.StatusCode.INVALID_ARGUMENT,
                                 f"malformed data port request (kind {kind}, {length} bytes, topic of "
                                 f"{topic_len} bytes){why}; closing the connection")
                return
            name = bytearray(topic_len)
            if topic_len and not recv_exact(sock, memoryview(name)):
                raise ProtocolError("connection closed inside a request")
            self._fetch(conn, name, *fields)

    def _session_valid(self, conn: _Conn) -> bool:
        """Whether the connection's session still holds (checked every RECHECK_SESSION_S): it expires,
        and ends when its user is removed or given a new password."""
        now = time.monotonic()
        if now - conn.checked_at < RECHECK_SESSION_S:
            return True
        try:
            self.auth.principal_of_token(conn.token)
        except AuthenticationError as e:
            log.info("data port: closing a connection of %s: %s", conn.principal, e)
            return False
        conn.checked_at = now
        return True

    def _authenticate(self, sock: socket.socket, token: bytearray, conn: _Conn):
        """The principal of the session ``token`` names, after replying it (OK, the principal as the body);
        None after replying UNAUTHENTICATED. The token is never logged."""
        def principal():
            try:
                text = token.decode()
            except UnicodeDecodeError:
                raise AuthenticationError("the session token is not UTF-8") from None
            return self.auth.principal_of_token(text)
        name = self._answer(sock, "Authenticate", self._send_error, principal)
        if name is not None:
            conn.token, conn.checked_at = token.decode(), time.monotonic()
            body = name.encode("utf-8", "replace")
            sock.sendall(REPLY.pack(REPLY.size, OK, -1, -1, -1, -1, len(body)) + body)
        return name

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
                if self.auth is not None:
                    self._authorize_replica(conn)
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

    def _authorize_replica(self, conn: _Conn) -> None:
        """ClusterAction on the cluster (Kafka's inter-broker right); a refusal is logged here too, once a
        minute per principal, since the member that asks may be misconfigured rather than hostile."""
        try:
            self.auth.authorize(conn.principal, "ClusterAction", "cluster", CLUSTER)
        except MetaqError as e:
            now = time.monotonic()
            if now - self._refusals_logged.get(conn.principal, -REFUSAL_LOG_S) >= REFUSAL_LOG_S:
                self._refusals_logged[conn.principal] = now
                log.warning("data port: replica fetch refused: %s (a group member's principal needs ClusterAction "
                            "on the cluster, or to be in super.users)", e)
            raise

    def _put(self, conn: _Conn, request: memoryview) -> None:
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

    @staticmethod
    def _send_put_error(sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
        body = message.encode("utf-8", "replace")
        sock.sendall(PUT_REPLY.pack(PUT_REPLY.size + len(body), code_number(code), -1, -1, -1, -1, 0, 0, 0) + body)

    @staticmethod
    def _send_error(sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
        body = message.encode("utf-8", "replace")
        sock.sendall(REPLY.pack(REPLY.size, code_number(code), -1, -1, -1, -1, len(body)) + body)


def _shutdown(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass
