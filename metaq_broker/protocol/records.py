"""The record-batch format: how an appended batch of messages is laid out in bytes.

One append becomes one batch: a 72-byte header (version 3; version 2's was its first 48 bytes, and version 2
batches stay readable everywhere) followed by a columnar body: per-message integer columns (value, key and
attribute lengths, header counts, create times, flags), each in the narrowest width that holds its batch's
entries (so a 100-byte value costs one byte of length), then each variable-width column's bytes back to
back, then the batch's record headers, columnar too. The same bytes are stored in segment files and sent to
consumers, so the broker never re-encodes, and a consumer turns any run of batches into Arrow arrays with
numpy and Arrow kernels instead of a Python loop per message: the only Python loop is one step per batch, to
check its checksums. docs/storage-format.md gives the layout byte by byte.

Every checksum is CRC-32C and goes through ``crc``.
"""
from __future__ import annotations

import functools
import struct
import time
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import google_crc32c
import numpy as np
import pyarrow as pa

from metaq_broker.errors import InvalidMessageError

MAGIC = 0x4D51  # u16 at byte 8, stored little-endian: the bytes 51 4D
VERSION = 3  # what is written. 1 used CRC-32 (zlib); 2 uses CRC-32C; 3 adds the producer and MetaQ byte
# fields, narrow columns, null values, create times and record headers
VERSIONS = (2, 3)  # what is read
HEADER = struct.Struct("<IIHBBIqqqII")  # the fields of every version (version 2's whole header)
BASE_HEADER_SIZE = HEADER.size  # 48
assert BASE_HEADER_SIZE == 48
# Version 3 goes on: producer id (-1: none), producer epoch (-1: none), the body's column widths
# (``layout``), base sequence (-1: none), and the batch's first message's position in the partition's MetaQ
# message stream (``metaq_bytes``).
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
# Where the stream continues at a segment without a position to go on from (version 2 batches, a replica's
# reset): this times the segment's logical start. A message takes at most 20 times its log bytes in MetaQ's
# layout (a null value: a 20-byte head against a 1-byte length), so positions stay below the next segment's.
METAQ_ANCHOR = 20

# Batch attribute bits. Those of BODY_ATTRIBUTE_BITS describe the body (a producer sets them); two are the
# broker's: TRANSACTIONAL marks the batch of an unsettled-at-append transaction (its number in ``txn``),
# CONTROL a marker, which no reader returns: a transaction's (its number in ``txn``, one message:
# COMMIT_MARKER or ABORT_MARKER), or with ``txn`` 0 an epoch marker (``epoch_marker``; replication).
HAS_KEYS = 0x1
HAS_ATTRIBUTES = 0x2
TRANSACTIONAL = 0x4
CONTROL = 0x8
HAS_HEADERS = 0x10  # version 3: a header-count column and the batch's headers section (Kafka record headers)
NO_FLAGS = 0x20  # version 3: no flag column, every message's flag is 0 (version 2 always has one)
HAS_TIMESTAMPS = 0x40  # version 3: a create-time column (Kafka's CreateTime); without, a message's time is
# its batch's store time (Kafka's LogAppendTime)
V3_ATTRIBUTE_BITS = HAS_HEADERS | NO_FLAGS | HAS_TIMESTAMPS
BODY_ATTRIBUTE_BITS = HAS_KEYS | HAS_ATTRIBUTES | V3_ATTRIBUTE_BITS
KNOWN_ATTRIBUTE_BITS = BODY_ATTRIBUTE_BITS | TRANSACTIONAL | CONTROL

# Version 3's ``layout`` (header bytes 58-59): a 2-bit width code per integer column of the body, column
# ``c`` at bits 2c..2c+1. Code 0 is i32, so layout 0 is version 2's columns (all i32); 3 (i64) only for
# create-time deltas. An absent column's code is 0. ``EncodedBody.attributes`` (and a Put's attributes)
# carry the layout above LAYOUT_SHIFT, the attribute bits below.
WIDTHS = np.array([4, 1, 2, 8], np.int64)  # width code -> bytes
INT_DTYPES = ("<i4", "<i1", "<i2", "<i8")  # width code -> little-endian signed integer
VALUE_LEN, KEY_LEN, ATTRIBUTE_LEN, HEADER_COUNT, HEADER_KEY_LEN, HEADER_VALUE_LEN, TIME_DELTA = range(7)
COLUMN_BITS = (0, HAS_KEYS, HAS_ATTRIBUTES, HAS_HEADERS, HAS_HEADERS, HAS_HEADERS, HAS_TIMESTAMPS)  # 0: always
LAYOUT_SHIFT = 16
MAX_TIMESTAMP = 1 << 62  # create times are ms in [0, MAX_TIMESTAMP): a base and a delta add up within i64
CREATE_TIME, LOG_APPEND_TIME = 0, 1  # a message's timestampType, as Kafka's and Spark's Kafka source's
TIMESTAMP_TYPE_NAMES = ("CreateTime", "LogAppendTime")  # Kafka's names of them
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

TIMESTAMP_TYPE_FIELD = pa.field("timestampType", pa.int32(), nullable=False)

# Arrow schema of decoded messages; the Spark connector adds topic and partition. ``decode`` adds
# HEADERS_FIELD and TIMESTAMP_TYPE_FIELD at the end when asked (``schema``). A null value is a Kafka
# tombstone; ``timestamp`` is the create time where the producer gave one, else the store time.
SCHEMA = pa.schema(
    [
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("timestamp", pa.timestamp("ms"), nullable=False),
        pa.field("msgId", pa.int64(), nullable=False),
        pa.field("flag", pa.int32(), nullable=False),
        pa.field("attribute", pa.string()),
    ]
)


def schema(headers: bool = False, timestamp_type: bool = False) -> pa.Schema:
    """``SCHEMA``, with the ``headers`` and ``timestampType`` columns when asked (``decode``)."""
    out = SCHEMA.append(HEADERS_FIELD) if headers else SCHEMA
    return out.append(TIMESTAMP_TYPE_FIELD) if timestamp_type else out


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
    layout: int = 0  # version 3: the body's column widths (``WIDTHS``); 0 (all i32) in version 2

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.count

    @property
    def size(self) -> int:
        """This header's bytes: where the body starts."""
        return HEADER_SIZES[self.version]

    @property
    def body_attributes(self) -> int:
        """The body's attribute bits and layout, as ``EncodedBody.attributes`` (what ``parse_body`` takes)."""
        return (self.attributes & BODY_ATTRIBUTE_BITS) | self.layout << LAYOUT_SHIFT


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


def binary_column(values, name: str, required: bool = False) -> Optional[pa.Array]:
    """Normalise a column given as a sequence or an Arrow array to an Arrow binary/string array (None
    entries are nulls); a chunked array of several chunks stays chunked (``encode_body`` takes the chunks'
    bytes where they lie). A column that is not given is None, or an error when ``required``."""
    if values is None:
        if required:
            raise MessageValueError(f"{name} column is missing; every message needs a {name} (None for a "
                                    f"null {name})")
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
    if pa.types.is_null(values.type):  # every entry None
        values = values.cast(pa.string() if name == "attribute" else pa.binary())
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
    return values


def flags_column(flags, n: int) -> Optional[np.ndarray]:
    """MetaQ's per-message flags as i32, checked; None when there are none or all are 0 (no flag column)."""
    if flags is None:
        return None
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
    return raw.astype("<i4") if raw.any() else None


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def timestamps_column(timestamps, n: int) -> Optional[np.ndarray]:
    """Create times (Kafka's CreateTime) as i64 ms since the epoch, from ints, datetimes, numpy datetime64
    or Arrow timestamps (a finer unit is truncated to ms); a null entry takes the time now, as Kafka's
    producer stamps a record given none. None when not given: the messages take their store time."""
    if timestamps is None:
        return None
    if isinstance(timestamps, (int, str, bytes)) or not hasattr(timestamps, "__len__"):
        raise MessageValueError(f"timestamps: expected a sequence with one entry per message, got a single "
                                f"{type(timestamps).__name__}")
    if isinstance(timestamps, np.ndarray) and timestamps.dtype.kind in "iuM":
        if timestamps.dtype.kind == "u" and timestamps.size and timestamps.max() >= MAX_TIMESTAMP:
            timestamps = np.minimum(timestamps, MAX_TIMESTAMP)  # not to wrap to a negative int64: refused below
        ms = timestamps.astype("datetime64[ms]").astype(np.int64) if timestamps.dtype.kind == "M" \
            else timestamps.astype(np.int64)
    else:
        arr = timestamps
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        if not isinstance(arr, pa.Array):
            try:
                arr = pa.array(arr, type=pa.timestamp("ms"))
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
                raise MessageValueError(f"timestamps: expected ms since the epoch or datetimes: {e}") from None
        if pa.types.is_timestamp(arr.type):
            arr = arr.cast(pa.timestamp("ms", arr.type.tz), safe=False)
        elif not pa.types.is_integer(arr.type):
            raise MessageValueError(f"timestamps: expected integers (ms since the epoch) or timestamps, got "
                                    f"Arrow type {arr.type}")
        if arr.null_count:
            arr = arr.cast(pa.int64()).fill_null(now_ms())
        ms = arr.cast(pa.int64()).to_numpy(zero_copy_only=False)
    if len(ms) != n:
        raise MessageValueError(f"timestamps column has {len(ms)} entries but value has {n}")
    bad = (ms < 0) | (ms >= MAX_TIMESTAMP)
    if bad.any():
        first = int(np.argmax(bad))
        raise MessageValueError(f"timestamp of message {first} is {int(ms[first])}; create times are ms since "
                                f"the epoch, from 0 to 2^62")
    return ms


def _width_code(largest: int) -> int:
    """The code of the narrowest signed width that holds every entry from -1 to ``largest``."""
    return 1 if largest < 1 << 7 else 2 if largest < 1 << 15 else 0 if largest < 1 << 31 else 3


def _narrow(column: np.ndarray, field: int):
    """``column`` in its narrowest width: (its bytes, its layout bits, its width)."""
    code = _width_code(int(column.max()) if len(column) else 0)
    return column.astype(INT_DTYPES[code]).tobytes(), code << (2 * field), int(WIDTHS[code])


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


def check_batch_size(n: int, body_size: int) -> None:
    """Refuse a body of ``n`` messages whose batch (header and body) would pass ``MAX_BATCH_BYTES``."""
    if HEADER_SIZE + body_size > MAX_BATCH_BYTES:
        raise MessageValueError(f"batch of {n} messages encodes to {HEADER_SIZE + body_size} bytes; the limit is "
                                f"{MAX_BATCH_BYTES}")


@dataclass
class EncodedBody:
    """A batch body ready to be stamped with offsets and written: buffers, their CRC, their size."""

    count: int
    attributes: int  # the header's attribute bits, and its layout above LAYOUT_SHIFT
    parts: list
    size: int
    crc: int
    message_sizes: np.ndarray  # bytes each message contributes (for byte budgets)
    max_message_size: int
    metaq_bytes: int = 0  # the batch's bytes in MetaQ's message-set layout (``metaq_sizes``)
    # Where its keys are, for the key index (``body_keys``): the key Arrow array (``encode_body``), or the
    # key lengths (-1: null) and where the key bytes start in ``parts[0]`` (``parse_body``); None: no keys.
    keys: object = None
    # (earliest, latest) create time of its messages (ms), for the time index's skew bounds; None: no
    # create-time column (every message's time is its batch's store time)
    create_times: Optional[tuple] = None


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


def _header_section(headers: pa.ListArray):
    """(per-message counts, the headers section's parts, its layout bits, per-message bytes)."""
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
    key_col, key_bits, key_width = _narrow(key_len, HEADER_KEY_LEN)
    value_col, value_bits, value_width = _narrow(value_len, HEADER_VALUE_LEN)
    per_header = key_len.astype(np.int64) + np.maximum(value_len, 0) + key_width + value_width
    return counts, [key_col, value_col] + list(key_data) + list(value_data), key_bits | value_bits, \
        _per_group(per_header, counts)


def metaq_sizes(value_len: np.ndarray, attr_len: Optional[np.ndarray]) -> np.ndarray:
    """Each message's bytes in MetaQ's message-set layout: a 20-byte head (msgLen, CRC32, id, flag), the
    attribute with its 4-byte length when it is not null, and the payload (none for a null value). Keys
    and headers have no place there. The unit of a partition's MetaQ byte positions (``byte_base``)."""
    sizes = np.maximum(value_len, 0).astype(np.int64) + METAQ_MESSAGE_HEAD
    if attr_len is not None:
        sizes += np.where(attr_len >= 0, attr_len.astype(np.int64) + METAQ_ATTRIBUTE_HEAD, 0)
    return sizes


def _metaq_total(n: int, value_bytes: int, attr_len: Optional[np.ndarray]) -> int:
    """``metaq_sizes(...).sum()`` without building the per-message array (the produce path's cost), from
    the batch's value bytes."""
    total = METAQ_MESSAGE_HEAD * n + value_bytes
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
    timestamps=None,
) -> EncodedBody:
    """Encode a batch body from column data (Python sequences or Arrow arrays); no per-message loop
    in Python for Arrow input. The header (offsets, ids, store time) is added at append time. A None value
    is a null value (a Kafka tombstone); the value column itself is required. ``headers``: Kafka record
    headers (``headers_column``); ``timestamps``: create times (``timestamps_column``)."""
    value_arr = binary_column(values, "value", required=True)
    n = len(value_arr)
    if n == 0:
        raise MessageValueError("a batch needs at least one message")
    key_arr = binary_column(keys, "key")
    attr_arr = binary_column(attributes, "attribute")
    for name, arr in (("key", key_arr), ("attribute", attr_arr)):
        if arr is not None and len(arr) != n:
            raise MessageValueError(f"{name} column has {len(arr)} entries but value has {n}")
    if key_arr is not None and key_arr.null_count == n:
        key_arr = None
    if attr_arr is not None and attr_arr.null_count == n:
        attr_arr = None
    header_arr = headers_column(headers, n)
    flag_col = flags_column(flags, n)
    times = timestamps_column(timestamps, n)

    bits, layout, column_bytes = NO_FLAGS if flag_col is None else 0, 0, 0
    columns, data_parts = [], []
    if flag_col is not None:
        columns.append(flag_col.tobytes())
        column_bytes += 4
    sizes = None  # each message's data bytes
    attr_len = None
    for field, bit, arr in ((VALUE_LEN, 0, value_arr), (KEY_LEN, HAS_KEYS, key_arr),
                            (ATTRIBUTE_LEN, HAS_ATTRIBUTES, attr_arr)):
        if arr is None:
            continue
        lengths, data = _lengths_and_data(arr)
        col, col_layout, width = _narrow(lengths, field)
        columns.append(col)
        bits, layout, column_bytes = bits | bit, layout | col_layout, column_bytes + width
        data_parts.extend(data)
        nonnegative = np.maximum(lengths, 0) if arr.null_count else lengths
        sizes = nonnegative.astype(np.int64) if sizes is None else sizes + nonnegative
        if field == VALUE_LEN:
            value_bytes = int(sizes.sum())
        elif field == ATTRIBUTE_LEN:
            attr_len = lengths
    header_parts = []
    if header_arr is not None:
        counts, header_parts, header_layout, header_bytes = _header_section(header_arr)
        col, col_layout, width = _narrow(counts, HEADER_COUNT)
        columns.append(col)
        bits, layout, column_bytes = bits | HAS_HEADERS, layout | col_layout | header_layout, column_bytes + width
        sizes += header_bytes
    if times is not None:
        base = int(times.min())
        col, col_layout, width = _narrow(times - base, TIME_DELTA)
        columns.append(struct.pack("<q", base) + col)
        bits, layout, column_bytes = bits | HAS_TIMESTAMPS, layout | col_layout, column_bytes + width

    max_message_size = int(sizes.max())
    sizes += column_bytes  # each message's share of the integer columns
    parts = columns + [d for d in data_parts if len(d)] + [d for d in header_parts if len(d)]
    size = sum(len(p) for p in parts)
    pad = _padding(size)
    if pad:
        parts.append(b"\0" * pad)
        size += pad
    check_batch_size(n, size)
    body_crc = 0
    for p in parts:
        body_crc = crc(p, body_crc)
    return EncodedBody(n, bits | layout << LAYOUT_SHIFT, parts, size, body_crc, sizes.astype(np.uint32),
                       max_message_size, _metaq_total(n, value_bytes, attr_len), key_arr,
                       None if times is None else (base, int(times.max())))


# A body's integer columns, one row each, in their order: flag, value length, key length, attribute length,
# header count, create time. Per row: the attribute bit that says it is there, or with _COLUMN_INVERT that
# it is not (the flag column; the value column, with no bit, is always there), where its width code lies in
# the layout (the flag column: bits 14-15, which are 0: i32), and the bytes before its entries (the create
# times' base).
_COLUMN_BIT = np.array([[NO_FLAGS], [0], [HAS_KEYS], [HAS_ATTRIBUTES], [HAS_HEADERS], [HAS_TIMESTAMPS]])
_COLUMN_INVERT = np.array([[True], [True], [False], [False], [False], [False]])
_COLUMN_SHIFT = np.array([[14], [2 * VALUE_LEN], [2 * KEY_LEN], [2 * ATTRIBUTE_LEN], [2 * HEADER_COUNT],
                          [2 * TIME_DELTA]])
_COLUMN_BASE = np.array([[0], [0], [0], [0], [0], [8]])
FLAG_COL, VALUE_COL, KEY_COL, ATTRIBUTE_COL, HEADER_COUNT_COL, TIME_COL = range(6)


def _columns(attributes: np.ndarray, layout: np.ndarray) -> tuple:
    """(present, width code, bytes) of each integer column (rows) of each body (columns) with these
    attribute bits and layouts; bytes: its entries' (one per message) and, for create times, its base's."""
    present = ((attributes & _COLUMN_BIT) != 0) ^ _COLUMN_INVERT
    code = (layout >> _COLUMN_SHIFT) & 3
    return present, code, present * WIDTHS[code], present * _COLUMN_BASE


def _fixed_size(attributes: np.ndarray, layout: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Bytes of each body's integer columns: where its data starts."""
    _, _, entry, base = _columns(attributes, layout)
    return (entry * counts + base).sum(axis=0)


# Per layout field (rows, bits 2f..2f+1): the attribute bit of its column (0: always there), and whether
# its code may be 3 (i64)
_FIELD_BIT = np.array([[bit] for bit in COLUMN_BITS])
_FIELD_SHIFT = np.arange(0, 14, 2)[:, None]
_FIELD_I64 = (np.arange(7) == TIME_DELTA)[:, None]


def _bad_layout(attributes: np.ndarray, layout: np.ndarray) -> np.ndarray:
    """Layouts that are not possible with these attribute bits (vectorised over bodies): a code for an
    absent column, i64 for a length or count, bits 14-15 set."""
    code = (layout >> _FIELD_SHIFT) & 3
    absent = ((attributes & _FIELD_BIT) == 0) & (_FIELD_BIT != 0)
    return ((absent & (code != 0)) | (~_FIELD_I64 & (code == 3))).any(axis=0) | ((layout >> 14) != 0)


@functools.lru_cache(maxsize=4096)
def _plan(attributes: int, layout: int) -> Optional[tuple]:
    """One body's integer columns (the rows of ``_columns``) in Python ints: (present, width code, entry
    bytes, base bytes) each; None when the layout is impossible with these bits. Cached: producers send few
    kinds of body."""
    a, lay = np.array([attributes]), np.array([layout])
    if _bad_layout(a, lay)[0]:
        return None
    return tuple(zip(*(x[:, 0].tolist() for x in _columns(a, lay))))


def parse_body(count: int, attributes: int, body, body_crc: int) -> EncodedBody:
    """Check a batch body that a producer encoded (``encode_body``) and sent over the network: checksum,
    layout, column lengths, padding, UTF-8 attributes and header keys, create times, all vectorised.
    ``attributes``: as ``EncodedBody.attributes`` (bits and layout). Raises RecordFormatError.

    The checks are ``_Layout``'s, for one body: its column arithmetic in Python ints (``_plan``) and a few
    numpy calls over its messages, where ``_Layout``'s per-batch arrays would cost a Put ~50 us more."""
    body = memoryview(body).cast("B")
    bits, layout, size = attributes & 0xFFFF, attributes >> LAYOUT_SHIFT, len(body)
    if count < 1:
        raise RecordFormatError(f"batch count must be at least 1, got {count}", 0)
    if bits & ~BODY_ATTRIBUTE_BITS:
        raise RecordFormatError(f"unknown batch attributes {bits:#x}", 0)
    plan = _plan(bits, layout)
    if plan is None:
        raise RecordFormatError(f"batch layout {layout:#x} is impossible with attributes {bits:#x}", 0)
    if size % ALIGN or HEADER_SIZE + size > MAX_BATCH_BYTES:
        raise RecordFormatError(f"batch body of {size} bytes is not a multiple of {ALIGN} or too large", 0)
    if crc(body) != body_crc:
        raise RecordFormatError("batch body checksum mismatch (damaged in transit?)", 0)
    columns, pos, time_base = [], 0, 0
    for present, code, entry, base in plan:
        columns.append(None)
        if not present:
            continue
        if pos + base + entry * count > size:
            raise RecordFormatError(f"batch body of {size} bytes is too short for the integer columns of {count} "
                                    f"messages", 0)
        if base:
            time_base = struct.unpack_from("<q", body, pos)[0]
        columns[-1] = np.frombuffer(body, INT_DTYPES[code], count, pos + base).astype(np.int64)
        pos += base + entry * count
    _, value, key, attr, header_counts, deltas = columns
    if value.min() < NULL_LENGTH or any(c is not None and c.min() < NULL_LENGTH for c in (key, attr)) \
            or (header_counts is not None and header_counts.min() < 0):
        raise RecordFormatError("negative message length in the batch body", 0)
    if deltas is not None and not (0 <= time_base < MAX_TIMESTAMP and 0 <= deltas.min()
                                   and deltas.max() < MAX_TIMESTAMP):
        raise RecordFormatError("create time out of range in the batch body", 0)
    data = [np.maximum(c, 0) for c in (value, key, attr) if c is not None]
    value_bytes = int(data[0].sum())
    sizes = sum(data)
    end = pos + int(sizes.sum())
    if end > size:
        raise RecordFormatError(f"message lengths overrun the batch body of {size} bytes", 0)
    if attr is not None:
        _check_utf8(body, end - int(data[-1].sum()), data[-1], "an attribute")
    if header_counts is not None:
        end, header_bytes = _check_headers(body, end, header_counts, layout)
        sizes = sizes + header_bytes
    if end + _padding(end) != size:
        raise RecordFormatError(f"batch body lengths add up to {end} bytes, the body has {size}", 0)
    column_bytes = sum(entry for _, _, entry, _ in plan)
    return EncodedBody(count, attributes, [body], size, body_crc, (sizes + column_bytes).astype(np.uint32),
                       int(sizes.max()), _metaq_total(count, value_bytes, attr),
                       None if key is None else (key, pos + value_bytes),
                       None if deltas is None else (time_base + int(deltas.min()), time_base + int(deltas.max())))


def _check_headers(body, start: int, counts: np.ndarray, layout: int) -> tuple:
    """Check a body's headers section at ``start`` for per-message ``counts``; returns (its end, each
    message's header bytes)."""
    total = int(counts.sum())
    key_code, value_code = (layout >> (2 * HEADER_KEY_LEN)) & 3, (layout >> (2 * HEADER_VALUE_LEN)) & 3
    key_width, value_width = int(WIDTHS[key_code]), int(WIDTHS[value_code])
    keys_at = start + (key_width + value_width) * total
    if keys_at > len(body):
        raise RecordFormatError(f"the headers section overruns the batch body of {len(body)} bytes", 0)
    klen = np.frombuffer(body, INT_DTYPES[key_code], total, start).astype(np.int64)
    vlen = np.frombuffer(body, INT_DTYPES[value_code], total, start + key_width * total).astype(np.int64)
    if total and (klen.min() < 0 or vlen.min() < NULL_LENGTH):
        raise RecordFormatError("negative header length in the batch body", 0)
    vlen = np.maximum(vlen, 0)
    end = keys_at + int(klen.sum()) + int(vlen.sum())
    if end > len(body):
        raise RecordFormatError(f"the headers section overruns the batch body of {len(body)} bytes", 0)
    _check_utf8(body, keys_at, klen, "a header key")
    return end, _per_group(klen + vlen + key_width + value_width, counts)


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


def body_keys(body: EncodedBody) -> Optional[tuple]:
    """(bytes, starts, lengths) of a body's keys for the key index: key i is ``bytes[starts[i]:][:lengths[i]]``,
    a length of -1 a null key; None when the body has no keys. Views, a few numpy steps per batch."""
    keys = body.keys
    if keys is None:
        return None
    if isinstance(keys, pa.Array):
        n = len(keys)
        offsets = np.frombuffer(keys.buffers()[1], np.int32, n + 1, keys.offset * 4).astype(np.int64)
        data = keys.buffers()[2]
        lengths = np.diff(offsets)
        if keys.null_count:
            lengths[~np.asarray(keys.is_valid())] = NULL_LENGTH
        return (np.frombuffer(data, np.uint8) if data is not None else _NO_BYTES), offsets[:-1], lengths
    lengths, at = keys
    sized = np.maximum(lengths, 0)
    return np.frombuffer(body.parts[0], np.uint8), at + np.cumsum(sized) - sized, lengths


_NO_BYTES = np.zeros(0, np.uint8)


def key_spans(u8: np.ndarray, positions: np.ndarray) -> Optional[tuple]:
    """(message offsets, starts, lengths) of the keys in the whole batches at ``positions`` of ``u8``
    (checked batches: a log's or a replica's copy), markers left out, as ``body_keys`` gives them (starts
    into ``u8``); None when none of them has a key column. Vectorised over the batches."""
    positions = np.asarray(positions, np.int64)
    if not len(positions):
        return None
    h = headers_at(u8, positions)
    keyed = ((h["attributes"] & HAS_KEYS) != 0) & ((h["attributes"] & CONTROL) == 0)
    if not keyed.any():
        return None
    L = _batch_layout(u8, positions[keyed])
    lengths = L.lengths[KEY_COL - VALUE_COL]
    offsets, region, _ = L.regions[KEY_COL - VALUE_COL]
    starts = L.per_message(region - offsets[L.first_msg]) + offsets[:-1]
    return L.numbered(L.h["base_offset"]), starts, lengths


def encode_header(body: EncodedBody, base_offset: int, base_msg_id: int, timestamp_ms: int, txn: int = 0,
                  flags: int = 0, producer: tuple = (NO_PRODUCER, NO_PRODUCER, NO_PRODUCER),
                  byte_base: int = 0) -> bytes:
    """A version 3 header. ``flags``: TRANSACTIONAL or CONTROL (with ``txn``, the transaction's number), or
    0. ``producer``: (id, epoch, base sequence) of an idempotent producer's batch, -1s otherwise.
    ``byte_base``: the first message's position in the partition's MetaQ message stream."""
    batch_len = HEADER_SIZE + body.size
    tail = HEADER.pack(batch_len, 0, MAGIC, VERSION, (body.attributes & 0xFF) | flags, body.count, base_offset,
                       base_msg_id, timestamp_ms, body.crc, txn)[8:] + HEADER_V3.pack(
        producer[0], producer[1], body.attributes >> LAYOUT_SHIFT, producer[2], byte_base)
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
        producer_id, producer_epoch, layout, base_sequence, byte_base = HEADER_V3.unpack_from(
            buf, pos + BASE_HEADER_SIZE)
        extra = (producer_id, producer_epoch, base_sequence, byte_base, layout)
    h = BatchHeader(*fields, *extra)
    known = KNOWN_ATTRIBUTE_BITS if version >= 3 else KNOWN_ATTRIBUTE_BITS & ~V3_ATTRIBUTE_BITS
    if h.attributes & ~known:
        raise RecordFormatError(f"unknown batch attributes {h.attributes:#x} at byte {pos}", pos)
    if _bad_layout(np.int64(h.attributes), np.int64(h.layout)):
        raise RecordFormatError(f"batch at byte {pos} has layout {h.layout:#x}, impossible with attributes "
                                f"{h.attributes:#x}", pos)
    if h.count < 1 or h.batch_len % ALIGN or h.batch_len < size + int(
            _fixed_size(np.array([h.attributes]), np.array([h.layout]), np.array([h.count]))[0]):
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
V3_DTYPE = np.dtype([("producer_id", "<i8"), ("producer_epoch", "<i2"), ("layout", "<u2"),
                     ("base_sequence", "<i4"), ("byte_base", "<i8")])
assert V3_DTYPE.itemsize == HEADER_V3.size


def headers_at(u8: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The fields every version has (``HEADER_DTYPE``) of the batches at ``positions``: one gather."""
    return u8[positions[:, None] + np.arange(BASE_HEADER_SIZE)].reshape(-1).view(HEADER_DTYPE)


def header_sizes(h: np.ndarray) -> np.ndarray:
    """Each batch's header bytes (where its body starts), from its version."""
    return np.where(h["version"] >= 3, HEADER_SIZE, BASE_HEADER_SIZE).astype(np.int64)


def v3_fields(u8: np.ndarray, positions: np.ndarray, h: Optional[np.ndarray] = None) -> np.ndarray:
    """``V3_DTYPE`` fields of the batches at ``positions``; for version 2 batches, which have none, -1s
    (layout 0: version 2's columns)."""
    h = headers_at(u8, positions) if h is None else h
    out = np.full(len(positions), -1, V3_DTYPE)
    out["layout"] = 0
    v3 = h["version"] >= 3
    if v3.any():
        at = positions[v3] + BASE_HEADER_SIZE
        out[v3] = u8[at[:, None] + np.arange(V3_DTYPE.itemsize)].reshape(-1).view(V3_DTYPE)
    return out


_LAYOUT_AT = BASE_HEADER_SIZE + 10  # the layout field's bytes in a version 3 header


def layouts(u8: np.ndarray, positions: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Each batch's layout (version 2: 0, every column i32): two bytes read per batch."""
    v3 = h["version"] >= 3
    out = np.zeros(len(positions), np.int64)
    if v3.any():  # version 2 headers are shorter: only version 3 ones are read
        out[v3] = u8[(positions[v3] + _LAYOUT_AT)[:, None] + np.arange(2)].reshape(-1).view("<u2")
    return out


def data_starts(u8: np.ndarray, positions: np.ndarray, h: Optional[np.ndarray] = None) -> np.ndarray:
    """Where each batch's variable-width data starts, after its header and integer columns: its first
    value's first byte (a marker's value)."""
    h = headers_at(u8, positions) if h is None else h
    return positions + header_sizes(h) + _fixed_size(h["attributes"].astype(np.int64), layouts(u8, positions, h),
                                                     h["count"].astype(np.int64))


def empty_batch(headers: bool = False, timestamp_type: bool = False) -> pa.RecordBatch:
    out = schema(headers, timestamp_type)
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in out], schema=out)


def _per_group(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sums of consecutive runs of ``values`` of lengths ``counts`` (runs may be empty)."""
    cum = np.zeros(len(values) + 1, np.int64)
    np.cumsum(values, out=cum[1:])
    ends = np.cumsum(counts, dtype=np.int64)
    return cum[ends] - cum[ends - counts]


class _Layout:
    """Where every message's fields sit in a buffer of batch bodies (versions 2 and 3 mixed). Within a batch
    each column is one contiguous run, so a column is gathered as one range per batch: a view of the buffer
    when there is one batch, one memcpy per batch when batches are large. An integer column's width may
    differ from batch to batch: it is gathered once per width present (at most four), never per message."""

    def __init__(self, u8: np.ndarray, starts: np.ndarray, ends: np.ndarray, counts: np.ndarray,
                 attributes: np.ndarray, layout: np.ndarray, version2: np.ndarray, position: int, label: str):
        """``starts``: where each body starts in ``u8``; ``ends``: where each batch ends; per batch its
        message count, attribute bits and layout (0 in version 2); ``version2``: the batches whose values
        may not be null; ``position`` and ``label``: what errors name."""
        self.u8, self.ends, self.position, self.label = u8, ends, position, label
        self.counts = counts = counts.astype(np.int64)
        self.layout = layout = layout.astype(np.int64)
        self.n = int(counts.sum())
        self.first_msg = first_msg = np.cumsum(counts) - counts
        # the integer columns (rows) of each batch: where their entries start, and the data after them
        present, code, entry, base = _columns(attributes.astype(np.int64), layout)
        size = entry * counts + base
        at = starts + np.cumsum(size, axis=0) - size + base
        pos = starts + size.sum(axis=0)
        if (pos > ends).any():
            raise self._error("integer columns overrun their batch")
        self.column_bytes = entry.sum(axis=0)  # per message
        self.present = present
        some, uniform = present.any(axis=1).tolist(), (present.all(axis=1) & (code == code[:, :1]).all(axis=1)).tolist()

        def column(row: int, fill: int) -> Optional[np.ndarray]:
            if not some[row]:
                return None
            return self._ints(present[row], at[row], code[row], counts, fill, uniform[row])
        self.flags = column(FLAG_COL, 0)  # None: every flag is 0
        # value, key and attribute lengths (-1: null; None: all null)
        self.lengths = [column(row, NULL_LENGTH) for row in (VALUE_COL, KEY_COL, ATTRIBUTE_COL)]
        self.header_counts = column(HEADER_COUNT_COL, 0)
        value = self.lengths[0]
        if value.min() < NULL_LENGTH or (version2.any() and (value[np.repeat(version2, counts)] < 0).any()) \
                or any(x is not None and x.min() < NULL_LENGTH for x in self.lengths[1:]) \
                or (self.header_counts is not None and self.header_counts.min() < 0):
            raise self._error("negative message length")
        self.has_times, self.time_base, self.time_deltas = present[TIME_COL], None, None
        if some[TIME_COL]:  # create times: an i64 base per batch, a delta per message
            self.time_base = np.zeros(len(counts), np.int64)
            bases = at[TIME_COL][self.has_times] - 8
            self.time_base[self.has_times] = _gather(u8, bases, np.full(len(bases), 8)).view("<i8")
            self.time_deltas = column(TIME_COL, 0)
            if self.time_base.min() < 0 or self.time_base.max() >= MAX_TIMESTAMP \
                    or self.time_deltas.min() < 0 or self.time_deltas.max() >= MAX_TIMESTAMP:
                raise self._error("create time out of range")

        self.regions = []  # the variable-width data, each column's back to back
        for lengths in self.lengths:
            if lengths is None:
                self.regions.append(None)
                continue
            offsets = np.zeros(self.n + 1, dtype=np.int64)
            np.cumsum(np.maximum(lengths, 0), out=offsets[1:])
            totals = offsets[first_msg + counts] - offsets[first_msg]
            self.regions.append((offsets, pos, totals))
            pos = pos + totals
        self.section = pos  # the headers section
        self._header_section = None
        if self.header_counts is not None:
            pos = np.where(present[HEADER_COUNT_COL], self.headers()["end"], pos)
        if (pos > ends).any():
            raise self._error("message lengths overrun their batch")
        self.data_end = pos

    def _error(self, problem: str) -> "RecordFormatError":
        return RecordFormatError(f"{problem} ({self.label})", self.position)

    def _ints(self, present: np.ndarray, at: np.ndarray, code: np.ndarray, counts: np.ndarray, fill: int,
              uniform: bool) -> np.ndarray:
        """An integer column as int64, ``counts[b]`` entries of batch b from ``at[b]`` in width ``code[b]``;
        ``fill`` for the batches without it (``present``). ``uniform``: every batch has it, in one width."""
        if uniform:
            c = int(code[0])
            return _gather(self.u8, at, counts * WIDTHS[c]).view(INT_DTYPES[c]).astype(np.int64)
        out = np.full(int(counts.sum()), fill, np.int64)
        for c in np.unique(code[present]).tolist():
            sel = present & (code == c)
            out[np.repeat(sel, counts)] = _gather(self.u8, at[sel], counts[sel] * WIDTHS[c]).view(INT_DTYPES[c])
        return out

    def headers(self) -> dict:
        """The headers sections of the batches that have one: lengths of every header's key and value, the
        bytes of its two length entries, and where each batch's key and value bytes lie."""
        if self._header_section is None:
            hb = self.present[HEADER_COUNT_COL]
            per_batch = _per_group(self.header_counts, self.counts)[hb]
            sec, key_code = self.section[hb], (self.layout[hb] >> (2 * HEADER_KEY_LEN)) & 3
            value_code = (self.layout[hb] >> (2 * HEADER_VALUE_LEN)) & 3
            key_width, value_width = WIDTHS[key_code], WIDTHS[value_code]
            keys_at = sec + (key_width + value_width) * per_batch
            if (keys_at > self.ends[hb]).any():
                raise self._error("a headers section overruns its batch")
            everywhere = np.ones(len(sec), bool)
            klen = self._ints(everywhere, sec, key_code, per_batch, 0, (key_code == key_code[0]).all())
            vlen = self._ints(everywhere, sec + key_width * per_batch, value_code, per_batch, 0,
                              (value_code == value_code[0]).all())
            if (klen < 0).any() or (vlen < NULL_LENGTH).any():
                raise self._error("negative header length")
            key_totals = _per_group(klen, per_batch)
            value_totals = _per_group(np.maximum(vlen, 0), per_batch)
            end = np.zeros(len(hb), np.int64)
            end[hb] = keys_at + key_totals + value_totals
            self._header_section = dict(klen=klen, vlen=vlen, widths=np.repeat(key_width + value_width, per_batch),
                                        keys_at=keys_at, key_totals=key_totals, values_at=keys_at + key_totals,
                                        value_totals=value_totals, end=end)
        return self._header_section

    def per_message(self, per_batch: np.ndarray) -> np.ndarray:
        return np.repeat(per_batch, self.counts)

    def numbered(self, base: np.ndarray) -> np.ndarray:
        """base[b] + i for message i of batch b: offsets and message ids."""
        return self.per_message(base - self.first_msg) + np.arange(self.n, dtype=np.int64)

    def times(self, store_ms: np.ndarray) -> tuple:
        """Each message's time, its create time where its batch has them, else its batch's store time
        (``store_ms``); and which are create times (None: none is)."""
        if self.time_base is None:
            return self.per_message(store_ms), None
        base = np.where(self.has_times, self.time_base, store_ms)
        return self.per_message(base) + self.time_deltas, self.per_message(self.has_times)

    def skews(self, store_ms: np.ndarray) -> tuple:
        """(least, greatest) ``create time - store time`` of each batch's messages (0 for a batch without
        create times): the bounds the time index keeps per segment (``offset_index``)."""
        if self.time_base is None:
            zero = np.zeros(len(self.counts), np.int64)
            return zero, zero
        lo = np.minimum.reduceat(self.time_deltas, self.first_msg) + self.time_base - store_ms
        hi = np.maximum.reduceat(self.time_deltas, self.first_msg) + self.time_base - store_ms
        return np.where(self.has_times, lo, 0), np.where(self.has_times, hi, 0)

    def data_sizes(self) -> np.ndarray:
        """Each message's bytes of keys, values, attributes and headers (with their length entries)."""
        sizes = sum(np.maximum(x, 0) for x in self.lengths if x is not None)
        if self.header_counts is not None:
            hs = self.headers()
            sizes = sizes + _per_group(hs["klen"] + np.maximum(hs["vlen"], 0) + hs["widths"], self.header_counts)
        return sizes

    def message_sizes(self) -> np.ndarray:
        """Each message's encoded bytes: its data and its integer column entries (the index's ``size``)."""
        return self.data_sizes() + self.per_message(self.column_bytes)

    def metaq_bytes(self) -> np.ndarray:
        """Each batch's bytes in MetaQ's message-set layout (``metaq_sizes``)."""
        return _per_group(metaq_sizes(self.lengths[0], self.lengths[2]), self.counts)

    def column(self, which: int, typ) -> pa.Array:
        """Column ``which`` (0 value, 1 key, 2 attribute) as an Arrow binary/string array."""
        if self.regions[which] is None:
            return pa.nulls(self.n, typ)
        offsets, region, totals = self.regions[which]
        return _binary(typ, self.n, self.lengths[which], offsets, _gather(self.u8, region, totals))

    def headers_column(self) -> pa.Array:
        """Every message's record headers (``HEADERS_TYPE``; an empty list where it has none)."""
        counts = self.header_counts if self.header_counts is not None else np.zeros(self.n, np.int64)
        list_offsets = np.zeros(self.n + 1, np.int64)
        np.cumsum(counts, out=list_offsets[1:])
        if list_offsets[-1] == 0:
            struct_arr = pa.StructArray.from_arrays([pa.array([], pa.string()), pa.array([], pa.binary())],
                                                    fields=list(HEADERS_TYPE.value_type))
        else:
            hs = self.headers()
            koff = np.zeros(len(hs["klen"]) + 1, np.int64)
            np.cumsum(hs["klen"], out=koff[1:])
            voff = np.zeros(len(hs["vlen"]) + 1, np.int64)
            np.cumsum(np.maximum(hs["vlen"], 0), out=voff[1:])
            keys = _binary(pa.string(), len(hs["klen"]), None, koff, _gather(self.u8, hs["keys_at"], hs["key_totals"]))
            values = _binary(pa.binary(), len(hs["vlen"]), hs["vlen"], voff,
                             _gather(self.u8, hs["values_at"], hs["value_totals"]))
            struct_arr = pa.StructArray.from_arrays([keys, values], fields=list(HEADERS_TYPE.value_type))
        return pa.ListArray.from_arrays(pa.array(list_offsets.astype(np.int32)), struct_arr, type=HEADERS_TYPE)


def _batch_layout(u8: np.ndarray, positions: np.ndarray, v3: Optional[np.ndarray] = None) -> _Layout:
    """The ``_Layout`` of the whole batches at ``positions``, their header fields checked vectorised (a
    bad one is re-read by ``parse_header`` to say exactly what is wrong); ``h`` holds the headers' fields
    every version has. ``v3``: their ``v3_fields``, when the caller has them."""
    h = headers_at(u8, positions)
    attrs = h["attributes"].astype(np.int64)
    layout = layouts(u8, positions, h) if v3 is None else v3["layout"].astype(np.int64)
    counts = h["count"].astype(np.int64)
    v3 = h["version"] == 3
    hsize = header_sizes(h)
    unknown = np.where(v3, 0xFF ^ KNOWN_ATTRIBUTE_BITS, 0xFF ^ (KNOWN_ATTRIBUTE_BITS & ~V3_ATTRIBUTE_BITS))
    bad = ((h["magic"] != MAGIC) | ~(v3 | (h["version"] == 2)) | ((attrs & unknown) != 0) | (counts < 1)
           | (h["batch_len"] % ALIGN != 0) | _bad_layout(attrs, layout))  # too short for its columns: _Layout
    if bad.any():
        at = int(positions[np.argmax(bad)])
        parse_header(u8, at)  # raises, naming the field
        raise RecordFormatError(f"bad batch header at byte {at}", at)
    first = int(positions[0])
    layout_of = _Layout(u8, positions + hsize, positions + h["batch_len"].astype(np.int64), counts, attrs, layout,
                        ~v3, first, f"batches from byte {first}")
    layout_of.h, layout_of.positions = h, positions
    return layout_of


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
    return index_table(u8, positions)[:6]


def index_table(u8: np.ndarray, positions: np.ndarray):
    """``index_columns``, then each batch's least and greatest create-time skew (``_Layout.skews``)."""
    positions = np.asarray(positions, dtype=np.int64)
    v3 = v3_fields(u8, positions)
    layout = _batch_layout(u8, positions, v3)
    ts = layout.h["timestamp"]
    return (layout.message_sizes(), layout.counts, ts, layout.h["batch_len"], layout.metaq_bytes(),
            v3["byte_base"]) + layout.skews(ts.astype(np.int64))


def metaq_message_sizes(u8: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Every message's size in MetaQ's message-set layout (``metaq_sizes``), markers and transactional ones
    included, of the whole batches at ``positions``: what a message adds to a MetaQ byte position."""
    layout = _batch_layout(u8, np.asarray(positions, dtype=np.int64))
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
           headers: bool = False, timestamp_type: bool = False) -> pa.RecordBatch:
    """Decode the whole batches in ``buf`` to an Arrow RecordBatch with ``SCHEMA`` (and ``headers``, Kafka
    record headers, and ``timestampType``, 0 where ``timestamp`` is a create time and 1 where it is the
    store time, when asked: ``schema``), keeping offsets in [start_offset, end_offset). Transaction
    markers and the batches of ``aborted`` transactions (``ABORTED_DTYPE``, as a fetch reply lists them)
    are left out: their offsets are gaps.

    With ``verify`` each batch's checksums are checked (one CRC-32C call per batch). ``positions`` (where
    each batch starts, e.g. from the broker's index) lets an unverified decode skip the header walk.
    Everything per message is numpy or Arrow work; values, keys and attributes of a single batch are
    views of ``buf``, never copies."""
    u8 = buf.view(np.uint8).reshape(-1) if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if positions is None or verify:
        positions = _batch_positions(u8, verify)
    positions = committed_positions(u8, np.asarray(positions, dtype=np.int64), aborted)
    if len(positions) == 0:
        return empty_batch(headers, timestamp_type)
    L = _batch_layout(u8, positions)
    offsets_col = L.numbered(L.h["base_offset"])
    times, created = L.times(L.h["timestamp"])
    columns = [
        L.column(1, pa.binary()),
        L.column(0, pa.binary()),
        pa.array(offsets_col, pa.int64()),
        pa.array(times, pa.int64()).cast(pa.timestamp("ms")),
        pa.array(L.numbered(L.h["base_msg_id"]), pa.int64()),
        pa.array(np.zeros(L.n, np.int32) if L.flags is None else L.flags.astype(np.int32), pa.int32()),
        L.column(2, pa.string()),
    ]
    if headers:
        columns.append(L.headers_column())
    if timestamp_type:
        columns.append(pa.array(np.full(L.n, LOG_APPEND_TIME, np.int32) if created is None else
                                np.where(created, CREATE_TIME, LOG_APPEND_TIME).astype(np.int32), pa.int32()))
    batch = pa.RecordBatch.from_arrays(columns, schema=schema(headers, timestamp_type))
    lo = 0 if start_offset is None else int(np.searchsorted(offsets_col, start_offset, "left"))
    hi = L.n if end_offset is None else int(np.searchsorted(offsets_col, end_offset, "left"))
    if lo or hi != L.n:
        batch = batch.slice(lo, max(hi - lo, 0))
    return batch
