"""MetaQ listener benchmark: puts and gets of 100 B messages over MetaQ's text protocol (``metaqPort``)
beside the native client's over the data port, same broker, same run, taking turns.

* ``put``: ``--batch`` puts (7 tokens, checksummed) pipelined on one connection (written in one send, then
  the replies read), ``--batches`` times; the broker stores each read's consecutive puts to one partition
  as one batch. Baseline: the native ``Producer.send_batch`` of the same values, ``--batch`` per put.
* ``get``: the messages just written read back from position 0 with ``get`` of 1 MiB, each next position
  the last plus the bytes of the whole messages (a MetaQ consumer's loop). Baseline: the native
  ``Consumer.fetch`` of 1 MiB from offset 0 to the end.

Figures: messages per second and the MetaQ/native ratio (the goal for puts: >= 0.5).

    python benchmarks/bench_metaq_listener.py [--quick] [--batches N] [--batch B] [--rounds R] [--json PATH]

One ``BrokerProcess`` and a ``LocalZooKeeper`` on loopback; everything is stopped and removed at the end.
Figures only: nothing is asserted about them.
"""
from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (VALUE_SIZE, add_common_options, log, run_facts, scratch_dir,  # noqa: E402
                               teardown, values_array, write_json)
from metaq_broker.client.consumer import Consumer  # noqa: E402
from metaq_broker.client.producer import Producer  # noqa: E402
from metaq_broker.devtools.broker_process import BrokerProcess  # noqa: E402
from metaq_broker.devtools.zookeeper import LocalZooKeeper  # noqa: E402
from metaq_broker.zk.paths import ZkPaths  # noqa: E402

ROOT = "/bench"
GET_SIZE = 1 << 20


class Wire:
    """A bare MetaQ connection: lines out, replies in."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()

    def reply(self) -> tuple:
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                head = self.buf[:end].split(b" ")
                length = int(head[2] if head[0] == b"result" else head[1])
                if len(self.buf) >= end + 2 + length:
                    body = bytes(self.buf[end + 2:end + 2 + length])
                    del self.buf[:end + 2 + length]
                    return head[0], int(head[1]) if head[0] == b"result" else 200, body
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the broker closed the connection")
            self.buf += chunk


    def replies(self, n: int) -> None:
        """Read ``n`` put replies (each has one CRLF: its body is "<msgId> <partition> <position>"), all 200."""
        while self.buf.count(b"\r\n") < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the broker closed the connection")
            self.buf += chunk
        end = len(self.buf) - len(self.buf.split(b"\r\n", n)[-1])  # after the n-th reply's line (one C call)
        end = self.buf.find(b"result", end)
        end = len(self.buf) if end < 0 else end
        if self.buf.count(b"result 200 ", 0, end) != n:
            raise RuntimeError(f"a put was refused: {bytes(self.buf[:end])[:300]!r}")
        del self.buf[:end]


def metaq_puts(wire: Wire, topic: str, values: list, batches: int) -> float:
    wire_puts = b"".join(b"put %s 0 %d 0 %d 1\r\n" % (topic.encode(), len(v), zlib.crc32(v) & 0x7FFFFFFF) + v
                         for v in values)
    t0 = time.perf_counter()
    for _ in range(batches):
        wire.sock.sendall(wire_puts)
        wire.replies(len(values))
    return time.perf_counter() - t0


def metaq_gets(wire: Wire, topic: str, expected: int) -> float:
    t0 = time.perf_counter()
    position = got = 0
    while got < expected:
        wire.sock.sendall(b"get %s g 0 %d %d 1\r\n" % (topic.encode(), position, GET_SIZE))
        kind, code, body = wire.reply()
        if kind != b"value":
            raise RuntimeError(f"get at {position} answered {code}: {body!r}")
        used = 0
        while len(body) - used >= 20:  # the whole messages, as a MetaQ client counts them
            length = struct.unpack_from(">i", body, used)[0]
            if used + 20 + length > len(body):
                break
            used += 20 + length
            got += 1
        position += used
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer batches and rounds")
    ap.add_argument("--batches", type=int, default=None, help="pipelined groups of puts per round (default 100)")
    ap.add_argument("--batch", type=int, default=1000, help="puts per group (default 1000)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per transport (default 3)")
    add_common_options(ap, "1g")
    args = ap.parse_args()
    batches = args.batches or (20 if args.quick else 100)
    rounds = args.rounds or (2 if args.quick else 3)
    n = batches * args.batch
    results = run_facts(benchmark="metaq_listener", batches=batches, batch=args.batch, rounds=rounds)
    tmp = scratch_dir(args.dir, "metaq-listener-")
    zk = broker = None
    try:
        zk = LocalZooKeeper(data_dir=tmp / "zk").start()
        broker = BrokerProcess(tmp / "broker", 1, zk.connect_string, settings={"zk.root": ROOT, "metaqPort": 0},
                               topics={f"{kind}{r}": {} for r in range(rounds) for kind in ("mq", "native")}).start()
        port = json.loads(zk_get(zk, ZkPaths(ROOT).broker(1)))["metaqPort"]
        arr = values_array(0, args.batch)
        values = arr.to_pylist()
        runs: dict = {"put": {"metaq": [], "native": []}, "get": {"metaq": [], "native": []}}
        with Producer(zk_connect=zk.connect_string, zk_root=ROOT) as producer, \
                Consumer(zk_connect=zk.connect_string, zk_root=ROOT) as consumer:
            for r in range(rounds):
                wire = Wire(port)
                metaq_puts(wire, f"mq{r}", values[:10], 1)  # connection and partition warm, outside the timing
                seconds = metaq_puts(wire, f"mq{r}", values, batches)
                runs["put"]["metaq"].append(n / seconds)
                producer.send_batch(f"native{r}", arr[:10], partition="1-0")
                t0 = time.perf_counter()
                for _ in range(batches):
                    producer.send_batch(f"native{r}", arr, partition="1-0")
                runs["put"]["native"].append(n / (time.perf_counter() - t0))
                runs["get"]["metaq"].append((n + 10) / metaq_gets(wire, f"mq{r}", n + 10))
                wire.sock.close()
                t0, offset = time.perf_counter(), 0
                while offset < n + 10:
                    f = consumer.fetch(f"native{r}", "1-0", offset, GET_SIZE)
                    offset = f.next_offset
                runs["get"]["native"].append((n + 10) / (time.perf_counter() - t0))
                log(f"round {r + 1}: " + ", ".join(f"{op} {kind} {rs[kind][-1]:,.0f}/s"
                                                   for op, rs in runs.items() for kind in rs))
        best = {op: {kind: max(v) for kind, v in rs.items()} for op, rs in runs.items()}
        results["cases"] = best
        names = {"put": f"MetaQ puts of {VALUE_SIZE} B, {args.batch} pipelined a send",
                 "get": f"MetaQ gets of 1 MiB, {VALUE_SIZE} B messages"}
        results["figures"] = [{"name": names[op], "value": best[op]["metaq"], "unit": "msg/s",
                               "baseline": "native client (data port)", "baseline_value": best[op]["native"]}
                              for op in ("put", "get")]
        print(f"\n{'':<6} {'MetaQ msg/s':>12} {'native msg/s':>13} {'ratio':>6}")
        for op in ("put", "get"):
            b = best[op]
            print(f"{op:<6} {b['metaq']:>12,.0f} {b['native']:>13,.0f} {b['metaq'] / b['native']:>6.2f}")
        write_json(args.json, results)
    finally:
        teardown(tmp, broker, zk)


def zk_get(zk: LocalZooKeeper, path: str) -> bytes:
    from kazoo.client import KazooClient
    client = KazooClient(hosts=zk.connect_string)
    client.start(timeout=30)
    try:
        deadline = time.monotonic() + 30
        while not client.exists(path):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{path} never showed in ZooKeeper")
            time.sleep(0.05)
        return client.get(path)[0]
    finally:
        client.stop()
        client.close()


if __name__ == "__main__":
    main()
