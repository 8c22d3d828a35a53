"""The broker's storage engine: partitioned, append-only segment logs with a dense offset index.

Knows nothing of the network; the gRPC service is a thin layer over ``MessageStore``."""
from metaq_broker.store.config import DeletePolicy, TopicConfig, validate_topic_name
from metaq_broker.store.message_store import MessageStore
from metaq_broker.store.partition import AppendResult, FetchResult, PartitionLog, SegmentInfo

__all__ = ["AppendResult", "DeletePolicy", "FetchResult", "MessageStore", "PartitionLog", "SegmentInfo",
           "TopicConfig", "validate_topic_name"]
