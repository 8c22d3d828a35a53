"""The exactly-once sink's decision records (zk/decisions.py) as a writer keeps them: in ZooKeeper itself
(an open ZooKeeper, or the clients' identity), or through a broker's ``metaq.v1.Sinks`` service
(server/sinks.py), which checks the sink's ACL and writes with its own identity, so that the writer holds
no ZooKeeper identity at all. ``ClientBase.group_offsets_via_broker`` chooses, as for group offsets."""
from __future__ import annotations

from typing import Optional

from metaq_broker.client.base import ClientBase
from metaq_broker.protocol.services import DECIDE, FORGET_DECISIONS, READ_DECISION, SWEEP_BATCH_WRITES, sinks_path
from metaq_broker.zk import decisions
from metaq_broker.zk.decisions import Decision
from metaq_broker.zk.paths import ZkPaths


class SinkDecisions:
    """The records of the sinks of ``client``'s cluster, by sink id and batch id."""

    def __init__(self, client: ClientBase):
        self.client = client
        self.paths = ZkPaths(client.cluster.root)

    @property
    def via_broker(self) -> bool:
        return self.client.group_offsets_via_broker

    def path(self, sink: str, batch: int) -> str:
        return self.paths.sink_batch(sink, batch)

    def _call(self, method: str, request: dict) -> dict:
        return self.client.broker_json_call(sinks_path(method), request)

    def _decide(self, sink: str, batch: int, run: str, xids: Optional[list], owner: Optional[dict]) -> Decision:
        if not self.via_broker:
            return decisions.decide(self.client.cluster.zk, self.path(sink, batch), run, xids, owner)
        request = {"sink": sink, "batch": batch, "run": run}
        if xids is not None:
            request.update(xids=xids, owner=owner or {})
        return Decision.from_json(self._call(DECIDE, request)["decision"])

    def decide_commit(self, sink: str, batch: int, run: str, xids: list, owner: Optional[dict] = None) -> Decision:
        """``decisions.decide_commit``: the decision in force; TransactionsAbortedError if a broker aborted
        the run first."""
        return decisions.committed(self._decide(sink, batch, run, xids, owner), self.path(sink, batch), run)

    def decide_abort(self, sink: str, batch: int, run: str) -> Decision:
        return self._decide(sink, batch, run, None, None)

    def read(self, sink: str, batch: int) -> Optional[Decision]:
        if not self.via_broker:
            return decisions.read(self.client.cluster.zk, self.path(sink, batch))[0]
        found = self._call(READ_DECISION, {"sink": sink, "batch": batch})["decision"]
        return None if found is None else Decision.from_json(found)

    def forget_below(self, sink: str, batch: int) -> int:
        """Delete the sink's records of batches below ``batch``."""
        if not self.via_broker:
            return decisions.forget_below(self.client.cluster.zk, self.paths, sink, batch)
        return self._call(FORGET_DECISIONS, {"sink": sink, "below": batch})["forgotten"]

    def forget_sink(self, sink: str) -> None:
        """Delete the sink's node with every record (a batch write's, once settled)."""
        if not self.via_broker:
            decisions.forget_sink(self.client.cluster.zk, self.paths, sink)
        else:
            self._call(FORGET_DECISIONS, {"sink": sink})

    def sweep_batch_writes(self, horizon_s: float) -> list:
        """Delete leftovers of batch writes older than ``horizon_s`` whose driver died after the decision
        (through a broker: of the sinks this client may Write); returns their sink ids."""
        if self.via_broker:
            return self._call(SWEEP_BATCH_WRITES, {"older_than_s": horizon_s})["forgotten"]
        return decisions.sweep_batch_writes(self.client.cluster.zk, self.paths, horizon_s)
