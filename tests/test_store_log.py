"""Partition log semantics: segments, reads with budgets, index lookups, ids, flush policies and
visibility, and the store facade."""
import os
import re
import threading
import time

import numpy as np
import pytest
from conftest import wait_until

from metaq_broker.errors import InvalidTopicError
from metaq_broker.store import MessageStore, PartitionLog, TopicConfig
from metaq_broker.store.segment import SEGMENT_HEADER_SIZE

pytestmark = pytest.mark.unit


def open_log(path, config=TopicConfig(), **kw):
    return PartitionLog.open(path, "t", 0, config, **kw)


def test_segments_are_named_by_start_position_contiguous_and_roll_at_max_size(tmp_path):
    log = open_log(tmp_path, TopicConfig(max_segment_size=4096))
    for i in range(200):
        log.append([b"v" * 50, b"w" * 30])
    segs = log.segments()
    assert len(segs) > 3
    for seg in segs:
        assert re.fullmatch(r"\d{20}\.meta", seg.path.name) and int(seg.path.stem) == seg.start
        assert seg.size <= 4096
        assert seg.path.stat().st_size == seg.size
    for a, b in zip(segs, segs[1:]):
        assert a.start + a.size == b.start
        assert a.base_offset + a.count == b.base_offset
    assert segs[0].start == 0 and segs[0].base_offset == 0
    log.close()


def test_a_batch_larger_than_a_segment_gets_a_segment_of_its_own(tmp_path):
    log = open_log(tmp_path, TopicConfig(max_segment_size=4096))
    log.append([b"small"])
    r = log.append([b"x" * 3000, b"y" * 3000])
    log.append([b"after"])
    segs = log.segments()
    assert [s.count for s in segs] == [1, 2, 1]
    assert segs[1].size > 4096
    assert log.read_arrow(r.base_offset, r.base_offset + 2).column("value").to_pylist() == [b"x" * 3000, b"y" * 3000]
    log.close()


def test_reads_return_whole_batches_within_the_byte_budget_and_at_least_one(tmp_path):
    log = open_log(tmp_path)
    for b in range(10):
        log.append([b"%d-%d" % (b, i) + b"." * 100 for i in range(10)])  # 10 batches of 10 messages
    res = log.read(15, max_bytes=1)  # over budget: still the whole first batch, from offset 15 to 20
    assert (res.start_offset, res.end_offset) == (15, 20)
    assert res.decode().column("offset").to_pylist() == list(range(15, 20))
    one = log.read(10, max_bytes=1).data.size
    res = log.read(10, max_bytes=3 * one)
    assert (res.end_offset, res.data.size) == (40, 3 * one)
    res = log.read(10, max_bytes=3 * one - 1)
    assert res.end_offset == 30
    res = log.read(12, max_bytes=10 ** 9, max_messages=5)  # cut mid-batch: the decode keeps 12..16
    assert res.end_offset == 17
    assert res.decode().column("value").to_pylist() == [b"1-%d" % i + b"." * 100 for i in range(2, 7)]
    assert len(res.batch_positions) == 1
    assert log.read(100).end_offset == 100 and log.read(100).data.size == 0
    log.close()


def test_reads_stop_at_segment_ends(tmp_path):
    log = open_log(tmp_path, TopicConfig(max_segment_size=4096))
    for i in range(100):
        log.append([b"m%03d" % i + b"-" * 60])
    first = log.segments()[0]
    res = log.read(0, max_bytes=10 ** 9)
    assert res.end_offset == first.count
    assert log.read(res.end_offset).start_offset == first.count
    log.close()


def test_offset_for_timestamp(tmp_path, clock):
    log = open_log(tmp_path, TopicConfig(max_segment_size=4096), clock=clock)
    stamps = []
    for i in range(60):
        clock.advance(1)
        stamps.append(int(clock.now * 1000))
        log.append([b"a" * 40, b"b" * 40])
    assert log.offset_for_timestamp(0) == 0
    assert log.offset_for_timestamp(stamps[0]) == 0
    assert log.offset_for_timestamp(stamps[0] + 1) == 2
    assert log.offset_for_timestamp(stamps[37]) == 74
    assert log.offset_for_timestamp(stamps[-1] + 1) == log.last_stable_offset == 120
    assert len(log.segments()) > 1
    log.close()


def test_store_time_never_goes_backwards(tmp_path, clock):
    log = open_log(tmp_path, clock=clock)
    log.append([b"a"])
    clock.advance(-3600)  # the wall clock steps back an hour
    log.append([b"b"])
    ts = log.read_arrow(0).column("timestamp").cast("int64").to_pylist()
    assert ts[0] == ts[1] == int((clock.now + 3600) * 1000)
    log.close()


def test_byte_lookups_match_the_stored_sizes(tmp_path):
    log = open_log(tmp_path, TopicConfig(max_segment_size=4096))
    sizes = []
    for i in range(80):
        value, key = b"v" * (i % 13), b"k" * (i % 5)
        log.append([value], keys=[key], attributes=["attr"])
        sizes.append(len(value) + len(key) + 4 + 3)  # three i8 length entries (no flags: no flag column)
    cum = np.cumsum([0] + sizes)
    assert log.range_bytes(0, 80) == cum[-1]
    assert log.range_bytes(17, 61) == cum[61] - cum[17]
    assert log.range_bytes(5, 5) == 0
    for budget in (0, 1, 100, 1000, 2000):
        after = log.offset_after_bytes(10, budget)
        assert cum[after] - cum[10] <= budget
        assert after == 80 or cum[after + 1] - cum[10] > budget
    assert log.position(0) == SEGMENT_HEADER_SIZE
    assert log.position(80) == log.segments()[-1].start + log.segments()[-1].size
    log.close()


def test_message_ids_are_unique_and_increasing_across_reopen_and_clock_steps(tmp_path, clock):
    log = open_log(tmp_path, clock=clock)
    log.append([b"a"] * 5)
    log.close()
    clock.advance(-86400)  # restarted with a clock a day behind
    log = open_log(tmp_path, clock=clock)
    log.append([b"b"] * 5)
    ids = log.read_arrow(0).column("msgId").to_pylist()
    assert ids == sorted(set(ids)) and len(ids) == 10
    log.close()


class FsyncSpy:
    """Wraps os.fsync to count calls (and optionally hold them), to observe when data is made durable."""

    def __init__(self, monkeypatch, delay=0.0):
        self.calls = 0
        self.paths = set()  # of the files fsynced
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()
        self.real = os.fsync
        monkeypatch.setattr(os, "fsync", self)

    def __call__(self, fd):
        self.gate.wait()
        if self.delay:
            time.sleep(self.delay)
        self.calls += 1
        self.paths.add(os.readlink(f"/proc/self/fd/{fd}"))
        self.real(fd)


def test_group_commit_acknowledges_only_after_an_fsync(tmp_path, monkeypatch):
    log = open_log(tmp_path)
    spy = FsyncSpy(monkeypatch)
    for i in range(5):
        before = spy.calls
        log.append([b"x"])
        assert spy.calls == before + 1
    log.close()


def test_group_commit_hides_unflushed_messages_from_readers(tmp_path, monkeypatch):
    log = open_log(tmp_path)
    log.append([b"first"])
    spy = FsyncSpy(monkeypatch)
    spy.gate.clear()  # the next fsync blocks
    t = threading.Thread(target=log.append, args=([b"second"],))
    t.start()
    deadline = time.time() + 5
    while log.segments()[-1].count < 2 and time.time() < deadline:
        time.sleep(0.01)
    assert log.segments()[-1].count == 2  # written to the file...
    assert log.last_stable_offset == 1  # ...but not acknowledged, so not visible
    assert log.read(1).data.size == 0
    spy.gate.set()
    t.join(5)
    assert log.last_stable_offset == 2
    assert log.read_arrow(1).column("value").to_pylist() == [b"second"]
    log.close()


def test_group_commit_shares_one_fsync_among_waiting_appends(tmp_path, monkeypatch):
    log = open_log(tmp_path)
    spy = FsyncSpy(monkeypatch, delay=0.005)
    threads = [threading.Thread(target=lambda: [log.append([b"x"]) for _ in range(25)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert log.last_stable_offset == 200
    assert spy.calls < 100, f"{spy.calls} fsyncs for 200 appends"
    log.close()


def test_unflush_threshold_fsyncs_by_count(tmp_path, monkeypatch, clock):
    log = open_log(tmp_path, TopicConfig(unflush_threshold=3, unflush_interval_ms=10 ** 6), clock=clock)
    spy = FsyncSpy(monkeypatch)
    assert not log.append([b"a"]).fsynced
    assert not log.append([b"b"]).fsynced
    assert spy.calls == 0 and log.last_stable_offset == 2  # acknowledged and visible before any fsync
    assert log.append([b"c"]).fsynced  # this append reached the threshold: fsynced before its ack
    assert spy.calls == 1
    log.append([b"d", b"e", b"f"])
    assert spy.calls == 2
    log.close()


def test_unflush_threshold_one_fsyncs_every_append(tmp_path, monkeypatch):
    log = open_log(tmp_path, TopicConfig(unflush_threshold=1))
    spy = FsyncSpy(monkeypatch)
    for i in range(4):
        log.append([b"a"])
        assert spy.calls == i + 1
    log.close()


def test_unflush_interval_fsyncs_by_time(tmp_path, monkeypatch, clock):
    log = open_log(tmp_path, TopicConfig(unflush_threshold=1000, unflush_interval_ms=500), clock=clock)
    spy = FsyncSpy(monkeypatch)
    log.append([b"a"])
    assert spy.calls == 0
    assert not log.flush_if_due()
    clock.advance(0.6)
    assert log.flush_if_due() and spy.calls == 1
    assert not log.flush_if_due()
    clock.advance(0.6)
    log.append([b"b"])  # the interval is also checked on append
    assert spy.calls == 2
    log.close()


def test_store_opens_topics_found_on_disk_and_keeps_all_partitions(tmp_path):
    with MessageStore(tmp_path, {"orders": TopicConfig(num_partitions=3), "my.topic-x": TopicConfig()},
                      background_interval=None) as store:
        store.append("orders", 2, [b"o2"])
        store.append("my.topic-x", 0, [b"x0"])
        store.create_topic("runtime", TopicConfig(num_partitions=2))
        store.append("runtime", 1, [b"r1"])
        with pytest.raises(InvalidTopicError, match="already exists with 2 partitions"):
            store.create_topic("runtime", TopicConfig(num_partitions=5))
        assert store.create_topic("runtime", TopicConfig(num_partitions=2)).num_partitions == 2
    (tmp_path / "not-a-partition-dir").mkdir()
    (tmp_path / "stray.txt").write_text("x")
    # Reopen with a config that knows only one topic, with fewer partitions than on disk.
    with MessageStore(tmp_path, {"orders": TopicConfig(num_partitions=1)}, background_interval=None) as store:
        assert store.topics() == ["my.topic-x", "orders", "runtime"]
        assert store.topic_config("orders").num_partitions == 3
        assert store.read("orders", 2, 0).decode().column("value").to_pylist() == [b"o2"]
        assert store.partition("my.topic-x", 0).read_arrow(0).column("value").to_pylist() == [b"x0"]
        assert store.partition("runtime", 1).last_stable_offset == 1


def test_background_thread_flushes_interval_topics(tmp_path, monkeypatch, clock):
    """The store's clock stands still until the append is made: on a real one, a loaded machine let 50 ms
    pass before it, so the append found its interval due, fsynced itself and waited on the closed gate
    for ever (a full run hung here)."""
    with MessageStore(tmp_path, {"t": TopicConfig(unflush_threshold=10 ** 6, unflush_interval_ms=50)},
                      background_interval=0.02, clock=clock) as store:
        spy = FsyncSpy(monkeypatch)
        spy.gate.clear()  # fsyncs wait: the append below is acknowledged, not yet durable
        p = store.partition("t", 0)
        store.append("t", 0, [b"a"])
        assert p.recovery_point == 0 and spy.calls == 0
        spy.gate.set()
        clock.advance(1.0)  # its interval has passed: the background thread's next round fsyncs it
        # nothing but the background thread fsyncs now (no append, flush or close follows)
        wait_until(lambda: p.recovery_point == 1, timeout=5, what="the background fsync covering the append")
        assert spy.calls >= 1 and str(p.segments()[-1].path) in spy.paths
