"""Prometheus metrics of a real broker: scraped over HTTP while producing and fetching through the
client, compared with what the store holds; ZooKeeper session state; config; the port freed on stop."""
import base64
import re
import signal
import socket
import ssl
import subprocess
import sys
import urllib.request

import pytest
from conftest import wait_until
from prometheus_client.parser import text_string_to_metric_families

from metaq_broker import __version__
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.errors import ConfigError
from metaq_broker.protocol import records
from metaq_broker.protocol.status import RemoteMessageTooLargeError, RemoteOffsetOutOfRangeError
from metaq_broker.server.broker import Broker
from metaq_broker.server.config import load
from metaq_broker.store.segment import SEGMENT_HEADER_SIZE

pytestmark = pytest.mark.unit


class Scrape:
    """One scrape of /metrics, parsed with Prometheus' own parser; ``m(name, **labels)`` is a sample. A
    secured broker's (docs/security.md, "The metrics port"): HTTPS trusting ``ca``, basic ``login``."""

    def __init__(self, port, ca=None, login=None):
        request = urllib.request.Request(f"{'https' if ca else 'http'}://127.0.0.1:{port}/metrics")
        if login is not None:
            request.add_header("Authorization", "Basic " + base64.b64encode(":".join(login).encode()).decode())
        context = ssl.create_default_context(cafile=ca) if ca else None
        text = urllib.request.urlopen(request, timeout=10, context=context).read().decode()
        self.types, self.samples = {}, {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for s in family.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def __call__(self, name, **labels):
        return self.samples[(name, tuple(sorted(labels.items())))]


def start_broker(tmp_path, name="b", **settings):
    overrides = {"brokerId": 1, "serverPort": 0, "kafkaPort": 0, "metricsPort": 0, "zk.connect": "none",
                 "dataPath": tmp_path / name, **settings}
    return Broker(load(None, {k: str(v) for k, v in overrides.items()})).start()


def port_is_free(port):
    """Connections are refused and a new server (SO_REUSEADDR, as the metrics server binds) can listen."""
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
    return True


def test_traffic_storage_latency_and_zookeeper_are_exported(tmp_path, zookeeper, zk_root):
    broker = start_broker(tmp_path, **{"zk.connect": zookeeper.connect_string, "zk.root": zk_root})
    try:
        broker.create_topic("orders", 2, {"maxSegmentSize": "4096", "maxMessageSize": "1000"})
        zk = dict(zk_connect=zookeeper.connect_string, zk_root=zk_root)
        with Producer(**zk) as producer, Consumer(**zk) as consumer:
            wait_until(lambda: producer.cluster.topic_partitions("orders"), what="topic in ZooKeeper")
            batches = [[b"order-%d-%d-" % (i, j) + b"x" * 40 for j in range(50)] for i in range(6)]
            for values in batches:
                producer.send_batch("orders", values, partition="1-0")
            producer.send_batch("orders", [b"small-%d" % i for i in range(7)], partition="1-1")
            with pytest.raises(RemoteMessageTooLargeError):
                producer.send_batch("orders", [b"y" * 2000], partition="1-0")
            puts = len(batches) + 2

            fetches, offset, latest = 0, 0, broker.store.partition("orders", 0).last_stable_offset
            while offset < latest:
                offset = consumer.fetch("orders", "1-0", offset).next_offset
                fetches += 1
            assert consumer.fetch("orders", "1-1", 0).next_offset == 7
            assert consumer.fetch("orders", "1-1", 7).next_offset == 7  # a miss
            with pytest.raises(RemoteOffsetOutOfRangeError):
                consumer.fetch("orders", "1-1", 1000)
            fetches += 3

        m = Scrape(broker.metrics_port)
        p0, p1 = broker.store.partition("orders", 0), broker.store.partition("orders", 1)
        one, two = dict(topic="orders", partition="1-0"), dict(topic="orders", partition="1-1")
        assert m("metaq_messages_in_total", **one) == 300 and m("metaq_messages_in_total", **two) == 7
        assert m("metaq_bytes_in_total", **one) == sum(records.encode_body(v).size for v in batches)
        assert m("metaq_bytes_in_total", **two) == records.encode_body([b"small-%d" % i for i in range(7)]).size
        assert (m("metaq_put_requests_total", **one), m("metaq_put_failures_total", **one)) == (6, 1)
        assert m("metaq_messages_out_total", **one) == 300 and m("metaq_messages_out_total", **two) == 7
        assert m("metaq_fetch_requests_total", **one) == fetches - 3
        assert (m("metaq_fetch_requests_total", **two), m("metaq_fetch_misses_total", **two),
                m("metaq_fetch_failures_total", **two)) == (2, 1, 1)
        # Every batch was fetched once, whole: the bytes out are the segments less their headers.
        segments = len(p0.segments())
        assert segments > 1 and m("metaq_segments", **one) == segments and m("metaq_segments", **two) == 1
        assert m("metaq_disk_bytes", **one) == p0.size_bytes and m("metaq_disk_bytes", **two) == p1.size_bytes
        assert m("metaq_bytes_out_total", **one) == p0.size_bytes - segments * SEGMENT_HEADER_SIZE
        assert m("metaq_bytes_out_total", **two) == p1.size_bytes - SEGMENT_HEADER_SIZE
        assert (m("metaq_earliest_offset", **one), m("metaq_latest_offset", **one)) == (0, 300)
        # Group commit, one producer: each stored batch took exactly one fsync.
        assert (m("metaq_fsyncs_total", **one), m("metaq_fsyncs_total", **two)) == (6, 1)
        assert m("metaq_fsync_seconds_total", **one) > 0 and p0.fsync_count == 6
        # the producer knows the broker's data port from ZooKeeper, so its puts went there
        assert m("metaq_rpc_latency_seconds_count", method="PutData") == puts
        assert m("metaq_rpc_latency_seconds_bucket", method="PutData", le="+Inf") == puts
        assert m("metaq_rpc_latency_seconds_count", method="FetchRaw") == fetches  # the client fetches raw
        assert m("metaq_rpc_latency_seconds_sum", method="FetchRaw") > 0
        assert m.types["metaq_rpc_latency_seconds"] == "histogram" and m.types["metaq_messages_in"] == "counter"
        assert m.types["metaq_segments"] == "gauge"
        assert m("metaq_zookeeper_connected") == 1 and m("metaq_zookeeper_state", state="connected") == 1
        assert m("metaq_zookeeper_state", state="disabled") == 0 and m("metaq_zookeeper_registrations_total") >= 1
        assert m("metaq_broker_info", broker_id="1", version=__version__) == 1
        assert sum(v for (name, _), v in m.samples.items() if name == "metaq_open_transactions") == 0
    finally:
        broker.stop()


def test_zookeeper_state_follows_the_session(tmp_path, own_zookeeper):
    zk = own_zookeeper  # not the shared one: we stop it
    broker = None
    try:
        broker = start_broker(tmp_path, **{"zk.connect": zk.connect_string, "zk.sessionTimeout": 4000})
        port = broker.metrics_port
        assert Scrape(port)("metaq_zookeeper_connected") == 1
        zk.stop()  # keeps the data dir (given), and start() keeps the port
        m = wait_until(lambda: (lambda m: m("metaq_zookeeper_connected") == 0 and m)(Scrape(port)),
                       what="disconnected in the metrics")
        assert m("metaq_zookeeper_state", state="suspended") + m("metaq_zookeeper_state", state="lost") == 1
        zk.start()
        m = wait_until(lambda: (lambda m: m("metaq_zookeeper_registrations_total") >= 2 and m)(Scrape(port)),
                       timeout=30, what="re-registered")
        assert m("metaq_zookeeper_connected") == 1 and m("metaq_zookeeper_state", state="connected") == 1
    finally:
        if broker is not None:
            broker.stop()
        zk.stop()


def test_brokers_in_one_process_report_separately_and_stop_frees_the_port(tmp_path):
    a = start_broker(tmp_path, "a", brokerId=1)
    b = start_broker(tmp_path, "b", brokerId=2)
    try:
        a.create_topic("ta", 1, {})
        b.create_topic("tb", 3, {})
        ma, mb = Scrape(a.metrics_port), Scrape(b.metrics_port)
        assert ma("metaq_broker_info", broker_id="1", version=__version__) == 1
        assert mb("metaq_broker_info", broker_id="2", version=__version__) == 1
        assert ma("metaq_segments", topic="ta", partition="1-0") == 1
        assert not any(dict(labels).get("topic") == "tb" for _, labels in ma.samples)
        assert [dict(labels)["partition"] for name, labels in mb.samples if name == "metaq_segments"] == \
            ["2-0", "2-1", "2-2"]
        assert ma("metaq_zookeeper_state", state="disabled") == 1 and ma("metaq_zookeeper_connected") == 0
        assert ma("metaq_open_transactions", state="open") == 0
    finally:
        a.stop()
    assert port_is_free(a.metrics_port)
    assert Scrape(b.metrics_port)("metaq_segments", topic="tb", partition="2-0") == 1  # b is unaffected
    b.stop()
    assert port_is_free(b.metrics_port)
    # The freed port can be taken again by a broker asking for it by number.
    c = start_broker(tmp_path, "c", metricsPort=b.metrics_port)
    try:
        assert c.metrics_port == b.metrics_port and Scrape(c.metrics_port)("metaq_zookeeper_connected") == 0
    finally:
        c.stop()


def test_metrics_off_by_default_and_a_taken_port_is_refused(tmp_path):
    broker = start_broker(tmp_path, "off", metricsPort=-1)
    try:
        assert broker.metrics is None and broker.metrics_port is None
    finally:
        broker.stop()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"metricsPort: cannot listen on 127.0.0.1:{port}"):
            start_broker(tmp_path, "taken", metricsPort=port)
    assert load(None).metrics_port == -1


@pytest.mark.parametrize("raw,match", [("http", "'http' is not an integer"), ("-2", "-2 is outside -1..65535"),
                                       ("65536", "65536 is outside"), ("", "'' is not an integer")])
def test_bad_metrics_port_values_are_refused(raw, match):
    with pytest.raises(ConfigError, match=rf"\[system\] metricsPort: {match}"):
        load(None, {"metricsPort": raw})


def test_metrics_port_setting_in_the_ini_file(tmp_path):
    path = tmp_path / "broker.ini"
    path.write_text("[system]\nmetricsPort=9123\n")
    assert load(str(path)).metrics_port == 9123
    assert load(str(path), {"metricsPort": "0"}).metrics_port == 0


@pytest.mark.process
def test_metrics_port_flag_of_the_broker_process(tmp_path):
    log = tmp_path / "broker.log"
    base = [sys.executable, "-m", "metaq_broker.server.main", "--brokerId", "7", "--serverPort", "0",
            "--kafkaPort", "0", "--zk.connect", "none", "--dataPath", str(tmp_path / "data")]  # 9092: parallel tests
    bad = subprocess.run(base + ["--metricsPort", "x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "metricsPort: 'x' is not an integer" in bad.stderr
    with open(log, "wb") as out:
        proc = subprocess.Popen(base + ["--metricsPort", "0"], stdout=out, stderr=subprocess.STDOUT)
    try:
        def logged_port():
            assert proc.poll() is None, log.read_text()
            return re.search(r"Prometheus metrics at http://127\.0\.0\.1:(\d+)/metrics", log.read_text())
        found = wait_until(logged_port, timeout=60, what="the metrics port in the broker's log")
        port = int(found.group(1))
        m = Scrape(port)
        assert m("metaq_broker_info", broker_id="7", version=__version__) == 1
        assert m("metaq_zookeeper_state", state="disabled") == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert port_is_free(port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
