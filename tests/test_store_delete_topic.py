"""Deleting a topic from the store (Kafka's DeleteTopics, server/topic_deletion.py carries it out): its
partitions are closed and their directories removed crash-safely, the other topics untouched; a crash after
a partition directory was renamed ``*.deleted`` leaves a directory the next open removes, never opens; a
topic created again under the name starts empty at offset 0."""
import os
import threading

import pytest

from metaq_broker.errors import UnknownTopicError
from metaq_broker.store import MessageStore, TopicConfig
from metaq_broker.store.durable import remove_dir

pytestmark = pytest.mark.unit


def _values(n, tag=b"v"):
    return [tag + str(i).encode() for i in range(n)]


def test_delete_topic_removes_its_partitions_and_nothing_else(tmp_path):
    with MessageStore(tmp_path, {"gone": TopicConfig(num_partitions=2), "kept": TopicConfig(num_partitions=1)},
                      background_interval=None) as store:
        for p in (0, 1):
            store.append("gone", p, _values(3))
        store.append("kept", 0, _values(5))
        assert store.delete_topic("gone") == 2
        assert store.topics() == ["kept"]
        assert sorted(os.listdir(tmp_path)) == ["kept-0"]
        assert [p.topic for p in store.all_partitions()] == ["kept"]
        with pytest.raises(UnknownTopicError, match="unknown topic 'gone'"):
            store.append("gone", 0, _values(1))
        with pytest.raises(UnknownTopicError, match="unknown topic 'gone'"):
            store.delete_topic("gone")  # twice: the second finds nothing
        assert store.read("kept", 0, 0).end_offset == 5
        store.create_topic("gone", TopicConfig(num_partitions=1))  # again: empty, from offset 0
        assert store.partition("gone", 0).log_end_offset == 0
        assert store.append("gone", 0, _values(1)).base_offset == 0
    with MessageStore(tmp_path, background_interval=None) as store:  # reopened: as it was left
        assert store.topics() == ["gone", "kept"] and store.partition("gone", 0).log_end_offset == 1


def test_a_crash_after_the_rename_is_finished_on_open(tmp_path):
    """The state a kill -9 leaves in the middle of ``remove_dir``: one partition renamed ``*.deleted`` with its
    files (and a half-removed one with a file fewer); the next open removes both, opens neither, and the
    topic's other partition is opened as it is (the broker's deletion record deletes it again)."""
    with MessageStore(tmp_path, {"gone": TopicConfig(num_partitions=3)}, background_interval=None) as store:
        for p in range(3):
            store.append("gone", p, _values(4))
    os.rename(tmp_path / "gone-0", tmp_path / "gone-0.deleted")
    os.rename(tmp_path / "gone-2", tmp_path / "gone-2.deleted")
    os.unlink(next((tmp_path / "gone-2.deleted").glob("*.meta")))
    with MessageStore(tmp_path, background_interval=None) as store:
        assert sorted(os.listdir(tmp_path)) == ["gone-0", "gone-1"]  # 0 made afresh: the topic has 2 now
        assert store.partition("gone", 1).log_end_offset == 4 and store.partition("gone", 0).log_end_offset == 0
        store.delete_topic("gone")
    assert os.listdir(tmp_path) == []


def test_remove_dir_finishes_a_removal_cut_short_before_it(tmp_path):
    (tmp_path / "a-0").mkdir()
    (tmp_path / "a-0" / "f").write_bytes(b"new")
    (tmp_path / "a-0.deleted").mkdir()  # an earlier removal of the same name, cut short
    (tmp_path / "a-0.deleted" / "f").write_bytes(b"old")
    remove_dir(tmp_path / "a-0")
    assert os.listdir(tmp_path) == []


def test_appends_racing_a_deletion_end_stored_or_refused(tmp_path):
    """Writers keep appending while the topic is deleted: each append either was stored before the close or
    fails with a metaq error naming the topic or the closed log, none hangs, and nothing of it stays on disk."""
    store = MessageStore(tmp_path, {"gone": TopicConfig(num_partitions=2)}, background_interval=None)
    errors, stop = [], threading.Event()

    def write(p):
        while not stop.is_set():
            try:
                store.append("gone", p, _values(10))
            except Exception as e:  # noqa: BLE001 - collected and checked below
                errors.append(e)
                return
    threads = [threading.Thread(target=write, args=(p,)) for p in (0, 1)]
    for t in threads:
        t.start()
    while sum(p.log_end_offset for p in store.all_partitions()) < 100:
        pass
    store.delete_topic("gone")
    stop.set()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    assert all(type(e).__module__ == "metaq_broker.errors" for e in errors), errors
    assert os.listdir(tmp_path) == []
    store.close()
