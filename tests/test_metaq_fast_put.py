"""The parser's fast path for the common put (one regular expression) must answer every line exactly as the
general path does: the same events, the same refusals. A put whose body arrives after its line always takes
the general path, so feeding the line and the body apart is the reference."""
import zlib

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


NUMBERS = st.sampled_from(["0", "1", "-1", "-2", "7", "2147483647", "2147483648", "-2147483648", "-2147483649",
                           "9999999999", "00012", "+5", "1e3", ""])


@settings(max_examples=400, deadline=None)
@given(topic=st.sampled_from(["t", "orders", "日本", "a" * 300, "x y"]), partition=NUMBERS, flag=NUMBERS,
       checksum=st.one_of(NUMBERS, st.just("good")), opaque=NUMBERS,
       body=st.binary(max_size=40), length=st.one_of(st.just(None), NUMBERS))
def test_the_fast_path_and_the_general_path_agree(topic, partition, flag, checksum, opaque, body, length):
    if checksum == "good":
        checksum = str(zlib.crc32(body) & 0x7FFFFFFF)
    declared = str(len(body)) if length is None else length
    line = f"put {topic} {partition} {declared} {flag} {checksum} {opaque}\r\n".encode()
    if not declared.lstrip("-+").isdigit() or int(declared) != len(body):
        return  # the body would not be this one: the framing differs by design, not by path
    whole, apart = both_ways(line, body)
    assert whole == apart


def test_a_good_put_takes_the_fast_path_and_yields_the_same_put():
    body = b"\x00\x00\x00\x02abpayload"
    line = b"put t -1 %d 1 %d 42\r\n" % (len(body), zlib.crc32(body) & 0x7FFFFFFF)
    whole, apart = both_ways(line, body)
    assert whole == apart and whole[0] == text.Put("t", -1, 1, zlib.crc32(body) & 0x7FFFFFFF, None, 42, b"payload",
                                                   "ab")
