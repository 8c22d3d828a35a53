"""Per-topic storage settings (MetaQ's topic config) and the rules for topic names."""
from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace

from metaq_broker.errors import ConfigError, InvalidTopicError

MAX_TOPIC_LENGTH = 249
_TOPIC_CHARS = re.compile(r"^[A-Za-z0-9._-]+$")

GROUP_COMMIT = 0  # unflushThreshold <= 0 selects group commit, as in MetaQ
MAX_REPLICAS = 256  # members of one broker group: replicaId 0-255
MAX_INDEX_INTERVAL = 1 << 24  # a lookup reads up to this much of the log at once


def validate_topic_name(name) -> str:
    """Return ``name`` if it can name a topic (and so a directory); raise InvalidTopicError otherwise."""
    if not isinstance(name, str):
        raise InvalidTopicError(f"topic name must be a string, got {type(name).__name__}")
    if not name:
        raise InvalidTopicError("topic name is empty")
    if len(name) > MAX_TOPIC_LENGTH:
        raise InvalidTopicError(f"topic name is {len(name)} characters long; the limit is {MAX_TOPIC_LENGTH}")
    if name in (".", ".."):
        raise InvalidTopicError(f"topic name {name!r} is not allowed")
    if not _TOPIC_CHARS.match(name):
        bad = sorted({c for c in name if not re.match(r"[A-Za-z0-9._-]", c)})
        raise InvalidTopicError(
            f"topic name {name!r} contains {''.join(bad)!r}; only letters, digits, '.', '_' and '-' are allowed"
        )
    return name


@dataclass(frozen=True)
class DeletePolicy:
    """MetaQ's delete policy: ``delete,<hours>`` removes old segments, ``archive,<hours>`` gzips them
    into the partition's ``archive/`` folder first."""

    action: str = "delete"
    hours: float = 168.0

    @classmethod
    def parse(cls, spec: str) -> "DeletePolicy":
        parts = [p.strip() for p in str(spec).split(",")]
        if len(parts) != 2 or parts[0] not in ("delete", "archive"):
            raise ConfigError(f"deletePolicy {spec!r}: expected 'delete,<hours>' or 'archive,<hours>'")
        try:
            hours = float(parts[1])
        except ValueError:
            raise ConfigError(f"deletePolicy {spec!r}: hours {parts[1]!r} is not a number") from None
        if not hours > 0:
            raise ConfigError(f"deletePolicy {spec!r}: hours must be positive")
        return cls(parts[0], hours)

    def __str__(self) -> str:
        return f"{self.action},{self.hours:g}"


@dataclass(frozen=True)
class TopicConfig:
    """Storage settings of one topic. ``unflush_threshold <= 0`` is group commit (the default): an append
    is acknowledged only after an fsync that covers it. ``> 0``: acknowledged after the page-cache write,
    fsynced once that many messages are unflushed or ``unflush_interval_ms`` has passed."""

    num_partitions: int = 1
    unflush_threshold: int = GROUP_COMMIT
    unflush_interval_ms: int = 1000
    max_segment_size: int = 256 * 1024 * 1024
    max_message_size: int = 4 * 1024 * 1024
    delete_policy: DeletePolicy = DeletePolicy()
    retention_bytes: int = -1  # per partition; -1 means no size bound
    # Replication: an acks=all put needs this many in-sync members (master included). Plain data carried
    # for the server (runtime topics, DescribeTopic); the store ignores it.
    min_insync_replicas: int = 1
    # Idempotent producers idle this long (by the store times of their batches) are forgotten: a batch of
    # theirs sent again after it is stored again. Kafka's producer.id.expiration.ms, and its default.
    producer_id_expiration_ms: int = 86_400_000
    # Bytes of log between two entries of a segment's sparse offset index (Kafka's index.interval.bytes): a
    # lookup walks at most this much of batch headers; the index costs 32 bytes per this many of log.
    index_interval_bytes: int = 4096
    # A key index per segment (``<start>.keys``, docs/storage-format.md section 15): lookups by key. About 13
    # bytes on disk and in memory (the active segment's) for each message with a key; false for a topic that
    # needs no lookups by key (lookups by message id and offset need none).
    key_index: bool = True

    def __post_init__(self):
        if isinstance(self.delete_policy, str):
            object.__setattr__(self, "delete_policy", DeletePolicy.parse(self.delete_policy))
        if not isinstance(self.delete_policy, DeletePolicy):
            raise ConfigError(f"delete_policy must be 'delete,<hours>', 'archive,<hours>' or a DeletePolicy, "
                              f"got {self.delete_policy!r}")
        for f in fields(self):
            if f.name == "delete_policy":
                continue
            v = getattr(self, f.name)
            if f.type in ("bool", bool):
                if not isinstance(v, bool):
                    raise ConfigError(f"{f.name} must be true or false, got {v!r}")
            elif not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"{f.name} must be an integer, got {v!r}")
        if not 1 <= self.num_partitions <= 10_000:
            raise ConfigError(f"num_partitions must be between 1 and 10000, got {self.num_partitions}")
        if self.unflush_interval_ms < 1:
            raise ConfigError(f"unflush_interval_ms must be at least 1, got {self.unflush_interval_ms}")
        if self.max_segment_size < 4096:
            raise ConfigError(f"max_segment_size must be at least 4096 bytes, got {self.max_segment_size}")
        if not 1 <= self.max_message_size <= (1 << 30):
            raise ConfigError(f"max_message_size must be between 1 and 1 GiB, got {self.max_message_size}")
        if self.retention_bytes < -1 or self.retention_bytes == 0:
            raise ConfigError(f"retention_bytes must be positive or -1 (no bound), got {self.retention_bytes}")
        if self.producer_id_expiration_ms < 1:
            raise ConfigError(f"producer_id_expiration_ms must be at least 1, got {self.producer_id_expiration_ms}")
        if not 1 <= self.index_interval_bytes <= MAX_INDEX_INTERVAL:
            raise ConfigError(f"index_interval_bytes must be between 1 and {MAX_INDEX_INTERVAL}, got "
                              f"{self.index_interval_bytes}")
        if not 1 <= self.min_insync_replicas <= MAX_REPLICAS:
            raise ConfigError(f"min_insync_replicas must be between 1 and {MAX_REPLICAS}, got {self.min_insync_replicas}")

    @property
    def group_commit(self) -> bool:
        return self.unflush_threshold <= 0

    def with_(self, **changes) -> "TopicConfig":
        return replace(self, **changes)
