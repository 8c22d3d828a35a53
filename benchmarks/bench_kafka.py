"""Kafka clients against metaq's Kafka listener, beside metaq's own client, same broker, same run.

    python benchmarks/bench_kafka.py [--quick] [--messages N] [--rounds R] [--json PATH] [--dir PATH]

Cases, for values of 100 B and 1 KiB (no keys), acks=all, the broker's default durability (group commit:
acknowledged after the fsync covering it):

* produce: confluent-kafka's ``Producer`` (librdkafka; ``linger.ms`` 5, ``batch.size`` 1 MB, lz4 off) into
  the Kafka listener, against metaq's ``Producer.send_batch`` with batches of 10,000 (the baseline), each
  into a topic of its own with 2 partitions; msgs/s, the broker's CPU (user + system, from its threads' schedstat: ``CpuMeter``) per message, and per
  produce request with the messages a request carried (the broker's metrics count the requests).
* produce, produce_batch: the same producer with confluent-kafka 2.x's ``produce_batch``, 10,000 messages
  a call, each call to partition 0 or 1 in turn as ``send_batch``'s batches go, a delivery callback per
  message as above: what a Python application gets when it hands the client batches.
* produce, Kafka requests: Produce requests of as many records as the same round's metaq put carried
  (10,000 of 100 B, 3,333 of 1 KiB; partitions 0 and 1 in turn, as ``send_batch``'s batches go), built
  before the timing with the broker's own Kafka codec and sent over one socket, 5 in flight: the broker's
  CPU per Kafka-produced message at the baseline's request size, with no client pacing it (librdkafka sends
  what ``linger.ms`` gathered: ~4,000-7,000 records of 100 B a request, one every few milliseconds).
* consume: confluent-kafka's ``Consumer`` (assign, ``consume(10000)``, at most the messages left; librdkafka's
  default ``fetch.wait.max.ms`` 500 and ``fetch.min.bytes`` 1; ``fetch.queue.backoff.ms`` 10: librdkafka's
  default pauses fetching for 1,000 ms whenever its prefetch queue holds more than ``queued.min.messages``
  (100,000), which its prefetch of 4 MiB fetches (~38,000 messages of 100 B each) reaches within a few
  fetches while the loop is still reading, so the figure measured that pause: 0.14-0.96 M msgs/s from run
  to run, 0.97-1.08 with 10 ms) reading every message of a topic, against
  metaq's ``Consumer.read_range`` of the same topic (the baseline); msgs/s.

* the client's ceiling: the same producer loops into librdkafka's own in-memory mock broker
  (``test.mock.num.brokers``, in the client's process: no network, no disk, no fsync), and the same
  consumer loop reading those messages back from it: what one Python thread gets out of confluent-kafka
  at all, so "Kafka listener / ceiling" says how much of it metaq's broker leaves on the table.

Goals (issue 27): Kafka produce >= 0.7 x metaq's msgs/s, Kafka consume >= 0.7 x metaq's, broker CPU per
Kafka-produced message <= 1.5 x per metaq put message. Figures only, best of ``--rounds``; nothing is
asserted. Each case starts after ``os.sync()``: the dirty pages the last one left (300 MB at 1 KiB) are not
written back during it. One ``BrokerProcess`` and a ``LocalZooKeeper`` on loopback, stopped and removed at the end.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import struct
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (CpuMeter, add_common_options, log, run_facts, scratch_dir,  # noqa: E402
                               teardown, write_json)
from metaq_broker.client import Consumer as MetaqConsumer  # noqa: E402
from metaq_broker.client import Producer as MetaqProducer  # noqa: E402
from metaq_broker.devtools.broker_process import BrokerProcess  # noqa: E402
from metaq_broker.devtools.zookeeper import LocalZooKeeper  # noqa: E402
from metaq_broker.protocol.kafka import records as krecords  # noqa: E402
from metaq_broker.protocol.kafka.protocol import PRODUCE, decode_response, encode_request  # noqa: E402

BATCH = 10_000
PRODUCE_V = 10  # what librdkafka 2 sends
SIZES = (100, 1024)
PARTITIONS = ("1-0", "1-1")
PRODUCER = {"acks": "all", "linger.ms": 5, "batch.size": 1 << 20, "queue.buffering.max.messages": 1_000_000,
            "log_level": 3}


def values(n: int, size: int) -> list:
    return [(b"%08d" % i).ljust(size, b"x") for i in range(n)]


def wait_topic(producer: MetaqProducer, topic: str) -> None:
    deadline = time.monotonic() + 30
    while len(producer.partitions(topic)) != 2:
        if time.monotonic() > deadline:
            raise RuntimeError(f"topic {topic} never showed in ZooKeeper")
        time.sleep(0.05)


def requests_served(broker: BrokerProcess, method: str) -> float:
    """How many ``method`` requests the broker has answered (its metrics: metaq_rpc_latency_seconds_count)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{broker.metrics_port}/metrics", timeout=10).read().decode()
    found = re.search(r'metaq_rpc_latency_seconds_count\{method="%s"\} (\S+)' % method, text)
    return float(found.group(1)) if found else 0.0


def per_request(broker: BrokerProcess, method: str, before: float, n: int, cpu: float) -> dict:
    """Messages and broker CPU per produce request: tells a cost per request (a client that sends smaller
    requests pays it more often) from a cost per message."""
    requests = requests_served(broker, method) - before
    if requests <= 0:
        raise RuntimeError(f"the broker's metrics counted no {method} request: no per-request figures")
    return {"msgs_per_request": n / requests, "broker_us_per_request": cpu / requests * 1e6}


def produce_metaq(z: dict, broker: BrokerProcess, topic: str, data: list) -> dict:
    with MetaqProducer(**z) as p:
        wait_topic(p, topic)
        p.send_batch(topic, data[:10])  # connections made, outside the timing
        requests0 = requests_served(broker, "PutData")
        meter, t0 = CpuMeter(broker.proc.pid), time.perf_counter()
        for i in range(0, len(data), BATCH):
            p.send_batch(topic, pa.array(data[i:i + BATCH], pa.binary()))
        seconds = time.perf_counter() - t0
        cpu = meter.seconds()
    return {"msgs_per_s": len(data) / seconds, "broker_us_per_msg": cpu / len(data) * 1e6,
            **per_request(broker, "PutData", requests0, len(data), cpu)}


def produce_kafka(broker: BrokerProcess, topic: str, data: list, batched: bool = False) -> dict:
    from confluent_kafka import Producer  # lazy: only this benchmark needs it
    return produce_confluent(Producer({"bootstrap.servers": broker.bootstrap, **PRODUCER}), topic, data, broker,
                             batched)


def produce_confluent(p, topic: str, data: list, broker: Optional[BrokerProcess] = None,
                      batched: bool = False) -> dict:
    """The producer loop (per message, a delivery callback: what a Python application writes) into
    whatever ``p`` is connected to; the broker's CPU per message when ``broker`` is given. ``batched``:
    ``produce_batch`` of ``BATCH`` messages at a time instead (confluent-kafka 2.x), each batch to
    partition 0 or 1 in turn as ``send_batch``'s go, the same delivery callback for every message."""
    p.produce(topic, data[0])  # connections and metadata, outside the timing
    p.flush(30)
    if broker:  # and the listener's warm-up at the first connection (numba: ~1 s of CPU) is done
        deadline = time.monotonic() + 60
        while "kafka: compiled kernels loaded" not in broker.log_path.read_text(errors="replace"):
            if time.monotonic() > deadline:
                raise RuntimeError("the Kafka listener never said its compiled kernels were loaded")
            time.sleep(0.05)
    failed = []

    def report(err, msg):
        if err:
            failed.append(err)
    requests0 = requests_served(broker, "KafkaProduce") if broker else 0.0
    meter, t0 = CpuMeter(broker.proc.pid) if broker else None, time.perf_counter()
    if batched:
        for i in range(0, len(data), BATCH):
            batch = [{"value": v} for v in data[i:i + BATCH]]
            while True:
                try:  # a full queue refuses the whole batch (BufferError) before queueing any of it
                    queued = p.produce_batch(topic, batch, partition=(i // BATCH) % 2, on_delivery=report)
                    break
                except BufferError:
                    p.poll(0.01)
            if queued != len(batch):
                raise RuntimeError(f"produce_batch queued {queued} of {len(batch)} messages: "
                                   f"{next(m['_error'] for m in batch if '_error' in m)}")
            p.poll(0)
    else:
        for v in data:
            try:
                p.produce(topic, v, on_delivery=report)
            except BufferError:
                p.poll(0.01)
                p.produce(topic, v, on_delivery=report)
    if p.flush(120):
        raise RuntimeError("confluent-kafka did not deliver every message within 120 s")
    seconds = time.perf_counter() - t0
    if failed:
        raise RuntimeError(f"{len(failed)} messages failed: {failed[:3]}")
    out = {"msgs_per_s": len(data) / seconds}
    if broker:
        cpu = meter.seconds()
        out.update(broker_us_per_msg=cpu / len(data) * 1e6,
                   **per_request(broker, "KafkaProduce", requests0, len(data), cpu))
    return out


def produce_kafka_requests(broker: BrokerProcess, topic: str, data: list, per: int) -> dict:
    """Produce requests of ``per`` records each (one uncompressed batch, partitions 0 and 1 in turn, as
    ``send_batch`` sends its batches), built before the timing and sent over one connection with up to 5 in
    flight (librdkafka's default): the broker's CPU per Kafka-produced message at a request size of metaq's,
    with no client in the way. Every answer must be NONE."""
    frames = []
    for c, i in enumerate(range(0, len(data), per)):
        values = pa.array(data[i:i + per], pa.binary())
        batch = krecords.encode(np.arange(len(values)), np.full(len(values), int(time.time() * 1000)), None, values)
        frames.append(encode_request(PRODUCE, PRODUCE_V, c, "bench", {
            "transactional_id": None, "acks": -1, "timeout_ms": 30_000,
            "topic_data": [{"name": topic, "partition_data": [{"index": c % 2, "records": bytes(batch)}]}]}))
    host, port = broker.bootstrap.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        answered = _answers(sock, [frames[0]], 1)  # the connection and the listener's warm-up, outside the timing
        requests0 = requests_served(broker, "KafkaProduce")
        meter, t0 = CpuMeter(broker.proc.pid), time.perf_counter()
        answered += _answers(sock, frames[1:], 5)
        seconds = time.perf_counter() - t0
        cpu = meter.seconds()  # before the connection's threads end
    refused = [p for r in answered for t in r["responses"] for p in t["partition_responses"] if p["error_code"]]
    if refused:
        raise RuntimeError(f"{len(refused)} partitions refused: {refused[:2]}")
    n = len(data) - min(per, len(data))
    return {"msgs_per_s": n / seconds, "broker_us_per_msg": cpu / n * 1e6,
            **per_request(broker, "KafkaProduce", requests0, n, cpu)}


def _answers(sock: socket.socket, frames: list, in_flight: int) -> list:
    """Send ``frames`` with at most ``in_flight`` unanswered; their answers' bodies, in order."""
    answers, sent = [], 0
    while len(answers) < len(frames):
        while sent < len(frames) and sent - len(answers) < in_flight:
            sock.sendall(frames[sent])
            sent += 1
        size = struct.unpack(">i", _recv_exactly(sock, 4))[0]
        answers.append(decode_response(PRODUCE, PRODUCE_V, _recv_exactly(sock, size))[1])
    return answers


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = sock.recv(n, socket.MSG_WAITALL)
    if len(data) != n:
        raise RuntimeError(f"the broker closed the connection ({len(data)} of {n} bytes)")
    return data


def consume_metaq(z: dict, topic: str, n: int) -> dict:
    with MetaqConsumer(**z) as c:
        ends = c.offsets(topic, list(PARTITIONS))
        t0 = time.perf_counter()
        got = sum(c.read_range(topic, p, 0, ends[p][1]).num_rows for p in PARTITIONS)
        seconds = time.perf_counter() - t0
    if got < n:
        raise RuntimeError(f"metaq's consumer read {got} of {n}")
    return {"msgs_per_s": got / seconds}


def consume_kafka(broker: BrokerProcess, topic: str, n: int) -> dict:
    return consume_confluent(broker.bootstrap, topic, n)


def consume_confluent(bootstrap: str, topic: str, n: int) -> dict:
    """The consumer loop (assign every partition from its earliest offset, ``consume(10000)``, look at each
    message) reading ``topic`` to its end from ``bootstrap``; at least ``n`` messages must be there."""
    from confluent_kafka import Consumer, TopicPartition  # lazy: only this benchmark needs it
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench", "enable.auto.commit": False,
                  "fetch.max.bytes": 8 << 20, "max.partition.fetch.bytes": 4 << 20, "log_level": 3,
                  "fetch.queue.backoff.ms": 10})  # see the module's docstring
    partitions = list(c.list_topics(topic, timeout=15).topics[topic].partitions)
    marks = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=15) for p in partitions}
    ends = sum(high - low for low, high in marks.values())
    c.assign([TopicPartition(topic, p, low) for p, (low, _) in marks.items()])
    got, t0 = 0, time.perf_counter()
    deadline = t0 + 300
    while got < ends and time.perf_counter() < deadline:
        # consume(n, timeout) returns once it has n messages or the timeout ran out: ask for no more than
        # are left, else the last call waits out its timeout for messages that will never come
        got += sum(1 for m in c.consume(min(10_000, ends - got), 1.0) if m.error() is None)
    seconds = time.perf_counter() - t0
    c.close()
    if got < max(ends, n):
        raise RuntimeError(f"confluent-kafka's consumer read {got} of {ends} ({n} expected)")
    return {"msgs_per_s": got / seconds}


def client_ceiling(topic: str, data: list) -> tuple:
    """(produce, produce_batch, consume) of the same loops against librdkafka's mock broker: the client's
    own limit."""
    from confluent_kafka import Producer  # lazy: only this benchmark needs it
    p = Producer({"test.mock.num.brokers": 1, **PRODUCER})
    produced = produce_confluent(p, topic, data)
    batched = produce_confluent(p, topic, data, batched=True)
    mock = next(iter(p.list_topics(topic, timeout=15).brokers.values()))  # lives as long as ``p``
    # the mock keeps the last few megabytes of each partition: the consumer reads what is left
    return produced, batched, consume_confluent(f"{mock.host}:{mock.port}", topic, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer messages and rounds")
    ap.add_argument("--messages", type=int, default=None, help="messages per case (default 300,000)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 2)")
    add_common_options(ap, "1g")
    args = ap.parse_args()
    n = args.messages or (50_000 if args.quick else 300_000)
    rounds = args.rounds or (1 if args.quick else 2)
    results = run_facts(benchmark="kafka", messages=n, rounds=rounds)
    tmp = scratch_dir(args.dir, "kafka-")
    zk = broker = None
    try:
        zk = LocalZooKeeper(data_dir=tmp / "zk").start()
        topics = {f"{kind}-{size}-{r}": {"numPartitions": 2} for kind in ("metaq", "kafka", "batched", "requests")
                  for size in SIZES for r in range(rounds)}
        broker = BrokerProcess(tmp / "broker", 1, zk.connect_string, settings={"zk.root": "/bench", "metricsPort": 0},
                               topics=topics).start()
        z = {"zk_connect": zk.connect_string, "zk_root": "/bench"}
        runs: dict = {}
        for r in range(rounds):
            for size in SIZES:
                data = values(n, size)
                cases = {
                    f"produce {size} B metaq send_batch": lambda: produce_metaq(z, broker, f"metaq-{size}-{r}", data),
                    f"produce {size} B confluent-kafka": lambda: produce_kafka(broker, f"kafka-{size}-{r}", data),
                    f"produce {size} B confluent-kafka produce_batch": lambda: produce_kafka(
                        broker, f"batched-{size}-{r}", data, batched=True),
                    f"produce {size} B Kafka requests": lambda: produce_kafka_requests(  # as many a request as a put
                        broker, f"requests-{size}-{r}", data, round(runs[f"produce {size} B metaq send_batch"][-1]["msgs_per_request"])),
                    f"consume {size} B metaq Consumer": lambda: consume_metaq(z, f"metaq-{size}-{r}", n),
                    f"consume {size} B confluent-kafka": lambda: consume_kafka(broker, f"metaq-{size}-{r}", n),
                }
                for name, case in cases.items():
                    os.sync()  # the last case's dirty pages written back now, not during this one
                    runs.setdefault(name, []).append(case())
                    log(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:,.1f}" for k, v in runs[name][-1].items()))
                ceiling = dict(zip((f"produce {size} B confluent-kafka into the mock",
                                    f"produce {size} B confluent-kafka produce_batch into the mock",
                                    f"consume {size} B confluent-kafka from the mock"),
                                   client_ceiling(f"mock-{size}-{r}", data)))
                for name, result in ceiling.items():
                    runs.setdefault(name, []).append(result)
                    log(f"round {r + 1} {name}: msgs_per_s {result['msgs_per_s']:,.1f}")
        best = {name: {k: (max if k in ("msgs_per_s", "msgs_per_request") else min)(x[k] for x in rs) for k in rs[0]}
                for name, rs in runs.items()}
        results["cases"] = best
        figures = []
        for size in SIZES:
            pm, cm = best[f"produce {size} B metaq send_batch"], best[f"consume {size} B metaq Consumer"]
            ck = best[f"consume {size} B confluent-kafka"]
            for producer in ("confluent-kafka", "confluent-kafka produce_batch"):
                pk = best[f"produce {size} B {producer}"]
                figures += [
                    {"name": f"{producer} produce {size} B", "value": pk["msgs_per_s"], "unit": "msgs/s",
                     "baseline": "metaq send_batch", "baseline_value": pm["msgs_per_s"], "goal": ">= 0.7"},
                    {"name": f"broker CPU per Kafka-produced message {size} B, {producer}",
                     "value": pk["broker_us_per_msg"], "unit": "us/msg", "baseline": "metaq put",
                     "baseline_value": pm["broker_us_per_msg"], "goal": "<= 1.5", "note": "lower is better"},
                    {"name": f"{producer} produce {size} B", "value": pk["msgs_per_s"], "unit": "msgs/s",
                     "baseline": "the client's ceiling (mock broker)",
                     "baseline_value": best[f"produce {size} B {producer} into the mock"]["msgs_per_s"]},
                ]
            figures += [
                {"name": f"broker CPU per Kafka-produced message {size} B, requests the size of a put's",
                 "value": best[f"produce {size} B Kafka requests"]["broker_us_per_msg"], "unit": "us/msg",
                 "baseline": "metaq put", "baseline_value": pm["broker_us_per_msg"], "note": "lower is better"},
                {"name": f"confluent-kafka consume {size} B", "value": ck["msgs_per_s"], "unit": "msgs/s",
                 "baseline": "metaq Consumer", "baseline_value": cm["msgs_per_s"], "goal": ">= 0.7"},
                {"name": f"confluent-kafka consume {size} B", "value": ck["msgs_per_s"], "unit": "msgs/s",
                 "baseline": "the client's ceiling (mock broker)",
                 "baseline_value": best[f"consume {size} B confluent-kafka from the mock"]["msgs_per_s"]},
            ]
        results["figures"] = figures
        print(f"\n{'case':<50} {'msgs/s':>12} {'broker us/msg':>14} {'msgs/request':>13} {'broker us/request':>18}")
        for name, b in best.items():
            cells = [f"{b[k]:,.{d}f}" if k in b else "" for k, d in
                     (("broker_us_per_msg", 2), ("msgs_per_request", 0), ("broker_us_per_request", 0))]
            print(f"{name:<50} {b['msgs_per_s']:>12,.0f} {cells[0]:>14} {cells[1]:>13} {cells[2]:>18}")
        print()
        for f in figures:
            goal = f" (goal {f['goal']})" if "goal" in f else ""
            print(f"{f['name']} / {f['baseline']}: {f['value'] / f['baseline_value']:.2f}{goal}")
        write_json(args.json, results)
    finally:
        teardown(tmp, broker, zk)


if __name__ == "__main__":
    main()
