"""MetaQ's message-set layout (protocol/metaq/messages.py): bytes checked field by field against the
layout of the reference (seed notes §2.2: i32 length, CRC32, i64 id, i32 flag, [i32 attribute length,
attribute], payload, big-endian), round trips from metaq's decoded Arrow columns, and the decoder's
refusals."""
import struct
import zlib

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from metaq_broker.protocol import records
from metaq_broker.protocol.metaq.messages import (MessageSetError, crc32_each, decode_message_set, encode_message_set,
                                                  message_sizes)

pytestmark = pytest.mark.unit


def reference_message(payload: bytes, attribute, flag: int, msg_id: int) -> bytes:
    """One message written straight from the reference's table."""
    data = payload if attribute is None else struct.pack(">i", len(attribute.encode())) + attribute.encode() + payload
    flag = (flag & ~1) | (attribute is not None)
    return struct.pack(">iIqi", len(data), zlib.crc32(data), msg_id, flag) + data


def test_layout_field_by_field():
    buf = bytes(encode_message_set(pa.array([b"hello", b"xy"]), pa.array([None, "k=v"]),
                                   np.array([0, 6], np.int32), np.array([7, 1 << 40])))
    assert buf[:20] == struct.pack(">iIqi", 5, zlib.crc32(b"hello"), 7, 0) and buf[20:25] == b"hello"
    second = buf[25:]
    assert struct.unpack(">iIqi", second[:20]) == (4 + 3 + 2, zlib.crc32(b"\x00\x00\x00\x03k=vxy"), 1 << 40, 7)
    assert second[20:] == b"\x00\x00\x00\x03k=vxy"
    assert list(message_sizes([5, 2], [-1, 3])) == [25, 29] and len(buf) == 54


def test_flag_bit0_follows_the_attribute_not_the_stored_flag():
    """A metaq message with flag 1 and no attribute must not tell a MetaQ client that an attribute follows."""
    buf = bytes(encode_message_set(pa.array([b"abcd1234"]), None, np.array([1 | 8], np.int32), np.array([1])))
    assert struct.unpack(">i", buf[16:20])[0] == 8
    assert decode_message_set(buf).values == [b"abcd1234"]


messages = st.lists(st.tuples(st.binary(max_size=40), st.none() | st.text(max_size=8),
                              st.integers(-(1 << 31), (1 << 31) - 1), st.integers(0, (1 << 63) - 1)),
                    min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(messages, st.integers(0, 3))
def test_round_trip_and_reference_bytes(rows, lead):
    values = pa.array([b"pad"] * lead + [r[0] for r in rows], pa.binary()).slice(lead)  # sliced: offset != 0
    attrs = pa.array([None] * lead + [r[1] for r in rows], pa.string()).slice(lead)
    flags = np.array([r[2] for r in rows], np.int32)
    ids = np.array([r[3] for r in rows], np.int64)
    buf = bytes(encode_message_set(values, attrs, flags, ids))
    assert buf == b"".join(reference_message(*r) for r in rows)
    sizes = message_sizes(pc_lengths(values), [-1 if a is None else len(a.encode()) for a in attrs.to_pylist()])
    assert int(sizes.sum()) == len(buf)
    got = decode_message_set(buf)
    assert got.values == [r[0] for r in rows] and got.attributes == [r[1] for r in rows]
    assert list(got.msg_ids) == list(ids) and list(got.positions) == list(np.cumsum(sizes) - sizes)
    assert list(got.flags) == [(f & ~1) | (a is not None) for _, a, f, _ in rows]
    assert got.consumed == len(buf)
    cut = decode_message_set(buf[:-1])  # a partial trailing message is left, as MetaQ's client leaves it
    assert len(cut.values) == len(rows) - 1 and cut.consumed == len(buf) - int(sizes[-1])


def pc_lengths(arr):
    return [len(v) for v in arr.to_pylist()]


def test_from_metaq_batches():
    """metaq's stored batches, decoded to Arrow as every reader decodes them, become MetaQ messages."""
    body = records.encode_body([b"a", b"bb", b"ccc"], keys=[b"k", None, None], attributes=[None, "x", ""],
                               flags=[0, 3, 4])
    buf = records.encode_header(body, base_offset=10, base_msg_id=500, timestamp_ms=1) + b"".join(
        bytes(p) for p in body.parts)
    batch = records.decode(buf)
    out = decode_message_set(encode_message_set(batch.column("value"), batch.column("attribute"),
                                                batch.column("flag").to_numpy(), batch.column("msgId").to_numpy()))
    assert out.values == [b"a", b"bb", b"ccc"] and out.attributes == [None, "x", ""]
    assert list(out.msg_ids) == [500, 501, 502] and list(out.flags) == [0, 3, 5]


@pytest.mark.parametrize("buf, problem", [
    (struct.pack(">iIqi", -1, 0, 1, 0), "negative length -1"),
    (struct.pack(">iIqi", 2, 123, 1, 0) + b"ab", "checksum 123 does not match"),
    (struct.pack(">iIqi", 2, zlib.crc32(b"ab"), 1, 1) + b"ab", "attribute length -1 does not fit"),
    (struct.pack(">iIqi", 6, zlib.crc32(b"\0\0\0\x09ab"), 1, 1) + b"\0\0\0\x09ab", "attribute length 9 does not fit"),
    (struct.pack(">iIqi", 6, zlib.crc32(b"\0\0\0\x02\xc3\x28"), 1, 1) + b"\0\0\0\x02\xc3\x28", "not UTF-8"),
])
def test_decode_refuses_bad_messages(buf, problem):
    with pytest.raises(MessageSetError, match=problem):
        decode_message_set(buf)


def test_decode_short_header_is_a_partial_message():
    assert decode_message_set(b"\0" * 19).consumed == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=200) | st.sampled_from([b"", b"z" * 5000]), max_size=40), st.integers(0, 5),
       st.integers(0, 5))
def test_crc32_each_is_zlib_crc32_of_each_entry(values, head, tail):
    """The compiled loop (small messages) and zlib's (large ones) agree with zlib, also on a sliced array."""
    arr = pa.array(values, pa.binary())
    arr = arr.slice(min(head, len(arr)), max(len(arr) - head - tail, 0))
    assert crc32_each(arr).tolist() == [zlib.crc32(v) for v in arr.to_pylist()]
