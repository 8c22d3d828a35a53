"""A Spark pipeline over SASL_SSL with ACLs: the source reads ``in`` and the exactly-once sink writes ``out``
as user ``etl``, who may do only that; every message arrives once; the password shows up in no plan,
progress report or error; a user without the sink's ACL is refused, naming it."""
import time

import pytest
from conftest import wait_until

from metaq_broker.client import Consumer, Producer
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.security.acl import Acl
from metaq_broker.security.scram import Credential
from metaq_broker.zk.acls import add_acls
from metaq_broker.zk.session import new_client
from metaq_broker.zk.users import put_user

PASSWORD = "etl-Pa55word-never-shown"
ROWS = 3000


@pytest.fixture(scope="module")
def setup(tmp_path_factory, zookeeper, pki):
    work = tmp_path_factory.mktemp("sec-spark")
    root = f"/sec-spark-{time.time_ns()}"
    zk = new_client(zookeeper.connect_string)
    zk.start()
    for user, password in (("etl", PASSWORD), ("admin", "admin-pw"), ("intruder", "intruder-pw")):
        put_user(zk, root, user, Credential.make(password))
    add_acls(zk, root, [Acl("User:etl", "Allow", "Read", "topic", "in"),
                        Acl("User:etl", "Allow", "Write", "topic", "out"),
                        Acl("User:etl", "Allow", "Read", "group", "etl-group"),
                        Acl("User:intruder", "Allow", "Read", "topic", "in"),
                        Acl("User:intruder", "Allow", "Write", "topic", "out")])
    add_acls(zk, root, [Acl("User:etl", "Allow", "Write", "sink", "etl-", "prefixed")])
    broker = BrokerProcess(work / "b", 1, zookeeper.connect_string, settings={
        "zk.root": root, "zk.sessionTimeout": 4000, "security.protocol": "SASL_SSL",
        "ssl.certificate.location": pki.broker.cert, "ssl.key.location": pki.broker.key,
        "ssl.ca.location": pki.ca, "authorizer": "acl", "super.users": "User:admin"},
        topics={"in": {"numPartitions": 2}, "out": {"numPartitions": 2}}).start()
    admin = {"security.protocol": "SASL_SSL", "ssl.ca.location": pki.ca, "sasl.username": "admin",
             "sasl.password": "admin-pw"}
    with Producer(zk_connect=zookeeper.connect_string, zk_root=root, security=admin) as p:
        wait_until(lambda: len(p.cluster.topic_partitions("in")) == 2, what="topic in")
        for part in ("1-0", "1-1"):
            p.send_batch("in", [b"%s:%d" % (part.encode(), i) for i in range(ROWS // 2)], partition=part)
    yield {"zk": zookeeper.connect_string, "root": root, "pki": pki, "admin": admin, "broker": broker}
    broker.kill()
    zk.stop()
    zk.close()


def options(s, user, password):
    return {"metaq.zk.connect": s["zk"], "metaq.zk.root": s["root"], "metaq.security.protocol": "SASL_SSL",
            "metaq.ssl.ca.location": s["pki"].ca, "metaq.sasl.mechanism": "SCRAM-SHA-256",
            "metaq.sasl.username": user, "metaq.sasl.password": password}


def start(spark, s, checkpoint, user="etl", password=PASSWORD, sink_id="etl-orders"):
    df = spark.readStream.format("metaq").options(**options(s, user, password)).option("subscribe", "in") \
        .option("maxOffsetsPerTrigger", 1000).option("group", "etl-group").load()
    return (df.selectExpr("key", "value").writeStream.format("metaq").options(**options(s, user, password))
            .option("topic", "out").option("sinkId", sink_id).option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True).start()), df


def out_values(s):
    with Consumer(zk_connect=s["zk"], zk_root=s["root"], security=s["admin"]) as c:
        values = []
        for part in ("1-0", "1-1"):
            offset, end = c.offsets("out", [part])[part]
            while offset < end:
                f = c.fetch("out", part, offset, max_messages=10_000)
                values += f.batch.column("value").to_pylist()
                offset = f.next_offset
        return values


def test_pipeline_over_sasl_ssl_with_acls_delivers_exactly_once_and_hides_the_password(spark, setup, tmp_path):
    q, df = start(spark, setup, tmp_path / "cp")
    q.awaitTermination(180)
    assert q.exception() is None, q.exception()
    values = out_values(setup)
    assert len(values) == ROWS and sorted(values) == sorted(
        b"%s:%d" % (p, i) for p in (b"1-0", b"1-1") for i in range(ROWS // 2))
    shown = [p.json for p in q.recentProgress] + [df._jdf.queryExecution().toString(), str(q.status)]
    assert not any(PASSWORD in text for text in shown)
    assert not any(PASSWORD in f.read_text(errors="replace") for f in (tmp_path / "cp").rglob("*") if f.is_file())
    assert PASSWORD not in setup["broker"].log_path.read_text()
    with Consumer(zk_connect=setup["zk"], zk_root=setup["root"], security=setup["admin"], group="etl-group") as c:
        assert sum(c.committed("in").values()) >= 1000  # the group's offsets, committed through the broker


def failure(q) -> str:
    """The query's error, once it has stopped (awaitTermination raises it)."""
    with pytest.raises(Exception):
        q.awaitTermination(180)
    return str(q.exception())


def test_a_user_without_the_sinks_acl_is_refused_naming_it(spark, setup, tmp_path):
    q, _ = start(spark, setup, tmp_path / "cp2", user="intruder", password="intruder-pw", sink_id="etl-orders")
    error = failure(q)
    assert "User:intruder is not allowed Write on sink 'etl-orders'" in error
    assert "intruder-pw" not in error


def test_a_wrong_password_fails_the_query_saying_so(spark, setup, tmp_path):
    q, _ = start(spark, setup, tmp_path / "cp3", password="wrong-password")
    error = failure(q)
    assert "unknown user or wrong password" in error and "wrong-password" not in error
