"""gRPC connections to brokers, and the mapping from gRPC status codes back to metaq errors."""
from __future__ import annotations

import threading
import time
from typing import Optional

import grpc

from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.proto import metaq_pb2_grpc as pb_grpc
from metaq_broker.protocol import rawfetch, rawput
from metaq_broker.protocol.status import to_error

# A restarted broker is reconnected to within a second, as in Kafka (reconnect.backoff.max.ms), not after
# gRPC's default backoff of up to two minutes.
GRPC_OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20),
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]

# Safe to resend: the call was refused or timed out before the broker did anything with it.
TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}


class BrokerConnection:
    """One channel to one broker. Calls wait for the channel to be ready (up to ``timeout``), so a
    broker that is restarting delays a call instead of failing it, and nothing is sent twice."""

    def __init__(self, address: str, timeout: float = 30.0):
        self.address = address
        self.timeout = timeout
        self.channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self.stub = pb_grpc.BrokerStub(self.channel)
        # Not in metaq.proto: the reply is a struct header and the record bytes, handed over as a view.
        self.stub.FetchRaw = self.channel.unary_unary(
            rawfetch.PATH, request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=rawfetch.unpack, _registered_method=True)
        # Nor this: the request is a struct header and the batch body (rawput), bytes sent as they are.
        self.stub.PutRaw = self.channel.unary_unary(
            rawput.PATH, response_deserializer=pb.PutResponse.FromString, _registered_method=True)

    def call(self, method: str, request, timeout: Optional[float] = None, retries: int = 0):
        """Call ``method``; ``retries`` > 0 resends on transient errors (only for idempotent calls)."""
        timeout = self.timeout if timeout is None else timeout
        delay = 0.05
        for attempt in range(retries + 1):
            try:
                return getattr(self.stub, method)(request, timeout=timeout, wait_for_ready=True)
            except grpc.RpcError as e:
                if attempt == retries or e.code() not in TRANSIENT or e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise to_error(e, self.address) from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def future(self, method: str, request, timeout: Optional[float] = None):
        return getattr(self.stub, method).future(request, timeout=self.timeout if timeout is None else timeout,
                                                 wait_for_ready=True)

    def close(self) -> None:
        self.channel.close()


class ConnectionPool:
    """Connections by address, shared by a client's threads."""

    def __init__(self, timeout: float = 30.0):
        self.timeout = timeout
        self._conns: dict = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> BrokerConnection:
        with self._lock:
            conn = self._conns.get(address)
            if conn is None:
                conn = self._conns[address] = BrokerConnection(address, self.timeout)
            return conn

    def close(self) -> None:
        with self._lock:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()
