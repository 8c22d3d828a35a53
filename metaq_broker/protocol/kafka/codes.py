"""The one table between metaq errors and Kafka error codes (``protocol/status.py`` is the same table for
gRPC): a Kafka listener answers the error a request raised with ``code_of(exc)`` in the error-code field
the response has there, and clients act on the code as they would with Kafka (a retriable code is
retried after a metadata refresh, the others fail the call with the message).

Codes are Kafka's (``org.apache.kafka.common.protocol.Errors``); only those metaq answers, or that a client
may send us, are named here.
"""
from __future__ import annotations

from metaq_broker.errors import (AuthenticationError, AuthorizationError, ConfigError, CorruptLogError, DiskFullError,
                                 InvalidMessageError, InvalidOffsetError, InvalidPartitionError, InvalidTopicError,
                                 MessageTooLargeError, NotAcknowledgedError, NotEnoughReplicasError, NotMasterError,
                                 OffsetOutOfRangeError, PartitionClosedError, StoreClosedError, TransactionError,
                                 UnknownTopicError)
from metaq_broker.protocol.records import RecordFormatError

UNKNOWN_SERVER_ERROR = -1
NONE = 0
OFFSET_OUT_OF_RANGE = 1
CORRUPT_MESSAGE = 2
UNKNOWN_TOPIC_OR_PARTITION = 3
LEADER_NOT_AVAILABLE = 5
NOT_LEADER_OR_FOLLOWER = 6
REQUEST_TIMED_OUT = 7
MESSAGE_TOO_LARGE = 10
OFFSET_METADATA_TOO_LARGE = 12
COORDINATOR_LOAD_IN_PROGRESS = 14
COORDINATOR_NOT_AVAILABLE = 15
NOT_COORDINATOR = 16
INVALID_TOPIC_EXCEPTION = 17
RECORD_LIST_TOO_LARGE = 18
NOT_ENOUGH_REPLICAS = 19
NOT_ENOUGH_REPLICAS_AFTER_APPEND = 20
INVALID_REQUIRED_ACKS = 21
ILLEGAL_GENERATION = 22
INCONSISTENT_GROUP_PROTOCOL = 23
INVALID_GROUP_ID = 24
UNKNOWN_MEMBER_ID = 25
INVALID_SESSION_TIMEOUT = 26
REBALANCE_IN_PROGRESS = 27
TOPIC_AUTHORIZATION_FAILED = 29
GROUP_AUTHORIZATION_FAILED = 30
CLUSTER_AUTHORIZATION_FAILED = 31
INVALID_TIMESTAMP = 32
UNSUPPORTED_SASL_MECHANISM = 33
ILLEGAL_SASL_STATE = 34
UNSUPPORTED_VERSION = 35
TOPIC_ALREADY_EXISTS = 36
INVALID_PARTITIONS = 37
INVALID_REPLICATION_FACTOR = 38
INVALID_CONFIG = 40
INVALID_REQUEST = 42
POLICY_VIOLATION = 44
OUT_OF_ORDER_SEQUENCE_NUMBER = 45
DUPLICATE_SEQUENCE_NUMBER = 46
INVALID_PRODUCER_EPOCH = 47
INVALID_TXN_STATE = 48
TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53
KAFKA_STORAGE_ERROR = 56
SASL_AUTHENTICATION_FAILED = 58
UNKNOWN_PRODUCER_ID = 59
NON_EMPTY_GROUP = 68
GROUP_ID_NOT_FOUND = 69
FETCH_SESSION_ID_NOT_FOUND = 70
INVALID_FETCH_SESSION_EPOCH = 71
TOPIC_DELETION_DISABLED = 73
UNSUPPORTED_COMPRESSION_TYPE = 76
MEMBER_ID_REQUIRED = 79
GROUP_MAX_SIZE_REACHED = 81
FENCED_INSTANCE_ID = 82
INVALID_RECORD = 87
PRODUCER_FENCED = 90
UNKNOWN_TOPIC_ID = 100
TRANSACTIONAL_ID_NOT_FOUND = 105
UNSUPPORTED_ENDPOINT_TYPE = 115

NAMES = {v: k for k, v in globals().items() if k.isupper() and isinstance(v, int)}
# Codes a Kafka client retries by itself (Kafka's RetriableException subclasses, of those named here)
RETRIABLE = frozenset({CORRUPT_MESSAGE, UNKNOWN_TOPIC_OR_PARTITION, LEADER_NOT_AVAILABLE, NOT_LEADER_OR_FOLLOWER,
                       REQUEST_TIMED_OUT, COORDINATOR_LOAD_IN_PROGRESS, COORDINATOR_NOT_AVAILABLE, NOT_COORDINATOR,
                       NOT_ENOUGH_REPLICAS, NOT_ENOUGH_REPLICAS_AFTER_APPEND, KAFKA_STORAGE_ERROR,
                       FETCH_SESSION_ID_NOT_FOUND, INVALID_FETCH_SESSION_EPOCH, UNKNOWN_TOPIC_ID})

# Refusals of the idempotent producer come with record format v3 (issue 24), in classes this layer does
# not import yet: matched by class name, most specific first, until they can be imported.
_BY_CLASS_NAME = (
    ("OutOfOrderSequenceError", OUT_OF_ORDER_SEQUENCE_NUMBER),
    ("DuplicateSequenceError", DUPLICATE_SEQUENCE_NUMBER),
    ("ProducerFencedError", INVALID_PRODUCER_EPOCH),
    ("InvalidProducerEpochError", INVALID_PRODUCER_EPOCH),
    ("UnknownProducerIdError", UNKNOWN_PRODUCER_ID),
)

# metaq errors, most specific first -> Kafka code. Why each: docs/kafka.md, "Errors".
TABLE = (
    ((MessageTooLargeError,), MESSAGE_TOO_LARGE),
    ((RecordFormatError,), CORRUPT_MESSAGE),  # a batch failing its checks on the way in
    ((InvalidMessageError,), INVALID_RECORD),
    ((UnknownTopicError, InvalidPartitionError), UNKNOWN_TOPIC_OR_PARTITION),
    ((InvalidTopicError,), INVALID_TOPIC_EXCEPTION),
    ((OffsetOutOfRangeError,), OFFSET_OUT_OF_RANGE),
    ((InvalidOffsetError,), INVALID_REQUEST),
    ((ConfigError,), INVALID_CONFIG),
    ((NotMasterError, StoreClosedError), NOT_LEADER_OR_FOLLOWER),  # the client refreshes metadata, resends
    ((NotEnoughReplicasError,), NOT_ENOUGH_REPLICAS),  # nothing stored: retried
    ((NotAcknowledgedError,), NOT_ENOUGH_REPLICAS_AFTER_APPEND),  # stored, not acknowledged by the in-sync set
    ((DiskFullError, CorruptLogError), KAFKA_STORAGE_ERROR),
    ((PartitionClosedError,), POLICY_VIOLATION),  # closed by an operator (MetaQ's closePartitions)
    ((TransactionError,), INVALID_TXN_STATE),
    ((AuthenticationError,), SASL_AUTHENTICATION_FAILED),
)
# AuthorizationError: by the kind of resource refused
_AUTHORIZATION = {"topic": TOPIC_AUTHORIZATION_FAILED, "group": GROUP_AUTHORIZATION_FAILED,
                  "cluster": CLUSTER_AUTHORIZATION_FAILED, "transactionalid": TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                  "sink": TRANSACTIONAL_ID_AUTHORIZATION_FAILED}  # the exactly-once sink's resource


def code_of(exc: BaseException) -> int:
    """The Kafka error code a broker answers for ``exc`` (UNKNOWN_SERVER_ERROR for anything unexpected)."""
    code = getattr(exc, "kafka_code", None)  # errors of the Kafka protocol layer carry their own
    if code is not None:
        return code
    names = {c.__name__ for c in type(exc).__mro__}
    for name, code in _BY_CLASS_NAME:
        if name in names:
            return code
    if isinstance(exc, AuthorizationError):
        return _AUTHORIZATION.get(str(exc.resource_type).replace("_", "").lower(), CLUSTER_AUTHORIZATION_FAILED)
    for kinds, code in TABLE:
        if isinstance(exc, kinds):
            return code
    return UNKNOWN_SERVER_ERROR


def name_of(code: int) -> str:
    return NAMES.get(code, f"error {code}")
