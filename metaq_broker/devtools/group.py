"""A replicated broker group as real ``metaq-broker`` processes on loopback: one ``brokerId``, a
``replicaId``, port and data directory per member (tests, benchmarks, the compose example's twin)."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Optional

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException

from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.zk import groups as zk_groups
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import new_client, start_client


class BrokerGroup:
    """``members`` processes of group ``broker_id``; ``settings`` and ``topics`` are every member's."""

    def __init__(self, workdir, broker_id: int, zk_connect: str, zk_root: str = "/meta", members: int = 3,
                 settings: Optional[dict] = None, topics: Optional[dict] = None):
        self.workdir = Path(workdir)
        self.broker_id, self.zk_connect, self.paths = broker_id, zk_connect, ZkPaths(zk_root)
        base = {"zk.root": zk_root, "zk.sessionTimeout": 4000, "replicaLagMaxMs": 3000, **(settings or {})}
        self.members = [BrokerProcess(self.workdir / f"member-{r}", broker_id, zk_connect,
                                      settings={**base, "replicaId": r}, topics=topics)
                        for r in range(members)]
        self._zk: Optional[KazooClient] = None

    @property
    def zk(self) -> KazooClient:
        if self._zk is None:
            self._zk = new_client(self.zk_connect)  # one that survives ZooKeeper losing its data (tests do that)
            start_client(self._zk, self.zk_connect, 15)
        return self._zk

    def start(self) -> "BrokerGroup":
        for m in self.members:
            m.start()
        return self

    def state(self) -> Optional[dict]:
        try:
            return json.loads(self.zk.get(self.paths.group_state(self.broker_id))[0])
        except Exception:  # noqa: BLE001 - no state yet
            return None

    def master_id(self) -> Optional[int]:
        """The replicaId holding the master node, or None (also while ZooKeeper does not answer)."""
        try:
            node = zk_groups.master_node(self.zk, self.paths, self.broker_id)
        except KazooException:
            return None
        return None if node is None else int(node["replicaId"])

    def wait_master(self, timeout: float = 30.0, other_than: Optional[int] = None) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.master_id()
            if m is not None and m != other_than and self.members[m].proc is not None \
                    and self.members[m].proc.poll() is None:
                return m
            time.sleep(0.05)
        raise TimeoutError(f"group {self.broker_id}: no master{'' if other_than is None else f' but {other_than}'} "
                           f"within {timeout}s; state {self.state()}")

    def wait_in_sync(self, replicas, timeout: float = 30.0) -> dict:
        """Wait until the state's in-sync set holds every replicaId in ``replicas``."""
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = self.state()
            if state and set(replicas) <= {r for r, _ in state["isr"]}:
                return state
            time.sleep(0.05)
        raise TimeoutError(f"group {self.broker_id}: in-sync set {state and state['isr']} lacks some of {replicas}")

    def stop(self) -> None:
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                os.kill(m.proc.pid, signal.SIGCONT)  # a member a test froze (SIGSTOP) could not stop
            try:
                m.stop()
            except Exception:  # noqa: BLE001 - kill what does not stop
                m.kill()
        if self._zk is not None:
            self._zk.stop()
            self._zk.close()
            self._zk = None
