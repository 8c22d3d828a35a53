"""The master's acknowledgement wait (``ReplicaManager.await_hw``) in-process: it ends with "not
acknowledged" as soon as the master cannot promise the batch any more, instead of holding the client
until the replica-lag limit. The group's processes under real faults are test_network_partitions.py's."""
import threading

import pytest

from metaq_broker.errors import NotAcknowledgedError
from metaq_broker.protocol import records
from metaq_broker.server.replica_manager import ReplicaManager
from metaq_broker.store import MessageStore, TopicConfig

pytestmark = pytest.mark.unit

LAG_MAX_S = 60.0  # far beyond the waits below: an answer within them came from the check under test


@pytest.fixture
def store(tmp_path):
    s = MessageStore(tmp_path, {"t": TopicConfig(num_partitions=1, min_insync_replicas=2)},
                     background_interval=None)
    yield s
    s.close()


def waiting_put(manager, store):
    """Append a batch on the master and wait for its HW in a thread; returns (thread, outcome list)."""
    end = store.partition("t", 0).append_body(records.encode_body([b"v"])).base_offset + 1
    outcome: list = []

    def wait():
        try:
            manager.await_hw("t", 0, end)
            outcome.append("acknowledged")
        except NotAcknowledgedError as e:
            outcome.append(e)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t, outcome


def master(store, lease):
    m = ReplicaManager(store, None, 1, 0, "u0", LAG_MAX_S, alter_isr=lambda isr: True,
                       lease_valid=lambda: lease.is_set())
    m.activate(1, {0: "u0", 1: "u1"})
    return m


def test_a_lease_that_runs_out_ends_the_wait_with_not_acknowledged(store):
    """A master cut from ZooKeeper refuses its replicas' fetches once its lease runs out, so the HW
    cannot move: a put waiting for it is answered at once, naming the lease, not after the lag limit
    (a client with a shorter timeout heard only "timed out" before)."""
    lease = threading.Event()
    lease.set()
    m = master(store, lease)
    t, outcome = waiting_put(m, store)
    t.join(0.3)
    assert t.is_alive() and not outcome, "the put must wait while the lease holds and no replica has it"
    lease.clear()
    t.join(10)
    assert not t.is_alive(), "the wait went on after the lease ran out"
    assert isinstance(outcome[0], NotAcknowledgedError)
    assert "lease" in str(outcome[0]) and "may or may not be stored" in str(outcome[0])


def test_a_demotion_ends_the_wait_too(store):
    lease = threading.Event()
    lease.set()
    m = master(store, lease)
    t, outcome = waiting_put(m, store)
    m.deactivate()
    t.join(10)
    assert not t.is_alive() and isinstance(outcome[0], NotAcknowledgedError)
    assert "stopped being master" in str(outcome[0])
