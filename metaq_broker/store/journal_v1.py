"""Reading the transaction journal of the metaq that kept transactions out of the log
(``transactions/transactions.journal``), so that ``TransactionManager`` can convert it on open: nothing it
holds is lost. That journal carried each transaction's batch bodies (PUT) until commit, which appended them
to the partitions with the transaction's number in the batch headers (no TRANSACTIONAL bit); a COMMIT record
without DONE was finished by counting those batches past the offsets it recorded. docs/transactions.md
("Journals of earlier versions") gives the old layout.
"""
from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from metaq_broker.errors import CorruptLogError
from metaq_broker.protocol import records
from metaq_broker.store.journal_frames import RECORD, bad_record, valid_record_after

log = logging.getLogger(__name__)

JOURNAL = "transactions.journal"
PUT, PREPARE, COMMIT, DONE, ROLLBACK, FINISHED = 1, 2, 3, 4, 5, 6
KINDS = range(PUT, FINISHED + 1)


@dataclass
class Put:
    topic: str
    partition: int
    count: int
    attributes: int
    crc: int
    position: int  # of the body in the journal
    size: int


@dataclass
class OldTransaction:
    xid: str
    state: str = "open"  # open | prepared | committing
    timeout_s: float = 60.0
    coordinator: str = ""
    prepared_at: float = 0.0
    puts: list = field(default_factory=list)
    number: int = 0
    before: dict = field(default_factory=dict)  # "topic/partition" -> latest offset before the commit


@dataclass
class OldJournal:
    path: Path
    fd: int
    prepared: list
    committing: list
    outcomes: list  # [xid, outcome, decision record path or ""]
    forgot_commits: bool
    next_number: int

    def body(self, put: Put) -> records.EncodedBody:
        return records.parse_body(put.count, put.attributes, os.pread(self.fd, put.size, put.position), put.crc)

    def close(self) -> None:
        os.close(self.fd)


def read(path: Path, default_timeout_s: float = 60.0) -> OldJournal:
    """Replay the old journal. Open transactions died with the broker that wrote it and are left out; a
    torn tail is ignored; damage followed by valid records raises CorruptLogError."""
    data = Path(path).read_bytes()
    live: dict = {}
    outcomes: dict = {}
    forgot, next_number, pos = False, 1, 0
    while pos < len(data):
        bad = bad_record(data, pos, KINDS)
        if bad:
            if valid_record_after(data, pos, KINDS):
                raise CorruptLogError(f"{path}: damaged transaction record ({bad}) followed by valid ones", path, pos)
            log.warning("%s: ignoring a torn tail of %d bytes at %d (%s)", path, len(data) - pos, pos, bad)
            break
        length, _, kind = RECORD.unpack_from(data, pos)
        payload = data[pos + RECORD.size: pos + RECORD.size + length]
        if kind == PUT:
            n = struct.unpack_from("<I", payload)[0]
            m = json.loads(payload[4: 4 + n])
            t = live.setdefault(m["xid"], OldTransaction(m["xid"], timeout_s=default_timeout_s))
            t.puts.append(Put(m["topic"], m["partition"], m["count"], m["attributes"], m["crc"],
                              pos + RECORD.size + 4 + n, len(payload) - 4 - n))
        else:
            m = json.loads(payload)
            if kind == FINISHED:
                outcomes.update({x: [x, o, ""] for x, o in m["finished"]})
                outcomes.update({x: [x, o, p] for x, o, p in m.get("decided", [])})
                forgot |= m.get("forgot_commits", False)
                next_number = max(next_number, m["next_number"])
            elif kind == PREPARE:
                t = live.setdefault(m["xid"], OldTransaction(m["xid"], timeout_s=default_timeout_s))
                t.state, t.coordinator, t.prepared_at = "prepared", m["coordinator"], m["at"]
                t.timeout_s = m.get("timeout", default_timeout_s)
            elif kind == COMMIT and m["xid"] in live:
                t = live[m["xid"]]
                t.state, t.number, t.before = "committing", m["number"], m["before"]
                next_number = max(next_number, t.number + 1)
            elif kind in (DONE, ROLLBACK):
                live.pop(m["xid"], None)
                outcomes[m["xid"]] = [m["xid"], "committed" if kind == DONE else "rolled_back", m.get("path", "")]
        pos += RECORD.size + length
    return OldJournal(Path(path), os.open(path, os.O_RDONLY),
                      [t for t in live.values() if t.state == "prepared"],
                      [t for t in live.values() if t.state == "committing"],
                      list(outcomes.values()), forgot, next_number)


def finish_commit(store, journal: OldJournal, t: OldTransaction) -> None:
    """Finish a commit the old broker had journalled but not completed: append, per partition, the puts
    that its numbered batches past the recorded offset do not account for yet (fsynced)."""
    by_partition: dict = {}
    for p in t.puts:
        by_partition.setdefault((p.topic, p.partition), []).append(p)
    for (topic, partition), puts in sorted(by_partition.items()):
        part = store.partition(topic, partition)
        have = _count_numbered(part, t.before[f"{topic}/{partition}"], t.number)
        missing = puts[have:]
        if missing:
            results = part.append_bodies([journal.body(p) for p in missing], txn=t.number)
            part.make_durable(results[-1].base_offset + results[-1].count)


def _count_numbered(part, from_offset: int, number: int) -> int:
    found, offset = 0, max(from_offset, part.earliest_offset)
    while offset < part.last_stable_offset:
        r = part.read(offset, 8 << 20)
        for pos in r.batch_positions.tolist():
            found += records.parse_header(r.data, pos).txn == number
        offset = r.end_offset
    return found
