"""LocalZooKeeper against a real server: start, data kept across a restart on the same port, stop,
temporary data removed, clear errors (port taken, no Java), and the ``metaq zookeeper`` foreground
runner stopping on SIGTERM. (Registration, cluster view and groups: test_registry.py.)"""
import os
import signal
import subprocess
import sys
import time

import pytest
from kazoo.client import KazooClient

from metaq_broker.devtools.zookeeper import LocalZooKeeper, free_port, java_available

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def zk_server(tmp_path_factory):
    """One ZooKeeper for this module; the restart test restarts it, which later tests must survive."""
    with LocalZooKeeper(data_dir=tmp_path_factory.mktemp("zk")) as zk:
        yield zk


def client(zk):
    c = KazooClient(zk.connect_string)
    c.start(10)
    return c


def test_start_restart_keeps_port_and_data(zk_server):
    assert zk_server.running and zk_server.connect_string == f"127.0.0.1:{zk_server.port}"
    c = client(zk_server)
    try:
        c.create("/kept", b"v1", makepath=True)
    finally:
        c.stop()
    port, pid = zk_server.port, zk_server.proc.pid
    zk_server.restart()
    assert zk_server.port == port and zk_server.proc.pid != pid and zk_server.running
    c = client(zk_server)
    try:
        assert c.get("/kept")[0] == b"v1"
    finally:
        c.stop()
    assert zk_server.log_path.exists() and zk_server.log_path.parent == zk_server.data_dir


def test_a_client_session_survives_a_quick_restart(zk_server):
    c = client(zk_server)
    try:
        session = c.client_id[0]
        c.create("/eph", b"", ephemeral=True)
        zk_server.restart()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if c.exists("/eph") is not None:
                    break
            except Exception:  # noqa: BLE001 - still reconnecting
                pass
            time.sleep(0.1)
        assert c.client_id[0] == session and c.exists("/eph").ephemeralOwner == session
    finally:
        c.stop()


def test_temporary_data_dir_is_removed_on_stop_and_given_one_kept(tmp_path):
    zk = LocalZooKeeper().start()
    data = zk.data_dir
    assert data.is_dir()
    zk.stop()
    assert not zk.running and not data.exists()
    zk.stop()  # idempotent

    given = tmp_path / "given"
    with LocalZooKeeper(data_dir=given) as zk2:
        proc = zk2.proc
    assert proc.poll() is not None and (given / "data").is_dir() and (given / "zookeeper.log").exists()


def test_port_in_use_is_a_clear_error(zk_server):
    with pytest.raises(RuntimeError, match=f"port {zk_server.port} .* in use"):
        LocalZooKeeper(port=zk_server.port).start()


def test_missing_java_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("JAVA_HOME", raising=False)
    assert not java_available()
    zk = LocalZooKeeper()
    try:
        with pytest.raises(RuntimeError, match="java"):
            zk.start()
    finally:
        zk.stop()


def test_run_foreground_stops_on_sigterm(tmp_path):
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "metaq_broker.devtools.zookeeper", "--port", str(port),
                          "--data", str(tmp_path / "fg")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = p.stdout.readline()
        assert f"127.0.0.1:{port}" in line, line
        c = KazooClient(f"127.0.0.1:{port}")
        c.start(10)
        c.stop()
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        assert "stopped" in p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    # The server is gone with the runner: the port can be used again.
    LocalZooKeeper(port=port, data_dir=tmp_path / "again").start().stop()
