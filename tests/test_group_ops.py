"""Consumer-group operations of the command line against a real ZooKeeper and broker: ``metaq groups
reset-offsets`` (each target, a partition subset, the dry run, refusal while members are live),
``metaq groups delete``, ``metaq consume --group`` joining the group and committing (the client's
``GroupMember``, which rebalances), and the errors."""
import subprocess
import sys
import time
from datetime import datetime, timezone

import pytest
from conftest import interrupt, wait_until
import cli

from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer, GroupMember
from metaq_broker.client.producer import Producer
from metaq_broker.zk.group_offsets import GroupStore

TOPIC = "events"


def command(cluster):
    """``metaq`` as a process of its own: followers that run until Ctrl-C."""
    return [sys.executable, "-m", "metaq_broker.tools.cli", *cli.cluster_args(cluster)]


metaq = cli.metaq_on


@pytest.fixture
def running(cluster):
    """Broker 1 with ``events`` (1-0: 10 messages, a pause, 10 more; 1-1: 5 before the pause); ``cluster.between``
    is a moment in the pause."""
    cluster.start_broker(1, settings={"numPartitions": 2})
    with cluster.client(Admin) as admin:
        wait_until(lambda: admin.brokers(), what="broker registered")
        admin.create_topic(TOPIC, 2)
    with cluster.client(Producer) as p:
        wait_until(lambda: len(p.cluster.topic_partitions(TOPIC)) == 2, what="topic")
        p.send_batch(TOPIC, [b"a%d" % i for i in range(10)], partition="1-0")
        p.send_batch(TOPIC, [b"b%d" % i for i in range(5)], partition="1-1")
        time.sleep(0.05)
        cluster.between = datetime.now(timezone.utc)
        time.sleep(0.05)
        p.send_batch(TOPIC, [b"c%d" % i for i in range(10)], partition="1-0")
    return cluster


def committed(cluster, group):
    with cluster.client(Admin) as admin:
        return GroupStore(admin.cluster.zk, cluster.zk_root).fetch(group, TOPIC)


def plan(r):
    """{partition: (old, new)} from reset-offsets' output."""
    assert r.returncode == 0, r.stderr
    rows = [line.decode().split("\t") for line in r.stdout.splitlines()]
    return {p: tuple(x.strip() for x in change.split("->")) for _, _, p, change in rows}


def test_reset_offsets_to_each_target(running):
    with running.client(Admin) as admin:
        GroupStore(admin.cluster.zk, running.zk_root).commit("g", TOPIC, {"1-0": 4})
    reset = ["groups", "reset-offsets", "--group", "g", "--topic", TOPIC]
    r = metaq(running, *reset, "--to-earliest", "--dry-run")
    assert plan(r) == {"1-0": ("4", "0"), "1-1": ("-", "0")} and b"dry run" in r.stderr
    assert committed(running, "g") == {"1-0": 4}
    assert plan(metaq(running, *reset, "--to-latest")) == {"1-0": ("4", "20"), "1-1": ("-", "5")}
    assert committed(running, "g") == {"1-0": 20, "1-1": 5}
    assert plan(metaq(running, *reset, "--to-earliest")) == {"1-0": ("20", "0"), "1-1": ("5", "0")}
    assert plan(metaq(running, *reset, "--to-offset", "7", "--partition", "1-0")) == {"1-0": ("0", "7")}
    assert committed(running, "g") == {"1-0": 7, "1-1": 0}
    # The first offset stored at or after a moment between the batches; none after it in 1-1: its end.
    assert plan(metaq(running, *reset, "--to-datetime", running.between.isoformat())) == {
        "1-0": ("7", "10"), "1-1": ("0", "5")}
    assert plan(metaq(running, *reset, "--to-earliest")) and committed(running, "g") == {"1-0": 0, "1-1": 0}
    local = running.between.astimezone().replace(tzinfo=None).isoformat()  # no zone: local time
    assert plan(metaq(running, *reset, "--to-datetime", local)) == {"1-0": ("0", "10"), "1-1": ("0", "5")}

    # Listing, as before the subcommands: `groups`, `groups GROUP`, `--topic`, and `groups list`.
    for args in (["groups"], ["groups", "g"], ["groups", "g", "--topic", TOPIC], ["groups", "--topic", TOPIC],
                 ["groups", "list", "g"]):
        r = metaq(running, *args)
        rows = {line.split()[2]: line.split()[3:] for line in r.stdout.splitlines()[1:]}
        assert r.returncode == 0 and rows == {b"1-0": [b"10", b"20", b"10"], b"1-1": [b"5", b"5", b"0"]}, args


def test_bad_input_is_refused_with_a_clear_error(running):
    with running.client(Admin) as admin:
        GroupStore(admin.cluster.zk, running.zk_root).commit("g", TOPIC, {"1-0": 4})
    reset = ["groups", "reset-offsets", "--topic", TOPIC]
    cases = [  # (args, exit code, what stderr says)
        (["--group", "nope", "--to-earliest"], 1, b"no consumer group 'nope'"),
        (["--group", "g", "--to-offset", "21"], 1, b"offset 21 is out of range for partition 1-0"),
        (["--group", "g", "--to-offset", "6"], 1, b"partition 1-1"),  # 1-1 ends at 5
        (["--group", "g", "--to-earliest", "--partition", "1-7"], 1, b"no live partition 1-7"),
        (["--group", "g", "--to-datetime", "yesterday"], 2, b"'yesterday' is not an ISO 8601"),
        (["--group", "g"], 2, b"exactly one of"),
        (["--group", "g", "--to-earliest", "--to-latest"], 2, b"exactly one of"),
        (["--group", "g", "--to-offset", "-1"], 2, b"--to-offset"),
        (["--group", "bad/name", "--to-earliest"], 1, b"bad/name"),
    ]
    for args, code, says in cases:
        r = metaq(running, *reset, *args)
        assert (r.returncode, says in r.stderr) == (code, True), (args, r.stderr)
    r = metaq(running, "groups", "reset-offsets", "--group", "g", "--topic", "nothing", "--to-earliest")
    assert r.returncode == 1 and b"topic 'nothing'" in r.stderr
    r = metaq(running, "groups", "delete", "--group", "nope")
    assert r.returncode == 1 and b"no consumer group 'nope'" in r.stderr
    r = metaq(running, "consume", TOPIC, "--group", "g", "--partition", "1-0")
    assert r.returncode == 2 and b"cannot be combined" in r.stderr
    assert committed(running, "g") == {"1-0": 4}


def test_live_members_block_reset_and_delete_unless_forced(running):
    with running.client(Consumer, group="live") as member:
        assert member.subscribe(TOPIC) == ["1-0", "1-1"]
        member.commit_positions(TOPIC)
        r = metaq(running, "groups", "reset-offsets", "--group", "live", "--topic", TOPIC, "--to-latest")
        assert r.returncode == 1 and b"1 live member(s) (" + member.consumer_id.encode() + b")" in r.stderr
        assert b"--force" in r.stderr and committed(running, "live") == {"1-0": 0, "1-1": 0}
        r = metaq(running, "groups", "delete", "--group", "live")
        assert r.returncode == 1 and b"live member" in r.stderr
        r = metaq(running, "groups", "reset-offsets", "--group", "live", "--topic", TOPIC, "--to-latest", "--force")
        assert r.returncode == 0 and committed(running, "live") == {"1-0": 20, "1-1": 5}
    r = metaq(running, "groups", "delete", "--group", "live")
    assert r.returncode == 0 and b"group live deleted" in r.stderr
    with running.client(Admin) as admin:
        assert "live" not in admin.groups()
    r = metaq(running, "groups", "live")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1  # the header only


def test_consume_with_a_group_joins_it_and_commits_what_it_printed(running):
    r = metaq(running, "consume", TOPIC, "--group", "cg", "--max", "4")
    assert r.returncode == 0 and r.stdout.split() == [b"a0", b"a1", b"a2", b"a3"]
    assert committed(running, "cg") == {"1-0": 4, "1-1": 0}  # after the last message printed
    r = metaq(running, "consume", TOPIC, "--group", "cg")
    assert r.returncode == 0 and len(r.stdout.split()) == 6 + 10 + 5 and r.stdout.split()[0] == b"a4"
    assert committed(running, "cg") == {"1-0": 20, "1-1": 5}
    r = metaq(running, "consume", TOPIC, "--group", "cg")
    assert r.returncode == 0 and r.stdout == b""
    r = metaq(running, "consume", TOPIC, "--group", "cg", "--from", "earliest", "--max", "1")
    assert r.stdout == b"a0\n" and committed(running, "cg") == {"1-0": 1, "1-1": 0}

    # --follow: a live member (reset refused while it runs) that commits each message it prints.
    follower = subprocess.Popen([*command(running), "consume", TOPIC, "--group", "cg", "--follow"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with running.client(Admin) as admin:
            members = wait_until(lambda: admin.group_members("cg"), what="the follower joined")
            wait_until(lambda: committed(running, "cg") == {"1-0": 20, "1-1": 5}, what="it caught up")
            r = metaq(running, "groups", "reset-offsets", "--group", "cg", "--topic", TOPIC, "--to-earliest")
            assert r.returncode == 1 and members[0].encode() in r.stderr
            with running.client(Producer) as p:
                p.send_batch(TOPIC, [b"late"], partition="1-1")
            wait_until(lambda: committed(running, "cg") == {"1-0": 20, "1-1": 6}, what="the new message committed")
            (out, _), = interrupt([follower])
            assert admin.group_members("cg") == []  # it left the group
    finally:
        follower.kill()
    assert out.split()[-1] == b"late" and len(out.split()) == 19 + 5 + 1
    r = metaq(running, "groups", "cg")
    assert [line.split()[-1] for line in r.stdout.splitlines()[1:]] == [b"0", b"0"]  # no lag


def test_two_group_members_share_the_partitions(running):
    followers = [subprocess.Popen([*command(running), "consume", TOPIC, "--group", "pair", "--follow"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    try:
        with running.client(Admin) as admin:
            store = GroupStore(admin.cluster.zk, running.zk_root)
            wait_until(lambda: len(store.members("pair")) == 2, what="both joined")
            owners = wait_until(lambda: (lambda o: len(o) == 2 and len(set(o.values())) == 2 and o)(
                store.owners("pair", TOPIC)), timeout=40, what="one partition each")
            assert set(owners.values()) == set(store.members("pair"))
            wait_until(lambda: committed(running, "pair") == {"1-0": 20, "1-1": 5}, what="all read and committed")
    finally:
        outs = [out for out, _ in interrupt(followers)]
    assert sorted(b"".join(outs).split()) == sorted([b"a%d" % i for i in range(10)] + [b"b%d" % i for i in range(5)]
                                                    + [b"c%d" % i for i in range(10)])


def test_a_group_member_commits_what_it_read_before_it_hands_a_partition_over(running, clock):
    """``GroupMember`` (what ``consume --group --follow`` runs): a second member gets a partition only
    after the first one's rebalance, which commits first, so the second reads on from where the first
    stopped: nothing read twice, nothing skipped."""
    with running.client(Consumer, group="gm") as a, running.client(Consumer, group="gm") as b:
        first = GroupMember(a, TOPIC, clock=clock, interval=5)
        assert first.partitions == ["1-0", "1-1"] and first.positions == {"1-0": 0, "1-1": 0}
        first.positions.update({"1-0": 7, "1-1": 3})  # what it read
        second = GroupMember(b, TOPIC, clock=clock, interval=5)
        assert second.partitions == [] and second.positions == {}  # the first still owns both
        clock.advance(4.9)
        assert not first.rebalance_if_due() and first.partitions == ["1-0", "1-1"]
        assert committed(running, "gm") == {}
        clock.advance(0.1)
        assert first.rebalance_if_due() and len(first.partitions) == 1
        assert committed(running, "gm") == {"1-0": 7, "1-1": 3}  # before the partition was let go
        assert second.rebalance_if_due()
        assert sorted(first.partitions + second.partitions) == ["1-0", "1-1"]
        assert {**first.positions, **second.positions} == {"1-0": 7, "1-1": 3}
        second.positions.update({p: o + 1 for p, o in second.positions.items()})
        second.commit()
        assert committed(running, "gm") == {**{"1-0": 7, "1-1": 3}, **second.positions}

    with running.client(Consumer, group="starts") as c:
        assert GroupMember(c, TOPIC, start=5).positions == {"1-0": 5, "1-1": 5}
        assert GroupMember(c, TOPIC, start="latest").positions == {"1-0": 20, "1-1": 5}
        assert GroupMember(c, TOPIC, start="earliest").positions == {"1-0": 0, "1-1": 0}
        with pytest.raises(ValueError, match="start must be None, 'earliest', 'latest' or an offset, got 'soon'"):
            GroupMember(c, TOPIC, start="soon")
    with running.client(Consumer) as plain:  # no group of its own: commits for the one it names
        assert plain.commit(TOPIC, {"1-0": 4}, group="named") == {"1-0": 4}
        with pytest.raises(ValueError, match="this consumer has no group"):
            plain.commit(TOPIC, {"1-0": 4})
    assert committed(running, "named") == {"1-0": 4}
