"""``metaq quickstart``: a local ZooKeeper and one broker in a work directory, a topic, sample data
produced and read back, a consumer group's lag; everything stopped and (for a temporary directory)
removed on exit."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import click

from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.console.server import Console
from metaq_broker.devtools import sparkhome
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.devtools.zookeeper import LocalZooKeeper

TOPIC = "quickstart-events"
CONSOLE_PORT = 8480  # as `metaq console`
OUT_TOPIC = "quickstart-upper"
GROUP = "quickstart-readers"


def say(text: str) -> None:
    click.echo(click.style("» ", fg="green") + text)


def run(workdir: Optional[Path], messages: int, keep_running: bool = False, spark: bool = True,
        console_port: Optional[int] = CONSOLE_PORT) -> dict:
    temporary = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="metaq-quickstart-")) if temporary else Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    zk = broker = console = None
    try:
        say(f"work directory {workdir}")
        zk = LocalZooKeeper(data_dir=workdir / "zookeeper")
        zk.start()
        say(f"ZooKeeper is up at {zk.connect_string}")
        broker = BrokerProcess(workdir / "broker", broker_id=0, zk_connect=zk.connect_string,
                               settings={"numPartitions": 4}).start()
        say(f"broker 0 is up at {broker.address} (log: {broker.log_path}); Kafka clients: "
            f"bootstrap.servers={broker.bootstrap}")
        if console_port is not None:
            console = _start_console(zk.connect_string, console_port)
        with Admin(zk_connect=zk.connect_string) as admin, Producer(zk_connect=zk.connect_string) as producer, \
                Consumer(zk_connect=zk.connect_string, group=GROUP) as consumer:
            deadline = time.monotonic() + 15
            while not admin.masters() and time.monotonic() < deadline:
                time.sleep(0.1)
            parts = admin.create_topic(TOPIC, 4)
            say(f"created topic {TOPIC} with partitions {', '.join(parts)}")
            _wait_for_partitions(producer, TOPIC, len(parts))

            started = time.monotonic()
            with click.progressbar(length=messages, label="producing") as bar:
                sent = 0
                while sent < messages:
                    n = min(1000, messages - sent)
                    keys = [b"user-%d" % ((sent + i) % 50) for i in range(n)]
                    values = [b'{"event": %d, "user": "user-%d"}' % (sent + i, (sent + i) % 50) for i in range(n)]
                    producer.send_batch(TOPIC, values, keys=keys)
                    sent += n
                    bar.update(n)
            elapsed = time.monotonic() - started
            say(f"produced {messages} messages in {elapsed:.2f}s ({messages / elapsed:,.0f} msgs/s), "
                f"each acknowledged after an fsync (group commit)")

            counts = Counter()
            offsets = consumer.offsets(TOPIC)
            for p, (earliest, latest) in sorted(offsets.items()):
                table = consumer.read_range(TOPIC, p, earliest, latest)
                counts[p] = table.num_rows
            say("read back per partition: " + ", ".join(f"{p}: {n}" for p, n in sorted(counts.items())))
            first = consumer.fetch(TOPIC, parts[0], 0, max_messages=3).messages()
            for m in first:
                say(f"  {m.partition} offset {m.offset} key {m.key.decode()} value {m.value.decode()}")
            consumer.commit(TOPIC, {p: latest for p, (_, latest) in offsets.items()})
            lag = sum(row.lag for row in admin.group_lag(GROUP, TOPIC))
            say(f"group {GROUP} committed its offsets in ZooKeeper; total lag {lag}")
            if sum(counts.values()) != messages:
                raise RuntimeError(f"read {sum(counts.values())} messages back, expected {messages}")
            if spark:
                piped = _spark_pipeline(zk.connect_string, workdir, admin, producer, consumer)
                if piped != messages:
                    raise RuntimeError(f"the Spark pipeline wrote {piped} messages, expected {messages}")
            if keep_running:
                say(f"leaving ZooKeeper ({zk.connect_string}), the broker" + (
                    f" and the console ({console.url})" if console else "") + " running; Ctrl-C stops them")
                say(f"Kafka clients: bootstrap.servers={broker.bootstrap} (e.g. kcat -b {broker.bootstrap} -C -t "
                    f"{TOPIC} -e)")
                try:
                    while True:
                        time.sleep(1)
                except KeyboardInterrupt:
                    pass
            return {"produced": messages, "consumed": sum(counts.values()), "lag": lag,
                    "bootstrap_servers": broker.bootstrap}
    finally:
        if console is not None:
            console.stop()
        if broker is not None:
            broker.stop()
        if zk is not None:
            zk.stop()
        if temporary:
            shutil.rmtree(workdir, ignore_errors=True)
        say("stopped the broker and ZooKeeper" + (" and removed the work directory" if temporary else ""))


def _start_console(zk_connect: str, port: int) -> Console:
    """The web console beside the cluster, so the pipeline's lag can be watched; on another port if
    ``port`` is taken (a console already running)."""
    try:
        console = Console(zk_connect, "/meta", None, port=port, interval=1.0).start()
    except OSError:
        console = Console(zk_connect, "/meta", None, port=0, interval=1.0).start()
    say(f"web console at {console.url}: brokers, topics, the Spark pipeline's group and its lag "
        f"(--keep-running keeps it up after the run)")
    return console


def _spark_pipeline(zk_connect: str, workdir: Path, admin, producer, consumer) -> int:
    """Spark reads the topic as a stream, upper-cases each value and writes it to a second topic through
    the exactly-once metaq sink (broker transactions, decision records in ZooKeeper)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # lazy: pyspark is heavy (a JVM), and only this step of the quickstart needs it
    from pyspark import SparkContext
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import metaq_spark
    from metaq_spark.group_commit import RECORDER

    admin.create_topic(OUT_TOPIC, 2)
    _wait_for_partitions(producer, OUT_TOPIC, 2)
    say("starting Spark (local[2]) ...")
    # A JVM or session already running (a notebook's) is reused and left running; what this run starts, it stops.
    launched, had_session = SparkContext._gateway is None, SparkContext._active_spark_context is not None
    with sparkhome.launching():  # its Python workers import the installed pyspark: the run ~20% shorter
        spark = (SparkSession.builder.master("local[2]").appName("metaq-quickstart")
                 .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
                 .config("spark.driver.bindAddress", "127.0.0.1").config("spark.sql.shuffle.partitions", "2")
                 .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        metaq_spark.register(spark)
        source = (spark.readStream.format("metaq").option("metaq.zk.connect", zk_connect)
                  .option("subscribe", TOPIC).option("maxOffsetsPerTrigger", 4000).load())
        upper = source.select("key", F.upper(F.col("value").cast("string")).alias("value"))
        started = time.monotonic()
        query = (upper.writeStream.format("metaq").option("metaq.zk.connect", zk_connect)
                 .option("topic", OUT_TOPIC).trigger(availableNow=True)
                 .option("checkpointLocation", str(workdir / "spark-checkpoint")).start())
        query.awaitTermination()
        batches = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
        elapsed = time.monotonic() - started
        say(f"Spark read {sum(batches)} messages from {TOPIC} in {len(batches)} micro-batches "
            f"({', '.join(map(str, batches))} rows) and wrote them upper-cased, exactly once, to {OUT_TOPIC} "
            f"in {elapsed:.1f}s")
        out = consumer.offsets(OUT_TOPIC)
        # rows, not offsets: each transaction's commit marker takes an offset in every partition it wrote
        written = sum(consumer.read_range(OUT_TOPIC, p, earliest, latest).num_rows
                      for p, (earliest, latest) in out.items())
        sample = consumer.fetch(OUT_TOPIC, sorted(out)[0], 0, max_messages=1).messages()
        if sample:
            say(f"  {sample[0].partition} offset 0: {sample[0].value.decode()}")
        say(f"{OUT_TOPIC} now holds {written} messages")
        return written
    finally:
        if launched:
            _stop_spark(spark)
        elif not had_session:
            spark.stop()
        RECORDER.close()  # its ZooKeeper session ends before ZooKeeper does


def _stop_spark(spark, timeout: float = 30.0) -> None:
    """Stop the session and the JVM this run launched, returning once the JVM and its Python workers have
    exited (``spark.stop()`` alone leaves the JVM up until the interpreter exits); killed past ``timeout``."""
    from pyspark import SparkContext  # lazy: as in _spark_pipeline, the one caller
    spark.stop()
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)  # the JVM: spark-submit execs it
    workers = _descendants(proc.pid) if proc is not None else []
    try:
        gateway.shutdown()
    except Exception:  # noqa: BLE001 - the JVM is ended below either way
        pass
    SparkContext._gateway = SparkContext._jvm = None  # a later session launches a new JVM
    if proc is None:
        return
    proc.stdin.close()  # the JVM's gateway server exits when its stdin ends
    deadline = time.monotonic() + timeout
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    while workers:  # Python workers exit when their pipe to the JVM closes
        workers = [w for w in workers if _alive(*w)]
        if workers and time.monotonic() > deadline:
            for pid, _ in workers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            deadline = float("inf")
        time.sleep(0.05)


def _proc_stat(pid: int):
    """(state, parent pid, start time) from /proc, or None once the process is gone (or without /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return fields[0].decode(), int(fields[1]), int(fields[19])


def _descendants(pid: int) -> list:
    """[(pid, start time)] of every process below ``pid`` (empty without /proc)."""
    children: dict = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        stat = _proc_stat(int(entry)) if entry.isdigit() else None
        if stat is not None:
            children.setdefault(stat[1], []).append((int(entry), stat[2]))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def _alive(pid: int, started: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[2] == started and stat[0] not in ("Z", "X")


def _wait_for_partitions(client, topic: str, count: int, timeout: float = 15.0) -> None:
    """ZooKeeper watches deliver the new topic to clients asynchronously; wait until they have it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if len(client.partitions(topic)) >= count:
                return
        except Exception:  # noqa: BLE001 - not visible yet
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise RuntimeError(f"topic {topic} did not appear in ZooKeeper within {timeout}s")
        time.sleep(0.05)
