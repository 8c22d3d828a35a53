"""The ``metaq`` command line against a real ZooKeeper and broker: what scripts see (output and exit
codes). The quickstart end to end is in test_quickstart_exit.py and test_console.py."""
import json
import subprocess
import sys

import pytest
from conftest import wait_until

from metaq_broker.client.admin import Admin


def metaq(cluster, *args, stdin=None):
    cmd = [sys.executable, "-m", "metaq_broker.tools.cli", "--zk", cluster.zk_connect, "--zk-root", cluster.zk_root,
           *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, timeout=120)


@pytest.fixture
def running(cluster):
    cluster.start_broker(1, settings={"numPartitions": 2})
    with cluster.client(Admin) as admin:
        wait_until(lambda: admin.brokers(), what="broker registered")
    return cluster


def test_topics_produce_consume_offsets_groups_stats(running):
    r = metaq(running, "topics", "create", "orders", "--partitions", "3", "--config", "unflushThreshold=0")
    assert r.returncode == 0, r.stderr
    assert b"partitions 1-0,1-1,1-2" in r.stdout
    r = metaq(running, "topics", "list")
    assert b"orders\t3 partitions\t1-0,1-1,1-2" in r.stdout
    r = metaq(running, "produce", "orders", "--partition", "1-1", stdin=b"alpha\nbeta\ngamma\n")
    assert r.returncode == 0 and b"sent 3 messages" in r.stderr
    r = metaq(running, "produce", "orders", "--count", "500", "--size", "20", "--key", "k")
    assert r.returncode == 0 and b"sent 500 messages" in r.stderr
    r = metaq(running, "consume", "orders", "--partition", "1-1", "--max", "2", "--format", "json")
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["partition"], x["offset"], x["value"]) for x in rows] == [("1-1", 0, "alpha"), ("1-1", 1, "beta")]
    r = metaq(running, "consume", "orders", "--from", "earliest")
    assert len(r.stdout.splitlines()) == 503
    r = metaq(running, "offsets", "orders")
    lines = sorted(line.split(b"\t") for line in r.stdout.splitlines())
    assert sum(int(x[3]) for x in lines) == 503 and [x[1] for x in lines] == [b"1-0", b"1-1", b"1-2"]
    r = metaq(running, "topics", "describe", "orders")
    assert r.returncode == 0 and b"1-1" in r.stdout and b"open" in r.stdout
    r = metaq(running, "stats", "--topic", "orders")
    assert r.returncode == 0 and b"broker 1 version" in r.stdout and b"puts" in r.stdout
    with running.client(Admin) as admin:
        from metaq_broker.zk.group_offsets import GroupStore
        GroupStore(admin.cluster.zk, running.zk_root).commit("readers", "orders", {"1-1": 1})
    r = metaq(running, "groups", "readers")
    row = [line.split() for line in r.stdout.splitlines() if b"1-1" in line][0]
    latest = int([x for x in lines if x[1] == b"1-1"][0][3])
    assert row[3:] == [b"1", str(latest).encode(), str(latest - 1).encode()]  # committed, latest, lag


def test_errors_exit_with_1_and_usage_with_2(running):
    r = metaq(running, "consume", "no-such-topic")
    assert r.returncode == 1 and b"no-such-topic" in r.stderr
    r = metaq(running, "produce", "orders", "--partition", "9-9", stdin=b"x\n")
    assert r.returncode == 1 and b"broker 9 is not alive" in r.stderr
    r = metaq(running, "topics", "create", "bad/name")
    assert r.returncode == 1 and b"bad/name" in r.stderr
    r = metaq(running, "consume", "orders", "--from", "middle")
    assert r.returncode == 2
    r = metaq(running, "topics", "create", "x", "--config", "novalue")
    assert r.returncode == 2 and b"KEY=VALUE" in r.stderr


def test_command_config_is_read_by_every_command_that_connects(running, tmp_path):
    config = tmp_path / "client.properties"
    config.write_text("# Kafka's form\nsecurity.protocol=PLAINTEXT\n")
    r = metaq(running, "--command-config", str(config), "topics", "create", "orders", "--partitions", "1")
    assert r.returncode == 0, r.stderr
    r = metaq(running, "--command-config", str(config), "topics", "list")
    assert r.returncode == 0 and b"orders\t1 partitions" in r.stdout
    config.write_text("security.protocol=PLAINTEXT\nsasl.jaas.config=whatever\n")
    r = metaq(running, "--command-config", str(config), "topics", "list")
    assert r.returncode == 2 and f"{config}: unknown security key 'sasl.jaas.config'".encode() in r.stderr
    config.write_text("security.protocol=TLS\n")
    r = metaq(running, "--command-config", str(config), "acls", "list")
    assert r.returncode == 2 and b"security.protocol: 'TLS' is not one of PLAINTEXT, SSL, SASL_SSL" in r.stderr
    r = metaq(running, "--command-config", str(tmp_path / "missing.properties"), "users", "list")
    assert r.returncode == 2 and b"missing.properties: cannot read" in r.stderr
