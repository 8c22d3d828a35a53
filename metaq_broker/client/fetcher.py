"""Fetching one partition's messages: the one policy every reader uses (``Consumer.fetch``, so ``metaq
consume``, and the Spark source's tasks).

A fetch goes to the broker's data port where it registered one (``dataconn``: persistent TCP, ``sendfile``
on the broker, ``recv_into`` here; with ``conn``'s TLS and SASL session), else as gRPC ``FetchRaw``. A data
port that fails (the broker stopping, a port the client cannot reach) is given up for the rest of this
fetcher's life after one attempt, and the fetch goes on over gRPC; one that refuses the client's
certificate or session raises AuthenticationError instead. While the broker is down or restarting the
fetch is sent again until ``timeout_s`` from when the caller started waiting for it; then, or on any other
refusal, the error names the topic, the partition, the offset and the broker. In a replicated group the
member that answered may no longer be master (``not master:``, or it is down): ``reroute`` then gives the
member to try next (the consumer: the group's master now; a Spark task: the next member it was planned
with). One fetch may be in flight while the caller decodes the previous reply (``send`` now, ``receive``
later)."""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import grpc

from metaq_broker.client.connection import BrokerConnection
from metaq_broker.client.dataconn import DataConnection, DataConnectionPool
from metaq_broker.errors import NotMasterError
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.protocol import rawfetch
from metaq_broker.protocol.dataport import ProtocolError
from metaq_broker.protocol.status import BrokerError, BrokerUnavailableError, to_error

log = logging.getLogger(__name__)

RESEND = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}  # the broker is down or restarting
Route = Callable[[], Optional[tuple]]  # () -> (BrokerConnection, data port address or None) to try next, or None


class PartitionFetcher:
    """Fetches of one partition from one broker. ``conn`` is the broker's gRPC connection; ``data_pool`` and
    ``data_address`` its data port (None: gRPC only)."""

    def __init__(self, conn: BrokerConnection, topic: str, partition: str, number: int, timeout_s: float,
                 max_bytes: int, data_pool: Optional[DataConnectionPool] = None, data_address: Optional[str] = None,
                 timeout_setting: str = "", reroute: Optional[Route] = None, wait_for_master: bool = True):
        self.topic, self.partition, self.number = topic, partition, number
        self.timeout_s, self.max_bytes = timeout_s, max_bytes
        self.timeout_setting = timeout_setting  # the user's name for timeout_s in errors (in ms), e.g. fetchTimeoutMs
        self._data_pool = data_pool
        self._reroute = reroute
        self.wait_for_master = wait_for_master  # False: ``not master:`` is final (a static list: nowhere to look)
        self._data: Optional[DataConnection] = None
        self._use(conn, data_address)

    def _use(self, conn: BrokerConnection, data_address: Optional[str]) -> None:
        self.conn = conn
        # The broker's security and SASL session go with its data port too (a worker's pool serves every query).
        self._data = self._data_pool.acquire(data_address, session=conn.session_token, security=conn.security) \
            if self._data_pool and data_address else None

    def _follow(self) -> None:
        """The member called refused or is unreachable: go on with the one ``reroute`` names, if another."""
        found = self._reroute() if self._reroute is not None else None
        if found is None:
            return
        conn, data_address = found
        if conn is not self.conn:
            log.info("%s %s: fetching from %s instead of %s", self.topic, self.partition, conn.address,
                     self.conn.address)
            self.close()
            self._use(conn, data_address)

    # -- fetching -------------------------------------------------------------------------------------
    def send(self, offset: int, max_messages: int = 0, max_wait_ms: int = 0):
        """Start the fetch of whole batches from ``offset`` on; ``receive`` takes its reply."""
        request = pb.FetchRequest(topic=self.topic, partition=self.number, offset=offset, max_bytes=self.max_bytes,
                                  max_messages=max_messages, max_wait_ms=max_wait_ms)
        if self._data is not None:
            try:
                self._data.send(self.topic, self.number, offset, self.max_bytes, max_messages, max_wait_ms,
                                timeout=self.timeout_s + max_wait_ms / 1000)
                return request, None
            except OSError as e:
                self._drop_data_port(e)
        return request, self._grpc(request)

    def receive(self, pending) -> rawfetch.FetchReply:
        """The reply of a ``send``, resending over gRPC while the broker is down or restarting (up to
        ``timeout_s`` from now); BrokerError naming the partition and the offset otherwise."""
        request, future = pending
        deadline = time.monotonic() + self.timeout_s + request.max_wait_ms / 1000
        if future is None:
            try:
                return self._data.receive(timeout=self.timeout_s + request.max_wait_ms / 1000)
            except BrokerError as e:  # refused: the same statuses as gRPC
                if e.code not in RESEND:
                    raise self._named(e, request) from None
                self._drop_data_port(e)
                self._follow()
            except (OSError, ProtocolError) as e:  # the connection broke: the broker is stopping
                self._drop_data_port(e)
                self._follow()
            future = self._grpc(request, deadline)
        while True:
            try:
                return future.result()
            except grpc.RpcError as e:
                left = deadline - time.monotonic()
                moved = e.code() == grpc.StatusCode.CANCELLED and self.conn.retired  # its group's master moved
                error = to_error(e, self.conn.address)
                if (e.code() not in RESEND and not moved) or left <= 0 or (
                        isinstance(error, NotMasterError) and not self.wait_for_master):
                    late = "" if e.code() not in RESEND or left > 0 else \
                        f" (still failing after {self.timeout_setting}={round(self.timeout_s * 1000)})" \
                        if self.timeout_setting else f" (still failing after {self.timeout_s:g}s)"
                    raise self._named(error, request, late) from None
            time.sleep(min(0.05, left))
            self._follow()
            future = self._grpc(request, deadline)

    def fetch(self, offset: int, max_messages: int = 0, max_wait_ms: int = 0) -> rawfetch.FetchReply:
        return self.receive(self.send(offset, max_messages, max_wait_ms))

    identity = ""  # the partition log's identity at the last ``offsets()`` ("" from a broker predating them)

    def offsets(self) -> tuple:
        """(earliest, latest, log end) of the partition now: latest is the last stable offset, where
        readers stop; the log end is past it while a transaction is open. Sets ``identity``."""
        request = pb.GetOffsetsRequest(queries=[pb.OffsetQuery(topic=self.topic, partition=self.number)])
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                r = self.conn.call("GetOffsets", request, retries=0 if self._reroute else 5,
                                   wait_for_ready=self._reroute is None).offsets[0]
                self.identity = r.partition_id
                return r.earliest, r.latest, r.log_end_offset
            except BrokerError as e:  # not master (any more), down: its group's master may be elsewhere
                moved = isinstance(e, BrokerUnavailableError) or self.conn.retired
                if self._reroute is None or not moved or time.monotonic() > deadline:
                    raise
            time.sleep(0.05)
            self._follow()

    def close(self) -> None:
        if self._data is not None:
            self._data_pool.release(self._data)  # closed instead when a reply is still pending
            self._data = None

    def __enter__(self) -> "PartitionFetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------------
    def _grpc(self, request, deadline: Optional[float] = None):
        wait = request.max_wait_ms / 1000
        timeout = self.timeout_s + wait if deadline is None else max(deadline - time.monotonic(), 0.001)
        return self.conn.future("FetchRaw", request, timeout=timeout, wait_for_ready=self._reroute is None)

    def _drop_data_port(self, reason) -> None:
        if self._data is not None:
            log.info("%s %s: data port %s failed (%s); fetching with FetchRaw", self.topic, self.partition,
                     self._data.address, reason)
            self._data.close()
            self._data = None

    def _named(self, error: BrokerError, request, late: str = "") -> BrokerError:
        return type(error)(error.code, f"{self.topic} {self.partition} at offset {request.offset}: "
                                       f"{error.details}{late}", self.conn.address)
