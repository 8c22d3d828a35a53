"""Consumer-group offsets through the broker, for clients of a secured broker (SSL or SASL_SSL): they
commit and read their group's offsets here instead of in ZooKeeper, the broker checks the ACLs as Kafka
does (committing: Read on the group and on the topic; reading: Describe on both) and writes ZooKeeper
with its own identity (``zk.auth``), so clients need no ZooKeeper credentials and ``group`` ACLs hold.

The gRPC service ``metaq.v1.Groups`` has two methods, messages as JSON: ``CommitOffsets``
``{"group", "topic", "offsets": {partition: offset}, "forward_only"}`` -> ``{"offsets": written}`` and
``FetchOffsets`` ``{"group", "topic"}`` -> ``{"offsets": committed}``. A commit names only partitions the
topic has (from its entries in ZooKeeper, brokers that are down included), at most
``MAX_COMMIT_PARTITIONS`` of them: the broker's ZooKeeper identity writes nothing a client made up."""
from __future__ import annotations

import json
import logging
from typing import Callable

import grpc
from kazoo.exceptions import KazooException

from metaq_broker.errors import InvalidPartitionError, MetaqError
from metaq_broker.names import parse_partition_name
from metaq_broker.protocol.services import COMMIT_OFFSETS, FETCH_OFFSETS, GROUPS_SERVICE
from metaq_broker.protocol.status import code_of
from metaq_broker.zk import topic_entries
from metaq_broker.zk.group_offsets import GroupStore
from metaq_broker.zk.paths import ZkPaths

log = logging.getLogger(__name__)

MAX_COMMIT_PARTITIONS = 4096  # partitions one CommitOffsets call may name


class GroupOffsetsService:
    """``auth`` is the broker's ``BrokerAuth``; ``zk()`` its connected ZooKeeper client (None while away)."""

    def __init__(self, auth, zk: Callable, root: str):
        self.auth, self._zk, self.root = auth, zk, root

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(GROUPS_SERVICE, {
            COMMIT_OFFSETS: grpc.unary_unary_rpc_method_handler(self._call(self.commit)),
            FETCH_OFFSETS: grpc.unary_unary_rpc_method_handler(self._call(self.fetch))})

    def _call(self, method):
        def serve(request: bytes, context) -> bytes:
            try:
                principal = self.auth.grpc_principal(context)
                m = json.loads(request)
                if not isinstance(m, dict) or not isinstance(m.get("group"), str) or not isinstance(m.get("topic"), str):
                    raise ValueError('expected JSON {"group": ..., "topic": ...}')
                return json.dumps({"offsets": method(principal, m)}).encode()
            except MetaqError as e:
                context.abort(code_of(e), str(e))
            except (ValueError, TypeError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"group offsets: {e}")
            except KazooException as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"ZooKeeper did not answer: {type(e).__name__}")
        return serve

    def _store(self) -> GroupStore:
        zk = self._zk()
        if zk is None:
            raise KazooException("no ZooKeeper session")
        return GroupStore(zk, self.root)

    def commit(self, principal: str, m: dict) -> dict:
        group, topic = m["group"], m["topic"]
        self.auth.authorize(principal, "Read", "group", group)
        self.auth.authorize(principal, "Read", "topic", topic)
        offsets = m.get("offsets")
        if not isinstance(offsets, dict):
            raise ValueError("offsets must be a JSON object {partition: offset}")
        if len(offsets) > MAX_COMMIT_PARTITIONS:
            raise InvalidPartitionError(f"a commit names {len(offsets)} partitions; at most {MAX_COMMIT_PARTITIONS} "
                                        f"per call")
        store = self._store()
        counts = topic_entries.partition_counts(store.zk, ZkPaths(self.root), topic)
        for name in offsets:
            broker, number = parse_partition_name(name)
            if number >= counts.get(broker, 0):
                raise InvalidPartitionError(
                    f"topic {topic!r} has no partition {name!r}" + (
                        f" (its partitions: {_spans(counts)})" if counts else " (no broker has the topic)"))
        return store.commit(group, topic, offsets, forward_only=bool(m.get("forward_only")),
                            identities=_identities(m))

    def fetch(self, principal: str, m: dict) -> dict:
        group, topic = m["group"], m["topic"]
        self.auth.authorize(principal, "Describe", "group", group)
        self.auth.authorize(principal, "Describe", "topic", topic)
        return self._store().fetch(group, topic, identities=_identities(m))


def _identities(m: dict) -> dict:
    """The request's ``{partition: partition log identity}`` (optional; older clients send none)."""
    ids = m.get("identities") or {}
    if not isinstance(ids, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ids.items()):
        raise ValueError("identities must be a JSON object {partition: identity}")
    return ids


def _spans(counts: dict) -> str:
    return ", ".join(f"{b}-0..{b}-{n - 1}" for b, n in sorted(counts.items()) if n)
