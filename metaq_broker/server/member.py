"""Who this member of a broker group is (``<dataPath>/replication/member.json``, written once), and the
last group state it saw (``<dataPath>/replication/group-state``).

The uuid names the data directory, not the process: a member whose data was wiped comes back with a new
uuid, so the in-sync set (which lists ``[replicaId, uuid]``) no longer counts it and it cannot be elected
before it has copied the log again (docs/design/replication-plan.md §1, §7). The ids in the file guard
against starting a member on another member's data.

The state copy lets a group survive ZooKeeper losing its data (docs/replication.md, "ZooKeeper lost its
data"): every member keeps, durably, the newest state it read or wrote, so it still knows the last
in-sync set (whom to wait for), the roster and the highest epoch ever used.
"""
from __future__ import annotations

import json
import logging
import re
import time
import uuid as uuid_module
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from metaq_broker.errors import ConfigError
from metaq_broker.protocol.records import crc
from metaq_broker.store.durable import make_dirs, replace_file
from metaq_broker.zk.groups import GroupState

log = logging.getLogger(__name__)

DIRECTORY = "replication"
FILE = "member.json"
STATE_FILE = "group-state"
_UUID = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class MemberIdentity:
    broker_id: int
    replica_id: int
    uuid: str  # 32 lowercase hex digits
    created: float  # time.time() when the file was written
    created_now: bool = False  # True when load_or_create wrote the file: a new (or wiped) data directory

    @property
    def uuid_bytes(self) -> bytes:
        """The 16 bytes the replica fetch request carries."""
        return bytes.fromhex(self.uuid)

    def to_json(self) -> bytes:
        return (json.dumps({"brokerId": self.broker_id, "replicaId": self.replica_id, "uuid": self.uuid,
                            "created": self.created}) + "\n").encode()


def path_of(data_path) -> Path:
    return Path(data_path) / DIRECTORY / FILE


def load_or_create(data_path, broker_id: int, replica_id: int) -> MemberIdentity:
    """The identity stored under ``data_path``, or a new one (new uuid) written durably when there is none.
    ConfigError when the file belongs to another member (its ids differ from the configuration) or is
    damaged."""
    path = path_of(data_path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        identity = MemberIdentity(broker_id, replica_id, uuid_module.uuid4().hex, time.time(), created_now=True)
        make_dirs(path.parent)
        replace_file(path, identity.to_json())
        return identity
    except OSError as e:
        raise ConfigError(f"{path}: cannot read this member's identity: {e}") from None
    identity = _parse(path, raw)
    if (identity.broker_id, identity.replica_id) != (broker_id, replica_id):
        raise ConfigError(
            f"{path} says this data belongs to brokerId {identity.broker_id} replicaId {identity.replica_id}, but "
            f"the configuration says brokerId {broker_id} replicaId {replica_id}: give this member another "
            f"dataPath, or, if the data really belongs to it, delete {path} (the member then starts as a new "
            f"one and is not electable until it has copied the master's log)")
    return identity


def _parse(path: Path, raw: bytes) -> MemberIdentity:
    def damaged(why: str) -> ConfigError:
        return ConfigError(f"{path} is damaged ({why}); delete it to start this member as a new one (it is not "
                           f"electable until it has copied the master's log)")
    try:
        d = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise damaged(f"not JSON: {e}") from None
    if not isinstance(d, dict):
        raise damaged("not a JSON object")
    for key in ("brokerId", "replicaId"):
        if not isinstance(d.get(key), int) or isinstance(d.get(key), bool) or d[key] < 0:
            raise damaged(f"{key} {d.get(key)!r} is not an id")
    if not isinstance(d.get("uuid"), str) or not _UUID.match(d["uuid"]):
        raise damaged(f"uuid {d.get('uuid')!r} is not 32 lowercase hex digits")
    created = d.get("created")
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        raise damaged(f"created {created!r} is not a time")
    return MemberIdentity(d["brokerId"], d["replicaId"], d["uuid"], float(created))


class StateCopy:
    """The newest group state this member has seen, kept in ``<dataPath>/replication/group-state`` as
    ``<CRC-32C hex>\n<JSON>`` (written whole and fsynced before the member acts on the state: it wrote it
    as master, or read it). A damaged file is logged and counts as none: the member then knows no more than
    a new one, and waits for the others as a new one does."""

    def __init__(self, data_path):
        self.path = Path(data_path) / DIRECTORY / STATE_FILE
        self.state: Optional[GroupState] = None
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        try:
            head, _, body = raw.partition(b"\n")
            if int(head, 16) != crc(body):
                raise ValueError("checksum mismatch")
            self.state = GroupState.from_copy(json.loads(body))
        except (ValueError, UnicodeDecodeError) as e:
            log.error("%s is damaged (%s): this member does not know its group's last state (it waits for the "
                      "others after ZooKeeper loses the group's data, as a new member would)", self.path, e)

    def keep(self, state: GroupState) -> bool:
        """Remember ``state`` durably if it is newer than the one kept; True if it was."""
        if state.version < 0 or not state.newer(self.state):
            return False
        body = json.dumps(state.to_copy(), sort_keys=True).encode()
        make_dirs(self.path.parent)
        replace_file(self.path, b"%08x\n" % crc(body) + body)
        self.state = state
        return True
