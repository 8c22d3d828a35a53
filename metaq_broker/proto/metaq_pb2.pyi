from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MessageBatch(_message.Message):
    __slots__ = ("count", "attributes", "body", "body_crc")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    BODY_CRC_FIELD_NUMBER: _ClassVar[int]
    count: int
    attributes: int
    body: bytes
    body_crc: int
    def __init__(self, count: _Optional[int] = ..., attributes: _Optional[int] = ..., body: _Optional[bytes] = ..., body_crc: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("topic", "partition", "batch", "xid", "acks", "producer_id", "producer_epoch", "base_sequence")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    XID_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    batch: MessageBatch
    xid: str
    acks: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., batch: _Optional[_Union[MessageBatch, _Mapping]] = ..., xid: _Optional[str] = ..., acks: _Optional[int] = ..., producer_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ..., base_sequence: _Optional[int] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("topic", "partition", "base_offset", "count", "base_msg_id", "timestamp_ms", "fsynced", "duplicate")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    BASE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    BASE_MSG_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    FSYNCED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    base_offset: int
    count: int
    base_msg_id: int
    timestamp_ms: int
    fsynced: bool
    duplicate: bool
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., base_offset: _Optional[int] = ..., count: _Optional[int] = ..., base_msg_id: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., fsynced: _Optional[bool] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("topic", "partition", "offset", "max_bytes", "max_messages", "max_wait_ms")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    offset: int
    max_bytes: int
    max_messages: int
    max_wait_ms: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., offset: _Optional[int] = ..., max_bytes: _Optional[int] = ..., max_messages: _Optional[int] = ..., max_wait_ms: _Optional[int] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("start_offset", "end_offset", "records", "batch_positions", "earliest_offset", "latest_offset", "aborted", "partition_id")
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    EARLIEST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LATEST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    PARTITION_ID_FIELD_NUMBER: _ClassVar[int]
    start_offset: int
    end_offset: int
    records: bytes
    batch_positions: _containers.RepeatedScalarFieldContainer[int]
    earliest_offset: int
    latest_offset: int
    aborted: bytes
    partition_id: str
    def __init__(self, start_offset: _Optional[int] = ..., end_offset: _Optional[int] = ..., records: _Optional[bytes] = ..., batch_positions: _Optional[_Iterable[int]] = ..., earliest_offset: _Optional[int] = ..., latest_offset: _Optional[int] = ..., aborted: _Optional[bytes] = ..., partition_id: _Optional[str] = ...) -> None: ...

class OffsetQuery(_message.Message):
    __slots__ = ("topic", "partition", "timestamp_ms", "from_offset", "max_bytes", "create_time_from_ms", "create_time_to_ms")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    FROM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FROM_MS_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_TO_MS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    timestamp_ms: int
    from_offset: int
    max_bytes: int
    create_time_from_ms: int
    create_time_to_ms: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., from_offset: _Optional[int] = ..., max_bytes: _Optional[int] = ..., create_time_from_ms: _Optional[int] = ..., create_time_to_ms: _Optional[int] = ...) -> None: ...

class GetOffsetsRequest(_message.Message):
    __slots__ = ("queries",)
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedCompositeFieldContainer[OffsetQuery]
    def __init__(self, queries: _Optional[_Iterable[_Union[OffsetQuery, _Mapping]]] = ...) -> None: ...

class PartitionOffsets(_message.Message):
    __slots__ = ("topic", "partition", "earliest", "latest", "for_timestamp", "after_bytes", "log_end_offset", "high_watermark", "partition_id", "create_time_start", "create_time_end")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    EARLIEST_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    FOR_TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    AFTER_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOG_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    PARTITION_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_START_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_END_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    earliest: int
    latest: int
    for_timestamp: int
    after_bytes: int
    log_end_offset: int
    high_watermark: int
    partition_id: str
    create_time_start: int
    create_time_end: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., earliest: _Optional[int] = ..., latest: _Optional[int] = ..., for_timestamp: _Optional[int] = ..., after_bytes: _Optional[int] = ..., log_end_offset: _Optional[int] = ..., high_watermark: _Optional[int] = ..., partition_id: _Optional[str] = ..., create_time_start: _Optional[int] = ..., create_time_end: _Optional[int] = ...) -> None: ...

class GetOffsetsResponse(_message.Message):
    __slots__ = ("offsets",)
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    offsets: _containers.RepeatedCompositeFieldContainer[PartitionOffsets]
    def __init__(self, offsets: _Optional[_Iterable[_Union[PartitionOffsets, _Mapping]]] = ...) -> None: ...

class ListTopicsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TopicSummary(_message.Message):
    __slots__ = ("topic", "num_partitions")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    num_partitions: int
    def __init__(self, topic: _Optional[str] = ..., num_partitions: _Optional[int] = ...) -> None: ...

class ListTopicsResponse(_message.Message):
    __slots__ = ("broker_id", "topics")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    broker_id: int
    topics: _containers.RepeatedCompositeFieldContainer[TopicSummary]
    def __init__(self, broker_id: _Optional[int] = ..., topics: _Optional[_Iterable[_Union[TopicSummary, _Mapping]]] = ...) -> None: ...

class TopicRequest(_message.Message):
    __slots__ = ("topic",)
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    topic: str
    def __init__(self, topic: _Optional[str] = ...) -> None: ...

class PartitionRangeRequest(_message.Message):
    __slots__ = ("topic", "start", "end")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    topic: str
    start: int
    end: int
    def __init__(self, topic: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class CreateTopicRequest(_message.Message):
    __slots__ = ("topic", "num_partitions", "config", "automatic")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    AUTOMATIC_FIELD_NUMBER: _ClassVar[int]
    topic: str
    num_partitions: int
    config: _containers.ScalarMap[str, str]
    automatic: bool
    def __init__(self, topic: _Optional[str] = ..., num_partitions: _Optional[int] = ..., config: _Optional[_Mapping[str, str]] = ..., automatic: _Optional[bool] = ...) -> None: ...

class PartitionDescription(_message.Message):
    __slots__ = ("partition", "name", "earliest", "latest", "bytes", "segments", "closed")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    EARLIEST_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    partition: int
    name: str
    earliest: int
    latest: int
    bytes: int
    segments: int
    closed: bool
    def __init__(self, partition: _Optional[int] = ..., name: _Optional[str] = ..., earliest: _Optional[int] = ..., latest: _Optional[int] = ..., bytes: _Optional[int] = ..., segments: _Optional[int] = ..., closed: _Optional[bool] = ...) -> None: ...

class TopicDescription(_message.Message):
    __slots__ = ("topic", "broker_id", "partitions", "config")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    topic: str
    broker_id: int
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionDescription]
    config: _containers.ScalarMap[str, str]
    def __init__(self, topic: _Optional[str] = ..., broker_id: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[PartitionDescription, _Mapping]]] = ..., config: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("topic",)
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    topic: str
    def __init__(self, topic: _Optional[str] = ...) -> None: ...

class PartitionStats(_message.Message):
    __slots__ = ("topic", "partition", "puts", "put_messages", "put_bytes", "put_failures", "gets", "get_messages", "get_bytes", "get_misses", "get_failures")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    PUT_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    GET_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    GET_BYTES_FIELD_NUMBER: _ClassVar[int]
    GET_MISSES_FIELD_NUMBER: _ClassVar[int]
    GET_FAILURES_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: str
    puts: int
    put_messages: int
    put_bytes: int
    put_failures: int
    gets: int
    get_messages: int
    get_bytes: int
    get_misses: int
    get_failures: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[str] = ..., puts: _Optional[int] = ..., put_messages: _Optional[int] = ..., put_bytes: _Optional[int] = ..., put_failures: _Optional[int] = ..., gets: _Optional[int] = ..., get_messages: _Optional[int] = ..., get_bytes: _Optional[int] = ..., get_misses: _Optional[int] = ..., get_failures: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("broker_id", "version", "uptime_seconds", "partitions")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    broker_id: int
    version: str
    uptime_seconds: float
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionStats]
    def __init__(self, broker_id: _Optional[int] = ..., version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., partitions: _Optional[_Iterable[_Union[PartitionStats, _Mapping]]] = ...) -> None: ...

class BeginTransactionRequest(_message.Message):
    __slots__ = ("xid", "timeout_ms", "coordinator")
    XID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    xid: str
    timeout_ms: int
    coordinator: str
    def __init__(self, xid: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., coordinator: _Optional[str] = ...) -> None: ...

class TransactionRequest(_message.Message):
    __slots__ = ("xid",)
    XID_FIELD_NUMBER: _ClassVar[int]
    xid: str
    def __init__(self, xid: _Optional[str] = ...) -> None: ...

class TransactionReply(_message.Message):
    __slots__ = ("xid", "state", "messages")
    XID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    xid: str
    state: str
    messages: int
    def __init__(self, xid: _Optional[str] = ..., state: _Optional[str] = ..., messages: _Optional[int] = ...) -> None: ...

class RecoverTransactionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PreparedTransaction(_message.Message):
    __slots__ = ("xid", "coordinator", "messages", "prepared_seconds_ago")
    XID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PREPARED_SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    xid: str
    coordinator: str
    messages: int
    prepared_seconds_ago: float
    def __init__(self, xid: _Optional[str] = ..., coordinator: _Optional[str] = ..., messages: _Optional[int] = ..., prepared_seconds_ago: _Optional[float] = ...) -> None: ...

class RecoverTransactionsResponse(_message.Message):
    __slots__ = ("transactions",)
    TRANSACTIONS_FIELD_NUMBER: _ClassVar[int]
    transactions: _containers.RepeatedCompositeFieldContainer[PreparedTransaction]
    def __init__(self, transactions: _Optional[_Iterable[_Union[PreparedTransaction, _Mapping]]] = ...) -> None: ...

class DescribeGroupRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GroupMemberInfo(_message.Message):
    __slots__ = ("replica_id", "uuid", "address", "data_address", "role", "in_sync", "lag_offsets", "last_caught_up_ms_ago", "journal_lag")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    IN_SYNC_FIELD_NUMBER: _ClassVar[int]
    LAG_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LAST_CAUGHT_UP_MS_AGO_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_LAG_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    uuid: str
    address: str
    data_address: str
    role: str
    in_sync: bool
    lag_offsets: int
    last_caught_up_ms_ago: int
    journal_lag: int
    def __init__(self, replica_id: _Optional[int] = ..., uuid: _Optional[str] = ..., address: _Optional[str] = ..., data_address: _Optional[str] = ..., role: _Optional[str] = ..., in_sync: _Optional[bool] = ..., lag_offsets: _Optional[int] = ..., last_caught_up_ms_ago: _Optional[int] = ..., journal_lag: _Optional[int] = ...) -> None: ...

class DescribeGroupResponse(_message.Message):
    __slots__ = ("broker_id", "epoch", "master", "unclean", "members")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MASTER_FIELD_NUMBER: _ClassVar[int]
    UNCLEAN_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    broker_id: int
    epoch: int
    master: int
    unclean: bool
    members: _containers.RepeatedCompositeFieldContainer[GroupMemberInfo]
    def __init__(self, broker_id: _Optional[int] = ..., epoch: _Optional[int] = ..., master: _Optional[int] = ..., unclean: _Optional[bool] = ..., members: _Optional[_Iterable[_Union[GroupMemberInfo, _Mapping]]] = ...) -> None: ...

class InitProducerIdRequest(_message.Message):
    __slots__ = ("producer_id", "producer_epoch")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    producer_epoch: int
    def __init__(self, producer_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ...) -> None: ...

class InitProducerIdResponse(_message.Message):
    __slots__ = ("producer_id", "producer_epoch")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    producer_epoch: int
    def __init__(self, producer_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ...) -> None: ...
