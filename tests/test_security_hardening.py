"""Hardening (docs/security.md, "Limits and hardening"): the SCRAM client refuses what a rogue broker could
abuse, the broker keeps its files private whatever the umask, warns about what it cannot fix itself, and
does not log a line per failed TLS handshake. Real broker processes and ZooKeeper; certificates from
tests/certs.py."""
import os
import shutil
import socket
import stat
import subprocess
import sys
import time

import pytest

from metaq_broker.client import Consumer, Producer
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.errors import AuthenticationError
from metaq_broker.security.scram import MAX_ITERATIONS, Credential, ScramClient
from metaq_broker.zk.session import new_client
from metaq_broker.zk.users import put_user

pytestmark = pytest.mark.unit


# -- the SCRAM client against a rogue broker --------------------------------------------------------------
def _server_first(nonce: str, iterations) -> str:
    return f"r={nonce},s=W22ZaJ0SNY7soEsUEjb6gQ==,i={iterations}"


def test_scram_client_refuses_a_server_nonce_that_does_not_extend_its_own():
    for nonce in ("rOprNGfwEbeRWgbNEkqO", "rOprNGfwEbeRWgbNEkq", "other%hvYDpWUa2RaTCAfuxFIlj", ""):
        client = ScramClient("user", "pencil", nonce="rOprNGfwEbeRWgbNEkqO")
        with pytest.raises(AuthenticationError, match="nonce does not extend ours"):
            client.final(_server_first(nonce, 4096))
    assert ScramClient("user", "pencil", nonce="abc").final(_server_first("abcX", 4096)).startswith("c=biws,r=abcX,")


@pytest.mark.parametrize("count", [MAX_ITERATIONS + 1, 4095, "4096x", "-4096", "", "٤٠٩٦"])
def test_scram_client_refuses_iteration_counts_outside_the_bound_before_any_work(count):
    """A broker naming 2**31 iterations would keep the client in PBKDF2 for hours before it could check
    the broker's signature: refused at once, naming the bound."""
    with pytest.raises(AuthenticationError, match=f"iteration count .* is not from 4096 to {MAX_ITERATIONS}"):
        ScramClient("user", "pencil", nonce="abc").final(_server_first("abcX", count))


@pytest.mark.process
def test_credentials_and_the_cli_keep_within_the_bound_clients_accept(tmp_path):
    Credential.make("pw", MAX_ITERATIONS)
    with pytest.raises(ValueError, match=f"from 4096 to {MAX_ITERATIONS}"):
        Credential.make("pw", MAX_ITERATIONS + 1)
    r = subprocess.run([sys.executable, "-m", "metaq_broker.tools.cli", "--zk", "127.0.0.1:1", "users", "add", "bob",
                        "--password", "x", "--iterations", str(MAX_ITERATIONS + 1)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and f"{MAX_ITERATIONS + 1} is not in the range 4096<=x<={MAX_ITERATIONS}" in r.stderr


# -- the broker's files, warnings and logs -----------------------------------------------------------------
def _modes(root):
    """{relative path: mode} of everything below ``root``."""
    out = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(top, name)
            out[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


def test_files_are_private_whatever_the_umask_and_what_cannot_be_fixed_is_warned_about(tmp_path, zookeeper, pki):
    """An operator's umask 000, a data directory of an older version (0755 directories, 0644 files), a
    dataPath open to others, a private key others may read, SASL without zk.auth: every file and directory
    below dataPath ends 0600/0700, and the rest is named in warnings at start."""
    key = tmp_path / "broker-key.pem"
    shutil.copy(pki.broker.key, key)
    os.chmod(key, 0o644)
    data = tmp_path / "b" / "data"
    old = data / "notes"  # an operator's or an older version's: ignored by the store, narrowed all the same
    old.mkdir(parents=True)
    (old / "readme.txt").write_text("left by someone\n")
    os.chmod(old, 0o755)
    os.chmod(old / "readme.txt", 0o644)
    os.chmod(data, 0o755)
    root = f"/hardening-{time.time_ns()}"
    zk = new_client(zookeeper.connect_string)
    zk.start()
    put_user(zk, root, "admin", Credential.make("admin-pw"))
    broker = BrokerProcess(tmp_path / "b", 1, zookeeper.connect_string, settings={
        "zk.root": root, "zk.sessionTimeout": 4000, "security.protocol": "SASL_SSL",
        "ssl.certificate.location": pki.broker.cert, "ssl.key.location": str(key)}, topics={"t": {"numPartitions": 1}})
    previous = os.umask(0)
    try:
        broker.start(ready_by_log=True)
    finally:
        os.umask(previous)
    try:
        sec = {"security.protocol": "SASL_SSL", "ssl.ca.location": pki.ca, "sasl.username": "admin",
               "sasl.password": "admin-pw"}
        with Producer(brokers=f"1={broker.address}", security=sec) as p:
            p.send_batch("t", [b"kept private"], partition="1-0")  # a segment, its index, runtime state
        with Consumer(brokers=f"1={broker.address}", security=sec) as c:
            assert c.fetch("t", "1-0", 0).batch.column("value").to_pylist() == [b"kept private"]
        modes = _modes(data)
        assert {"session.key", "notes", "notes/readme.txt", "t-0"} <= set(modes), modes
        assert any(p.startswith("t-0/") and p.endswith(".meta") for p in modes), modes
        wide = {p: f"{m:04o}" for p, m in modes.items()
                if m & 0o077 or m != (0o700 if os.path.isdir(data / p) else 0o600)}
        assert not wide, wide
        log = broker.log_path.read_text()
        assert "narrowed 2 files and directories below" in log
        assert f"dataPath {data} is open to group or others (mode 0755)" in log
        assert f"ssl.key.location {key} may be read by group or others (mode 0644)" in log
        assert "security.protocol SASL_SSL keeps users and ACLs in ZooKeeper, but zk.auth is not set" in log
        assert stat.S_IMODE(os.stat(data).st_mode) == 0o755  # told, not changed: it may be shared
    finally:
        broker.kill()
        zk.stop()
        zk.close()


@pytest.mark.process
def test_a_flood_of_failed_tls_handshakes_leaves_no_line_per_handshake_in_the_log(tmp_path, pki):
    broker = BrokerProcess(tmp_path / "b", 1, "none", settings={
        "security.protocol": "SSL", "ssl.certificate.location": pki.broker.cert,
        "ssl.key.location": pki.broker.key}).start(ready_by_log=True)
    try:
        host, port = broker.address.rsplit(":", 1)
        for _ in range(30):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(b"\x16\x03\x01\x02\x00garbage" * 50)
                try:
                    s.recv(100)
                except OSError:
                    pass
        broker.proc.send_signal(15)  # a clean stop flushes what the broker had to say
        broker.proc.wait(30)
        log = broker.log_path.read_text()
        assert "listening on" in log and "stopped" in log
        assert "Handshake failed" not in log and "ssl_transport_security" not in log, log[-2000:]
    finally:
        broker.kill()
