"""The record-batch format: how an appended batch of messages is laid out in bytes.

One append becomes one batch: a 48-byte header followed by a columnar body (per-message fixed-width
columns, then each variable-width column's bytes back to back). The same bytes are stored in segment
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
VERSION = 2  # 1 used CRC-32 (zlib); 2 uses CRC-32C
HEADER = struct.Struct("<IIHBBIqqqII")
HEADER_SIZE = HEADER.size  # 48
assert HEADER_SIZE == 48
ALIGN = 8

# Batch attribute bits. The first two describe the body (a producer sets them); the last two are the
# broker's: TRANSACTIONAL marks the batch of an unsettled-at-append transaction (its number in ``txn``),
# CONTROL a marker, which no reader returns: a transaction's (its number in ``txn``, one message:
# COMMIT_MARKER or ABORT_MARKER), or with ``txn`` 0 an epoch marker (``epoch_marker``; replication).
HAS_KEYS = 0x1
HAS_ATTRIBUTES = 0x2
TRANSACTIONAL = 0x4
CONTROL = 0x8
BODY_ATTRIBUTE_BITS = HAS_KEYS | HAS_ATTRIBUTES
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

# Arrow schema of decoded messages; the Spark connector adds topic and partition.
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

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.count


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


def encode_body(
    values,
    keys=None,
    attributes=None,
    flags: Union[None, Sequence[int], np.ndarray, pa.Array] = None,
) -> EncodedBody:
    """Encode a batch body from column data (Python sequences or Arrow arrays); no per-message loop
    in Python for Arrow input. The header (offsets, ids, time) is added at append time."""
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
    for bit, arr in ((HAS_KEYS, key_arr), (HAS_ATTRIBUTES, attr_arr)):
        if arr is None:
            continue
        lengths, data = _lengths_and_data(arr)
        attr_bits |= bit
        columns.append(lengths)
        data_parts.extend(data)
        sizes += np.maximum(lengths, 0)

    max_message_size = int(sizes.max())
    sizes += 4 * len(columns)  # each message's share of the fixed-width columns
    parts = [c.astype("<i4", copy=False).tobytes() for c in columns] + [d for d in data_parts if len(d)]
    size = sum(len(p) for p in parts)
    pad = _padding(size)
    if pad:
        parts.append(b"\0" * pad)
        size += pad
    if HEADER_SIZE + size > MAX_BATCH_BYTES:
        raise MessageValueError(f"batch of {n} messages encodes to {HEADER_SIZE + size} bytes; the limit is {MAX_BATCH_BYTES}")
    body_crc = 0
    for p in parts:
        body_crc = crc(p, body_crc)
    return EncodedBody(n, attr_bits, parts, size, body_crc, sizes.astype(np.uint32), max_message_size)


def parse_body(count: int, attributes: int, body, body_crc: int) -> EncodedBody:
    """Check a batch body that a producer encoded (``encode_body``) and sent over the network: checksum,
    column lengths, padding and UTF-8 attributes, all vectorised. Raises RecordFormatError."""
    body = memoryview(body).cast("B")
    if count < 1:
        raise RecordFormatError(f"batch count must be at least 1, got {count}", 0)
    if attributes & ~BODY_ATTRIBUTE_BITS:
        raise RecordFormatError(f"unknown batch attributes {attributes:#x}", 0)
    if len(body) % ALIGN or HEADER_SIZE + len(body) > MAX_BATCH_BYTES:
        raise RecordFormatError(f"batch body of {len(body)} bytes is not a multiple of {ALIGN} or too large", 0)
    if crc(body) != body_crc:
        raise RecordFormatError("batch body checksum mismatch (damaged in transit?)", 0)
    ncols = 2 + bool(attributes & HAS_KEYS) + bool(attributes & HAS_ATTRIBUTES)
    fixed = 4 * ncols * count
    if fixed > len(body):
        raise RecordFormatError(f"batch body of {len(body)} bytes is too short for {count} messages", 0)
    cols = np.frombuffer(body, dtype="<i4", count=ncols * count).reshape(ncols, count)
    lengths = cols[1:].astype(np.int64)
    if (lengths[0] < 0).any() or (lengths[1:] < NULL_LENGTH).any():
        raise RecordFormatError("batch body has a negative length", 0)
    data = np.maximum(lengths, 0)
    data_end = fixed + int(data.sum())
    if data_end + _padding(data_end) != len(body):
        raise RecordFormatError(f"batch body lengths add up to {data_end} bytes, the body has {len(body)}", 0)
    if attributes & HAS_ATTRIBUTES:
        alen = data[-1]
        offsets = np.zeros(count + 1, dtype=np.int32)
        np.cumsum(alen, out=offsets[1:])
        start = data_end - int(offsets[-1])
        try:
            pa.Array.from_buffers(pa.string(), count, [None, pa.py_buffer(offsets),
                                                       pa.py_buffer(body[start:data_end])]).validate(full=True)
        except pa.ArrowInvalid:
            raise RecordFormatError("an attribute is not valid UTF-8", 0) from None
    sizes = data.sum(axis=0) + 4 * ncols
    return EncodedBody(count, attributes, [body], len(body), body_crc, sizes.astype(np.uint32),
                       int(data.sum(axis=0).max()))


def encode_header(body: EncodedBody, base_offset: int, base_msg_id: int, timestamp_ms: int, txn: int = 0,
                  flags: int = 0) -> bytes:
    """``flags``: TRANSACTIONAL or CONTROL (with ``txn``, the transaction's number), or 0."""
    batch_len = HEADER_SIZE + body.size
    tail = HEADER.pack(batch_len, 0, MAGIC, VERSION, body.attributes | flags, body.count, base_offset,
                       base_msg_id, timestamp_ms, body.crc, txn)
    header_crc = crc(tail[8:])
    return struct.pack("<II", batch_len, header_crc) + tail[8:]


# ---------------------------------------------------------------------------------------------------
# Reading


def parse_header(buf, pos: int = 0) -> BatchHeader:
    """Parse and check one batch header at ``pos``; raises RecordFormatError naming what is wrong."""
    if len(buf) - pos < HEADER_SIZE:
        raise RecordFormatError(f"truncated batch header at byte {pos}: {len(buf) - pos} of {HEADER_SIZE} bytes", pos)
    h = BatchHeader(*HEADER.unpack_from(buf, pos))
    if h.magic == MAGIC and h.version == 1:  # checked before the checksum, which version 1 computed otherwise
        raise RecordFormatError(f"batch at byte {pos} is in format version 1 (CRC-32 checksums), written by an "
                                f"older metaq; this version reads only version {VERSION} (CRC-32C)", pos)
    if crc(memoryview(buf)[pos + 8: pos + HEADER_SIZE]) != h.header_crc:
        raise RecordFormatError(f"batch header checksum mismatch at byte {pos}", pos)
    if h.magic != MAGIC or h.version != VERSION:
        raise RecordFormatError(f"unknown batch magic/version {h.magic:#x}/{h.version} at byte {pos}", pos)
    if h.attributes & ~KNOWN_ATTRIBUTE_BITS:
        raise RecordFormatError(f"unknown batch attributes {h.attributes:#x} at byte {pos}", pos)
    ncols = 2 + bool(h.attributes & HAS_KEYS) + bool(h.attributes & HAS_ATTRIBUTES)
    if h.count < 1 or h.batch_len < HEADER_SIZE + 4 * ncols * h.count or h.batch_len % ALIGN:
        raise RecordFormatError(f"batch at byte {pos} has impossible length {h.batch_len} for {h.count} messages", pos)
    return h


def check_batch(buf, pos: int = 0) -> BatchHeader:
    """Parse a batch header and verify the body checksum; the batch must lie wholly inside ``buf``."""
    h = parse_header(buf, pos)
    end = pos + h.batch_len
    if end > len(buf):
        raise RecordFormatError(f"truncated batch at byte {pos}: needs {h.batch_len} bytes, {len(buf) - pos} present", pos)
    if crc(memoryview(buf)[pos + HEADER_SIZE: end]) != h.body_crc:
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
assert HEADER_DTYPE.itemsize == HEADER_SIZE


def empty_batch() -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in SCHEMA], schema=SCHEMA)


class _Layout:
    """Where every message's fields sit in a buffer of whole batches. Within a batch each column (fixed
    or variable width) is one contiguous run, so a column is gathered as one range per batch: a view of
    the buffer when there is one batch, one memcpy per batch when batches are large."""

    def __init__(self, u8: np.ndarray, positions: np.ndarray):
        self.u8, self.positions = u8, positions
        self.h = h = u8[positions[:, None] + np.arange(HEADER_SIZE)].reshape(-1).view(HEADER_DTYPE)
        self.counts = counts = h["count"].astype(np.int64)
        has_keys = (h["attributes"] & HAS_KEYS) != 0
        has_attrs = (h["attributes"] & HAS_ATTRIBUTES) != 0
        self.ncols = ncols = 2 + has_keys.astype(np.int64) + has_attrs.astype(np.int64)
        bad = ((h["magic"] != MAGIC) | (h["version"] != VERSION) | ((h["attributes"] & np.uint8(0xFF ^ KNOWN_ATTRIBUTE_BITS)) != 0)
               | (counts < 1) | (h["batch_len"] % ALIGN != 0)
               | (h["batch_len"] < HEADER_SIZE + 4 * ncols * counts))
        if bad.any():
            parse_header(u8, int(positions[np.argmax(bad)]))  # raises, naming the field
        self.n = n = int(counts.sum())
        self.first_msg = first_msg = np.cumsum(counts) - counts

        # Batches start 8-aligned and columns are 4-byte ints, so one int32 view reads every column.
        i32 = u8[: len(u8) - len(u8) % 4].view("<i4")
        col_start = (positions + HEADER_SIZE) // 4

        def fixed_col(col_no: np.ndarray, present: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
            starts = col_start + col_no * counts
            if present is None or present.all():
                return _gather(i32, starts, counts)
            if not present.any():
                return None  # no batch has this column: every entry is null
            out = np.full(n, NULL_LENGTH, dtype=np.int32)
            out[np.repeat(present, counts)] = _gather(i32, starts[present], counts[present])
            return out

        zero = np.zeros(len(positions), dtype=np.int64)
        self.flags = fixed_col(zero)
        # value, key and attribute lengths (-1: null; None: all null), and each column's offsets and regions
        self.lengths = [fixed_col(zero + 1), fixed_col(zero + 2, has_keys), fixed_col(2 + has_keys, has_attrs)]
        if (self.lengths[0] < 0).any() or any(x is not None and (x < NULL_LENGTH).any() for x in self.lengths[1:]):
            raise RecordFormatError(f"negative message length (batches from byte {int(positions[0])})",
                                    int(positions[0]))
        region = positions + HEADER_SIZE + 4 * ncols * counts
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
        if (region > positions + h["batch_len"]).any():
            raise RecordFormatError(f"message lengths overrun their batch (batches from byte {int(positions[0])})",
                                    int(positions[0]))

    def per_message(self, per_batch: np.ndarray) -> np.ndarray:
        return np.repeat(per_batch, self.counts)

    def numbered(self, base: np.ndarray) -> np.ndarray:
        """base[b] + i for message i of batch b: offsets and message ids."""
        return self.per_message(base - self.first_msg) + np.arange(self.n, dtype=np.int64)

    def column(self, which: int, typ) -> pa.Array:
        """Column ``which`` (0 value, 1 key, 2 attribute) as an Arrow binary/string array."""
        if self.regions[which] is None:
            return pa.nulls(self.n, typ)
        offsets, region, totals = self.regions[which]
        if offsets[-1] > MAX_BATCH_BYTES:
            raise RecordFormatError("decoded column exceeds 2 GiB; fetch a smaller range", 0)
        validity, null_count = None, 0
        if which:
            valid = self.lengths[which] >= 0
            null_count = self.n - int(np.count_nonzero(valid))
            if null_count:
                validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
        data = _gather(self.u8, region, totals)
        return pa.Array.from_buffers(typ, self.n, [validity, pa.py_buffer(offsets.astype(np.int32)),
                                                   pa.py_buffer(data)], null_count=null_count)


_LEN_AND_CRC = struct.Struct("<II")
_BODY_CRC = struct.Struct("<I")


def _batch_positions(u8: np.ndarray, verify: bool) -> np.ndarray:
    """Walk the batch headers (one cheap step per batch), checking the header checksum and, with
    ``verify``, the body checksum. Field-by-field checks happen vectorised in ``_Layout``; on any
    failure ``check_batch`` re-reads the batch to say exactly what is wrong."""
    size, pos = len(u8), 0
    out = []
    unpack = _LEN_AND_CRC.unpack_from
    while pos < size:
        if size - pos < HEADER_SIZE:
            check_batch(u8, pos)
        batch_len, header_crc = unpack(u8, pos)
        end = pos + batch_len
        if crc(u8[pos + 8: pos + HEADER_SIZE]) != header_crc or batch_len < HEADER_SIZE or end > size or (
                verify and crc(u8[pos + HEADER_SIZE: end]) != _BODY_CRC.unpack_from(u8, pos + 40)[0]):
            check_batch(u8, pos)  # raises the precise error
            raise RecordFormatError(f"bad batch at byte {pos}", pos)
        out.append(pos)
        pos = end
    return np.array(out, dtype=np.int64)


def index_columns(u8: np.ndarray, positions: np.ndarray):
    """For the offset index: each message's encoded size, and each batch's count, time and length."""
    layout = _Layout(u8, np.asarray(positions, dtype=np.int64))
    sizes = sum(np.maximum(x, 0).astype(np.int64) for x in layout.lengths if x is not None)
    return sizes + 4 * layout.per_message(layout.ncols), layout.counts, layout.h["timestamp"], layout.h["batch_len"]


def committed_positions(u8: np.ndarray, positions: np.ndarray, aborted: Optional[np.ndarray] = None) -> np.ndarray:
    """The batches a reader returns: not markers, not of an aborted transaction (``ABORTED_DTYPE``
    entries). Vectorised over the batch headers, never a step per message."""
    if not len(positions):
        return positions
    h = u8[positions[:, None] + np.arange(HEADER_SIZE)].reshape(-1).view(HEADER_DTYPE)
    drop = (h["attributes"] & CONTROL) != 0
    if aborted is not None and len(aborted):
        txn = np.where((h["attributes"] & TRANSACTIONAL) != 0, h["txn"].astype(np.int64), -1)
        base = h["base_offset"]
        hit = ((txn[:, None] == aborted["txn"][None, :]) & (base[:, None] >= aborted["first"][None, :])
               & (base[:, None] < aborted["last"][None, :]))
        drop |= hit.any(axis=1)
    return positions[~drop] if drop.any() else positions


def decode(buf, start_offset: Optional[int] = None, end_offset: Optional[int] = None, verify: bool = True,
           positions: Optional[np.ndarray] = None, aborted: Optional[np.ndarray] = None) -> pa.RecordBatch:
    """Decode the whole batches in ``buf`` to an Arrow RecordBatch with ``SCHEMA``, keeping offsets in
    [start_offset, end_offset). Transaction markers and the batches of ``aborted`` transactions
    (``ABORTED_DTYPE``, as a fetch reply lists them) are left out: their offsets are gaps.

    With ``verify`` each batch's checksums are checked (one CRC-32C call per batch). ``positions`` (where
    each batch starts, e.g. from the broker's index) lets an unverified decode skip the header walk.
    Everything per message is numpy or Arrow work; values, keys and attributes of a single batch are
    views of ``buf``, never copies."""
    u8 = buf.view(np.uint8).reshape(-1) if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if positions is None or verify:
        positions = _batch_positions(u8, verify)
    positions = committed_positions(u8, np.asarray(positions, dtype=np.int64), aborted)
    if len(positions) == 0:
        return empty_batch()
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
    batch = pa.RecordBatch.from_arrays(columns, schema=SCHEMA)
    lo = 0 if start_offset is None else int(np.searchsorted(offsets_col, start_offset, "left"))
    hi = L.n if end_offset is None else int(np.searchsorted(offsets_col, end_offset, "left"))
    if lo or hi != L.n:
        batch = batch.slice(lo, max(hi - lo, 0))
    return batch
