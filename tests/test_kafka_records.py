"""Kafka record batches (magic 2) to Arrow and back, without sockets.

The contract: ``records.decode`` returns exactly the records of every batch (null keys and null values
stay null, empty stays empty, headers in order), checks each batch and refuses bad bytes with a
KafkaRecordError naming the batch, the problem and the Kafka code the partition is answered with;
``records.encode`` writes batches that an independent reader (aiokafka's record reader, which real
consumers use) reads back as the same records, CRC included. Real producers' batches: test_kafka_clients.py."""
from __future__ import annotations

import gzip
import struct

import numpy as np
import pyarrow as pa
import pytest
from aiokafka.record import default_records as aiokafka_records
from fuzzing import fuzz_settings, mutated
from hypothesis import event, given
from hypothesis import strategies as st

from metaq_broker.protocol.kafka import codes, records
from metaq_broker.protocol.kafka.records import HEADERS_TYPE, KafkaRecordError
from metaq_broker.protocol.records import crc

pytestmark = pytest.mark.unit



def columns(n, seed=0):
    rng = np.random.default_rng(seed)
    keys = [None if i % 5 == 0 else bytes(rng.integers(0, 256, i % 40, dtype=np.uint8)) for i in range(n)]
    values = [None if i % 7 == 3 else b"v" * int(rng.integers(0, 300)) for i in range(n)]
    headers = [[(f"h{j}", None if j == 1 else bytes([j]) * j) for j in range(i % 4)] for i in range(n)]
    ts = 1_700_000_000_000 + rng.integers(-5000, 5000, n)
    return keys, values, headers, ts


def as_rows(batches):
    """(key, value, [(header key, value)]) per record; the timestamps are left out, as Python's datetime
    cannot hold every int64 a damaged batch may carry (the fuzz test below met one)."""
    columns = [batches.column(name).to_pylist() for name in ("key", "value", "headers")]
    return [(k, v, [(h["key"], h["value"]) for h in hs]) for k, v, hs in zip(*columns)]


@pytest.mark.parametrize("codec", sorted(records.CODECS))
def test_round_trip_and_independent_reader(codec):
    keys, values, headers, ts = columns(500)
    starts = [0, 1, 100, 499]
    data = records.encode(np.arange(1000, 1500), ts, keys, values, pa.array(headers, HEADERS_TYPE),
                          batch_starts=starts, codec=codec, producer_id=7, producer_epoch=2,
                          base_sequence=[0, 1, 100, 499], attributes=records.TRANSACTIONAL)
    got = records.decode(data)
    assert as_rows(got) == list(zip(keys, values, headers))
    assert got.records.column("timestamp").cast(pa.int64()).to_pylist() == ts.tolist()
    assert got.counts.tolist() == [1, 99, 399, 1] and got.transactional.all() and not got.control.any()
    assert (got.codec == codec).all() and got.header["base_offset"].tolist() == [1000, 1001, 1100, 1499]
    assert got.header["base_sequence"].tolist() == starts and (got.header["producer_id"] == 7).all()
    # aiokafka's reader, batch by batch
    pos, read = 0, []
    mv = memoryview(data)
    while pos < len(data):
        size = 12 + struct.unpack_from(">i", mv, pos + 8)[0]
        batch = aiokafka_records.DefaultRecordBatch(bytes(mv[pos:pos + size]))
        assert batch.validate_crc() and batch.compression_type == codec and batch.producer_id == 7
        read += [(r.offset, r.timestamp, r.key, r.value, list(r.headers)) for r in batch]
        pos += size
    assert read == [(1000 + i, int(ts[i]), keys[i], values[i], headers[i]) for i in range(500)]


def test_encode_takes_arrow_slices_and_chunks():
    keys, values, headers, ts = columns(50, 3)
    table = pa.table({"key": pa.array(keys, pa.binary()), "value": pa.array(values, pa.binary()),
                      "headers": pa.array(headers, HEADERS_TYPE)})
    part = pa.concat_tables([table.slice(10, 20), table.slice(30, 5)])  # two chunks, offset slices
    data = records.encode(np.arange(25), ts[:25], part["key"], part["value"], part["headers"])
    want = list(zip(keys, values, headers))
    assert as_rows(records.decode(data)) == want[10:30] + want[30:35]


def test_null_value_is_kept_apart_from_empty():
    data = records.encode([0, 1], [5, 5], [None, b""], [None, b""])
    got = records.decode(data).records
    assert got.column("value").to_pylist() == [None, b""] and got.column("value").null_count == 1
    assert got.column("key").to_pylist() == [None, b""]


def batch(count=3, magic=2, codec=0, fix_crc=True, last_delta=None, body=None, attributes=None):
    data = bytearray(records.encode(np.arange(count), np.zeros(count, np.int64), [b"k"] * count, [b"v"] * count,
                                    codec=codec))
    if body is not None:
        data[61:] = body
        struct.pack_into(">i", data, 8, len(data) - 12)
    if last_delta is not None:
        struct.pack_into(">i", data, 23, last_delta)
    if attributes is not None:
        struct.pack_into(">h", data, 21, attributes)
    data[16] = magic
    if fix_crc:
        struct.pack_into(">I", data, 17, crc(bytes(data[21:])))
    return bytes(data)


@pytest.mark.parametrize("data,problem,code", [
    (batch()[:-1], "length .* does not fit", codes.CORRUPT_MESSAGE),
    (batch()[:40], "shorter than a batch header", codes.CORRUPT_MESSAGE),
    (batch(fix_crc=False)[:20] + b"\x00" + batch()[21:], "CRC-32C mismatch", codes.CORRUPT_MESSAGE),
    (batch(magic=1), "message format v1 .* magic 2", codes.INVALID_RECORD),
    (batch(magic=0), "message format v0", codes.INVALID_RECORD),
    (batch(magic=7), "unknown magic 7", codes.CORRUPT_MESSAGE),
    (batch(attributes=6), "unknown compression codec 6", codes.UNSUPPORTED_COMPRESSION_TYPE),
    (batch(last_delta=5), "last offset delta 5 for 3 records", codes.INVALID_RECORD),
    (batch(body=batch()[61:] + b"\x00"), "left over", codes.CORRUPT_MESSAGE),
    (batch(body=batch()[61:-3]), "record 2", codes.CORRUPT_MESSAGE),
    (batch(body=b"\x02" + batch()[62:]), "impossible length", codes.CORRUPT_MESSAGE),  # record length 1
    (batch(body=b"\xff" * 12 + batch()[73:]), "varint|length", codes.CORRUPT_MESSAGE),
    (batch(codec=records.GZIP)[:61] + b"not gzip at all", "length|gzip", codes.CORRUPT_MESSAGE),
    (b"", "no record batch", codes.INVALID_RECORD),
])
def test_bad_batches_are_refused_by_name(data, problem, code):
    with pytest.raises(KafkaRecordError, match=problem) as e:
        records.decode(data)
    assert e.value.kafka_code == code and codes.code_of(e.value) == code


@pytest.mark.parametrize("headers", [None, [[("h", b"v")]]], ids=["no header", "a header"])
def test_a_record_longer_than_its_fields_is_refused(headers):
    """Kafka reads a record's fields and requires them to end where its length says (DefaultRecord: "Invalid
    record size"); a record whose length claims a byte more, with a stray byte there, is refused whether or
    not the partition has headers (without any, the walk once skipped the stray byte and took the record)."""
    data = bytearray(records.encode([0], [1_700_000_000_000], None, pa.array([b"abc"], pa.binary()),
                                    None if headers is None else pa.array(headers, HEADERS_TYPE)))
    assert data[61] >> 1 == len(data) - 62  # the record's length varint: one byte, the rest of the batch
    data[61] += 2  # zigzag: one more
    data += b"\x07"
    struct.pack_into(">i", data, 8, len(data) - 12)
    struct.pack_into(">I", data, 17, crc(bytes(data[21:])))
    with pytest.raises(KafkaRecordError, match="record 0.*left over at the end of a record") as e:
        records.decode(bytes(data))
    assert e.value.kafka_code == codes.CORRUPT_MESSAGE


def test_second_batch_is_named():
    with pytest.raises(KafkaRecordError, match="batch 1 at byte"):
        records.decode(batch() + batch(fix_crc=False)[:20] + b"\x01" + batch()[21:])


def test_offset_deltas_must_count_from_zero():
    data = bytearray(records.encode([0, 1, 2], [0, 0, 0], None, [b"a", b"b", b"c"]))
    pos = 61 + 1 + 1 + 1  # record 0: length varint, attributes, timestamp delta, then its offset delta
    assert data[pos] == 0
    data[pos] = 2  # zigzag 1
    struct.pack_into(">I", data, 17, crc(bytes(data[21:])))
    with pytest.raises(KafkaRecordError, match="record 0: offset delta 1, expected 0"):
        records.decode(bytes(data))


def test_decompression_is_bounded():
    bomb = gzip.compress(b"\x00" * (20 << 20))  # 20 MiB of zeros in ~20 KiB
    data = batch(codec=records.GZIP, body=bomb)
    with pytest.raises(KafkaRecordError, match="decompresses to more than 1048576 bytes") as e:
        records.decode(data, max_uncompressed=1 << 20)
    assert e.value.kafka_code == codes.RECORD_LIST_TOO_LARGE


def test_header_keys_must_be_utf8():
    data = bytearray(records.encode([0], [0], [b"k"], [b"v"], pa.array([[("ab", b"x")]], HEADERS_TYPE)))
    i = data.index(b"ab")
    data[i] = 0xFF
    struct.pack_into(">I", data, 17, crc(bytes(data[21:])))
    with pytest.raises(KafkaRecordError, match="header key is not valid UTF-8"):
        records.decode(bytes(data))


def test_log_append_time_batches_take_the_max_timestamp():
    data = records.encode([0, 1], [10, 20], None, [b"a", b"b"], timestamp_type=records.LOG_APPEND_TIME)
    got = records.decode(data)
    assert got.log_append_time.all()
    assert got.records.column("timestamp").cast(pa.int64()).to_pylist() == [20, 20]


def _varint(data: bytes, p: int, end: int, max_bytes: int) -> tuple:
    shift = result = 0
    for _ in range(max_bytes):
        if p >= end:
            raise ValueError("varint past the end")
        b = data[p]
        p += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return (result >> 1) ^ -(result & 1), p
        shift += 7
    raise ValueError("varint too long")


def _field(data: bytes, p: int, end: int) -> tuple:
    n, p = _varint(data, p, end, 5)
    if n < -1 or p + max(n, 0) > end:
        raise ValueError("bad length")
    return (None if n < 0 else data[p:p + n]), p + max(n, 0)


def reference_rows(data: bytes) -> list:
    """Kafka's own reading rules for uncompressed batches (DefaultRecordBatch, DefaultRecord: a record's
    fields end exactly where its length says), in plain Python, one byte at a time: (key, value, headers)
    of every record, or ValueError. The oracle the compiled walk is compared with."""
    rows, pos = [], 0
    if not data:
        raise ValueError("no batch")
    while pos < len(data):
        if len(data) - pos < records.HEADER_SIZE:
            raise ValueError("short header")
        h = records.HEADER.unpack_from(data, pos)
        length, magic, attributes, last_delta, count = h[1], h[3], h[5], h[6], h[12]
        end = pos + 12 + length
        if magic != 2 or length < records.HEADER_SIZE - 12 or end > len(data):
            raise ValueError("bad batch header")
        if count < 1 or count > length or last_delta != count - 1:
            raise ValueError("bad record count")
        p = pos + records.HEADER_SIZE
        for k in range(count):
            size, p = _varint(data, p, end, 5)
            record_end = p + size
            if size < 6 or record_end > end:
                raise ValueError("bad record length")
            p += 1  # attributes (int8)
            _, p = _varint(data, p, record_end, 10)
            delta, p = _varint(data, p, record_end, 5)
            if delta != k:
                raise ValueError("bad offset delta")
            key, p = _field(data, p, record_end)
            value, p = _field(data, p, record_end)
            n_headers, p = _varint(data, p, record_end, 5)
            if n_headers < 0:
                raise ValueError("bad header count")
            headers = []
            for _ in range(n_headers):
                name, p = _field(data, p, record_end)
                if name is None:
                    raise ValueError("null header key")
                header_value, p = _field(data, p, record_end)
                headers.append((name.decode("utf-8"), header_value))  # UnicodeDecodeError is a ValueError
            if p != record_end:
                raise ValueError("bytes left over in a record")
            rows.append((key, value, headers))
        if p != end:
            raise ValueError("bytes left over in a batch")
        pos = end
    return rows


@pytest.fixture(scope="module", params=["headers", "no headers"])
def two_batches(request):
    """Two uncompressed batches (keys, nulls, headers or none: a partition without any header takes another
    path) to damage: the walk, not the CRC, meets the damage."""
    keys, values, headers, ts = columns(12, seed=3)
    return bytes(records.encode(np.arange(12), ts, pa.array(keys, pa.binary()), pa.array(values, pa.binary()),
                                pa.array(headers, HEADERS_TYPE) if request.param == "headers" else None,
                                batch_starts=[0, 7]))


@fuzz_settings(short=400)
@given(data=st.data())
def test_any_damage_to_batches_is_refused_by_name_or_decodes_to_valid_columns(two_batches, data):
    """An attacker's Produce records: whatever bytes the compiled walk meets (CRC not checked, so damage
    reaches it), decode either refuses them with a KafkaRecordError or returns exactly the batches' record
    count in columns Arrow validates in full (no read past a region, no negative length let through)."""
    damaged = data.draw(mutated(two_batches))
    try:
        got = records.decode(damaged, verify=False)
    except KafkaRecordError as e:
        assert str(e) and e.kafka_code in (codes.CORRUPT_MESSAGE, codes.INVALID_RECORD,
                                           codes.UNSUPPORTED_COMPRESSION_TYPE, codes.RECORD_LIST_TOO_LARGE)
        got = None
    else:
        got.records.validate(full=True)
        assert got.records.num_rows == int(got.counts.sum())
    if any(h[5] & 0x7 for h in _headers_of(damaged)):
        return  # the codec bits were hit: the damaged bytes were handed to a decompressor (bounded, refused)
    try:
        expected = reference_rows(damaged)
    except (ValueError, struct.error):
        event("refused by Kafka's rules")
        assert got is None, "decode accepted bytes that Kafka's reading rules refuse"
        return
    event("accepted by Kafka's rules")
    assert got is not None, "decode refused bytes that Kafka's reading rules accept"
    assert as_rows(got) == expected


def _headers_of(data: bytes) -> list:
    """The batch headers that can be read from ``data`` (for its codec bits), as far as they go."""
    out, pos = [], 0
    while len(data) - pos >= records.HEADER_SIZE:
        h = records.HEADER.unpack_from(data, pos)
        out.append(h)
        if h[1] < records.HEADER_SIZE - 12:
            break
        pos += 12 + h[1]
    return out


def test_gathering_fields_copies_each_range_and_refuses_one_outside_its_buffers():
    """The compiled copy behind every decoded key, value and header (``_kernels.gather``, one memcpy a
    field) copies exactly the ranges, nulls as nothing, and copies nothing it cannot check: a range past
    the source or an output too small is refused, never read or written out of bounds."""
    from metaq_broker.protocol.kafka import _kernels
    src = np.frombuffer(b"..abc.de...f", np.uint8)
    starts, lengths = np.array([2, 0, 6, 11], np.int64), np.array([3, -1, 2, 1], np.int32)
    out, offsets = np.zeros(6, np.uint8), np.zeros(5, np.int32)
    assert _kernels.gather(src, starts, lengths, out, offsets) == 6
    assert out.tobytes() == b"abcdef" and offsets.tolist() == [0, 3, 3, 5, 6]
    arr = records._binary(src, starts, lengths, pa.binary())
    assert arr.to_pylist() == [b"abc", None, b"de", b"f"] and arr.null_count == 1
    arr.validate(full=True)
    assert _kernels.gather(src, np.array([11], np.int64), np.array([2], np.int32), out, offsets) == -1
    assert _kernels.gather(src, np.array([-1], np.int64), np.array([2], np.int32), out, offsets) == -1
    assert _kernels.gather(src, starts, lengths, np.zeros(5, np.uint8), offsets) == -1
    assert _kernels.gather(src, starts, lengths, out, np.zeros(4, np.int32)) == -1  # offsets one short
    from numba.core.errors import TypingError
    for bad in (np.frombuffer(bytes(6), np.uint8), np.zeros(12, np.uint8)[::2]):  # read-only; strided
        with pytest.raises(TypingError):
            _kernels.gather(src, starts, lengths, bad, offsets)
    with pytest.raises(KafkaRecordError, match="out of their batch"):
        records._binary(src, np.array([11], np.int64), np.array([2], np.int32), pa.binary())
    with pytest.raises(IndexError, match="outside its column"):  # encode's copy checks its ranges too
        _kernels._put(np.zeros(4, np.uint8), 0, src, 10, 3)
