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
the commit decision does not, and after the timeout records abort(R) itself before rolling back.

Writers reach the records directly (a session with ZooKeeper rights on them) or through a broker's
``metaq.v1.Sinks`` service (server/sinks.py), which checks the sink's ACL; both use the functions here,
the housekeeping of old records (``forget_below``, ``forget_sink``, ``sweep_batch_writes``) included."""
from __future__ import annotations

import json
import posixpath
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, NotEmptyError

from metaq_broker.errors import MetaqError, TransactionError
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import children

BATCH_WRITE_PREFIX = "write."  # the sink node of a batch write: write.<sinkId>, or write.<random run>


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

    def to_json(self) -> dict:
        return asdict(self)

    def encode(self) -> bytes:
        return json.dumps(self.to_json()).encode()

    @classmethod
    def from_json(cls, m: dict) -> "Decision":
        return cls(m["outcome"], m.get("run", ""), [list(x) for x in m.get("xids", [])],
                   list(m.get("aborted", [])), dict(m.get("owner") or {}))


def read(zk, path: str):
    """(Decision or None, znode version)."""
    try:
        data, stat = zk.get(path)
    except NoNodeError:
        return None, -1
    return Decision.from_json(json.loads(data)), stat.version


def decide(zk, path: str, run: str, xids: Optional[list], owner: Optional[dict] = None) -> Decision:
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


def committed(d: Decision, path: str, run: str) -> Decision:
    """``d``, the decision in force after run ``run`` asked to commit: TransactionsAbortedError if it is an
    abort (a broker gave up on the run first)."""
    if d.outcome == "abort":
        raise TransactionsAbortedError(
            f"decision {path}: the brokers rolled back run {run}'s transactions before the commit decision "
            f"(the batch took longer than its transaction timeout); the batch must be written again")
    return d


def decide_commit(zk, path: str, run: str, xids: list, owner: Optional[dict] = None) -> Decision:
    """Record that run ``run`` (of ``owner``) commits ``xids``; returns the decision in force, which may be
    an earlier run's commit (the batch was decided before: commit those, roll back this run's). Raises
    TransactionsAbortedError if a broker already aborted this run."""
    return committed(decide(zk, path, run, xids, owner), path, run)


def decide_abort(zk, path: str, run: str) -> Decision:
    """A broker giving up on run ``run``: returns the decision in force (a commit if the writer won)."""
    return decide(zk, path, run, None)


# -- housekeeping: old records go, by sink id (paths from ``ZkPaths``) ---------------------------------
def forget_below(zk, paths: ZkPaths, sink: str, batch_id: int) -> int:
    """Delete the sink's records of batches below ``batch_id`` (a streaming sink keeps its last two, the
    only ones a replay may ask for); returns how many."""
    batches, gone = paths.sink_batches(sink), 0
    for child in children(zk, batches):
        if child.isdigit() and int(child) < batch_id:
            try:
                zk.delete(f"{batches}/{child}")
                gone += 1
            except NoNodeError:
                pass
    return gone


def forget_sink(zk, paths: ZkPaths, sink: str) -> None:
    """Delete a sink's node and its records (a batch write's, once settled)."""
    try:
        zk.delete(paths.sink(sink), recursive=True)
    except (NoNodeError, NotEmptyError):
        pass  # gone, or a broker is recreating a record meanwhile: the next sweep takes it


def sweep_batch_writes(zk, paths: ZkPaths, horizon_s: float, may: Callable[[str], bool] = lambda sink: True,
                       clock: Callable[[], float] = time.time) -> list:
    """Delete the sinks of batch writes whose driver died after the decision, older than ``horizon_s``
    (by then their brokers have long settled) and that ``may(sink id)`` allows; returns their sink ids.
    A batch write's sink has batch 0 only and no streaming owner: a streaming sink is never swept."""
    sinks = paths.sinks()
    gone = []
    for sink in children(zk, sinks):
        if sink.startswith(BATCH_WRITE_PREFIX) and _old_batch_write(zk, paths, sink, horizon_s, clock()) \
                and may(sink):
            forget_sink(zk, paths, sink)
            gone.append(sink)
    return gone


def _old_batch_write(zk, paths: ZkPaths, sink: str, horizon_s: float, now: float) -> bool:
    batches = children(zk, paths.sink_batches(sink))
    first = paths.sink_batch(sink, 0)
    if batches not in ([], [posixpath.basename(first)]):
        return False
    stat = zk.exists(paths.sink(sink))
    if stat is None or now - stat.ctime / 1000 <= horizon_s:
        return False
    decision = read(zk, first)[0] if batches else None
    return decision is None or not decision.owner


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
