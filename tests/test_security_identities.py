"""ZooKeeper identities (docs/security.md, section 6): clients never hold one that can change users or ACLs.

The attack this guards against: the docs once told users to give the brokers' zk.auth to the exactly-once
sink, so a job allowed only Write on ``out`` could grant itself ``All topic *`` in ZooKeeper and read
``payroll``. Now the sink keeps its decision records and offsets through the brokers (which check its
ACLs) and needs no ZooKeeper identity; clients that must write ZooKeeper themselves (balanced group
membership, PLAINTEXT committers) get the clients' identity (the brokers' zk.client.auth), whose rights
cover only consumer groups and decision records. Real broker processes, ZooKeeper and Spark."""
import time

import pytest
from conftest import wait_until
from kazoo.exceptions import NoAuthError

from metaq_broker.client import Consumer, Producer
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.errors import AuthenticationError, AuthorizationError
from metaq_broker.protocol.status import RemoteInvalidArgumentError
from metaq_broker.security.acl import Acl
from metaq_broker.security.scram import Credential
from metaq_broker.security.settings import ZkSecurity
from metaq_broker.zk.acls import add_acls, list_acls, remove_acls
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import new_client
from metaq_broker.zk.users import put_user

pytestmark = pytest.mark.unit

CLUSTER = "digest:metaq:cluster-pw"  # brokers and the admin
CLIENTS = "digest:apps:apps-pw"  # the clients' identity: groups and decision records only
ROWS = 1000
GRANT_ALL = Acl("User:etl", "Allow", "All", "topic", "*")


def session(zookeeper, auth=None):
    zk = new_client(zookeeper.connect_string, security=ZkSecurity.from_properties({"zk.auth": auth} if auth else {}))
    zk.start(15)
    return zk


def the_attack_fails(zk, root):
    """What a job's ZooKeeper session must not do: grant itself every topic, add a user, drop ACLs."""
    with pytest.raises(NoAuthError):
        add_acls(zk, root, [GRANT_ALL])
    with pytest.raises(NoAuthError):
        put_user(zk, root, "mallory", Credential.make("mallory-pw"))
    with pytest.raises(NoAuthError):
        zk.delete(ZkPaths(root).acl_resource("topic", "literal", "payroll"), recursive=True)


@pytest.fixture(scope="module")
def secured(tmp_path_factory, zookeeper, pki):
    work = tmp_path_factory.mktemp("identities")
    root = f"/identities-{time.time_ns()}"
    admin_zk = session(zookeeper, CLUSTER)
    for user, password in (("etl", "etl-pw"), ("admin", "admin-pw")):
        put_user(admin_zk, root, user, Credential.make(password))
    add_acls(admin_zk, root, [Acl("User:etl", "Allow", "Read", "topic", "in"),
                              Acl("User:etl", "Allow", "Write", "topic", "out"),
                              Acl("User:etl", "Allow", "Read", "group", "etl-group"),
                              Acl("User:etl", "Allow", "Write", "sink", "etl-", "prefixed"),
                              Acl("User:admin", "Allow", "Read", "topic", "payroll")])
    broker = BrokerProcess(work / "b", 1, zookeeper.connect_string, settings={
        "zk.root": root, "zk.sessionTimeout": 4000, "zk.auth": CLUSTER, "zk.client.auth": CLIENTS,
        "security.protocol": "SASL_SSL", "ssl.certificate.location": pki.broker.cert,
        "ssl.key.location": pki.broker.key, "ssl.ca.location": pki.ca, "authorizer": "acl",
        "super.users": "User:admin"}, topics={"in": {"numPartitions": 2}, "out": {"numPartitions": 2},
                                              "payroll": {"numPartitions": 1}}).start()
    sec = {"security.protocol": "SASL_SSL", "ssl.ca.location": pki.ca}
    admin = {**sec, "sasl.username": "admin", "sasl.password": "admin-pw"}
    with Producer(zk_connect=zookeeper.connect_string, zk_root=root, security=admin) as p:
        wait_until(lambda: len(p.cluster.topic_partitions("in")) == 2, what="topic in")
        for part in ("1-0", "1-1"):
            p.send_batch("in", [b"%s:%d" % (part.encode(), i) for i in range(ROWS // 2)], partition=part)
        p.send_batch("payroll", [b"alice: 100000"], partition="1-0")
    yield {"zk": zookeeper.connect_string, "root": root, "admin_zk": admin_zk, "broker": broker,
           "etl": {**sec, "sasl.username": "etl", "sasl.password": "etl-pw"}, "admin": admin}
    broker.kill()
    admin_zk.stop()
    admin_zk.close()


def test_the_exactly_once_sink_needs_no_zookeeper_identity_and_none_a_job_holds_changes_acls(
        secured, spark, tmp_path, zookeeper):
    s, root = secured, secured["root"]
    options = {"metaq.zk.connect": s["zk"], "metaq.zk.root": root, "metaq.security.protocol": "SASL_SSL",
               "metaq.ssl.ca.location": s["etl"]["ssl.ca.location"], "metaq.sasl.username": "etl",
               "metaq.sasl.password": "etl-pw"}  # and no metaq.zk.auth
    df = spark.readStream.format("metaq").options(**options).option("subscribe", "in") \
        .option("group", "etl-group").option("maxOffsetsPerTrigger", 300).load()
    q = (df.selectExpr("key", "value").writeStream.format("metaq").options(**options).option("topic", "out")
         .option("sinkId", "etl-orders").option("checkpointLocation", str(tmp_path / "cp"))
         .trigger(availableNow=True).start())
    q.awaitTermination(180)
    assert q.exception() is None, q.exception()
    with Consumer(zk_connect=s["zk"], zk_root=root, security=s["admin"]) as c:
        values = [v for p in ("1-0", "1-1") for v in c.read_range("out", p, 0, c.offsets("out", [p])[p][1])
                  .column("value").to_pylist()]
        assert sorted(values) == sorted(b"%s:%d" % (p, i) for p in (b"1-0", b"1-1") for i in range(ROWS // 2))
    admin_zk, paths = s["admin_zk"], ZkPaths(root)
    batches = admin_zk.get_children(paths.sink_batches("etl-orders"))  # written by the broker for the job
    assert batches, "no decision record"
    acl = {a.id.id.split(":")[0] for a in admin_zk.get_acls(paths.sink_batch("etl-orders", int(batches[-1])))[0]}
    assert acl == {"metaq", "apps"}  # the cluster's and the clients' identity, nobody else

    # the job's credentials: its SASL user, and at most the clients' ZooKeeper identity
    for auth in (None, CLIENTS):
        zk = session(zookeeper, auth)
        try:
            the_attack_fails(zk, root)
        finally:
            zk.stop()
            zk.close()
    from metaq_broker.client.decisions import SinkDecisions  # here: what comes before needs only older parts
    with Producer(zk_connect=s["zk"], zk_root=root, security=s["etl"]) as p:
        records = SinkDecisions(p)
        assert records.via_broker
        with pytest.raises(AuthorizationError, match="User:etl is not allowed Write on sink 'payroll-job'"):
            records.decide_commit("payroll-job", 0, "run-1", [[1, "payroll-job/0/x"]])
        with pytest.raises(RemoteInvalidArgumentError, match="cannot be used in a ZooKeeper path"):
            records.decide_abort("..", 0, "run-1")
    with Consumer(zk_connect=s["zk"], zk_root=root, security=s["etl"], group="payroll-readers") as c:
        with pytest.raises(AuthorizationError, match="User:etl is not allowed Read on group 'payroll-readers'"):
            c.commit("payroll", {"1-0": 0})
        with pytest.raises(AuthorizationError, match="User:etl is not allowed Read on topic 'payroll'"):
            c.fetch("payroll", "1-0", 0)

        # the attack is real: with the cluster's identity (which the docs once handed out) it succeeds
        add_acls(admin_zk, root, [GRANT_ALL])
        try:
            wait_until(lambda: _reads(c), what="etl reading payroll once granted All on every topic")
        finally:
            remove_acls(admin_zk, root, [GRANT_ALL])
    assert GRANT_ALL not in list_acls(admin_zk, root)


def _reads(consumer) -> bool:
    try:
        return consumer.fetch("payroll", "1-0", 0).batch.column("value").to_pylist() == [b"alice: 100000"]
    except AuthorizationError:
        return False


@pytest.fixture
def plaintext(tmp_path, zookeeper):
    """A PLAINTEXT broker that protects ZooKeeper with both identities; stopped at teardown."""
    root = f"/identities-plain-{time.time_ns()}"
    brokers = []

    def start(**settings):
        b = BrokerProcess(tmp_path / "b", 2, zookeeper.connect_string, settings={
            "zk.root": root, "zk.sessionTimeout": 4000, "zk.auth": CLUSTER, **settings},
            topics={"t": {"numPartitions": 2}})
        brokers.append(b)
        return b.start()

    yield root, start
    for b in brokers:
        b.kill()


def test_plaintext_clients_hold_the_clients_identity_or_go_through_the_brokers(plaintext, zookeeper):
    from metaq_broker.client.decisions import SinkDecisions
    root, start = plaintext
    start(**{"zk.client.auth": CLIENTS})
    where = {"zk_connect": zookeeper.connect_string, "zk_root": root}
    with Consumer(**where, group="members", security={"zk.auth": CLIENTS}) as member:
        wait_until(lambda: member.cluster.topic_partitions("t"), what="topic t")
        assert not member.group_offsets_via_broker
        assert member.subscribe("t") == ["2-0", "2-1"]  # its ids and owners nodes, with its own session
        member.commit("t", {"2-0": 0, "2-1": 0})
        admin_zk = session(zookeeper, CLUSTER)
        try:
            paths = ZkPaths(root)
            for path in (paths.group_offset("members", "t", "2-0"), paths.group_owner("members", "t", "2-1")):
                assert {a.id.id.split(":")[0] for a in admin_zk.get_acls(path)[0]} == {"metaq", "apps"}, path
            records = SinkDecisions(member)  # a PLAINTEXT sink with the clients' identity writes itself
            assert records.decide_commit("job", 3, "run-1", [[2, "job/3/x"]]).xids == [[2, "job/3/x"]]
            assert admin_zk.exists(paths.sink_batch("job", 3))
            add_acls(admin_zk, root, [Acl("User:admin", "Allow", "Read", "topic", "payroll")])
            the_attack_fails(member.cluster.zk, root)
        finally:
            admin_zk.stop()
            admin_zk.close()

    with Consumer(**where, group="readers") as plain:  # no ZooKeeper identity at all
        wait_until(plain.cluster.zk_protected, what="the broker's registration saying ZooKeeper is protected")
        assert plain.group_offsets_via_broker
        assert plain.commit("t", {"2-0": 0}) == {"2-0": 0} and plain.committed("t") == {"2-0": 0}
        with pytest.raises(AuthenticationError, match="zk.client.auth"):
            plain.subscribe("t")
        records = SinkDecisions(plain)
        assert records.decide_commit("job2", 0, "run-1", []).outcome == "commit"
        assert records.read("job2", 0).run == "run-1"


def test_a_restart_with_zk_client_auth_opens_the_existing_groups_to_the_clients_identity(plaintext, zookeeper):
    """An operator adds zk.client.auth to a running cluster: groups committed before keep working."""
    root, start = plaintext
    broker = start()
    where = {"zk_connect": zookeeper.connect_string, "zk_root": root}
    with Consumer(**where, group="old", security={"zk.auth": CLUSTER}) as admin:
        wait_until(lambda: admin.cluster.topic_partitions("t"), what="topic t")
        admin.commit("t", {"2-0": 5})
    broker.kill()
    start(**{"zk.client.auth": CLIENTS})
    with Consumer(**where, group="old", security={"zk.auth": CLIENTS}) as member:
        assert member.committed("t") == {"2-0": 5}
        member.commit("t", {"2-0": 7})
        assert member.committed("t") == {"2-0": 7}


def test_bad_identity_settings_are_refused_naming_the_key():
    from metaq_broker.errors import ConfigError
    from metaq_broker.security.settings import ClientSecurity
    with pytest.raises(ConfigError, match="zk.client.auth needs zk.auth"):
        ZkSecurity.from_properties({"zk.client.auth": CLIENTS})
    with pytest.raises(ConfigError, match="zk.client.auth must name another user than zk.auth"):
        ZkSecurity.from_properties({"zk.auth": CLUSTER, "zk.client.auth": "digest:metaq:other-pw"})
    with pytest.raises(ConfigError, match="zk.client.auth: expected digest:USER:PASSWORD"):
        ZkSecurity.from_properties({"zk.auth": CLUSTER, "zk.client.auth": "digest:apps"})
    with pytest.raises(ConfigError, match="zk.client.auth is a broker setting"):
        ClientSecurity.from_properties({"zk.client.auth": CLIENTS})
    both = ZkSecurity.from_properties({"zk.auth": CLUSTER, "zk.client.auth": CLIENTS})
    assert "apps-pw" not in repr(both) and "cluster-pw" not in repr(both)
