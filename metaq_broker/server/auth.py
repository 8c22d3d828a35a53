"""Who is calling, and may they: the broker's side of docs/security.md.

A principal comes from the client certificate (mutual TLS), from a SASL exchange, or is ``User:ANONYMOUS``.
SASL runs once per client and broker over the gRPC service ``metaq.v1.Auth`` (PLAIN, or SCRAM-SHA-256 in
two rounds; messages as JSON) and ends with a session token that later gRPC calls carry as metadata
``metaq-session`` and the data port's AUTH frame carries once per connection. A token is the principal,
the user's credential salt and an expiry, signed with HMAC-SHA256 by a key kept in the data directory: the
broker keeps no table of sessions (nothing for a flood to fill), tokens outlive a broker restart, and a
changed or removed user's tokens stop working at once (the salt no longer matches).

Credential checks (PBKDF2) run ``AUTH_CONCURRENCY`` at a time; a login that waits longer than
``AUTH_QUEUE_WAIT_S`` is refused as "busy" (UNAUTHENTICATED, clients back off and retry), so a flood of bad
passwords cannot take every gRPC worker from authenticated clients. An unknown user is checked against a
made-up credential (``scram.fake_credential``: the cluster's salt key, the users' usual iteration count),
so that PLAIN and SCRAM cost and show the same for it as for a known user with a wrong password.

Sessions end as soon as their user is changed or removed: gRPC checks the token on every call, and
``watch_sessions`` tells the data port, whose connections authenticate once, which user changed.

``gate`` runs before gRPC reads a call's request: without a valid session (SASL_SSL) or a client
certificate that names a principal (mutual TLS), and for a put by a principal that may write nowhere,
the call is refused before its message is received, so an unauthenticated caller cannot make the broker
hold requests of up to its receive limit."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import grpc

from metaq_broker.errors import AuthenticationError, AuthorizationError, ConfigError
from metaq_broker.protocol import rawput
from metaq_broker.protocol.services import AUTH_PATH, SESSION_METADATA
from metaq_broker.protocol.status import code_of
from metaq_broker.security import certificates, scram, tls
from metaq_broker.security.acl import CLUSTER, AclTable
from metaq_broker.security.settings import BrokerSecurity

log = logging.getLogger(__name__)

SESSION_LIFETIME_S = 3600.0  # clients renew at half-life (client/connection.py)
AUTH_CONCURRENCY = 2
AUTH_QUEUE_WAIT_S = 0.5
HANDSHAKE_TTL_S = 30.0
MAX_HANDSHAKES = 10_000  # SCRAM exchanges between their two rounds; the oldest go first
KEY_FILE = "session.key"

__all__ = ["BrokerAuth", "CLUSTER"]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def session_key(directory: Path) -> bytes:
    """The key that signs session tokens: made at the first start, kept (0600) in the data directory."""
    path = Path(directory) / KEY_FILE
    try:
        key = path.read_bytes()
        if len(key) == 32:
            return key
    except FileNotFoundError:
        pass
    key = secrets.token_bytes(32)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return key


class Session(NamedTuple):
    """What a valid session token says."""
    principal: str
    user: str
    expires: float  # seconds since the epoch (the broker's clock)


# gRPC methods served before any login (the login itself, health checks)
_OPEN_PATHS = (AUTH_PATH, "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")
_PUT_PATHS = ("/metaq.v1.Broker/Put", rawput.PATH)


class BrokerAuth:
    """Authentication and authorization of one broker. ``users`` looks up a SCRAM credential by user name
    (None: unknown); ``fake_key`` (the cluster's ``zk.users.scram_secret``) and ``iterations()`` (the users'
    usual count) make up unknown users' credentials; ``acls`` is set by ``set_acls`` from ZooKeeper
    (zk/acls.py's cache)."""

    def __init__(self, security: BrokerSecurity, data_path, users: Optional[Callable] = None,
                 clock: Callable[[], float] = time.time, fake_key: bytes = b"",
                 iterations: Callable[[], int] = lambda: scram.DEFAULT_ITERATIONS):
        if security.uses_sasl and users is None:
            raise ConfigError("security.protocol SASL_SSL needs ZooKeeper (zk.connect), where users are kept")
        self.security = security
        self._users = users
        self._clock = clock
        self._key = session_key(data_path) if security.uses_sasl else b""
        self._table = AclTable(super_users=security.super_users)
        self._checks = threading.BoundedSemaphore(AUTH_CONCURRENCY)
        self._handshakes: dict = {}  # id -> (ScramServer, started)
        self._lock = threading.Lock()
        self._fake_key = fake_key or secrets.token_bytes(32)
        self._iterations = iterations
        self._session_watchers: list = []  # called with a user's name when its sessions may have ended
        self.denied = Counter()  # (operation, resource_type) -> denials, for the metrics
        self.failures = Counter()  # mechanism -> failed authentications, for the metrics
        self._ssl_context = None

    # -- who ------------------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.security.protocol != "PLAINTEXT" or self.security.authorizer != "none"

    def data_port_context(self):
        """The data port's ``ssl.SSLContext``, or None for PLAINTEXT."""
        if self.security.uses_tls and self._ssl_context is None:
            self._ssl_context = tls.server_context(self.security)
        return self._ssl_context

    def grpc_principal(self, context) -> str:
        """The principal of a gRPC call: its session token with SASL, its client certificate with mutual TLS,
        ANONYMOUS otherwise. Raises AuthenticationError."""
        if self.security.uses_sasl:
            for key, value in context.invocation_metadata():
                if key == SESSION_METADATA:
                    return self.principal_of_token(value)
            raise AuthenticationError("authenticate first: this broker takes SASL_SSL clients only "
                                      "(security.protocol=SASL_SSL, sasl.username, sasl.password)")
        if self.security.client_auth == "required":
            return self.principal_of_certificate(certificates.peer_certificate(context.auth_context()))
        return tls.ANONYMOUS

    def principal_of_certificate(self, cert: Optional[bytes]) -> str:
        """A verified client certificate's principal (``ssl.principal.mapping.rules``), the same on every port."""
        return certificates.principal_of_certificate(cert, self.security.principal_rules)

    def principal_of_token(self, token: str) -> str:
        return self.session(token).principal

    def session(self, token: str) -> Session:
        """The session a token names, if it still holds; AuthenticationError saying why not."""
        try:
            payload, signature = token.split(".")
            ok = hmac.compare_digest(_unb64(signature), hmac.new(self._key, payload.encode(), hashlib.sha256).digest())
            claims = json.loads(_unb64(payload)) if ok else None
        except (ValueError, UnicodeError):
            claims = None
        if not claims:
            raise AuthenticationError("unknown session: authenticate again (the broker's session key changed?)")
        if claims["exp"] < self._clock():
            raise AuthenticationError("session expired: authenticate again")
        cred = self._users(claims["u"])
        if cred is None or _b64(cred.salt) != claims["s"]:
            raise AuthenticationError(f"session of {claims['p']} ended: the user was removed or its password changed")
        return Session(claims["p"], claims["u"], claims["exp"])

    def watch_sessions(self, callback: Callable[[str], None]) -> None:
        """``callback(user)`` whenever that user was changed or removed: its sessions may have ended."""
        self._session_watchers.append(callback)

    def user_changed(self, user: str) -> None:
        """The user cache's event (zk/users.py ``UserCache.listen``)."""
        for callback in self._session_watchers:
            callback(user)

    def now(self) -> float:
        return self._clock()

    def _token(self, user: str, cred: scram.Credential) -> tuple:
        exp = self._clock() + SESSION_LIFETIME_S
        payload = _b64(json.dumps({"p": f"User:{user}", "u": user, "s": _b64(cred.salt), "exp": exp}).encode())
        return payload + "." + _b64(hmac.new(self._key, payload.encode(), hashlib.sha256).digest()), SESSION_LIFETIME_S

    # -- SASL (served over gRPC by service.py, as metaq.v1.Auth) ---------------------------------------
    def authenticate(self, m: dict) -> dict:
        """One step of a SASL exchange: ``{"mechanism", "message"[, "handshake"]}`` -> ``{"message"[,
        "handshake"]}`` or, at the end, ``{"message", "session", "lifetime_s", "principal"}``."""
        mechanism = m["mechanism"]
        if not self.security.uses_sasl:
            raise AuthenticationError(f"this broker does not take SASL (security.protocol={self.security.protocol})")
        if mechanism not in self.security.mechanisms:
            raise AuthenticationError(f"SASL mechanism {mechanism} is not enabled on this broker "
                                      f"(sasl.enabled.mechanisms: {', '.join(self.security.mechanisms)})")
        if not self._checks.acquire(timeout=AUTH_QUEUE_WAIT_S):
            raise AuthenticationError("the broker is busy authenticating others; try again")
        try:
            return self._step(mechanism, m)
        except AuthenticationError:
            self.failures[mechanism] += 1
            raise
        finally:
            self._checks.release()

    def _fake(self, user: str) -> scram.Credential:
        return scram.fake_credential(self._fake_key, user, self._iterations())

    def _step(self, mechanism: str, m: dict) -> dict:
        message = str(m["message"])
        if mechanism == "PLAIN":
            _authzid, user, password = message.split("\0", 2)
            cred = self._users(user)
            checked = (cred or self._fake(user)).check_password(password)  # the same PBKDF2 for an unknown user
            if cred is None or not checked:
                raise AuthenticationError("authentication failed: unknown user or wrong password (PLAIN)")
            return self._done(user, cred, "")
        handshake = m.get("handshake")
        if handshake is None:
            server = scram.ScramServer(self._users, self._fake)
            reply = server.first(message)
            handshake = secrets.token_urlsafe(16)
            with self._lock:
                self._expire_handshakes()
                self._handshakes[handshake] = (server, self._clock())
            return {"message": reply, "handshake": handshake}
        with self._lock:
            server, _ = self._handshakes.pop(str(handshake), (None, 0))
        if server is None:
            raise AuthenticationError("SCRAM exchange unknown or too slow; start again")
        final, user = server.final(message)
        return self._done(user, self._users(user), final)

    def _done(self, user: str, cred, message: str) -> dict:
        token, lifetime = self._token(user, cred)
        return {"message": message, "session": token, "lifetime_s": lifetime, "principal": f"User:{user}"}

    def _expire_handshakes(self) -> None:
        now = self._clock()
        for hid in [h for h, (_, t) in self._handshakes.items() if now - t > HANDSHAKE_TTL_S]:
            del self._handshakes[hid]
        while len(self._handshakes) >= MAX_HANDSHAKES:
            del self._handshakes[next(iter(self._handshakes))]

    # -- may they -------------------------------------------------------------------------------------
    def set_acls(self, acls) -> None:
        self._table = AclTable(acls, self.security.super_users)

    def allows(self, principal: str, operation: str, resource_type: str, name: str) -> bool:
        return self.security.authorizer == "none" or self._table.allows(principal, operation, resource_type, name)

    def authorize(self, principal: str, operation: str, resource_type: str, name: str) -> None:
        if not self.allows(principal, operation, resource_type, name):
            self.denied[(operation, resource_type)] += 1
            raise AuthorizationError(principal, operation, resource_type, name)

    def may_write_somewhere(self, principal: str) -> bool:
        """Whether some ACL lets ``principal`` write some topic: a put by anyone else is refused unread."""
        return self.security.authorizer == "none" or self._table.allows_some(principal, "Write", "topic")

    def authorize_write_somewhere(self, principal: str, why: str) -> None:
        """Refuse ``principal`` unless it may write some topic (``why`` says what needs it)."""
        if not self.may_write_somewhere(principal):
            self.denied[("Write", "topic")] += 1
            raise AuthorizationError(principal, "Write", "topic", "*",
                                     f"{principal} is not allowed Write on any topic ({why})")

    # -- before a gRPC call's request is read ---------------------------------------------------------
    def gate(self) -> grpc.ServerInterceptor:
        """The interceptor that refuses calls before their request message is received (see above)."""
        return _Gate(self)

    def admit(self, method: str, context) -> None:
        """Refuse (abort) a call that ``gate`` must not let read its request."""
        try:
            principal = self.grpc_principal(context)
        except AuthenticationError as e:
            context.abort(code_of(e), str(e))
        if method in _PUT_PATHS and not self.may_write_somewhere(principal):
            self.denied[("Write", "topic")] += 1
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{principal} is not allowed Write on any topic")

    def authorize_any(self, principal: str, operation: str, resources: list) -> None:
        """Allowed if any of ``[(resource_type, name)]`` allows it (Create on the cluster or on the topic)."""
        if not any(self.allows(principal, operation, t, n) for t, n in resources):
            self.authorize(principal, operation, *resources[-1])


class _Gate(grpc.ServerInterceptor):
    """Serves each unary call through a stream-request handler, which gRPC runs before it receives the
    request: ``BrokerAuth.admit`` first, then the message is read and the method's own handler called."""

    def __init__(self, auth: BrokerAuth):
        self.auth = auth

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.unary_unary is None or method in _OPEN_PATHS or not self.auth.enabled:
            return handler
        unary, auth = handler.unary_unary, self.auth

        def admitted(requests, context):
            auth.admit(method, context)
            request = next(requests, None)
            if request is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
            return unary(request, context)
        return grpc.stream_unary_rpc_method_handler(admitted, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)
