"""The one table between metaq errors and status codes on the wire, used by both sides: the broker turns
the error a call raised into a gRPC status code (``code_of``), the data port sends the same code as a
number, and the client turns a code back into an error of the matching kind (``error_of``), so
``except UnknownTopicError`` works alike in the broker and in a client."""
from __future__ import annotations

import grpc

from metaq_broker.errors import (AuthenticationError, AuthorizationError, ConfigError, CorruptLogError, DiskFullError, InvalidMessageError,
                                 InvalidOffsetError, InvalidPartitionError, InvalidTopicError, MessageTooLargeError,
                                 MetaqError, OffsetOutOfRangeError, PartitionClosedError, StoreClosedError,
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


# (errors raised in the broker, most specific first) -> code -> error raised in the client
TABLE = [
    ((MessageTooLargeError,), grpc.StatusCode.RESOURCE_EXHAUSTED, RemoteMessageTooLargeError),
    ((DiskFullError,), grpc.StatusCode.RESOURCE_EXHAUSTED, RemoteDiskFullError),
    ((UnknownTopicError,), grpc.StatusCode.NOT_FOUND, RemoteUnknownTopicError),
    ((OffsetOutOfRangeError,), grpc.StatusCode.OUT_OF_RANGE, RemoteOffsetOutOfRangeError),
    ((InvalidPartitionError, InvalidOffsetError, InvalidTopicError, InvalidMessageError, ConfigError,
      RecordFormatError), grpc.StatusCode.INVALID_ARGUMENT, RemoteInvalidArgumentError),
    ((CorruptLogError,), grpc.StatusCode.DATA_LOSS, RemoteDataLossError),
    ((StoreClosedError,), grpc.StatusCode.UNAVAILABLE, BrokerUnavailableError),
    ((TransactionError,), grpc.StatusCode.ABORTED, RemoteTransactionError),
    ((PartitionClosedError,), grpc.StatusCode.FAILED_PRECONDITION, RemotePartitionClosedError),
    ((AuthenticationError,), grpc.StatusCode.UNAUTHENTICATED, RemoteAuthenticationError),
    ((AuthorizationError,), grpc.StatusCode.PERMISSION_DENIED, RemoteAuthorizationError),
]
# Two errors share RESOURCE_EXHAUSTED: a disk-full message starts with DISK_FULL, the rest are too large.
DISK_FULL = "disk full:"
_ERROR_OF = {code: remote for _, code, remote in reversed(TABLE)}  # the first of a code wins
_ERROR_OF[grpc.StatusCode.DEADLINE_EXCEEDED] = BrokerUnavailableError


def code_of(exc: BaseException) -> grpc.StatusCode:
    """The status a broker answers for ``exc`` (INTERNAL for anything unexpected)."""
    for kinds, code, _ in TABLE:
        if isinstance(exc, kinds):
            return code
    return grpc.StatusCode.INTERNAL


def error_of(code: grpc.StatusCode, message: str, address: str) -> BrokerError:
    """The client-side error for a status the broker at ``address`` answered."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and message.startswith(DISK_FULL):
        return RemoteDiskFullError(code, message, address)
    return _ERROR_OF.get(code, BrokerError)(code, message, address)


def to_error(e: grpc.RpcError, address: str) -> BrokerError:
    """The client-side error for a failed gRPC call to the broker at ``address``."""
    return error_of(e.code(), e.details() or "", address)
