"""Fuzzing every gRPC method of real broker processes with hypothesis: request bytes that are valid,
mutated or garbage, to a PLAINTEXT broker (everything allowed, so the checks behind the ACLs are reached)
and to a SASL_SSL broker with ACLs (with and without a session). Invariants: each call ends with a status
within seconds (never a hang), never INTERNAL from the broker's own code (only a request gRPC could not
deserialize is INTERNAL, as gRPC words it), the broker never dies, and a refused put stores nothing."""
import json

import grpc
import pytest
from fuzzing import bodies, fuzz_settings, mutated
from hypothesis import given
from hypothesis import strategies as st

from metaq_broker.client import Admin
from metaq_broker.client.connection import BrokerConnection
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.protocol import rawfetch, rawput
from metaq_broker.protocol.services import AUTH_PATH, COMMIT_OFFSETS, FETCH_OFFSETS, groups_path
from metaq_broker.security.acl import Acl
from metaq_broker.security.settings import ClientSecurity, read_pem

CALL_TIMEOUT_S = 20.0


def valid_requests(draw) -> dict:
    """A valid request per method path, for the mutations to start from."""
    body = draw(bodies())
    xid = draw(st.sampled_from(["", "s/1/r/0-0", "x"]))
    coordinator = draw(st.sampled_from(["", '{"path": "/fz/sinks/s/batches/00000000000000000001", "run": "r"}',
                                        '{"path": "/a/../b", "run": "r"}', "{"]))
    topic = draw(st.sampled_from(["t", "nope", ""]))
    put = pb.PutRequest(topic=topic, partition=draw(st.integers(-2, 2)), xid=xid, batch=pb.MessageBatch(
        count=body.count, attributes=body.attributes, body=b"".join(bytes(p) for p in body.parts), body_crc=body.crc))
    fetch = pb.FetchRequest(topic=topic, partition=draw(st.integers(-2, 2)), offset=draw(st.integers(-5, 50)),
                            max_bytes=draw(st.integers(-1, 1 << 20)), max_wait_ms=draw(st.integers(0, 200)))
    base = "/metaq.v1.Broker/"
    return {
        base + "Put": put.SerializeToString(),
        base + "Fetch": fetch.SerializeToString(),
        rawfetch.PATH: fetch.SerializeToString(),
        rawput.PATH: rawput.pack(topic, put.partition, xid, body.count, body.attributes, body.crc, body.parts),
        base + "GetOffsets": pb.GetOffsetsRequest(queries=[pb.OffsetQuery(
            topic=topic, partition=draw(st.integers(-2, 2)), timestamp_ms=draw(st.integers(-1, 2 ** 62)))])
        .SerializeToString(),
        base + "ListTopics": b"",
        base + "DescribeTopic": pb.TopicRequest(topic=topic).SerializeToString(),
        base + "CreateTopic": pb.CreateTopicRequest(topic=draw(st.sampled_from(["t", "fz", "a/b", "..", ""])),
                                                    num_partitions=draw(st.integers(-1, 3)),
                                                    config=draw(st.dictionaries(
                                                        st.sampled_from(["maxMessageSize", "numPartitions", "x"]),
                                                        st.sampled_from(["1", "-1", "abc", "99999999999"]),
                                                        max_size=2))).SerializeToString(),
        base + "ClosePartitions": pb.PartitionRangeRequest(topic=topic, start=draw(st.integers(-1, 2)),
                                                           end=draw(st.integers(-1, 2))).SerializeToString(),
        base + "OpenPartitions": pb.TopicRequest(topic=topic).SerializeToString(),
        base + "Stats": pb.StatsRequest(topic=topic).SerializeToString(),
        base + "BeginTransaction": pb.BeginTransactionRequest(xid=xid, timeout_ms=draw(st.integers(-1, 5000)),
                                                              coordinator=coordinator).SerializeToString(),
        base + "PrepareTransaction": pb.TransactionRequest(xid=xid).SerializeToString(),
        base + "CommitTransaction": pb.TransactionRequest(xid=xid).SerializeToString(),
        base + "RollbackTransaction": pb.TransactionRequest(xid=xid).SerializeToString(),
        base + "RecoverTransactions": b"",
        base + "DescribeGroup": b"",
        AUTH_PATH: json.dumps({"mechanism": draw(st.sampled_from(["PLAIN", "SCRAM-SHA-256", "X"])),
                               "message": draw(st.sampled_from(["\0alice\0alice-pw", "n,,n=alice,r=abc", "", "\0"])),
                               **draw(st.sampled_from([{}, {"handshake": "h"}]))}).encode(),
        groups_path(COMMIT_OFFSETS): json.dumps({"group": "g", "topic": topic, "offsets": draw(st.dictionaries(
            st.sampled_from(["1-0", "2-0", "1-9", "x", "-1"]), st.integers(-1, 10), max_size=3))}).encode(),
        groups_path(FETCH_OFFSETS): json.dumps({"group": draw(st.sampled_from(["g", "", "a/b"])),
                                                "topic": topic}).encode(),
    }


@st.composite
def calls(draw) -> tuple:
    requests = valid_requests(draw)
    path = draw(st.sampled_from(sorted(requests)))
    request = draw(st.one_of(st.just(requests[path]), mutated(requests[path]), st.binary(max_size=256)))
    return path, request


@pytest.fixture(scope="module")
def brokers(tmp_path_factory, zookeeper, pki):
    from test_security import Brokers
    bs = Brokers.made(tmp_path_factory, zookeeper, "fuzz-grpc", users={"alice": "alice-pw"},
                      acls=[Acl("User:alice", "Allow", "All", "topic", "t"),
                            Acl("User:alice", "Allow", "Read", "group", "g"),
                            Acl("User:alice", "Allow", "Write", "sink", "s")])
    topics = {"t": {"numPartitions": 1, "maxMessageSize": 1000}}
    plain = bs.start("plain", 1, {"maxFetchWait": 100, "transactionTimeout": 2000}, topics=topics)
    sasl = bs.start("sasl", 2, {"maxFetchWait": 100, "transactionTimeout": 2000, "security.protocol": "SASL_SSL",
                                "authorizer": "acl", "ssl.certificate.location": pki.broker.cert,
                                "ssl.key.location": pki.broker.key, "ssl.ca.location": pki.ca}, topics=topics)
    secure = ClientSecurity.from_properties({"security.protocol": "SASL_SSL", "ssl.ca.location": pki.ca,
                                             "sasl.username": "alice", "sasl.password": "alice-pw"})
    conn = BrokerConnection(sasl.address, 10, secure)
    yield {"plain": (plain, None, None, None),
           "sasl": (sasl, secure, conn.session_token(), grpc.ssl_channel_credentials(read_pem("ca", pki.ca)))}
    conn.close()
    bs.stop()


def stored(admin, broker) -> int:
    """Messages the broker stored in topic t by puts (its put counter: transactions' puts included)."""
    return sum(p.put_messages for p in admin.stats(broker.broker_id, "t").partitions)


@pytest.mark.parametrize("which", ["plain", "sasl"])
def test_hostile_requests_get_a_status_and_nothing_refused_is_stored(brokers, which):
    broker, sec, token, creds = brokers[which]
    channel = (grpc.secure_channel(broker.address, creds) if creds else grpc.insecure_channel(broker.address))
    admin = Admin(brokers=f"{broker.broker_id}={broker.address}", security=sec)
    before = [stored(admin, broker)]
    seen: dict = {}

    @fuzz_settings(short=300)
    @given(calls(), st.booleans())
    def one(call, with_session):
        path, request = call
        metadata = (("metaq-session", token),) if token and with_session else ()
        added = 0
        try:
            reply = channel.unary_unary(path)(request, timeout=CALL_TIMEOUT_S, metadata=metadata)
            code = grpc.StatusCode.OK
            if path in ("/metaq.v1.Broker/Put", rawput.PATH):
                added = pb.PutResponse.FromString(reply).count
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{path} did not answer in {CALL_TIMEOUT_S}s"
            assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) or \
                "deserializ" in details.lower(), f"{path}: {code.name}: {details}"
        seen[code.name] = seen.get(code.name, 0) + 1
        if path in ("/metaq.v1.Broker/Put", rawput.PATH):  # only a put stores messages
            now = stored(admin, broker)
            assert now - before[0] == added, f"{path} answered {code.name}, storing {added}, yet {now - before[0]} were"
            before[0] = now
        assert broker.proc.poll() is None, "the broker died"

    try:
        one()
    finally:
        admin.close()
        channel.close()
    print(f"{which}: {sum(seen.values())} hostile calls: {seen}")
    log = broker.log_path.read_text()
    assert "Traceback" not in log, log[log.index("Traceback"):][:2000]
