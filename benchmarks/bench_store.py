"""Storage-engine benchmark: append and read-to-Arrow throughput, beside baselines from the same run.

    python benchmarks/bench_store.py [--quick] [--dir PATH] [--json PATH]

What it measures (each case on a fresh partition in a temporary directory under --dir, removed after):

* Baselines, measured in the same directory at the start and again at the end of the run (the ratios use
  their mean; a large difference between the two means the disk's speed drifted during the run):
  - ``disk 1MiB+fsync``: os.write of 1 MiB chunks, os.fsync after each (as much as one batch-of-1000
    case writes): the disk's sequential durable write rate, MB/s.
  - ``disk 150B+fsync``: os.write of 150 bytes, os.fsync after each: fsyncs per second, the ceiling
    for batch-of-1 appends under group commit from a single thread.
  - ``memcpy``: numpy copy of a 256 MiB array (best of 3), GB/s.
* ``append <mode> <value size> b<batch size> t<threads>``: appends of 100 B and 1 KiB values under group
  commit (``group``: unflush_threshold=0, acknowledged after an fsync covering the batch) and under
  ``unflush1000`` (acknowledged after the page-cache write, fsync every 1000 messages or 1 s), in
  batches of 1000 (pre-built pyarrow arrays, one thread) and of 1 (one-element lists, from 1 thread and
  from 8 concurrent threads, which share fsyncs under group commit). At most 256 MiB of values
  (batches of 1000) or 20k appends (batches of 1), and at most 4 s, per case.
* ``read+decode <value size> b<batch size>``: the whole partition read back with ``read()`` (1 MiB per
  fetch) + ``decode(verify=True)`` to Arrow in a loop over offsets, for the data of the unflush1000
  t1 cases (written in batches of 1000, and of 1); whole passes, repeated for up to 4 s.
* Lookups (a table of their own: calls/s, and wall and CPU microseconds per call) in the 100 B data of those cases, at
  random offsets or times: ``locate`` of 1 MiB (where a data-port fetch's bytes are), ``offset_for_timestamp``,
  ``range_bytes`` and ``offset_after_bytes`` of 1 MiB (Spark's byte budgets), ``timestamp_at``.
* Key index (a table of its own; skipped for a tree without ``store/keyindex.py``): appends of 100 B values
  with keys (``order-<n>``, 7 to 15 bytes) in batches of 1000 (group commit and unflush1000) and of 1
  (unflush1000), with the key index off, and on: each append followed by ``KeyIndex.add`` of its keys, as
  the partition will do it. Rounds alternate off and on; the best of each, and their ratio (the goal:
  at least 0.9). Beside them, from the same rounds, the median cost of an append and of ``KeyIndex.add``
  per batch, and append / (append + add): the rate ratio with the noise of a shared machine taken out.
* Stored bytes (a table of their own): per message of each append case, the log's and the offset index's
  bytes on disk after the partitions are closed (sealed, indexes written): log + index over the values,
  and the index over the log. The issue's goal for 100 B messages: at most 3% over the message.

The lookup and stored-bytes cases use only calls that every metaq version has, so the same script run
against another tree (``PYTHONPATH`` of that tree, the script copied outside this one) gives its figures
for the same cases.

``--quick`` shrinks every volume 10x and the time limit to 1 s. Figures only: no timing is asserted.

Reading the table: ``MB/s`` counts value (payload) bytes only; the log adds a 72-byte header per batch
and each message's integer column entries (record format 3: one byte for a value of up to 127 bytes, two
up to 32 KiB; format 2, before: 8 bytes). ``appends/fsync`` counts every os.fsync the engine made during the case:
above 1 under group commit from 8 threads, appends shared fsyncs. ``/disk`` is our MB/s over the
1 MiB+fsync rate: near 1.0, appends (or reads) move bytes as fast as the disk takes them durably.
``/fsync`` is our appends (batches) per second over the 150 B+fsync rate: batch-of-1 group commit from
one thread cannot exceed about 1.0; from 8 threads it can, by sharing fsyncs. ``/memcpy`` is our MB/s
over the memory copy rate, the ceiling for anything that touches every byte once.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from metaq_broker.store import PartitionLog, TopicConfig  # noqa: E402

MiB = 1 << 20
MODES = {"group": TopicConfig(unflush_threshold=0), "unflush1000": TopicConfig(unflush_threshold=1000)}


def timed(op, n, limit, threads=1):
    """Run ``op(i)`` for i in 0..n-1, shared among ``threads`` threads, stopping early once ``limit``
    seconds have passed. Returns (the sum of what the calls returned, the calls made, seconds)."""
    tickets, results = itertools.count(), []
    start = threading.Barrier(threads + 1)

    def worker():
        total = calls = 0
        start.wait()
        while (i := next(tickets)) < n and time.perf_counter() < deadline:
            total += op(i)
            calls += 1
        results.append((total, calls))

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    t0 = time.perf_counter()
    deadline = t0 + limit
    start.wait()
    for t in pool:
        t.join()
    secs = time.perf_counter() - t0
    return sum(r[0] for r in results), sum(r[1] for r in results), secs


def random_values(count, size, rng):
    """A pyarrow binary array of ``count`` random ``size``-byte values (no Python loop)."""
    offsets = np.arange(count + 1, dtype=np.int32) * size
    data = rng.integers(0, 256, count * size, dtype=np.uint8)
    return pa.Array.from_buffers(pa.binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def disk_rate(path, chunk, n, limit):
    """Write ``n`` chunks of ``chunk`` bytes with an fsync after each; returns (bytes, writes, seconds)."""
    buf = os.urandom(chunk)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        def op(_):
            os.write(fd, buf)
            os.fsync(fd)
            return chunk
        return timed(op, n, limit)
    finally:
        os.close(fd)
        os.unlink(path)


def memcpy_rate(nbytes):
    """Bytes per second of a numpy copy between two ``nbytes`` arrays (best of 3, pages faulted in)."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def baselines(root, volume, small_n, limit, scale):
    """The disk (1 MiB + fsync, 150 B + fsync) and memory-copy rates, measured now under ``root``."""
    nbytes, _, secs = disk_rate(root / "disk-1m", MiB, max(volume // MiB, 4), limit)
    _, fsyncs, fsync_secs = disk_rate(root / "disk-150", 150, small_n, limit)
    return {"disk_mb_s": nbytes / 1e6 / secs, "fsync_per_s": fsyncs / fsync_secs,
            "memcpy_gb_s": memcpy_rate(int(256 * MiB * scale)) / 1e9}


@contextlib.contextmanager
def counting_fsyncs():
    """Count the os.fsync calls made while the block runs (the engine calls it through the os module)."""
    real, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)  # list.append is atomic, so the count is exact across threads
        return real(fd)

    os.fsync = fsync
    try:
        yield calls
    finally:
        os.fsync = real


def read_all(log):
    """One pass over the partition with read() + decode(verify=True); returns the messages decoded."""
    offset, end, n = log.earliest_offset, log.latest_offset, 0
    while offset < end:
        batch = log.read(offset).decode(verify=True)
        if batch.num_rows == 0 or batch.column("offset")[0].as_py() != offset:
            raise RuntimeError(f"{log.name}: read at offset {offset} returned a bad batch")
        n += batch.num_rows
        offset += batch.num_rows
    if n != end - log.earliest_offset:
        raise RuntimeError(f"{log.name}: decoded {n} messages, the log holds {end - log.earliest_offset}")
    return n


def run(root, quick):
    scale = 0.1 if quick else 1.0
    volume = int(256 * MiB * scale)  # value bytes per batch-of-1000 case, and bytes for the 1 MiB disk baseline
    small_n = int(20_000 * scale)  # appends per batch-of-1 case
    limit = 1.0 if quick else 4.0  # seconds per case at most (read cases repeat whole passes until then)
    rng = np.random.default_rng(1)
    before = baselines(root, volume, small_n, limit, scale)
    print("baselines at start: " + describe(before), flush=True)
    rows, logs = [], {}

    def record(name, msgs, size, secs, appends=None, fsyncs=None):
        row = {"case": name, "msgs": msgs, "seconds": secs, "msgs_s": msgs / secs, "mb_s": msgs * size / 1e6 / secs,
               "appends_s": None if appends is None else appends / secs,
               "appends_per_fsync": None if appends is None else appends / max(fsyncs, 1)}
        rows.append(row)
        print(f"  {name:<34} {msgs:>10,} msgs {secs:6.2f} s {row['msgs_s']:>12,.0f} msgs/s "
              f"{row['mb_s']:9.1f} MB/s", flush=True)

    for size in (100, 1024):
        pool = [random_values(1000, size, rng) for _ in range(8)]
        singles = [[v] for v in pool[0].to_pylist()]
        for batch, threads in ((1000, 1), (1, 1), (1, 8)):
            src = pool if batch > 1 else singles
            n = max(volume // (batch * size), 4) if batch > 1 else small_n
            for mode, cfg in MODES.items():  # modes back to back, so drift in the disk's speed hits both alike
                name = f"append {mode} {size}B b{batch} t{threads}"
                log = logs[mode, size, batch, threads] = PartitionLog(root / name.replace(" ", "_"), "bench", 0, cfg)
                with counting_fsyncs() as fsyncs:
                    msgs, calls, secs = timed(lambda i: log.append(src[i % len(src)]).count, n, limit, threads)
                record(name, msgs, size, secs, calls, len(fsyncs))
    for size in (100, 1024):
        for batch in (1000, 1):
            log = logs["unflush1000", size, batch, 1]
            msgs, _, secs = timed(lambda _: read_all(log), 100, limit)
            record(f"read+decode {size}B b{batch}", msgs, size, secs)
    lookups = []
    for batch in (1000, 1):
        lookups += lookup_rates(logs["unflush1000", 100, batch, 1], f"100B b{batch}", limit, rng)
    keyed = key_index_rates(root, volume, small_n, limit, rng)
    counts = {key: log.latest_offset for key, log in logs.items()}
    for log in logs.values():
        log.close()
    stored = [stored_bytes(logs[key].directory, counts[key], key) for key in logs]

    after = baselines(root, volume, small_n, limit, scale)
    print("baselines at end:   " + describe(after), flush=True)
    base = {k: (before[k] + after[k]) / 2 for k in before}
    for r in rows:
        r["x_disk"] = r["mb_s"] / base["disk_mb_s"]
        r["x_fsync"] = None if r["appends_s"] is None else r["appends_s"] / base["fsync_per_s"]
        r["x_memcpy"] = r["mb_s"] / (base["memcpy_gb_s"] * 1e3)
    return {"start": before, "end": after, "mean": base}, rows, lookups, stored, keyed


def key_index_rates(root, volume, small_n, limit, rng) -> list:
    """Appends of keyed 100 B messages with the key index off and on (see the module's docstring)."""
    try:
        from metaq_broker.store.keyindex import KeyIndex
    except ImportError:
        print("  key index: this tree has none; skipped", flush=True)
        return []
    values = random_values(1000, 100, rng)
    pool = [pa.array([b"order-%d" % k for k in rng.integers(0, 10 ** 9, 1000)], pa.binary()) for _ in range(8)]
    singles = [([v], pool[0].slice(i, 1)) for i, v in enumerate(values.to_pylist())]  # keys stay columns
    KeyIndex(0, 0).add(0, pool[0])  # compiles (or loads numba's cached code) before anything is timed
    rows = []
    for mode, batch in (("group", 1000), ("unflush1000", 1000), ("unflush1000", 1)):
        n = max(volume // (batch * 100), 4) if batch > 1 else small_n
        best, append_secs, add_secs = {}, [], []
        for rnd in range(6):
            on = rnd % 2 == 1
            log = PartitionLog(root / f"keyed-{mode}-{batch}-{rnd}", "bench", 0, MODES[mode])
            index = KeyIndex(0, 0)

            def op(i):
                vs, ks = (values, pool[i % 8]) if batch > 1 else singles[i % 1000]
                t0 = time.perf_counter()
                r = log.append(vs, ks)
                t1 = time.perf_counter()
                append_secs.append(t1 - t0)
                if on:
                    index.add(r.base_offset, ks)
                    add_secs.append(time.perf_counter() - t1)
                return r.count

            msgs, _, secs = timed(op, n, limit)
            log.close()
            shutil.rmtree(log.directory)
            best[on] = max(best.get(on, 0), msgs / secs)
        append_us, add_us = 1e6 * float(np.median(append_secs)), 1e6 * float(np.median(add_secs))
        rows.append({"case": f"{mode} 100B+key b{batch}", "off_msgs_s": best[False], "on_msgs_s": best[True],
                     "ratio": best[True] / best[False], "append_us_per_batch": append_us,
                     "add_us_per_batch": add_us, "cost_ratio": append_us / (append_us + add_us)})
        r = rows[-1]
        print(f"  key index {r['case']:<28} off {r['off_msgs_s']:>11,.0f} on {r['on_msgs_s']:>11,.0f} msgs/s "
              f"(ratio {r['ratio']:.3f}); per batch: append {append_us:.1f} us, add {add_us:.1f} us "
              f"(ratio {r['cost_ratio']:.3f})", flush=True)
    return rows


def lookup_rates(log, data: str, limit: float, rng) -> list:
    """Calls per second of each index lookup at random offsets (or times) of ``log``'s data."""
    lo, hi = log.earliest_offset, log.latest_offset
    offsets = rng.integers(lo, hi, 4096).tolist()
    t0, t1 = log.timestamp_at(lo), log.timestamp_at(hi - 1)
    stamps = rng.integers(t0, t1 + 1, 4096).tolist()
    pairs = np.sort(rng.integers(lo, hi + 1, (4096, 2)), axis=1).tolist()
    calls = {"locate 1MiB": lambda i: log.locate(offsets[i % 4096], MiB).length > 0,
             "offset_for_timestamp": lambda i: log.offset_for_timestamp(stamps[i % 4096]) >= 0,
             "range_bytes": lambda i: log.range_bytes(*pairs[i % 4096]) >= 0,
             "offset_after_bytes 1MiB": lambda i: log.offset_after_bytes(offsets[i % 4096], MiB) >= 0,
             "timestamp_at": lambda i: log.timestamp_at(offsets[i % 4096]) > 0}
    rows = []
    for name, op in calls.items():
        cpu = time.process_time()
        _, n, secs = timed(op, 1_000_000, limit / 2)
        cpu = time.process_time() - cpu  # CPU seconds: on a shared machine steadier than the wall clock
        rows.append({"case": f"{name} {data}", "calls_s": n / secs, "us_per_call": secs / n * 1e6,
                     "cpu_us_per_call": cpu / n * 1e6})
        print(f"  {rows[-1]['case']:<34} {rows[-1]['calls_s']:>12,.0f} calls/s {rows[-1]['us_per_call']:9.1f} us "
              f"({rows[-1]['cpu_us_per_call']:.1f} us CPU)", flush=True)
    return rows


def stored_bytes(directory: Path, messages: int, key) -> dict:
    """Bytes on disk per message of a closed partition: log (segments) and offset index (any format)."""
    mode, size, batch, threads = key
    log_b = sum(f.stat().st_size for f in directory.glob("*.meta"))
    index_b = sum(f.stat().st_size for f in directory.iterdir() if f.suffix in (".idx", ".index"))
    return {"case": f"{mode} {size}B b{batch} t{threads}", "messages": messages, "value_bytes": size,
            "log_b_per_msg": log_b / messages, "index_b_per_msg": index_b / messages,
            "over_value": (log_b + index_b) / messages / size - 1, "index_over_log": index_b / log_b}


def describe(b):
    return (f"disk 1MiB+fsync {b['disk_mb_s']:,.1f} MB/s, disk 150B+fsync {b['fsync_per_s']:,.0f} fsync/s, "
            f"memcpy {b['memcpy_gb_s']:.2f} GB/s")


def table(base, rows):
    head = ("case", "msgs", "secs", "msgs/s", "MB/s", "appends/fsync", "/disk", "/fsync", "/memcpy")
    opt = lambda v, f: "-" if v is None else format(v, f)
    body = [(r["case"], f"{r['msgs']:,}", f"{r['seconds']:.2f}", f"{r['msgs_s']:,.0f}", f"{r['mb_s']:,.1f}",
             opt(r["appends_per_fsync"], ",.1f"), f"{r['x_disk']:.3f}", opt(r["x_fsync"], ".3f"),
             f"{r['x_memcpy']:.4f}") for r in rows]
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join(["baselines (same run, same directory; ratios use the mean of start and end):",
                      f"  start: {describe(base['start'])}", f"  end:   {describe(base['end'])}",
                      fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="about 10x smaller volumes and time limits")
    ap.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent / ".bench-data",
                    help="where to create the temporary data directory (default: benchmarks/.bench-data)")
    ap.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    created = not args.dir.exists()
    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.dir))
    try:
        base, rows, lookups, stored, keyed = run(root, args.quick)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if created:
            try:
                args.dir.rmdir()
            except OSError:
                pass
    print("\n" + table(base, rows))
    print("\nlookups (random offsets or times in the 100 B data of the unflush1000 t1 cases):")
    for r in lookups:
        print(f"  {r['case']:<34} {r['calls_s']:>12,.0f} calls/s {r['us_per_call']:9.1f} us/call "
              f"{r['cpu_us_per_call']:9.1f} us CPU/call")
    if keyed:
        print("\nkey index: keyed 100 B messages, index off and on (best of 3 rounds each, alternating), and the "
              "median cost of an append and of the index's add per batch, same rounds:")
        print(f"  {'case':<30} {'off msgs/s':>12} {'on msgs/s':>12} {'on/off':>7} {'append us':>10} {'add us':>8} "
              f"{'append/(append+add)':>20}")
        for r in keyed:
            print(f"  {r['case']:<30} {r['off_msgs_s']:>12,.0f} {r['on_msgs_s']:>12,.0f} {r['ratio']:>7.3f} "
                  f"{r['append_us_per_batch']:>10.1f} {r['add_us_per_batch']:>8.1f} {r['cost_ratio']:>20.3f}")
    print("\nstored bytes per message (after close; the index in any format: .index, or a dense .idx):")
    print(f"  {'case':<28} {'log B':>8} {'index B':>8} {'log+index over value':>21} {'index over log':>15}")
    for r in stored:
        print(f"  {r['case']:<28} {r['log_b_per_msg']:>8.1f} {r['index_b_per_msg']:>8.2f} {r['over_value']:>21.1%} "
              f"{r['index_over_log']:>15.2%}")
    if args.json:
        args.json.write_text(json.dumps({"quick": args.quick, "baselines": base, "cases": rows, "lookups": lookups,
                                         "stored": stored, "key_index": keyed}, indent=2))


if __name__ == "__main__":
    main()
