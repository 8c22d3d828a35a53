"""Seeing a replicated group: ``Admin.brokers()`` (the master's ``DescribeGroup``), ``metaq brokers`` and
the replication metrics, against a real group of three and a plain broker, through a stopped replica
falling behind and catching up, and a master killed."""
import json
import os
import signal
import urllib.request

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from metaq_broker.client.admin import Admin
from metaq_broker.client.producer import Producer
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.devtools.group import BrokerGroup
from metaq_broker.devtools.process import freeze
from metaq_broker.tools.cli import main
from conftest import wait_until
from webconsole import cell, open_page, start_console, stop_console, texts

TOPICS = {"orders": {"numPartitions": 2}}


@pytest.fixture(scope="module")
def env(tmp_path_factory, zookeeper):
    root = f"/test-observe-{os.getpid()}"
    group = BrokerGroup(tmp_path_factory.mktemp("group"), 1, zookeeper.connect_string, root, members=3,
                        topics=TOPICS)
    for m in group.members:
        m.settings["metricsPort"] = 0  # any free port: member.metrics_port
    plain = BrokerProcess(tmp_path_factory.mktemp("plain"), 2, zookeeper.connect_string,
                          settings={"zk.root": root, "zk.sessionTimeout": 4000}, topics={"alone": {}})
    try:
        group.start()
        plain.start()
        group.wait_master()
        group.wait_in_sync(range(3))
        with Admin(zk_connect=zookeeper.connect_string, zk_root=root, timeout=5.0) as admin:
            yield group, plain, admin
    finally:
        for m in group.members:
            if m.proc is not None and m.proc.poll() is None:
                os.kill(m.proc.pid, signal.SIGCONT)
        plain.stop()
        group.stop()


def rows_of(admin, broker_id=1) -> dict:
    return {r["replicaId"]: r for r in admin.brokers() if r["brokerId"] == broker_id}


def scrape(member) -> dict:
    """{(name, labels as a sorted tuple): value} of a member's /metrics."""
    port = member.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def cli(group, *args):
    out = CliRunner().invoke(main, ["--zk", group.zk_connect, "--zk-root", group.paths.root, "brokers", *args])
    assert out.exit_code == 0, out.output
    return out.output


def test_every_member_is_listed_with_its_role(env):
    group, plain, admin = env
    master = group.master_id()
    epoch = group.state()["epoch"]
    rows = wait_until(lambda: (r := rows_of(admin)) and all(m["lagMessages"] == 0 for m in r.values()) and r,
                      what="three members caught up")
    assert sorted(rows) == [0, 1, 2]
    for r, row in rows.items():
        assert row["address"] == group.members[r].address
        assert row["role"] == ("master" if r == master else "replica")
        assert row["epoch"] == epoch and row["inSync"] is True and row["error"] is None
        assert row["dataAddress"].startswith("127.0.0.1:")
    # a broker without replicas is a group of one
    [alone] = rows_of(admin, 2).values()
    assert alone["address"] == plain.address and alone["role"] == "master"
    assert alone["inSync"] is True and alone["lagMessages"] == 0
    assert admin.masters() == {1: group.members[master].address, 2: plain.address}

    listed = {b["brokerId"]: b for b in json.loads(cli(group, "--format", "json"))}
    assert listed[1]["state"] == "live" and listed[1]["address"] == group.members[master].address
    assert [(m["replicaId"], m["role"]) for m in listed[1]["members"]] == \
        [(r, "master" if r == master else "replica") for r in range(3)]
    assert [m["role"] for m in listed[2]["members"]] == ["master"]
    text = cli(group).splitlines()
    member_lines = [line.split() for line in text if line.split()[:1] == ["1"] and len(line.split()) == 7]
    assert [(int(f[1]), f[3], f[5]) for f in member_lines] == \
        [(r, "master" if r == master else "replica", "yes") for r in range(3)]


def test_metrics_show_roles_epoch_and_the_in_sync_set(env):
    group, _, _ = env
    master = group.master_id()
    epoch = group.state()["epoch"]
    for r, m in enumerate(group.members):
        got = scrape(m)
        role = "master" if r == master else "replica"
        assert got[("metaq_replication_role", (("role", role),))] == 1
        assert got[("metaq_replication_role", (("role", "electing"),))] == 0
        assert got[("metaq_replication_epoch", ())] == epoch
        assert got[("metaq_replication_in_sync_replicas", ())] == 3
        assert ("metaq_replication_truncations_total", ()) in got
    on_master = scrape(group.members[master])
    assert on_master[("metaq_replication_under_replicated_partitions", ())] == 0
    assert on_master[("metaq_replication_elections_total", ())] >= 1
    assert {k[1] for k in on_master if k[0] == "metaq_replication_replica_lag_messages"} == \
        {(("replica", str(r)),) for r in range(3) if r != master}


def test_a_stopped_replica_lags_then_catches_up(env):
    group, _, admin = env
    master = group.master_id()
    r = next(x for x in range(3) if x != master)
    z = dict(zk_connect=group.zk_connect, zk_root=group.paths.root)
    with Producer(timeout=20.0, acks="1", **z) as producer:
        wait_until(lambda: len(producer.cluster.topic_partitions("orders")) == 2, what="topic routed")
        freeze(group.members[r].proc.pid)
        try:
            for i in range(20):
                producer.send_batch("orders", [b"x-%d-%d" % (i, j) for j in range(50)])
            lagging = wait_until(lambda: (row := rows_of(admin).get(r)) and (row["lagMessages"] or 0) > 0 and row,
                                 what="the stopped replica shown lagging")
            assert lagging["lagMessages"] >= 1000 - 1  # what it missed, at least (markers may add)
            lag_metric = scrape(group.members[master])[("metaq_replication_replica_lag_messages",
                                                        (("replica", str(r)),))]
            assert lag_metric >= lagging["lagMessages"] - 1  # it cannot shrink while the replica is stopped
        finally:
            os.kill(group.members[r].proc.pid, signal.SIGCONT)
    caught_up = wait_until(lambda: (row := rows_of(admin).get(r)) and row["lagMessages"] == 0 and row["inSync"]
                           and row["role"] == "replica" and row, timeout=60, what="the replica caught up")
    assert caught_up["error"] is None
    assert scrape(group.members[master])[("metaq_replication_replica_lag_messages", (("replica", str(r)),))] == 0


def test_the_console_shows_the_members(env, browser):
    """The brokers page of ``metaq console`` in a real headless Chromium."""
    group, _, _ = env
    master = group.master_id()
    proc, url = start_console(group.zk_connect, group.paths.root)
    try:
        open_page(browser, url, "brokers")
        for r in range(3):
            row = f'tr[data-member="1-{r}"]'
            wait_until(lambda: cell(browser, row, "role") == ("master" if r == master else "replica"),
                       what=f"member {r}'s role shown")
            assert cell(browser, row, "address") == group.members[r].address
            assert cell(browser, row, "insync") == "yes"
        assert texts(browser, 'tr[data-member^="2-"]') == []  # a group of one is its broker row
    finally:
        stop_console(proc)


def test_roles_change_when_the_master_is_killed(env):
    group, _, admin = env
    first = group.master_id()
    epoch = group.state()["epoch"]
    group.members[first].kill()
    second = group.wait_master(timeout=30, other_than=first)
    rows = wait_until(lambda: (rs := rows_of(admin)) and rs.get(second, {}).get("role") == "master"
                      and rs.get(first, {}).get("role") == "down" and rs, timeout=30, what="new roles listed")
    assert rows[first]["inSync"] is False and rows[second]["epoch"] > epoch
    assert all(row["epoch"] == rows[second]["epoch"] for row in rows.values())
    # The gauges follow the role a moment after ZooKeeper shows it (CI: a scrape in between read 0).
    got = wait_until(lambda: (g := scrape(group.members[second]))[("metaq_replication_role", (("role", "master"),))]
                     == 1 and g, what="the new master's role gauge")
    assert got[("metaq_replication_in_sync_replicas", ())] == 2
    assert got[("metaq_replication_under_replicated_partitions", ())] == 2  # the group is three, two in sync
    assert got[("metaq_replication_epoch", ())] == rows[second]["epoch"]
    # the old master comes back as a replica
    group.members[first].start()
    group.wait_in_sync(range(3))
    rows = wait_until(lambda: (rs := rows_of(admin)) and rs[first]["role"] == "replica" and rs[first]["inSync"]
                      and rs, timeout=30, what="the old master listed as a replica")
    assert rows[second]["role"] == "master"
    wait_until(lambda: scrape(group.members[second])[("metaq_replication_under_replicated_partitions", ())] == 0,
               what="no partition under-replicated")
