"""A partition's idempotent producers, its MetaQ byte stream and its identity, in the storage engine:
duplicates answered with the first offsets and never stored twice, gaps and fenced epochs refused by name,
state rebuilt after a restart (snapshot and tail scan) and on a replica's verbatim copy, expiry; the
stream position running across segments, restarts, truncation and old (version 2) logs; the identity made
with the log and kept."""

import numpy as np
import pytest
from record_v2 import v2_batch

from metaq_broker.errors import DuplicateSequenceError, OutOfOrderSequenceError, ProducerFencedError
from metaq_broker.protocol import records
from metaq_broker.store import PartitionLog, TopicConfig
from metaq_broker.store import identity as identity_file
from metaq_broker.store.producer_state import MAX_BATCHES, SNAPSHOT
from metaq_broker.store.segment import LOG_SUFFIX

pytestmark = pytest.mark.unit


def open_log(path, clock=None, **config):
    kw = {"clock": clock} if clock else {}
    return PartitionLog.open(path, "t", 0, TopicConfig(**config), **kw)


def body(*values):
    return records.encode_body(list(values))


def values(log):
    return log.read_arrow(log.earliest_offset, log.last_stable_offset, 1 << 30).column("value").to_pylist()


def test_a_batch_sent_again_gets_its_first_offsets_and_is_stored_once(tmp_path):
    log = open_log(tmp_path / "p")
    first = log.append_body(body(b"a", b"b"), (7, 0, 0))
    log.append_body(body(b"c"), (7, 0, 2))
    again = log.append_body(body(b"a", b"b"), (7, 0, 0))
    assert (again.base_offset, again.count, again.base_msg_id, again.timestamp) == \
        (first.base_offset, first.count, first.base_msg_id, first.timestamp)
    assert again.duplicate and again.fsynced and not first.duplicate
    assert values(log) == [b"a", b"b", b"c"] and log.log_end_offset == 3
    log.close()


def test_gaps_old_duplicates_and_fenced_epochs_are_refused_by_name(tmp_path):
    log = open_log(tmp_path / "p")
    for seq in range(0, 2 * MAX_BATCHES):
        log.append_body(body(b"x"), (7, 2, seq))
    with pytest.raises(OutOfOrderSequenceError, match=r"producer 7 \(epoch 2\) in partition t-0.*got sequences "
                                                      r"12-12, expected 10"):
        log.append_body(body(b"x"), (7, 2, 12))
    with pytest.raises(DuplicateSequenceError, match="producer 7.*t-0.*sequences 1-1"):
        log.append_body(body(b"x"), (7, 2, 1))
    with pytest.raises(ProducerFencedError, match="producer 7 \\(epoch 1\\) in partition t-0.*epoch 2"):
        log.append_body(body(b"x"), (7, 1, 10))
    with pytest.raises(OutOfOrderSequenceError, match="new epoch starts at sequence 0, got 10"):
        log.append_body(body(b"x"), (7, 3, 10))
    assert log.append_body(body(b"x"), (7, 3, 0)).base_offset == 2 * MAX_BATCHES  # a new epoch from 0
    with pytest.raises(ProducerFencedError):
        log.append_body(body(b"x"), (7, 2, 10))  # the old epoch is fenced from now on
    assert log.append_body(body(b"y"), (8, 0, 5)).count == 1  # an unknown producer may start anywhere
    assert log.log_end_offset == 2 * MAX_BATCHES + 2
    log.close()


@pytest.mark.parametrize("crash", [False, True])
def test_producers_survive_a_restart_from_the_snapshot_and_the_tail(tmp_path, crash):
    log = open_log(tmp_path / "p", max_segment_size=4096)
    for seq in range(40):  # several rolls: snapshots at each, then a tail to scan
        log.append_body(body(b"v" * 300), (9, 0, seq))
    first = log.append_body(body(b"last"), (9, 0, 40))
    assert len(log.segments()) > 3
    if crash:  # no snapshot at close: the open scans from the last roll's snapshot
        log._closed = True
        for seg in log._segments:
            seg._close_fd()
    else:
        log.close()
    log = open_log(tmp_path / "p", max_segment_size=4096)
    again = log.append_body(body(b"last"), (9, 0, 40))
    assert again.duplicate and again.base_offset == first.base_offset
    with pytest.raises(OutOfOrderSequenceError):
        log.append_body(body(b"x"), (9, 0, 43))
    assert log.append_body(body(b"next"), (9, 0, 41)).base_offset == first.base_offset + 1
    log.close()


def test_a_replicas_copy_takes_in_the_producers_and_a_truncation_forgets_the_cut_ones(tmp_path):
    master, replica = open_log(tmp_path / "m"), open_log(tmp_path / "r")
    for seq in range(3):
        master.append_body(body(b"m%d" % seq), (5, 0, seq))
    r = master.read(0, 1 << 20)
    replica.append_replicated(r.data, r.batch_positions)
    replica.make_durable(replica.log_end_offset)
    assert replica.append_body(body(b"m2"), (5, 0, 2)).duplicate  # the new master answers it
    assert replica.metaq_end == master.metaq_end
    replica.truncate_to(2)
    assert not replica.append_body(body(b"m2"), (5, 0, 2)).duplicate  # the cut batch is stored again
    assert values(replica) == [b"m0", b"m1", b"m2"]
    master.close()
    replica.close()


def test_idle_producers_expire(tmp_path, clock):
    log = open_log(tmp_path / "p", clock=clock, producer_id_expiration_ms=60_000)
    log.append_body(body(b"a"), (3, 0, 0))
    clock.advance(61)
    assert not log.append_body(body(b"a"), (3, 0, 0)).duplicate  # forgotten: stored again (as in Kafka)
    log.close()
    assert b'"producers": [[3,' in (tmp_path / "p" / SNAPSHOT).read_bytes()


def _batch_bases(log):
    r = log.read(0, 1 << 30, end=log.log_end_offset)
    return records.v3_fields(r.data, r.batch_positions)["byte_base"].tolist()


def test_batches_carry_their_metaq_stream_position(tmp_path):
    log = open_log(tmp_path / "p", max_segment_size=4096)
    sizes = []
    for i in range(30):
        b = records.encode_body([b"x" * (100 + i), b"y"], attributes=[None, "attr"])
        sizes.append(b.metaq_bytes)
        log.append_body(b)
    log.append_marker(1, commit=False)  # markers take their place in the stream too
    expected = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    assert sizes[0] == 20 + 100 + 20 + 4 + 4 + 1
    end = log.metaq_end
    log.close()
    log = open_log(tmp_path / "p", max_segment_size=4096)
    assert log.metaq_end == end == expected[-1] + 21
    bases = []
    offset = 0
    while offset < log.log_end_offset:
        r = log.read(offset, 1 << 20, end=log.log_end_offset)
        bases += records.v3_fields(r.data, r.batch_positions)["byte_base"].tolist()
        offset = r.end_offset
    assert bases == expected
    log.close()


def _write_v2_log(path, batches):
    """A partition directory as the previous metaq left it: version 2 batches, no identity file."""
    from metaq_broker.store.segment import encode_segment_header
    path.mkdir(parents=True)
    out, offset = [encode_segment_header(0, 0)], 0
    for vals in batches:
        out.append(v2_batch(vals, base=offset, msg_id=100 + offset, ts=1_700_000_000_000))
        offset += len(vals)
    (path / ("0" * 20 + LOG_SUFFIX)).write_bytes(b"".join(out))


def test_an_old_version_2_log_opens_reads_and_continues_in_version_3(tmp_path):
    path = tmp_path / "t-0"
    _write_v2_log(path, [[b"old-a", b"old-b"], [b"old-c"]])
    log = open_log(path)
    ident = log.identity
    assert log.identity_adopted and len(ident) == 32
    # version 2 batches continue the stream from 3 x their segment's start (0 here)
    assert log.metaq_end == 3 * (20 + 5)
    log.append([b"new"])
    assert values(log) == [b"old-a", b"old-b", b"old-c", b"new"] and log.verify() == []
    assert _batch_bases(log) == [-1, -1, 75]
    log.close()
    log = open_log(path)
    assert log.identity == ident and log.metaq_end == 75 + 23 and values(log)[-1] == b"new"
    log.close()


def test_a_new_log_has_a_new_identity_that_it_keeps(tmp_path):
    a = open_log(tmp_path / "a")
    assert not a.identity_adopted
    ident = a.identity
    a.append([b"x"])
    a.close()
    a = open_log(tmp_path / "a")
    assert a.identity == ident
    a.close()
    b = open_log(tmp_path / "b")
    assert b.identity != ident
    b.reset_to(0, identity=ident)  # a replica starting over as its master's log
    assert b.identity == ident and not b.identity_adopted
    b.close()
    (tmp_path / "a" / identity_file.FILE).write_bytes(b"garbage")
    with pytest.raises(Exception, match="unreadable partition identity"):
        open_log(tmp_path / "a")
