"""The broker's data port: bulk fetches and puts over plain TCP (or TLS), fetched record bytes sent from
the segment file with ``sendfile``, put bodies received straight into a buffer the connection reuses.

gRPC in Python costs about a millisecond of CPU per MB fetched, end to end (copies in its Python layer
and HTTP/2 framing), and a Spark task shares its cores with the broker. The data port serves the same
fetch as ``FetchRaw`` on a persistent connection: a fixed 32-byte request and the topic, answered with
``rawfetch``'s 40-byte header (its ``flags`` field carrying a status code), the records' length, the
aborted transactions overlapping them, and the records copied by the kernel from the page cache to the
socket. A PUT carries a ``PutRaw`` request as it is; the reply comes after the store's acknowledgement
(its fsync, by the topic's flush policy), so a connection has one put in flight and a producer opens one
connection per partition it writes at once. ``protocol/dataport.py`` parses and builds the frames
(docs/protocol.md gives the layout); ``dataPort`` = -1 turns the port off, and clients then use
``FetchRaw`` and ``PutRaw``, as they do whenever the data port cannot be reached.

This module is the data port's framing on a ``Listener`` (``listener.py``: accepting, TLS, the login
stage, a thread per connection, deadlines); everything but the framing is the request handler's
(``handler.py``): the same checks, errors (as gRPC status code numbers with the same messages), counters
and long-poll wait as gRPC's calls. The login: with SASL_SSL the first frame must be AUTH (a session
token from ``metaq.v1.Auth/Authenticate``, checked there; ``AUTH_ATTEMPTS`` refused tokens close the
connection); otherwise the first request's head logs a connection in, as its client certificate's
principal (``BrokerAuth.principal_of_certificate``, the rule gRPC uses too) or ANONYMOUS.

A put is checked before its body is read: its declared size against the broker's limit (the handler's
``limits.max_put_bytes``: over it the connection is closed after the refusal), then from its header who may
write the topic (``RequestHandler.admit_put``); a refused body is read into a small scratch buffer and
dropped, never stored or kept. A group member's REPLICA_FETCH needs ClusterAction on the cluster, checked
before its request body is read, and takes the same ``send_range`` path as fetches.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import grpc
import numpy as np

from metaq_broker.errors import AuthenticationError, MetaqError
from metaq_broker.protocol import dataport, rawput
from metaq_broker.protocol import replication as rp
from metaq_broker.protocol.dataport import AUTH, FETCH, PUT, REPLICA_FETCH, RequestError, RequestReader, code_number
from metaq_broker.protocol.status import code_of
from metaq_broker.server.handler import FetchRequest, RequestHandler
from metaq_broker.server.listener import GO_ON, Connection, Limits, Listener, Step
from metaq_broker.server.replica_manager import FencedError

log = logging.getLogger(__name__)

# The data port's limits (docs/security.md, "Limits")
LOGIN_TIMEOUT_S = 10.0  # accept to authenticated: TLS handshake and AUTH (SASL_SSL), or the first request head
MAX_UNAUTHENTICATED = 64  # connections in that stage at once; more are closed as they are accepted
REQUEST_TIMEOUT_S = 30.0  # a request's bytes (head, topic, put body) must all arrive within this of its first
IDLE_TIMEOUT_S = 600.0  # an authenticated connection that sends no request for this long is closed
SEND_TIMEOUT_S = 60.0  # a reply the client does not take in for this long ends the connection
LIMITS = Limits(LOGIN_TIMEOUT_S, MAX_UNAUTHENTICATED, REQUEST_TIMEOUT_S, IDLE_TIMEOUT_S, SEND_TIMEOUT_S)
KEEP_PUT_BUFFER = 16 << 20  # a connection keeps its put buffer up to this size (puts are <= max_put_bytes)
REFUSED = object()  # what DataServer._answer returns once it answered a refusal
_AUTHENTICATE_FIRST = ("authenticate first: the data port of a SASL_SSL broker takes an AUTH frame with the session "
                       "token from metaq.v1.Auth/Authenticate before any request; closing the connection")


def data_listener(host: str, port: int, auth, request_timeout_s: float = REQUEST_TIMEOUT_S) -> Listener:
    """The data port's listener on ``host:port`` (0: any free port), listening, not serving yet: TLS unless
    PLAINTEXT, connections of ended SASL sessions closed. ``auth`` is the broker's ``BrokerAuth``."""
    limits = replace(LIMITS, request_timeout_s=request_timeout_s)  # the broker's requestTimeout
    return Listener("data", host, port, limits, auth.data_port_context(),
                    sessions=auth if auth.security.uses_sasl else None)


class DataServer:
    """The data port's framing on ``listener`` (``data_listener``), serving from ``start()``. ``handler`` is
    the broker's ``RequestHandler``; ``replicated``: this broker is in a replicated group (REPLICA_FETCH taken)."""

    def __init__(self, handler: RequestHandler, listener: Listener, replicated: bool = False):
        self.handler = handler
        security = handler.auth.security
        self._sasl = security.uses_sasl
        self._certificates = security.client_auth == "required"
        self._replicated = replicated
        self.listener = listener
        self.port = listener.port

    def start(self) -> "DataServer":
        self.listener.start(self)
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, let each connection finish the request it is serving (up to ``grace`` seconds)
        and close them: no reply is sent from a segment file once this returns."""
        self.listener.stop(grace)

    def unauthenticated(self) -> int:
        return self.listener.unauthenticated()

    @property
    def refused_connections(self) -> int:
        return self.listener.refused_connections

    def _reader(self) -> RequestReader:
        """A logged-in connection's reader."""
        return RequestReader((FETCH, PUT, REPLICA_FETCH) if self._replicated else (FETCH, PUT),
                             self.handler.limits.max_put_bytes, rp.MAX_REQUEST_BYTES,
                             {AUTH: " (already authenticated)" if self._sasl else " (this broker takes no AUTH frame)"})

    # -- Framing: the login ---------------------------------------------------------------------------
    def login(self, conn: Connection) -> "_Login":
        return _Login(self, conn)

    # -- Framing: a logged-in connection --------------------------------------------------------------
    def serve(self, conn: Connection, login: "_Login") -> None:
        reader = login.reader
        put_buffer = np.empty(0, np.uint8)  # grown to the largest put, then reused: no new pages per put
        deadline = conn.deadline()
        while conn.active:
            if reader.idle:
                n = conn.wait_request(reader.buffer())
                if not n:
                    return
                reader.received(n)
                deadline = conn.deadline()
            try:
                event = reader.next_event()
            except RequestError as e:  # refused by its framing: answered, then read on or closed
                conn.send(dataport.error_reply(e.kind, code_of(e), str(e)))
                if e.close:
                    return
                continue
            if event is None:
                reader.received(conn.recv_some(reader.buffer(), deadline))
            elif isinstance(event, dataport.Fetch):
                conn.replying()
                self._fetch(conn, event)
            elif isinstance(event, dataport.PutHead):
                if self._answer(conn, PUT, "PutData", self.handler.admit_put, conn.principal, event.topic,
                                event.xid) is REFUSED:
                    put_buffer = np.empty(0, np.uint8)
                    reader.skip_body()
                    continue
                if len(put_buffer) < event.length:
                    put_buffer = np.empty(event.length, np.uint8)
                reader.take_body(memoryview(put_buffer)[:event.length])
            elif isinstance(event, dataport.Put):
                conn.replying()
                if not self._put(conn, event.request) or len(put_buffer) > KEEP_PUT_BUFFER:
                    put_buffer = np.empty(0, np.uint8)  # after a refusal, or a rare huge put: not kept
            elif isinstance(event, dataport.ReplicaFetchHead):
                if not self._authorize_replica(conn):
                    return
                reader.take_replica_request()
            else:  # ReplicaFetch
                conn.replying()
                self._replica_fetch(conn, event.request)

    def _answer(self, conn: Connection, kind: int, method: str, call, *args):
        """``call(*args)``, or REFUSED once its refusal is sent in the layout of ``kind``."""
        try:
            return call(*args)
        except Exception as e:  # noqa: BLE001 - every failure is answered; refusal logs what is unexpected
            error = self.handler.refusal(e, method)
            conn.send(dataport.error_reply(kind, code_of(error), str(error)))
            return REFUSED

    def _fetch(self, conn: Connection, event: dataport.Fetch) -> None:
        start = time.perf_counter()
        request = FetchRequest(event.topic, event.partition, event.offset, event.max_bytes, event.max_messages,
                               event.max_wait_ms)
        fd = -1
        try:
            def locate():
                f = self.handler.fetch(conn.principal, request, lambda: conn.active, locate=True)
                return f, f.records.dup_fd() if f.records.length else -1
            located = self._answer(conn, FETCH, "FetchData", locate)
            if located is REFUSED:
                return
            f, fd = located
            where = f.records
            header = dataport.fetch_reply_head(where.start_offset, where.end_offset, f.earliest_offset,
                                               f.last_stable_offset, where.length, where.aborted)
            if not where.length:
                conn.send(header)
            else:
                conn.send_range(header, fd, where.position, where.length, where.path)
        finally:
            if fd >= 0:
                os.close(fd)
            self.handler.observe("FetchData", time.perf_counter() - start)

    def _put(self, conn: Connection, request: memoryview) -> bool:
        start = time.perf_counter()
        try:
            r = self._answer(conn, PUT, "PutData", lambda: self.handler.put(conn.principal, rawput.unpack(request)))
        finally:  # counted before the answer goes out, as gRPC's puts are: whoever sees the answer sees the count
            self.handler.observe("PutData", time.perf_counter() - start)
        if r is REFUSED:
            return False
        conn.send(dataport.put_reply(r.base_offset, r.base_msg_id, r.timestamp_ms, r.partition, r.count, r.fsynced))
        return True

    # -- the replica fetch ----------------------------------------------------------------------------
    def _epoch(self) -> int:
        replicas = self.handler.replicas
        return replicas.epoch if replicas is not None else 0

    def _authorize_replica(self, conn: Connection) -> bool:
        """ClusterAction on the cluster, before the request's body is read; a refusal is answered, the
        connection closed (False), and logged once a minute per principal, since the member that asks may
        be misconfigured rather than hostile."""
        try:
            self.handler.authorize_replica(conn.principal)
            return True
        except MetaqError as e:
            self.listener.log_once(("replica", conn.principal), logging.WARNING,
                                   "data port: replica fetch refused: %s (a group member's principal needs "
                                   "ClusterAction on the cluster, or to be in super.users)", e)
            conn.send(rp.error_reply(code_number(code_of(e)), str(e), self._epoch()))
            return False

    def _replica_fetch(self, conn: Connection, request: bytearray) -> None:
        """A group member copying from this master (``RequestHandler.replica_fetch`` decides what): the head,
        the journal frames, then per partition a section head and its records from the segment file."""
        fds = []
        try:
            try:
                req = rp.unpack_request(request)
                answer = self.handler.replica_fetch(conn.principal, req, lambda: conn.active)
            except FencedError as e:
                conn.send(rp.error_reply(code_number(grpc.StatusCode.FAILED_PRECONDITION), str(e), self._epoch()))
                return
            except Exception as e:  # noqa: BLE001 - every failure is answered; refusal logs what is unexpected
                error = self.handler.refusal(e, "ReplicaFetch")
                conn.send(rp.error_reply(code_number(code_of(error)), str(error), self._epoch()))
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
                    sec.status, sec.epoch, sec.offset,
                    self.handler.partition_identity(pf.topic, pf.partition) if identities else None))
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
                    conn.send_range(b"".join(pending), fd, pos, n, path)
                    pending = []
            if pending:
                conn.send(b"".join(pending))
        finally:
            for fd in fds:
                os.close(fd)


class _Login:
    """A data port connection's login, fed by the accepting thread. With SASL_SSL: the AUTH frame, its
    token checked (a refused one answered, ``AUTH_ATTEMPTS`` of them close the connection), anything else
    refused; otherwise the first request's head, the client certificate's principal taken (mutual TLS).
    ``reader`` then goes on with the connection's requests."""

    def __init__(self, port: DataServer, conn: Connection):
        self.port, self.conn = port, conn
        self.reader = RequestReader((AUTH,)) if port._sasl else port._reader()
        self.refused = 0

    def buffer(self) -> memoryview:
        return self.reader.buffer()

    def received(self, n: int) -> Step:
        self.reader.received(n)
        handler = self.port.handler
        if not self.port._sasl:
            if not self.reader.has_head:
                return GO_ON
            if self.port._certificates:
                try:
                    self.conn.principal = handler.principal_of_certificate(self.conn.peer_certificate())
                except AuthenticationError as e:
                    return Step(dataport.error_reply(self.reader.kind, grpc.StatusCode.UNAUTHENTICATED,
                                                     f"{e}; closing the connection"), close=True)
            return Step(logged_in=True)
        try:
            event = self.reader.next_event()
        except RequestError as e:
            return Step(dataport.error_reply(e.kind, grpc.StatusCode.UNAUTHENTICATED, _AUTHENTICATE_FIRST), close=True)
        if event is None:
            return GO_ON
        try:
            session = handler.session(event.token)
        except AuthenticationError as e:
            self.refused += 1
            return Step(dataport.error_reply(AUTH, grpc.StatusCode.UNAUTHENTICATED, str(e)),
                        close=self.refused >= dataport.AUTH_ATTEMPTS)
        self.conn.principal, self.conn.session, self.conn.token = session.principal, session, event.token
        self.reader = self.port._reader()
        return Step(dataport.auth_reply(session.principal), logged_in=True)
