"""The classic consumer-group protocol's state machine (server/kafka_coordinator.py) driven step by step with a
fake clock: member ids (KIP-394), joins, the leader's assignment, heartbeats in every state, members leaving
and timing out, the rebalance, sync and initial-delay timeouts, static members, offset-commit checks, storage
failures, a group taken over from its record and given up. Every answer is also encoded with the Kafka codec
at each version served, so a body a client cannot read fails here."""
import collections
import threading
import time

import pytest

from metaq_broker.protocol.kafka import codes
from metaq_broker.protocol.kafka.messages import APIS
from metaq_broker.protocol.kafka.schema import decode, encode_parts
from metaq_broker.server.kafka_coordinator import (COMPLETING, DEAD, EMPTY, PREPARING, STABLE, GroupCoordinator,
                                                    Persistence)
from metaq_broker.zk.kafka_group_records import GroupMovedError, GroupRecord, MemberRecord

pytestmark = pytest.mark.unit

JOIN, SYNC, HEARTBEAT, LEAVE, DESCRIBE = 11, 14, 12, 13, 15
SESSION, REBALANCE = 10_000, 30_000


def readable(api_key: int, body: dict, versions=None) -> dict:
    """``body`` encoded and decoded at every served version (or ``versions``); the decoded newest."""
    api = APIS[api_key]
    lo, hi = api.supported
    out = None
    for v in versions or range(lo, hi + 1):
        flexible = api.is_flexible(v)
        raw = b"".join(bytes(p) for p in encode_parts(api.response, v, flexible, body))
        out, _ = decode(api.response, v, flexible, raw)
    return out


class Recorder(Persistence):
    """Keeps what the coordinator stores, answering at once or when told (``hold``)."""

    def __init__(self):
        self.records, self.members, self.held, self.hold, self.fail = [], [], [], False, None

    def store(self, group_id, record, done):
        self.records.append((group_id, record))
        if self.hold:
            self.held.append(done)
        else:
            done(self.fail)

    def members_changed(self, group_id, member_ids):
        self.members.append((group_id, member_ids))


@pytest.fixture
def rec():
    return Recorder()


@pytest.fixture
def coord(clock, rec):
    return GroupCoordinator(clock, rec, initial_rebalance_delay_ms=0)


def join(c, member="", group="g", version=9, protocols=(("range", b"m"),), instance=None, session=SESSION,
         rebalance=REBALANCE, protocol_type="consumer", client="app"):
    return c.join_group({"group_id": group, "member_id": member, "group_instance_id": instance,
                         "session_timeout_ms": session, "rebalance_timeout_ms": rebalance,
                         "protocol_type": protocol_type,
                         "protocols": [{"name": n, "metadata": m} for n, m in protocols]}, version, client, "/10.0.0.1")


def sync(c, member, generation, assignments=(), group="g"):
    return c.sync_group({"group_id": group, "generation_id": generation, "member_id": member,
                         "group_instance_id": None, "protocol_type": "consumer", "protocol_name": None,
                         "assignments": [{"member_id": m, "assignment": a} for m, a in assignments]})


def beat(c, member, generation, group="g", instance=None):
    return readable(HEARTBEAT, c.heartbeat({"group_id": group, "generation_id": generation, "member_id": member,
                                            "group_instance_id": instance}))["error_code"]


def result(fut):
    assert fut.done(), "the request is still parked"
    return readable(JOIN if "generation_id" in fut.result() else SYNC, fut.result())


def new_member(c, **kw) -> str:
    """A member id by KIP-394's round trip (MEMBER_ID_REQUIRED first)."""
    first = result(join(c, **kw))
    assert first["error_code"] == codes.MEMBER_ID_REQUIRED and first["generation_id"] == -1
    assert first["member_id"].startswith("app-")
    return first["member_id"]


def stable_group(c, n=1, **kw):
    """n members in a Stable group; returns (member ids by join order, generation)."""
    ids = [new_member(c, **kw) for _ in range(n)]
    futures = [join(c, member=m, **kw) for m in ids]
    answers = [result(f) for f in futures]
    gen = answers[0]["generation_id"]
    leader = answers[0]["leader"]
    syncs = {m: sync(c, m, gen, [(x, x.encode()) for x in ids] if m == leader else []) for m in ids}
    for m, f in syncs.items():
        assert result(f)["assignment"] == m.encode()
    assert c.state("g") == STABLE
    return ids, gen


# -- joining -------------------------------------------------------------------------------------------
def test_first_join_needs_a_member_id_then_one_member_is_leader_at_generation_1(coord, rec):
    m = new_member(coord)
    assert coord.state("g") == EMPTY and coord.member_ids("g") == (m,)  # pending, no rebalance yet
    answer = result(join(coord, member=m, protocols=(("range", b"sub-1"),)))
    assert answer["error_code"] == codes.NONE and answer["generation_id"] == 1
    assert (answer["leader"], answer["member_id"], answer["protocol_name"]) == (m, m, "range")
    assert answer["members"] == [{"member_id": m, "group_instance_id": None, "metadata": b"sub-1"}]
    assert coord.state("g") == COMPLETING
    assert rec.members[-1] == ("g", (m,))


def test_join_below_v4_gets_an_id_at_once(coord):
    answer = result(join(coord, version=3))
    assert answer["error_code"] == codes.NONE and answer["generation_id"] == 1 and answer["member_id"].startswith("app-")


def test_member_ids_are_safe_path_components(coord):
    first = result(join(coord, client="../evil/client id\u0000"))
    assert first["error_code"] == codes.MEMBER_ID_REQUIRED
    assert "/" not in first["member_id"] and "\u0000" not in first["member_id"]
    assert first["member_id"].startswith(".._evil_client_id_-")


def test_refusals_of_join(coord):
    assert result(join(coord, group=""))["error_code"] == codes.INVALID_GROUP_ID
    assert result(join(coord, session=5999))["error_code"] == codes.INVALID_SESSION_TIMEOUT
    assert result(join(coord, session=1_800_001))["error_code"] == codes.INVALID_SESSION_TIMEOUT
    assert result(join(coord, member="someone"))["error_code"] == codes.UNKNOWN_MEMBER_ID  # unknown group
    ids, _ = stable_group(coord)
    assert result(join(coord, member="someone"))["error_code"] == codes.UNKNOWN_MEMBER_ID
    assert result(join(coord, protocol_type="connect"))["error_code"] == codes.INCONSISTENT_GROUP_PROTOCOL
    assert result(join(coord, protocols=(("sticky", b""),)))["error_code"] == codes.INCONSISTENT_GROUP_PROTOCOL
    for v in range(0, 10):  # an error answer any version can carry
        readable(JOIN, join(coord, group="", version=v).result(), [v])


def test_group_max_size(clock, rec):
    c = GroupCoordinator(clock, rec, initial_rebalance_delay_ms=0, max_group_size=1)
    new_member(c)
    assert result(join(c))["error_code"] == codes.GROUP_MAX_SIZE_REACHED


def test_protocol_chosen_by_the_members_votes(coord):
    a, b, d = (new_member(coord) for _ in range(3))
    fa = join(coord, member=a, protocols=(("range", b"a"), ("roundrobin", b"a2")))
    fb = join(coord, member=b, protocols=(("roundrobin", b"b"), ("range", b"b2")))
    fd = join(coord, member=d, protocols=(("roundrobin", b"d"), ("sticky", b""), ("range", b"d3")))
    answers = [result(f) for f in (fa, fb, fd)]
    assert {x["protocol_name"] for x in answers} == {"roundrobin"}
    leader = [x for x in answers if x["members"]][0]
    assert leader["member_id"] == a  # the first to join leads
    assert {m["member_id"]: m["metadata"] for m in leader["members"]} == {a: b"a2", b: b"b", d: b"d"}


# -- SyncGroup -----------------------------------------------------------------------------------------
def test_followers_wait_for_the_leaders_assignment(coord, rec):
    a, b = new_member(coord), new_member(coord)
    fa = join(coord, member=a)
    assert not fa.done()  # b's id is pending: the join waits for it
    fb = join(coord, member=b)
    gen = result(fb)["generation_id"]
    assert result(fa)["generation_id"] == gen == 1
    follower = sync(coord, b, gen)
    assert not follower.done()
    assert beat(coord, b, gen) == codes.NONE  # heartbeats while waiting are fine
    leader = sync(coord, a, gen, [(a, b"p0"), ("stranger", b"x")])  # b left out: an empty assignment
    assert result(leader)["assignment"] == b"p0" and result(follower)["assignment"] == b""
    assert result(follower)["protocol_name"] == "range"
    assert coord.state("g") == STABLE
    group, record = rec.records[-1]
    assert (group, record.generation, record.leader, record.protocol) == ("g", 1, a, "range")
    assert {m.member_id: m.assignment for m in record.members} == {a: b"p0", b: b""}
    assert result(sync(coord, b, gen))["assignment"] == b""  # again, in Stable: the same at once


def test_sync_refusals(coord):
    assert result(sync(coord, "x", 1))["error_code"] == codes.UNKNOWN_MEMBER_ID
    a = new_member(coord)
    gen = result(join(coord, member=a))["generation_id"]
    assert result(sync(coord, "x", gen))["error_code"] == codes.UNKNOWN_MEMBER_ID
    assert result(sync(coord, a, gen + 1))["error_code"] == codes.ILLEGAL_GENERATION
    bad = coord.sync_group({"group_id": "g", "generation_id": gen, "member_id": a, "group_instance_id": None,
                            "protocol_type": "consumer", "protocol_name": "sticky", "assignments": []})
    assert result(bad)["error_code"] == codes.INCONSISTENT_GROUP_PROTOCOL
    b = new_member(coord)
    join(coord, member=b)  # a rebalance starts
    assert result(sync(coord, a, gen))["error_code"] == codes.REBALANCE_IN_PROGRESS


# -- heartbeats and a generation bump ------------------------------------------------------------------
def test_a_second_member_makes_the_group_rebalance(coord, clock):
    (a,), gen = stable_group(coord)
    assert beat(coord, a, gen) == codes.NONE
    b = new_member(coord)
    fb = join(coord, member=b)
    assert coord.state("g") == PREPARING and not fb.done()
    assert beat(coord, a, gen) == codes.REBALANCE_IN_PROGRESS
    fa = join(coord, member=a)
    ra, rb = result(fa), result(fb)
    assert ra["generation_id"] == rb["generation_id"] == gen + 1
    assert ra["leader"] == a and len(ra["members"]) == 2 and rb["members"] == []
    assert beat(coord, a, gen) == codes.ILLEGAL_GENERATION
    assert beat(coord, a, gen + 1) == codes.NONE  # CompletingRebalance: a heartbeat is fine
    assert beat(coord, "nobody", gen + 1) == codes.UNKNOWN_MEMBER_ID
    assert beat(coord, a, gen + 1, group="other") == codes.UNKNOWN_MEMBER_ID


def test_a_member_rejoining_the_same_way_gets_the_same_generation(coord):
    (a, b), gen = stable_group(coord, 2)
    answer = result(join(coord, member=b))  # a follower, nothing changed: no rebalance
    assert answer["generation_id"] == gen and coord.state("g") == STABLE
    f = join(coord, member=a)  # the leader asks for a new assignment (a topic changed): a rebalance
    assert coord.state("g") == PREPARING and not f.done()


def test_session_expiry_removes_a_member_and_the_others_rebalance(coord, clock):
    (a, b), gen = stable_group(coord, 2)
    clock.advance(SESSION / 1000 - 1)
    assert beat(coord, a, gen) == codes.NONE
    clock.advance(1.5)  # b's session has run out, a heartbeated 1.5 s ago
    coord.tick()
    assert coord.member_ids("g") == (a,) and coord.state("g") == PREPARING
    assert beat(coord, b, gen) == codes.UNKNOWN_MEMBER_ID
    assert beat(coord, a, gen) == codes.REBALANCE_IN_PROGRESS
    answer = result(join(coord, member=a))
    assert answer["generation_id"] == gen + 1 and [m["member_id"] for m in answer["members"]] == [a]


def test_a_member_that_does_not_rejoin_in_the_rebalance_timeout_is_dropped(coord, clock):
    (a, b), gen = stable_group(coord, 2)
    fa = join(coord, member=a, protocols=(("range", b"new"),))  # new metadata: a rebalance
    for step in (5, 5, 5, 5, 5, 4.9):
        clock.advance(step)
        beat(coord, b, gen)  # b heartbeats, but never rejoins
        coord.tick()
    assert not fa.done()
    clock.advance(0.2)
    assert coord.tick() <= 1.0
    answer = result(fa)
    assert answer["generation_id"] == gen + 1 and [m["member_id"] for m in answer["members"]] == [a]
    assert beat(coord, b, gen) == codes.UNKNOWN_MEMBER_ID


def test_a_pending_member_id_expires(coord, clock):
    (a,), gen = stable_group(coord)
    b = new_member(coord)  # takes an id, never comes back
    fa = join(coord, member=a, protocols=(("range", b"v2"),))
    assert not fa.done()  # waits for the pending member ...
    clock.advance(SESSION / 1000 + 0.1)
    beat(coord, a, gen)
    coord.tick()  # ... until its id expires
    assert result(fa)["generation_id"] == gen + 1
    assert result(join(coord, member=b))["error_code"] == codes.UNKNOWN_MEMBER_ID


def test_a_member_that_sends_no_sync_is_dropped_after_the_rebalance_timeout(coord, clock):
    a, b = new_member(coord), new_member(coord)
    fa, _ = join(coord, member=a), join(coord, member=b)
    gen = result(fa)["generation_id"]
    assert result(sync(coord, a, gen, [(a, b"1"), (b, b"2")]))["assignment"] == b"1"
    clock.advance(REBALANCE / 1000 + 0.1)
    beat(coord, a, gen)
    coord.tick()
    assert coord.member_ids("g") == (a,) and coord.state("g") == PREPARING


def test_a_new_member_stuck_in_join_is_dropped_after_the_new_member_timeout(clock, rec):
    c = GroupCoordinator(clock, rec, initial_rebalance_delay_ms=0, new_member_join_timeout_ms=20_000)
    (a,), gen = stable_group(c)
    b = new_member(c)
    fb = join(c, member=b, rebalance=300_000)  # a waits with a long rebalance timeout, a never rejoins
    clock.advance(9)
    beat(c, a, gen)
    c.tick()
    clock.advance(9)
    beat(c, a, gen)
    c.tick()
    assert not fb.done()
    clock.advance(2.5)
    c.tick()
    assert result(fb)["error_code"] == codes.UNKNOWN_MEMBER_ID  # b gives up; a is still in
    assert c.member_ids("g") == (a,)


# -- leaving -------------------------------------------------------------------------------------------
def test_leave_group_v3_batch_and_the_group_empties(coord, rec):
    (a, b, d), gen = stable_group(coord, 3)
    answer = readable(LEAVE, coord.leave_group({"group_id": "g", "members": [
        {"member_id": a, "group_instance_id": None}, {"member_id": "nobody", "group_instance_id": None},
        {"member_id": b, "group_instance_id": None}]}, 5), range(3, 6))
    assert answer["error_code"] == codes.NONE
    assert [m["error_code"] for m in answer["members"]] == [codes.NONE, codes.UNKNOWN_MEMBER_ID, codes.NONE]
    assert coord.state("g") == PREPARING and coord.member_ids("g") == (d,)
    assert result(join(coord, member=d))["leader"] == d  # the leader left: d leads
    single = coord.leave_group({"group_id": "g", "member_id": d}, 0)
    assert readable(LEAVE, single, range(0, 3))["error_code"] == codes.NONE
    assert coord.state("g") == EMPTY
    assert rec.records[-1][1].generation == gen + 2 and rec.records[-1][1].members == ()
    assert rec.members[-1] == ("g", ())
    assert coord.leave_group({"group_id": "g", "member_id": d}, 1)["error_code"] == codes.UNKNOWN_MEMBER_ID
    unknown = coord.leave_group({"group_id": "nope", "members": [{"member_id": "x", "group_instance_id": None}]}, 4)
    assert unknown["error_code"] == codes.NONE and unknown["members"][0]["error_code"] == codes.UNKNOWN_MEMBER_ID


def test_the_leader_leaving_while_followers_wait_for_their_assignment(coord):
    a, b = new_member(coord), new_member(coord)
    fa, _ = join(coord, member=a), join(coord, member=b)
    gen = result(fa)["generation_id"]
    waiting = sync(coord, b, gen)
    coord.leave_group({"group_id": "g", "member_id": a}, 2)
    assert result(waiting)["error_code"] == codes.REBALANCE_IN_PROGRESS
    assert result(join(coord, member=b))["generation_id"] == gen + 1


def test_a_pending_member_leaving(coord):
    (a,), gen = stable_group(coord)
    b = new_member(coord)
    fa = join(coord, member=a, protocols=(("range", b"v2"),))
    assert not fa.done()
    coord.leave_group({"group_id": "g", "members": [{"member_id": b, "group_instance_id": None}]}, 3)
    assert result(fa)["generation_id"] == gen + 1


# -- static membership (group.instance.id) -------------------------------------------------------------
def test_static_member_restart_keeps_the_group_stable_and_fences_the_old_id(coord, rec):
    first = result(join(coord, instance="host-1"))  # static members need no MEMBER_ID_REQUIRED
    a = first["member_id"]
    assert first["error_code"] == codes.NONE and a.startswith("host-1-")
    assert result(sync(coord, a, 1, [(a, b"p")]))["assignment"] == b"p"
    again = result(join(coord, instance="host-1"))  # restarted: no member id
    a2 = again["member_id"]
    assert a2 != a and again["generation_id"] == 1 and again["leader"] == a and again["members"] == []
    assert coord.state("g") == STABLE
    assert beat(coord, a, 1, instance="host-1") == codes.FENCED_INSTANCE_ID
    assert result(sync(coord, a2, 1))["assignment"] == b"p"  # the place it had
    assert rec.records[-1][1].members[0].member_id == a2
    left = coord.leave_group({"group_id": "g", "members": [{"member_id": "", "group_instance_id": "host-1"}]}, 4)
    assert left["members"][0]["error_code"] == codes.NONE and coord.state("g") == EMPTY


def test_static_member_with_new_metadata_rebalances(coord):
    a = result(join(coord, instance="i"))["member_id"]
    result(sync(coord, a, 1, [(a, b"p")]))
    f = join(coord, instance="i", protocols=(("range", b"other"),))
    assert result(f)["generation_id"] == 2 and result(f)["member_id"] != a


# -- the initial rebalance delay -----------------------------------------------------------------------
def test_initial_delay_waits_for_more_members_and_extends_up_to_the_rebalance_timeout(clock, rec):
    c = GroupCoordinator(clock, rec, initial_rebalance_delay_ms=3000)
    a = new_member(c)
    fa = join(c, member=a, rebalance=7000)
    assert c.state("g") == PREPARING and not fa.done()
    clock.advance(2)
    b = new_member(c)
    fb = join(c, member=b, rebalance=7000)
    clock.advance(1)
    assert c.tick() > 0 and not fa.done()  # extended: b came during the delay
    clock.advance(2.9)
    c.tick()
    assert not fa.done()
    clock.advance(0.2)
    c.tick()
    assert result(fa)["generation_id"] == result(fb)["generation_id"] == 1
    assert len(result(fa)["members"]) == 2


# -- storing the assignment ----------------------------------------------------------------------------
def test_syncs_are_answered_only_once_the_assignment_is_stored(coord, rec):
    rec.hold = True
    a = new_member(coord)
    gen = result(join(coord, member=a))["generation_id"]
    f = sync(coord, a, gen, [(a, b"x")])
    assert not f.done() and coord.state("g") == COMPLETING
    rec.held.pop()(None)
    assert result(f)["assignment"] == b"x" and coord.state("g") == STABLE


def test_a_failed_store_makes_the_members_rejoin(coord, rec):
    rec.fail = OSError("ZooKeeper went away")
    a = new_member(coord)
    gen = result(join(coord, member=a))["generation_id"]
    assert result(sync(coord, a, gen, [(a, b"x")]))["error_code"] == codes.COORDINATOR_NOT_AVAILABLE
    assert coord.state("g") == PREPARING


def test_a_store_that_finds_another_coordinator_gives_the_group_up(coord, rec):
    rec.fail = GroupMovedError("moved")
    a, b = new_member(coord), new_member(coord)
    fa, _ = join(coord, member=a), join(coord, member=b)
    gen = result(fa)["generation_id"]
    fs = sync(coord, b, gen)
    assert result(sync(coord, a, gen, [(a, b"x")]))["error_code"] == codes.NOT_COORDINATOR
    assert result(fs)["error_code"] == codes.NOT_COORDINATOR
    assert not coord.has("g") and rec.members[-1] == ("g", ())


# -- offsets commits -----------------------------------------------------------------------------------
def test_commit_checks(coord):
    assert coord.commit_allowed("g", -1, "", None) == codes.NONE  # no group management: allowed
    assert coord.commit_allowed("g", 3, "m", None) == codes.ILLEGAL_GENERATION
    a, b = new_member(coord), new_member(coord)
    fa, _ = join(coord, member=a), join(coord, member=b)
    gen = result(fa)["generation_id"]
    assert coord.commit_allowed("g", gen, a, None) == codes.REBALANCE_IN_PROGRESS  # CompletingRebalance
    sync(coord, a, gen, [(a, b"1"), (b, b"2")])
    assert coord.commit_allowed("g", gen, a, None) == codes.NONE
    assert coord.commit_allowed("g", gen - 1, a, None) == codes.ILLEGAL_GENERATION
    assert coord.commit_allowed("g", gen, "x", None) == codes.UNKNOWN_MEMBER_ID
    assert coord.commit_allowed("g", -1, "", None) == codes.UNKNOWN_MEMBER_ID  # members exist: not anonymous
    join(coord, member=b, protocols=(("range", b"v2"),))
    assert coord.commit_allowed("g", gen, a, None) == codes.NONE  # PreparingRebalance: still taken


def test_a_commit_counts_as_a_heartbeat(coord, clock):
    (a,), gen = stable_group(coord)
    for _ in range(5):
        clock.advance(SESSION / 1000 - 1)
        assert coord.commit_allowed("g", gen, a, None) == codes.NONE
        coord.tick()
    assert coord.member_ids("g") == (a,)


# -- taking over, giving up, describing, deleting ------------------------------------------------------
def record(gen=7):
    return GroupRecord(gen, "consumer", "range", "m-1", (
        MemberRecord("m-1", None, "app", "/10.0.0.1", SESSION, REBALANCE, b"s1", b"a1"),
        MemberRecord("m-2", "inst", "app", "/10.0.0.2", SESSION, REBALANCE, b"s2", b"a2")))


def test_a_loaded_group_goes_on_without_a_rebalance(coord, clock, rec):
    coord.load("g", record())
    assert coord.state("g") == STABLE
    assert beat(coord, "m-1", 7) == codes.NONE
    assert result(sync(coord, "m-2", 7))["assignment"] == b"a2"
    assert beat(coord, "m-3", 7, instance="inst") == codes.FENCED_INSTANCE_ID
    assert rec.members[-1] == ("g", ("m-1", "m-2"))
    coord.load("g", None)  # already in memory: left as it is
    assert coord.state("g") == STABLE
    clock.advance(SESSION / 1000 - 1)
    beat(coord, "m-1", 7)
    clock.advance(2)
    coord.tick()  # m-2 never heartbeated to this coordinator
    assert result(join(coord, member="m-1"))["generation_id"] == 8  # generations go on from the record's


def test_an_empty_record_keeps_the_generation(coord):
    coord.load("g", GroupRecord(4, "consumer", None, None, ()))
    assert coord.state("g") == EMPTY
    m = new_member(coord)
    assert result(join(coord, member=m))["generation_id"] == 5


def test_unload_answers_parked_requests_not_coordinator(coord, rec):
    (a,), gen = stable_group(coord)
    b = new_member(coord)
    fb = join(coord, member=b)
    assert coord.unload(lambda g: g != "g") == ["g"]
    assert result(fb)["error_code"] == codes.NOT_COORDINATOR
    assert not coord.has("g") and rec.members[-1] == ("g", ())
    assert beat(coord, a, gen) == codes.UNKNOWN_MEMBER_ID


def test_describe_overview_delete(coord):
    assert coord.describe("g") is None and coord.delete("g") is None
    (a, b), gen = stable_group(coord, 2)
    d = readable(DESCRIBE, {"groups": [coord.describe("g")]})["groups"][0]
    assert (d["group_state"], d["protocol_type"], d["protocol_data"]) == ("Stable", "consumer", "range")
    assert [(m["member_id"], m["member_assignment"], m["member_metadata"], m["client_host"]) for m in d["members"]] \
        == [(a, a.encode(), b"m", "/10.0.0.1"), (b, b.encode(), b"m", "/10.0.0.1")]
    join(coord, member=a, protocols=(("range", b"v2"),))
    d = coord.describe("g")
    assert d["group_state"] == PREPARING and d["protocol_data"] == "" and d["members"][0]["member_metadata"] == b""
    assert coord.overview() == [("g", "consumer", PREPARING)]
    assert coord.delete("g") == codes.NON_EMPTY_GROUP
    coord.leave_group({"group_id": "g", "members": [{"member_id": a, "group_instance_id": None},
                                                    {"member_id": b, "group_instance_id": None}]}, 3)
    assert coord.state("g") == EMPTY and coord.delete("g") == codes.NONE and not coord.has("g")
    assert coord.overview() == []
    assert DEAD == "Dead"


def test_idle_empty_groups_leave_memory(coord, clock):
    """Any group id a client names takes memory: an Empty one without pending ids is dropped after a minute
    (its record brings it back when asked)."""
    for i in range(100):
        new_member(coord, group=f"probe-{i}")  # ids handed out, never used
    (a,), gen = stable_group(coord)
    coord.leave_group({"group_id": "g", "member_id": a}, 2)
    clock.advance(SESSION / 1000 + 0.1)
    coord.tick()
    assert coord.has("probe-7") and coord.has("g")  # pending ids expired just now: kept a while
    clock.advance(60.5)
    coord.tick()
    assert coord.overview() == [] and not coord.has("g") and not coord.has("probe-7")


def test_members_on_many_threads_with_a_real_clock(rec):
    """Eight members behave as Kafka clients do (rejoin on REBALANCE_IN_PROGRESS, start over on
    UNKNOWN_MEMBER_ID) on their own threads while the group thread ticks: every request is answered,
    nothing deadlocks, and the group ends Empty."""
    c = GroupCoordinator(time.monotonic, rec, initial_rebalance_delay_ms=0, min_session_timeout_ms=100)
    stop, errors, rounds = threading.Event(), [], collections.Counter()

    def ticker():
        while not stop.is_set():
            time.sleep(min(c.tick(), 0.05))

    def client(i):
        try:
            member_id = ""
            for _ in range(6):
                answer = join(c, member=member_id, session=3000, rebalance=3000).result(20)
                if answer["error_code"] in (codes.MEMBER_ID_REQUIRED, codes.UNKNOWN_MEMBER_ID):
                    member_id = answer["member_id"] if answer["error_code"] == codes.MEMBER_ID_REQUIRED else ""
                    continue
                assert answer["error_code"] == codes.NONE, answer
                gen, leader = answer["generation_id"], answer["leader"] == member_id
                plan = [(m["member_id"], b"a") for m in answer["members"]] if leader else []
                if sync(c, member_id, gen, plan).result(20)["error_code"] != codes.NONE:
                    continue
                rounds[i] += 1
                for _ in range(3):
                    if beat(c, member_id, gen) != codes.NONE:
                        break
                    time.sleep(0.02)
            if member_id:
                c.leave_group({"group_id": "g", "member_id": member_id}, 2)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    tick = threading.Thread(target=ticker)
    tick.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    stop.set()
    tick.join(5)
    assert not errors and not any(t.is_alive() for t in threads)
    assert sum(rounds.values()) >= 8  # every member got through rounds with an assignment
    assert c.state("g") in (EMPTY, PREPARING)
    clock_end = time.monotonic() + 10
    while c.state("g") != EMPTY and time.monotonic() < clock_end:
        time.sleep(min(c.tick(), 0.05))
    assert c.state("g") == EMPTY and rec.members[-1] == ("g", ())


def test_only_the_groups_master_coordinates_and_a_demoted_one_gives_its_groups_up():
    """A replicated group's members share the broker id that rendezvous hashing picks, so every member
    took itself for the coordinator of that id's Kafka groups: a replica answered JoinGroup and
    OffsetCommit. Only the master coordinates (NOT_COORDINATOR elsewhere); a master that lost its role gives
    the groups in its memory up at their next request, so it never serves stale state when master again."""
    from metaq_broker.server import kafka_metadata
    from metaq_broker.server.kafka_groups import KafkaGroups

    snap = kafka_metadata.static_snapshot(1, "127.0.0.1", 9092, {}, {}, "cluster")
    master = [False]
    groups = KafkaGroups(lambda: None, "/r", 1, lambda: snap, coordinating=lambda: master[0])
    assert groups._ensure("g") == codes.NOT_COORDINATOR  # a replica
    master[0] = True
    assert groups._ensure("g") == codes.COORDINATOR_NOT_AVAILABLE  # the master, its ZooKeeper away here
    groups.coordinator.load("g", None)
    assert groups._ensure("g") is None and groups.coordinator.has("g")
    master[0] = False  # demoted
    assert groups._ensure("g") == codes.NOT_COORDINATOR and not groups.coordinator.has("g")
