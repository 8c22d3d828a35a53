"""The one table between metaq errors and status codes on the wire, used by both sides: the broker turns
the error a call raised into a gRPC status code (``code_of``), the data port sends the same code as a
number, and the client turns a code back into an error of the matching kind (``error_of``), so
``except UnknownTopicError`` works alike in the broker and in a client."""
from __future__ import annotations

import grpc

from metaq_broker.errors import (AuthenticationError, AuthorizationError, ConfigError, CorruptLogError, DiskFullError,
                                 DuplicateSequenceError, InvalidMessageError, InvalidOffsetError, InvalidPartitionError,
                                 InvalidQueryError, InvalidTopicError, MessageTooLargeError, MetaqError,
                                 NotAcknowledgedError, NotEnoughReplicasError, NotMasterError, OffsetOutOfRangeError,
                                 OutOfOrderSequenceError, PartitionClosedError, ProducerFencedError, StoreClosedError,
                                 TransactionError, UnknownTopicError)
from metaq_broker.protocol.records import RecordFormatError


class BrokerError(MetaqError):
    """A broker refused a call; ``code`` is the gRPC status code, the message is the broker's."""

    def __init__(self, code: grpc.StatusCode, message: str, address: str):
        super().__init__(f"broker {address}: {code.name}: {message}")
        self.code, self.details, self.address = code, message, address


class RemoteUnknownTopicError(BrokerError, UnknownTopicError):
    pass


class RemoteOffsetOutOfRangeError(BrokerError, LookupError):
    pass


class RemoteMessageTooLargeError(BrokerError, MessageTooLargeError):
    pass


class RemoteDiskFullError(BrokerError, DiskFullError):
    """The broker's disk is full: nothing of the call was stored. Not resent by the client (a full disk
    waits for an operator or for retention); sending it again once space is freed is safe."""


class RemoteInvalidArgumentError(BrokerError, ValueError):
    pass


class RemoteDataLossError(BrokerError):
    """Stored bytes failed a checksum on the broker (CorruptLogError there)."""


class RemotePartitionClosedError(BrokerError, PartitionClosedError):
    pass


class RemoteTransactionError(BrokerError, TransactionError):
    """The broker refused a transaction request (unknown xid, wrong state)."""


class RemoteAuthenticationError(BrokerError, AuthenticationError):
    """The broker does not know who the client is: no, wrong or expired credentials."""


class RemoteAuthorizationError(BrokerError, AuthorizationError):
    """The broker's ACLs do not allow this principal the operation; the message names all three."""

    def __init__(self, code: grpc.StatusCode, message: str, address: str):
        MetaqError.__init__(self, f"broker {address}: {code.name}: {message}")
        self.code, self.details, self.address = code, message, address


class BrokerUnavailableError(BrokerError):
    """The broker is down, restarting or stopping, or the call timed out: nothing was done."""


def _remote_init(self, code: grpc.StatusCode, message: str, address: str) -> None:
    """BrokerError's fields without the local error's constructor, which would prefix the message again."""
    MetaqError.__init__(self, f"broker {address}: {code.name}: {message}")
    self.code, self.details, self.address = code, message, address


class RemoteProducerFencedError(BrokerError, ProducerFencedError):
    """An idempotent producer's epoch was fenced by a newer one of the same producer id: nothing stored."""

    __init__ = _remote_init


class RemoteOutOfOrderSequenceError(BrokerError, OutOfOrderSequenceError):
    """An idempotent producer's batch does not follow its last stored sequence: nothing stored."""

    __init__ = _remote_init


class RemoteDuplicateSequenceError(BrokerError, DuplicateSequenceError):
    """An idempotent producer's batch was stored before, too long ago for its offsets to be known."""

    __init__ = _remote_init


class RemoteNotMasterError(BrokerUnavailableError, NotMasterError):
    """The broker is a replica (or electing) in its group, not the master: nothing was done; resending to
    the master, once known, is safe."""

    __init__ = _remote_init


class RemoteNotEnoughReplicasError(BrokerError, NotEnoughReplicasError):
    """The group has fewer in-sync members than the topic's ``minInSyncReplicas``: nothing was written;
    resending later is safe."""

    __init__ = _remote_init


class RemoteNotAcknowledgedError(BrokerUnavailableError, NotAcknowledgedError):
    """Stored on the master, not acknowledged by the in-sync set: it may or may not be stored, so unlike
    other BrokerUnavailableErrors it is never resent."""

    __init__ = _remote_init


# (errors raised in the broker, most specific first) -> code -> error raised in the client
TABLE = [
    ((MessageTooLargeError,), grpc.StatusCode.RESOURCE_EXHAUSTED, RemoteMessageTooLargeError),
    ((DiskFullError,), grpc.StatusCode.RESOURCE_EXHAUSTED, RemoteDiskFullError),
    ((UnknownTopicError,), grpc.StatusCode.NOT_FOUND, RemoteUnknownTopicError),
    ((OffsetOutOfRangeError,), grpc.StatusCode.OUT_OF_RANGE, RemoteOffsetOutOfRangeError),
    ((InvalidPartitionError, InvalidOffsetError, InvalidTopicError, InvalidMessageError, InvalidQueryError,
      ConfigError, RecordFormatError), grpc.StatusCode.INVALID_ARGUMENT, RemoteInvalidArgumentError),
    ((CorruptLogError,), grpc.StatusCode.DATA_LOSS, RemoteDataLossError),
    ((StoreClosedError,), grpc.StatusCode.UNAVAILABLE, BrokerUnavailableError),
    ((NotMasterError,), grpc.StatusCode.UNAVAILABLE, RemoteNotMasterError),
    ((NotAcknowledgedError,), grpc.StatusCode.UNAVAILABLE, RemoteNotAcknowledgedError),
    ((TransactionError,), grpc.StatusCode.ABORTED, RemoteTransactionError),
    ((PartitionClosedError,), grpc.StatusCode.FAILED_PRECONDITION, RemotePartitionClosedError),
    ((ProducerFencedError, OutOfOrderSequenceError, DuplicateSequenceError), grpc.StatusCode.FAILED_PRECONDITION,
     RemotePartitionClosedError),
    ((NotEnoughReplicasError,), grpc.StatusCode.FAILED_PRECONDITION, RemoteNotEnoughReplicasError),
    ((AuthenticationError,), grpc.StatusCode.UNAUTHENTICATED, RemoteAuthenticationError),
    ((AuthorizationError,), grpc.StatusCode.PERMISSION_DENIED, RemoteAuthorizationError),
]
# Two errors share RESOURCE_EXHAUSTED: a disk-full message starts with DISK_FULL, the rest are too large.
DISK_FULL = "disk full:"
# Replicated groups (docs/protocol.md, Errors): told apart from the other errors of their code by prefix.
NOT_MASTER = NotMasterError.PREFIX
NOT_ENOUGH_REPLICAS = NotEnoughReplicasError.PREFIX
NOT_ACKNOWLEDGED = NotAcknowledgedError.PREFIX
_BY_PREFIX = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: ((DISK_FULL, RemoteDiskFullError),),
    grpc.StatusCode.UNAVAILABLE: ((NOT_MASTER, RemoteNotMasterError), (NOT_ACKNOWLEDGED, RemoteNotAcknowledgedError)),
    grpc.StatusCode.FAILED_PRECONDITION: ((NOT_ENOUGH_REPLICAS, RemoteNotEnoughReplicasError),
                                          (ProducerFencedError.PREFIX, RemoteProducerFencedError),
                                          (OutOfOrderSequenceError.PREFIX, RemoteOutOfOrderSequenceError),
                                          (DuplicateSequenceError.PREFIX, RemoteDuplicateSequenceError)),
}
_ERROR_OF = {code: remote for _, code, remote in reversed(TABLE)}  # the first of a code wins
_ERROR_OF[grpc.StatusCode.DEADLINE_EXCEEDED] = BrokerUnavailableError
# Refusals that stored nothing, so a producer may send the put again (to the master, once known)
STORED_NOTHING = (RemoteNotMasterError, RemoteNotEnoughReplicasError)


def code_of(exc: BaseException) -> grpc.StatusCode:
    """The status a broker answers for ``exc`` (INTERNAL for anything unexpected)."""
    for kinds, code, _ in TABLE:
        if isinstance(exc, kinds):
            return code
    return grpc.StatusCode.INTERNAL


def error_of(code: grpc.StatusCode, message: str, address: str) -> BrokerError:
    """The client-side error for a status the broker at ``address`` answered."""
    for prefix, remote in _BY_PREFIX.get(code, ()):
        if message.startswith(prefix):
            return remote(code, message, address)
    return _ERROR_OF.get(code, BrokerError)(code, message, address)


def to_error(e: grpc.RpcError, address: str) -> BrokerError:
    """The client-side error for a failed gRPC call to the broker at ``address``."""
    return error_of(e.code(), e.details() or "", address)
