"""Kafka record batches (message format v2, magic 2) to Arrow columns and back.

``decode(data)`` takes the bytes of one Produce partition (one or more batches, any codec), checks each
batch (magic, length, CRC-32C, record count, offset deltas) and every record, and returns ``Batches``: the
batches' fields (producer id and epoch, base sequence, transactional and control bits, codec) as numpy
arrays, and the records either as Arrow columns (``RECORD_SCHEMA``: offset delta, timestamp, key, value,
headers; null keys and null values stay null), built when asked for, or as one metaq batch body
(``Batches.metaq_body``, what a Produce stores), written straight from the Kafka bytes by a compiled loop.
``encode(...)`` writes Arrow columns as batches for a Fetch answer, uncompressed or in a codec.

One Python step per batch (its header, CRC, decompression); everything per record is numpy or the
compiled walks of ``_kernels.py``. Codecs are cramjam's: gzip, snappy (raw, or xerial-framed as the Java
client and kafka-python send it), lz4 (frame) and zstd. Decompression writes into a buffer of at most
``max_uncompressed`` bytes, so a small hostile batch cannot inflate without bound.

Layout of a batch (big-endian): base offset i64, batch length i32 (bytes after this field), partition
leader epoch i32, magic i8 (2), CRC-32C u32 (of the bytes after it), attributes i16 (bits 0-2 codec, 3
timestamp type, 4 transactional, 5 control), last offset delta i32, base timestamp i64, max timestamp i64,
producer id i64, producer epoch i16, base sequence i32, record count i32, then the records.
"""
from __future__ import annotations

import struct

import cramjam
import numpy as np
import pyarrow as pa

from metaq_broker.errors import InvalidMessageError
from metaq_broker.protocol import records as mrecords
from metaq_broker.protocol.kafka import codes
from metaq_broker.protocol.records import crc


def _compiled():
    """The compiled walks (``_kernels.py``), imported on first use: numba's import and cache load cost a
    broker about a second of CPU, which one that no Kafka client reaches never pays (``warm_up``)."""
    from metaq_broker.protocol.kafka import _kernels  # lazy: numba, a second of CPU (see above)
    return _kernels

NONE, GZIP, SNAPPY, LZ4, ZSTD = 0, 1, 2, 3, 4
CODECS = {NONE: "none", GZIP: "gzip", SNAPPY: "snappy", LZ4: "lz4", ZSTD: "zstd"}
CREATE_TIME, LOG_APPEND_TIME = 0, 1
TIMESTAMP_TYPE, TRANSACTIONAL, CONTROL = 0x08, 0x10, 0x20
MAGIC = 2
HEADER = struct.Struct(">qiibIhiqqqhii")
HEADER_SIZE = HEADER.size  # 61
HEADER_DTYPE = np.dtype([("base_offset", ">i8"), ("batch_length", ">i4"), ("partition_leader_epoch", ">i4"),
                         ("magic", "i1"), ("crc", ">u4"), ("attributes", ">i2"), ("last_offset_delta", ">i4"),
                         ("base_timestamp", ">i8"), ("max_timestamp", ">i8"), ("producer_id", ">i8"),
                         ("producer_epoch", ">i2"), ("base_sequence", ">i4"), ("records_count", ">i4")])
assert HEADER_SIZE == HEADER_DTYPE.itemsize == 61
_NATIVE_HEADER = np.dtype([(name, HEADER_DTYPE[name].newbyteorder("=")) for name in HEADER_DTYPE.names])
CRC_START = 21  # the CRC covers the batch from its attributes on
DEFAULT_MAX_UNCOMPRESSED = 64 * 1024 * 1024
_XERIAL = b"\x82SNAPPY\x00"
_MAX_INT32 = 0x7FFFFFFF
_XERIAL_BLOCK = 32 * 1024  # the Java client's (xerial snappy-java's) block size

HEADERS_TYPE = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
_NO_HEADERS = pa.StructArray.from_arrays([pa.array([], pa.string()), pa.array([], pa.binary())],
                                        fields=list(HEADERS_TYPE.value_type))
RECORD_SCHEMA = pa.schema([
    pa.field("offset_delta", pa.int32(), nullable=False),
    pa.field("timestamp", pa.timestamp("ms"), nullable=False),
    pa.field("key", pa.binary()),
    pa.field("value", pa.binary()),  # null: a tombstone (docs/kafka.md, "Null values")
    pa.field("headers", HEADERS_TYPE, nullable=False),
])


class KafkaRecordError(InvalidMessageError):
    """A Produce partition's bytes that are not valid record batches; names the batch and the problem.
    ``kafka_code`` is what the partition is answered with."""

    def __init__(self, message: str, kafka_code: int = codes.CORRUPT_MESSAGE, batch: int = 0, position: int = 0):
        super().__init__(message)
        self.kafka_code, self.batch, self.position = kafka_code, batch, position


class Batches:
    """Decoded batches: per batch (numpy arrays) its header fields and record count, ``batch_of`` each
    record's batch; the records as Arrow columns (``column(name)``, ``records``: RECORD_SCHEMA) or as one
    metaq batch body (``metaq_body``). Columns are built when first asked for: a Produce converts
    straight from the Kafka bytes and builds none."""

    def __init__(self, src: np.ndarray, header: np.ndarray, counts: np.ndarray, timestamps_ms: np.ndarray,
                 fields: tuple):
        self.header, self.counts = header, counts
        self.timestamps_ms = timestamps_ms  # each record's timestamp, int64 ms
        # every batch's attribute bits OR-ed together: one numpy call where a Produce asks three questions
        # (any transactional, control, LogAppendTime batch?), each a few microseconds of fixed cost
        self.attributes_any = int(np.bitwise_or.reduce(header["attributes"]))
        self._src, self._fields = src, fields  # the bytes and where ``walk`` found each record's fields
        self.has_headers = bool(fields[5].any())  # any record with a header (decode checks them at once)
        self._columns: dict = {}
        self._records = None

    def column(self, name: str) -> pa.Array:
        if name not in self._columns:
            self._columns[name] = self._build(name)
        return self._columns[name]

    def _build(self, name: str) -> pa.Array:
        od, ks, kl, vs, vl, hc, hs, re = self._fields
        if name == "offset_delta":
            return pa.Array.from_buffers(pa.int32(), len(od), [None, pa.py_buffer(od.astype(np.int32))])
        if name == "timestamp":
            return pa.Array.from_buffers(pa.timestamp("ms"), len(od), [None, pa.py_buffer(self.timestamps_ms)])
        if name in ("key", "value"):
            return _binary(self._src, *((ks, kl) if name == "key" else (vs, vl)), pa.binary())
        return _headers(self._src, hc, hs, re)

    @property
    def records(self) -> pa.RecordBatch:
        if self._records is None:
            self._records = pa.RecordBatch.from_arrays([self.column(f.name) for f in RECORD_SCHEMA],
                                                       schema=RECORD_SCHEMA)
        return self._records

    def metaq_body(self, create_times: bool) -> mrecords.EncodedBody:
        """The records as one metaq batch body, byte for byte what ``encode_body`` makes of their value,
        key and headers columns and, with ``create_times``, their timestamps (else each message's time is
        its batch's store time). Records without headers go through the compiled ``metaq_body``, straight
        from the Kafka bytes; any header, or a create time metaq cannot store, takes the columns' way
        (whose checks then say what is wrong)."""
        if not self.has_headers:
            _, ks, kl, vs, vl, _, _, _ = self._fields
            times = self.timestamps_ms if create_times else _NO_TIMES
            out, vw, kw, tw, value_bytes, tmin, tmax, sizes, largest = _compiled().metaq_body(
                self._src, vs, vl, ks, kl, times)
            if not create_times or (0 <= tmin and tmax < mrecords.MAX_TIMESTAMP):
                return _metaq_body(out, len(vl), vw, kw, tw, value_bytes, sizes, largest, kl,
                                   (int(tmin), int(tmax)) if create_times else None)
        headers = self.column("headers")
        return mrecords.encode_body(self.column("value"), keys=self.column("key"),
                                    headers=headers if len(headers.values) else None,
                                    timestamps=self.timestamps_ms if create_times else None)

    @property
    def codec(self) -> np.ndarray:
        return self.header["attributes"] & 0x7

    @property
    def transactional(self) -> np.ndarray:
        return (self.header["attributes"] & TRANSACTIONAL) != 0

    @property
    def control(self) -> np.ndarray:
        return (self.header["attributes"] & CONTROL) != 0

    @property
    def log_append_time(self) -> np.ndarray:
        return (self.header["attributes"] & TIMESTAMP_TYPE) != 0

    def batch_of(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.counts), dtype=np.int32), self.counts)


# ---------------------------------------------------------------------------------------------------
# Codecs


def _decompress(codec: int, data, cap: int, batch: int) -> np.ndarray:
    out = np.empty(cap + 1, np.uint8)
    try:
        if codec == SNAPPY and bytes(data[:8]) == _XERIAL:
            n = _xerial_decompress(data, out)
        else:
            into = {GZIP: cramjam.gzip.decompress_into, SNAPPY: cramjam.snappy.decompress_raw_into,
                    LZ4: cramjam.lz4.decompress_into, ZSTD: cramjam.zstd.decompress_into}[codec]
            n = into(bytes(data) if codec == SNAPPY else data, out)
    except cramjam.DecompressionError as e:
        too_big = "smaller than required" in str(e) or "whole buffer" in str(e)
        raise KafkaRecordError(f"batch {batch}: {CODECS[codec]} data decompresses to more than {cap} bytes"
                               if too_big else f"batch {batch}: {CODECS[codec]} data cannot be decompressed: {e}",
                               codes.RECORD_LIST_TOO_LARGE if too_big else codes.CORRUPT_MESSAGE, batch) from None
    if n > cap:
        raise KafkaRecordError(f"batch {batch}: {CODECS[codec]} data decompresses to more than {cap} bytes",
                               codes.RECORD_LIST_TOO_LARGE, batch)
    return out[:n]


def _xerial_decompress(data, out: np.ndarray) -> int:
    """snappy-java's framing: magic, two int32 versions, then blocks of [int32 length][raw snappy]."""
    mv = memoryview(data)
    pos, q = 16, 0
    while pos < len(mv):
        if len(mv) - pos < 4:
            raise cramjam.DecompressionError("truncated xerial snappy block length")
        size = struct.unpack_from(">i", mv, pos)[0]
        pos += 4
        if size < 0 or pos + size > len(mv):
            raise cramjam.DecompressionError(f"xerial snappy block of {size} bytes overruns the data")
        q += cramjam.snappy.decompress_raw_into(bytes(mv[pos:pos + size]), out[q:])
        pos += size
    return q


def _compress(codec: int, data: np.ndarray) -> bytes:
    if codec == SNAPPY:  # xerial-framed, as the Java client writes it; every client reads it
        raw = data.tobytes()
        blocks = [bytes(cramjam.snappy.compress_raw(raw[i:i + _XERIAL_BLOCK])) for i in range(0, len(raw), _XERIAL_BLOCK)]
        return _XERIAL + struct.pack(">ii", 1, 1) + b"".join(struct.pack(">i", len(b)) + b for b in blocks)
    if codec == LZ4:  # LZ4's fast mode, as librdkafka writes it: cramjam's default is the ~10x slower HC
        return bytes(cramjam.lz4.compress(data, level=1))
    return bytes({GZIP: cramjam.gzip.compress, ZSTD: cramjam.zstd.compress}[codec](data))


# ---------------------------------------------------------------------------------------------------
# Decoding


def _binary(u8: np.ndarray, starts: np.ndarray, lengths: np.ndarray, typ) -> pa.Array:
    """The ranges ``u8[starts[i]:starts[i] + lengths[i]]`` (length -1: null) as one Arrow array of ``typ``,
    bytes back to back: the compiled ``gather`` copies them into buffers from Arrow's memory pool, which
    keeps its pages (a fresh numpy array per request faults its pages in again; Arrow's ``take`` of every
    second entry of ``u8`` seen as a binary array cost 19 µs a call and 13 ns a record: measured 132 µs
    against ~50 for 10,000 values of 100 B)."""
    n = len(starts)
    nulls = int(np.count_nonzero(lengths < 0))
    if nulls == n:
        return pa.nulls(n, typ)
    total = int(np.maximum(lengths, 0).sum(dtype=np.int64))
    if total > _MAX_INT32:  # decode refuses keys or values over 2 GiB before; headers stay within them
        raise KafkaRecordError("record fields of one partition exceed 2 GiB", codes.RECORD_LIST_TOO_LARGE)
    data, offsets = pa.allocate_buffer(total), pa.allocate_buffer(4 * (n + 1))
    if _compiled().gather(u8, starts, lengths, np.frombuffer(data, np.uint8), np.frombuffer(offsets, np.int32)) != total:
        raise KafkaRecordError("record fields out of their batch", codes.CORRUPT_MESSAGE)  # never: walk checked
    validity = pa.py_buffer(np.packbits(lengths >= 0, bitorder="little")) if nulls else None
    return pa.Array.from_buffers(typ, n, [validity, offsets, data], null_count=nulls)


def decode(data, verify: bool = True, max_uncompressed: int = DEFAULT_MAX_UNCOMPRESSED) -> Batches:
    """Decode every batch in ``data`` (a Produce partition's records); raises KafkaRecordError naming the
    batch and what is wrong. ``verify``: check each batch's CRC-32C (Kafka brokers always do)."""
    mv = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else memoryview(data)
    u8 = np.frombuffer(mv, np.uint8)
    size = len(u8)
    heads, regions, pos = [], [], 0
    while pos < size:
        b = len(heads)
        if size - pos < HEADER_SIZE:
            if size - pos >= 17 and u8[pos + 16] in (0, 1):
                _old_magic(int(u8[pos + 16]), b)
            raise KafkaRecordError(f"batch {b} at byte {pos}: {size - pos} bytes, shorter than a batch header "
                                   f"({HEADER_SIZE})", batch=b, position=pos)
        h = HEADER.unpack_from(mv, pos)
        if h[3] != MAGIC:
            if h[3] in (0, 1):
                _old_magic(h[3], b)
            raise KafkaRecordError(f"batch {b} at byte {pos}: unknown magic {h[3]}", codes.CORRUPT_MESSAGE, b, pos)
        end = pos + 12 + h[1]
        if h[1] < HEADER_SIZE - 12 or end > size:
            raise KafkaRecordError(f"batch {b} at byte {pos}: length {h[1]} does not fit the {size - pos} bytes "
                                   f"left", batch=b, position=pos)
        if verify and crc(u8[pos + CRC_START:end]) != h[4]:
            raise KafkaRecordError(f"batch {b} at byte {pos}: CRC-32C mismatch (damaged in transit?)",
                                   batch=b, position=pos)
        attributes, count = h[5], h[12]
        codec = attributes & 0x7
        if codec not in CODECS:
            raise KafkaRecordError(f"batch {b}: unknown compression codec {codec}", codes.UNSUPPORTED_COMPRESSION_TYPE, b)
        if count < 1 or count > h[1]:
            raise KafkaRecordError(f"batch {b}: impossible record count {count}", codes.INVALID_RECORD, b, pos)
        if h[6] != count - 1:
            raise KafkaRecordError(f"batch {b}: last offset delta {h[6]} for {count} records (expected "
                                   f"{count - 1})", codes.INVALID_RECORD, b, pos)
        body = u8[pos + HEADER_SIZE:end]
        if codec == NONE:
            regions.append((u8, pos + HEADER_SIZE, end))
        else:
            raw = _decompress(codec, body, max_uncompressed, b)
            regions.append((raw, 0, len(raw)))
        heads.append(h)
        pos = end
    if not heads:
        raise KafkaRecordError("no record batch: the partition's records are empty", codes.INVALID_RECORD)
    header = np.array(heads, dtype=_NATIVE_HEADER)
    counts = header["records_count"].astype(np.int64)
    if all(r[0] is u8 for r in regions):
        src = u8
        starts = np.array([r[1] for r in regions], np.int64)
        ends = np.array([r[2] for r in regions], np.int64)
    else:
        src = np.concatenate([r[0][r[1]:r[2]] for r in regions])
        ends = np.cumsum([r[2] - r[1] for r in regions]).astype(np.int64)
        starts = ends - np.array([r[2] - r[1] for r in regions], np.int64)
    K = _compiled()
    status, bad_b, bad_r, ts, od, ks, kl, vs, vl, hc, hs, re = K.walk(src, starts, ends, counts)
    if status == K.BAD_OFFSET_DELTA:
        raise KafkaRecordError(f"batch {bad_b}, record {bad_r}: offset delta {int(od[counts[:bad_b].sum() + bad_r])}, "
                               f"expected {bad_r}", codes.INVALID_RECORD, int(bad_b))
    if status:
        raise KafkaRecordError(f"batch {bad_b}, record {bad_r}: {K.ERRORS[status]}", codes.CORRUPT_MESSAGE, int(bad_b))
    if len(src) > _MAX_INT32 and max(int(np.maximum(kl, 0).sum()), int(np.maximum(vl, 0).sum())) > _MAX_INT32:
        raise KafkaRecordError("keys or values of one partition exceed 2 GiB", codes.RECORD_LIST_TOO_LARGE)
    n = len(od)
    if len(counts) == 1:  # the usual case: one batch a partition
        if header["attributes"][0] & TIMESTAMP_TYPE:
            timestamps = np.full(n, header["max_timestamp"][0], np.int64)
        else:
            timestamps = ts
            timestamps += header["base_timestamp"][0]
    else:
        timestamps = np.repeat(header["base_timestamp"], counts) + ts
        log_append = (header["attributes"] & TIMESTAMP_TYPE) != 0
        if log_append.any():
            timestamps = np.where(np.repeat(log_append, counts), np.repeat(header["max_timestamp"], counts), timestamps)
    batches = Batches(src, header, counts, timestamps, (od, ks, kl, vs, vl, hc, hs, re))
    if batches.has_headers:
        batches.column("headers")  # checked now: decode refuses what is wrong in any record's headers
    return batches


_NO_TIMES = np.zeros(0, np.int64)


def _metaq_body(out: np.ndarray, n: int, vw: int, kw: int, tw: int, value_bytes: int, sizes: np.ndarray,
                largest: int, key_lengths: np.ndarray, create_times) -> mrecords.EncodedBody:
    """The ``EncodedBody`` of a body the compiled ``metaq_body`` wrote, with ``encode_body``'s attribute
    bits and layout (a column's width code at its field's bits)."""
    code = mrecords.WIDTHS.tolist().index
    bits = mrecords.NO_FLAGS | (mrecords.HAS_KEYS if kw else 0) | (mrecords.HAS_TIMESTAMPS if tw else 0)
    layout = code(vw) << 2 * mrecords.VALUE_LEN | (code(kw) << 2 * mrecords.KEY_LEN if kw else 0) \
        | (code(tw) << 2 * mrecords.TIME_DELTA if tw else 0)
    mrecords.check_batch_size(n, len(out))
    columns = (vw + kw + tw) * n + (8 if tw else 0)
    return mrecords.EncodedBody(n, bits | layout << mrecords.LAYOUT_SHIFT, [out], len(out), crc(out), sizes, largest,
                                mrecords.METAQ_MESSAGE_HEAD * n + value_bytes,
                                (key_lengths, columns + value_bytes) if kw else None, create_times)


def _old_magic(magic: int, batch: int):
    raise KafkaRecordError(f"batch {batch} is in message format v{magic} (magic {magic}), which this broker does "
                           f"not accept: only record batches of magic 2 (Kafka 0.11+ clients; Produce v3+)",
                           codes.INVALID_RECORD, batch)


def _headers(src: np.ndarray, hc: np.ndarray, hs: np.ndarray, re: np.ndarray) -> pa.Array:
    n = len(hc)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(hc, out=offsets[1:])
    if not offsets[-1]:  # the usual case: no record has a header
        return pa.Array.from_buffers(HEADERS_TYPE, n, [None, pa.py_buffer(offsets)], children=[_NO_HEADERS])
    K = _compiled()
    status, bad, hks, hkl, hvs, hvl = K.walk_headers(src, hc, hs, re)
    if status:
        raise KafkaRecordError(f"record {int(bad)}: its headers: {K.ERRORS[status]}", codes.CORRUPT_MESSAGE)
    keys = _binary(src, hks, hkl, pa.string())
    try:
        keys.validate(full=True)
    except pa.ArrowInvalid:
        raise KafkaRecordError("a header key is not valid UTF-8", codes.CORRUPT_MESSAGE) from None
    entries = pa.StructArray.from_arrays([keys, _binary(src, hvs, hvl, pa.binary())],
                                         fields=list(HEADERS_TYPE.value_type))
    return pa.ListArray.from_arrays(pa.array(offsets), entries, type=HEADERS_TYPE)


# ---------------------------------------------------------------------------------------------------
# Encoding


def _parts(arr, n: int, typ) -> tuple:
    """(data, starts, lengths) of a binary/string column; lengths -1 where null."""
    if arr is None:
        return np.zeros(0, np.uint8), np.zeros(n, np.int64), np.full(n, -1, np.int32)
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if not isinstance(arr, pa.Array):
        arr = pa.array(arr, typ)
    if pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type):
        arr = arr.cast(typ)
    if len(arr) != n:
        raise InvalidMessageError(f"a column of {len(arr)} entries beside {n} records")
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], np.int32, count=arr.offset + n + 1)[arr.offset:].astype(np.int64)
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets).astype(np.int32)
    if arr.null_count:
        lengths[~arr.is_valid().to_numpy(zero_copy_only=False)] = -1
    return data, offsets[:-1], lengths


def _as_int64(col, n: int, name: str) -> np.ndarray:
    if isinstance(col, (pa.Array, pa.ChunkedArray)):
        if col.null_count:
            raise InvalidMessageError(f"{name} has nulls")
        if pa.types.is_timestamp(col.type):
            col = col.cast(pa.timestamp("ms")).cast(pa.int64())
        col = col.to_numpy(zero_copy_only=False)
    out = np.asarray(col, dtype=np.int64)
    if out.shape != (n,):
        raise InvalidMessageError(f"{name}: {out.shape} entries beside {n} records")
    return out


def _per_batch(value, k: int, dtype) -> np.ndarray:
    return np.broadcast_to(np.asarray(value, dtype=dtype), (k,))


def encode(offsets, timestamps, keys, values, headers=None, batch_starts=None, codec: int = NONE,
           producer_id=-1, producer_epoch=-1, base_sequence=-1, attributes=0, partition_leader_epoch=-1,
           timestamp_type: int = CREATE_TIME) -> memoryview:
    """Record batches (magic 2) of the records given as columns: ``offsets`` and ``timestamps`` (ms, or
    Arrow timestamps), ``keys`` and ``values`` (binary, null allowed), ``headers`` (HEADERS_TYPE, null: none).
    ``batch_starts``: the record where each batch begins (default: one batch); the producer fields and
    ``attributes`` (TRANSACTIONAL, CONTROL) are one value for all batches or one per batch."""
    n = len(values)
    if n == 0:
        return memoryview(b"")
    offsets = _as_int64(offsets, n, "offsets")
    ts = _as_int64(timestamps, n, "timestamps")
    starts = np.array([0] if batch_starts is None else batch_starts, np.int64)
    if starts[0] != 0 or (np.diff(starts) <= 0).any() or starts[-1] >= n:
        raise InvalidMessageError("batch_starts must rise strictly from 0 within the records")
    k = len(starts)
    bounds = np.append(starts, n)
    counts = np.diff(bounds)
    kd, ko, kl = _parts(keys, n, pa.binary())
    vd, vo, vl = _parts(values, n, pa.binary())
    if headers is None:
        h_first = np.zeros(n + 1, np.int64)
        hkd = hvd = np.zeros(0, np.uint8)
        hko = hvo = np.zeros(0, np.int64)
        hkl = hvl = np.zeros(0, np.int32)
    else:
        if isinstance(headers, pa.ChunkedArray):
            headers = headers.combine_chunks()
        if not isinstance(headers, pa.Array):
            headers = pa.array(headers, HEADERS_TYPE)
        if headers.null_count:
            headers = headers.fill_null(pa.scalar([], HEADERS_TYPE))
        h_first = headers.offsets.to_numpy().astype(np.int64)
        flat = headers.flatten()
        nh = len(flat)
        hkd, hko, hkl = _parts(flat.field("key"), nh, pa.string())
        hvd, hvo, hvl = _parts(flat.field("value"), nh, pa.binary())
        if (hkl < 0).any():
            raise InvalidMessageError("a header key is null; Kafka header keys are strings")
        h_first = h_first - h_first[0]
    base_offset = offsets[starts]
    base_ts = ts[starts]
    ts_delta = ts - np.repeat(base_ts, counts)
    off_delta = offsets - np.repeat(base_offset, counts)
    if (off_delta < 0).any() or (off_delta > 0x7FFFFFFF).any():
        raise InvalidMessageError("offsets must rise within a batch, by less than 2**31")
    K = _compiled()
    bodies, sizes = K.record_sizes(ts_delta, off_delta, ko, kl, vo, vl, h_first, hkl, hvl)
    section = np.add.reduceat(sizes, starts)
    if codec == NONE:  # the records are written in place, after room for their batch's header
        lengths = section
        out = raw = np.empty(int((lengths + HEADER_SIZE).sum()), np.uint8)
        rec_pos = np.cumsum(lengths + HEADER_SIZE) - lengths
    else:
        raw = np.empty(int(section.sum()), np.uint8)
        rec_pos = np.cumsum(section) - section
    for b in range(k):  # one compiled call per batch writes its records
        lo, hi = int(bounds[b]), int(bounds[b + 1])
        K.write_records(raw, int(rec_pos[b]), ts_delta[lo:hi], off_delta[lo:hi], kd, ko[lo:hi], kl[lo:hi],
                        vd, vo[lo:hi], vl[lo:hi], h_first[lo:hi + 1], hkd, hko, hkl, hvd, hvo, hvl, bodies[lo:hi])
    if codec != NONE:
        payloads = [_compress(codec, raw[int(p):int(p + s)]) for p, s in zip(rec_pos, section)]
        lengths = np.array([len(p) for p in payloads], np.int64)
        out = np.empty(int((lengths + HEADER_SIZE).sum()), np.uint8)
    head = np.zeros(k, HEADER_DTYPE)
    head["base_offset"] = base_offset
    head["batch_length"] = HEADER_SIZE - 12 + lengths
    head["partition_leader_epoch"] = partition_leader_epoch
    head["magic"] = MAGIC
    head["attributes"] = (codec | (TIMESTAMP_TYPE if timestamp_type == LOG_APPEND_TIME else 0)
                          | _per_batch(attributes, k, np.int16))
    head["last_offset_delta"] = off_delta[bounds[1:] - 1]
    head["base_timestamp"] = base_ts
    head["max_timestamp"] = np.maximum.reduceat(ts, starts)
    head["producer_id"] = _per_batch(producer_id, k, np.int64)
    head["producer_epoch"] = _per_batch(producer_epoch, k, np.int16)
    head["base_sequence"] = _per_batch(base_sequence, k, np.int32)
    head["records_count"] = counts
    hb = head.view(np.uint8).reshape(k, HEADER_SIZE)
    q = 0
    for b in range(k):  # the CRC of each batch covers its header from the attributes on, then its records
        out[q:q + HEADER_SIZE] = hb[b]
        end = q + HEADER_SIZE + int(lengths[b])
        if codec != NONE:
            out[q + HEADER_SIZE:end] = np.frombuffer(payloads[b], np.uint8)
        out[q + 17:q + CRC_START] = np.frombuffer(struct.pack(">I", crc(out[q + CRC_START:end])), np.uint8)
        q = end
    return out.data


def warm_up() -> None:
    """Load (or on first use on this machine, compile) the compiled walks, so the first Kafka request a
    broker serves does not pay for it. Measured in benchmarks/bench_kafka_codec.py."""
    data = encode([0, 1], [0, 0], [b"k", None], [b"v", None], pa.array([[("a", b"b")], []], HEADERS_TYPE))
    decode(data).records  # noqa: B018 - the walks and the gathers
    decode(encode([0, 1], [0, 0], [b"k", None], [b"v", None])).metaq_body(create_times=True)
