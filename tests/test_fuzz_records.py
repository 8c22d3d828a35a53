"""Fuzzing the record-batch decoder and the put parser (protocol/records.py, protocol/rawput.py) with
hypothesis, through their public functions only: a refused input is a RecordFormatError (the broker
answers INVALID_ARGUMENT, a reader names the byte), never another exception or a hang; whatever the
broker's put check accepts, a reader can decode to the same messages; an untouched batch decodes to what
was encoded. Mutated bodies get fresh checksums, so the checks behind the CRCs are reached too. (Readers
do not check attributes for UTF-8: the broker's put check does, once.)"""
import numpy as np
import pytest
from fuzzing import bodies, fuzz_settings, mutated
from hypothesis import given
from hypothesis import strategies as st

from metaq_broker.protocol import rawput, records

pytestmark = pytest.mark.unit


def batch_bytes(body: records.EncodedBody, base_offset: int = 0) -> bytes:
    return records.encode_header(body, base_offset, 100, 1_700_000_000_000) + b"".join(bytes(p) for p in body.parts)


def rebuilt(body: records.EncodedBody, data: bytes, count: int, attributes: int) -> records.EncodedBody:
    """``body`` with other bytes, count or attributes, and a checksum that fits the bytes."""
    return records.EncodedBody(count, attributes, [data], len(data), records.crc(data), body.message_sizes,
                               body.max_message_size)


def decode_or_refuse(buf: bytes, utf8_checked: bool = True):
    """The decoded batch (a valid Arrow batch: offsets within their buffers), or None for a refusal.
    Attributes are checked for UTF-8 once, by the broker's put check (parse_body), not by readers: bytes
    with a valid checksum that it would have refused are checked for everything else."""
    try:
        batch = records.decode(buf)
    except records.RecordFormatError:
        return None
    batch.validate()
    for name in batch.schema.names:
        if utf8_checked or name != "attribute":
            batch.column(name).validate(full=True)
    return batch


@fuzz_settings(short=300)
@given(bodies())
def test_an_untouched_batch_decodes_to_what_was_encoded(body):
    buf = batch_bytes(body, base_offset=7)
    batch = records.decode(buf)
    batch.validate(full=True)
    assert batch.num_rows == body.count and batch.column("offset").to_pylist() == list(range(7, 7 + body.count))
    checked = records.parse_body(body.count, body.attributes, b"".join(bytes(p) for p in body.parts), body.crc)
    assert checked.size == body.size


@fuzz_settings(short=500)
@given(bodies(), st.data())
def test_a_mutated_body_is_refused_or_decodes_and_what_the_broker_takes_is_readable(body, data):
    original = b"".join(bytes(p) for p in body.parts)
    raw = data.draw(mutated(original))
    count = data.draw(st.one_of(st.just(body.count), st.integers(0, 2 ** 32 - 1)))
    attributes = data.draw(st.one_of(st.just(body.attributes), st.integers(0, 255), st.integers(0, 2 ** 32 - 1)))
    try:
        accepted = records.parse_body(count, attributes, raw, records.crc(raw))
    except records.RecordFormatError:
        accepted = None
    if not 0 < count < 2 ** 31 or attributes & 0xFFFF & ~records.KNOWN_ATTRIBUTE_BITS:  # the layout rides above
        assert accepted is None
        return
    batch = decode_or_refuse(batch_bytes(rebuilt(body, raw, count, attributes)), utf8_checked=accepted is not None)
    if accepted is not None:  # stored as it is: every reader must be able to decode it
        assert batch is not None and batch.num_rows == count


@fuzz_settings(short=500)
@given(st.lists(bodies(), min_size=1, max_size=3), st.data())
def test_decoding_any_bytes_returns_messages_or_a_record_format_error(batches, data):
    buf = b"".join(batch_bytes(b, i * 1000) for i, b in enumerate(batches))
    garbage = data.draw(st.one_of(mutated(buf), st.binary(max_size=512)))
    decode_or_refuse(garbage, utf8_checked=False)
    u8 = np.frombuffer(garbage, np.uint8)
    for pos in range(0, min(len(garbage), 64), 8):
        try:
            records.check_batch(u8, pos)
        except records.RecordFormatError:
            pass


@fuzz_settings(short=500)
@given(bodies(), st.text(max_size=20), st.text(max_size=20), st.data())
def test_a_putraw_request_is_unpacked_or_refused(body, topic, xid, data):
    request = rawput.pack(topic, 0, xid, body.count, body.attributes, body.crc, body.parts)
    raw = data.draw(st.one_of(mutated(request), st.binary(max_size=256)))
    try:
        r = rawput.unpack(raw)
    except records.RecordFormatError:
        return
    assert len(r.batch.body) <= len(raw)
    try:
        records.parse_body(r.batch.count, r.batch.attributes, r.batch.body, r.batch.body_crc)
    except records.RecordFormatError:
        pass
