"""Lookups by key and by message id in a partition (``store/lookup.py`` over the key index wired into
``PartitionLog``), against their adversary: a full scan of what a reader gets.

A seeded schedule of operations runs on a partition with small segments: keyed appends (keys that repeat,
null keys, two keys whose indexed hashes collide, create times), transactions committed, aborted or left
open, a replica's verbatim copy and its truncation, retention by size, reopening after a clean close and
after a crash (the tail's key index rebuilt from the log), key index files lost or damaged. After each
step every key is looked up, read_committed and read_uncommitted, whole and within store-time ranges, and
the answers must equal the scan's newest-first matches. Then the topic setting: no key index, no files,
a lookup that says so; and the errors a bad query gets.
"""
from __future__ import annotations

import random
import shutil

import numpy as np
import pytest

from conftest import FakeClock
from metaq_broker.errors import InvalidQueryError, NoKeyIndexError
from metaq_broker.protocol import records
from metaq_broker.store import PartitionLog, TopicConfig
from metaq_broker.store import lookup
from metaq_broker.store.keyindex import KeyIndex, hash_key

pytestmark = pytest.mark.unit

SMALL = TopicConfig(max_segment_size=4096, retention_bytes=-1)


def colliding_pair():
    """Two keys whose indexed hashes (the high 32 bits) are equal."""
    keys = [b"c%d" % i for i in range(300_000)]
    index = KeyIndex(0, 0)
    index.add(0, keys)
    hashes = index.columns()[0]
    order = np.argsort(hashes, kind="stable")
    same = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])[0]
    a, b = keys[order[same]], keys[order[same + 1]]
    assert a != b and hash_key(a) >> 32 == hash_key(b) >> 32
    return a, b


A, B = colliding_pair()
KEYS = [b"order-4711", b"order-4712", b"", b"x" * 70, A, B]


def scan(log, read_uncommitted=False):
    """(offset, key, store time) of every message a reader gets, oldest first: the adversary's answer."""
    end = lookup.read_end(log, read_uncommitted)
    out, offset = [], log.earliest_offset
    while offset < end:
        r = log.read(offset, 1 << 16, end=end)
        positions = r.batch_positions
        stores = records.headers_at(r.data, positions)
        batch = records.decode(r.data, r.start_offset, r.end_offset, aborted=log.aborted_in(offset, r.end_offset))
        first_of = dict(zip(stores["base_offset"].tolist(), stores["timestamp"].tolist()))
        bases = sorted(first_of)
        for o, k in zip(batch.column("offset").to_pylist(), batch.column("key").to_pylist()):
            out.append((o, k, first_of[bases[int(np.searchsorted(bases, o, "right")) - 1]]))
        offset = r.end_offset
    return out


def expected(rows, key, since=None, until=None, n=64):
    return [o for o, k, t in reversed(rows) if k == key and (since is None or t >= since)
            and (until is None or t <= until)][:n]


def check(log, rng):
    for uncommitted in (False, True):
        rows = scan(log, uncommitted)
        times = sorted({t for _, _, t in rows})
        for key in KEYS + [b"never"]:
            got = lookup.by_key(log, key, read_uncommitted=uncommitted)
            assert got.offsets == expected(rows, key), (key, uncommitted)
            assert all(k == key for k in got.batch.column("key").to_pylist())
            if times:
                since, until = sorted(rng.choices(times + [times[0] - 5, times[-1] + 5], k=2))
                n = rng.randint(1, 5)
                got = lookup.by_key(log, key, since, until, n, read_uncommitted=uncommitted)
                assert got.offsets == expected(rows, key, since, until, n), (key, since, until, n)
            if rows:  # within an offset range [first, before) (a Spark task's)
                first, before = sorted(rng.choices([o for o, _, _ in rows] + [rows[-1][0] + 1], k=2))
                got = lookup.by_key(log, key, read_uncommitted=uncommitted, first=first, before=before)
                assert got.offsets == [o for o in expected(rows, key, n=1 << 30) if first <= o < before][:64]
        if rows:  # by message id: exactly the message, or none for an id the reader does not get
            for o, _, _ in rng.sample(rows, min(3, len(rows))):
                msg_id = int(log.read_arrow(o, o + 1).column("msgId")[0].as_py()) if not uncommitted else None
                if msg_id is not None:
                    assert lookup.by_msg_id(log, msg_id).offsets == [o]
                    assert lookup.by_msg_id(log, msg_id, first=o, before=o + 1).offsets == [o]
                    assert lookup.by_msg_id(log, msg_id, first=o + 1).offsets == []
                    assert lookup.by_msg_id(log, msg_id, before=o).offsets == []


class Schedule:
    """A partition driven by a seeded sequence of operations, with a replica copying it."""

    def __init__(self, tmp_path, seed):
        self.tmp, self.rng, self.clock = tmp_path, random.Random(seed), FakeClock()
        self.log = self.open("master")
        self.txn = 100
        self.open_txns = []

    def open(self, name):
        return PartitionLog.open(self.tmp / name, "t", 0, SMALL, clock=self.clock)

    def keys(self, n):
        return [self.rng.choice(KEYS + [None]) for _ in range(n)]

    def step(self):
        op = self.rng.choice(["append", "append", "append", "txn", "settle", "retention", "reopen", "crash",
                              "lose", "damage", "truncate"])
        log, rng = self.log, self.rng
        self.clock.advance(rng.choice([0, 0.001, 1]))
        if op == "append":
            n = rng.randint(1, 12)
            created = [int(self.clock() * 1000) - rng.randint(-10_000, 10_000) for _ in range(n)] \
                if rng.random() < 0.3 else None
            log.append([b"v" * rng.randint(0, 300)] * n, keys=self.keys(n), timestamps=created)
        elif op == "txn":
            self.txn += 1
            log.append_bodies([records.encode_body([b"t"] * 3, keys=self.keys(3))], self.txn, records.TRANSACTIONAL)
            self.open_txns.append(self.txn)
        elif op == "settle" and self.open_txns:
            log.append_marker(self.open_txns.pop(0), commit=rng.random() < 0.5)
        elif op == "retention":
            log.config = log.config.with_(retention_bytes=rng.choice([4096, 8192, 16384]))
            log.apply_retention()
            log.config = SMALL
        elif op in ("reopen", "crash"):
            if op == "reopen":
                log.close()
                self.log = self.open("master")
            else:  # the directory as a crash leaves it: the tail's key index only in memory, lost
                target = self.tmp / f"crash-{self.rng.random()}"
                shutil.copytree(log.directory, target)
                log.close()
                shutil.rmtree(log.directory)
                shutil.move(target, log.directory)
                self.log = self.open("master")
            self.open_txns = sorted(self.log.txns.ongoing)
        elif op in ("lose", "damage"):
            files = sorted(log.directory.glob("*.keys"))
            if files:
                victim = rng.choice(files)
                log.close()
                if op == "lose":
                    victim.unlink()
                else:
                    raw = bytearray(victim.read_bytes())
                    raw[rng.randrange(len(raw))] ^= 0x10
                    victim.write_bytes(bytes(raw))
                self.log = self.open("master")
                self.open_txns = sorted(self.log.txns.ongoing)
        elif op == "truncate":  # a replica's copy, cut back as after a failover, then copied again
            replica = self.open("replica")
            replica.truncate_to(0)
            if replica.log_end_offset < log.earliest_offset or replica.earliest_offset > log.earliest_offset:
                replica.reset_to(log.earliest_offset)
            copy(log, replica)
            cut = rng.randint(replica.earliest_offset, replica.log_end_offset)
            replica.truncate_to(cut)
            check(replica, rng)
            copy(log, replica)
            check(replica, rng)
            replica.close()


def copy(master, replica):
    while replica.log_end_offset < master.log_end_offset:
        r = master.read(replica.log_end_offset, 1500, end=master.log_end_offset)
        replica.append_replicated(r.data, r.batch_positions)
    replica.make_durable(replica.log_end_offset)


@pytest.mark.parametrize("seed", range(6))
def test_lookups_equal_a_scan_through_rolls_transactions_retention_truncation_and_recovery(tmp_path, seed):
    s = Schedule(tmp_path, seed)
    for i in range(45):
        s.step()
        if i % 3 == 2:
            check(s.log, s.rng)
    check(s.log, s.rng)
    assert s.log.segments()[-1].start > 2 * SMALL.max_segment_size  # segments rolled, three times or more
    s.log.close()


def test_colliding_keys_are_told_apart_across_segments(tmp_path):
    log = PartitionLog.open(tmp_path / "p", "t", 0, SMALL)
    for i in range(60):
        log.append([b"v" * 100] * 4, keys=[A, B, A if i % 2 else B, None])
    assert len(log.segments()) > 5
    rows = scan(log)
    for key in (A, B):  # each is in 90 messages: every batch has one of each and a third of either
        assert lookup.by_key(log, key, max_answers=1000).offsets == expected(rows, key, n=1000)
        assert len(expected(rows, key, n=1000)) == 90
    log.close()


def test_open_transactions_only_for_read_uncommitted_aborted_never(tmp_path):
    log = PartitionLog.open(tmp_path / "p", "t", 0, SMALL)
    log.append([b"a"], keys=[b"k"])
    log.append_bodies([records.encode_body([b"open"], keys=[b"k"])], 7, records.TRANSACTIONAL)
    log.append_bodies([records.encode_body([b"aborted"], keys=[b"k"])], 8, records.TRANSACTIONAL)
    log.append_marker(8, commit=False)
    log.append([b"b"], keys=[b"k"])  # above the open transaction: read_committed readers stop before it
    values = lambda found: found.batch.column("value").to_pylist()  # noqa: E731
    assert values(lookup.by_key(log, b"k")) == [b"a"]
    assert values(lookup.by_key(log, b"k", read_uncommitted=True)) == [b"b", b"open", b"a"]
    log.append_marker(7, commit=True)
    assert values(lookup.by_key(log, b"k")) == [b"b", b"open", b"a"]
    aborted_id = log.read(2, 1 << 20, end=log.log_end_offset)
    msg_id = records.parse_header(aborted_id.data, 0).base_msg_id
    assert lookup.by_msg_id(log, msg_id, read_uncommitted=True).offsets == []  # an aborted message: none
    log.close()


def test_a_replicated_groups_high_watermark_caps_both_isolations(tmp_path):
    log = PartitionLog.open(tmp_path / "p", "t", 0, SMALL)
    for i in range(5):
        log.append([b"v%d" % i], keys=[b"k"])
    log.set_high_watermark(3)
    assert lookup.by_key(log, b"k").offsets == [2, 1, 0]
    assert lookup.by_key(log, b"k", read_uncommitted=True).offsets == [2, 1, 0]
    log.close()


def test_a_topic_without_a_key_index_writes_none_and_says_so(tmp_path):
    off = SMALL.with_(key_index=False)
    log = PartitionLog.open(tmp_path / "p", "t", 0, off)
    for i in range(40):
        log.append([b"v" * 200] * 3, keys=[b"k", None, b"j"])
    with pytest.raises(NoKeyIndexError, match="topic t keeps no key index .keyIndex=false."):
        lookup.by_key(log, b"k")
    msg_id = int(log.read_arrow(5, 6).column("msgId")[0].as_py())
    assert lookup.by_msg_id(log, msg_id).offsets == [5]  # message ids need no key index
    log.close()
    assert not list((tmp_path / "p").glob("*.keys"))
    # turned on later: the sealed segments' key indexes are built from the log when first needed
    log = PartitionLog.open(tmp_path / "p", "t", 0, SMALL)
    assert lookup.by_key(log, b"k", max_answers=1000).offsets == expected(scan(log), b"k", n=1000)
    log.close()
    assert len(list((tmp_path / "p").glob("*.keys"))) == len(list((tmp_path / "p").glob("*.meta")))
    # and off again: the files stay for the sealed segments, whose bytes never change
    log = PartitionLog.open(tmp_path / "p", "t", 0, off)
    log.append([b"more"], keys=[b"k"])
    log.close()
    log = PartitionLog.open(tmp_path / "p", "t", 0, SMALL)
    assert lookup.by_key(log, b"k", max_answers=1000).offsets == expected(scan(log), b"k", n=1000)
    log.close()


def test_a_stale_key_index_of_a_cut_segment_is_never_used(tmp_path):
    """A sealed segment cut by a replica's truncation and filled again with other bytes of the same size:
    its old ``.keys`` goes with the cut, so the new bytes are indexed, not the old ones."""
    log = PartitionLog.open(tmp_path / "p", "t", 0, SMALL)
    for i in range(30):
        log.append([b"v" * 100] * 3, keys=[b"old-%d" % (i % 10)] * 3)
    first = log.segments()[0]
    assert first.path.with_suffix(".keys").exists()
    log.truncate_to(first.base_offset + 3)
    assert not first.path.with_suffix(".keys").exists()
    for i in range(30):
        log.append([b"v" * 100] * 3, keys=[b"new-%d" % (i % 10)] * 3)
    log.close()
    log = PartitionLog.open(tmp_path / "p", "t", 0, SMALL)
    rows = scan(log)
    for key in (b"old-0", b"old-1", b"new-0", b"new-5"):
        assert lookup.by_key(log, key, max_answers=1000).offsets == expected(rows, key, n=1000)
    log.close()


def test_bad_queries_name_the_problem(tmp_path):
    log = PartitionLog.open(tmp_path / "p", "t", 0, SMALL)
    log.append([b"v"], keys=[b"k"])
    with pytest.raises(InvalidQueryError, match=r"since \(2000 ms\) is after until \(1000 ms\)"):
        lookup.by_key(log, b"k", 2000, 1000)
    with pytest.raises(InvalidQueryError, match="a key is bytes, got str"):
        lookup.by_key(log, "k")
    with pytest.raises(InvalidQueryError, match="positive integer, got 0"):
        lookup.by_key(log, b"k", max_answers=0)
    log.close()


def test_the_active_segments_index_is_built_per_batch_as_the_log_would_rebuild_it(tmp_path):
    log = PartitionLog.open(tmp_path / "p", "t", 0, TopicConfig())
    rng = random.Random(3)
    for i in range(50):
        n = rng.randint(1, 40)
        log.append([b"v"] * n, keys=[rng.choice(KEYS + [None]) for _ in range(n)])
        body = records.encode_body([b"w"] * 2, keys=[b"k", None])
        log.append_body(records.parse_body(body.count, body.attributes, b"".join(map(bytes, body.parts)), body.crc))
    seg = log._segments[-1]
    assert b"".join(map(bytes, seg.keys.encode(seg.size))) == b"".join(map(bytes, seg.build_keys().encode(seg.size)))
    log.close()


def test_sealed_key_indexes_are_written_outside_the_write_lock_and_mapped_when_used(tmp_path):
    log = PartitionLog.open(tmp_path / "p", "t", 0, SMALL)
    for i in range(40):
        log.append([b"v" * 200] * 3, keys=[b"k%d" % i] * 3)
    sealed = log._segments[:-1]
    assert sealed and all(s.keys is None and s.keys_path.exists() for s in sealed)  # written, let go
    assert lookup.by_key(log, b"k0").offsets == [2, 1, 0]
    assert isinstance(sealed[0].keys.columns()[0], np.memmap)
    assert not list(log.directory.glob("*.tmp"))
    log.close()


def test_a_key_index_never_spans_more_than_2_to_the_32_offsets(tmp_path, monkeypatch):
    from metaq_broker.store import partition
    monkeypatch.setattr(partition, "MAX_SEGMENT_OFFSETS", 10)
    log = PartitionLog.open(tmp_path / "p", "t", 0, TopicConfig())
    for i in range(7):
        log.append([b"v"] * 3, keys=[b"k"] * 3)
    assert [s.count for s in log.segments()] == [9, 9, 3]
    assert lookup.by_key(log, b"k", max_answers=100).offsets == list(range(20, -1, -1))
    log.close()


def test_the_keys_of_a_batch_body_are_views_of_it():
    body = records.encode_body([b"a", b"b", b"c"], keys=[b"k1", None, b"k333"])
    data, starts, lengths = records.body_keys(body)
    assert lengths.tolist() == [2, -1, 4]
    assert bytes(data[starts[0]:starts[0] + 2]) == b"k1" and bytes(data[starts[2]:starts[2] + 4]) == b"k333"
    raw = b"".join(map(bytes, body.parts))
    parsed = records.parse_body(body.count, body.attributes, raw, body.crc)
    data, starts, lengths = records.body_keys(parsed)
    assert lengths.tolist() == [2, -1, 4]
    assert [bytes(data[s:s + n]) for s, n in zip(starts, lengths) if n >= 0] == [b"k1", b"k333"]
    assert records.body_keys(records.encode_body([b"a"])) is None
    assert records.body_keys(records.encode_body([b"a"], keys=[None])) is None
