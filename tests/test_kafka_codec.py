"""The Kafka codec without sockets: every API's request and response round-trip at every version our tables
know; headers and correlation ids; unsupported versions answered in a layout the client reads (ApiVersions
v3/v4 included); hostile frames refused by name; the frame splitter; the error-code table.

Real clients' requests and their acceptance of our answers: tests/test_kafka_clients.py."""
from __future__ import annotations

import struct

import pytest

from metaq_broker import errors
from metaq_broker.protocol.kafka import codes
from metaq_broker.protocol.kafka.framing import FrameSplitter, FrameTooLargeError
from metaq_broker.protocol.kafka.messages import APIS, BY_NAME
from metaq_broker.protocol.kafka.protocol import (KafkaRequestError, api_versions_response, decode_response,
                                                  encode_request, encode_response, error_response, read_request)
from metaq_broker.protocol.kafka.schema import F, KafkaDecodeError, decode, encode
from metaq_broker.protocol.records import RecordFormatError

pytestmark = pytest.mark.unit

ALL_VERSIONS = [(a.key, v) for a in APIS.values() for v in range(a.known[0], a.known[1] + 1)]


def sample(fields, version, depth=0):
    """A value with every field of ``version`` set to something other than its default."""
    out = {}
    for i, f in enumerate(fields):
        if not f.has(version):
            continue
        t = f.type
        if t == "[]":
            out[f.name] = [sample(f.fields, version, depth + 1), sample(f.fields, version, depth + 1)]
        elif t == "{}":
            out[f.name] = sample(f.fields, version, depth + 1)
        elif t.startswith("[]"):
            out[f.name] = {"[]int32": [1, -2, 3], "[]int64": [7, 1 << 40], "[]string": ["a", "ü"]}[t]
        else:
            out[f.name] = {"bool": True, "int8": -3, "int16": 300 + i, "int32": 70000 + i, "int64": (1 << 40) + i,
                           "uint16": 65000, "float64": 0.5, "string": f"{f.name}-ü", "bytes": b"\x00\x01by",
                           "records": b"rec" * 3, "uuid": bytes(range(16))}[t]
    return out


@pytest.mark.parametrize("key,version", ALL_VERSIONS)
def test_every_request_and_response_round_trips(key, version):
    api = APIS[key]
    flexible = api.is_flexible(version)
    for fields in (api.request, api.response):
        value = sample(fields, version)
        data = encode(fields, version, flexible, value)
        back, _ = decode(fields, version, flexible, data)
        assert same(back, value), (api.name, version)
        assert encode(fields, version, flexible, back) == data


def same(got, want) -> bool:
    """``got`` has every value of ``want`` (decoded dicts also hold the defaults of other versions' fields)."""
    if isinstance(want, dict):
        return all(same(got[k], v) for k, v in want.items())
    if isinstance(want, list):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
    return (bytes(got) if isinstance(got, memoryview) else got) == want


def test_flexible_versions_use_compact_types_and_tagged_fields():
    fields = (F("name", "string", "0+"), F("ids", "[]int32", "0+"), F("extra", "int64", "1+", tag=0, tagged="1+",
                                                                       default=-1))
    assert encode(fields, 0, False, {"name": "ab", "ids": [1]}) == b"\x00\x02ab" + b"\x00\x00\x00\x01" + b"\x00\x00\x00\x01"
    assert encode(fields, 1, True, {"name": "ab", "ids": [1]}) == b"\x03ab" + b"\x02" + b"\x00\x00\x00\x01" + b"\x00"
    tagged = encode(fields, 1, True, {"name": "ab", "ids": [], "extra": 5})
    assert tagged == b"\x03ab\x01" + b"\x01" + b"\x00\x08" + struct.pack(">q", 5)
    assert decode(fields, 1, True, tagged)[0]["extra"] == 5
    # an unknown tag (a newer client's field) is skipped, as Kafka does
    assert decode(fields, 1, True, b"\x03ab\x01\x01\x07\x02zz")[0] == {"name": "ab", "ids": [], "extra": -1}


@pytest.mark.parametrize("data,problem", [
    (b"\x00\x05ab", "needs 5 bytes"),
    (b"\xff\xff\x00\x00\x00\x00", "not nullable"),
    (b"\x00\x02ab\x7f\xff\xff\xff", "entries declared"),  # a hostile array count: refused before allocating
    (b"\x00\x02\xff\xfe\x00\x00\x00\x00", "UTF-8"),
    (b"\x00\x02ab\x00\x00\x00\x00\x00", "left over"),
])
def test_malformed_bodies_are_refused_by_name(data, problem):
    fields = (F("name", "string", "0+"), F("ids", "[]int32", "0+"))
    with pytest.raises(KafkaDecodeError, match=problem):
        decode(fields, 0, False, data)


def test_request_header_and_correlation_id_echo():
    frame = encode_request(3, 12, 987654, "my-client", {"topics": [{"name": "t", "topic_id": bytes(16)}]})
    req = read_request(frame[4:])
    assert (req.api.name, req.api_version, req.correlation_id, req.client_id) == ("Metadata", 12, 987654, "my-client")
    assert req.body["topics"][0]["name"] == "t" and req.body["allow_auto_topic_creation"] is True
    out = b"".join(encode_response(req, {"brokers": [{"node_id": 1, "host": "h", "port": 9092}]}))
    assert struct.unpack(">i", out[:4])[0] == len(out) - 4
    assert struct.unpack(">i", out[4:8])[0] == 987654 and out[8] == 0  # response header v1: empty tagged fields
    cid, body = decode_response(3, 12, out[4:])
    assert cid == 987654 and body["brokers"][0]["host"] == "h"


def test_api_versions_always_answers_with_header_v0():
    req = read_request(encode_request(18, 4, 5, "c", {"client_software_name": "librdkafka",
                                                      "client_software_version": "2.16.1"})[4:])
    out = b"".join(encode_response(req, api_versions_response(req)))
    cid, body = decode_response(18, 4, out[4:])
    assert cid == 5 and body["error_code"] == 0
    rows = {r["api_key"]: (r["min_version"], r["max_version"]) for r in body["api_keys"]}
    assert rows == {a.key: a.advertised for a in APIS.values()}
    assert rows[0] == (0, 13) and rows[1] == (4, 18) and rows[18] == (0, 4)


def test_api_versions_refuses_a_bad_client_software_name():
    req = read_request(encode_request(18, 3, 5, "c", {"client_software_name": "bad name!",
                                                      "client_software_version": "1"})[4:])
    assert api_versions_response(req)["error_code"] == codes.INVALID_REQUEST


@pytest.mark.parametrize("version", [5, 100])
def test_api_versions_v3_plus_of_an_unknown_version_gets_v0_with_error_35_and_the_ranges(version):
    frame = encode_request(18, 4, 77, "future-client", {"client_software_name": "x", "client_software_version": "9"})
    frame = frame[:4] + struct.pack(">hhi", 18, version, 77) + frame[12:]
    with pytest.raises(KafkaRequestError, match=r"ApiVersions v%d .* serves ApiVersions v0 to v4" % version) as e:
        read_request(frame[4:])
    reply = b"".join(e.value.reply)
    cid, body = decode_response(18, 0, reply[4:])
    assert cid == 77 and body["error_code"] == codes.UNSUPPORTED_VERSION
    assert {r["api_key"]: r["max_version"] for r in body["api_keys"]}[18] == 4


@pytest.mark.parametrize("name,version", [("Produce", 2), ("Fetch", 3), ("ListOffsets", 0), ("OffsetCommit", 1),
                                          ("CreateTopics", 1), ("DeleteTopics", 0), ("OffsetForLeaderEpoch", 1),
                                          ("DescribeConfigs", 0), ("OffsetFetch", 0)])
def test_versions_kafka_4_removed_are_answered_in_their_own_layout(name, version):
    """KIP-896's removed versions: the body is decoded by our tables and every partition or topic it
    names is answered UNSUPPORTED_VERSION in that version's response layout."""
    api = BY_NAME[name]
    body = {"topic_data": [{"name": "t", "partition_data": [{"index": 3, "records": b""}]}],
            "topics": [{"name": "t", "topic": "t", "partitions": [{"partition": 3, "partition_index": 3}],
                        "partition_indexes": [3]}],
            "topic_names": ["t"], "resources": [{"resource_type": 2, "resource_name": "t"}]}
    with pytest.raises(KafkaRequestError, match=f"{name} v{version} .* not supported") as e:
        read_request(encode_request(api.key, version, 31, "old", body)[4:])
    assert e.value.kafka_code == codes.UNSUPPORTED_VERSION
    cid, answer = decode_response(api.key, version, b"".join(e.value.reply)[4:])
    assert cid == 31
    answer = {f.name: answer[f.name] for f in api.response if f.has(version)}  # not the other versions' defaults
    codes_found = []

    def walk(v):
        if isinstance(v, dict):
            for k, x in v.items():
                if k == "error_code":
                    codes_found.append(x)
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
    walk(answer)
    assert codes_found and set(codes_found) == {codes.UNSUPPORTED_VERSION}, answer


def test_unknown_api_key_and_future_versions_close_the_connection():
    with pytest.raises(KafkaRequestError, match="unknown API key 999") as e:
        read_request(struct.pack(">hhih", 999, 0, 1, -1))
    assert e.value.reply is None
    with pytest.raises(KafkaRequestError, match="Produce v14 .* v3 to v13") as e:
        read_request(struct.pack(">hhih", 0, 14, 1, -1) + b"\x00")
    assert e.value.reply is None


@pytest.mark.parametrize("frame,problem", [
    (b"\x00\x03", "shorter than a request header"),
    (struct.pack(">hhih", 3, 12, 1, 50) + b"ab", "client_id"),
    (struct.pack(">hhih", 3, 12, 1, -1) + b"\x00" + b"\xff\xff\xff\xff\xff\xff", "malformed"),
])
def test_hostile_request_frames_are_refused_by_name(frame, problem):
    with pytest.raises(KafkaRequestError, match=problem) as e:
        read_request(frame)
    assert e.value.reply is None


def test_bytes_after_a_request_body_are_ignored_as_kafka_ignores_them():
    """librdkafka 2.16's Metadata v13 asking for every topic, as sent (AdminClient.list_topics()): three bytes
    more than the schema's. Refused, librdkafka's client lost its connection and list_topics() failed."""
    frame = bytes.fromhex("0003000d00000003000772646b61666b610000000000010000")
    request = read_request(frame)
    assert (request.api.name, request.api_version, request.client_id) == ("Metadata", 13, "rdkafka")
    assert request.body["topics"] is None and request.body["allow_auto_topic_creation"] is False


def test_acks_0_produce_expects_no_response():
    body = {"acks": 0, "timeout_ms": 1000, "topic_data": []}
    assert not read_request(encode_request(0, 9, 1, "c", body)[4:]).expects_response
    assert read_request(encode_request(0, 9, 1, "c", {**body, "acks": -1})[4:]).expects_response


def test_error_response_names_every_partition():
    body = {"acks": -1, "timeout_ms": 1000, "topic_data": [
        {"name": "a", "partition_data": [{"index": 0, "records": None}, {"index": 5, "records": None}]}]}
    req = read_request(encode_request(0, 11, 1, "c", body)[4:])
    resp = error_response(req, codes.TOPIC_AUTHORIZATION_FAILED, "User:bob may not Write topic 'a'")
    parts = resp["responses"][0]["partition_responses"]
    assert [(p["index"], p["error_code"]) for p in parts] == [(0, 29), (5, 29)]
    _, back = decode_response(0, 11, b"".join(encode_response(req, resp))[4:])
    assert back["responses"][0]["partition_responses"][1]["error_message"] == "User:bob may not Write topic 'a'"


# ---------------------------------------------------------------------------------------------------
# Framing


def test_frame_splitter_is_incremental_and_keeps_frames_valid():
    frames = [b"a" * n for n in (0, 1, 5, 300)]
    stream = b"".join(struct.pack(">i", len(f)) + f for f in frames)
    for step in (1, 3, 7, len(stream)):
        s, got = FrameSplitter(1000), []
        for i in range(0, len(stream), step):
            got += s.feed(stream[i:i + step])
        assert [bytes(g) for g in got] == frames and s.buffered == 0


@pytest.mark.parametrize("size", [1001, 1 << 30, -5])
def test_frame_splitter_refuses_huge_or_negative_sizes_before_buffering(size):
    s = FrameSplitter(1000)
    with pytest.raises(FrameTooLargeError, match=str(size)) as e:
        s.feed(struct.pack(">i", size) + b"x" * 10)
    assert e.value.size == size and e.value.cap == 1000


def test_frame_splitter_holds_back_only_a_partial_frame():
    s = FrameSplitter(100)
    assert s.feed(struct.pack(">i", 100) + b"x" * 99) == []
    assert s.buffered == 103
    assert [bytes(f) for f in s.feed(b"y")] == [b"x" * 99 + b"y"] and s.buffered == 0


def test_frame_splitter_reads_a_sized_frame_straight_into_its_buffer_and_grows_a_huge_one():
    s = FrameSplitter(1 << 30)
    frames = [b"p" * 10, b"q" * 5000, b"r" * 3]
    stream = b"".join(struct.pack(">i", len(f)) + f for f in frames)
    got = s.feed(stream[:24])  # the first frame whole, 6 bytes of the second: sized now
    assert [bytes(g) for g in got] == [frames[0]] and s.buffered == 10
    room = s.room()
    assert len(room) == 4994
    room[:1000] = stream[24:1024]
    assert s.received(1000) == [] and s.buffered == 1010
    got = s.feed(stream[1024:])  # the second's rest copied into it, the third parsed after it
    assert [bytes(g) for g in got] == frames[1:] and s.buffered == 0 and s.room() is None
    # a size declared alone, over PRESIZE_MAX: nothing allocated ahead of its bytes
    assert s.feed(struct.pack(">i", FrameSplitter.PRESIZE_MAX + 1) + b"z") == []
    assert s.room() is None and s.buffered == 5
    assert [len(f) for f in s.feed(b"z" * FrameSplitter.PRESIZE_MAX)] == [FrameSplitter.PRESIZE_MAX + 1]


# ---------------------------------------------------------------------------------------------------
# Error codes


@pytest.mark.parametrize("exc,code", [
    (errors.UnknownTopicError("t"), codes.UNKNOWN_TOPIC_OR_PARTITION),
    (errors.InvalidPartitionError("p"), codes.UNKNOWN_TOPIC_OR_PARTITION),
    (errors.NotMasterError("x"), codes.NOT_LEADER_OR_FOLLOWER),
    (errors.StoreClosedError("x"), codes.NOT_LEADER_OR_FOLLOWER),
    (errors.NotEnoughReplicasError("x"), codes.NOT_ENOUGH_REPLICAS),
    (errors.NotAcknowledgedError("x"), codes.NOT_ENOUGH_REPLICAS_AFTER_APPEND),
    (errors.AuthorizationError("User:a", "Write", "topic", "t"), codes.TOPIC_AUTHORIZATION_FAILED),
    (errors.AuthorizationError("User:a", "Read", "group", "g"), codes.GROUP_AUTHORIZATION_FAILED),
    (errors.AuthorizationError("User:a", "Create", "cluster", "kafka-cluster"), codes.CLUSTER_AUTHORIZATION_FAILED),
    (errors.AuthenticationError("bad password"), codes.SASL_AUTHENTICATION_FAILED),
    (errors.OffsetOutOfRangeError("t-0", 9, 0, 5), codes.OFFSET_OUT_OF_RANGE),
    (errors.MessageTooLargeError("big"), codes.MESSAGE_TOO_LARGE),
    (RecordFormatError("crc", 0), codes.CORRUPT_MESSAGE),
    (errors.InvalidMessageError("null"), codes.INVALID_RECORD),
    (errors.DiskFullError("full"), codes.KAFKA_STORAGE_ERROR),
    (errors.PartitionClosedError("closed"), codes.POLICY_VIOLATION),
    (errors.TransactionError("state"), codes.INVALID_TXN_STATE),
    (errors.ConfigError("k"), codes.INVALID_CONFIG),
    (KeyError("surprise"), codes.UNKNOWN_SERVER_ERROR),
])
def test_metaq_errors_map_to_kafka_codes(exc, code):
    assert codes.code_of(exc) == code


def test_idempotence_refusals_map_by_class_name_until_importable():
    for name, code in [("OutOfOrderSequenceError", 45), ("DuplicateSequenceError", 46),
                       ("ProducerFencedError", 47), ("UnknownProducerIdError", 59)]:
        assert codes.code_of(type(name, (errors.MetaqError,), {})("x")) == code
    assert codes.name_of(35) == "UNSUPPORTED_VERSION" and codes.name_of(12345) == "error 12345"
