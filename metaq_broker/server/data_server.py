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
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

import grpc
import numpy as np

from metaq_broker.errors import InvalidOffsetError, MetaqError
from metaq_broker.protocol import records
from metaq_broker.protocol.dataport import (FETCH, MAX_PUT_BYTES, MAX_TOPIC_BYTES, OK, PREFIX, PUT, PUT_REPLY, REPLY,
                                            REQUEST, ProtocolError, code_number, recv_exact)
from metaq_broker.protocol.rawfetch import pack_aborted
from metaq_broker.protocol.status import code_of

log = logging.getLogger(__name__)

_SENDFILE_CHUNK = 1 << 30
KEEP_PUT_BUFFER = 16 << 20  # a connection keeps its put buffer up to this size (the sink's puts are <= 4 MiB)
_MSG_MORE = getattr(socket, "MSG_MORE", 0)


class DataServer:
    """Accepts on ``host:port`` (0: any free port); one daemon thread per connection, each serving its
    requests in order. ``service`` is the broker's ``BrokerService``: the store, closed partitions,
    counters and limits are its."""

    def __init__(self, service, host: str, port: int):
        self.service = service
        self._listener = socket.create_server((host, port), backlog=128)  # SO_REUSEADDR: a restart rebinds
        self.port = self._listener.getsockname()[1]
        self._conns: dict = {}  # socket -> thread
        self._lock = threading.Lock()
        self._stopping = False
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
                sock, _ = self._listener.accept()
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
                thread = threading.Thread(target=self._serve, args=(sock,), name="metaq-data", daemon=True)
                self._conns[sock] = thread
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        head = bytearray(REQUEST.size)  # no request is shorter: a PUT has a 32-byte PutRaw header after its prefix
        put_buffer = np.empty(0, np.uint8)  # grown to the largest put, then reused: no new pages per put
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._stopping and recv_exact(sock, memoryview(head)):
                length, kind, topic_len, *fields = REQUEST.unpack(head)
                if kind == PUT:
                    if not REQUEST.size + records.ALIGN <= length <= MAX_PUT_BYTES:
                        self._send_put_error(sock, grpc.StatusCode.INVALID_ARGUMENT,
                                             f"data port put of {length} bytes (at most {MAX_PUT_BYTES}); closing "
                                             f"the connection")
                        return
                    if len(put_buffer) < length:
                        put_buffer = np.empty(length, np.uint8)
                    put_buffer[:REQUEST.size] = np.frombuffer(head, np.uint8)
                    if not recv_exact(sock, memoryview(put_buffer)[REQUEST.size:length]):
                        raise ProtocolError("connection closed inside a request")
                    self._put(sock, memoryview(put_buffer)[PREFIX.size:length])
                    if len(put_buffer) > KEEP_PUT_BUFFER:  # a rare huge put: its memory is not kept
                        put_buffer = np.empty(0, np.uint8)
                    continue
                if kind != FETCH or topic_len > MAX_TOPIC_BYTES or length != REQUEST.size + topic_len:
                    self._send_error(sock, grpc.StatusCode.INVALID_ARGUMENT,
                                     f"malformed data port request (kind {kind}, {length} bytes, topic of "
                                     f"{topic_len} bytes); closing the connection")
                    return
                name = bytearray(topic_len)
                if topic_len and not recv_exact(sock, memoryview(name)):
                    raise ProtocolError("connection closed inside a request")
                self._fetch(sock, name, *fields)
        except (OSError, ProtocolError):
            pass  # the client went away or broke the framing: nothing to answer
        except Exception:  # noqa: BLE001 - a bad connection must never take the broker down
            log.exception("data port connection failed")
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()

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

    def _locate(self, name: bytearray, partition: int, offset: int, max_bytes: int, max_messages: int,
                max_wait_ms: int) -> tuple:
        """(FileRange, partition, a dup of its segment's fd or -1 when empty) of one fetch."""
        try:
            topic = name.decode()
        except UnicodeDecodeError:
            raise InvalidOffsetError("the topic name is not UTF-8") from None
        where, log_ = self.service.read(topic, partition, offset, max_bytes, max_messages, max_wait_ms,
                                        lambda: not self._stopping, locate=True)
        return where, log_, where.dup_fd() if where.length else -1

    def _fetch(self, sock: socket.socket, *request) -> None:
        start = time.perf_counter()
        fd = -1
        try:
            located = self._answer(sock, "FetchData", self._send_error, lambda: self._locate(*request))
            if located is None:
                return
            where, log_, fd = located
            aborted = pack_aborted(where.aborted)
            header = REPLY.pack(REPLY.size + len(aborted), OK, where.start_offset, where.end_offset,
                                log_.earliest_offset, log_.latest_offset, where.length) + aborted
            if not where.length:
                sock.sendall(header)
                return
            sock.sendall(header, _MSG_MORE)
            pos, left = where.position, where.length
            while left:
                n = os.sendfile(sock.fileno(), fd, pos, min(left, _SENDFILE_CHUNK))
                if n == 0:  # the file is shorter than its index says: the client sees a cut reply
                    raise ProtocolError(f"{where.path} ends at byte {pos}, {left} bytes short")
                pos += n
                left -= n
        finally:
            if fd >= 0:
                os.close(fd)
            if self.service.observe is not None:
                self.service.observe("FetchData", time.perf_counter() - start)

    def _put(self, sock: socket.socket, request: memoryview) -> None:
        start = time.perf_counter()
        try:
            r = self._answer(sock, "PutData", self._send_put_error, lambda: self.service.put(request))
            if r is not None:
                sock.sendall(PUT_REPLY.pack(PUT_REPLY.size, OK, r.base_offset, r.base_msg_id, r.timestamp_ms,
                                            r.partition, r.count, int(r.fsynced), 0))
        finally:
            if self.service.observe is not None:
                self.service.observe("PutData", time.perf_counter() - start)

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
