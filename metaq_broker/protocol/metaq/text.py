"""MetaQ's text commands, parsed without I/O, and its two replies.

A request is one line of tokens joined by single spaces and ended by CRLF; ``put`` (and ``sync``) carry a
body of the line's ``valueLen`` bytes after it. ``RequestParser.feed`` takes bytes as they arrive and
returns the requests completed so far, in order, as events; a listener answers each, in order (MetaQ
clients pipeline and match answers by their ``opaque``). The parser never holds more than one line
(``max_line``) plus one put body (``max_message_size``): a longer line or a larger body is read past, not
kept, and answered with ``Rejected``. docs/metaq-protocol.md lists every line and every refusal.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Optional, Union

import numpy as np

CRLF = b"\r\n"
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
NO_OPAQUE = INT32_MAX  # MetaQ's opaque for a version, stats or quit line that names none
MAX_LINE = 4096  # bytes of one command line; the longest a MetaQ client writes is a put with an XA key (~400)
MAX_MESSAGE_SIZE = 4 << 20  # metaq's default maxMessageSize
HAS_ATTRIBUTE = 0x1  # flag bit 0: the data starts with a 4-byte attribute length and the attribute
ATTRIBUTE_PREFIX = 4
CHECKSUM_MASK = 0x7FFFFFFF  # a put's checksum is CRC32(data) & 0x7FFFFFFF; -1: none


class Code(IntEnum):
    """MetaQ's status codes (``HttpStatus``), with their HTTP meanings."""
    SUCCESS = 200
    MOVED = 301  # the offset asked for is not a message's position: the message holds the one to use
    BAD_REQUEST = 400
    UNAUTHORIZED = 401
    FORBIDDEN = 403  # the partition is closed
    NOT_FOUND = 404  # no such topic or partition, or nothing at that position yet
    INTERNAL_ERROR = 500
    SERVICE_UNAVAILABLE = 503  # also Gecko's answer for a command no processor handles
    GATEWAY_TIMEOUT = 504


class TxType(Enum):
    BEGIN = "BEGIN"
    PREPARE = "PREPARE"
    COMMIT_ONE_PHASE = "COMMIT_ONE_PHASE"
    COMMIT_TWO_PHASE = "COMMIT_TWO_PHASE"
    ROLLBACK = "ROLLBACK"
    RECOVER = "RECOVER"
    FORGET = "FORGET"
    END = "END"


class ProtocolError(ValueError):
    """A request the parser refuses; ``close``: its framing is lost, so the connection must close."""

    def __init__(self, message: str, close: bool = False):
        super().__init__(message)
        self.close = close


# ---------------------------------------------------------------------------------------------------
# Transaction keys


@dataclass(frozen=True, slots=True)
class LocalTxKey:
    """``TX:<sessionId>:<value>``: a producer session's local transaction."""
    session_id: str
    value: int

    def __str__(self) -> str:
        return f"TX:{self.session_id}:{self.value}"


MAX_XA_PART = 64  # bytes of an XA global transaction id or branch qualifier (javax.transaction.xa.Xid)


@dataclass(frozen=True, slots=True)
class XaTxKey:
    """``XID:<formatId>:<gtid hex>:<bqual hex>:<uniqueQualifier>``: an XA branch."""
    format_id: int
    gtid: bytes
    bqual: bytes
    unique_qualifier: str

    def __str__(self) -> str:
        return f"XID:{self.format_id}:{self.gtid.hex()}:{self.bqual.hex()}:{self.unique_qualifier}"


TxKey = Union[LocalTxKey, XaTxKey]


def parse_tx_key(text: str) -> Optional[TxKey]:
    """A transaction key as MetaQ writes it (``null``: none); ProtocolError naming what is wrong."""
    if text == "null":
        return None
    if text.startswith("TX:"):
        session, sep, value = text[3:].rpartition(":")  # a session id may itself hold ':'
        if not sep or not session:
            raise ProtocolError(f"transaction key {text!r}: expected TX:<sessionId>:<value>")
        return LocalTxKey(session, _int(value, INT64_MIN, INT64_MAX, f"transaction key {text!r}: value"))
    if text.startswith("XID:"):
        parts = text[4:].split(":", 3)
        if len(parts) != 4:
            raise ProtocolError(f"transaction key {text!r}: expected XID:<formatId>:<gtid>:<bqual>:<uniqueQualifier>")
        fmt = _int(parts[0], INT32_MIN, INT32_MAX, f"transaction key {text!r}: formatId")
        gtid, bqual = (_hex(p, f"transaction key {text!r}: {what}") for p, what in ((parts[1], "gtid"),
                                                                                   (parts[2], "bqual")))
        return XaTxKey(fmt, gtid, bqual, parts[3])
    raise ProtocolError(f"transaction key {text!r}: expected null, TX:... or XID:...")


def _hex(text: str, what: str) -> bytes:
    try:
        value = bytes.fromhex(text)
    except ValueError:
        raise ProtocolError(f"{what} {text!r} is not hexadecimal") from None
    if not value or len(value) > MAX_XA_PART or len(text) != 2 * len(value):
        raise ProtocolError(f"{what} must be 1 to {MAX_XA_PART} bytes in hex, got {text!r}")
    return value


# ---------------------------------------------------------------------------------------------------
# Request events (not frozen: a frozen dataclass costs a microsecond more to build, once per request)


@dataclass(slots=True)
class Put:
    """``put``: one message. ``partition`` -1: the broker picks one. ``value`` and ``attribute`` are the
    data split at the attribute (flag bit 0); ``checksum`` was verified when it is not -1."""
    topic: str
    partition: int
    flag: int
    checksum: int
    tx: Optional[TxKey]
    opaque: int
    value: bytes
    attribute: Optional[str]


@dataclass(slots=True)
class Get:
    """``get``: whole messages from byte position ``offset``, at most ``max_size`` bytes (> 0)."""
    topic: str
    group: str
    partition: int
    offset: int
    max_size: int
    opaque: int


@dataclass(slots=True)
class OffsetQuery:
    """``offset``: the nearest valid position to ``offset``."""
    topic: str
    group: str
    partition: int
    offset: int
    opaque: int


@dataclass(slots=True)
class Version:
    """``version``: the broker's version; MetaQ clients' heartbeat."""
    opaque: int


@dataclass(slots=True)
class Stats:
    """``stats``: ``item`` None (broker), ``topics``, ``offsets``, ``realtime``, ``config``, or a topic."""
    item: Optional[str]
    opaque: int


@dataclass(slots=True)
class Quit:
    """``quit``: no answer; the broker closes the connection (the parser reads nothing after it)."""


@dataclass(slots=True)
class Transaction:
    """``transaction``: ``timeout`` in seconds (0: the broker's), ``unique_qualifier`` for RECOVER."""
    key: Optional[TxKey]
    session_id: str
    type: TxType
    timeout: int
    unique_qualifier: Optional[str]
    opaque: int


@dataclass(slots=True)
class Rejected:
    """A request the parser answers itself: ``result <code>`` with ``message``; ``close``: then close
    the connection (its framing is lost)."""
    code: Code
    message: str
    opaque: int
    close: bool = False


@dataclass(slots=True, eq=False)
class PutRun:
    """Consecutive plain puts to one partition of one topic (7 tokens, no attribute, no transaction, the
    checksum verified), found in one read by the compiled scan: columns instead of a ``Put`` each. The i-th
    value is ``data[offsets[i]:offsets[i + 1]]``; ``puts()`` gives the ``Put`` events the general path would."""
    topic: str
    partition: int
    flags: np.ndarray  # int32
    checksums: np.ndarray  # int64
    opaques: np.ndarray  # int64
    data: np.ndarray  # uint8: the bodies one after another
    offsets: np.ndarray  # int32, one more than the puts

    def __len__(self) -> int:
        return len(self.opaques)

    @staticmethod
    def joined(runs: list) -> "PutRun":
        """Runs to one partition of one topic (reads of one pipeline) as one."""
        if len(runs) == 1:
            return runs[0]
        bases = np.cumsum([0] + [int(r.offsets[-1]) for r in runs[:-1]])
        offsets = np.concatenate([runs[0].offsets[:1]] + [r.offsets[1:] + b for r, b in zip(runs, bases)])
        return PutRun(runs[0].topic, runs[0].partition, *(np.concatenate([getattr(r, f) for r in runs]) for f in
                                                          ("flags", "checksums", "opaques", "data")),
                      offsets.astype(np.int32))

    def puts(self) -> list:
        data, o = self.data.tobytes(), self.offsets.tolist()
        columns = zip(self.flags.tolist(), self.checksums.tolist(), self.opaques.tolist())
        return [Put(self.topic, self.partition, f, c, None, op, data[o[i]:o[i + 1]], None)
                for i, (f, c, op) in enumerate(columns)]


Event = Union[Put, PutRun, Get, OffsetQuery, Version, Stats, Quit, Transaction, Rejected]


# ---------------------------------------------------------------------------------------------------
# Tokens

_NUMBER = re.compile(r"[+-]?[0-9]{1,20}")  # Java's parseInt/parseLong: ASCII digits, optional sign
# ``put topic partition valueLen flag checksum opaque``: ASCII topic, numbers of at most 10 digits (ranges
# checked after the match)
_FAST_PUT = re.compile(rb"put ([!-~]{1,255}) (-1|[0-9]{1,10}) ([0-9]{1,10}) (-?[0-9]{1,10}) (-?[0-9]{1,10}) "
                       rb"(-?[0-9]{1,10})\r\n")


def _int(token: str, lo: int, hi: int, what: str) -> int:
    if not (token.isascii() and token.isdigit() and len(token) < 19) and not _NUMBER.fullmatch(token):
        raise ProtocolError(f"{what} {token!r} is not an integer")
    value = int(token)
    if not lo <= value <= hi:
        raise ProtocolError(f"{what} {value} is out of range [{lo}, {hi}]")
    return value


def _name(token: str, what: str) -> str:
    if not token:
        raise ProtocolError(f"{what} is empty (two spaces in a row?)")
    return token


def _opaque(token: str) -> int:
    return _int(token, INT32_MIN, INT32_MAX, "opaque")


def _guess_opaque(tokens: list) -> int:
    """The opaque to answer a bad line with: its last token when that is one, else NO_OPAQUE."""
    try:
        return _opaque(tokens[-1]) if len(tokens) > 1 else NO_OPAQUE
    except ProtocolError:
        return NO_OPAQUE


# ---------------------------------------------------------------------------------------------------
# The compiled scan of pipelined puts (``_kernels.py``)

RUN_MIN_BYTES = 1024  # a read with fewer bytes left takes the per-line paths: a scan costs a few microseconds
SCAN_BACKOFF = 16
RUN_MAX_PUTS = 1024  # puts a scan takes at most (40 KiB of columns kept per connection); the next scan goes on
_SCAN = None


def compiled():
    """The compiled kernels and their CRC tables, imported on first use."""
    global _SCAN
    if _SCAN is None:
        # lazy: numba takes a second to import (more to compile once per machine, then its cache serves)
        from metaq_broker.protocol.metaq import _kernels
        _SCAN = (_kernels, _kernels.crc_tables())
    return _SCAN


def warm_up() -> None:
    """Load (or on first use on this machine, compile) the put scan, so a broker's first client does not
    wait for it."""
    parser = RequestParser(run_min_bytes=0, scan_backoff=0)
    parser.feed(b"put t 0 1 0 %d 1\r\nxput t 0 1 0 -1 2\r\ny" % (zlib.crc32(b"x") & CHECKSUM_MASK))
    put_results(np.zeros(RESULTS_COMPILED_FROM, np.int64), 0, np.zeros(RESULTS_COMPILED_FROM, np.int64),
                [0] * RESULTS_COMPILED_FROM)
    kernels, table = compiled()
    kernels.crcs(np.zeros(1, np.uint8), np.zeros(2, np.int64), table, np.zeros(1, np.int64))


# ---------------------------------------------------------------------------------------------------
# The parser


class RequestParser:
    """Incremental parser of one connection's requests. ``feed`` bytes, get events in request order.

    ``max_message_size``: the largest put body accepted (a put with an attribute may send 4 bytes more:
    the attribute's length is not stored). ``max_line``: the longest command line. ``run_min_bytes``: from
    how many buffered bytes a ``put`` starts a compiled scan for a ``PutRun``; ``scan_backoff``: puts taken
    by the other paths, without a scan, after a scan that took none (a pipeline of puts with attributes
    would pay a failed scan, ~1 µs, each)."""

    def __init__(self, max_message_size: int = MAX_MESSAGE_SIZE, max_line: int = MAX_LINE,
                 run_min_bytes: int = RUN_MIN_BYTES, scan_backoff: int = SCAN_BACKOFF):
        self.max_message_size, self.max_line, self.run_min_bytes = max_message_size, max_line, run_min_bytes
        self.scan_backoff, self._backoff = scan_backoff, 0
        self._buf = bytearray()
        self._pos = 0
        self._body: Optional[tuple] = None  # (put tokens..., length) of the put whose body is awaited
        self._skip = 0  # body bytes still to read past (a refused put's, a sync's)
        self._discarding = False  # reading past an over-long line up to its CRLF
        self._out, self._head = None, np.empty(3, np.int64)  # ``_put_run``'s columns
        self.closed = False  # after quit or a loss of framing: nothing more is read

    @property
    def buffered(self) -> int:
        """Bytes held: at most ``max_line`` + ``max_message_size`` + one ``feed``'s input."""
        return len(self._buf) - self._pos

    def feed(self, data) -> list:
        if self.closed:
            return []
        self._buf += data
        events: list = []
        try:
            self._parse(events)
        finally:
            if self._pos:
                del self._buf[:self._pos]
                self._pos = 0
        return events

    def _parse(self, events: list) -> None:
        buf = self._buf
        while not self.closed:
            avail = len(buf) - self._pos
            if self._skip:
                n = min(self._skip, avail)
                self._pos += n
                self._skip -= n
                if self._skip:
                    return
                continue
            if self._body is not None:
                length = self._body[-1]
                if avail < length:
                    return
                data = bytes(buf[self._pos: self._pos + length])
                self._pos += length
                head, self._body = self._body, None
                events.append(self._put(head, data))
                continue
            if not self._discarding and buf.startswith(b"put ", self._pos):
                if self._backoff:
                    self._backoff -= 1
                elif avail >= self.run_min_bytes:
                    if self._put_run(buf, events):
                        continue
                    self._backoff = self.scan_backoff  # a put the scan does not take: likely more of its kind
                if self._fast_put(buf, events):
                    continue
            end = buf.find(CRLF, self._pos)
            if self._discarding:
                if end < 0:
                    self._pos = len(buf) - (1 if buf.endswith(b"\r") else 0)
                    return
                self._discarding = False
                self._pos = end + 2
                continue
            if end < 0 and avail > self.max_line + 1 or end - self._pos > self.max_line:  # + 1: a CR may wait for its LF
                events.append(Rejected(Code.BAD_REQUEST, f"command line longer than {self.max_line} bytes",
                                       NO_OPAQUE))
                self._discarding = True
                continue
            if end < 0:
                return
            line = bytes(buf[self._pos: end])
            self._pos = end + 2
            event = self._line(line)
            if event is not None:
                events.append(event)

    def _put_run(self, buf: bytearray, events: list) -> bool:
        """The puts from here that ``_kernels.scan_puts`` accepts, as one ``PutRun``; False (nothing
        taken) when it accepts none."""
        kernels, table = compiled()
        u8 = np.frombuffer(buf, np.uint8)  # a view: released before ``feed`` trims the buffer
        try:
            if self._out is None:  # kept: a fresh array each scan costs more than a failed scan
                self._out = np.empty((RUN_MAX_PUTS, 5), np.int64)
            out, head = self._out, self._head
            n, end = kernels.scan_puts(u8, self._pos, len(buf), self.max_message_size, table, out, head)
            if not n:
                return False
            lengths = out[:n, 0]
            offsets = np.zeros(n + 1, np.int32)
            np.cumsum(lengths, out=offsets[1:])
            data = np.empty(int(offsets[-1]), np.uint8)
            kernels.gather(u8, out[:n, 4].copy(), lengths.copy(), data)
            topic = bytes(u8[head[0]:head[0] + head[1]]).decode("ascii")
        finally:
            del u8
        events.append(PutRun(topic, int(head[2]), out[:n, 1].astype(np.int32), out[:n, 2].copy(),
                             out[:n, 3].copy(), data, offsets))  # copies: ``out`` is the next scan's
        self._pos = int(end)
        return True

    def _fast_put(self, buf: bytearray, events: list) -> bool:
        """The common put (7 tokens, a numeric checksum, an ASCII topic, its body already here) in one
        regular expression match: False leaves any other line to the general path, which says what is wrong."""
        m = _FAST_PUT.match(buf, self._pos)
        if m is None:
            return False
        topic, partition, length, flag, checksum, opaque = m.groups()
        partition, length, flag, checksum, opaque = int(partition), int(length), int(flag), int(checksum), int(opaque)
        start = m.end()
        if (partition > INT32_MAX or length > self.max_message_size or len(buf) - start < length
                or not INT32_MIN <= flag <= INT32_MAX or not INT32_MIN <= checksum <= INT32_MAX
                or not INT32_MIN <= opaque <= INT32_MAX):
            return False
        self._pos = start + length
        events.append(self._put((topic.decode("ascii"), partition, flag, checksum, None, opaque, length),
                                bytes(buf[start:self._pos])))
        return True

    def _line(self, line: bytes):
        """The event of one command line; None when a put's body is awaited (``self._body`` set)."""
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            return Rejected(Code.BAD_REQUEST, f"command line is not UTF-8 (byte {e.start})", NO_OPAQUE)
        tokens = text.split(" ")
        while tokens and not tokens[-1]:  # as Java's String.split: trailing empty tokens go
            tokens.pop()
        if not tokens:
            return Rejected(Code.BAD_REQUEST, "blank command line", NO_OPAQUE)
        handler = _COMMANDS.get(tokens[0])
        try:
            if handler is None:
                raise ProtocolError(f"unknown command {tokens[0][:40]!r}")
            return handler(self, tokens)
        except ProtocolError as e:
            if e.close:
                self.closed = True
            return Rejected(Code.BAD_REQUEST, f"{tokens[0][:40]}: {e}", _guess_opaque(tokens), e.close)

    def _body_length(self, tokens: list, at: int) -> int:
        """The declared body length; a length that cannot be read loses the framing (close)."""
        try:
            return _int(tokens[at] if len(tokens) > at else "", 0, INT32_MAX, "body length")
        except ProtocolError as e:
            raise ProtocolError(f"{e}; the request's end is unknown, closing", close=True) from None

    def _skip_body(self, length: int, code: Code, message: str, tokens: list) -> Rejected:
        self._skip = length
        return Rejected(code, message, _guess_opaque(tokens))

    # -- commands --------------------------------------------------------------------------------------
    def _cmd_put(self, t: list):
        length = self._body_length(t, 3)
        try:
            n = len(t)
            if n not in (6, 7, 8):
                raise ProtocolError(f"expected 6, 7 or 8 tokens, got {n}")
            topic = _name(t[1], "topic")
            partition = _int(t[2], -1, INT32_MAX, "partition")
            flag = _int(t[4], INT32_MIN, INT32_MAX, "flag")
            checksum, tx = -1, None
            if n == 8:
                checksum, tx = _int(t[5], INT32_MIN, INT32_MAX, "checksum"), parse_tx_key(t[6])
            elif n == 7:  # MetaQ's rule: a checksum starts with a digit or '-', anything else is a key
                if t[5][:1].isdigit() and t[5][:1].isascii() or t[5][:1] == "-":
                    checksum = _int(t[5], INT32_MIN, INT32_MAX, "checksum")
                else:
                    tx = parse_tx_key(t[5])
            opaque = _opaque(t[-1])
            limit = self.max_message_size + (ATTRIBUTE_PREFIX if flag & HAS_ATTRIBUTE else 0)
            if length > limit:
                raise ProtocolError(f"valueLen {length} exceeds maxMessageSize {self.max_message_size}")
        except ProtocolError as e:
            return self._skip_body(length, Code.BAD_REQUEST, f"put: {e}", t)
        self._body = (topic, partition, flag, checksum, tx, opaque, length)
        return None

    @staticmethod
    def _put(head: tuple, data: bytes):
        topic, partition, flag, checksum, tx, opaque, _ = head
        if checksum != -1 and zlib.crc32(data) & CHECKSUM_MASK != checksum:
            return Rejected(Code.BAD_REQUEST, f"put: checksum {checksum} does not match the data's "
                            f"{zlib.crc32(data) & CHECKSUM_MASK} (CRC32 & 0x7FFFFFFF)", opaque)
        attribute = None
        if flag & HAS_ATTRIBUTE:
            try:
                attribute, data = split_attribute(data)
            except ProtocolError as e:
                return Rejected(Code.BAD_REQUEST, f"put: {e}", opaque)
        return Put(topic, partition, flag, checksum, tx, opaque, data, attribute)

    def _cmd_get(self, t: list):
        if len(t) != 7:
            raise ProtocolError(f"expected get topic group partition offset maxSize opaque, got {len(t)} tokens")
        max_size = _int(t[5], INT32_MIN, INT32_MAX, "maxSize")
        if max_size <= 0:
            raise ProtocolError(f"Bad request,invalid max size:{max_size}")
        return Get(_name(t[1], "topic"), _name(t[2], "group"), _int(t[3], INT32_MIN, INT32_MAX, "partition"),
                   _int(t[4], INT64_MIN, INT64_MAX, "offset"), max_size, _opaque(t[6]))

    def _cmd_offset(self, t: list):
        if len(t) != 6:
            raise ProtocolError(f"expected offset topic group partition offset opaque, got {len(t)} tokens")
        return OffsetQuery(_name(t[1], "topic"), _name(t[2], "group"), _int(t[3], INT32_MIN, INT32_MAX, "partition"),
                           _int(t[4], INT64_MIN, INT64_MAX, "offset"), _opaque(t[5]))

    def _cmd_version(self, t: list):
        if len(t) > 2:
            raise ProtocolError(f"expected version [opaque], got {len(t)} tokens")
        return Version(_opaque(t[1]) if len(t) == 2 else NO_OPAQUE)

    def _cmd_stats(self, t: list):
        if len(t) > 3:
            raise ProtocolError(f"expected stats [item] [opaque], got {len(t)} tokens")
        return Stats(t[1] or None if len(t) > 1 else None, _opaque(t[2]) if len(t) == 3 else NO_OPAQUE)

    def _cmd_quit(self, t: list):
        self.closed = True
        return Quit()

    def _cmd_transaction(self, t: list):
        n = len(t)
        if n not in (5, 6, 7):
            raise ProtocolError(f"expected transaction key sessionId type [timeout] [uniqueQualifier] opaque, "
                                f"got {n} tokens")
        try:
            tx_type = TxType(t[3])
        except ValueError:
            raise ProtocolError(f"unknown transaction type {t[3][:40]!r}; expected one of "
                                f"{', '.join(x.value for x in TxType)}") from None
        timeout, qualifier = 0, None
        if n == 7:
            timeout, qualifier = _int(t[4], 0, INT32_MAX, "timeout"), t[5]
        elif n == 6:  # MetaQ's rule: a numeric token is the timeout, anything else the qualifier
            if t[4].isascii() and t[4].isdigit():
                timeout = _int(t[4], 0, INT32_MAX, "timeout")
            else:
                qualifier = t[4]
        return Transaction(parse_tx_key(t[1]), _name(t[2], "sessionId"), tx_type, timeout, qualifier or None,
                           _opaque(t[-1]))

    def _cmd_sync(self, t: list):
        # A MetaQ master's replication to its slaves; a MetaQ broker without the HA plugin has no
        # processor for it and Gecko answers 503. metaq replicates with its own protocol.
        return self._skip_body(self._body_length(t, 3), Code.SERVICE_UNAVAILABLE,
                               "sync: no processor for MetaQ's master-slave replication; metaq replicates "
                               "broker groups with its own protocol (docs/replication.md)", t)

    def _cmd_reply(self, t: list):
        length = self._body_length(t, 2 if t[0] == "result" else 1)
        return self._skip_body(length, Code.BAD_REQUEST, f"{t[0]} is a reply, not a request", t)


_COMMANDS = {"put": RequestParser._cmd_put, "get": RequestParser._cmd_get, "offset": RequestParser._cmd_offset,
             "version": RequestParser._cmd_version, "stats": RequestParser._cmd_stats,
             "quit": RequestParser._cmd_quit, "transaction": RequestParser._cmd_transaction,
             "sync": RequestParser._cmd_sync, "result": RequestParser._cmd_reply, "value": RequestParser._cmd_reply}


def split_attribute(data: bytes) -> tuple:
    """(attribute, payload) of a message's data with flag bit 0: a big-endian i32 length, that many
    bytes of UTF-8 attribute, then the payload."""
    if len(data) < ATTRIBUTE_PREFIX:
        raise ProtocolError(f"flag bit 0 says the data starts with an attribute, but it has only {len(data)} bytes")
    n = int.from_bytes(data[:ATTRIBUTE_PREFIX], "big", signed=True)
    if not 0 <= n <= len(data) - ATTRIBUTE_PREFIX:
        raise ProtocolError(f"attribute length {n} does not fit in the {len(data)} bytes of data")
    try:
        attribute = data[ATTRIBUTE_PREFIX: ATTRIBUTE_PREFIX + n].decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("attribute is not valid UTF-8") from None
    return attribute, data[ATTRIBUTE_PREFIX + n:]


# ---------------------------------------------------------------------------------------------------
# Replies


def result(code: int, message: Union[str, bytes, None], opaque: int) -> bytes:
    """``result <code> <len> <opaque>\\r\\n<message>`` (MetaQ's BooleanCommand)."""
    body = message.encode("utf-8") if isinstance(message, str) else (message or b"")
    return b"result %d %d %d\r\n" % (code, len(body), opaque) + body


def value_header(length: int, opaque: int) -> bytes:
    """``value <len> <opaque>\\r\\n``: a message set of ``length`` bytes follows (MetaQ's DataCommand)."""
    return b"value %d %d\r\n" % (length, opaque)


def put_result(msg_id: int, partition: int, position: int, opaque: int) -> bytes:
    """A put's success: the message id, its partition and its byte position."""
    return result(Code.SUCCESS, f"{msg_id} {partition} {position}", opaque)


_POWERS_OF_TEN = np.array([10 ** k for k in range(1, 19)], dtype=np.int64)


def _digits(a: np.ndarray) -> np.ndarray:
    """Decimal digits of each non-negative int64 (exact: no floating point)."""
    return 1 + np.searchsorted(_POWERS_OF_TEN, a, side="right")


RESULTS_COMPILED_FROM = 32  # puts: fewer are formatted in Python (no kernel to load for a few)


def put_results(msg_ids: np.ndarray, partition: int, positions: np.ndarray, opaques) -> bytes:
    """``put_result`` of many puts at once (a pipelined batch): from ``RESULTS_COMPILED_FROM`` puts by the
    compiled ``format_put_results``, else the lengths counted with numpy and one formatting per reply."""
    n = len(msg_ids)
    if n >= RESULTS_COMPILED_FROM:
        kernels = compiled()[0]
        out = np.empty(n * kernels.REPLY_MAX, np.uint8)
        w = kernels.format_put_results(np.asarray(msg_ids, np.int64), partition, np.asarray(positions, np.int64),
                                       np.asarray(opaques, np.int64), out)
        return out[:w].tobytes()
    if not isinstance(opaques, list):
        opaques = opaques.tolist()
    lengths = _digits(msg_ids) + len(str(partition)) + _digits(positions) + 2
    form = (b"result 200 %%d %%d\r\n%%d %d %%d" % partition).__mod__
    return b"".join(map(form, zip(lengths.tolist(), opaques, msg_ids.tolist(), positions.tolist())))


def stats_body(pairs) -> str:
    """``STATS``, a ``<key> <value>`` line per pair, ``END``; every line ends in CRLF."""
    return "STATS\r\n" + "".join(f"{k} {v}\r\n" for k, v in pairs) + "END\r\n"


def rejected_reply(event: Rejected) -> bytes:
    return result(event.code, event.message, event.opaque)
