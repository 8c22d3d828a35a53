"""Kafka requests in, responses out: headers, bodies by schema, and the answers to versions not served.

``read_request(frame)`` parses one request frame (the bytes after its size prefix: ``framing.py`` splits a
stream into frames) into a ``Request``; ``encode_response(request, body)`` gives the buffers of its answer,
size prefix and header included, with the request's correlation id. Request header v1 (api key, version,
correlation id, client id) is used by non-flexible versions, v2 (the same, then tagged fields) by flexible
ones; response header v0 (correlation id) and v1 (then tagged fields) likewise, except that ApiVersions is
always answered with header v0, so a client that does not yet know our versions can read it.

A request that cannot be served raises ``KafkaRequestError`` with ``reply``: the bytes to answer (an
UNSUPPORTED_VERSION response in the layout of the version asked for, or for ApiVersions the v0 answer with
error 35 and our ranges, KIP-511), or None where no client could read an answer (an unknown API key, a
version newer than any we know, malformed bytes), and the connection is closed, as Kafka does.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Optional

from metaq_broker.errors import MetaqError
from metaq_broker.protocol.kafka import codes
from metaq_broker.protocol.kafka.messages import APIS, Api
from metaq_broker.protocol.kafka.schema import KafkaDecodeError, Reader, decode, encode_parts

API_VERSIONS = 18
PRODUCE = 0
_HEADER = struct.Struct(">hhi")
_SIZE = struct.Struct(">i")
# KIP-511: what ApiVersions v3+ accepts as a client's software name and version
_SOFTWARE = re.compile(r"[a-zA-Z0-9](?:[a-zA-Z0-9\-.]*[a-zA-Z0-9])?")


@dataclass
class Request:
    """One parsed request. ``body`` is a dict of the API's request fields (defaults filled in)."""

    api: Api
    api_version: int
    correlation_id: int
    client_id: Optional[str]
    body: dict

    @property
    def api_key(self) -> int:
        return self.api.key

    @property
    def expects_response(self) -> bool:
        """False for a Produce with acks=0: Kafka sends nothing back for it."""
        return not (self.api.key == PRODUCE and self.body.get("acks") == 0)


class KafkaRequestError(MetaqError):
    """A request this broker cannot serve; ``reply`` is the answer to send (None: close the connection)."""

    def __init__(self, message: str, correlation_id: Optional[int] = None, reply: Optional[list] = None,
                 code: int = codes.INVALID_REQUEST):
        super().__init__(message)
        self.correlation_id, self.reply, self.kafka_code = correlation_id, reply, code


def _header(frame) -> tuple[int, int, int, Optional[str], Reader]:
    r = Reader(frame)
    if len(r.buf) < _HEADER.size + 2:
        raise KafkaRequestError(f"a request of {len(r.buf)} bytes is shorter than a request header")
    api_key, version, correlation_id = _HEADER.unpack_from(r.buf, 0)
    r.pos = _HEADER.size
    n = struct.unpack_from(">h", r.buf, r.pos)[0]
    r.pos += 2
    client_id = None
    if n >= 0:
        try:
            client_id = str(r.take(n, "client_id"), "utf-8")
        except (KafkaDecodeError, UnicodeDecodeError) as e:
            raise KafkaRequestError(f"request header: bad client_id: {e}", correlation_id) from None
    elif n != -1:
        raise KafkaRequestError(f"request header: client_id length {n}", correlation_id)
    return api_key, version, correlation_id, client_id, r


def read_request(frame) -> Request:
    """Parse one request frame; raises KafkaRequestError naming what is wrong (see the module doc)."""
    api_key, version, correlation_id, client_id, r = _header(frame)
    api = APIS.get(api_key)
    if api is None:
        raise KafkaRequestError(f"unknown API key {api_key} (version {version}, client {client_id!r}): "
                                f"this broker serves {', '.join(sorted(a.name for a in APIS.values()))}",
                                correlation_id, code=codes.UNSUPPORTED_VERSION)
    if not api.serves(version) and (api.key == API_VERSIONS or not api.knows(version)):
        reply = None
        if api.key == API_VERSIONS:  # KIP-511: answer in v0 with the ranges, so the client can retry
            reply = _encode(api, 0, correlation_id, api_versions_body(codes.UNSUPPORTED_VERSION))
        raise KafkaRequestError(_unsupported(api, version, client_id), correlation_id, reply,
                                codes.UNSUPPORTED_VERSION)
    flexible = api.is_flexible(version)
    try:
        if flexible:  # request header v2: tagged fields after the client id (none defined: skipped)
            for _ in range(r.uvarint("header tagged fields")):
                r.uvarint("tag")
                r.take(r.uvarint("tag size"), "header tagged field")
        # Bytes after the body are ignored, as Kafka's broker ignores them: librdkafka 2.16's Metadata v13 for
        # every topic ends with three more bytes than the schema has, and Kafka answers it
        body, _ = decode(api.request, version, flexible, r.buf, r.pos, whole=False)
    except KafkaDecodeError as e:
        raise KafkaRequestError(f"{api.name} v{version} request from {client_id!r} is malformed: {e}",
                                correlation_id) from None
    request = Request(api, version, correlation_id, client_id, body)
    if not api.serves(version):
        raise KafkaRequestError(_unsupported(api, version, client_id), correlation_id,
                                encode_response(request, error_response(request, codes.UNSUPPORTED_VERSION)),
                                codes.UNSUPPORTED_VERSION)
    return request


def _unsupported(api: Api, version: int, client_id) -> str:
    lo, hi = api.supported
    return (f"{api.name} v{version} (client {client_id!r}) is not supported: this broker serves "
            f"{api.name} v{lo} to v{hi}")


def _encode(api: Api, version: int, correlation_id: int, body: dict) -> list:
    header_v1 = api.is_flexible(version) and api.key != API_VERSIONS
    parts = encode_parts(api.response, version, api.is_flexible(version), body)
    head = _SIZE.pack(correlation_id) + (b"\x00" if header_v1 else b"")
    size = len(head) + sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
    return [_SIZE.pack(size) + head] + parts


def encode_response(request: Request, body: dict) -> list:
    """The buffers of the answer to ``request``: size prefix, response header, body (write them in order;
    record bytes stay the views they were given)."""
    return _encode(request.api, request.api_version, request.correlation_id, body)


def encode_request(api_key: int, version: int, correlation_id: int, client_id: Optional[str], body: dict) -> bytes:
    """A request frame with its size prefix, as a client sends it (tests and tools)."""
    api = APIS[api_key]
    flexible = api.is_flexible(version)
    cid = client_id.encode() if client_id is not None else None
    head = _HEADER.pack(api_key, version, correlation_id) + (struct.pack(">h", -1) if cid is None
                                                              else struct.pack(">h", len(cid)) + cid)
    if flexible:
        head += b"\x00"
    data = head + b"".join(encode_parts(api.request, version, flexible, body))
    return _SIZE.pack(len(data)) + data


def decode_response(api_key: int, version: int, frame) -> tuple[int, dict]:
    """(correlation id, body) of a response frame without its size prefix (tests and tools)."""
    api = APIS[api_key]
    flexible = api.is_flexible(version)
    correlation_id = _SIZE.unpack_from(frame, 0)[0]
    r = Reader(frame, 4)
    if flexible and api_key != API_VERSIONS:
        for _ in range(r.uvarint("header tagged fields")):
            r.uvarint("tag")
            r.take(r.uvarint("tag size"), "header tagged field")
    return correlation_id, decode(api.response, version, flexible, r.buf, r.pos)[0]


# ---------------------------------------------------------------------------------------------------
# Answers a broker gives without asking its store


def api_versions_body(error_code: int = codes.NONE) -> dict:
    """The ApiVersions answer: every API served with the versions advertised (``messages.APIS``)."""
    return {"error_code": error_code, "throttle_time_ms": 0,
            "api_keys": [{"api_key": a.key, "min_version": a.advertised[0], "max_version": a.advertised[1]}
                         for a in sorted(APIS.values(), key=lambda a: a.key)]}


def api_versions_response(request: Request) -> dict:
    """ApiVersions for a request of a served version: INVALID_REQUEST for a bad client software name or
    version (KIP-511), the ranges otherwise."""
    body = request.body
    if request.api_version >= 3 and not (_SOFTWARE.fullmatch(body["client_software_name"] or "")
                                         and _SOFTWARE.fullmatch(body["client_software_version"] or "")):
        return {"error_code": codes.INVALID_REQUEST, "api_keys": []}
    return api_versions_body()


def _echo_partitions(topics, topic_keys, partitions_in, partition_key, partitions_out, partition_out_key, extra):
    out = []
    for t in topics or ():
        entry = {k: t.get(k) for k in topic_keys if k in t}
        entry[partitions_out] = [{partition_out_key: p[partition_key] if isinstance(p, dict) else p, **extra}
                                 for p in t.get(partitions_in) or ()]
        out.append(entry)
    return out


def error_response(request: Request, code: int, message: Optional[str] = None) -> dict:
    """A response to ``request`` saying ``code`` for everything it asked (every topic, partition, group or
    resource it named, and the top-level error where the version has one), as Kafka's getErrorResponse."""
    b, key = request.body, request.api.key
    err = {"error_code": code}
    msg = {"error_code": code, "error_message": message}
    body = {"error_code": code, "error_message": message}
    if key == 0:  # Produce
        body["responses"] = _echo_partitions(b["topic_data"], ("name", "topic_id"), "partition_data", "index",
                                             "partition_responses", "index",
                                             {**msg, "base_offset": -1, "log_append_time_ms": -1, "log_start_offset": -1})
    elif key == 1:  # Fetch
        body["responses"] = _echo_partitions(b["topics"], ("topic", "topic_id"), "partitions", "partition",
                                             "partitions", "partition_index",
                                             {**err, "high_watermark": -1, "last_stable_offset": -1,
                                              "log_start_offset": -1})
    elif key == 2:  # ListOffsets
        body["topics"] = _echo_partitions(b["topics"], ("name",), "partitions", "partition_index", "partitions",
                                          "partition_index", {**err, "timestamp": -1, "offset": -1})
    elif key == 3:  # Metadata
        body["topics"] = [{"name": t["name"], "topic_id": t["topic_id"], **err} for t in b["topics"] or ()]
    elif key == 8:  # OffsetCommit
        body["topics"] = _echo_partitions(b["topics"], ("name", "topic_id"), "partitions", "partition_index",
                                          "partitions", "partition_index", err)
    elif key == 9:  # OffsetFetch
        body["topics"] = _echo_partitions(b["topics"], ("name",), "partition_indexes", None, "partitions",
                                          "partition_index", {**err, "committed_offset": -1, "metadata": None}) \
            if request.api_version < 2 else []
        body["groups"] = [{"group_id": g["group_id"], **err} for g in b["groups"]]
    elif key == 23:  # OffsetForLeaderEpoch
        body["topics"] = _echo_partitions(b["topics"], ("topic",), "partitions", "partition", "partitions",
                                          "partition", {**err, "leader_epoch": -1, "end_offset": -1})
    elif key == 19:  # CreateTopics
        body["topics"] = [{"name": t["name"], **msg} for t in b["topics"]]
    elif key == 20:  # DeleteTopics
        named = [{"name": n} for n in b["topic_names"]] + [{"name": t["name"], "topic_id": t["topic_id"]}
                                                           for t in b["topics"]]
        body["responses"] = [{**t, **msg} for t in named]
    elif key == 37:  # CreatePartitions
        body["results"] = [{"name": t["name"], **msg} for t in b["topics"]]
    elif key == 32:  # DescribeConfigs
        body["results"] = [{"resource_type": r["resource_type"], "resource_name": r["resource_name"], **msg}
                           for r in b["resources"]]
    elif key == 42:  # DeleteGroups
        body["results"] = [{"group_id": g, **err} for g in b["groups_names"]]
    elif key == 15:  # DescribeGroups
        body["groups"] = [{"group_id": g, **msg} for g in b["groups"]]
    elif key == 10 and request.api_version >= 4:  # FindCoordinator, several keys
        body["coordinators"] = [{"key": k, "node_id": -1, "port": -1, **msg} for k in b["coordinator_keys"]]
    elif key == API_VERSIONS:
        body = api_versions_body(code)
    return body
