"""The replica fetch's wire format (data-port kind 3, protocol/replication.py): request and reply round
trips, malformed input refused with a message naming the problem, a reply of three sections and journal
frames read from a real socket pair; and the replication errors mapped to status codes and back."""
import socket
import struct
import threading
import uuid as uuid_module

import grpc
import numpy as np
import pytest

from metaq_broker.errors import MetaqError, NotAcknowledgedError, NotEnoughReplicasError, NotMasterError
from metaq_broker.net.blocking import read_replica_reply
from metaq_broker.protocol import dataport, records
from metaq_broker.protocol import replication as rp
from metaq_broker.protocol.dataport import ProtocolError
from metaq_broker.protocol.records import ABORTED_DTYPE
from metaq_broker.protocol.status import (STORED_NOTHING, BrokerUnavailableError, RemoteNotAcknowledgedError,
                                          RemoteNotEnoughReplicasError, RemoteNotMasterError,
                                          RemotePartitionClosedError, code_of, error_of)

pytestmark = pytest.mark.unit

UUID = uuid_module.UUID("3f2a0000-0000-4000-8000-00000000beef").bytes


def request(n=3):
    parts = [rp.PartitionFetch(f"topic-{'x' * i}", i, 100 * i, 90 * i, i) for i in range(n)]
    parts.append(rp.PartitionFetch("ünïcode", 7, 0, 0, 0))
    return rp.FetchRequest(epoch=7, replica_id=2, uuid=UUID, journal_applied_seq=41, max_wait_ms=500,
                           max_bytes=1 << 20, partitions=parts)


def batches(base: int, n: int) -> bytes:
    """``n`` real record batches from offset ``base``, one message each."""
    out = []
    for i in range(n):
        body = records.encode_body([f"v{base + i}".encode()])
        out.append(records.encode_header(body, base + i, 1000 + base + i, 1_700_000_000_000) +
                   b"".join(bytes(p) for p in body.parts))
    return b"".join(out)


# -- request --------------------------------------------------------------------------------------------------
def test_request_round_trip_and_layout():
    req = request()
    buf = rp.pack_request(req)
    assert len(buf) % 8 == 0 and len(buf) == struct.unpack_from("<I", buf)[0]
    length, kind, flags = dataport.PREFIX.unpack_from(buf)  # the data port's common prefix reads it
    assert (kind, flags) == (dataport.REPLICA_FETCH, rp.REQUEST_IDENTITIES) == (3, 1)
    assert buf[16:32] == UUID
    assert rp.unpack_request(buf) == req
    assert rp.unpack_request(memoryview(bytearray(buf))) == req  # from the receiver's buffer
    # the first entry right after the 56-byte head, its topic padded to 8
    assert rp.ENTRY.unpack_from(buf, 56) == (len("topic-"), 0, 0, 0, 0, 0, 0)
    assert bytes(buf[88:94]) == b"topic-" and bytes(buf[94:96]) == b"\0\0"
    empty = rp.FetchRequest(1, 0, uuid_module.UUID(bytes=UUID), -1, 0, 0, [])
    assert rp.unpack_request(rp.pack_request(empty)) == rp.FetchRequest(1, 0, UUID, -1, 0, 0, [])


@pytest.mark.parametrize("damage, words", [
    (lambda b: b[:40], "shorter than its 56-byte head"),
    (lambda b: struct.pack("<IH", len(b), 1) + b[6:], "kind 1 is not a replica fetch"),
    (lambda b: b + b"\0" * 8, "says it is"),
    (lambda b: b[:-8], "says it is"),
    (lambda b: struct.pack("<I", len(b) - 8) + b[4:-8], "ends inside the topic of entry"),
    (lambda b: b[:48] + struct.pack("<I", 100_001) + b[52:], "over 100000"),
    (lambda b: b[:48] + struct.pack("<I", 9) + b[52:], "ends inside partition entry"),
    (lambda b: b[:48] + struct.pack("<I", 0) + b[52:], "bytes after its 0 partition entries"),
    (lambda b: b[:40] + struct.pack("<i", -1) + b[44:], "none may be negative"),  # max_wait_ms
    (lambda b: b[:44] + struct.pack("<i", -1) + b[48:], "none may be negative"),  # max_bytes
    (lambda b: b[:32] + struct.pack("<q", -2) + b[40:], "none may be negative"),  # journal_applied_seq
    (lambda b: b[:56] + struct.pack("<H", 0) + b[58:], "topic length 0"),
    (lambda b: b[:56] + struct.pack("<H", 1025) + b[58:], "topic length 1025"),
    (lambda b: b[:88] + b"\xff" + b[89:], "not UTF-8"),
    (lambda b: b[:60] + struct.pack("<i", -1) + b[64:], "0 <= durable <= fetch"),
    (lambda b: b[:72] + struct.pack("<q", 5) + b[80:], "0 <= durable <= fetch"),  # durable 5 > fetch 0
])
def test_malformed_requests_are_refused_naming_the_problem(damage, words):
    buf = rp.pack_request(request(1))
    with pytest.raises(ProtocolError, match=words):
        rp.unpack_request(damage(buf))


def test_pack_request_refuses_what_cannot_be_sent():
    with pytest.raises(ValueError, match="over 1024"):
        rp.pack_request(rp.FetchRequest(1, 0, UUID, 0, 0, 0, [rp.PartitionFetch("t" * 1025, 0, 0, 0, 0)]))
    with pytest.raises(ValueError, match="16 bytes"):
        rp.pack_request(rp.FetchRequest(1, 0, b"short", 0, 0, 0, []))


# -- reply head and sections ----------------------------------------------------------------------------------
def test_reply_head_round_trip_and_refusal():
    head = rp.ReplyHead(0, "", master_epoch=7, sections=2, body_len=400, journal_first_seq=10,
                        journal_last_seq=12, journal_len=123, flags=rp.FLAG_JOURNAL_SNAPSHOT | rp.FLAG_TOPICS_CHANGED)
    buf = rp.pack_reply_head(head)
    assert len(buf) == 48 and rp.unpack_reply_head(buf) == head
    code = dataport.code_number(grpc.StatusCode.FAILED_PRECONDITION)
    refusal = rp.error_reply(code, f"{rp.FENCED} epoch 6, the master is at 7", master_epoch=7)
    got = rp.unpack_reply_head(refusal)
    assert (got.status, got.message, got.master_epoch, got.sections, got.body_len) == (
        code, "fenced: epoch 6, the master is at 7", 7, 0, len(got.message))
    assert len(refusal) == 48 + got.body_len
    with pytest.raises(ProtocolError, match="shorter than its 48-byte head"):
        rp.unpack_reply_head(buf[:47])
    with pytest.raises(ProtocolError, match="journal of 401 bytes"):
        rp.unpack_reply_head(rp.pack_reply_head(rp.ReplyHead(0, body_len=400, journal_len=401)))
    with pytest.raises(ProtocolError, match="bad replica fetch reply head"):
        rp.unpack_reply_head(struct.pack("<I", 44) + buf[4:])


def test_section_is_a_data_port_fetch_reply_with_a_trailer():
    data = batches(100, 3)
    aborted = np.array([(5, 90, 101)], ABORTED_DTYPE)
    head = rp.pack_section_head(100, 103, 0, 102, len(data), aborted, 110, 102, rp.SECTION_DATA, 7, 0)
    assert len(head) == 48 + 8 + 24 + 32
    # the existing data port reply layout reads it unchanged: status OK, the aborted list where it was
    header_len, status, start, end, earliest, latest, body_len = dataport.REPLY.unpack_from(head)
    assert (header_len, status, start, end, earliest, latest, body_len) == (len(head), 0, 100, 103, 0, 102, len(data))
    assert np.array_equal(rp.rawfetch.unpack_aborted(head, 48, header_len), aborted)
    section, pos = rp.unpack_section(head + data)
    assert pos == len(head) + len(data)
    assert (section.start, section.end, section.earliest, section.latest, section.log_end, section.hw,
            section.status, section.epoch, section.offset) == (100, 103, 0, 102, 110, 102, rp.SECTION_DATA, 7, 0)
    assert bytes(section.records) == data and np.array_equal(section.aborted, aborted)
    assert records.decode(section.records).column("value").to_pylist() == [b"v100", b"v101", b"v102"]
    bad = bytearray(head)
    struct.pack_into("<I", bad, len(head) - 16, 9)  # section_status
    with pytest.raises(ProtocolError, match="unknown section status 9"):
        rp.unpack_section(bytes(bad) + data)
    with pytest.raises(ProtocolError, match="runs past"):
        rp.unpack_section(head + data[:-8])
    with pytest.raises(ProtocolError, match="bad replica fetch section"):
        rp.unpack_section(rp.pack_section_head(0, 0, 0, 0, 4, None, 0, 0, 0, 0, 0) + b"\0" * 4)


def _reply_parts():
    """A reply of three sections (DIVERGING, RESET, data) and journal frames, as a master would send it."""
    journal = b"frame-1|frame-two|"  # 18 bytes: padded to 24
    data = batches(500, 4)
    sections = [
        (rp.pack_section_head(-1, -1, 0, 300, 0, None, 400, 300, rp.DIVERGING, 5, 250), b""),
        (rp.pack_section_head(-1, -1, 1000, 1200, 0, None, 1300, 1200, rp.RESET, 0, 1000), b""),
        (rp.pack_section_head(500, 504, 0, 504, len(data), np.array([(3, 400, 502)], ABORTED_DTYPE), 504, 504,
                              rp.SECTION_DATA, 0, 0), data),
    ]
    body_len = rp.reply_body_len(len(journal), (len(h) + len(r) for h, r in sections))
    head = rp.pack_reply_head(rp.ReplyHead(0, "", 7, len(sections), body_len, 40, 41, len(journal),
                                           rp.FLAG_TOPICS_CHANGED))
    parts = [head, journal, bytes(rp.pad8(len(journal)) - len(journal))]
    for h, r in sections:
        parts += [h, r]
    return parts, journal, data


def _serve(parts):
    a, b = socket.socketpair()

    def send():
        with a:
            try:
                for p in parts:  # small writes: the reader must reassemble them
                    for i in range(0, len(p), 7):
                        a.sendall(p[i:i + 7])
            except OSError:
                pass  # the reader gave up on a bad reply and closed

    t = threading.Thread(target=send)
    t.start()
    return b, t


def test_reply_with_three_sections_over_a_socket_pair():
    parts, journal, data = _reply_parts()
    sock, t = _serve(parts)
    allocated = []

    def view_alloc(n):
        buf = np.empty(n + 64, np.uint8)  # larger than asked: only n bytes are used
        allocated.append(buf)
        return buf

    with sock:
        head, frames, sections = read_replica_reply(sock, view_alloc)
        t.join()
        assert sock.recv(1) == b""  # read exactly the reply
    assert (head.status, head.master_epoch, head.sections, head.journal_first_seq, head.journal_last_seq,
            head.flags) == (0, 7, 3, 40, 41, rp.FLAG_TOPICS_CHANGED)
    assert frames == journal
    assert [s.status for s in sections] == [rp.DIVERGING, rp.RESET, rp.SECTION_DATA]
    div, reset, got = sections
    assert (div.epoch, div.offset, div.log_end, div.hw, len(div.records)) == (5, 250, 400, 300, 0)
    assert (reset.offset, reset.earliest, reset.log_end) == (1000, 1000, 1300)
    assert (got.start, got.end, got.hw) == (500, 504, 504) and bytes(got.records) == data
    assert got.records.obj is not None and len(allocated) == 1  # records are a view of the one buffer
    assert np.shares_memory(np.frombuffer(got.records, np.uint8), allocated[0])
    assert records.decode(got.records).column("offset").to_pylist() == [500, 501, 502, 503]


def test_refusal_and_cut_replies_over_a_socket_pair():
    code = dataport.code_number(grpc.StatusCode.UNAVAILABLE)
    sock, t = _serve([rp.error_reply(code, "not master: group 1, master replica 0 at h:1, epoch 7", 7)])
    with sock:
        head, frames, sections = read_replica_reply(sock)
        t.join()
    assert (head.status, head.message, frames, sections) == (code, "not master: group 1, master replica 0 at h:1, epoch 7", b"", [])
    assert isinstance(error_of(grpc.StatusCode.UNAVAILABLE, head.message, "h:1"), RemoteNotMasterError)

    parts, _, _ = _reply_parts()
    whole = b"".join(parts)
    for cut in (0, 20, 48 + 10, len(whole) - 8):
        sock, t = _serve([whole[:cut]])
        with sock, pytest.raises(ProtocolError, match="connection closed"):
            read_replica_reply(sock)
        t.join()
    # a head counting one section less than sent: the bytes left over are named
    wrong = bytearray(whole)
    struct.pack_into("<I", wrong, 12, 2)
    sock, t = _serve([bytes(wrong)])
    with sock, pytest.raises(ProtocolError, match="bytes after its 2 sections"):
        read_replica_reply(sock)
    t.join()
    sock, t = _serve([whole])
    with sock, pytest.raises(ProtocolError, match="over 100"):
        read_replica_reply(sock, max_body=100)
    t.join()


# -- errors and status codes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("local, code, remote, message", [
    (NotMasterError, grpc.StatusCode.UNAVAILABLE, RemoteNotMasterError,
     "not master: group 1, master replica 0 at 127.0.0.1:8123, epoch 7"),
    (NotEnoughReplicasError, grpc.StatusCode.FAILED_PRECONDITION, RemoteNotEnoughReplicasError,
     "not enough in-sync replicas: group 1 has in-sync set {0} (1 of 3 members), topic 'orders' needs "
     "minInSyncReplicas=2; nothing was written"),
    (NotAcknowledgedError, grpc.StatusCode.UNAVAILABLE, RemoteNotAcknowledgedError,
     "not acknowledged: stored on the master, not on in-sync set {0, 1}; it may or may not become visible"),
])
def test_replication_errors_both_ways(local, code, remote, message):
    e = local(message)
    assert str(e) == message and code_of(e) == code
    # the prefix is added when the broker's message lacks it, so the client always recognises it
    bare = message.split(": ", 1)[1]
    assert str(local(bare)) == message
    back = error_of(code_of(e), str(e), "h:9")
    assert type(back) is remote and isinstance(back, local) and isinstance(back, MetaqError)
    assert back.details == message and back.code == code and back.address == "h:9"
    assert str(back) == f"broker h:9: {code.name}: {message}"  # the prefix not added twice


def test_unavailable_kinds_and_what_may_be_resent():
    assert isinstance(error_of(grpc.StatusCode.UNAVAILABLE, "not master: x", "h"), BrokerUnavailableError)
    not_acked = error_of(grpc.StatusCode.UNAVAILABLE, "not acknowledged: x", "h")
    assert isinstance(not_acked, BrokerUnavailableError) and not isinstance(not_acked, STORED_NOTHING)
    assert isinstance(error_of(grpc.StatusCode.FAILED_PRECONDITION, "not enough in-sync replicas: x", "h"),
                      STORED_NOTHING)
    assert isinstance(error_of(grpc.StatusCode.UNAVAILABLE, "not master: x", "h"), STORED_NOTHING)
    # other messages of the same codes keep their old kinds
    plain = error_of(grpc.StatusCode.UNAVAILABLE, "the broker is stopping", "h")
    assert type(plain) is BrokerUnavailableError
    assert type(error_of(grpc.StatusCode.FAILED_PRECONDITION, "partition t-0 is closed", "h")) is \
        RemotePartitionClosedError
