"""Kafka's admin requests about the broker and a topic's partitions, without I/O: DescribeConfigs of a
broker resource, what CreatePartitions asks of this broker, and the topics a DeleteTopics request names.
``kafka_listener.py`` calls these and encodes the answers.

A broker's settings are its INI file's ``[system]`` keys as loaded (``server/config.py``), under metaq's
names, plus Kafka's name where one means the same (``num.partitions``, ``advertised.listeners``, ...).
Secrets (``replication.sasl.password``, ``zk.auth``, ``zk.client.auth``: ``SENSITIVE_KEYS``) are always
listed, sensitive and without a value, set or not, as Kafka lists a password: their value never leaves
the broker.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from metaq_broker.names import parse_partition_name
from metaq_broker.protocol.kafka import codes
from metaq_broker.server.config import SYSTEM_KEYS, BrokerConfig, topic_ini_values
from metaq_broker.store.config import TopicConfig

# The settings whose values are secrets: answered is_sensitive with a null value
SENSITIVE_KEYS = ("replication.sasl.password", "zk.auth", "zk.client.auth")

# DescribeConfigs' config_source and config_type values (Kafka's DescribeConfigsResponse)
SOURCE_STATIC_BROKER, SOURCE_DEFAULT = 4, 5
TYPE_BOOLEAN, TYPE_STRING, TYPE_LONG, TYPE_LIST, TYPE_PASSWORD = 1, 2, 5, 7, 9

# Kafka's broker setting -> metaq's [system] key that means the same (same unit, same meaning)
KAFKA_BROKER_NAMES = {
    "broker.id": "brokerId", "num.partitions": "numPartitions", "log.segment.bytes": "maxSegmentSize",
    "message.max.bytes": "maxMessageSize", "log.retention.bytes": "retentionBytes",
    "min.insync.replicas": "minInSyncReplicas", "auto.create.topics.enable": "autoCreateTopics",
    "log.dirs": "dataPath", "zookeeper.connect": "zk.connect",
    "zookeeper.session.timeout.ms": "zk.sessionTimeout", "log.flush.interval.ms": "unflushInterval",
    "transaction.max.timeout.ms": "transactionMaxTimeout", "replica.lag.time.max.ms": "replicaLagMaxMs",
    "unclean.leader.election.enable": "uncleanElection",
}


class Refused(Exception):
    """A request refused with a Kafka error ``code`` and a message that names the problem."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Setting:
    name: str
    value: Optional[str]  # None: a secret (``sensitive``) or not set
    default: bool  # the value metaq has when the INI file does not set it
    sensitive: bool = False
    kind: int = TYPE_STRING


def broker_settings(cfg: BrokerConfig, kafka_port: int) -> list:
    """Every setting of the broker ``cfg`` describes, by name; ``kafka_port`` is the Kafka listener's port
    (the one bound, when ``kafkaPort`` is 0), for ``advertised.listeners``."""
    base = BrokerConfig()
    out = {}
    for key, (attr, _) in SYSTEM_KEYS.items():
        out[key] = _setting(key, getattr(cfg, attr), getattr(base, attr))
    defaults, base_topic = topic_ini_values(cfg.topic_defaults), topic_ini_values(TopicConfig())
    for key, value in defaults.items():
        out[key] = Setting(key, value, value == base_topic[key], kind=_kind(value))
    security, base_security = _security(cfg), _security(base)
    for key, value in security.items():
        out[key] = _setting(key, value, base_security[key])
    secrets = {"replication.sasl.password": cfg.security.replication_password, "zk.auth": cfg.zk_security.digest,
               "zk.client.auth": cfg.zk_security.client_user}
    for key in SENSITIVE_KEYS:  # only whether it is set (not set: the default), never its value
        out[key] = Setting(key, None, secrets[key] is None, sensitive=True, kind=TYPE_PASSWORD)
    for kafka, metaq in KAFKA_BROKER_NAMES.items():
        out[kafka] = Setting(kafka, out[metaq].value, out[metaq].default, kind=out[metaq].kind)
    protocol = cfg.security.protocol
    out["advertised.listeners"] = Setting("advertised.listeners", f"{protocol}://{cfg.advertised_host}:{kafka_port}",
                                          False, kind=TYPE_LIST)
    out["listeners"] = Setting("listeners", f"{protocol}://{cfg.host_name}:{kafka_port}", False, kind=TYPE_LIST)
    retention_ms = int(cfg.topic_defaults.delete_policy.hours * 3_600_000)
    out["log.retention.ms"] = Setting("log.retention.ms", str(retention_ms), out["deletePolicy"].default,
                                      kind=TYPE_LONG)
    out["log.retention.check.interval.ms"] = Setting(
        "log.retention.check.interval.ms", str(cfg.retention_check_interval_s * 1000),
        out["retentionCheckInterval"].default, kind=TYPE_LONG)
    return [out[k] for k in sorted(out)]


def _security(cfg: BrokerConfig) -> dict:
    """The security settings that are no secret, by key."""
    sec, zk = cfg.security, cfg.zk_security
    return {"security.protocol": sec.protocol, "ssl.ca.location": sec.ca_location,
            "ssl.certificate.location": sec.certificate_location, "ssl.key.location": sec.key_location,
            "ssl.client.auth": sec.client_auth, "ssl.principal.mapping.rules": ",".join(map(str, sec.principal_rules)),
            "sasl.enabled.mechanisms": ",".join(sec.mechanisms),
            "authorizer": sec.authorizer, "super.users": ";".join(sorted(sec.super_users)) or None,
            "replication.sasl.username": sec.replication_username, "zk.ssl.ca.location": zk.ca_location,
            "zk.ssl.certificate.location": zk.certificate_location, "zk.ssl.key.location": zk.key_location}


def _setting(key: str, value, default) -> Setting:
    return Setting(key, None if value is None else _ini(value), value == default, kind=_kind(value))


def _ini(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _kind(value) -> int:
    if isinstance(value, bool) or value in ("true", "false"):
        return TYPE_BOOLEAN
    if isinstance(value, int) or (isinstance(value, str) and value.lstrip("-").isdigit()):
        return TYPE_LONG
    return TYPE_STRING


def describe_configs_entries(settings: list, keys: Optional[list]) -> list:
    """The ``configs`` of a DescribeConfigs result: ``settings`` (``broker_settings``) or those ``keys``
    names (None: all)."""
    wanted = None if keys is None else set(keys)
    return [{"name": s.name, "value": None if s.sensitive else s.value, "read_only": True, "is_default": s.default,
             "config_source": SOURCE_DEFAULT if s.default else SOURCE_STATIC_BROKER, "is_sensitive": s.sensitive,
             "synonyms": [], "config_type": s.kind, "documentation": None}
            for s in settings if wanted is None or s.name in wanted]


# -- DeleteTopics ---------------------------------------------------------------------------------------------
DELETE_WAIT_MAX_S = 60.0  # a DeleteTopics request waits at most this long for its deletions (its timeout_ms less)


def deletions_asked(body: dict, version: int) -> list:
    """The answer entries of a DeleteTopics request, one per topic named (by name, or by id from v6), in
    order: ``name`` None where only the id was given."""
    if version >= 6:
        return [{"name": t["name"], "topic_id": t["topic_id"], "error_code": codes.NONE, "error_message": None}
                for t in body["topics"]]
    return [{"name": name, "topic_id": bytes(16), "error_code": codes.NONE, "error_message": None}
            for name in body["topic_names"]]


# -- CreatePartitions -------------------------------------------------------------------------------------
def partitions_to_add(snap, topic: str, count: int, assignments, broker_id: int, have_here: Optional[int]) -> int:
    """How many partitions this broker adds to ``topic`` so Kafka's count becomes ``count``: every number
    the topic's map ever gave counts (an offline one too: a number is never reused), the new ones are
    numbered after them. ``have_here``: this broker's partitions of the topic (None: it has none).
    Raises ``Refused`` naming the problem."""
    if assignments is not None:
        raise Refused(codes.INVALID_REQUEST, f"topic {topic!r}: metaq places new partitions on the broker that "
                                             f"answers CreatePartitions (the controller): manual assignments are "
                                             f"not taken")
    tmap = snap.maps.get(topic)
    if tmap is None:
        if topic in snap.topics or have_here is not None:
            raise Refused(codes.LEADER_NOT_AVAILABLE, f"topic {topic!r} has no Kafka partition numbers yet; retry")
        raise Refused(codes.UNKNOWN_TOPIC_OR_PARTITION, f"unknown topic {topic!r}")
    have = len(tmap.partitions)
    if count < have:
        raise Refused(codes.INVALID_PARTITIONS, f"topic {topic!r} has {have} partitions, more than the {count} "
                                                f"asked for: a topic's partitions are never removed")
    if count == have:
        raise Refused(codes.INVALID_PARTITIONS, f"topic {topic!r} has {have} partitions already")
    numbered = sum(1 for name in tmap.partitions if parse_partition_name(name)[0] == broker_id)
    if numbered != (have_here or 0):
        raise Refused(codes.LEADER_NOT_AVAILABLE, f"topic {topic!r}: {have_here or 0} partitions on broker "
                                                  f"{broker_id}, {numbered} numbered for Kafka: a change is still "
                                                  f"being published; retry")
    return count - have
