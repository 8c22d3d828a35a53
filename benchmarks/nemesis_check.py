"""The nemesis harness's checker (``benchmarks/nemesis.py``): what the clients of ``nemesis_load.py``
were told against what the group's log holds.

At every checkpoint (after each fault, once the group has recovered, and at the end) the checker reads
each partition up to its last stable offset, incrementally, into a *mirror* (offset -> message identity).
Before extending it, it reads again the last message it mirrored: the log only ever changes at its tail
(truncation), so if that message is still there the whole mirrored prefix is; if not, the partition is
read again from its earliest offset and every mirrored message that vanished or changed is reported.
Against the mirror:

* **acknowledged, lost**: an acknowledged put (``acks=all``, idempotent) whose message is not at the
  offset it was acknowledged at (``acks=1`` losses are counted apart: its contract allows them, see
  docs/replication.md). Below the earliest offset (retention) it is *expired*, not lost.
* **vanished**: a message a reader (or the checker) was shown that is no longer at its offset, or changed.
* **duplicates**: one message id stored more than once. From an idempotent producer or a transaction: a
  violation. From a plain producer: *explained* when the copies come from different attempts and every
  attempt but one ended "may or may not be stored"; a violation when one attempt was stored twice or an
  attempt refused with an error that promised nothing was stored is there.
* **transactions**: committed ones wholly visible, aborted ones not at all, uncertain ones all or nothing.
* **stalled**: acknowledged messages below the log end but past the last stable offset for longer than
  ``stall_s`` (20 s: twice the harness's transaction timeout), or at the end: readers cannot reach them,
  held back by a transaction that is not settled.

``compare_member_logs`` compares the members' segment bytes (stopped members, read from their data
directories) from the latest earliest offset up to the high watermark.
"""
from __future__ import annotations

import collections
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from benchmarks.nemesis_load import ACKS_ONE, IDEMPOTENT, TXN, History, identity
from metaq_broker.protocol import records
from metaq_broker.store import MessageStore


@dataclass
class Violation:
    kind: str  # lost | vanished | duplicate | transaction | diverged | ...
    where: str  # the checkpoint (fault) it was found at
    detail: str
    group: str = ""  # what many violations of one cause share (``summarize`` counts them under it)


@dataclass
class Mirror:
    """One partition as the checker read it: offset -> identity (or value), below ``end``."""

    log: dict = field(default_factory=dict)
    end: int = 0
    earliest: int = 0
    leo: int = 0  # the log end offset when last read: an acknowledged offset at or past it was cut off
    last: Optional[int] = None


def summarize(violations: list, examples: int = 3) -> list:
    """One line per (where, kind, what): the count and the first ``examples`` details (a lost failover
    can cost thousands of messages; one line each would bury the rest)."""
    groups: dict = {}
    for v in violations:
        groups.setdefault((v.where, v.kind, v.group or v.detail), []).append(v.detail)
    out = []
    for (where, kind, group), details in groups.items():
        if len(details) == 1:
            out.append(f"[{where}] {kind}: {details[0][:1500]}")
            continue
        more = f" | ... and {len(details) - examples} more" if len(details) > examples else ""
        out.append(f"[{where}] {kind} x{len(details)}, {group}: e.g. " + " | ".join(d[:300] for d in details[:examples])
                   + more)
    return out


def _key(value: bytes):
    return identity(value) or bytes(value)


class Checker:
    """``stall_s``: how long acknowledged messages may stay past the last stable offset (an open
    transaction may hold readers back until its timeout) before that is a violation."""

    def __init__(self, history: History, topics: list, stall_s: float = 20.0):
        self.history, self.topics, self.stall_s = history, topics, stall_s
        self.mirrors: dict = {}  # (topic, partition) -> Mirror
        self.where: dict = collections.defaultdict(set)  # (writer, seq) -> {(topic, partition, offset, attempt)}
        self.acked: dict = {}  # (writer, seq, attempt) -> (topic, partition, offset)
        self.pending_acked: dict = collections.defaultdict(list)  # (topic, partition) -> [(offset, identity)]
        self.pending_seen: dict = collections.defaultdict(list)  # (topic, partition) -> [(offset, value, reader)]
        self._attempts = self._seen = 0
        self._copied: set = set()  # (writer, seq) stored more than once, not yet judged
        self._read_now: set = set()  # the partitions read at the current checkpoint
        self._txns_taken, self._txns_pending = 0, []
        self._stalled: dict = {}  # (topic, partition) -> the last stable offset a stall was reported at
        self._judged: set = set()
        self.violations: list = []
        self.counts = collections.Counter()  # acked, verified, expired, acks1_lost, seen, ...
        self.label = "start"

    def _violate(self, kind: str, detail: str, group: str = "") -> None:
        self.violations.append(Violation(kind, self.label, detail, group or detail))

    # -- reading the log --------------------------------------------------------------------------------
    def checkpoint(self, consumer, label: str) -> list:
        """Read what is new, check the mirrored prefix still holds, verify what can be; returns the new
        violations."""
        self.label, before = label, len(self.violations)
        self._take_history()  # first: everything taken was acknowledged (or shown) before the log is read
        self._read_now = set()
        for topic in self.topics:
            for p, (earliest, lso, leo) in sorted(consumer.offset_bounds(topic).items()):
                m = self.mirrors.setdefault((topic, p), Mirror())
                m.earliest, m.leo = earliest, leo
                self._read_now.add((topic, p))
                if not self._prefix_holds(consumer, topic, p, m, lso):
                    self._reread(consumer, topic, p, m, lso)
                self._extend(consumer, topic, p, m, lso)
                for o in [o for o in m.log if o < earliest]:  # retention: no longer readable, no longer kept
                    del m.log[o]
        self._verify()
        self._check_duplicates()
        self._check_transactions()
        return self.violations[before:]

    def _prefix_holds(self, consumer, topic, p, m: Mirror, lso: int) -> bool:
        if m.last is None or m.last < m.earliest:
            return True
        if m.last >= lso:
            return False
        f = consumer.fetch(topic, p, m.last, max_messages=1)
        rows = f.batch.to_pydict()
        return bool(rows["offset"]) and rows["offset"][0] == m.last and _key(rows["value"][0]) == m.log[m.last]

    def _read(self, consumer, topic, p, start: int, end: int):
        offset = start
        while offset < end:
            f = consumer.fetch(topic, p, offset, max_bytes=4 << 20, max_messages=end - offset)
            rows = f.batch.to_pydict()
            yield from zip(rows["offset"], rows["value"])
            if f.next_offset <= offset:
                raise RuntimeError(f"{topic} {p}: no progress reading at {offset} (end {end})")
            offset = f.next_offset

    def _add(self, topic, p, m: Mirror, offset: int, value: bytes) -> None:
        key = _key(value)
        m.log[offset] = key
        m.last = offset if m.last is None else max(m.last, offset)
        if isinstance(key, tuple):
            self.where[key[:2]].add((topic, p, offset, key[2]))
            if len(self.where[key[:2]]) > 1:
                self._copied.add(key[:2])

    def _extend(self, consumer, topic, p, m: Mirror, lso: int) -> None:
        start = max(m.end, m.earliest)
        for offset, value in self._read(consumer, topic, p, start, lso):
            self._add(topic, p, m, offset, value)
        m.end = max(m.end, lso)

    def _reread(self, consumer, topic, p, m: Mirror, lso: int) -> None:
        """The mirrored tail is gone: read the partition again and report every message that vanished."""
        old = m.log
        for offset, key in old.items():
            if isinstance(key, tuple):
                self.where[key[:2]].discard((topic, p, offset, key[2]))
        fresh = Mirror(earliest=m.earliest)
        for offset, value in self._read(consumer, topic, p, m.earliest, lso):
            self._add(topic, p, fresh, offset, value)
        fresh.end = lso
        gone = [(o, k) for o, k in sorted(old.items()) if o >= m.earliest and fresh.log.get(o) != k]
        if gone:
            acked = [k for _, k in gone if isinstance(k, tuple) and k in self.acked]
            self._violate("vanished", f"{topic} {p}: {len(gone)} messages below the last stable offset that the "
                          f"checker had read vanished or changed, offsets {gone[0][0]}..{gone[-1][0]} (first: "
                          f"{gone[0][1]} is now {fresh.log.get(gone[0][0])}); {len(acked)} of them acknowledged",
                          f"the log the checker had read was replaced in {topic} {p}")
            for k in acked:
                self._lost(k, self.acked[k], "vanished after it had been read below the high watermark")
        m.log, m.end, m.last = fresh.log, fresh.end, fresh.last

    # -- verifying --------------------------------------------------------------------------------------
    def _take_history(self) -> None:
        h = self.history
        with h.lock:
            attempts, self._attempts = h.attempts[self._attempts:], len(h.attempts)
            seen, self._seen = h.seen[self._seen:], len(h.seen)
            self._txns_pending += h.txns[self._txns_taken:]
            self._txns_taken = len(h.txns)
        for a in attempts:
            if a.outcome != "acked":
                continue
            for i in range(a.count):
                key = (a.writer, a.seq + i, a.attempt)
                self.acked[key] = (a.topic, a.partition, a.base_offset + i)
                self.pending_acked[(a.topic, a.partition)].append((a.base_offset + i, key, 0.0))
                self.counts["acked " + h.kinds[a.writer]] += 1
        for topic, p, offset, value, reader in seen:
            self.pending_seen[(topic, p)].append((offset, _key(value), reader))
            self.counts["seen by readers"] += 1

    def _lost(self, key, where, why: str) -> None:
        kind = self.history.kinds.get(key[0])
        if kind == ACKS_ONE:
            self.counts["acks=1 lost"] += 1
            return
        self._violate("lost", f"{kind} message {key} acknowledged at {where[0]} {where[1]} offset {where[2]}: {why}",
                      f"{kind} acknowledged messages lost from {where[0]} {where[1]}")

    def _verify(self, final: bool = False) -> None:
        for tp, pending in self.pending_acked.items():
            if tp not in self._read_now and not final:
                continue  # not listed this time (no master): judged at a later checkpoint
            m = self.mirrors.get(tp, Mirror())
            keep = []
            now = time.monotonic()
            for offset, key, since in pending:
                if m.end <= offset < m.leo:  # written, not readable yet: behind an unsettled transaction
                    since = since or now
                    if final:
                        self.counts["acked, never readable (behind an unsettled transaction)"] += 1
                        self._hidden(tp, m, offset)
                    else:
                        keep.append((offset, key, since))
                        if now - since > self.stall_s:
                            self._hidden(tp, m, offset)
                elif m.log.get(offset) == key:
                    self.counts["acked and verified"] += 1
                elif offset < m.earliest:
                    self.counts["acked, expired by retention"] += 1
                else:
                    found = m.log.get(offset)
                    self._lost(key, (*tp, offset), f"the log now ends at {m.leo}" if offset >= m.leo else
                               f"the offset holds {found} instead")
            self.pending_acked[tp] = keep
        for tp, pending in self.pending_seen.items():
            if tp not in self._read_now and not final:
                continue
            m = self.mirrors.get(tp, Mirror())
            keep = []
            for offset, key, reader in pending:
                if m.end <= offset < m.leo and not final:
                    keep.append((offset, key, reader))
                elif offset < m.earliest or m.log.get(offset) == key:
                    continue
                else:
                    self._violate("vanished", f"{reader} was shown {key} at {tp[0]} {tp[1]} offset {offset}; "
                                  + (f"the log now ends at {m.leo}" if offset >= m.leo else
                                     f"the log now has {m.log.get(offset)} there"),
                                  f"messages shown to readers vanished from {tp[0]} {tp[1]}")
            self.pending_seen[tp] = keep

    def _hidden(self, tp, m: Mirror, offset: int) -> None:
        """Acknowledged messages that readers still cannot read ``stall_s`` after a checkpoint first found
        them so (or at the end): once per partition and last stable offset."""
        if self._stalled.get(tp) == m.end:
            return
        self._stalled[tp] = m.end
        self._violate("stalled", f"{tp[0]} {tp[1]}: acknowledged messages from offset {offset} on are still not "
                      f"readable: the last stable offset stays at {m.end} (log end {m.leo}), held back by a "
                      f"transaction that is not settled")

    # -- the end ----------------------------------------------------------------------------------------
    def final(self, consumer) -> list:
        before = len(self.violations)
        self.checkpoint(consumer, "final")
        self._verify(final=True)
        self._check_transactions(final=True)
        return self.violations[before:]

    def _check_duplicates(self) -> None:
        """Judge each message id found stored more than once since the last checkpoint."""
        h = self.history
        with h.lock:
            attempts = list(h.attempts)
        outcomes = {}
        for a in attempts:
            for i in range(a.count):
                outcomes[(a.writer, a.seq + i, a.attempt)] = a
        copied, self._copied = self._copied, set()
        for writer, seq in sorted(copied - self._judged):
            copies = self.where[(writer, seq)]
            if len(copies) < 2:
                continue
            self._judged.add((writer, seq))
            kind = h.kinds.get(writer)
            places = sorted(copies)
            attempts_stored = [c[3] for c in places]
            if kind in (IDEMPOTENT, TXN):
                self._violate("duplicate", f"{kind} message ({writer}, {seq}) stored {len(copies)} times: {places}",
                              f"{kind} messages stored more than once")
            elif len(set(attempts_stored)) < len(attempts_stored):
                self._violate("duplicate", f"{kind} message ({writer}, {seq}): one put stored twice (attempt "
                              f"{collections.Counter(attempts_stored).most_common(1)[0][0]}): {places}",
                              f"{kind} messages of one put stored twice")
            elif any(outcomes.get((writer, seq, a)) is not None and outcomes[(writer, seq, a)].outcome == "refused"
                     for a in attempts_stored):
                a = next(outcomes[(writer, seq, a)] for a in attempts_stored if outcomes.get((writer, seq, a))
                         is not None and outcomes[(writer, seq, a)].outcome == "refused")
                self._violate("duplicate", f"{kind} message ({writer}, {seq}) attempt {a.attempt} is stored although "
                              f"its put was refused with an error that says nothing was stored: {a.error[:300]}",
                              f"{kind} messages stored although refused")
            else:
                self.counts[f"{kind} duplicates (after 'may or may not be stored')"] += len(copies) - 1

    def _check_transactions(self, final: bool = False) -> None:
        """Judge each transaction once none of its messages lies between its partition's last stable
        offset and log end (not yet decided there): committed wholly visible, aborted not at all,
        uncertain all or nothing."""
        keep = []
        for t in self._txns_pending:
            mirrors = [self.mirrors.get((topic, p), Mirror()) for topic, p, _, _ in t.messages]
            if any(m.end <= o < m.leo for (_, _, o, _), m in zip(t.messages, mirrors)):
                if final:  # still behind an unsettled transaction: reported as stalled, not judged
                    self.counts[f"transactions {t.outcome}, never readable"] += 1
                else:
                    keep.append(t)
                continue
            visible = sum(1 for (_, _, offset, value), m in zip(t.messages, mirrors)
                          if m.log.get(offset) == identity(value))
            total = len(t.messages)
            self.counts[f"transactions {t.outcome}"] += 1
            ok = {"committed": visible == total, "aborted": visible == 0}.get(t.outcome, visible in (0, total))
            if not ok:
                self._violate("transaction", f"{t.outcome} transaction {t.xid_prefix}: {visible} of its {total} "
                              f"messages visible ({t.error[:200]})", f"{t.outcome} transactions not all or nothing")
        self._txns_pending = keep


def partition_bytes(data_path: Path, topic: str, partition: int, start: int, end: int) -> bytes:
    """The record bytes of ``[start, end)`` of a stopped member's partition (whole batches)."""
    store = MessageStore(data_path, background_interval=None)
    try:
        part = store.partition(topic, partition)
        chunks, offset = [], start
        while offset < end:
            r = part.read(offset, 8 << 20, end=end)
            if r.end_offset <= offset:
                break
            chunks.append(r.data.tobytes())
            offset = r.end_offset
        return b"".join(chunks)
    finally:
        store.close()


def member_bounds(data_path: Path, topic: str, partition: int) -> tuple:
    """(earliest offset, log end offset) of a stopped member's partition."""
    store = MessageStore(data_path, background_interval=None)
    try:
        part = store.partition(topic, partition)
        return part.earliest_offset, part.log_end_offset
    finally:
        store.close()


def first_difference(a: bytes, b: bytes, start: int) -> str:
    """Where two members' record bytes of one range first differ, in offsets and messages."""
    ra = records.decode(a, start, None) if a else None
    rb = records.decode(b, start, None) if b else None
    da = dict(zip(ra.column("offset").to_pylist(), ra.column("value").to_pylist())) if ra is not None else {}
    db = dict(zip(rb.column("offset").to_pylist(), rb.column("value").to_pylist())) if rb is not None else {}
    for o in sorted(set(da) | set(db)):
        if da.get(o) != db.get(o):
            return f"offset {o}: {da.get(o)!r:.60} vs {db.get(o)!r:.60}"
    return "same messages, different bytes (headers, timestamps or markers)"


def compare_member_logs(data_paths: dict, partitions: list, high_watermarks: dict) -> list:
    """Problems (strings) found comparing the stopped members' logs: ``data_paths`` {replicaId: Path},
    ``partitions`` [(topic, number)], ``high_watermarks`` {(topic, number): offset}."""
    problems = []
    for topic, n in partitions:
        hw = high_watermarks[(topic, n)]
        bounds = {r: member_bounds(path, topic, n) for r, path in data_paths.items()}
        start = max(b[0] for b in bounds.values())
        short = {r: b[1] for r, b in bounds.items() if b[1] < hw}
        if short:
            problems.append(f"{topic}-{n}: members {sorted(short)} end at {short} below the high watermark {hw}")
        end = min([hw] + [b[1] for b in bounds.values()])
        logs = {r: partition_bytes(path, topic, n, start, end) for r, path in data_paths.items()}
        digests = {r: hashlib.sha256(b).hexdigest()[:12] for r, b in logs.items()}
        if len(set(digests.values())) > 1:
            first, *rest = sorted(logs)
            for r in rest:
                if logs[r] != logs[first]:
                    problems.append(f"{topic}-{n} [{start}, {end}): member {r}'s bytes differ from member {first}'s: "
                                    f"{first_difference(logs[first], logs[r], start)}")
    return problems
