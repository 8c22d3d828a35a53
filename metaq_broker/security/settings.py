"""Security settings under Kafka's names (librdkafka's for the client's files), checked once: an unknown
key or a bad value fails naming the key, a certificate file that is missing or not PEM fails naming the
file. Passwords never appear in a repr, a log line or an error."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from metaq_broker.errors import ConfigError
from metaq_broker.security.principals import parse_rules

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256")
CLIENT_AUTH = ("none", "required")
AUTHORIZERS = ("none", "acl")

# Keys a client takes: Producer/Consumer/Admin(security=...), the CLI's --command-config file.
CLIENT_KEYS = ("security.protocol", "ssl.ca.location", "ssl.certificate.location", "ssl.key.location",
               "sasl.mechanism", "sasl.username", "sasl.password")
# Keys any process that talks to ZooKeeper takes (clients and brokers alike).
ZK_KEYS = ("zk.auth", "zk.ssl.ca.location", "zk.ssl.certificate.location", "zk.ssl.key.location")
# ZooKeeper keys of a broker only: the identity clients may hold (docs/security.md, section 6).
BROKER_ZK_KEYS = ("zk.client.auth",)
# Keys of a broker's [system] section.
BROKER_KEYS = ("security.protocol", "ssl.ca.location", "ssl.certificate.location", "ssl.key.location",
               "ssl.client.auth", "ssl.principal.mapping.rules", "sasl.enabled.mechanisms", "authorizer",
               "super.users", "replication.sasl.username", "replication.sasl.password")


def _choice(key: str, raw: str, allowed, upper: bool = True) -> str:
    value = str(raw).strip()
    value = value.upper() if upper else value.lower()
    if value not in allowed:
        raise ConfigError(f"{key}: {raw!r} is not one of {', '.join(allowed)}")
    return value


def _path(key: str, raw) -> Optional[str]:
    if raw is None or not str(raw).strip():
        return None
    path = Path(str(raw).strip()).expanduser()
    if not path.is_file():
        raise ConfigError(f"{key}: {path} does not exist or is not a file")
    return str(path)


def read_pem(key: str, path: str) -> bytes:
    """The file's bytes, if it holds at least one PEM block; ConfigError naming ``key`` and the file otherwise."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{key}: {path} is not a PEM file (no -----BEGIN line)")
    return data


def private_key_warning(key: str, path: Optional[str]) -> Optional[str]:
    """A warning when the private key file ``path`` (setting ``key``) may be read by group or others, as
    ssh refuses such keys; None when it may not (or is not set)."""
    if not path:
        return None
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None  # a missing file is reported where it is read
    if not mode & 0o077:
        return None
    return (f"{key} {path} may be read by group or others (mode {mode:04o}): anyone who can read it can "
            f"pass for this process; chmod 600 {path}")


def _unknown(where: str, keys, known) -> None:
    extra = sorted(set(keys) - set(known))
    if extra:
        raise ConfigError(f"{where}unknown security key {extra[0]!r}; known keys are {', '.join(known)}")


def _digest(key: str, raw, where: str) -> tuple:
    """(user, password) of ``digest:USER:PASSWORD`` (or ``USER:PASSWORD``); (None, None) when not set."""
    raw = str(raw or "").strip()
    if not raw:
        return None, None
    rest = raw[len("digest:"):] if raw.startswith("digest:") else raw
    user, sep, password = rest.partition(":")
    if not (user and sep and password):
        raise ConfigError(f"{where}{key}: expected digest:USER:PASSWORD (the password is not shown)")
    return user, password


@dataclass(frozen=True)
class ZkSecurity:
    """How a process authenticates to ZooKeeper. ``auth`` is ``digest:USER:PASSWORD`` (or ``USER:PASSWORD``):
    with it, every znode metaq creates is readable and writable by that identity only, except broker
    registrations and topic entries, which stay world-readable (a client without credentials still finds
    brokers). A broker's ``zk.client.auth`` names the identity clients may hold: it may also write the
    consumer groups' and the sinks' decision records (zk/session.py). The TLS files turn on kazoo's TLS
    to ZooKeeper's secure client port."""
    auth_user: Optional[str] = None
    auth_password: Optional[str] = field(default=None, repr=False)
    ca_location: Optional[str] = None
    certificate_location: Optional[str] = None
    key_location: Optional[str] = None
    client_user: Optional[str] = None
    client_password: Optional[str] = field(default=None, repr=False)

    @classmethod
    def from_properties(cls, props: Mapping[str, str], where: str = "") -> "ZkSecurity":
        props = {k: v for k, v in props.items() if k in ZK_KEYS + BROKER_ZK_KEYS}
        user, password = _digest("zk.auth", props.get("zk.auth"), where)
        client_user, client_password = _digest("zk.client.auth", props.get("zk.client.auth"), where)
        if client_user and not user:
            raise ConfigError(f"{where}zk.client.auth needs zk.auth: the clients' identity is granted beside the "
                              f"cluster's, which brokers and the admin hold")
        if client_user and client_user == user:
            raise ConfigError(f"{where}zk.client.auth must name another user than zk.auth ({user!r}): ZooKeeper "
                              f"knows an identity by its user and password, and clients must not hold the cluster's")
        return cls(user, password, _path(f"{where}zk.ssl.ca.location", props.get("zk.ssl.ca.location")),
                   _path(f"{where}zk.ssl.certificate.location", props.get("zk.ssl.certificate.location")),
                   _path(f"{where}zk.ssl.key.location", props.get("zk.ssl.key.location")),
                   client_user, client_password)

    @property
    def digest(self) -> Optional[str]:
        """``USER:PASSWORD`` for kazoo's ``add_auth("digest", ...)``, or None."""
        return f"{self.auth_user}:{self.auth_password}" if self.auth_user else None

    @property
    def uses_tls(self) -> bool:
        return self.ca_location is not None


class _Protocol:
    """What ``security.protocol`` implies, for both sides."""
    protocol: str

    @property
    def uses_tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    @property
    def uses_sasl(self) -> bool:
        return self.protocol == "SASL_SSL"


@dataclass(frozen=True)
class ClientSecurity(_Protocol):
    """A client's side: how it connects to brokers (``security.protocol``), whom it trusts (``ssl.ca.location``),
    its own certificate for mutual TLS, its SASL user. The broker's host name is always checked against
    its certificate, as Kafka's default ``ssl.endpoint.identification.algorithm=https`` does."""
    protocol: str = "PLAINTEXT"
    ca_location: Optional[str] = None
    certificate_location: Optional[str] = None
    key_location: Optional[str] = None
    sasl_mechanism: str = "SCRAM-SHA-256"
    sasl_username: Optional[str] = None
    sasl_password: Optional[str] = field(default=None, repr=False)
    zk: ZkSecurity = field(default_factory=ZkSecurity)

    @classmethod
    def from_properties(cls, props: Optional[Mapping[str, str]], where: str = "") -> "ClientSecurity":
        """From Kafka-style keys (``security.protocol``, ``ssl.*``, ``sasl.*``, ``zk.*``); ``where`` prefixes
        errors (a file name)."""
        props = {str(k).strip(): v for k, v in (props or {}).items()}
        where = f"{where}: " if where and not where.endswith(": ") else where
        if "zk.client.auth" in props:
            raise ConfigError(f"{where}zk.client.auth is a broker setting; a client given the clients' ZooKeeper "
                              f"identity sets zk.auth to it")
        _unknown(where, props, CLIENT_KEYS + ZK_KEYS)
        protocol = _choice(f"{where}security.protocol", props.get("security.protocol", "PLAINTEXT"), PROTOCOLS)
        out = cls(protocol=protocol,
                  ca_location=_path(f"{where}ssl.ca.location", props.get("ssl.ca.location")),
                  certificate_location=_path(f"{where}ssl.certificate.location", props.get("ssl.certificate.location")),
                  key_location=_path(f"{where}ssl.key.location", props.get("ssl.key.location")),
                  sasl_mechanism=_choice(f"{where}sasl.mechanism", props.get("sasl.mechanism", "SCRAM-SHA-256"),
                                         MECHANISMS),
                  sasl_username=(str(props["sasl.username"]).strip() or None) if "sasl.username" in props else None,
                  sasl_password=str(props["sasl.password"]) if props.get("sasl.password") else None,
                  zk=ZkSecurity.from_properties(props, where))
        out.check(where)
        return out

    def pem_files(self) -> tuple:
        """(CA, private key, certificate chain) as PEM bytes, None for one not set: what gRPC's channel
        credentials take."""
        return tuple(read_pem(key, path) if path else None for key, path in (
            ("ssl.ca.location", self.ca_location), ("ssl.key.location", self.key_location),
            ("ssl.certificate.location", self.certificate_location)))

    def check(self, where: str = "") -> None:
        if (self.certificate_location is None) != (self.key_location is None):
            raise ConfigError(f"{where}ssl.certificate.location and ssl.key.location go together (mutual TLS)")
        if self.protocol == "PLAINTEXT" and (self.certificate_location or self.sasl_username):
            raise ConfigError(f"{where}security.protocol is PLAINTEXT but TLS or SASL settings are given; "
                              f"set security.protocol to SSL or SASL_SSL")
        if self.protocol == "SASL_SSL" and not (self.sasl_username and self.sasl_password):
            raise ConfigError(f"{where}security.protocol SASL_SSL needs sasl.username and sasl.password")
        if self.protocol != "SASL_SSL" and self.sasl_password:
            raise ConfigError(f"{where}sasl.password is given but security.protocol is {self.protocol}, "
                              f"not SASL_SSL")


@dataclass(frozen=True)
class BrokerSecurity(_Protocol):
    """A broker's side: one protocol for every listener (gRPC and the data port), its certificate and
    key, the CA that signs client certificates, whether one is required, the SASL mechanisms it accepts,
    and whether ACLs are checked."""
    protocol: str = "PLAINTEXT"
    ca_location: Optional[str] = None
    certificate_location: Optional[str] = None
    key_location: Optional[str] = None
    client_auth: str = "none"
    principal_rules: tuple = field(default_factory=parse_rules)  # ssl.principal.mapping.rules (principals.py)
    mechanisms: tuple = MECHANISMS
    authorizer: str = "none"
    super_users: frozenset = frozenset()
    # The SASL user a group member logs in to its master with (SASL_SSL); mutual TLS needs none.
    replication_username: Optional[str] = None
    replication_password: Optional[str] = field(default=None, repr=False)

    @classmethod
    def from_properties(cls, props: Mapping[str, str], where: str = "[system] ") -> "BrokerSecurity":
        _unknown(where, props, BROKER_KEYS)
        get = props.get
        mechanisms = tuple(_choice(f"{where}sasl.enabled.mechanisms", m, MECHANISMS)
                           for m in str(get("sasl.enabled.mechanisms", ",".join(MECHANISMS))).split(",") if m.strip())
        supers = frozenset(parse_principal(p, f"{where}super.users")
                           for p in str(get("super.users", "")).split(";") if p.strip())
        out = cls(protocol=_choice(f"{where}security.protocol", get("security.protocol", "PLAINTEXT"), PROTOCOLS),
                  ca_location=_path(f"{where}ssl.ca.location", get("ssl.ca.location")),
                  certificate_location=_path(f"{where}ssl.certificate.location", get("ssl.certificate.location")),
                  key_location=_path(f"{where}ssl.key.location", get("ssl.key.location")),
                  client_auth=_choice(f"{where}ssl.client.auth", get("ssl.client.auth", "none"), CLIENT_AUTH, False),
                  principal_rules=parse_rules(get("ssl.principal.mapping.rules"),
                                              f"{where}ssl.principal.mapping.rules"),
                  mechanisms=mechanisms,
                  authorizer=_choice(f"{where}authorizer", get("authorizer", "none"), AUTHORIZERS, False),
                  super_users=supers,
                  replication_username=str(get("replication.sasl.username") or "").strip() or None,
                  replication_password=str(get("replication.sasl.password") or "") or None)
        if out.uses_tls and not (out.certificate_location and out.key_location):
            raise ConfigError(f"{where}security.protocol {out.protocol} needs ssl.certificate.location and "
                              f"ssl.key.location")
        if out.client_auth == "required" and not out.ca_location:
            raise ConfigError(f"{where}ssl.client.auth=required needs ssl.ca.location (the CA of client certificates)")
        if out.client_auth == "required" and not out.uses_tls:
            raise ConfigError(f"{where}ssl.client.auth=required needs security.protocol SSL or SASL_SSL")
        if out.uses_sasl and not mechanisms:
            raise ConfigError(f"{where}sasl.enabled.mechanisms: name at least one of {', '.join(MECHANISMS)}")
        if (out.replication_username is None) != (out.replication_password is None):
            raise ConfigError(f"{where}replication.sasl.username and replication.sasl.password go together")
        if out.replication_username and not out.uses_sasl:
            raise ConfigError(f"{where}replication.sasl.username is given but security.protocol is {out.protocol}, "
                              f"not SASL_SSL")
        return out

    def replication_problem(self, where: str = "[system] ") -> Optional[str]:
        """Why this broker cannot copy from its group's master, or None: the CA to trust the master by
        (TLS), the user to log in with (SASL_SSL)."""
        if self.uses_tls and not self.ca_location:
            return (f"{where}ssl.ca.location is needed for replication over {self.protocol}: a group member "
                    f"checks its master's certificate against that CA")
        if self.uses_sasl and not self.replication_username:
            return (f"{where}replication.sasl.username and replication.sasl.password are needed for replication "
                    f"over SASL_SSL: a group member logs in to its master's data port as that user")
        return None

    def replication_client(self) -> "ClientSecurity":
        """How this broker connects to its group's master: its own protocol, trusting ``ssl.ca.location``,
        presenting its own certificate (mutual TLS: the master sees ``User:<CN>``), logging in as the
        replication user under SASL_SSL (SCRAM-SHA-256 when enabled, else PLAIN). Check
        ``replication_problem`` first."""
        if not self.uses_tls:
            return ClientSecurity()
        mechanism = "SCRAM-SHA-256" if "SCRAM-SHA-256" in self.mechanisms else self.mechanisms[0]
        return ClientSecurity(protocol=self.protocol, ca_location=self.ca_location,
                              certificate_location=self.certificate_location, key_location=self.key_location,
                              sasl_mechanism=mechanism,
                              sasl_username=self.replication_username if self.uses_sasl else None,
                              sasl_password=self.replication_password if self.uses_sasl else None)


def parse_principal(text: str, key: str = "principal") -> str:
    """``User:NAME`` (Kafka's principal form); ``User:*`` stands for every principal in ACLs."""
    value = str(text).strip()
    kind, sep, name = value.partition(":")
    if kind != "User" or not sep or not name:
        raise ConfigError(f"{key}: {text!r} is not a principal; write User:NAME")
    return value


def load_properties(path: str) -> dict:
    """A Kafka ``.properties`` file (``key=value`` lines, ``#`` or ``!`` comments), e.g. the CLI's
    ``--command-config client.properties``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    out = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line[0] in "#!":
            continue
        key, sep, value = line.partition("=")
        if not sep:
            key, sep, value = line.partition(":")
        if not sep or not key.strip():
            raise ConfigError(f"{path}:{number}: expected key=value")
        out[key.strip()] = value.strip()
    return out
