"""A broker whose disk fills up (a real tmpfs, ``small_disk``; the store's own full-disk behaviour is in
tests/test_transactions_log.py): writes are refused as RESOURCE_EXHAUSTED naming the path and the free
space, the client raises a disk-full error, the broker logs a warning (no traceback), the metrics and the
health service show it, and once space is freed writes succeed again by themselves."""
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from metaq_broker.client import Admin, Consumer, Producer  # the package's own names, as the README shows
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.errors import DiskFullError, MessageTooLargeError
from metaq_broker.protocol.status import RemoteDiskFullError, RemoteMessageTooLargeError, error_of

pytestmark = pytest.mark.unit

PAGE = 4096
BIG = b"v" * (3 * PAGE)  # more than the free end of any page a file already has: needs new pages


def test_the_client_package_exports_producer_consumer_and_admin():
    import metaq_broker.client as client
    assert {"Producer", "Consumer", "Admin"} <= set(client.__all__)
    assert (Producer.__module__, Consumer.__module__, Admin.__module__) == (
        "metaq_broker.client.producer", "metaq_broker.client.consumer", "metaq_broker.client.admin")


def test_resource_exhausted_is_told_apart_by_its_message():
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    full = error_of(code, "disk full: cannot write /d/t-0: No space left on device (0 B free of 2.0 MiB); ...", "h:1")
    assert isinstance(full, RemoteDiskFullError) and isinstance(full, DiskFullError)
    assert not isinstance(full, MessageTooLargeError)
    big = error_of(code, "message 0 of the batch is 2000000 bytes", "h:1")
    assert isinstance(big, RemoteMessageTooLargeError) and not isinstance(big, DiskFullError)


def metrics(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def write_health(address):
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="metaq.write"), timeout=10).status


def refused(send):
    """Call ``send`` until the disk refuses it (a file's last page may still take a little); the error."""
    for _ in range(200):
        try:
            send()
        except RemoteDiskFullError as e:
            return e
    raise AssertionError("the disk never refused a write")


@pytest.mark.process
@pytest.mark.parametrize("via", ["grpc", "dataport"])
def test_a_full_disk_is_refused_plainly_counted_shown_in_health_and_writes_resume(tmp_path, small_disk, via, request):
    """``grpc``: a static broker list and a producer told to put with ``PutRaw`` calls; ``dataport``: found
    through ZooKeeper, so puts go over the broker's data port."""
    disk = small_disk(tmp_path / "disk", 2048)
    if via == "grpc":
        zk, connect = {"zk.connect": "none"}, {}
    else:
        zookeeper, zk_root = request.getfixturevalue("zookeeper"), request.getfixturevalue("zk_root")
        zk = {"zk.connect": zookeeper.connect_string, "zk.root": zk_root}
        connect = {"zk_connect": zookeeper.connect_string, "zk_root": zk_root}
    broker = BrokerProcess(tmp_path / "broker", 0, settings={
        "dataPath": disk.path / "data", "metricsPort": 0, **zk}, topics={"t": {"numPartitions": 1}}).start()
    metrics_port = broker.metrics_port
    data = str(disk.path / "data")
    connect = connect or {"brokers": f"0={broker.address}"}
    try:
        with Producer(**connect, use_data_port=via == "dataport") as producer, Consumer(**connect) as consumer:
            producer.send_batch("t", [b"before"])
            prepared = []
            for i in range(60):  # prepared now, committed once the disk is full
                tx = producer.transaction(f"p{i}")
                if i == 0:
                    tx.send_batch("t", [b"p0"])
                else:
                    tx.xid_on(0)
                tx.prepare()
                prepared.append(tx)
            open_tx = producer.transaction("open")
            open_tx.send_batch("t", [b"in the open transaction"])
            assert write_health(broker.address) == health_pb2.HealthCheckResponse.SERVING
            free_before = metrics(metrics_port)[("metaq_data_free_bytes", (("path", data),))]
            assert free_before > 0

            disk.fill()
            e = refused(lambda: producer.send_batch("t", [BIG]))
            assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.details.startswith(f"disk full: cannot write {data}/t-0/"), e.details
            assert "No space left on device" in e.details and " free of 2.0 MiB" in e.details
            assert "nothing of this call was stored" in e.details
            for _ in range(10):
                with pytest.raises(RemoteDiskFullError):
                    producer.send_batch("t", [BIG], partition="0-0")
            with pytest.raises(RemoteDiskFullError, match="disk full: cannot write"):  # a transaction's put
                open_tx.send_batch("t", [BIG])
            with pytest.raises(RemoteDiskFullError):
                for i in range(200):  # each prepare journals a record: one finds no room
                    tx = producer.transaction(f"q{i}")
                    tx.xid_on(0)
                    tx.prepare()
            commit_error = None
            for tx in prepared[1:]:  # commits journal their decision: one finds no room
                try:
                    tx.commit()
                except RemoteDiskFullError as e:
                    commit_error = e
                    break
            assert commit_error is not None and commit_error.details.startswith("disk full: cannot write")

            assert write_health(broker.address) == health_pb2.HealthCheckResponse.NOT_SERVING
            m = metrics(metrics_port)
            assert m[("metaq_disk_full", ())] == 1
            assert m[("metaq_disk_full_errors_total", ())] >= 14
            assert m[("metaq_data_free_bytes", (("path", data),))] < PAGE
            assert m[("metaq_put_failures_total", (("partition", "0-0"), ("topic", "t")))] >= 12
            put_method = "PutData" if via == "dataport" else "Put"  # the path this variant means to take
            assert m[("metaq_rpc_latency_seconds_count", (("method", put_method),))] >= 12

            disk.free()  # no restart, nothing resent by hand but the refused calls
            producer.send_batch("t", [b"after"])
            assert write_health(broker.address) == health_pb2.HealthCheckResponse.SERVING
            m = metrics(metrics_port)
            assert m[("metaq_disk_full", ())] == 0
            assert m[("metaq_data_free_bytes", (("path", data),))] > PAGE
            prepared[0].commit()  # its outcome is settled in the log too
            open_tx.send_batch("t", [b"resent"])
            open_tx.prepare()
            open_tx.commit()
            earliest, latest = consumer.offsets("t")["0-0"]
            values = consumer.read_range("t", "0-0", earliest, latest).column("value").to_pylist()
            assert values == [b"before", b"p0", b"in the open transaction", b"after", b"resent"]
    finally:
        broker.stop()
    log = broker.log_path.read_text()
    warnings = [line for line in log.splitlines() if " WARNING " in line and "disk full: cannot write" in line]
    assert 1 <= len(warnings) < 14, warnings  # rate-limited: not one line per refused write
    assert "Traceback" not in log and " ERROR " not in log, log
    assert "writes succeed again" in log
