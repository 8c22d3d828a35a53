"""The broker's transaction housekeeping: roll back open transactions past their timeout, and settle
in-doubt prepared transactions that name a ZooKeeper decision record (``txn_decisions``).

A prepared transaction is never given up while its outcome can still be commit: it is committed when
a commit decision lists it, rolled back when the decision in force does not, and only after
``transactionTimeout`` without any decision does the broker record an abort for its run (a versioned
ZooKeeper write that the writer's commit decision cannot overtake) and roll it back."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from . import txn_decisions

log = logging.getLogger(__name__)


class TransactionResolver:
    def __init__(self, manager, broker_id: int, zk: Callable[[], Optional[object]], timeout_s: float,
                 interval_s: float = 1.0):
        self.manager, self.broker_id, self.zk = manager, broker_id, zk
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metaq-txn-resolver", daemon=True)

    def start(self) -> "TransactionResolver":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception as e:  # noqa: BLE001 - retried next round; ZooKeeper may be away
                log.warning("transaction housekeeping failed (will retry): %s", e)

    def run_once(self) -> None:
        self.manager.expire()
        zk = self.zk()
        if zk is None:
            return
        for t in self.manager.prepared():
            coordinator = txn_decisions.parse_coordinator(t.coordinator)
            if coordinator is not None:
                self.resolve(zk, t, coordinator)

    def resolve(self, zk, t, coordinator: dict) -> None:
        path, run = coordinator["path"], coordinator["run"]
        decision, _ = txn_decisions.read(zk, path)
        if decision is None or (decision.outcome == "abort" and run not in decision.aborted):
            if time.time() - t.prepared_at < self.timeout_s:
                return  # the writer may still decide to commit
            decision = txn_decisions.decide_abort(zk, path, run)
        if decision.commits(self.broker_id, t.xid):
            log.info("committing in-doubt transaction %s (decision %s)", t.xid, path)
            self.manager.commit(t.xid)
        else:
            log.info("rolling back in-doubt transaction %s (decision %s: %s)", t.xid, path, decision.outcome)
            self.manager.rollback(t.xid)
