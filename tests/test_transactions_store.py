"""Broker transactions at the storage level: invisible until commit, durable prepare, idempotent
outcomes, and recovery of a commit cut short or a torn journal. (tests/test_transactions_log.py: the log
side: markers, last stable offset, crashes, full disks, old journals.)"""
import pytest

from metaq_broker.errors import CorruptLogError, MessageTooLargeError, UnknownTopicError
from metaq_broker.protocol import records
from metaq_broker.store import MessageStore, TopicConfig
from metaq_broker.store.transactions import TransactionError, TransactionManager, UnknownTransactionError
from metaq_broker.store.txn_journal import COMMIT, JOURNAL

pytestmark = pytest.mark.unit


def markers(store, partition):
    """(transaction number, commit?) of every marker in the partition, in log order."""
    log = store.partition("t", partition)
    out = []
    offset = 0
    while offset < log.visible_end:
        r = log.read(offset, 1 << 20, end=log.visible_end)
        data = r.data
        for pos, value_at in zip(r.batch_positions.tolist(), records.data_starts(data, r.batch_positions).tolist()):
            h = records.parse_header(data, pos)
            if h.attributes & records.CONTROL:
                out.append((h.txn, bytes(data[value_at: value_at + 1]) == records.COMMIT_MARKER))
        offset = r.end_offset
    return out


def open_all(path, clock=None):
    store = MessageStore(path / "data", {"t": TopicConfig(num_partitions=2, max_message_size=1000)},
                         background_interval=None)
    kw = {"clock": clock} if clock else {}
    return store, TransactionManager(store, path / "data" / "transactions", default_timeout_s=5, **kw)


def body(*values):
    return records.encode_body([v.encode() for v in values])


def values(store, partition):
    log = store.partition("t", partition)
    if log.last_stable_offset == 0:
        return []
    return [v.as_py().decode() for v in log.read_arrow(0, log.last_stable_offset).column("value")]


def test_invisible_until_commit_then_atomic_per_partition(tmp_path):
    store, tx = open_all(tmp_path)
    store.partition("t", 0).append([b"plain"])
    tx.begin("x1")
    tx.put("x1", "t", 0, body("a", "b"))
    tx.put("x1", "t", 1, body("c"))
    tx.put("x1", "t", 0, body("d"))
    assert tx.prepare("x1").messages == 4
    assert values(store, 0) == ["plain"] and values(store, 1) == []
    assert tx.commit("x1") == "committed"
    assert values(store, 0) == ["plain", "a", "b", "d"] and values(store, 1) == ["c"]
    assert tx.commit("x1") == "committed"  # idempotent
    assert values(store, 0) == ["plain", "a", "b", "d"]
    with pytest.raises(TransactionError, match="committed; it cannot be rolled back"):
        tx.rollback("x1")
    tx.close()
    store.close()


def test_rollback_discards_and_is_idempotent(tmp_path):
    store, tx = open_all(tmp_path)
    tx.begin("r1")
    tx.put("r1", "t", 0, body("gone"))
    tx.prepare("r1")
    assert tx.rollback("r1") == "rolled_back"
    assert tx.rollback("r1") == "rolled_back"
    assert values(store, 0) == []
    with pytest.raises(TransactionError, match="rolled back"):
        tx.commit("r1")
    tx.close()
    store.close()


def test_bad_requests_name_the_problem(tmp_path):
    store, tx = open_all(tmp_path)
    with pytest.raises(TransactionError, match="transaction id"):
        tx.begin("")
    with pytest.raises(UnknownTransactionError, match="unknown transaction 'nope'"):
        tx.put("nope", "t", 0, body("x"))
    tx.begin("b1")
    with pytest.raises(TransactionError, match="already exists"):
        tx.begin("b1")
    with pytest.raises(TransactionError, match="prepare it first"):
        tx.commit("b1")
    with pytest.raises(UnknownTopicError):
        tx.put("b1", "nosuch", 0, body("x"))
    with pytest.raises(MessageTooLargeError):
        tx.put("b1", "t", 0, body("y" * 2000))
    tx.prepare("b1")
    with pytest.raises(TransactionError, match="prepared; it takes no more messages"):
        tx.put("b1", "t", 0, body("late"))
    with pytest.raises(UnknownTransactionError):
        tx.commit("never-begun")
    tx.close()
    store.close()


def test_prepared_survives_restart_open_does_not(tmp_path):
    store, tx = open_all(tmp_path)
    tx.begin("p1", coordinator='{"path": "/sinks/s/batches/7"}')
    tx.put("p1", "t", 1, body("kept"))
    tx.prepare("p1")
    tx.begin("o1")
    tx.put("o1", "t", 1, body("lost"))
    tx.begin("c1")
    tx.put("c1", "t", 0, body("done"))
    tx.prepare("c1")
    tx.commit("c1")
    tx.close()
    store.close()

    store, tx = open_all(tmp_path)
    assert [(t.xid, t.coordinator, t.messages) for t in tx.prepared()] == [("p1", '{"path": "/sinks/s/batches/7"}', 1)]
    assert tx.state("o1") is None and tx.state("c1") == "committed"
    with pytest.raises(UnknownTransactionError):
        tx.prepare("o1")
    assert tx.commit("c1") == "committed"  # still idempotent after a restart
    tx.commit("p1")
    assert values(store, 0) == ["done"] and values(store, 1) == ["kept"]
    tx.close()
    store.close()


def test_commit_cut_short_by_a_crash_is_finished_once(tmp_path):
    store, tx = open_all(tmp_path)
    tx.begin("k1")
    tx.put("k1", "t", 0, body("a"))
    tx.put("k1", "t", 1, body("b"))
    tx.prepare("k1")
    # The crash point: decision journalled, partition 0's marker written, partition 1's not, no DONE record.
    number = tx.get("k1").number
    tx.journal.append(COMMIT, {"xid": "k1", "number": number}, fsync=True)
    store.partition("t", 0).append_marker(number, commit=True)
    assert values(store, 0) == ["a"] and values(store, 1) == []
    tx.close()
    store.close()

    store, tx = open_all(tmp_path)
    assert values(store, 0) == ["a"] and values(store, 1) == ["b"]
    assert markers(store, 0) == [(number, True)] and markers(store, 1) == [(number, True)]
    assert tx.state("k1") == "committed"
    tx.begin("k2")  # numbers continue after the recovered one
    assert tx.get("k2").number > number
    tx.put("k2", "t", 0, body("c"))
    tx.prepare("k2")
    tx.commit("k2")
    assert values(store, 0) == ["a", "c"]
    tx.close()
    store.close()


def test_torn_journal_tail_is_cut_damage_inside_refuses(tmp_path):
    store, tx = open_all(tmp_path)
    tx.begin("p1")
    tx.put("p1", "t", 0, body("prepared"))
    tx.prepare("p1")
    tx.begin("o1")
    tx.put("o1", "t", 0, body("never prepared"))
    tx.begin("c1")
    tx.put("c1", "t", 1, body("committed"))
    tx.prepare("c1")
    tx.commit("c1")
    tx.close()
    store.close()
    journal = tmp_path / "data" / "transactions" / JOURNAL
    data = journal.read_bytes()
    journal.write_bytes(data[:-3])  # c1's last record (DONE: its markers are written) is torn
    store, tx = open_all(tmp_path)
    assert [t.xid for t in tx.prepared()] == ["p1"]
    assert tx.state("c1") == "committed" and values(store, 1) == ["committed"]
    assert tx.state("o1") is None
    tx.commit("p1")
    assert values(store, 0) == ["prepared"]  # o1's batch was rolled back when the broker reopened
    tx.begin("p2")
    tx.put("p2", "t", 0, body("more"))
    tx.prepare("p2")
    tx.close()
    store.close()

    data = bytearray(journal.read_bytes())
    data[10] ^= 0xFF  # inside the first record; valid ones follow
    journal.write_bytes(bytes(data))
    store = MessageStore(tmp_path / "data", {"t": TopicConfig(num_partitions=2)}, background_interval=None)
    with pytest.raises(CorruptLogError, match="damaged transaction record"):
        TransactionManager(store, tmp_path / "data" / "transactions")
    store.close()


def test_open_transactions_time_out_prepared_never(tmp_path, clock):
    store, tx = open_all(tmp_path, clock)
    tx.begin("slow")
    tx.put("slow", "t", 0, body("x"))
    tx.begin("ready", timeout_s=1)
    tx.prepare("ready")
    clock.now += 6
    assert tx.expire() == ["slow"]
    assert tx.state("slow") == "rolled_back" and tx.state("ready") == "prepared"
    assert tx.counts() == {"open": 0, "prepared": 1, "committing": 0, "aborting": 0}
    tx.close()
    store.close()


def test_outcomes_with_a_decision_record_outlive_the_lru(tmp_path, monkeypatch):
    """A commit decision may be replayed long after: the outcome of a transaction begun with a decision
    record is kept (also across a restart) while the record exists, not only for KEEP_FINISHED later
    transactions; and a rollback of a forgotten xid does not claim it was rolled back."""
    from metaq_broker.store import txn_state
    monkeypatch.setattr(txn_state, "KEEP_FINISHED", 3)
    store, tx = open_all(tmp_path)
    record = '{"path": "/meta/sinks/s/batches/00000000000000000001", "run": "r"}'
    for xid, coordinator in (("decided", record), ("plain", "")):
        tx.begin(xid, coordinator=coordinator)
        tx.put(xid, "t", 0, body(xid))
        tx.prepare(xid)
        tx.commit(xid)
    for i in range(5):  # later transactions push both out of the LRU of 3
        tx.begin(f"later{i}")
        tx.prepare(f"later{i}")
        tx.rollback(f"later{i}")
    tx.close()
    store, tx = open_all(tmp_path)  # the kept outcome survives a restart
    assert tx.commit("decided") == "committed"
    with pytest.raises(TransactionError, match="committed; it cannot be rolled back"):
        tx.rollback("decided")
    with pytest.raises(UnknownTransactionError, match="outcome may have been forgotten"):
        tx.rollback("plain")
    assert tx.decided_records() == {"/meta/sinks/s/batches/00000000000000000001"}
    assert tx.forget_decided({"/meta/sinks/s/batches/00000000000000000001"}) == 1
    with pytest.raises(UnknownTransactionError):
        tx.commit("decided")
    assert values(store, 0) == ["decided", "plain"]
    tx.close()
    store.close()


def test_a_transactions_own_timeout_governs_its_prepared_life_and_is_capped(tmp_path):
    """BeginTransaction's timeout is the transaction's limit also once prepared, kept across a restart;
    more than the broker's transactionMaxTimeout is refused naming both settings."""
    store, tx = open_all(tmp_path)
    tx.begin("slow", timeout_s=120)
    tx.prepare("slow")
    with pytest.raises(TransactionError, match=r"exceeds the broker's transactionMaxTimeout \(900000 ms\).*"
                                               r"transactionTimeoutMs"):
        tx.begin("greedy", timeout_s=901)
    tx.close()
    store, tx = open_all(tmp_path)
    assert [(t.xid, t.timeout_s) for t in tx.prepared()] == [("slow", 120)]
    tx.close()
    store.close()


def test_a_transaction_moves_only_as_the_transition_table_says():
    """The state machine's one table: the moves the XA calls, recovery and promotion make, and no other
    (an illegal move raises naming both states and leaves the state as it was)."""
    from metaq_broker.store.txn_state import Transaction, TxnState
    legal = {("open", "prepared"), ("open", "aborting"), ("prepared", "committing"), ("prepared", "aborting"),
             ("committing", "committed"), ("aborting", "rolled_back")}
    for state in TxnState:
        for to in TxnState:
            t = Transaction("x", state, 60, 1)
            if (state, to) in legal:
                t.move(to)
                assert t.state is to
            else:
                with pytest.raises(TransactionError, match=f"'x': no transition from {state.value} to {to.value}$"):
                    t.move(to)
                assert t.state is state
