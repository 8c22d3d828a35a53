"""Broker benchmark: produce and fetch throughput over loopback through the metaq client, beside Redis
Streams and NATS JetStream started by this script and driven from their Python clients in the same run.

    python benchmarks/bench_broker.py [--quick] [--dir PATH] [--json PATH] [--only NAME,...]

Systems (each a server process on a free 127.0.0.1 port, its data in a temporary directory under --dir,
stopped and removed at the end, also on Ctrl-C or an error):

* ``metaq group``: a metaq broker (``BrokerProcess``), topic default ``unflushThreshold=0``: group commit,
  a Put is acknowledged after an fsync that covers it.
* ``metaq unflush1000``: ``unflushThreshold=1000``: acknowledged after the page-cache write, fsync every
  1000 messages or ``unflushInterval`` (1 s). For comparison with the peers that do not fsync per ack. The
  broker fsyncs inline, before the ack, in the Put that reaches the threshold: in batches of 1000 that is
  every Put, so those rows have an fsync per batch too.
* ``redis always``: redis-server, ``appendonly yes``, ``appendfsync always``: the AOF is written and
  fsynced before replies go out, the durability metaq's group commit has. Redis fsyncs once per event-loop
  turn, and a turn reads about 16 KiB of a pipeline, so a pipeline of 1000 XADDs costs several fsyncs
  (strace: about 8 fdatasyncs per 1000 x 100 B, about 54 per 1000 x 1 KiB).
* ``redis everysec``: ``appendfsync everysec`` (Redis's default): acknowledged before the fsync, which
  runs once a second in the background; an OS crash can lose about the last 1-2 s of acknowledged writes.
* ``nats jetstream``: nats-server with JetStream, file storage: a publish is acknowledged once written to
  the stream's block file (page cache); the server fsyncs in the background on its sync interval
  (``sync_interval``, default 2 minutes; servers before 2.10 have no such option and refuse it).

Cases, each on a fresh topic / stream key / JetStream stream with one partition, from one client thread
in this process: values of 100 B and 1 KiB, in batches of 1 and of 1000.

* produce: metaq ``Producer.send_batch`` with 1 (a one-element list) or 1000 (a pre-built pyarrow binary
  array) messages per call; Redis a non-transactional pipeline of 1 or 1000 ``XADD``s per round trip;
  NATS ``js.publish`` awaiting each ack (batch 1), or 1000 ``js.publish_async`` and then awaiting their
  1000 acks (batch 1000). Up to 200k messages (batches of 1000) or 5k (batches of 1), at most 5 s.
* fetch: everything that case produced, read back: metaq ``Consumer.fetch`` in a loop over offsets (8 MiB
  per fetch, decoded to an Arrow RecordBatch with checksums verified); Redis ``XRANGE`` in chunks of
  1000; NATS a pull consumer (no acks) fetching batches of 1000. At most 5 s. The first and last values
  read are compared with the ones sent (and the count, unless the time limit cut the read short).

Before the timed cases each system runs every case once, small and untimed, on topics of its own (lazy
imports, first-call set-up, connections). Each case runs on every system in turn, starting with a
different system each case. ``client cpu`` / ``server cpu``: CPU time over wall time of this process (all
its threads) and of the server process during the case (100% = one core busy; from /proc, 10 ms ticks,
shown for cases of 0.2 s or more): a side near 100% is what limits the row, both well below it means
round-trip latency or the disk does. The disk under --dir is measured at the start and the end (150 B
appends with an fsync each, 1 MiB appends with an fsync each), with the load average, to show how
steady the machine was.

``--quick`` cuts volumes and the time limit 10x. A peer whose server binary or Python client (``redis``,
``nats-py``) is missing is skipped with a message. MB/s counts value bytes only (1 MB = 10^6 B); the
ratio table divides metaq's msgs/s by a peer's for the same case (the MB/s ratio is the same).
Figures only: no timing is asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from metaq_broker.devtools.broker_process import BrokerProcess, free_port  # noqa: E402
from metaq_broker.devtools.process import ChildProcess  # noqa: E402

POOL = 8000  # distinct values per size; message j carries value j % POOL
SIZES = (100, 1024)
BATCHES = (1, 1000)


# -- the timing loop every case of every system goes through ------------------------------------------
def timed(op, n, limit, loop=None):
    """Call ``op(0)``, ``op(1)``, ... until the message counts they return add up to ``n`` or ``limit``
    seconds have passed. ``op`` may return an awaitable (NATS): then the whole loop runs as one coroutine
    on ``loop``, so no event-loop round trip is added per call. Returns (messages, calls, seconds)."""
    async def drive():
        total = calls = 0
        t0 = time.perf_counter()
        deadline = t0 + limit
        while total < n and time.perf_counter() < deadline:
            got = op(calls)
            if inspect.isawaitable(got):
                got = await got
            if got <= 0:
                raise RuntimeError(f"call {calls} made no progress ({total} of {n} messages done)")
            total += got
            calls += 1
        return total, calls, time.perf_counter() - t0

    if loop is not None:
        return loop.run_until_complete(drive())
    coro = drive()  # never suspends when op is synchronous: run it to the end without an event loop
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a synchronous op returned something that suspended")


# -- data ------------------------------------------------------------------------------------------------
@dataclass
class Data:
    """Pre-built values of one size: ``lists[i]`` / ``arrays[i]`` hold call i's batch (i modulo their
    number), as Python lists of bytes and as pyarrow binary arrays; message j is ``flat[j % POOL]``."""

    size: int
    flat: list
    lists: dict = field(default_factory=dict)  # batch size -> [list of bytes]
    arrays: dict = field(default_factory=dict)  # batch size -> [pa.BinaryArray]

    @classmethod
    def make(cls, size: int, seed: int) -> Data:
        blob = random.Random(seed).randbytes(POOL * size)
        flat = [blob[i * size:(i + 1) * size] for i in range(POOL)]
        d = cls(size, flat)
        whole = pa.array(flat, pa.binary())
        for b in BATCHES:
            d.lists[b] = [flat[s:s + b] for s in range(0, POOL, b)]
            d.arrays[b] = [whole.slice(s, b) for s in range(0, POOL, b)]
        return d


@dataclass
class Case:
    key: str  # names the case's topic / stream key / stream
    size: int
    batch: int
    n: int  # messages to produce at most


@dataclass
class State:
    """One case on one system: its clients, what was read, a note for the table."""

    case: Case
    handles: dict = field(default_factory=dict)
    position: object = None  # where the next fetch starts
    got: int = 0
    first: object = None
    last: object = None
    note: str = ""


# -- servers ---------------------------------------------------------------------------------------------
def find_binary(name: str):
    """The server binary on PATH, or in an sbin directory (Debian puts nats-server in /usr/sbin)."""
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/local/bin", "/usr/bin"):
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def missing(binary: str, module: str, pip_name: str):
    """Why a peer cannot run here, or None."""
    if find_binary(binary) is None:
        return f"{binary} not found (Debian: apt-get install {binary})"
    try:
        importlib.import_module(module)
    except ImportError as e:
        return f"Python client {pip_name!r} not importable ({e}; pip install {pip_name})"
    return None


def version_of(cmd) -> str:
    try:
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "?"


class ServerProcess(ChildProcess):
    """A peer's server: its own session (a Ctrl-C at the terminal reaches only this script, which then
    stops it), its output in ``<workdir>/server.log``, SIGTERM to stop, SIGKILL if that takes >30 s."""

    def __init__(self, argv, workdir: Path, port: int):
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(Path(argv[0]).name, argv, workdir / "server.log", cwd=workdir, own_session=True)
        self.port = port

    def start(self, ready, timeout: float = 30.0) -> ServerProcess:
        """Start; ready once the port accepts and ``ready()`` returns without raising."""
        def serving() -> bool:
            if not port_open(self.port):
                return False
            ready()
            return True
        return super().start(serving, timeout)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


# -- the systems -----------------------------------------------------------------------------------------
class System:
    """What the run needs from a system: start/stop its server; per case, ``prepare`` a fresh topic and
    clients (untimed), a ``produce_op`` and a ``fetch_op`` for ``timed``, ``finish`` (untimed)."""

    name = ""
    durability = ""
    loop = None  # an asyncio loop for systems whose ops are coroutines

    def unavailable(self):
        return None

    def start(self, workdir: Path, cases) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def versions(self) -> dict:
        return {}

    def pid(self) -> int:
        """The server's process id (for its CPU time)."""
        raise NotImplementedError

    def prepare(self, case: Case) -> State:
        raise NotImplementedError

    def produce_op(self, st: State, data: Data):
        raise NotImplementedError

    def fetch_op(self, st: State, sent: int):
        raise NotImplementedError

    def finish(self, st: State) -> None:
        pass


class Metaq(System):
    def __init__(self, name: str, unflush_threshold: int, durability: str):
        self.name, self.unflush, self.durability = name, unflush_threshold, durability
        self.broker = None

    def start(self, workdir, cases):
        topics = {c.key: {"numPartitions": 1, "unflushThreshold": self.unflush} for c in cases}
        self.broker = BrokerProcess(workdir, broker_id=1, zk_connect="none", topics=topics).start()

    def stop(self):
        if self.broker is not None:
            try:
                self.broker.stop()
            except RuntimeError:
                self.broker.kill()
            self.broker = None

    def versions(self):
        import grpc

        import metaq_broker
        return {"metaq": metaq_broker.__version__, "grpcio": grpc.__version__, "pyarrow": pa.__version__}

    def pid(self):
        return self.broker.proc.pid

    def prepare(self, case):
        from metaq_broker.client.consumer import Consumer
        from metaq_broker.client.producer import Producer
        brokers = f"1={self.broker.address}"
        producer, consumer = Producer(brokers=brokers), Consumer(brokers=brokers)
        producer.partitions(case.key)  # connect both channels now, outside the timed loops
        consumer.offsets(case.key, ["1-0"])
        return State(case, {"producer": producer, "consumer": consumer}, position=0)

    def produce_op(self, st, data):
        send, topic = st.handles["producer"].send_batch, st.case.key
        batches = data.arrays[st.case.batch] if st.case.batch > 1 else data.lists[1]
        acks = st.handles["fsynced"] = set()

        def op(i):
            r = send(topic, batches[i % len(batches)], partition="1-0")[0]
            acks.add(r.fsynced)
            return r.count
        return op

    def fetch_op(self, st, sent):
        fetch, topic = st.handles["consumer"].fetch, st.case.key

        def op(i):
            f = fetch(topic, "1-0", st.position, max_bytes=8 << 20)
            n = f.batch.num_rows
            if n and f.next_offset != st.position + n:
                raise RuntimeError(f"metaq fetch at {st.position}: {n} rows but next_offset {f.next_offset}")
            if n:
                values = f.batch.column("value")
                if st.first is None:
                    st.first = values[0].as_py()
                st.last = values[n - 1].as_py()
            st.position = f.next_offset
            return n
        return op

    def finish(self, st):
        acks = st.handles.get("fsynced") or set()
        st.note = {frozenset({True}): "acks fsynced", frozenset({False}): "acks not fsynced",
                   frozenset(): ""}.get(frozenset(acks), "acks mixed")
        st.handles["producer"].close()
        st.handles["consumer"].close()


class Redis(System):
    def __init__(self, appendfsync: str, durability: str):
        self.name, self.appendfsync, self.durability = f"redis {appendfsync}", appendfsync, durability
        self.server = None

    def unavailable(self):
        return missing("redis-server", "redis", "redis")

    def client(self):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.server.port, socket_timeout=60)

    def start(self, workdir, cases):
        port = free_port()
        argv = [find_binary("redis-server"), "--bind", "127.0.0.1", "--port", str(port), "--protected-mode", "yes",
                "--daemonize", "no", "--dir", str(workdir), "--logfile", "", "--save", "",
                "--appendonly", "yes", "--appendfsync", self.appendfsync]
        self.server = ServerProcess(argv, workdir, port)
        self.server.start(lambda: self.client().ping())

    def stop(self):
        if self.server is not None:
            self.server.stop()
            self.server = None

    def versions(self):
        import redis
        import redis.utils
        return {"redis-server": version_of([find_binary("redis-server"), "--version"]),
                "redis-py": redis.__version__, "hiredis parser": bool(redis.utils.HIREDIS_AVAILABLE)}

    def pid(self):
        return self.server.proc.pid

    def prepare(self, case):
        r = self.client()
        r.ping()  # connect now, outside the timed loops
        return State(case, {"r": r, "rewrites": r.info("persistence")["aof_rewrites"]}, position="-")

    def produce_op(self, st, data):
        pipe, key = st.handles["r"].pipeline(transaction=False), st.case.key
        batches = data.lists[st.case.batch]

        def op(i):
            batch = batches[i % len(batches)]
            for v in batch:
                pipe.xadd(key, {b"v": v})
            pipe.execute()  # raises on any error reply; the pipeline is reset for the next call
            return len(batch)
        return op

    def fetch_op(self, st, sent):
        xrange, key = st.handles["r"].xrange, st.case.key

        def op(i):
            rows = xrange(key, min=st.position, max="+", count=1000)
            if rows:
                if st.first is None:
                    st.first = rows[0][1][b"v"]
                st.last = rows[-1][1][b"v"]
                st.position = b"(" + rows[-1][0]
            return len(rows)
        return op

    def finish(self, st):
        r = st.handles["r"]
        rewrites = r.info("persistence")["aof_rewrites"] - st.handles["rewrites"]
        st.note = f"{rewrites} AOF rewrite(s) ran" if rewrites else ""
        r.close()


class Nats(System):
    name = "nats jetstream"

    def __init__(self, durability: str):
        self.durability = durability
        self.server = None
        self.loop = None

    def unavailable(self):
        return missing("nats-server", "nats", "nats-py")

    async def connect(self):
        import nats
        return await nats.connect(f"nats://127.0.0.1:{self.server.port}", allow_reconnect=False, connect_timeout=5)

    def start(self, workdir, cases):
        port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        conf = workdir / "nats.conf"
        conf.write_text(f'listen: "127.0.0.1:{port}"\njetstream {{\n  store_dir: "{workdir / "js"}"\n}}\n')
        self.loop = asyncio.new_event_loop()
        self.server = ServerProcess([find_binary("nats-server"), "-c", str(conf)], workdir, port)

        async def ready():
            nc = await self.connect()
            try:
                await nc.jetstream().account_info()
            finally:
                await nc.close()
        self.server.start(lambda: self.loop.run_until_complete(ready()))

    def stop(self):
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.loop is not None:
            self.loop.close()
            self.loop = None

    def versions(self):
        import importlib.metadata
        return {"nats-server": version_of([find_binary("nats-server"), "--version"]),
                "nats-py": importlib.metadata.version("nats-py")}

    def pid(self):
        return self.server.proc.pid

    def prepare(self, case):
        from nats.js.api import StorageType

        async def setup():
            nc = await self.connect()
            js = nc.jetstream()
            await js.add_stream(name=case.key.upper(), subjects=[case.key], storage=StorageType.FILE)
            return nc, js
        nc, js = self.loop.run_until_complete(setup())
        return State(case, {"nc": nc, "js": js})

    def produce_op(self, st, data):
        js, subject = st.handles["js"], st.case.key
        batches = data.lists[st.case.batch]

        async def one(i):
            v = batches[i % len(batches)][0]
            await js.publish(subject, v)
            return 1

        async def many(i):
            batch = batches[i % len(batches)]
            acks = [await js.publish_async(subject, v) for v in batch]
            await asyncio.gather(*acks)
            return len(batch)
        return one if st.case.batch == 1 else many

    def fetch_op(self, st, sent):
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
        js, subject = st.handles["js"], st.case.key
        sub = self.loop.run_until_complete(js.pull_subscribe(
            subject, durable="bench", stream=subject.upper(),
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL)))

        async def op(i):
            msgs = await sub.fetch(min(1000, sent - st.got), timeout=5)
            if msgs:
                if st.first is None:
                    st.first = msgs[0].data
                st.last = msgs[-1].data
            st.got += len(msgs)
            return len(msgs)
        return op

    def finish(self, st):
        self.loop.run_until_complete(st.handles["nc"].close())


def systems(only=None) -> list:
    everysec = ("ack before fsync; fsync once a second in the background (~1-2 s of acked writes "
                "can be lost on an OS crash)")
    out = [
        Metaq("metaq group", 0, "group commit: ack after an fsync covering the batch (unflushThreshold=0, default)"),
        Metaq("metaq unflush1000", 1000, "ack after the page-cache write; fsync every 1000 msgs or 1 s "
                                         "(unflushThreshold=1000). A Put that reaches 1000 is fsynced before its "
                                         "ack, so in batches of 1000 every Put is (PutResult.fsynced says so)"),
        Redis("always", "appendonly, appendfsync always: AOF fsynced before the reply (one fsync per "
                        "event-loop turn, which reads ~16 KiB of a pipeline: several fsyncs per 1000-XADD pipeline)"),
        Redis("everysec", "appendonly, appendfsync everysec (Redis default): " + everysec),
        Nats("file storage: ack after the write to the stream's block file (page cache); fsync in the "
             "background every sync_interval (default 2 min; nats-server < 2.10 has no such option)"),
    ]
    return [s for s in out if only is None or s.name in only]


# -- the run ---------------------------------------------------------------------------------------------
def check_read(system: System, st: State, data: Data, sent: int, got: int, capped: bool) -> None:
    """What was read back starts with message 0 and ends with message got-1 of what was sent."""
    where = f"{system.name} {st.case.key}"
    if got and (st.first != data.flat[0] or st.last != data.flat[(got - 1) % POOL]):
        raise RuntimeError(f"{where}: the values read back differ from the ones sent")
    if not capped and got != sent:
        raise RuntimeError(f"{where}: read {got} messages, {sent} were produced")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc; clock-tick resolution, usually 10 ms)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def run_case(s: System, case: Case, d: Data, limit: float) -> list:
    """Produce then fetch one case on one system; its two table rows, with the CPU time this process
    (the client, all its threads) and the server used, as a share of the wall-clock time."""
    st = s.prepare(case)
    out = []
    try:
        for op in ("produce", "fetch"):
            fn = s.produce_op(st, d) if op == "produce" else s.fetch_op(st, out[0]["msgs"])
            want = case.n if op == "produce" else out[0]["msgs"]
            client, server = time.process_time(), cpu_seconds(s.pid())
            msgs, calls, secs = timed(fn, want, limit, s.loop)
            client, server = time.process_time() - client, cpu_seconds(s.pid()) - server
            if op == "fetch":
                check_read(s, st, d, want, msgs, capped=msgs < want)
            out.append({"system": s.name, "op": op, "value_bytes": case.size, "batch": case.batch, "msgs": msgs,
                        "calls": calls, "seconds": secs, "msgs_s": msgs / secs, "mb_s": msgs * case.size / 1e6 / secs,
                        "client_cpu": client / secs, "server_cpu": server / secs, "time_capped": msgs < want,
                        "note": ""})
    finally:
        s.finish(st)
    out[0]["note"] = st.note
    return out


def disk_baseline(directory: Path, limit: float) -> dict:
    """What the disk under the data directories does now: 150-byte appends each followed by an fsync
    (fsyncs/s, the ceiling for one writer that fsyncs every message) and 1 MiB appends + fsync (MB/s)."""
    out = {}
    for name, size in (("fsync_150b_per_s", 150), ("write_1mib_fsync_mb_s", 1 << 20)):
        path, buf = directory / f"disk-{size}", os.urandom(size)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            def op(_, fd=fd, buf=buf):
                os.write(fd, buf)
                os.fsync(fd)
                return 1
            n, _, secs = timed(op, 10 ** 6 if size < 4096 else 256, limit)
        finally:
            os.close(fd)
            os.unlink(path)
        out[name] = n / secs if size < 4096 else n * size / 1e6 / secs
    out["loadavg_1m"] = os.getloadavg()[0]
    return out


def describe_disk(b: dict) -> str:
    return (f"150 B write+fsync {b['fsync_150b_per_s']:,.0f}/s, 1 MiB write+fsync {b['write_1mib_fsync_mb_s']:,.0f} "
            f"MB/s, load average {b['loadavg_1m']:.2f}")


def run(root: Path, quick: bool, only=None) -> dict:
    scale = 0.1 if quick else 1.0
    limit = 5.0 * scale
    cases = [Case(f"s{size}b{batch}", size, batch, int((200_000 if batch > 1 else 5_000) * scale))
             for size in SIZES for batch in BATCHES]
    # Untimed, first: every client's code path once (lazy imports, first-call set-up), on their own topics.
    warmups = [Case(f"w{c.size}b{c.batch}", c.size, c.batch, 20 * c.batch) for c in cases]
    data = {size: Data.make(size, seed=size) for size in SIZES}
    disk = {"start": disk_baseline(root, limit / 5)}
    print(f"disk at start: {describe_disk(disk['start'])}", flush=True)
    active, skipped, info = [], {}, {}
    with contextlib.ExitStack() as stack:
        for s in systems(only):
            why = s.unavailable()
            if why:
                skipped[s.name] = why
                print(f"SKIPPING {s.name}: {why}", flush=True)
                continue
            t0 = time.perf_counter()
            stack.callback(s.stop)  # registered first: a server that half-started is stopped too
            s.start(root / s.name.replace(" ", "-"), warmups + cases)
            info[s.name] = s.versions()
            for case in warmups:
                run_case(s, case, data[case.size], limit)
            print(f"started and warmed up {s.name} in {time.perf_counter() - t0:.1f} s", flush=True)
            active.append(s)
        rows = []
        print(f"\n{len(cases)} cases x {len(active)} systems, at most {limit:g} s per case and direction", flush=True)
        for k, case in enumerate(cases):
            # Every system on one case before the next, starting with a different one each case, so drift
            # in the disk's speed (or other load on the machine) does not always hit the same system.
            for s in active[k % len(active):] + active[:k % len(active)]:
                rows += run_case(s, case, data[case.size], limit)
                for r in rows[-2:]:
                    print("  " + format_row(r), flush=True)
    disk["end"] = disk_baseline(root, limit / 5)
    print(f"disk at end:   {describe_disk(disk['end'])}", flush=True)
    order = {s.name: i for i, s in enumerate(active)}
    rows.sort(key=lambda r: (r["op"] != "produce", r["value_bytes"], r["batch"], order[r["system"]]))
    return {"rows": rows, "skipped": skipped, "versions": info, "limit_s": limit, "disk": disk,
            "durability": {s.name: s.durability for s in active}}


def format_row(r: dict) -> str:
    return (f"{r['op']:<8} {size_name(r['value_bytes']):>5} b{r['batch']:<5} {r['system']:<18} {r['msgs']:>9,} msgs "
            f"{r['seconds']:6.2f} s {r['msgs_s']:>11,.0f} msgs/s {r['mb_s']:8.1f} MB/s  cpu client "
            f"{percent(r, 'client_cpu'):>4} server {percent(r, 'server_cpu'):>4}"
            + ("  (time limit)" if r["time_capped"] else "") + (f"  {r['note']}" if r["note"] else ""))


def percent(r: dict, key: str) -> str:
    """A CPU share, or '-' when the case was too short for clock-tick CPU times to mean much."""
    return "-" if r["seconds"] < 0.2 or r[key] != r[key] else f"{r[key] * 100:.0f}%"


def size_name(n: int) -> str:
    return f"{n // 1024}KiB" if n % 1024 == 0 else f"{n}B"


RATIOS = [  # (metaq system, peer): the second group pairs metaq without fsync-per-ack with peers without it
    ("metaq group", "redis always"), ("metaq group", "redis everysec"), ("metaq group", "nats jetstream"),
    ("metaq unflush1000", "redis everysec"), ("metaq unflush1000", "nats jetstream"),
]


def ratios(rows) -> list:
    by = {(r["system"], r["op"], r["value_bytes"], r["batch"]): r for r in rows}
    out = []
    for op in ("produce", "fetch"):
        for size in SIZES:
            for batch in BATCHES:
                line = {"op": op, "value_bytes": size, "batch": batch}
                for m, peer in RATIOS:
                    a, b = by.get((m, op, size, batch)), by.get((peer, op, size, batch))
                    line[f"{m} / {peer}"] = a["msgs_s"] / b["msgs_s"] if a and b else None
                out.append(line)
    return out


def table(head, body, left) -> str:
    """Columns padded to their widest cell; those in ``left`` left-aligned, the others right-aligned."""
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i in left else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


def report(result: dict, quick: bool) -> str:
    rows = result["rows"]
    lines = [(f"bench_broker {'--quick ' if quick else ''}(loopback 127.0.0.1, one client thread, {os.cpu_count()} "
              f"cores, Python {platform.python_version()}; at most {result['limit_s']:g} s per case and direction)"),
             "durability of an acknowledged message:"]
    lines += [f"  {name:<18} {text}" for name, text in result["durability"].items()]
    lines += [f"  skipped {name}: {why}" for name, why in result["skipped"].items()]
    versions = {k: v for i in result["versions"].values() for k, v in i.items()}
    lines.append("versions: " + "; ".join(f"{k} {v}" for k, v in versions.items()))
    lines += [f"disk at start: {describe_disk(result['disk']['start'])}",
              f"disk at end:   {describe_disk(result['disk']['end'])}",
              (f"MB/s: value bytes only. cpu: CPU time over wall time (100% = one core; {os.cpu_count()} cores here) "
               "of the client (this Python process, all threads) and of the server process; a side near 100% is "
               "what limits the row. The peers' clients are Python too (redis-py, nats-py)."), ""]
    head = ["op", "value", "batch", "system", "msgs", "secs", "msgs/s", "MB/s", "client cpu", "server cpu", "note"]
    body = [[r["op"], size_name(r["value_bytes"]), str(r["batch"]), r["system"], f"{r['msgs']:,}",
             f"{r['seconds']:.2f}", f"{r['msgs_s']:,.0f}", f"{r['mb_s']:,.1f}", percent(r, "client_cpu"),
             percent(r, "server_cpu"), ", ".join(filter(None, ["time limit" if r["time_capped"] else "", r["note"]]))]
            for r in rows]
    lines.append(table(head, body, left={0, 1, 2, 3, len(head) - 1}))
    rat = ratios(rows)
    cols = [f"{m} / {p}" for m, p in RATIOS if any(line[f"{m} / {p}"] is not None for line in rat)]
    if cols:
        lines += ["", ("metaq msgs/s over the peer's (>1: metaq faster); 'always' is the like-for-like durability "
                       "for 'metaq group', 'everysec' and nats for 'metaq unflush1000':")]
        head = ["op", "value", "batch"] + [c.replace("metaq ", "").replace(" / ", "/") for c in cols]
        body = [[l["op"], size_name(l["value_bytes"]), str(l["batch"])] +
                ["-" if l[c] is None else f"{l[c]:.2f}" for c in cols] for l in rat]
        lines.append(table(head, body, left={0, 1, 2}))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10x smaller volumes and time limit")
    ap.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent / ".bench-data",
                    help="where to create the temporary data directories (default: benchmarks/.bench-data)")
    ap.add_argument("--json", type=Path, help="also write the results to this JSON file")
    ap.add_argument("--only", help="comma-separated system names to run, e.g. 'metaq group,redis always'")
    args = ap.parse_args(argv)
    only = None if not args.only else {x.strip() for x in args.only.split(",")}
    if only:
        unknown = only - {s.name for s in systems()}
        if unknown:
            ap.error(f"unknown system(s) {sorted(unknown)}; known: {[s.name for s in systems()]}")

    def terminate(signum, frame):  # SIGTERM: unwind like Ctrl-C, so the servers are stopped
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored (`cmd &`)

    created = not args.dir.exists()
    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-broker-", dir=args.dir))
    try:
        result = run(root, args.quick, only)
    except KeyboardInterrupt:
        print("\ninterrupted: servers stopped, temporary data removed", file=sys.stderr)
        sys.exit(130)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                args.dir.rmdir()
    print("\n" + report(result, args.quick))
    if args.json:
        args.json.write_text(json.dumps({"quick": args.quick, **result, "ratios": ratios(result["rows"])}, indent=2))


if __name__ == "__main__":
    main()
