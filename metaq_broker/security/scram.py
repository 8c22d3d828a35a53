"""SCRAM-SHA-256 (RFC 5802, RFC 7677) as Kafka keeps it: a user is stored as a salted credential (salt,
StoredKey, ServerKey, iterations), never the password. The broker checks a SCRAM exchange, or a PLAIN
password, against it; the client checks the broker's signature in turn, so a broker that does not hold
the credential cannot pass for one that does."""
from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Callable, Optional

from metaq_broker.errors import AuthenticationError

MECHANISM = "SCRAM-SHA-256"
DEFAULT_ITERATIONS = 4096  # Kafka's default and RFC 7677's example
MIN_ITERATIONS = 4096
# Kafka's bound too: a client runs PBKDF2 with the count the broker names before it can check the broker's
# signature, so a rogue broker (or a man in the middle before TLS is checked) naming 2**31 would spin it.
MAX_ITERATIONS = 16384


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise AuthenticationError("malformed SCRAM message (bad base64)") from None


def _hmac(key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hashlib.sha256).digest()


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).to_bytes(len(a), "big")


def salted_password(password: str, salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations)


@dataclass(frozen=True)
class Credential:
    salt: bytes
    stored_key: bytes
    server_key: bytes
    iterations: int

    @classmethod
    def make(cls, password: str, iterations: int = DEFAULT_ITERATIONS, salt: Optional[bytes] = None) -> "Credential":
        if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
            raise ValueError(f"SCRAM iterations must be from {MIN_ITERATIONS} to {MAX_ITERATIONS} (clients refuse "
                             f"more), got {iterations}")
        if not password:
            raise ValueError("the password must not be empty")
        salt = salt or secrets.token_bytes(16)
        salted = salted_password(password, salt, iterations)
        return cls(salt, hashlib.sha256(_hmac(salted, b"Client Key")).digest(), _hmac(salted, b"Server Key"),
                   iterations)

    def encode(self) -> str:
        """Kafka's form: ``salt=..,stored_key=..,server_key=..,iterations=N``."""
        return (f"salt={_b64(self.salt)},stored_key={_b64(self.stored_key)},server_key={_b64(self.server_key)},"
                f"iterations={self.iterations}")

    @classmethod
    def decode(cls, text: str) -> "Credential":
        fields = dict(item.split("=", 1) for item in text.split(","))
        return cls(base64.b64decode(fields["salt"]), base64.b64decode(fields["stored_key"]),
                   base64.b64decode(fields["server_key"]), int(fields["iterations"]))

    def check_password(self, password: str) -> bool:
        """PLAIN: does ``password`` derive this credential?"""
        salted = salted_password(password, self.salt, self.iterations)
        return hmac.compare_digest(hashlib.sha256(_hmac(salted, b"Client Key")).digest(), self.stored_key)


def _escape(name: str) -> str:
    return name.replace("=", "=3D").replace(",", "=2C")


def _unescape(name: str) -> str:
    return name.replace("=2C", ",").replace("=3D", "=")


def _attributes(message: str) -> dict:
    out = {}
    for item in message.split(","):
        key, sep, value = item.partition("=")
        if not sep or len(key) != 1:
            raise AuthenticationError("malformed SCRAM message")
        out[key] = value
    return out


FAILED = "authentication failed: unknown user or wrong password (SCRAM-SHA-256)"


def fake_credential(key: bytes, user: str, iterations: int = DEFAULT_ITERATIONS) -> Credential:
    """What an unknown user is checked against, so that it costs and shows what a known one does: a salt
    derived from ``key`` and the name (the same on every broker that shares ``key``, and after a restart),
    ``iterations`` as the real users have, and keys no password derives."""
    derived = _hmac(key, b"metaq-fake-user\0" + user.encode("utf-8", "surrogatepass"))
    return Credential(derived[:16], _hmac(key, derived), _hmac(derived, key), iterations)


class ScramServer:
    """One exchange on the broker: ``first(client-first) -> server-first``, then
    ``final(client-final) -> (server-final, username)``. An unknown user gets ``fake(user)`` (a stable
    made-up salt, the usual iteration count) and fails at the end, like a wrong password, so that names
    cannot be probed."""

    def __init__(self, lookup: Callable[[str], Optional[Credential]], fake: Callable[[str], Credential]):
        self._lookup = lookup
        self._fake = fake
        self._state = None

    def first(self, client_first: str) -> str:
        if not client_first.startswith("n,,"):
            raise AuthenticationError("SCRAM: channel binding and authzid are not supported (expected 'n,,')")
        bare = client_first[3:]
        attrs = _attributes(bare)
        if "n" not in attrs or "r" not in attrs or not attrs["r"]:
            raise AuthenticationError("malformed SCRAM client-first message")
        user = _unescape(attrs["n"])
        cred = self._lookup(user)
        fake = cred is None
        if fake:
            cred = self._fake(user)
        nonce = attrs["r"] + secrets.token_urlsafe(18)
        server_first = f"r={nonce},s={_b64(cred.salt)},i={cred.iterations}"
        self._state = (user, cred, fake, bare, server_first, nonce)
        return server_first

    def final(self, client_final: str) -> tuple:
        if self._state is None:
            raise AuthenticationError("SCRAM: client-final before client-first")
        user, cred, fake, bare, server_first, nonce = self._state
        self._state = None
        without_proof, sep, proof_part = client_final.rpartition(",p=")
        attrs = _attributes(without_proof) if sep else {}
        if not sep or attrs.get("r") != nonce or attrs.get("c") != "biws":
            raise AuthenticationError("malformed SCRAM client-final message (nonce or channel binding)")
        auth_message = f"{bare},{server_first},{without_proof}".encode("utf-8")
        proof = _unb64(proof_part)
        signature = _hmac(cred.stored_key, auth_message)
        if fake or len(proof) != 32 or not hmac.compare_digest(hashlib.sha256(_xor(proof, signature)).digest(),
                                                               cred.stored_key):
            raise AuthenticationError(FAILED)
        return f"v={_b64(_hmac(cred.server_key, auth_message))}", user


class ScramClient:
    """One exchange on the client: ``first()``, ``final(server-first)``, ``verify(server-final)``."""

    def __init__(self, username: str, password: str, nonce: Optional[str] = None):
        self.username, self._password = username, password
        self._nonce = nonce or secrets.token_urlsafe(18)
        self._bare = f"n={_escape(username)},r={self._nonce}"
        self._server_signature = None

    def first(self) -> str:
        return "n,," + self._bare

    def final(self, server_first: str) -> str:
        """The client-final message. Refuses, before any PBKDF2 work, a server nonce that does not extend
        this client's own (RFC 5802: the server appends its part; an echo would let a replayed exchange
        pass) and an iteration count outside MIN_ITERATIONS..MAX_ITERATIONS."""
        attrs = _attributes(server_first)
        nonce, count = attrs.get("r", ""), attrs.get("i", "")
        if not (nonce.startswith(self._nonce) and len(nonce) > len(self._nonce)):
            raise AuthenticationError("the broker's SCRAM reply is not valid: its nonce does not extend ours")
        if not (count.isascii() and count.isdigit() and MIN_ITERATIONS <= int(count) <= MAX_ITERATIONS):
            raise AuthenticationError(f"the broker's SCRAM reply is not valid: iteration count {count[:20]!r} is "
                                      f"not from {MIN_ITERATIONS} to {MAX_ITERATIONS}")
        salt, iterations = _unb64(attrs.get("s", "")), int(count)
        without_proof = f"c=biws,r={nonce}"
        auth_message = f"{self._bare},{server_first},{without_proof}".encode("utf-8")
        salted = salted_password(self._password, salt, iterations)
        client_key = _hmac(salted, b"Client Key")
        proof = _xor(client_key, _hmac(hashlib.sha256(client_key).digest(), auth_message))
        self._server_signature = _hmac(_hmac(salted, b"Server Key"), auth_message)
        return f"{without_proof},p={_b64(proof)}"

    def verify(self, server_final: str) -> None:
        attrs = _attributes(server_final)
        if "e" in attrs:
            raise AuthenticationError(f"the broker refused: {attrs['e']}")
        if self._server_signature is None or not hmac.compare_digest(_unb64(attrs.get("v", "")),
                                                                     self._server_signature):
            raise AuthenticationError("the broker's SCRAM signature is wrong: it does not hold this user's credential")
