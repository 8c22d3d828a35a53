"""An attacker's tests of issue 25's broker defects, each against real broker processes and a real
ZooKeeper: a coordinator path with ``..`` (5), a certificate whose principal differed by port (6), user
names told apart by timing and salts (8), group offsets committed for partitions that do not exist (10).
Resource exhaustion before authentication (4) is in test_resource_limits.py, sessions that end at once (7)
in test_security_dataport.py and test_security.py, the fuzzers in test_fuzz_*.py."""
import json
import statistics
import time

import grpc
import pytest
from certs import CertificateAuthority
from conftest import wait_until
from cryptography import x509
from cryptography.x509.oid import NameOID

from metaq_broker.client import Admin, Consumer, Producer
from metaq_broker.client.dataconn import DataConnection
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.errors import AuthenticationError, AuthorizationError, ConfigError
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.protocol import rawput, records
from metaq_broker.protocol.services import AUTH_PATH, COMMIT_OFFSETS
from metaq_broker.protocol.status import RemoteTransactionError
from metaq_broker.security import principals
from metaq_broker.security.acl import Acl
from metaq_broker.security.scram import Credential
from metaq_broker.security.settings import ClientSecurity, read_pem
from metaq_broker.server.txn_resolver import TransactionResolver
from metaq_broker.store import MessageStore, TopicConfig
from metaq_broker.store.transactions import TransactionManager
from metaq_broker.zk import decisions as txn_decisions
from metaq_broker.zk.acls import add_acls
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.users import put_user
from test_security import registered_data_port
from test_security_dataport import zk  # noqa: F401 - a fixture: a ZooKeeper client

pytestmark = pytest.mark.unit


def tls(pki, protocol="SSL", **more) -> dict:
    return {"security.protocol": protocol, "ssl.certificate.location": pki.broker.cert,
            "ssl.key.location": pki.broker.key, "ssl.ca.location": pki.ca, **more}


def sasl(pki, user, password, mechanism="SCRAM-SHA-256") -> ClientSecurity:
    return ClientSecurity.from_properties({"security.protocol": "SASL_SSL", "ssl.ca.location": pki.ca,
                                           "sasl.mechanism": mechanism, "sasl.username": user,
                                           "sasl.password": password})


def broker(cluster, broker_id, settings, topics=None, **kw) -> BrokerProcess:
    return cluster.start_broker(broker_id, settings, topics=topics or {"t": {"numPartitions": 2}}, **kw)


# -- 5: a coordinator path with ".." ----------------------------------------------------------------------

def begin(producer, xid: str, path: str):
    return producer.connection(1).call("BeginTransaction", pb.BeginTransactionRequest(
        xid=xid, coordinator=json.dumps({"path": path, "run": "r1"})))


def test_begin_transaction_refuses_a_coordinator_path_zookeeper_would_refuse(cluster):
    broker(cluster, 1, {})
    with cluster.client(Producer) as p:
        wait_until(lambda: p.partitions("t"), what="topic t")
        for bad in (f"{cluster.zk_root}/sinks/s/batches/../../../brokers", f"{cluster.zk_root}/sinks//x",
                    f"{cluster.zk_root}/sinks/./x"):
            with pytest.raises(RemoteTransactionError, match="coordinator path .* cannot be used in a ZooKeeper path"):
                begin(p, "s/1/r1/0-0", bad)
        begin(p, "s/1/r1/0-0", f"{cluster.zk_root}/elsewhere/7")  # an open broker trusts its clients' paths


def test_a_secured_broker_takes_only_the_record_of_the_transactions_own_batch(cluster, zk, pki):
    put_user(zk, cluster.zk_root, "etl", Credential.make("etl-pw"))
    add_acls(zk, cluster.zk_root, [Acl("User:etl", "Allow", "Write", "sink", "s")])
    broker(cluster, 1, tls(pki, "SASL_SSL", authorizer="acl"))
    paths = ZkPaths(cluster.zk_root)
    with cluster.client(Producer, security=sasl(pki, "etl", "etl-pw")) as p:
        wait_until(lambda: p.cluster.brokers(), what="broker 1")
        for bad in (paths.sink_batch("s", 2), paths.sink_batch("other", 1), paths.sink_batches("s") + "/1",
                    paths.sink_batches("s") + "/00000000000000000001/..", paths.sinks() + "/s/x"):
            with pytest.raises(RemoteTransactionError, match="coordinator path"):
                begin(p, "s/1/r1/0-0", bad)
        with pytest.raises(RemoteTransactionError, match="names no sink batch"):
            begin(p, "s/x/r1/0-0", paths.sink_batch("s", 1))
        assert begin(p, "s/1/r1/0-0", paths.sink_batch("s", 1)).state == "open"


def test_one_unreadable_decision_record_does_not_stop_the_resolver(tmp_path, zk, zk_root):
    """Two in-doubt transactions: one names a record ZooKeeper refuses (journalled by a broker that took any
    path), the other a commit decision. The resolver commits the second all the same, and rolls the first
    back once its timeout passed (no decision can ever be read for it)."""
    store = MessageStore(tmp_path / "data", {"t": TopicConfig(num_partitions=1)}, background_interval=None)
    tx = TransactionManager(store, tmp_path / "data" / "transactions", default_timeout_s=3)
    good = f"{zk_root}/sinks/s/batches/{1:020d}"
    for xid, path in (("bad", f"{zk_root}/sinks/s/../../../x"), ("good", good)):
        tx.begin(xid, coordinator=json.dumps({"path": path, "run": "r1"}))
        tx.put(xid, "t", 0, records.encode_body([xid.encode()]))
        tx.prepare(xid)
    txn_decisions.decide_commit(zk, good, "r1", [[1, "good"]])
    resolver = TransactionResolver(tx, 1, lambda: zk)
    try:
        resolver.run_once()
        assert tx.state("good") == "committed" and tx.state("bad") == "prepared"
        wait_until(lambda: resolver.run_once() or tx.state("bad") == "rolled_back", timeout=20,
                   what="the unreadable one rolled back after its timeout")
    finally:
        tx.close()
        store.close()


# -- 6: one principal for one certificate, on every port ---------------------------------------------------

def test_mapping_rules_parse_as_kafkas():
    rules = principals.parse_rules(r"RULE:^CN=([^,]+),O=(.*)$/$1@$2/L, RULE:^OU=a\/b$/slash/, DEFAULT")
    assert principals.principal_of_dn("CN=Carol,O=Corp", rules) == "User:carol@corp"
    assert principals.principal_of_dn("OU=a/b", rules) == "User:slash"
    assert principals.principal_of_dn("OU=x", rules) == "User:OU=x"
    default = principals.parse_rules(None)
    assert principals.principal_of_dn("CN=alice,OU=eng,O=corp", default) == "User:alice"
    assert principals.principal_of_dn(r"CN=a\,b,O=corp", default) == r"User:a\,b"
    assert principals.principal_of_dn("O=corp,CN=alice", default) == "User:O=corp,CN=alice"
    assert principals.principal_of_dn("", default) is None  # an empty subject names nobody
    assert principals.principal_of_dn("CN=x", principals.parse_rules("RULE:^O=(.*)$/$1/")) is None
    for bad in ("RULE:^CN=(.*)$", "RULE:(/x/", "FOO", "DEFAULT DEFAULT"):
        with pytest.raises(ConfigError, match="ssl.principal.mapping.rules"):
            principals.parse_rules(bad)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    ca = CertificateAuthority(tmp_path_factory.mktemp("ca6"))
    name = lambda *attrs: x509.Name([x509.NameAttribute(oid, v) for oid, v in attrs])  # noqa: E731
    return ca, {
        "broker": ca.issue("broker", "broker", ("127.0.0.1", "localhost")),
        "admin": ca.issue("admin", "admin", client=True),
        "san-admin": ca.issue("san-admin", "", client=True, subject=name(), sans=[x509.DNSName("admin")]),
        "o-admin": ca.issue("o-admin", "", client=True, subject=name((NameOID.ORGANIZATION_NAME, "admin")),
                            sans=[x509.DNSName("admin")]),
        "carol": ca.issue("carol", "", client=True, subject=name(
            (NameOID.COUNTRY_NAME, "US"), (NameOID.ORGANIZATION_NAME, "Corp"), (NameOID.COMMON_NAME, "Carol"))),
    }


def mtls_client(ca, pem) -> ClientSecurity:
    return ClientSecurity.from_properties({"security.protocol": "SSL", "ssl.ca.location": ca.ca_path,
                                           "ssl.certificate.location": pem.cert, "ssl.key.location": pem.key})


def mtls_broker(cluster, certificates, rules=None) -> tuple:
    ca, certs = certificates
    admin = certs["admin"]
    settings = {"security.protocol": "SSL", "ssl.certificate.location": certs["broker"].cert,
                "ssl.key.location": certs["broker"].key, "ssl.ca.location": ca.ca_path, "ssl.client.auth": "required",
                "authorizer": "acl", "super.users": "User:admin"}
    if rules:
        settings["ssl.principal.mapping.rules"] = rules
    b = broker(cluster, 1, settings, topics={"secret": {"numPartitions": 1}},
               health_certificate=(admin.cert, admin.key))
    return b, f"127.0.0.1:{registered_data_port(cluster.zk_connect, cluster.zk_root, 1)}"


def put_parts(values, topic="secret"):
    body = records.encode_body(values)
    return rawput.pack_parts(topic, 0, "", body.count, body.attributes, body.crc, body.parts)


def stored(cluster, ca, admin) -> list:
    with cluster.client(Consumer, security=mtls_client(ca, admin)) as c:
        return c.fetch("secret", "1-0", 0).batch.column("value").to_pylist()


@pytest.mark.parametrize("who", ["san-admin", "o-admin"])
def test_a_subject_alternative_name_never_becomes_a_principal(cluster, certificates, who):
    """No CN, SAN DNS:admin: the data port took it for the super user User:admin (and stored a put to
    `secret`), gRPC for `User:`. Now one rule decides for both: an empty subject is refused on both ports,
    O=admin is User:O=admin on both, and User:O=admin may do nothing."""
    ca, certs = certificates
    _, data_address = mtls_broker(cluster, certificates)
    sec = mtls_client(ca, certs[who])
    refusal = AuthenticationError if who == "san-admin" else AuthorizationError
    message = "names no principal" if who == "san-admin" else "User:O=admin is not allowed Write"
    with DataConnection(data_address, 10, sec) as d:
        d.send_put(put_parts([b"smuggled"]))
        with pytest.raises(refusal, match=message):
            d.receive_put()
    with cluster.client(Producer, security=sec, use_data_port=False) as p:
        wait_until(lambda: p.partitions("secret"), what="topic secret")
        with pytest.raises(refusal, match=message if who == "san-admin" else "User:O=admin is not allowed"):
            p.send_batch("secret", [b"smuggled"], partition="1-0")
    assert stored(cluster, ca, certs["admin"]) == []


def test_both_ports_name_the_same_principal_by_the_mapping_rules(cluster, certificates):
    ca, certs = certificates
    _, data_address = mtls_broker(cluster, certificates, rules="RULE:^CN=([^,]+),O=([^,]+),.*$/$1@$2/L")
    sec = mtls_client(ca, certs["carol"])
    with DataConnection(data_address, 10, sec) as d:
        with pytest.raises(AuthorizationError, match="User:carol@corp is not allowed Read on topic 'secret'"):
            d.fetch("secret", 0, 0)
    with cluster.client(Consumer, security=sec) as c:
        wait_until(lambda: c.partitions("secret"), what="topic secret")
        with pytest.raises(AuthorizationError, match="User:carol@corp is not allowed Read on topic 'secret'"):
            c.fetch("secret", "1-0", 0)
    with Admin(brokers=f"1={cluster.brokers[1].address}", security=mtls_client(ca, certs["admin"])) as admin:
        with pytest.raises(AuthenticationError, match="names no principal"):  # the rule maps CN=admin to nothing
            admin.stats(1)


# -- 8: user names cannot be probed -------------------------------------------------------------------------

ITERATIONS = 16384  # a cost above the default, so that the iteration count and the work can both be compared


@pytest.fixture(scope="module")
def two_sasl_brokers(tmp_path_factory, zookeeper, pki):
    from test_security import Brokers
    bs = Brokers.made(tmp_path_factory, zookeeper, "probe", users={"alice": "alice-pw", "bob": "bob-pw"},
                      iterations=ITERATIONS)
    yield bs, [bs.start(f"b{i}", i, tls(pki, "SASL_SSL")) for i in (1, 2)]
    bs.stop()


def auth_call(channel, mechanism: str, message: str):
    call = channel.unary_unary(AUTH_PATH)
    return call(json.dumps({"mechanism": mechanism, "message": message}).encode(), timeout=10)


def channel_to(pki, address) -> grpc.Channel:
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(read_pem("ca", pki.ca)))


def server_first(pki, address, user: str) -> dict:
    with channel_to(pki, address) as ch:
        reply = json.loads(auth_call(ch, "SCRAM-SHA-256", f"n,,n={user},r=clientnonce"))
    return dict(item.split("=", 1) for item in reply["message"].split(","))


def test_scram_shows_an_unknown_user_a_stable_salt_and_the_users_iteration_count(two_sasl_brokers, pki):
    bs, (b1, b2) = two_sasl_brokers
    known = server_first(pki, b1.address, "alice")
    fake1, fake2 = (server_first(pki, b.address, "mallory") for b in (b1, b2))
    assert int(known["i"]) == int(fake1["i"]) == ITERATIONS
    assert fake1["s"] == fake2["s"] and fake1["s"] != server_first(pki, b1.address, "trudy")["s"]
    assert len(fake1["s"]) == len(known["s"])  # 16 bytes, base64
    b1.stop()
    b1.start()
    assert server_first(pki, b1.address, "mallory")["s"] == fake1["s"]  # after a restart too


def test_plain_costs_the_same_for_an_unknown_user_as_for_a_wrong_password(two_sasl_brokers, pki):
    """Many interleaved trials of each, compared by their medians with a tolerant bound (the known user's
    wrong password took 3x as long as an unknown user before: one PBKDF2 against none)."""
    bs, (b1, _) = two_sasl_brokers
    times: dict = {"known": [], "unknown": []}
    with channel_to(pki, b1.address) as ch:
        for i in range(60):
            for kind, user in (("known", "alice"), ("unknown", f"nobody{i}")):
                start = time.perf_counter()
                with pytest.raises(grpc.RpcError) as e:
                    auth_call(ch, "PLAIN", f"\0{user}\0wrong-password")
                times[kind].append(time.perf_counter() - start)
                assert "unknown user or wrong password" in e.value.details()
    known, unknown = statistics.median(times["known"]), statistics.median(times["unknown"])
    print(f"PLAIN refusal, median of 60: known user {known * 1e3:.2f} ms, unknown user {unknown * 1e3:.2f} ms")
    assert 0.7 < unknown / known < 1.4


# -- 10: group offsets only for partitions that exist ------------------------------------------------------

def test_commit_offsets_takes_only_the_topics_partitions(cluster, zk, pki):
    put_user(zk, cluster.zk_root, "bob", Credential.make("bob-pw"))
    add_acls(zk, cluster.zk_root, [Acl("User:bob", "Allow", "Read", "group", "g"),
                                   Acl("User:bob", "Allow", "Read", "topic", "*")])
    broker(cluster, 1, tls(pki, "SASL_SSL", authorizer="acl"))
    offsets = ZkPaths(cluster.zk_root).group_offsets("g", "t")
    with cluster.client(Consumer, security=sasl(pki, "bob", "bob-pw"), group="g") as c:
        wait_until(lambda: c.partitions("t"), what="topic t")
        assert c.broker_group_call(COMMIT_OFFSETS, {"group": "g", "topic": "t", "offsets": {"1-1": 5}}) == {"1-1": 5}
        for bad, why in (({"1-2": 1}, "topic 't' has no partition '1-2' .its partitions: 1-0..1-1"),
                         ({"9-0": 1}, "has no partition '9-0'"),
                         ({f"1-{n}": 1 for n in range(10_000)}, "at most 4096 per call")):
            with pytest.raises(ValueError, match=why):
                c.broker_group_call(COMMIT_OFFSETS, {"group": "g", "topic": "t", "offsets": bad})
        with pytest.raises(ValueError, match="no broker has the topic"):
            c.broker_group_call(COMMIT_OFFSETS, {"group": "g", "topic": "nope", "offsets": {"1-0": 1}})
    assert zk.get_children(offsets) == ["1-1"]  # nothing written for a partition that does not exist
