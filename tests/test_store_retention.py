"""Retention (MetaQ's deletePolicy and a size bound) with a fake clock and 4 KiB segments, and the timing
of timed flushes in unflushThreshold mode."""
import gzip

import pytest

from metaq_broker.errors import OffsetOutOfRangeError
from metaq_broker.protocol import records
from metaq_broker.store import MessageStore, TopicConfig
from metaq_broker.store.segment import SEGMENT_HEADER_SIZE

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0  # the conftest clock's start
MIN = 60
HOUR = 3600
BATCH = 1080  # one message per batch (big): 72 + 2 (an i16 value length) + 1004 bytes, padded to 1080
SEALED = SEGMENT_HEADER_SIZE + 3 * BATCH  # a sealed segment of three batches
ACTIVE = SEGMENT_HEADER_SIZE + BATCH


def big(i: int) -> bytes:
    return b"%04d" % i + b"." * 1000  # one message per batch: BATCH bytes


def ms(seconds: float) -> int:
    return int(seconds * 1000)


def open_store(path, clock, **config):
    config.setdefault("max_segment_size", 4096)
    return MessageStore(path, {"t": TopicConfig(**config)}, background_interval=None, clock=clock)


def build(p, clock):
    """Segments A..D of offsets 0-2, 3-5, 6-8, 9-11 written at T0, +10, +20, +30 minutes, and the active
    segment E holding offset 12, written at +40 minutes."""
    assert clock() == T0
    for group in range(4):
        for j in range(3):
            p.append([big(3 * group + j)])
        clock.advance(10 * MIN)
    p.append([big(12)])
    segs = p.segments()
    assert [(s.base_offset, s.count, s.size, s.last_timestamp) for s in segs] == [
        (0, 3, SEALED, ms(T0)), (3, 3, SEALED, ms(T0 + 10 * MIN)), (6, 3, SEALED, ms(T0 + 20 * MIN)),
        (9, 3, SEALED, ms(T0 + 30 * MIN)), (12, 1, ACTIVE, ms(T0 + 40 * MIN))]
    return segs


def dump(p):
    rows, off, latest = [], p.earliest_offset, p.last_stable_offset
    while off < latest:
        res = p.read(off, max_bytes=1 << 20)
        rows += res.decode().to_pylist()
        off = res.end_offset
    return rows


def values(p, start=None):
    start = p.earliest_offset if start is None else start
    return [r["value"] for r in dump(p) if r["offset"] >= start]


def files(p):
    """Segment and index files (the partition's transaction snapshot is not a segment)."""
    return sorted(f.name for f in p.directory.iterdir() if f.suffix in (".meta", ".index"))


def seg_files(segs):
    """Each segment's log, and the index of each sealed one (the active segment's is in memory)."""
    return sorted([s.path.name for s in segs] + [s.path.with_suffix(".index").name for s in segs[:-1]])


# ---------------------------------------------------------------------------------------------------
# delete,<hours>


def test_delete_removes_exactly_the_sealed_segments_older_than_the_cutoff(tmp_path, clock):
    with open_store(tmp_path, clock, delete_policy="delete,1") as s:
        p = s.partition("t", 0)
        segs = build(p, clock)
        before = dump(p)
        assert files(p) == seg_files(segs)
        # cutoff = now - 1h = T0 + 10 min + 1 ms: A (last message at T0) and B (T0 + 10 min) are older
        removed = p.apply_retention(ms(T0 + HOUR + 10 * MIN) + 1)
        assert [(r.base_offset, r.count, r.path, r.size, r.last_timestamp) for r in removed] == [
            (0, 3, segs[0].path, SEALED, ms(T0)), (3, 3, segs[1].path, SEALED, ms(T0 + 10 * MIN))]
        assert (p.earliest_offset, p.last_stable_offset) == (6, 13)
        assert [x.base_offset for x in p.segments()] == [6, 9, 12]
        assert files(p) == seg_files(segs[2:])
        assert dump(p) == before[6:]
        assert p.apply_retention(ms(T0 + HOUR + 10 * MIN) + 1) == []


def test_a_segment_whose_last_message_is_exactly_at_the_cutoff_is_kept(tmp_path, clock):
    with open_store(tmp_path, clock, delete_policy="delete,1") as s:
        p = s.partition("t", 0)
        build(p, clock)
        now = ms(T0 + HOUR + 10 * MIN)  # cutoff == B's last timestamp
        assert [r.base_offset for r in p.apply_retention(now)] == [0]
        assert p.earliest_offset == 3
        assert [r.base_offset for r in p.apply_retention(now + 1)] == [3]
        assert p.earliest_offset == 6
        assert p.apply_retention(now - HOUR * 1000) == []


def test_fractional_hours_and_the_store_clock(tmp_path, clock):
    with open_store(tmp_path, clock, delete_policy="delete,0.25") as s:  # 15 minutes
        p = s.partition("t", 0)
        build(p, clock)  # the clock now reads T0 + 40 min: the cutoff is T0 + 25 min
        assert [r.base_offset for r in s.run_retention()] == [0, 3, 6]
        assert p.earliest_offset == 9
        clock.advance(5 * MIN)  # cutoff T0 + 30 min == D's last message: kept
        assert s.run_retention() == []
        assert p.earliest_offset == 9
        clock.advance(0.01)
        assert [r.base_offset for r in s.run_retention()] == [9]
        assert p.earliest_offset == 12
        assert values(p) == [big(12)]


def test_the_active_segment_stays_even_when_everything_is_expired(tmp_path, clock):
    with open_store(tmp_path, clock, delete_policy="delete,1") as s:
        p = s.partition("t", 0)
        segs = build(p, clock)
        clock.advance(100 * HOUR)
        removed = p.apply_retention()
        assert [r.base_offset for r in removed] == [0, 3, 6, 9]
        assert [x.base_offset for x in p.segments()] == [12]
        assert files(p) == seg_files(segs[4:])
        assert (p.earliest_offset, p.last_stable_offset) == (12, 13)
        assert p.read_arrow(12).column("value").to_pylist() == [big(12)]
        assert p.apply_retention() == []
        r = p.append([b"more"])
        assert r.base_offset == 13
        assert p.read_arrow(12).column("value").to_pylist() == [big(12), b"more"]
        assert p.apply_retention(ms(T0 + 1000 * HOUR)) == []
        assert p.earliest_offset == 12


def test_a_single_segment_partition_is_never_emptied(tmp_path, clock):
    with open_store(tmp_path, clock, delete_policy="delete,1", retention_bytes=1) as s:
        p = s.partition("t", 0)
        p.append([b"a", b"b"])
        p.append([b"c"])
        assert p.apply_retention(ms(T0 + 1000 * HOUR)) == []
        assert (p.earliest_offset, p.last_stable_offset) == (0, 3)
        assert values(p) == [b"a", b"b", b"c"]


def test_run_retention_covers_every_partition_of_every_topic(tmp_path, clock):
    config = TopicConfig(max_segment_size=4096, delete_policy="delete,1", num_partitions=2)
    with MessageStore(tmp_path, {"t": config, "u": config.with_(num_partitions=1)}, background_interval=None,
                      clock=clock) as s:
        for group in range(3):
            for name, n in (("t", 0), ("t", 1), ("u", 0)):
                for j in range(3):
                    s.append(name, n, [big(3 * group + j)])
            clock.advance(HOUR)
        # each partition: A (T0), B (T0 + 1h), C (active, T0 + 2h); now T0 + 3h, cutoff T0 + 2h
        removed = s.run_retention()
        assert sorted((r.path.parent.name, r.base_offset) for r in removed) == [
            ("t-0", 0), ("t-0", 3), ("t-1", 0), ("t-1", 3), ("u-0", 0), ("u-0", 3)]
        for name, n in (("t", 0), ("t", 1), ("u", 0)):
            p = s.partition(name, n)
            assert (p.earliest_offset, p.last_stable_offset) == (6, 9)
            assert values(p) == [big(6), big(7), big(8)]


# ---------------------------------------------------------------------------------------------------
# archive,<hours>


def test_archive_gzips_the_exact_segment_bytes_then_removes_segment_and_index(tmp_path, clock):
    with open_store(tmp_path, clock, delete_policy="archive,1") as s:
        p = s.partition("t", 0)
        segs = build(p, clock)
        original = {seg.path.name: seg.path.read_bytes() for seg in segs[:2]}
        assert all(len(b) == SEALED for b in original.values())
        before = dump(p)
        removed = p.apply_retention(ms(T0 + HOUR + 10 * MIN) + 1)
        assert [r.base_offset for r in removed] == [0, 3]
        archive = p.directory / "archive"
        assert sorted(f.name for f in archive.iterdir()) == sorted(name + ".gz" for name in original)
        assert sorted(f.name for f in archive.iterdir()) == ["00000000000000000000.meta.gz",
                                                              "%020d.meta.gz" % SEALED]
        for name, data in original.items():
            assert gzip.decompress((archive / (name + ".gz")).read_bytes()) == data
        assert files(p) == seg_files(segs[2:])
        assert not segs[0].path.exists() and not segs[0].path.with_suffix(".index").exists()
        assert (p.earliest_offset, p.last_stable_offset) == (6, 13)
        assert dump(p) == before[6:]


def test_archive_names_use_the_segment_start_position(tmp_path, clock):
    with open_store(tmp_path, clock, delete_policy="archive,1") as s:
        p = s.partition("t", 0)
        build(p, clock)
        p.apply_retention(ms(T0 + 100 * HOUR))
        assert sorted(f.name for f in (p.directory / "archive").iterdir()) == [
            "%020d.meta.gz" % (SEALED * k) for k in range(4)]


def test_archive_folder_is_ignored_when_reopening_and_later_archives_add_to_it(tmp_path, clock):
    with open_store(tmp_path, clock, delete_policy="archive,1") as s:
        p = s.partition("t", 0)
        segs = build(p, clock)
        originals = {seg.path.name: seg.path.read_bytes() for seg in segs}
        p.apply_retention(ms(T0 + HOUR + 10 * MIN) + 1)
        before = dump(p)
        archive = p.directory / "archive"
        archived = {f.name: f.read_bytes() for f in archive.iterdir()}
        assert len(archived) == 2
    with open_store(tmp_path, clock, delete_policy="archive,1") as s:
        p = s.partition("t", 0)
        assert (p.earliest_offset, p.last_stable_offset) == (6, 13)
        assert dump(p) == before
        assert {f.name: f.read_bytes() for f in archive.iterdir()} == archived
        assert p.verify() == []
        removed = p.apply_retention(ms(T0 + HOUR + 30 * MIN) + 1)
        assert [r.base_offset for r in removed] == [6, 9]
        assert sorted(f.name for f in archive.iterdir()) == sorted(name + ".gz" for name in list(originals)[:4])
        for name, data in list(originals.items())[:4]:
            assert gzip.decompress((archive / (name + ".gz")).read_bytes()) == data
        assert (p.earliest_offset, p.last_stable_offset) == (12, 13)
        assert values(p) == [big(12)]


# ---------------------------------------------------------------------------------------------------
# The size bound


@pytest.mark.parametrize("bound,kept", [
    (1, [12]),
    (ACTIVE, [12]),
    (ACTIVE + 1, [9, 12]),
    (SEALED * 2 + ACTIVE, [6, 9, 12]),  # removing B leaves exactly the bound: still >= it
    (SEALED * 2 + ACTIVE + 1, [3, 6, 9, 12]),
    (SEALED * 4 + ACTIVE - 1, [0, 3, 6, 9, 12]),
    (SEALED * 4 + ACTIVE, [0, 3, 6, 9, 12]),
    (10 ** 9, [0, 3, 6, 9, 12]),
])
def test_size_bound_removes_oldest_segments_while_the_rest_still_reaches_the_bound(tmp_path, clock, bound, kept):
    with open_store(tmp_path, clock, retention_bytes=bound) as s:  # deletePolicy is the default 168 hours
        p = s.partition("t", 0)
        segs = build(p, clock)
        total = sum(x.size for x in segs)
        removed = p.apply_retention()
        assert [r.base_offset for r in removed] == [b for b in (0, 3, 6, 9) if b not in kept]
        assert [x.base_offset for x in p.segments()] == kept
        assert p.size_bytes == sum(x.size for x in segs if x.base_offset in kept)
        if removed:
            assert p.size_bytes >= bound
        else:
            assert p.size_bytes == total
        if kept[0] != 12:  # removing the next segment too would go below the bound
            assert p.size_bytes - SEALED < bound
        assert (p.earliest_offset, p.last_stable_offset) == (kept[0], 13)
        assert values(p) == [big(i) for i in range(kept[0], 13)]
        assert files(p) == seg_files([x for x in segs if x.base_offset in kept])


def test_size_bound_and_age_together(tmp_path, clock):
    with open_store(tmp_path, clock, retention_bytes=SEALED * 2 + ACTIVE, delete_policy="delete,1") as s:
        p = s.partition("t", 0)
        build(p, clock)
        # nothing is an hour old yet: the size bound alone removes A and B
        assert [r.base_offset for r in p.apply_retention(ms(T0 + 30 * MIN))] == [0, 3]
        # C is within the bound but older than the cutoff
        assert [r.base_offset for r in p.apply_retention(ms(T0 + HOUR + 20 * MIN) + 1)] == [6]
        assert p.earliest_offset == 9
        assert values(p) == [big(i) for i in range(9, 13)]


def test_reading_below_the_new_earliest_names_it(tmp_path, clock):
    with open_store(tmp_path, clock, retention_bytes=SEALED * 2 + ACTIVE) as s:
        p = s.partition("t", 0)
        build(p, clock)
        p.apply_retention()
        assert p.earliest_offset == 6
        for bad in (0, 3, 5):
            with pytest.raises(OffsetOutOfRangeError) as info:
                p.read(bad)
            assert (info.value.offset, info.value.earliest, info.value.latest) == (bad, 6, 13)
            assert "6 (earliest)" in str(info.value) and "13 (latest" in str(info.value)
            with pytest.raises(OffsetOutOfRangeError, match=r"6 \(earliest\)"):
                p.read_arrow(bad)
            with pytest.raises(OffsetOutOfRangeError, match=r"6 \(earliest\)"):
                s.read("t", 0, bad)
        assert p.read_arrow(6, 7).column("value").to_pylist() == [big(6)]
        assert p.offset_for_timestamp(0) == 6
        assert p.offset_for_timestamp(ms(T0 + 30 * MIN)) == 9
        assert p.position(6) == 2 * SEALED + SEGMENT_HEADER_SIZE


# ---------------------------------------------------------------------------------------------------
# Reopening and readers


@pytest.mark.parametrize("policy", ["delete,1", "archive,1"])
def test_reopening_after_retention_gives_the_same_log(tmp_path, clock, policy):
    with open_store(tmp_path, clock, delete_policy=policy) as s:
        p = s.partition("t", 0)
        build(p, clock)
        p.apply_retention(ms(T0 + HOUR + 20 * MIN) + 1)
        state = (p.earliest_offset, p.last_stable_offset,
                 [(x.path.name, x.base_offset, x.count, x.size, x.last_timestamp) for x in p.segments()], dump(p))
        assert state[:2] == (9, 13)
        last_id = state[3][-1]["msgId"]
    with open_store(tmp_path, clock, delete_policy=policy) as s:
        p = s.partition("t", 0)
        assert (p.earliest_offset, p.last_stable_offset,
                [(x.path.name, x.base_offset, x.count, x.size, x.last_timestamp) for x in p.segments()], dump(p)) == state
        r = p.append([b"after"])
        assert r.base_offset == 13 and r.base_msg_id > last_id
        with pytest.raises(OffsetOutOfRangeError, match=r"9 \(earliest\)"):
            p.read(8)
        # sealed segments opened from disk are removable; the reopened active one is not
        assert [x.base_offset for x in p.apply_retention(ms(T0 + 100 * HOUR))] == [9]
        assert values(p) == [big(12), b"after"]
    with open_store(tmp_path, clock, delete_policy=policy) as s:
        p = s.partition("t", 0)
        assert (p.earliest_offset, p.last_stable_offset) == (12, 14)
        assert values(p) == [big(12), b"after"]


def test_readers_holding_data_or_a_snapshot_from_before_retention_can_still_decode(tmp_path, clock):
    with open_store(tmp_path, clock, delete_policy="delete,1") as s:
        p = s.partition("t", 0)
        build(p, clock)
        original_b = p.segments()[1].path.read_bytes()
        fetch_a = p.read(0)
        fetch_b = p.read(4, max_messages=1)
        assert (fetch_a.start_offset, fetch_a.end_offset) == (0, 3)
        segs, end = p._snapshot(0)  # what a reader holds while it reads
        p.apply_retention(ms(T0 + 100 * HOUR))
        assert not segs[0].path.exists() and not segs[1].path.exists()
        assert fetch_a.decode().column("value").to_pylist() == [big(0), big(1), big(2)]
        assert fetch_b.decode().column("offset").to_pylist() == [4]
        assert fetch_b.decode().column("value").to_pylist() == [big(4)]
        seg_b = segs[1]
        assert bytes(seg_b.read(seg_b.start, seg_b.size)) == original_b
        first, length, stop = seg_b.plan(seg_b.base_offset, end, 1 << 20, end)  # its unlinked index still serves
        assert (first, length, stop) == (seg_b.start + SEGMENT_HEADER_SIZE, seg_b.size - SEGMENT_HEADER_SIZE, 6)
        data = seg_b.read(first, length)
        got = records.decode(data)
        assert got.column("offset").to_pylist() == [3, 4, 5]
        assert got.column("value").to_pylist() == [big(3), big(4), big(5)]
        with pytest.raises(OffsetOutOfRangeError):
            p.read(0)


# ---------------------------------------------------------------------------------------------------
# unflushThreshold mode: timed flushes


def test_flush_due_fires_once_the_interval_has_passed_with_unflushed_data(tmp_path, clock):
    config = TopicConfig(unflush_threshold=1000, unflush_interval_ms=1000)
    with MessageStore(tmp_path, {"t": config}, background_interval=None, clock=clock) as s:
        p = s.partition("t", 0)
        assert s.flush_due() == 0
        assert s.flush_due(T0 + 5) == 0  # nothing unflushed, however long ago the last flush was
        r = p.append([b"a"])  # acknowledged at once, without an fsync
        assert p.last_stable_offset == 1 and r.base_offset == 0
        assert p.read_arrow(0).column("value").to_pylist() == [b"a"]
        clock.now = T0 + 0.5
        assert s.flush_due() == 0
        clock.now = T0 + 0.999
        assert s.flush_due() == 0
        clock.now = T0 + 1.0
        assert s.flush_due() == 1
        assert s.flush_due() == 0  # flushed: nothing left
        clock.now = T0 + 1.5
        p.append([b"b"])  # 500 ms after the last flush: no fsync
        assert s.flush_due() == 0
        clock.now = T0 + 1.9
        assert s.flush_due() == 0
        clock.now = T0 + 2.0  # the interval counts from the last flush (T0 + 1), not from the append
        assert s.flush_due() == 1
        assert s.flush_due() == 0


def test_flush_due_with_an_explicit_now(tmp_path, clock):
    config = TopicConfig(unflush_threshold=1000, unflush_interval_ms=1000)
    with MessageStore(tmp_path, {"t": config}, background_interval=None, clock=clock) as s:
        s.partition("t", 0).append([b"a"])
        assert s.flush_due(T0 + 0.5) == 0
        assert s.flush_due(T0 + 1.0) == 1
        assert s.flush_due(T0 + 1.0) == 0


def test_an_append_after_the_interval_flushes_itself(tmp_path, clock):
    config = TopicConfig(unflush_threshold=1000, unflush_interval_ms=1000)
    with MessageStore(tmp_path, {"t": config}, background_interval=None, clock=clock) as s:
        p = s.partition("t", 0)
        p.append([b"a"])
        clock.advance(3)
        p.append([b"b"])  # 3 s since the last flush: this append fsyncs everything
        assert s.flush_due() == 0
        clock.advance(10)
        assert s.flush_due() == 0


def test_reaching_the_threshold_flushes(tmp_path, clock):
    config = TopicConfig(unflush_threshold=1000, unflush_interval_ms=1000)
    with MessageStore(tmp_path, {"t": config}, background_interval=None, clock=clock) as s:
        p = s.partition("t", 0)
        p.append([b"x"] * 999)
        clock.advance(0.5)
        p.append([b"y"])  # 1000 unflushed: fsynced by the append
        assert s.flush_due(clock() + 5) == 0
        p.append([b"x"] * 999)  # 999 unflushed, 0 ms after the last flush
        assert s.flush_due(clock() + 0.5) == 0
        clock.advance(1)
        assert s.flush_due() == 1
        assert p.last_stable_offset == 1999


def test_flush_due_counts_partitions_and_ignores_group_commit_topics(tmp_path, clock):
    timed = TopicConfig(num_partitions=3, unflush_threshold=1000, unflush_interval_ms=1000)
    with MessageStore(tmp_path, {"t": timed, "g": TopicConfig()}, background_interval=None, clock=clock) as s:
        s.append("t", 0, [b"a"])
        s.append("t", 2, [b"b"])
        s.append("g", 0, [b"c"])  # group commit: fsynced before it was acknowledged
        clock.now = T0 + 1
        assert s.flush_due() == 2
        assert s.flush_due() == 0
        s.append("g", 0, [b"d"])
        assert s.flush_due(T0 + 100) == 0
        clock.now = T0 + 1.5
        s.append("t", 0, [b"e"])  # t-0 flushed at T0 + 1: no fsync yet
        clock.now = T0 + 1.999
        assert s.flush_due() == 0
        clock.now = T0 + 2
        assert s.flush_due() == 1
        s.append("t", 1, [b"f"])
    clock.advance(100)
    assert s.flush_due() == 0  # closed: everything was flushed by close
