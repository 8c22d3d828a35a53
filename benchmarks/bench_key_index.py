"""Key index benchmark (issue 29): what keeping it costs and what lookups through it gain, each against a
baseline measured in the same run, through one real broker (``BrokerProcess``) and ZooKeeper.

    python benchmarks/bench_key_index.py [--messages N] [--quick] [--runs R] [--dir PATH] [--json PATH]

* Appends: keyed 100 B messages (keys ``user-<7 digits>``, 1 M distinct, 12 B) from one Producer in
  batches of 1000, to two one-partition topics on the same broker, ``keyIndex=true`` and ``keyIndex=false``
  (``unflushThreshold=1000``), alternating case by case (``best_of``); ratio on / off (goal >= 0.9).
* Stored bytes per message: each topic's files after the appends (log, offset index, key index files so
  far), per message, and over the 112 B of key and value (goal: log and offset index at most 3% over the
  message); and the key index's own bytes per keyed message, from the big topic's sealed segments.
* Lookups on a big topic (``--messages``, default 10 M; one partition, key index on): ``Consumer.lookup
  (key=...)`` on a warm client, random keys, median and 99th percentile (goal < 50 ms); ``metaq lookup
  --key`` as a new process, start-up included, its bytecode cached as an installed package's is (goal
  < 1 s); baseline: the same key found by reading the
  whole topic with ``Consumer.read_range`` and comparing keys in Arrow (once).
* Spark (local[2], spark.sql.python.filterPushdown.enabled=true): a batch read of the big topic with
  ``where key = x`` (pushed: lookups) against ``where substring(key, 1, 64) = x`` (Spark cannot push it:
  it reads every row), the same rows checked; ratio (goal >= 10). And ``where timestamp >= x`` (x: the
  store time of the message 95% into the big topic: each partition's range narrowed through the time
  index, Spark still filters) against ``where unix_millis(timestamp) >= x`` (Spark cannot push it), both
  aggregating the rows' offsets, keys and value lengths, the same figures checked; ratio.

Figures only, no timing is asserted. ``--quick``: 1 M messages, 1 run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    VALUE_SIZE,
    add_common_options,
    best_of,
    log,
    make_spark,
    run_facts,
    scratch_dir,
    teardown,
    values_array,
    write_json,
)
from metaq_broker.devtools.broker_process import BrokerProcess  # noqa: E402
from metaq_broker.devtools.zookeeper import LocalZooKeeper  # noqa: E402

DISTINCT_KEYS = 1_000_000
BATCH = 1000
APPEND_MESSAGES = 1_000_000  # per case and run
TOPICS = {"keys_on": {"keyIndex": "true"}, "keys_off": {"keyIndex": "false"}, "big": {"keyIndex": "true"}}


def keys_array(rng, n: int) -> pa.Array:
    """n keys ``user-NNNNNNN`` (12 B) drawn from DISTINCT_KEYS, as one Arrow binary array."""
    digits = np.char.zfill(rng.integers(0, DISTINCT_KEYS, n).astype(str), 7)
    return pa.array(np.char.add("user-", digits).astype(object), pa.binary())


def wait_for_topics(producer, names) -> None:
    deadline = time.monotonic() + 30
    while not all(producer.cluster.topic_partitions(t) for t in names):
        if time.monotonic() > deadline:
            raise RuntimeError(f"topics {names} did not show in ZooKeeper")
        time.sleep(0.1)


def send(producer, topic: str, values: pa.Array, keys: pa.Array) -> None:
    for s in range(0, len(values), BATCH):
        producer.send_batch(topic, values.slice(s, BATCH), keys=keys.slice(s, BATCH), partition="1-0")


def stored_bytes(broker_dir: Path, topic: str) -> dict:
    files = list((broker_dir / "data").glob(f"{topic}-0/*"))
    by = {"log": 0, "index": 0, "keys": 0, "other": 0}
    for f in files:
        by[{".meta": "log", ".index": "index", ".keys": "keys"}.get(f.suffix, "other")] += f.stat().st_size
    return by


def key_index_files(broker_dir: Path, topic: str) -> dict:
    """The sealed segments' key index files of ``topic``: bytes, entries (each header's count: messages
    with a key) and bytes per entry. (The active segment's index is in memory until the segment is sealed.)"""
    files = sorted((broker_dir / "data").glob(f"{topic}-0/*.keys"))
    size = sum(f.stat().st_size for f in files)
    entries = sum(struct.unpack_from("<I", f.read_bytes()[:64], 44)[0] for f in files)  # storage-format.md §15
    return {"files": len(files), "bytes": size, "entries": entries, "per_entry": size / entries if entries else None}


def percentile(xs, q) -> float:
    return float(np.percentile(np.asarray(xs), q))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=None, help="messages in the big topic (default 10,000,000)")
    ap.add_argument("--quick", action="store_true", help="1,000,000 messages in the big topic, 1 run")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per append case (default 5; quick 1)")
    ap.add_argument("--no-spark", action="store_true", help="skip the Spark cases")
    add_common_options(ap, driver_memory="4g")
    args = ap.parse_args(argv)
    n_big = args.messages if args.messages is not None else (1_000_000 if args.quick else 10_000_000)
    runs = args.runs or (1 if args.quick else 5)
    rng = np.random.default_rng(29)

    from metaq_broker.client.consumer import Consumer
    from metaq_broker.client.producer import Producer

    tmp = scratch_dir(args.dir, "key-index-")
    zk = broker = spark = producer = consumer = None
    results = run_facts(big_messages=n_big, value_bytes=VALUE_SIZE, key_bytes=12, runs=runs)
    try:
        zk = LocalZooKeeper(data_dir=tmp / "zk").start()
        broker = BrokerProcess(tmp / "broker", 1, zk.connect_string,
                               topics={t: {"numPartitions": 1, "unflushThreshold": 1000, **c} for t, c in TOPICS.items()}
                               ).start()
        producer = Producer(zk_connect=zk.connect_string)
        wait_for_topics(producer, list(TOPICS))

        # -- appends, key index on and off, through the broker ------------------------------------------
        values, keys = values_array(0, APPEND_MESSAGES), keys_array(rng, APPEND_MESSAGES)
        cases = [(t, lambda t=t: send(producer, t, values, keys)) for t in ("keys_off", "keys_on")]
        appends = best_of(cases, runs, broker.proc.pid, rows=APPEND_MESSAGES)
        off, on = appends["keys_off"]["rows_per_s"], appends["keys_on"]["rows_per_s"]
        results["cases"]["append"] = appends
        results["append_ratio"] = on / off
        log(f"appends: key index off {off:,.0f} msgs/s, on {on:,.0f} msgs/s: ratio {on / off:.3f}")
        cpu = {t: min(appends[t]["broker_cpu_s_all"]) * 1e9 / APPEND_MESSAGES for t in ("keys_off", "keys_on")}
        results["append_broker_cpu_ns_per_message"] = cpu
        log(f"broker CPU per message (least of the runs): key index off {cpu['keys_off']:.0f} ns, on "
            f"{cpu['keys_on']:.0f} ns (the indexer thread's included)")

        # -- stored bytes per message ---------------------------------------------------------------------
        stored_n = APPEND_MESSAGES * (runs + 1)
        stored = {t: stored_bytes(tmp / "broker", t) for t in ("keys_off", "keys_on")}
        results["stored"] = {t: {**b, "messages": stored_n, "per_message": sum(b.values()) / stored_n}
                             for t, b in stored.items()}
        key_share = stored["keys_on"]["keys"] / stored_n
        results["key_index_bytes_per_message"] = key_share
        for t, b in results["stored"].items():
            log(f"stored {t}: {b['per_message']:.2f} B/message (log {b['log'] / stored_n:.2f}, offset index "
                f"{b['index'] / stored_n:.3f}, key index {b['keys'] / stored_n:.3f}) over {VALUE_SIZE + 12} B of "
                f"key and value: {b['per_message'] / (VALUE_SIZE + 12) - 1:+.1%}")
        log(f"key index files on disk so far: {key_share:.3f} B/message")

        # -- the big topic: lookups -----------------------------------------------------------------------
        t0 = time.perf_counter()
        big_keys = []
        for s in range(0, n_big, APPEND_MESSAGES):
            k = min(APPEND_MESSAGES, n_big - s)
            ks = keys_array(rng, k)
            if s == 0:
                big_keys = ks.slice(0, 1000).to_pylist()
            send(producer, "big", values_array(s, k), ks)
        results["big_produce_s"] = time.perf_counter() - t0
        log(f"big topic: {n_big:,} messages in {results['big_produce_s']:.1f} s")
        consumer = Consumer(zk_connect=zk.connect_string)
        probes = [big_keys[i] for i in rng.choice(len(big_keys), 200, replace=False)]
        for k in probes[:20]:  # warm: connections, the sealed segments' key indexes mapped
            consumer.lookup("big", key=k)
        times, answers = [], 0
        for k in probes:
            t = time.perf_counter()
            found = consumer.lookup("big", key=k)
            times.append(time.perf_counter() - t)
            answers += len(found)
            assert found and all(m.key == k for m in found), k
        results["lookup_ms"] = {"median": 1000 * statistics.median(times), "p99": 1000 * percentile(times, 99),
                                "max": 1000 * max(times), "answers_mean": answers / len(probes)}
        log(f"Consumer.lookup(key=...), warm, {len(probes)} keys: median {results['lookup_ms']['median']:.2f} ms, "
            f"p99 {results['lookup_ms']['p99']:.2f} ms ({answers / len(probes):.1f} answers each)")

        # As an installed package runs: its modules' bytecode cached (pip compiles on install), here in scratch.
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
               "METAQ_ZK": zk.connect_string, "PYTHONPYCACHEPREFIX": str(tmp / "pycache")}
        subprocess.run([sys.executable, "-m", "metaq_broker.tools.cli", "--help"], env=env, capture_output=True)
        cli = []
        for k in probes[:5]:
            t = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "metaq_broker.tools.cli", "lookup", "big", "--key", k.decode()],
                                 env=env, capture_output=True, timeout=60)
            cli.append(time.perf_counter() - t)
            if out.returncode or not out.stdout.strip():
                raise RuntimeError(f"metaq lookup failed: {out.stderr}")
        results["cli_lookup_s"] = {"median": statistics.median(cli), "max": max(cli)}
        log(f"metaq lookup --key (a new process each): median {statistics.median(cli):.2f} s, max {max(cli):.2f} s")

        t = time.perf_counter()
        start, end = consumer.offsets("big")["1-0"][:2]
        matches, offset = 0, start
        while offset < end:
            batch = consumer.read_range("big", "1-0", offset, min(end, offset + 1_000_000))
            matches += pc.sum(pc.equal(batch.column("key"), pa.scalar(probes[0], pa.binary()))).as_py() or 0
            offset = min(end, offset + 1_000_000)
        results["scan_s"] = time.perf_counter() - t
        if matches != len(consumer.lookup("big", key=probes[0], max_messages=10_000)):
            raise RuntimeError(f"the scan found {matches} messages with key {probes[0]}, the lookup others")
        log(f"baseline, the same key by reading the whole topic: {results['scan_s']:.2f} s "
            f"({results['scan_s'] * 1000 / results['lookup_ms']['median']:,.0f}x the lookup)")

        files = results["key_index_files"] = key_index_files(tmp / "broker", "big")
        if files["entries"]:
            log(f"key index of the big topic's {files['files']} sealed segments: {files['bytes']:,} B for "
                f"{files['entries']:,} keyed messages, {files['per_entry']:.2f} B each")

        # -- Spark: pushed key filter against one Spark cannot push ---------------------------------------
        if not args.no_spark:
            import metaq_spark
            spark = make_spark(tmp, args.driver_memory, "bench_key_index",
                               **{"spark.sql.python.filterPushdown.enabled": "true"})
            spark.sparkContext.setLogLevel("WARN")
            metaq_spark.register(spark)
            key = probes[1].decode()
            df = spark.read.format("metaq").option("metaq.zk.connect", zk.connect_string).option("subscribe", "big") \
                .load()
            pushed = df.where(f"key = cast('{key}' as binary)")
            unpushed = df.where(f"substring(key, 1, 64) = cast('{key}' as binary)")
            got = {}

            def collect(name, frame):
                got[name] = sorted((r.offset, r.value) for r in frame.collect())
                return len(got[name])

            spark_runs = 1 if args.quick else 2
            sparks = best_of([("spark pushed key =", lambda: collect("pushed", pushed)),
                              ("spark unpushable filter", lambda: collect("unpushed", unpushed))], spark_runs,
                             broker.proc.pid)
            if got["pushed"] != got["unpushed"] or not got["pushed"]:
                raise RuntimeError("the pushed and unpushed queries found different rows")
            ratio = sparks["spark unpushable filter"]["best_s"] / sparks["spark pushed key ="]["best_s"]
            results["cases"]["spark"] = sparks
            results["spark_ratio"] = ratio
            log(f"Spark where key = x: {sparks['spark pushed key =']['best_s']:.2f} s, unpushable filter "
                f"{sparks['spark unpushable filter']['best_s']:.2f} s, same {len(got['pushed'])} rows: {ratio:.1f}x")

            # timestamp >= x: narrowed ranges against the same rows by a filter Spark cannot push
            at = start + (end - start) * 95 // 100
            x = consumer.read_range("big", "1-0", at, at + 1).column("timestamp")[0].value  # ms

            def count(name, where):
                row = df.where(where).selectExpr("count(*) AS n", "sum(offset) AS s", "sum(length(value)) AS v",
                                                 "count(key) AS k").collect()[0]
                got[name] = (row.n, row.s, row.v, row.k)
                return row.n

            ts_cases = best_of([
                ("spark timestamp >= x, pushed", lambda: count("ts pushed", f"timestamp >= timestamp_millis({x})")),
                ("spark timestamp >= x, not pushed", lambda: count("ts plain", f"unix_millis(timestamp) >= {x}"))],
                spark_runs, broker.proc.pid)
            if got["ts pushed"] != got["ts plain"] or not got["ts pushed"][0]:
                raise RuntimeError(f"timestamp >= x: pushed {got['ts pushed']}, not pushed {got['ts plain']}")
            pushed_s, plain_s = (ts_cases[f"spark timestamp >= x, {k}"]["best_s"] for k in ("pushed", "not pushed"))
            results["cases"]["spark_timestamp"] = ts_cases
            results["spark_timestamp_ratio"] = plain_s / pushed_s
            log(f"Spark where timestamp >= x (the last 5%): pushed {pushed_s:.2f} s, not pushed {plain_s:.2f} s, "
                f"same {got['ts pushed'][0]:,} rows: {plain_s / pushed_s:.1f}x")
        write_json(args.json, results)
        return 0
    finally:
        for c in (producer, consumer):
            if c is not None:
                c.close()
        teardown(tmp, spark, broker, zk)


if __name__ == "__main__":
    sys.exit(main())
