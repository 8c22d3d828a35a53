"""The broker's transaction housekeeping: roll back open transactions past their timeout, and settle
in-doubt prepared transactions that name a ZooKeeper decision record (``txn_decisions``).

A prepared transaction is never given up while its outcome can still be commit: it is committed when
a commit decision lists it, rolled back when the decision in force does not, and only after
the transaction's own limit (BeginTransaction's timeout_ms, else ``transactionTimeout``) without any
decision does the broker record an abort for its run (a versioned ZooKeeper write that the writer's commit
decision cannot overtake) and roll it back. An *open* transaction whose decision record is already written
and does not list it (a task attempt that died before its prepare, while a retry wrote the batch) can never
commit: it is rolled back at once rather than at its timeout, since its first batch holds back every reader
of its partitions. Rarely, it also tells the manager which decision records are gone, so that it forgets
the outcomes it kept for them (a replay of an existing record may still ask). In a replicated group only the
master does any of this: a replica's manager is a follower, and the member promoted next settles from the
same records (its journal holds the prepared transactions and their coordinators).

Settled promptly (issue 24, defect 9): a round runs as soon as this member becomes master (``wake``), not a
round later, and a client's commit or rollback first settles the in-doubt transactions of the same
partitions whose decision is recorded (``settle_ahead``), so a read planned after that commit was answered
is not held back by an older transaction that was only waiting for this resolver's next round."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from kazoo.exceptions import BadArgumentsError

from metaq_broker.zk import decisions as txn_decisions

log = logging.getLogger(__name__)


class TransactionResolver:
    def __init__(self, manager, broker_id: int, zk: Callable[[], Optional[object]], interval_s: float = 1.0,
                 forget_interval_s: float = 600.0):
        self.manager, self.broker_id, self.zk = manager, broker_id, zk
        self.interval_s, self.forget_interval_s = interval_s, forget_interval_s
        self._next_forget = time.monotonic() + forget_interval_s
        self._failing: set = set()  # xids whose housekeeping failed (logged at warning once)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metaq-txn-resolver", daemon=True)

    def start(self) -> "TransactionResolver":
        self._wake.set()  # the first round at once: a restarted broker settles what is decided without delay
        self._thread.start()
        return self

    def wake(self) -> None:
        """Run a round now (this member just became master: what it holds in doubt may be decided)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.run_once()
            except Exception as e:  # noqa: BLE001 - retried next round; ZooKeeper may be away
                log.warning("transaction housekeeping failed (will retry): %s", e)

    def settle_ahead(self, partitions) -> None:
        """Settle the prepared transactions with batches in ``partitions`` whose decision record is there
        to read (one read per record): a commit answered after this is not hidden behind them. Those
        without a decision yet stay (their writer may still commit), as the last stable offset says."""
        zk = self.zk()
        wanted = set(partitions)
        if zk is None or not wanted or getattr(self.manager, "follower", False):
            return
        decisions: dict = {}

        def settle(t) -> None:
            coordinator = txn_decisions.parse_coordinator(t.coordinator)
            if coordinator is None or not wanted & set(t.partitions):
                return
            path = coordinator["path"]
            if path not in decisions:
                decisions[path] = txn_decisions.read(zk, path)[0]
            if decisions[path] is not None:
                self.resolve(zk, t, coordinator, decisions[path], logging.DEBUG)
        for t in self.manager.prepared():
            self._isolated(t.xid, settle, t)

    def run_once(self) -> None:
        if getattr(self.manager, "follower", False):
            return  # a replica: the group's master settles (its journal then reaches this member)
        self.manager.expire()
        zk = self.zk()
        if zk is None:
            return
        for t in self.manager.prepared():
            self._isolated(t.xid, self._resolve_prepared, zk, t)
        self.roll_back_orphans(zk)
        if time.monotonic() >= self._next_forget:
            self.forget_gone_records(zk)

    def roll_back_orphans(self, zk) -> list:
        """Roll back open transactions that their decision record has already left out: a commit lists
        every transaction it will ever commit, and an abort of their run is final. One read per record."""
        decided: dict = {}
        gone = []

        def check(t) -> None:
            coordinator = txn_decisions.parse_coordinator(t.coordinator)
            if coordinator is None:
                return
            path = coordinator["path"]
            if path not in decided:
                decided[path] = txn_decisions.read(zk, path)[0]
            d = decided[path]
            if d is not None and (d.outcome == "commit" or coordinator["run"] in d.aborted) \
                    and not d.commits(self.broker_id, t.xid):
                log.info("rolling back open transaction %s: decision %s (%s) leaves it out", t.xid, path, d.outcome)
                self.manager.rollback(t.xid)
                gone.append(t.xid)
        for t in self.manager.open_transactions():
            self._isolated(t.xid, check, t)
        return gone

    def _isolated(self, xid: str, step, *args) -> None:
        """One transaction's step; its failure is logged (at warning once per transaction, then at debug)
        and never stops the others' (a decision record ZooKeeper refuses must not pin every partition)."""
        try:
            step(*args)
        except Exception as e:  # noqa: BLE001 - retried next round
            first = xid not in self._failing
            self._failing.add(xid)
            log.log(logging.WARNING if first else logging.DEBUG,
                    "transaction %s: housekeeping failed (retried every round): %s: %s", xid, type(e).__name__, e)

    def forget_gone_records(self, zk) -> int:
        """Let the manager forget outcomes whose decision record was deleted (one batch of exists calls)."""
        self._next_forget = time.monotonic() + self.forget_interval_s
        paths = sorted(self.manager.decided_records())
        checks = [(path, zk.exists_async(path)) for path in paths]
        gone = {path for path, result in checks if result.get(timeout=30) is None}
        return self.manager.forget_decided(gone) if gone else 0

    def _resolve_prepared(self, zk, t) -> None:
        coordinator = txn_decisions.parse_coordinator(t.coordinator)
        if coordinator is not None:
            self.resolve(zk, t, coordinator)

    def resolve(self, zk, t, coordinator: dict, decision=None, level: int = logging.INFO) -> None:
        """Settle prepared ``t`` as its decision record says (``decision``: read already)."""
        path, run = coordinator["path"], coordinator["run"]
        if decision is None:
            try:
                decision, _ = txn_decisions.read(zk, path)
            except (BadArgumentsError, ValueError) as e:  # a path ZooKeeper refuses: no decision can ever be read
                if time.time() - t.prepared_at < t.timeout_s:
                    raise
                log.warning("rolling back in-doubt transaction %s: its decision record %r cannot be read (%s) and "
                            "its timeout passed", t.xid, path, e)
                self.manager.rollback(t.xid)
                return
        if decision is None or (decision.outcome == "abort" and run not in decision.aborted):
            if time.time() - t.prepared_at < t.timeout_s:
                return  # the writer may still decide to commit
            decision = txn_decisions.decide_abort(zk, path, run)
        if decision.commits(self.broker_id, t.xid):
            log.log(level, "committing in-doubt transaction %s (decision %s)", t.xid, path)
            self.manager.commit(t.xid)
        else:
            log.log(level, "rolling back in-doubt transaction %s (decision %s: %s)", t.xid, path, decision.outcome)
            self.manager.rollback(t.xid)
