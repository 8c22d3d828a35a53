"""Schema tables of the Kafka APIs metaq speaks: each message's fields with the versions they exist in
(our own transcription of Kafka's message definitions, ``clients/src/main/resources/common/message``,
in ``schema.F`` notation; docs/kafka.md lists the version ranges and where they come from).

Every table covers the API's versions from 0 up to the newest Kafka 4.3 serves, also those Kafka 4.0
removed (KIP-896): a request of a removed version is still decoded, so it can be answered with
UNSUPPORTED_VERSION in the layout its client reads. ``APIS`` says which versions are served.
"""
from __future__ import annotations

from dataclasses import dataclass

from metaq_broker.protocol.kafka.schema import INF, F, versions

# fmt: off
API_VERSIONS_REQUEST = (
    F("client_software_name", "string", "3+"),
    F("client_software_version", "string", "3+"),
)
API_VERSIONS_RESPONSE = (
    F("error_code", "int16", "0+"),
    F("api_keys", "[]", "0+", fields=[
        F("api_key", "int16", "0+"),
        F("min_version", "int16", "0+"),
        F("max_version", "int16", "0+"),
    ]),
    F("throttle_time_ms", "int32", "1+"),
    F("supported_features", "[]", "3+", tag=0, tagged="3+", fields=[
        F("name", "string", "3+"),
        F("min_version", "int16", "3+"),
        F("max_version", "int16", "3+"),
    ]),
    F("finalized_features_epoch", "int64", "3+", tag=1, tagged="3+", default=-1),
    F("finalized_features", "[]", "3+", tag=2, tagged="3+", fields=[
        F("name", "string", "3+"),
        F("max_version_level", "int16", "3+"),
        F("min_version_level", "int16", "3+"),
    ]),
    F("zk_migration_ready", "bool", "3+", tag=3, tagged="3+", default=False),
)
METADATA_REQUEST = (
    F("topics", "[]", "0+", nullable="1+", fields=[
        F("topic_id", "uuid", "10+"),
        F("name", "string", "0+", nullable="10+"),
    ]),
    F("allow_auto_topic_creation", "bool", "4+", default=True),
    F("include_cluster_authorized_operations", "bool", "8-10"),
    F("include_topic_authorized_operations", "bool", "8+"),
)
METADATA_RESPONSE = (
    F("throttle_time_ms", "int32", "3+"),
    F("brokers", "[]", "0+", fields=[
        F("node_id", "int32", "0+"),
        F("host", "string", "0+"),
        F("port", "int32", "0+"),
        F("rack", "string", "1+", nullable="1+", default=None),
    ]),
    F("cluster_id", "string", "2+", nullable="2+", default=None),
    F("controller_id", "int32", "1+", default=-1),
    F("topics", "[]", "0+", fields=[
        F("error_code", "int16", "0+"),
        F("name", "string", "0+", nullable="12+"),
        F("topic_id", "uuid", "10+"),
        F("is_internal", "bool", "1+", default=False),
        F("partitions", "[]", "0+", fields=[
            F("error_code", "int16", "0+"),
            F("partition_index", "int32", "0+"),
            F("leader_id", "int32", "0+"),
            F("leader_epoch", "int32", "7+", default=-1),
            F("replica_nodes", "[]int32", "0+"),
            F("isr_nodes", "[]int32", "0+"),
            F("offline_replicas", "[]int32", "5+"),
        ]),
        F("topic_authorized_operations", "int32", "8+", default=-2147483648),
    ]),
    F("cluster_authorized_operations", "int32", "8-10", default=-2147483648),
    F("error_code", "int16", "13+"),
)
PRODUCE_REQUEST = (
    F("transactional_id", "string", "3+", nullable="3+", default=None),
    F("acks", "int16", "0+"),
    F("timeout_ms", "int32", "0+"),
    F("topic_data", "[]", "0+", fields=[
        F("name", "string", "0-12"),
        F("topic_id", "uuid", "13+"),
        F("partition_data", "[]", "0+", fields=[
            F("index", "int32", "0+"),
            F("records", "records", "0+", nullable="0+"),
        ]),
    ]),
)
PRODUCE_RESPONSE = (
    F("responses", "[]", "0+", fields=[
        F("name", "string", "0-12"),
        F("topic_id", "uuid", "13+"),
        F("partition_responses", "[]", "0+", fields=[
            F("index", "int32", "0+"),
            F("error_code", "int16", "0+"),
            F("base_offset", "int64", "0+"),
            F("log_append_time_ms", "int64", "2+", default=-1),
            F("log_start_offset", "int64", "5+", default=-1),
            F("record_errors", "[]", "8+", fields=[
                F("batch_index", "int32", "8+"),
                F("batch_index_error_message", "string", "8+", nullable="8+", default=None),
            ]),
            F("error_message", "string", "8+", nullable="8+", default=None),
            F("current_leader", "{}", "10+", tag=0, tagged="10+", fields=[
                F("leader_id", "int32", "10+", default=-1),
                F("leader_epoch", "int32", "10+", default=-1),
            ]),
        ]),
    ]),
    F("throttle_time_ms", "int32", "1+", default=0),
    F("node_endpoints", "[]", "10+", tag=0, tagged="10+", fields=[
        F("node_id", "int32", "10+"),
        F("host", "string", "10+"),
        F("port", "int32", "10+"),
        F("rack", "string", "10+", nullable="10+", default=None),
    ]),
)
FETCH_REQUEST = (
    F("cluster_id", "string", "12+", nullable="12+", tag=0, tagged="12+", default=None),
    F("replica_id", "int32", "0-14", default=-1),
    F("replica_state", "{}", "15+", tag=1, tagged="15+", fields=[
        F("replica_id", "int32", "15+", default=-1),
        F("replica_epoch", "int64", "15+", default=-1),
    ]),
    F("max_wait_ms", "int32", "0+"),
    F("min_bytes", "int32", "0+"),
    F("max_bytes", "int32", "3+", default=2147483647),
    F("isolation_level", "int8", "4+", default=0),
    F("session_id", "int32", "7+", default=0),
    F("session_epoch", "int32", "7+", default=-1),
    F("topics", "[]", "0+", fields=[
        F("topic", "string", "0-12"),
        F("topic_id", "uuid", "13+"),
        F("partitions", "[]", "0+", fields=[
            F("partition", "int32", "0+"),
            F("current_leader_epoch", "int32", "9+", default=-1),
            F("fetch_offset", "int64", "0+"),
            F("last_fetched_epoch", "int32", "12+", default=-1),
            F("log_start_offset", "int64", "5+", default=-1),
            F("partition_max_bytes", "int32", "0+"),
            F("replica_directory_id", "uuid", "17+", tag=0, tagged="17+"),
            F("high_watermark", "int64", "18+", tag=1, tagged="18+", default=9223372036854775807),
        ]),
    ]),
    F("forgotten_topics_data", "[]", "7+", fields=[
        F("topic", "string", "7-12"),
        F("topic_id", "uuid", "13+"),
        F("partitions", "[]int32", "7+"),
    ]),
    F("rack_id", "string", "11+", default=""),
)
FETCH_RESPONSE = (
    F("throttle_time_ms", "int32", "1+"),
    F("error_code", "int16", "7+"),
    F("session_id", "int32", "7+", default=0),
    F("responses", "[]", "0+", fields=[
        F("topic", "string", "0-12"),
        F("topic_id", "uuid", "13+"),
        F("partitions", "[]", "0+", fields=[
            F("partition_index", "int32", "0+"),
            F("error_code", "int16", "0+"),
            F("high_watermark", "int64", "0+"),
            F("last_stable_offset", "int64", "4+", default=-1),
            F("log_start_offset", "int64", "5+", default=-1),
            F("diverging_epoch", "{}", "12+", tag=0, tagged="12+", fields=[
                F("epoch", "int32", "12+", default=-1),
                F("end_offset", "int64", "12+", default=-1),
            ]),
            F("current_leader", "{}", "12+", tag=1, tagged="12+", fields=[
                F("leader_id", "int32", "12+", default=-1),
                F("leader_epoch", "int32", "12+", default=-1),
            ]),
            F("snapshot_id", "{}", "12+", tag=2, tagged="12+", fields=[
                F("end_offset", "int64", "0+", default=-1),
                F("epoch", "int32", "0+", default=-1),
            ]),
            F("aborted_transactions", "[]", "4+", nullable="4+", fields=[
                F("producer_id", "int64", "4+"),
                F("first_offset", "int64", "4+"),
            ]),
            F("preferred_read_replica", "int32", "11+", default=-1),
            F("records", "records", "0+", nullable="0+"),
        ]),
    ]),
    F("node_endpoints", "[]", "16+", tag=0, tagged="16+", fields=[
        F("node_id", "int32", "16+"),
        F("host", "string", "16+"),
        F("port", "int32", "16+"),
        F("rack", "string", "16+", nullable="16+", default=None),
    ]),
)
LIST_OFFSETS_REQUEST = (
    F("replica_id", "int32", "0+"),
    F("isolation_level", "int8", "2+"),
    F("topics", "[]", "0+", fields=[
        F("name", "string", "0+"),
        F("partitions", "[]", "0+", fields=[
            F("partition_index", "int32", "0+"),
            F("current_leader_epoch", "int32", "4+", default=-1),
            F("timestamp", "int64", "0+"),
            F("max_num_offsets", "int32", "0", default=1),
        ]),
    ]),
    F("timeout_ms", "int32", "10+"),
)
LIST_OFFSETS_RESPONSE = (
    F("throttle_time_ms", "int32", "2+"),
    F("topics", "[]", "0+", fields=[
        F("name", "string", "0+"),
        F("partitions", "[]", "0+", fields=[
            F("partition_index", "int32", "0+"),
            F("error_code", "int16", "0+"),
            F("old_style_offsets", "[]int64", "0"),
            F("timestamp", "int64", "1+", default=-1),
            F("offset", "int64", "1+", default=-1),
            F("leader_epoch", "int32", "4+", default=-1),
        ]),
    ]),
)
OFFSET_FOR_LEADER_EPOCH_REQUEST = (
    F("replica_id", "int32", "3+", default=-2),
    F("topics", "[]", "0+", fields=[
        F("topic", "string", "0+"),
        F("partitions", "[]", "0+", fields=[
            F("partition", "int32", "0+"),
            F("current_leader_epoch", "int32", "2+", default=-1),
            F("leader_epoch", "int32", "0+"),
        ]),
    ]),
)
OFFSET_FOR_LEADER_EPOCH_RESPONSE = (
    F("throttle_time_ms", "int32", "2+"),
    F("topics", "[]", "0+", fields=[
        F("topic", "string", "0+"),
        F("partitions", "[]", "0+", fields=[
            F("error_code", "int16", "0+"),
            F("partition", "int32", "0+"),
            F("leader_epoch", "int32", "1+", default=-1),
            F("end_offset", "int64", "0+", default=-1),
        ]),
    ]),
)
CREATE_TOPICS_REQUEST = (
    F("topics", "[]", "0+", fields=[
        F("name", "string", "0+"),
        F("num_partitions", "int32", "0+"),
        F("replication_factor", "int16", "0+"),
        F("assignments", "[]", "0+", fields=[
            F("partition_index", "int32", "0+"),
            F("broker_ids", "[]int32", "0+"),
        ]),
        F("configs", "[]", "0+", fields=[
            F("name", "string", "0+"),
            F("value", "string", "0+", nullable="0+"),
        ]),
    ]),
    F("timeout_ms", "int32", "0+", default=60000),
    F("validate_only", "bool", "1+", default=False),
)
CREATE_TOPICS_RESPONSE = (
    F("throttle_time_ms", "int32", "2+"),
    F("topics", "[]", "0+", fields=[
        F("name", "string", "0+"),
        F("topic_id", "uuid", "7+"),
        F("error_code", "int16", "0+"),
        F("error_message", "string", "1+", nullable="0+"),
        F("topic_config_error_code", "int16", "5+", tag=0, tagged="5+"),
        F("num_partitions", "int32", "5+", default=-1),
        F("replication_factor", "int16", "5+", default=-1),
        F("configs", "[]", "5+", nullable="5+", fields=[
            F("name", "string", "5+"),
            F("value", "string", "5+", nullable="5+"),
            F("read_only", "bool", "5+"),
            F("config_source", "int8", "5+", default=-1),
            F("is_sensitive", "bool", "5+"),
        ]),
    ]),
)
DELETE_TOPICS_REQUEST = (
    F("topics", "[]", "6+", fields=[
        F("name", "string", "6+", nullable="6+", default=None),
        F("topic_id", "uuid", "6+"),
    ]),
    F("topic_names", "[]string", "0-5"),
    F("timeout_ms", "int32", "0+"),
)
DELETE_TOPICS_RESPONSE = (
    F("throttle_time_ms", "int32", "1+"),
    F("responses", "[]", "0+", fields=[
        F("name", "string", "0+", nullable="6+"),
        F("topic_id", "uuid", "6+"),
        F("error_code", "int16", "0+"),
        F("error_message", "string", "5+", nullable="5+", default=None),
    ]),
)
CREATE_PARTITIONS_REQUEST = (
    F("topics", "[]", "0+", fields=[
        F("name", "string", "0+"),
        F("count", "int32", "0+"),
        F("assignments", "[]", "0+", nullable="0+", fields=[
            F("broker_ids", "[]int32", "0+"),
        ]),
    ]),
    F("timeout_ms", "int32", "0+"),
    F("validate_only", "bool", "0+"),
)
CREATE_PARTITIONS_RESPONSE = (
    F("throttle_time_ms", "int32", "0+"),
    F("results", "[]", "0+", fields=[
        F("name", "string", "0+"),
        F("error_code", "int16", "0+"),
        F("error_message", "string", "0+", nullable="0+", default=None),
    ]),
)
DESCRIBE_CONFIGS_REQUEST = (
    F("resources", "[]", "0+", fields=[
        F("resource_type", "int8", "0+"),
        F("resource_name", "string", "0+"),
        F("configuration_keys", "[]string", "0+", nullable="0+"),
    ]),
    F("include_synonyms", "bool", "1+", default=False),
    F("include_documentation", "bool", "3+", default=False),
)
DESCRIBE_CONFIGS_RESPONSE = (
    F("throttle_time_ms", "int32", "0+"),
    F("results", "[]", "0+", fields=[
        F("error_code", "int16", "0+"),
        F("error_message", "string", "0+", nullable="0+"),
        F("resource_type", "int8", "0+"),
        F("resource_name", "string", "0+"),
        F("configs", "[]", "0+", fields=[
            F("name", "string", "0+"),
            F("value", "string", "0+", nullable="0+"),
            F("read_only", "bool", "0+"),
            F("is_default", "bool", "0"),
            F("config_source", "int8", "1+", default=-1),
            F("is_sensitive", "bool", "0+"),
            F("synonyms", "[]", "1+", fields=[
                F("name", "string", "1+"),
                F("value", "string", "1+", nullable="0+"),
                F("source", "int8", "1+"),
            ]),
            F("config_type", "int8", "3+", default=0),
            F("documentation", "string", "3+", nullable="0+"),
        ]),
    ]),
)
DESCRIBE_CLUSTER_REQUEST = (
    F("include_cluster_authorized_operations", "bool", "0+"),
    F("endpoint_type", "int8", "1+", default=1),
    F("include_fenced_brokers", "bool", "2+"),
)
DESCRIBE_CLUSTER_RESPONSE = (
    F("throttle_time_ms", "int32", "0+"),
    F("error_code", "int16", "0+"),
    F("error_message", "string", "0+", nullable="0+", default=None),
    F("endpoint_type", "int8", "1+", default=1),
    F("cluster_id", "string", "0+"),
    F("controller_id", "int32", "0+", default=-1),
    F("brokers", "[]", "0+", fields=[
        F("broker_id", "int32", "0+"),
        F("host", "string", "0+"),
        F("port", "int32", "0+"),
        F("rack", "string", "0+", nullable="0+", default=None),
        F("is_fenced", "bool", "2+"),
    ]),
    F("cluster_authorized_operations", "int32", "0+", default=-2147483648),
)
FIND_COORDINATOR_REQUEST = (
    F("key", "string", "0-3"),
    F("key_type", "int8", "1+", default=0),
    F("coordinator_keys", "[]string", "4+"),
)
FIND_COORDINATOR_RESPONSE = (
    F("throttle_time_ms", "int32", "1+"),
    F("error_code", "int16", "0-3"),
    F("error_message", "string", "1-3", nullable="1-3"),
    F("node_id", "int32", "0-3"),
    F("host", "string", "0-3"),
    F("port", "int32", "0-3"),
    F("coordinators", "[]", "4+", fields=[
        F("key", "string", "4+"),
        F("node_id", "int32", "4+"),
        F("host", "string", "4+"),
        F("port", "int32", "4+"),
        F("error_code", "int16", "4+"),
        F("error_message", "string", "4+", nullable="4+"),
    ]),
)
JOIN_GROUP_REQUEST = (
    F("group_id", "string", "0+"),
    F("session_timeout_ms", "int32", "0+"),
    F("rebalance_timeout_ms", "int32", "1+", default=-1),
    F("member_id", "string", "0+"),
    F("group_instance_id", "string", "5+", nullable="5+", default=None),
    F("protocol_type", "string", "0+"),
    F("protocols", "[]", "0+", fields=[
        F("name", "string", "0+"),
        F("metadata", "bytes", "0+"),
    ]),
    F("reason", "string", "8+", nullable="8+", default=None),
)
JOIN_GROUP_RESPONSE = (
    F("throttle_time_ms", "int32", "2+"),
    F("error_code", "int16", "0+"),
    F("generation_id", "int32", "0+", default=-1),
    F("protocol_type", "string", "7+", nullable="7+", default=None),
    F("protocol_name", "string", "0+", nullable="7+"),
    F("leader", "string", "0+"),
    F("skip_assignment", "bool", "9+", default=False),
    F("member_id", "string", "0+"),
    F("members", "[]", "0+", fields=[
        F("member_id", "string", "0+"),
        F("group_instance_id", "string", "5+", nullable="5+", default=None),
        F("metadata", "bytes", "0+"),
    ]),
)
SYNC_GROUP_REQUEST = (
    F("group_id", "string", "0+"),
    F("generation_id", "int32", "0+"),
    F("member_id", "string", "0+"),
    F("group_instance_id", "string", "3+", nullable="3+", default=None),
    F("protocol_type", "string", "5+", nullable="5+", default=None),
    F("protocol_name", "string", "5+", nullable="5+", default=None),
    F("assignments", "[]", "0+", fields=[
        F("member_id", "string", "0+"),
        F("assignment", "bytes", "0+"),
    ]),
)
SYNC_GROUP_RESPONSE = (
    F("throttle_time_ms", "int32", "1+"),
    F("error_code", "int16", "0+"),
    F("protocol_type", "string", "5+", nullable="5+", default=None),
    F("protocol_name", "string", "5+", nullable="5+", default=None),
    F("assignment", "bytes", "0+"),
)
HEARTBEAT_REQUEST = (
    F("group_id", "string", "0+"),
    F("generation_id", "int32", "0+"),
    F("member_id", "string", "0+"),
    F("group_instance_id", "string", "3+", nullable="3+", default=None),
)
HEARTBEAT_RESPONSE = (
    F("throttle_time_ms", "int32", "1+"),
    F("error_code", "int16", "0+"),
)
LEAVE_GROUP_REQUEST = (
    F("group_id", "string", "0+"),
    F("member_id", "string", "0-2"),
    F("members", "[]", "3+", fields=[
        F("member_id", "string", "3+"),
        F("group_instance_id", "string", "3+", nullable="3+", default=None),
        F("reason", "string", "5+", nullable="5+", default=None),
    ]),
)
LEAVE_GROUP_RESPONSE = (
    F("throttle_time_ms", "int32", "1+"),
    F("error_code", "int16", "0+"),
    F("members", "[]", "3+", fields=[
        F("member_id", "string", "3+"),
        F("group_instance_id", "string", "3+", nullable="3+"),
        F("error_code", "int16", "3+"),
    ]),
)
OFFSET_COMMIT_REQUEST = (
    F("group_id", "string", "0+"),
    F("generation_id_or_member_epoch", "int32", "1+", default=-1),
    F("member_id", "string", "1+"),
    F("group_instance_id", "string", "7+", nullable="7+", default=None),
    F("retention_time_ms", "int64", "2-4", default=-1),
    F("topics", "[]", "0+", fields=[
        F("name", "string", "0-9"),
        F("topic_id", "uuid", "10+"),
        F("partitions", "[]", "0+", fields=[
            F("partition_index", "int32", "0+"),
            F("committed_offset", "int64", "0+"),
            F("committed_leader_epoch", "int32", "6+", default=-1),
            F("commit_timestamp", "int64", "1", default=-1),
            F("committed_metadata", "string", "0+", nullable="0+"),
        ]),
    ]),
)
OFFSET_COMMIT_RESPONSE = (
    F("throttle_time_ms", "int32", "3+"),
    F("topics", "[]", "0+", fields=[
        F("name", "string", "0-9"),
        F("topic_id", "uuid", "10+"),
        F("partitions", "[]", "0+", fields=[
            F("partition_index", "int32", "0+"),
            F("error_code", "int16", "0+"),
        ]),
    ]),
)
OFFSET_FETCH_REQUEST = (
    F("group_id", "string", "0-7"),
    F("topics", "[]", "0-7", nullable="2-7", fields=[
        F("name", "string", "0-7"),
        F("partition_indexes", "[]int32", "0-7"),
    ]),
    F("groups", "[]", "8+", fields=[
        F("group_id", "string", "8+"),
        F("member_id", "string", "9+", nullable="9+", default=None),
        F("member_epoch", "int32", "9+", default=-1),
        F("topics", "[]", "8+", nullable="8+", fields=[
            F("name", "string", "8-9"),
            F("topic_id", "uuid", "10+"),
            F("partition_indexes", "[]int32", "8+"),
        ]),
    ]),
    F("require_stable", "bool", "7+", default=False),
)
OFFSET_FETCH_RESPONSE = (
    F("throttle_time_ms", "int32", "3+"),
    F("topics", "[]", "0-7", fields=[
        F("name", "string", "0-7"),
        F("partitions", "[]", "0-7", fields=[
            F("partition_index", "int32", "0-7"),
            F("committed_offset", "int64", "0-7"),
            F("committed_leader_epoch", "int32", "5-7", default=-1),
            F("metadata", "string", "0-7", nullable="0-7"),
            F("error_code", "int16", "0-7"),
        ]),
    ]),
    F("error_code", "int16", "2-7", default=0),
    F("groups", "[]", "8+", fields=[
        F("group_id", "string", "8+"),
        F("topics", "[]", "8+", fields=[
            F("name", "string", "8-9"),
            F("topic_id", "uuid", "10+"),
            F("partitions", "[]", "8+", fields=[
                F("partition_index", "int32", "8+"),
                F("committed_offset", "int64", "8+"),
                F("committed_leader_epoch", "int32", "8+", default=-1),
                F("metadata", "string", "8+", nullable="8+"),
                F("error_code", "int16", "8+"),
            ]),
        ]),
        F("error_code", "int16", "8+", default=0),
    ]),
)
LIST_GROUPS_REQUEST = (
    F("states_filter", "[]string", "4+"),
    F("types_filter", "[]string", "5+"),
)
LIST_GROUPS_RESPONSE = (
    F("throttle_time_ms", "int32", "1+"),
    F("error_code", "int16", "0+"),
    F("groups", "[]", "0+", fields=[
        F("group_id", "string", "0+"),
        F("protocol_type", "string", "0+"),
        F("group_state", "string", "4+"),
        F("group_type", "string", "5+"),
    ]),
)
DESCRIBE_GROUPS_REQUEST = (
    F("groups", "[]string", "0+"),
    F("include_authorized_operations", "bool", "3+"),
)
DESCRIBE_GROUPS_RESPONSE = (
    F("throttle_time_ms", "int32", "1+"),
    F("groups", "[]", "0+", fields=[
        F("error_code", "int16", "0+"),
        F("error_message", "string", "6+", nullable="6+", default=None),
        F("group_id", "string", "0+"),
        F("group_state", "string", "0+"),
        F("protocol_type", "string", "0+"),
        F("protocol_data", "string", "0+"),
        F("members", "[]", "0+", fields=[
            F("member_id", "string", "0+"),
            F("group_instance_id", "string", "4+", nullable="4+", default=None),
            F("client_id", "string", "0+"),
            F("client_host", "string", "0+"),
            F("member_metadata", "bytes", "0+"),
            F("member_assignment", "bytes", "0+"),
        ]),
        F("authorized_operations", "int32", "3+", default=-2147483648),
    ]),
)
DELETE_GROUPS_REQUEST = (
    F("groups_names", "[]string", "0+"),
)
DELETE_GROUPS_RESPONSE = (
    F("throttle_time_ms", "int32", "0+"),
    F("results", "[]", "0+", fields=[
        F("group_id", "string", "0+"),
        F("error_code", "int16", "0+"),
    ]),
)
SASL_HANDSHAKE_REQUEST = (
    F("mechanism", "string", "0+"),
)
SASL_HANDSHAKE_RESPONSE = (
    F("error_code", "int16", "0+"),
    F("mechanisms", "[]string", "0+"),
)
SASL_AUTHENTICATE_REQUEST = (
    F("auth_bytes", "bytes", "0+"),
)
SASL_AUTHENTICATE_RESPONSE = (
    F("error_code", "int16", "0+"),
    F("error_message", "string", "0+", nullable="0+"),
    F("auth_bytes", "bytes", "0+"),
    F("session_lifetime_ms", "int64", "1+", default=0),
)
INIT_PRODUCER_ID_REQUEST = (
    F("transactional_id", "string", "0+", nullable="0+"),
    F("transaction_timeout_ms", "int32", "0+"),
    F("producer_id", "int64", "3+", default=-1),
    F("producer_epoch", "int16", "3+", default=-1),
)
INIT_PRODUCER_ID_RESPONSE = (
    F("throttle_time_ms", "int32", "0+"),
    F("error_code", "int16", "0+"),
    F("producer_id", "int64", "0+", default=-1),
    F("producer_epoch", "int16", "0+"),
)

# fmt: on


@dataclass(frozen=True)
class Api:
    """One Kafka API: its key, the versions our tables know (``known``), the versions served
    (``supported``), the row ApiVersions advertises, and the first flexible version."""

    key: int
    name: str
    known: tuple[int, int]
    supported: tuple[int, int]
    flexible: int
    request: tuple
    response: tuple
    advertised: tuple[int, int] = None

    def __post_init__(self):
        if self.advertised is None:
            object.__setattr__(self, "advertised", self.supported)
        assert self.known[0] <= self.supported[0] <= self.supported[1] <= self.known[1], self.name

    def is_flexible(self, version: int) -> bool:
        return version >= self.flexible

    def serves(self, version: int) -> bool:
        return self.supported[0] <= version <= self.supported[1]

    def knows(self, version: int) -> bool:
        return self.known[0] <= version <= self.known[1]


def _api(key, name, known, supported, flexible, request, response, advertised=None) -> Api:
    lo, hi = versions(flexible)  # "none" (SaslHandshake): no version is flexible
    return Api(key, name, versions(known), versions(supported), lo if lo <= hi else INF, request, response,
               versions(advertised) if advertised else None)


# The versions a Kafka 4.3 broker serves on its client listener (the minimums KIP-896 raised in 4.0
# included). Produce is advertised from 0 as Kafka 4.x does (KAFKA-18659: librdkafka before 2.10 gives up
# on a broker whose Produce row starts above 0), and v0-v2 are refused all the same.
APIS = {a.key: a for a in (
    _api(0, "Produce", "0-13", "3-13", "9+", PRODUCE_REQUEST, PRODUCE_RESPONSE, advertised="0-13"),
    _api(1, "Fetch", "0-18", "4-18", "12+", FETCH_REQUEST, FETCH_RESPONSE),
    _api(2, "ListOffsets", "0-11", "1-11", "6+", LIST_OFFSETS_REQUEST, LIST_OFFSETS_RESPONSE),
    _api(3, "Metadata", "0-13", "0-13", "9+", METADATA_REQUEST, METADATA_RESPONSE),
    _api(8, "OffsetCommit", "0-10", "2-10", "8+", OFFSET_COMMIT_REQUEST, OFFSET_COMMIT_RESPONSE),
    _api(9, "OffsetFetch", "0-10", "1-10", "6+", OFFSET_FETCH_REQUEST, OFFSET_FETCH_RESPONSE),
    _api(10, "FindCoordinator", "0-6", "0-6", "3+", FIND_COORDINATOR_REQUEST, FIND_COORDINATOR_RESPONSE),
    _api(11, "JoinGroup", "0-9", "0-9", "6+", JOIN_GROUP_REQUEST, JOIN_GROUP_RESPONSE),
    _api(12, "Heartbeat", "0-4", "0-4", "4+", HEARTBEAT_REQUEST, HEARTBEAT_RESPONSE),
    _api(13, "LeaveGroup", "0-5", "0-5", "4+", LEAVE_GROUP_REQUEST, LEAVE_GROUP_RESPONSE),
    _api(14, "SyncGroup", "0-5", "0-5", "4+", SYNC_GROUP_REQUEST, SYNC_GROUP_RESPONSE),
    _api(15, "DescribeGroups", "0-6", "0-6", "5+", DESCRIBE_GROUPS_REQUEST, DESCRIBE_GROUPS_RESPONSE),
    _api(16, "ListGroups", "0-5", "0-5", "3+", LIST_GROUPS_REQUEST, LIST_GROUPS_RESPONSE),
    _api(17, "SaslHandshake", "0-1", "0-1", "none", SASL_HANDSHAKE_REQUEST, SASL_HANDSHAKE_RESPONSE),
    _api(18, "ApiVersions", "0-4", "0-4", "3+", API_VERSIONS_REQUEST, API_VERSIONS_RESPONSE),
    _api(19, "CreateTopics", "0-7", "2-7", "5+", CREATE_TOPICS_REQUEST, CREATE_TOPICS_RESPONSE),
    _api(20, "DeleteTopics", "0-6", "1-6", "4+", DELETE_TOPICS_REQUEST, DELETE_TOPICS_RESPONSE),
    _api(22, "InitProducerId", "0-5", "0-5", "2+", INIT_PRODUCER_ID_REQUEST, INIT_PRODUCER_ID_RESPONSE),
    _api(23, "OffsetForLeaderEpoch", "0-4", "2-4", "4+", OFFSET_FOR_LEADER_EPOCH_REQUEST,
         OFFSET_FOR_LEADER_EPOCH_RESPONSE),
    _api(32, "DescribeConfigs", "0-4", "1-4", "4+", DESCRIBE_CONFIGS_REQUEST, DESCRIBE_CONFIGS_RESPONSE),
    _api(36, "SaslAuthenticate", "0-2", "0-2", "2+", SASL_AUTHENTICATE_REQUEST, SASL_AUTHENTICATE_RESPONSE),
    _api(37, "CreatePartitions", "0-3", "0-3", "2+", CREATE_PARTITIONS_REQUEST, CREATE_PARTITIONS_RESPONSE),
    _api(42, "DeleteGroups", "0-2", "0-2", "2+", DELETE_GROUPS_REQUEST, DELETE_GROUPS_RESPONSE),
    _api(60, "DescribeCluster", "0-2", "0-2", "0+", DESCRIBE_CLUSTER_REQUEST, DESCRIBE_CLUSTER_RESPONSE),
)}
BY_NAME = {a.name: a for a in APIS.values()}
