"""The broker's storage engine: partitioned, append-only segment logs with a dense offset index.

Knows nothing of the network; the gRPC service is a thin layer over ``MessageStore``."""
from .config import DeletePolicy, TopicConfig, validate_topic_name
from .message_store import MessageStore
from .partition import AppendResult, FetchResult, PartitionLog, SegmentInfo

__all__ = ["AppendResult", "DeletePolicy", "FetchResult", "MessageStore", "PartitionLog", "SegmentInfo",
           "TopicConfig", "validate_topic_name"]
