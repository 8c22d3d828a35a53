"""Processes using the client end in bounded time when ZooKeeper is gone: a script with a Producer, a
Consumer and an Admin (closing them, or simply exiting), a `metaq` CLI command, and a Spark driver with a metaq
streaming query. Each runs in its own process against a ZooKeeper of its own, stopped under it."""
import os
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import interrupt, wait_until

from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import GroupMember
from metaq_broker.client.producer import Producer
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.zk.group_offsets import GroupStore

pytestmark = pytest.mark.process

BOUND_S = 60  # "exits in bounded time": far above what it takes, far below forever


@pytest.fixture
def doomed_zookeeper(tmp_path, own_zookeeper):
    """A ZooKeeper of this test's own (the session's shared one must not be stopped) and one broker."""
    zk = own_zookeeper
    broker = BrokerProcess(tmp_path / "broker", 1, zk.connect_string, settings={"zk.sessionTimeout": 4000},
                           topics={"t": {"numPartitions": 2}}).start()
    yield zk
    broker.kill()


def run_script(code: str, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                              timeout=BOUND_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the process did not exit within {BOUND_S}s; its output:\n{e.stdout}\n{e.stderr}")


CLIENTS = """
    import sys, time
    from metaq_broker.client.admin import Admin
    from metaq_broker.client.consumer import Consumer
    from metaq_broker.client.producer import Producer

    zk_connect, close = sys.argv[1], sys.argv[2] == "close"
    producer, consumer, admin = (cls(zk_connect=zk_connect) for cls in (Producer, Consumer, Admin))
    deadline = time.monotonic() + 30
    while len(producer.partitions("t")) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    producer.send_batch("t", [b"a", b"b"], keys=[b"1", b"2"])
    print("partitions", consumer.partitions("t"), flush=True)
    print("zookeeper gone", flush=True)
    input()  # the test stops ZooKeeper, then lets us go on
    time.sleep(6)  # past the session timeout: watches fire and their callbacks wait for a reconnect
    if close:
        producer.close()
        consumer.close()
        admin.close()
        print("closed", flush=True)
    print("exiting", flush=True)
"""


@pytest.mark.parametrize("close", ["close", "exit"])
def test_a_client_script_ends_when_zookeeper_is_gone(doomed_zookeeper, close):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CLIENTS), doomed_zookeeper.connect_string, close], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("zookeeper gone"):
                break
        assert any(line.startswith("partitions ['1-0', '1-1']") for line in lines), lines
        doomed_zookeeper.stop()
        out, err = proc.communicate("\n", timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the script did not exit within {BOUND_S}s after ZooKeeper stopped:\n{out}\n"
                             f"{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    assert "exiting" in out and (close == "exit" or "closed" in out)


def test_a_cli_command_ends_with_a_clear_error_when_zookeeper_is_gone(doomed_zookeeper):
    connect = doomed_zookeeper.connect_string
    doomed_zookeeper.stop()
    r = run_script("from metaq_broker.tools.cli import main; main()", "--zk", connect, "topics", "list")
    assert r.returncode != 0
    assert f"cannot connect to ZooKeeper at {connect}" in r.stderr + r.stdout


def test_a_group_member_following_a_topic_ends_on_ctrl_c_when_zookeeper_is_gone(doomed_zookeeper):
    """``metaq consume --group --follow`` commits and leaves its group on Ctrl-C; with ZooKeeper gone it
    can do neither (kazoo holds a call until it reconnects: the command hung, in its leave and, stop 38's
    run, in its last commit), and it ends anyway, saying so; its nodes go with its session. The Ctrl-C
    comes while its periodic rebalance waits for ZooKeeper, and lands on a thread other than the main one
    (the kernel may choose any: then a main thread waiting on a lock without a timeout never woke)."""
    connect = doomed_zookeeper.connect_string
    follower = subprocess.Popen([sys.executable, "-m", "metaq_broker.tools.cli", "--zk", connect, "consume", "t",
                                 "--group", "g", "--follow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with Admin(zk_connect=connect) as admin, Producer(zk_connect=connect) as producer:
            wait_until(lambda: admin.group_members("g"), timeout=30, what="the follower joined its group")
            wait_until(lambda: len(producer.partitions("t")) == 2, what="the topic routed")
            producer.send_batch("t", [b"m0", b"m1"], partition="1-0")
            assert follower.stdout.readline() == b"m0\n" and follower.stdout.readline() == b"m1\n"
            groups = GroupStore(admin.cluster.zk, "/meta")
            wait_until(lambda: groups.fetch("g", "t").get("1-0") == 2, what="the printed messages committed")
        doomed_zookeeper.stop()
        time.sleep(GroupMember.REBALANCE_S + 1)  # its rebalance's commit waits for ZooKeeper, on a lock
        (out, err), = interrupt([follower], timeout=BOUND_S, to_a_side_thread=True)
    finally:
        follower.kill()
    assert follower.returncode != 0 and b"could not leave in ZooKeeper" in err, err[-3000:].decode()
    assert b"the group's offsets were not committed (ZooKeeper did not answer within 10s)" in err


SPARK_DRIVER = """
    import os, sys, time
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession
    import metaq_spark

    zk_connect, checkpoint = sys.argv[1], sys.argv[2]
    spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    metaq_spark.register(spark)
    q = (spark.readStream.format("metaq").option("metaq.zk.connect", zk_connect).option("subscribe", "t").load()
         .writeStream.format("noop").option("checkpointLocation", checkpoint).trigger(processingTime="1 second")
         .start())
    deadline = time.monotonic() + 60
    while not q.recentProgress and time.monotonic() < deadline:
        time.sleep(0.2)
    print("running", bool(q.recentProgress), flush=True)
    input()  # the test stops ZooKeeper
    time.sleep(6)
    q.stop()
    spark.stop()
    print("stopped", flush=True)
"""


@pytest.mark.spark
def test_a_spark_driver_with_a_metaq_query_ends_when_zookeeper_is_gone(doomed_zookeeper, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SPARK_DRIVER), doomed_zookeeper.connect_string,
                             str(tmp_path / "checkpoint")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
    try:
        first = proc.stdout.readline()
        assert first.strip() == "running True", first + proc.stderr.read(3000)
        doomed_zookeeper.stop()
        # 6 s of the driver's own, then at most one recording of group offsets that gives up (one connect
        # timeout, metaq_spark.group_commit), then Spark's stop: ~20 s; each progress event still queued
        # used to hold spark.stop() for ~50 s
        out, err = proc.communicate("\n", timeout=45)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the driver did not exit in time after ZooKeeper stopped:\n{out}\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    assert "stopped" in out


def test_a_client_closed_by_two_threads_at_once_closes_cleanly(own_zookeeper):
    """A client's own thread and the interpreter's exit hook may close one cluster view at the same time
    (the nemesis saw it: ``Cannot close connection until it is stopped`` from the exit hook). With
    ZooKeeper gone, kazoo's stop takes a while, and a second caller's close used to raise meanwhile."""
    import threading
    import time

    from metaq_broker.client.cluster import ClusterView

    zk = own_zookeeper
    views = [ClusterView(zk.connect_string) for _ in range(3)]
    zk.stop()
    time.sleep(2.0)  # the sessions are reconnecting now, between retries
    errors = []

    def close(view):
        try:
            view.close()
        except Exception as e:  # noqa: BLE001 - what the test looks at
            errors.append(repr(e))

    for view in views:
        threads = [threading.Thread(target=close, args=(view,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=BOUND_S)
        assert not any(t.is_alive() for t in threads), "a close did not return"
    assert not errors, errors


@pytest.mark.unit
@pytest.mark.parametrize("retire", [True, False])
def test_a_call_on_a_connection_closed_meanwhile_is_a_broker_error_that_did_nothing(retire):
    """A thread takes a connection from the pool, another closes it (the group's master moved: ``retire``; or
    the client closes) before the call is sent. gRPC then raises a bare ``ValueError: Cannot invoke RPC on
    closed channel!``, which ``ClientBase.call`` did not take for "sent nothing, resend to the new master":
    a consumer reading right after ZooKeeper lost its data failed with it (CI, stop 30). It is a
    ``BrokerUnavailableError`` naming why, on a connection marked retired, so the call is resent."""
    from metaq_broker.client.connection import ConnectionPool
    from metaq_broker.proto import metaq_pb2 as pb
    from metaq_broker.protocol.status import BrokerUnavailableError

    pool = ConnectionPool(timeout=1.0)
    conn = pool.get("127.0.0.1:1")
    if retire:
        pool.retire("127.0.0.1:1")
    else:
        pool.close()
    for send in (conn.call, conn.future):
        with pytest.raises(BrokerUnavailableError, match="connection closed: " + (
                "the group's master moved" if retire else "the client is closing")):
            send("GetOffsets", pb.GetOffsetsRequest())
    assert conn.retired is retire


def undrained_call(channel) -> None:
    """Leave on ``channel`` the call gRPC's Python layer leaves when a KeyboardInterrupt lands between its
    making an integrated call and starting the thread that drains it (grpc/_channel.py,
    ``_channel_managed_call_management``): ``channel.close()`` waits for it forever."""
    from grpc._cython import cygrpc
    method = channel.unary_unary("/metaq.v1.Broker/GetOffsets")
    _, operations, _, _ = method._prepare(b"", None, None, True, None)
    channel._channel.integrated_call(cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS, method._method, None,
                                     None, None, None, ((operations, None),), method._context,
                                     method._registered_call_handle)


def test_a_command_ends_when_its_client_does_not_close(cluster, capsys):
    """A `metaq` command's client closes within ``cli.CLOSE_S`` or the command ends without it, saying so:
    stop 39's run had ``consume --follow`` hang after Ctrl-C in gRPC's channel close, waiting for a call the
    Ctrl-C had interrupted as gRPC began it."""
    import threading

    from metaq_broker.client.consumer import Consumer
    from metaq_broker.tools import cli
    cluster.start_broker(1, topics={"t": {"numPartitions": 1}})
    ended = threading.Event()

    def command():
        with cli._client(Consumer, {"zk": cluster.zk_connect, "zk_root": cluster.zk_root, "brokers": None}) as c:
            wait_until(lambda: c.partitions("t"), what="topic t")
            c.offsets("t", ["1-0"])  # a connection to broker 1
            undrained_call(c.pool.get(cluster.brokers[1].address).channel)
        ended.set()

    threading.Thread(target=command, daemon=True).start()
    assert ended.wait(cli.CLOSE_S + 15), "the command did not end"
    assert f"the connections to the brokers did not close within {cli.CLOSE_S:g}s" in capsys.readouterr().err
