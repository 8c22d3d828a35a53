"""Create-time ranges through the store-time index (``PartitionLog.offsets_for_create_times``, the segments'
skew bounds in ``offset_index``): the offsets it gives never leave out a message whose create time is in the
range, whatever the producers' clocks say, and they narrow what a reader reads when the clocks are sane.

The adversary's model: every message's time as a reader decodes it (its create time, or its batch's store
time without one), read from the log, checked against the answer for many ranges: across segment rolls,
create times before, after and equal to store times, batches without create times, a producer whose clock
is years off, a segment whose bounds are unknown (an index written before the bounds), a torn tail cut by
recovery, and a replica's truncation."""
from __future__ import annotations

import struct

import numpy as np
import pyarrow.compute as pc
import pytest

from conftest import FakeClock
from metaq_broker.protocol.records import crc
from metaq_broker.store import PartitionLog, TopicConfig
from metaq_broker.store import offset_index

pytestmark = pytest.mark.unit

T0 = 1_700_000_000_000  # ms: the fake clock's start


@pytest.mark.parametrize("since, until, skews, lowest, highest", [
    (1000, None, (0, 0), 1000, None),
    (1000, 2000, (-5, 7), 993, 2005),  # a message created at 1000 with skew 7 was stored at 993
    (None, 2000, (-(1 << 62), 0), None, 2000 + (1 << 62)),
    (0, 0, offset_index.UNKNOWN_SKEW, -(1 << 62), 1 << 62),
    (-(1 << 63), (1 << 63) - 1, (-10, 10), -(1 << 63), (1 << 63) - 1),  # clamped to i64
])
def test_store_time_bounds(since, until, skews, lowest, highest):
    assert offset_index.store_time_bounds(since, until, *skews) == (lowest, highest)


def test_skew_bounds_of_batches_hold_zero_and_every_batch():
    b = np.zeros(3, offset_index.BATCH_DTYPE)
    b["min_skew"], b["max_skew"] = [3, -4, 5], [9, -1, 6]
    assert offset_index.skew_bounds(b) == (-4, 9)
    assert offset_index.skew_bounds(b[:1]) == (0, 9)  # the bounds always hold 0
    assert offset_index.skew_bounds(b[:0], (-2, 3)) == (-2, 3)


def times(p: PartitionLog) -> tuple:
    """(offsets, each message's time as a reader sees it) of the whole partition, from the log."""
    offsets, ts = [], []
    o = p.earliest_offset
    while o < p.last_stable_offset:
        batch = p.read_arrow(o)
        offsets.append(batch.column("offset").to_numpy())
        ts.append(pc.cast(batch.column("timestamp"), "int64").to_numpy())
        o = int(offsets[-1][-1]) + 1
    return (np.concatenate(offsets), np.concatenate(ts)) if offsets else (np.zeros(0, int), np.zeros(0, int))


def check(p: PartitionLog, rng, rounds: int = 300) -> list:
    """Every answer for ``rounds`` ranges holds every message whose time is in the range; returns the
    answers' widths (offsets read) for ranges selecting messages."""
    offsets, ts = times(p)
    lo_t, hi_t = int(ts.min()) - 50, int(ts.max()) + 50
    widths = []
    for _ in range(rounds):
        a, b = sorted(int(x) for x in rng.integers(lo_t, hi_t, 2))
        since, until = [(a, b), (a, None), (None, b), (a, a)][int(rng.integers(4))]
        low, high = p.offsets_for_create_times(since, until)
        assert p.earliest_offset <= low <= high <= p.last_stable_offset
        hit = offsets[((ts >= since) if since is not None else True) & ((ts <= until) if until is not None else True)]
        if len(hit):
            assert low <= hit.min() and hit.max() < high, (since, until, low, high, hit.min(), hit.max())
            widths.append(high - low)
    return widths


def fill(p: PartitionLog, clock: FakeClock, rng, batches: int = 120, skew_ms=(-300, 300), wild: tuple = ()):
    """Batches a second apart; create times around the store time (``skew_ms``), some batches without create
    times, the batches numbered in ``wild`` created by a clock ten years off (either way)."""
    for i in range(batches):
        clock.advance(1)
        n = int(rng.integers(1, 20))
        now = int(clock() * 1000)
        if i % 5 == 0:
            stamps = None  # no create times: the store time is the message's time
        elif i in wild:
            stamps = [now + (1 if i % 2 else -1) * 10 * 365 * 86400 * 1000 + j for j in range(n)]
        else:
            stamps = (now + rng.integers(*skew_ms, n)).tolist()
            stamps[0] = now  # one equal to the store time
        p.append([b"v%d" % j for j in range(n)], timestamps=stamps)


def test_answers_hold_every_match_and_narrow_across_segments(tmp_path):
    clock, rng = FakeClock(), np.random.default_rng(7)
    p = PartitionLog.open(tmp_path, "t", 0, TopicConfig(max_segment_size=4096, index_interval_bytes=256), clock=clock)
    fill(p, clock, rng, batches=300)
    assert len(p.segments()) > 5
    assert check(p, rng)
    total = p.last_stable_offset - p.earliest_offset
    for t in range(T0 + 10_000, T0 + 290_000, 20_000):  # a range of 3 s of 300 reads little more than 3 s
        low, high = p.offsets_for_create_times(t, t + 3000)
        assert high - low < total / 30, (t, low, high)
    segs = p._segments
    assert all(s.skew[0] >= -300 and s.skew[1] <= 300 for s in segs)
    # Past the last message's time by more than any skew: nothing can qualify, nothing is read; before the
    # first, likewise.
    last, first = int(times(p)[1].max()), int(times(p)[1].min())
    assert p.offsets_for_create_times(last + 1000, None) == (p.last_stable_offset,) * 2
    assert p.offsets_for_create_times(None, first - 1000) == (p.earliest_offset,) * 2
    p.close()
    p = PartitionLog.open(tmp_path, "t", 0, TopicConfig(max_segment_size=4096), clock=clock)  # bounds from the files
    assert [s.skew for s in p._segments[:-1]] == [s.skew for s in segs[:-1]]
    assert check(p, rng) and p.verify() == []
    p.close()


def test_a_producer_clock_years_off_still_gives_every_match(tmp_path):
    clock, rng = FakeClock(), np.random.default_rng(11)
    p = PartitionLog.open(tmp_path, "t", 0, TopicConfig(max_segment_size=4096, index_interval_bytes=256), clock=clock)
    fill(p, clock, rng, wild=(33, 34, 81))
    check(p, rng)
    offsets, ts = times(p)
    for t in np.unique(ts[(ts < T0) | (ts > T0 + 10 ** 9)]).tolist():  # each wild time alone
        low, high = p.offsets_for_create_times(t, t)
        assert all(low <= o < high for o in offsets[ts == t])
    # Segments without wild messages still narrow: a range in the middle reads far less than the whole.
    mid = int(np.median(ts))
    low, high = p.offsets_for_create_times(mid, mid + 2000)
    wild_segments = [s for s in p._segments if s.skew[1] - s.skew[0] > 10 ** 9]
    assert wild_segments and high - low < sum(s.count for s in p._segments) - min(s.count for s in wild_segments)
    p.close()


def write_v1(path, summary: offset_index.Summary, entries) -> None:
    """An index file as the version before the skew bounds wrote it (MQINDEX1, 96-byte header)."""
    entries = np.ascontiguousarray(entries, offset_index.ENTRY_DTYPE)
    s = summary
    head = offset_index.HEADER_V1.pack(b"MQINDEX1", s.base_offset, s.start, s.size, s.next_offset, s.bytes,
                                       s.last_timestamp, s.last_position, s.first_msg_id, s.last_msg_id, s.interval,
                                       len(entries), crc(memoryview(entries).cast("B")))
    path.write_bytes(head + struct.pack("<I", crc(head)) + entries.tobytes())


def test_an_index_from_before_the_bounds_narrows_nothing_in_its_segment(tmp_path):
    clock, rng = FakeClock(), np.random.default_rng(3)
    config = TopicConfig(max_segment_size=4096, index_interval_bytes=256)
    p = PartitionLog.open(tmp_path, "t", 0, config, clock=clock)
    fill(p, clock, rng, skew_ms=(-2000, 2000))
    old = p._segments[2]
    p.close()
    summary, entries = offset_index.load(old.index_path, old.base_offset, old.start, old.size, None,
                                         old.start + 32)
    write_v1(old.index_path, summary, np.array(entries))
    p = PartitionLog.open(tmp_path, "t", 0, config, clock=clock)
    seg = p._segments[2]
    assert seg.skew == offset_index.UNKNOWN_SKEW and p.verify() == []  # unknown bounds are sound bounds
    check(p, rng)
    # A range before the old segment's messages: the old segment may hold anything, so it is read from its
    # start on; a range after it: up to its end.
    first_t = int(times(p)[1].min())
    assert p.offsets_for_create_times(None, first_t)[1] >= seg.next_offset
    assert p.offsets_for_create_times(first_t + 10 ** 7, None)[0] <= seg.base_offset
    p.close()


def test_a_torn_tail_and_a_truncation_keep_the_bounds_sound(tmp_path):
    clock, rng = FakeClock(), np.random.default_rng(5)
    config = TopicConfig(max_segment_size=1 << 20, index_interval_bytes=256, unflush_threshold=1)
    p = PartitionLog.open(tmp_path, "t", 0, config, clock=clock)
    fill(p, clock, rng, batches=30)
    clock.advance(1)
    now = int(clock() * 1000)
    p.append([b"far"] * 3, timestamps=[now + 10 ** 9] * 3)  # the last batch: a clock far ahead
    assert p._segments[-1].skew[1] >= 10 ** 9
    tail = p._segments[-1].path
    p.close()
    with open(tail, "r+b") as f:  # tear the last batch
        f.truncate(tail.stat().st_size - 16)
    p = PartitionLog.open(tmp_path, "t", 0, config, clock=clock)
    assert p._segments[-1].skew[1] < 10 ** 9  # recomputed from the batches that survived
    check(p, rng)
    # A replica's truncation keeps the (wider) bounds of what was cut; answers stay sound, and new appends widen.
    fill(p, clock, rng, batches=10, skew_ms=(-50_000, 50_000))
    before = p._segments[-1].skew
    p.truncate_to(p.last_stable_offset - 30)
    assert p._segments[-1].skew == before
    check(p, rng)
    fill(p, clock, rng, batches=5, skew_ms=(100_000, 200_000))
    assert p._segments[-1].skew[1] >= 100_000
    check(p, rng)
    assert p.verify() == []
    p.close()


def test_a_replica_copy_carries_the_bounds(tmp_path):
    clock, rng = FakeClock(), np.random.default_rng(9)
    config = TopicConfig(max_segment_size=4096, index_interval_bytes=256)
    master = PartitionLog.open(tmp_path / "m", "t", 0, config, clock=clock)
    fill(master, clock, rng, wild=(7,))
    replica = PartitionLog.open(tmp_path / "r", "t", 0, config, clock=clock)
    o = 0
    while o < master.log_end_offset:
        r = master.read(o, 1 << 16)
        replica.append_replicated(r.data, r.batch_positions)
        o = r.end_offset
    assert [s.skew for s in replica._segments] == [s.skew for s in master._segments]
    for since, until in [(T0, T0 + 5000), (T0 + 60_000, None), (None, T0 + 30_000)]:
        end = master.log_end_offset  # the replica publishes nothing by itself (no high watermark here)
        assert replica.offsets_for_create_times(since, until, end) == master.offsets_for_create_times(since, until)
    master.close()
    replica.close()


def test_a_rebuilt_index_has_the_bounds_its_log_makes(tmp_path):
    clock, rng = FakeClock(), np.random.default_rng(13)
    config = TopicConfig(max_segment_size=4096, index_interval_bytes=256)
    p = PartitionLog.open(tmp_path, "t", 0, config, clock=clock)
    fill(p, clock, rng, skew_ms=(-5000, 9000), wild=(3,))
    skews = [s.skew for s in p._segments[:-1]]
    damaged = p._segments[1].index_path
    p.close()
    damaged.write_bytes(b"\0" * 100)  # rebuilt from the log on open
    p = PartitionLog.open(tmp_path, "t", 0, config, clock=clock)
    assert [s.skew for s in p._segments[:-1]] == skews and skews[1] != (0, 0)
    check(p, rng)
    p.close()
