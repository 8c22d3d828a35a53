"""The housekeeping of the exactly-once sink's decision records (zk/decisions.py) against a real ZooKeeper:
a streaming sink keeps its last two batches, a settled batch write's sink goes whole, and the sweep takes
only leftovers of batch writes older than the horizon that the caller may write, never a streaming sink's
records. Paths come from ``ZkPaths`` only: a sink id that is no path component is refused, not spliced."""
import time

import pytest
from kazoo.client import KazooClient

from metaq_broker.zk import decisions
from metaq_broker.zk.decisions import BATCH_WRITE_PREFIX
from metaq_broker.zk.paths import ZkPaths

pytestmark = pytest.mark.unit

DAY = 86_400


@pytest.fixture
def zk(zookeeper):
    client = KazooClient(zookeeper.connect_string)
    client.start(10)
    yield client
    client.stop()
    client.close()


def test_a_sink_node_and_its_records_have_one_path_builder():
    p = ZkPaths("/meta")
    assert p.sink("etl") == "/meta/sinks/etl"
    assert p.sink_batches("etl") == "/meta/sinks/etl/batches"
    assert p.sink_batch("etl", 7) == "/meta/sinks/etl/batches/00000000000000000007"
    for bad in ("", "..", "a/b"):
        with pytest.raises(ValueError, match="sink id"):
            p.sink(bad)


def test_forget_below_keeps_the_batches_a_replay_may_ask_for(zk, zk_root):
    paths = ZkPaths(zk_root)
    for batch in range(5):
        decisions.decide_commit(zk, paths.sink_batch("s", batch), f"run{batch}", [[1, f"x{batch}"]])
    decisions.decide_commit(zk, paths.sink_batch("other", 0), "r", [])
    assert decisions.forget_below(zk, paths, "s", 3) == 3
    assert sorted(zk.get_children(paths.sink_batches("s"))) == [f"{3:020d}", f"{4:020d}"]
    assert decisions.read(zk, paths.sink_batch("s", 4))[0].run == "run4"  # kept as it was
    assert zk.exists(paths.sink_batch("other", 0))  # another sink's records untouched
    assert decisions.forget_below(zk, paths, "s", 3) == 0
    assert decisions.forget_below(zk, paths, "never-written", 3) == 0


def test_forget_sink_deletes_the_node_whole_and_is_harmless_twice(zk, zk_root):
    paths = ZkPaths(zk_root)
    decisions.decide_commit(zk, paths.sink_batch("write.job", 0), "r", [[1, "x"]])
    decisions.decide_commit(zk, paths.sink_batch("kept", 0), "r", [])
    decisions.forget_sink(zk, paths, "write.job")
    assert zk.exists(paths.sink("write.job")) is None
    decisions.forget_sink(zk, paths, "write.job")  # gone already: no error
    assert zk.exists(paths.sink_batch("kept", 0))
    with pytest.raises(ValueError, match="sink id '..'"):
        decisions.forget_sink(zk, paths, "..")  # never the parent of every sink
    assert zk.exists(paths.sink_batch("kept", 0))


def test_the_sweep_takes_only_old_batch_write_leftovers_the_caller_may_write(zk, zk_root):
    paths = ZkPaths(zk_root)
    w = BATCH_WRITE_PREFIX
    decisions.decide_commit(zk, paths.sink_batch(f"{w}settled", 0), "r", [[1, "x"]])  # driver died after it
    decisions.decide_abort(zk, paths.sink_batch(f"{w}aborted", 0), "r")
    zk.ensure_path(paths.sink_batches(f"{w}empty"))  # died before any decision
    decisions.decide_commit(zk, paths.sink_batch(f"{w}foreign", 0), "r", [])
    decisions.decide_commit(zk, paths.sink_batch(f"{w}streaming", 0), "r", [], {"query": "q", "checkpoint": "/c"})
    decisions.decide_commit(zk, paths.sink_batch(f"{w}two", 0), "r", [])
    decisions.decide_commit(zk, paths.sink_batch(f"{w}two", 1), "r", [])
    decisions.decide_commit(zk, paths.sink_batch("stream", 0), "r", [])  # not a batch write's sink
    everything = sorted(zk.get_children(paths.sinks()))

    young = decisions.sweep_batch_writes(zk, paths, 7 * DAY, clock=lambda: time.time() + 6 * DAY)
    assert young == [] and sorted(zk.get_children(paths.sinks())) == everything

    gone = decisions.sweep_batch_writes(zk, paths, 7 * DAY, may=lambda sink: sink != f"{w}foreign",
                                        clock=lambda: time.time() + 8 * DAY)
    assert sorted(gone) == [f"{w}aborted", f"{w}empty", f"{w}settled"]
    assert sorted(zk.get_children(paths.sinks())) == sorted(set(everything) - set(gone))
    assert decisions.sweep_batch_writes(zk, ZkPaths(zk_root + "-none"), 0) == []  # no sinks node at all
