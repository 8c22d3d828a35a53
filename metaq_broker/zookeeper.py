"""A local ZooKeeper for development, tests and the quickstart, run from the ZooKeeper jars that the
pyspark wheel ships (so nothing else needs installing), on a loopback port."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional


def pyspark_jars() -> Path:
    import pyspark
    return Path(pyspark.__file__).parent / "jars"


def java_available() -> bool:
    return shutil.which("java") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalZooKeeper:
    def __init__(self, data_dir=None, port: Optional[int] = None, host: str = "127.0.0.1"):
        self._temporary = data_dir is None
        self.data_dir = Path(tempfile.mkdtemp(prefix="metaq-zk-") if data_dir is None else data_dir)
        self.port = port or _free_port()
        self.host = host
        self.proc: Optional[subprocess.Popen] = None

    @property
    def connect_string(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "zookeeper.log"

    def start(self, timeout: float = 60.0) -> "LocalZooKeeper":
        if not java_available():
            raise RuntimeError("java is not on PATH; ZooKeeper needs Java 17")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            ["java", "-Dzookeeper.admin.enableServer=false", "-Dzookeeper.4lw.commands.whitelist=ruok,srvr",
             "-Xmx256m", "-cp", f"{pyspark_jars()}/*", "org.apache.zookeeper.server.ZooKeeperServerMain",
             str(self.port), str(self.data_dir / "data")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"ZooKeeper exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ZooKeeper did not answer on {self.connect_string} in {timeout}s:\n{self.log_tail()}")
            time.sleep(0.1)
        return self

    def _answers(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1) as s:
                s.sendall(b"ruok")
                return s.recv(4) == b"imok"
        except OSError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, remove: bool = True) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if remove and self._temporary:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def restart(self, down_for: float = 0.0) -> None:
        """Stop and start again on the same port with the same data (sessions may expire meanwhile)."""
        self.stop(remove=False)
        time.sleep(down_for)
        self.start()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def run_foreground(port: int, data_dir=None) -> None:
    """``metaq zookeeper``: run until Ctrl-C or SIGTERM."""
    zk = LocalZooKeeper(data_dir=data_dir, port=port).start()
    print(f"ZooKeeper listening on {zk.connect_string} (data in {zk.data_dir}); Ctrl-C stops it", flush=True)
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        while zk.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        zk.stop()
