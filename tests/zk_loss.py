"""ZooKeeper losing its data, for tests: the wipe, and what a test needs to line up zxids across it."""
from __future__ import annotations

import shutil
import threading

from kazoo.protocol.states import KazooState


def wipe(zk) -> None:
    """ZooKeeper loses everything: stopped, its data (snapshots and transaction logs) deleted, started again."""
    zk.stop()
    shutil.rmtree(zk.data_dir / "data")
    zk.start()


def pad_to(writer, zxid: int) -> None:
    """Create nodes until the next write gets ``zxid``: after a wipe zxids count from the start again, so a
    node can be written at the ``mzxid`` its predecessor had (AssertionError if that is already past)."""
    i = 0
    while (last := writer.exists(writer.create(f"/pad-{i}", b"")).czxid) < zxid - 1:
        i += 1
    assert last == zxid - 1, f"zxid {zxid} is already past ({last})"


class NewSession:
    """``connected`` is set once ``client`` lost its session and is connected with a new one (a wiped
    ZooKeeper refuses the old session for a session timeout, then ``zk/session.py`` starts a new one)."""

    def __init__(self, client):
        self.lost, self.connected = threading.Event(), threading.Event()
        client.add_listener(self._on)

    def _on(self, state) -> None:
        if state == KazooState.LOST:
            self.lost.set()
            self.connected.clear()
        elif state == KazooState.CONNECTED and self.lost.is_set():
            self.connected.set()
