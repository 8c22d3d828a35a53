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
