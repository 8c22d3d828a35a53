"""Resource exhaustion before authentication (issue 25, defect 4): each attack of the issue against a real
SASL_SSL broker process with ACLs, while a legitimate client produces and reads back without pause. For
each: the broker's memory (RSS, sampled every 20 ms), threads and file descriptors before, at the worst
moment and after, printed as a table (docs/security.md quotes it) and held to the issue's goal: memory
grows by at most 64 MiB, every legitimate round succeeds during the attack, and threads and descriptors
come back.

    python -m pytest -q -s tests/test_resource_limits.py      # the table is printed at the end"""
import os
import resource
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest import wait_until
from test_security import registered_data_port

from metaq_broker.client import Admin, Consumer, Producer
from metaq_broker.client.connection import BrokerConnection
from metaq_broker.net.blocking import recv_exact
from metaq_broker.protocol import dataport, rawput
from metaq_broker.security.acl import Acl
from metaq_broker.security.settings import ClientSecurity, read_pem
from metaq_broker.server import data_server

MIB = 1 << 20
GOAL = 64 * MIB
OPEN_REQUEST_TIMEOUT_S = 6.0  # open_broker's requestTimeout: a request trickling in is cut off after it
FIGURES: list = []


class Usage:
    """A process's RSS, threads and descriptors, with the RSS peak sampled by a thread while ``watch``."""

    def __init__(self, pid: int):
        self.pid = pid

    def now(self) -> dict:
        status = dict(line.split(":", 1) for line in open(f"/proc/{self.pid}/status"))
        return {"rss": int(status["VmRSS"].split()[0]) * 1024, "threads": int(status["Threads"]),
                "fds": len(os.listdir(f"/proc/{self.pid}/fd"))}

    def watch(self):
        return _Peak(self)


class _Peak:
    def __init__(self, usage: Usage):
        self.usage, self.peak, self._stop = usage, usage.now(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.02):
            now = self.usage.now()
            self.peak = {k: max(self.peak[k], now[k]) for k in now}

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class Legit:
    """A SASL client producing to and fetching from ``t`` in rounds, in a thread, for as long as it runs;
    every round's outcome is kept with its time."""

    def __init__(self, zk_connect, root, security=None):
        self.producer = Producer(zk_connect=zk_connect, zk_root=root, security=security, timeout=30)
        self.consumer = Consumer(zk_connect=zk_connect, zk_root=root, security=security, timeout=30)
        wait_until(lambda: self.producer.partitions("t"), what="topic t")
        self.rounds: list = []  # (time, None or the error)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        i = 0
        while not self._stop.is_set():
            try:
                r = self.producer.send_batch("t", [b"legit-%d" % i] * 10, partition="1-0")[0]
                got = self.consumer.fetch("t", "1-0", r.base_offset, max_messages=10).batch.column("value")
                assert got.to_pylist() == [b"legit-%d" % i] * 10
                self.rounds.append((time.monotonic(), None))
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.rounds.append((time.monotonic(), e))
            i += 1
            time.sleep(0.05)

    def served(self, since: float) -> tuple:
        """(rounds since ``since``, their failures)."""
        mine = [r for r in self.rounds if r[0] >= since]
        return len(mine), [e for _, e in mine if e is not None]

    def close(self):
        self._stop.set()
        self._thread.join(60)
        self.producer.close()
        self.consumer.close()


@pytest.fixture(scope="module")
def secured(tmp_path_factory, zookeeper, pki):
    """A SASL_SSL broker with ACLs: alice may write and read ``t``, bob only read it."""
    from test_security import Brokers
    bs = Brokers.made(tmp_path_factory, zookeeper, "limits", users={"alice": "alice-pw", "bob": "bob-pw"},
                      acls=[Acl("User:alice", "Allow", "All", "topic", "t"),
                            Acl("User:bob", "Allow", "Read", "topic", "t")])
    broker = bs.start("b", 1, {"security.protocol": "SASL_SSL", "ssl.certificate.location": pki.broker.cert,
                               "ssl.key.location": pki.broker.key, "ssl.ca.location": pki.ca,
                               "authorizer": "acl"}, topics={"t": {"numPartitions": 1}})
    legit = Legit(zookeeper.connect_string, bs.root, security(pki, "alice"))
    yield broker, bs.data_port(1), legit
    legit.close()
    bs.stop()


@pytest.fixture(scope="module")
def open_broker(tmp_path_factory, zookeeper, secured):
    """A PLAINTEXT broker without ACLs: anyone may write, so only the put limit stands in an attacker's way.
    A request's bytes must arrive within OPEN_REQUEST_TIMEOUT_S (its ``requestTimeout``)."""
    from test_security import Brokers
    bs = Brokers.made(tmp_path_factory, zookeeper, "limits-open")
    broker = bs.start("b", 1, {"requestTimeout": int(OPEN_REQUEST_TIMEOUT_S * 1000)},
                      topics={"t": {"numPartitions": 1}})
    legit = Legit(zookeeper.connect_string, bs.root, None)
    yield broker, bs.data_port(1), legit
    legit.close()
    bs.stop()


@pytest.fixture(scope="module", autouse=True)
def figures():
    yield
    if FIGURES:
        print("\n| attack | RSS before / worst / after (MiB) | threads | fds | legitimate rounds during |")
        print("|---|---|---|---|---|")
        for row in FIGURES:
            print(row)


def security(pki, user) -> ClientSecurity:
    return ClientSecurity.from_properties({"security.protocol": "SASL_SSL", "ssl.ca.location": pki.ca,
                                           "sasl.username": user, "sasl.password": f"{user}-pw"})


def tls_socket(pki, port: int, alpn=None) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=pki.ca)
    if alpn:
        ctx.set_alpn_protocols(alpn)  # gRPC refuses a handshake without "h2"
    s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=15), server_hostname="127.0.0.1")
    s.settimeout(15)
    return s


def attack(name: str, broker, legit, run, settle=None) -> dict:
    """Run ``run()`` against the broker while watching it; record and return the figures."""
    usage = Usage(broker.proc.pid)
    before = usage.now()
    start = time.monotonic()
    with usage.watch() as peak:
        result = run()
        if settle is not None:
            settle()
        wait_until(lambda: legit.served(start)[0] >= 2, timeout=60, what=f"legitimate rounds during {name}")
    after = usage.now()
    rounds, failures = legit.served(start)
    row = (f"| {name} | {before['rss'] / MIB:.0f} / {peak.peak['rss'] / MIB:.0f} / {after['rss'] / MIB:.0f} | "
           f"{before['threads']} / {peak.peak['threads']} / {after['threads']} | "
           f"{before['fds']} / {peak.peak['fds']} / {after['fds']} | {rounds}, {len(failures)} failed |")
    FIGURES.append(row)
    print("\n" + row)
    assert not failures, f"a legitimate client failed during {name}: {failures[0]!r}"
    assert rounds >= 1, f"no legitimate round completed during {name}"
    grew = peak.peak["rss"] - before["rss"]
    assert grew <= GOAL, f"{name}: memory grew by {grew / MIB:.0f} MiB"
    return {"before": before, "peak": peak.peak, "after": after, "result": result}


def test_idle_tls_connections_that_never_log_in(secured, pki):
    """150 TLS connections to the data port and 150 to gRPC that send nothing after the handshake: at most
    MAX_UNAUTHENTICATED are held by the data port (no thread each), the rest are closed at once, and all
    are closed after LOGIN_TIMEOUT_S; gRPC drops its own after its handshake timeout. The broker's
    descriptor limit is lowered so that the old thread-and-two-descriptors per connection would run out."""
    broker, data_port, legit = secured
    grpc_port = int(broker.address.rsplit(":", 1)[1])
    held: list = []
    refused = [0]
    base_fds = len(os.listdir(f"/proc/{broker.proc.pid}/fd"))
    resource.prlimit(broker.proc.pid, resource.RLIMIT_NOFILE, (base_fds + 250, base_fds + 250))

    def run():
        for port, alpn in ((data_port, None), (grpc_port, ["h2"])):
            for _ in range(150):
                try:
                    held.append(tls_socket(pki, port, alpn))
                except OSError:
                    refused[0] += 1
        time.sleep(1)  # the legitimate client goes on meanwhile
        return refused[0]

    def settle():
        wait_until(lambda: all(_closed(s) for s in held), timeout=data_server.LOGIN_TIMEOUT_S + 20,
                   what="every idle connection closed by the broker")

    try:
        figures = attack("150 + 150 idle TLS connections (data port, gRPC)", broker, legit, run, settle)
    finally:
        for s in held:
            s.close()
    assert figures["peak"]["threads"] - figures["before"]["threads"] <= 4  # no thread per connection
    assert figures["peak"]["fds"] - figures["before"]["fds"] <= 250
    assert figures["after"]["fds"] <= figures["before"]["fds"] + 8


def _closed(sock) -> bool:
    """Whether the broker closed ``sock`` (whatever it sent before, e.g. gRPC's GOAWAY, is read and dropped)."""
    sock.settimeout(0.01)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ssl.SSLWantReadError, TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


def _stream(sock, first: bytes, total: int) -> int:
    """Send ``first`` then zeros up to ``total`` bytes until the broker stops taking them; bytes sent."""
    sent = 0
    chunk = bytes(MIB)
    try:
        sock.sendall(first)
        sent = len(first)
        while sent < total:
            sock.sendall(chunk[:min(MIB, total - sent)])
            sent += min(MIB, total - sent)
    except OSError:
        pass
    return sent


def put_head(declared: int, topic: str = "t") -> bytes:
    """A data-port PUT's prefix and PutRaw header declaring ``declared`` bytes in all."""
    names = topic.encode()
    header_len = rawput.HEADER.size + len(names)
    header_len += -header_len % 8
    head = rawput.HEADER.pack(header_len, 0, 0, 1, 0, 0, len(names), 0, 0) + names
    return dataport.PREFIX.pack(declared, dataport.PUT, 0) + head + bytes(header_len - len(head))


@pytest.mark.parametrize("where", ["SASL_SSL", "PLAINTEXT"])
def test_most_of_a_256_mib_put_from_an_anonymous_client(secured, open_broker, pki, where):
    """Anonymous clients declaring 256 MiB PUTs and streaming 200 MiB each, four at once. SASL_SSL: the
    first frame must be AUTH, so each is refused at its 32-byte head. PLAINTEXT, where anonymous may write:
    the declared size is over the broker's put limit, refused before the body. Each connection is closed."""
    broker, data_port, legit = secured if where == "SASL_SSL" else open_broker

    def one(_):
        s = tls_socket(pki, data_port) if where == "SASL_SSL" else socket.create_connection(("127.0.0.1", data_port))
        with s:
            return _stream(s, put_head(256 * MIB), 200 * MIB)

    def run():
        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(one, range(4)))
    sent = attack(f"4 x most of a 256 MiB data-port PUT, anonymous ({where})", broker, legit, run)["result"]
    assert all(n < 64 * MIB for n in sent), sent  # cut off long before: the broker closed the connection


def test_puts_refused_after_login(secured, pki):
    """A logged-in user without Write: 20 connections each putting 16 MiB (over the broker's put limit:
    refused at the head, connection closed) and 20 putting 8 MiB (under it: refused by the ACLs from the
    header, the body read through a 64 KiB buffer and dropped, the connection kept). No buffer is held."""
    broker, data_port, legit = secured
    conn = BrokerConnection(broker.address, 10, security(pki, "bob"))
    token = conn.session_token()
    opened: list = []

    def one(size):
        s = tls_socket(pki, data_port)
        opened.append(s)
        s.sendall(dataport.pack_auth(token))
        head = bytearray(dataport.REPLY.size)
        recv_exact(s, memoryview(head))
        s.recv(dataport.REPLY.unpack(head)[-1])
        _stream(s, put_head(size), size)
        reply = bytearray(dataport.PUT_REPLY.size)
        try:
            recv_exact(s, memoryview(reply))
        except (OSError, dataport.ProtocolError):  # closed after the refusal: the reply may be lost to the reset
            return "closed"
        return dataport.PUT_REPLY.unpack(reply)[1]

    def run():
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, [16 * MIB] * 20 + [8 * MIB] * 20))
    try:
        statuses = attack("40 refused PUTs of 16 and 8 MiB, logged in", broker, legit, run)["result"]
    finally:
        for s in opened:
            s.close()
        conn.close()
    assert set(statuses[:20]) <= {grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "closed"}
    assert statuses[20:] == [grpc.StatusCode.PERMISSION_DENIED.value[0]] * 20


def test_three_120_mib_grpc_calls(secured, pki):
    """Three 120 MiB PutRaw calls at once, with no session and then with alice's (who may write): the
    first are refused before their message is read, the others by the receive limit (the broker's put
    limit), never buffered whole."""
    broker, _, legit = secured
    conn = BrokerConnection(broker.address, 10, security(pki, "alice"))
    token = conn.session_token()
    creds = grpc.ssl_channel_credentials(read_pem("ca", pki.ca))
    request = put_head(0)[dataport.PREFIX.size:] + bytes(120 * MIB)

    def one(metadata):
        with grpc.secure_channel(broker.address, creds) as ch:
            try:
                ch.unary_unary(rawput.PATH)(request, timeout=60, metadata=metadata)
            except grpc.RpcError as e:
                return e.code()

    def run():
        with ThreadPoolExecutor(3) as pool:
            return list(pool.map(one, [()] * 3)) + list(pool.map(one, [(("metaq-session", token),)] * 3))
    try:
        codes = attack("3 + 3 gRPC PutRaw calls of 120 MiB", broker, legit, run)["result"]
    finally:
        conn.close()
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3


# -- the put limit, as legitimate clients meet it -------------------------------------------------------

def test_a_large_send_batch_is_cut_under_the_limit_and_stored_in_order(cluster):
    """A producer cuts a partition's 24 MB of messages into puts of at most rawput.SPLIT_BYTES (the broker
    takes up to max(maxTransferSize, maxMessageSize, SPLIT_BYTES) + header), sent one after the other."""
    cluster.start_broker(1, {"maxTransferSize": 1 << 20}, topics={"t": {"numPartitions": 2}})
    values = [b"%07d" % i + bytes(993) for i in range(24_000)]
    for use_data_port in (True, False):
        with cluster.client(Producer, use_data_port=use_data_port) as p:
            wait_until(lambda: len(p.partitions("t")) == 2, what="topic t")
            results = p.send_batch("t", values, partition="1-0")
        assert len(results) == 6 and all(r.count <= rawput.SPLIT_BYTES // 1000 for r in results)
        assert [r.base_offset for r in results] == sorted(r.base_offset for r in results)
    with cluster.client(Consumer) as c:
        got = []
        while len(got) < 2 * len(values):
            got += c.fetch("t", "1-0", len(got), max_bytes=16 << 20).batch.column("value").to_pylist()
    assert got == values + values


def test_a_put_over_the_brokers_limit_is_refused_in_words(cluster):
    b = cluster.start_broker(1, {"maxTransferSize": 1 << 20}, topics={"t": {"numPartitions": 1}})
    limit = max(1 << 20, 4 << 20, rawput.SPLIT_BYTES) + rawput.HEADER_ALLOWANCE
    big = rawput.pack("t", 0, "", 1, 0, 0, [bytes(limit)])
    with grpc.insecure_channel(b.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary(rawput.PATH)(big, timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    port = registered_data_port(cluster.zk_connect, cluster.zk_root, 1)
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(dataport.PREFIX.pack(dataport.PREFIX.size + len(big), dataport.PUT, 0) + big[:4096])
        head = bytearray(dataport.PUT_REPLY.size)
        assert recv_exact(s, memoryview(head))
        reply_len, status, *_ = dataport.PUT_REPLY.unpack(head)
        message = s.recv(reply_len - len(head)).decode()
    assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert f"over this broker's limit of {limit}" in message and "maxTransferSize" in message
    with cluster.client(Admin) as admin:  # nor may a topic ask for messages larger than one put
        with pytest.raises(ValueError, match="maxMessageSize 16777216 is over what this broker takes in one put"):
            admin.create_topic("huge", 1, config={"maxMessageSize": str(16 << 20)}, broker_ids=[1])


def test_a_request_trickling_in_is_cut_off_at_its_deadline(open_broker):
    """A put that sends a byte every second never finishes: the broker closes the connection once its
    requestTimeout passed since its first byte, having kept only the scratch of its header."""
    broker, data_port, legit = open_broker
    with socket.create_connection(("127.0.0.1", data_port), timeout=15) as s:
        s.sendall(put_head(1 << 20))
        start = time.monotonic()

        def trickled_out():
            try:
                s.sendall(b"\0")
            except OSError:
                return True
            return _closed(s)
        wait_until(trickled_out, timeout=OPEN_REQUEST_TIMEOUT_S + 30, interval=1.0,
                   what="the trickling put cut off")
        took = time.monotonic() - start
    print(f"a put trickling in a byte a second was cut off after {took:.0f}s")
    assert OPEN_REQUEST_TIMEOUT_S - 1 <= took < data_server.REQUEST_TIMEOUT_S  # the setting's, not the default
