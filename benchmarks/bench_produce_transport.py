"""Produce transport benchmark: the same puts over the broker's data port and over gRPC ``PutRaw``, same
broker, same run, taking turns.

A producer that finds its broker through ZooKeeper puts over the data port (one scatter-gather
``sendmsg`` per put, the broker receiving into a buffer it reuses); ``Producer(use_data_port=False)`` puts
the same requests as gRPC ``PutRaw`` (HTTP/2 framing and gRPC's copies on both sides). Each round sends
``--batches`` batches of 10,000 keyed messages of 100 B with ``PipelinedSender`` (the Spark sink's
sender: one put in flight per partition) to a topic of 2 partitions, then the other transport does the
same; ``--rounds`` rounds, the best of each transport reported. Figures: MB/s, and CPU milliseconds per
MB in this process (encoding, CRC and sending) and in the broker (receiving, checking, writing; group
commit fsyncs every put), with gRPC as the baseline.

    python benchmarks/bench_produce_transport.py [--quick] [--batches N] [--rounds R] [--json PATH] [--dir PATH]

One ``BrokerProcess`` and a ``LocalZooKeeper`` on loopback; everything is stopped and removed at the end.
Figures only: nothing is asserted about them.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (VALUE_SIZE, add_common_options, log, proc_cpu_s, run_facts,  # noqa: E402
                               scratch_dir, teardown, values_array, write_json)
from metaq_broker.client.producer import PipelinedSender, Producer  # noqa: E402
from metaq_broker.devtools.broker_process import BrokerProcess  # noqa: E402
from metaq_broker.devtools.zookeeper import LocalZooKeeper  # noqa: E402

ROWS = 10_000
TOPIC = "transport"
TRANSPORTS = {"data port": True, "gRPC PutRaw": False}


def one_round(zk: LocalZooKeeper, broker: BrokerProcess, data_port: bool, batches: int, values, keys) -> dict:
    with Producer(zk_connect=zk.connect_string, zk_root="/bench", use_data_port=data_port) as producer:
        deadline = time.monotonic() + 30
        while not (producer.data_address(broker.broker_id) and len(producer.partitions(TOPIC)) == 2):
            if time.monotonic() > deadline:
                raise RuntimeError("the broker's partitions and data port never showed in ZooKeeper")
            time.sleep(0.05)
        sender = PipelinedSender(producer)
        sender.send_batch(TOPIC, values, keys)  # connections made, outside the timing
        sender.flush()
        cpu0, broker0, t0 = time.process_time(), proc_cpu_s(broker.proc.pid), time.perf_counter()
        for _ in range(batches):
            sender.send_batch(TOPIC, values, keys)
        sent = sum(r.count for r in sender.flush())
        seconds = time.perf_counter() - t0
        cpu, broker_cpu = time.process_time() - cpu0, proc_cpu_s(broker.proc.pid) - broker0
    if sent != batches * ROWS:
        raise RuntimeError(f"{sent} messages acknowledged, {batches * ROWS} sent")
    mb = batches * ROWS * VALUE_SIZE / 1e6
    return {"mb_per_s": mb / seconds, "client_ms_per_mb": cpu / mb * 1e3, "broker_ms_per_mb": broker_cpu / mb * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer batches and rounds")
    ap.add_argument("--batches", type=int, default=None, help="batches of 10,000 messages per round (default 300)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per transport (default 3)")
    add_common_options(ap, "1g")
    args = ap.parse_args()
    batches = args.batches or (60 if args.quick else 300)
    rounds = args.rounds or (2 if args.quick else 3)
    results = run_facts(benchmark="produce_transport", batches=batches, rows_per_batch=ROWS, rounds=rounds)
    tmp = scratch_dir(args.dir, "produce-transport-")
    zk = broker = None
    try:
        zk = LocalZooKeeper(data_dir=tmp / "zk").start()
        broker = BrokerProcess(tmp / "broker", 1, zk.connect_string, settings={"zk.root": "/bench"},
                               topics={TOPIC: {"numPartitions": 2}}).start()
        values = values_array(0, ROWS)
        keys = pa.array([b"%d" % i for i in range(ROWS)], pa.binary())
        runs: dict = {name: [] for name in TRANSPORTS}
        for r in range(rounds):
            for name, data_port in TRANSPORTS.items():
                runs[name].append(one_round(zk, broker, data_port, batches, values, keys))
                log(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[name][-1].items()))
        best = {name: {"mb_per_s": max(x["mb_per_s"] for x in rs),
                       "client_ms_per_mb": min(x["client_ms_per_mb"] for x in rs),
                       "broker_ms_per_mb": min(x["broker_ms_per_mb"] for x in rs)} for name, rs in runs.items()}
        results["cases"] = best
        base, new = best["gRPC PutRaw"], best["data port"]
        results["figures"] = [
            {"name": "puts over the data port, throughput", "value": new["mb_per_s"], "unit": "MB/s",
             "baseline": "gRPC PutRaw", "baseline_value": base["mb_per_s"]},
            {"name": "puts over the data port, client CPU", "value": new["client_ms_per_mb"], "unit": "ms/MB",
             "baseline": "gRPC PutRaw", "baseline_value": base["client_ms_per_mb"], "note": "lower is better"},
            {"name": "puts over the data port, broker CPU", "value": new["broker_ms_per_mb"], "unit": "ms/MB",
             "baseline": "gRPC PutRaw", "baseline_value": base["broker_ms_per_mb"], "note": "lower is better"},
        ]
        print(f"\n{'transport':<14} {'MB/s':>8} {'client ms/MB':>13} {'broker ms/MB':>13}")
        for name, b in best.items():
            print(f"{name:<14} {b['mb_per_s']:>8.1f} {b['client_ms_per_mb']:>13.2f} {b['broker_ms_per_mb']:>13.2f}")
        for f in results["figures"]:
            print(f"{f['name']} / {f['baseline']}: {f['value'] / f['baseline_value']:.2f}")
        write_json(args.json, results)
    finally:
        teardown(tmp, broker, zk)


if __name__ == "__main__":
    main()
