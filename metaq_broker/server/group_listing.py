"""Consumer groups as a principal may see them, through the broker (``metaq.v1.Groups/DescribeGroups``,
JSON): every group it may ``Describe``, with its live members and, for each topic it may ``Describe``,
the committed offsets and owning members. The web console shows a logged-in user's groups from this, so
that the ACLs decide what each person sees; group names and offsets never come from ZooKeeper, which
keeps them readable by the brokers' identity only. A handler of its own beside server/group_offsets_service.py's, on
the same service."""
from __future__ import annotations

from typing import Callable

import grpc
from kazoo.exceptions import NoNodeError

from metaq_broker.protocol.services import DESCRIBE_GROUPS, GROUPS_SERVICE
from metaq_broker.server.json_rpc import connected, json_method
from metaq_broker.zk.group_offsets import GroupStore

MAX_GROUPS = 10_000  # groups one answer describes (the first, by name)


class GroupListingService:
    """``auth`` is the broker's ``BrokerAuth``; ``zk()`` its connected ZooKeeper client (None while away)."""

    def __init__(self, auth, zk: Callable, root: str):
        self.auth, self._zk, self.root = auth, zk, root

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(GROUPS_SERVICE, {
            DESCRIBE_GROUPS: json_method(self.auth, self._describe, "describe groups")})

    def _describe(self, principal: str, m: dict) -> dict:
        if not isinstance(m.get("group", ""), str):
            raise ValueError('expected JSON {} or {"group": ...}')
        return {"groups": self.describe(principal, m.get("group") or None)}

    def describe(self, principal: str, only=None) -> list:
        zk = connected(self._zk)
        store = GroupStore(zk, self.root)
        names = [only] if only else store.groups()
        out = []
        for group in names:
            if not self.auth.allows(principal, "Describe", "group", group):
                continue
            if len(out) == MAX_GROUPS:
                break
            try:
                topics = {}
                for topic in store.group_topics(group):
                    if self.auth.allows(principal, "Describe", "topic", topic):
                        topics[topic] = {"offsets": store.fetch(group, topic), "owners": store.owners(group, topic)}
                out.append({"group": group, "members": store.members(group), "topics": topics})
            except NoNodeError:
                continue  # deleted meanwhile
        return out
