"""Compiled loops over a buffer of pipelined MetaQ ``put`` lines (numba, ``cache=True``: compiled once per
machine, then loaded from numba's cache; ``text.warm_up`` does that at the MetaQ listener's first connection).

Why compiled: where put i+1 starts depends on put i's declared body length, so finding a buffer's puts is
a sequential walk that numpy cannot express, and a regular expression, ``int()`` and ``zlib.crc32`` per put
cost microseconds of Python each. ``scan_puts`` does the walk, the numbers and the checksums at native speed
and stops at the first put it does not accept exactly as ``text._FAST_PUT`` and the general path would
(anything else is left to them, which say what is wrong); ``format_put_results`` writes their replies.
``text.py`` imports this module on first use, so importing the protocol costs no numba.
"""
from __future__ import annotations

import numpy as np
from numba import njit

INT32_MAX = (1 << 31) - 1
MAX_TOPIC = 255  # as text._FAST_PUT: [!-~]{1,255}
MAX_DIGITS = 10
BIG_BODY = 4096  # a larger body ends a run: zlib's CRC (one call) beats ``_crc`` on it


def crc_tables() -> np.ndarray:
    """CRC-32's (IEEE 802.3, reflected: zlib's and java.util.zip.CRC32's) tables for slicing by 8: row 0
    the byte-wise table, row k a byte's effect k bytes further on. int64: numba mixes no signed and unsigned
    types in ``_crc``."""
    t = np.zeros((8, 256), np.int64)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        t[0, i] = c
    for k in range(1, 8):
        t[k] = (t[k - 1] >> 8) ^ t[0, t[k - 1] & 0xFF]
    return t


@njit(cache=True, nogil=True)
def _crc(u8, start, length, t):
    """CRC32 of ``u8[start:start + length]``, eight bytes a step."""
    c = 0xFFFFFFFF
    k = start
    end = start + length
    while end - k >= 8:
        one = c ^ (np.int64(u8[k]) | np.int64(u8[k + 1]) << 8 | np.int64(u8[k + 2]) << 16 | np.int64(u8[k + 3]) << 24)
        c = (t[7, one & 0xFF] ^ t[6, (one >> 8) & 0xFF] ^ t[5, (one >> 16) & 0xFF] ^ t[4, one >> 24]
             ^ t[3, u8[k + 4]] ^ t[2, u8[k + 5]] ^ t[1, u8[k + 6]] ^ t[0, u8[k + 7]])
        k += 8
    while k < end:
        c = t[0, (c ^ u8[k]) & 0xFF] ^ (c >> 8)
        k += 1
    return c ^ 0xFFFFFFFF


@njit(cache=True, nogil=True)
def scan_puts(u8, pos, end, max_size, table, out, head):
    """Walk the puts from ``pos`` while each is ``put <topic> <partition> <len> <flag> <checksum>
    <opaque>\\r\\n<body>`` with the first put's topic and partition, every number in range, flag bit 0 clear
    (no attribute), a body of at most ``min(max_size, BIG_BODY)`` bytes already in ``u8[:end]``, and a
    checksum of -1 or CRC32(body) & 0x7FFFFFFF. Fills ``out`` rows (length, flag, checksum, opaque, body
    start) and ``head`` (topic start, topic length, partition); returns (puts found, position after them)."""
    cap = out.shape[0]
    n = 0
    p = pos
    ts0 = 0
    tl0 = 0
    part0 = 0
    limit = min(max_size, BIG_BODY)
    while n < cap:
        q = p
        if end - q < 4 or u8[q] != 112 or u8[q + 1] != 117 or u8[q + 2] != 116 or u8[q + 3] != 32:  # "put "
            break
        q += 4
        ts = q
        while q < end and 33 <= u8[q] <= 126 and q - ts <= MAX_TOPIC:
            q += 1
        tl = q - ts
        if tl == 0 or tl > MAX_TOPIC or q >= end or u8[q] != 32:
            break
        if n > 0:
            if tl != tl0:
                break
            same = True
            for k in range(tl):
                if u8[ts + k] != u8[ts0 + k]:
                    same = False
                    break
            if not same:
                break
        q += 1
        ok = True
        partition = 0
        length = 0
        flag = 0
        checksum = 0
        opaque = 0
        for field in range(5):  # partition, length, flag, checksum, opaque
            negative = False
            if q < end and u8[q] == 45 and field != 1:  # '-'
                negative = True
                q += 1
            value = 0
            digits = 0
            while q < end and 48 <= u8[q] <= 57 and digits <= MAX_DIGITS:
                value = value * 10 + (u8[q] - 48)
                digits += 1
                q += 1
            if digits == 0 or digits > MAX_DIGITS:
                ok = False
                break
            if field < 4:
                if q >= end or u8[q] != 32:
                    ok = False
                    break
                q += 1
            else:
                if end - q < 2 or u8[q] != 13 or u8[q + 1] != 10:
                    ok = False
                    break
                q += 2
            if negative:
                value = -value
            if field == 0:
                if negative and (digits != 1 or value != -1) or value > INT32_MAX:
                    ok = False
                    break
                partition = value
            elif field == 1:
                length = value
            elif value > INT32_MAX or value < -INT32_MAX - 1:
                ok = False
                break
            elif field == 2:
                flag = value
            elif field == 3:
                checksum = value
            else:
                opaque = value
        if not ok or flag & 1 or length > limit or end - q < length:
            break
        if n > 0 and partition != part0:
            break
        if checksum != -1:
            if _crc(u8, q, length, table) & 0x7FFFFFFF != checksum:
                break
        if n == 0:
            ts0 = ts
            tl0 = tl
            part0 = partition
        out[n, 0] = length
        out[n, 1] = flag
        out[n, 2] = checksum
        out[n, 3] = opaque
        out[n, 4] = q
        n += 1
        p = q + length
    head[0] = ts0
    head[1] = tl0
    head[2] = part0
    return n, p


@njit(cache=True, nogil=True)
def gather(u8, starts, lengths, data):
    """The bodies at ``starts`` (``lengths`` bytes each) one after another into ``data``."""
    w = 0
    for i in range(starts.shape[0]):
        s = starts[i]
        for k in range(lengths[i]):
            data[w + k] = u8[s + k]
        w += lengths[i]


@njit(cache=True, nogil=True)
def _decimal(out, w, v):
    """``v`` in decimal at ``out[w:]``; the position after it."""
    if v < 0:
        out[w] = 45
        w += 1
        v = -v
    n = 1
    x = v
    while x >= 10:
        x //= 10
        n += 1
    for i in range(n - 1, -1, -1):
        out[w + i] = 48 + v % 10
        v //= 10
    return w + n


@njit(cache=True, nogil=True)
def _digits(v):
    n = 1 if v >= 0 else 2
    v = abs(v)
    while v >= 10:
        v //= 10
        n += 1
    return n


REPLY_MAX = 96  # bytes of one put's reply at most: "result 200 " + 2 + 1 + 11 + 2, then 20 + 1 + 11 + 1 + 20


@njit(cache=True, nogil=True)
def format_put_results(ids, partition, positions, opaques, out):
    """``result 200 <len> <opaque>\r\n<msgId> <partition> <position>`` for each put into ``out`` (``REPLY_MAX``
    bytes a put); the bytes written."""
    w = 0
    part_digits = _digits(partition)
    for i in range(ids.shape[0]):
        for ch in (114, 101, 115, 117, 108, 116, 32, 50, 48, 48, 32):  # "result 200 "
            out[w] = ch
            w += 1
        w = _decimal(out, w, _digits(ids[i]) + part_digits + _digits(positions[i]) + 2)
        out[w] = 32
        w = _decimal(out, w + 1, opaques[i])
        out[w] = 13
        out[w + 1] = 10
        w = _decimal(out, w + 2, ids[i])
        out[w] = 32
        w = _decimal(out, w + 1, partition)
        out[w] = 32
        w = _decimal(out, w + 1, positions[i])
    return w


@njit(cache=True, nogil=True)
def crcs(u8, offsets, table, out):
    """CRC32 of each ``u8[offsets[i]:offsets[i + 1]]`` into ``out[i]`` (a ``get`` reply's messages)."""
    for i in range(out.shape[0]):
        out[i] = _crc(u8, offsets[i], offsets[i + 1] - offsets[i], table)
