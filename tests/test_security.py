"""TLS, SASL and ACLs with real broker processes and a real ZooKeeper (docs/security.md): who gets in, what
they may do, and that every refusal says why. Certificates come from a throwaway CA (tests/certs.py).
The data port's side is in test_security_dataport.py, ZooKeeper's own ACLs in test_security_zk.py."""
import base64
import contextlib
import json
import socket
import ssl
import threading
import time
import urllib.request

import pytest
from conftest import wait_until

from metaq_broker.client import Admin, Consumer, Producer
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.errors import AuthenticationError, AuthorizationError, ConfigError
from metaq_broker.security.acl import Acl, AclTable
from metaq_broker.security.scram import Credential, ScramClient
from metaq_broker.security.settings import BrokerSecurity, ClientSecurity
from metaq_broker.zk.acls import add_acls
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import new_client
from metaq_broker.zk.users import delete_user, put_user

pytestmark = pytest.mark.unit

PASSWORDS = {"alice": "alice-secret-1", "bob": "bob-secret-2", "admin": "admin-secret-3", "dave": "dave-secret-4"}


def tls_settings(pki, cert=None, **more):
    cert = cert or pki.broker
    return {"security.protocol": "SSL", "ssl.certificate.location": cert.cert, "ssl.key.location": cert.key,
            **more}


def sasl(pki, user, mechanism="SCRAM-SHA-256", password=None):
    return {"security.protocol": "SASL_SSL", "ssl.ca.location": pki.ca, "sasl.mechanism": mechanism,
            "sasl.username": user, "sasl.password": PASSWORDS.get(user, "") if password is None else password}


class Brokers:
    """Broker processes of one module under one zk root, killed at the end."""

    def __init__(self, workdir, zk_connect, root):
        self.workdir, self.zk_connect, self.root = workdir, zk_connect, root
        self.started = []

    def start(self, name, broker_id, settings, topics=None, **kw):
        ready_by_log = kw.pop("ready_by_log", False)
        b = BrokerProcess(self.workdir / name, broker_id, self.zk_connect,
                          settings={"zk.root": self.root, "zk.sessionTimeout": 4000, "metricsPort": 0, **settings},
                          topics=topics, **kw)
        self.started.append(b)
        return b.start(ready_by_log=ready_by_log)

    def client(self, cls, security=None, **kw):
        return cls(zk_connect=self.zk_connect, zk_root=self.root, security=security, **kw)

    @classmethod
    def made(cls, tmp_path_factory, zookeeper, name: str, users=None, acls=(), iterations: int = 4096) -> "Brokers":
        """A fresh zk root with SCRAM ``users`` ({name: password}) and ``acls`` written (the ZooKeeper client
        that wrote them is closed again)."""
        bs = cls(tmp_path_factory.mktemp(name), zookeeper.connect_string, f"/{name}-{time.time_ns()}")
        with bs._zk() as zk:
            for user, password in (users or {}).items():
                put_user(zk, bs.root, user, Credential.make(password, iterations=iterations))
            if acls:
                add_acls(zk, bs.root, list(acls))
        return bs

    def data_port(self, broker_id: int) -> int:
        return registered_data_port(self.zk_connect, self.root, broker_id)

    def _zk(self):
        return _zk_client(self.zk_connect)

    def stop(self):
        for b in self.started:
            b.kill()


@contextlib.contextmanager
def _zk_client(zk_connect: str):
    zk = new_client(zk_connect)
    zk.start(15)
    try:
        yield zk
    finally:
        zk.stop()
        zk.close()


def registered_data_port(zk_connect: str, root: str, broker_id: int) -> int:
    """The data port broker ``broker_id`` registered under ``root``."""
    with _zk_client(zk_connect) as zk:
        return json.loads(zk.get(ZkPaths(root).broker(broker_id))[0])["dataPort"]


def login(broker, security):
    """Authenticate with a static-list client (the first call does) and ask for something harmless."""
    with Admin(brokers=f"1={broker.address}", security=security, timeout=10) as admin:
        admin.connection(1).session_token()


def _brokers(tmp_path_factory, zookeeper, name):
    return Brokers(tmp_path_factory.mktemp(name), zookeeper.connect_string, f"/sec-{name}-{time.time_ns()}")


# -- unit: the pieces without a network ---------------------------------------------------------------
def test_scram_matches_rfc7677_and_never_accepts_a_wrong_password():
    client = ScramClient("user", "pencil", nonce="rOprNGfwEbeRWgbNEkqO")
    final = client.final("r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096")
    assert final.endswith("p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")  # RFC 7677's example
    client.verify("v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")
    with pytest.raises(AuthenticationError, match="signature"):
        client.verify("v=" + "A" * 44)
    cred = Credential.make("pencil")
    assert Credential.decode(cred.encode()) == cred and "pencil" not in cred.encode()
    assert cred.check_password("pencil") and not cred.check_password("pencil ")


def test_acl_evaluation_deny_wins_prefixes_implied_describe_and_super_users():
    table = AclTable([Acl("User:alice", "Allow", "All", "topic", "orders-", "prefixed"),
                      Acl("User:alice", "Deny", "Write", "topic", "orders-audit"),
                      Acl("User:*", "Allow", "Read", "topic", "public"),
                      Acl("User:bob", "Allow", "Read", "group", "*")], super_users={"User:admin"})
    assert table.allows("User:alice", "Write", "topic", "orders-eu")
    assert not table.allows("User:alice", "Write", "topic", "orders-audit")
    assert table.allows("User:alice", "Read", "topic", "orders-audit")  # a denial of Write is not one of Read
    assert not table.allows("User:alice", "Read", "topic", "order")  # a prefix is not a substring match
    assert table.allows("User:carol", "Describe", "topic", "public")  # Read implies Describe
    assert not table.allows("User:carol", "Write", "topic", "public")
    assert table.allows("User:bob", "Read", "group", "anything") and not table.allows("User:bob", "Read", "topic", "x")
    assert table.allows("User:admin", "Alter", "cluster", "metaq-cluster")
    assert not AclTable().allows("User:alice", "Read", "topic", "t")  # no matching allow: denied
    with pytest.raises(ConfigError, match="User:NAME"):
        Acl("alice", "Allow", "Read", "topic", "t")
    with pytest.raises(ConfigError, match="operation 'Reed'"):
        Acl("User:alice", "Allow", "Reed", "topic", "t")


def test_bad_security_settings_name_the_key_and_never_show_a_password(pki, tmp_path):
    with pytest.raises(ConfigError, match="security.protocol: 'TLS' is not one of"):
        ClientSecurity.from_properties({"security.protocol": "TLS"})
    with pytest.raises(ConfigError, match="ssl.ca.location: .*missing.pem does not exist"):
        ClientSecurity.from_properties({"security.protocol": "SSL", "ssl.ca.location": str(tmp_path / "missing.pem")})
    with pytest.raises(ConfigError, match="needs sasl.username and sasl.password"):
        ClientSecurity.from_properties({"security.protocol": "SASL_SSL", "sasl.username": "alice"})
    with pytest.raises(ConfigError, match="unknown security key 'sasl.passwd'"):
        ClientSecurity.from_properties({"sasl.passwd": "x"})
    sec = ClientSecurity.from_properties(sasl(pki, "alice"))
    assert PASSWORDS["alice"] not in repr(sec) and PASSWORDS["alice"] not in str(sec)
    with pytest.raises(ConfigError, match="needs ssl.certificate.location"):
        BrokerSecurity.from_properties({"security.protocol": "SSL"})
    with pytest.raises(ConfigError, match="ssl.client.auth=required needs ssl.ca.location"):
        BrokerSecurity.from_properties(tls_settings(pki, **{"ssl.client.auth": "required"}))
    with pytest.raises(ConfigError, match="super.users: 'admin' is not a principal"):
        BrokerSecurity.from_properties({"super.users": "admin"})
    not_pem = tmp_path / "key.txt"
    not_pem.write_text("hello")
    from metaq_broker.security.settings import read_pem
    with pytest.raises(ConfigError, match="is not a PEM file"):
        read_pem("ssl.key.location", str(not_pem))


# -- TLS ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_brokers(tmp_path_factory, zookeeper, pki):
    bs = _brokers(tmp_path_factory, zookeeper, "tls")
    good = bs.start("good", 1, tls_settings(pki, **{"ssl.ca.location": pki.ca}), topics={"t": {"numPartitions": 2}})
    expired = bs.start("expired", 2, tls_settings(pki, pki.expired_broker), ready_by_log=True)
    elsewhere = bs.start("elsewhere", 3, tls_settings(pki, pki.other_host_broker), ready_by_log=True)
    yield bs, good, expired, elsewhere
    bs.stop()


def test_tls_carries_produce_and_fetch(tls_brokers, pki):
    _, good, _, _ = tls_brokers
    sec = {"security.protocol": "SSL", "ssl.ca.location": pki.ca}
    with Producer(brokers=f"1={good.address}", security=sec, use_data_port=False) as p:
        p.send_batch("t", [b"over", b"tls"], partition="1-0")
    with Consumer(brokers=f"1={good.address}", security=sec) as c:
        assert c.fetch("t", "1-0", 0).batch.column("value").to_pylist() == [b"over", b"tls"]


@pytest.mark.parametrize("case, match", [
    ("expired", "certificate has expired"),
    ("elsewhere", "not for this host name"),
    ("stranger", "not signed by a trusted CA"),
    ("plaintext port", "does not speak TLS"),
])
def test_tls_failures_are_told_at_once(tls_brokers, pki, zookeeper, case, match):
    bs, good, expired, elsewhere = tls_brokers
    sec = {"security.protocol": "SSL", "ssl.ca.location": pki.stranger_ca if case == "stranger" else pki.ca}
    address = {"expired": expired, "elsewhere": elsewhere, "stranger": good}.get(case, good).address
    plain = None
    if case == "plaintext port":
        plain = bs.start("plain", 9, {})
        address = plain.address
    start = time.monotonic()
    with pytest.raises(AuthenticationError, match=match):
        Admin(brokers=address, security=sec)
    assert time.monotonic() - start < 10  # not the 30 s call timeout: the handshake said it
    if plain is not None:
        plain.kill()


def test_a_plaintext_client_is_told_the_broker_speaks_tls(tls_brokers):
    bs, good, _, _ = tls_brokers
    with bs.client(Producer) as p:  # registered as SSL in ZooKeeper: told before any call
        wait_until(lambda: p.cluster.brokers().get(1), what="broker 1 registered")
        with pytest.raises(AuthenticationError, match="takes security.protocol SSL; this client is set to PLAINTEXT"):
            p.send_batch("t", [b"x"], partition="1-0")
    with Admin(brokers=f"1={good.address}", timeout=3) as admin:  # a static list: told when the call fails
        with pytest.raises(AuthenticationError, match="speaks TLS; set security.protocol"):
            admin.stats(1)


# -- mutual TLS -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mtls(tmp_path_factory, zookeeper, pki):
    bs = _brokers(tmp_path_factory, zookeeper, "mtls")
    zk = new_client(zookeeper.connect_string)
    zk.start()
    add_acls(zk, bs.root, [Acl("User:alice", "Allow", "All", "topic", "m"),
                           Acl("User:bob", "Allow", "Read", "topic", "m")])
    broker = bs.start("b", 1, tls_settings(pki, **{"ssl.ca.location": pki.ca, "ssl.client.auth": "required",
                                                   "authorizer": "acl"}),
                      topics={"m": {"numPartitions": 1}}, health_certificate=(pki.alice.cert, pki.alice.key))
    yield bs, broker
    bs.stop()
    zk.stop()
    zk.close()


def _cert(pki, pem):
    return {"security.protocol": "SSL", "ssl.ca.location": pki.ca, "ssl.certificate.location": pem.cert,
            "ssl.key.location": pem.key}


def test_mutual_tls_names_the_principal_from_the_certificate(mtls, pki):
    bs, broker = mtls
    with bs.client(Producer, _cert(pki, pki.alice), use_data_port=False) as p:
        p.send_batch("m", [b"from alice"], partition="1-0")
    with bs.client(Producer, _cert(pki, pki.bob), use_data_port=False) as p:
        with pytest.raises(AuthorizationError, match="User:bob is not allowed Write on (topic 'm'|any topic)"):
            p.send_batch("m", [b"from bob"], partition="1-0")
    with bs.client(Consumer, _cert(pki, pki.bob)) as c:
        assert c.fetch("m", "1-0", 0).batch.column("value").to_pylist() == [b"from alice"]


@pytest.mark.parametrize("who, match", [("nobody", "requires a client certificate"),
                                        ("stranger", "not signed by a trusted CA|certificate")])
def test_mutual_tls_refuses_clients_without_a_trusted_certificate(mtls, pki, who, match):
    bs, broker = mtls
    sec = {"security.protocol": "SSL", "ssl.ca.location": pki.ca}
    if who == "stranger":
        sec = _cert(pki, pki.stranger_client)
    with pytest.raises(AuthenticationError, match=match):
        with Admin(brokers=f"1={broker.address}", security=sec) as admin:
            admin.stats(1)


# -- SASL and ACLs --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def secured(tmp_path_factory, zookeeper, pki):
    bs = _brokers(tmp_path_factory, zookeeper, "sasl")
    zk = new_client(zookeeper.connect_string)
    zk.start()
    for user, password in PASSWORDS.items():
        put_user(zk, bs.root, user, Credential.make(password))
    add_acls(zk, bs.root, [
        Acl("User:alice", "Allow", "All", "topic", "orders-", "prefixed"),
        Acl("User:alice", "Deny", "Write", "topic", "orders-audit"),
        Acl("User:bob", "Allow", "Read", "topic", "orders-eu"),
        Acl("User:dave", "Allow", "Write", "topic", "orders-eu"),
    ])
    broker = bs.start("b", 1, {"security.protocol": "SASL_SSL", "ssl.certificate.location": pki.broker.cert,
                               "ssl.key.location": pki.broker.key, "ssl.ca.location": pki.ca,
                               "authorizer": "acl", "super.users": "User:admin"},
                      topics={"orders-eu": {"numPartitions": 2}, "orders-audit": {"numPartitions": 1},
                              "other": {"numPartitions": 1}})
    yield bs, broker, zk
    bs.stop()
    zk.stop()
    zk.close()


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "PLAIN"])
def test_sasl_users_produce_and_consume_as_their_acls_allow(secured, pki, mechanism):
    bs, broker, _ = secured
    with bs.client(Producer, sasl(pki, "alice", mechanism), use_data_port=False) as p:
        wait_until(lambda: len(p.cluster.topic_partitions("orders-eu")) == 2, what="orders-eu")
        p.send_batch("orders-eu", [b"one", b"two"], partition="1-1")
    with bs.client(Consumer, sasl(pki, "bob", mechanism)) as c:
        values = c.fetch("orders-eu", "1-1", 0, max_messages=1000).batch.column("value").to_pylist()
        assert values[-2:] == [b"one", b"two"]
    with bs.client(Producer, sasl(pki, "bob", mechanism), use_data_port=False) as p:
        with pytest.raises(AuthorizationError, match="User:bob is not allowed Write on (topic 'orders-eu'|any topic)"):
            p.send_batch("orders-eu", [b"bob"], partition="1-0")
    with bs.client(Consumer, sasl(pki, "dave", mechanism)) as c:  # Write but not Read
        with pytest.raises(AuthorizationError, match="User:dave is not allowed Read on topic 'orders-eu'"):
            c.fetch("orders-eu", "1-0", 0)


@pytest.mark.parametrize("user, password", [("alice", "not-her-password"), ("mallory", "whatever")])
@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "PLAIN"])
def test_wrong_password_and_unknown_user_are_refused_alike(secured, pki, user, password, mechanism):
    bs, broker, _ = secured
    with pytest.raises(AuthenticationError, match=f"unknown user or wrong password \\({mechanism}\\)"):
        login(broker, sasl(pki, user, mechanism, password))


def test_deny_wins_prefixes_create_and_listing_follow_the_acls(secured, pki):
    bs, broker, _ = secured
    with bs.client(Producer, sasl(pki, "alice"), use_data_port=False) as p:
        with pytest.raises(AuthorizationError, match="User:alice is not allowed Write on topic 'orders-audit'"):
            p.send_batch("orders-audit", [b"x"], partition="1-0")
    with Admin(brokers=f"1={broker.address}", security=sasl(pki, "alice")) as admin:
        admin.create_topic("orders-new", 1, broker_ids=[1])  # All on the prefix includes Create
        with pytest.raises(AuthorizationError, match="User:alice is not allowed Create on topic 'elsewhere'"):
            admin.create_topic("elsewhere", 1, broker_ids=[1])
    with Admin(brokers=f"1={broker.address}", security=sasl(pki, "bob")) as admin:
        assert admin.cluster.topics() == ["orders-eu"]  # bob may Describe only what he may Read
    with Admin(brokers=f"1={broker.address}", security=sasl(pki, "admin")) as admin:  # a super user
        assert {"orders-eu", "orders-audit", "orders-new", "other"} <= set(admin.cluster.topics())
        admin.create_topic("elsewhere", 1, broker_ids=[1])


def test_denials_are_counted_and_no_password_is_logged(secured, pki):
    bs, broker, _ = secured
    with bs.client(Consumer, sasl(pki, "bob")) as c:
        for _ in range(3):
            with pytest.raises(AuthorizationError):
                c.fetch("other", "1-0", 0)
    with pytest.raises(AuthenticationError):
        login(broker, sasl(pki, "bob", password="guess"))
    port = int(broker.log_path.read_text().split("Prometheus metrics at https://127.0.0.1:")[1].split("/")[0])
    request = urllib.request.Request(f"https://127.0.0.1:{port}/metrics", headers={  # SASL_SSL: HTTPS, a login
        "Authorization": "Basic " + base64.b64encode(f"admin:{PASSWORDS['admin']}".encode()).decode()})
    text = urllib.request.urlopen(request, timeout=10, context=ssl.create_default_context(cafile=pki.ca)).read().decode()
    denied = [line for line in text.splitlines()
              if line.startswith('metaq_authorization_denials_total{operation="Read",resource_type="topic"}')]
    assert denied and float(denied[0].split()[-1]) >= 3
    assert any(line.startswith("metaq_authentication_failures_total") and float(line.split()[-1]) >= 1
               for line in text.splitlines())
    log = broker.log_path.read_text()
    assert not any(pw in log for pw in PASSWORDS.values()) and "guess" not in log


def test_a_removed_users_session_ends_at_once(secured, pki):
    bs, broker, zk = secured
    put_user(zk, bs.root, "erin", Credential.make("erin-secret-5"))
    add_acls(zk, bs.root, [Acl("User:erin", "Allow", "Read", "topic", "orders-eu")])
    with Consumer(brokers=f"1={broker.address}", security=sasl(pki, "erin", password="erin-secret-5")) as c:
        wait_until(lambda: _fetches(c, until_allowed=True), what="erin can read (her ACL reached the broker)")
        delete_user(zk, bs.root, "erin")
        with pytest.raises(AuthenticationError):
            wait_until(lambda: not _fetches(c), what="erin's session refused")
            c.fetch("orders-eu", "1-0", 0)


def _fetches(consumer, until_allowed: bool = False) -> bool:
    try:
        consumer.fetch("orders-eu", "1-0", 0)
        return True
    except AuthenticationError:
        return False
    except AuthorizationError:
        if until_allowed:
            return False
        raise


def test_a_flood_of_bad_logins_and_handshakes_leaves_good_clients_served(secured, pki):
    bs, broker, _ = secured
    host, port = broker.address.rsplit(":", 1)
    stop = threading.Event()
    refused = []

    def bad_logins():
        while not stop.is_set():
            try:
                login(broker, sasl(pki, "alice", password="wrong"))
            except AuthenticationError:
                refused.append(1)

    def bad_handshakes():
        while not stop.is_set():
            try:
                with socket.create_connection((host, int(port)), timeout=2) as s:
                    s.sendall(b"\x16\x03\x01\x02\x00garbage" * 50)
                    s.recv(100)
            except OSError:
                pass

    threads = [threading.Thread(target=f, daemon=True) for f in (bad_logins, bad_logins, bad_handshakes,
                                                                 bad_handshakes)]
    for t in threads:
        t.start()
    try:
        with bs.client(Producer, sasl(pki, "alice"), use_data_port=False) as p, \
                bs.client(Consumer, sasl(pki, "alice")) as c:
            wait_until(lambda: len(p.cluster.topic_partitions("orders-new")) == 1, what="orders-new")
            start = c.offsets("orders-new")["1-0"][1]
            for i in range(20):
                p.send_batch("orders-new", [b"%d" % i], partition="1-0")
            got = c.fetch("orders-new", "1-0", start, max_messages=100).batch.column("value").to_pylist()
            assert got == [b"%d" % i for i in range(20)]
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert refused  # the flood really was refused meanwhile


@pytest.mark.process
def test_broker_refuses_sasl_without_zookeeper_and_bad_settings(tmp_path, pki):
    b = BrokerProcess(tmp_path / "b", 1, "none", settings={"security.protocol": "SASL_SSL",
                                                           "ssl.certificate.location": pki.broker.cert,
                                                           "ssl.key.location": pki.broker.key})
    with pytest.raises(RuntimeError, match="keep users and ACLs in ZooKeeper; set zk.connect"):
        b.start(timeout=20)
    b = BrokerProcess(tmp_path / "c", 1, "none", settings={"security.protocol": "SSL",
                                                           "ssl.certificate.location": pki.broker.cert,
                                                           "ssl.key.location": pki.alice.key})
    with pytest.raises(RuntimeError, match="do not make a usable certificate and key"):
        b.start(timeout=20)


def test_ssl_module_sees_the_brokers_certificate_chain(tls_brokers, pki):
    """The broker serves the certificate it was given (a check on the test's own PKI)."""
    _, good, _, _ = tls_brokers
    host, port = good.address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=pki.ca)
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=5) as s, ctx.wrap_socket(s, server_hostname=host) as t:
        assert dict(x[0] for x in t.getpeercert()["subject"])["commonName"] == "broker"


def test_group_offsets_go_through_the_broker_which_checks_the_group_acl(secured, pki):
    bs, broker, zk = secured
    with bs.client(Consumer, sasl(pki, "bob"), group="billing") as c:
        with pytest.raises(AuthorizationError, match="User:bob is not allowed Read on group 'billing'"):
            c.commit("orders-eu", {"1-0": 1})
        add_acls(zk, bs.root, [Acl("User:bob", "Allow", "Read", "group", "billing")])
        wait_until(lambda: _commits(c), what="bob may commit for billing")
        assert c.committed("orders-eu") == {"1-0": 1}
        with pytest.raises(AuthorizationError, match="User:bob is not allowed Read on topic 'other'"):
            c.commit("other", {"1-0": 1})
    data, _ = zk.get(ZkPaths(bs.root).group_offset("billing", "orders-eu", "1-0"))  # written by the broker
    assert data == b"1"


def _commits(consumer) -> bool:
    try:
        consumer.commit("orders-eu", {"1-0": 1})
        return True
    except AuthorizationError:
        return False

