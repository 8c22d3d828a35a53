"""The transaction journal as a replicated stream (plan §8): seqs, the master's memory tail and snapshot, a
follower applying records behind its data gates, and promotion. Two real MessageStores in temp dirs: the
"replica" store gets the master's batches by re-appending them at the same offsets, as a replica fetcher
would copy them."""
import json
import random

import numpy as np
import pytest

from metaq_broker.protocol import records
from metaq_broker.store import MessageStore, TopicConfig
from metaq_broker.store import txn_journal
from metaq_broker.store.journal_frames import frame, split
from metaq_broker.store.transactions import TransactionError, TransactionManager
from metaq_broker.store.txn_journal import COMMIT, DONE, FINISHED, PREPARE

pytestmark = pytest.mark.unit

PARTS = 3


def open_store(path):
    return MessageStore(path / "data", {"t": TopicConfig(num_partitions=PARTS, max_message_size=1000)},
                        background_interval=None)


def open_tx(store, path, follower=False):
    return TransactionManager(store, path / "data" / "transactions", default_timeout_s=60, follower=follower)


def body(*values):
    return records.encode_body([v.encode() for v in values])




def copy_batches(src, dst, limit=None) -> int:
    """Copy the batches ``dst`` lacks, oldest first (at most ``limit``): same offsets, txn and kind; not made
    durable (transactional batches), as a replica writes before its group-commit fsync."""
    n = 0
    while dst.log_end_offset < src.log_end_offset and (limit is None or n < limit):
        data = src.read(dst.log_end_offset, 1, end=src.log_end_offset).data
        h = records.parse_header(data, 0)
        assert h.base_offset == dst.log_end_offset
        if h.attributes & records.CONTROL:
            value_at = int(records.data_starts(data, np.zeros(1, np.int64))[0])
            dst.append_marker(h.txn, bytes(data[value_at:value_at + 1]) == records.COMMIT_MARKER)
        else:
            b = records.parse_body(h.count, h.body_attributes, data[records.HEADER_SIZE:h.batch_len], h.body_crc)
            dst.append_bodies([b], h.txn, h.attributes & records.TRANSACTIONAL)
        n += 1
    return n


def copy_all(src_store, dst_store, make_durable=True):
    for p in range(PARTS):
        src, dst = src_store.partition("t", p), dst_store.partition("t", p)
        copy_batches(src, dst)
        if make_durable:
            dst.make_durable(dst.log_end_offset)


def give(follower, got, snapshot=False) -> int:
    first, last, frames = got
    return follower.apply(frames, first, last, snapshot)


def ship(master, follower, max_bytes=1 << 20) -> int:
    """One journal exchange, as a replica fetch carries it."""
    got = master.records_since(follower.applied_seq, max_bytes)
    if got is None:
        return give(follower, master.snapshot_records(), snapshot=True)
    return give(follower, got)


def kept_state(tx):
    """What a journal must carry: non-open transactions and remembered outcomes."""
    live = {x: (t.state, t.number, sorted(t.partitions.items()), t.messages, t.coordinator, t.prepared_at,
                t.timeout_s, t.seq, t.decision_seq)
            for x, t in tx._live.items() if t.state != "open"}
    return live, dict(tx._outcomes.finished), dict(tx._outcomes.decided), tx._outcomes.forgot_commits


def seqs_of(frames):
    return [(kind, json.loads(payload)["seq"]) for kind, payload, _ in split(frames, txn_journal.KINDS)]


def values(store, p):
    part = store.partition("t", p)
    if part.last_stable_offset == 0:
        return []
    return [v.as_py().decode() for v in part.read_arrow(0, part.last_stable_offset).column("value")]


def test_seqs_memory_tail_snapshot_and_compaction(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    tx = open_tx(store, tmp_path)
    assert tx.journal_seq == tx.applied_seq == 0 and tx.records_since(0) == (1, 0, b"")
    tx.begin("x1")
    tx.put("x1", "t", 0, body("a"))
    tx.prepare("x1")
    tx.commit("x1")
    assert tx.journal_seq == 3
    first, last, frames = tx.records_since(0)
    assert (first, last) == (1, 3) and seqs_of(frames) == [(PREPARE, 1), (COMMIT, 2), (DONE, 3)]
    assert tx.path.read_bytes().endswith(frames)  # the frames as written
    assert tx.records_since(3) == (4, 3, b"")
    assert tx.records_since(1, max_bytes=1)[:2] == (2, 2)  # at least one record, then the budget
    assert tx.records_since(4) is None and tx.records_since(-1) is None
    first, last, snap = tx.snapshot_records()
    assert last == 3 and seqs_of(snap) == [(FINISHED, 3)]
    tx.begin("x2")
    tx.put("x2", "t", 1, body("b"))
    tx.prepare("x2")
    tx.close()
    tx = open_tx(store, tmp_path)  # compacts on start, seqs kept
    assert tx.journal_seq == 4 and seqs_of(tx.path.read_bytes()) == [(FINISHED, 4), (PREPARE, 4)]
    assert tx.records_since(4) == (5, 4, b"") and tx.records_since(3) is None  # the tail starts now
    tx.commit("x2")
    assert seqs_of(tx.records_since(4)[2]) == [(COMMIT, 5), (DONE, 6)]
    # The tail keeps about TAIL_BYTES: a follower further behind gets a snapshot.
    monkeypatch.setattr(txn_journal, "TAIL_BYTES", 400)
    for i in range(6):
        tx.begin(f"y{i}")
        tx.rollback(f"y{i}")
    assert tx.records_since(4) is None
    assert tx.records_since(tx.journal_seq - 1)[:2] == (tx.journal_seq, tx.journal_seq)
    tx.close()
    store.close()


def test_old_journal_without_seqs_loads(tmp_path):
    store = open_store(tmp_path)
    (tmp_path / "data" / "transactions").mkdir()
    old = (frame(FINISHED, json.dumps({"finished": [["a", "committed"]], "decided": [], "forgot_commits": False,
                                       "next_number": 5}).encode())
           + frame(DONE, json.dumps({"xid": "b", "number": 6, "outcome": "rolled_back", "path": ""}).encode()))
    (tmp_path / "data" / "transactions" / txn_journal.JOURNAL).write_bytes(old)
    tx = open_tx(store, tmp_path)
    assert tx.journal_seq == 2 and tx.state("a") == "committed" and tx.state("b") == "rolled_back"
    assert tx.begin("c").number == 7
    tx.close()
    store.close()


def test_follower_gates_prepare_on_durable_data_and_done_on_markers(tmp_path):
    ms, rs = open_store(tmp_path / "m"), open_store(tmp_path / "r")
    master, follower = open_tx(ms, tmp_path / "m"), open_tx(rs, tmp_path / "r", follower=True)
    assert follower.applied_seq == -1  # a replica starts from a snapshot
    master.begin("x")
    master.put("x", "t", 0, body("a", "b"))
    master.put("x", "t", 1, body("c"))
    copy_all(ms, rs, make_durable=False)
    master.prepare("x")
    assert ship(master, follower) == -1  # the snapshot's PREPARE waits for its batches to be durable
    assert follower.prepared() == []
    for p in range(2):
        rs.partition("t", p).make_durable(rs.partition("t", p).log_end_offset)
    assert follower.apply_pending() == 1
    assert [t.xid for t in follower.prepared()] == ["x"]
    assert follower.path.read_bytes() == master.snapshot_records()[2]
    master.commit("x")
    assert ship(master, follower) == 2  # COMMIT applied; DONE waits for the markers
    assert follower.state("x") == "committing"
    assert ship(master, follower) == 2  # resent: ignored, still waiting
    assert len(follower._follower.pending) == 1
    copy_all(ms, rs)
    assert follower.apply_pending() == 3 and follower.state("x") == "committed"
    assert follower.path.read_bytes().endswith(master.records_since(1)[2])  # byte for byte
    size = follower.path.stat().st_size
    assert give(follower, master.records_since(1)) == 3  # idempotent resend
    assert follower.path.stat().st_size == size
    assert values(rs, 0) == ["a", "b"] and values(rs, 1) == ["c"]
    for tx in (master, follower):
        tx.close()
    ms.close()
    rs.close()


def test_snapshot_for_a_new_follower_then_stream_refusals_gap_restart(tmp_path):
    ms, rs = open_store(tmp_path / "m"), open_store(tmp_path / "r")
    master = open_tx(ms, tmp_path / "m")
    for i, outcome in enumerate(["commit", "rollback", "prepare", "open", "commit"]):
        xid = f"x{i}"
        master.begin(xid, coordinator=json.dumps({"path": f"/d/{i}"}) if i == 4 else "")
        master.put(xid, "t", i % PARTS, body(xid))
        if outcome != "open":
            master.prepare(xid)
        if outcome == "commit":
            master.commit(xid)
        elif outcome == "rollback":
            master.rollback(xid)
    copy_all(ms, rs)
    follower = open_tx(rs, tmp_path / "r", follower=True)
    assert ship(master, follower) == master.journal_seq
    assert kept_state(follower) == kept_state(master)
    assert follower.path.read_bytes() == master.snapshot_records()[2]
    assert follower.state("x3") is None and follower.state("x4") == "committed"
    assert ship(master, follower) == master.journal_seq  # nothing new
    assert give(follower, master.snapshot_records(), snapshot=True) == master.journal_seq  # same snapshot
    master.commit("x2")
    copy_all(ms, rs)
    assert ship(master, follower) == master.journal_seq and kept_state(follower) == kept_state(master)
    # Refused while a follower; expire does nothing.
    for call in (lambda: follower.begin("n"), lambda: follower.commit("x2"), lambda: follower.rollback("x2"),
                 lambda: follower.prepare("x2"), lambda: follower.put("x2", "t", 0, body("v"))):
        with pytest.raises(TransactionError, match="this broker is a replica"):
            call()
    assert follower.expire() == []
    # A gap is an error.
    at = follower.applied_seq
    master.begin("g")
    master.rollback("g")
    with pytest.raises(ValueError, match="gap"):
        give(follower, master.records_since(at + 1))
    # A restarted follower keeps its journal, writes no markers, and asks for a snapshot again.
    ends = [rs.partition("t", p).log_end_offset for p in range(PARTS)]
    follower.close()
    follower = open_tx(rs, tmp_path / "r", follower=True)
    assert follower.applied_seq == -1 and follower.journal_seq == at
    assert [rs.partition("t", p).log_end_offset for p in range(PARTS)] == ends  # x3's batch not aborted here
    assert ship(master, follower) == master.journal_seq and kept_state(follower) == kept_state(master)
    with pytest.raises(TransactionError, match="master"):
        master.apply(b"", 1, 0, False)
    for tx in (master, follower):
        tx.close()
    ms.close()
    rs.close()


def test_promote_settles_from_the_copied_journal_and_serves_the_stream(tmp_path):
    ms, rs, ts = open_store(tmp_path / "m"), open_store(tmp_path / "r"), open_store(tmp_path / "t")
    master = open_tx(ms, tmp_path / "m")
    follower = open_tx(rs, tmp_path / "r", follower=True)
    master.begin("x")
    master.put("x", "t", 0, body("a"))
    master.put("x", "t", 2, body("b"))
    master.prepare("x")
    master.begin("w")  # open at the failover: aborted by the new master
    master.put("w", "t", 1, body("lost"))
    copy_all(ms, rs)
    applied = ship(master, follower)
    master.follow()  # the old master steps down
    assert master.applied_seq == -1 and master.open_transactions() == []
    with pytest.raises(TransactionError, match="replica"):
        master.commit("x")
    follower.promote()
    assert follower.journal_seq > applied  # the DONE of w's abort continues the seqs
    assert [t.xid for t in follower.prepared()] == ["x"]
    assert rs.partition("t", 1).txns.ongoing == {}  # w aborted by markers written here
    assert follower.commit("x") == "committed"
    assert values(rs, 0) == ["a"] and values(rs, 2) == ["b"] and values(rs, 1) == []
    # The promoted member serves the stream: the old master follows it from a snapshot.
    copy_all(rs, ms)  # (its log is a prefix of the new master's here: nothing to truncate)
    assert ship(follower, master) == follower.journal_seq
    assert kept_state(master) == kept_state(follower) and master.state("x") == "committed"
    # A member that joins later: from the promoted member's tail or snapshot.
    third = open_tx(ts, tmp_path / "t", follower=True)
    copy_all(rs, ts)
    assert ship(follower, third) == follower.journal_seq and kept_state(third) == kept_state(follower)
    follower.begin("y")
    follower.put("y", "t", 0, body("c"))
    follower.prepare("y")
    copy_all(rs, ts)
    copy_all(rs, ms)
    assert ship(follower, third) == ship(follower, master) == follower.journal_seq
    assert [t.xid for t in third.prepared()] == [t.xid for t in master.prepared()] == ["y"]
    for tx in (master, follower, third):
        tx.close()
    for s in (ms, rs, ts):
        s.close()


def raw_counts(store):
    """Messages per transaction number in the transactional batches of the store's log, settled or not."""
    out = {}
    for p in range(PARTS):
        part = store.partition("t", p)
        offset = 0
        while offset < part.log_end_offset:
            h = records.parse_header(part.read(offset, 1, end=part.log_end_offset).data, 0)
            if h.attributes & records.TRANSACTIONAL:
                out[h.txn] = out.get(h.txn, 0) + h.count
            offset = h.next_offset
    return out


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_random_interleaving_of_log_and_journal(tmp_path, seed):
    """Master calls, batch copies, fsyncs and journal exchanges in a seeded random order: the follower
    never holds a PREPARE whose batches are not durable here; caught up (odd seeds), its state equals the
    master's; promoted, caught up or not (even seeds: there a prepare returns once the follower applied it,
    as the server's wait for the in-sync set does), it settles everything consistently with the master
    (what it commits the master committed, and whole)."""
    rnd = random.Random(seed)
    ms, rs = open_store(tmp_path / "m"), open_store(tmp_path / "r")
    master = open_tx(ms, tmp_path / "m")
    follower = open_tx(rs, tmp_path / "r", follower=True)
    numbers, n = {}, 0

    def check():
        for t in follower._live.values():
            for (topic, p), end in t.partitions.items():
                assert rs.partition(topic, p).recovery_point >= end, (t.xid, p)

    for _ in range(300):
        live = master._live
        open_ = [x for x, t in live.items() if t.state == "open"]
        prepared = [x for x, t in live.items() if t.state == "prepared"]
        op = rnd.random()
        if op < 0.12 or not (open_ or prepared):
            xid = f"x{n}"
            n += 1
            numbers[xid] = master.begin(xid).number
        elif op < 0.35 and open_:
            xid = rnd.choice(open_)
            master.put(xid, "t", rnd.randrange(PARTS), body(*[xid] * rnd.randint(1, 3)))
        elif op < 0.45 and open_:
            t = master.prepare(rnd.choice(open_))
            if seed % 2 == 0:
                copy_all(ms, rs)
                while follower.applied_seq < t.seq:
                    ship(master, follower)
        elif op < 0.52 and prepared:
            master.commit(rnd.choice(prepared))
        elif op < 0.56 and (open_ or prepared):
            master.rollback(rnd.choice(open_ + prepared))
        elif op < 0.60:
            ms.partition("t", rnd.randrange(PARTS)).append([b"plain"])
        elif op < 0.78:
            p = rnd.randrange(PARTS)
            copy_batches(ms.partition("t", p), rs.partition("t", p), rnd.randint(1, 3))
        elif op < 0.86:
            part = rs.partition("t", rnd.randrange(PARTS))
            part.make_durable(part.log_end_offset)
            if rnd.random() < 0.5:
                follower.apply_pending()
        else:
            ship(master, follower, max_bytes=rnd.choice([1, 300, 1 << 20]))
        check()
    if seed % 2:
        copy_all(ms, rs)
        while follower.applied_seq != master.journal_seq:
            ship(master, follower, max_bytes=500)
            check()
        assert kept_state(follower) == kept_state(master)
        prepared = sorted(t.xid for t in master.prepared())
        open_ = master.open_transactions()
    follower.promote()
    if seed % 2:
        assert sorted(t.xid for t in follower.prepared()) == prepared
        assert all(follower.state(t.xid) is None for t in open_)  # open ones aborted, never journalled
    for t in follower.prepared():  # decide as the master did (or did not yet)
        if master.state(t.xid) in ("committed", "committing"):
            follower.commit(t.xid)
        else:
            follower.rollback(t.xid)
    for p in range(PARTS):
        part = rs.partition("t", p)
        assert part.txns.ongoing == {} and part.last_stable_offset == part.visible_end
    raw = raw_counts(rs)
    visible = {}
    for p in range(PARTS):
        for v in values(rs, p):
            visible[v] = visible.get(v, 0) + 1
    for xid, number in numbers.items():  # (a commit marker may arrive before the journal says so)
        if visible.get(xid, 0) or follower.state(xid) == "committed":
            assert master.state(xid) in ("committed", "committing"), xid
            assert visible.get(xid, 0) == raw.get(number, 0), xid
    for tx in (master, follower):
        tx.close()
    ms.close()
    rs.close()
