"""Bad input to the store: every bad call raises one specific exception whose message names the problem,
and nothing already stored is touched (contents, offsets and the bytes of every file are unchanged).
Also Arrow input of every accepted shape round-trips exactly."""
import re

import grpc
import numpy as np
import pyarrow as pa
import pytest

from metaq_broker.errors import (ConfigError, InvalidMessageError, InvalidOffsetError, InvalidPartitionError,
                                 InvalidTopicError, MessageTooLargeError, OffsetOutOfRangeError, UnknownTopicError)
from metaq_broker.protocol.status import RemoteInvalidArgumentError, RemoteMessageTooLargeError, code_of, error_of
from metaq_broker.store import DeletePolicy, MessageStore, TopicConfig, validate_topic_name

pytestmark = pytest.mark.unit

LIMIT = 100  # max_message_size of topic "t"


def raises_exactly(exc_class, call, *patterns):
    """Run ``call``; it must raise exactly ``exc_class`` (not a subclass) with every pattern in its message."""
    with pytest.raises(exc_class) as info:
        call()
    assert type(info.value) is exc_class, f"raised {type(info.value).__name__}: {info.value}"
    for pattern in patterns:
        assert re.search(pattern, str(info.value)), f"{pattern!r} not in {str(info.value)!r}"
    return info.value


def assert_reaches_a_client_as(e, code, remote_class):
    """What an error's place in errors.py is for: a broker answers it with ``code`` (protocol/status.py's
    table goes by isinstance) and a client raises ``remote_class`` carrying the store's message unchanged."""
    assert code_of(e) == code
    remote = error_of(code, str(e), "127.0.0.1:1")
    assert type(remote) is remote_class and str(e) in str(remote)
    return remote


def dump(p):
    """Every stored message of a partition as dicts, read batch run by batch run."""
    rows, off = [], p.earliest_offset
    latest = p.last_stable_offset
    while off < latest:
        res = p.read(off, max_bytes=1 << 20)
        assert res.end_offset > off
        rows += res.decode().to_pylist()
        off = res.end_offset
    return rows


def state(p):
    files = {f.name: f.read_bytes() for f in sorted(p.directory.rglob("*")) if f.is_file()}
    return p.earliest_offset, p.last_stable_offset, dump(p), files


def fill(p):
    p.append([b"v0", b"v1", b"v2"], keys=[b"k0", None, b""], attributes=["a0", None, "\u00e9"], flags=[1, 2, 3])
    p.append([b"w0"])
    p.append([b"x" * 90], keys=[b"kk"], attributes=["z" * 8], flags=[-7])
    assert p.last_stable_offset == 5


@pytest.fixture
def store(tmp_path, clock):
    s = MessageStore(tmp_path / "data", {"t": TopicConfig(num_partitions=2, max_message_size=LIMIT)},
                     background_interval=None, clock=clock)
    fill(s.partition("t", 0))
    s.partition("t", 1).append([b"p1"])
    yield s
    s.close()


@pytest.fixture
def p(store):
    return store.partition("t", 0)


def check_untouched(store, before):
    """Both partitions hold exactly what they held before, and the next append lands where it would have."""
    for n, snap in enumerate(before):
        part = store.partition("t", n)
        assert state(part) == snap
    p0 = store.partition("t", 0)
    r = p0.append([b"next"])
    assert r.base_offset == before[0][1] and r.count == 1
    assert p0.read_arrow(r.base_offset).column("value").to_pylist() == [b"next"]


def snapshot(store):
    return [state(store.partition("t", n)) for n in range(2)]


# ---------------------------------------------------------------------------------------------------
# Partitions and topics


@pytest.mark.parametrize("bad", [-1, 2, 3, 10_000, "0", "1", None, True, False, b"0", (0,)])
def test_bad_partition_numbers_name_the_valid_range(store, bad):
    before = snapshot(store)
    e = raises_exactly(InvalidPartitionError, lambda: store.partition("t", bad), r"0 to 1", re.escape(repr(bad)))
    assert "'t'" in str(e)
    raises_exactly(InvalidPartitionError, lambda: store.append("t", bad, [b"x"]), r"0 to 1")
    raises_exactly(InvalidPartitionError, lambda: store.read("t", bad, 0), r"0 to 1")
    check_untouched(store, before)


@pytest.mark.parametrize("bad", [0.0, 1.0])
def test_float_partition_numbers_are_rejected_like_bools_and_strings(store, bad):
    # The store rejects True and "0" although they compare/hash like 0 or 1; 0.0 hashes like 0 too and
    # is just as much not a partition number.
    raises_exactly(InvalidPartitionError, lambda: store.partition("t", bad), r"0 to 1")


def test_numpy_integer_partition_numbers_are_accepted(store):
    assert store.partition("t", np.int64(1)) is store.partition("t", 1)


def test_unknown_topic(store, tmp_path):
    before = snapshot(store)
    raises_exactly(UnknownTopicError, lambda: store.partition("nope", 0), r"unknown topic 'nope'")
    raises_exactly(UnknownTopicError, lambda: store.partition("nope", 7), r"'nope'")
    raises_exactly(UnknownTopicError, lambda: store.append("nope", 0, [b"x"]), r"'nope'")
    raises_exactly(UnknownTopicError, lambda: store.read("nope", 0, 0), r"'nope'")
    raises_exactly(UnknownTopicError, lambda: store.topic_config("nope"), r"'nope'")
    raises_exactly(UnknownTopicError, lambda: store.partitions("nope"), r"'nope'")
    assert store.topics() == ["t"]
    assert sorted(e.name for e in (tmp_path / "data").iterdir()) == ["t-0", "t-1"]
    check_untouched(store, before)


BAD_TOPIC_NAMES = [
    ("a/b", r"'/'"),
    ("a\\b", r"\\\\"),
    ("..", r"'\.\.' is not allowed"),
    (".", r"'\.' is not allowed"),
    ("", r"empty"),
    ("x" * 250, r"250 .*249"),
    ("a b", r"' '"),
    ("t\x00", r"contains"),
    ("t\u00e9", r"'\u00e9'"),
    ("../t", r"'/'"),
]


@pytest.mark.parametrize("name,pattern", BAD_TOPIC_NAMES)
def test_illegal_topic_names_are_rejected_everywhere(store, tmp_path, name, pattern):
    before = snapshot(store)
    data = tmp_path / "data"
    entries = sorted(e.name for e in data.iterdir())
    raises_exactly(InvalidTopicError, lambda: validate_topic_name(name), pattern)
    raises_exactly(InvalidTopicError, lambda: store.create_topic(name, TopicConfig()), pattern)
    raises_exactly(InvalidTopicError, lambda: store.create_topic(name), pattern)
    assert store.topics() == ["t"]
    assert sorted(e.name for e in data.iterdir()) == entries
    assert sorted(e.name for e in tmp_path.iterdir()) == ["data"]
    other = tmp_path / "other"
    raises_exactly(InvalidTopicError,
                   lambda: MessageStore(other, {name: TopicConfig()}, background_interval=None), pattern)
    assert [e.name for e in other.iterdir()] == []
    check_untouched(store, before)


@pytest.mark.parametrize("bad", [5, None, b"t"])
def test_topic_names_must_be_strings(bad):
    raises_exactly(InvalidTopicError, lambda: validate_topic_name(bad), r"must be a string")


@pytest.mark.parametrize("name", ["x" * 249, "my-topic", "my.topic.v2", "a_b", "a-1", "t-0", "A.-_9", "-", ".a"])
def test_legal_topic_names_work_and_survive_reopening(tmp_path, clock, name):
    assert validate_topic_name(name) == name
    data = tmp_path / "data"
    with MessageStore(data, {"t": TopicConfig()}, background_interval=None, clock=clock) as s:
        assert s.create_topic(name, TopicConfig(num_partitions=2)).num_partitions == 2
        assert s.topics() == sorted(["t", name])
        s.append(name, 1, [b"hello"])
        s.append("t", 0, [b"other"])
        assert (data / f"{name}-1").is_dir()
    with MessageStore(data, background_interval=None, clock=clock) as s:  # found on disk, not configured
        assert s.topics() == sorted(["t", name])
        assert s.topic_config(name).num_partitions == 2
        assert s.partition(name, 1).read_arrow(0).column("value").to_pylist() == [b"hello"]
        assert s.partition(name, 0).last_stable_offset == 0
        assert s.partition("t", 0).read_arrow(0).column("value").to_pylist() == [b"other"]


def test_create_topic_again_with_other_partition_count_is_an_error(store):
    before = snapshot(store)
    raises_exactly(InvalidTopicError, lambda: store.create_topic("t", TopicConfig(num_partitions=3)),
                   r"'t' already exists with 2 partitions")
    assert store.create_topic("t", TopicConfig(num_partitions=2)).max_message_size == LIMIT  # a no-op
    check_untouched(store, before)


# ---------------------------------------------------------------------------------------------------
# Messages


@pytest.mark.parametrize("kwargs,size,index", [
    (dict(values=[b"x" * (LIMIT + 1)]), LIMIT + 1, 0),
    (dict(values=[b"ok", b"x" * 500, b"ok"]), 500, 1),
    (dict(values=[b"a", b"b", b"v" * 51], keys=[None, b"k", b"k" * 50]), LIMIT + 1, 2),
    (dict(values=[b"v" * 40], keys=[b"k" * 40], attributes=["\u00e9" * 11]), LIMIT + 2, 0),  # é is 2 bytes
    (dict(values=[b"v" * 60, b"v"], attributes=["a" * 41, None]), LIMIT + 1, 0),
    (dict(values=pa.array([b"ok", b"y" * 1000])), 1000, 1),
])
def test_oversize_messages_are_rejected_and_the_whole_batch_is_not_stored(store, p, kwargs, size, index):
    before = snapshot(store)
    e = raises_exactly(MessageTooLargeError, lambda: p.append(**kwargs),
                       rf"message {index} of the batch is {size} bytes", rf"limit for topic t is {LIMIT}\b")
    remote = assert_reaches_a_client_as(e, grpc.StatusCode.RESOURCE_EXHAUSTED, RemoteMessageTooLargeError)
    assert isinstance(remote, MessageTooLargeError)  # ``except MessageTooLargeError`` works in a client too
    raises_exactly(MessageTooLargeError, lambda: store.append("t", 0, **kwargs), rf"{size} bytes")
    check_untouched(store, before)


def test_messages_of_exactly_the_limit_are_stored(p):
    r = p.append([b"v" * 50, b"w" * LIMIT], keys=[b"k" * 30, None], attributes=["a" * 20, None])
    got = p.read_arrow(r.base_offset, r.base_offset + 2)
    assert got.column("value").to_pylist() == [b"v" * 50, b"w" * LIMIT]
    assert got.column("key").to_pylist() == [b"k" * 30, None]
    assert got.column("attribute").to_pylist() == ["a" * 20, None]


BAD_MESSAGES = [
    (dict(values=[b"a", b"b"], keys=[b"k"]), r"key column has 1 entries but value has 2"),
    (dict(values=[b"a", b"b"], keys=[b"k", b"k", b"k"]), r"key column has 3 entries but value has 2"),
    (dict(values=[b"a", b"b"], attributes=["x"]), r"attribute column has 1 entries but value has 2"),
    (dict(values=[b"a", b"b"], flags=[1]), r"flag column has shape \(1,\) but value has 2"),
    (dict(values=[b"a", b"b"], flags=[1, 2, 3]), r"flag column has shape \(3,\)"),
    (dict(values=[b"a"], flags=5), r"flag column has shape \(\)"),
    (dict(values=[1, 2]), r"value: cannot be stored as bytes"),
    (dict(values=[b"a", 2]), r"value: cannot be stored as bytes"),
    (dict(values=pa.array([1, 2])), r"value: expected bytes, got Arrow type int64"),
    (dict(values=[b"a"], keys=[3]), r"key: cannot be stored as bytes"),
    (dict(values=[b"a"], keys=pa.array([3.5])), r"key: expected bytes, got Arrow type double"),
    (dict(values=[b"a", b"b"], attributes=[b"ok", b"\xff\xfe"]), r"attribute.*utf-?8"),
    (dict(values=[b"a"], attributes=pa.array([b"\xc3"], pa.binary())), r"attribute: not valid UTF-8"),
    (dict(values=[b"a"], attributes=[7]), r"attribute: cannot be stored as UTF-8 text"),
    (dict(values=[b"a"], attributes=pa.array([7])), r"attribute: expected strings, got Arrow type int64"),
    (dict(values=[b"a", b"b"], flags=[1.0, 2.0]), r"flag: expected integers, got float64"),
    (dict(values=[b"a"], flags=np.array([1.5])), r"flag: expected integers"),
    (dict(values=[b"a"], flags=pa.array([1.0])), r"flag: expected integers"),
    (dict(values=[b"a"], flags=["1"]), r"flag: expected integers"),
    (dict(values=[b"a", b"b"], flags=[0, 2 ** 31]), r"flag: values must fit in a signed 32-bit integer"),
    (dict(values=[b"a", b"b"], flags=[-(2 ** 31) - 1, 0]), r"signed 32-bit"),
    (dict(values=[b"a"], flags=np.array([2 ** 40], np.int64)), r"signed 32-bit"),
    (dict(values=[b"a"], flags=np.array([2 ** 32], np.uint64)), r"signed 32-bit"),
    (dict(values=[b"a"], flags=[2 ** 70]), r"flag: expected integers"),
    (dict(values=[b"a", b"b"], flags=pa.array([1, None])), r"flag column has nulls"),
    (dict(values=[]), r"at least one message"),
    (dict(values=pa.array([], pa.binary())), r"at least one message"),
    (dict(values=pa.chunked_array([], pa.binary())), r"at least one message"),
    (dict(values=pa.array([b"a", b"b"]).slice(2)), r"at least one message"),
]


@pytest.mark.parametrize("kwargs,pattern", BAD_MESSAGES)
def test_invalid_messages_are_rejected_and_nothing_is_stored(store, p, kwargs, pattern):
    before = snapshot(store)
    raises_exactly(InvalidMessageError, lambda: p.append(**kwargs), pattern)
    raises_exactly(InvalidMessageError, lambda: store.append("t", 0, **kwargs), pattern)
    check_untouched(store, before)


def test_values_none_is_an_invalid_message_not_a_type_error(store, p):
    before = snapshot(store)
    raises_exactly(InvalidMessageError, lambda: p.append(None), r"value")
    check_untouched(store, before)


@pytest.mark.parametrize("values", [np.array([7, 300, 0]), np.array([1.5, 2.0]), np.array([True, False])])
def test_numeric_numpy_values_are_rejected_not_stored_as_garbage(store, p, values):
    # A list of ints is rejected ("value: cannot be stored as bytes"); a numpy array of numbers must be
    # too, rather than being stored as some byte rendering of the numbers.
    before = snapshot(store)
    raises_exactly(InvalidMessageError, lambda: p.append(values), r"value")
    check_untouched(store, before)


def test_extreme_flags_and_empty_values_are_stored(p):
    r = p.append([b"", b"x", b""], keys=[b"", None, b""], flags=[2 ** 31 - 1, -(2 ** 31), 0])
    got = p.read_arrow(r.base_offset, r.base_offset + 3)
    assert got.column("flag").to_pylist() == [2 ** 31 - 1, -(2 ** 31), 0]
    assert got.column("value").to_pylist() == [b"", b"x", b""]
    assert got.column("key").to_pylist() == [b"", None, b""]


# ---------------------------------------------------------------------------------------------------
# Offsets and budgets


@pytest.mark.parametrize("bad,pattern", [(-1, r"offset -1 is negative"), (-(2 ** 63), r"negative"),
                                         ("0", r"offset must be an integer, got '0'"),
                                         (1.0, r"must be an integer, got 1\.0"), (None, r"got None"),
                                         (True, r"got True"), (np.float64(2), r"must be an integer")])
def test_bad_offsets(store, p, bad, pattern):
    before = snapshot(store)
    raises_exactly(InvalidOffsetError, lambda: p.read(bad), pattern)
    raises_exactly(InvalidOffsetError, lambda: p.read_arrow(bad), pattern)
    raises_exactly(InvalidOffsetError, lambda: store.read("t", 0, bad), pattern)
    raises_exactly(InvalidOffsetError, lambda: p.range_bytes(bad, 2), pattern)
    raises_exactly(InvalidOffsetError, lambda: p.offset_after_bytes(bad, 10), pattern)
    raises_exactly(InvalidOffsetError, lambda: p.position(bad), pattern)
    check_untouched(store, before)


def test_numpy_integer_offsets_are_accepted(p):
    assert p.read_arrow(np.int64(3)).column("offset").to_pylist() == [3, 4]


@pytest.mark.parametrize("bad", [0, -1, -(2 ** 40), 1.5, "10", None])
def test_bad_max_bytes(store, p, bad):
    before = snapshot(store)
    raises_exactly(InvalidOffsetError, lambda: p.read(0, max_bytes=bad), r"max_bytes must be a positive integer",
                   re.escape(repr(bad)))
    raises_exactly(InvalidOffsetError, lambda: p.read_arrow(0, max_bytes=bad), r"max_bytes")
    check_untouched(store, before)


@pytest.mark.parametrize("bad", [0, -3, 2.0, "1"])
def test_bad_max_messages(store, p, bad):
    before = snapshot(store)
    raises_exactly(InvalidOffsetError, lambda: p.read(0, max_messages=bad),
                   r"max_messages must be a positive integer", re.escape(repr(bad)))
    raises_exactly(InvalidOffsetError, lambda: store.read("t", 0, 0, max_messages=bad), r"max_messages")
    check_untouched(store, before)


@pytest.mark.parametrize("bad", ["4", b"4", [4]])
def test_non_integer_end_offsets_are_invalid_offsets(store, p, bad):
    before = snapshot(store)
    raises_exactly(InvalidOffsetError, lambda: p.read_arrow(2, bad), r"integer", re.escape(repr(bad)))
    check_untouched(store, before)


@pytest.mark.parametrize("bad", ["3", None, 2.5])
def test_non_integer_range_stop_is_an_invalid_offset(store, p, bad):
    before = snapshot(store)
    raises_exactly(InvalidOffsetError, lambda: p.range_bytes(0, bad), r"integer", re.escape(repr(bad)))
    check_untouched(store, before)


def test_read_arrow_with_an_empty_range_returns_no_messages(p):
    assert p.read_arrow(2, 4).column("offset").to_pylist() == [2, 3]
    assert p.read_arrow(2, 3).column("offset").to_pylist() == [2]
    # [2, 2) holds no offsets
    assert p.read_arrow(2, 2).num_rows == 0


def test_read_arrow_with_end_before_start_returns_nothing_outside_the_range(store, p):
    before = snapshot(store)
    try:
        got = p.read_arrow(3, 1)
    except InvalidOffsetError as e:  # rejecting the reversed range is as good as returning nothing
        assert "1" in str(e) and "3" in str(e)
    else:
        assert got.column("offset").to_pylist() == []
    check_untouched(store, before)


def test_reading_above_latest_names_the_valid_range(store, p):
    before = snapshot(store)
    for bad in (6, 7, 10 ** 12):
        e = raises_exactly(OffsetOutOfRangeError, lambda: p.read(bad),
                           rf"offset {bad} is out of range for t-0", r"\b0 \(earliest\)", r"\b5 \(latest")
        assert (e.offset, e.earliest, e.latest) == (bad, 0, 5)
        raises_exactly(OffsetOutOfRangeError, lambda: p.read_arrow(bad), r"\b0 \(earliest\)", r"\b5 \(latest")
        raises_exactly(OffsetOutOfRangeError, lambda: store.read("t", 0, bad), rf"offset {bad}")
        raises_exactly(OffsetOutOfRangeError, lambda: p.position(bad), r"\b5 \(latest")
    raises_exactly(OffsetOutOfRangeError, lambda: p.range_bytes(0, 6), r"offset 6 ", r"\b5 \(latest")
    raises_exactly(OffsetOutOfRangeError, lambda: store.partition("t", 1).read(2), r"t-1", r"\b1 \(latest")
    check_untouched(store, before)


def test_reading_exactly_at_latest_is_empty_not_an_error(store, p):
    res = p.read(5)
    assert (res.start_offset, res.end_offset) == (5, 5)
    assert res.decode().num_rows == 0
    assert res.decode().schema == p.read_arrow(0).schema
    assert p.read_arrow(5).num_rows == 0
    assert p.range_bytes(5, 5) == 0
    assert p.offset_after_bytes(5, 100) == 5
    store.create_topic("fresh", TopicConfig())
    empty = store.partition("fresh", 0)
    assert (empty.earliest_offset, empty.last_stable_offset) == (0, 0)
    assert empty.read(0).decode().num_rows == 0
    e = raises_exactly(OffsetOutOfRangeError, lambda: empty.read(1), r"fresh-0", r"\b0 \(earliest\)", r"\b0 \(latest")
    assert (e.earliest, e.latest) == (0, 0)


def test_reading_below_earliest_after_retention_names_the_valid_range(tmp_path, clock):
    config = TopicConfig(max_segment_size=4096, delete_policy="delete,1")
    with MessageStore(tmp_path, {"t": config}, background_interval=None, clock=clock) as s:
        p = s.partition("t", 0)
        for i in range(12):
            p.append([b"%03d" % i + b"." * 1000])  # 1088-byte batches: three to a segment
        clock.advance(2 * 3600)
        p.append([b"late"])  # fits in the active segment, which starts at offset 9
        assert [(seg.base_offset, seg.count) for seg in p.segments()] == [(0, 3), (3, 3), (6, 3), (9, 4)]
        removed = p.apply_retention()
        assert [info.base_offset for info in removed] == [0, 3, 6]
        assert (p.earliest_offset, p.last_stable_offset) == (9, 13)
        files_before = state(p)
        for bad in (0, 5, 8):
            e = raises_exactly(OffsetOutOfRangeError, lambda: p.read(bad), rf"offset {bad} is out",
                               r"\b9 \(earliest\)", r"\b13 \(latest")
            assert (e.offset, e.earliest, e.latest) == (bad, 9, 13)
            raises_exactly(OffsetOutOfRangeError, lambda: p.read_arrow(bad), r"\b9 \(earliest\)")
            raises_exactly(OffsetOutOfRangeError, lambda: p.range_bytes(bad, 12), r"\b9 \(earliest\)")
        e = raises_exactly(OffsetOutOfRangeError, lambda: p.read(14), r"\b9 \(earliest\)", r"\b13 \(latest")
        assert (e.earliest, e.latest) == (9, 13)
        assert state(p) == files_before
        assert p.read_arrow(9).column("value").to_pylist() == [b"%03d" % i + b"." * 1000 for i in (9, 10, 11)] + [b"late"]
        assert p.read(13).decode().num_rows == 0


# ---------------------------------------------------------------------------------------------------
# Configuration


@pytest.mark.parametrize("kwargs,key", [
    (dict(num_partitions=0), "num_partitions"),
    (dict(num_partitions=-1), "num_partitions"),
    (dict(num_partitions=10_001), "num_partitions"),
    (dict(num_partitions="2"), "num_partitions"),
    (dict(num_partitions=2.0), "num_partitions"),
    (dict(num_partitions=True), "num_partitions"),
    (dict(unflush_interval_ms=0), "unflush_interval_ms"),
    (dict(unflush_interval_ms=-5), "unflush_interval_ms"),
    (dict(unflush_interval_ms=0.5), "unflush_interval_ms"),
    (dict(unflush_threshold="100"), "unflush_threshold"),
    (dict(unflush_threshold=None), "unflush_threshold"),
    (dict(max_segment_size=4095), "max_segment_size"),
    (dict(max_segment_size=0), "max_segment_size"),
    (dict(max_segment_size=4096.0), "max_segment_size"),
    (dict(max_message_size=0), "max_message_size"),
    (dict(max_message_size=-1), "max_message_size"),
    (dict(max_message_size=(1 << 30) + 1), "max_message_size"),
    (dict(retention_bytes=0), "retention_bytes"),
    (dict(retention_bytes=-2), "retention_bytes"),
    (dict(retention_bytes="1"), "retention_bytes"),
    (dict(delete_policy="purge,1"), "deletePolicy"),
    (dict(delete_policy="delete,-1"), "deletePolicy"),
])
def test_bad_topic_config_values_name_the_key(kwargs, key):
    e = raises_exactly(ConfigError, lambda: TopicConfig(**kwargs), re.escape(key))
    remote = assert_reaches_a_client_as(e, grpc.StatusCode.INVALID_ARGUMENT, RemoteInvalidArgumentError)
    assert isinstance(remote, ValueError)  # as ConfigError is one
    base = TopicConfig()
    raises_exactly(ConfigError, lambda: base.with_(**kwargs), re.escape(key))


@pytest.mark.parametrize("bad", [None, 168, ("delete", 1.0)])
def test_delete_policy_of_the_wrong_type_is_a_config_error(bad):
    raises_exactly(ConfigError, lambda: TopicConfig(delete_policy=bad), r"delete_?[pP]olicy")


def test_good_topic_config_edge_values():
    c = TopicConfig(num_partitions=10_000, unflush_threshold=-3, unflush_interval_ms=1, max_segment_size=4096,
                    max_message_size=1 << 30, retention_bytes=-1, delete_policy="archive,0.5")
    assert c.group_commit and c.delete_policy == DeletePolicy("archive", 0.5)
    assert not TopicConfig(unflush_threshold=1).group_commit
    assert TopicConfig(retention_bytes=1).retention_bytes == 1
    assert TopicConfig(num_partitions=1).num_partitions == 1


@pytest.mark.parametrize("spec,pattern", [
    ("delete", r"expected 'delete,<hours>' or 'archive,<hours>'"),
    ("delete,abc", r"hours 'abc' is not a number"),
    ("purge,1", r"'purge,1'.*expected"),
    ("delete,-1", r"hours must be positive"),
    ("delete,0", r"hours must be positive"),
    ("archive,nan", r"hours must be positive"),
    ("", r"expected"),
    ("delete,1,2", r"expected"),
    ("DELETE,1", r"expected"),
])
def test_delete_policy_bad_specs(spec, pattern):
    e = raises_exactly(ConfigError, lambda: DeletePolicy.parse(spec), pattern, r"deletePolicy")
    assert repr(spec) in str(e)


@pytest.mark.parametrize("spec,action,hours,text", [
    ("delete,168", "delete", 168.0, "delete,168"),
    ("archive,0.5", "archive", 0.5, "archive,0.5"),
    (" delete , 24 ", "delete", 24.0, "delete,24"),
])
def test_delete_policy_good_specs(spec, action, hours, text):
    policy = DeletePolicy.parse(spec)
    assert (policy.action, policy.hours) == (action, hours)
    assert str(policy) == text
    assert DeletePolicy.parse(str(policy)) == policy
    assert TopicConfig(delete_policy=spec).delete_policy == policy


# ---------------------------------------------------------------------------------------------------
# Arrow input


def _col(batch, name):
    return batch.column(name).to_pylist()


VALUE_INPUTS = [
    ("binary", lambda: pa.array([b"a", b"", b"ccc", b"\x00\xff"], pa.binary()), [b"a", b"", b"ccc", b"\x00\xff"]),
    ("string", lambda: pa.array(["h\u00e9llo", "", "x"], pa.string()), ["h\u00e9llo".encode(), b"", b"x"]),
    ("large_binary", lambda: pa.array([b"big", b"", b"x" * 70], pa.large_binary()), [b"big", b"", b"x" * 70]),
    ("large_string", lambda: pa.array(["\u20ac", "y"], pa.large_string()), ["\u20ac".encode(), b"y"]),
    ("slice", lambda: pa.array([b"v%d" % i for i in range(10)]).slice(3, 5), [b"v%d" % i for i in range(3, 8)]),
    ("slice_of_nullable", lambda: pa.array([None, b"a", None, b"bb", b"c", b"d"]).slice(3, 3), [b"bb", b"c", b"d"]),
    ("string_slice", lambda: pa.array(["s%d" % i for i in range(9)]).slice(7), [b"s7", b"s8"]),
    ("chunked", lambda: pa.chunked_array([[b"a", b"b"], [b"c"], [], [b"dd"]]), [b"a", b"b", b"c", b"dd"]),
    ("chunked_slices", lambda: pa.chunked_array([pa.array([b"0", b"1", b"2"]).slice(1),
                                                 pa.array([b"3", b"4"]).slice(1, 1)]), [b"1", b"2", b"4"]),
    ("chunked_large", lambda: pa.chunked_array([pa.array([b"L"], pa.large_binary())]), [b"L"]),
    ("numpy_object", lambda: np.array([b"n1", b"n22"], dtype=object), [b"n1", b"n22"]),
    ("list_of_str", lambda: ["p", "\u00e9"], [b"p", "\u00e9".encode()]),
    ("tuple", lambda: (b"t1", b"t2"), [b"t1", b"t2"]),
]


@pytest.mark.parametrize("name,make,expected", VALUE_INPUTS, ids=[v[0] for v in VALUE_INPUTS])
def test_arrow_and_sequence_values_round_trip(p, name, make, expected):
    r = p.append(make())
    assert (r.base_offset, r.count) == (5, len(expected))
    got = p.read_arrow(5)
    assert _col(got, "value") == expected
    assert _col(got, "offset") == list(range(5, 5 + len(expected)))
    assert _col(got, "key") == [None] * len(expected)
    assert _col(got, "attribute") == [None] * len(expected)
    assert _col(got, "flag") == [0] * len(expected)
    assert _col(got, "msgId") == list(range(r.base_msg_id, r.base_msg_id + len(expected)))


def test_keys_and_attributes_with_nulls_round_trip(p):
    keys_full = pa.array([b"x", b"k0", None, b"", None, b"k4", b"y"])
    attrs_full = pa.array(["q", None, "a1", "", None, "\u00fc", "r"], pa.large_string())
    values = pa.array([b"v%d" % i for i in range(7)])
    r = p.append(values.slice(1, 5), keys=keys_full.slice(1, 5), attributes=attrs_full.slice(1, 5),
                 flags=pa.array([10, -1, 0, 2 ** 31 - 1, 5], pa.int32()))
    got = p.read_arrow(r.base_offset)
    assert _col(got, "value") == [b"v1", b"v2", b"v3", b"v4", b"v5"]
    assert _col(got, "key") == [b"k0", None, b"", None, b"k4"]  # b"" and None stay different
    assert _col(got, "attribute") == [None, "a1", "", None, "\u00fc"]
    assert _col(got, "flag") == [10, -1, 0, 2 ** 31 - 1, 5]


def test_nulls_that_own_bytes_are_stored_as_nulls(p):
    # An Arrow null slot may cover bytes in the data buffer; they must not leak into stored values.
    data = pa.py_buffer(b"AAAkeyBBB")
    offsets = pa.py_buffer(np.array([0, 3, 6, 9], np.int32).tobytes())
    validity = pa.py_buffer(np.packbits(np.array([0, 1, 0], bool), bitorder="little").tobytes())
    keys = pa.Array.from_buffers(pa.binary(), 3, [validity, offsets, data], null_count=2)
    r = p.append([b"a", b"b", b"c"], keys=keys, attributes=pa.chunked_array([["x"], [None, "z"]]))
    got = p.read_arrow(r.base_offset)
    assert _col(got, "key") == [None, b"key", None]
    assert _col(got, "attribute") == ["x", None, "z"]
    assert _col(got, "value") == [b"a", b"b", b"c"]


def test_all_null_keys_and_binary_attributes(p):
    r = p.append([b"a", b"b"], keys=pa.array([None, None], pa.binary()),
                 attributes=pa.array(["\u00e9".encode(), b"plain"], pa.binary()),
                 flags=np.array([3, 4], np.int64))
    got = p.read_arrow(r.base_offset)
    assert _col(got, "key") == [None, None]
    assert _col(got, "attribute") == ["\u00e9", "plain"]
    assert _col(got, "flag") == [3, 4]


def test_arrow_batches_mix_with_the_rest_of_the_log(store, p):
    before = dump(p)
    p.append(pa.array([b"a1", b"a2"]).slice(1), keys=pa.array([None], pa.binary()))
    p.append(pa.chunked_array([[b"c1"], [b"c2"]], pa.large_binary()), keys=[b"k", None])
    rows = dump(p)
    assert rows[:5] == before
    assert [(r["offset"], r["value"], r["key"]) for r in rows[5:]] == [(5, b"a2", None), (6, b"c1", b"k"),
                                                                       (7, b"c2", None)]
