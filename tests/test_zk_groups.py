"""A replicated broker group's ZooKeeper state (zk/groups.py) against a real ZooKeeper: the first election
creates it, two members racing on the same state give exactly one master, a stale in-sync write fails,
member nodes, resigning, taking over the nodes of a dead previous run."""
import json
import threading

import pytest

from metaq_broker.zk import groups
from metaq_broker.zk.groups import ElectionLostError, GroupState, MemberHeldError, StaleStateError
from metaq_broker.zk.paths import ZkPaths

pytestmark = pytest.mark.unit

U0, U1, U2 = "0" * 31 + "a", "1" * 31 + "b", "2" * 31 + "c"


def test_paths_of_a_group():
    p = ZkPaths("/meta")
    assert p.group_state(1) == "/meta/brokers/groups/1/state"
    assert p.group_members(1) == "/meta/brokers/groups/1/members"
    assert p.group_replica(1, 2) == "/meta/brokers/groups/1/members/2"
    assert p.group_starting(1, 2) == "/meta/brokers/groups/1/starting/2"
    assert p.group("g") == "/meta/consumers/g"  # consumer groups unchanged
    with pytest.raises(ValueError, match="replica id must be non-negative"):
        p.group_replica(1, -1)


def test_state_json_round_trip():
    s = GroupState(7, 1, ((0, U0), (1, U1)), (0, 1, 2), False, 12.5)
    back = GroupState.from_json(s.to_json(), 3)
    assert back == GroupState(7, 1, ((0, U0), (1, U1)), (0, 1, 2), False, 12.5, 3)
    assert back.in_isr(1, U1) and not back.in_isr(1, U2) and not back.in_isr(2, U2)
    assert GroupState.from_json(b'{"epoch":7,"master":1,"isr":[[1,"%s"],[0,"%s"]],"replicas":[1,0]}'
                                % (U1.encode(), U0.encode())).isr == ((0, U0), (1, U1))
    for bad in (b"[]", b"{}", b'{"epoch":1,"master":0,"isr":[[0]]}', b'{"epoch":1,"master":0,"isr":[[0,"a"],[0,"b"]]}',
                b'{"epoch":-1,"master":0,"isr":[]}', b"not json"):
        with pytest.raises(ValueError, match="broker group's"):
            GroupState.from_json(bad)


def test_bootstrap_then_failover(zk_clients):
    make, paths = zk_clients
    a, b = make(), make()
    assert groups.read_state(a, paths, 1) is None
    s1 = groups.elect(a, paths, 1, 0, U0, b'{"replicaId": 0}', None)
    assert (s1.epoch, s1.master, s1.isr, s1.replicas, s1.version) == (1, 0, ((0, U0),), (0,), 0)
    assert groups.read_state(b, paths, 1) == s1
    data, stat = b.get(paths.broker(1))
    assert data == b'{"replicaId": 0}' and stat.ephemeralOwner == a.client_id[0]

    s2 = groups.alter_isr(a, paths, 1, s1, [(0, U0), (1, U1)])  # the master expands the set
    assert s2.isr == ((0, U0), (1, U1)) and s2.replicas == (0, 1) and s2.version == 1
    assert groups.read_state(b, paths, 1) == s2

    a.stop()  # the master's session ends: its ids node goes
    s3 = groups.elect(b, paths, 1, 1, U1, b'{"replicaId": 1}', groups.read_state(b, paths, 1))
    assert (s3.epoch, s3.master, s3.isr, s3.replicas, s3.version) == (2, 1, ((1, U1),), (0, 1), 2)
    assert groups.read_state(b, paths, 1) == s3 and b.get(paths.broker(1))[0] == b'{"replicaId": 1}'


def test_election_keeps_members_other_than_the_old_master(zk_clients):
    make, paths = zk_clients
    a = make()
    s = groups.elect(a, paths, 2, 0, U0, b"{}", None)
    s = groups.alter_isr(a, paths, 2, s, [(0, U0), (1, U1), (2, U2)])
    assert groups.resign(a, paths, 2) and a.exists(paths.broker(2)) is None
    s = groups.elect(a, paths, 2, 2, U2, b"{}", s)
    assert (s.epoch, s.master, s.isr) == (2, 2, ((1, U1), (2, U2)))
    with pytest.raises(ValueError, match="not in group 2's in-sync set"):
        groups.elect(a, paths, 2, 0, U0, b"{}", s)  # out of the set: clean elections refuse it
    assert groups.resign(a, paths, 2)
    s = groups.elect(a, paths, 2, 0, U0, b"{}", s, unclean=True)
    assert (s.epoch, s.master, s.isr, s.unclean, s.replicas) == (3, 0, ((0, U0),), True, (0, 1, 2))


def _race(clients_and_args):
    """Run elect in threads at once; [(state or exception)] in order."""
    out = [None] * len(clients_and_args)
    start = threading.Barrier(len(clients_and_args))

    def run(i, args):
        start.wait()
        try:
            out[i] = groups.elect(*args)
        except Exception as e:  # noqa: BLE001 - collected for the assertions
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(clients_and_args)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_bootstrap_race_has_one_winner(zk_clients):
    make, paths = zk_clients
    zks = [make() for _ in range(3)]
    uuids = (U0, U1, U2)
    out = _race([(zk, paths, 3, r, uuids[r], b'{"r": %d}' % r, None) for r, zk in enumerate(zks)])
    won = [s for s in out if isinstance(s, GroupState)]
    assert len(won) == 1 and all(isinstance(e, ElectionLostError) for e in out if e is not won[0])
    state = groups.read_state(zks[0], paths, 3)
    assert state == won[0] and state.epoch == 1
    data, stat = zks[0].get(paths.broker(3))
    assert data == b'{"r": %d}' % state.master and stat.ephemeralOwner == zks[state.master].client_id[0]


def test_election_race_on_the_same_state_has_one_winner(zk_clients):
    make, paths = zk_clients
    zks = [make() for _ in range(3)]
    s = groups.elect(zks[0], paths, 4, 0, U0, b"{}", None)
    s = groups.alter_isr(zks[0], paths, 4, s, [(0, U0), (1, U1), (2, U2)])
    zks[0].stop()  # the master dies; both others saw the same state
    out = _race([(zks[r], paths, 4, r, (U0, U1, U2)[r], b"{}", s) for r in (1, 2)])
    won = [x for x in out if isinstance(x, GroupState)]
    lost = [x for x in out if isinstance(x, ElectionLostError)]
    assert len(won) == 1 and len(lost) == 1, out
    state = groups.read_state(zks[1], paths, 4)
    assert state == won[0] and state.epoch == 2 and state.master in (1, 2)
    assert state.isr == ((1, U1), (2, U2))  # the old master left, the loser kept
    # the loser's stale in-sync write fails: the election bumped the version
    with pytest.raises(StaleStateError, match="group 4"):
        groups.alter_isr(zks[1], paths, 4, s, [(0, U0)])
    # the winner's master node is in place; the loser's transaction left nothing behind
    assert zks[1].get(paths.broker(4))[1].ephemeralOwner == zks[state.master].client_id[0]


def test_election_fails_while_the_master_node_is_held(zk_clients):
    make, paths = zk_clients
    a, b = make(), make()
    s = groups.elect(a, paths, 5, 0, U0, b"{}", None)
    s = groups.alter_isr(a, paths, 5, s, [(0, U0), (1, U1)])
    with pytest.raises(ElectionLostError, match="NodeExistsError"):
        groups.elect(b, paths, 5, 1, U1, b"{}", s)
    assert groups.read_state(b, paths, 5) == s  # the multi-op changed nothing
    assert not groups.resign(b, paths, 5)  # not b's node
    assert a.exists(paths.broker(5)) is not None


def test_alter_isr_must_keep_the_master(zk_clients):
    make, paths = zk_clients
    a = make()
    s = groups.elect(a, paths, 6, 0, U0, b"{}", None)
    with pytest.raises(ValueError, match="must hold its master 0"):
        groups.alter_isr(a, paths, 6, s, [(1, U1)])


def test_member_nodes(zk_clients):
    make, paths = zk_clients
    a, b = make(), make()
    assert groups.members(a, paths, 7) == {}
    groups.register_member(a, paths, 7, 0, {"host": "h", "port": 1, "uuid": U0})
    groups.register_member(a, paths, 7, 0, {"host": "h", "port": 2, "uuid": U0})  # our own: replaced
    groups.register_member(b, paths, 7, 1, {"host": "h", "port": 3, "uuid": U1})
    assert groups.members(b, paths, 7) == {0: {"host": "h", "port": 2, "uuid": U0},
                                           1: {"host": "h", "port": 3, "uuid": U1}}
    with pytest.raises(MemberHeldError, match="held by ZooKeeper session") as held:
        groups.register_member(b, paths, 7, 0, {"host": "x"})
    assert held.value.owner == a.client_id[0]
    assert a.get(paths.group_replica(7, 0))[1].ephemeralOwner == a.client_id[0]
    a.stop()  # ephemeral: gone with the session
    assert groups.members(b, paths, 7) == {1: {"host": "h", "port": 3, "uuid": U1}}


def test_take_over_stale_deletes_only_nodes_naming_this_run(zk_clients):
    """A restarted member deletes the member and master nodes its dead previous run's session holds: only
    where replicaId, uuid and instance (the locked data directory) are its own, never its own session's."""
    make, paths = zk_clients
    old, new, other = make(), make(), make()
    mine = {"replicaId": 0, "uuid": U0, "instance": "boot:1:42"}
    groups.register_member(old, paths, 8, 0, mine)
    groups.elect(old, paths, 8, 0, U0, json.dumps(mine).encode(), None)
    groups.register_member(other, paths, 8, 1, {"replicaId": 1, "uuid": U1, "instance": "boot:1:42"})
    for instance, uuid in (("boot:1:43", U0), ("other-boot:1:42", U0), ("boot:1:42", U2)):  # a copy, or wiped
        assert groups.take_over_stale(new, paths, 8, 0, uuid, instance) == []
    assert old.exists(paths.broker(8)) is not None and old.exists(paths.group_replica(8, 0)) is not None
    assert groups.take_over_stale(old, paths, 8, 0, U0, "boot:1:42") == []  # its own session: nothing stale
    taken = groups.take_over_stale(new, paths, 8, 0, U0, "boot:1:42")
    assert taken == [(paths.group_replica(8, 0), old.client_id[0]), (paths.broker(8), old.client_id[0])]
    assert new.exists(paths.broker(8)) is None and new.exists(paths.group_replica(8, 0)) is None
    assert new.exists(paths.group_replica(8, 1)) is not None  # another member's node stays
    groups.register_member(new, paths, 8, 0, mine)  # the restarted run registers at once
    assert groups.take_over_stale(new, paths, 8, 0, U0, "boot:1:42") == []


def test_starting_members_master_node_and_addresses(zk_clients):
    make, paths = zk_clients
    zk = make()
    assert groups.starting(zk, paths, 1) == set() and groups.master_node(zk, paths, 1) is None
    zk.create(paths.group_starting(1, 2), b"{}", makepath=True)
    zk.create(f"{paths.group_startings(1)}/not-a-replica", b"{}")
    assert groups.starting(zk, paths, 1) == {2}  # replicaIds as numbers, other names left out
    zk.create(paths.broker(1), json.dumps({"host": "h", "port": 7, "dataPort": 8, "replicaId": 2}).encode(),
              makepath=True)
    node = groups.master_node(zk, paths, 1)
    assert node["replicaId"] == 2 and groups.addresses(node) == ("h:7", "h:8")
    assert groups.addresses({"host": "h", "port": 7}) == ("h:7", "")
    with pytest.raises(ValueError):
        groups.addresses({"host": "h", "port": "x"})
