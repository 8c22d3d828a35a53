"""Every ZooKeeper path metaq uses for its own state, in one place.

The root is configurable (``zk.root``, default ``/meta``) and shared with MetaQ 1.4's own layout, which
brokers with a MetaQ listener write beside metaq's (``zk/metaq_layout.py`` spells those nodes: MetaQ's
``brokers/ids/<b>`` with ``master``/``slave<n>`` children, ``brokers/topics``, ``topics-pub|sub`` and the
``<msgId>-<byteOffset>`` group offsets). metaq's own nodes are below paths MetaQ clients never read, so
their data can be metaq's JSON (docs/protocol.md, "ZooKeeper layout"). Brokers, clients, the CLI and the
Spark connector cannot drift apart on a path spelling::

    <root>/brokers/metaq/ids/<brokerId>                   ephemeral, JSON addresses of a group's master
    <root>/brokers/metaq/topics/<topic>/<brokerId>-m      JSON {"numPartitions": n, "brokerId": id}, and
                                                          "static": true for a topic of its server.ini
    <root>/brokers/starting/<brokerId>                    ephemeral, JSON: a restarted broker waiting for the
                                                          session of its previous run to expire
    <root>/brokers/groups/<brokerId>/state                JSON: the replicated group's epoch, master, in-sync set
    <root>/brokers/groups/<brokerId>/members/<replicaId>  ephemeral, JSON: a live member of the group
    <root>/brokers/groups/<brokerId>/starting/<replicaId> ephemeral, JSON: a member waiting for its old session
    <root>/consumers/<group>/ids/<consumerId>             ephemeral, comma-separated topics (a Kafka member's:
                                                          {"kafka": true, "broker": <its coordinator>})
    <root>/consumers/<group>/metaq/offsets/<topic>/<b>-<n>  ASCII decimal committed (logical) offset
    <root>/consumers/<group>/owners/<topic>/<b>-<n>       ephemeral, owning consumerId
    <root>/consumers/<group>/kafka                        JSON: a Kafka consumer group's generation, protocol and
                                                          members, written by its coordinator (docs/kafka.md)
    <root>/kafka/cluster_id                               JSON {"version": "1", "id": <22 chars>}: Kafka's cluster id
    <root>/kafka/topics/<topic>                           JSON: the topic's Kafka id and its partitions in Kafka's
                                                          numbering (append-only: a number is never reused)
    <root>/admin/delete_topics/<topic>                    JSON: a topic's deletion, recorded until no broker has
                                                          the topic any more (Kafka's path; zk/topic_deletions.py)
    <root>/sinks/<sinkId>/batches/<batchId:020d>          exactly-once sink decisions
    <root>/latest_producer_id_block                       JSON: the last block of producer ids a broker took
    <root>/config/users/<quoted user>                     JSON {"SCRAM-SHA-256": salted credential}
    <root>/config/scram-secret                            32 random bytes: the brokers' key for the salts
                                                          of unknown SCRAM users (zk/users.py)
    <root>/acls/<resourceType>/<patternType>/<quoted name>  the ACLs of one resource pattern (security.acl)

Before issue 28 metaq kept its master node at ``brokers/ids/<b>``, its topic entries in ``topics-pub|sub``
and its group offsets at ``consumers/<group>/offsets``, where MetaQ clients read theirs; brokers move
such data on start (``zk/layout_upgrade.py``).

Names that become one path component are checked here, so a bad topic or group name fails with a
clear ValueError instead of silently addressing some other node (``a/b``, ``..``).
"""
from __future__ import annotations

from urllib.parse import quote, unquote

from metaq_broker.names import parse_partition_name, whole_number


def check_component(kind: str, value: str) -> str:
    """Return ``value`` if it can be one path component; ValueError naming ``kind`` and the problem."""
    if not isinstance(value, str):
        raise ValueError(f"{kind} must be a string to be used in a ZooKeeper path, got {type(value).__name__}")
    problem = None
    if not value:
        problem = "it is empty"
    elif "/" in value:
        problem = "it contains '/'"
    elif value in (".", ".."):
        problem = f"{value!r} is reserved"
    elif any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or 0xD800 <= ord(c) <= 0xF8FF or ord(c) in (0xFFFE, 0xFFFF)
             for c in value):
        problem = "it contains a control or reserved character"  # ZooKeeper rejects these in paths
    if problem:
        raise ValueError(f"{kind} {value!r} cannot be used in a ZooKeeper path: {problem}")
    return value


def normalize_root(root: str | None) -> str:
    """``"meta/"`` → ``"/meta"``; ``""``, ``"/"`` and None → ``""`` (no prefix)."""
    parts = [p for p in str(root or "").split("/") if p]
    for p in parts:
        check_component("zk root component", p)
    return "".join("/" + p for p in parts)


class ZkPaths:
    """Path builder for one root. Methods return absolute znode paths."""

    def __init__(self, root: str = "/meta"):
        self.root = normalize_root(root)

    def __repr__(self) -> str:
        return f"ZkPaths({self.root or '/'!r})"

    # -- brokers: metaq's own nodes, below ``brokers/metaq`` (MetaQ's are in zk/metaq_layout.py) ---------
    def brokers_metaq(self) -> str:
        return f"{self.root}/brokers/metaq"

    def broker_ids(self) -> str:
        return f"{self.brokers_metaq()}/ids"

    def broker(self, broker_id: int) -> str:
        """A broker group's master node (created by its election, ``zk/groups.py``)."""
        return f"{self.broker_ids()}/{whole_number('broker id', broker_id)}"

    def brokers_starting(self) -> str:
        return f"{self.root}/brokers/starting"

    def broker_starting(self, broker_id: int) -> str:
        return f"{self.brokers_starting()}/{whole_number('broker id', broker_id)}"

    def topics(self) -> str:
        """Parent of every topic's entries (its children are the topics brokers have)."""
        return f"{self.brokers_metaq()}/topics"

    def topic(self, topic: str) -> str:
        return f"{self.topics()}/{check_component('topic', topic)}"

    def topic_entry(self, topic: str, broker_id: int) -> str:
        return f"{self.topic(topic)}/{whole_number('broker id', broker_id)}-m"

    # -- replicated broker groups (zk/groups.py); ``group``/``group_member`` name consumer groups below ------
    def broker_groups(self) -> str:
        return f"{self.root}/brokers/groups"

    def broker_group(self, broker_id: int) -> str:
        return f"{self.broker_groups()}/{whole_number('broker id', broker_id)}"

    def group_state(self, broker_id: int) -> str:
        return f"{self.broker_group(broker_id)}/state"

    def group_members(self, broker_id: int) -> str:
        return f"{self.broker_group(broker_id)}/members"

    def group_replica(self, broker_id: int, replica_id: int) -> str:
        """A member's node (``group_member`` is a consumer group's)."""
        return f"{self.group_members(broker_id)}/{whole_number('replica id', replica_id)}"

    def group_startings(self, broker_id: int) -> str:
        return f"{self.broker_group(broker_id)}/starting"

    def group_starting(self, broker_id: int, replica_id: int) -> str:
        return f"{self.group_startings(broker_id)}/{whole_number('replica id', replica_id)}"

    # -- consumer groups ------------------------------------------------------------------------------
    def consumers(self) -> str:
        return f"{self.root}/consumers"

    def group(self, group: str) -> str:
        return f"{self.consumers()}/{check_component('group', group)}"

    def group_ids(self, group: str) -> str:
        return f"{self.group(group)}/ids"

    def group_member(self, group: str, consumer_id: str) -> str:
        return f"{self.group_ids(group)}/{check_component('consumer id', consumer_id)}"

    def group_offset_topics(self, group: str) -> str:
        """Parent of metaq's per-topic offset nodes (its children are the topics the group committed for);
        MetaQ's ``<msgId>-<byteOffset>`` are at ``MetaqZkLayout.group_offset``."""
        return f"{self.group(group)}/metaq/offsets"

    def group_offsets(self, group: str, topic: str) -> str:
        return f"{self.group_offset_topics(group)}/{check_component('topic', topic)}"

    def group_offset(self, group: str, topic: str, partition_name: str) -> str:
        parse_partition_name(partition_name)
        return f"{self.group_offsets(group, topic)}/{partition_name}"

    def group_owners(self, group: str, topic: str) -> str:
        return f"{self.group(group)}/owners/{check_component('topic', topic)}"

    def group_owner(self, group: str, topic: str, partition_name: str) -> str:
        parse_partition_name(partition_name)
        return f"{self.group_owners(group, topic)}/{partition_name}"

    def group_kafka(self, group: str) -> str:
        """A Kafka consumer group's record (generation, protocol, members), kept by its coordinator."""
        return f"{self.group(group)}/kafka"

    # -- Kafka's view: partition numbers, topic ids, the cluster id (zk/kafka_partitions.py) -------------
    def kafka(self) -> str:
        return f"{self.root}/kafka"

    def kafka_cluster_id(self) -> str:
        return f"{self.kafka()}/cluster_id"

    def kafka_topics(self) -> str:
        return f"{self.kafka()}/topics"

    def kafka_topic(self, topic: str) -> str:
        return f"{self.kafka_topics()}/{check_component('topic', topic)}"

    # -- topics being deleted (zk/topic_deletions.py) ---------------------------------------------------
    def topic_deletions(self) -> str:
        return f"{self.root}/admin/delete_topics"

    def topic_deletion(self, topic: str) -> str:
        return f"{self.topic_deletions()}/{check_component('topic', topic)}"

    # -- exactly-once sink decisions ------------------------------------------------------------------
    def producer_id_block(self) -> str:
        return f"{self.root}/latest_producer_id_block"

    def sinks(self) -> str:
        return f"{self.root}/sinks"

    def sink(self, sink_id: str) -> str:
        return f"{self.sinks()}/{check_component('sink id', sink_id)}"

    def sink_batches(self, sink_id: str) -> str:
        return f"{self.sink(sink_id)}/batches"

    def sink_batch(self, sink_id: str, batch_id: int) -> str:
        """Zero-padded to 20 digits (any int64 fits) so ZooKeeper's string order is numeric order."""
        return f"{self.sink_batches(sink_id)}/{whole_number('batch id', batch_id):020d}"

    # -- security: SCRAM users and ACLs, kept as Kafka keeps them --------------------------------------
    def users(self) -> str:
        return f"{self.root}/config/users"

    def user(self, name: str) -> str:
        return f"{self.users()}/{quoted_component('user name', name)}"

    def scram_secret(self) -> str:
        return f"{self.root}/config/scram-secret"

    def acls(self) -> str:
        return f"{self.root}/acls"

    def acl_resource_type(self, resource_type: str) -> str:
        return f"{self.acls()}/{check_component('resource type', resource_type)}"

    def acl_pattern_type(self, resource_type: str, pattern_type: str) -> str:
        return f"{self.acl_resource_type(resource_type)}/{check_component('pattern type', pattern_type)}"

    def acl_resource(self, resource_type: str, pattern_type: str, name: str) -> str:
        return f"{self.acl_pattern_type(resource_type, pattern_type)}/{quoted_component('resource name', name)}"


def quoted_component(kind: str, value: str) -> str:
    """``value`` URL-quoted into one path component (Kafka's Sanitizer does the same), so any user or
    resource name fits, ``/`` and ``*`` included; ``unquote_component`` gives it back."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
    return check_component(kind, quote(value, safe=""))


def unquote_component(component: str) -> str:
    return unquote(component)
