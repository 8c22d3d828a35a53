"""A replicated broker group's state in ZooKeeper (docs/protocol.md, "ZooKeeper layout"; plan §1).

``<root>/brokers/groups/<b>/state`` holds the epoch, the master and the in-sync set; it changes only by
versioned writes, so of two members acting on the same state exactly one succeeds. An election is one
multi-op that also creates the ephemeral master node clients route by (``ZkPaths.broker``,
``brokers/metaq/ids/<b>``): the epoch bump and the master's node appear together or not at all. Before
issue 28 that node was ``brokers/ids/<b>``, now MetaQ's persistent node: every election makes sure it
exists, so a member of that older layout can never create its master node there beside a newer master,
and a newer member follows (``master_data``) but never stands against an older master that holds it.
``members/<r>`` are the live members' ephemeral nodes.
The broker's group logic (server/member_role.py) decides who may stand; this module only reads and writes."""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Optional

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, RolledBackError, RuntimeInconsistency

from metaq_broker.errors import ElectionLostError, MetaqError, StaleStateError
from metaq_broker.zk.metaq_layout import MetaqZkLayout
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import children

__all__ = ["GroupState", "ElectionLostError", "StaleStateError", "MemberHeldError", "read_state", "elect",
           "alter_isr", "register_member", "members", "starting", "master_node", "master_data", "addresses",
           "resign", "delete_own", "take_over_stale"]


class MemberHeldError(MetaqError):
    """The member node is held by another ZooKeeper session: this member's crashed run (wait for it to
    expire) or another process configured with the same replicaId."""

    def __init__(self, path: str, owner: int, data: bytes):
        super().__init__(f"{path} is held by ZooKeeper session 0x{owner:x}")
        self.path, self.owner, self.data = path, owner, data


def _isr(entries) -> tuple:
    """``[[replicaId, uuid], ...]`` as a tuple of (int, str) by replicaId, one entry per replica."""
    out = {}
    for entry in entries:
        rid, uuid = entry
        if isinstance(rid, bool) or not isinstance(rid, int) or rid < 0 or not isinstance(uuid, str):
            raise ValueError(f"in-sync entry {entry!r} is not [replicaId, uuid]")
        if rid in out:
            raise ValueError(f"replica {rid} is in the in-sync set twice")
        out[rid] = uuid
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class GroupState:
    epoch: int
    master: int
    isr: tuple  # ((replicaId, uuid), ...), by replicaId; the master is in it
    replicas: tuple  # every member ever seen (the roster), by replicaId
    unclean: bool = False  # the master was elected from outside the in-sync set
    since: float = 0.0  # time.time() when this epoch began
    version: int = -1  # the state node's ZooKeeper version this was read at (-1: not read)

    def to_json(self) -> bytes:
        return json.dumps({"epoch": self.epoch, "master": self.master, "isr": [list(e) for e in self.isr],
                           "replicas": list(self.replicas), "unclean": self.unclean,
                           "since": self.since}).encode()

    @classmethod
    def from_json(cls, data, version: int = -1) -> "GroupState":
        """ValueError naming the problem if ``data`` is not a group state."""
        try:
            d = json.loads(data)
            state = cls(int(d["epoch"]), int(d["master"]), _isr(d["isr"]),
                        tuple(sorted({int(r) for r in d.get("replicas", ())})), bool(d.get("unclean", False)),
                        float(d.get("since", 0.0)), version)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"not a broker group's state: {e}: {data[:200]!r}") from None
        if state.epoch < 0:
            raise ValueError(f"a broker group's epoch is never negative: {state.epoch}")
        return state

    def to_copy(self) -> dict:
        """What a member keeps of the last state it saw (its data directory, its member node): the state
        and the ZooKeeper version it was read or written at. Copies order by ``newer``."""
        return {**json.loads(self.to_json()), "version": self.version}

    @classmethod
    def from_copy(cls, d) -> "GroupState":
        """A ``to_copy`` dict back; ValueError naming the problem."""
        if not isinstance(d, dict):
            raise ValueError(f"not a broker group's state: {d!r:.200}")
        version = d.get("version", -1)
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"not a broker group's state: version {version!r}")
        return cls.from_json(json.dumps(d), version)

    def newer(self, other: Optional["GroupState"]) -> bool:
        """Later than ``other`` in the state's history: a higher epoch, or the same epoch at a higher
        version (in-sync changes within an epoch). Epochs only grow, also across a ZooKeeper that lost its
        data (the recreated node starts at version 0 with a higher epoch)."""
        return other is None or (self.epoch, self.version) > (other.epoch, other.version)

    def in_isr(self, replica_id: int, uuid: str) -> bool:
        """True when this replica, with this data directory (uuid), is in the in-sync set."""
        return (replica_id, uuid) in self.isr

    @property
    def isr_ids(self) -> tuple:
        return tuple(r for r, _ in self.isr)


def read_state(zk, paths: ZkPaths, broker_id: int) -> Optional[GroupState]:
    """The group's state, or None when it has none yet (never elected)."""
    try:
        data, stat = zk.get(paths.group_state(broker_id))
    except NoNodeError:
        return None
    return GroupState.from_json(data, stat.version)


def _failure(results) -> Optional[Exception]:
    """The error that failed a multi-op (the others are rolled back), or None if it committed."""
    errors = [r for r in results if isinstance(r, Exception)]
    real = [e for e in errors if not isinstance(e, (RolledBackError, RuntimeInconsistency))]
    return (real or errors or [None])[0]


def elect(zk, paths: ZkPaths, broker_id: int, replica_id: int, uuid: str, broker_node_data: bytes,
          prior: Optional[GroupState], acl=None, unclean: bool = False, min_epoch: int = 1,
          recovered: Optional[GroupState] = None) -> GroupState:
    """Become master of the group in one multi-op: the state written at ``prior``'s version (created when
    ``prior`` is None: the first election ever, or after ZooKeeper lost the group's state) and
    the master node created ephemeral with ``broker_node_data``. The new in-sync set is ``prior``'s
    less its master (not known to be caught up) and with this member; with ``unclean`` only this member.
    ``recovered`` (with ``prior`` None): the last state the members kept of a group whose ZooKeeper state
    is lost; its in-sync set (the caller checked every member of it is alive with the same data) and
    roster carry over. ElectionLostError when someone else changed the state or holds the master node;
    the state written (with its new version) otherwise. ``acl`` is for every node created, parents
    included (a broker passes ``session.public_acl``: clients read them). ``min_epoch``: above every epoch
    any live member has seen (its log, its copy of the state): an epoch number is never used twice."""
    if prior is not None and not unclean and not prior.in_isr(replica_id, uuid):
        raise ValueError(f"replica {replica_id} ({uuid}) is not in group {broker_id}'s in-sync set "
                         f"{list(prior.isr)}: only an unclean election may make it master")
    zk.ensure_path(paths.broker_group(broker_id), acl)
    zk.ensure_path(paths.broker_ids(), acl)
    fence = MetaqZkLayout(paths.root).broker(broker_id)
    zk.ensure_path(fence, acl)
    fence_stat = zk.exists(fence)
    if fence_stat is None or fence_stat.ephemeralOwner:
        raise ElectionLostError(f"group {broker_id}: {fence} is the master node of a broker of the layout before "
                                f"issue 28: it is master")
    me = (replica_id, uuid)
    now = time.time()
    t = zk.transaction()
    if prior is None:
        base = recovered if recovered is not None and not unclean else None
        isr = _isr(tuple(e for e in base.isr if e[0] != replica_id) + (me,)) if base is not None else (me,)
        roster = set(recovered.replicas) | {r for r, _ in recovered.isr} if recovered is not None else set()
        epoch = max(1, min_epoch, recovered.epoch + 1 if recovered is not None else 1)
        state = GroupState(epoch, replica_id, isr, tuple(sorted(roster | {replica_id})), unclean, now)
        t.create(paths.group_state(broker_id), state.to_json(), acl)
    else:
        kept = () if unclean else tuple(e for e in prior.isr if e[0] not in (prior.master, replica_id))
        state = GroupState(max(prior.epoch + 1, min_epoch), replica_id, _isr(kept + (me,)),
                           tuple(sorted(set(prior.replicas) | {replica_id})), unclean, now)
        t.set_data(paths.group_state(broker_id), state.to_json(), prior.version)
    t.check(fence, fence_stat.version)
    t.create(paths.broker(broker_id), broker_node_data, acl, ephemeral=True)
    results = t.commit()
    error = _failure(results)
    if isinstance(error, (BadVersionError, NodeExistsError, NoNodeError)):
        raise ElectionLostError(f"group {broker_id}: replica {replica_id} lost the election for epoch "
                                f"{state.epoch} ({type(error).__name__})")
    if error is not None:
        raise error
    version = 0 if prior is None else results[0].version
    return dataclasses.replace(state, version=version)


def alter_isr(zk, paths: ZkPaths, broker_id: int, state: GroupState, isr) -> GroupState:
    """Write a new in-sync set (the master's shrink or expansion) at ``state``'s version; StaleStateError
    when the state changed since (a new election: the writer is no longer master)."""
    isr = _isr(isr)
    if state.master not in (r for r, _ in isr):
        raise ValueError(f"group {broker_id}: the in-sync set {list(isr)} must hold its master {state.master}")
    new = dataclasses.replace(state, isr=isr, replicas=tuple(sorted(set(state.replicas) | {r for r, _ in isr})))
    try:
        stat = zk.set(paths.group_state(broker_id), new.to_json(), version=state.version)
    except (BadVersionError, NoNodeError) as e:
        raise StaleStateError(f"group {broker_id}: the state changed after version {state.version} "
                              f"(epoch {state.epoch}); not written ({type(e).__name__})") from None
    return dataclasses.replace(new, version=stat.version)


def register_member(zk, paths: ZkPaths, broker_id: int, replica_id: int, info: dict, acl=None) -> None:
    """Create this member's ephemeral node with ``info`` (JSON), or replace its data when our own session
    already holds it; MemberHeldError when another session does."""
    path = paths.group_replica(broker_id, replica_id)
    data = json.dumps(info, sort_keys=True).encode()
    zk.ensure_path(paths.group_members(broker_id), acl)
    while True:
        try:
            zk.create(path, data, acl, ephemeral=True)
            return
        except NodeExistsError:
            pass
        try:
            held, stat = zk.get(path)
        except NoNodeError:
            continue  # just went away: create it
        if stat.ephemeralOwner != zk.client_id[0]:
            raise MemberHeldError(path, stat.ephemeralOwner, held)
        try:
            zk.set(path, data, version=stat.version)
            return
        except (BadVersionError, NoNodeError):
            continue


def members(zk, paths: ZkPaths, broker_id: int) -> dict:
    """{replicaId: member node JSON} of the group's live members."""
    root = paths.group_members(broker_id)
    out = {}
    for name in children(zk, root):
        try:
            out[int(name)] = json.loads(zk.get(f"{root}/{name}")[0])
        except (NoNodeError, ValueError):
            continue  # gone meanwhile, or not a member's
    return out


def starting(zk, paths: ZkPaths, broker_id: int) -> set:
    """replicaIds of the group's members waiting for their previous run's session to expire."""
    return {int(c) for c in children(zk, paths.group_startings(broker_id)) if c.isdigit()}


def master_data(zk, paths: ZkPaths, broker_id: int) -> tuple:
    """(data, stat) of the group's master node, or of a master of the layout before issue 28 (its ephemeral
    node at MetaQ's ``brokers/ids/<b>``: a rolling upgrade); (None, None) without a master."""
    try:
        return zk.get(paths.broker(broker_id))
    except NoNodeError:
        pass
    try:
        data, stat = zk.get(MetaqZkLayout(paths.root).broker(broker_id))
    except NoNodeError:
        return None, None
    return (data, stat) if stat.ephemeralOwner else (None, None)


def master_node(zk, paths: ZkPaths, broker_id: int) -> Optional[dict]:
    """The JSON of the master node (the master's addresses, its ``replicaId``), None without a master."""
    data, _ = master_data(zk, paths, broker_id)
    return None if data is None else json.loads(data)


def addresses(node: dict) -> tuple:
    """("host:port", "host:dataPort") of a member or master node's JSON, "" for a port it does not give;
    ValueError for a port that is not a number."""
    host = node.get("host", "")
    port, data_port = node.get("port"), node.get("dataPort")
    return (f"{host}:{int(port)}" if port else "", f"{host}:{int(data_port)}" if data_port else "")


def resign(zk, paths: ZkPaths, broker_id: int) -> bool:
    """Delete the master node if our session holds it (a master stepping down); True if deleted."""
    return delete_own(zk, paths.broker(broker_id))


def delete_own(zk, path: str) -> bool:
    """Delete ``path`` if it is this session's ephemeral node; True if it did."""
    try:
        stat = zk.exists(path)
        if stat is None or stat.ephemeralOwner != zk.client_id[0]:
            return False
        zk.delete(path, version=stat.version)
        return True
    except (NoNodeError, BadVersionError):
        return False


def take_over_stale(zk, paths: ZkPaths, broker_id: int, replica_id: int, uuid: str, instance: str) -> list:
    """Delete this member's member node and master node (also one at ``brokers/ids/<b>``, the layout before
    issue 28) where another session holds them with this member's ``uuid`` and ``instance``; returns
    ``[(path, session), ...]`` deleted.

    ``instance`` names the data directory's lock file (boot id, device, inode) that the caller holds locked:
    the run that wrote it into those nodes held the same lock, so it is dead, and its session, which
    ZooKeeper would expire only after the session timeout, can act no more. Another process sharing the
    uuid (a copied data directory, here or on another host) has another instance: its nodes stay."""
    taken = []
    for path in (paths.group_replica(broker_id, replica_id), paths.broker(broker_id),
                 MetaqZkLayout(paths.root).broker(broker_id)):
        try:
            data, stat = zk.get(path)
        except NoNodeError:
            continue
        if stat.ephemeralOwner in (0, zk.client_id[0]):
            continue
        try:
            info = json.loads(data)
        except ValueError:
            continue
        if not isinstance(info, dict) or (info.get("replicaId"), info.get("uuid"), info.get("instance")) != \
                (replica_id, uuid, instance):
            continue
        try:
            zk.delete(path, version=stat.version)
        except (NoNodeError, BadVersionError):
            continue
        taken.append((path, stat.ephemeralOwner))
    return taken
