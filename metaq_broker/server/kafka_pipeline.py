"""A Kafka connection's produce requests in flight (Kafka's produce purgatory): the connection's thread
appends each Produce request's batches as it reads it, in request order, and hands the wait for their
acknowledgement (group commit's fsync, the in-sync replicas) and the answer to the connection's answering
thread, then reads the next request. The answering thread takes the requests of one read once they are
all appended (``before_read``), so one fsync acknowledges them all; requests read while it waits are
appended meanwhile and covered by its next fsync. So a client's pipelined requests (librdkafka sends up
to 5 per connection) no longer pay one fsync each, one after another.

Order, as Kafka keeps it: appends happen on the connection's thread, one after another, in request order
(an idempotent producer's sequences and a partition's order are as if served one at a time); answers are
sent strictly in request order, each once its own batches are acknowledged; any other request waits
(``drain``) until every answer before it is sent. At most ``MAX_IN_FLIGHT`` requests wait at once: the
connection's thread stops reading until the oldest is answered, so a client that sends without reading
(acks=0, or one that never reads) holds at most that many requests' batches in memory.

A TLS connection is answered by its own thread (``threaded=False``): an SSL socket must not be read and
written by two threads at once. Its requests that came in one read are still appended before the first of
them is waited for (``drain`` before the next read), so they share a group commit too.

If the client goes away, every appended batch is still acknowledged (under group commit a batch becomes
visible only once an fsync covers it), just not answered. ``close`` returns once every request in flight
is acknowledged: each wait is bounded (an fsync; ``ReplicaManager.await_hw``'s replica lag limit).

Lock order: ``_cond`` alone; nothing is called under it.
"""
from __future__ import annotations

import logging
import socket
import threading
from collections import deque
from typing import Callable, Optional

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 8  # a connection's produce requests appended and not answered yet (librdkafka sends 5)


class InFlight:
    """The produce requests of one connection waiting for their answers. ``add(answer)``: ``answer()``
    waits for one request's acknowledgement and sends its answer (it never raises but for a failed send);
    it runs on the answering thread, after every earlier one."""

    def __init__(self, name: str, sock: socket.socket, threaded: bool = True):
        self._name, self._sock, self._threaded = name, sock, threaded
        self._cond = threading.Condition()
        self._waiting: deque = deque()  # answers not run yet, oldest first
        self._ready = 0  # how many of them the answering thread may take (``_release``)
        self._running = False  # the answering thread is running the oldest one
        self._closed = False
        self._send_failed: Optional[BaseException] = None  # the client went away: nothing more is sent
        self._thread: Optional[threading.Thread] = None

    def add(self, answer: Callable[[bool], None]) -> None:
        """Queue ``answer(send)`` (``send`` False once the client is gone: acknowledge, answer nobody);
        waits while ``MAX_IN_FLIGHT`` are queued. Raises ConnectionError once an answer could not be sent."""
        if not self._threaded:
            self._check()
            self._waiting.append(answer)
            if len(self._waiting) >= MAX_IN_FLIGHT:
                self.drain()
            return
        with self._cond:
            while len(self._waiting) + self._running >= MAX_IN_FLIGHT and self._send_failed is None:
                self._release()
                self._cond.wait(0.5)
            self._check()
            self._waiting.append(answer)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self._name}-answers", daemon=True)
                self._thread.start()

    def drain(self) -> None:
        """Return once every queued request is answered (before another request is answered, or before a
        TLS connection reads again). Raises ConnectionError once an answer could not be sent."""
        if not self._threaded:
            self._answer_queued()
        with self._cond:
            while self._waiting or self._running:
                self._release()
                self._cond.wait(0.5)
            self._check()

    def before_read(self) -> None:
        """The connection's thread has appended what the last read brought and is about to read again: the
        answering thread may now wait for those requests (one fsync covers all of them, since they are all
        written before it starts); a TLS connection answers them itself first."""
        if not self._threaded:
            self.drain()
            return
        with self._cond:
            self._release()

    def close(self) -> None:
        """The connection ends: acknowledge what is queued (answering it while the client is there), end
        the answering thread. Bounded: each acknowledgement's wait is."""
        with self._cond:
            self._closed = True
            self._release()
            self._cond.notify_all()
        if not self._threaded:
            self._answer_queued()
        elif self._thread is not None:
            self._thread.join()

    def _release(self) -> None:
        """(Under ``_cond``.) The answering thread may take every request queued so far."""
        if self._ready < len(self._waiting):
            self._ready = len(self._waiting)
            self._cond.notify_all()

    def _answer_queued(self) -> None:
        """Without a thread (TLS): answer what is queued, on the connection's own thread."""
        while self._waiting:
            self._answer(self._waiting.popleft())

    def _check(self) -> None:
        if self._send_failed is not None:
            raise ConnectionError(f"an answer could not be sent: {self._send_failed}")

    def _answer(self, answer: Callable[[bool], None]) -> None:
        try:
            answer(self._send_failed is None)
        except Exception as e:  # noqa: BLE001 - the client went away or stopped reading (OSError), or a bug:
            if not isinstance(e, OSError):  # the rest is acknowledged, not sent, and the connection closed
                log.exception("%s: answering a produce request failed", self._name)
            self._send_failed = e
            try:  # the connection's thread, reading, sees the end
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
            except OSError:
                pass
            log.debug("%s: an answer could not be sent (%s); closing the connection", self._name, e)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ready and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return
                answer = self._waiting.popleft()
                self._ready = max(self._ready - 1, 0)
                self._running = True
            try:
                self._answer(answer)
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()

