"""The log operations replication needs (docs/design/replication-plan.md steps 3-9): the lazy epoch marker,
reads up to the log end offset, a verbatim copy of a master's batches, truncation and reset (durable before
they return: checked by reopening a copy of the directory taken without closing), and the high-watermark
cap with transactions settled only below it."""
import random
import shutil
import threading

import pytest

from metaq_broker.errors import CorruptLogError, OffsetOutOfRangeError
from metaq_broker.protocol import records
from metaq_broker.store import MessageStore, PartitionLog, TopicConfig
from metaq_broker.store.epochs import Epoch, EpochFile

pytestmark = pytest.mark.unit

SMALL = TopicConfig(max_segment_size=4096)


def open_log(path, config=SMALL, **kw):
    return PartitionLog.open(path, "t", 0, config, **kw)


def body(*values):
    return records.encode_body(list(values))


def put_txn(log, txn, *values):
    """A transactional batch of ``txn`` (as TransactionManager.put appends it)."""
    return log.append_bodies([body(*values)], txn, records.TRANSACTIONAL)[0].base_offset


def values(log, start=None, end=None):
    start = log.earliest_offset if start is None else start
    end = log.last_stable_offset if end is None else end
    got, offset = [], start
    while offset < end:
        r = log.read(offset, 1 << 20, end=end)
        got += r.decode().column("value").to_pylist()
        offset = r.end_offset
    return got


def decoded(log, column):
    got, offset = [], log.earliest_offset
    while offset < log.last_stable_offset:
        r = log.read(offset, 1 << 20)
        got += r.decode().column(column).to_pylist()
        offset = r.end_offset
    return got


def raw(log, start=None):
    """Every batch of the log as stored, from ``start`` (default the earliest offset) to the log end offset."""
    end = log.log_end_offset
    parts, offset = [], log.earliest_offset if start is None else start
    while offset < end:
        r = log.read(offset, 1 << 20, end=end)
        parts.append(r.data.tobytes())
        offset = r.end_offset
    return b"".join(parts)


def copy(master, replica, max_bytes=1500):
    """What a replica fetcher does: read from its log end offset up to the master's, append verbatim."""
    while replica.log_end_offset < master.log_end_offset:
        r = master.read(replica.log_end_offset, max_bytes, end=master.log_end_offset)
        replica.append_replicated(r.data, r.batch_positions)
    replica.make_durable(replica.log_end_offset)


def crash_copy(log, tmp_path, name="crashed"):
    """The partition directory as a crash would leave it now (no close, so nothing more is written)."""
    target = tmp_path / name
    shutil.copytree(log.directory, target)
    return target


# -- epochs ---------------------------------------------------------------------------------------------
def test_the_epoch_marker_is_written_lazily_with_the_epochs_first_append(tmp_path):
    log = open_log(tmp_path / "p")
    log.append([b"a", b"b"])
    log.begin_epoch(4, 2)
    assert (log.log_end_offset, log.last_epoch, log.epochs.entries) == (2, 0, [])  # idle: nothing written
    r = log.append([b"c"])
    assert r.base_offset == 3 and log.log_end_offset == 4  # the marker took offset 2
    assert log.epochs.entries == [Epoch(4, 2, 2)] and log.last_epoch == 4
    assert [log.epoch_before(o) for o in (0, 2, 3, 4)] == [0, 0, 4, 4]
    assert values(log) == [b"a", b"b", b"c"]  # readers skip it
    log.begin_epoch(4, 2)  # the log has this epoch: nothing more
    log.begin_epoch(3, 1)
    log.append([b"d"])
    assert log.log_end_offset == 5 and EpochFile.load(tmp_path / "p").entries == [Epoch(4, 2, 2)]
    log.begin_epoch(5, 0)
    put_txn(log, 1, b"t")  # any append path
    assert log.epochs.entries[-1] == Epoch(5, 0, 5)
    with pytest.raises(ValueError):
        log.begin_epoch(0, 0)
    log.close()


def test_the_marker_and_its_batch_are_one_write_and_one_segment(tmp_path):
    log = open_log(tmp_path / "p")
    while len(log.segments()) == 1:
        log.append([b"x" * 200])
    log.append([b"x" * 200] * 8)  # fill the second segment nearly up
    log.begin_epoch(1, 0)
    before = len(log.segments())
    log.append([b"y" * 3000])  # with its marker it overflows: both go to the new segment
    segs = log.segments()
    marker = log.epochs.latest.start
    assert len(segs) == before + 1 and segs[-1].base_offset == marker and segs[-1].count == 2
    log.close()


def test_the_store_begins_an_epoch_in_every_partition_and_in_topics_created_later(tmp_path):
    store = MessageStore(tmp_path, {"a": TopicConfig(num_partitions=2)}, background_interval=None)
    store.begin_epoch(7, 1)
    store.create_topic("b", TopicConfig(num_partitions=1))
    for topic, p in (("a", 0), ("a", 1), ("b", 0)):
        store.append(topic, p, [b"v"])
        assert store.partition(topic, p).epochs.entries == [Epoch(7, 1, 0)]
    store.close()


def test_recovery_drops_epochs_past_the_log_end_and_rebuilds_a_damaged_file(tmp_path):
    log = open_log(tmp_path / "p")
    for epoch in (1, 2, 3):
        log.begin_epoch(epoch, 0)
        for _ in range(30):
            log.append([b"x" * 100])
    entries = log.epochs.entries
    assert len(log.segments()) > 2 and [e.epoch for e in entries] == [1, 2, 3]
    log.close()
    EpochFile(tmp_path / "p", entries + [Epoch(9, 0, 10_000)]).save()  # an epoch whose marker is not here
    assert open_log(tmp_path / "p").epochs.entries == entries
    (tmp_path / "p" / "epochs").write_bytes(b"garbage")  # damaged: rebuilt from every segment's markers
    log = open_log(tmp_path / "p")
    assert log.epochs.entries == entries == EpochFile.load(tmp_path / "p").entries
    log.close()


# -- reading up to the log end offset ------------------------------------------------------------------------
def test_written_but_unsettled_batches_are_read_to_the_log_end_offset_only(tmp_path):
    log = open_log(tmp_path / "p", TopicConfig())
    log.append([b"a"])
    put_txn(log, 1, b"t1", b"t2")  # written, not fsynced, behind the last stable offset
    assert (log.last_stable_offset, log.log_end_offset) == (1, 3)
    assert log.locate(1).length == 0 and log.read(1).end_offset == 1
    where = log.locate(1, end=log.log_end_offset)
    assert (where.start_offset, where.end_offset) == (1, 3) and where.length > 0
    r = log.read(1, end=log.log_end_offset)
    assert records.decode(r.data).column("value").to_pylist() == [b"t1", b"t2"]
    assert log.read(0, end=10**6).end_offset == 3  # an end past the log end offset is the log end offset
    log.make_durable(log.log_end_offset)
    assert log.recovery_point == 3
    log.close()


def test_a_reader_at_the_log_end_offset_never_sees_a_partial_batch(tmp_path):
    """Writers append batches of varied sizes across rolls while a replica-style reader copies from the
    log end offset, woken by the store's write counter; the copy is byte-identical at the end."""
    store = MessageStore(tmp_path / "m", {"t": TopicConfig(num_partitions=1, max_segment_size=8192)},
                         background_interval=None)
    master = store.partition("t", 0)
    replica = open_log(tmp_path / "r", TopicConfig(max_segment_size=5000))
    done = threading.Event()
    errors = []

    def writer(seed):
        rng = random.Random(seed)
        try:
            for i in range(150):
                master.append([b"%d-%d-%d" % (seed, i, k) + b"#" * rng.randrange(300)
                               for k in range(rng.randrange(1, 6))])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def reader():
        seen = -1
        try:
            while not (done.is_set() and replica.log_end_offset == master.log_end_offset):
                seen = store.wait_written(seen, 0.05)
                end = master.log_end_offset
                while replica.log_end_offset < end:
                    r = master.read(replica.log_end_offset, 2000, end=end)
                    assert r.data.size and r.end_offset <= end
                    records.decode(r.data)  # whole, valid batches only: raises otherwise
                    replica.append_replicated(r.data, r.batch_positions)
                replica.make_durable(replica.log_end_offset)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(3)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads[:3]:
        t.join(60)
    done.set()
    store.notify_written()
    threads[3].join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert raw(replica) == raw(master) and replica.verify() == []
    assert sorted(values(replica)) == sorted(values(master)) and len(values(master)) > 300
    store.close()
    replica.close()


def test_wait_written_returns_on_a_change_or_the_timeout(tmp_path):
    store = MessageStore(tmp_path, {"t": TopicConfig(num_partitions=1)}, background_interval=None)
    seen = store.wait_written(-1, 0)
    assert store.wait_written(seen, 0.01) == seen  # nothing written: the timeout
    threading.Timer(0.05, store.append, ("t", 0, [b"v"])).start()
    assert store.wait_written(seen, 30) != seen
    seen = store.wait_written(-1, 0)
    store.notify_written()  # the transaction journal's way in
    assert store.wait_written(seen, 0) == seen + 1
    store.close()


# -- the verbatim copy ------------------------------------------------------------------------------------
def busy_master(path):
    """A master log with plain, transactional (committed and aborted) batches, markers, two epochs and
    several segments."""
    log = open_log(path)
    log.begin_epoch(1, 0)
    for i in range(20):
        log.append([b"p%d" % i * 30, b"q%d" % i])
    put_txn(log, 1, b"c1")
    put_txn(log, 2, b"a1")
    log.append([b"plain"])
    put_txn(log, 1, b"c2")
    log.append_marker(1, commit=True)
    log.append_marker(2, commit=False)
    log.begin_epoch(2, 1)
    for i in range(20):
        log.append([b"r%d" % i * 40])
    put_txn(log, 3, b"open")
    return log


def test_a_verbatim_copy_is_byte_identical_with_the_same_state(tmp_path):
    master = busy_master(tmp_path / "m")
    replica = open_log(tmp_path / "r", TopicConfig(max_segment_size=6000))  # other rolls than the master's
    copy(master, replica)
    assert replica.log_end_offset == master.log_end_offset and replica.recovery_point == master.log_end_offset
    assert raw(replica) == raw(master) and len(replica.segments()) > 1 and replica.verify() == []
    assert replica.epochs.entries == master.epochs.entries == [Epoch(1, 0, 0), Epoch(2, 1, 47)]
    assert replica.last_stable_offset == master.last_stable_offset  # held at transaction 3's batch
    assert replica.txns.ongoing == master.txns.ongoing == {3: master.log_end_offset - 1}
    assert (replica.aborted_in(0, 100) == master.aborted_in(0, 100)).all() and len(master.aborted_in(0, 100)) == 1
    assert values(replica) == values(master) and b"a1" not in values(replica) and b"c2" in values(replica)
    for column in ("offset", "msgId", "timestamp", "value"):  # ids and store times are the master's
        assert decoded(replica, column) == decoded(master, column)
    r = replica.append([b"own"])  # the id allocator moved past every copied id
    assert r.base_offset == master.log_end_offset
    assert r.base_msg_id > max_msg_id(master)
    master.close()
    replica.close()
    again = open_log(tmp_path / "r", TopicConfig(max_segment_size=6000))  # and it all survives a reopen
    assert again.epochs.entries[-1] == Epoch(2, 1, 47) and again.txns.ongoing == {3: r.base_offset - 1}
    assert again.verify() == []
    again.close()


def max_msg_id(log):
    offset, best = log.earliest_offset, -1
    while offset < log.log_end_offset:
        r = log.read(offset, 1 << 20, end=log.log_end_offset)
        positions = r.batch_positions
        h = records.headers_at(r.data, positions)
        best = max(best, int((h["base_msg_id"] + h["count"] - 1).max()))
        offset = r.end_offset
    return best


def test_a_copy_that_does_not_fit_is_refused_whole(tmp_path):
    master = busy_master(tmp_path / "m")
    replica = open_log(tmp_path / "r")
    first = master.read(0, 2000, end=master.log_end_offset)
    data = bytearray(first.data.tobytes())
    with pytest.raises(CorruptLogError, match="begins at offset 1, the log ends at 0"):
        replica.append_replicated(master.read(2, 2000, end=master.log_end_offset).data)
    bad = bytearray(data)
    bad[-3] ^= 1  # the last batch's body
    with pytest.raises(CorruptLogError, match="checksum"):
        replica.append_replicated(bytes(bad))
    with pytest.raises(CorruptLogError, match="truncated batch"):
        replica.append_replicated(bytes(data[:-8]))
    with pytest.raises(CorruptLogError, match="not at the positions given"):
        replica.append_replicated(bytes(data), first.batch_positions[:1])
    assert replica.log_end_offset == 0 and replica.segments()[0].size == 32  # nothing written
    gap = master.read(first.end_offset + 2, 2000, end=master.log_end_offset).data.tobytes()
    with pytest.raises(CorruptLogError, match="expected"):
        replica.append_replicated(bytes(data) + gap)
    assert replica.log_end_offset == 0
    assert replica.append_replicated(memoryview(data)) == first.end_offset  # bytes-like of any kind
    master.close()
    replica.close()


# -- truncation -----------------------------------------------------------------------------------------
def test_truncate_across_segments_and_a_commit_marker_is_durable_at_once(tmp_path):
    log = open_log(tmp_path / "p")
    log.begin_epoch(1, 0)
    for i in range(30):
        log.append([b"a%d" % i * 50])
    txn_first = put_txn(log, 5, b"t1", b"t2")
    log.append([b"b" * 50])
    commit = log.append_marker(5, commit=True)
    log.begin_epoch(2, 0)
    for i in range(40):
        log.append([b"c%d" % i * 60, b"d"])
    assert len(log.segments()) >= 3 and log.last_stable_offset == log.log_end_offset
    end_before = log.log_end_offset
    cut = log.truncate_to(commit + 3)  # inside epoch 2's second batch (two messages): rounded down
    assert cut == commit + 2 and log.log_end_offset == log.recovery_point == log.visible_end == cut
    assert log.epochs.entries == [Epoch(1, 0, 0), Epoch(2, 0, commit + 1)]
    crashed = crash_copy(log, tmp_path)  # no close: what a crash right now would leave
    cut = log.truncate_to(commit)  # the commit marker goes: transaction 5 is unsettled again
    assert cut == commit and log.last_stable_offset == txn_first and log.txns.ongoing == {5: txn_first}
    assert log.epochs.entries == [Epoch(1, 0, 0)] and len(log.segments()) < 3
    crashed2 = crash_copy(log, tmp_path, "crashed2")
    r = log.append([b"after"])  # appends continue in the cut, un-sealed segment
    assert r.base_offset == commit
    log.append_marker(5, commit=False)
    assert values(log) == [b"a%d" % i * 50 for i in range(30)] + [b"b" * 50, b"after"]
    log.close()
    assert end_before > commit + 2
    for path, end, ongoing in ((crashed, commit + 2, {}), (crashed2, commit, {5: txn_first})):
        again = open_log(path)
        assert again.log_end_offset == end and again.txns.ongoing == ongoing and again.verify() == []
        assert again.epochs.entries[-1].start < end
        again.close()
    again = open_log(tmp_path / "p")
    assert values(again)[-1] == b"after" and again.txns.ongoing == {} and len(again.aborted_in(0, 10**6)) == 1
    again.close()


def test_truncate_to_a_segment_boundary_and_below_the_earliest(tmp_path):
    log = open_log(tmp_path / "p")
    for i in range(60):
        log.append([b"x" * 100])
    boundary = log.segments()[1].base_offset
    assert log.truncate_to(boundary) == boundary and log.segments()[-1].count == 0
    assert log.append([b"y"]).base_offset == boundary
    assert log.truncate_to(10**6) == boundary + 1  # past the end: nothing to cut
    assert log.truncate_to(0) == 0 and log.log_end_offset == 0 and values(log) == []
    log.close()
    again = open_log(tmp_path / "p")
    assert again.log_end_offset == 0 and len(again.segments()) == 1
    again.close()


def test_an_append_waiting_for_its_fsync_fails_when_the_log_is_cut_under_it(tmp_path):
    log = open_log(tmp_path / "p", TopicConfig())
    put_txn(log, 1, b"t")
    assert log.truncate_to(0) == 0
    with pytest.raises(Exception, match="truncated"):
        log.make_durable(1)
    log.close()


# -- reset ----------------------------------------------------------------------------------------------
def test_reset_empties_the_log_at_a_new_base_offset(tmp_path):
    log = open_log(tmp_path / "p")
    log.begin_epoch(1, 0)
    for i in range(40):
        log.append([b"x" * 100])
    put_txn(log, 2, b"open")
    log.reset_to(500)
    assert (log.earliest_offset, log.log_end_offset, log.last_stable_offset) == (500, 500, 500)
    assert log.epochs.entries == [] and log.txns.ongoing == {} and len(log.segments()) == 1
    with pytest.raises(OffsetOutOfRangeError):
        log.read(0)
    crashed = crash_copy(log, tmp_path)
    assert log.append([b"new"]).base_offset == 500
    log.close()
    again = open_log(crashed)
    assert (again.earliest_offset, again.log_end_offset, again.epochs.entries) == (500, 500, [])
    again.close()
    again = open_log(tmp_path / "p")
    assert values(again) == [b"new"] and again.earliest_offset == 500 and again.txns.ongoing == {}
    again.close()


def test_reset_then_copy_from_a_master_whose_log_starts_later(tmp_path):
    master = busy_master(tmp_path / "m")
    replica = open_log(tmp_path / "r")
    replica.append([b"stale"] * 3)
    h = records.parse_header(master.read(30, 1).data)
    start = h.base_offset if h.base_offset == 30 else h.next_offset  # a batch start on the master
    replica.reset_to(start)
    copy(master, replica)
    assert raw(replica) == raw(master, start) and replica.earliest_offset == start
    assert replica.epochs.entries == [Epoch(2, 1, 47)] and replica.txns.ongoing == master.txns.ongoing
    master.close()
    replica.close()


# -- the high watermark ---------------------------------------------------------------------------------
def test_the_hw_caps_readers_and_wakes_those_waiting(tmp_path):
    log = open_log(tmp_path / "p")
    for i in range(10):
        log.append([b"v%d" % i])
    assert log.high_watermark is None and log.last_stable_offset == 10
    log.set_high_watermark(4)
    assert log.last_stable_offset == 4 and values(log) == [b"v%d" % i for i in range(4)]
    log.set_high_watermark(2)  # never down
    assert log.high_watermark == 4
    assert log.read(4).end_offset == 4  # between the HW and the log end: valid, empty
    threading.Timer(0.05, log.set_high_watermark, (8,)).start()
    assert log.wait_for_data(4, 30) and log.last_stable_offset == 8
    log.set_high_watermark(None)
    assert log.last_stable_offset == 10
    log.close()


@pytest.mark.parametrize("commit", [True, False])
def test_a_transaction_settles_only_when_its_marker_is_below_the_hw(tmp_path, commit):
    log = open_log(tmp_path / "p")
    log.append([b"a"])
    log.set_high_watermark(1)
    first = put_txn(log, 7, b"t")
    log.append([b"b"])
    marker = log.append_marker(7, commit=commit)
    log.append([b"c"])
    assert 7 not in log.txns.ongoing  # settled here: no second marker is ever written
    for hw in (first + 1, marker):
        log.set_high_watermark(hw)
        assert log.last_stable_offset == first and len(log.aborted_in(0, 100)) == 0
    log.set_high_watermark(marker + 1)
    assert log.last_stable_offset == marker + 1 and len(log.aborted_in(0, 100)) == (0 if commit else 1)
    assert values(log) == ([b"a", b"t", b"b"] if commit else [b"a", b"b"])
    log.close()
    again = open_log(tmp_path / "p")  # the snapshot holds the state without a cap
    assert again.last_stable_offset == again.log_end_offset and len(again.aborted_in(0, 100)) == (0 if commit else 1)
    again.close()


def test_the_first_hw_unsettles_transactions_whose_marker_is_above_it(tmp_path):
    """At open there is no cap, so markers settle; the first cap (after promotion) must undo that."""
    log = open_log(tmp_path / "p")
    log.append([b"a"])
    first = put_txn(log, 3, b"t")
    marker = log.append_marker(3, commit=False)
    log.close()
    log = open_log(tmp_path / "p")
    assert log.last_stable_offset == marker + 1 and len(log.aborted_in(0, 10)) == 1
    log.set_high_watermark(marker)
    assert log.last_stable_offset == first and len(log.aborted_in(0, 10)) == 0
    log.set_high_watermark(marker + 1)
    assert log.last_stable_offset == marker + 1 and len(log.aborted_in(0, 10)) == 1
    log.close()


def test_truncation_lowers_the_hw_and_reset_moves_it_to_the_new_base(tmp_path):
    log = open_log(tmp_path / "p")
    for i in range(10):
        log.append([b"v%d" % i])
    log.set_high_watermark(8)
    log.truncate_to(5)
    assert log.high_watermark == 5 and log.last_stable_offset == 5
    log.reset_to(20)  # an empty log: its only offset
    assert log.high_watermark == 20 and log.last_stable_offset == 20
    log.close()
