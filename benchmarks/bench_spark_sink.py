"""Spark sink benchmark: rows/s written by ``df.write.format("metaq")``, exactly-once and at-least-once,
beside the ceiling of the Python Arrow writer API measured in the same run and the same Spark session:

* ``discard (ceiling)``: a ``DataSourceArrowWriter`` that counts the Arrow batches Spark hands it and
  drops them: what this API carries at best (JVM rows -> Arrow IPC -> Python worker), with no sending.
* ``metaq exactly-once``: the sink's default (one broker transaction per task, prepared, then the driver's
  decision record in ZooKeeper and the commits).
* ``metaq at-least-once``: ``deliveryGuarantee=at-least-once`` (plain ``send_batch`` per Arrow batch).

The input is the same for all three: ``spark.range(N, numPartitions=2)`` turned into a 100-byte binary
``value`` by Spark's own expressions (no Python, no disk), so the cases differ only in the sink. Then the
whole pipeline: ``readStream.format("metaq")`` of a topic ``in`` holding N messages of 100 B ->
a transformation (a prefix added to each value, in Spark SQL) -> ``writeStream.format("metaq")`` into
``pipe-out``, exactly-once, ``trigger(availableNow=True)``, ``maxOffsetsPerTrigger`` N/4 (4 batches).

    python benchmarks/bench_spark_sink.py [--quick] [--rows N] [--runs R] [--json PATH] [--no-pipeline]
                                          [--dir PATH]

N is 10,000,000 (``--quick``: 1,000,000). One local broker (``BrokerProcess`` + ``LocalZooKeeper``,
loopback only), topics of 2 partitions; Spark runs ``local[2]``. Each case runs once untimed, then
``--runs`` (2) timed rounds going round the cases in turn; the best run of each is reported, with the
machine's and the broker's CPU seconds. Each metaq run writes to a fresh topic, and its message count is
checked through the client afterwards. Everything is stopped and the data removed at the end. Figures only:
nothing is asserted about them.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

VALUE_SIZE = 100


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cpu_busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (all cores, from /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid) -> float:
    """CPU seconds (user + system) used so far by one process."""
    with open(f"/proc/{pid}/stat") as f:
        v = f.read().rsplit(")", 1)[1].split()
    return (int(v[11]) + int(v[12])) / os.sysconf("SC_CLK_TCK")


def values_array(start: int, n: int) -> pa.Array:
    """n binary values of VALUE_SIZE bytes, each starting with its 8-byte little-endian index."""
    buf = np.zeros((n, VALUE_SIZE), dtype=np.uint8)
    buf[:, 8:] = np.frombuffer(b"metaq-spark-bench-" * 6, dtype=np.uint8)[:VALUE_SIZE - 8]
    buf[:, :8] = np.arange(start, start + n, dtype="<i8").view(np.uint8).reshape(n, 8)
    offsets = np.arange(n + 1, dtype=np.int32) * VALUE_SIZE
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(buf.reshape(-1))])


def make_spark(tmp: Path, driver_memory: str):
    from pyspark.sql import SparkSession
    return (SparkSession.builder.master("local[2]").appName("bench_spark_sink")
            .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.memory", driver_memory).config("spark.local.dir", str(tmp / "spark-local"))
            .config("spark.sql.shuffle.partitions", "2").getOrCreate())


# -- the ceiling: a Python Arrow writer that discards its input ---------------------------------------

@dataclass
class Counted(WriterCommitMessage):
    rows: int


class DiscardWriter(DataSourceArrowWriter):
    def write(self, iterator):
        rows = 0
        for batch in iterator:
            rows += batch.num_rows
        return Counted(rows)

    def commit(self, messages):
        total = sum(m.rows for m in messages)
        path = self.options.get("countfile")
        if path:
            Path(path).write_text(str(total))

    def __init__(self, options):
        self.options = dict(options)


class DiscardSink(DataSource):
    @classmethod
    def name(cls):
        return "benchDiscard"

    def writer(self, schema, overwrite):
        return DiscardWriter(self.options)


# -- helpers ------------------------------------------------------------------------------------------

def timed_rounds(cases: list, runs: int, broker_pid: int) -> dict:
    out = {}
    for name, fn in cases:
        log(f"{name}: warm-up")
        t0 = time.perf_counter()
        rows = fn()
        out[name] = {"name": name, "rows": rows, "warmup_s": time.perf_counter() - t0, "times_s": [],
                     "machine_cpu_s_all": [], "broker_cpu_s_all": []}
    for i in range(runs):
        for name, fn in cases:
            r = out[name]
            c0, b0, t0 = cpu_busy_s(), proc_cpu_s(broker_pid), time.perf_counter()
            fn()
            r["times_s"].append(time.perf_counter() - t0)
            r["machine_cpu_s_all"].append(cpu_busy_s() - c0)
            r["broker_cpu_s_all"].append(proc_cpu_s(broker_pid) - b0)
            log(f"  {name} run {i + 1}: {r['times_s'][-1]:.2f} s  {r['rows'] / r['times_s'][-1]:,.0f} rows/s  "
                f"machine cpu {r['machine_cpu_s_all'][-1]:.1f} s, broker cpu {r['broker_cpu_s_all'][-1]:.1f} s")
    for r in out.values():
        k = min(range(len(r["times_s"])), key=r["times_s"].__getitem__)
        r.update(best_s=r["times_s"][k], rows_per_s=r["rows"] / r["times_s"][k],
                 machine_cpu_s=r["machine_cpu_s_all"][k], broker_cpu_s=r["broker_cpu_s_all"][k])
    return out


def topic_count(zk_connect: str, topic: str) -> int:
    from metaq_broker.client.consumer import Consumer
    with Consumer(zk_connect=zk_connect) as c:
        return sum(latest - earliest for earliest, latest in c.offsets(topic).values())


def create_topic(zk_connect: str, topic: str, partitions: int = 2) -> None:
    from metaq_broker.client.admin import Admin
    with Admin(zk_connect=zk_connect) as admin:
        admin.create_topic(topic, partitions)
        deadline = time.monotonic() + 30
        while len(admin.cluster.topic_partitions(topic)) < partitions:
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {topic} did not show {partitions} partitions")
            time.sleep(0.05)


def produce_in(zk_connect: str, topic: str, n: int) -> float:
    from metaq_broker.client.producer import Producer
    with Producer(zk_connect=zk_connect) as p:
        names = p.partitions(topic)
        t0 = time.perf_counter()
        for i, name in enumerate(names):
            start, count = i * (n // len(names)), n // len(names) + (n % len(names) if i == 0 else 0)
            for s in range(start, start + count, 100_000):
                p.send_batch(topic, values_array(s, min(100_000, start + count - s)), partition=name)
        return time.perf_counter() - t0


# -- main ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=None, help="rows per write (default 10,000,000)")
    ap.add_argument("--quick", action="store_true", help="1,000,000 rows")
    ap.add_argument("--runs", type=int, default=2, help="timed runs per case (best is reported)")
    ap.add_argument("--no-pipeline", action="store_true", help="skip the in -> Spark -> out pipeline")
    ap.add_argument("--driver-memory", default="4g")
    ap.add_argument("--dir", default=str(Path(__file__).resolve().parent / ".bench-data"))
    ap.add_argument("--json", default=None, help="write results as JSON to this path")
    args = ap.parse_args(argv)
    n = args.rows if args.rows is not None else (1_000_000 if args.quick else 10_000_000)

    from metaq_broker.local import BrokerProcess
    from metaq_broker.zookeeper import LocalZooKeeper

    Path(args.dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="spark-sink-", dir=args.dir))
    zk = broker = spark = None
    results: dict = {"rows": n, "value_bytes": VALUE_SIZE, "partitions": 2, "runs": args.runs,
                     "python": platform.python_version(), "cpus": os.cpu_count(), "cases": {}}
    try:
        log(f"{n:,} rows of {VALUE_SIZE} B per write; data in {tmp}")
        zk = LocalZooKeeper(data_dir=tmp / "zk").start()
        broker = BrokerProcess(tmp / "broker", 1, zk.connect_string, settings={"numPartitions": 2}).start()

        import pyspark
        import metaq_spark
        from pyspark.sql import functions as F
        spark = make_spark(tmp, args.driver_memory)
        spark.sparkContext.setLogLevel("WARN")
        results["pyspark"] = pyspark.__version__
        metaq_spark.register(spark)
        spark.dataSource.register(DiscardSink)

        pad = "metaq-spark-sink-bench-" * 5
        source = spark.range(0, n, numPartitions=2).select(
            F.concat(F.lpad(F.col("id").cast("string"), 12, "0"), F.lit(pad[:VALUE_SIZE - 12])).cast("binary")
            .alias("value"))

        def discard():
            count_file = tmp / "discarded"
            source.write.format("benchDiscard").option("countfile", str(count_file)).mode("append").save()
            got = int(count_file.read_text())
            if got != n:
                raise RuntimeError(f"the discarding writer saw {got:,} rows, expected {n:,}")
            return n

        written = []  # topics written, counted through the client after the timed runs

        def metaq(guarantee):
            ready = [f"{guarantee}-{i}" for i in range(args.runs + 1)]
            for topic in ready:  # created before timing
                create_topic(zk.connect_string, topic)

            def run():
                topic = ready.pop(0)
                (source.write.format("metaq").option("metaq.zk.connect", zk.connect_string).option("topic", topic)
                 .option("deliveryGuarantee", guarantee).mode("append").save())
                written.append(topic)
                return n
            return run

        cases = [("discard (ceiling)", discard), ("metaq exactly-once", metaq("exactly-once")),
                 ("metaq at-least-once", metaq("at-least-once"))]
        results["cases"] = timed_rounds(cases, args.runs, broker.proc.pid)
        for topic in written:
            got = topic_count(zk.connect_string, topic)
            if got != n:
                raise RuntimeError(f"{topic} holds {got:,} messages after the write, expected {n:,}")
        log(f"checked: each of {len(written)} metaq writes stored {n:,} messages")

        if not args.no_pipeline:
            create_topic(zk.connect_string, "in")
            secs = produce_in(zk.connect_string, "in", n)
            log(f"topic in: {n:,} messages produced in {secs:.1f} s")
            outs = [f"pipe-out-{i}" for i in range(2)]  # warm-up and one timed run
            for topic in outs:
                create_topic(zk.connect_string, topic)
            pending = list(outs)

            def pipeline():
                out = pending.pop(0)
                q = (spark.readStream.format("metaq").option("metaq.zk.connect", zk.connect_string)
                     .option("subscribe", "in").option("maxOffsetsPerTrigger", str(max(1, n // 4)))
                     .option("group", f"bench-{out}").load()
                     .select(F.concat(F.lit(b"out:"), F.col("value")).alias("value"))
                     .writeStream.format("metaq").option("metaq.zk.connect", zk.connect_string).option("topic", out)
                     .option("checkpointLocation", str(tmp / f"ck-{out}")).trigger(availableNow=True).start())
                q.awaitTermination()
                if q.exception() is not None:
                    raise RuntimeError(f"pipeline failed: {q.exception()}")
                return n

            results["cases"].update(timed_rounds([("pipeline in->out exactly-once", pipeline)], 1,
                                                 broker.proc.pid))
            for topic in outs:
                got = topic_count(zk.connect_string, topic)
                if got != n:
                    raise RuntimeError(f"{topic} holds {got:,} messages after the pipeline, expected {n:,}")

        c = results["cases"]
        pairs = [("metaq exactly-once", "discard (ceiling)"), ("metaq at-least-once", "discard (ceiling)"),
                 ("metaq exactly-once", "metaq at-least-once"),
                 ("pipeline in->out exactly-once", "discard (ceiling)")]
        pairs = [(a, b) for a, b in pairs if a in c and b in c]
        results["ratios"] = {f"{a} / {b}": c[a]["rows_per_s"] / c[b]["rows_per_s"] for a, b in pairs}
        results["figures"] = [  # for benchmarks/run_all.py
            {"name": a, "value": c[a]["rows_per_s"], "unit": "rows/s", "baseline": b,
             "baseline_value": c[b]["rows_per_s"], "note": f"{n:,} rows x {VALUE_SIZE} B"} for a, b in pairs]

        print()
        print(f"Spark sink benchmark: {n:,} rows x {VALUE_SIZE} B, topics of 2 partitions on 1 broker, local[2], "
              f"best of {args.runs} (after a warm-up)")
        print(f"{'case':<32}{'best s':>9}{'rows/s':>14}{'MB/s (values)':>15}{'machine cpu s':>15}"
              f"{'broker cpu s':>14}")
        for name, r in c.items():
            print(f"{name:<32}{r['best_s']:>9.2f}{r['rows_per_s']:>14,.0f}"
                  f"{r['rows_per_s'] * VALUE_SIZE / 1e6:>15.1f}{r['machine_cpu_s']:>15.1f}{r['broker_cpu_s']:>14.1f}")
        print()
        for k, v in results["ratios"].items():
            print(f"{k:<52}{v:>7.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
            log(f"results written to {args.json}")
        return 0
    finally:
        if spark is not None:
            with contextlib.suppress(Exception):
                spark.stop()
        if broker is not None:
            with contextlib.suppress(Exception):
                broker.stop()
        if zk is not None:
            with contextlib.suppress(Exception):
                zk.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
