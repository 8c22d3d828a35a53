"""The offset bridge (server/offset_bridge.py) against a real ZooKeeper and a real message store, one round
at a time: each side's commit becomes the other's form, a bridged pair is left alone (the bridge never
answers its own writes), and what an attacker or a broken client writes into either node (junk, an offset
of another log, a partition of another broker, a topic this broker lacks) is refused in a log line and
changes nothing."""
import logging
import time

import pytest
from conftest import wait_until

from metaq_broker.server.offset_bridge import OffsetBridge
from metaq_broker.store import MessageStore, TopicConfig
from metaq_broker.zk.group_offsets import GroupStore
from metaq_broker.zk.metaq_layout import MetaqZkLayout


@pytest.fixture
def bridge(tmp_path, zk_clients, zk_root):
    make, paths = zk_clients
    zk = make()
    store = MessageStore(tmp_path / "data", {"t": TopicConfig(num_partitions=1)}, background_interval=None)
    part = store.partition("t", 0)
    part.append([b"a" * 10, b"b" * 20, b"c" * 30], attributes=[None, "x", None])  # 30, 45, 50 bytes in MetaQ
    ids = part.read_arrow(0, 3).column("msgId").to_pylist()
    b = OffsetBridge(store, 1, zk_root, zk=lambda: zk, is_master=lambda: True)
    yield b, zk, paths, MetaqZkLayout(zk_root), part, ids
    store.close()


def rounds_until(b, zk, predicate, what):
    """Bridge rounds until ``predicate()`` (a watch event reaches the bridge's client a moment after the write
    that caused it); returns how many pairs they wrote."""
    before = b.bridged
    wait_until(lambda: b.run_once(zk) >= 0 and predicate(), what=what)
    return b.bridged - before


def test_each_sides_commit_becomes_the_others_and_a_bridged_pair_stays(bridge, zk_root):
    b, zk, paths, layout, part, ids = bridge
    theirs, ours = layout.group_offset("g", "t", "1-0"), paths.group_offset("g", "t", "1-0")
    GroupStore(zk, zk_root).commit("g", "t", {"1-0": 2}, identities={"1-0": part.identity})
    assert rounds_until(b, zk, lambda: zk.exists(theirs) and zk.get(theirs)[0] == f"{ids[1]}-75".encode(),
                        "MetaQ's form") == 1
    time.sleep(0.2)  # the watch events of the bridge's own writes arrive
    assert b.run_once(zk) == 0 and b.run_once(zk) == 0  # in step: nothing more to write

    zk.set(theirs, f"{ids[2]}-125".encode())  # a MetaQ consumer, through message 2
    assert rounds_until(b, zk, lambda: zk.get(ours)[0] == b"3", "metaq's form") == 1
    assert GroupStore(zk, zk_root).fetch("g", "t", identities={"1-0": part.identity}) == {"1-0": 3}
    assert zk.get(theirs)[0] == f"{ids[2]}-125".encode()  # its own value kept
    time.sleep(0.2)
    assert b.run_once(zk) == 0

    zk.set(theirs, b"1")  # a bare offset: an older metaq's
    assert rounds_until(b, zk, lambda: zk.get(ours)[0] == b"1", "the bare offset taken") == 1
    assert zk.get(theirs)[0] == f"{ids[0]}-30".encode()
    time.sleep(0.2)
    assert b.run_once(zk) == 0


def test_what_cannot_be_bridged_is_refused_once_in_words_and_changes_nothing(bridge, zk_root, caplog):
    b, zk, paths, layout, part, ids = bridge
    store = GroupStore(zk, zk_root)
    zk.create(layout.group_offset("junk", "t", "1-0"), b"12-x-3", makepath=True)
    store.commit("other-log", "t", {"1-0": 2}, identities={"1-0": "e" * 32})  # an offset of another log
    zk.create(f"{paths.group_offset('broken', 't', '1-0')}", b"-5", makepath=True)
    zk.create(layout.group_offset("elsewhere", "t", "2-0"), b"7-100", makepath=True)  # broker 2's partition
    zk.create(layout.group_offset("unknown", "nope", "1-0"), b"7-100", makepath=True)  # a topic this broker lacks
    with caplog.at_level(logging.WARNING, logger="metaq_broker.server.offset_bridge"):
        assert rounds_until(b, zk, lambda: sum("12-x" in r.getMessage() for r in caplog.records), "junk seen") == 0
        zk.set(layout.group_offset("junk", "t", "1-0"), b"12-x-4")
        time.sleep(0.2)
        assert b.run_once(zk) == 0
        assert rounds_until(b, zk, lambda: any("broken" in r.getMessage() for r in caplog.records), "all seen") == 0
    assert zk.get(layout.group_offset("junk", "t", "1-0"))[0] == b"12-x-4"
    assert zk.exists(paths.group_offset("junk", "t", "1-0")) is None
    assert zk.exists(layout.group_offset("other-log", "t", "1-0")) is None
    assert zk.exists(layout.group_offset("broken", "t", "1-0")) is None
    assert zk.exists(paths.group_offset("elsewhere", "t", "2-0")) is None
    assert zk.exists(paths.group_offset("unknown", "nope", "1-0")) is None
    messages = [r.getMessage() for r in caplog.records]
    assert sum("12-x" in m for m in messages) == 1  # once, not at every change
    assert any("other-log" in m and "another log" in m for m in messages)
    assert any("broken" in m for m in messages)


def test_nothing_is_bridged_while_not_master_and_what_changed_meanwhile_is_bridged_after(bridge, zk_root):
    b, zk, paths, layout, part, ids = bridge
    master = [False]
    b._is_master = lambda: master[0]
    b.interval_s = 0.05
    b.start()
    try:
        zk.create(layout.group_offset("g", "t", "1-0"), f"{ids[0]}-30".encode(), makepath=True)
        time.sleep(0.5)  # ten rounds as a replica: none may write
        assert zk.exists(paths.group_offset("g", "t", "1-0")) is None
        master[0] = True
        wait_until(lambda: GroupStore(zk, zk_root).fetch("g", "t") == {"1-0": 1}, what="bridged once master")
    finally:
        b.stop()
