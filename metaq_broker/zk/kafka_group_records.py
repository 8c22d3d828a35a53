"""A Kafka consumer group's record in ZooKeeper, ``<root>/consumers/<group>/kafka``, kept by the group's
coordinator (``server/kafka_groups.py``) beside the group's offsets (``zk/group_offsets.py``), as Kafka keeps
group metadata beside offsets in ``__consumer_offsets``: the generation, the chosen protocol, the leader and
each member with its subscription and assignment. A coordinator that takes a group over (the old one
stopped or died) loads it, so members keep their generation and assignment without a rebalance, and
generations never go back.

JSON: ``{"version": 1, "generation": g, "protocolType": "consumer", "protocol": "range", "leader": id,
"members": [{"memberId", "instanceId", "clientId", "clientHost", "sessionTimeoutMs", "rebalanceTimeoutMs",
"metadata": base64, "assignment": base64}, ...]}``. Writes are conditioned on the version the writer read or
wrote last, so of two brokers that both believe they coordinate the group (one with an old view of the live
brokers) the second write fails and that broker gives the group up (``GroupMovedError``).

Each live member of a Kafka group also has an ephemeral ``<root>/consumers/<group>/ids/<memberId>`` of the
coordinator's session, as metaq's own consumers do, so ``metaq groups`` and the console see it and resets
and deletes are refused while it lives. Its data, ``{"kafka": true, "broker": <coordinator>}``, names no
topic, so metaq's own consumers, which balance over the members listing a topic, never count it; and a node
without it is one of metaq's own consumers."""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Optional

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from metaq_broker.errors import MetaqError
from metaq_broker.zk.paths import ZkPaths, check_component
from metaq_broker.zk.session import children

MAX_RECORD = 512 << 10  # bytes; ZooKeeper's jute.maxbuffer is 1 MiB. Larger: written without its members


class GroupMovedError(MetaqError):
    """The record changed under the writer: another broker coordinates the group now (or it was deleted)."""


@dataclass(frozen=True)
class MemberRecord:
    member_id: str
    instance_id: Optional[str]
    client_id: str
    client_host: str
    session_timeout_ms: int
    rebalance_timeout_ms: int
    metadata: bytes  # the member's metadata for the group's protocol
    assignment: bytes


@dataclass(frozen=True)
class GroupRecord:
    generation: int
    protocol_type: Optional[str]
    protocol: Optional[str]
    leader: Optional[str]
    members: tuple = ()  # MemberRecord, in join order

    def to_json(self) -> bytes:
        body = {"version": 1, "generation": self.generation, "protocolType": self.protocol_type,
                "protocol": self.protocol, "leader": self.leader}
        members = [{"memberId": m.member_id, "instanceId": m.instance_id, "clientId": m.client_id,
                    "clientHost": m.client_host, "sessionTimeoutMs": m.session_timeout_ms,
                    "rebalanceTimeoutMs": m.rebalance_timeout_ms, "metadata": _b64(m.metadata),
                    "assignment": _b64(m.assignment)} for m in self.members]
        data = json.dumps({**body, "members": members}).encode()
        if len(data) > MAX_RECORD:  # the generation still counts: a takeover rebalances, from generation + 1
            data = json.dumps({**body, "members": [], "membersLeftOut": len(members)}).encode()
        return data

    @classmethod
    def from_json(cls, data: bytes) -> "GroupRecord":
        """ValueError naming the problem for data that is not a group record."""
        try:
            d = json.loads(data)
            if not isinstance(d, dict) or d.get("version") != 1:
                raise ValueError("not version 1")
            members = tuple(MemberRecord(str(m["memberId"]), _opt_str(m.get("instanceId")), str(m["clientId"]),
                                         str(m["clientHost"]), int(m["sessionTimeoutMs"]), int(m["rebalanceTimeoutMs"]),
                                         base64.b64decode(m["metadata"], validate=True),
                                         base64.b64decode(m["assignment"], validate=True)) for m in d["members"])
            generation = int(d["generation"])
            if generation < 0:
                raise ValueError(f"generation {generation}")
            return cls(generation, _opt_str(d.get("protocolType")), _opt_str(d.get("protocol")),
                       _opt_str(d.get("leader")), members)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a Kafka group record ({e}): {bytes(data[:200])!r}") from None


def _b64(raw: bytes) -> str:
    return base64.b64encode(bytes(raw)).decode("ascii")


def _opt_str(v) -> Optional[str]:
    return None if v is None else str(v)


def read(zk, paths: ZkPaths, group: str) -> tuple:
    """(GroupRecord or None, the node's version or None); ValueError for a damaged record."""
    try:
        data, stat = zk.get(paths.group_kafka(group))
    except NoNodeError:
        return None, None
    return GroupRecord.from_json(data), stat.version


def write(zk, paths: ZkPaths, group: str, record: GroupRecord, version: Optional[int]) -> int:
    """Write ``record`` over the version ``version`` (None: there was none: create it); the new version.
    GroupMovedError when the node is not at that version any more."""
    path = paths.group_kafka(group)
    try:
        if version is None:
            zk.create(path, record.to_json(), makepath=True)
            return 0
        return zk.set(path, record.to_json(), version=version).version
    except (BadVersionError, NodeExistsError, NoNodeError):
        raise GroupMovedError(f"the Kafka record of group {group!r} ({path}) was changed by another broker or "
                              f"deleted since version {version}") from None


def add_member(zk, paths: ZkPaths, group: str, member_id: str, broker_id: int) -> None:
    """The ephemeral node of a live Kafka member (this session's); one this session has is kept."""
    path = paths.group_member(group, check_component("member id", member_id))
    zk.ensure_path(paths.group_ids(group))
    while True:
        try:
            zk.create(path, json.dumps({"kafka": True, "broker": broker_id}).encode(), ephemeral=True)
            return
        except NodeExistsError:
            stat = zk.exists(path)
            if stat is None:
                continue  # gone meanwhile
            if stat.ephemeralOwner == zk.client_id[0]:
                return
            raise


def remove_member(zk, paths: ZkPaths, group: str, member_id: str) -> None:
    try:
        zk.delete(paths.group_member(group, member_id))
    except NoNodeError:
        pass


def is_kafka_member(data: bytes) -> bool:
    try:
        return json.loads(data).get("kafka") is True
    except (ValueError, AttributeError):
        return False


def native_members(zk, paths: ZkPaths, group: str) -> list:
    """Live members of ``group`` that are metaq's own consumers (not a Kafka coordinator's), sorted."""
    out = []
    for name in children(zk, paths.group_ids(group)):
        try:
            if not is_kafka_member(zk.get(paths.group_member(group, name))[0]):
                out.append(name)
        except NoNodeError:
            continue
    return sorted(out)
