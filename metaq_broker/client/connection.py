"""gRPC connections to brokers, with TLS and SASL sessions as ``ClientSecurity`` says (docs/security.md),
and the mapping from gRPC status codes back to metaq errors."""
from __future__ import annotations

import collections
import socket
import ssl
import threading
import time
from typing import Optional

import grpc

from metaq_broker.errors import AuthenticationError
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.proto import metaq_pb2_grpc as pb_grpc
from metaq_broker.protocol import rawfetch, rawput, sasl
from metaq_broker.protocol.services import AUTH_PATH, SESSION_METADATA
from metaq_broker.protocol.status import BrokerUnavailableError, RemoteAuthenticationError, to_error
from metaq_broker.security import scram, tls
from metaq_broker.security.settings import ClientSecurity

PROBE_TIMEOUT = 5.0

# A restarted broker is reconnected to within a second, as in Kafka (reconnect.backoff.max.ms), not after
# gRPC's default backoff of up to two minutes.
GRPC_OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20),
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]

# Safe to resend: the call was refused or timed out before the broker did anything with it.
TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                     "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class _SessionMetadata(grpc.UnaryUnaryClientInterceptor):
    """Adds the SASL session token to every call (``metaq-session``)."""

    def __init__(self, conn: "BrokerConnection"):
        self._conn = conn

    def intercept_unary_unary(self, continuation, details, request):
        metadata = list(details.metadata or ()) + [(SESSION_METADATA, self._conn.session_token())]
        return continuation(_Details(details.method, details.timeout, metadata, details.credentials,
                                     details.wait_for_ready, details.compression), request)


def probe_tls(address: str, security: ClientSecurity, timeout: float = PROBE_TIMEOUT) -> None:
    """One TLS handshake with the broker, to fail at once, in words, where gRPC would only retry: an
    untrusted, expired or wrong-host certificate, a plaintext port, a client certificate required. A
    broker that is down is no error here (calls wait for it as without TLS)."""
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except OSError:
        return
    ctx = tls.client_context(security)
    ctx.set_alpn_protocols(["h2"])
    try:
        with ctx.wrap_socket(sock, server_hostname=host) as s:
            # With TLS 1.3 a refused client certificate shows only after the handshake: gRPC then closes
            # the connection instead of sending its first HTTP/2 frame.
            s.settimeout(1.0)
            try:
                closed = s.recv(1) == b""
            except (socket.timeout, BlockingIOError, ssl.SSLWantReadError):
                closed = False
            if closed:
                raise AuthenticationError(
                    f"TLS handshake with {address} failed: " + (
                        "it refused our client certificate (not signed by a CA it trusts?)"
                        if security.certificate_location else
                        "it requires a client certificate (ssl.certificate.location, ssl.key.location)"))
    except ssl.SSLError as e:
        raise AuthenticationError(tls.explain(e, address)) from None
    except OSError:
        pass
    finally:
        sock.close()


def speaks_tls(address: str, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether ``address`` answers a TLS handshake: why a PLAINTEXT client's calls find no broker there."""
    host, _, port = address.rpartition(":")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock, ctx.wrap_socket(sock):
            return True
    except ssl.SSLError as e:  # a broker that wants a client certificate refuses with an alert: still TLS
        return "alert" in str(e).lower()
    except OSError:
        return False


def _session_error(e: BaseException) -> bool:
    """The broker does not (or no longer) accept this connection's session: renew it once."""
    return isinstance(e, RemoteAuthenticationError) and str(e.details).startswith(("unknown session",
                                                                                  "session expired", "session of"))


class BrokerConnection:
    """One channel to one broker. Calls wait for the channel to be ready (up to ``timeout``), so a
    broker that is restarting delays a call instead of failing it, and nothing is sent twice. With TLS the
    broker's certificate is checked once up front (``probe_tls``); with SASL the first call authenticates
    and later calls carry the session token, renewed at half its lifetime."""

    def __init__(self, address: str, timeout: float = 30.0, security: Optional[ClientSecurity] = None):
        self.address = address
        self.timeout = timeout
        self.security = security or ClientSecurity()
        self._session: Optional[str] = None
        self._renew_at = 0.0
        self._session_lock = threading.Lock()
        self.closed = False
        self.retired = False  # closed because its broker group's master moved elsewhere (ConnectionPool.retire)
        self.channel = self._auth_channel = self._open_channel()
        if self.security.uses_sasl:
            self.channel = grpc.intercept_channel(self._auth_channel, _SessionMetadata(self))
        self.stub = pb_grpc.BrokerStub(self.channel)
        # Not in metaq.proto: the reply is a struct header and the record bytes, handed over as a view.
        self.stub.FetchRaw = self.channel.unary_unary(
            rawfetch.PATH, request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=rawfetch.unpack, _registered_method=True)
        # Nor this: the request is a struct header and the batch body (rawput), bytes sent as they are.
        self.stub.PutRaw = self.channel.unary_unary(
            rawput.PATH, response_deserializer=pb.PutResponse.FromString, _registered_method=True)

    def _open_channel(self) -> grpc.Channel:
        sec = self.security
        if not sec.uses_tls:
            return grpc.insecure_channel(self.address, options=GRPC_OPTIONS)
        probe_tls(self.address, sec)
        return grpc.secure_channel(self.address, grpc.ssl_channel_credentials(*sec.pem_files()), options=GRPC_OPTIONS)

    def session_token(self, renew: bool = False) -> Optional[str]:
        """The SASL session with this broker (None without SASL): authenticates when there is none, when
        ``renew`` (the broker refused the last one) or at half its lifetime."""
        if not self.security.uses_sasl:
            return None
        with self._session_lock:
            if renew or self._session is None or time.monotonic() >= self._renew_at:
                self._session, lifetime = self._authenticate()
                self._renew_at = time.monotonic() + lifetime / 2
            return self._session

    def _authenticate(self) -> tuple:
        sec = self.security
        return sasl.authenticate(self._auth_channel.unary_unary(AUTH_PATH), sec.sasl_mechanism, sec.sasl_username,
                                 sec.sasl_password, self.timeout, self.address, scram.ScramClient)

    def call(self, method: str, request, timeout: Optional[float] = None, retries: int = 0,
             wait_for_ready: bool = True):
        """Call ``method`` (a Broker RPC's name, or a full path ``/service/method`` taking and giving bytes);
        ``retries`` > 0 resends on transient errors (only for idempotent calls). A
        session the broker no longer knows (it restarted with a new key, the session expired) is renewed
        once and the call sent again: it was refused before the broker did anything."""
        timeout = self.timeout if timeout is None else timeout
        delay = 0.05
        renewed = False
        attempt = 0
        while True:
            try:
                stub = self.channel.unary_unary(method) if method.startswith("/") else getattr(self.stub, method)
                return stub(request, timeout=timeout, wait_for_ready=wait_for_ready)
            except ValueError:
                if not self.closed:
                    raise
                raise self._closed_error() from None
            except grpc.RpcError as e:
                error = to_error(e, self.address)
                if _session_error(error) and not renewed:
                    renewed = True
                    self.session_token(renew=True)
                    continue
                if attempt == retries or e.code() not in TRANSIENT or e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    if e.code() in TRANSIENT and not self.security.uses_tls and speaks_tls(self.address):
                        raise AuthenticationError(f"broker {self.address} speaks TLS; set security.protocol to SSL "
                                                  f"or SASL_SSL (and ssl.ca.location)") from None
                    raise error from None
            attempt += 1
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def future(self, method: str, request, timeout: Optional[float] = None, wait_for_ready: bool = True):
        """``wait_for_ready=False``: fail at once (UNAVAILABLE) while the broker cannot be reached, for a
        caller that has somewhere else to try."""
        try:
            return getattr(self.stub, method).future(request, timeout=self.timeout if timeout is None else timeout,
                                                     wait_for_ready=wait_for_ready)
        except ValueError:
            if not self.closed:
                raise
            raise self._closed_error() from None

    def _closed_error(self) -> BrokerUnavailableError:
        """A call begun on a connection another thread closed meanwhile (gRPC raises a bare ValueError): for
        a retired one (``MasterMovedError``), ``ClientBase.call`` and a put send it to the new master; it
        did nothing."""
        if self.retired:
            return MasterMovedError(grpc.StatusCode.CANCELLED, "connection closed: the group's master moved "
                                    "elsewhere", self.address)
        return BrokerUnavailableError(grpc.StatusCode.CANCELLED, "connection closed: the client is closing",
                                      self.address)

    def close(self) -> None:
        self.closed = True
        self.channel.close()


class MasterMovedError(BrokerUnavailableError):
    """A call not sent: the connection to its broker group's master was retired as it began (the master
    moved elsewhere, ``ConnectionPool.retire``); sent to the new master, it is sent once."""


class ConnectionPool:
    """Connections by address, shared by a client's threads."""

    def __init__(self, timeout: float = 30.0, security: Optional[ClientSecurity] = None):
        self.timeout = timeout
        self.security = security or ClientSecurity()
        self._conns: dict = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> BrokerConnection:
        with self._lock:
            conn = self._conns.get(address)
            if conn is None:
                conn = self._conns[address] = BrokerConnection(address, self.timeout, self.security)
            return conn

    def close(self) -> None:
        with self._lock:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()

    def retire(self, address: str) -> None:
        """Close the connection to ``address`` (a group master that moved elsewhere): calls waiting on it
        end at once (CANCELLED) instead of waiting for a dead address until their timeout, and
        ``ClientBase.call`` sends them to the new master."""
        with self._lock:
            conn = self._conns.pop(address, None)
        if conn is not None:
            conn.retired = True
            conn.close()
