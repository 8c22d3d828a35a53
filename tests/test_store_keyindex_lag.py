"""The key index behind the log (``KeyIndex.defer``): an append queues its batch's keys and the indexer
thread applies them later, so the index may lag the log. Its promises, each against an adversary:

* a lookup finds every message a reader could read when it began, queued or applied: a model of the
  partition's keys (hypothesis, the indexer held back and let run at chosen moments, truncations, markers,
  receive buffers overwritten after the append) and threads that look up their own keys right after
  each append returns while others append across segment rolls, under both flush policies;
* a crash that leaves the log ahead of its index (the queue never applied, a sealed segment's file never
  written) loses nothing: recovery rebuilds the tail's index and a lookup a sealed segment's;
* a queued append that cannot be applied is never dropped: every reader of the index fails on it;
* the queue is bounded: past ``MAX_LAG_KEYS`` the appender applies it itself.
"""
from __future__ import annotations

import random
import shutil
import sys
import threading

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FakeClock
from metaq_broker.protocol import records
from metaq_broker.store import PartitionLog, TopicConfig
from metaq_broker.store import keyindex, lookup
from metaq_broker.store.keyindex import KeyIndex

pytestmark = pytest.mark.unit

SMALL = TopicConfig(max_segment_size=4096, retention_bytes=-1)


@pytest.fixture
def held(monkeypatch):
    """The indexer thread held back: the indexes handed to it, none applied until the test says."""
    handed = []
    monkeypatch.setattr(keyindex._INDEXER, "schedule", handed.append)
    return handed


def received(values, keys):
    """A batch body as the broker parses it from a receive buffer, and that buffer (which a connection
    fills again with its next request)."""
    body = records.encode_body(values, keys)
    buffer = bytearray(b"".join(bytes(p) for p in body.parts))
    return records.parse_body(body.count, body.attributes, memoryview(buffer), body.crc), buffer


KEYS = [b"a", b"b", b"order-4711", b"x" * 20, b""]
ops_st = st.lists(st.one_of(
    st.tuples(st.just("append"), st.lists(st.sampled_from(KEYS + [None]), min_size=1, max_size=12)),
    st.tuples(st.just("marker")),
    st.tuples(st.just("run")),
    st.tuples(st.just("truncate"), st.integers(0, 40)),
    st.tuples(st.just("lookup"), st.sampled_from(KEYS), st.integers(0, 60), st.integers(0, 60), st.integers(1, 5)),
), max_size=40)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops_st, bits=st.sampled_from([0, keyindex.MAX_SLOT_BITS]))
def test_lookups_equal_the_model_whatever_the_indexer_has_applied(held, ops, bits):
    index, model, end = KeyIndex(0, 0, max_slot_bits=bits), {}, 0  # model: offset -> key (None: no key)
    for op in ops:
        if op[0] == "append":
            body, buffer = received([b"v"] * len(op[1]), op[1])
            index.defer(end, body.count, body)
            buffer[:] = b"\xff" * len(buffer)  # the connection's next request
            model.update((end + i, k) for i, k in enumerate(op[1]))
            end += len(op[1])
        elif op[0] == "marker":
            index.defer(end, 1, None)
            end += 1
        elif op[0] == "run":
            index.catch_up()
            assert not index._pending
        elif op[0] == "truncate":
            end = min(op[1], end)
            index.truncate(end)
            model = {o: k for o, k in model.items() if o < end}
        else:
            _, key, lo, hi, n = op
            want = sorted((o for o, k in model.items() if k == key and lo <= o < hi), reverse=True)[:n]
            got = keyindex.lookup([index], key, lo, hi, lambda offsets: [model.get(o) for o in offsets], n)
            assert got == want
        assert index.next_offset == end
    inline = KeyIndex(0, 0, max_slot_bits=bits)  # the same appends, indexed as they came
    inline.add(sorted(model), [model[o] for o in sorted(model)], end)
    assert b"".join(map(bytes, index.encode())) == b"".join(map(bytes, inline.encode()))


def test_a_lookup_applies_the_appends_the_indexer_has_not(tmp_path, held):
    log = PartitionLog.open(tmp_path / "p", "t", 0, SMALL)
    offsets = [log.append([b"v" * 50] * 3, keys=[b"k%d" % i, None, b"common"]).base_offset for i in range(100)]
    assert held and any(seg.keys is not None and seg.keys._pending for seg in log._segments)
    assert len(log.segments()) > 3  # sealing applied the queue of each segment it sealed
    for i in (0, 57, 99):
        assert lookup.by_key(log, b"k%d" % i).offsets == [offsets[i]]
    assert lookup.by_key(log, b"common", max_answers=1000).offsets == [o + 2 for o in reversed(offsets)]
    assert not log._segments[-1].keys._pending
    log.close()


def test_a_crash_with_the_index_behind_the_log_loses_no_answer(tmp_path, held):
    """The directory as a crash leaves it: every batch written, the tail's queue never applied, the last
    sealed segments' files never written; recovery and the first lookup rebuild them from the log."""
    log = PartitionLog.open(tmp_path / "p", "t", 0, SMALL)
    offsets = [log.append([b"v" * 80] * 4, keys=[b"k%d" % (i % 7), b"u%d" % i, None, b"k%d" % (i % 7)]).base_offset
               for i in range(60)]
    assert log._segments[-1].keys._pending
    (tmp_path / "p").joinpath(sorted(p.name for p in (tmp_path / "p").glob("*.keys"))[-1]).unlink()
    shutil.copytree(tmp_path / "p", tmp_path / "crash")
    log.close()
    log = PartitionLog.open(tmp_path / "crash", "t", 0, SMALL)
    for i in (0, 31, 59):
        assert lookup.by_key(log, b"u%d" % i).offsets == [offsets[i] + 1]
    for k in range(7):
        want = sorted([o for i, o in enumerate(offsets) if i % 7 == k for o in (o, o + 3)], reverse=True)
        assert lookup.by_key(log, b"k%d" % k, max_answers=1000).offsets == want
    log.close()


def test_an_append_that_cannot_be_applied_stays_queued_and_fails_every_reader(held):
    index = KeyIndex(0, 0)
    index.add(0, [b"a", b"b"])
    index.defer(1, 1, records.encode_body([b"v"], [b"c"]))  # a caller's bug: offset 1 is indexed already
    for read in (index.catch_up, lambda: index.next_offset, lambda: index.candidates(keyindex.hash_key(b"a"), 0, 9, 9),
                 index.encode, lambda: index.truncate(1)):
        with pytest.raises(ValueError, match="cannot follow"):
            read()
    assert len(index._pending) == 1


def test_the_queue_is_bounded_the_appender_applies_it_past_the_limit(tmp_path, held, monkeypatch):
    monkeypatch.setattr(keyindex, "MAX_LAG_KEYS", 25)
    log = PartitionLog.open(tmp_path / "p", "t", 0, TopicConfig())
    for i in range(20):
        log.append([b"v"] * 10, keys=[b"k%d" % i] * 10)
        keys = log._segments[-1].keys
        assert keys._queued_keys - keys._applied_keys <= 25 + 10
    assert keys._applied_keys >= 150
    log.close()


@pytest.mark.parametrize("mode", [dict(unflush_threshold=0), dict(unflush_threshold=7, unflush_interval_ms=1000)],
                         ids=["group_commit", "unflush"])
def test_each_acknowledged_append_is_found_at_once_while_others_append_and_roll(tmp_path, mode):
    """The real indexer thread. Writers look their own keys up as soon as each append returns; a reader
    looks up keys others had acknowledged before its lookup began. Small segments: rolls, seals and
    key index files written meanwhile."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    log = PartitionLog.open(tmp_path / "p", "t", 0, TopicConfig(max_segment_size=8192, **mode), clock=FakeClock())
    acked, errors, done = [], [], threading.Event()

    def writer(w):
        rng = random.Random(w)
        for b in range(60):
            keys = [b"w%d-%d-%d" % (w, b, i) if rng.random() < 0.8 else None for i in range(rng.randint(1, 30))]
            r = log.append([b"v" * rng.randint(0, 60)] * len(keys), keys=keys)
            for i, k in enumerate(keys):
                if k is not None:
                    assert lookup.by_key(log, k).offsets == [r.base_offset + i], k
                    acked.append((k, r.base_offset + i))

    def reader():
        rng = random.Random(9)
        while not done.is_set():
            for k, offset in rng.sample(acked, min(len(acked), 20)):
                assert lookup.by_key(log, k).offsets == [offset], k

    def guard(fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        writers = [threading.Thread(target=guard, args=(writer, w)) for w in range(4)]
        readers = [threading.Thread(target=guard, args=(reader,)) for _ in range(2)]
        for t in writers + readers:
            t.start()
        for t in writers:
            t.join(120)
        done.set()
        for t in readers:
            t.join(120)
        assert not any(t.is_alive() for t in writers + readers), "threads hung"
        assert errors == []
        assert len(log.segments()) > 5
        for k, offset in acked:
            assert lookup.by_key(log, k).offsets == [offset]
    finally:
        sys.setswitchinterval(old)
        log.close()


def test_keys_in_a_buffer_used_again_after_the_append_are_indexed_as_appended(tmp_path, held):
    """An Arrow key column over a caller's buffer (as a zero-copy decode makes), overwritten once the append
    returned and before the indexer ran: the index holds the keys as they were written."""
    buffer = bytearray(b"k1k22")
    keys = pa.Array.from_buffers(pa.binary(), 3, [None, pa.py_buffer(np.array([0, 2, 2, 5], np.int32).tobytes()),
                                                  pa.py_buffer(buffer)])
    log = PartitionLog.open(tmp_path / "p", "t", 0, TopicConfig())
    log.append([b"v", b"w", b"x"], keys=keys)
    buffer[:] = b"zzzzz"
    assert lookup.by_key(log, b"k1").offsets == [0]
    assert lookup.by_key(log, b"").offsets == [1]
    assert lookup.by_key(log, b"k22").offsets == [2]
    log.close()
