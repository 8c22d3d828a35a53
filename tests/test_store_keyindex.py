"""The key index (``store/keyindex.py``), before the partition uses it: every lookup equals a brute-force
scan of what was indexed.

The adversary's model is a plain list of (offset, key). Lookups by key within an offset range, newest
first, at most N, are compared with it: with keys that repeat, null keys, keys that share a slot (a
one-slot table) and keys that share the whole hash (a hash that looks at the length only), after
truncation and more appends, across several segments' indexes, and after a write and a read of the file.
An index built batch by batch equals, byte for byte, one rebuilt from a real partition's log; time
ranges go through the partition's time index.
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FakeClock
from metaq_broker.errors import InvalidQueryError
from metaq_broker.protocol import records
from metaq_broker.store import PartitionLog, TopicConfig
from metaq_broker.store import keyindex
from metaq_broker.store.keyindex import IndexProblem, KeyIndex, hash_key, lookup, offset_range

pytestmark = pytest.mark.unit

keys_st = st.lists(st.one_of(st.none(), st.binary(max_size=90)), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(keys=keys_st, cut=st.integers(0, 5))
def test_the_compiled_hash_is_the_one_key_hash(keys, cut):
    arr = pa.array(keys, pa.binary()).slice(min(cut, len(keys) - 1))  # a slice: the array's offset is not 0
    listed = arr.to_pylist()
    for form in (arr, arr.cast(pa.large_binary()), listed):
        index = KeyIndex(100, 0)
        index.add(100, form)
        hashes, _, offsets = index.columns()
        assert offsets.tolist() == [i for i, k in enumerate(listed) if k is not None]
        assert hashes.tolist() == [hash_key(k) >> 32 for k in listed if k is not None]


def test_the_hash_tells_apart_keys_that_differ_only_in_padding_or_length():
    keys = [b"", b"\0", b"\0" * 8, b"ab", b"ab\0", b"a" * 64, b"a" * 65, b"a" * 63 + b"b"]
    assert len({hash_key(k) for k in keys}) == len(keys)


class Model:
    """What was indexed: (offset, key) in offset order."""

    def __init__(self):
        self.rows = []

    def answers(self, key, lo, hi, n):
        return [o for o, k in reversed(self.rows) if k == key and lo <= o < hi][:n]

    def read_keys(self, offsets):
        found = dict(self.rows)
        return [found.get(o) for o in offsets]


alphabet = [b"order-4711", b"order-4712", b"a", b"", b"x" * 70, None]
batches_st = st.lists(st.lists(st.sampled_from(alphabet), min_size=1, max_size=30), min_size=1, max_size=25)


def build(batches, base=0, model=None, max_bits=keyindex.MAX_SLOT_BITS, gap=0):
    index, model = KeyIndex(base, 0, max_bits), model or Model()
    offset = base
    for keys in batches:
        index.add(offset, pa.array(keys, pa.binary()))
        model.rows += [(offset + i, k) for i, k in enumerate(keys) if k is not None]
        offset += len(keys) + gap  # gap: offsets of markers, which have no keys
    return index, model, offset


def check(indexes, model, rng, end):
    for key in alphabet[:-1]:
        for _ in range(4):
            lo, hi = sorted(int(x) for x in rng.integers(0, end + 2, 2))
            n = int(rng.integers(1, 8))
            assert lookup(indexes, key, lo, hi, model.read_keys, n) == model.answers(key, lo, hi, n)
        assert lookup(indexes, key, 0, end, model.read_keys) == model.answers(key, 0, end, 64)
    assert lookup(indexes, b"never", 0, end, model.read_keys) == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=batches_st, more=batches_st, bits=st.sampled_from([0, 1, 3, keyindex.MAX_SLOT_BITS]),
       cut=st.floats(0, 1), gap=st.integers(0, 2), seed=st.integers(0, 2 ** 16))
def test_lookups_equal_a_scan_with_collisions_truncation_and_segments(batches, more, bits, cut, gap, seed):
    rng = np.random.default_rng(seed)
    index, model, end = build(batches, max_bits=bits, gap=gap)
    check([index], model, rng, end)
    # a replica's cut, then more appends
    at, covered = int(cut * end), index.next_offset
    index.truncate(at)
    model.rows = [(o, k) for o, k in model.rows if o < at]
    assert index.next_offset == min(at, covered)
    check([index], model, rng, at)
    second, model, end = build(more, at, model, bits, gap)  # the next segment's index
    assert index.size == sum(1 for o, _ in model.rows if o < at)
    check([index, second], model, rng, end)
    with tempfile.TemporaryDirectory(prefix="keyindex-test-") as d:  # a sealed segment's, from its file
        index.write(Path(d) / "a.keys")
        loaded = KeyIndex.load(Path(d) / "a.keys", 0, 0)
        assert (loaded.next_offset, loaded.size, loaded.slot_bits) == (index.next_offset, index.size, index.slot_bits)
        check([loaded, second], model, rng, end)


def colliding_keys():
    """Two keys whose indexed hashes (32 bits) are equal: among 300 000 keys there are about ten such pairs."""
    keys = [b"c%d" % i for i in range(300_000)]
    index = KeyIndex(0, 0)
    index.add(0, keys)
    hashes = index.columns()[0]
    order = np.argsort(hashes, kind="stable")
    same = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])[0]
    a, b = keys[order[same]], keys[order[same + 1]]
    assert a != b and hash_key(a) >> 32 == hash_key(b) >> 32
    return a, b


def test_keys_that_share_the_whole_hash_are_told_apart_by_the_log():
    a, b = colliding_keys()
    index, model, end = build([[a, b, b"x", a], [b] * 3, [b"zz", a]])
    reads = []

    def read_keys(offsets):
        reads.append(list(offsets))
        return model.read_keys(offsets)

    assert lookup([index], a, 0, end, read_keys) == [8, 3, 0]
    assert reads and all(set(r) <= {0, 1, 3, 4, 5, 6, 8} for r in reads)  # b's offsets were read and dropped
    assert lookup([index], a, 0, end, read_keys, 2) == [8, 3]
    assert lookup([index], b, 0, end, read_keys, 2) == [6, 5]
    assert lookup([index], b"cc", 0, end, read_keys) == []


def test_a_message_the_log_no_longer_returns_is_not_an_answer():
    index, model, end = build([[b"k", b"k", b"k"]])
    aborted = {1}  # e.g. an aborted transaction's message: the reader returns nothing there
    answers = lookup([index], b"k", 0, end, lambda offs: [None if o in aborted else b"k" for o in offs])
    assert answers == [2, 0]


def test_a_long_chain_is_finished_by_a_scan_of_the_range(monkeypatch):
    monkeypatch.setattr(keyindex, "_WALK_STEPS", 5)
    index, model, end = build([[b"hot"] * 50, [b"cold"], [b"hot"] * 50], max_bits=0)
    assert lookup([index], b"hot", 10, 60, model.read_keys, 64) == model.answers(b"hot", 10, 60, 64)
    assert lookup([index], b"cold", 0, end, model.read_keys) == [50]


def test_bad_queries_are_refused_naming_the_problem():
    index, model, _ = build([[b"k"]])
    with pytest.raises(InvalidQueryError, match=r"since \(2000 ms\) is after until \(1000 ms\)"):
        offset_range(2000, 1000, lambda t: 0, 0, 10)
    with pytest.raises(InvalidQueryError, match=r"until must be a time in ms since the epoch, got '1 h'"):
        offset_range(None, "1 h", lambda t: 0, 0, 10)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(InvalidQueryError, match=re.escape(f"got {bad!r}")):
            lookup([index], b"k", 0, 1, model.read_keys, bad)
    with pytest.raises(ValueError, match="cannot follow"):
        index.add(0, pa.array([b"older than what is indexed"]))


def test_a_damaged_or_foreign_file_is_refused(tmp_path):
    index, _, _ = build([[b"a", b"b", None, b"a"]] * 3)
    path = tmp_path / "s.keys"
    index.write(path)
    good = path.read_bytes()
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(IndexProblem, match="belongs to offset 0, start 0; the segment is offset 5"):
        KeyIndex.load(path, 5, 0)
    for at, problem in ((3, "bad header"), (len(good) - 1, "checksums"), (keyindex.HEADER_SIZE + 7, "checksums")):
        raw = bytearray(good)
        raw[at] ^= 0x20
        path.write_bytes(bytes(raw))
        with pytest.raises(IndexProblem, match=problem):
            KeyIndex.load(path, 0, 0)
    path.write_bytes(good[:-12])
    with pytest.raises(IndexProblem, match="bytes for 2\\^10 slots and 9 entries"):
        KeyIndex.load(path, 0, 0)
    path.unlink()
    with pytest.raises(IndexProblem, match="is missing"):
        KeyIndex.load(path, 0, 0)
    path.write_bytes(good)
    loaded = KeyIndex.load(path, 0, 0)
    with pytest.raises(ValueError, match="does not change"):
        loaded.add(100, pa.array([b"a"]))
    copy = loaded.writable_copy()  # a sealed segment that a truncation makes the tail again
    copy.truncate(6)
    copy.add(6, pa.array([b"b"]))
    assert lookup([copy], b"b", 0, 10, lambda offs: [b"b"] * len(offs)) == [6, 5, 1]


def test_the_table_grows_and_chains_stay_short(monkeypatch):
    index, model, end = build([[b"k%d" % i for i in range(j * 1000, j * 1000 + 1000)] for j in range(20)])
    assert index.size == 20_000 and index.slot_bits == 14  # 20 000 entries, at most 4 per slot: 2^14 slots
    chains = np.bincount(index.columns()[0] >> np.uint32(32 - index.slot_bits), minlength=1 << index.slot_bits)
    assert chains.mean() <= keyindex.LOAD and chains.max() < 20
    check([index], model, np.random.default_rng(0), end)


def keyed_log(directory: Path, clock: FakeClock):
    """A partition with keyed batches, a transaction (aborted) and its marker, and segment rolls."""
    p = PartitionLog.open(directory, "t", 0, TopicConfig(max_segment_size=4096), clock=clock)
    for i in range(40):
        clock.advance(1)
        p.append([b"v" * 50] * 3, keys=[b"order-%d" % (i % 7), None, b"order-%d" % (i % 3)])
        if i % 10 == 5:
            body = records.encode_body([b"t"], keys=[b"order-1"])
            p.append_bodies([body], txn=9 + i, flags=records.TRANSACTIONAL)
            p.append_marker(9 + i, commit=False)
    return p


def decoded_keys(p: PartitionLog, seg, aborted=None):
    """(offsets, keys) of every keyed message of a segment, markers left out, from the log."""
    end = seg.base_offset + seg.count
    offsets, keys, o = [], [], seg.base_offset
    while o < end:
        r = p.read(o, 1 << 20, end=end)
        batch = records.decode(r.data, r.start_offset, r.end_offset, aborted=aborted)
        offsets += batch.column("offset").to_pylist()
        keys += batch.column("key").to_pylist()
        o = r.end_offset
    return offsets, keys


def test_an_index_built_batch_by_batch_is_the_one_rebuilt_from_the_log(tmp_path):
    clock = FakeClock()
    p = keyed_log(tmp_path / "log", clock)
    segs = p._segments
    assert len(segs) >= 3
    for seg in segs:
        offsets, keys = decoded_keys(p, seg)
        at_once = KeyIndex(seg.base_offset, seg.start)
        at_once.add(offsets, pa.array(keys, pa.binary()), seg.base_offset + seg.count)
        by_batch = KeyIndex(seg.base_offset, seg.start)
        for i in range(0, len(keys), 3):  # as appends would add them: a batch at a time
            by_batch.add(offsets[i: i + 3], pa.array(keys[i: i + 3], pa.binary()))
        by_batch.add(offsets[:0], pa.array([], pa.binary()), seg.base_offset + seg.count)
        assert b"".join(map(bytes, at_once.encode())) == b"".join(map(bytes, by_batch.encode()))
    p.close()


def test_time_ranges_through_the_partitions_time_index(tmp_path):
    clock = FakeClock()
    p = keyed_log(tmp_path / "log", clock)
    indexes, model = [], Model()
    for seg in p._segments:
        offsets, keys = decoded_keys(p, seg)
        index = KeyIndex(seg.base_offset, seg.start)
        index.add(offsets, pa.array(keys, pa.binary()), seg.base_offset + seg.count)
        indexes.append(index)
        model.rows += [(o, k) for o, k in zip(offsets, keys) if k is not None]
    aborted = p.aborted_in(p.earliest_offset, p.visible_end)
    readable = {o for seg in p._segments for o in decoded_keys(p, seg, aborted)[0]}

    def read_keys(offsets):  # as a reader sees the log: an aborted transaction's messages are not there
        return [k if o in readable else None for o, k in zip(offsets, model.read_keys(offsets))]

    stamps = {o: p.timestamp_at(o) for o, _ in model.rows}
    for since, until in ((None, None), (stamps[9], stamps[40]), (stamps[40], stamps[40]), (None, stamps[3]),
                         (stamps[60], None), (stamps[60] + 1, stamps[60] + 1)):
        lo, hi = offset_range(since, until, p.offset_for_timestamp, p.earliest_offset, p.last_stable_offset)
        for key in (b"order-1", b"order-2", b"order-6"):
            want = [o for o, k in reversed(model.rows) if k == key and o in readable
                    and (since is None or stamps[o] >= since) and (until is None or stamps[o] <= until)]
            assert lookup(indexes, key, lo, hi, read_keys, 10) == want[:10], (since, until, key)
    p.close()
