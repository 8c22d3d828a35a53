"""Concurrent appends and reads on one partition, under group commit and under unflushThreshold mode.

Thread timing varies from run to run; every assertion holds whatever the interleaving."""
import random
import sys
import threading
from collections import defaultdict

import pytest

from metaq_broker.store import MessageStore, TopicConfig
from metaq_broker.store import offset_index

pytestmark = pytest.mark.unit

THREADS = 8
MODES = {
    "group_commit": dict(unflush_threshold=0),
    "unflush": dict(unflush_threshold=50, unflush_interval_ms=1000),
}


@pytest.fixture(autouse=True)
def fast_thread_switches():
    """Switch threads far more often than the default 5 ms, to shake out more interleavings."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


def value(tid, batch, i, k, pad=0):
    return f"{tid}:{batch}:{i}:{k}:".encode() + b"#" * pad


def parse(v):
    tid, batch, i, k = v.split(b":")[:4]
    return int(tid), int(batch), int(i), int(k)


def run_threads(targets):
    errors = []

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)
        return run

    threads = [threading.Thread(target=guard(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "threads hung"
    assert errors == [], errors


def make_writer(p, tid, batches, start, results, pad=0, max_k=5):
    rng = random.Random(tid)

    def write():
        start.wait()
        for b in range(batches):
            k = rng.randint(1, max_k)
            vals = [value(tid, b, i, k, pad) for i in range(k)]
            r = p.append(vals, keys=[b"%d" % tid] * k, attributes=[f"t{tid}"] * k, flags=[tid * 1000 + b] * k)
            visible = p.last_stable_offset  # an acknowledged append is readable at once
            got = p.read_arrow(r.base_offset, r.base_offset + r.count).column("value").to_pylist()
            results.append((tid, b, vals, r, visible, got))
    return write


def read_all(p, latest=None):
    """Every message in [earliest, latest) as (offset, value, msgId), batch run by batch run."""
    latest = p.last_stable_offset if latest is None else latest
    out, off = [], p.earliest_offset
    while off < latest:
        res = p.read(off, max_bytes=1 << 16, max_messages=latest - off)
        assert off < res.end_offset <= latest
        batch = res.decode()
        offsets = batch.column("offset").to_pylist()
        assert offsets == list(range(off, res.end_offset))
        out += zip(offsets, batch.column("value").to_pylist(), batch.column("msgId").to_pylist())
        off = res.end_offset
    return out


def check_final_log(p, results, threads, batches):
    n = sum(r.count for (_, _, _, r, _, _) in results)
    assert len(results) == threads * batches
    assert p.last_stable_offset == n
    final = read_all(p)
    offsets = [o for o, _, _ in final]
    assert offsets == list(range(n))  # no gaps, no duplicates
    values = [v for _, v, _ in final]
    expected = [v for (_, _, vals, _, _, _) in results for v in vals]
    assert len(set(values)) == n and sorted(values) == sorted(expected)  # each value exactly once
    ids = [m for _, _, m in final]
    assert all(a < b for a, b in zip(ids, ids[1:]))  # msgIds unique and increasing with offset
    for tid, b, vals, r, visible, got in results:
        assert r.count == len(vals)
        assert values[r.base_offset: r.base_offset + r.count] == vals  # the batch landed where reported
        assert ids[r.base_offset: r.base_offset + r.count] == list(r.msg_ids)
        assert visible >= r.base_offset + r.count
        assert got == vals
    per_thread = defaultdict(list)
    for v in values:
        tid, b, i, k = parse(v)
        per_thread[tid].append((b, i))
    for tid, seen in per_thread.items():
        assert seen == sorted(seen)  # each thread's messages in the order it appended them
        assert len(seen) == len(set(seen))
    return final


@pytest.mark.parametrize("mode", list(MODES))
def test_concurrent_appends_give_a_dense_log_with_each_value_once(tmp_path, clock, mode):
    batches = 60
    with MessageStore(tmp_path, {"t": TopicConfig(**MODES[mode])}, background_interval=None, clock=clock) as s:
        p = s.partition("t", 0)
        start, results = threading.Barrier(THREADS), []
        run_threads([make_writer(p, tid, batches, start, results) for tid in range(THREADS)])
        final = check_final_log(p, results, THREADS, batches)
        rows = read_columns(p)
        for (o, v, m), row in zip(final, rows):
            tid, b, i, k = parse(v)
            assert (row["offset"], row["value"], row["msgId"]) == (o, v, m)
            assert (row["key"], row["attribute"], row["flag"]) == (b"%d" % tid, f"t{tid}", tid * 1000 + b)
        n = len(final)
    with MessageStore(tmp_path, {"t": TopicConfig(**MODES[mode])}, background_interval=None, clock=clock) as s:
        assert read_all(s.partition("t", 0)) == final  # and all of it was on disk at close
        assert s.partition("t", 0).last_stable_offset == n


def read_columns(p):
    rows, off = [], 0
    while off < p.last_stable_offset:
        res = p.read(off)
        rows += res.decode().to_pylist()
        off = res.end_offset
    return rows


def make_reader(p, stop, passes):
    def read():
        last_latest = 0
        while True:
            done = stop.is_set()
            latest = p.last_stable_offset
            assert latest >= last_latest  # the visible end never moves back
            last_latest = latest
            seen = read_all(p, latest)
            assert [o for o, _, _ in seen] == list(range(latest))
            # whole batches only: every batch seen is complete
            counts = defaultdict(int)
            for _, v, _ in seen:
                tid, b, i, k = parse(v)
                counts[(tid, b, k)] += 1
            assert all(c == k for (tid, b, k), c in counts.items()), "partial batch"
            passes.append(seen)
            if done:
                return
    return read


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("segment_size", [None, 4096])
def test_readers_see_a_prefix_of_the_final_log_while_writers_append(tmp_path, clock, mode, segment_size):
    batches = 40
    config = TopicConfig(**MODES[mode], **({"max_segment_size": segment_size} if segment_size else {}))
    with MessageStore(tmp_path, {"t": config}, background_interval=None, clock=clock) as s:
        p = s.partition("t", 0)
        writers = 6
        start, results, stop = threading.Barrier(writers), [], threading.Event()
        passes_a, passes_b = [], []
        writer_fns = [make_writer(p, tid, batches, start, results, pad=40) for tid in range(writers)]

        def writers_then_stop():
            try:
                run_threads(writer_fns)
            finally:
                stop.set()

        run_threads([writers_then_stop, make_reader(p, stop, passes_a), make_reader(p, stop, passes_b)])
        final = check_final_log(p, results, writers, batches)
        if segment_size:
            assert len(p.segments()) > 3
        for passes in (passes_a, passes_b):
            assert passes and passes[-1] == final  # the last pass started after every append returned
            for seen in passes:
                assert seen == final[: len(seen)]  # same message at the same offset, msgId included


@pytest.mark.parametrize("mode", list(MODES))
def test_concurrent_appends_across_segment_rolls(tmp_path, clock, mode):
    batches = 30
    config = TopicConfig(max_segment_size=4096, **MODES[mode])
    with MessageStore(tmp_path, {"t": config}, background_interval=None, clock=clock) as s:
        p = s.partition("t", 0)
        start, results = threading.Barrier(THREADS), []
        run_threads([make_writer(p, tid, batches, start, results, pad=150, max_k=3) for tid in range(THREADS)])
        final = check_final_log(p, results, THREADS, batches)
        segs = p.segments()
        assert len(segs) > 10
        for a, b in zip(segs, segs[1:]):
            assert a.start + a.size == b.start
            assert a.base_offset + a.count == b.base_offset
            assert a.size <= 4096
            assert a.path.stat().st_size == a.size
            size = offset_index.HEADER_SIZE + 32 * a.index_entries  # header, entries
            assert a.path.with_suffix(".index").stat().st_size == size
        assert segs[0].base_offset == 0 and segs[-1].base_offset + segs[-1].count == len(final)
        assert p.verify() == []
        layout = [(x.path.name, x.base_offset, x.count, x.size) for x in segs]
    with MessageStore(tmp_path, {"t": config}, background_interval=None, clock=clock) as s:
        p = s.partition("t", 0)
        assert [(x.path.name, x.base_offset, x.count, x.size) for x in p.segments()] == layout
        assert read_all(p) == final


def test_concurrent_appends_to_two_partitions_share_unique_msg_ids(tmp_path, clock):
    batches = 40
    with MessageStore(tmp_path, {"t": TopicConfig(num_partitions=2)}, background_interval=None, clock=clock) as s:
        parts = [s.partition("t", 0), s.partition("t", 1)]
        start = threading.Barrier(THREADS)
        results = [[], []]
        run_threads([make_writer(parts[tid % 2], tid, batches, start, results[tid % 2]) for tid in range(THREADS)])
        all_ids = []
        for p, res in zip(parts, results):
            final = check_final_log(p, res, THREADS // 2, batches)
            all_ids += [m for _, _, m in final]
        assert len(all_ids) == len(set(all_ids))


def test_a_topic_being_created_is_not_listed_before_all_its_partitions_are_open(tmp_path, monkeypatch):
    """Another thread listing topics while one is created (a broker answering ListTopics or Metadata, a
    producer racing to create it) must not see the topic before its partitions exist: it used to be listed
    first, and ``partitions``/``describe`` then failed with "there is no partition 0"."""
    store = MessageStore(tmp_path / "data", {})
    seen = []
    opening = store._open_partition

    def watched(topic, p, config):
        seen.append((p, "t" in store.topics()))
        return opening(topic, p, config)
    monkeypatch.setattr(store, "_open_partition", watched)
    try:
        store.create_topic("t", TopicConfig(num_partitions=3))
        assert seen == [(0, False), (1, False), (2, False)]
        assert "t" in store.topics() and len(store.partitions("t")) == 3
    finally:
        store.close()
