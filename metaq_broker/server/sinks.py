"""The exactly-once sinks' decision records through the broker (``metaq.v1.Sinks``, messages as JSON), so
that a writer needs no ZooKeeper identity: the broker checks the sink's ACL as for its transactions
(``Write`` on ``sink <sinkId>``; reading a record: ``Describe``) and writes ZooKeeper with its own. The
record's path is the broker's to make from the sink id and batch (``ZkPaths.sink_batch``), so a caller
cannot name another node. Methods (zk/decisions.py has the rules):

* ``Decide`` ``{"sink", "batch", "run", "xids"?, "owner"?}`` -> ``{"decision": {...}}``: commit ``xids`` for
  ``run`` (with ``xids``) or abort the run (without), returning the decision in force;
* ``Read`` ``{"sink", "batch"}`` -> ``{"decision": {...} | null}``;
* ``Forget`` ``{"sink", "below"?}`` -> ``{"forgotten": n}``: the records of batches below ``below``, or the
  sink's whole node (a batch write's, once settled);
* ``SweepBatchWrites`` ``{"older_than_s"}`` -> ``{"forgotten": [sinks]}``: leftovers of batch writes whose
  driver died after the decision, among the sinks the caller may ``Write``."""
from __future__ import annotations

import functools
from typing import Callable

import grpc

from metaq_broker.protocol.services import (DECIDE, FORGET_DECISIONS, READ_DECISION, SINKS_SERVICE,
                                            SWEEP_BATCH_WRITES)
from metaq_broker.server.json_rpc import connected, json_method
from metaq_broker.zk import decisions
from metaq_broker.zk.paths import ZkPaths

MAX_XIDS = 100_000  # transactions one decision may list (a record must fit ZooKeeper's 1 MB anyway)


class SinkDecisionsService:
    """``auth`` is the broker's ``BrokerAuth``; ``zk()`` its connected ZooKeeper client (None while away)."""

    def __init__(self, auth, zk: Callable, root: str):
        self.auth, self._zk, self.paths = auth, zk, ZkPaths(root)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SINKS_SERVICE, {
            name: json_method(self.auth, method, "sink decisions") for name, method in (
                (DECIDE, self.decide), (READ_DECISION, self.read), (FORGET_DECISIONS, self.forget),
                (SWEEP_BATCH_WRITES, self.sweep))})

    def _zk_for(self, principal: str, operation: str, sink) -> object:
        if not isinstance(sink, str):
            raise TypeError("sink must be a string")
        self.paths.sink_batches(sink)  # ValueError for a name that is no path component
        self.auth.authorize(principal, operation, "sink", sink)
        return connected(self._zk)

    def _record(self, m: dict) -> str:
        batch = m["batch"]
        if isinstance(batch, bool) or not isinstance(batch, int):
            raise TypeError("batch must be an integer")
        return self.paths.sink_batch(m["sink"], batch)

    def decide(self, principal: str, m: dict) -> dict:
        zk = self._zk_for(principal, "Write", m["sink"])
        run, xids, owner = m["run"], m.get("xids"), m.get("owner") or {}
        if not isinstance(run, str) or not run:
            raise ValueError("run must be a non-empty string")
        if xids is not None:
            if not isinstance(xids, list) or len(xids) > MAX_XIDS or not all(
                    isinstance(x, list) and len(x) == 2 and isinstance(x[0], int) and not isinstance(x[0], bool)
                    and isinstance(x[1], str) for x in xids):
                raise ValueError(f"xids must be at most {MAX_XIDS} pairs [brokerId, xid]")
            if not isinstance(owner, dict) or not all(isinstance(v, str) for v in owner.values()):
                raise ValueError("owner must be a JSON object of strings")
        return {"decision": decisions.decide(zk, self._record(m), run, xids, owner).to_json()}

    def read(self, principal: str, m: dict) -> dict:
        zk = self._zk_for(principal, "Describe", m["sink"])
        decision = decisions.read(zk, self._record(m))[0]
        return {"decision": None if decision is None else decision.to_json()}

    def forget(self, principal: str, m: dict) -> dict:
        zk = self._zk_for(principal, "Write", m["sink"])
        if "below" in m:
            below = m["below"]
            if isinstance(below, bool) or not isinstance(below, int):
                raise TypeError("below must be an integer")
            return {"forgotten": decisions.forget_below(zk, self.paths, m["sink"], below)}
        decisions.forget_sink(zk, self.paths, m["sink"])
        return {"forgotten": 1}

    def sweep(self, principal: str, m: dict) -> dict:
        horizon = m["older_than_s"]
        if isinstance(horizon, bool) or not isinstance(horizon, (int, float)) or horizon < 3600:
            raise ValueError("older_than_s must be a number of seconds, at least 3600")
        may_write = functools.partial(self.auth.allows, principal, "Write", "sink")
        return {"forgotten": decisions.sweep_batch_writes(connected(self._zk), self.paths, horizon, may=may_write)}
