"""The record-batch format: exact round trips, trimming, and detection of every damaged byte."""
import numpy as np
import pyarrow as pa
import pytest

from metaq_broker.errors import InvalidMessageError
from metaq_broker.protocol import records

pytestmark = pytest.mark.unit


def encode(values, keys=None, attributes=None, flags=None, base=0, msg_id=1000, ts=1_700_000_000_000):
    body = records.encode_body(values, keys, attributes, flags)
    return bytes(records.encode_header(body, base, msg_id, ts)) + b"".join(bytes(p) for p in body.parts)


def random_messages(rng, n, max_len, with_keys=True, with_attrs=True):
    values = [rng.bytes(int(rng.integers(0, max_len))) for _ in range(n)]
    keys = [None if rng.random() < 0.3 else rng.bytes(int(rng.integers(0, 20))) for _ in range(n)] if with_keys else None
    attrs = [None if rng.random() < 0.5 else "attr-é-%d" % i for i in range(n)] if with_attrs else None
    flags = rng.integers(-(1 << 31), 1 << 31, n).tolist()
    return values, keys, attrs, flags


def expected_rows(values, keys, attrs, flags, base, msg_id, ts):
    n = len(values)
    return {
        "key": keys if keys is not None else [None] * n,
        "value": values,
        "offset": list(range(base, base + n)),
        "msgId": list(range(msg_id, msg_id + n)),
        "flag": flags if flags is not None else [0] * n,
        "attribute": attrs if attrs is not None else [None] * n,
        "timestamp": [ts] * n,
    }


def as_dict(batch):
    d = batch.to_pydict()
    d["timestamp"] = batch.column("timestamp").cast(pa.int64()).to_pylist()
    return d


@pytest.mark.parametrize("n,max_len", [(1, 10), (7, 300), (500, 40), (50, 5000)])
def test_round_trip_of_random_batches(n, max_len):
    rng = np.random.default_rng(n)
    values, keys, attrs, flags = random_messages(rng, n, max_len)
    buf = encode(values, keys, attrs, flags, base=42, msg_id=7, ts=123)
    batch = records.decode(buf)
    assert batch.schema == records.SCHEMA
    assert as_dict(batch) == expected_rows(values, keys, attrs, flags, 42, 7, 123)


@pytest.mark.parametrize("batch_size", [1, 3, 40])
@pytest.mark.parametrize("max_len", [8, 2000])
def test_many_batches_decode_as_one(batch_size, max_len):
    """Small and large values exercise both gather paths; batches mix having keys/attributes or not."""
    rng = np.random.default_rng(batch_size * max_len)
    bufs, want = [], None
    offset, msg_id = 0, 500
    for b in range(30):
        values, keys, attrs, flags = random_messages(rng, batch_size, max_len, with_keys=b % 2 == 0,
                                                     with_attrs=b % 3 == 0)
        bufs.append(encode(values, keys, attrs, flags, base=offset, msg_id=msg_id, ts=1000 + b))
        rows = expected_rows(values, keys, attrs, flags, offset, msg_id, 1000 + b)
        want = rows if want is None else {k: want[k] + rows[k] for k in want}
        offset += batch_size
        msg_id += batch_size + 3
    buf = b"".join(bufs)
    assert as_dict(records.decode(buf)) == want
    # Trimming to an offset range keeps exactly that range, even when it starts or ends mid-batch.
    lo, hi = batch_size // 2 + 1, offset - batch_size // 2 - 1
    trimmed = as_dict(records.decode(buf, lo, hi))
    assert trimmed == {k: v[lo:hi] for k, v in want.items()}
    # Decoding from known batch positions without the checksum walk gives the same rows.
    positions = np.cumsum([0] + [len(b) for b in bufs[:-1]])
    assert as_dict(records.decode(np.frombuffer(buf, np.uint8), verify=False, positions=positions)) == want


def test_arrow_input_is_encoded_without_copying_rows_through_python():
    values = pa.array([b"a" * i for i in range(10)]).slice(2, 6)
    keys = pa.chunked_array([pa.array(["k1", None, "k3"]), pa.array([None, "k5", "k6"])])
    attrs = pa.array([b"x", None, b"z", None, None, b"w"], pa.large_binary())
    batch = records.decode(encode(values, keys, attrs, pa.array([1, 2, 3, 4, 5, 6], pa.int8())))
    assert batch.column("value").to_pylist() == [b"a" * i for i in range(2, 8)]
    assert batch.column("key").to_pylist() == [b"k1", None, b"k3", None, b"k5", b"k6"]
    assert batch.column("attribute").to_pylist() == ["x", None, "z", None, None, "w"]
    assert batch.column("flag").to_pylist() == [1, 2, 3, 4, 5, 6]


def test_null_slots_that_own_bytes_are_not_stored():
    # Arrow allows a null slot to have a non-empty range; such bytes must not leak into other keys.
    arr = pa.Array.from_buffers(pa.binary(), 3, [pa.py_buffer(np.packbits([1, 0, 1], bitorder="little")),
                                                 pa.py_buffer(np.array([0, 2, 5, 7], np.int32)),
                                                 pa.py_buffer(b"aaXXXbb")])
    batch = records.decode(encode([b"1", b"2", b"3"], keys=arr))
    assert batch.column("key").to_pylist() == [b"aa", None, b"bb"]


def test_batches_are_aligned_and_the_header_is_72_bytes():
    for n in range(1, 20):
        buf = encode([b"x" * n] * n)
        assert len(buf) % 8 == 0
        h = records.parse_header(buf)
        assert (h.batch_len, h.count, h.magic, h.version) == (len(buf), n, records.MAGIC, records.VERSION)
        assert h.size == records.HEADER_SIZE == 72 and records.VERSION == 3


def test_every_damaged_byte_is_detected():
    buf = bytearray(encode([b"hello", b"world!"], keys=[b"k", None], attributes=["a", None], flags=[1, 2]))
    for i in range(len(buf)):
        for bit in (0, 7):
            damaged = bytearray(buf)
            damaged[i] ^= 1 << bit
            with pytest.raises(records.RecordFormatError):
                records.decode(bytes(damaged))


def test_checksums_are_crc32c_of_any_buffer():
    check = b"123456789"  # the standard check value of CRC-32C
    for buf in (check, bytearray(check), memoryview(check), np.frombuffer(check, np.uint8)):
        assert records.crc(buf) == 0xE3069283
    assert records.crc(check[4:], records.crc(check[:4])) == 0xE3069283


def test_format_version_1_is_refused_by_name():
    buf = bytearray(encode([b"old"]))
    buf[10] = 1  # version 1 batches carried zlib CRC-32 checksums
    with pytest.raises(records.RecordFormatError, match="version 1"):
        records.decode(bytes(buf))


def test_truncated_buffers_are_rejected_at_every_length():
    buf = encode([b"hello", b"world"] * 5)
    for cut in range(1, len(buf)):
        with pytest.raises(records.RecordFormatError, match="truncated"):
            records.decode(buf[:cut])


def test_lengths_that_overrun_the_batch_are_rejected_even_unverified():
    buf = bytearray(encode([b"abc", b"def"]))
    # no flag column (all flags 0): the value length column (i8) starts right after the 72-byte header
    assert bytes(buf[72:74]) == b"\x03\x03"
    buf[72] = 0x7F
    with pytest.raises(records.RecordFormatError, match="overrun"):
        records.decode(bytes(buf), verify=False, positions=np.array([0]))


def test_empty_buffer_decodes_to_no_rows():
    assert records.decode(b"").num_rows == 0
    assert records.decode(b"").schema == records.SCHEMA


@pytest.mark.parametrize("kwargs,match", [
    (dict(values=[]), "at least one"),
    (dict(values=None), "value column is missing"),
    (dict(values=[b"a"], keys=[b"a", b"b"]), "key column has 2 entries"),
    (dict(values=[b"a"], attributes=[b"\xff"]), "UTF-8"),
    (dict(values=[1, 2]), "value"),
    (dict(values=[b"a"], flags=[1.5]), "integers"),
    (dict(values=[b"a"], flags=[1 << 31]), "32-bit"),
    (dict(values=[b"a"], flags=[1, 2]), "flag column"),
])
def test_bad_messages_are_rejected_with_a_clear_message(kwargs, match):
    with pytest.raises(InvalidMessageError, match=match):
        records.encode_body(**kwargs)


def test_chunked_columns_encode_like_combined_ones_and_send_the_chunks_bytes_where_they_lie():
    rng = np.random.default_rng(5)
    values, keys, attrs, flags = random_messages(rng, 60, 50)
    cuts = [0, 7, 7, 30, 59, 60]  # an empty chunk and a one-message chunk among them

    def chunked(col, typ):
        return pa.chunked_array([pa.array(col[a:b], typ) for a, b in zip(cuts, cuts[1:])], typ)

    body = records.encode_body(chunked(values, pa.binary()), chunked(keys, pa.binary()),
                               chunked(attrs, pa.large_string()), flags)
    combined = records.encode_body(values, keys, attrs, flags)
    assert b"".join(bytes(p) for p in body.parts) == b"".join(bytes(p) for p in combined.parts)
    assert (body.crc, body.size, body.attributes) == (combined.crc, combined.size, combined.attributes)
    assert body.message_sizes.tolist() == combined.message_sizes.tolist()
    value_chunks = chunked(values, pa.binary())
    body = records.encode_body(value_chunks)
    addresses = {np.frombuffer(p, np.uint8).ctypes.data for p in body.parts if len(p)}
    assert all(c.buffers()[2].address in addresses for c in value_chunks.chunks if c.buffers()[2].size)
    batch = records.decode(encode(value_chunks, base=0, msg_id=1, ts=2))
    assert batch.column("value").to_pylist() == values


def test_putraw_request_round_trip():
    from metaq_broker.protocol import rawput
    body = records.encode_body([b"a", b"bc"], keys=[b"k", None])
    req = rawput.pack("t\u00e9", -1, "sink/1@2", body.count, body.attributes, body.crc, body.parts)
    r = rawput.unpack(req)
    assert (r.topic, r.partition, r.xid) == ("t\u00e9", -1, "sink/1@2")
    assert (r.batch.count, r.batch.attributes, r.batch.body_crc) == (2, body.attributes, body.crc)
    assert body.attributes & 0xFFFF == records.HAS_KEYS | records.NO_FLAGS
    assert bytes(r.batch.body) == b"".join(bytes(p) for p in body.parts)
    assert rawput.unpack(bytes(req)).batch.body.obj is not None  # a view, not a copy
    header_len = int.from_bytes(req[:4], "little")
    assert header_len % 8 == 0 and len(req) - header_len == body.size
    parsed = records.parse_body(r.batch.count, r.batch.attributes, r.batch.body, r.batch.body_crc)
    assert parsed.crc == body.crc and parsed.size == body.size


@pytest.mark.parametrize("damage,match", [
    (lambda b: b[:20], "shorter than"),
    (lambda b: (1000).to_bytes(4, "little") + b[4:], "body starts at byte 1000"),
    (lambda b: (36).to_bytes(4, "little") + b[4:], "body starts at byte 36"),  # not 8-aligned
    (lambda b: (16).to_bytes(4, "little") + b[4:], "body starts at byte 16"),  # inside the header
    (lambda b: b[:24] + (60000).to_bytes(2, "little") + b[26:], "body starts"),  # topic past the header
    (lambda b: b[:32] + b"\xff" + b[33:], "UTF-8"),
])
def test_putraw_requests_that_do_not_add_up_are_refused(damage, match):
    from metaq_broker.protocol import rawput
    body = records.encode_body([b"x" * 9])
    req = rawput.pack("topic", 0, "", body.count, body.attributes, body.crc, body.parts)
    with pytest.raises(records.RecordFormatError, match=match):
        rawput.unpack(damage(req))
