"""A MetaQ 1.4-style client for tests, written from the protocol description (seed notes §2.2 and
shared/reference/metaq-1.4-clients.md), not from metaq's code: it imports nothing of ``metaq_broker``,
so it checks metaq's MetaQ listener the way a real MetaQ client would, not against metaq's own idea of
the protocol.

What it does, as a MetaQ 1.4 client does: finds brokers and partition counts in ZooKeeper
(``topics-pub``/``topics-sub`` JSON, ``ids/<id>/master`` URIs), produces with ``put`` (7 tokens with
``CRC32 & 0x7FFFFFFF`` or -1; 6 tokens as clients before 1.4.4; 8 tokens in a transaction), runs local
(``TX:``) and XA (``XID:``) transactions, consumes as a group (range balancing over the sorted
partitions, ``owners`` nodes), counts offsets in bytes of whole messages, follows ``301``, waits on
``404``/``403``, doubles ``maxSize`` up to 2 MiB when no whole message fits and shrinks it back after,
and commits ``<msgId>-<offset>``.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import socket
import struct
import uuid
import zlib
from dataclasses import dataclass
from typing import Optional

from kazoo.exceptions import NodeExistsError

MAX_READ_BUFFER = 2 * 1024 * 1024  # MetaQ's MAX_READ_BUFFER_SIZE: the cap of a doubled maxSize
HEADER = struct.Struct(">iIqi")


class MetaqReplyError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


@dataclass
class Reply:
    kind: str  # "result" or "value"
    code: int  # 200 for a value reply
    opaque: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8")


class Connection:
    """One TCP connection speaking the text protocol; requests may be pipelined (``send`` several, then
    ``read_reply`` each: replies come in order, each with its request's opaque)."""

    def __init__(self, host: str, port: int, timeout: float = 10.0):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self._buf = b""
        self._opaques = itertools.count(1)

    def send(self, tokens, body: bytes = b"", opaque: Optional[int] = None) -> int:
        opaque = next(self._opaques) if opaque is None else opaque
        line = " ".join(str(t) for t in tokens) + f" {opaque}\r\n"
        self.sock.sendall(line.encode() + body)
        return opaque

    def _read_exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the broker closed the connection")
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def read_reply(self) -> Reply:
        while b"\r\n" not in self._buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the broker closed the connection")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\r\n", 1)
        t = line.decode().split(" ")
        if t[0] == "result":
            return Reply("result", int(t[1]), int(t[3]), self._read_exactly(int(t[2])))
        if t[0] == "value":
            return Reply("value", 200, int(t[2]), self._read_exactly(int(t[1])))
        raise ConnectionError(f"unexpected reply line {line!r}")

    def call(self, tokens, body: bytes = b"") -> Reply:
        opaque = self.send(tokens, body)
        reply = self.read_reply()
        assert reply.opaque == opaque, f"reply for opaque {reply.opaque}, expected {opaque}"
        return reply

    def ok(self, tokens, body: bytes = b"") -> str:
        reply = self.call(tokens, body)
        if reply.code != 200:
            raise MetaqReplyError(reply.code, reply.text)
        return reply.text

    def version(self) -> str:
        return self.ok(["version"])

    def close(self) -> None:
        try:
            self.sock.sendall(b"quit\r\n")
        except OSError:
            pass
        self.sock.close()


def checksum(data: bytes) -> int:
    return zlib.crc32(data) & 0x7FFFFFFF


def message_data(value: bytes, attribute: Optional[str]) -> tuple:
    """(flag bit 0, data) of a message: with an attribute, its i32 length and UTF-8 bytes come first."""
    if attribute is None:
        return 0, value
    a = attribute.encode("utf-8")
    return 1, struct.pack(">i", len(a)) + a + value


@dataclass
class Message:
    msg_id: int
    flag: int
    value: bytes
    attribute: Optional[str]
    offset: int  # its byte position in the partition


def decode_messages(buf: bytes, position: int) -> tuple:
    """The whole messages of a ``value`` reply read at ``position``, and the bytes they take; a
    partial trailing message is left. Every checksum is verified."""
    out, pos = [], 0
    while len(buf) - pos >= HEADER.size:
        length, crc, msg_id, flag = HEADER.unpack_from(buf, pos)
        end = pos + HEADER.size + length
        if length < 0 or end > len(buf):
            break
        data = buf[pos + HEADER.size: end]
        if zlib.crc32(data) != crc:
            raise ValueError(f"checksum mismatch in the message at position {position + pos}")
        attribute = None
        if flag & 1:
            n = struct.unpack(">i", data[:4])[0]
            attribute, data = data[4:4 + n].decode("utf-8"), data[4 + n:]
        out.append(Message(msg_id, flag, data, attribute, position + pos))
        pos = end
    return out, pos


# ---------------------------------------------------------------------------------------------------
# The cluster as ZooKeeper shows it


class Cluster:
    """Reads MetaQ's layout under ``root`` with a kazoo client the caller owns."""

    def __init__(self, zk, root: str = "/meta"):
        self.zk, self.root = zk, root.rstrip("/")
        self._conns: dict = {}

    def partitions(self, topic: str, kind: str = "pub") -> list:
        """Sorted ``(brokerId, n)`` of the topic, from ``topics-pub`` (producers) or ``topics-sub``."""
        base = f"{self.root}/brokers/topics-{kind}/{topic}"
        out = []
        for child in self.zk.get_children(base):
            if not child.endswith("-m"):
                continue  # a slave's entry
            entry = json.loads(self.zk.get(f"{base}/{child}")[0])
            broker = int(entry["broker"].split("-")[0])
            out += [(broker, n) for n in range(int(entry["numParts"]))]
        return sorted(out)

    def address(self, broker_id: int) -> tuple:
        uri = self.zk.get(f"{self.root}/brokers/ids/{broker_id}/master")[0].decode()
        assert uri.startswith("meta://"), uri
        host, _, port = uri[len("meta://"):].rpartition(":")
        return host.strip("[]"), int(port)

    def connection(self, broker_id: int) -> Connection:
        if broker_id not in self._conns:
            self._conns[broker_id] = Connection(*self.address(broker_id))
        return self._conns[broker_id]

    def close(self) -> None:
        for c in self._conns.values():
            c.close()
        self._conns.clear()


# ---------------------------------------------------------------------------------------------------
# Producing and transactions


@dataclass
class SendResult:
    msg_id: int
    partition: str
    offset: int


class Producer:
    def __init__(self, cluster: Cluster, topic: str, use_checksum: bool = True, legacy: bool = False):
        """``legacy``: 6-token puts, as clients before 1.4.4 send them (no checksum)."""
        self.cluster, self.topic, self.use_checksum, self.legacy = cluster, topic, use_checksum, legacy

    def send(self, value: bytes, partition: Optional[tuple] = None, attribute: Optional[str] = None,
             flag: int = 0, tx: Optional[str] = None) -> SendResult:
        broker, n = partition or random.choice(self.cluster.partitions(self.topic))
        bit, data = message_data(value, attribute)
        tokens = ["put", self.topic, n, len(data), flag | bit]
        if not self.legacy:
            tokens.append(checksum(data) if self.use_checksum else -1)
        if tx is not None:
            tokens.append(tx)
        msg_id, part, offset = self.cluster.connection(broker).ok(tokens, data).split(" ")
        return SendResult(int(msg_id), f"{broker}-{part}", int(offset))


class LocalTransaction:
    """``TX:<sessionId>:<n>``: begin, puts carrying the key, then commit (one phase) or roll back."""
    _numbers = itertools.count(1)

    def __init__(self, producer: Producer, broker_id: int, session_id: Optional[str] = None):
        self.producer, self.broker = producer, broker_id
        self.session = session_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.key = f"TX:{self.session}:{next(self._numbers)}"

    def _tx(self, kind: str, *extra) -> str:
        return self.producer.cluster.connection(self.broker).ok(["transaction", self.key, self.session, kind, *extra])

    def begin(self, timeout: int = 0) -> None:
        self._tx("BEGIN", timeout) if timeout else self._tx("BEGIN")

    def send(self, value: bytes, n: int, **kw) -> SendResult:
        return self.producer.send(value, (self.broker, n), tx=self.key, **kw)

    def commit(self) -> None:
        self._tx("COMMIT_ONE_PHASE")

    def rollback(self) -> None:
        self._tx("ROLLBACK")


class XaBranch:
    """``XID:<formatId>:<gtid>:<bqual>:<uniqueQualifier>``: begin, puts, end, prepare, then the
    coordinator's commit (two phase) or roll back; ``recover`` lists the prepared branches."""

    def __init__(self, producer: Producer, broker_id: int, gtid: bytes, bqual: bytes = b"\x01",
                 unique_qualifier: str = "test-rm", format_id: int = 1):
        self.producer, self.broker, self.qualifier = producer, broker_id, unique_qualifier
        self.session = f"xa-{uuid.uuid4().hex[:8]}"
        self.key = f"XID:{format_id}:{gtid.hex()}:{bqual.hex()}:{unique_qualifier}"

    def _tx(self, kind: str, *extra) -> str:
        return self.producer.cluster.connection(self.broker).ok(["transaction", self.key, self.session, kind, *extra])

    def begin(self, timeout: int = 60) -> None:
        self._tx("BEGIN", timeout, self.qualifier)

    def send(self, value: bytes, n: int, **kw) -> SendResult:
        return self.producer.send(value, (self.broker, n), tx=self.key, **kw)

    def end(self) -> None:
        self._tx("END")

    def prepare(self) -> None:
        self._tx("PREPARE")

    def commit(self) -> None:
        self._tx("COMMIT_TWO_PHASE")

    def rollback(self) -> None:
        self._tx("ROLLBACK")

    def recover(self) -> list:
        text = self.producer.cluster.connection(self.broker).ok(["transaction", "null", self.session, "RECOVER",
                                                                 self.qualifier])
        return [k for k in text.split("\r\n") if k]


# ---------------------------------------------------------------------------------------------------
# Consuming through a group


def parse_offset(data: bytes) -> tuple:
    """(msgId, offset) of ``<msgId>-<offset>`` (msgId may be -1), or (-1, offset) of a bare offset."""
    text = data.decode()
    head, sep, tail = text.rpartition("-")
    return (int(head) if sep and head else -1), int(tail)


class GroupConsumer:
    """One member of a consumer group for one topic."""

    def __init__(self, cluster: Cluster, group: str, topic: str, max_size: int = 1 << 20):
        self.cluster, self.group, self.topic, self.max_size = cluster, group, topic, max_size
        self.consumer_id = f"{group}_{socket.gethostname()}-{os.getpid()}-{uuid.uuid4()}"
        self.owned: list = []
        self.positions: dict = {}  # partition name -> (msgId of the last message consumed, next byte offset)
        self.sizes: dict = {}  # partition name -> current maxSize (doubled while no whole message fits)
        self.moves = 0  # 301s followed
        self.partials = 0  # replies with no whole message

    def _path(self, *parts) -> str:
        return "/".join([f"{self.cluster.root}/consumers/{self.group}", *parts])

    def join(self) -> None:
        self.cluster.zk.create(self._path("ids", self.consumer_id), self.topic.encode(), ephemeral=True,
                               makepath=True)
        self.rebalance()

    def rebalance(self) -> None:
        zk = self.cluster.zk
        members = sorted(zk.get_children(self._path("ids")))
        parts = [f"{b}-{n}" for b, n in self.cluster.partitions(self.topic, "sub")]
        i, k = members.index(self.consumer_id), len(members)
        per, extra = divmod(len(parts), k)
        start = i * per + min(i, extra)
        mine = parts[start: start + per + (1 if i < extra else 0)]
        for p in self.owned:
            if p not in mine:
                zk.delete(self._path("owners", self.topic, p))
        owned = [p for p in self.owned if p in mine]
        for p in mine:
            if p in owned:
                continue
            try:
                zk.create(self._path("owners", self.topic, p), self.consumer_id.encode(), ephemeral=True,
                          makepath=True)
            except NodeExistsError:
                continue  # its previous owner has not let go yet: MetaQ retries at the next rebalance
            node = self._path("offsets", self.topic, p)
            self.positions[p] = parse_offset(zk.get(node)[0]) if zk.exists(node) else (-1, 0)
            self.sizes[p] = self.max_size
            owned.append(p)
        self.owned = sorted(owned, key=lambda name: tuple(int(x) for x in name.split("-")))

    def fetch(self, partition: str) -> list:
        """One ``get`` (following 301s): the whole messages there, the position advanced past them."""
        broker, n = (int(x) for x in partition.split("-"))
        conn = self.cluster.connection(broker)
        for _ in range(100):
            msg_id, offset = self.positions[partition]
            size = self.sizes[partition]
            reply = conn.call(["get", self.topic, self.group, n, offset, size])
            if reply.kind == "result":
                if reply.code == 301:
                    self.moves += 1
                    self.positions[partition] = (msg_id, int(reply.text))
                    continue
                if reply.code in (404, 403):
                    return []
                raise MetaqReplyError(reply.code, reply.text)
            messages, used = decode_messages(reply.body, offset)
            if not messages:
                self.partials += 1
                self.sizes[partition] = min(size * 2, MAX_READ_BUFFER)
                if size >= MAX_READ_BUFFER:
                    raise ValueError(f"a message at {partition}:{offset} is larger than {MAX_READ_BUFFER} bytes")
                continue
            self.positions[partition] = (messages[-1].msg_id, offset + used)
            self.sizes[partition] = max(self.max_size, size // 2)  # shrink back toward the configured size
            return messages
        raise AssertionError(f"{partition}: no answer but 301s or partial messages after 100 gets")

    def poll(self) -> list:
        out = []
        for p in self.owned:
            out += [(p, m) for m in self.fetch(p)]
        return out

    def commit(self) -> None:
        zk = self.cluster.zk
        for p in self.owned:
            msg_id, offset = self.positions[p]
            node = self._path("offsets", self.topic, p)
            data = f"{msg_id}-{offset}".encode()
            if zk.exists(node):
                zk.set(node, data)
            else:
                zk.create(node, data, makepath=True)

    def leave(self) -> None:
        for p in self.owned:
            self.cluster.zk.delete(self._path("owners", self.topic, p))
        self.cluster.zk.delete(self._path("ids", self.consumer_id))
        self.owned = []
