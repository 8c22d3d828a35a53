"""Consumer groups as a principal may see them, through the broker (``metaq.v1.Groups/DescribeGroups``,
JSON): every group it may ``Describe``, with its live members and, for each topic it may ``Describe``,
the committed offsets and owning members. The web console shows a logged-in user's groups from this, so
that the ACLs decide what each person sees; group names and offsets never come from ZooKeeper, which
keeps them readable by the brokers' identity only. A handler of its own beside server/groups.py's, on
the same service."""
from __future__ import annotations

import json
import logging
from typing import Callable

import grpc
from kazoo.exceptions import KazooException, NoNodeError

from metaq_broker.errors import MetaqError
from metaq_broker.protocol.services import DESCRIBE_GROUPS, GROUPS_SERVICE
from metaq_broker.protocol.status import code_of
from metaq_broker.zk.group_offsets import GroupStore

log = logging.getLogger(__name__)

MAX_GROUPS = 10_000  # groups one answer describes (the first, by name)


class GroupListingService:
    """``auth`` is the broker's ``BrokerAuth``; ``zk()`` its connected ZooKeeper client (None while away)."""

    def __init__(self, auth, zk: Callable, root: str):
        self.auth, self._zk, self.root = auth, zk, root

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(GROUPS_SERVICE, {
            DESCRIBE_GROUPS: grpc.unary_unary_rpc_method_handler(self._serve)})

    def _serve(self, request: bytes, context) -> bytes:
        try:
            principal = self.auth.grpc_principal(context)
            m = json.loads(request or b"{}")
            if not isinstance(m, dict) or not isinstance(m.get("group", ""), str):
                raise ValueError('expected JSON {} or {"group": ...}')
            return json.dumps({"groups": self.describe(principal, m.get("group") or None)}).encode()
        except MetaqError as e:
            context.abort(code_of(e), str(e))
        except (ValueError, TypeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"describe groups: {e}")
        except KazooException as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"ZooKeeper did not answer: {type(e).__name__}")

    def describe(self, principal: str, only=None) -> list:
        zk = self._zk()
        if zk is None:
            raise KazooException("no ZooKeeper session")
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
