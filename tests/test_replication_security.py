"""Replicated groups on a secured cluster (docs/replication.md, Security), with real processes: members copy
over TLS with their own certificates (mutual TLS, ACLs, the broker principal a super user), or log in as a
replication user under SASL_SSL with ACLs granting ClusterAction and Describe; a kill -9 of the master
fails over and what was acknowledged is read back from the new master through a secured client. A missing
CA or replication user is refused at start naming the key; a refused login is told in the replica's log
and copying resumes once the user exists. Certificates come from a throwaway CA made here."""
import datetime
import ipaddress
import subprocess
import sys

import pytest
from certs import CertificateAuthority, Pem, _name, _write
from conftest import wait_until
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from metaq_broker.client import Admin, Consumer, Producer
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.devtools.group import BrokerGroup
from metaq_broker.errors import ConfigError
from metaq_broker.security.acl import CLUSTER, Acl
from metaq_broker.security.scram import Credential
from metaq_broker.server.config import load
from metaq_broker.zk.acls import add_acls
from metaq_broker.zk.session import new_client
from metaq_broker.zk.users import put_user

pytestmark = pytest.mark.process

TOPICS = {"orders": {"numPartitions": 2}}
REPLICATOR, REPLICATOR_PASSWORD = "replicator", "replicator-secret-1"
ADMIN_PASSWORD = "admin-secret-2"


def issue_broker(ca: CertificateAuthority, file_name: str, common_name: str, hosts: tuple) -> Pem:
    """A broker certificate for both ends of a connection: it serves (serverAuth) and, copying from its
    master, is a client (clientAuth), as a Kafka broker's certificate on an inter-broker listener."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(ca.key, hashes.SHA256()))
    return _write(ca.directory / file_name, cert, key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = CertificateAuthority(tmp_path_factory.mktemp("pki"))
    return {"ca": ca.ca_path, "broker": issue_broker(ca, "broker", "broker", ("127.0.0.1", "localhost")),
            "admin": ca.issue("admin", "admin", client=True)}


def read_all(consumer, topic) -> list:
    out = []
    for name, (start, end) in consumer.offsets(topic).items():
        out += consumer.read_range(topic, name, start, end).column("value").to_pylist()
    return out


def send_each(producer, topic, values) -> list:
    """``acks=all`` puts, one value each (the producer follows a moving master by itself)."""
    for v in values:
        producer.send_batch(topic, [v])
    return list(values)


def fail_over(group, security, zk_connect, zk_root, topics) -> None:
    """Data through a secured client (acks=all), the master killed, more data, all of it read back from
    the new master. ``topics``: one in every member's INI, and one created at run time on the master (the
    replica creates it over the master's gRPC, as secured as the data port)."""
    master = group.wait_master()
    group.wait_in_sync(range(len(group.members)))
    with Admin(zk_connect=zk_connect, zk_root=zk_root, security=security) as admin:
        admin.create_topic(topics[1], 1)
    with Producer(zk_connect=zk_connect, zk_root=zk_root, security=security, timeout=30.0) as producer:
        wait_until(lambda: len(producer.cluster.topic_partitions(topics[0])) == 2, what="topic routed")
        wait_until(lambda: len(producer.cluster.topic_partitions(topics[1])) == 1, what="runtime topic routed")
        acked = {t: send_each(producer, t, [b"%s-a-%d" % (t.encode(), i) for i in range(30)]) for t in topics}
        group.members[master].kill()
        group.wait_master(timeout=30, other_than=master)
        for t in topics:
            acked[t] += send_each(producer, t, [b"%s-b-%d" % (t.encode(), i) for i in range(10)])
    with Consumer(zk_connect=zk_connect, zk_root=zk_root, security=security) as consumer:
        for t in topics:
            assert sorted(read_all(consumer, t)) == sorted(acked[t])


def test_ssl_group_with_mutual_tls_and_acls_replicates_and_fails_over(tmp_path, zookeeper, zk_root, pki):
    broker = pki["broker"]
    settings = {"security.protocol": "SSL", "ssl.certificate.location": broker.cert, "ssl.key.location": broker.key,
                "ssl.ca.location": pki["ca"], "ssl.client.auth": "required", "authorizer": "acl",
                "super.users": "User:broker;User:admin"}
    group = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=2, settings=settings, topics=TOPICS)
    for m in group.members:  # the readiness check must present a certificate too
        m.health_certificate = (broker.cert, broker.key)
    admin = pki["admin"]
    client = {"security.protocol": "SSL", "ssl.ca.location": pki["ca"], "ssl.certificate.location": admin.cert,
              "ssl.key.location": admin.key}
    try:
        group.start()
        fail_over(group, client, zookeeper.connect_string, zk_root, ["orders", "events"])
    finally:
        group.stop()


def test_sasl_ssl_group_logs_in_as_the_replication_user(tmp_path, zookeeper, zk_root, pki):
    """The replication user does not exist at first: the replica says so in its log (once, not in a loop);
    once the user is created it copies, the in-sync set forms, and a failover keeps what was acknowledged."""
    broker = pki["broker"]
    zk = new_client(zookeeper.connect_string)
    zk.start()
    put_user(zk, zk_root, "admin", Credential.make(ADMIN_PASSWORD))
    add_acls(zk, zk_root, [Acl(f"User:{REPLICATOR}", "Allow", "ClusterAction", "cluster", CLUSTER),
                           Acl(f"User:{REPLICATOR}", "Allow", "Describe", "topic", "*")])
    settings = {"security.protocol": "SASL_SSL", "ssl.certificate.location": broker.cert,
                "ssl.key.location": broker.key, "ssl.ca.location": pki["ca"], "authorizer": "acl",
                "super.users": "User:admin", "replication.sasl.username": REPLICATOR,
                "replication.sasl.password": REPLICATOR_PASSWORD}
    group = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=2, settings=settings, topics=TOPICS)
    client = {"security.protocol": "SASL_SSL", "ssl.ca.location": pki["ca"], "sasl.username": "admin",
              "sasl.password": ADMIN_PASSWORD}
    try:
        group.start()
        master = group.wait_master()
        replica = group.members[1 - master]
        refused = "replication login as replicator (replication.sasl.username) failed"
        wait_until(lambda: refused in replica.log_path.read_text(), what="the refused login in the replica's log")
        assert {r for r, _ in group.state()["isr"]} == {master}
        put_user(zk, zk_root, REPLICATOR, Credential.make(REPLICATOR_PASSWORD))
        group.wait_in_sync(range(2))
        text = replica.log_path.read_text()
        assert text.count(refused) == 1, "a lasting refusal is logged once, not once per retry"
        assert "copies from" in text and "again" in text
        fail_over(group, client, zookeeper.connect_string, zk_root, ["orders", "events"])
    finally:
        group.stop()
        zk.stop()
        zk.close()


def test_a_member_without_ca_or_replication_user_is_refused_naming_the_key(tmp_path, pki):
    broker = pki["broker"]
    ssl_settings = {"security.protocol": "SSL", "ssl.certificate.location": broker.cert,
                    "ssl.key.location": broker.key, "zk.connect": "127.0.0.1:1"}
    with pytest.raises(ConfigError, match=r"ssl.ca.location is needed for replication over SSL.*replicaId 1"):
        load(None, {**ssl_settings, "replicaId": "1"})
    assert load(None, ssl_settings).security.replication_problem()  # maybe a group of one: told at run time
    sasl_settings = {**ssl_settings, "security.protocol": "SASL_SSL", "ssl.ca.location": pki["ca"]}
    with pytest.raises(ConfigError, match="replication.sasl.username and replication.sasl.password are needed"):
        load(None, {**sasl_settings, "replicaId": "0"})
    with pytest.raises(ConfigError, match="go together"):
        load(None, {**sasl_settings, "replicaId": "0", "replication.sasl.username": REPLICATOR})
    cfg = load(None, {**sasl_settings, "replicaId": "0", "replication.sasl.username": REPLICATOR,
                      "replication.sasl.password": REPLICATOR_PASSWORD})
    assert REPLICATOR_PASSWORD not in repr(cfg)
    # The operator sees it as the broker's exit: code 2 and the key in words.
    member = BrokerProcess(tmp_path / "m", 1, "127.0.0.1:1", settings={**sasl_settings, "replicaId": 1})
    done = subprocess.run([sys.executable, "-m", "metaq_broker.server.main", "--config", str(member.write_config())],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "replication.sasl.username and replication.sasl.password are needed for replication over SASL_SSL" \
        in done.stderr
