"""Compiled loops over Kafka records (numba, ``cache=True``: compiled once per machine, then loaded from
numba's cache in well under a second; ``records.warm_up`` does that at the Kafka listener's first connection).

Why compiled: a record's fields are varints, and where record i+1 starts depends on record i's length
varint, so finding the records is a sequential walk that numpy cannot express; these loops do it at native
speed (benchmarks/bench_kafka_codec.py). Every read is bounds-checked: a kernel returns an error number and
the record it stopped at instead of reading past its region; ``records.py`` turns that into a message.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

OK, TRUNCATED, BAD_LENGTH, LEFTOVER, TOO_MANY_HEADERS, BAD_VARINT, BAD_OFFSET_DELTA, RECORD_LEFTOVER = range(8)
ERRORS = {TRUNCATED: "a record runs past the end of its batch", BAD_LENGTH: "a negative or impossible length",
          LEFTOVER: "bytes left over after the batch's last record (its record count is wrong)",
          TOO_MANY_HEADERS: "a record's header count is impossible for its length",
          BAD_VARINT: "a varint longer than its type allows",
          BAD_OFFSET_DELTA: "its offset delta is not its position in the batch",
          RECORD_LEFTOVER: "bytes left over at the end of a record (its length is wrong)"}


@intrinsic
def _copy(typingctx, dst, dst_at, src, src_at, n):
    """``dst[dst_at:dst_at + n] = src[src_at:src_at + n]`` of two uint8 arrays as one memcpy, unchecked
    (callers check the bounds): numba compiles the slice assignment to a generic loop, ~39 ns per 100-byte
    field against ~3.5."""
    if not (all(isinstance(a, types.Array) and a.dtype == types.uint8 and a.ndim == 1 and a.layout == "C"
                for a in (dst, src)) and dst.mutable):
        return None  # positions count bytes of contiguous arrays, and the bytes are written: nothing else types

    def codegen(context, builder, signature, args):
        d, d_at, s, s_at, size = args
        dst_arr = context.make_array(signature.args[0])(context, builder, d)
        src_arr = context.make_array(signature.args[2])(context, builder, s)
        cgutils.raw_memcpy(builder, builder.gep(dst_arr.data, [d_at]), builder.gep(src_arr.data, [s_at]), size, 1)
        return context.get_dummy_value()
    return types.void(dst, dst_at, src, src_at, n), codegen


@njit(cache=True, nogil=True)
def _varint(u8, p, end, max_bytes):
    """Zigzag varint at p: (value, next position); next position -1 on a truncated or overlong varint."""
    result = np.uint64(0)
    shift = np.uint64(0)
    for i in range(max_bytes):
        if p >= end:
            return np.int64(0), -1
        b = np.uint64(u8[p])
        p += 1
        result |= (b & np.uint64(0x7F)) << shift
        if b < np.uint64(0x80):
            value = np.int64(result >> np.uint64(1)) ^ -np.int64(result & np.uint64(1))
            return value, p
        shift += np.uint64(7)
    return np.int64(0), -2


@njit(cache=True, nogil=True)
def walk(u8, starts, ends, counts):
    """Find every record of the batches whose record regions are u8[starts[b]:ends[b]] (counts[b] records
    each). Returns (status, batch, record, arrays): per record its timestamp and offset deltas, key and value
    start and length (-1: null), header count, where its headers start and where it ends. A record whose
    offset delta is not its position in its batch is refused (BAD_OFFSET_DELTA; Kafka's INVALID_RECORD)."""
    n = 0
    for b in range(len(counts)):
        n += counts[b]
    ts = np.empty(n, np.int64)
    od = np.empty(n, np.int64)
    ks = np.empty(n, np.int64)
    kl = np.empty(n, np.int32)
    vs = np.empty(n, np.int64)
    vl = np.empty(n, np.int32)
    hc = np.empty(n, np.int32)
    hs = np.empty(n, np.int64)
    re = np.empty(n, np.int64)
    i = 0
    for b in range(len(counts)):
        p = starts[b]
        end = ends[b]
        for k in range(counts[b]):
            length, p = _varint(u8, p, end, 5)
            if p < 0:
                return (TRUNCATED if p == -1 else BAD_VARINT), b, k, ts, od, ks, kl, vs, vl, hc, hs, re
            rec_end = p + length
            if length < 6 or rec_end > end:  # attributes, then five varints of at least a byte each
                return (BAD_LENGTH if length < 6 else TRUNCATED), b, k, ts, od, ks, kl, vs, vl, hc, hs, re
            p += 1  # record attributes: unused
            t, p = _varint(u8, p, rec_end, 10)
            if p < 0:
                return (TRUNCATED if p == -1 else BAD_VARINT), b, k, ts, od, ks, kl, vs, vl, hc, hs, re
            o, p = _varint(u8, p, rec_end, 5)
            if p < 0:
                return (TRUNCATED if p == -1 else BAD_VARINT), b, k, ts, od, ks, kl, vs, vl, hc, hs, re
            od[i] = o
            if o != k:
                return BAD_OFFSET_DELTA, b, k, ts, od, ks, kl, vs, vl, hc, hs, re
            ln, p = _varint(u8, p, rec_end, 5)
            if p < 0 or ln < -1 or p + max(ln, 0) > rec_end:
                return (BAD_VARINT if p == -2 else BAD_LENGTH), b, k, ts, od, ks, kl, vs, vl, hc, hs, re
            ks[i] = p
            kl[i] = ln
            p += max(ln, 0)
            ln, p = _varint(u8, p, rec_end, 5)
            if p < 0 or ln < -1 or p + max(ln, 0) > rec_end:
                return (BAD_VARINT if p == -2 else BAD_LENGTH), b, k, ts, od, ks, kl, vs, vl, hc, hs, re
            vs[i] = p
            vl[i] = ln
            p += max(ln, 0)
            h, p = _varint(u8, p, rec_end, 5)
            if p < 0:
                return (TRUNCATED if p == -1 else BAD_VARINT), b, k, ts, od, ks, kl, vs, vl, hc, hs, re
            if h < 0 or 2 * h > rec_end - p:  # each header is at least two one-byte varints
                return TOO_MANY_HEADERS, b, k, ts, od, ks, kl, vs, vl, hc, hs, re
            if h == 0 and p != rec_end:  # a record's fields end where its length says (walk_headers: with headers)
                return RECORD_LEFTOVER, b, k, ts, od, ks, kl, vs, vl, hc, hs, re
            ts[i] = t
            hc[i] = h
            hs[i] = p
            re[i] = rec_end
            p = rec_end
            i += 1
        if p != end:
            return LEFTOVER, b, counts[b], ts, od, ks, kl, vs, vl, hc, hs, re
    return OK, 0, 0, ts, od, ks, kl, vs, vl, hc, hs, re


@njit(cache=True, nogil=True)
def walk_headers(u8, hc, hs, re):
    """Every header of the records ``walk`` found: key start and length, value start and length (-1:
    null). Returns (status, record, arrays)."""
    total = 0
    for i in range(len(hc)):
        total += hc[i]
    hks = np.empty(total, np.int64)
    hkl = np.empty(total, np.int32)
    hvs = np.empty(total, np.int64)
    hvl = np.empty(total, np.int32)
    j = 0
    for i in range(len(hc)):
        p = hs[i]
        end = re[i]
        for _ in range(hc[i]):
            ln, p = _varint(u8, p, end, 5)
            if p < 0 or ln < 0 or p + ln > end:
                return BAD_LENGTH, i, hks, hkl, hvs, hvl
            hks[j] = p
            hkl[j] = ln
            p += ln
            ln, p = _varint(u8, p, end, 5)
            if p < 0 or ln < -1 or p + max(ln, 0) > end:
                return BAD_LENGTH, i, hks, hkl, hvs, hvl
            hvs[j] = p
            hvl[j] = ln
            p += max(ln, 0)
            j += 1
        if p != end:
            return RECORD_LEFTOVER, i, hks, hkl, hvs, hvl
    return OK, 0, hks, hkl, hvs, hvl


@njit(cache=True, nogil=True)
def gather(u8, starts, lengths, out, offsets):
    """Copy the ranges ``u8[starts[i]:starts[i] + lengths[i]]`` (length -1: null, nothing) back to back into
    ``out``, ``offsets[i]`` where range i begins there (n + 1 entries: an Arrow binary column's offsets).
    Returns the bytes written, or -1 (nothing trusted) if a range lies outside ``u8`` or would overrun
    ``out``, or the arrays' lengths do not match: never for ranges ``walk`` found."""
    if len(lengths) != len(starts) or len(offsets) != len(starts) + 1:
        return -1
    q = 0
    offsets[0] = 0
    for i in range(len(starts)):
        ln = lengths[i]
        if ln > 0:
            s = starts[i]
            if s < 0 or s + ln > len(u8) or q + ln > len(out):
                return -1
            _copy(out, np.int64(q), u8, np.int64(s), np.int64(ln))
            q += ln
        offsets[i + 1] = q
    return q


# ---------------------------------------------------------------------------------------------------
# Encoding


@njit(cache=True, nogil=True)
def _zz_size(v):
    u = np.uint64((v << 1) ^ (v >> 63))
    n = 1
    while u >= np.uint64(0x80):
        u >>= np.uint64(7)
        n += 1
    return n


@njit(cache=True, nogil=True)
def _put_zz(out, q, v):
    u = np.uint64((v << 1) ^ (v >> 63))
    while u >= np.uint64(0x80):
        out[q] = np.uint8((u & np.uint64(0x7F)) | np.uint64(0x80))
        u >>= np.uint64(7)
        q += 1
    out[q] = np.uint8(u)
    return q + 1


@njit(cache=True, nogil=True)
def _put(out, q, data, off, ln):
    """``data[off:off + ln]`` (nothing for a null's -1) copied to ``out[q]``; the position after it.
    Written without ``max(ln, 0)``: with it numba's loop around a call ran at ~14 ns a 100-byte field
    against ~4 (benchmarks/bench_kafka_codec.py)."""
    if ln > 0:
        if off < 0 or off + ln > len(data) or q + ln > len(out):  # never: encode sized ``out`` from the columns
            raise IndexError("a record field lies outside its column or its batch")
        _copy(out, np.int64(q), data, np.int64(off), np.int64(ln))
        return q + ln
    return q


@njit(cache=True, nogil=True)
def record_sizes(ts_delta, off_delta, k_off, k_len, v_off, v_len, h_first, hk_len, hv_len):
    """Each record's body size and its encoded size (length varint included). ``h_first[i]:h_first[i+1]``
    are record i's headers (lengths -1: null)."""
    n = len(ts_delta)
    bodies = np.empty(n, np.int64)
    sizes = np.empty(n, np.int64)
    for i in range(n):
        body = 1 + _zz_size(ts_delta[i]) + _zz_size(off_delta[i])
        body += _zz_size(k_len[i]) + max(k_len[i], 0) + _zz_size(v_len[i]) + max(v_len[i], 0)
        h0 = h_first[i]
        h1 = h_first[i + 1]
        body += _zz_size(h1 - h0)
        for j in range(h0, h1):
            body += _zz_size(hk_len[j]) + hk_len[j] + _zz_size(hv_len[j]) + max(hv_len[j], 0)
        bodies[i] = body
        sizes[i] = _zz_size(body) + body
    return bodies, sizes


@njit(cache=True, nogil=True)
def write_records(out, q, ts_delta, off_delta, k_data, k_off, k_len, v_data, v_off, v_len,
                  h_first, hk_data, hk_off, hk_len, hv_data, hv_off, hv_len, bodies):
    """Write the records into ``out`` from byte ``q``; returns the end position."""
    for i in range(len(ts_delta)):
        q = _put_zz(out, q, bodies[i])
        out[q] = 0
        q += 1
        q = _put_zz(out, q, ts_delta[i])
        q = _put_zz(out, q, off_delta[i])
        q = _put_zz(out, q, k_len[i])
        q = _put(out, q, k_data, k_off[i], k_len[i])
        q = _put_zz(out, q, v_len[i])
        q = _put(out, q, v_data, v_off[i], v_len[i])
        h0 = h_first[i]
        h1 = h_first[i + 1]
        q = _put_zz(out, q, h1 - h0)
        for j in range(h0, h1):
            q = _put_zz(out, q, hk_len[j])
            q = _put(out, q, hk_data, hk_off[j], hk_len[j])
            q = _put_zz(out, q, hv_len[j])
            q = _put(out, q, hv_data, hv_off[j], hv_len[j])
    return q


# ---------------------------------------------------------------------------------------------------
# Kafka records to a metaq batch body

@njit(cache=True, nogil=True)
def _width(largest):
    """Bytes of metaq's narrowest signed column width that holds every entry from -1 to ``largest``
    (``protocol/records.py``'s ``_width_code``)."""
    if largest < 1 << 7:
        return 1
    if largest < 1 << 15:
        return 2
    if largest < 1 << 31:
        return 4
    return 8


@njit(cache=True, nogil=True)
def _put_le(out, q, v, width):
    """``v`` as a little-endian two's-complement integer of ``width`` bytes at ``out[q]``."""
    u = np.uint64(v)
    for b in range(width):
        out[q + b] = np.uint8(u & np.uint64(0xFF))
        u >>= np.uint64(8)
    return q + width


@njit(cache=True, nogil=True)
def _put_column(out, q, column, base, width):
    """Each ``column[i] - base`` as a ``width``-byte little-endian integer, back to back from ``out[q]``; the
    position after them. One loop per width, so each is unrolled: with the width a variable the byte loop
    ran ~5 ns an entry against ~1."""
    n = len(column)
    if width == 1:
        for i in range(n):
            _put_le(out, q + i, column[i] - base, 1)
    elif width == 2:
        for i in range(n):
            _put_le(out, q + 2 * i, column[i] - base, 2)
    elif width == 4:
        for i in range(n):
            _put_le(out, q + 4 * i, column[i] - base, 4)
    else:
        for i in range(n):
            _put_le(out, q + 8 * i, column[i] - base, 8)
    return q + n * width


@njit(cache=True, nogil=True)
def metaq_body(u8, vs, vl, ks, kl, times):
    """The metaq batch body of the records ``walk`` found (values at ``vs``/``vl``, keys at ``ks``/``kl``,
    create times ``times``, or none when it is empty), laid out as ``protocol/records.encode_body`` lays
    out these columns without flags, attributes or headers: value lengths, key lengths (only when a key is
    not null), an 8-byte base (the earliest time) and each time's delta from it, each column in its
    narrowest width; then the values' bytes, the keys', zeros up to a multiple of 8. Straight from the
    Kafka bytes: no column is built on the way. Returns (body, value width, key width (0: no key column),
    time width (0: none), value bytes, earliest and latest time, each message's bytes in the body (its data
    and its column entries), the largest message's data bytes)."""
    n = len(vl)
    vmax = -1
    kmax = -1
    vsum = 0
    ksum = 0
    for i in range(n):
        vmax = max(vmax, vl[i])
        kmax = max(kmax, kl[i])
        vsum += max(vl[i], 0)
        ksum += max(kl[i], 0)
    tmin = 0
    tmax = 0
    if len(times):
        tmin = times.min()
        tmax = times.max()
    vw = _width(vmax)
    kw = _width(kmax) if kmax >= 0 else 0
    tw = _width(tmax - tmin) if len(times) else 0
    end = (vw + kw + tw) * n + (8 if tw else 0) + vsum + ksum
    out = np.empty(end + (-end) % 8, np.uint8)
    q = _put_column(out, 0, vl, 0, vw)
    if kw:
        q = _put_column(out, q, kl, 0, kw)
    if tw:
        q = _put_column(out, _put_le(out, q, tmin, 8), times, tmin, tw)
    sizes = np.empty(n, np.uint32)
    largest = 0
    for i in range(n):
        data = vl[i] if vl[i] > 0 else 0
        if kw and kl[i] > 0:
            data += kl[i]
        if data > largest:
            largest = data
        sizes[i] = data + vw + kw + tw
    for i in range(n):
        q = _put(out, q, u8, vs[i], vl[i])
    if kw:
        for i in range(n):
            q = _put(out, q, u8, ks[i], kl[i])
    out[q:] = 0
    return out, vw, kw, tw, vsum, tmin, tmax, sizes, largest

