"""The parser's fast path for the common put (one regular expression) must answer every line exactly as the
general path does: the same events, the same refusals. A put whose body arrives after its line always takes
the general path, so feeding the line and the body apart is the reference."""
import zlib

import numpy as np

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaq_broker.protocol.metaq import text

pytestmark = pytest.mark.unit


def both_ways(wire_line: bytes, body: bytes, max_message_size: int = 1000):
    whole = text.RequestParser(max_message_size).feed(wire_line + body + b"version 7\r\n")
    apart = text.RequestParser(max_message_size)
    events = apart.feed(wire_line) + apart.feed(body) + apart.feed(b"version 7\r\n")
    return whole, events


NUMBERS = ["0", "1", "-1", "-2", "7", "2147483647", "2147483648", "-2147483648", "-2147483649", "9999999999",
           "00012", "+5", "1e3", "", "٣"]
BODY = b"\x00\x00\x00\x02abpayload"
GOOD = {"topic": "t", "partition": "0", "flag": "1", "checksum": str(zlib.crc32(BODY) & 0x7FFFFFFF), "opaque": "9"}
CASES = [(field, value) for field in ("partition", "flag", "checksum", "opaque") for value in NUMBERS] + \
        [("topic", t) for t in ("orders", "日本", "a" * 300, "x\ty", "")]


@pytest.mark.parametrize("field,value", CASES)
def test_the_fast_path_and_the_general_path_agree(field, value):
    f = {**GOOD, field: value}
    line = f"put {f['topic']} {f['partition']} {len(BODY)} {f['flag']} {f['checksum']} {f['opaque']}\r\n".encode()
    whole, apart = both_ways(line, BODY)
    assert whole == apart


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=40), flag=st.integers(-3, 3), checksum=st.integers(-2, 3))
def test_bodies_and_flags_agree(body, flag, checksum):
    checksum = zlib.crc32(body) & 0x7FFFFFFF if checksum == 3 else checksum
    line = b"put t 1 %d %d %d 5\r\n" % (len(body), flag, checksum)
    whole, apart = both_ways(line, body)
    assert whole == apart


def test_a_good_put_takes_the_fast_path_and_yields_the_same_put():
    body = b"\x00\x00\x00\x02abpayload"
    line = b"put t -1 %d 1 %d 42\r\n" % (len(body), zlib.crc32(body) & 0x7FFFFFFF)
    whole, apart = both_ways(line, body)
    assert whole == apart and whole[0] == text.Put("t", -1, 1, zlib.crc32(body) & 0x7FFFFFFF, None, 42, b"payload",
                                                   "ab")


# ---------------------------------------------------------------------------------------------------
# The compiled scan of pipelined puts (``PutRun``): every buffer answered as the per-line paths answer it

def expand(events):
    return [p for e in events for p in (e.puts() if isinstance(e, text.PutRun) else [e])]


def per_line(wire: bytes, max_message_size: int = 1000) -> list:
    """The reference: the bytes one at a time, the compiled scan off (a put's body arrives after its line,
    so every put takes the general path, except one of 0 bytes: the regular expression's, tested above)."""
    p = text.RequestParser(max_message_size, run_min_bytes=1 << 62)
    return [e for i in range(len(wire)) for e in p.feed(wire[i:i + 1])]


def put_line(topic=b"t", partition=b"0", body=b"x", flag=b"0", checksum=None, opaque=b"1") -> bytes:
    checksum = b"%d" % (zlib.crc32(body) & 0x7FFFFFFF) if checksum is None else checksum
    return b"put %s %s %d %s %s %s\r\n" % (topic, partition, len(body), flag, checksum, opaque) + body


@st.composite
def requests(draw):
    kind = draw(st.sampled_from(["put"] * 6 + ["other"]))
    if kind == "other":
        return draw(st.sampled_from([
            b"version 3\r\n", b"bogus line\r\n", b"\r\n", b"put t 0 1 0\r\nx", b"put t 0 2 0 TX:s:1 4\r\nab",
            b"put t 0 1 0 5 TX:s:1 4\r\nx", b"put t 0 1 0 0 x 4\r\nz", b"put  t 0 1 0 -1 4\r\nx",
            b"put t 0 2000 0 -1 4\r\n" + b"y" * 2000, b"put t 0 3 0 -1 4\r\nab",  # the last one eats what follows
            b"put t 0 1 0 -1 " + b"9" * 5000 + b"\r\nx", b"get t g 0 0 100 8\r\n", b"put t 0 x 0 -1 4\r\n"]))
    fields = {"topic": b"t", "partition": b"0", "body": draw(st.binary(max_size=30)), "flag": b"0",
              "checksum": draw(st.sampled_from([None, b"-1"])), "opaque": b"%d" % draw(st.integers(-9, 9))}
    if draw(st.booleans()):  # a plain put to another partition or topic: a new run
        fields.update(draw(st.sampled_from([{"topic": b"u"}, {"partition": b"1"}, {"partition": b"-1"},
                                            {"topic": b"t2"}, {"partition": b"00"}])))
    if draw(st.integers(0, 3)) == 0:  # one field anything a client (or an attacker) might send
        field, values = draw(st.sampled_from(list(ODD.items())))
        fields[field] = draw(st.sampled_from(values))
    return put_line(**fields)


ODD = {"topic": ["日本".encode(), b"t" * 255, b"t" * 256, b"t\x7f"],
       "partition": [b"-0", b"-01", b"-2", b"2147483647", b"2147483648", b"+1", b"1" * 11],
       "body": [b"", b"put t 0 1 0 -1 1\r\nx", b"\r\n", b"y" * 4097],
       "flag": [b"1", b"2", b"-2", b"-3", b"2147483647", b"2147483648", b"-2147483648", b"-2147483649", b"-"],
       "checksum": [b"0", b"+5", b"-0", b"2147483648", b"01", b"-2147483649", b"-2147483648", b"--1"],
       "opaque": [b"-2147483648", b"-2147483649", b"2147483647", b"2147483648", b"09", b"-", b"1 ", b"1x"]}


@settings(max_examples=300, deadline=None)
@given(st.lists(requests(), min_size=1, max_size=30), st.lists(st.integers(0, 1 << 16), max_size=6),
       st.sampled_from([1000, 5000, 3]), st.sampled_from([0, 0, 2]))
def test_pipelined_buffers_are_answered_as_line_by_line(reqs, cuts, max_message_size, backoff):
    wire = b"".join(reqs) + b"version 7\r\n"
    expected = per_line(wire, max_message_size)
    assert expand(text.RequestParser(max_message_size, run_min_bytes=0, scan_backoff=backoff).feed(wire)) == expected
    split = text.RequestParser(max_message_size, run_min_bytes=0, scan_backoff=backoff)
    events, prev = [], 0
    for c in sorted(c % (len(wire) + 1) for c in cuts) + [len(wire)]:
        events += split.feed(wire[prev:c])
        prev = c
    assert expand(events) == expected


def test_plain_puts_to_one_partition_become_one_run_and_anything_else_ends_it():
    good = [put_line(body=b"v%d" % i, opaque=b"%d" % i) for i in range(5)]
    wire = b"".join(good[:3] + [put_line(body=b"bad", checksum=b"7")] + good[3:] + [put_line(topic=b"u")] +
                    [put_line(partition=b"1")] + [put_line(body=b"ab", flag=b"1")])
    events = text.RequestParser(run_min_bytes=0, scan_backoff=0).feed(wire)
    assert [type(e).__name__ for e in events] == ["PutRun", "Rejected", "PutRun", "PutRun", "PutRun", "Rejected"]
    assert [len(events[i]) for i in (0, 2, 3, 4)] == [3, 2, 1, 1]
    assert [p.value for p in events[0].puts()] == [b"v0", b"v1", b"v2"] and events[3].topic == "u"
    assert "checksum 7 does not match" in events[1].message
    assert expand(events) == per_line(wire, text.MAX_MESSAGE_SIZE)


def test_a_run_takes_bodies_larger_than_big_body_no_more():
    big = put_line(body=b"z" * 5000, checksum=b"-1")
    events = text.RequestParser(run_min_bytes=0, scan_backoff=0).feed(put_line() + big + put_line())
    assert [type(e).__name__ for e in events] == ["PutRun", "Put", "PutRun"]


def test_the_tail_of_an_over_long_line_is_never_read_as_a_put():
    p = text.RequestParser(max_line=20, run_min_bytes=0, scan_backoff=0)
    assert p.feed(b"a" * 30)[0].code == text.Code.BAD_REQUEST
    assert p.feed(b"put t 0 0 0 -1 1\r\nversion 5\r\n") == [text.Version(5)]
    p = text.RequestParser(max_line=20)
    p.feed(b"a" * 30)
    assert p.feed(b"put t 0 0 0 -1 1\r\nversion 5\r\n") == [text.Version(5)]


@pytest.mark.parametrize("field,value", [(f, v) for f, values in ODD.items() for v in values])
def test_each_odd_field_between_plain_puts_is_answered_as_line_by_line(field, value):
    wire = put_line() + put_line(**{field: value}) + put_line(opaque=b"3") + b"version 7\r\n"
    events = text.RequestParser(run_min_bytes=0, scan_backoff=0).feed(wire)
    assert expand(events) == per_line(wire, text.MAX_MESSAGE_SIZE)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, (1 << 63) - 1), st.integers(0, (1 << 63) - 1),
                          st.integers(text.INT32_MIN, text.INT32_MAX)), min_size=1, max_size=80),
       st.integers(0, text.INT32_MAX))
def test_compiled_put_results_are_put_result_each(rows, partition):
    ids, positions, opaques = (np.array(c, np.int64) for c in zip(*rows))
    assert text.put_results(ids, partition, positions, list(opaques.tolist())) == \
        b"".join(text.put_result(*r[:1], partition, *r[1:]) for r in rows)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_the_scan_checks_crc32_as_zlib(body):
    right, wrong = zlib.crc32(body) & 0x7FFFFFFF, (zlib.crc32(body) + 1) & 0x7FFFFFFF
    events = text.RequestParser(run_min_bytes=0, scan_backoff=0).feed(put_line(body=body, checksum=b"%d" % right) +
                                                      put_line(body=body, checksum=b"%d" % wrong))
    assert isinstance(events[0], text.PutRun) and isinstance(events[1], text.Rejected)


def test_after_a_put_the_scan_does_not_take_the_next_puts_take_the_other_paths_then_scans_resume():
    wire = put_line(body=b"\0\0\0\0v", flag=b"1") + b"".join(put_line(opaque=b"%d" % i) for i in range(4))
    events = text.RequestParser(run_min_bytes=0, scan_backoff=2).feed(wire)
    assert [type(e).__name__ for e in events] == ["Put", "Put", "Put", "PutRun"] and len(events[-1]) == 2
    assert expand(events) == per_line(wire, text.MAX_MESSAGE_SIZE)
