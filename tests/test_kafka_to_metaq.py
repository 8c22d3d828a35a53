"""``kafka_listener.to_metaq``: a Produce partition's decoded Kafka batches as one metaq batch body. What
every batch of the partition decides (any transactional or control batch is refused; create times are
kept unless a batch asks for LogAppendTime) holds whichever batch it is, not only the first. The body is
written by a compiled loop straight from the Kafka bytes (``Batches.metaq_body``): it must be what
``encode_body`` makes of the decoded columns, for generated batches and for damaged ones decode accepts."""
import re

import numpy as np
import pyarrow as pa
import pytest
from fuzzing import fuzz_settings, mutated
from hypothesis import event, given, settings
from hypothesis import strategies as st

from metaq_broker.errors import InvalidMessageError
from metaq_broker.protocol import records as mrecords
from metaq_broker.protocol.kafka import records as krecords
from metaq_broker.server.kafka_listener import to_metaq

pytestmark = pytest.mark.unit

CREATED = 1_700_000_000_000


def batches(*attributes, timestamp_type=None):
    """Two records per batch, one batch per entry of ``attributes`` (its attribute bits)."""
    n = 2 * len(attributes)
    data = krecords.encode(np.arange(n), CREATED + np.arange(n), None, [b"v%d" % i for i in range(n)],
                           batch_starts=list(range(0, n, 2)), attributes=list(attributes))
    return krecords.decode(data)


@pytest.mark.parametrize("bit", [krecords.TRANSACTIONAL, krecords.CONTROL])
@pytest.mark.parametrize("where", [0, 1])
def test_a_transactional_or_control_batch_is_refused_wherever_it_is(bit, where):
    attributes = [0, 0]
    attributes[where] = bit
    with pytest.raises(krecords.KafkaRecordError, match="transaction"):
        to_metaq(batches(*attributes))


def test_create_times_are_kept_as_the_records_carry_them():
    body, producer = to_metaq(batches(0, 0))
    assert producer is None and body.create_times == (CREATED, CREATED + 3)
    decoded = mrecords.decode(mrecords.encode_header(body, 0, 0, 0) + b"".join(bytes(p) for p in body.parts))
    assert decoded.column("timestamp").cast(pa.int64()).to_pylist() == [CREATED + i for i in range(4)]


@pytest.mark.parametrize("where", [0, 1])
def test_a_log_append_time_batch_anywhere_makes_the_store_time_every_records_time(where):
    attributes = [0, 0]
    attributes[where] = krecords.TIMESTAMP_TYPE
    body, _ = to_metaq(batches(*attributes))
    assert body.create_times is None  # no create-time column: the batch's store time is each record's


def columns_way(batches: krecords.Batches, create_times: bool) -> mrecords.EncodedBody:
    """What a Produce stored before the compiled conversion, and what records with headers still take:
    the Arrow columns through ``encode_body``."""
    headers = batches.column("headers")
    return mrecords.encode_body(batches.column("value"), keys=batches.column("key"),
                                headers=headers if len(headers.values) else None,
                                timestamps=batches.timestamps_ms if create_times else None)


def same_body(got: mrecords.EncodedBody, expected: mrecords.EncodedBody) -> None:
    assert b"".join(bytes(p) for p in got.parts) == b"".join(bytes(p) for p in expected.parts)
    assert (got.count, got.attributes, got.size, got.crc, got.max_message_size, got.metaq_bytes,
            got.create_times) == (expected.count, expected.attributes, expected.size, expected.crc,
                                  expected.max_message_size, expected.metaq_bytes, expected.create_times)
    assert got.message_sizes.dtype == expected.message_sizes.dtype
    assert got.message_sizes.tolist() == expected.message_sizes.tolist()
    assert index_keys(got) == index_keys(expected)


def index_keys(body: mrecords.EncodedBody):
    """The keys as the key index reads them (``body_keys``; None: a null key), or None without keys."""
    found = mrecords.body_keys(body)
    if found is None:
        return None
    data, starts, lengths = found
    return [None if n < 0 else bytes(data[s:s + n]) for s, n in zip(starts, lengths)]


_sizes = st.one_of(st.none(), st.integers(0, 140), st.integers(0, 40_000))  # widths of 1, 2 and 4 bytes


@st.composite
def kafka_partitions(draw):
    """A Produce partition's records: values and keys null, empty or of any width's length (all keys null
    included), create times close together or years apart, one batch or several, LogAppendTime on any."""
    n = draw(st.integers(1, 12))
    values = [None if s is None else bytes([i % 251]) * s for i, s in enumerate(draw(st.lists(_sizes, min_size=n, max_size=n)))]
    keys = draw(st.one_of(st.none(), st.lists(st.one_of(st.none(), st.binary(max_size=300)), min_size=n, max_size=n)))
    spread = draw(st.sampled_from([10, 100_000, 1 << 40]))  # time deltas of 1, 4 and 8 bytes
    times = CREATED + np.array(draw(st.lists(st.integers(0, spread), min_size=n, max_size=n)), np.int64)
    starts = sorted({0} | set(draw(st.lists(st.integers(1, n - 1), max_size=3)) if n > 1 else {0}))
    attributes = draw(st.lists(st.sampled_from([0, krecords.TIMESTAMP_TYPE]), min_size=len(starts), max_size=len(starts)))
    return krecords.encode(np.arange(n), times, None if keys is None else pa.array(keys, pa.binary()),
                           pa.array(values, pa.binary()), batch_starts=starts, attributes=attributes)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=kafka_partitions(), create_times=st.booleans())
def test_the_compiled_conversion_writes_what_encode_body_writes_of_the_columns(data, create_times):
    """A Produce's records go from Kafka's bytes straight into a metaq body (``Batches.metaq_body``, the
    compiled ``metaq_body``): the body, its attribute bits and layout, checksum, per-message sizes, keys for
    the key index and create-time bounds are those ``encode_body`` makes of the decoded columns, and the
    body reads back as the records."""
    batches = krecords.decode(data)
    got = batches.metaq_body(create_times)
    same_body(got, columns_way(krecords.decode(data), create_times))
    stored = mrecords.decode(mrecords.encode_header(got, 0, 0, 0) + b"".join(bytes(p) for p in got.parts))
    assert stored.column("value").to_pylist() == batches.column("value").to_pylist()
    if create_times:
        assert stored.column("timestamp").cast(pa.int64()).to_pylist() == batches.timestamps_ms.tolist()


def test_records_with_headers_or_times_metaq_cannot_keep_take_the_columns_way():
    """Headers are stored by ``encode_body`` from the columns; a create time before 1970 is refused by it,
    naming the message, as before the compiled conversion."""
    data = krecords.encode([0, 1], [CREATED, CREATED], None, [b"a", b"b"],
                           pa.array([[("h", b"1")], []], krecords.HEADERS_TYPE))
    body = krecords.decode(data).metaq_body(create_times=True)
    same_body(body, columns_way(krecords.decode(data), True))
    assert body.attributes & mrecords.HAS_HEADERS
    early = krecords.decode(krecords.encode([0, 1], [CREATED, -5], None, [b"a", b"b"]))
    with pytest.raises(InvalidMessageError, match="timestamp of message 1 is -5"):
        early.metaq_body(create_times=True)
    assert early.metaq_body(create_times=False).create_times is None  # LogAppendTime: no create time kept


_BASE = bytes(krecords.encode(np.arange(9), CREATED + np.arange(9) * 7, pa.array([None, b"k1", b"", None, b"k4" * 90, b"k5",
                                                                             None, b"k7", b"k8"], pa.binary()),
                              pa.array([b"v0", None, b"", b"v" * 200, b"v4", b"v5", None, b"v7", b"v8" * 70], pa.binary()),
                              batch_starts=[0, 4], attributes=[0, 0]))


@fuzz_settings(short=300)
@given(data=st.data(), create_times=st.booleans())
def test_damaged_records_that_decode_accepts_convert_to_a_body_the_broker_accepts(data, create_times):
    """An attacker's Produce records (CRC not checked, so the damage reaches the walk): whatever ``decode``
    accepts, the compiled conversion turns into the body ``encode_body`` makes of the same columns, and
    ``parse_body`` (the broker's check of a producer's body) accepts it; nothing is read or written out of
    bounds on the way (the kernel's copies are checked)."""
    damaged = data.draw(mutated(_BASE))
    try:
        batches = krecords.decode(damaged, verify=False)
    except krecords.KafkaRecordError:
        event("refused by decode")
        return
    event("accepted by decode")
    try:
        expected = columns_way(krecords.decode(damaged, verify=False), create_times)
    except InvalidMessageError as e:  # a damaged create time metaq cannot store: refused the same way
        with pytest.raises(InvalidMessageError, match=re.escape(str(e))):
            batches.metaq_body(create_times)
        return
    got = batches.metaq_body(create_times)
    same_body(got, expected)
    body = b"".join(bytes(p) for p in got.parts)
    mrecords.parse_body(got.count, got.attributes, body, got.crc)
