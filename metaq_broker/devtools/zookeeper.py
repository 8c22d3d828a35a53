"""A local, standalone ZooKeeper for development, tests and the quickstart.

It runs ``org.apache.zookeeper.server.ZooKeeperServerMain PORT DIR`` from the ZooKeeper jars that the
pyspark wheel already ships, so a machine with Python and Java needs nothing else installed. The
AdminServer is disabled (it would grab port 8080) and four-letter-word commands stay at ZooKeeper's
default (off), so readiness is probed with a real client session rather than ``ruok``.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from kazoo.client import KazooClient

from metaq_broker.devtools import jvm
from metaq_broker.devtools.process import ChildProcess

log = logging.getLogger(__name__)

# The flags of a development JVM (this ZooKeeper; the tests' Spark sessions use them too): C1 alone and the
# serial collector, since its load needs neither C2 nor parallel GC threads, and a test suite's many JVMs
# share two cores. Behaviour is the same.
LIGHT_JVM = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")
ZOOKEEPER_JVM = ("-Xmx256m", *LIGHT_JVM)



def pyspark_jars() -> Path:
    """The jars directory of the installed pyspark wheel (holds zookeeper-*.jar and its dependencies)."""
    try:
        # lazy: a third of a second to import, and every `metaq` command imports this module (cli.py) while
        # only the ones that start a ZooKeeper need the wheel's jars
        import pyspark
    except ImportError:
        raise RuntimeError("pyspark is not installed; its wheel provides the ZooKeeper jars") from None
    jars = Path(pyspark.__file__).parent / "jars"
    if not any(jars.glob("zookeeper-*.jar")):
        raise RuntimeError(f"no zookeeper-*.jar in {jars}; is the pyspark installation complete?")
    return jars


def java_executable() -> Optional[str]:
    """``$JAVA_HOME/bin/java`` if it exists, else ``java`` on PATH, else None."""
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "java"), os.X_OK):
        return os.path.join(home, "bin", "java")
    return shutil.which("java")


def java_available() -> bool:
    return java_executable() is not None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZooKeeper binds; ignores TIME_WAIT
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


class LocalZooKeeper:
    """One ZooKeeper server process. ``restart()`` keeps port and data, as tests of reconnection need.

    ``tick_time_ms`` (ZooKeeper's default is 3000) bounds session timeouts to 2–20 ticks; tests that
    want sessions to expire quickly pass a smaller one.

    ``tls_cert``/``tls_key`` (PEM) add a TLS ``secureClientPort`` (``secure_connect_string``) beside the
    plain port, with client certificates signed by ``tls_ca`` checked as ``tls_client_auth`` says
    (ZooKeeper's ssl.clientAuth: need, want, none).
    """

    def __init__(self, data_dir=None, port: Optional[int] = None, host: str = "127.0.0.1",
                 tick_time_ms: Optional[int] = None, tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                 tls_ca: Optional[str] = None, tls_client_auth: str = "need", jvm_options=()):
        self._temporary = data_dir is None
        self.data_dir = Path(tempfile.mkdtemp(prefix="metaq-zk-") if data_dir is None else data_dir)
        self.host = host
        self._pick_port = not port  # ours to choose: choose again if taken before the first start
        self.port = port if port else free_port(host)
        self.tick_time_ms = tick_time_ms
        self.tls = (tls_cert, tls_key, tls_ca, tls_client_auth) if tls_cert else None
        self.secure_port = free_port(host) if tls_cert else None
        self.jvm_options = list(jvm_options)  # added to the JVM's flags (``make_archive``'s)
        self._child: Optional[ChildProcess] = None

    @property
    def connect_string(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def secure_connect_string(self) -> Optional[str]:
        return f"{self.host}:{self.secure_port}" if self.secure_port else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "zookeeper.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 30.0) -> "LocalZooKeeper":
        """Launch the server and return once a client session can be opened; RuntimeError (with the
        tail of the server log) if Java is missing, the port is taken, or it does not come up."""
        if self.running:
            return self
        java = java_executable()
        if java is None:
            raise RuntimeError("java is not installed (or not on PATH / JAVA_HOME); ZooKeeper needs Java 17")
        if self._pick_port and not _port_free(self.host, self.port):
            self.port = free_port(self.host)
        if not _port_free(self.host, self.port):
            raise RuntimeError(f"cannot start ZooKeeper: port {self.port} on {self.host} is already in use")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [str(self.port), str(self.data_dir / "data")]
        if self.tick_time_ms:
            args.append(str(int(self.tick_time_ms)))
        netty = []
        if self.tls:  # a secure port needs a configuration file and the Netty connection factory
            args = [self._write_tls_config()]
            netty = ["-Dzookeeper.serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory"]
        jars = pyspark_jars()
        cmd = [java, "-Dzookeeper.admin.enableServer=false", *netty, *ZOOKEEPER_JVM, *self.jvm_options,
               *jvm.sharing_options(archive(java, jars)), "-cp", f"{jars}/*",
               "org.apache.zookeeper.server.ZooKeeperServerMain", *args]
        # Its own session: Ctrl-C in a terminal is ours to handle (we stop it in order).
        self._child = ChildProcess("ZooKeeper", cmd, self.log_path, own_session=True)
        self._child.start(self._serving, timeout, interval=0.1)
        self._pick_port = False  # restarts keep the port clients know
        log.info("ZooKeeper up at %s (data in %s)", self.connect_string, self.data_dir)
        return self

    def _write_tls_config(self) -> str:
        cert, key, ca, client_auth = self.tls
        keystore = self.data_dir / "keystore.pem"  # ZooKeeper's PEM key store: certificate and key in one file
        keystore.touch(mode=0o600)  # holds a private key: never readable by others, not even for a moment
        keystore.write_text(Path(cert).read_text() + Path(key).read_text())
        lines = [f"dataDir={self.data_dir / 'data'}", f"clientPort={self.port}", f"clientPortAddress={self.host}",
                 f"secureClientPort={self.secure_port}", f"secureClientPortAddress={self.host}",
                 f"tickTime={int(self.tick_time_ms or 3000)}",
                 f"ssl.keyStore.location={keystore}", "ssl.keyStore.type=PEM", f"ssl.clientAuth={client_auth}"]
        if ca:
            lines += [f"ssl.trustStore.location={ca}", "ssl.trustStore.type=PEM"]
        path = self.data_dir / "zoo.cfg"
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    def _serving(self) -> bool:
        """A real client session can be opened and used (four-letter words are off)."""
        socket.create_connection((self.host, self.port), timeout=1).close()
        quiet = logging.getLogger(__name__ + ".probe")
        quiet.setLevel(logging.CRITICAL)  # connection refusals while the JVM boots are expected
        probe = KazooClient(hosts=self.connect_string, logger=quiet)
        try:
            probe.start(timeout=5.0)
            probe.get_children("/")
            return True
        finally:
            probe.stop()
            probe.close()

    @property
    def proc(self):
        return self._child.proc if self._child else None

    def log_tail(self, lines: int = 30) -> str:
        return self._child.log_tail(lines) if self._child else "(no log)"

    def _stop_process(self, timeout: float = 15.0) -> None:
        if self._child is not None:
            self._child.stop(timeout)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (SIGKILL after ``timeout``). A temporary data dir is removed; a given one is kept."""
        self._stop_process(timeout)
        if self._temporary:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def restart(self, down_for: float = 0.0, timeout: float = 30.0) -> "LocalZooKeeper":
        """Stop and start again on the same port with the same data. Sessions survive if clients
        reconnect within their timeout; ``down_for`` keeps the server down that many seconds first."""
        self._stop_process()
        time.sleep(down_for)
        return self.start(timeout)

    def __enter__(self) -> "LocalZooKeeper":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalZooKeeper({self.connect_string}, data_dir={str(self.data_dir)!r}, running={self.running})"


def archive(java: Optional[str] = None, jars: Optional[Path] = None) -> Path:
    """This machine's class-data archive for ZooKeeper's JVM (``devtools/jvm.py``), made yet or not; ``java``
    and ``jars`` when the caller has them already (``start``)."""
    return jvm.archive_path("zookeeper", java or java_executable() or "java", jars or pyspark_jars(), ZOOKEEPER_JVM)


def make_archive() -> bool:
    """Make ZooKeeper's class-data archive unless there is one: a server started, a client session that
    writes, a clean stop (the JVM writes the archive as it exits). True when it exists afterwards."""
    def run(flags):
        with LocalZooKeeper(jvm_options=flags) as zk:
            client = KazooClient(zk.connect_string)
            client.start(timeout=30)
            try:
                client.ensure_path("/metaq/archive")
                client.create("/metaq/archive/session", ephemeral=True)
            finally:
                client.stop()
                client.close()
    return jvm.make(archive(), run)


def run_foreground(port: int = 2181, data_dir=None) -> int:
    """``metaq zookeeper``: start, print the connect string, run until Ctrl-C or SIGTERM, then stop.
    Returns 0, or 1 if the server died on its own."""
    zk = LocalZooKeeper(data_dir=data_dir, port=port).start()
    print(f"ZooKeeper listening on {zk.connect_string} (data in {zk.data_dir}"
          f"{', removed on exit' if data_dir is None else ''}); Ctrl-C stops it", flush=True)
    stop = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.is_set() and zk.running:
            stop.wait(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        died = not stop.is_set() and zk.proc is not None and zk.proc.poll() is not None
        tail = zk.log_tail() if died else ""
        zk.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if died:
        print(f"ZooKeeper exited on its own:\n{tail}", flush=True)
        return 1
    print("ZooKeeper stopped", flush=True)
    return 0


def main(argv=None) -> int:
    """``python -m metaq_broker.devtools.zookeeper [--port N] [--data DIR]``."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--port", type=int, default=2181)
    ap.add_argument("--data", dest="data_dir", default=None)
    args = ap.parse_args(argv)
    try:
        return run_foreground(args.port, args.data_dir)
    except RuntimeError as e:
        print(e, flush=True)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
