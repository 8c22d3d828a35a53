"""Spark source benchmark: rows/s of the ``metaq`` Python Data Source into Spark's ``noop`` sink, beside
two references read in the same run and the same Spark session:

* ``arrow ceiling``: a Python Data Source with metaq's schema and 2 partitions that yields pre-built
  pyarrow RecordBatches of ``--arrow-batch`` rows (64k) from memory: what this Spark API can carry at
  best (Python worker -> Arrow IPC -> JVM -> rows), with no fetching or decoding.
* ``parquet``: the same rows written once with pyarrow (2 files, one per partition) and read back with
  ``spark.read.parquet(...)`` (Spark's native vectorized reader, no Python).

    python benchmarks/bench_spark_source.py [--quick] [--messages N] [--runs R] [--json PATH]
                                            [--no-stream] [--no-profile] [--no-data-port] [--dir PATH]

N messages of 100 B (default 10,000,000; ``--quick`` 1,000,000) are produced to a topic of 2 partitions
on one local broker (``BrokerProcess`` + ``LocalZooKeeper``, loopback only), half to each partition, in
``send_batch`` calls of 100k pre-built pyarrow values. Spark runs ``local[2]``.

Measured, each after one untimed warm-up run, best of ``--runs`` (3) timed runs; the runs go round the
cases in turn, so load from elsewhere on the machine falls on every case alike:

* ``metaq batch``: ``spark.read.format("metaq")...load().write.format("noop").mode("overwrite").save()``
* ``metaq stream``: ``readStream.format("metaq")`` -> ``writeStream.format("noop")`` with
  ``trigger(availableNow=True)``, a fresh checkpoint per run (so every run reads the whole topic).
* ``arrow ceiling`` and ``parquet`` as above, written to noop the same way as ``metaq batch``.

The metaq row count is checked once (``df.count()``) before timing. ``--profile`` (on by default) then
times the executor side in this process over one partition's range: ``read_partition`` as a whole, and
split into its parts: the fetches alone (over the broker's data port, as the tasks fetch, and over gRPC
FetchRaw), ``records.decode`` (with checksum verification) of the fetched replies, and ``to_spark`` of the
decoded batches. ``--no-data-port`` runs the broker with ``dataPort=-1``: the tasks fetch with FetchRaw.

The broker, ZooKeeper and Spark are stopped and the data directory removed at the end, also on errors or
Ctrl-C. Figures only: nothing is asserted about them.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition  # noqa: E402

from benchmarks.common import (  # noqa: E402
    VALUE_SIZE,
    add_common_options,
    best_of,
    log,
    make_spark,
    proc_cpu_s,
    run_facts,
    scratch_dir,
    teardown,
    values_array,
    write_json,
)
from metaq_broker.devtools.broker_process import BrokerProcess  # noqa: E402
from metaq_broker.devtools.zookeeper import LocalZooKeeper  # noqa: E402

TOPIC = "bench"
PRODUCE_CHUNK = 100_000
SCHEMA_DDL = ("key binary, value binary, topic string, partition string, offset long, timestamp timestamp, "
              "msgId long, flag int, attribute string")
ARROW_SCHEMA = pa.schema([("key", pa.binary()), ("value", pa.binary()), ("topic", pa.string()),
                          ("partition", pa.string()), ("offset", pa.int64()),
                          ("timestamp", pa.timestamp("us", tz="UTC")), ("msgId", pa.int64()),
                          ("flag", pa.int32()), ("attribute", pa.string())])
PARTITIONS = ("1-0", "1-1")


# -- the same rows, built with numpy/pyarrow --------------------------------------------------------



def constant_strings(value: str, n: int) -> pa.Array:
    data = value.encode()
    offsets = np.arange(n + 1, dtype=np.int32) * len(data)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data * n)])


def rows_batch(partition: str, start: int, n: int, ts_us: int) -> pa.RecordBatch:
    """Rows shaped like metaq's: key and attribute null (the producer sends none), flag 0."""
    off = np.arange(start, start + n, dtype=np.int64)
    return pa.RecordBatch.from_arrays([
        pa.nulls(n, pa.binary()), values_array(start, n), constant_strings(TOPIC, n),
        constant_strings(partition, n), pa.array(off), pa.array(np.full(n, ts_us, dtype=np.int64)).cast(
            pa.timestamp("us", tz="UTC")), pa.array(off), pa.array(np.zeros(n, dtype=np.int32)),
        pa.nulls(n, pa.string())], schema=ARROW_SCHEMA)


# -- (a) the Arrow ceiling: a Python data source serving pre-built batches from memory ------------------

class ArrowMemPartition(InputPartition):
    def __init__(self, partition: str, rows: int, batch_rows: int):
        super().__init__((partition, rows))
        self.partition, self.rows, self.batch_rows = partition, rows, batch_rows


class ArrowMemReader(DataSourceReader):
    def __init__(self, options):
        self.rows = int(options.get("rows"))
        self.batch_rows = int(options.get("batchRows", 65536))

    def partitions(self):
        half = self.rows // len(PARTITIONS)
        return [ArrowMemPartition(p, half + (self.rows % len(PARTITIONS) if i == 0 else 0), self.batch_rows)
                for i, p in enumerate(PARTITIONS)]

    def read(self, part):
        # Built before the first yield: what is timed afterwards is only handing batches to Spark.
        full = rows_batch(part.partition, 0, min(part.batch_rows, part.rows), 1_700_000_000_000_000)
        left = part.rows
        while left > 0:
            n = min(left, full.num_rows)
            yield full if n == full.num_rows else full.slice(0, n)
            left -= n


class ArrowMemSource(DataSource):
    @classmethod
    def name(cls):
        return "benchArrowMem"

    def schema(self):
        return SCHEMA_DDL

    def reader(self, schema):
        return ArrowMemReader(self.options)


# -- helpers ---------------------------------------------------------------------------------------










def produce(zk_connect: str, n: int) -> float:
    from metaq_broker.client.producer import Producer
    p = Producer(zk_connect=zk_connect)
    try:
        deadline = time.monotonic() + 30
        while len(p.cluster.topic_partitions(TOPIC)) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {TOPIC} did not show 2 partitions in ZooKeeper")
            time.sleep(0.1)
        names = [f"{b}-{k}" for b, k in p.cluster.topic_partitions(TOPIC)]
        per = [n // 2 + n % 2, n // 2]
        t0 = time.perf_counter()
        for name, count in zip(names, per):
            sent = 0
            while sent < count:
                k = min(PRODUCE_CHUNK, count - sent)
                p.send_batch(TOPIC, values_array(sent, k), partition=name)
                sent += k
        return time.perf_counter() - t0
    finally:
        p.close()


# -- profile of the executor side ---------------------------------------------------------------------

def profile(zk_connect: str, broker_pid: int, arrow_batch_rows: int) -> dict:
    """Executor side in this process over partition 1-0's whole range: read_partition as a whole, then
    the same loop batch by batch with each stage timed (nothing kept between batches), plus the Arrow IPC
    write the Python worker does next (to /dev/null), and the same IPC write for the ceiling's batches."""
    from metaq_broker.names import parse_partition_name
    from metaq_broker.proto import metaq_pb2 as pb
    from metaq_broker.protocol import records
    from metaq_spark import reader as src
    from metaq_spark.options import parse

    opts = parse({"metaq.zk.connect": zk_connect, "subscribe": TOPIC}, streaming=False)
    reader = src.MetaqBatchReader(opts)
    parts = [p for p in reader.partitions() if p.partition.endswith("-0")]
    reader.planner.close()
    part = parts[0]
    rows = part.end - part.start
    out = {"partition": part.partition, "rows": rows}

    def run_read_partition():
        n = 0
        for b in src.read_partition(part):
            n += b.num_rows
        assert n == rows, (n, rows)

    run_read_partition()  # warm: connection, imports, page cache
    t, bc = [], []
    for _ in range(2):
        b0, t0 = proc_cpu_s(broker_pid), time.perf_counter()
        run_read_partition()
        t.append(time.perf_counter() - t0)
        bc.append(proc_cpu_s(broker_pid) - b0)
    out["read_partition_s"] = min(t)
    out["broker_cpu_s"] = bc[int(np.argmin(t))]

    conn = src._pool(part.security).get(part.address)
    _, number = parse_partition_name(part.partition)
    out["data_address"] = part.data_address
    if part.data_address:  # the fetches alone over the data port, as read_partition makes them
        from metaq_broker.client.dataconn import DataConnection
        with DataConnection(part.data_address) as dconn:
            best = float("inf")
            for _ in range(3):
                offset, t0 = part.start, time.perf_counter()
                while offset < part.end:
                    offset = dconn.fetch(part.topic, number, offset, part.fetch_max_bytes, part.end - offset).end_offset
                best = min(best, time.perf_counter() - t0)
        out["data_port_fetch_s"] = best
    stages = dict.fromkeys(("fetch_s", "decode_verify_s", "decode_noverify_s", "to_spark_s", "ipc_write_s"), 0.0)
    fetches = nbytes = 0
    offset = part.start
    with pa.OSFile("/dev/null", "wb") as devnull:
        writer = None
        while offset < part.end:
            t0 = time.perf_counter()
            r = conn.call("FetchRaw", pb.FetchRequest(topic=part.topic, partition=number, offset=offset,
                                                      max_bytes=part.fetch_max_bytes,
                                                      max_messages=part.end - offset), retries=5)
            t1 = time.perf_counter()
            decoded = records.decode(r.records, r.start_offset, r.end_offset, verify=True, timestamp_type=True)
            t2 = time.perf_counter()
            records.decode(r.records, r.start_offset, r.end_offset, verify=False)
            t3 = time.perf_counter()
            batch = src.to_spark(decoded, part.topic, part.partition)
            t4 = time.perf_counter()
            if writer is None:
                writer = pa.ipc.new_stream(devnull, batch.schema)
            writer.write_batch(batch)
            t5 = time.perf_counter()
            for k, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                stages[k] += dt
            fetches += 1
            nbytes += len(r.records)
            offset = r.end_offset
            del r, decoded, batch
        writer.close()
        full = rows_batch(part.partition, 0, arrow_batch_rows, 1_700_000_000_000_000)
        t0 = time.perf_counter()
        with pa.ipc.new_stream(devnull, full.schema) as w:
            for _ in range(0, rows, arrow_batch_rows):
                w.write_batch(full)
        out["ceiling_ipc_write_s"] = time.perf_counter() - t0
    out.update(stages)
    out["fetches"], out["fetched_bytes"] = fetches, nbytes
    return out


# -- main -------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=None, help="messages (default 10,000,000)")
    ap.add_argument("--quick", action="store_true", help="1,000,000 messages")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per case (best is reported)")
    ap.add_argument("--arrow-batch", type=int, default=65536, help="rows per batch of the Arrow ceiling")
    ap.add_argument("--min-partitions", type=int, default=None, help="metaq minPartitions option")
    ap.add_argument("--fetch-max-bytes", type=int, default=None, help="metaq fetchMaxBytes option")
    ap.add_argument("--no-stream", action="store_true", help="skip the AvailableNow streaming query")
    ap.add_argument("--no-profile", action="store_true", help="skip the in-process executor-side profile")
    ap.add_argument("--no-data-port", action="store_true", help="broker without a data port (dataPort=-1)")
    add_common_options(ap, driver_memory="8g")
    args = ap.parse_args(argv)
    n = args.messages if args.messages is not None else (1_000_000 if args.quick else 10_000_000)


    tmp = scratch_dir(args.dir, "spark-source-")
    zk = broker = spark = None
    results = run_facts(messages=n, value_bytes=VALUE_SIZE, partitions=2, runs=args.runs)
    try:
        log(f"{n:,} messages of {VALUE_SIZE} B over 2 partitions; data in {tmp}")
        zk = LocalZooKeeper(data_dir=tmp / "zk").start()
        results["data_port"] = not args.no_data_port
        broker = BrokerProcess(tmp / "broker", 1, zk.connect_string,
                               settings={"dataPort": -1} if args.no_data_port else None,
                               topics={TOPIC: {"numPartitions": 2, "unflushThreshold": 1000}}).start()
        secs = produce(zk.connect_string, n)
        results["produce_s"] = secs
        log(f"produced in {secs:.1f} s ({n / secs:,.0f} msgs/s)")

        pq_dir = tmp / "parquet"
        pq_dir.mkdir()
        t0 = time.perf_counter()
        per = [n // 2 + n % 2, n // 2]
        for name, count in zip(PARTITIONS, per):
            with pq.ParquetWriter(pq_dir / f"part-{name}.parquet", ARROW_SCHEMA) as w:
                for s in range(0, count, 1_000_000):
                    w.write_batch(rows_batch(name, s, min(1_000_000, count - s), 1_700_000_000_000_000))
        log(f"parquet written in {time.perf_counter() - t0:.1f} s "
            f"({sum(f.stat().st_size for f in pq_dir.iterdir()) / 1e6:.0f} MB)")

        import pyspark

        import metaq_spark
        spark = make_spark(tmp, args.driver_memory, "bench_spark_source",
                           **{"spark.sql.streaming.metricsEnabled": "false"})
        spark.sparkContext.setLogLevel("WARN")
        results["pyspark"] = pyspark.__version__
        metaq_spark.register(spark)
        spark.dataSource.register(ArrowMemSource)

        def metaq_reader(r):
            r = r.format("metaq").option("metaq.zk.connect", zk.connect_string).option("subscribe", TOPIC)
            if args.min_partitions:
                r = r.option("minPartitions", str(args.min_partitions))
            if args.fetch_max_bytes:
                r = r.option("fetchMaxBytes", str(args.fetch_max_bytes))
            return r

        count = metaq_reader(spark.read).load().count()
        if count != n:
            raise RuntimeError(f"metaq source read {count:,} rows, expected {n:,}")
        log(f"metaq count checked: {count:,}")
        pcount = spark.read.parquet(str(pq_dir)).count()
        if pcount != n:
            raise RuntimeError(f"parquet has {pcount:,} rows, expected {n:,}")

        def metaq_batch():
            metaq_reader(spark.read).load().write.format("noop").mode("overwrite").save()

        def arrow_batch():
            (spark.read.format("benchArrowMem").option("rows", str(n)).option("batchRows", str(args.arrow_batch))
             .load().write.format("noop").mode("overwrite").save())

        def parquet_batch():
            spark.read.parquet(str(pq_dir)).write.format("noop").mode("overwrite").save()

        stream_runs = [0]

        def metaq_stream():
            stream_runs[0] += 1
            cp = tmp / f"checkpoint-{stream_runs[0]}"
            q = (metaq_reader(spark.readStream).option("startingOffsets", "earliest").load()
                 .writeStream.format("noop").trigger(availableNow=True).option("checkpointLocation", str(cp))
                 .start())
            q.awaitTermination()
            if q.exception() is not None:
                raise RuntimeError(f"streaming query failed: {q.exception()}")
            got = sum(p["numInputRows"] for p in q.recentProgress)
            if got != n:
                raise RuntimeError(f"streaming query read {got:,} rows, expected {n:,}")
            shutil.rmtree(cp, ignore_errors=True)

        cases = [("metaq batch", metaq_batch), ("arrow ceiling", arrow_batch), ("parquet", parquet_batch)]
        if not args.no_stream:
            cases.append(("metaq stream", metaq_stream))
        results["cases"] = best_of(cases, args.runs, broker.proc.pid, rows=n)

        c = results["cases"]
        m, a, p = c["metaq batch"]["rows_per_s"], c["arrow ceiling"]["rows_per_s"], c["parquet"]["rows_per_s"]
        results["ratios"] = {"metaq batch / arrow ceiling": m / a, "metaq batch / parquet": m / p}
        if "metaq stream" in c:
            s = c["metaq stream"]["rows_per_s"]
            results["ratios"]["metaq stream / arrow ceiling"] = s / a
            results["ratios"]["metaq stream / parquet"] = s / p

        if not args.no_profile:
            log("profile: executor side in this process, one partition")
            results["profile"] = profile(zk.connect_string, broker.proc.pid, args.arrow_batch)

        print()
        print(f"Spark source benchmark: {n:,} messages x {VALUE_SIZE} B, 2 partitions, local[2], "
              f"best of {args.runs} (after a warm-up); tasks fetch over "
              f"{'gRPC FetchRaw (--no-data-port)' if args.no_data_port else 'the data port'}")
        print(f"{'case':<16}{'best s':>9}{'rows/s':>14}{'MB/s (values)':>15}{'machine cpu s':>15}"
              f"{'broker cpu s':>14}")
        for name, r in c.items():
            print(f"{name:<16}{r['best_s']:>9.2f}{r['rows_per_s']:>14,.0f}"
                  f"{r['rows_per_s'] * VALUE_SIZE / 1e6:>15.1f}{r['machine_cpu_s']:>15.1f}{r['broker_cpu_s']:>14.1f}")
        print()
        for k, v in results["ratios"].items():
            flag = "" if "arrow" not in k else ("  (target >= 0.80: met)" if v >= 0.8 else
                                                "  (target >= 0.80: NOT met)")
            print(f"{k:<30}{v:>7.2f}{flag}")
        if "profile" in results:
            pr = results["profile"]
            r = pr["rows"]
            print()
            print(f"executor-side profile, one partition ({pr['partition']}, {r:,} rows, {pr['fetches']} fetches, "
                  f"{pr['fetched_bytes'] / 1e6:.0f} MB), in this one Python process (other cases idle):")
            print(f"  {'read_partition':<26}{pr['read_partition_s']:>8.3f} s  {r / pr['read_partition_s']:>14,.0f} rows/s"
                  f"  (broker cpu meanwhile {pr['broker_cpu_s']:.2f} s)")
            for k in ("data_port_fetch_s", "fetch_s", "decode_verify_s", "decode_noverify_s", "to_spark_s",
                      "ipc_write_s", "ceiling_ipc_write_s"):
                if k not in pr:
                    continue
                label = {"data_port_fetch_s": "  data port fetch", "fetch_s": "  gRPC FetchRaw", "decode_verify_s": "  decode (verify=True)",
                         "decode_noverify_s": "  [decode verify=False]", "to_spark_s": "  to_spark",
                         "ipc_write_s": "  Arrow IPC write", "ceiling_ipc_write_s": "ceiling IPC write"}[k]
                print(f"  {label:<26}{pr[k]:>8.3f} s  {r / pr[k]:>14,.0f} rows/s")
        write_json(args.json, results)
        return 0
    finally:
        teardown(tmp, spark, broker, zk)


if __name__ == "__main__":
    sys.exit(main())
