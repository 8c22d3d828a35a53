"""The MetaQ listener: MetaQ 1.4's text protocol on ``metaqPort`` (docs/metaq-protocol.md).

The framing only: a connection's bytes go to ``protocol/metaq/text.py``'s ``RequestParser``, each request
becomes calls of the broker's one ``RequestHandler`` (the same checks, ACLs, errors and counters as every
other transport) and its answer a ``result`` or ``value`` reply, written in request order with the
request's opaque. The requests a single read brought (a client pipelining; read on while a request is
incomplete and its rest already waiting) are answered together in one send, and consecutive puts among
them to one partition of one topic, outside a transaction, are stored as one batch (one append, one
acknowledgement), each answered with its own message id and position.

MetaQ has no login: a connection's first bytes log it in (``Listener``'s pre-login limits apply to that
wait), as its TLS client certificate's principal where one is required, else ANONYMOUS; ACLs then decide
every command as for any other caller. ``get`` and ``offset`` count in MetaQ byte positions
(``metaq_reads.py``).

Status codes as MetaQ answers them: 200; 301 a moved position; 400 a bad request (the parser's refusals);
403 a closed partition, or a principal the ACLs refuse; 404 no such topic or partition (``get``,
``offset``), or nothing at a position yet; 500 anything else, with the error's message; 503 ``sync``."""
from __future__ import annotations

import hashlib
import os
import select
import time
from dataclasses import replace
from typing import Optional

import numpy as np
import pyarrow as pa

from metaq_broker import __version__
from metaq_broker.errors import (AuthorizationError, ConfigError, InvalidPartitionError, MetaqError,
                                 OffsetOutOfRangeError, PartitionClosedError, UnknownTopicError)
from metaq_broker.protocol import rawput, records
from metaq_broker.protocol.metaq import offsets as mq_offsets
from metaq_broker.protocol.metaq import text
from metaq_broker.protocol.metaq.messages import message_sizes
from metaq_broker.protocol.metaq.text import Code
from metaq_broker.security.tls import ANONYMOUS
from metaq_broker.server import metaq_positions, metaq_reads
from metaq_broker.server.handler import FetchRequest, RequestHandler
from metaq_broker.server.listener import Connection, Limits, Listener, Step
from metaq_broker.store.txn_state import MAX_XID_BYTES

# The MetaQ port's limits (docs/security.md, "Limits"): as the data port's
LOGIN_TIMEOUT_S = 10.0  # accept to the first bytes (and the TLS handshake)
MAX_UNAUTHENTICATED = 64
REQUEST_TIMEOUT_S = 30.0  # a request's bytes (line and put body) must all arrive within this of its first
IDLE_TIMEOUT_S = 600.0  # MetaQ clients send ``version`` as a heartbeat well within this
SEND_TIMEOUT_S = 60.0
LIMITS = Limits(LOGIN_TIMEOUT_S, MAX_UNAUTHENTICATED, REQUEST_TIMEOUT_S, IDLE_TIMEOUT_S, SEND_TIMEOUT_S)
READ_SIZE = 256 << 10  # bytes read from the socket at a time, once logged in
GATHER_MAX = 4 * READ_SIZE  # bytes read before answering while a request is incomplete and more is waiting
FIRST_READ = text.MAX_LINE  # before: a connection costs no more than its first line's worth


def check_security(security, anonymous_topics: tuple) -> None:
    """Refuse a MetaQ listener that would let anyone in unchecked: MetaQ 1.4 has no login, so on a cluster
    with SASL or ACLs its clients are ANONYMOUS (unless TLS client certificates name them), and the operator
    must name the topics they may use (``metaq.anonymousTopics``)."""
    secured = security.uses_sasl or security.authorizer == "acl"
    named = security.uses_tls and security.client_auth == "required"
    if secured and not named and not anonymous_topics:
        raise ConfigError(
            f"metaqPort: MetaQ 1.4 clients have no login, so on this cluster (security.protocol="
            f"{security.protocol}, authorizer={security.authorizer}) they would all be ANONYMOUS; name the topics "
            f"they may use in metaq.anonymousTopics (ACLs still apply to User:ANONYMOUS), require TLS client "
            f"certificates (ssl.client.auth=required), or turn the MetaQ listener off (metaqPort=-1)")


def metaq_listener(host: str, port: int, auth, request_timeout_s: float = REQUEST_TIMEOUT_S) -> Listener:
    """The MetaQ port's listener on ``host:port`` (0: any free port), listening, not serving yet: TLS
    unless security.protocol is PLAINTEXT (MetaQ 1.4 clients speak plain TCP: put a TLS proxy beside them)."""
    limits = replace(LIMITS, request_timeout_s=request_timeout_s)  # the broker's requestTimeout
    return Listener("metaq", host, port, limits, auth.data_port_context())


def _readable_now(conn: Connection) -> bool:
    """Bytes are waiting on the connection (a read would not block)."""
    sock = conn.sock
    if getattr(sock, "pending", None) and sock.pending():  # TLS: decrypted bytes already in hand
        return True
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return bool(poll.poll(0))


class _Login:
    """MetaQ has no login: the first bytes of a connection log it in; they are its first request's."""

    def __init__(self, server: "MetaqServer", conn: Connection):
        self._server, self._conn = server, conn
        self._buf = bytearray(FIRST_READ)
        self.first = b""

    def buffer(self) -> memoryview:
        return memoryview(self._buf)

    def received(self, n: int) -> Step:
        self.first = bytes(self._buf[:n])
        if self._server.certificates:
            self._conn.principal = self._server.handler.principal_of_certificate(self._conn.peer_certificate())
        return Step(logged_in=True)


class MetaqServer:
    """MetaQ's framing on ``listener`` (``metaq_listener``), serving from ``start()``; ``handler`` is the
    broker's ``RequestHandler``."""

    def __init__(self, handler: RequestHandler, listener: Listener, max_message_size: int = text.MAX_MESSAGE_SIZE,
                 anonymous_topics: tuple = ()):
        self.handler = handler
        security = handler.auth.security
        # ANONYMOUS is let in only to these topics where security is on (``check_security``); None: anywhere
        self.anonymous_topics = frozenset(anonymous_topics) if security.uses_sasl or \
            security.authorizer == "acl" else None
        self.listener = listener
        self.port = listener.port
        self.certificates = handler.auth.security.client_auth == "required"
        self.positions = metaq_reads.Positions()
        self._max_message = max_message_size  # the broker's maxMessageSize: a larger put is refused unread
        self._long_keys: dict = {}  # xid -> an XA key too long to be the xid itself (``_xid``)

    def start(self) -> "MetaqServer":
        self.listener.start(self, text.warm_up)  # the compiled put scan, at the first connection
        return self

    def stop(self, grace: float = 5.0) -> None:
        self.listener.stop(grace)

    # -- Framing --------------------------------------------------------------------------------------
    def login(self, conn: Connection) -> _Login:
        return _Login(self, conn)

    def serve(self, conn: Connection, login: _Login) -> None:
        parser = text.RequestParser(max_message_size=self._max_message)
        events = parser.feed(login.first)
        view = memoryview(bytearray(READ_SIZE))
        deadline = conn.deadline()
        while True:
            if events:
                conn.replying()
                out = self.answer(conn, events)
                if out:
                    conn.send(out)
                deadline = conn.deadline()  # a request completed: the clock of the next one starts
            if parser.closed:
                return
            # inside a request (buffered), its rest must come by its deadline, however it trickles
            n, deadline = conn.read_next(view, parser.buffered, deadline)
            if not n:
                return
            events = parser.feed(view[:n])
            gathered = n
            while events and parser.buffered and not parser.closed and gathered < GATHER_MAX and _readable_now(conn):
                # a pipeline longer than a read: its rest is already here, so its puts make one batch
                n = conn.recv_some(view, deadline)
                events += parser.feed(view[:n])
                gathered += n

    # -- requests -------------------------------------------------------------------------------------
    def answer(self, conn: Connection, events: list) -> bytes:
        """The replies of ``events``, in order."""
        out = []
        i = 0
        while i < len(events):
            event = events[i]
            if isinstance(event, text.PutRun):
                j = i + 1
                while (j < len(events) and isinstance(events[j], text.PutRun) and events[j].topic == event.topic
                       and events[j].partition == event.partition):
                    j += 1
                out.append(self._put_run(conn, text.PutRun.joined(events[i:j])))
                i = j
                continue
            if isinstance(event, text.Put) and event.tx is None:
                j = i + 1
                while (j < len(events) and isinstance(events[j], text.Put) and events[j].tx is None
                       and events[j].topic == event.topic and events[j].partition == event.partition):
                    j += 1
                out.append(self._puts(conn, events[i:j]))
                i = j
                continue
            i += 1
            if isinstance(event, text.Quit):
                break
            if isinstance(event, text.Rejected):
                out.append(text.rejected_reply(event))
                if event.close:
                    break
                continue
            started = time.monotonic()
            name = type(event).__name__.lower()
            try:
                out.append(getattr(self, f"_{name}")(conn, event))
            except Exception as e:  # noqa: BLE001 - every failure is answered; the handler logs bugs
                out.append(self._refusal(e, f"metaq.{name}", [event.opaque]))
            self.handler.observe(f"metaq.{name}", time.monotonic() - started)
        return b"".join(out)

    def _principal(self, conn: Connection, topic: Optional[str]) -> str:
        """The caller's principal for a command on ``topic`` (None: on the broker); ANONYMOUS, where security
        is on, only on a topic of metaq.anonymousTopics."""
        principal = conn.principal
        if principal == ANONYMOUS and self.anonymous_topics is not None and topic not in self.anonymous_topics:
            where = f"topic {topic!r}" if topic is not None else "the broker"
            raise AuthorizationError(principal, "Use", "topic" if topic is not None else "cluster", topic or "",
                                     f"MetaQ clients have no login: ANONYMOUS may use only the topics of "
                                     f"metaq.anonymousTopics, not {where}")
        return principal

    def _refusal(self, exc: BaseException, method: str, opaques, missing: int = Code.INTERNAL_ERROR) -> bytes:
        """``result`` for a failed request (one per opaque: the puts of a batch): 403 closed or refused,
        ``missing`` (404 for reads) no such topic or partition, else 500; the handler's ``refusal`` says what."""
        error = self.handler.refusal(exc, method)
        if isinstance(error, (PartitionClosedError, AuthorizationError)):
            code = Code.FORBIDDEN
        elif isinstance(error, (UnknownTopicError, InvalidPartitionError)):
            code = missing
        else:
            code = Code.INTERNAL_ERROR
        return b"".join(text.result(code, str(error), opaque) for opaque in opaques)

    def _puts(self, conn: Connection, puts: list) -> bytes:
        """Consecutive puts to one partition, stored as one batch; a reply each."""
        n = len(puts)
        attributes = [p.attribute for p in puts]
        return self._batch(conn, puts[0].topic, puts[0].partition, [p.value for p in puts], attributes,
                           np.fromiter((p.flag for p in puts), np.int64, n),
                           np.fromiter((len(p.value) for p in puts), np.int64, n),
                           np.fromiter((-1 if a is None else len(a.encode()) for a in attributes), np.int64, n),
                           [p.opaque for p in puts])

    def _put_run(self, conn: Connection, run: text.PutRun) -> bytes:
        """A ``PutRun`` (no attributes) stored as one batch, its values an Arrow column over the run's bytes."""
        values = pa.BinaryArray.from_buffers(pa.binary(), len(run), [None, pa.py_buffer(run.offsets),
                                                                     pa.py_buffer(run.data)])
        return self._batch(conn, run.topic, run.partition, values, None, run.flags, np.diff(run.offsets), None,
                           run.opaques)

    def _batch(self, conn: Connection, topic: str, partition: int, values, attributes, flags,
               value_lengths: np.ndarray, attribute_lengths, opaques) -> bytes:
        """Puts to one partition stored as one batch (one append, one acknowledgement); a reply each, in order."""
        started = time.monotonic()
        try:
            body = records.encode_body(values, attributes=attributes, flags=flags)
            request = rawput.Request(topic, partition, "",
                                     rawput.Batch(body.count, body.attributes, memoryview(b"".join(body.parts)),
                                                  body.crc))
            done = self.handler.put(self._principal(conn, topic), request)
            part = self.handler.store.partition(done.topic, done.partition)
            position = metaq_positions.stream_position(part, done.base_offset)
        except Exception as e:  # noqa: BLE001 - every put of the batch gets the refusal
            return self._refusal(e, "metaq.put", opaques)
        finally:
            self.handler.observe("metaq.put", time.monotonic() - started)
        sizes = message_sizes(value_lengths, attribute_lengths)
        starts = position + np.cumsum(sizes) - sizes
        ids = np.arange(done.base_msg_id, done.base_msg_id + len(opaques), dtype=np.int64)
        return text.put_results(ids, done.partition, starts, opaques)

    def _get(self, conn: Connection, get: text.Get) -> bytes:
        try:
            part = self.handler.readable(self._principal(conn, get.topic), get.topic, get.partition)
            answer, served = self._read(conn, part, get)
        except Exception as e:  # noqa: BLE001
            return self._refusal(e, "metaq.get", [get.opaque], Code.NOT_FOUND)
        if isinstance(answer, mq_offsets.NotFound):
            return text.result(Code.NOT_FOUND, f"Could not find message at position {get.offset}", get.opaque)
        if isinstance(answer, mq_offsets.Moved):
            return text.result(Code.MOVED, str(answer.position), get.opaque)
        return text.value_header(len(served), get.opaque) + served

    def _read(self, conn: Connection, part, get: text.Get) -> tuple:
        """(answer, the message set of a ``Serve``)."""
        handler = self.handler
        position = get.offset
        log_start, last_stable = part.earliest_offset, part.last_stable_offset
        end = metaq_reads.visible_end(part, last_stable)
        if position >= end:
            return metaq_reads.at_end(position, end), b""
        offset = self.positions.offset_at(part, max(position, 0))
        try:
            fetched = handler.fetch(conn.principal, FetchRequest(get.topic, get.partition, offset, get.max_size),
                                    lambda: conn.active)
        except OffsetOutOfRangeError:  # retention removed it meanwhile: the next readable message
            return mq_offsets.Moved(metaq_positions.stream_position(part, part.earliest_offset)), b""
        w = metaq_reads.window(part, fetched.records)
        if w is not None and w.start_position > position and offset > part.earliest_offset:
            # a remembered position the log no longer has there (truncated since): looked up again
            offset = metaq_positions.offset_at(part, -1, position)
            fetched = handler.fetch(conn.principal, FetchRequest(get.topic, get.partition, offset, get.max_size),
                                    lambda: conn.active)
            w = metaq_reads.window(part, fetched.records)
        if w is None:
            return mq_offsets.NotFound(), b""
        answer = mq_offsets.answer_get(w, position, get.max_size, log_start, last_stable, end)
        if not isinstance(answer, mq_offsets.Serve):
            return answer, b""
        served = metaq_reads.message_set(fetched.records, answer)
        if answer.count:
            self.positions.remember(part, answer.position + answer.nbytes, answer.offset + answer.count)
        return answer, served

    def _offsetquery(self, conn: Connection, query: text.OffsetQuery) -> bytes:
        try:
            part = self.handler.readable(self._principal(conn, query.topic), query.topic, query.partition)
            log_start, last_stable = part.earliest_offset, part.last_stable_offset
            end = metaq_reads.visible_end(part, last_stable)
            position = max(query.offset, 0)
            if position >= end:
                nearest = end
            else:
                offset = self.positions.offset_at(part, position)
                w = metaq_reads.window(part, part.read(offset, 1 << 16))
                nearest = end if w is None else mq_offsets.nearest_position(w, position, log_start, last_stable, end)
        except Exception as e:  # noqa: BLE001
            return self._refusal(e, "metaq.offset", [query.opaque], Code.NOT_FOUND)
        return text.result(Code.SUCCESS, str(nearest), query.opaque)

    def _version(self, conn: Connection, version: text.Version) -> bytes:
        return text.result(Code.SUCCESS, __version__, version.opaque)

    def _stats(self, conn: Connection, stats: text.Stats) -> bytes:
        item = stats.item
        handler = self.handler
        broker_wide = item in (None, "realtime", "config", "topics", "offsets")
        principal = self._principal(conn, None if broker_wide else item)
        if item in (None, "realtime"):
            reply = handler.stats_of(principal)
            pairs = [("pid", os.getpid()), ("broker_id", reply.broker_id), ("port", self.port),
                     ("uptime", int(reply.uptime_seconds)), ("version", reply.version), ("slave", "false"),
                     ("curr_connections", self.listener.connections()),
                     ("cmd_put", sum(p.puts for p in reply.partitions)),
                     ("cmd_get", sum(p.gets for p in reply.partitions)),
                     ("get_miss", sum(p.get_misses for p in reply.partitions)),
                     ("put_failed", sum(p.put_failures for p in reply.partitions)),
                     ("total_messages", sum(p.put_messages for p in reply.partitions)),
                     ("topics", len(handler.list_topics(principal)))]
        elif item == "topics":
            pairs = [(t.topic, f"partitions {t.num_partitions}") for t in handler.list_topics(principal)]
        elif item == "offsets":
            pairs = []
            for t in handler.list_topics(principal):
                for p in handler.describe_topic(principal, t.topic).partitions:
                    part = handler.store.partition(t.topic, p.partition)
                    pairs.append((f"{t.topic}-{p.partition}",
                                  f"min_offset {metaq_positions.stream_position(part, p.earliest)} "
                                  f"max_offset {metaq_reads.visible_end(part, p.latest)}"))
        elif item == "config":  # the topics' settings as INI, not the broker's file (it may hold secrets)
            sections = [f"[topic={t.topic}]\r\n" + "".join(f"{k}={v}\r\n" for k, v in
                                                           handler.describe_topic(principal, t.topic).config.items())
                        for t in handler.list_topics(principal)]
            return text.result(Code.SUCCESS, "\r\n".join(sections), stats.opaque)
        else:
            description = handler.describe_topic(principal, item)
            pairs = [("resultCode", 0), ("partitions", len(description.partitions)),
                     ("message_count", sum(p.latest - p.earliest for p in description.partitions)),
                     ("bytes", sum(p.bytes for p in description.partitions))]
        return text.result(Code.SUCCESS, text.stats_body(pairs), stats.opaque)

    # -- transactions ---------------------------------------------------------------------------------
    def _xid(self, key) -> str:
        """metaq's xid of a MetaQ transaction key: its text, or for a longer one than metaq's 255 bytes (an
        XA key with long ids) a digest of it, remembered for RECOVER while the broker runs."""
        if key is None:
            raise MetaqError("transaction: a key is needed (null names no transaction)")
        key_text = str(key)
        if len(key_text.encode()) <= MAX_XID_BYTES:
            return key_text
        xid = "metaq-xa:" + hashlib.sha256(key_text.encode()).hexdigest()
        self._long_keys[xid] = key_text
        return xid

    def _put(self, conn: Connection, put: text.Put) -> bytes:
        """A put in a transaction (BEGIN first): stored flagged with it, invisible until its commit."""
        body = records.encode_body([put.value], attributes=[put.attribute], flags=[put.flag])
        request = rawput.Request(put.topic, put.partition, self._xid(put.tx),
                                 rawput.Batch(body.count, body.attributes, memoryview(b"".join(body.parts)), body.crc))
        done = self.handler.put(self._principal(conn, None), request)  # a transaction needs a named caller
        position = metaq_positions.stream_position(self.handler.store.partition(done.topic, done.partition),
                                                   done.base_offset)
        return text.put_result(done.base_msg_id, done.partition, position, put.opaque)

    def _transaction(self, conn: Connection, tx: text.Transaction) -> bytes:
        """MetaQ's transaction commands onto metaq's: BEGIN, PREPARE, COMMIT_TWO_PHASE, ROLLBACK as they are;
        COMMIT_ONE_PHASE a prepare and a commit; END and FORGET answer 200 (metaq ends a branch at its
        prepare and forgets outcomes itself); RECOVER the prepared XA keys of the unique qualifier."""
        handler, principal, kind = self.handler, self._principal(conn, None), tx.type
        if kind is text.TxType.RECOVER:
            keys = [self._long_keys.get(t.xid, t.xid) for t in handler.recover_transactions(principal)]
            qualifier = tx.unique_qualifier
            keys = [k for k in keys if k.startswith("XID:") and (qualifier is None or k.endswith(f":{qualifier}"))]
            return text.result(Code.SUCCESS, "".join(f"{k}\r\n" for k in keys), tx.opaque)
        xid = self._xid(tx.key)
        if kind is text.TxType.BEGIN:
            handler.begin_transaction(principal, xid, tx.timeout * 1000, "")
        elif kind is text.TxType.PREPARE:
            handler.prepare_transaction(principal, xid)
        elif kind is text.TxType.COMMIT_ONE_PHASE:
            handler.prepare_transaction(principal, xid)
            handler.commit_transaction(principal, xid)
        elif kind is text.TxType.COMMIT_TWO_PHASE:
            handler.commit_transaction(principal, xid)
        elif kind is text.TxType.ROLLBACK:
            handler.rollback_transaction(principal, xid)
        if kind in (text.TxType.COMMIT_ONE_PHASE, text.TxType.COMMIT_TWO_PHASE, text.TxType.ROLLBACK,
                    text.TxType.FORGET):
            self._long_keys.pop(xid, None)
        return text.result(Code.SUCCESS, None, tx.opaque)
