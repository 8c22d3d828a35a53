"""The data port with TLS and SASL: fetches and puts over TLS (pread + sendall in place of sendfile), the
principal of a client certificate or a session checked by the ACLs, certificates refused in words, the
AUTH frame first, and a flood of bad handshakes that does not disturb good clients. Real brokers: child
processes, or in-process where a broker's certificate is bad on purpose (its health check could not pass)."""
import functools
import json
import os
import socket
import ssl
import threading
import time

import pytest
from conftest import wait_until
from kazoo.client import KazooClient
from test_metrics import Scrape

from metaq_broker.client.connection import BrokerConnection
from metaq_broker.client.dataconn import DataConnection, DataConnectionPool
from metaq_broker.client.fetcher import PartitionFetcher
from metaq_broker.client.producer import Producer
from metaq_broker.errors import AuthenticationError
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.net.blocking import recv_exact
from metaq_broker.protocol import dataport, rawput, records
from metaq_broker.protocol.status import RemoteAuthenticationError, RemoteAuthorizationError
from metaq_broker.security import tls
from metaq_broker.security.acl import Acl
from metaq_broker.security.scram import Credential
from metaq_broker.security.settings import ClientSecurity
from metaq_broker.server.broker import Broker
from metaq_broker.server.config import load
from metaq_broker.zk import acls as zk_acls
from metaq_broker.zk import users as zk_users
from metaq_broker.zk.paths import ZkPaths

pytestmark = pytest.mark.unit

UNAUTHENTICATED, PERMISSION_DENIED = 16, 7


@pytest.fixture
def zk(zookeeper):
    c = KazooClient(hosts=zookeeper.connect_string)
    c.start(15)
    yield c
    c.stop()
    c.close()


def broker_tls(pki, cert=None, protocol="SSL", **more):
    cert = cert or pki.broker
    return {"security.protocol": protocol, "ssl.certificate.location": cert.cert, "ssl.key.location": cert.key,
            "ssl.ca.location": pki.ca, **more}


def client_tls(pki, cert=None, ca=None, **more) -> ClientSecurity:
    props = {"security.protocol": "SSL", "ssl.ca.location": ca or pki.ca, **more}
    if cert is not None:
        props.update({"ssl.certificate.location": cert.cert, "ssl.key.location": cert.key})
    return ClientSecurity.from_properties(props)


def client_sasl(pki, user="alice", password="alice-pw") -> ClientSecurity:
    return ClientSecurity.from_properties({"security.protocol": "SASL_SSL", "ssl.ca.location": pki.ca,
                                           "sasl.username": user, "sasl.password": password})


def start(cluster, settings, **kw):
    """A broker process with metrics on; (process, data port address, a scrape of its metrics: HTTPS, as
    alice under SASL_SSL)."""
    b = cluster.start_broker(1, {"metricsPort": 0, **settings}, topics={"t": {"numPartitions": 1}}, **kw)
    metrics = functools.partial(Scrape, b.metrics_port, settings["ssl.ca.location"], ("alice", "alice-pw")
                                if settings["security.protocol"] == "SASL_SSL" else None)
    zk = KazooClient(hosts=cluster.zk_connect)
    zk.start(15)
    try:
        reg = json.loads(zk.get(ZkPaths(cluster.zk_root).broker(1))[0])
    finally:
        zk.stop()
        zk.close()
    return b, f"127.0.0.1:{reg['dataPort']}", metrics


def served(metrics, method):
    """Calls of ``method`` the broker's metrics have timed (FetchData, PutData: the data port's)."""
    return metrics().samples.get(("metaq_rpc_latency_seconds_count", (("method", method),)), 0)


def put_parts(values, topic="t", partition=0):
    body = records.encode_body(values)
    return rawput.pack_parts(topic, partition, "", body.count, body.attributes, body.crc, body.parts)


def values_of(reply) -> list:
    return records.decode(reply.records, reply.start_offset, reply.end_offset).column("value").to_pylist()


def read_reply(sock) -> tuple:
    """(status, body) of one data port reply read from a raw socket."""
    head = bytearray(dataport.REPLY.size)
    assert recv_exact(sock, memoryview(head))
    header_len, status, *_, body_len = dataport.REPLY.unpack(head)
    rest = bytearray(header_len - dataport.REPLY.size + body_len)
    assert recv_exact(sock, memoryview(rest))
    return status, bytes(rest[header_len - dataport.REPLY.size:])


def closed(sock) -> bool:
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, ssl.SSLEOFError):
        return True


def tls_socket(pki, port, cert=None):
    ctx = tls.client_context(client_tls(pki, cert))
    s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=15), server_hostname="127.0.0.1")
    s.settimeout(15)
    return s


# -- TLS -------------------------------------------------------------------------------------------------

def test_fetch_and_put_over_the_tls_data_port(cluster, pki):
    b, data_address, metrics = start(cluster, broker_tls(pki))
    sec = client_tls(pki)
    values = [os.urandom(700) + b"%06d" % i for i in range(4000)]  # ~2.8 MB: several TLS_CHUNKs per reply
    with Producer(zk_connect=cluster.zk_connect, zk_root=cluster.zk_root, security=sec) as producer:
        wait_until(lambda: producer.data_address(1), what="data port in the cluster view")
        puts = served(metrics, "PutData")
        for i in range(0, len(values), 1000):
            producer.send_batch("t", values[i:i + 1000], partition="1-0")
        wait_until(lambda: served(metrics, "PutData") == puts + 4, what="4 puts counted")  # counted after the reply
        idle = producer.data_pool._idle[data_address]
        assert idle and all(isinstance(c.sock, ssl.SSLSocket) for c in idle)

    conn = BrokerConnection(b.address, 10, sec)
    pool = DataConnectionPool(10)  # no security of its own: the fetcher takes its connection's
    try:
        fetches = served(metrics, "FetchData")
        with PartitionFetcher(conn, "t", "1-0", 0, 10, 8 << 20, pool, data_address) as fetcher:
            reply = fetcher.fetch(0)
            assert isinstance(fetcher._data.sock, ssl.SSLSocket)
            small = fetcher.fetch(1500, max_messages=10)  # the connection serves on
        wait_until(lambda: served(metrics, "FetchData") == fetches + 2, what="2 fetches counted")
        assert (reply.start_offset, reply.end_offset) == (0, 4000) and values_of(reply) == values
        assert values_of(small) == values[1500:1510]
        raw = conn.call("FetchRaw", pb.FetchRequest(topic="t", partition=0, offset=0, max_bytes=8 << 20))
        assert bytes(reply.records) == bytes(raw.records) and len(raw.records) > 2 << 20
    finally:
        pool.close()
        conn.close()


def test_a_plaintext_client_is_refused_by_a_tls_data_port(cluster, pki):
    _, data_address, _ = start(cluster, broker_tls(pki))
    host, port = data_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=15) as s:
        s.sendall(dataport.pack_request("t", 0, 0))
        try:
            first = s.recv(1)
        except ConnectionResetError:
            first = b""
        assert first in (b"", b"\x15")  # nothing, or a TLS alert record: never a data port reply
        assert first == b"" or closed(s)
    # and the client library says what is wrong instead of waiting
    with DataConnection(data_address, 10) as plain:
        with pytest.raises((OSError, dataport.ProtocolError)):
            plain.fetch("t", 0, 0)


@pytest.mark.parametrize("case, why", [
    ("expired_broker", "has expired"),
    ("other_host_broker", "not for this host name"),
    ("stranger_broker", "not signed by a trusted CA"),
    ("plaintext", "does not speak TLS"),
])
def test_bad_broker_certificates_fail_in_words(tmp_path, pki, case, why):
    overrides = {"brokerId": 1, "serverPort": 0, "kafkaPort": 0, "dataPort": 0, "zk.connect": "none", "dataPath": tmp_path / "b"}
    if case != "plaintext":
        overrides.update(broker_tls(pki, getattr(pki, case)))
    broker = Broker(load(None, {k: str(v) for k, v in overrides.items()})).start()
    try:
        address = f"127.0.0.1:{broker.data_port}"
        with DataConnection(address, 10, client_tls(pki)) as d:
            with pytest.raises(AuthenticationError) as e:
                d.fetch("t", 0, 0)
        assert why in str(e.value) and address in str(e.value)
        assert not isinstance(e.value, OSError)  # no silent fallback to gRPC: callers see it
    finally:
        broker.stop(grace=1)


def test_mutual_tls_principal_is_checked_by_the_acls(cluster, zk, pki):
    zk_acls.add_acls(zk, cluster.zk_root, [Acl("User:alice", "Allow", op, "topic", "t") for op in ("Read", "Write")])
    _, data_address, _ = start(cluster, broker_tls(pki, **{"ssl.client.auth": "required", "authorizer": "acl"}),
                               health_certificate=(pki.alice.cert, pki.alice.key))
    with DataConnection(data_address, 10, client_tls(pki, pki.alice)) as alice:
        alice.send_put(put_parts([b"from alice"]))
        assert alice.receive_put()[0] == 0
        assert values_of(alice.fetch("t", 0, 0)) == [b"from alice"]
    with DataConnection(data_address, 10, client_tls(pki, pki.bob)) as bob:
        with pytest.raises(RemoteAuthorizationError, match="User:bob is not allowed Read on topic 't'"):
            bob.fetch("t", 0, 0)
        bob.send_put(put_parts([b"from bob"]))
        with pytest.raises(RemoteAuthorizationError, match="User:bob is not allowed Write on topic 't'"):
            bob.receive_put()
        assert bob.connects == 1  # a refusal leaves the connection usable
    with DataConnection(data_address, 10, client_tls(pki)) as nobody:
        with pytest.raises(AuthenticationError, match="requires a client certificate"):
            nobody.fetch("t", 0, 0)
    with DataConnection(data_address, 10, client_tls(pki, pki.stranger_client)) as stranger:
        with pytest.raises(AuthenticationError, match="TLS handshake with .* failed"):
            stranger.fetch("t", 0, 0)


# -- SASL ------------------------------------------------------------------------------------------------

def sasl_broker(cluster, zk, pki):
    zk_users.put_user(zk, cluster.zk_root, "alice", Credential.make("alice-pw"))
    return start(cluster, broker_tls(pki, protocol="SASL_SSL"))


def test_sasl_data_port_takes_nothing_before_auth_and_refuses_bad_tokens(cluster, zk, pki):
    b, data_address, _ = sasl_broker(cluster, zk, pki)
    port = int(data_address.rsplit(":", 1)[1])
    with tls_socket(pki, port) as s:  # a fetch first
        s.sendall(dataport.pack_request("t", 0, 0))
        status, body = read_reply(s)
        assert status == UNAUTHENTICATED and b"authenticate first" in body
        assert closed(s)
    with tls_socket(pki, port) as s:  # a put first: refused in the put reply's layout
        s.sendall(b"".join(bytes(p) for p in dataport.put_request(put_parts([b"x"]))))
        head = bytearray(dataport.PUT_REPLY.size)
        assert recv_exact(s, memoryview(head))
        assert dataport.PUT_REPLY.unpack(head)[1] == UNAUTHENTICATED
    with tls_socket(pki, port) as s:  # bad tokens: refused, then the connection is closed
        for attempt in range(dataport.AUTH_ATTEMPTS):
            s.sendall(dataport.pack_auth(f"forged.token{attempt}"))
            status, body = read_reply(s)
            assert status == UNAUTHENTICATED and body.startswith(b"unknown session")
        assert closed(s)

    conn = BrokerConnection(b.address, 10, client_sasl(pki))
    try:
        with DataConnection(data_address, 10, client_sasl(pki)) as d:  # no session: told, nothing sent
            with pytest.raises(AuthenticationError, match="session token"):
                d.fetch("t", 0, 0)
        with DataConnection(data_address, 10, client_sasl(pki), session=lambda renew=False: "forged.x") as d:
            with pytest.raises(RemoteAuthenticationError, match="unknown session"):
                d.fetch("t", 0, 0)
        calls = []

        def stale_then_fresh(renew=False):  # a session from before a broker restart, then a new one
            calls.append(renew)
            return conn.session_token(renew=True) if renew else "stale.token"
        with DataConnection(data_address, 10, client_sasl(pki), session=stale_then_fresh) as d:
            assert d.fetch("t", 0, 0).end_offset == 0
            assert calls == [False, True] and d.principal == "User:alice" and d.connects == 1
    finally:
        conn.close()


def test_produce_and_fetch_over_a_sasl_data_port(cluster, zk, pki):
    b, data_address, metrics = sasl_broker(cluster, zk, pki)
    sec = client_sasl(pki)
    with Producer(zk_connect=cluster.zk_connect, zk_root=cluster.zk_root, security=sec) as producer:
        wait_until(lambda: producer.data_address(1), what="data port in the cluster view")
        puts = served(metrics, "PutData")
        producer.send_batch("t", [b"m%d" % i for i in range(100)], partition="1-0")
        wait_until(lambda: served(metrics, "PutData") == puts + 1, what="the put counted")
        assert producer.data_pool._idle[data_address][0].principal == "User:alice"
    conn = BrokerConnection(b.address, 10, sec)
    pool = DataConnectionPool(10)
    try:
        fetches = served(metrics, "FetchData")
        with PartitionFetcher(conn, "t", "1-0", 0, 10, 1 << 20, pool, data_address) as fetcher:
            assert values_of(fetcher.fetch(0)) == [b"m%d" % i for i in range(100)]
        wait_until(lambda: served(metrics, "FetchData") == fetches + 1, what="the fetch counted")  # after the reply
    finally:
        pool.close()
        conn.close()


# -- a flood of bad handshakes ---------------------------------------------------------------------------

def _garbage(port: int, i: int) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
            if i % 3 == 0:
                s.sendall(os.urandom(1 + i % 300))  # noise
            elif i % 3 == 1:
                s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc" + os.urandom(64))  # a ClientHello cut short
            else:
                s.sendall(dataport.pack_request("t", 0, 0))  # plaintext on a TLS port
            s.shutdown(socket.SHUT_WR)
            while s.recv(4096):
                pass
    except OSError:
        pass


def test_a_flood_of_bad_handshakes_does_not_disturb_good_clients(cluster, zk, pki):
    b, data_address, metrics = sasl_broker(cluster, zk, pki)
    port = int(data_address.rsplit(":", 1)[1])
    sec = client_sasl(pki)
    attackers = [threading.Thread(target=lambda k=k: [_garbage(port, k * 20 + j) for j in range(20)])
                 for k in range(10)]  # 200 bad connections from 10 threads
    stored = []
    with Producer(zk_connect=cluster.zk_connect, zk_root=cluster.zk_root, security=sec) as producer:
        wait_until(lambda: producer.data_address(1), what="data port in the cluster view")
        conn = BrokerConnection(b.address, 10, sec)
        pool = DataConnectionPool(10)
        puts, fetches = served(metrics, "PutData"), served(metrics, "FetchData")
        for t in attackers:
            t.start()
        try:
            rounds = 0
            while any(t.is_alive() for t in attackers) or rounds < 10:
                batch = [b"r%d-%d" % (rounds, i) for i in range(50)]
                producer.send_batch("t", batch, partition="1-0")
                stored += batch
                with PartitionFetcher(conn, "t", "1-0", 0, 10, 8 << 20, pool, data_address) as fetcher:
                    reply = fetcher.fetch(0)
                assert values_of(reply) == stored
                rounds += 1
        finally:
            for t in attackers:
                t.join(60)
            pool.close()
            conn.close()
        wait_until(lambda: served(metrics, "PutData") == puts + rounds and served(metrics, "FetchData") == fetches + rounds,
                   what="every round counted")
    log = b.log_path.read_text()
    assert "TLS handshake" not in log and "Traceback" not in log  # failed handshakes are debug lines only
    assert len(log.splitlines()) < 50


@pytest.mark.parametrize("change", ["removed", "new password", "expired"])
def test_an_ended_session_closes_its_open_data_port_connection_at_once(tmp_path, zookeeper, zk_root, zk, pki,
                                                                       monkeypatch, change):
    """The user cache's watch (or the session's expiry) ends the connection itself, not its next request
    (which came up to 60 s later)."""
    from metaq_broker.server import auth
    if change == "expired":
        monkeypatch.setattr(auth, "SESSION_LIFETIME_S", 3.0)
    zk_users.put_user(zk, zk_root, "alice", Credential.make("alice-pw"))
    overrides = {"brokerId": 1, "serverPort": 0, "kafkaPort": 0, "dataPort": 0, "zk.connect": zookeeper.connect_string,
                 "zk.root": zk_root, "dataPath": tmp_path / "b", **broker_tls(pki, protocol="SASL_SSL")}
    broker = Broker(load(None, {k: str(v) for k, v in overrides.items()})).start()
    broker.create_topic("t", None, {})
    conn = BrokerConnection(broker.address, 10, client_sasl(pki))
    try:
        with DataConnection(f"127.0.0.1:{broker.data_port}", 10, client_sasl(pki), conn.session_token) as d:
            assert d.fetch("t", 0, 0).end_offset == 0
            if change == "removed":
                zk_users.delete_user(zk, zk_root, "alice")
            elif change == "new password":
                zk_users.put_user(zk, zk_root, "alice", Credential.make("alice-new-pw"))
            ended = time.monotonic()
            wait_until(lambda: not d.alive(), timeout=10, interval=0.02, what="the connection closed by the broker")
            print(f"session {change}: connection closed {time.monotonic() - ended:.2f}s later")

            def refused():
                try:
                    d.fetch("t", 0, 0)
                except (RemoteAuthenticationError, AuthenticationError) as e:
                    return str(e)
            if change != "expired":  # connecting again renews the session, which fails: the credential is gone
                assert "unknown user or wrong password" in wait_until(refused, what="the new login refused")
    finally:
        conn.close()
        broker.stop(grace=1)
