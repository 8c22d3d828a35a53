"""A Kafka Produce against a metaq put of the same messages, request by request, in one process: what the
broker's request path pays for Kafka's record format at equal request sizes, without sockets, threads or
the client's choice of request size (``bench_kafka.py`` measures end to end, where librdkafka sends
~4,000-7,000 records a request against ``send_batch``'s 10,000).

    python benchmarks/bench_kafka_replay.py [--quick] [--rounds R] [--json PATH] [--dir PATH]

For values of 100 B and 1 KiB (no keys, one partition) and requests of 1,000, 4,000 and 10,000 records:

* ``kafka produce``: ``read_request`` of a Produce frame whose records are one uncompressed v2 batch (as
  librdkafka sends them with lz4 off), ``KafkaServer.append_produce`` (decode, ``to_metaq``, append), its
  acknowledgement and ``encode_response``: what the Kafka listener runs per request;
* ``metaq put`` (the baseline): ``records.parse_body`` of the same messages as metaq's producer encodes
  them, ``RequestHandler.put_encoded``: what the data port runs per ``PutData``.

Both go to one broker of this process's own (no ZooKeeper), into a topic with the default durability, group
commit (one fsync per request either way), and into one acknowledged when written (``unflushThreshold``
above the run: no fsync), which leaves the record format's cost without the disk's noise. The figure is
this process's CPU (``time.process_time``: the kernel's writes and fsyncs included) per message, best of
``--rounds`` passes over the requests; the ratio is against the same run's metaq put (issue 27's goal for
the broker's CPU per Kafka-produced message: at most x1.5). The kernel's share swings with the page cache
(dirty pages written back by whoever writes next): ``--dir /dev/shm`` leaves the record format's own cost.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_common_options, log, run_facts, scratch_dir, teardown, write_json  # noqa: E402
from metaq_broker.protocol import rawput  # noqa: E402
from metaq_broker.protocol import records as mrecords  # noqa: E402
from metaq_broker.protocol.kafka import records as krecords  # noqa: E402
from metaq_broker.protocol.kafka.protocol import PRODUCE, encode_request, encode_response, read_request  # noqa: E402
from metaq_broker.server.broker import Broker  # noqa: E402
from metaq_broker.server.config import load  # noqa: E402
from metaq_broker.server.listener import ANONYMOUS  # noqa: E402

SIZES = (100, 1024)
PER_REQUEST = (1_000, 4_000, 10_000)
PRODUCE_V = 10  # what librdkafka 2 sends (v13 names topics by id)


class _Connection:
    """What ``append_produce`` reads of a connection: who is asking."""

    principal = ANONYMOUS


def kafka_frame(topic: str, values: pa.Array) -> bytes:
    n = len(values)
    batch = krecords.encode(np.arange(n), np.full(n, int(time.time() * 1000)), None, values)
    body = {"transactional_id": None, "acks": -1, "timeout_ms": 30_000,
            "topic_data": [{"name": topic, "partition_data": [{"index": 0, "records": bytes(batch)}]}]}
    return encode_request(PRODUCE, PRODUCE_V, 1, "bench", body)[4:]  # as the listener hands it: no size prefix


def metaq_put(values: pa.Array) -> tuple:
    """(count, attributes, body bytes, body CRC) of a metaq producer's batch of ``values``."""
    e = mrecords.encode_body(values)
    return e.count, e.attributes, b"".join(bytes(p) for p in e.parts), e.crc


def cpu_us_per_msg(fn, items: list, messages: int, rounds: int) -> float:
    """CPU microseconds per message of ``fn`` over ``items``, the best of ``rounds`` passes."""
    for it in items[:2]:
        fn(it)  # warm
    best = float("inf")
    for _ in range(rounds):
        c0 = time.process_time()
        for it in items:
            fn(it)
        best = min(best, time.process_time() - c0)
    return best / messages * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer messages and rounds")
    ap.add_argument("--rounds", type=int, default=None, help="passes over the requests (default 5)")
    add_common_options(ap, "1g")
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    messages = {100: 100_000 if args.quick else 400_000, 1024: 25_000 if args.quick else 100_000}  # per case
    results = run_facts(benchmark="kafka_replay", messages=messages, rounds=rounds)
    tmp = scratch_dir(args.dir, "kafka-replay-")
    broker = None
    try:
        broker = Broker(load(None, {"brokerId": "1", "serverPort": "0", "kafkaPort": "0", "dataPort": "-1",
                                    "zk.connect": "none", "dataPath": str(tmp / "broker")})).start()
        durabilities = {"group commit": "t", "written": "w"}
        broker.create_topic("t", None, {})
        broker.create_topic("w", None, {"unflushThreshold": str(1 << 30), "unflushInterval": str(3_600_000)})
        conn, handler, kafka = _Connection(), broker.handler, broker.kafka_server

        def produce(frame) -> None:
            request = read_request(frame)
            answer = kafka.append_produce(conn, request)()
            encode_response(request, answer)
            if answer["responses"][0]["partition_responses"][0]["error_code"]:  # a refusal measures nothing
                raise RuntimeError(f"the Produce was refused: {answer}")

        def put(item) -> None:
            topic, (count, attributes, body, crc) = item
            request = rawput.Request(topic, 0, "", None, rawput.ACKS_ALL, None)
            handler.put_encoded(ANONYMOUS, request, mrecords.parse_body(count, attributes, body, crc))
        figures = []
        for durability, topic in durabilities.items():
            for size in SIZES:
                for per in PER_REQUEST:
                    values = pa.array([(b"%08d" % i).ljust(size, b"x") for i in range(per)], pa.binary())
                    n = max(messages[size] // per, 3)
                    k = cpu_us_per_msg(produce, [kafka_frame(topic, values)] * n, n * per, rounds)
                    m = cpu_us_per_msg(put, [(topic, metaq_put(values))] * n, n * per, rounds)
                    name = f"{size} B, {per:,} a request, {durability}"
                    results["cases"][f"kafka produce {name}"] = {"cpu_us_per_msg": k}
                    results["cases"][f"metaq put {name}"] = {"cpu_us_per_msg": m}
                    figures.append({"name": f"kafka produce CPU {name}", "value": k, "unit": "us/msg",
                                    "baseline": "metaq put", "baseline_value": m, "goal": "<= 1.5",
                                    "note": "lower is better"})
                    log(f"{name}: kafka produce {k:.3f} us/msg, metaq put {m:.3f} us/msg, x{k / m:.2f}")
        results["figures"] = figures
        write_json(args.json, results)
    finally:
        teardown(tmp, broker)


if __name__ == "__main__":
    main()
