"""The broker's configuration: an INI file like MetaQ's server.ini, a ``[system]`` section and one
``[topic=NAME]`` section per topic, with command-line flags overriding any ``[system]`` key. Unknown keys
and bad values are refused at start, naming the key."""
from __future__ import annotations

import configparser
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional

from metaq_broker.errors import ConfigError, InvalidTopicError
from metaq_broker.security.settings import BROKER_KEYS, BROKER_ZK_KEYS, ZK_KEYS, BrokerSecurity, ZkSecurity
from metaq_broker.store.config import MAX_REPLICAS, DeletePolicy, TopicConfig, validate_topic_name


def _int(lo: int, hi: int = 2 ** 62) -> Callable[[str, str], int]:
    def parse(key: str, raw: str) -> int:
        try:
            v = int(str(raw).strip())
        except ValueError:
            raise ConfigError(f"{key}: {raw!r} is not an integer") from None
        if not lo <= v <= hi:
            raise ConfigError(f"{key}: {v} is outside {lo}..{hi}")
        return v
    return parse


def _str(key: str, raw: str) -> str:
    v = str(raw).strip()
    if not v:
        raise ConfigError(f"{key}: must not be empty")
    return v


def _bool(key: str, raw: str) -> bool:
    v = str(raw).strip().lower()
    if v not in ("true", "false"):
        raise ConfigError(f"{key}: {raw!r} is not true or false")
    return v == "true"


def _root(key: str, raw: str) -> str:
    v = str(raw).strip()
    if v and not v.startswith("/"):
        raise ConfigError(f"{key}: {v!r} must start with '/'")
    return v.rstrip("/") or "/"


def _topics(key: str, raw: str) -> str:
    """Comma-separated topic names, each checked; kept as "a,b" (``topic_names`` splits it)."""
    names = topic_names(raw)
    for name in names:
        try:
            validate_topic_name(name)
        except InvalidTopicError as e:
            raise ConfigError(f"{key}: {e}") from None
    return ",".join(names)


def topic_names(text: str) -> tuple:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _policy(key: str, raw: str) -> str:
    try:
        return str(DeletePolicy.parse(raw))
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from None


# Per-topic keys: INI name -> (TopicConfig field, parser). They may also stand in [system] as defaults.
TOPIC_KEYS: dict = {
    "numPartitions": ("num_partitions", _int(1, 10_000)),
    "unflushThreshold": ("unflush_threshold", _int(-1, 2 ** 31)),
    "unflushInterval": ("unflush_interval_ms", _int(1, 86_400_000)),
    "maxSegmentSize": ("max_segment_size", _int(4096, 2 ** 40)),
    "maxMessageSize": ("max_message_size", _int(1, 2 ** 30)),
    "deletePolicy": ("delete_policy", _policy),
    "retentionBytes": ("retention_bytes", _int(-1, 2 ** 62)),
    "minInSyncReplicas": ("min_insync_replicas", _int(1, MAX_REPLICAS)),
    "producer.id.expiration.ms": ("producer_id_expiration_ms", _int(1, 2 ** 62)),
    "keyIndex": ("key_index", _bool),
}

# [system]-only keys: INI name -> (BrokerConfig field, parser); defaults live in BrokerConfig.
SYSTEM_KEYS: dict = {
    "brokerId": ("broker_id", _int(0, 1023)),
    "replicaId": ("replica_id", _int(0, MAX_REPLICAS - 1)),
    "hostName": ("host_name", _str),
    "advertisedHostName": ("advertised_host_name", _str),
    "kafkaPort": ("kafka_port", _int(-1, 65535)),
    "metaqPort": ("metaq_port", _int(-1, 65535)),
    "metaq.anonymousTopics": ("metaq_anonymous_topics", _topics),
    "serverPort": ("server_port", _int(0, 65535)),
    "metricsPort": ("metrics_port", _int(-1, 65535)),
    "dataPort": ("data_port", _int(-1, 65535)),
    "dataPath": ("data_path", _str),
    "zk.connect": ("zk_connect", _str),
    "zk.root": ("zk_root", _root),
    "zk.sessionTimeout": ("zk_session_timeout_ms", _int(1000, 600_000)),
    "zk.maxSessionTimeout": ("zk_max_session_timeout_ms", _int(1000, 2 ** 31 - 1)),
    "maxTransferSize": ("max_transfer_size", _int(1024, 1 << 30)),
    "maxFetchWait": ("max_fetch_wait_ms", _int(0, 600_000)),
    "requestTimeout": ("request_timeout_ms", _int(100, 600_000)),
    "retentionCheckInterval": ("retention_check_interval_s", _int(1, 86_400)),
    "grpcWorkers": ("grpc_workers", _int(2, 1024)),
    "transactionTimeout": ("transaction_timeout_ms", _int(100, 86_400_000)),
    "transactionMaxTimeout": ("transaction_max_timeout_ms", _int(100, 86_400_000)),
    "replicaLagMaxMs": ("replica_lag_max_ms", _int(1, 86_400_000)),
    "uncleanElection": ("unclean_election", _bool),
    "autoCreateTopics": ("auto_create_topics", _bool),
}


@dataclass
class BrokerConfig:
    broker_id: int = 0
    replica_id: int = 0  # this member of broker group broker_id (replication: same brokerId, own replicaId)
    host_name: str = "127.0.0.1"
    # The address every listener registers and Kafka's Metadata returns (None: hostName), so a broker can bind
    # 0.0.0.0 in a container and be reached by its DNS name
    advertised_host_name: Optional[str] = None
    kafka_port: int = 9092  # Kafka's wire protocol on hostName: -1 off, 0 any free port (docs/kafka.md)
    metaq_port: int = -1  # MetaQ 1.4's text protocol on hostName: -1 off, 0 any free port (docs/metaq-protocol.md)
    # MetaQ 1.4 has no login: on a cluster with SASL or ACLs its clients are ANONYMOUS, let in only to these
    # topics (and only as far as the ACLs allow User:ANONYMOUS); without it such a listener is refused at start
    metaq_anonymous_topics: str = ""
    server_port: int = 8123
    metrics_port: int = -1  # Prometheus /metrics on hostName: -1 off, 0 any free port
    data_port: int = 0  # bulk fetches (sendfile) and puts over plain TCP (data_server.py): -1 off, 0 any free port
    data_path: str = "metaq-data"
    zk_connect: str = "127.0.0.1:2181"
    zk_root: str = "/meta"
    zk_session_timeout_ms: int = 10_000
    # The ZooKeeper servers' maxSessionTimeout (theirs defaults to 20 x tickTime = 40 s): a longer
    # zk.sessionTimeout would be lowered silently, and the master's lease assumes it was not.
    zk_max_session_timeout_ms: int = 40_000
    max_transfer_size: int = 8 << 20
    max_fetch_wait_ms: int = 30_000
    # a request's bytes (data port, Kafka and MetaQ listeners) must all arrive within this of its first:
    # a client trickling one in is cut off (docs/security.md, Limits)
    request_timeout_ms: int = 30_000
    retention_check_interval_s: int = 300
    grpc_workers: int = 64
    transaction_timeout_ms: int = 60_000  # a transaction's limit when its BeginTransaction names none
    transaction_max_timeout_ms: int = 900_000  # the largest limit a BeginTransaction may ask for (Kafka's
    # transaction.max.timeout.ms): open, rolled back after it; prepared in-doubt, abort recorded after it
    replica_lag_max_ms: int = 10_000  # a replica not caught up for this long leaves the in-sync set
    unclean_election: bool = False  # elect an out-of-sync member when no in-sync one is alive (loses data)
    # Kafka's auto.create.topics.enable: a Kafka Metadata request that allows it creates the unknown topics it
    # names, with numPartitions (docs/kafka.md). False, MetaQ's way: unknown topics are refused
    auto_create_topics: bool = False
    security: BrokerSecurity = field(default_factory=BrokerSecurity)  # TLS, SASL, ACLs (docs/security.md)
    zk_security: ZkSecurity = field(default_factory=ZkSecurity)  # zk.auth, zk.ssl.*
    topic_defaults: TopicConfig = field(default_factory=TopicConfig)
    topics: dict = field(default_factory=dict)  # name -> TopicConfig
    source: Optional[str] = None

    @property
    def advertised_host(self) -> str:
        """The host name clients are given: ``advertisedHostName``, else ``hostName``."""
        return self.advertised_host_name or self.host_name


def topic_config_from(base: TopicConfig, overrides: Mapping[str, str], where: str) -> TopicConfig:
    """``base`` with per-topic INI keys applied; ``where`` names the source in errors."""
    changes = {}
    for key, raw in overrides.items():
        if key not in TOPIC_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r}; per-topic keys are {', '.join(sorted(TOPIC_KEYS))}")
        attr, parse = TOPIC_KEYS[key]
        changes[attr] = parse(f"{where} {key}", raw)
    try:
        return base.with_(**changes)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def topic_ini_values(topic: TopicConfig) -> dict:
    return {key: _ini(getattr(topic, attr)) for key, (attr, _) in TOPIC_KEYS.items()}


def _ini(value) -> str:
    """A setting as the INI file writes it (``true``/``false`` for booleans)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


_UNROUTABLE = ("0.0.0.0", "::", "[::]")


def _check_system(cfg: BrokerConfig) -> None:
    """Rules between [system] keys."""
    if cfg.zk_session_timeout_ms > cfg.zk_max_session_timeout_ms and cfg.zk_connect.lower() != "none":
        raise ConfigError(
            f"[system] zk.sessionTimeout: {cfg.zk_session_timeout_ms} is above zk.maxSessionTimeout "
            f"{cfg.zk_max_session_timeout_ms}: ZooKeeper silently lowers a session timeout above its "
            f"maxSessionTimeout (by default 20 x tickTime = 40000 ms), and a group's master would then serve past "
            f"its lease; lower zk.sessionTimeout, or raise the ZooKeeper servers' maxSessionTimeout and set "
            f"zk.maxSessionTimeout to it")
    if cfg.advertised_host_name in _UNROUTABLE:  # (a hostName of 0.0.0.0 is still registered as before)
        raise ConfigError(
            f"[system] advertisedHostName: {cfg.advertised_host_name!r} means every address of the host, not one "
            f"clients can reach; it is registered in ZooKeeper and returned to Kafka clients: give this host's "
            f"name or address")
    if cfg.data_port == -1 and cfg.replica_id != 0:
        raise ConfigError(
            f"[system] dataPort: -1 (off) with replicaId {cfg.replica_id}: the members of a broker group copy "
            f"the master's log through its data port, so each needs one; set dataPort to a port (0: any free one)")


def _check_replication(cfg: BrokerConfig, member: bool) -> None:
    """A member of a replicated group (``replicaId`` given) copies from its master over the broker's own
    protocol, so it needs what a client of it would: the CA (TLS) and a user (SASL_SSL). A broker without
    ``replicaId`` may be a group of one and is told at run time, by the fetcher, if it ever must copy."""
    if not member or cfg.zk_connect.lower() == "none":
        return
    problem = cfg.security.replication_problem()
    if problem:
        raise ConfigError(f"{problem} (replicaId {cfg.replica_id}: this broker is a member of replicated group "
                          f"{cfg.broker_id}; docs/replication.md, Security)")


def load(path: Optional[str] = None, overrides: Optional[Mapping[str, str]] = None) -> BrokerConfig:
    """Read the INI file (if any), apply ``overrides`` (flags) to [system], and check everything."""
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # keys are case-sensitive, as in MetaQ
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            parser.read(path, encoding="utf-8")
        except configparser.Error as e:
            raise ConfigError(f"{path}: {e}") from None
    system = dict(parser["system"]) if parser.has_section("system") else {}
    system.update(overrides or {})
    for section in parser.sections():
        if section != "system" and not section.startswith("topic="):
            raise ConfigError(f"unknown section [{section}]; expected [system] or [topic=NAME]")

    cfg = BrokerConfig(source=str(path) if path else None)
    topic_defaults, security = {}, {}
    for key, raw in system.items():
        if key in BROKER_KEYS or key in ZK_KEYS or key in BROKER_ZK_KEYS:
            security[key] = raw
        elif key in SYSTEM_KEYS:
            attr, parse = SYSTEM_KEYS[key]
            setattr(cfg, attr, parse(f"[system] {key}", raw))
        elif key in TOPIC_KEYS:
            topic_defaults[key] = raw
        else:
            known = sorted(SYSTEM_KEYS) + sorted(TOPIC_KEYS) + sorted(BROKER_KEYS + ZK_KEYS + BROKER_ZK_KEYS)
            raise ConfigError(f"[system]: unknown key {key!r}; known keys are {', '.join(known)}")
    _check_system(cfg)
    cfg.security = BrokerSecurity.from_properties({k: v for k, v in security.items() if k in BROKER_KEYS})
    _check_replication(cfg, "replicaId" in system)
    cfg.zk_security = ZkSecurity.from_properties(security, "[system] ")
    cfg.topic_defaults = topic_config_from(TopicConfig(), topic_defaults, "[system]")
    for section in parser.sections():
        if section.startswith("topic="):
            name = section[len("topic="):].strip()
            try:
                validate_topic_name(name)
            except InvalidTopicError as e:
                raise ConfigError(f"[{section}]: {e}") from None
            cfg.topics[name] = topic_config_from(cfg.topic_defaults, dict(parser[section]), f"[{section}]")
    return cfg
