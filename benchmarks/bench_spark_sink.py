"""Spark sink benchmark: rows/s written by ``df.write.format("metaq")``, exactly-once and at-least-once,
beside the ceiling of the Python Arrow writer API measured in the same run and the same Spark session:

* ``discard (ceiling)``: a ``DataSourceArrowWriter`` that counts the Arrow batches Spark hands it and
  drops them: what this API carries at best (JVM rows -> Arrow IPC -> Python worker), with no sending.
* ``metaq exactly-once``: the sink's default (one broker transaction per task, prepared, then the driver's
  decision record in ZooKeeper and the commits).
* ``metaq at-least-once``: ``deliveryGuarantee=at-least-once`` (plain ``send_batch`` per Arrow batch).
* ``disk bound``: rows/s the broker's disk allows at most: sequential writes fsynced every 4 MiB (as group
  commit does per put), measured in the same run on the broker's file system, over the bytes each row
  takes there (its record and its share of the offset index, counted after a clean stop of the broker has
  written every segment's index).
* ``cpu bound (...)``: rows/s the machine's cores allow at most for that guarantee's write if the sink's own
  Python cost nothing: the CPU seconds of the ceiling run (Spark making and handing over the rows) plus
  the broker's *system* CPU seconds in that write (the kernel copying the bytes off the socket into the
  page cache and writing them out: work no user-space change removes), spread over every core.

The input is the same for all three: ``spark.range(N, numPartitions=2)`` turned into a 100-byte binary
``value`` by Spark's own expressions (no Python, no disk), so the cases differ only in the sink. Then the
whole pipeline: ``readStream.format("metaq")`` of a topic ``in`` holding N messages of 100 B ->
a transformation (a prefix added to each value, in Spark SQL) -> ``writeStream.format("metaq")`` into
``pipe-out``, exactly-once, ``trigger(availableNow=True)``, ``maxOffsetsPerTrigger`` N/4 (4 batches).

    python benchmarks/bench_spark_sink.py [--quick] [--rows N] [--runs R] [--json PATH] [--no-pipeline]
                                          [--dir PATH] [--headers K]

``--headers K`` adds both guarantees again with a ``headers`` column of K Kafka record headers per row
(keys ``h0``.., each value the row's first 16 bytes, built by Spark's expressions), timed in the same
rounds as the cases without, and prints their ratio to them; ``discard, K headers/row`` is the ceiling
with that column (Spark building the nested column and handing it over as Arrow).

N is 10,000,000 (``--quick``: 1,000,000). One local broker (``BrokerProcess`` + ``LocalZooKeeper``,
loopback only), topics of 2 partitions; Spark runs ``local[2]``. Each case runs once untimed, then
``--runs`` (2) timed rounds going round the cases in turn; the best run of each is reported, with the
machine's and the broker's CPU seconds. Each metaq run writes to a fresh topic, and its message count is
checked through the client afterwards. Everything is stopped and the data removed at the end. Figures only:
nothing is asserted about them.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage  # noqa: E402

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


def topic_count(zk_connect: str, topic: str) -> int:
    """Messages a reader gets (not offsets: transaction markers take offsets too)."""
    from metaq_broker.client.consumer import Consumer
    n = 0
    with Consumer(zk_connect=zk_connect) as c:
        for p, (offset, latest) in c.offsets(topic).items():
            while offset < latest:
                f = c.fetch(topic, p, offset, 64 << 20)
                n += f.batch.num_rows
                offset = f.next_offset
    return n


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

def fsynced_write_mb_s(directory: Path, total: int, step: int = 4 << 20) -> float:
    """MB/s of sequential writes to a new file in ``directory``, fsynced every ``step`` bytes, as group
    commit fsyncs each put of the sink (its merged puts are up to 4 MiB)."""
    block = os.urandom(step)
    path = directory / "bench-disk-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        start = time.perf_counter()
        for _ in range(total // step):
            os.write(fd, block)
            os.fdatasync(fd)
        return total / (time.perf_counter() - start) / 1e6
    finally:
        os.close(fd)
        path.unlink()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=None, help="rows per write (default 10,000,000)")
    ap.add_argument("--quick", action="store_true", help="1,000,000 rows")
    ap.add_argument("--runs", type=int, default=2, help="timed runs per case (best is reported)")
    ap.add_argument("--no-pipeline", action="store_true", help="skip the in -> Spark -> out pipeline")
    ap.add_argument("--headers", type=int, default=0, metavar="K",
                    help="also write with a headers column of K headers per row (e.g. 2)")
    add_common_options(ap, driver_memory="4g")
    args = ap.parse_args(argv)
    n = args.rows if args.rows is not None else (1_000_000 if args.quick else 10_000_000)


    tmp = scratch_dir(args.dir, "spark-sink-")
    zk = broker = spark = None
    results = run_facts(rows=n, value_bytes=VALUE_SIZE, partitions=2, runs=args.runs)
    try:
        log(f"{n:,} rows of {VALUE_SIZE} B per write; data in {tmp}")
        zk = LocalZooKeeper(data_dir=tmp / "zk").start()
        broker = BrokerProcess(tmp / "broker", 1, zk.connect_string, settings={"numPartitions": 2}).start()

        import pyspark
        from pyspark.sql import functions as F

        import metaq_spark
        spark = make_spark(tmp, args.driver_memory, "bench_spark_sink")
        spark.sparkContext.setLogLevel("WARN")
        results["pyspark"] = pyspark.__version__
        metaq_spark.register(spark)
        spark.dataSource.register(DiscardSink)

        pad = "metaq-spark-sink-bench-" * 5
        source = spark.range(0, n, numPartitions=2).select(
            F.concat(F.lpad(F.col("id").cast("string"), 12, "0"), F.lit(pad[:VALUE_SIZE - 12])).cast("binary")
            .alias("value"))

        def discard(frame=source):
            count_file = tmp / "discarded"
            frame.write.format("benchDiscard").option("countfile", str(count_file)).mode("append").save()
            got = int(count_file.read_text())
            if got != n:
                raise RuntimeError(f"the discarding writer saw {got:,} rows, expected {n:,}")
            return n

        with_headers = source.select("value", F.array(*[
            F.struct(F.lit(f"h{i}").alias("key"), F.substring("value", 1, 16).alias("value"))
            for i in range(args.headers)]).alias("headers"))
        written = []  # topics written, counted through the client after the timed runs

        def metaq(guarantee, frame=source, tag=""):
            ready = [f"{guarantee}{tag}-{i}" for i in range(args.runs + 1)]
            for topic in ready:  # created before timing
                create_topic(zk.connect_string, topic)

            def run():
                topic = ready.pop(0)
                (frame.write.format("metaq").option("metaq.zk.connect", zk.connect_string).option("topic", topic)
                 .option("deliveryGuarantee", guarantee).mode("append").save())
                written.append(topic)
                return n
            return run

        cases = [("discard (ceiling)", discard), ("metaq exactly-once", metaq("exactly-once")),
                 ("metaq at-least-once", metaq("at-least-once"))]
        headed = f"{args.headers} headers/row"
        if args.headers > 0:
            cases += [(f"discard, {headed}", lambda: discard(with_headers)),
                      (f"metaq exactly-once, {headed}", metaq("exactly-once", with_headers, "-h")),
                      (f"metaq at-least-once, {headed}", metaq("at-least-once", with_headers, "-h"))]
        results["cases"] = best_of(cases, args.runs, broker.proc.pid)
        for topic in written:
            got = topic_count(zk.connect_string, topic)
            if got != n:
                raise RuntimeError(f"{topic} holds {got:,} messages after the write, expected {n:,}")
        log(f"checked: each of {len(written)} metaq writes stored {n:,} messages")
        # The disk's bound: every acknowledged row is fsynced (group commit), with its index, so the sink
        # cannot pass this many rows/s whatever the CPU does. The broker is stopped first (and started
        # again): a clean stop seals every segment, so each index is on disk whole, as a roll writes it.
        broker.stop()
        files = [f for f in (broker.workdir / "data").glob(f"{written[-1]}-*/*") if f.is_file()]
        stored = sum(f.stat().st_size for f in files)
        index = sum(f.stat().st_size for f in files if f.suffix in (".idx", ".index"))
        broker.start()
        mb_s = fsynced_write_mb_s(broker.workdir / "data", (256 if n <= 1_000_000 else 1024) << 20)
        results["disk"] = {"fsynced_write_mb_per_s": mb_s, "stored_bytes_per_row": stored / n,
                           "index_bytes_per_row": index / n}
        results["cases"]["disk bound (fsynced writes)"] = {"rows_per_s": mb_s * 1e6 / (stored / n), "best_s": 0.0,
                                                           "machine_cpu_s": 0.0, "broker_cpu_s": 0.0,
                                                           "broker_system_s": 0.0}
        log(f"disk: {mb_s:.0f} MB/s written in fsynced 4 MiB steps; {stored / n:.2f} B stored per row "
            f"({(stored - index) / n:.2f} of log, {index / n:.2f} of offset index)")
        cores = len(os.sched_getaffinity(0))
        for guarantee in ("exactly-once", "at-least-once"):
            cpu = results["cases"]["discard (ceiling)"]["machine_cpu_s"] + \
                results["cases"][f"metaq {guarantee}"]["broker_system_s"]
            results["cases"][f"cpu bound ({guarantee})"] = {"rows_per_s": n * cores / cpu, "best_s": 0.0,
                                                             "machine_cpu_s": cpu, "broker_cpu_s": 0.0,
                                                             "broker_system_s": 0.0}

        if not args.no_pipeline:
            create_topic(zk.connect_string, "in")
            secs = produce_in(zk.connect_string, "in", n)
            log(f"topic in: {n:,} messages produced in {secs:.1f} s")
            outs = [f"pipe-out-{i}" for i in range(4)]  # warm-up and one timed run, each for both reads
            for topic in outs:
                create_topic(zk.connect_string, topic)
            pending = list(outs)

            def pipeline(schema=None):
                out = pending.pop(0)
                r = spark.readStream.format("metaq")
                if schema is not None:  # only the columns the query uses: Spark converts fewer
                    r = r.schema(schema)
                q = (r.option("metaq.zk.connect", zk.connect_string)
                     .option("subscribe", "in").option("maxOffsetsPerTrigger", str(max(1, n // 4)))
                     .option("group", f"bench-{out}").load()
                     .select(F.concat(F.lit(b"out:"), F.col("value")).alias("value"))
                     .writeStream.format("metaq").option("metaq.zk.connect", zk.connect_string).option("topic", out)
                     .option("checkpointLocation", str(tmp / f"ck-{out}")).trigger(availableNow=True).start())
                q.awaitTermination()
                if q.exception() is not None:
                    raise RuntimeError(f"pipeline failed: {q.exception()}")
                return n

            results["cases"].update(best_of([("pipeline in->out exactly-once", pipeline),
                                             ("pipeline, value column only", lambda: pipeline("value binary"))], 1,
                                            broker.proc.pid))
            for topic in outs:
                got = topic_count(zk.connect_string, topic)
                if got != n:
                    raise RuntimeError(f"{topic} holds {got:,} messages after the pipeline, expected {n:,}")

        c = results["cases"]
        pairs = [("metaq exactly-once", "discard (ceiling)"), ("metaq at-least-once", "discard (ceiling)"),
                 ("metaq exactly-once", "metaq at-least-once"),
                 (f"metaq exactly-once, {headed}", "metaq exactly-once"),
                 (f"metaq at-least-once, {headed}", "metaq at-least-once"),
                 (f"discard, {headed}", "discard (ceiling)"),
                 (f"metaq exactly-once, {headed}", f"discard, {headed}"),
                 (f"metaq at-least-once, {headed}", f"discard, {headed}"),
                 ("pipeline in->out exactly-once", "discard (ceiling)"),
                 ("pipeline, value column only", "discard (ceiling)"),
                 ("pipeline, value column only", "pipeline in->out exactly-once"),
                 ("metaq at-least-once", "disk bound (fsynced writes)"),
                 ("metaq exactly-once", "disk bound (fsynced writes)"),
                 ("disk bound (fsynced writes)", "discard (ceiling)"),
                 ("metaq at-least-once", "cpu bound (at-least-once)"),
                 ("metaq exactly-once", "cpu bound (exactly-once)"),
                 ("cpu bound (at-least-once)", "discard (ceiling)"),
                 ("cpu bound (exactly-once)", "discard (ceiling)")]
        pairs = [(a, b) for a, b in pairs if a in c and b in c]
        results["ratios"] = {f"{a} / {b}": c[a]["rows_per_s"] / c[b]["rows_per_s"] for a, b in pairs}
        results["figures"] = [  # for benchmarks/run_all.py
            {"name": a, "value": c[a]["rows_per_s"], "unit": "rows/s", "baseline": b,
             "baseline_value": c[b]["rows_per_s"], "note": f"{n:,} rows x {VALUE_SIZE} B"} for a, b in pairs]

        print()
        print(f"Spark sink benchmark: {n:,} rows x {VALUE_SIZE} B, topics of 2 partitions on 1 broker, local[2], "
              f"best of {args.runs} (after a warm-up)")
        print(f"{'case':<36}{'best s':>9}{'rows/s':>14}{'MB/s (values)':>15}{'machine cpu s':>15}"
              f"{'broker cpu s':>14}{'of it system':>14}")
        for name, r in c.items():
            print(f"{name:<36}{r['best_s']:>9.2f}{r['rows_per_s']:>14,.0f}"
                  f"{r['rows_per_s'] * VALUE_SIZE / 1e6:>15.1f}{r['machine_cpu_s']:>15.1f}{r['broker_cpu_s']:>14.1f}"
                  f"{r['broker_system_s']:>14.1f}")
        print()
        for k, v in results["ratios"].items():
            print(f"{k:<72}{v:>7.2f}")
        write_json(args.json, results)
        return 0
    finally:
        teardown(tmp, spark, broker, zk)


if __name__ == "__main__":
    sys.exit(main())
