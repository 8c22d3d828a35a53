"""Users and ACLs in ZooKeeper, ZooKeeper's own ACLs (zk.auth) and TLS, and the `metaq users` / `metaq acls`
commands, against a real ZooKeeper (and a real broker where registration matters)."""
import json
import threading

import pytest
from conftest import wait_until
import cli
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError

from metaq_broker.security.acl import Acl
from metaq_broker.security.scram import MECHANISM, Credential
from metaq_broker.security.settings import ZkSecurity
from metaq_broker.zk import acls as zk_acls
from metaq_broker.zk import decisions
from metaq_broker.zk import users as zk_users
from metaq_broker.zk.group_offsets import GroupStore
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import new_client

pytestmark = pytest.mark.process

ZK_AUTH = "digest:metaq:zk-s3cret"


def metaq(zk_connect, zk_root, *args, config=None, stdin=None):
    return cli.metaq("--zk", zk_connect, "--zk-root", zk_root, *(["--command-config", config] if config else []),
                     *args, stdin=stdin)


@pytest.fixture
def admin_config(tmp_path):
    path = tmp_path / "admin.properties"
    path.write_text(f"# the cluster's ZooKeeper identity\nzk.auth={ZK_AUTH}\n")
    return path


@pytest.fixture
def secure_zk(zookeeper):
    c = new_client(zookeeper.connect_string, security=ZkSecurity.from_properties({"zk.auth": ZK_AUTH}))
    c.start(15)
    yield c
    c.stop()
    c.close()


@pytest.fixture
def stranger(zookeeper):
    c = KazooClient(hosts=zookeeper.connect_string)
    c.start(15)
    yield c
    c.stop()
    c.close()


def acl_rows(output: str) -> set:
    """The rows of `metaq acls list`'s table, as tuples."""
    lines = output.splitlines()
    assert lines[0].split() == ["principal", "permission", "operation", "resource", "name", "pattern"], output
    return {tuple(line.split()) for line in lines[1:]}


def test_user_znode_holds_a_salted_credential_never_the_password(zookeeper, zk_root, admin_config, secure_zk,
                                                                 tmp_path):
    password = "correct horse battery staple"
    secret = tmp_path / "alice.password"
    secret.write_text(password + "\n")
    r = metaq(zookeeper.connect_string, zk_root, "users", "add", "alice", "--password-file", str(secret),
              config=admin_config)
    assert r.returncode == 0, r.err
    assert "user alice created (SCRAM-SHA-256, 4096 iterations)" in r.out
    r = metaq(zookeeper.connect_string, zk_root, "users", "add", "bob", "--password", "hunter2!", config=admin_config)
    assert r.returncode == 0, r.err

    data, _ = secure_zk.get(ZkPaths(zk_root).user("alice"))
    assert password.encode() not in data and b"horse" not in data
    stored = json.loads(data)
    assert list(stored) == [MECHANISM] and "salt=" in stored[MECHANISM] and "iterations=4096" in stored[MECHANISM]
    credential = Credential.decode(stored[MECHANISM])
    assert credential.check_password(password) and not credential.check_password("hunter2!")

    r = metaq(zookeeper.connect_string, zk_root, "users", "list", config=admin_config)
    assert r.returncode == 0 and r.out.split() == ["alice", "bob"]
    # a new password replaces the credential (new salt too)
    r = metaq(zookeeper.connect_string, zk_root, "users", "add", "alice", "--password", "new-one", config=admin_config)
    assert r.returncode == 0 and "user alice updated" in r.out
    updated = Credential.decode(json.loads(secure_zk.get(ZkPaths(zk_root).user("alice"))[0])[MECHANISM])
    assert updated.check_password("new-one") and not updated.check_password(password) and updated.salt != credential.salt

    r = metaq(zookeeper.connect_string, zk_root, "users", "remove", "bob", config=admin_config)
    assert r.returncode == 0 and "user bob removed" in r.out
    r = metaq(zookeeper.connect_string, zk_root, "users", "remove", "bob", config=admin_config)
    assert r.returncode == 1 and "'bob' does not exist" in r.err
    assert zk_users.list_users(secure_zk, zk_root) == ["alice"]

    r = metaq(zookeeper.connect_string, zk_root, "users", "add", "carol", "--password", "x", "--password-file",
              str(secret), config=admin_config)
    assert r.returncode == 2 and "not both" in r.err
    # without the digest ZooKeeper refuses, and the message says what to do
    r = metaq(zookeeper.connect_string, zk_root, "users", "list")
    assert r.returncode == 1 and "NoAuth" in r.err and "zk.auth" in r.err


def test_acls_add_list_remove_through_the_cli(zookeeper, zk_root, admin_config, secure_zk):
    zk, root = zookeeper.connect_string, zk_root
    r = metaq(zk, root, "acls", "add", "--allow-principal", "User:alice", "--allow-principal", "User:bob",
              "--operation", "read", "--operation", "Write", "--topic", "orders", config=admin_config)
    assert r.returncode == 0, r.err
    assert "added 4 ACL(s)" in r.out
    r = metaq(zk, root, "acls", "add", "--deny-principal", "User:mallory", "--group", "billing", config=admin_config)
    assert r.returncode == 0 and "added 1 ACL(s)" in r.out
    r = metaq(zk, root, "acls", "add", "--allow-principal", "User:ops", "--operation", "ClusterAction", "--cluster",
              config=admin_config)
    assert r.returncode == 0, r.err
    # adding again changes nothing
    r = metaq(zk, root, "acls", "add", "--allow-principal", "User:alice", "--operation", "Read", "--topic", "orders",
              config=admin_config)
    assert r.returncode == 0 and "added 0 ACL(s) (1 were there already)" in r.out

    r = metaq(zk, root, "acls", "list", config=admin_config)
    assert r.returncode == 0, r.err
    assert acl_rows(r.out) == {
        ("User:alice", "Allow", "Read", "topic", "orders", "literal"),
        ("User:alice", "Allow", "Write", "topic", "orders", "literal"),
        ("User:bob", "Allow", "Read", "topic", "orders", "literal"),
        ("User:bob", "Allow", "Write", "topic", "orders", "literal"),
        ("User:mallory", "Deny", "All", "group", "billing", "literal"),
        ("User:ops", "Allow", "ClusterAction", "cluster", "metaq-cluster", "literal")}
    r = metaq(zk, root, "acls", "list", "--topic", "orders", "--principal", "User:bob", config=admin_config)
    assert acl_rows(r.out) == {("User:bob", "Allow", "Read", "topic", "orders", "literal"),
                               ("User:bob", "Allow", "Write", "topic", "orders", "literal")}
    assert len(zk_acls.list_acls(secure_zk, root, "topic", "orders")) == 4

    r = metaq(zk, root, "acls", "remove", "--allow-principal", "User:alice", "--operation", "Read", "--topic", "orders",
              config=admin_config)
    assert r.returncode == 0 and "removed 1 ACL(s)" in r.out
    r = metaq(zk, root, "acls", "remove", "--allow-principal", "User:bob", "--topic", "orders", config=admin_config)
    assert r.returncode == 0 and "removed 2 ACL(s)" in r.out
    # every principal's: asks first (no answer: nothing removed), --force does not
    r = metaq(zk, root, "acls", "remove", "--group", "billing", config=admin_config, stdin=b"")
    assert r.returncode == 1 and "remove every ACL of group 'billing'" in r.err
    r = metaq(zk, root, "acls", "remove", "--group", "billing", "--force", config=admin_config)
    assert r.returncode == 0 and "removed 1 ACL(s)" in r.out
    assert zk_acls.list_acls(secure_zk, root) == [  # sorted by resource type, name, ...
        Acl("User:ops", "Allow", "ClusterAction", "cluster", "metaq-cluster"),
        Acl("User:alice", "Allow", "Write", "topic", "orders")]

    # bad input: a clear error naming it, exit code 2
    r = metaq(zk, root, "acls", "add", "--allow-principal", "User:a", "--operation", "Fly", "--topic", "t",
              config=admin_config)
    assert r.returncode == 2 and "unknown operation 'Fly'" in r.err
    r = metaq(zk, root, "acls", "add", "--allow-principal", "User:a", config=admin_config)
    assert r.returncode == 2 and "no resource" in r.err
    r = metaq(zk, root, "acls", "add", "--allow-principal", "alice", "--topic", "t", config=admin_config)
    assert r.returncode == 2 and "'alice' is not a principal; write User:NAME" in r.err
    r = metaq(zk, root, "acls", "add", "--allow-principal", "User:a", "--topic", "t", "--group", "g",
              config=admin_config)
    assert r.returncode == 2 and "give one resource" in r.err
    r = metaq(zk, root, "acls", "add", "--topic", "t", config=admin_config)
    assert r.returncode == 2 and "--allow-principal or --deny-principal" in r.err
    r = metaq(zk, root, "acls", "list", config=admin_config.parent / "missing.properties")
    assert r.returncode == 2 and "missing.properties" in r.err


def test_prefixed_acls_are_listed_matched_and_removed(zookeeper, zk_root, admin_config, secure_zk):
    zk, root = zookeeper.connect_string, zk_root
    for args in (["--topic", "orders-", "--resource-pattern-type", "prefixed", "--operation", "Read"],
                 ["--topic", "orders-", "--operation", "Write"],  # a literal ACL with the same name
                 ["--topic", "*", "--operation", "Describe"],
                 ["--topic", "payments-", "--resource-pattern-type", "PREFIXED", "--operation", "Read"]):
        r = metaq(zk, root, "acls", "add", "--allow-principal", "User:alice", *args, config=admin_config)
        assert r.returncode == 0, r.err
    r = metaq(zk, root, "acls", "list", "--topic", "orders-", "--resource-pattern-type", "prefixed", config=admin_config)
    assert acl_rows(r.out) == {("User:alice", "Allow", "Read", "topic", "orders-", "prefixed")}
    r = metaq(zk, root, "acls", "list", "--topic", "orders-", config=admin_config)  # any: both patterns of the name
    assert acl_rows(r.out) == {("User:alice", "Allow", "Read", "topic", "orders-", "prefixed"),
                               ("User:alice", "Allow", "Write", "topic", "orders-", "literal")}
    r = metaq(zk, root, "acls", "list", "--topic", "orders-eu", "--resource-pattern-type", "match", config=admin_config)
    assert acl_rows(r.out) == {("User:alice", "Allow", "Read", "topic", "orders-", "prefixed"),
                               ("User:alice", "Allow", "Describe", "topic", "*", "literal")}

    r = metaq(zk, root, "acls", "remove", "--allow-principal", "User:alice", "--topic", "orders-",
              "--resource-pattern-type", "prefixed", config=admin_config)
    assert r.returncode == 0 and "removed 1 ACL(s)" in r.out
    r = metaq(zk, root, "acls", "list", "--topic", "orders-eu", "--resource-pattern-type", "match", config=admin_config)
    assert acl_rows(r.out) == {("User:alice", "Allow", "Describe", "topic", "*", "literal")}
    assert {(a.name, a.pattern_type) for a in zk_acls.list_acls(secure_zk, root)} == {
        ("orders-", "literal"), ("*", "literal"), ("payments-", "prefixed")}
    # a name that is no path component is stored quoted and comes back as it was
    zk_acls.add_acls(secure_zk, root, [Acl("User:bob", "Allow", "Read", "sink", "a/b c", "prefixed")])
    assert zk_acls.list_acls(secure_zk, root, "sink") == [Acl("User:bob", "Allow", "Read", "sink", "a/b c", "prefixed")]


def test_concurrent_acl_writers_keep_each_others_acls(secure_zk, zk_root):
    wanted = [Acl(f"User:u{i}", "Allow", "Read", "topic", "shared") for i in range(24)]

    def add(part):
        for a in part:
            zk_acls.add_acls(secure_zk, zk_root, [a])

    threads = [threading.Thread(target=add, args=(wanted[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(zk_acls.list_acls(secure_zk, zk_root, "topic", "shared")) == set(wanted)
    threads = [threading.Thread(target=zk_acls.remove_acls, args=(secure_zk, zk_root, wanted[i::3])) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert zk_acls.list_acls(secure_zk, zk_root) == []


def test_caches_follow_changes_made_by_another_client(zookeeper, zk_root, secure_zk):
    other = new_client(zookeeper.connect_string, security=ZkSecurity.from_properties({"zk.auth": ZK_AUTH}))
    other.start(15)
    try:
        zk_users.put_user(other, zk_root, "alice", Credential.make("one"))
        seen_acls = []
        users = zk_users.UserCache(secure_zk, zk_root)
        cache = zk_acls.AclCache(secure_zk, zk_root, seen_acls.append)
        try:
            assert users.credential("alice").check_password("one")  # loaded before the constructor returned
            assert users.credential("bob") is None
            assert seen_acls == [[]]

            zk_users.put_user(other, zk_root, "bob", Credential.make("two"))
            wait_until(lambda: users.credential("bob"), what="bob in the cache")
            assert users.credential("bob").check_password("two")
            zk_users.put_user(other, zk_root, "alice", Credential.make("three"))
            wait_until(lambda: users.credential("alice").check_password("three"), what="alice's new password")
            zk_users.delete_user(other, zk_root, "bob")
            wait_until(lambda: users.credential("bob") is None, what="bob gone from the cache")

            read = Acl("User:alice", "Allow", "Read", "topic", "t")
            prefixed = Acl("User:bob", "Deny", "Write", "topic", "t-", "prefixed")
            zk_acls.add_acls(other, zk_root, [read])
            wait_until(lambda: seen_acls[-1] == [read], what="the ACL in the cache")
            zk_acls.add_acls(other, zk_root, [prefixed])
            wait_until(lambda: set(seen_acls[-1]) == {read, prefixed}, what="the prefixed ACL in the cache")
            assert set(cache.acls()) == {read, prefixed}
            zk_acls.remove_acls(other, zk_root, [read, prefixed])
            wait_until(lambda: seen_acls[-1] == [], what="both ACLs gone from the cache")
        finally:
            users.close()
            cache.close()
    finally:
        other.stop()
        other.close()


def test_with_zk_auth_strangers_cannot_touch_metaq_nodes_but_find_brokers(cluster, zk_root, secure_zk, stranger):
    cluster.start_broker(1, settings={"zk.auth": ZK_AUTH, "numPartitions": 2}, topics={"orders": {}})
    paths = ZkPaths(zk_root)
    wait_until(lambda: secure_zk.exists(paths.broker(1)), what="broker registered")
    zk_users.put_user(secure_zk, zk_root, "alice", Credential.make("pw"))
    zk_acls.add_acls(secure_zk, zk_root, [Acl("User:alice", "Allow", "Read", "topic", "orders")])
    GroupStore(secure_zk, zk_root).commit("readers", "orders", {"1-0": 5})
    decisions.decide_commit(secure_zk, paths.sink_batch("sink-1", 7), "run-1", [[1, "xid-1"]])
    secured = {"user": paths.user("alice"), "acl": paths.acl_resource("topic", "literal", "orders"),
               "offset": paths.group_offset("readers", "orders", "1-0"), "decision": paths.sink_batch("sink-1", 7)}

    for what, path in secured.items():
        parent = path.rsplit("/", 1)[0]
        with pytest.raises(NoAuthError):
            stranger.get(path)
        with pytest.raises(NoAuthError):
            stranger.set(path, b"rewritten")
        with pytest.raises(NoAuthError):
            stranger.delete(path)
        with pytest.raises(NoAuthError):
            stranger.get_children(parent)
        with pytest.raises(NoAuthError):
            stranger.create(f"{parent}/planted", b"x")
        assert secure_zk.get(path)[0], what  # the digest identity reads it
    for path in (paths.users(), paths.acls(), paths.consumers(), paths.sinks()):
        with pytest.raises(NoAuthError):
            stranger.get_children(path)

    # broker registrations stay readable (clients without credentials find brokers), but not writable
    assert stranger.get_children(paths.broker_ids()) == ["1"]
    assert json.loads(stranger.get(paths.broker(1))[0])["brokerId"] == 1
    assert stranger.get_children(paths.topics()) == ["orders"]
    assert stranger.get_children(paths.topic("orders")) == ["1-m"]
    assert json.loads(stranger.get(paths.topic_entry("orders", 1))[0])["numPartitions"] == 2
    with pytest.raises(NoAuthError):
        stranger.set(paths.topic_entry("orders", 1), b'{"numPartitions": 99, "brokerId": 1}')
    with pytest.raises(NoAuthError):
        stranger.create(paths.broker(2), b"{}", ephemeral=True)
    with pytest.raises(NoAuthError):
        stranger.delete(paths.topic_entry("orders", 1))


def test_without_zk_auth_nodes_stay_open(zookeeper, zk_root, stranger):
    plain = new_client(zookeeper.connect_string)
    plain.start(15)
    try:
        zk_users.put_user(plain, zk_root, "alice", Credential.make("pw"))
        zk_acls.add_acls(plain, zk_root, [Acl("User:alice", "Allow", "Read", "topic", "orders")])
        assert stranger.get(ZkPaths(zk_root).user("alice"))[0]
        assert zk_acls.list_acls(stranger, zk_root) == [Acl("User:alice", "Allow", "Read", "topic", "orders")]
    finally:
        plain.stop()
        plain.close()


# -- ZooKeeper over TLS (its secureClientPort, PEM key store) ------------------------------------------
@pytest.fixture(scope="module")
def tls_zookeeper(tmp_path_factory, pki):
    from metaq_broker.devtools.zookeeper import LocalZooKeeper
    zk = LocalZooKeeper(data_dir=tmp_path_factory.mktemp("zk-tls"), tick_time_ms=500, tls_cert=pki.broker.cert,
                        tls_key=pki.broker.key, tls_ca=pki.ca, tls_client_auth="need")
    zk.start()
    yield zk, pki
    zk.stop()


def test_zookeeper_over_tls_with_client_certificates(tls_zookeeper, tmp_path, zk_root):
    from conftest import Cluster

    zk, pki = tls_zookeeper
    props = {"zk.auth": ZK_AUTH, "zk.ssl.ca.location": pki.ca, "zk.ssl.certificate.location": pki.alice.cert,
             "zk.ssl.key.location": pki.alice.key}
    config = tmp_path / "admin.properties"
    config.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    r = metaq(zk.secure_connect_string, zk_root, "users", "add", "alice", "--password", "pw", config=config)
    assert r.returncode == 0, r.err
    r = metaq(zk.secure_connect_string, zk_root, "users", "list", config=config)
    assert r.returncode == 0 and r.out.split() == ["alice"]

    # a broker whose ZooKeeper session is TLS (and digest-authenticated) registers where plain clients see it
    cluster = Cluster(tmp_path, zk.secure_connect_string, zk_root)
    try:
        cluster.start_broker(1, settings=props)
        stranger = KazooClient(hosts=zk.connect_string)  # the plain port, no credentials
        stranger.start(15)
        try:
            wait_until(lambda: stranger.exists(ZkPaths(zk_root).broker(1)), what="broker registered over TLS")
            with pytest.raises(NoAuthError):
                stranger.get(ZkPaths(zk_root).user("alice"))
        finally:
            stranger.stop()
            stranger.close()
    finally:
        cluster.stop()


@pytest.mark.parametrize("case, expected", [
    ("no client certificate", "requires a client certificate (zk.ssl.certificate.location"),
    ("client certificate of a stranger CA", "refused this client's certificate"),
    ("untrusted server", "not signed by a trusted CA (zk.ssl.ca.location)"),
    ("plain port", "is that its secureClientPort?"),
])
def test_zookeeper_tls_failures_say_why(tls_zookeeper, case, expected):
    from metaq_broker.zk.session import ZooKeeperUnavailableError, start_client

    zk, pki = tls_zookeeper
    props, address = {"zk.ssl.ca.location": pki.ca}, zk.secure_connect_string
    if case == "client certificate of a stranger CA":
        props.update({"zk.ssl.certificate.location": pki.stranger_client.cert,
                      "zk.ssl.key.location": pki.stranger_client.key})
    elif case == "untrusted server":
        props.update({"zk.ssl.ca.location": pki.stranger_ca, "zk.ssl.certificate.location": pki.alice.cert,
                      "zk.ssl.key.location": pki.alice.key})
    elif case == "plain port":
        address = zk.connect_string
    client = new_client(address, security=ZkSecurity.from_properties(props))
    with pytest.raises(ZooKeeperUnavailableError) as failure:
        start_client(client, address, 2.0)
    assert expected in str(failure.value)
