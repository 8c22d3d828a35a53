"""Run a broker as a real child process on loopback, for the quickstart, tests and benchmarks."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .zookeeper import free_port


class BrokerProcess:
    """``metaq-broker`` in a subprocess, configured by ``<workdir>/broker.ini``; its log is
    ``<workdir>/broker.log``. ``settings`` are [system] keys; ``topics`` maps names to their keys."""

    def __init__(self, workdir, broker_id: int = 0, zk_connect: str = "none", port: Optional[int] = None,
                 settings: Optional[dict] = None, topics: Optional[dict] = None):
        self.workdir = Path(workdir)
        self.broker_id = broker_id
        self.port = port or free_port()
        self.settings = {"brokerId": broker_id, "hostName": "127.0.0.1", "serverPort": self.port,
                         "dataPath": str(self.workdir / "data"), "zk.connect": zk_connect, **(settings or {})}
        self.topics = topics or {}
        self.proc: Optional[subprocess.Popen] = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "broker.log"

    def write_config(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        lines = ["[system]"] + [f"{k}={v}" for k, v in self.settings.items()]
        for name, keys in self.topics.items():
            lines += ["", f"[topic={name}]"] + [f"{k}={v}" for k, v in keys.items()]
        path = self.workdir / "broker.ini"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self, timeout: float = 30.0, args=(), wrapper=()) -> "BrokerProcess":
        """Start and wait until serving; ``args`` are extra ``metaq-broker`` flags, ``wrapper`` a command
        the broker runs under (e.g. ``strace -f -o FILE``)."""
        config = self.write_config()
        log = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([*wrapper, sys.executable, "-m", "metaq_broker.broker_main", "--config", str(config),
                                      *args], stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"broker {self.broker_id} exited with code {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(service="metaq.v1.Broker"),
                                  timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"broker {self.broker_id} did not become ready in {timeout}s:\n{self.log_tail()}")
                time.sleep(0.1)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM: the broker stops accepting, finishes in-flight calls, fsyncs and deregisters."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"broker {self.broker_id} did not stop within {timeout}s")

    def kill(self) -> None:
        """SIGKILL: a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
