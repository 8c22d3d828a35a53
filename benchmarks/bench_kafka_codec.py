"""Kafka record-batch conversion speed, beside metaq's own record format in the same run.

    python benchmarks/bench_kafka_codec.py [--quick] [--json PATH]

Cases, each for values of 100 B and 1 KiB with 16-byte keys, 1,000 records per batch:

* ``kafka decode <codec>``: ``protocol.kafka.records.decode(...).records`` of a Produce partition's bytes
  (CRC-32C checked, decompressed, every record found by the compiled walk, keys/values/headers gathered
  into Arrow).
* ``kafka encode <codec>``: ``records.encode`` of Arrow columns into batches for a Fetch answer.
* ``kafka to metaq <codec>``: ``records.decode(...).metaq_body``, what a Produce stores: the records found
  and written straight into one metaq batch body, no Arrow column built; beside ``metaq encode``.
* baselines: ``metaq encode`` (``protocol.records.encode_body`` + ``encode_header``, what a metaq producer
  does) and ``metaq decode`` (``protocol.records.decode(verify=True)``, what a metaq consumer does), of the
  same records; and ``aiokafka decode`` (aiokafka's record reader, compiled, one Python object per record:
  the well-kept library alternative to our walk).
* start-up: import of numba and ``records.warm_up()`` in a fresh interpreter, numba's cache warm (what a
  broker pays at its Kafka listener's first connection), and with the cache emptied (the first start on a machine).

Figures only, best of several passes (``--quick``: fewer records, fewer passes); ratios are against the
same run's metaq baselines. ``MB/s`` counts value bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from metaq_broker.protocol import records as metaq_records
from metaq_broker.protocol.kafka import records

ROOT = Path(__file__).resolve().parent.parent


def best(fn, passes: int) -> float:
    fn()  # warm
    times = []
    for _ in range(passes):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def data(n: int, size: int):
    rng = np.random.default_rng(1)
    values = pa.array([rng.bytes(size // 2) + b"x" * (size - size // 2) for _ in range(n)], pa.binary())
    keys = pa.array([rng.bytes(16) for _ in range(n)], pa.binary())
    return keys, values


def startup(clear_cache: bool) -> float:
    """Seconds of one fresh interpreter importing the codec and warming its compiled walks."""
    code = ("import time; t=time.perf_counter(); from metaq_broker.protocol.kafka import records; "
            "records.warm_up(); print(time.perf_counter()-t)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if clear_cache:
        tmp = tempfile.mkdtemp(prefix="bench-kafka-numba-")
        env["NUMBA_CACHE_DIR"] = tmp  # an empty cache: compile as on a machine's first start
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if clear_cache:
        shutil.rmtree(tmp, ignore_errors=True)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return float(out.stdout.strip())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    n = 20_000 if args.quick else 200_000
    passes = 3 if args.quick else 5
    per_batch = 1000
    results = {}
    from aiokafka.record.default_records import DefaultRecordBatch  # the library baseline

    print(f"{'case':<28}{'size':>6}{'records/s':>14}{'MB/s':>10}{'vs metaq':>10}")
    for size in (100, 1024):
        keys, values = data(n, size)
        mb = n * size / 1e6
        starts = np.arange(0, n, per_batch)
        offsets = np.arange(n)
        ts = np.full(n, 1_700_000_000_000, np.int64)
        # metaq baselines: one batch per 1,000 records, as the Kafka batches below
        def metaq_encode():
            out = []
            for s in starts:
                body = metaq_records.encode_body(values.slice(s, per_batch), keys.slice(s, per_batch))
                out.append(metaq_records.encode_header(body, int(s), int(s), 0))
                out.extend(body.parts)
            return out
        metaq_bytes = b"".join(metaq_encode())
        t_menc = best(metaq_encode, passes)
        t_mdec = best(lambda: metaq_records.decode(metaq_bytes, verify=True), passes)
        rows = [("metaq encode", t_menc, t_menc), ("metaq decode", t_mdec, t_mdec)]
        for codec in (records.NONE, records.LZ4, records.ZSTD):
            name = records.CODECS[codec]
            kbytes = records.encode(offsets, ts, keys, values, batch_starts=starts, codec=codec)
            t_enc = best(lambda: records.encode(offsets, ts, keys, values, batch_starts=starts, codec=codec), passes)
            t_dec = best(lambda: records.decode(kbytes).records, passes)
            t_body = best(lambda: records.decode(kbytes).metaq_body(create_times=True), passes)
            rows += [(f"kafka encode {name}", t_enc, t_menc), (f"kafka decode {name}", t_dec, t_mdec),
                     (f"kafka to metaq {name}", t_body, t_menc)]
        kbytes = records.encode(offsets, ts, keys, values, batch_starts=starts)

        def aiokafka_decode():
            pos, mv, out = 0, memoryview(kbytes), 0
            while pos < len(kbytes):
                end = pos + 12 + int.from_bytes(mv[pos + 8:pos + 12], "big")
                out += sum(1 for r in DefaultRecordBatch(mv[pos:end]) if r.value is not None)
                pos = end
            return out
        rows.append(("aiokafka decode (objects)", best(aiokafka_decode, max(1, passes // 2)), t_mdec))
        for case, t, base in rows:
            print(f"{case:<28}{size:>6}{n / t:>14,.0f}{mb / t:>10,.0f}{base / t:>10.2f}")
            results[f"{case} {size}B"] = {"records_per_s": n / t, "MB_per_s": mb / t, "vs_metaq": base / t}
    warm = min(startup(False) for _ in range(2))
    cold = startup(True)
    import_numba = subprocess.run([sys.executable, "-c", "import time; t=time.perf_counter(); import numba; "
                                   "print(time.perf_counter()-t)"], capture_output=True, text=True).stdout.strip()
    print(f"start-up: import numba {float(import_numba):.2f} s; import + warm_up with numba's cache "
          f"{warm:.2f} s, with an empty cache (first start on a machine) {cold:.2f} s")
    results["startup"] = {"import_numba_s": float(import_numba), "warm_cache_s": warm, "empty_cache_s": cold}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
