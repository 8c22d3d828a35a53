"""The data port's frames parsed and built without I/O (protocol/dataport.py): the contract a listener and
the clients rely on, in process.

- ``RequestReader`` gives the same events however the bytes are cut, and never hands out a buffer reaching
  past the request it is reading: it reads nothing it has not been asked to, so a refused put's body, a
  login's first frame or the next pipelined request stay where they belong.
- A put's body lands in the caller's buffer (no copy); a refused one is dropped through a small buffer and
  the next request parses.
- Every malformed head raises exactly one error naming the problem, with the layout (``kind``) its refusal
  takes and whether the connection must close; the lengths refused before anything is allocated for them.
- Replies round-trip through the client's parsers, refusals as the gRPC path's errors."""
import re
import struct

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaq_broker.protocol import dataport, rawput, records
from metaq_broker.protocol.dataport import (AUTH, FETCH, PUT, REPLICA_FETCH, Auth, Fetch, MalformedRequest, Put,
                                            PutHead, PutSizeRefused, ReplicaFetch, ReplicaFetchHead, RequestReader)
from metaq_broker.protocol.status import (RemoteDiskFullError, RemoteInvalidArgumentError, RemoteNotMasterError,
                                          RemoteUnknownTopicError)

pytestmark = pytest.mark.unit


def raises_exactly(exc_class, call, *patterns):
    with pytest.raises(exc_class) as info:
        call()
    assert type(info.value) is exc_class, f"raised {type(info.value).__name__}: {info.value}"
    for pattern in patterns:
        assert re.search(pattern, str(info.value)), f"{pattern!r} not in {str(info.value)!r}"
    return info.value


def put_frame(topic="t", xid="", values=(b"a", b"bc"), partition=0, producer=None) -> bytes:
    body = records.encode_body(list(values))
    parts = rawput.pack_parts(topic, partition, xid, body.count, body.attributes, body.crc, body.parts,
                              producer=producer)
    return b"".join(bytes(p) for p in dataport.put_request(parts))


def run(reader: RequestReader, stream: bytes, cuts, take=True) -> list:
    """Feed ``stream`` cut after each offset in ``cuts``; answer PutHead with take_body (a fresh buffer)
    or skip_body, ReplicaFetchHead with take_replica_request. Returns (events, errors) in order and checks
    that no buffer handed out reached past the bytes the stream has."""
    out, pos, cuts = [], 0, sorted(set(c for c in cuts if 0 < c < len(stream))) + [len(stream)]
    limit = cuts.pop(0)
    while True:
        try:
            event = reader.next_event()
        except dataport.RequestError as e:
            out.append(e)
            if e.close:
                return out
            continue
        if event is not None:
            out.append(event)
            if isinstance(event, PutHead):
                if take:
                    reader.take_body(memoryview(np.empty(event.length, np.uint8)))
                else:
                    reader.skip_body()
            elif isinstance(event, ReplicaFetchHead):
                reader.take_replica_request()
            continue
        if pos == len(stream):
            return out
        if pos == limit:
            limit = cuts.pop(0)
        view = reader.buffer()
        n = min(len(view), limit - pos)
        assert n > 0
        view[:n] = stream[pos:pos + n]
        reader.received(n)
        pos += n


def test_a_fetch_an_auth_and_a_put_whatever_the_cuts():
    stream = dataport.pack_request("topic", 3, 42, 1000, 7, 250) + dataport.pack_auth("tok.en") + put_frame()
    whole = run(RequestReader((FETCH, AUTH, PUT)), stream, [])
    one_by_one = run(RequestReader((FETCH, AUTH, PUT)), stream, range(len(stream)))
    for events in (whole, one_by_one):
        assert events[:3] == [Fetch("topic", 3, 42, 1000, 7, 250), Auth("tok.en"), PutHead("t", "", events[2].length)]
        put = events[3]
        assert isinstance(put, Put) and len(events) == 4
        request = rawput.unpack(put.request)
        assert (request.topic, request.partition, request.batch.count) == ("t", 0, 2)
        assert bytes(put.request) == put_frame()[dataport.PREFIX.size:]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 400), max_size=12), st.booleans())
def test_events_do_not_depend_on_how_the_stream_is_cut(cuts, take):
    stream = (put_frame(values=[b"x" * 50] * 3) + dataport.pack_request("t", 0, 5) +
              put_frame("u", "sink/1/0", [b"y"]) + dataport.pack_request("", 0, 0))
    expected = run(RequestReader(), stream, [], take)
    got = run(RequestReader(), stream, cuts, take)
    assert [type(e) for e in got] == [type(e) for e in expected]
    assert [e for e in got if not isinstance(e, Put)] == [e for e in expected if not isinstance(e, Put)]
    assert [bytes(e.request) for e in got if isinstance(e, Put)] == \
        [bytes(e.request) for e in expected if isinstance(e, Put)]
    assert len([e for e in got if isinstance(e, Put)]) == (2 if take else 0)


def test_a_put_body_lands_in_the_callers_buffer():
    frame = put_frame(values=[b"z" * 1000])
    reader = RequestReader()
    mine = np.zeros(64 << 10, np.uint8)
    view = reader.buffer()
    view[:] = frame[:len(view)]
    reader.received(len(view))
    pos = len(view)
    head = None
    while head is None:
        head = reader.next_event()
        if head is None:
            view = reader.buffer()
            view[:] = frame[pos:pos + len(view)]
            reader.received(len(view))
            pos += len(view)
    assert isinstance(head, PutHead)
    reader.take_body(memoryview(mine)[:head.length])
    view = reader.buffer()
    assert len(view) == len(frame) - pos  # exactly the rest of this request, nothing of the next
    view[:] = frame[pos:]
    reader.received(len(view))
    put = reader.next_event()
    assert put.request.obj is mine  # received in place: no copy
    assert bytes(mine[:head.length]) == frame[dataport.PREFIX.size:]
    assert reader.idle


def test_a_refused_body_is_dropped_through_a_small_buffer_and_the_next_request_parses():
    big = put_frame(values=[b"q" * 200_000])
    stream = big + dataport.pack_request("t", 1, 2)
    reader = RequestReader()
    seen, pos = [], 0
    while pos < len(stream) or seen[-1:] != [Fetch("t", 1, 2, 0, 0, 0)]:
        event = reader.next_event()
        if isinstance(event, PutHead):
            reader.skip_body()
            seen.append(event)
            continue
        if event is not None:
            seen.append(event)
            continue
        view = reader.buffer()
        assert len(view) <= 64 << 10  # a refused body (200 kB) is never held whole
        n = min(len(view), len(stream) - pos)
        view[:n] = stream[pos:pos + n]
        reader.received(n)
        pos += n
    assert [type(e) for e in seen] == [PutHead, Fetch]


def head(length, kind, topic_len=0, *rest):
    return dataport.REQUEST.pack(length, kind, topic_len, *(rest or (0, 0, 0, 0, 0)))


@pytest.mark.parametrize("frame, kinds, error, close, layout, pattern", [
    (head(999, 7, 1), (FETCH, PUT), MalformedRequest, True, 7, r"malformed data port request \(kind 7, 999 bytes, "
                                                                r"topic of 1 bytes\); closing the connection"),
    (head(40, FETCH, 9), (FETCH, PUT), MalformedRequest, True, FETCH, r"kind 1, 40 bytes, topic of 9 bytes"),
    (head(32 + 2000, FETCH, 2000), (FETCH, PUT), MalformedRequest, True, FETCH, r"topic of 2000 bytes"),
    (head(32 + 5000, AUTH, 5000), (AUTH,), MalformedRequest, True, AUTH, r"kind 4"),
    (dataport.pack_auth("t"), (FETCH, PUT), MalformedRequest, True, AUTH, r"kind 4.*\(no AUTH here\)"),
    (head(56, REPLICA_FETCH), (FETCH, PUT), MalformedRequest, True, REPLICA_FETCH, r"kind 3"),
    (dataport.PREFIX.pack(dataport.MAX_PUT_BYTES + 1, PUT, 0) + bytes(24), (FETCH, PUT), PutSizeRefused, True, PUT,
     r"put of 268435457 bytes is over this broker's limit of 268435456 .*closing the connection"),
    (dataport.PREFIX.pack(20, PUT, 0) + bytes(24), (FETCH, PUT), PutSizeRefused, True, PUT,
     r"put of 20 bytes is too short to hold a PutRaw request"),
    (head(32 + 3, FETCH, 3) + b"\xff\xfe\xfd", (FETCH, PUT), MalformedRequest, False, FETCH,
     r"^the topic name is not UTF-8$"),
])
def test_malformed_heads_are_refused_in_their_layout(frame, kinds, error, close, layout, pattern):
    reader = RequestReader(kinds, why_not={AUTH: " (no AUTH here)"})
    assert len(reader.buffer()) == dataport.REQUEST.size  # a head first, and nothing more
    out = run(reader, frame, [])
    assert len(out) == 1 and type(out[0]) is error, out
    e = out[0]
    assert re.search(pattern, str(e)), str(e)
    assert (e.kind, e.close) == (layout, close)


def test_a_put_header_that_does_not_add_up_is_refused_its_frame_dropped_and_the_next_one_read():
    bad = dataport.PREFIX.pack(48, PUT, 0) + rawput.HEADER.pack(4096, 0, 0, 1, 0, 0, 0, 0, 0) + bytes(8)
    names = bytearray(put_frame())
    struct.pack_into("<H", names, dataport.PREFIX.size + 24, 0x10)  # topic_len past header_len
    out = run(RequestReader(), bad + bytes(names) + dataport.pack_request("t", 0, 9), [])
    assert [type(e) for e in out] == [MalformedRequest, MalformedRequest, Fetch]
    assert str(out[0]) == "PutRaw request header says the body starts at byte 4096 of 40" and not out[0].close
    assert "says the body starts at byte" in str(out[1]) and not out[1].close
    assert out[2] == Fetch("t", 0, 9, 0, 0, 0)


def test_names_that_are_not_utf8_drop_the_put_and_keep_the_connection():
    frame = bytearray(put_frame("tt"))
    at = dataport.PREFIX.size + rawput.HEADER.size
    frame[at:at + 2] = b"\xff\xff"
    out = run(RequestReader(), bytes(frame) + dataport.pack_request("t", 0, 1), [])
    assert [type(e) for e in out] == [MalformedRequest, Fetch]
    assert str(out[0]) == "PutRaw request: topic or xid is not UTF-8" and (out[0].kind, out[0].close) == (PUT, False)


def test_a_replica_fetch_is_read_only_once_taken_and_bounded():
    request = head(56, REPLICA_FETCH) + bytes(24)
    out = run(RequestReader((REPLICA_FETCH,), max_replica_request=1000), request, [5, 40])
    assert out == [ReplicaFetchHead(56), ReplicaFetch(bytearray(request))]
    too_long = run(RequestReader((REPLICA_FETCH,), max_replica_request=1000), head(1001, REPLICA_FETCH), [])
    assert type(too_long[0]) is MalformedRequest and too_long[0].close


def test_the_head_of_a_request_is_known_before_its_body():
    reader = RequestReader()
    assert reader.idle and not reader.has_head
    frame = put_frame()
    view = reader.buffer()
    view[:10] = frame[:10]
    reader.received(10)
    assert not reader.idle and not reader.has_head
    view = reader.buffer()
    view[:] = frame[10:32]
    reader.received(22)
    assert reader.has_head and reader.kind == PUT


# -- replies ------------------------------------------------------------------------------------------

def test_replies_round_trip_through_the_clients_parsers():
    aborted = np.array([(7, 10, 20)], dtype=records.ABORTED_DTYPE)
    built = dataport.fetch_reply_head(10, 30, 0, 25, 16, aborted) + bytes(range(16))
    head = dataport.unpack_reply_head(built[:dataport.REPLY.size], "b:1")
    rest = np.frombuffer(built[dataport.REPLY.size:], np.uint8).copy()
    assert head.rest == len(rest)
    reply = dataport.fetch_reply(head, rest, "b:1")
    assert (reply.start_offset, reply.end_offset, reply.earliest_offset, reply.latest_offset) == (10, 30, 0, 25)
    assert bytes(reply.records) == bytes(range(16)) and reply.aborted.tolist() == aborted.tolist()

    put = dataport.put_reply(5, 99, 1234, 1, 3, True)
    h = dataport.unpack_put_reply(put, "b:1")
    assert h.rest == 0 and h.result(b"", "b:1") == (5, 99, 1234, 1, 3, True)
    auth = dataport.auth_reply("User:alice")
    h = dataport.unpack_reply_head(auth[:dataport.REPLY.size], "b:1", max_header=dataport.REPLY.size)
    assert (h.status, auth[dataport.REPLY.size:]) == (dataport.OK, b"User:alice")


@pytest.mark.parametrize("code, message, error", [
    (grpc.StatusCode.NOT_FOUND, "unknown topic 'x'", RemoteUnknownTopicError),
    (grpc.StatusCode.INVALID_ARGUMENT, "checksum mismatch", RemoteInvalidArgumentError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "disk full: cannot write /d", RemoteDiskFullError),
    (grpc.StatusCode.UNAVAILABLE, "not master: member 2", RemoteNotMasterError),
])
def test_refusals_in_both_layouts_are_the_grpc_paths_errors(code, message, error):
    fetch = dataport.error_reply(FETCH, code, message)
    head = dataport.unpack_reply_head(fetch[:dataport.REPLY.size], "b:1")
    e = raises_exactly(error, lambda: dataport.fetch_reply(head, np.frombuffer(fetch[dataport.REPLY.size:], np.uint8),
                                                           "b:1"))
    assert (e.code, e.details) == (code, message)
    put = dataport.error_reply(PUT, code, message)
    h = dataport.unpack_put_reply(put[:dataport.PUT_REPLY.size], "b:1")
    e = raises_exactly(error, lambda: h.result(put[dataport.PUT_REPLY.size:], "b:1"))
    assert (e.code, e.details, e.address) == (code, message, "b:1")


@pytest.mark.parametrize("raw", [
    dataport.REPLY.pack(47, 0, 0, 0, 0, 0, 0),
    dataport.REPLY.pack(dataport.MAX_REPLY_HEADER + 8, 0, 0, 0, 0, 0, 0),
    dataport.REPLY.pack(48, 0, 0, 0, 0, 0, -1),
])
def test_a_reply_header_that_cannot_be_one_is_a_protocol_error(raw):
    raises_exactly(dataport.ProtocolError, lambda: dataport.unpack_reply_head(raw, "b:1"), r"data port b:1: bad reply")
