"""MetaQ's text commands (protocol/metaq/text.py): every line format of the reference
(seed notes §2.2, metaq-1.4-clients.md), valid and malformed. Each malformed request becomes one
``Rejected`` naming the problem; the connection stays usable (a ``version`` after it still parses)
unless the request's end cannot be known, and then the parser closes and reads nothing more. However the
bytes are split across ``feed`` calls, the events are the same, and the parser holds no more than a line
and a body however much is sent."""
import zlib

import pytest
from hypothesis import given, settings, strategies as st

from metaq_broker.protocol.metaq import text as T
from metaq_broker.protocol.metaq.text import (Code, Get, LocalTxKey, OffsetQuery, Put, Quit, Rejected, RequestParser,
                                              Stats, Transaction, TxType, Version, XaTxKey)

pytestmark = pytest.mark.unit

MAX = 1000
PROBE = b"version 77\r\n"  # after any non-fatal refusal, the next request must still parse


def crc(data: bytes) -> int:
    return zlib.crc32(data) & 0x7FFFFFFF


def parse(data: bytes, max_message_size=MAX, **kw):
    p = RequestParser(max_message_size=max_message_size, **kw)
    return p, p.feed(data)


def only(data: bytes):
    _, events = parse(data)
    assert len(events) == 1, events
    return events[0]


def attr_data(attribute: bytes, payload: bytes) -> bytes:
    return len(attribute).to_bytes(4, "big") + attribute + payload


# ---------------------------------------------------------------------------------------------------
# Valid lines


def test_put_six_tokens_before_1_4_4():
    assert only(b"put orders 2 5 0 17\r\nhello") == Put("orders", 2, 0, -1, None, 17, b"hello", None)


def test_put_seven_tokens_with_checksum():
    e = only(b"put orders 0 5 4 %d 3\r\nhello" % crc(b"hello"))
    assert e == Put("orders", 0, 4, crc(b"hello"), None, 3, b"hello", None)


def test_put_seven_tokens_checksum_minus_one_is_none():
    assert only(b"put orders 0 2 0 -1 3\r\nhi").checksum == -1


def test_put_seven_tokens_with_local_transaction_key():
    e = only(b"put t 1 2 0 TX:sess-1:42 9\r\nhi")
    assert e.tx == LocalTxKey("sess-1", 42) and e.checksum == -1 and e.opaque == 9


def test_put_seven_tokens_with_xa_key():
    e = only(b"put t 1 2 0 XID:7:0a0b:cc:host-1 9\r\nhi")
    assert e.tx == XaTxKey(7, b"\x0a\x0b", b"\xcc", "host-1") and str(e.tx) == "XID:7:0a0b:cc:host-1"


def test_put_eight_tokens_checksum_and_key():
    e = only(b"put t 0 2 0 %d TX:s:1 9\r\nhi" % crc(b"hi"))
    assert (e.checksum, e.tx, e.value) == (crc(b"hi"), LocalTxKey("s", 1), b"hi")


def test_put_eight_tokens_null_key_is_no_transaction():
    assert only(b"put t 0 2 0 -1 null 9\r\nhi").tx is None


def test_put_any_partition():
    assert only(b"put t -1 2 0 -1 9\r\nhi").partition == -1


def test_put_empty_body():
    assert only(b"put t 0 0 0 9\r\n").value == b""


def test_put_body_may_hold_crlf_and_command_text():
    body = b"get t g 0 0 1 1\r\nput x\r\n"
    assert only(b"put t 0 %d 0 9\r\n" % len(body) + body).value == body


def test_put_with_attribute_splits_data():
    data = attr_data("caf\u00e9".encode(), b"payload")
    e = only(b"put t 0 %d 1 %d 4\r\n" % (len(data), crc(data)) + data)
    assert (e.attribute, e.value, e.flag) == ("caf\u00e9", b"payload", 1)


def test_put_with_empty_attribute():
    e = only(b"put t 0 4 1 4\r\n" + attr_data(b"", b""))
    assert (e.attribute, e.value) == ("", b"")


def test_put_at_max_message_size_with_attribute_prefix():
    data = attr_data(b"a" * 10, b"x" * (MAX - 10))  # stored bytes = MAX; the 4-byte length is not stored
    assert only(b"put t 0 %d 1 4\r\n" % len(data) + data).value == b"x" * (MAX - 10)
    assert only(b"put t 0 %d 0 4\r\n" % MAX + b"x" * MAX).value == b"x" * MAX


def test_get_and_offset():
    assert only(b"get orders grp 3 1024 65536 5\r\n") == Get("orders", "grp", 3, 1024, 65536, 5)
    assert only(b"offset orders grp 3 1024 6\r\n") == OffsetQuery("orders", "grp", 3, 1024, 6)


def test_get_at_long_max_value():
    assert only(b"get t g 0 9223372036854775807 100 5\r\n").offset == (1 << 63) - 1


@pytest.mark.parametrize("line, event", [
    (b"version 12", Version(12)),
    (b"version", Version(T.NO_OPAQUE)),
    (b"version -5", Version(-5)),
    (b"stats  12", Stats(None, 12)),  # MetaQ writes a blank item as two spaces
    (b"stats", Stats(None, T.NO_OPAQUE)),
    (b"stats topics 1", Stats("topics", 1)),
    (b"stats offsets 1", Stats("offsets", 1)),
    (b"stats realtime 1", Stats("realtime", 1)),
    (b"stats config 1", Stats("config", 1)),
    (b"stats orders 1", Stats("orders", 1)),
    (b"stats orders", Stats("orders", T.NO_OPAQUE)),
    (b"version 12 ", Version(12)),  # trailing spaces dropped, as Java's split drops trailing empties
])
def test_version_and_stats(line, event):
    assert only(line + b"\r\n") == event


@pytest.mark.parametrize("tx_type", list(TxType))
def test_transaction_every_type(tx_type):
    e = only(b"transaction TX:s:5 s %s 11\r\n" % tx_type.value.encode())
    assert e == Transaction(LocalTxKey("s", 5), "s", tx_type, 0, None, 11)


def test_transaction_optional_tokens():
    assert only(b"transaction XID:1:ab:cd:q s BEGIN 30 12\r\n").timeout == 30  # 6 tokens, numeric: timeout
    e = only(b"transaction null s RECOVER host-1 12\r\n")  # 6 tokens, not numeric: the unique qualifier
    assert (e.key, e.unique_qualifier, e.timeout) == (None, "host-1", 0)
    e = only(b"transaction XID:1:ab:cd:q s BEGIN 30 q 12\r\n")  # 7 tokens: both
    assert (e.timeout, e.unique_qualifier, e.key) == (30, "q", XaTxKey(1, b"\xab", b"\xcd", "q"))


def test_transaction_keys_round_trip_and_colons():
    assert str(T.parse_tx_key("TX:a:b:c:-3")) == "TX:a:b:c:-3"  # the session id keeps its colons
    assert T.parse_tx_key("XID:-1:AB:cd:q:r") == XaTxKey(-1, b"\xab", b"\xcd", "q:r")


def test_quit_ends_reading():
    p, events = parse(b"quit\r\nversion 1\r\n")
    assert events == [Quit()] and p.closed and p.feed(PROBE) == []


def test_pipelined_requests_in_order():
    body = b"x" * 10
    data = (b"version 1\r\n" + b"put t 0 10 0 %d 2\r\n" % crc(body) + body + b"get t g 0 0 100 3\r\n"
            + b"stats  4\r\n" + b"offset t g 0 0 5\r\n")
    assert [type(e) for e in only_all(data)] == [Version, Put, Get, Stats, OffsetQuery]


def only_all(data):
    return parse(data)[1]


PIPELINE = (b"version 1\r\nput t 0 5 1 %d 2\r\n" % crc(attr_data(b"a", b"")) + attr_data(b"a", b"")
            + b"put t 0 3 0 9\r\nabc" + b"bogus line\r\nput t 0 x 0 1\r\n")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(PIPELINE)), max_size=12))
def test_same_events_however_the_bytes_are_split(cuts):
    whole = RequestParser(MAX).feed(PIPELINE)
    p, got, prev = RequestParser(MAX), [], 0
    for c in sorted(cuts) + [len(PIPELINE)]:
        got += p.feed(PIPELINE[prev:c])
        prev = c
    assert got == whole
    assert [type(e) for e in whole] == [Version, Put, Put, Rejected, Rejected] and whole[-1].close


# ---------------------------------------------------------------------------------------------------
# Malformed lines: one Rejected each, naming the problem; the connection stays usable


USABLE = [
    (b"bogus 1 2\r\n", "unknown command 'bogus'", 2),  # the last token, when it is a number
    (b"\r\n", "blank command line", T.NO_OPAQUE),
    (b"   \r\n", "blank command line", T.NO_OPAQUE),
    (b"get \xff\xfe t\r\n", "not UTF-8", T.NO_OPAQUE),
    (b"PUT t 0 1 0 1\r\n", "unknown command 'PUT'", 1),
    (b"put t 0 3 0\r\nabc", "expected 6, 7 or 8 tokens, got 5", 0),  # the length is readable: skipped
    (b"put t 0 3 0 -1 TX:s:1 x 5\r\nabc", "expected 6, 7 or 8 tokens, got 9", 5),
    (b"put t 0 3 zero 5\r\nabc", "flag 'zero' is not an integer", 5),
    (b"put t -2 3 0 5\r\nabc", "partition -2 is out of range", 5),
    (b"put t x 3 0 5\r\nabc", "partition 'x' is not an integer", 5),
    (b"put  0 3 0 5\r\nabc", "topic is empty", 5),
    (b"put t 0 3 0 five\r\nabc", "opaque 'five' is not an integer", T.NO_OPAQUE),
    (b"put t 0 3 0 2147483648\r\nabc", "opaque 2147483648 is out of range", T.NO_OPAQUE),
    (b"put t 0 3 0 12 5\r\nabc", "checksum 12 does not match", 5),
    (b"put t 0 3 0 12x TX:s:1 5\r\nabc", "checksum '12x' is not an integer", 5),
    (b"put t 0 3 0 1x 5\r\nabc", "checksum '1x' is not an integer", 5),  # 7 tokens, a digit: a checksum
    (b"put t 0 3 0 +1 5\r\nabc", "expected null, TX:... or XID:...", 5),  # not a digit or '-': a key
    (b"put t 0 3 0 TX:s 5\r\nabc", "expected TX:<sessionId>:<value>", 5),
    (b"put t 0 3 0 TX::1 5\r\nabc", "expected TX:<sessionId>:<value>", 5),
    (b"put t 0 3 0 TX:s:one 5\r\nabc", "value 'one' is not an integer", 5),
    (b"put t 0 3 0 XID:1:ab:cd 5\r\nabc", "expected XID:<formatId>:<gtid>:<bqual>:<uniqueQualifier>", 5),
    (b"put t 0 3 0 XID:1:zz:cd:q 5\r\nabc", "gtid 'zz' is not hexadecimal", 5),
    (b"put t 0 3 0 XID:1:abc:cd:q 5\r\nabc", "gtid 'abc' is not hexadecimal", 5),
    (b"put t 0 3 0 XID:1::cd:q 5\r\nabc", "gtid must be 1 to 64 bytes", 5),
    (b"put t 0 3 0 XID:1:" + b"ab" * 65 + b":cd:q 5\r\nabc", "gtid must be 1 to 64 bytes", 5),
    (b"put t 0 3 0 XID:x:ab:cd:q 5\r\nabc", "formatId 'x' is not an integer", 5),
    (b"put t 0 1001 0 5\r\n" + b"x" * 1001, "valueLen 1001 exceeds maxMessageSize 1000", 5),
    (b"put t 0 1005 1 5\r\n" + b"x" * 1005, "valueLen 1005 exceeds maxMessageSize 1000", 5),
    (b"put t 0 2 1 5\r\nab", "only 2 bytes", 5),
    (b"put t 0 5 1 5\r\n\x00\x00\x00\x09a", "attribute length 9 does not fit", 5),
    (b"put t 0 5 1 5\r\n\xff\xff\xff\xffa", "attribute length -1 does not fit", 5),
    (b"put t 0 6 1 5\r\n\x00\x00\x00\x02\xc3\x28", "attribute is not valid UTF-8", 5),
    (b"get t g 0 0 100\r\n", "expected get topic group partition offset maxSize opaque, got 6", 100),
    (b"get t g 0 0 0 5\r\n", "Bad request,invalid max size:0", 5),
    (b"get t g 0 0 -7 5\r\n", "invalid max size:-7", 5),
    (b"get t g 0 1e3 100 5\r\n", "offset '1e3' is not an integer", 5),
    (b"get t g 0 9223372036854775808 100 5\r\n", "offset 9223372036854775808 is out of range", 5),
    (b"get t g 0 \xd9\xa1 100 5\r\n", "is not an integer", 5),  # a non-ASCII digit
    (b"get t g 0 1_0 100 5\r\n", "offset '1_0' is not an integer", 5),
    (b"get t  0 0 100 5\r\n", "group is empty", 5),
    (b"offset t g 0 5\r\n", "expected offset topic group partition offset opaque, got 5", 5),
    (b"version 1 2\r\n", "expected version [opaque], got 3", 2),
    (b"version x\r\n", "opaque 'x' is not an integer", T.NO_OPAQUE),
    (b"stats a b c\r\n", "expected stats [item] [opaque], got 4", T.NO_OPAQUE),
    (b"stats topics x\r\n", "opaque 'x' is not an integer", T.NO_OPAQUE),
    (b"transaction TX:s:1 s COMMIT 5\r\n", "unknown transaction type 'COMMIT'", 5),
    (b"transaction TX:s:1 s\r\n", "got 3 tokens", T.NO_OPAQUE),
    (b"transaction TX:s:1 s BEGIN 1 q x 5\r\n", "got 8 tokens", 5),
    (b"transaction TX:s:1 s BEGIN x q 5\r\n", "timeout 'x' is not an integer", 5),
    (b"transaction TX:s:1 s BEGIN -1 q 5\r\n", "timeout -1 is out of range", 5),
    (b"transaction bogus s BEGIN 5\r\n", "expected null, TX:... or XID:...", 5),
    (b"transaction TX:s:1  BEGIN 5\r\n", "sessionId is empty", 5),
    (b"result 200 3 5\r\nabc", "result is a reply, not a request", 5),
    (b"value 3 5\r\nabc", "value is a reply, not a request", 5),
]


@pytest.mark.parametrize("data, problem, opaque", USABLE)
def test_malformed_request_is_refused_and_connection_stays_usable(data, problem, opaque):
    p, events = parse(data + PROBE)
    assert len(events) == 2, events
    bad, probe = events
    assert isinstance(bad, Rejected) and bad.code == Code.BAD_REQUEST and not bad.close
    assert problem in bad.message, bad.message
    assert bad.opaque == opaque
    assert probe == Version(77) and not p.closed
    assert T.rejected_reply(bad).startswith(b"result 400 ")


def test_sync_is_refused_like_a_broker_without_its_processor():
    p, events = parse(b"sync t 0 3 0 12345 -1 5\r\nabc" + PROBE)
    assert events[0].code == Code.SERVICE_UNAVAILABLE and "replication" in events[0].message
    assert events[0].opaque == 5 and events[1] == Version(77)


FATAL = [
    (b"put t 0 x 0 5\r\n", "body length 'x' is not an integer"),
    (b"put t 0 -1 0 5\r\n", "body length -1 is out of range"),
    (b"put t 0 2147483648 0 5\r\n", "body length 2147483648 is out of range"),
    (b"put t\r\n", "body length '' is not an integer"),
    (b"sync t 0 x 0 1 5\r\n", "body length 'x'"),
    (b"result 200 x 5\r\n", "body length 'x'"),
]


@pytest.mark.parametrize("data, problem", FATAL)
def test_unframeable_request_is_refused_and_closes(data, problem):
    p, events = parse(data + PROBE)
    assert len(events) == 1 and events[0].close and events[0].code == Code.BAD_REQUEST
    assert problem in events[0].message and "closing" in events[0].message
    assert p.closed and p.feed(PROBE) == []


# ---------------------------------------------------------------------------------------------------
# Limits: nothing buffered without bound


def test_over_long_line_without_crlf_is_refused_and_not_kept():
    p = RequestParser(MAX, max_line=100)
    events = []
    for _ in range(1000):  # 1 MB of one endless line
        events += p.feed(b"a" * 1000)
        assert p.buffered <= 101
    events += p.feed(b"\r\n" + PROBE)
    assert [type(e) for e in events] == [Rejected, Version]
    assert "longer than 100 bytes" in events[0].message and not events[0].close


def test_line_at_the_cap_is_accepted_even_when_its_lf_arrives_late():
    p = RequestParser(MAX, max_line=20)
    line = b"version 1" + b" " * 11  # 20 bytes
    assert p.feed(line + b"\r") == [] and p.feed(b"\n") == [Version(1)]
    assert p.feed(line + b"  \r\n")[0].code == Code.BAD_REQUEST  # 22 bytes


def test_over_long_line_with_crlf_in_one_piece():
    p, events = parse(b"get " + b"t" * 5000 + b" g 0 0 1 1\r\n" + PROBE)
    assert [type(e) for e in events] == [Rejected, Version]


def test_cr_split_from_lf_while_discarding():
    p = RequestParser(MAX, max_line=10)
    events = p.feed(b"x" * 50 + b"\r")
    events += p.feed(b"\n" + PROBE)
    assert [type(e) for e in events] == [Rejected, Version]


def test_oversized_body_is_read_past_not_kept():
    p = RequestParser(MAX)
    events = p.feed(b"put t 0 10000000 0 5\r\n")
    for _ in range(100):
        events += p.feed(b"y" * 100_000)
        assert p.buffered == 0
    events += p.feed(PROBE)
    assert [type(e) for e in events] == [Rejected, Version] and "exceeds maxMessageSize" in events[0].message


def test_awaited_body_is_held_up_to_its_length_only():
    p = RequestParser(MAX)
    assert p.feed(b"put t 0 1000 0 5\r\n" + b"z" * 999) == []
    assert p.buffered == 999
    assert p.feed(b"z")[0].value == b"z" * 1000 and p.buffered == 0


# ---------------------------------------------------------------------------------------------------
# Replies


def test_result_reply_counts_utf8_bytes():
    assert T.result(Code.SUCCESS, "caf\u00e9", 7) == "result 200 5 7\r\ncaf\u00e9".encode()
    assert T.result(Code.NOT_FOUND, None, -1) == b"result 404 0 -1\r\n"


def test_value_header_and_put_result():
    assert T.value_header(123, 9) == b"value 123 9\r\n"
    assert T.put_result(1234567890123, 3, 4096, 9) == b"result 200 20 9\r\n1234567890123 3 4096"


def test_stats_body():
    assert T.stats_body([("pid", 12), ("topics", 3)]) == "STATS\r\npid 12\r\ntopics 3\r\nEND\r\n"
