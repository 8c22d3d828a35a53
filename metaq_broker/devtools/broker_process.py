"""Run a broker as a real child process on loopback, for the quickstart, tests and benchmarks."""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from metaq_broker.devtools.process import ChildProcess
from metaq_broker.devtools.zookeeper import free_port
from metaq_broker.security.settings import read_pem


class BrokerProcess:
    """``metaq-broker`` in a subprocess, configured by ``<workdir>/broker.ini``; its log is
    ``<workdir>/broker.log``. ``settings`` are [system] keys; ``topics`` maps names to their keys."""

    def __init__(self, workdir, broker_id: int = 0, zk_connect: str = "none", port: Optional[int] = None,
                 settings: Optional[dict] = None, topics: Optional[dict] = None, health_certificate=None,
                 forkable: bool = True):
        self.workdir = Path(workdir)
        self.broker_id = broker_id
        self.port = port or free_port()
        self._port_chosen = port is None  # free_port's: another may be given a new one if it is taken by then
        # kafkaPort 0 unless given: brokers on one machine never clash on Kafka's 9092 (``kafka_port`` reads it)
        self.settings = {"brokerId": broker_id, "hostName": "127.0.0.1", "serverPort": self.port, "kafkaPort": 0,
                         "dataPath": str(self.workdir / "data"), "zk.connect": zk_connect, **(settings or {})}
        self.topics = topics or {}
        self.health_certificate = health_certificate  # (cert, key) PEM paths when ssl.client.auth=required
        # may be forked from a warm interpreter where the test suite enables it (zygote.py), unless it runs
        # under a wrapper or with --log-level (gRPC reads its verbosity as it is imported); False: started as
        # an operator starts it, for a test of what a broker loads as it starts
        self.forkable = forkable
        self.netns: Optional[str] = None  # the network namespace it runs in (devtools/netns.py)
        self._child: Optional[ChildProcess] = None
        self._log_start = 0  # where the current run's lines begin in the log

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def kafka_port(self) -> Optional[int]:
        """The Kafka listener's port of the current run (None before it listens, or with kafkaPort=-1)."""
        return self._logged_port("Kafka")

    @property
    def metaq_port(self) -> Optional[int]:
        """The MetaQ listener's port of the current run (``metaqPort`` 0: any free port)."""
        return self._logged_port("MetaQ")

    @property
    def metrics_port(self) -> Optional[int]:
        """The Prometheus port of the current run (``metricsPort`` 0: any free port; a port a test chose
        beforehand could be taken by another test's process before the broker binds it)."""
        return self._logged_port("metrics")

    def _logged_port(self, what: str) -> Optional[int]:
        """A listener's port from the current run's log line "listening on ..., <what> port N"."""
        found = re.findall(rf"listening on \S+.*?, {what} port (\d+)", self._run_log())
        return int(found[-1]) if found else None

    def _listening(self) -> bool:
        """The current run has logged that it listens (a restart's log still holds the run before)."""
        return "listening on" in self._run_log()

    def _run_log(self) -> str:
        """The current run's log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    @property
    def bootstrap(self) -> str:
        """``bootstrap.servers`` for a Kafka client."""
        port = self.kafka_port  # logged before ``start`` returns
        if port is None:
            raise RuntimeError(f"broker {self.broker_id} has no Kafka listener (kafkaPort=-1, or not started)")
        return f"127.0.0.1:{port}"

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

    @property
    def proc(self):
        """The running ``subprocess.Popen`` (None before the first start)."""
        return self._child.proc if self._child else None

    def start(self, timeout: float = 30.0, args=(), wrapper=(), ready_by_log: bool = False) -> "BrokerProcess":
        """Start and wait until its gRPC health check says SERVING (``ready_by_log``: until its log says it
        listens, for a broker whose certificate no client trusts); ``args`` are extra ``metaq-broker``
        flags, ``wrapper`` a command the broker runs under (e.g. ``strace -f -o FILE``). A port this object
        chose (``free_port``) that another process took between the choice and the start (tests run in
        parallel) is chosen again, at most twice."""
        for attempt in range(3):
            try:
                return self._start(timeout, args, wrapper, ready_by_log)
            except RuntimeError as e:
                taken = f"serverPort: cannot listen on 127.0.0.1:{self.port}" in str(e)
                if not (taken and self._port_chosen and attempt < 2):
                    raise
                self.port = free_port()
                self.settings["serverPort"] = self.port
        raise AssertionError("unreachable")

    def _start(self, timeout, args, wrapper, ready_by_log) -> "BrokerProcess":
        config = self.write_config()
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        argv = [*wrapper, sys.executable, "-m", "metaq_broker.server.main", "--config", str(config), *args]
        self._child = ChildProcess(f"broker {self.broker_id}", argv, self.log_path,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                   forkable=self.forkable and not wrapper and "--log-level" not in args,
                                   netns=self.netns)
        if ready_by_log:
            self._child.start(self._listening, timeout, interval=0.1)
            return self
        with self._health_channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            self._child.start(lambda: stub.Check(health_pb2.HealthCheckRequest(service="metaq.v1.Broker"), timeout=1)
                              .status == health_pb2.HealthCheckResponse.SERVING, timeout, interval=0.1)
        deadline = time.monotonic() + 10  # the "listening on" line, with the ports chosen, follows SERVING
        while not self._listening() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def _health_channel(self) -> grpc.Channel:
        """A channel for the readiness check: TLS trusting ``ssl.ca.location`` when the broker uses TLS."""
        options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                   ("grpc.max_reconnect_backoff_ms", 100)]  # polled while the broker starts: not gRPC's 1 s
        if str(self.settings.get("security.protocol", "PLAINTEXT")).upper() == "PLAINTEXT":
            return grpc.insecure_channel(self.address, options)
        ca = self.settings.get("ssl.ca.location")
        key, chain = ((read_pem("key", self.health_certificate[1]), read_pem("cert", self.health_certificate[0]))
                      if self.health_certificate else (None, None))
        return grpc.secure_channel(self.address, grpc.ssl_channel_credentials(
            read_pem("ssl.ca.location", ca) if ca else None, key, chain), options)

    def log_tail(self, lines: int = 30) -> str:
        return self._child.log_tail(lines) if self._child else "(no log)"

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM: the broker stops accepting, finishes in-flight calls, fsyncs and deregisters."""
        if self._child is None:
            return 0
        code = self._child.stop(timeout)
        if code is None:
            raise RuntimeError(f"broker {self.broker_id} did not stop within {timeout}s")
        return code

    def kill(self) -> None:
        """SIGKILL: a crash."""
        if self._child is not None:
            self._child.kill()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
