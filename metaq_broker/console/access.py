"""Who may use the console (docs/console.md, "Access"): requests must name a Host the console serves
(loopback names, the address it listens on, ``--allowed-hosts``), which defeats DNS rebinding; with a
SASL_SSL cluster each person logs in (as a SASL user of the cluster: the console then acts as them, and the
brokers' ACLs decide what they see) and holds a session cookie (HttpOnly, SameSite=Strict, Secure under
TLS); and a request that changes something (log in, log out) carries a token the page was given with
it, besides the cookie. No I/O here: the HTTP server (server.py) asks."""
from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlsplit

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
SESSION_COOKIE, CSRF_COOKIE = "metaq_session", "metaq_login_csrf"
IDLE_S = 30 * 60  # a session nobody used for this long ends
MAX_AGE_S = 12 * 3600  # and every session ends after this, used or not
MAX_SESSIONS = 64  # the oldest goes when a new one would pass this
FAILED_LOGINS_PER_MINUTE = 10  # per remote address; more are refused until the minute has passed


def host_of(header: Optional[str]) -> Optional[str]:
    """The host name of a ``Host`` header (``example.com:8480``, ``[::1]:8480``), lower case; None when
    missing or malformed."""
    if not header or any(c in header for c in "/@ \t\\"):
        return None
    parsed = urlsplit("//" + header.strip())
    try:
        parsed.port  # noqa: B018 - raises ValueError for a port that is no number
    except ValueError:
        return None
    host = (parsed.hostname or "").rstrip(".")
    return host or None


class HostCheck:
    """The host names the console answers for: loopback, the address it listens on (unless every
    interface), and ``extra`` (``--allowed-hosts``)."""

    def __init__(self, listen_host: str, extra=()):
        self.allowed = {*LOOPBACK_HOSTS, *(h.strip().lower().rstrip(".") for h in extra if h.strip())}
        if listen_host not in ("", "0.0.0.0", "::"):
            self.allowed.add(listen_host.lower().strip("[]"))

    def allows(self, header: Optional[str]) -> bool:
        return host_of(header) in self.allowed

    def same_origin(self, origin: str) -> bool:
        """An ``Origin`` header names one of these hosts (cross-site requests name the attacker's)."""
        return self.allows(urlsplit(origin).netloc) if origin and origin != "null" else False


@dataclass
class Session:
    token: str
    user: str
    csrf: str  # the page sends it with every request that changes something
    created: float
    seen: float = field(default=0.0)


class Sessions:
    """Logged-in sessions by cookie token, in memory (a restarted console asks everyone to log in again).
    ``on_last(user)`` is called when a user's last session ends, to close the clients acting as them."""

    def __init__(self, on_last: Callable[[str], None] = lambda user: None, clock=time.monotonic):
        self._on_last, self._clock = on_last, clock
        self._by_token: dict = {}
        self._lock = threading.Lock()

    def create(self, user: str) -> Session:
        now = self._clock()
        s = Session(secrets.token_urlsafe(32), user, secrets.token_urlsafe(24), now, now)
        evicted = []
        with self._lock:
            self._by_token[s.token] = s
            while len(self._by_token) > MAX_SESSIONS:
                evicted.append(self._by_token.pop(next(iter(self._by_token))).user)  # the oldest
        self._ended(evicted)
        return s

    def get(self, token: Optional[str]) -> Optional[Session]:
        """The live session of ``token`` (its idle time starts again), or None."""
        self._ended()
        with self._lock:
            s = self._by_token.get(token or "")
            if s is not None:
                s.seen = self._clock()
            return s

    def end(self, token: Optional[str]) -> None:
        with self._lock:
            s = self._by_token.pop(token or "", None)
        self._ended([s.user] if s else [])

    def end_user(self, user: str) -> None:
        """Every session of ``user`` (their password changed, or they were removed)."""
        with self._lock:
            for token in [t for t, s in self._by_token.items() if s.user == user]:
                del self._by_token[token]
        self._ended([user])

    def users(self) -> set:
        with self._lock:
            return {s.user for s in self._by_token.values()}

    def _ended(self, dropped=()) -> None:
        """Drop expired sessions; tell ``on_last`` of the users (of those and of ``dropped``) left with none."""
        now = self._clock()
        with self._lock:
            expired = [t for t, s in self._by_token.items() if now - s.seen > IDLE_S or now - s.created > MAX_AGE_S]
            ended = set(dropped) | {self._by_token.pop(t).user for t in expired}
            left = {s.user for s in self._by_token.values()}
        for user in sorted(ended - left):
            self._on_last(user)


class LoginLimiter:
    """Failed logins per remote address over the last minute (the brokers limit the password checks
    themselves; this keeps one address from guessing at their pace)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._failures: dict = collections.defaultdict(collections.deque)
        self._lock = threading.Lock()

    def _recent(self, address: str) -> collections.deque:
        q = self._failures[address]
        while q and self._clock() - q[0] > 60:
            q.popleft()
        return q

    def blocked(self, address: str) -> bool:
        with self._lock:
            return len(self._recent(address)) >= FAILED_LOGINS_PER_MINUTE

    def failed(self, address: str) -> None:
        with self._lock:
            self._recent(address).append(self._clock())
            if len(self._failures) > 10_000:  # addresses that stopped trying
                for a in [a for a, q in self._failures.items() if not q]:
                    del self._failures[a]


class FormTokens:
    """The login form's token (double submit: as a cookie and in the form), signed by a key of this
    console's run, so that only tokens it issued count: a form posted from another site has no cookie,
    and a token made up by anyone else is refused."""

    def __init__(self):
        self._key = secrets.token_bytes(32)

    def _sign(self, nonce: str) -> str:
        return hmac.new(self._key, nonce.encode(), hashlib.sha256).hexdigest()

    def issue(self) -> str:
        nonce = secrets.token_urlsafe(18)
        return f"{nonce}.{self._sign(nonce)}"

    def valid(self, token: Optional[str]) -> bool:
        nonce, _, signature = (token or "").partition(".")
        return bool(nonce) and hmac.compare_digest(signature.encode(), self._sign(nonce).encode())


def tokens_match(given: Optional[str], expected: Optional[str]) -> bool:
    return bool(given) and bool(expected) and hmac.compare_digest(given.encode(), expected.encode())


def cookie(name: str, value: str, secure: bool, path: str = "/", max_age: Optional[int] = None) -> str:
    """A ``Set-Cookie`` value: HttpOnly and SameSite=Strict always, Secure under TLS."""
    parts = [f"{name}={value}", f"Path={path}", "HttpOnly", "SameSite=Strict"]
    if max_age is not None:
        parts.append(f"Max-Age={max_age}")
    if secure:
        parts.append("Secure")
    return "; ".join(parts)
