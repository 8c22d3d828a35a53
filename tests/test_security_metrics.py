"""The metrics port with security on (docs/security.md, "The metrics port"): HTTPS and a login under SSL
and SASL_SSL, loopback only under PLAINTEXT with ACLs, and a scrape shows only the topics and groups its
principal may Describe. Real broker processes (an in-process broker where its listening address is
checked) and ZooKeeper; certificates from tests/certs.py."""
import base64
import http.client
import ssl
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from metaq_broker.client import Producer
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.security.acl import Acl
from metaq_broker.security.scram import Credential
from metaq_broker.server.broker import Broker
from metaq_broker.server.config import load
from metaq_broker.zk.acls import add_acls
from metaq_broker.zk.group_offsets import GroupStore
from metaq_broker.zk.session import new_client
from metaq_broker.zk.users import put_user

PASSWORDS = {"alice": "alice-pw-1", "prom": "prom-pw-2", "admin": "admin-pw-3"}
TOPICS = {"orders-eu": {"numPartitions": 2}, "payroll": {"numPartitions": 1}}


def metrics_url(broker) -> str:
    line = next(x for x in broker.log_path.read_text().splitlines() if "Prometheus metrics at " in x)
    return line.split("Prometheus metrics at ")[1].split()[0]


def scrape(url, ca=None, user=None, password=None, cert=None):
    """(HTTP status, body) of one scrape."""
    ctx = None
    if url.startswith("https:"):
        ctx = ssl.create_default_context(cafile=ca)
        if cert is not None:
            ctx.load_cert_chain(cert.cert, cert.key)
    request = urllib.request.Request(url)
    if user is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10, context=ctx) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode() + str(e.headers.get("WWW-Authenticate"))


def labels_seen(text: str, label: str) -> set:
    return {s.labels[label] for f in text_string_to_metric_families(text) for s in f.samples if label in s.labels}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, zookeeper, pki):
    work = tmp_path_factory.mktemp("sec-metrics")
    root = f"/sec-metrics-{time.time_ns()}"
    zk = new_client(zookeeper.connect_string)
    zk.start()
    for user, password in PASSWORDS.items():
        put_user(zk, root, user, Credential.make(password))
    add_acls(zk, root, [Acl("User:alice", "Allow", "Read", "topic", "orders-eu"),
                        Acl("User:alice", "Allow", "Describe", "group", "billing"),
                        Acl("User:prom", "Allow", "Describe", "cluster", "metaq-cluster")])
    store = GroupStore(zk, root)  # two groups with lag on this broker's partitions
    store.commit("billing", "orders-eu", {"1-0": 0})
    store.commit("billing", "payroll", {"1-0": 0})
    store.commit("payroll-audit", "payroll", {"1-0": 0})
    yield {"zk": zookeeper.connect_string, "zkc": zk, "root": root, "pki": pki, "work": work}
    zk.stop()
    zk.close()


def test_sasl_ssl_metrics_need_tls_and_a_login_and_show_only_what_the_scraper_may_describe(setup):
    pki = setup["pki"]
    broker = BrokerProcess(setup["work"] / "sasl", 1, setup["zk"], settings={
        "zk.root": setup["root"], "zk.sessionTimeout": 4000, "metricsPort": 0, "security.protocol": "SASL_SSL",
        "ssl.certificate.location": pki.broker.cert, "ssl.key.location": pki.broker.key, "ssl.ca.location": pki.ca,
        "authorizer": "acl", "super.users": "User:admin"}, topics=TOPICS).start()
    try:
        admin = {"security.protocol": "SASL_SSL", "ssl.ca.location": pki.ca, "sasl.username": "admin",
                 "sasl.password": PASSWORDS["admin"]}
        with Producer(brokers=f"1={broker.address}", security=admin) as p:
            p.send_batch("payroll", [b"salary: 1"], partition="1-0")
            p.send_batch("orders-eu", [b"order"], partition="1-0")
        url = metrics_url(broker)
        assert url.startswith("https://127.0.0.1:")
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(url.replace("https:", "http:"), timeout=10).read()  # no plaintext answer
        status, body = scrape(url, pki.ca)
        assert status == 401 and 'Basic realm="metaq metrics"' in body and "payroll" not in body
        status, body = scrape(url, pki.ca, "alice", "not-her-password")
        assert status == 401 and "payroll" not in body

        status, body = scrape(url, pki.ca, "alice", PASSWORDS["alice"])
        assert status == 200, body
        assert labels_seen(body, "topic") == {"orders-eu"} and labels_seen(body, "group") == {"billing"}
        assert "payroll" not in body and "metaq_uptime_seconds" in body
        status, body = scrape(url, pki.ca, "prom", PASSWORDS["prom"])  # Describe on the cluster only
        assert status == 200 and labels_seen(body, "topic") == set() and "metaq_broker_info" in body
        status, body = scrape(url, pki.ca, "admin", PASSWORDS["admin"])  # a super user sees everything
        assert labels_seen(body, "topic") == {"orders-eu", "payroll"}
        assert labels_seen(body, "group") == {"billing", "payroll-audit"}
        failures = [s.value for f in text_string_to_metric_families(body) for s in f.samples
                    if s.name == "metaq_authentication_failures_total" and s.labels == {"mechanism": "PLAIN"}]
        assert failures and failures[0] >= 1  # the wrong password, counted as any failed login
        assert PASSWORDS["alice"] not in broker.log_path.read_text()
    finally:
        broker.kill()


def test_mutual_tls_metrics_take_the_principal_from_the_client_certificate(setup):
    pki = setup["pki"]
    add_acls(setup["zkc"], setup["root"], [Acl("User:bob", "Allow", "Describe", "topic", "payroll")])
    broker = BrokerProcess(setup["work"] / "mtls", 2, setup["zk"], settings={
        "zk.root": setup["root"], "zk.sessionTimeout": 4000, "metricsPort": 0, "security.protocol": "SSL",
        "ssl.certificate.location": pki.broker.cert, "ssl.key.location": pki.broker.key, "ssl.ca.location": pki.ca,
        "ssl.client.auth": "required", "authorizer": "acl"}, topics=TOPICS,
        health_certificate=(pki.alice.cert, pki.alice.key)).start()
    try:
        url = metrics_url(broker)
        status, body = scrape(url, pki.ca, cert=pki.bob)
        assert status == 200 and labels_seen(body, "topic") == {"payroll"}
        status, body = scrape(url, pki.ca, cert=pki.alice)
        assert status == 200 and labels_seen(body, "topic") == {"orders-eu"} and "payroll" not in body
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            scrape(url, pki.ca)  # no certificate: no handshake
    finally:
        broker.kill()


def test_plaintext_with_acls_serves_metrics_on_loopback_only_as_anonymous(setup, tmp_path):
    add_acls(setup["zkc"], setup["root"], [Acl("User:ANONYMOUS", "Allow", "Describe", "topic", "orders-eu")])
    settings = {"brokerId": 3, "hostName": "0.0.0.0", "serverPort": 0, "kafkaPort": 0, "metricsPort": 0, "dataPort": -1,
                "zk.connect": setup["zk"], "zk.root": setup["root"], "zk.sessionTimeout": 4000,
                "authorizer": "acl", "dataPath": tmp_path / "data"}
    broker = Broker(load(None, {k: str(v) for k, v in settings.items()})).start()
    try:
        for topic in TOPICS:
            broker.create_topic(topic, 1, {})
        assert broker.metrics.server.server_address[0] == "127.0.0.1"  # not hostName's every interface
        status, body = scrape(f"http://127.0.0.1:{broker.metrics_port}/metrics")
        assert status == 200 and labels_seen(body, "topic") == {"orders-eu"} and "payroll" not in body
    finally:
        broker.stop(grace=0)
