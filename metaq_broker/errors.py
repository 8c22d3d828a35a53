"""Errors shared by every layer. Each names the problem; the gRPC service maps them to status codes."""


class MetaqError(Exception):
    """Base class of all metaq errors."""


class ConfigError(MetaqError, ValueError):
    """A configuration key has a bad value, or is unknown."""


class InvalidTopicError(MetaqError, ValueError):
    """A topic name that may not be used (empty, too long, path separators, ..)."""


class UnknownTopicError(MetaqError, LookupError):
    """The topic does not exist on this broker."""


class InvalidPartitionError(MetaqError, ValueError):
    """A partition number outside the topic's partitions."""


class InvalidOffsetError(MetaqError, ValueError):
    """An offset or byte budget that can never be valid (negative, wrong type)."""


class InvalidQueryError(MetaqError, ValueError):
    """A lookup that can never match: a time range whose start is after its end, a non-positive count."""


class NoKeyIndexError(InvalidQueryError):
    """A lookup by key on a topic that keeps no key index (``keyIndex=false``)."""


class OffsetOutOfRangeError(MetaqError, LookupError):
    """An offset outside the stored log; carries the valid range. ``latest`` is where reading stops: the
    partition's last stable offset (Kafka's ``latest`` for a read_committed consumer), not its log end."""

    def __init__(self, what: str, offset: int, earliest: int, latest: int):
        super().__init__(
            f"offset {offset} is out of range for {what}: valid offsets are {earliest} (earliest) "
            f"to {latest} (latest, where reading stops)"
        )
        self.offset, self.earliest, self.latest = offset, earliest, latest


class InvalidMessageError(MetaqError, ValueError):
    """Messages that cannot be stored: null value, mismatched columns, wrong types."""


class MessageTooLargeError(InvalidMessageError):
    """A message over the topic's maxMessageSize."""


class CorruptLogError(MetaqError):
    """Stored bytes fail a checksum or structural check; names the file and byte position."""

    def __init__(self, message: str, path=None, position=None):
        super().__init__(message)
        self.path, self.position = path, position


class PartitionClosedError(MetaqError):
    """The partition was closed by an operator (MetaQ's closePartitions): it takes no more messages."""


class StoreClosedError(MetaqError):
    """The store or partition was closed."""


class TransactionError(MetaqError):
    """A transaction request that cannot be honoured (bad xid, wrong state)."""


class UnknownTransactionError(TransactionError):
    """No open or prepared transaction has this xid, and none finished under it recently."""


class DiskFullError(MetaqError):
    """A write found its file system full (ENOSPC, EDQUOT); nothing of it was stored, so sending it again
    once space is freed is safe. Names the path and the free space."""

    def __init__(self, message: str, path=None, free_bytes=None):
        super().__init__(message)
        self.path, self.free_bytes = path, free_bytes


class AuthenticationError(MetaqError):
    """Credentials were missing, wrong or no longer valid, or the TLS handshake failed (UNAUTHENTICATED)."""


class AuthorizationError(MetaqError):
    """The principal may not do this; names the principal, the operation and the resource (PERMISSION_DENIED)."""

    def __init__(self, principal: str, operation: str, resource_type: str, name: str, message: str = ""):
        super().__init__(message or f"{principal} is not allowed {operation} on {resource_type} {name!r}")
        self.principal, self.operation, self.resource_type, self.name = principal, operation, resource_type, name


class _Prefixed(MetaqError):
    """An error whose message starts with ``PREFIX``: the client tells it apart by that prefix, as a status
    code alone is shared with other errors (protocol/status.py). The prefix is added when missing."""

    PREFIX = ""

    def __init__(self, message: str = ""):
        message = str(message)
        super().__init__(message if message.startswith(self.PREFIX) else f"{self.PREFIX} {message}".rstrip())


class NotMasterError(_Prefixed):
    """This member of a replicated broker group is not its master (a replica, or electing): nothing was
    done, so the client finds the master and sends again (UNAVAILABLE)."""

    PREFIX = "not master:"


class NotEnoughReplicasError(_Prefixed):
    """An ``acks=all`` put while the group's in-sync set is smaller than ``minInSyncReplicas``: nothing was
    written, so sending it again later is safe (FAILED_PRECONDITION)."""

    PREFIX = "not enough in-sync replicas:"


class NotAcknowledgedError(_Prefixed):
    """Stored on the master but not acknowledged by the in-sync set (a shrink, a demotion, no progress):
    it may or may not become visible, so it must not be resent blindly (UNAVAILABLE)."""

    PREFIX = "not acknowledged:"


class ProducerFencedError(_Prefixed):
    """An idempotent producer's batch carries an older epoch than one its producer id already wrote to the
    partition with: a newer producer (a re-init) took the id over. Nothing was written (FAILED_PRECONDITION)."""

    PREFIX = "producer fenced:"


class OutOfOrderSequenceError(_Prefixed):
    """An idempotent producer's batch does not follow its last stored sequence there (a gap, or a new epoch
    not starting at 0). Nothing was written (FAILED_PRECONDITION)."""

    PREFIX = "out of order sequence:"


class DuplicateSequenceError(_Prefixed):
    """An idempotent producer's batch was stored before the batches the partition still remembers: it is a
    duplicate whose offsets are no longer known. Nothing was written (FAILED_PRECONDITION)."""

    PREFIX = "duplicate sequence:"


class ElectionLostError(MetaqError):
    """Another member won the group's election (its state changed, or the master node exists): follow it."""


class StaleStateError(MetaqError):
    """A write of the group's ZooKeeper state at a version someone else already changed: re-read it."""
