"""Transactions written into the partition log: markers, the last stable offset, aborted batches skipped
by offset-exact reads, crashes at every step (real processes killed with SIGKILL), disks that fill up
(real tmpfs), and journals of the metaq that kept transactions out of the log."""
import json
import signal
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from metaq_broker.protocol import records
from metaq_broker.store import MessageStore, TopicConfig
from metaq_broker.store import journal_v1
from metaq_broker.store.journal_frames import frame
from metaq_broker.store.transactions import TransactionError, TransactionManager

pytestmark = pytest.mark.unit


def open_all(path, clock=None, **config):
    kw = {"clock": clock} if clock else {}
    store = MessageStore(path / "data", {"t": TopicConfig(num_partitions=2, **config)}, background_interval=None,
                         **kw)
    return store, TransactionManager(store, path / "data" / "transactions", default_timeout_s=5, **kw)


def body(*values):
    return records.encode_body([v.encode() for v in values])


def rows(log, start=0, max_bytes=1 << 20):
    """(offset, value) of every message a reader gets from ``start`` to the last stable offset, fetching
    ``max_bytes`` at a time and advancing by each reply's end offset."""
    out, offset = [], start
    while offset < log.last_stable_offset:
        r = log.read(offset, max_bytes)
        assert r.end_offset > offset, "a read below the last stable offset must advance"
        b = r.decode()
        out += zip(b.column("offset").to_pylist(), (v.decode() for v in b.column("value").to_pylist()))
        offset = r.end_offset
    return out


def test_interleaved_transactions_some_rolled_back_read_exactly_the_committed(tmp_path):
    """Many transactions and plain appends interleaved on one partition, across segment rolls: readers
    get exactly the committed messages with their offsets (aborted batches and markers are gaps), in
    any fetch size and from any start, also from inside an aborted range and after a reopen."""
    store, tx = open_all(tmp_path, max_segment_size=4096)
    log = store.partition("t", 0)
    expected = {}
    rng = np.random.default_rng(7)
    live = []
    for i in range(60):
        op = rng.integers(0, 4)
        if op == 0 or not live:
            xid = f"x{i}"
            tx.begin(xid)
            live.append(xid)
        xid = live[rng.integers(0, len(live))]
        r = tx.put(xid, "t", 0, body(f"{xid}-{i}a", f"{xid}-{i}b"))
        expected.setdefault(xid, []).extend([(r.base_offset, f"{xid}-{i}a"), (r.base_offset + 1, f"{xid}-{i}b")])
        plain = log.append([f"plain{i}".encode()])
        expected.setdefault("plain", []).append((plain.base_offset, f"plain{i}"))
        if op == 3 and live:
            done = live.pop(rng.integers(0, len(live)))
            if rng.integers(0, 2):
                tx.prepare(done)
                tx.commit(done)
            else:
                if rng.integers(0, 2):
                    tx.prepare(done)
                tx.rollback(done)
                expected.pop(done)
    for xid in live:
        tx.prepare(xid)
        tx.commit(xid)
    want = sorted(m for ms in expected.values() for m in ms)
    assert len(store.partition("t", 0).segments()) >= 3
    assert log.last_stable_offset == log.visible_end
    assert rows(log) == want
    assert rows(log, max_bytes=1) == want  # one batch per reply
    aborted = log.aborted_in(0, log.last_stable_offset)
    assert len(aborted) > 0
    inside = int(aborted[0]["first"]) + 1  # a reader positioned inside an aborted range
    assert rows(log, inside) == [m for m in want if m[0] >= inside]
    tx.close()
    store.close()

    store, tx = open_all(tmp_path, max_segment_size=4096)  # the snapshot at rolls + the tail scan
    log = store.partition("t", 0)
    assert rows(log) == want and log.txns.ongoing == {}
    assert log.aborted_in(0, log.last_stable_offset).tolist() == aborted.tolist()
    tx.close()
    store.close()


def test_an_open_transaction_holds_the_last_stable_offset_until_its_timeout(tmp_path, clock):
    store, tx = open_all(tmp_path, clock)
    log = store.partition("t", 0)
    log.append([b"before"])
    tx.begin("stuck")  # its writer dies before prepare
    first = tx.put("stuck", "t", 0, body("never")).base_offset
    log.append([b"after1"])
    log.append([b"after2"])
    assert (log.last_stable_offset, log.visible_end) == (first, first + 3)
    assert [v for _, v in rows(log)] == ["before"]
    assert not log.wait_for_data(first, 0.05)  # a long poll at the stable offset waits
    assert log.read(first + 1).end_offset == first + 1  # between stable offset and log end: nothing yet
    clock.now += 4
    assert tx.expire() == []
    clock.now += 2
    assert tx.expire() == ["stuck"]
    assert log.last_stable_offset == log.visible_end == first + 4  # the abort marker took an offset
    assert rows(log) == [(0, "before"), (first + 1, "after1"), (first + 2, "after2")]
    with pytest.raises(TransactionError, match="rolled back"):
        tx.prepare("stuck")
    tx.close()
    store.close()


def test_retention_keeps_segments_of_an_unsettled_transaction(tmp_path, clock):
    store, tx = open_all(tmp_path, clock, max_segment_size=4096, delete_policy="delete,1")
    log = store.partition("t", 0)
    tx.begin("slow", timeout_s=600)
    tx.put("slow", "t", 0, body("kept"))
    tx.prepare("slow")
    for i in range(40):
        log.append([b"x" * 200])
    clock.now += 7200
    assert log.apply_retention() == []  # the oldest segment holds the prepared transaction's batch
    tx.commit("slow")
    assert [v for _, v in rows(log)][0] == "kept"
    assert len(log.apply_retention()) > 0
    tx.close()
    store.close()


# -- crashes -------------------------------------------------------------------------------------------
CRASH = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from metaq_broker.protocol import records
    from metaq_broker.store import MessageStore, TopicConfig
    from metaq_broker.store.transactions import TransactionManager
    from metaq_broker.store.txn_journal import COMMIT
    path, step = Path(sys.argv[1]), sys.argv[2]
    store = MessageStore(path / "data", {"t": TopicConfig(num_partitions=2)}, background_interval=None)
    tx = TransactionManager(store, path / "data" / "transactions", default_timeout_s=5)
    store.partition("t", 0).append([b"plain"])
    tx.begin("k")
    tx.put("k", "t", 0, records.encode_body([b"a0", b"a1"]))
    tx.put("k", "t", 1, records.encode_body([b"b0"]))
    t = tx.get("k")
    if step == "prepare":  # batches fsynced, the PREPARE record not yet written
        for (topic, p), end in t.partitions.items():
            store.partition(topic, p).make_durable(end)
    elif step in ("prepared", "commit"):
        tx.prepare("k")
    if step == "commit":  # the decision journalled, one partition's marker written, the other's not
        tx.journal.append(COMMIT, {"xid": "k", "number": t.number}, fsync=True)
        store.partition("t", 0).append_marker(t.number, commit=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.process
@pytest.mark.parametrize("step,outcome", [("open", "rolled back"), ("prepare", "rolled back"),
                                          ("prepared", "prepared"), ("commit", "committed")])
def test_a_broker_killed_at_each_step_of_a_transaction_settles_it_all_or_nothing(tmp_path, step, outcome):
    child = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path), step], capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr
    store, tx = open_all(tmp_path)
    p0, p1 = store.partition("t", 0), store.partition("t", 1)
    if outcome == "prepared":
        assert [t.xid for t in tx.prepared()] == ["k"]
        assert [v for _, v in rows(p0)] == ["plain"] and rows(p1) == []
        tx.commit("k")
        outcome = "committed"
    got0, got1 = [v for _, v in rows(p0)], [v for _, v in rows(p1)]
    if outcome == "committed":
        assert got0 == ["plain", "a0", "a1"] and got1 == ["b0"]
    else:
        assert got0 == ["plain"] and got1 == []
    assert p0.last_stable_offset == p0.visible_end and p1.last_stable_offset == p1.visible_end
    tx.close()
    store.close()
    store, tx = open_all(tmp_path)  # settled once: a second restart changes nothing
    assert [v for _, v in rows(store.partition("t", 0))] == got0
    assert store.partition("t", 0).visible_end == p0.visible_end
    tx.close()
    store.close()


# -- full disks ----------------------------------------------------------------------------------------
def test_a_journal_write_on_a_full_disk_is_cut_back_and_the_broker_keeps_serving(tmp_path, small_disk):
    disk = small_disk(tmp_path / "disk", 2048)
    store, tx = open_all(disk.path)
    tx.begin("x")
    tx.put("x", "t", 0, body("a"))
    journal = disk.path / "data" / "transactions" / "transactions.log"
    size = journal.stat().st_size
    disk.fill()
    with pytest.raises(OSError):
        for i in range(200):  # the journal's page may have room for a few records; then ENOSPC
            tx.begin(f"y{i}")
            tx.prepare(f"y{i}")
    assert journal.stat().st_size < size + 4096 * 2
    assert store.partition("t", 0).read_arrow(0).num_rows == 0
    disk.free()
    tx.prepare("x")
    tx.commit("x")
    assert [v for _, v in rows(store.partition("t", 0))] == ["a"]
    tx.close()
    store.close()
    store, tx = open_all(disk.path)  # a clean restart: no "damaged record followed by valid ones"
    assert [v for _, v in rows(store.partition("t", 0))] == ["a"] and tx.state("x") == "committed"
    tx.close()
    store.close()


def test_a_commit_that_fails_in_one_partition_finishes_by_itself_all_or_nothing(tmp_path, small_disk):
    """Partition t-1 on a disk of its own that fills up: the commit's marker cannot be written there.
    The transaction stays committing (t-0 readable, t-1 held back, nothing half visible in t-1), a
    restart while the disk is still full opens, and once space returns the broker finishes it."""
    data = tmp_path / "data"
    data.mkdir()
    disk = small_disk(data / "t-1", 512)
    store, tx = open_all(tmp_path)
    tx.begin("x")
    tx.put("x", "t", 0, body("a"))
    # 32-byte segment header + 72-byte batch header + a 3992-byte body: t-1's segment ends on a page boundary.
    tx.put("x", "t", 1, records.encode_body([b"b" * 3984]))
    tx.prepare("x")
    disk.fill()
    with pytest.raises(OSError):
        tx.commit("x")
    assert tx.state("x") == "committing"
    p1 = store.partition("t", 1)
    assert [v for _, v in rows(store.partition("t", 0))] == ["a"] and rows(p1) == [] and p1.last_stable_offset == 0
    tx.expire()  # still full: still committing
    assert tx.state("x") == "committing"
    tx.close()
    store.close()

    store, tx = open_all(tmp_path)  # a restart while the disk is full
    assert tx.state("x") == "committing" and store.partition("t", 1).last_stable_offset == 0
    disk.free()
    tx.expire()
    assert tx.state("x") == "committed"
    assert [len(v) for _, v in rows(store.partition("t", 1))] == [3984]
    tx.close()
    store.close()
    store, tx = open_all(tmp_path)
    assert [v for _, v in rows(store.partition("t", 0))] == ["a"]
    assert [len(v) for _, v in rows(store.partition("t", 1))] == [3984]
    tx.close()
    store.close()


# -- journals of the earlier format --------------------------------------------------------------------
old_record = frame  # the earlier journal framed its records the same way


def old_put(xid, partition, b):
    meta = json.dumps({"xid": xid, "topic": "t", "partition": partition, "count": b.count,
                       "attributes": b.attributes, "crc": b.crc}).encode()
    return old_record(journal_v1.PUT, struct.pack("<I", len(meta)) + meta + b"".join(bytes(p) for p in b.parts))


def test_a_data_directory_with_an_old_journal_opens_and_settles(tmp_path):
    """The earlier journal held prepared transactions' bodies and finished commits by counting numbered
    batches: a prepared transaction is moved into the log (and commits later), a commit cut short is
    finished without duplicates, outcomes are kept, the old journal is gone."""
    store = MessageStore(tmp_path / "data", {"t": TopicConfig(num_partitions=2)}, background_interval=None)
    # The old broker committed transaction 4 ("c") into t-0 and crashed before t-1; "p" is prepared.
    store.partition("t", 0).append([b"plain"])
    store.partition("t", 0).append_bodies([body("c0")], txn=4)
    store.close()
    (tmp_path / "data" / "transactions").mkdir()
    (tmp_path / "data" / "transactions" / "transactions.journal").write_bytes(b"".join([
        old_record(journal_v1.FINISHED, json.dumps({"finished": [["old", "committed"]], "decided": [],
                                                     "forgot_commits": False, "next_number": 4}).encode()),
        old_put("c", 0, body("c0")), old_put("c", 1, body("c1")),
        old_record(journal_v1.PREPARE, json.dumps({"xid": "c", "coordinator": "", "at": 1.0}).encode()),
        old_record(journal_v1.COMMIT, json.dumps({"xid": "c", "number": 4, "before": {"t/0": 1, "t/1": 0}}).encode()),
        old_put("p", 1, body("p1")),
        old_record(journal_v1.PREPARE, json.dumps({"xid": "p", "coordinator": '{"path": "/x", "run": "r"}',
                                                   "at": 2.0, "timeout": 30}).encode()),
        old_put("o", 0, body("open")),
    ]))
    store, tx = open_all(tmp_path)
    assert not (tmp_path / "data" / "transactions" / "transactions.journal").exists()
    assert tx.state("old") == "committed" and tx.state("c") == "committed"
    assert [(t.xid, t.timeout_s, t.messages) for t in tx.prepared()] == [("p", 30, 1)]
    assert [v for _, v in rows(store.partition("t", 0))] == ["plain", "c0"]
    assert [v for _, v in rows(store.partition("t", 1))] == ["c1"]
    tx.commit("p")
    assert [v for _, v in rows(store.partition("t", 1))] == ["c1", "p1"]
    tx.begin("new")
    assert tx.get("new").number > 4
    tx.close()
    store.close()


@pytest.mark.process
def test_metaq_log_describe_and_verify_understand_markers(tmp_path):
    store, tx = open_all(tmp_path)
    for xid, end in (("c", "commit"), ("a", "rollback"), ("o", None)):
        tx.begin(xid)
        tx.put(xid, "t", 0, body(xid))
        if end:
            tx.prepare(xid)
            getattr(tx, end)(xid)
    numbers = {x: n for x, n in (("a", 2), ("o", 3))}
    tx.close()
    store.close()
    part = str(tmp_path / "data" / "t-0")
    cli = [sys.executable, "-m", "metaq_broker.tools.cli", "log"]
    out = subprocess.run(cli + ["describe", part], capture_output=True, text=True, check=True).stdout
    # c at 0, its marker 1, a at 2, its marker 3, o at 4: the open one holds the stable offset at 4
    assert "offsets 0 to 5 (next), last stable offset 4" in out, out
    assert f"1 unsettled, #{numbers['o']} from offset 4; 1 aborted with batches here, #{numbers['a']} offsets 2-2" in out
    out = subprocess.run(cli + ["verify", part], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "t-0: ok", out
