"""The record-batch format: how an appended batch of messages is laid out in bytes.

One append becomes one batch: a 72-byte header (version 3; version 2's was its first 48 bytes, and version 2
batches stay readable everywhere) followed by a columnar body (per-message fixed-width columns, then each
variable-width column's bytes back to back, then the batch's record headers, columnar too). The same bytes are stored in segment
files and sent to consumers, so the broker never re-encodes, and a consumer turns any run of batches
into Arrow arrays with numpy and Arrow kernels instead of a Python loop per message: the only Python
loop is one step per batch, to check its checksums. docs/storage-format.md gives the layout byte by byte.

Every checksum is CRC-32C and goes through ``crc``.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import google_crc32c
import numpy as np
import pyarrow as pa

from metaq_broker.errors import InvalidMessageError

MAGIC = 0x4D51  # u16 at byte 8, stored little-endian: the bytes 51 4D
VERSION = 3  # what is written. 1 used CRC-32 (zlib); 2 uses CRC-32C; 3 adds the producer and MetaQ byte fields
VERSIONS = (2, 3)  # what is read
HEADER = struct.Struct("<IIHBBIqqqII")  # the fields of every version (version 2's whole header)
BASE_HEADER_SIZE = HEADER.size  # 48
assert BASE_HEADER_SIZE == 48
# Version 3 goes on: producer id (-1: none), producer epoch (-1: none), 0, base sequence (-1: none), and the
# batch's first message's position in the partition's MetaQ message stream (``metaq_bytes``).
HEADER_V3 = struct.Struct("<qhHiq")
HEADER_SIZE = BASE_HEADER_SIZE + HEADER_V3.size  # 72: the header of what is written
assert HEADER_SIZE == 72
HEADER_SIZES = {2: BASE_HEADER_SIZE, 3: HEADER_SIZE}
ALIGN = 8
NO_PRODUCER = -1  # producer id, epoch and sequence of a batch no idempotent producer stamped
# A message's size in MetaQ's message-set layout (msgLen, CRC32, id, flag; [attrLen, attr]; payload): the
# unit of MetaQ byte offsets (docs/storage-format.md, section 3.5)
METAQ_MESSAGE_HEAD = 20
METAQ_ATTRIBUTE_HEAD = 4

# Batch attribute bits. The first two describe the body (a producer sets them); the last two are the
# broker's: TRANSACTIONAL marks the batch of an unsettled-at-append transaction (its number in ``txn``),
# CONTROL a marker, which no reader returns: a transaction's (its number in ``txn``, one message:
# COMMIT_MARKER or ABORT_MARKER), or with ``txn`` 0 an epoch marker (``epoch_marker``; replication).
HAS_KEYS = 0x1
HAS_ATTRIBUTES = 0x2
TRANSACTIONAL = 0x4
CONTROL = 0x8
HAS_HEADERS = 0x10  # version 3: a header-count column and the batch's headers section (Kafka record headers)
BODY_ATTRIBUTE_BITS = HAS_KEYS | HAS_ATTRIBUTES | HAS_HEADERS
KNOWN_ATTRIBUTE_BITS = BODY_ATTRIBUTE_BITS | TRANSACTIONAL | CONTROL
ABORT_MARKER, COMMIT_MARKER = b"\x00", b"\x01"  # a marker's value
EPOCH_MARKER = struct.Struct("<BII")  # an epoch marker's value: 0x02, the epoch, the master's replica id
EPOCH_MARKER_TAG = 2


def epoch_marker(epoch: int, replica_id: int) -> bytes:
    """The value of the marker a master writes with an epoch's first append in a partition (a CONTROL
    batch with ``txn`` 0: transaction numbers start at 1); docs/storage-format.md section 12."""
    return EPOCH_MARKER.pack(EPOCH_MARKER_TAG, epoch, replica_id)


def parse_epoch_marker(value: bytes):
    """(epoch, replica id) of an epoch marker's value; None for any other value."""
    if len(value) != EPOCH_MARKER.size or value[0] != EPOCH_MARKER_TAG:
        return None
    return EPOCH_MARKER.unpack(value)[1:]

# Aborted transactions of a partition overlapping a fetched range: transaction number ``txn``'s batches
# lie at offsets [first, last) (``last`` is its abort marker's offset). Readers drop those batches.
ABORTED_DTYPE = np.dtype([("txn", "<i8"), ("first", "<i8"), ("last", "<i8")])
NO_ABORTED = np.empty(0, ABORTED_DTYPE)

NULL_LENGTH = -1
MAX_BATCH_BYTES = (1 << 31) - 1

# Kafka's record headers: per message a list of (key, value), keys UTF-8 and never null, values bytes or null
HEADERS_TYPE = pa.list_(pa.struct([pa.field("key", pa.string(), nullable=False), pa.field("value", pa.binary())]))
HEADERS_FIELD = pa.field("headers", HEADERS_TYPE)

# Arrow schema of decoded messages; the Spark connector adds topic and partition. ``decode(headers=True)``
# adds HEADERS_FIELD at the end.
SCHEMA = pa.schema(
    [
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("timestamp", pa.timestamp("ms"), nullable=False),
        pa.field("msgId", pa.int64(), nullable=False),
        pa.field("flag", pa.int32(), nullable=False),
        pa.field("attribute", pa.string()),
    ]
)


class RecordFormatError(ValueError):
    """Bytes that are not a valid batch: bad length, magic, count or checksum."""

    def __init__(self, message: str, position: int):
        super().__init__(message)
        self.position = position


MessageValueError = InvalidMessageError


@dataclass(frozen=True)
class BatchHeader:
    batch_len: int
    header_crc: int
    magic: int
    version: int
    attributes: int
    count: int
    base_offset: int
    base_msg_id: int
    timestamp: int
    body_crc: int
    txn: int  # broker transaction number that committed the batch; 0: a plain append
    producer_id: int = NO_PRODUCER  # version 3 (version 2 batches have none)
    producer_epoch: int = NO_PRODUCER
    base_sequence: int = NO_PRODUCER
    byte_base: int = -1  # version 3: the first message's MetaQ stream position; -1 in version 2

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.count

    @property
    def size(self) -> int:
        """This header's bytes: where the body starts."""
        return HEADER_SIZES[self.version]


_crc32c_extend = google_crc32c.extend


def crc(data, value: int = 0) -> int:
    """CRC-32C (Castagnoli, as in Kafka's record batch v2) of ``data``, continuing from ``value``: the one
    checksum of the format. google-crc32c uses the CPU's CRC instruction, about 5x zlib.crc32, and every
    consumer checks every body."""
    try:
        return _crc32c_extend(value, data)
    except TypeError:  # its C function takes bytes and numpy arrays, not memoryviews: view those with numpy
        return _crc32c_extend(value, np.frombuffer(data, np.uint8))


def _padding(n: int) -> int:
    return (-n) % ALIGN


# ---------------------------------------------------------------------------------------------------
# Encoding


def binary_column(values, name: str, nullable: bool) -> Optional[pa.Array]:
    """Normalise a column given as a sequence or an Arrow array to an Arrow binary/string array; a chunked
    array of several chunks stays chunked (``encode_body`` takes the chunks' bytes where they lie)."""
    if values is None:
        if not nullable:
            raise MessageValueError(f"{name} column is missing; every message needs a {name}")
        return None
    if isinstance(values, (str, bytes, bytearray, memoryview)):
        raise MessageValueError(f"{name}: expected a sequence with one entry per message, got a single "
                                f"{type(values).__name__}")
    if isinstance(values, np.ndarray) and values.dtype.kind not in "SUO":
        raise MessageValueError(f"{name}: a numpy array of {values.dtype} is not bytes; encode the values first")
    if isinstance(values, pa.ChunkedArray) and values.num_chunks <= 1:
        values = values.chunk(0) if values.num_chunks else values.combine_chunks()
    if not isinstance(values, (pa.Array, pa.ChunkedArray)):  # chunks stay apart: encode_body takes each
        try:
            values = pa.array(values, type=pa.string() if name == "attribute" else pa.binary())
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise MessageValueError(f"{name}: cannot be stored as {'UTF-8 text' if name == 'attribute' else 'bytes'}: {e}") from None
    if pa.types.is_large_binary(values.type) or pa.types.is_large_string(values.type):
        values = values.cast(pa.string() if pa.types.is_large_string(values.type) else pa.binary())
    if name == "attribute":
        if pa.types.is_binary(values.type):
            try:
                values = values.cast(pa.string())
            except pa.ArrowInvalid as e:
                raise MessageValueError(f"attribute: not valid UTF-8: {e}") from None
        if not pa.types.is_string(values.type):
            raise MessageValueError(f"attribute: expected strings, got Arrow type {values.type}")
    elif pa.types.is_string(values.type):
        values = values.cast(pa.binary())
    elif not pa.types.is_binary(values.type):
        raise MessageValueError(f"{name}: expected bytes, got Arrow type {values.type}")
    if not nullable and values.null_count:
        first = values.is_null().index(True).as_py()
        raise MessageValueError(f"{name} of message {first} is null; every message needs a value")
    return values


def _lengths_and_data(arr):
    """Per-message byte lengths (-1 for null) and the non-null bytes: one view per chunk, no copy."""
    if isinstance(arr, pa.ChunkedArray):
        pieces = [_lengths_and_data(c) for c in arr.chunks if len(c)]
        return np.concatenate([p[0] for p in pieces]), [d for p in pieces for d in p[1]]
    if arr.null_count:
        # Arrow lets a null slot own bytes; ours must not, so take the bytes of the valid slots only.
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
        compact_lengths, data = _lengths_and_data(arr.drop_null())
        lengths = np.full(len(arr), NULL_LENGTH, dtype=np.int32)
        lengths[valid] = compact_lengths
        return lengths, data
    n = len(arr)
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32, count=arr.offset + n + 1)[arr.offset:]
    data_buf = arr.buffers()[2]
    start, end = int(offsets[0]), int(offsets[-1])
    data = memoryview(data_buf)[start:end] if data_buf is not None else memoryview(b"")
    return np.diff(offsets).astype(np.int32), [data]


@dataclass
class EncodedBody:
    """A batch body ready to be stamped with offsets and written: buffers, their CRC, their size."""

    count: int
    attributes: int
    parts: list
    size: int
    crc: int
    message_sizes: np.ndarray  # bytes each message contributes (for byte budgets)
    max_message_size: int
    metaq_bytes: int = 0  # the batch's bytes in MetaQ's message-set layout (``metaq_sizes``)


def headers_column(headers, n: int) -> Optional[pa.Array]:
    """Record headers as an Arrow ``HEADERS_TYPE`` array of ``n`` entries (a null entry: no headers), from
    Arrow or from Python lists of (key, value) pairs; None when no message has one."""
    if headers is None:
        return None
    if isinstance(headers, pa.ChunkedArray):
        headers = headers.combine_chunks() if headers.num_chunks != 1 else headers.chunk(0)
    if not isinstance(headers, pa.Array):
        try:
            headers = pa.array(headers, type=HEADERS_TYPE)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as e:
            raise MessageValueError(f"headers: expected per message a list of (str key, bytes value) pairs: {e}") from None
    if headers.type != HEADERS_TYPE:
        try:
            headers = headers.cast(HEADERS_TYPE)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise MessageValueError(f"headers: Arrow type {headers.type} is not list<struct<key: string, "
                                    f"value: binary>>: {e}") from None
    if len(headers) != n:
        raise MessageValueError(f"headers column has {len(headers)} entries but value has {n}")
    counts = _list_counts(headers)
    if not counts.any():
        return None
    return headers


def _list_counts(arr: pa.ListArray) -> np.ndarray:
    """Entries per list (0 for a null list), vectorised."""
    offsets = arr.offsets.to_numpy()
    counts = np.diff(offsets).astype(np.int32)
    if arr.null_count:
        counts[~arr.is_valid().to_numpy(zero_copy_only=False)] = 0
    return counts


def _header_parts(headers: pa.ListArray):
    """(per-message counts, [key lengths, value lengths, key bytes, value bytes], per-message bytes)."""
    counts = _list_counts(headers)
    flat = headers.flatten()  # the headers of the non-null lists, in message order
    if flat.null_count:
        raise MessageValueError("headers: a header is null; each is a (key, value) pair")
    keys, values = flat.field("key"), flat.field("value")
    if keys.null_count:
        raise MessageValueError("headers: a header key is null; keys are strings")
    if keys.type != pa.string():
        keys = keys.cast(pa.string())
    key_len, key_data = _lengths_and_data(keys.cast(pa.binary()))
    value_len, value_data = _lengths_and_data(values)
    per_header = key_len.astype(np.int64) + np.maximum(value_len, 0) + 8
    cum = np.zeros(len(per_header) + 1, np.int64)
    np.cumsum(per_header, out=cum[1:])
    ends = np.cumsum(counts, dtype=np.int64)
    per_message = cum[ends] - cum[ends - counts]
    return counts, [key_len.astype("<i4", copy=False).tobytes(), value_len.astype("<i4", copy=False).tobytes()] \
        + list(key_data) + list(value_data), per_message


def metaq_sizes(value_len: np.ndarray, attr_len: Optional[np.ndarray]) -> np.ndarray:
    """Each message's bytes in MetaQ's message-set layout: a 20-byte head (msgLen, CRC32, id, flag), the
    attribute with its 4-byte length when it is not null, and the payload. Keys and headers have no place
    there. The unit of a partition's MetaQ byte positions (``byte_base``)."""
    sizes = value_len.astype(np.int64) + METAQ_MESSAGE_HEAD
    if attr_len is not None:
        sizes += np.where(attr_len >= 0, attr_len.astype(np.int64) + METAQ_ATTRIBUTE_HEAD, 0)
    return sizes


def _metaq_total(n: int, value_len: np.ndarray, attr_len: Optional[np.ndarray]) -> int:
    """``metaq_sizes(...).sum()`` without building the per-message array (the produce path's cost)."""
    total = METAQ_MESSAGE_HEAD * n + int(value_len.sum(dtype=np.int64))
    if attr_len is not None:
        present = attr_len >= 0
        total += int(attr_len.sum(dtype=np.int64, where=present)) + METAQ_ATTRIBUTE_HEAD * int(np.count_nonzero(present))
    return total


def encode_body(
    values,
    keys=None,
    attributes=None,
    flags: Union[None, Sequence[int], np.ndarray, pa.Array] = None,
    headers=None,
) -> EncodedBody:
    """Encode a batch body from column data (Python sequences or Arrow arrays); no per-message loop
    in Python for Arrow input. The header (offsets, ids, time) is added at append time. ``headers``:
    Kafka record headers (``headers_column``)."""
    value_arr = binary_column(values, "value", nullable=False)
    n = len(value_arr)
    if n == 0:
        raise MessageValueError("a batch needs at least one message")
    key_arr = binary_column(keys, "key", nullable=True)
    attr_arr = binary_column(attributes, "attribute", nullable=True)
    for name, arr in (("key", key_arr), ("attribute", attr_arr)):
        if arr is not None and len(arr) != n:
            raise MessageValueError(f"{name} column has {len(arr)} entries but value has {n}")
    if key_arr is not None and key_arr.null_count == n:
        key_arr = None
    if attr_arr is not None and attr_arr.null_count == n:
        attr_arr = None
    header_arr = headers_column(headers, n)

    if flags is None:
        flag_col = np.zeros(n, dtype=np.int32)
    else:
        if isinstance(flags, (pa.Array, pa.ChunkedArray)):
            if flags.null_count:
                raise MessageValueError("flag column has nulls; flags are integers")
            flags = flags.to_numpy(zero_copy_only=False)
        try:
            raw = np.asarray(flags)
        except (TypeError, ValueError) as e:
            raise MessageValueError(f"flag: {e}") from None
        if raw.shape != (n,):
            raise MessageValueError(f"flag column has shape {raw.shape} but value has {n} entries")
        if raw.dtype.kind not in "iub":
            raise MessageValueError(f"flag: expected integers, got {raw.dtype}")
        if raw.size and (raw.min() < -(1 << 31) or raw.max() >= (1 << 31)):
            raise MessageValueError("flag: values must fit in a signed 32-bit integer")
        flag_col = raw.astype("<i4")

    value_len, value_data = _lengths_and_data(value_arr)
    columns = [flag_col, value_len]
    data_parts = list(value_data)
    sizes = value_len.astype(np.int64)
    attr_bits = 0
    attr_len = None
    for bit, arr in ((HAS_KEYS, key_arr), (HAS_ATTRIBUTES, attr_arr)):
        if arr is None:
            continue
        lengths, data = _lengths_and_data(arr)
        attr_bits |= bit
        columns.append(lengths)
        data_parts.extend(data)
        sizes += np.maximum(lengths, 0)
        if bit == HAS_ATTRIBUTES:
            attr_len = lengths
    header_parts = []
    if header_arr is not None:
        counts, header_parts, header_bytes = _header_parts(header_arr)
        attr_bits |= HAS_HEADERS
        columns.append(counts)
        sizes += header_bytes

    max_message_size = int(sizes.max())
    sizes += 4 * len(columns)  # each message's share of the fixed-width columns
    parts = [c.astype("<i4", copy=False).tobytes() for c in columns] + [d for d in data_parts if len(d)]
    size = sum(len(p) for p in parts)
    if header_parts:  # the headers section starts 4-aligned: its length columns are read as int32
        if size % 4:
            parts.append(b"\0" * (-size % 4))
            size += -size % 4
        parts += [d for d in header_parts if len(d)]
        size += sum(len(d) for d in header_parts)
    pad = _padding(size)
    if pad:
        parts.append(b"\0" * pad)
        size += pad
    if HEADER_SIZE + size > MAX_BATCH_BYTES:
        raise MessageValueError(f"batch of {n} messages encodes to {HEADER_SIZE + size} bytes; the limit is {MAX_BATCH_BYTES}")
    body_crc = 0
    for p in parts:
        body_crc = crc(p, body_crc)
    return EncodedBody(n, attr_bits, parts, size, body_crc, sizes.astype(np.uint32), max_message_size,
                       _metaq_total(n, value_len, attr_len))


def _ncols(attributes) -> Union[int, np.ndarray]:
    """Fixed-width columns of a body with these attribute bits (int or vectorised)."""
    if isinstance(attributes, np.ndarray):
        return (2 + ((attributes & HAS_KEYS) != 0).astype(np.int64) + ((attributes & HAS_ATTRIBUTES) != 0)
                + ((attributes & HAS_HEADERS) != 0))
    return 2 + bool(attributes & HAS_KEYS) + bool(attributes & HAS_ATTRIBUTES) + bool(attributes & HAS_HEADERS)


def parse_body(count: int, attributes: int, body, body_crc: int) -> EncodedBody:
    """Check a batch body that a producer encoded (``encode_body``) and sent over the network: checksum,
    column lengths, padding, UTF-8 attributes and header keys, all vectorised. Raises RecordFormatError."""
    body = memoryview(body).cast("B")
    if count < 1:
        raise RecordFormatError(f"batch count must be at least 1, got {count}", 0)
    if attributes & ~BODY_ATTRIBUTE_BITS:
        raise RecordFormatError(f"unknown batch attributes {attributes:#x}", 0)
    if len(body) % ALIGN or HEADER_SIZE + len(body) > MAX_BATCH_BYTES:
        raise RecordFormatError(f"batch body of {len(body)} bytes is not a multiple of {ALIGN} or too large", 0)
    if crc(body) != body_crc:
        raise RecordFormatError("batch body checksum mismatch (damaged in transit?)", 0)
    has_headers = bool(attributes & HAS_HEADERS)
    ncols = _ncols(attributes)
    fixed = 4 * ncols * count
    if fixed > len(body):
        raise RecordFormatError(f"batch body of {len(body)} bytes is too short for {count} messages", 0)
    cols = np.frombuffer(body, dtype="<i4", count=ncols * count).reshape(ncols, count)
    lengths = cols[1:ncols - has_headers].astype(np.int64)
    if (lengths[0] < 0).any() or (lengths[1:] < NULL_LENGTH).any():
        raise RecordFormatError("batch body has a negative length", 0)
    data = np.maximum(lengths, 0)
    data_end = fixed + int(data.sum())
    sizes = data.sum(axis=0) + 4 * ncols
    end = data_end
    if has_headers:
        counts = cols[-1].astype(np.int64)
        if (counts < 0).any():
            raise RecordFormatError("batch body has a negative header count", 0)
        end, header_bytes = _check_headers(body, data_end + (-data_end % 4), counts)
        sizes += header_bytes
    if end + _padding(end) != len(body):
        raise RecordFormatError(f"batch body lengths add up to {end} bytes, the body has {len(body)}", 0)
    if attributes & HAS_ATTRIBUTES:
        _check_utf8(body, data_end - int(data[-1].sum()), data[-1], "an attribute")
    attr_len = lengths[-1] if attributes & HAS_ATTRIBUTES else None
    return EncodedBody(count, attributes, [body], len(body), body_crc, sizes.astype(np.uint32),
                       int((sizes - 4 * ncols).max()), _metaq_total(count, lengths[0], attr_len))


def _check_utf8(body, start: int, lengths: np.ndarray, what: str) -> None:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 1 << 31:
        raise RecordFormatError(f"{what} region is over 2 GiB", 0)
    try:
        pa.Array.from_buffers(pa.string(), len(lengths), [None, pa.py_buffer(offsets.astype(np.int32)),
                                                          pa.py_buffer(body[start:start + int(offsets[-1])])]
                              ).validate(full=True)
    except pa.ArrowInvalid:
        raise RecordFormatError(f"{what} is not valid UTF-8", 0) from None


def _check_headers(body, start: int, counts: np.ndarray) -> tuple:
    """Check a body's headers section at ``start`` (4-aligned) for per-message ``counts``; returns (its
    end, each message's header bytes)."""
    total = int(counts.sum())
    if start + 8 * total > len(body):
        raise RecordFormatError(f"batch body of {len(body)} bytes is too short for its {total} headers", 0)
    hl = np.frombuffer(body, dtype="<i4", count=2 * total, offset=start).reshape(2, total).astype(np.int64)
    if (hl[0] < 0).any() or (hl[1] < NULL_LENGTH).any():
        raise RecordFormatError("batch body has a negative header key or value length", 0)
    key_start = start + 8 * total
    end = key_start + int(hl[0].sum()) + int(np.maximum(hl[1], 0).sum())
    if end > len(body):
        raise RecordFormatError(f"batch body's headers run to byte {end} of {len(body)}", 0)
    _check_utf8(body, key_start, hl[0], "a header key")
    per_header = hl[0] + np.maximum(hl[1], 0) + 8
    cum = np.zeros(total + 1, np.int64)
    np.cumsum(per_header, out=cum[1:])
    ends = np.cumsum(counts)
    return end, cum[ends] - cum[ends - counts]


def encode_header(body: EncodedBody, base_offset: int, base_msg_id: int, timestamp_ms: int, txn: int = 0,
                  flags: int = 0, producer: tuple = (NO_PRODUCER, NO_PRODUCER, NO_PRODUCER),
                  byte_base: int = 0) -> bytes:
    """A version 3 header. ``flags``: TRANSACTIONAL or CONTROL (with ``txn``, the transaction's number), or
    0. ``producer``: (id, epoch, base sequence) of an idempotent producer's batch, -1s otherwise.
    ``byte_base``: the first message's position in the partition's MetaQ message stream."""
    batch_len = HEADER_SIZE + body.size
    tail = HEADER.pack(batch_len, 0, MAGIC, VERSION, body.attributes | flags, body.count, base_offset,
                       base_msg_id, timestamp_ms, body.crc, txn)[8:] + HEADER_V3.pack(producer[0], producer[1], 0,
                                                                                      producer[2], byte_base)
    return struct.pack("<II", batch_len, crc(tail)) + tail


# ---------------------------------------------------------------------------------------------------
# Reading


def parse_header(buf, pos: int = 0) -> BatchHeader:
    """Parse and check one batch header (version 2 or 3) at ``pos``; raises RecordFormatError naming what
    is wrong."""
    if len(buf) - pos < BASE_HEADER_SIZE:
        raise RecordFormatError(f"truncated batch header at byte {pos}: {len(buf) - pos} of {BASE_HEADER_SIZE} bytes", pos)
    fields = HEADER.unpack_from(buf, pos)
    magic, version = fields[2], fields[3]
    if magic == MAGIC and version == 1:  # checked before the checksum, which version 1 computed otherwise
        raise RecordFormatError(f"batch at byte {pos} is in format version 1 (CRC-32 checksums), written by an "
                                f"older metaq; this version reads only versions {VERSIONS} (CRC-32C)", pos)
    size = HEADER_SIZES.get(version, BASE_HEADER_SIZE) if magic == MAGIC else BASE_HEADER_SIZE
    if len(buf) - pos < size:
        raise RecordFormatError(f"truncated batch header at byte {pos}: {len(buf) - pos} of {size} bytes", pos)
    if crc(memoryview(buf)[pos + 8: pos + size]) != fields[1]:
        raise RecordFormatError(f"batch header checksum mismatch at byte {pos}", pos)
    if magic != MAGIC or version not in VERSIONS:
        raise RecordFormatError(f"unknown batch magic/version {magic:#x}/{version} at byte {pos}", pos)
    extra = ()
    if version >= 3:
        producer_id, producer_epoch, _, base_sequence, byte_base = HEADER_V3.unpack_from(buf, pos + BASE_HEADER_SIZE)
        extra = (producer_id, producer_epoch, base_sequence, byte_base)
    h = BatchHeader(*fields, *extra)
    known = KNOWN_ATTRIBUTE_BITS if version >= 3 else KNOWN_ATTRIBUTE_BITS & ~HAS_HEADERS
    if h.attributes & ~known:
        raise RecordFormatError(f"unknown batch attributes {h.attributes:#x} at byte {pos}", pos)
    if h.count < 1 or h.batch_len < size + 4 * _ncols(h.attributes) * h.count or h.batch_len % ALIGN:
        raise RecordFormatError(f"batch at byte {pos} has impossible length {h.batch_len} for {h.count} messages", pos)
    return h


def check_batch(buf, pos: int = 0) -> BatchHeader:
    """Parse a batch header and verify the body checksum; the batch must lie wholly inside ``buf``."""
    h = parse_header(buf, pos)
    end = pos + h.batch_len
    if end > len(buf):
        raise RecordFormatError(f"truncated batch at byte {pos}: needs {h.batch_len} bytes, {len(buf) - pos} present", pos)
    if crc(memoryview(buf)[pos + h.size: end]) != h.body_crc:
        raise RecordFormatError(f"batch body checksum mismatch at byte {pos}", pos)
    return h


def _gather(arr: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ranges of ``arr``: a view for one range, a memcpy per range for large ranges, one
    vectorised gather for many small ones."""
    if len(starts) == 1:
        s = int(starts[0])
        return arr[s: s + int(lengths[0])]
    total = int(lengths.sum())
    if total == 0:
        return arr[:0].copy()
    if total >= 256 * len(starts):
        return np.concatenate([arr[s: s + n] for s, n in zip(starts.tolist(), lengths.tolist())])
    out_starts = np.cumsum(lengths) - lengths
    idx = np.repeat(starts - out_starts, lengths) + np.arange(total, dtype=np.int64)
    return arr[idx]


HEADER_DTYPE = np.dtype([("batch_len", "<u4"), ("header_crc", "<u4"), ("magic", "<u2"), ("version", "u1"),
                          ("attributes", "u1"), ("count", "<u4"), ("base_offset", "<i8"), ("base_msg_id", "<i8"),
                          ("timestamp", "<i8"), ("body_crc", "<u4"), ("txn", "<u4")])
assert HEADER_DTYPE.itemsize == BASE_HEADER_SIZE
V3_DTYPE = np.dtype([("producer_id", "<i8"), ("producer_epoch", "<i2"), ("reserved", "<u2"),
                     ("base_sequence", "<i4"), ("byte_base", "<i8")])
assert V3_DTYPE.itemsize == HEADER_V3.size


def headers_at(u8: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The fields every version has (``HEADER_DTYPE``) of the batches at ``positions``: one gather."""
    return u8[positions[:, None] + np.arange(BASE_HEADER_SIZE)].reshape(-1).view(HEADER_DTYPE)


def header_sizes(h: np.ndarray) -> np.ndarray:
    """Each batch's header bytes (where its body starts), from its version."""
    return np.where(h["version"] >= 3, HEADER_SIZE, BASE_HEADER_SIZE).astype(np.int64)


def v3_fields(u8: np.ndarray, positions: np.ndarray, h: Optional[np.ndarray] = None) -> np.ndarray:
    """``V3_DTYPE`` fields of the batches at ``positions``; -1s for version 2 batches, which have none."""
    h = headers_at(u8, positions) if h is None else h
    out = np.full(len(positions), -1, V3_DTYPE)
    v3 = h["version"] >= 3
    if v3.any():
        at = positions[v3] + BASE_HEADER_SIZE
        out[v3] = u8[at[:, None] + np.arange(V3_DTYPE.itemsize)].reshape(-1).view(V3_DTYPE)
    return out


def body_starts(u8: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Where each batch's body starts (its header's size depends on its version)."""
    return positions + header_sizes(headers_at(u8, positions))


def empty_batch(headers: bool = False) -> pa.RecordBatch:
    schema = SCHEMA.append(HEADERS_FIELD) if headers else SCHEMA
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in schema], schema=schema)


def _per_group(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sums of consecutive runs of ``values`` of lengths ``counts`` (runs may be empty)."""
    cum = np.zeros(len(values) + 1, np.int64)
    np.cumsum(values, out=cum[1:])
    ends = np.cumsum(counts, dtype=np.int64)
    return cum[ends] - cum[ends - counts]


class _Layout:
    """Where every message's fields sit in a buffer of whole batches (versions 2 and 3 mixed). Within a
    batch each column (fixed or variable width) is one contiguous run, so a column is gathered as one range
    per batch: a view of the buffer when there is one batch, one memcpy per batch when batches are large."""

    def __init__(self, u8: np.ndarray, positions: np.ndarray):
        self.u8, self.positions = u8, positions
        self.h = h = headers_at(u8, positions)
        self.counts = counts = h["count"].astype(np.int64)
        attrs = h["attributes"]
        v3 = h["version"] == 3
        has_keys = (attrs & HAS_KEYS) != 0
        has_attrs = (attrs & HAS_ATTRIBUTES) != 0
        self.has_headers = has_headers = (attrs & HAS_HEADERS) != 0
        self.ncols = ncols = _ncols(attrs)
        self.hsize = hsize = header_sizes(h)
        unknown = np.where(v3, 0xFF ^ KNOWN_ATTRIBUTE_BITS, 0xFF ^ (KNOWN_ATTRIBUTE_BITS & ~HAS_HEADERS))
        bad = ((h["magic"] != MAGIC) | ~(v3 | (h["version"] == 2)) | ((attrs & unknown) != 0)
               | (counts < 1) | (h["batch_len"] % ALIGN != 0)
               | (h["batch_len"] < hsize + 4 * ncols * counts))
        if bad.any():
            parse_header(u8, int(positions[np.argmax(bad)]))  # raises, naming the field
        self.n = n = int(counts.sum())
        self.first_msg = first_msg = np.cumsum(counts) - counts

        # Batches start 8-aligned and columns are 4-byte ints, so one int32 view reads every column.
        self.i32 = i32 = u8[: len(u8) - len(u8) % 4].view("<i4")
        col_start = (positions + hsize) // 4

        def fixed_col(col_no, present: Optional[np.ndarray] = None, fill: int = NULL_LENGTH) -> Optional[np.ndarray]:
            starts = col_start + col_no * counts
            if present is None or present.all():
                return _gather(i32, starts, counts)
            if not present.any():
                return None  # no batch has this column: every entry is null
            out = np.full(n, fill, dtype=np.int32)
            out[np.repeat(present, counts)] = _gather(i32, starts[present], counts[present])
            return out

        zero = np.zeros(len(positions), dtype=np.int64)
        self.flags = fixed_col(zero)
        # value, key and attribute lengths (-1: null; None: all null), and each column's offsets and regions
        self.lengths = [fixed_col(zero + 1), fixed_col(zero + 2, has_keys), fixed_col(2 + has_keys, has_attrs)]
        self.header_counts = fixed_col(ncols - 1, has_headers, fill=0)
        if (self.lengths[0] < 0).any() or any(x is not None and (x < NULL_LENGTH).any() for x in self.lengths[1:]) \
                or (self.header_counts is not None and (self.header_counts < 0).any()):
            raise RecordFormatError(f"negative message length (batches from byte {int(positions[0])})",
                                    int(positions[0]))
        region = positions + hsize + 4 * ncols * counts
        self.regions = []
        for lengths in self.lengths:
            if lengths is None:
                self.regions.append(None)
                continue
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(np.maximum(lengths, 0), out=offsets[1:])
            totals = offsets[first_msg + counts] - offsets[first_msg]
            self.regions.append((offsets, region, totals))
            region = region + totals
        self.ends = positions + h["batch_len"].astype(np.int64)
        self._header_section = None
        if self.header_counts is not None:
            self.section = region + (-region % 4)  # the headers section starts 4-aligned
            region = np.where(has_headers, self._headers()["end"], region)
        if (region > self.ends).any():
            raise RecordFormatError(f"message lengths overrun their batch (batches from byte {int(positions[0])})",
                                    int(positions[0]))

    def _headers(self) -> dict:
        """The headers sections of the batches that have one: lengths of every header's key and value, and
        where each batch's key and value bytes lie."""
        if self._header_section is None:
            hb = self.has_headers
            per_batch = _per_group(self.header_counts, self.counts)[hb]
            sec = self.section[hb]
            if (sec + 8 * per_batch > self.ends[hb]).any():
                raise RecordFormatError("a headers section overruns its batch", int(self.positions[0]))
            klen = _gather(self.i32, sec // 4, per_batch).astype(np.int64)
            vlen = _gather(self.i32, sec // 4 + per_batch, per_batch).astype(np.int64)
            if (klen < 0).any() or (vlen < NULL_LENGTH).any():
                raise RecordFormatError("negative header length", int(self.positions[0]))
            key_totals = _per_group(klen, per_batch)
            value_totals = _per_group(np.maximum(vlen, 0), per_batch)
            keys_at = sec + 8 * per_batch
            end = np.zeros(len(hb), np.int64)
            end[hb] = keys_at + key_totals + value_totals
            self._header_section = dict(klen=klen, vlen=vlen, keys_at=keys_at, key_totals=key_totals,
                                        values_at=keys_at + key_totals, value_totals=value_totals, end=end)
        return self._header_section

    def per_message(self, per_batch: np.ndarray) -> np.ndarray:
        return np.repeat(per_batch, self.counts)

    def numbered(self, base: np.ndarray) -> np.ndarray:
        """base[b] + i for message i of batch b: offsets and message ids."""
        return self.per_message(base - self.first_msg) + np.arange(self.n, dtype=np.int64)

    def message_sizes(self) -> np.ndarray:
        """Each message's encoded bytes: keys, values, attributes, headers (8 bytes of lengths each) and its
        column entries (the index's ``size``)."""
        sizes = sum(np.maximum(x, 0).astype(np.int64) for x in self.lengths if x is not None)
        if self.header_counts is not None:
            hs = self._headers()
            sizes = sizes + _per_group(hs["klen"] + np.maximum(hs["vlen"], 0) + 8, self.header_counts)
        return sizes + 4 * self.per_message(self.ncols)

    def metaq_bytes(self) -> np.ndarray:
        """Each batch's bytes in MetaQ's message-set layout (``metaq_sizes``)."""
        return _per_group(metaq_sizes(self.lengths[0], self.lengths[2]), self.counts)

    def column(self, which: int, typ) -> pa.Array:
        """Column ``which`` (0 value, 1 key, 2 attribute) as an Arrow binary/string array."""
        if self.regions[which] is None:
            return pa.nulls(self.n, typ)
        offsets, region, totals = self.regions[which]
        return _binary(typ, self.n, self.lengths[which] if which else None, offsets,
                       _gather(self.u8, region, totals))

    def headers_column(self) -> pa.Array:
        """Every message's record headers (``HEADERS_TYPE``; an empty list where it has none)."""
        counts = self.header_counts if self.header_counts is not None else np.zeros(self.n, np.int32)
        list_offsets = np.zeros(self.n + 1, np.int64)
        np.cumsum(counts, out=list_offsets[1:])
        if list_offsets[-1] == 0:
            struct = pa.StructArray.from_arrays([pa.array([], pa.string()), pa.array([], pa.binary())],
                                                fields=list(HEADERS_TYPE.value_type))
        else:
            hs = self._headers()
            koff = np.zeros(len(hs["klen"]) + 1, np.int64)
            np.cumsum(hs["klen"], out=koff[1:])
            voff = np.zeros(len(hs["vlen"]) + 1, np.int64)
            np.cumsum(np.maximum(hs["vlen"], 0), out=voff[1:])
            keys = _binary(pa.string(), len(hs["klen"]), None, koff, _gather(self.u8, hs["keys_at"], hs["key_totals"]))
            values = _binary(pa.binary(), len(hs["vlen"]), hs["vlen"], voff,
                             _gather(self.u8, hs["values_at"], hs["value_totals"]))
            struct = pa.StructArray.from_arrays([keys, values], fields=list(HEADERS_TYPE.value_type))
        return pa.ListArray.from_arrays(pa.array(list_offsets.astype(np.int32)), struct, type=HEADERS_TYPE)


def _binary(typ, n: int, lengths: Optional[np.ndarray], offsets: np.ndarray, data: np.ndarray) -> pa.Array:
    """An Arrow binary/string array from int64 ``offsets`` and ``data``; ``lengths`` < 0 are nulls."""
    if offsets[-1] > MAX_BATCH_BYTES:
        raise RecordFormatError("decoded column exceeds 2 GiB; fetch a smaller range", 0)
    validity, null_count = None, 0
    if lengths is not None:
        valid = lengths >= 0
        null_count = n - int(np.count_nonzero(valid))
        if null_count:
            validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(typ, n, [validity, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)],
                                 null_count=null_count)


_LEN_AND_CRC = struct.Struct("<II")
_BODY_CRC = struct.Struct("<I")
_VERSION_AT = 10


def _batch_positions(u8: np.ndarray, verify: bool) -> np.ndarray:
    """Walk the batch headers (one cheap step per batch), checking the header checksum and, with
    ``verify``, the body checksum. Field-by-field checks happen vectorised in ``_Layout``; on any
    failure ``check_batch`` re-reads the batch to say exactly what is wrong."""
    size, pos = len(u8), 0
    out = []
    unpack = _LEN_AND_CRC.unpack_from
    sizes = HEADER_SIZES
    while pos < size:
        if size - pos < HEADER_SIZE:
            check_batch(u8, pos)
        batch_len, header_crc = unpack(u8, pos)
        hsize = sizes.get(int(u8[pos + _VERSION_AT]), BASE_HEADER_SIZE)
        end = pos + batch_len
        if crc(u8[pos + 8: pos + hsize]) != header_crc or batch_len < hsize or end > size or (
                verify and crc(u8[pos + hsize: end]) != _BODY_CRC.unpack_from(u8, pos + 40)[0]):
            check_batch(u8, pos)  # raises the precise error
            raise RecordFormatError(f"bad batch at byte {pos}", pos)
        out.append(pos)
        pos = end
    return np.array(out, dtype=np.int64)


def index_columns(u8: np.ndarray, positions: np.ndarray):
    """For the offset index: each message's encoded size, and each batch's count, time and length; and for
    the MetaQ stream, each batch's MetaQ bytes and ``byte_base`` (-1 in version 2)."""
    layout = _Layout(u8, np.asarray(positions, dtype=np.int64))
    return (layout.message_sizes(), layout.counts, layout.h["timestamp"], layout.h["batch_len"],
            layout.metaq_bytes(), v3_fields(u8, layout.positions, layout.h)["byte_base"])


def metaq_message_sizes(u8: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Every message's size in MetaQ's message-set layout (``metaq_sizes``), markers and transactional ones
    included, of the whole batches at ``positions``: what a message adds to a MetaQ byte position."""
    layout = _Layout(u8, np.asarray(positions, dtype=np.int64))
    return metaq_sizes(layout.lengths[0], layout.lengths[2])


def stream_ends(byte_base: np.ndarray, metaq_bytes: np.ndarray, anchor: int) -> np.ndarray:
    """Where each batch ends in the partition's MetaQ message stream: a version 3 batch starts at its
    ``byte_base``, a version 2 batch (``byte_base`` -1) where the batch before it ends, the first one at
    ``anchor`` (docs/storage-format.md, section 3.5). Vectorised."""
    base = np.asarray(byte_base, np.int64).copy()
    if base[0] < 0:
        base[0] = anchor
    index = np.where(base >= 0, np.arange(len(base)), 0)
    np.maximum.accumulate(index, out=index)
    before = np.cumsum(metaq_bytes, dtype=np.int64) - metaq_bytes
    return base[index] + before - before[index] + metaq_bytes


def committed_positions(u8: np.ndarray, positions: np.ndarray, aborted: Optional[np.ndarray] = None) -> np.ndarray:
    """The batches a reader returns: not markers, not of an aborted transaction (``ABORTED_DTYPE``
    entries). Vectorised over the batch headers, never a step per message."""
    if not len(positions):
        return positions
    h = headers_at(u8, positions)
    drop = (h["attributes"] & CONTROL) != 0
    if aborted is not None and len(aborted):
        txn = np.where((h["attributes"] & TRANSACTIONAL) != 0, h["txn"].astype(np.int64), -1)
        base = h["base_offset"]
        hit = ((txn[:, None] == aborted["txn"][None, :]) & (base[:, None] >= aborted["first"][None, :])
               & (base[:, None] < aborted["last"][None, :]))
        drop |= hit.any(axis=1)
    return positions[~drop] if drop.any() else positions


def decode(buf, start_offset: Optional[int] = None, end_offset: Optional[int] = None, verify: bool = True,
           positions: Optional[np.ndarray] = None, aborted: Optional[np.ndarray] = None,
           headers: bool = False) -> pa.RecordBatch:
    """Decode the whole batches in ``buf`` to an Arrow RecordBatch with ``SCHEMA`` (and ``headers``, Kafka
    record headers, when asked), keeping offsets in [start_offset, end_offset). Transaction markers and the
    batches of ``aborted`` transactions (``ABORTED_DTYPE``, as a fetch reply lists them) are left out:
    their offsets are gaps.

    With ``verify`` each batch's checksums are checked (one CRC-32C call per batch). ``positions`` (where
    each batch starts, e.g. from the broker's index) lets an unverified decode skip the header walk.
    Everything per message is numpy or Arrow work; values, keys and attributes of a single batch are
    views of ``buf``, never copies."""
    u8 = buf.view(np.uint8).reshape(-1) if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if positions is None or verify:
        positions = _batch_positions(u8, verify)
    positions = committed_positions(u8, np.asarray(positions, dtype=np.int64), aborted)
    if len(positions) == 0:
        return empty_batch(headers)
    L = _Layout(u8, positions)
    offsets_col = L.numbered(L.h["base_offset"])
    columns = [
        L.column(1, pa.binary()),
        L.column(0, pa.binary()),
        pa.array(offsets_col, pa.int64()),
        pa.array(L.per_message(L.h["timestamp"]), pa.int64()).cast(pa.timestamp("ms")),
        pa.array(L.numbered(L.h["base_msg_id"]), pa.int64()),
        pa.array(L.flags, pa.int32()),
        L.column(2, pa.string()),
    ]
    schema = SCHEMA
    if headers:
        columns.append(L.headers_column())
        schema = SCHEMA.append(HEADERS_FIELD)
    batch = pa.RecordBatch.from_arrays(columns, schema=schema)
    lo = 0 if start_offset is None else int(np.searchsorted(offsets_col, start_offset, "left"))
    hi = L.n if end_offset is None else int(np.searchsorted(offsets_col, end_offset, "left"))
    if lo or hi != L.n:
        batch = batch.slice(lo, max(hi - lo, 0))
    return batch
