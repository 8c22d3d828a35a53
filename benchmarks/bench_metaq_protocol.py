"""MetaQ protocol parts, per message, beside baselines from the same run (no broker, no sockets).

    python benchmarks/bench_metaq_protocol.py [--messages N] [--json PATH]

* ``parse put``: ``RequestParser.feed`` over N pipelined 7-token puts of 100 B values with checksums
  (verified), fed in 64 KiB pieces as a socket delivers them: ns per put. Baselines: ``native encode``,
  records.encode_body of the same N values as one batch (the native producer's per-message cost), and
  ``crc32 loop``, one zlib.crc32 call per value (the checksum a MetaQ put must verify).
* ``encode set``: encode_message_set of N 100 B messages, without and with attributes: ns per message
  and MB/s. Baseline: ``native decode``, records.decode of the same messages stored as one batch (what a
  native fetch costs the reader).
* ``crc32``: the per-message CRC32, zlib.crc32 called per message, against a vectorised numpy CRC
  (256-entry table, one numpy step per byte column over all messages: slower) and the encoder's compiled
  loop over the Arrow buffer (``messages.crc32_each``, numba).
* ``answer_get``: one answer over a window of 100 batches of 100 messages.

Figures only: no timing is asserted.
"""
from __future__ import annotations

import argparse
import json
import time
import zlib

import numpy as np
import pyarrow as pa

from benchmarks.common import log, values_array
from metaq_broker.protocol import records
from metaq_broker.protocol.metaq.messages import crc32_each, encode_message_set
from metaq_broker.protocol.metaq.offsets import Window, answer_get
from metaq_broker.protocol.metaq.text import PutRun, RequestParser


def best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def numpy_crc32(values: pa.Array) -> np.ndarray:
    """CRC32 of every value at once: right-aligned rows (leading zeros leave a zero-initialised CRC
    register unchanged), one table step per byte column, then zlib's initial value folded in per length."""
    table = np.zeros(256, np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        table[i] = c
    offsets = np.frombuffer(values.buffers()[1], np.int32, len(values) + 1).astype(np.int64)
    lengths = np.diff(offsets)
    width = int(lengths.max())
    data = np.frombuffer(values.buffers()[2], np.uint8)
    idx = np.arange(width)[None, :] - (width - lengths)[:, None]
    rows = np.where(idx >= 0, data[np.clip(offsets[:-1, None] + idx, 0, len(data) - 1)], 0).astype(np.uint32)
    crc = np.zeros(len(values), np.uint32)
    for j in range(width):
        crc = table[(crc ^ rows[:, j]) & 0xFF] ^ (crc >> 8)
    zero_crcs = np.array([zlib.crc32(bytes(k)) for k in range(width + 1)], np.uint32)
    return crc ^ zero_crcs[lengths]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--json")
    args = ap.parse_args()
    n = args.messages
    values = values_array(0, n)
    pylist = values.to_pylist()
    rows = {}

    def row(name, seconds, per=n, nbytes=None, baseline=None):
        ns = seconds / per * 1e9
        rows[name] = {"ns_per_message": round(ns, 1)}
        extra = ""
        if nbytes is not None:
            rows[name]["MB_s"] = round(nbytes / seconds / 1e6, 1)
            extra += f"  {rows[name]['MB_s']:8.1f} MB/s"
        if baseline is not None:
            rows[name][f"x_{baseline}"] = round(ns / rows[baseline]["ns_per_message"], 2)
            extra += f"  {rows[name][f'x_{baseline}']:6.2f} x {baseline}"
        log(f"{name:<28} {ns:9.1f} ns/msg{extra}")

    # -- baselines ---------------------------------------------------------------------------------------
    row("native encode", best(lambda: records.encode_body(values)))
    row("crc32 loop", best(lambda: list(map(zlib.crc32, pylist))))
    body = records.encode_body(values, attributes=pa.array(["k=v"] * n))
    stored = records.encode_header(body, 0, 1, 0) + b"".join(bytes(p) for p in body.parts)
    row("native decode", best(lambda: records.decode(stored)))

    # -- parsing pipelined puts ----------------------------------------------------------------------------
    wire = b"".join(b"put bench 0 %d 0 %d %d\r\n" % (len(v), zlib.crc32(v) & 0x7FFFFFFF, i) + v
                    for i, v in enumerate(pylist))
    pieces = [wire[i: i + 65536] for i in range(0, len(wire), 65536)]

    def parse():
        p = RequestParser()
        count = 0
        for piece in pieces:
            count += sum(len(e) if isinstance(e, PutRun) else 1 for e in p.feed(piece))
        assert count == n
    row("parse put", best(parse, 3), baseline="native encode")

    # -- encoding value replies ---------------------------------------------------------------------------
    flags = np.zeros(n, np.int32)
    ids = np.arange(n, dtype=np.int64)
    plain = best(lambda: encode_message_set(values, None, flags, ids))
    row("encode set", plain, nbytes=n * 120, baseline="native decode")
    attrs = pa.array(["k=v"] * n)
    row("encode set + attribute", best(lambda: encode_message_set(values, attrs, flags, ids)), nbytes=n * 127,
        baseline="native decode")

    # -- CRC32 per message: a C call each, numpy, or one compiled loop ---------------------------------------
    assert (numpy_crc32(values[:1000]) == np.array(list(map(zlib.crc32, pylist[:1000])), np.uint32)).all()
    row("crc32 numpy vectorised", best(lambda: numpy_crc32(values), 3), baseline="crc32 loop")
    assert (crc32_each(values) == np.array(list(map(zlib.crc32, pylist)), np.uint32)).all()
    row("crc32 compiled (crc32_each)", best(lambda: crc32_each(values)), baseline="crc32 loop")

    # -- offset answers -----------------------------------------------------------------------------------
    nb, per = 100, 100
    w = Window(np.arange(nb) * per, np.arange(nb) * per * 120, [per] * nb, [120] * (nb * per))
    positions = np.random.default_rng(1).integers(0, nb * per * 120, 1000)
    row("answer_get (window 10k msgs)",
        best(lambda: [answer_get(w, int(p), 1 << 20, 0, nb * per, w.end_position) for p in positions]), per=1000)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
