"""A partition's epochs file (store/epochs.py): its byte layout, damage found and named, the rules on
appending, truncation and retention, and the answers a master gives a rejoining replica in the cases of
docs/design/replication-plan.md section 6 (KIP-101 and KIP-279)."""
import shutil
import struct

import pytest

from metaq_broker.errors import CorruptLogError
from metaq_broker.protocol.records import crc
from metaq_broker.store import PartitionLog, TopicConfig
from metaq_broker.store.epochs import FILE_NAME, Epoch, EpochFile, decode, encode

pytestmark = pytest.mark.unit


def log_of(tmp_path, name, *entries):
    directory = tmp_path / name
    directory.mkdir()
    f = EpochFile(directory)
    for epoch, start in entries:
        f.append(epoch, epoch % 3, start)
    return f


def test_layout_is_magic_count_crc_then_16_byte_entries(tmp_path):
    f = log_of(tmp_path, "p", (1, 0), (4, 100))
    data = (tmp_path / "p" / FILE_NAME).read_bytes()
    body = struct.pack("<IIq", 1, 1, 0) + struct.pack("<IIq", 4, 1, 100)
    assert data == b"MQEPOCH1" + struct.pack("<II", 2, crc(body)) + body
    assert EpochFile.load(tmp_path / "p").entries == f.entries == [Epoch(1, 1, 0), Epoch(4, 1, 100)]


def test_no_file_means_epoch_zero_everywhere(tmp_path):
    f = EpochFile.load(tmp_path)
    assert f.entries == [] and f.latest is None and f.epoch_at(123) == 0
    assert f.end_offset_for(7, log_end=42) == (0, 42)


@pytest.mark.parametrize("damage, match", [
    (lambda d: d[:10], "shorter than the 16-byte header"),
    (lambda d: b"XXEPOCH1" + d[8:], "not an epochs file"),
    (lambda d: d[:-1], "need 32 bytes after the header, found 31"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "fail their CRC-32C"),
])
def test_damage_is_found_and_names_the_file(tmp_path, damage, match):
    log_of(tmp_path, "p", (1, 0), (2, 10))
    path = tmp_path / "p" / FILE_NAME
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CorruptLogError, match=match) as e:
        EpochFile.load(tmp_path / "p")
    assert str(path) in str(e.value)


def test_entries_out_of_order_are_damage_too():
    with pytest.raises(CorruptLogError, match="epoch 2 at offset 5 does not follow epoch 3 at offset 1"):
        decode(encode([Epoch(3, 0, 1), Epoch(2, 0, 5)]))


def test_epochs_and_starts_only_grow(tmp_path):
    f = log_of(tmp_path, "p", (2, 10))
    with pytest.raises(ValueError, match="epoch 2 at offset 20 cannot follow epoch 2 at offset 10"):
        f.append(2, 0, 20)
    with pytest.raises(ValueError, match="epoch 3 at offset 10 cannot follow"):
        f.append(3, 0, 10)
    with pytest.raises(ValueError, match="out of range"):
        f.append(0, 0, 30)
    assert EpochFile.load(tmp_path / "p").entries == [Epoch(2, 2, 10)]  # nothing refused was saved


def test_truncate_and_trim_keep_what_covers_the_log(tmp_path):
    f = log_of(tmp_path, "p", (1, 0), (2, 50), (5, 70), (6, 90))
    f.truncate(90)  # the log was cut at 90: epoch 6 began there and holds nothing now
    f.trim(60)  # retention removed offsets below 60: epoch 1 goes, epoch 2 covers 60 and starts there now
    assert EpochFile.load(tmp_path / "p").entries == [Epoch(2, 2, 60), Epoch(5, 2, 70)]
    assert [f.epoch_at(o) for o in (60, 69, 70, 89)] == [2, 2, 5, 5]
    f.trim(60)  # nothing more to do: the file is not rewritten
    f.trim(75)
    assert EpochFile.load(tmp_path / "p").entries == [Epoch(5, 2, 75)]


def test_a_replica_that_starts_over_after_retention_is_not_told_it_diverges(tmp_path):
    """Issue 24, defect 6: the master's retention removed everything the replica has and the start of
    epoch 2's range. The replica (epoch 1 only) asks; the master's answer lets it start over at the
    earliest offset (RESET, with the epoch there), after which its requests validate at once. With the
    first entry's start left below the earliest offset, the master answered "diverges at 50" after
    every reset, forever."""
    master = log_of(tmp_path, "m", (1, 0), (2, 50), (5, 70))
    master.trim(60)
    replica = log_of(tmp_path, "r", (1, 0))
    held, end = master.end_offset_for(1, log_end=100)
    assert (held, end) == (0, 60)  # the replica's epoch 1 is gone here: it holds nothing of this log
    assert rejoin(replica, 40, master, 100) == 0  # cut to its own epoch-0 part (none)
    replica.reset(master.epoch_at(60), 60)  # RESET(earliest 60, epoch 2): reset_to(60, 2)
    assert replica.entries == [Epoch(2, 0, 60)]
    for replica_end in (60, 65, 70, 80):  # copying on: every request validates (no DIVERGING)
        if replica_end > 70 and replica.latest.epoch < 5:
            replica.append(5, 2, 70)  # epoch 5's marker copied
        last = replica.epoch_at(replica_end - 1)
        held, end = master.end_offset_for(last, log_end=100)
        assert held == last and replica_end <= end
    assert EpochFile.load(tmp_path / "r").entries == [Epoch(2, 0, 60), Epoch(5, 2, 70)]


def rejoin(replica: EpochFile, replica_end: int, master: EpochFile, master_end: int) -> int:
    """Where a rejoining replica cuts its log, asking the master as section 6 describes."""
    while True:
        last = replica.latest.epoch if replica.latest else 0
        held, end = master.end_offset_for(last, master_end)
        own, own_end = replica.end_offset_for(held, replica_end)
        if own == held:  # it holds e': cut to where e' ends on the master
            return min(end, own_end, replica_end)
        replica.truncate(own_end)  # it lacks e': cut to where its largest epoch below e' ends, ask again
        replica_end = own_end


def test_a_deposed_masters_unacknowledged_tail_is_cut(tmp_path):
    """Worked example: A wrote 100-109 in epoch 1, B copied to 104 and won epoch 2 at 105."""
    b = log_of(tmp_path, "b", (1, 0), (2, 105))
    a = log_of(tmp_path, "a", (1, 0))
    assert b.end_offset_for(1, log_end=120) == (1, 105)
    assert rejoin(a, 110, b, 120) == 105
    c = log_of(tmp_path, "c", (1, 0))  # C had 0-99 and copies on from 100: nothing to cut
    assert rejoin(c, 100, b, 120) == 100


def test_kip_279_the_answer_is_the_largest_epoch_the_master_holds(tmp_path):
    """B wrote 105-107 in epoch 2 and died; C (0-104) won epoch 3 at 105. B rejoins asking with 2."""
    c = log_of(tmp_path, "c", (1, 0), (3, 105))
    b = log_of(tmp_path, "b", (1, 0), (2, 105))
    assert c.end_offset_for(2, log_end=130) == (1, 105)  # not "epoch 2 ends at my log end"
    assert rejoin(b, 108, c, 130) == 105


def test_a_replica_lacking_the_answered_epoch_asks_again(tmp_path):
    master = log_of(tmp_path, "m", (1, 0), (2, 50), (5, 70))
    replica = log_of(tmp_path, "r", (1, 0), (3, 60))
    assert master.end_offset_for(3, log_end=100) == (2, 70)
    assert rejoin(replica, 80, master, 100) == 50
    assert replica.entries == [Epoch(1, 1, 0)]  # its epoch 3 went with the cut


def test_an_epoch_marker_is_invisible_to_readers_and_to_transactions(tmp_path):
    """Plan step 1: a CONTROL batch with txn 0 carries an epoch; readers skip it, it settles no
    transaction, and recovery's scan passes it by (a reopen keeps the last stable offset at the log end)."""
    from metaq_broker.protocol import records
    from metaq_broker.store import MessageStore, TopicConfig
    from metaq_broker.store.transactions import TransactionManager

    def open_all():
        store = MessageStore(tmp_path / "data", {"t": TopicConfig(num_partitions=1)}, background_interval=None)
        return store, TransactionManager(store, tmp_path / "data" / "transactions", default_timeout_s=5)

    value = records.epoch_marker(7, 2)
    assert len(value) == 9 and records.parse_epoch_marker(value) == (7, 2)
    assert records.parse_epoch_marker(records.COMMIT_MARKER) is None
    store, tx = open_all()
    log = store.partition("t", 0)
    log.append_body(records.encode_body([b"before"]))
    tx.begin("x1")
    tx.put("x1", "t", 0, records.encode_body([b"in a transaction"]))
    marker = log.append_bodies([records.encode_body([value])], 0, records.CONTROL)[0].base_offset
    assert log.last_stable_offset == 1  # the open transaction still holds readers back: the marker settled nothing
    tx.prepare("x1")
    tx.commit("x1")
    log.append_body(records.encode_body([b"after"]))
    got = log.read(0, 1 << 20).decode().column("value").to_pylist()
    assert got == [b"before", b"in a transaction", b"after"] and marker == 2
    tx.close()
    store.close()
    store, tx = open_all()
    log = store.partition("t", 0)
    assert log.last_stable_offset == log.visible_end == 5
    assert log.read(0, 1 << 20).decode().column("value").to_pylist() == got
    tx.close()
    store.close()


def open_partition(path):
    return PartitionLog.open(path, "t", 0, TopicConfig())


def test_crash_between_the_marker_and_the_epochs_file(tmp_path):
    """Plan step 3: the marker is in the log, the epochs file was not yet rewritten (a copy of the
    directory taken without closing is what a crash leaves): reopening adds it."""
    log = open_partition(tmp_path / "p")
    log.append([b"before"])
    log.begin_epoch(1, 0)
    log.append([b"one"])
    old = (tmp_path / "p" / "epochs").read_bytes()
    log.begin_epoch(2, 3)
    log.append([b"two"])
    crashed = shutil.copytree(log.directory, tmp_path / "crashed")
    (crashed / "epochs").write_bytes(old)
    again = open_partition(crashed)
    assert again.epochs.entries == [Epoch(1, 0, 1), Epoch(2, 3, 3)] == EpochFile.load(crashed).entries
    assert again.read(0).decode().column("value").to_pylist() == [b"before", b"one", b"two"]
    again.close()
    crashed = shutil.copytree(log.directory, tmp_path / "crashed2")
    (crashed / "epochs").unlink()  # the crash came before the file's first write: the same
    again = open_partition(crashed)
    assert again.epochs.entries == [Epoch(1, 0, 1), Epoch(2, 3, 3)]
    again.close()
    log.close()
