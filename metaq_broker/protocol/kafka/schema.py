"""One encoder and decoder for every Kafka message, driven by schema tables (``messages.py``).

A schema is a list of ``Field``s, each with the versions it exists in, the versions it may be null in,
and, for a tagged field, its tag. ``codec(fields, version, flexible)`` compiles the list once per version
into a ``StructCodec`` (a list of ready readers and writers, no version tests left at run time), cached.
Flexible versions (KIP-482) use compact strings, bytes and arrays (unsigned varint of length + 1) and end
every struct with its tagged fields; unknown tags are skipped, as Kafka does. Decoded messages are plain
dicts keyed by snake_case field names; a field absent from the version decodes to its default, and a field
the caller leaves out of a dict is encoded as its default, so one handler serves every version.

``records`` fields decode to a memoryview of the frame (no copy) and encode as separate parts, so a fetch
answer's record bytes reach the socket without being joined into one buffer (``encode_parts``).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field as dc_field
from typing import Any, Callable, Optional

from metaq_broker.errors import MetaqError

INF = 1 << 15


class KafkaDecodeError(MetaqError, ValueError):
    """Bytes that are not a valid Kafka message of the version they claim: names the field and position.
    Kafka answers such a request by closing the connection; so does a listener."""


def versions(spec: Optional[str]) -> tuple[int, int]:
    """'3+' -> (3, INF), '0-12' -> (0, 12), '5' -> (5, 5), 'none'/None -> empty range (1, 0)."""
    if spec is None or spec == "none":
        return 1, 0
    if spec.endswith("+"):
        return int(spec[:-1]), INF
    lo, _, hi = spec.partition("-")
    return int(lo), int(hi or lo)


@dataclass(frozen=True)
class Field:
    """One field of a message: ``type`` is a primitive name, ``[]prim`` for an array of primitives,
    ``[]`` for an array of structs or ``{}`` for a struct (both with ``fields``)."""

    name: str
    type: str
    versions: str
    nullable: Optional[str] = None
    tag: Optional[int] = None
    tagged: Optional[str] = None
    default: Any = "<type default>"
    flexible: Optional[str] = None  # a field whose encoding ignores the message's flexible versions
    fields: tuple = ()

    def has(self, version: int) -> bool:
        lo, hi = versions(self.versions)
        return lo <= version <= hi

    def nullable_in(self, version: int) -> bool:
        lo, hi = versions(self.nullable)
        return lo <= version <= hi

    def tagged_in(self, version: int) -> bool:
        lo, hi = versions(self.tagged)
        return self.tag is not None and lo <= version <= hi


def F(name: str, type: str, vers: str, *, fields=(), **kw) -> Field:
    """Shorthand the schema tables use."""
    return Field(name, type, vers, fields=tuple(fields), **kw)


_TYPE_DEFAULTS = {"bool": False, "int8": 0, "int16": 0, "uint16": 0, "int32": 0, "int64": 0, "float64": 0.0,
                  "string": "", "bytes": b"", "records": None, "uuid": bytes(16)}


def default_of(f: Field, version: int = INF):
    """The value a field has when a version lacks it or a dict leaves it out (a fresh list/dict each time)."""
    if f.type == "[]" or f.type.startswith("[]"):
        return [] if f.default in ("<type default>",) else f.default
    if f.type == "{}":
        return {s.name: default_of(s, version) for s in f.fields}
    if f.default != "<type default>":
        return f.default
    return _TYPE_DEFAULTS[f.type]


# ---------------------------------------------------------------------------------------------------
# Primitives


class Reader:
    """A position in a frame. ``buf`` is a memoryview; ``records`` fields are views of it."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf, pos: int = 0, end: Optional[int] = None):
        self.buf = buf if isinstance(buf, memoryview) else memoryview(buf)
        self.pos = pos
        self.end = len(self.buf) if end is None else end

    def take(self, n: int, what: str):
        p = self.pos
        if n < 0 or p + n > self.end:
            raise KafkaDecodeError(f"{what}: needs {n} bytes at byte {p}, {self.end - p} left")
        self.pos = p + n
        return self.buf[p:p + n]

    def uvarint(self, what: str) -> int:
        value = shift = 0
        buf, p, end = self.buf, self.pos, self.end
        while True:
            if p >= end:
                raise KafkaDecodeError(f"{what}: truncated varint at byte {self.pos}")
            b = buf[p]
            p += 1
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
            if shift > 28:
                raise KafkaDecodeError(f"{what}: varint longer than 5 bytes at byte {self.pos}")
        self.pos = p
        return value


def write_uvarint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def uvarint_bytes(value: int) -> bytes:
    out = bytearray()
    write_uvarint(out, value)
    return bytes(out)


_FIXED = {"bool": struct.Struct(">?"), "int8": struct.Struct(">b"), "int16": struct.Struct(">h"),
          "uint16": struct.Struct(">H"), "int32": struct.Struct(">i"), "int64": struct.Struct(">q"),
          "float64": struct.Struct(">d")}
_I16, _I32 = _FIXED["int16"], _FIXED["int32"]


class Writer:
    """Encoded parts: small fields go into a bytearray, ``records`` views are kept as their own parts."""

    __slots__ = ("parts", "out")

    def __init__(self):
        self.parts: list = []
        self.out = bytearray()

    def view(self, data) -> None:
        if len(data) < 4096:
            self.out += data
            return
        if self.out:
            self.parts.append(self.out)
            self.out = bytearray()
        self.parts.append(data)

    def finish(self) -> list:
        if self.out:
            self.parts.append(self.out)
            self.out = bytearray()
        return self.parts


def _length(r: Reader, compact: bool, what: str) -> int:
    """A length prefix: -1 is null."""
    if compact:
        return r.uvarint(what) - 1
    return _I16.unpack(r.take(2, what))[0]


def _prim_reader(f: Field, typ: str, version: int, compact: bool) -> Callable[[Reader], Any]:
    nullable = f.nullable_in(version)
    what = f.name
    if typ in _FIXED:
        s = _FIXED[typ]
        size, unpack = s.size, s.unpack_from

        def read_fixed(r: Reader):
            p = r.pos
            if p + size > r.end:
                raise KafkaDecodeError(f"{what}: needs {size} bytes at byte {p}, {r.end - p} left")
            r.pos = p + size
            return unpack(r.buf, p)[0]
        return read_fixed
    if typ == "uuid":
        return lambda r: bytes(r.take(16, what))
    if typ == "string":
        def read_string(r: Reader):
            n = _length(r, compact, what)
            if n < 0:
                if n == -1 and nullable:
                    return None
                raise KafkaDecodeError(f"{what}: length {n} (null) in version {version}, where it is not nullable")
            try:
                return str(r.take(n, what), "utf-8")
            except UnicodeDecodeError:
                raise KafkaDecodeError(f"{what}: not valid UTF-8") from None
        return read_string
    if typ in ("bytes", "records"):
        copy = typ == "bytes"

        def read_bytes(r: Reader):
            n = r.uvarint(what) - 1 if compact else _I32.unpack(r.take(4, what))[0]
            if n < 0:
                if n == -1 and nullable:
                    return None
                raise KafkaDecodeError(f"{what}: length {n} (null) in version {version}, where it is not nullable")
            data = r.take(n, what)
            return bytes(data) if copy else data
        return read_bytes
    raise ValueError(f"unknown type {typ!r} of field {what}")


def _prim_writer(f: Field, typ: str, version: int, compact: bool) -> Callable[[Writer, Any], None]:
    nullable = f.nullable_in(version)
    what = f.name
    if typ in _FIXED:
        pack = _FIXED[typ].pack

        def write_fixed(w: Writer, v):
            try:
                w.out += pack(v)
            except struct.error as e:
                raise ValueError(f"{what}: {v!r} does not fit {typ}: {e}") from None
        return write_fixed
    if typ == "uuid":
        def write_uuid(w: Writer, v):
            v = getattr(v, "bytes", v)
            if len(v) != 16:
                raise ValueError(f"{what}: a uuid is 16 bytes, got {len(v)}")
            w.out += v
        return write_uuid

    def write_null(w: Writer):
        if not nullable:
            raise ValueError(f"{what} is null, which version {version} cannot carry")
        if compact:
            w.out.append(0)
        else:
            w.out += b"\xff\xff" if typ == "string" else b"\xff\xff\xff\xff"

    if typ == "string":
        def write_string(w: Writer, v):
            if v is None:
                return write_null(w)
            data = v.encode("utf-8")
            if compact:
                write_uvarint(w.out, len(data) + 1)
            else:
                if len(data) > 0x7FFF:
                    raise ValueError(f"{what}: {len(data)} bytes is over the 32767 a string holds")
                w.out += _I16.pack(len(data))
            w.out += data
        return write_string

    def write_bytes(w: Writer, v):
        if v is None:
            return write_null(w)
        n = v.nbytes if isinstance(v, memoryview) else len(v)
        if compact:
            write_uvarint(w.out, n + 1)
        else:
            w.out += _I32.pack(n)
        w.view(v)
    return write_bytes


# ---------------------------------------------------------------------------------------------------
# Structs


@dataclass
class StructCodec:
    """A struct's fields compiled for one version: ``read`` makes a dict, ``write`` writes one."""

    fields: tuple
    version: int
    flexible: bool
    defaults: list = dc_field(default_factory=list)  # (name, field) of fields this version lacks
    regular: list = dc_field(default_factory=list)  # (name, reader, writer, field)
    tagged: dict = dc_field(default_factory=dict)  # tag -> (name, reader, writer, field)

    def read(self, r: Reader) -> dict:
        out = {}
        for name, f in self.defaults:
            out[name] = default_of(f, self.version)
        for name, read, _, _ in self.regular:
            out[name] = read(r)
        if self.flexible:
            for _ in range(r.uvarint("tagged fields")):
                tag = r.uvarint("tag")
                size = r.uvarint("tagged field size")
                end = r.pos + size
                if end > r.end:
                    raise KafkaDecodeError(f"tagged field {tag}: {size} bytes at byte {r.pos}, {r.end - r.pos} left")
                known = self.tagged.get(tag)
                if known is None:
                    r.pos = end  # an unknown tag: skipped, as Kafka does
                    continue
                sub = Reader(r.buf, r.pos, end)
                out[known[0]] = known[1](sub)
                if sub.pos != end:
                    raise KafkaDecodeError(f"tagged field {known[0]}: {end - sub.pos} bytes left over")
                r.pos = end
        return out

    def write(self, w: Writer, value: dict) -> None:
        get = value.get
        for name, _, write, f in self.regular:
            v = get(name, _MISSING)
            write(w, default_of(f, self.version) if v is _MISSING else v)
        if self.flexible:
            present = []
            for tag in sorted(self.tagged):
                name, _, write, f = self.tagged[tag]
                v = get(name, _MISSING)
                if v is _MISSING or v == default_of(f, self.version):
                    continue
                sub = Writer()
                write(sub, v)
                present.append((tag, b"".join(sub.finish())))
            write_uvarint(w.out, len(present))
            for tag, data in present:
                write_uvarint(w.out, tag)
                write_uvarint(w.out, len(data))
                w.out += data


_MISSING = object()


def _field_codec(f: Field, version: int, flexible: bool):
    """(reader, writer) of one field at one version."""
    lo, hi = versions(f.flexible)
    compact = flexible if f.flexible is None else lo <= version <= hi
    if f.type in ("[]", "{}"):
        inner = codec(f.fields, version, flexible)
        if f.type == "{}":
            return inner.read, inner.write
        item_read, item_write = inner.read, inner.write
    elif f.type.startswith("[]"):
        item_read = _prim_reader(f, f.type[2:], version, compact)
        item_write = _prim_writer(Field(f.name, f.type[2:], f.versions), f.type[2:], version, compact)
    else:
        return _prim_reader(f, f.type, version, compact), _prim_writer(f, f.type, version, compact)
    nullable = f.nullable_in(version)
    what = f.name

    def read_array(r: Reader):
        n = r.uvarint(what) - 1 if compact else _I32.unpack(r.take(4, what))[0]
        if n < 0:
            if n == -1 and nullable:
                return None
            raise KafkaDecodeError(f"{what}: array length {n} in version {version}")
        if n > r.end - r.pos:  # every entry takes at least one byte: a hostile count fails here, not in memory
            raise KafkaDecodeError(f"{what}: {n} entries declared at byte {r.pos}, {r.end - r.pos} bytes left")
        return [item_read(r) for _ in range(n)]

    def write_array(w: Writer, v):
        if v is None:
            if not nullable:
                raise ValueError(f"{what} is null, which version {version} cannot carry")
            w.out += b"\x00" if compact else b"\xff\xff\xff\xff"
            return
        if compact:
            write_uvarint(w.out, len(v) + 1)
        else:
            w.out += _I32.pack(len(v))
        for item in v:
            item_write(w, item)
    return read_array, write_array


# Compiled codecs by the identity of the fields tuple (held in the value, so its id is not reused while
# cached): schema tables are module constants, and hashing a tuple of Fields (as ``lru_cache`` did) cost
# ~8 us of each request and each answer
_CODECS: dict = {}


def codec(fields: tuple, version: int, flexible: bool) -> StructCodec:
    """The compiled codec of a struct at a version (cached: compiled once per struct and version)."""
    key = (id(fields), version, flexible)
    hit = _CODECS.get(key)
    if hit is None or hit[0] is not fields:
        hit = _CODECS[key] = (fields, _compile(fields, version, flexible))
    return hit[1]


def _compile(fields: tuple, version: int, flexible: bool) -> StructCodec:
    c = StructCodec(fields, version, flexible)
    for f in fields:
        if not f.has(version):
            c.defaults.append((f.name, f))
            continue
        read, write = _field_codec(f, version, flexible)
        if f.tagged_in(version):
            if not flexible:
                raise ValueError(f"{f.name} is tagged in version {version}, which is not flexible")
            c.defaults.append((f.name, f))
            c.tagged[f.tag] = (f.name, read, write, f)
        else:
            c.regular.append((f.name, read, write, f))
    return c


def decode(fields: tuple, version: int, flexible: bool, buf, pos: int = 0, whole: bool = True) -> tuple[dict, int]:
    """Decode one struct from ``buf`` at ``pos``; with ``whole`` the struct must end the buffer."""
    r = Reader(buf, pos)
    value = codec(fields, version, flexible).read(r)
    if whole and r.pos != r.end:
        raise KafkaDecodeError(f"{r.end - r.pos} bytes left over after the message (version {version})")
    return value, r.pos


def encode_parts(fields: tuple, version: int, flexible: bool, value: dict) -> list:
    """Encode one struct to a list of buffers (``records`` views stay separate parts)."""
    w = Writer()
    codec(fields, version, flexible).write(w, value)
    return w.finish()


def encode(fields: tuple, version: int, flexible: bool, value: dict) -> bytes:
    return b"".join(encode_parts(fields, version, flexible, value))
