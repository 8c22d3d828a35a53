"""MetaQ byte positions of logical offsets read from a real partition log (server/metaq_positions.py), checked
against sizes computed here from the message-set layout (20-byte head, attribute with its 4-byte length,
payload): every offset of a log with attributes, markers, an aborted transaction and several segments, the
way back from every position (message starts, positions inside a message, below the log start and past
its end), a consumer's ``<msgId>-<position>``, and a log of the previous metaq (version 2 batches)."""
import numpy as np
import pytest

from metaq_broker.protocol import records
from metaq_broker.server.metaq_positions import offset_at, position_of
from metaq_broker.store import PartitionLog, TopicConfig
from test_store_producers import _write_v2_log

pytestmark = pytest.mark.unit


def metaq_size(value: bytes, attribute=None) -> int:
    return 20 + len(value) + (0 if attribute is None else 4 + len(attribute.encode()))


@pytest.fixture
def log(tmp_path):
    log = PartitionLog.open(tmp_path / "p", "t", 0, TopicConfig(max_segment_size=4096))
    yield log
    log.close()


def fill(log) -> tuple:
    """Append batches of several sizes (some attributes, markers); return (positions, ids) per offset, and the
    end position, from sizes computed here."""
    positions, ids, at = [], [], 0
    for i in range(80):
        values = [bytes([65 + i % 26]) * (i * 7 % 90) for _ in range(1 + i % 3)]
        attributes = [None if (i + j) % 2 else f"attr-{i}-{j}" for j in range(len(values))]
        result = log.append(values, attributes=attributes)
        for j, (v, a) in enumerate(zip(values, attributes)):
            positions.append(at)
            ids.append(result.base_msg_id + j)
            at += metaq_size(v, a)
        if i % 9 == 4:
            offset = log.append_marker(1, commit=False)  # a marker has its place in the stream: 21 bytes
            assert offset == len(positions)
            positions.append(at)
            ids.append(-2)  # not a message a consumer gets
            at += 21
    return positions, ids, at


def test_every_offset_and_its_position_both_ways(log):
    positions, ids, end = fill(log)
    assert len(log.segments()) >= 3  # positions continue across segments
    assert log.metaq_end == end
    for offset, position in enumerate(positions):
        before = ids[offset - 1] if offset and ids[offset - 1] != -2 else position_of(log, offset)[1]
        assert position_of(log, offset) == (position, before if offset else -1), offset
        assert offset_at(log, -1, position) == offset
        assert offset_at(log, before, position) == offset
        if offset + 1 < len(positions) and positions[offset + 1] - position > 1:
            assert offset_at(log, -1, position + 1) == offset  # inside a message: that message, nothing skipped
    n = len(positions)
    assert position_of(log, n)[0] == end and offset_at(log, -1, end) == n == offset_at(log, ids[n - 1], end)
    assert offset_at(log, -1, end + 1000) == n  # past the end: the end
    assert position_of(log, n + 5)[0] == end  # an offset past the end is clamped (a commit ahead of the log)


def test_a_consumers_message_id_picks_the_message_at_once_but_a_wrong_one_is_not_trusted(log):
    positions, ids, _ = fill(log)
    assert offset_at(log, ids[10], positions[11]) == 11
    assert offset_at(log, ids[3], positions[11]) == 11  # the id of another message: found by the position
    assert offset_at(log, 10 ** 15, positions[7]) == 7  # an id this log never had


def test_below_the_log_start_after_retention(tmp_path):
    log = PartitionLog.open(tmp_path / "p", "t", 0, TopicConfig(max_segment_size=4096, retention_bytes=4096))
    try:
        positions, _, _ = fill(log)
        log.apply_retention()
        start = log.earliest_offset
        assert start > 0
        assert position_of(log, start)[0] == positions[start]  # positions do not move with retention
        assert position_of(log, 0)[0] == positions[start]  # an offset below the start: the start
        assert offset_at(log, -1, 0) == start and offset_at(log, -1, positions[start]) == start
        assert offset_at(log, -1, positions[start + 3]) == start + 3
    finally:
        log.close()


def test_version_2_batches_of_the_previous_metaq(tmp_path):
    path = tmp_path / "t-0"
    _write_v2_log(path, [[b"old-a", b"old-b"], [b"old-c"], [b"x" * 50]])
    log = PartitionLog.open(path, "t", 0, TopicConfig())
    try:
        log.append([b"new"], attributes=["k"])
        # version 2 batches start at 3 x their segment's start (0 here) and follow each other
        expected = [0, 25, 50, 75, 145]
        assert [position_of(log, o)[0] for o in range(5)] == expected
        assert position_of(log, 5)[0] == 145 + 20 + 3 + 4 + 1 == log.metaq_end
        assert [offset_at(log, -1, p) for p in expected] == list(range(5))
        assert position_of(log, 3)[1] == 102  # the id of offset 2 (ids 100 + offset in this log)
        bases = records.v3_fields(log.read(0, 1 << 20).data, log.read(0, 1 << 20).batch_positions)["byte_base"]
        assert np.array_equal(bases, [-1, -1, -1, 145])
    finally:
        log.close()
