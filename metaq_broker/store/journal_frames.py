"""The record framing of the transaction journals (``txn_journal.py`` and the earlier ``journal_v1.py``):
``u32 payload length | u32 CRC-32C of (type byte, payload) | u8 type | payload``. A record that is short or
fails its checksum ends the journal (a torn tail) unless a valid record follows (damage: refuse)."""
from __future__ import annotations

import struct

from metaq_broker.protocol import records

RECORD = struct.Struct("<IIB")


def frame(kind: int, payload: bytes) -> bytes:
    return RECORD.pack(len(payload), records.crc(payload, records.crc(bytes([kind]))), kind) + payload


def bad_record(data: bytes, pos: int, kinds: range) -> str:
    """Why the record at ``pos`` is not valid ("" when it is)."""
    if len(data) - pos < RECORD.size:
        return "truncated header"
    length, value, kind = RECORD.unpack_from(data, pos)
    if pos + RECORD.size + length > len(data):
        return "truncated payload"
    if records.crc(data[pos + RECORD.size: pos + RECORD.size + length], records.crc(bytes([kind]))) != value:
        return "checksum mismatch"
    if kind not in kinds:
        return f"unknown type {kind}"
    return ""


def valid_record_after(data: bytes, pos: int, kinds: range) -> bool:
    return any(not bad_record(data, p, kinds) and RECORD.unpack_from(data, p)[0] > 0
               for p in range(pos + 1, len(data) - RECORD.size))


def split(data: bytes, kinds: range) -> list:
    """The records of a stream from another broker as (type, payload, frame), each checked: a stream has
    no torn tail, so any bad record raises ValueError."""
    out, pos, view = [], 0, memoryview(data)
    while pos < len(data):
        bad = bad_record(data, pos, kinds)
        if bad:
            raise ValueError(f"journal stream: bad record at byte {pos} ({bad})")
        length, _, kind = RECORD.unpack_from(data, pos)
        end = pos + RECORD.size + length
        out.append((kind, bytes(view[pos + RECORD.size:end]), bytes(view[pos:end])))
        pos = end
    return out
