"""Decision records: the outcome of a group of broker transactions, kept in ZooKeeper so that a writer
(the Spark sink's driver) and the brokers holding in-doubt transactions agree on it.

A record lives at a path such as ``<root>/sinks/<sinkId>/batches/<batchId>`` and holds JSON
``{"outcome": "commit" | "abort", "run": <committing writer run>, "xids": [[brokerId, xid], ...],
"aborted": [runs], "owner": {"query": <query id>, "checkpoint": <location>}}``; ``owner`` names the query
whose run committed (empty for batch writes), so that another query reusing the sink id is told, not
mistaken for a replay. It changes only by versioned writes, along these edges:

* absent -> commit(run R, xids) | abort(runs {R})
* abort(S) -> commit(R) for a run R not in S, or abort(S + {R}): an aborted run stays aborted
* commit is final.

The writer of run R commits its transactions only after ``decide_commit`` returned a commit decision
that lists them; finding abort(R) means a broker gave up on them (``transactionTimeout``). A broker
holding a prepared transaction of run R commits it when a commit decision lists it, rolls it back when
the commit decision does not, and after the timeout records abort(R) itself before rolling back."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from metaq_broker.errors import MetaqError, TransactionError


class TransactionsAbortedError(MetaqError):
    """The brokers gave up on this run's transactions before the commit decision was written."""


@dataclass
class Decision:
    outcome: str  # "commit" | "abort"
    run: str = ""  # the committing run
    xids: list = field(default_factory=list)  # [[broker_id, xid], ...] to commit
    aborted: list = field(default_factory=list)  # runs whose transactions the brokers rolled back
    owner: dict = field(default_factory=dict)  # {"query": ..., "checkpoint": ...} of the committing run

    def commits(self, broker_id: int, xid: str) -> bool:
        return self.outcome == "commit" and [broker_id, xid] in self.xids

    def encode(self) -> bytes:
        return json.dumps({"outcome": self.outcome, "run": self.run, "xids": self.xids,
                           "aborted": self.aborted, "owner": self.owner}).encode()


def read(zk, path: str):
    """(Decision or None, znode version)."""
    try:
        data, stat = zk.get(path)
    except NoNodeError:
        return None, -1
    m = json.loads(data)
    return Decision(m["outcome"], m.get("run", ""), [list(x) for x in m.get("xids", [])],
                    list(m.get("aborted", [])), dict(m.get("owner") or {})), stat.version


def _decide(zk, path: str, run: str, xids: Optional[list], owner: Optional[dict] = None) -> Decision:
    """Move the record to commit(run, xids) (``xids`` given) or add ``run`` to the aborted runs, unless
    the record is already final for this purpose; returns the decision in force."""
    while True:
        current, version = read(zk, path)
        if current is not None and (current.outcome == "commit" or run in current.aborted):
            return current
        if xids is not None:
            wanted = Decision("commit", run, [list(x) for x in xids], current.aborted if current else [],
                              dict(owner or {}))
        else:
            wanted = Decision("abort", aborted=(current.aborted if current else []) + [run])
        try:
            if current is None:
                zk.create(path, wanted.encode(), makepath=True)
            else:
                zk.set(path, wanted.encode(), version=version)
            return wanted
        except (NodeExistsError, BadVersionError, NoNodeError):
            continue


def decide_commit(zk, path: str, run: str, xids: list, owner: Optional[dict] = None) -> Decision:
    """Record that run ``run`` (of ``owner``) commits ``xids``; returns the decision in force, which may be
    an earlier run's commit (the batch was decided before: commit those, roll back this run's). Raises
    TransactionsAbortedError if a broker already aborted this run."""
    d = _decide(zk, path, run, xids, owner)
    if d.outcome == "abort":
        raise TransactionsAbortedError(
            f"decision {path}: the brokers rolled back run {run}'s transactions before the commit decision "
            f"(the batch took longer than its transaction timeout); the batch must be written again")
    return d


def decide_abort(zk, path: str, run: str) -> Decision:
    """A broker giving up on run ``run``: returns the decision in force (a commit if the writer won)."""
    return _decide(zk, path, run, None)


def parse_coordinator(text: str) -> Optional[dict]:
    """The coordinator a transaction was begun with: {"path": ..., "run": ...}, or None."""
    if not text:
        return None
    try:
        m = json.loads(text)
    except ValueError:
        m = None
    if not isinstance(m, dict) or not isinstance(m.get("path"), str) or not isinstance(m.get("run"), str) \
            or not m["path"].startswith("/"):
        raise TransactionError(f'coordinator must be JSON {{"path": "/...", "run": "..."}}, got {text!r}')
    return m
