"""MetaQ's message-set layout, the bytes of a ``value`` reply, from and to metaq's decoded columns.

Each message, big-endian: i32 length of data, u32 CRC32 (zlib's, the whole 32 bits) of data, i64 message
id, i32 flag, then data: with flag bit 0, an i32 attribute length, the UTF-8 attribute and the payload;
without, the payload. So a message occupies ``20 + len(value) + (4 + len(attribute) if any)`` bytes,
which is how ``byte_base`` counts positions in a partition's MetaQ stream (``offsets``).

Message ids are metaq's own 64-bit ids unchanged (``metaq_broker/ids.py``): positive, increasing within
a partition and unique per broker group, where MetaQ's are unique per broker; MetaQ 1.4 clients keep
them as a Java ``long`` and only log them and store them beside committed offsets.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from metaq_broker.protocol.metaq.text import ATTRIBUTE_PREFIX, HAS_ATTRIBUTE, compiled

HEADER_SIZE = 20
HEADER_DTYPE = np.dtype([("length", ">i4"), ("crc", ">u4"), ("msg_id", ">i8"), ("flag", ">i4")])
assert HEADER_DTYPE.itemsize == HEADER_SIZE
_HEADER = struct.Struct(">iIqi")
_EMPTY = pa.scalar(b"", pa.binary())


def message_sizes(value_lengths: np.ndarray, attribute_lengths: Optional[np.ndarray] = None) -> np.ndarray:
    """Bytes each message occupies in MetaQ's layout; lengths in bytes, -1 for null (a null value is an
    empty payload: MetaQ has no null)."""
    sizes = HEADER_SIZE + np.maximum(np.asarray(value_lengths, dtype=np.int64), 0)
    if attribute_lengths is not None:
        a = np.asarray(attribute_lengths, dtype=np.int64)
        sizes += np.where(a >= 0, ATTRIBUTE_PREFIX + a, 0)
    return sizes


def _binary(arr) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return arr.cast(pa.binary()) if not pa.types.is_binary(arr.type) else arr


COMPILED_CRC_UP_TO = 4096  # mean message bytes up to which the compiled loop beats a zlib.crc32 call each


def crc32_each(data: pa.Array) -> np.ndarray:
    """CRC32 (zlib's, ``java.util.zip.CRC32``'s) of each entry of an Arrow binary array without nulls: small
    messages by one compiled loop over the array's buffer (``_kernels.crcs``: a ``zlib.crc32`` call costs
    more than 100 bytes' checksum), large ones a ``zlib.crc32`` call each."""
    n = len(data)
    offsets = np.frombuffer(data.buffers()[1], np.int32, n + 1, data.offset * 4)
    if n < 8 or int(offsets[-1] - offsets[0]) > COMPILED_CRC_UP_TO * n or data.buffers()[2] is None:
        return np.fromiter(map(zlib.crc32, data.to_pylist()), np.uint32, n)
    kernels, table = compiled()
    out = np.empty(n, np.int64)
    kernels.crcs(np.frombuffer(data.buffers()[2], np.uint8), offsets.astype(np.int64), table, out)
    return out.astype(np.uint32)


def encode_message_set(values, attributes, flags, msg_ids) -> pa.Buffer:
    """The message set of these messages, in order. ``values``: Arrow binary (a null value, a Kafka
    tombstone, is an empty payload: MetaQ has no null, and ``message_sizes`` counts it so); ``attributes``:
    Arrow string or None (nulls: no attribute); ``flags``: i32; ``msg_ids``: i64. Flag bit 0 is set
    exactly for the messages with an attribute (it tells a MetaQ client that the data starts with one).

    Arrow kernels join the pieces; ``crc32_each`` checksums them."""
    values = _binary(values)
    if values.null_count:
        values = values.fill_null(_EMPTY)
    n = len(values)
    flags = np.asarray(flags, dtype=np.int32)
    data = values
    has_attr = np.zeros(n, dtype=bool)
    if attributes is not None and attributes.null_count < n:
        attributes = _binary(attributes)
        has_attr = attributes.is_valid().to_numpy(zero_copy_only=False)
        alen = pc.binary_length(attributes).fill_null(0).to_numpy(zero_copy_only=False).astype(">i4")
        prefix = pa.FixedSizeBinaryArray.from_buffers(pa.binary(ATTRIBUTE_PREFIX), n, [None, pa.py_buffer(alen)])
        prefix = pc.if_else(pa.array(has_attr), prefix.cast(pa.binary()), pa.nulls(n, pa.binary()))
        data = pc.binary_join_element_wise(prefix, attributes, values, _EMPTY, null_handling="replace",
                                           null_replacement=b"")
    header = np.empty(n, HEADER_DTYPE)
    header["length"] = pc.binary_length(data).to_numpy(zero_copy_only=False)
    header["crc"] = crc32_each(data)
    header["msg_id"] = msg_ids
    header["flag"] = (flags & ~np.int32(HAS_ATTRIBUTE)) | has_attr.astype(np.int32)
    head = pa.FixedSizeBinaryArray.from_buffers(pa.binary(HEADER_SIZE), n, [None, pa.py_buffer(header)])
    joined = pc.binary_join_element_wise(head.cast(pa.binary()), data, _EMPTY)
    offsets = np.frombuffer(joined.buffers()[1], np.int32, n + 1, joined.offset * 4)
    return joined.buffers()[2][int(offsets[0]): int(offsets[-1])]


class MessageSetError(ValueError):
    """Bytes that are not MetaQ messages: a bad length, checksum or attribute."""


@dataclass
class MessageSet:
    """Decoded messages: ``values`` and ``attributes`` (None: no attribute) as lists, the rest numpy;
    ``positions`` relative to the set's start; ``consumed``: bytes of the complete messages (a trailing
    partial message is left, as MetaQ's client leaves it)."""
    values: list
    attributes: list
    flags: np.ndarray
    msg_ids: np.ndarray
    positions: np.ndarray
    consumed: int


def decode_message_set(buf, verify: bool = True) -> MessageSet:
    """Decode the complete messages of ``buf``. Tools and tests only: the broker never decodes these."""
    view = memoryview(buf).cast("B")
    pos, rows = 0, []
    while len(view) - pos >= HEADER_SIZE:
        length, crc, msg_id, flag = _HEADER.unpack_from(view, pos)
        if length < 0:
            raise MessageSetError(f"message at byte {pos} has negative length {length}")
        end = pos + HEADER_SIZE + length
        if end > len(view):
            break
        data = bytes(view[pos + HEADER_SIZE: end])
        if verify and zlib.crc32(data) != crc:
            raise MessageSetError(f"message at byte {pos}: checksum {crc} does not match its data's {zlib.crc32(data)}")
        attribute = None
        if flag & HAS_ATTRIBUTE:
            n = int.from_bytes(data[:ATTRIBUTE_PREFIX], "big", signed=True) if length >= ATTRIBUTE_PREFIX else -1
            if not 0 <= n <= length - ATTRIBUTE_PREFIX:
                raise MessageSetError(f"message at byte {pos}: attribute length {n} does not fit its {length} bytes")
            try:
                attribute = data[ATTRIBUTE_PREFIX: ATTRIBUTE_PREFIX + n].decode("utf-8")
            except UnicodeDecodeError:
                raise MessageSetError(f"message at byte {pos}: attribute is not UTF-8") from None
            data = data[ATTRIBUTE_PREFIX + n:]
        rows.append((data, attribute, flag, msg_id, pos))
        pos = end
    cols = list(zip(*rows)) if rows else [(), (), (), (), ()]
    return MessageSet(list(cols[0]), list(cols[1]), np.array(cols[2], np.int32), np.array(cols[3], np.int64),
                      np.array(cols[4], np.int64), pos)
