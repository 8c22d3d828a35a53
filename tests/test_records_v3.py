"""Record format version 3: the producer fields and MetaQ byte position in the header, Kafka record headers
in the body, and version 2 batches (written by the previous metaq) read everywhere beside them."""
import struct

import numpy as np
import pyarrow as pa
import pytest
from record_v2 import v2_batch

from metaq_broker.errors import InvalidMessageError
from metaq_broker.protocol import records

pytestmark = pytest.mark.unit


def v3(values, base=0, msg_id=1, ts=5, producer=(-1, -1, -1), byte_base=0, **kw):
    body = records.encode_body(values, **kw)
    return records.encode_header(body, base, msg_id, ts, producer=producer, byte_base=byte_base) + \
        b"".join(bytes(p) for p in body.parts)


def v2(values, base=0, msg_id=1, ts=5, keys=None, attributes=None):
    return v2_batch(values, keys, attributes, base=base, msg_id=msg_id, ts=ts)


def test_the_header_is_72_bytes_and_carries_the_producer_and_the_metaq_position():
    buf = v3([b"a", b"bc"], base=7, producer=(123456789012, 3, 41), byte_base=1000)
    h = records.check_batch(buf)
    assert (h.version, h.size, h.batch_len % 8) == (3, 72, 0)
    assert (h.producer_id, h.producer_epoch, h.base_sequence, h.byte_base) == (123456789012, 3, 41, 1000)
    pid, epoch, layout, seq, byte_base = struct.unpack_from("<qhHiq", buf, 48)
    assert (pid, epoch, layout, seq, byte_base) == (123456789012, 3, h.layout, 41, 1000)
    assert layout == records.encode_body([b"a", b"bc"]).attributes >> 16 == 1  # one i8 column: value lengths
    for i in range(8, 72):  # the header CRC covers every byte from 8 to 72
        damaged = bytearray(buf)
        damaged[i] ^= 0x10
        with pytest.raises(records.RecordFormatError):
            records.check_batch(bytes(damaged))


def test_version_2_and_3_batches_decode_together():
    buf = v2([b"old1", b"old2"], base=0, msg_id=10, keys=[b"k", None], attributes=["a", None]) \
        + v3([b"new"], base=2, msg_id=12, headers=[[("h", b"v")]]) + v2([b"old3"], base=3, msg_id=13)
    batch = records.decode(buf, headers=True)
    assert batch.column("value").to_pylist() == [b"old1", b"old2", b"new", b"old3"]
    assert batch.column("offset").to_pylist() == [0, 1, 2, 3]
    assert batch.column("msgId").to_pylist() == [10, 11, 12, 13]
    assert batch.column("key").to_pylist() == [b"k", None, None, None]
    assert batch.column("attribute").to_pylist() == ["a", None, None, None]
    assert batch.column("headers").to_pylist() == [[], [], [{"key": "h", "value": b"v"}], []]
    assert records.decode(buf).schema == records.SCHEMA  # no headers column unless asked


@pytest.mark.parametrize("bit", [records.HAS_HEADERS, records.NO_FLAGS, records.HAS_TIMESTAMPS])
def test_a_version_2_batch_may_not_claim_version_3_bits(bit):
    with pytest.raises(records.RecordFormatError, match="attributes"):
        records.decode(v2_batch([b"x"], extra_bits=bit))


@pytest.mark.parametrize("n", [1, 3, 200])
def test_headers_round_trip_vectorised(n):
    rng = np.random.default_rng(n)
    headers = []
    for i in range(n):
        k = int(rng.integers(0, 4))
        headers.append(None if k == 3 and i % 2 else
                       [(f"key-é{j}", None if rng.random() < 0.3 else rng.bytes(int(rng.integers(0, 9))))
                        for j in range(k)])
    values = [b"v%d" % i for i in range(n)]
    buf = v3(values, keys=[b"k"] * n, attributes=["a"] * n, headers=headers)
    got = records.decode(buf, headers=True).column("headers").to_pylist()
    want = [[{"key": k, "value": v} for k, v in (h or [])] for h in headers]
    assert got == want
    body = records.encode_body(values, keys=[b"k"] * n, attributes=["a"] * n, headers=headers)
    parsed = records.parse_body(body.count, body.attributes, b"".join(bytes(p) for p in body.parts), body.crc)
    assert parsed.message_sizes.tolist() == body.message_sizes.tolist()
    assert parsed.metaq_bytes == body.metaq_bytes


def test_headers_from_arrow_and_a_slice_of_the_fetched_range():
    arr = pa.array([[("a", b"1")], [], [("b", None), ("c", b"")]], type=records.HEADERS_TYPE)
    buf = v3([b"x", b"y", b"z"], base=10, headers=arr)
    batch = records.decode(buf, start_offset=11, end_offset=13, headers=True)
    assert batch.column("headers").to_pylist() == [[], [{"key": "b", "value": None}, {"key": "c", "value": b""}]]


@pytest.mark.parametrize("headers,match", [
    ([[(None, b"v")]], "key"),
    ([[("k", b"v")], [("k", b"v")]], "2 entries"),
    ([["not a pair"]], "headers"),
])
def test_bad_headers_are_refused_by_name(headers, match):
    with pytest.raises(InvalidMessageError, match=match):
        records.encode_body([b"x"], headers=headers)


def test_a_body_whose_headers_do_not_add_up_is_refused():
    body = records.encode_body([b"x"], headers=[[("key", b"value")]])
    raw = bytearray(b"".join(bytes(p) for p in body.parts))
    # i8 columns: value length, header count; "x"; then the header's key and value lengths, key, value
    assert bytes(raw[:8]) == b"\x01\x01x\x03\x05key"
    raw[3] = 0x7F  # the header key's length
    with pytest.raises(records.RecordFormatError, match="overrun"):
        records.parse_body(1, body.attributes, bytes(raw), records.crc(bytes(raw)))
    raw = bytearray(b"".join(bytes(p) for p in body.parts))
    raw[5:8] = b"\xff\xfe\xfd"  # the key is not UTF-8
    with pytest.raises(records.RecordFormatError, match="UTF-8"):
        records.parse_body(1, body.attributes, bytes(raw), records.crc(bytes(raw)))


def test_message_sizes_in_metaq_layout():
    """MetaQ's message set: 20-byte head, [4-byte attribute length, attribute], payload; keys and headers
    have no place there."""
    body = records.encode_body([b"abc", b""], keys=[b"kk", None], attributes=["xyz", None],
                               headers=[[("h", b"v")], None])
    assert body.metaq_bytes == (20 + 4 + 3 + 3) + (20 + 0)
    sizes, counts, _, _, metaq, byte_base = records.index_columns(
        np.frombuffer(v3([b"abc", b""], keys=[b"kk", None], attributes=["xyz", None], byte_base=77), np.uint8),
        np.array([0]))
    assert metaq.tolist() == [50] and byte_base.tolist() == [77]


def test_stream_ends_continue_version_2_batches_from_the_one_before():
    # v3 at 100 (size 10), then two v2 (sizes 5, 7), then a v3 at 500 (size 1)
    ends = records.stream_ends(np.array([100, -1, -1, 500]), np.array([10, 5, 7, 1]), anchor=0)
    assert ends.tolist() == [110, 115, 122, 501]
    assert records.stream_ends(np.array([-1, -1]), np.array([3, 4]), anchor=60).tolist() == [63, 67]
