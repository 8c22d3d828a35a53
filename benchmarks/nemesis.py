"""The nemesis: a seeded, bounded schedule of real faults against a replicated group under load, and a
checker of what the clients were promised (Jepsen's idea, kept small).

    python -m benchmarks.nemesis [--minutes M | --seconds S] [--seed N] [--faults KIND,...] [--loopback]
                                 [--session-timeout-ms MS] [--recover-s S] [--dir PATH] [--keep] [--json PATH]

**The system.** One real ZooKeeper and a group of three ``metaq-broker`` members (``minInSyncReplicas=2``,
``zk.sessionTimeout`` 4 s, ``replicaLagMaxMs`` 3 s, group commit). Each member runs on an address of its
own in a network namespace when the machine allows it (root, ``ip``, ``nft``:
``metaq_broker.devtools.netns``), else on loopback (``--loopback`` forces that; link cuts are then left
out and the output says so). Topic ``nem`` (2 partitions) carries most of the traffic; topic ``nem-ret``
(1 partition, ``retentionBytes`` 128 KiB, segments of 32 KiB, retention every second) has a slow producer
whose bursts in the ``retention`` fault move its earliest offset.

**The clients** (``nemesis_load.py``): two plain producers at ``acks=all``, one at ``acks=1``, an
idempotent producer when ``Producer`` takes ``idempotent=`` (the output says whether it does), a
transactional writer (``Producer.transaction``: a batch per partition, prepare, commit), a producer on
``nem-ret``, and a reader per topic that records every message it was shown. Every message's value is
its identity ``<writer>|<seq>|<attempt>|``.

**The faults**, one at a time, each followed by recovery (every member running, a master, all three in
sync, an ``acks=all`` put acknowledged) and a checkpoint of the checker: ``kill-master`` and
``kill-replica`` (kill -9, restarted after a while), ``pause-*-short`` and ``pause-*-long`` (SIGSTOP for
less than the session timeout, and past it), ``zk-restart`` (down for a while), ``zk-data-loss``
(ZooKeeper stopped, its data directory wiped, started: in a quarter of the runs while every member and
client runs on, whose sessions the emptied ZooKeeper refuses, since they saw later transactions, until
they give them up after a session timeout and start new ones; in a quarter with every member killed
meanwhile and started again after it, and the clients replaced; in half the same with a replica down
and lagging first, and started first), ``wipe-member`` (kill -9, data directory removed, restarted),
``retention`` (a replica down until the master's earliest offset of ``nem-ret`` passed its log end), and
with namespaces
``cut-master-replicas``, ``cut-master-zk``, ``cut-client-master``, ``cut-replica-master``,
``cut-replica-zk`` (packets dropped both ways, then healed). The seed fixes the order, durations and
targets (targets by role: "the master", "the first/second replica"); timing is the machine's own.

**The checks** (``nemesis_check.py``): 0 acknowledged messages lost (``acks=all``, idempotent; ``acks=1``
losses are counted apart), 0 duplicates from the idempotent producer and from transactions (a plain
producer's duplicates are counted and must each follow a "may or may not be stored" error), 0 messages a
reader was shown that later vanished or changed, transactions all or nothing, members' logs identical up
to the high watermark (their segment bytes compared once they are stopped), every member process alive
unless the nemesis killed it, and after each fault no stretch without an ``acks=all`` acknowledgement
longer than ``zk.sessionTimeout`` + 2 s (counted from the fault's start when the group must survive it
alone, from its end when no member can serve meanwhile: a short pause of the master, ZooKeeper down or
emptied, the master cut from its replicas, the client cut from the master; when ZooKeeper lost its data
under running processes, each must first give its refused session up, after a session timeout of
refusals and a reconnect backoff, the clients' sessions being ``CLIENT_SESSION_S``: that is added to the
bound, see ``Harness.bound``). A fault the group has not
recovered from within ``--recover-s`` is a violation; then the harness repairs as an operator would (a
member out of sync wiped, a group without master restarted) and goes on, or stops the schedule if that
fails too. The output is a line per fault, a table per fault kind, the violations (counted by cause,
with examples) with the member log lines around them, and a final verdict; the exit code is 0 for PASS,
1 for violations, 2 when the harness itself could not run.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.nemesis_check import Checker, Violation, compare_member_logs, summarize  # noqa: E402
from benchmarks.nemesis_load import (ACKS_ALL, ACKS_ONE, IDEMPOTENT, PAD, History, Observer, Reader,  # noqa: E402
                                     TxnWriter, Writer, idempotence_available)
from benchmarks.nemesis_load import recover as recover_transactions  # noqa: E402
from metaq_broker.client.admin import Admin  # noqa: E402
from metaq_broker.client.consumer import Consumer  # noqa: E402
from metaq_broker.client.producer import Producer  # noqa: E402
from metaq_broker.devtools import netns  # noqa: E402
from metaq_broker.devtools.group import BrokerGroup  # noqa: E402
from metaq_broker.devtools.process import freeze  # noqa: E402
from metaq_broker.devtools.zookeeper import LocalZooKeeper  # noqa: E402
from metaq_broker.server.member_role import BOOTSTRAP_GRACE_S  # noqa: E402

TOPIC, RET_TOPIC = "nem", "nem-ret"
TOPICS = {TOPIC: {"numPartitions": 2},
          RET_TOPIC: {"numPartitions": 1, "retentionBytes": 128 << 10, "maxSegmentSize": 32 << 10}}
LAG_MS = 3000
CLIENT_SESSION_S = 10.0  # the clients' ZooKeeper session timeout (ClusterView: zk.session.new_client's default)
RECONNECT_BACKOFF_S = 2.0  # kazoo's longest wait between reconnect attempts (zk.session.new_client)
RET_PACE = 2.0  # seconds between puts to nem-ret: its earliest offset moves in the retention fault's bursts only
# kind -> (resume counted from "start" or "end" of the fault, duration range in session timeouts, needs namespaces)
FAULTS = {
    "kill-master": ("start", (0.5, 2.0), False),
    "kill-replica": ("start", (0.5, 2.0), False),
    "pause-master-short": ("end", (0.2, 0.6), False),
    "pause-master-long": ("start", (1.5, 2.5), False),
    "pause-replica-short": ("start", (0.2, 0.6), False),
    "pause-replica-long": ("start", (1.5, 2.5), False),
    "zk-restart": ("end", (0.2, 1.5), False),
    "zk-data-loss": ("end", (0.0, 0.0), False),
    "wipe-member": ("start", (0.5, 1.5), False),
    "retention": ("start", (0.0, 0.0), False),
    "cut-master-replicas": ("end", (1.0, 2.0), True),
    "cut-master-zk": ("start", (1.5, 2.5), True),
    "cut-client-master": ("end", (0.5, 2.0), True),
    "cut-replica-master": ("start", (1.0, 2.0), True),
    "cut-replica-zk": ("start", (1.0, 2.5), True),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class FaultSpec:
    kind: str
    duration: float  # seconds (the kind's range times the session timeout)
    target: int  # which replica (0 or 1, by replicaId order) where the kind picks one; for wipe-member 0 = master
    variant: bool  # zk-data-loss: a lagging replica first (else: target 0 every member killed, 1 all running)
    gap: float  # quiet seconds before the fault

    @property
    def running(self) -> bool:
        """zk-data-loss while every member and client runs on."""
        return self.kind == "zk-data-loss" and not self.variant and self.target == 1

    def describe(self) -> str:
        extra = {"wipe-member": f", {'master' if self.target == 0 else 'a replica'}",
                 "zk-data-loss": ", a replica lagging" if self.variant else
                 ", all running" if self.running else ""}.get(self.kind, "")
        return f"{self.kind} ({self.duration:.1f} s{extra})"


@dataclass
class FaultEvent:
    index: int
    spec: FaultSpec
    detail: str = ""
    started: float = 0.0  # time.monotonic()
    ended: float = 0.0
    started_wall: float = 0.0
    recovered: Optional[float] = None
    resumed: Optional[float] = None  # the longest stretch without an acks=all acknowledgement (Harness.resumed)
    master_before: Optional[int] = None
    master_after: Optional[int] = None
    epochs: tuple = ()
    violations: list = field(default_factory=list)


def schedule(seed: int, kinds: list, session_s: float, count: int = 1000) -> list:
    """The seeded fault schedule: rounds in which every kind comes once, in a shuffled order."""
    rng = random.Random(seed)
    out: list = []
    while len(out) < count:
        order = list(kinds)
        rng.shuffle(order)
        for kind in order:
            lo, hi = FAULTS[kind][1]
            out.append(FaultSpec(kind, round(rng.uniform(lo, hi) * session_s, 2), rng.randrange(2),
                                 rng.random() < 0.5, round(rng.uniform(0.5, 2.0), 2)))
    return out[:count]


def settled(group: BrokerGroup, consumer: Consumer, admin: Admin, topics: list) -> tuple:
    """(high watermarks {(topic, n): offset}, "") once no transaction is prepared or open and the master
    says every member is in sync with nothing to copy (``DescribeGroup``: lag 0, from where each
    replica's last fetch said its log ends); else (None, what is missing)."""
    try:
        prepared = admin.prepared_transactions(group.broker_id)
        rows = [r for r in admin.brokers() if r["brokerId"] == group.broker_id]
        behind = [f"member {r['replicaId']} is {r['role']}, in sync {r['inSync']}, {r['lagMessages']} behind"
                  + (f" ({r['error']})" if r["error"] else "") for r in rows
                  if r["role"] not in ("master", "replica") or not r["inSync"] or r["lagMessages"] != 0]
        if len(rows) != len(group.members):
            behind.append(f"the master describes {len(rows)} members")
        hw = {}
        for topic in topics:
            for p, (_, lso, leo) in consumer.offset_bounds(topic).items():
                hw[(topic, int(p.split("-")[1]))] = lso
                if lso != leo:
                    behind.append(f"{topic} {p}: last stable offset {lso}, log end {leo}")
        if prepared or behind:
            return None, f"{len(prepared)} prepared transactions; " + "; ".join(behind)
        return hw, ""
    except Exception as e:  # noqa: BLE001 - a member or ZooKeeper not answering yet
        return None, f"{type(e).__name__}: {e}"


class GroupView:
    """The group's state and master node read with timeouts (``BrokerGroup``'s reads wait forever while
    ZooKeeper is away), through a session that ``reset`` replaces: after ZooKeeper lost its data it
    refuses every session that saw a later transaction (kazoo retries such a session forever)."""

    def __init__(self, connect: str, paths, broker_id: int):
        self.connect, self.paths, self.broker_id = connect, paths, broker_id
        self._zk: Optional[KazooClient] = None
        self._lock = threading.Lock()  # the harness and the Observer both read

    def _client(self) -> KazooClient:
        with self._lock:
            if self._zk is None:
                zk = KazooClient(hosts=self.connect, timeout=5.0)
                zk.start(timeout=10)
                self._zk = zk
            return self._zk

    def _get(self, path: str):
        try:
            return self._client().get_async(path).get(timeout=3)[0]
        except NoNodeError:
            return None

    def state(self) -> Optional[dict]:
        data = self._get(self.paths.group_state(self.broker_id))
        return None if data is None else json.loads(data)

    def master_id(self) -> Optional[int]:
        data = self._get(self.paths.broker(self.broker_id))
        return None if data is None else int(json.loads(data).get("replicaId", 0))

    def sample(self) -> Optional[tuple]:
        """(epoch, master, in-sync replicaIds) or None (the Observer's sample)."""
        state = self.state()
        return None if state is None else (state["epoch"], self.master_id(), tuple(r for r, _ in state["isr"]))

    def reset(self) -> None:
        with self._lock:
            zk, self._zk = self._zk, None
        if zk is not None:
            try:
                zk.stop()
                zk.close()
            except Exception:  # noqa: BLE001 - a session that can never come back
                pass


class Harness:
    def __init__(self, args, workdir: Path):
        self.args, self.workdir = args, workdir
        self.session_s = args.session_timeout_ms / 1000
        self.bound_s = self.session_s + 2.0
        self.history = History()
        self.events: list = []
        self.violations: list = []  # Violation found by the harness itself (the checker keeps its own)
        self.zk: Optional[LocalZooKeeper] = None
        self.network: Optional[netns.Network] = None
        self.group: Optional[BrokerGroup] = None
        self.clients: list = []
        self.observer: Optional[Observer] = None
        self.checker: Optional[Checker] = None
        self.reader_consumer: Optional[Consumer] = None
        self.down: set = set()  # members the nemesis keeps down on purpose

    # -- setting up ---------------------------------------------------------------------------------
    def start(self) -> None:
        a = self.args
        why = "--loopback" if a.loopback else netns.unavailable()
        if why is None:
            netns.sweep()
            self.network = netns.Network()
        log(f"members: {'network namespaces ' + self.network.bridge if self.network else 'loopback'}; "
            f"link cuts: {'on' if self.network else 'off (' + why + ')'}")
        self.zk = LocalZooKeeper(data_dir=self.workdir / "zookeeper", tick_time_ms=500).start()
        zk_host = self.network.zookeeper.address if self.network else "127.0.0.1"
        self.zk_connect = f"{zk_host}:{self.zk.port}"
        settings = {"zk.sessionTimeout": a.session_timeout_ms, "replicaLagMaxMs": LAG_MS, "minInSyncReplicas": 2,
                    "retentionCheckInterval": 1, "transactionTimeout": 10_000}
        make = netns.group_in_namespaces if self.network else (lambda _net, *args, **kw: BrokerGroup(*args, **kw))
        self.group = make(self.network, self.workdir / "group", 1, self.zk_connect, "/nemesis", members=3,
                          settings=settings, topics=TOPICS)
        self.group.start()
        self.group.wait_master(timeout=60)
        self.group.wait_in_sync(range(3), timeout=60)
        self.view = GroupView(self.zk_connect, self.group.paths, self.group.broker_id)
        if idempotence_available():
            log("idempotent producers: yes (Producer takes idempotent=True): writer idem-0")
        else:
            log("idempotent producers: NOT AVAILABLE in this tree (Producer has no 'idempotent' parameter): "
                "not exercised, and 0 idempotent duplicates means nothing yet")
        self.checker = Checker(self.history, [TOPIC, RET_TOPIC])
        self.observer = Observer(self.view.sample)
        self.observer.start()
        self.start_clients()
        deadline = time.monotonic() + 60
        while len(self.history.acks_all_times()) < 20:
            if time.monotonic() > deadline:
                raise RuntimeError("no acks=all put acknowledged within 60 s of the start")
            time.sleep(0.1)

    def start_clients(self) -> None:
        """The writers and readers (again after ZooKeeper lost its data: the old ones' sessions are refused
        for good, so new clients take over under new names: ``all-0`` becomes ``all-0.1``)."""
        a, h = self.args, self.history
        self.generation = getattr(self, "generation", -1) + 1
        suffix = "" if self.generation == 0 else f".{self.generation}"
        client = self.client_settings = {"zk_connect": self.zk_connect, "zk_root": "/nemesis"}
        timeout = 2 * self.session_s + 2
        self.clients = [Writer("all-0" + suffix, ACKS_ALL, h, TOPIC, client, a.seed, timeout),
                        Writer("all-1" + suffix, ACKS_ALL, h, TOPIC, client, a.seed, timeout),
                        Writer("one-0" + suffix, ACKS_ONE, h, TOPIC, client, a.seed, timeout),
                        TxnWriter("txn-0" + suffix, h, TOPIC, client, a.seed, timeout),
                        Writer("ret-0" + suffix, ACKS_ALL, h, RET_TOPIC, client, a.seed, timeout, pace=RET_PACE),
                        Reader("read-nem" + suffix, h, TOPIC, client, timeout),
                        Reader("read-ret" + suffix, h, RET_TOPIC, client, timeout)]
        if idempotence_available():
            self.clients.append(Writer("idem-0" + suffix, IDEMPOTENT, h, TOPIC, client, a.seed, timeout))
        self.reader_consumer = Consumer(**client, timeout=timeout)
        self.admin = Admin(**client, timeout=timeout)
        for c in self.clients:
            c.start()

    def stop_clients(self) -> None:
        """Stop the writers and readers (each ends within its producer's timeout) and the checker's clients."""
        for c in self.clients:
            c.stop()
        for c in self.clients:
            c.join(timeout=4 * self.session_s + 10)
            if c.crash:
                self._violate("clients", "harness", f"client {c.name} crashed:\n{c.crash}")
        for closeable in (self.reader_consumer, self.admin):
            try:
                closeable.close()
            except Exception:  # noqa: BLE001 - a client whose ZooKeeper session can never come back
                pass

    # -- roles --------------------------------------------------------------------------------------
    def master(self) -> int:
        m = self.view.master_id()
        if m is None:
            raise RuntimeError(f"no master before a fault; state {self.view.state()}")
        return m

    def replica(self, which: int) -> int:
        master = self.master()
        return [r for r in range(len(self.group.members)) if r != master][which % 2]

    def host(self, r: int) -> str:
        return self.group.members[r].host.name

    def signal(self, r: int, sig) -> None:
        """SIGSTOP returns once the member has stopped (``freeze``): the pause starts when it says."""
        pid = self.group.members[r].proc.pid
        if sig == signal.SIGSTOP:
            freeze(pid)
        else:
            os.kill(pid, sig)

    def restart(self, r: int) -> None:
        self.down.discard(r)
        self.group.members[r].start(timeout=60)

    # -- the faults ---------------------------------------------------------------------------------
    def inject(self, ev: FaultEvent) -> None:
        s, g = ev.spec, self.group
        kind = s.kind
        ev.master_before = self.master()
        ev.started, ev.started_wall = time.monotonic(), time.time()
        if kind in ("kill-master", "kill-replica"):
            r = ev.master_before if kind == "kill-master" else self.replica(s.target)
            ev.detail = f"member {r}"
            g.members[r].kill()
            self.down.add(r)
            ev.started = ev.ended = time.monotonic()
            time.sleep(s.duration)
            self.restart(r)
        elif kind.startswith("pause-"):
            r = ev.master_before if kind.startswith("pause-master") else self.replica(s.target)
            ev.detail = f"member {r}"
            self.signal(r, signal.SIGSTOP)
            ev.started = time.monotonic()
            time.sleep(s.duration)
            self.signal(r, signal.SIGCONT)
            ev.ended = time.monotonic()
        elif kind == "zk-restart":
            ev.detail = "ZooKeeper stopped and started"
            self.zk.restart(down_for=s.duration)
            ev.ended = time.monotonic()
        elif kind == "zk-data-loss" and s.running:
            ev.detail = "ZooKeeper's data wiped while every member and client ran"
            self.zk.stop()
            shutil.rmtree(self.zk.data_dir / "data", ignore_errors=True)
            self.zk.start()
            self.view.reset()
            ev.ended = time.monotonic()
        elif kind == "zk-data-loss":
            ev.detail = "ZooKeeper's data wiped, every member killed meanwhile"
            lagging = None
            if s.variant:
                lagging = self.replica(s.target)
                ev.detail += f", member {lagging} down and lagging first, then started first"
                g.members[lagging].kill()
                self.down.add(lagging)
                time.sleep(LAG_MS / 1000 + 2.0)  # out of the in-sync set, and behind by 2 s of writes
            self.stop_clients()
            for r, m in enumerate(g.members):
                m.kill()
                self.down.add(r)
            self.zk.stop()
            shutil.rmtree(self.zk.data_dir / "data", ignore_errors=True)
            self.zk.start()
            self.view.reset()
            order = ([lagging] if lagging is not None else []) + [r for r in range(3) if r != lagging]
            for i, r in enumerate(order):
                self.restart(r)
                if i == 0 and lagging is not None:
                    time.sleep(BOOTSTRAP_GRACE_S + 1)  # alone long enough to stand unless it waits for the others
            ev.ended = time.monotonic()
            self.start_clients()
        elif kind == "wipe-member":
            r = ev.master_before if s.target == 0 else self.replica(1)
            ev.detail = f"member {r}"
            g.members[r].kill()
            self.down.add(r)
            ev.started = ev.ended = time.monotonic()
            shutil.rmtree(g.members[r].workdir / "data")
            time.sleep(s.duration)
            self.restart(r)
        elif kind == "retention":
            r = self.replica(s.target)
            end = self.reader_consumer.offset_bounds(RET_TOPIC)["1-0"][2]  # the master's log end: the replica's is below
            g.members[r].kill()
            self.down.add(r)
            ev.started = ev.ended = time.monotonic()
            deadline = time.monotonic() + 60
            earliest = 0
            writer = next(c for c in self.clients if c.name.startswith("nemesis-ret-0"))
            writer.pace, writer.batch_max, writer.pad = 0.0, 40, b"r" * 1000  # a burst: retention passes the replica
            while time.monotonic() < deadline:
                try:
                    earliest = self.reader_consumer.offsets(RET_TOPIC)["1-0"][0]
                except Exception:  # noqa: BLE001 - a slow answer: ask again
                    pass
                if earliest > end:
                    break
                time.sleep(0.2)
            writer.pace, writer.batch_max, writer.pad = RET_PACE, 5, PAD
            ev.detail = f"member {r} down when the master's log ended at {end}; its earliest offset {earliest} when restarted"
            self.restart(r)
        elif kind.startswith("cut-"):
            master = ev.master_before
            replica = self.replica(s.target)
            pairs = {"cut-master-replicas": [(self.host(master), self.host(r)) for r in range(3) if r != master],
                     "cut-master-zk": [(self.host(master), netns.ZOOKEEPER)],
                     "cut-client-master": [(netns.CLIENT, self.host(master))],
                     "cut-replica-master": [(self.host(replica), self.host(master))],
                     "cut-replica-zk": [(self.host(replica), netns.ZOOKEEPER)]}[kind]
            ev.detail = ", ".join(f"{a}-{b}" for a, b in pairs)
            for a, b in pairs:
                self.network.cut(a, b)
            ev.started = time.monotonic()
            time.sleep(s.duration)
            self.network.heal_all()
            ev.ended = time.monotonic()
        else:
            raise ValueError(f"unknown fault {kind!r}")

    # -- recovery -----------------------------------------------------------------------------------
    def _violate(self, where: str, kind: str, detail: str) -> None:
        self.violations.append(Violation(kind, where, detail))
        log(f"VIOLATION [{where}] {kind}: {detail}")

    def check_processes(self, where: str) -> None:
        """A member that exited although the nemesis did not kill it is a violation; it is started again."""
        for r, m in enumerate(self.group.members):
            if r in self.down or m.proc is None or m.proc.poll() is None:
                continue
            self._violate(where, "crashed", f"member {r} exited on its own with code {m.proc.returncode}:\n"
                          f"{m.log_tail(15)}")
            try:
                self.restart(r)
            except Exception as e:  # noqa: BLE001 - reported; recovery then fails too
                self._violate(where, "crashed", f"member {r} did not start again: {e}")

    def healthy(self) -> Optional[str]:
        """None when every member runs, one is master and all are in sync; else what is missing."""
        state, master = self.view.state(), self.view.master_id()
        if master is None:
            return f"no master (state {state})"
        isr = {r for r, _ in state["isr"]} if state else set()
        if isr != {0, 1, 2}:
            return f"in-sync set {sorted(isr)} (master {master}, epoch {state and state['epoch']})"
        return None

    def recover(self, ev: Optional[FaultEvent], where: str, timeout: Optional[float] = None) -> bool:
        """Wait (at most ``--recover-s``) until the group is whole and, after a fault, an acks=all put
        sent since it began was acknowledged after its reference point."""
        for r in range(len(self.group.members)):
            if self.group.members[r].proc is not None and self.group.members[r].proc.poll() is None:
                self.signal(r, signal.SIGCONT)
        if self.network:
            self.network.heal_all()
        timeout = self.args.recover_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        missing = "?"
        while time.monotonic() < deadline:
            self.check_processes(where)
            if ev is not None and ev.resumed is None:
                ev.resumed = self.resumed(ev)
            try:
                missing = self.healthy()
            except Exception as e:  # noqa: BLE001 - ZooKeeper restarting
                missing = f"ZooKeeper: {e}"
            if missing is None and ev is not None and ev.resumed is None:
                missing = "no acks=all put acknowledged since the fault"
            if missing is None:
                if ev is not None:
                    ev.recovered = time.monotonic()
                return True
            time.sleep(0.2)
        self._violate(where, "unrecovered", f"the group did not recover within {timeout:.0f} s: {missing}")
        return False

    def repair(self, where: str) -> bool:
        """What an operator would do after a fault the group did not recover from, so that the schedule
        can go on (the violation is already recorded): a member out of the in-sync set is wiped and
        started again (it copies everything); a group without master has every member restarted."""
        try:
            state, master = self.view.state(), self.view.master_id()
        except Exception:  # noqa: BLE001
            state, master = None, None
        if master is None:
            log(f"repair after {where}: no master: every member killed and started again")
            for r, m in enumerate(self.group.members):
                m.kill()
            for r in range(len(self.group.members)):
                self.restart(r)
        else:
            isr = {r for r, _ in state["isr"]} if state else set()
            for r in sorted(set(range(len(self.group.members))) - isr):
                log(f"repair after {where}: member {r} is out of the in-sync set: wiped and started again")
                self.group.members[r].kill()
                shutil.rmtree(self.group.members[r].workdir / "data", ignore_errors=True)
                self.restart(r)
        return self.recover(None, where + " (after repair)")

    def bound(self, ev: FaultEvent) -> float:
        """The longest stretch without an acks=all acknowledgement ``ev`` may cause: zk.sessionTimeout + 2 s,
        and when ZooKeeper lost its data under running processes, also the time a process needs to give
        up its refused session (its session timeout of refusals, ``zk.session``, then a reconnect backoff),
        a client's being the longer one."""
        return self.bound_s + (CLIENT_SESSION_S + RECONNECT_BACKOFF_S if ev.spec.running else 0.0)

    def resumed(self, ev: FaultEvent) -> Optional[float]:
        """The longest stretch without an acks=all acknowledgement from the fault's reference point (its
        start or its end) to the first acknowledgement, once the fault is over, of a put sent since it
        began; None until there is one. A master that serves on for a while (its lease) and then stops is
        measured from its last acknowledgement to the next: the stretch runs to the fault's end, not to the
        first acknowledgement after its start, which such a master still gives."""
        ref = ev.started if FAULTS[ev.spec.kind][0] == "start" else ev.ended
        acks = self.history.acks_all_times(since=ref)
        fresh = [done for sent, done in acks if sent >= ev.started and done >= max(ref, ev.ended)]
        if not fresh:
            return None
        until = min(fresh)
        points = [ref] + sorted(done for _, done in acks if ref <= done <= until)
        return max(b - a for a, b in zip(points, points[1:]))

    # -- the run ------------------------------------------------------------------------------------
    def run(self, budget_s: float, kinds: list) -> None:
        plan = schedule(self.args.seed, kinds, self.session_s)
        log(f"schedule of seed {self.args.seed} (first 12): " + "; ".join(s.describe() for s in plan[:12]))
        begin = time.monotonic()
        for i, spec in enumerate(plan):
            if time.monotonic() - begin + spec.gap + spec.duration + 10 > budget_s:
                break
            time.sleep(spec.gap)
            ev = FaultEvent(i + 1, spec)
            self.events.append(ev)
            where = f"fault {ev.index} {spec.kind}"
            epoch_before = (self.view.state() or {}).get("epoch")
            try:
                self.inject(ev)
            except Exception as e:  # noqa: BLE001 - a fault that could not be applied is reported as such
                self._violate(where, "harness", f"could not inject: {e}\n{traceback.format_exc(limit=3)}")
            ok = self.recover(ev, where)
            try:
                ev.master_after = self.view.master_id()
                ev.epochs = (epoch_before, (self.view.state() or {}).get("epoch"))
            except Exception:  # noqa: BLE001
                pass
            if not ok:
                ok = self.repair(where)
            found = self.checkpoint(where) if ok else []
            ev.violations = [v for v in self.violations if v.where.startswith(where)] + found
            self.report_event(ev)
            if not ok:
                log("stopping the schedule: the group did not recover, not even after a repair")
                break

    def checkpoint(self, where: str) -> list:
        try:
            found = self.checker.checkpoint(self.reader_consumer, where)
        except Exception as e:  # noqa: BLE001 - the check could not read: that is a finding too
            self._violate(where, "unreadable", f"the checker could not read the log: {type(e).__name__}: {e}")
            return []
        for line in summarize(found):
            log(f"VIOLATION {line}")
        return found

    def report_event(self, ev: FaultEvent) -> None:
        resumed = ("never" if ev.resumed is None else
                   f"after a pause of {ev.resumed:.1f} s (counted from its {FAULTS[ev.spec.kind][0]})")
        over = "" if ev.resumed is None or ev.resumed <= self.bound(ev) else f" OVER the {self.bound(ev):.1f} s bound"
        recovered = "no" if ev.recovered is None else f"{ev.recovered - ev.started:.1f} s"
        before = ev.epochs[0] if ev.epochs else None
        sample = None if before is None else self.observer.first_after(ev.started, lambda s: s[1] > before)
        elected = "" if sample is None else f" (elected {sample[0] - ev.started:.1f} s after the fault began)"
        log(f"fault {ev.index} {ev.spec.describe()} {ev.detail}: master {ev.master_before} -> {ev.master_after}, "
            f"epoch {ev.epochs[0] if ev.epochs else '?'} -> {ev.epochs[1] if ev.epochs else '?'}{elected}; acks=all "
            f"resumed {resumed}{over}; recovered in {recovered}; violations {len(ev.violations)}")

    def finish(self) -> dict:
        """Stop the clients, let the group settle, run the final checks, stop the members, compare logs."""
        for c in self.clients:
            if isinstance(c, (Writer, TxnWriter)):
                c.stop()
        for c in self.clients:
            if isinstance(c, (Writer, TxnWriter)):
                c.join(timeout=4 * self.session_s + 10)
                if c.is_alive():
                    self._violate("final", "stuck", f"client {c.name} did not stop within {4 * self.session_s + 10:.0f} s")
        last = self.events[-1] if self.events else None
        if last is None or last.recovered is not None:  # else recovery and repair have just failed: not again
            if not self.recover(None, "final"):
                self.repair("final")
        with Producer(**self.client_settings, timeout=2 * self.session_s + 2, idempotent=False) as producer:
            due = recover_transactions(producer, self.history)  # what the stopped writers decided, unanswered
        if due:
            log(f"{due} decided transactions could not be settled (their brokers did not answer)")
        hw = self.quiesce()
        for c in self.clients:
            c.stop()
        for c in self.clients:
            c.join(timeout=30)
            if c.crash:
                self._violate("final", "harness", f"client {c.name} crashed:\n{c.crash}")
        self.observer.stop()
        try:
            found = self.checker.final(self.reader_consumer)
            for line in summarize(found):
                log(f"VIOLATION {line}")
        except Exception as e:  # noqa: BLE001
            self._violate("final", "unreadable", f"the final read failed: {type(e).__name__}: {e}")
        logs_identical = None
        if hw is not None:
            master = self.view.master_id()
            order = [r for r in range(3) if r != master] + ([master] if master is not None else [])
            for r in order:  # replicas first: a stopping master hands over to whoever is still there
                self.group.members[r].stop()
            partitions = [(t, n) for t, keys in TOPICS.items() for n in range(keys["numPartitions"])]
            problems = compare_member_logs({r: m.workdir / "data" for r, m in enumerate(self.group.members)},
                                           partitions, hw)
            for p in problems:
                self._violate("final", "diverged", p)
            logs_identical = not problems
        return {"logs_identical": logs_identical, "high_watermarks": {f"{t}-{n}": v for (t, n), v in (hw or {}).items()}}

    def quiesce(self) -> Optional[dict]:
        """Wait until the group settled (``settled``); returns the high watermarks (None, and a violation,
        if it never does)."""
        deadline = time.monotonic() + self.args.recover_s
        why = "?"
        while time.monotonic() < deadline:
            hw, why = settled(self.group, self.reader_consumer, self.admin, list(TOPICS))
            if hw is not None:
                return hw
            time.sleep(0.5)
        self._violate("final", "unsettled", f"the group did not settle within {self.args.recover_s:.0f} s: {why}")
        return None

    def member_lines(self, ev: FaultEvent, limit: int = 12) -> list:
        """The member log lines worth reading around a fault: warnings, errors, elections, truncations."""
        start = ev.started_wall - 1
        end = start + (ev.recovered - ev.started if ev.recovered else 2 * self.args.recover_s) + 3
        pattern = re.compile(r"WARNING|ERROR|master of epoch|stops being master|truncat|reset|diverg|took over")
        out = []
        for r, m in enumerate(self.group.members):
            lines: list = []  # [message, first line, repeats]
            try:
                text = m.log_path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for line in text:
                try:
                    t = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
                except ValueError:
                    continue
                if start - 1 <= t <= end and pattern.search(line):
                    if lines and lines[-1][0] == line[24:]:
                        lines[-1][2] += 1  # the same message again: counted, not repeated
                    else:
                        lines.append([line[24:], line, 1])
            out += [f"  member {r}: {first[:400]}" + (f" (and {n - 1} more times)" if n > 1 else "")
                    for _, first, n in lines[-limit:]]
        return out

    def stop(self) -> None:
        for c in self.clients:
            c.stop()
        if self.observer:
            self.observer.stop()
        if getattr(self, "view", None):
            self.view.reset()
        for closeable in (self.reader_consumer, getattr(self, "admin", None)):
            if closeable is not None:
                try:
                    closeable.close()
                except Exception:  # noqa: BLE001
                    pass
        if self.group:
            for m in self.group.members:
                if m.proc is not None and m.proc.poll() is None:
                    os.kill(m.proc.pid, signal.SIGCONT)
            self.group.stop()
        if self.zk:
            self.zk.stop()
        if self.network:
            self.network.close()


def report(h: Harness, final: dict, elapsed: float) -> tuple:
    """The table per fault kind, the totals and the verdict line; returns (text, violations)."""
    lines = []
    kinds = sorted({ev.spec.kind for ev in h.events})
    lines.append(f"{'fault':22} {'runs':>4} {'max pause s':>12} {'over bound':>10} {'unrecovered':>11} "
                 f"{'violations':>10}")
    for k in kinds:
        evs = [ev for ev in h.events if ev.spec.kind == k]
        resumes = [ev.resumed for ev in evs if ev.resumed is not None]
        over = sum(1 for ev in evs if ev.resumed is not None and ev.resumed > h.bound(ev))
        lines.append(f"{k:22} {len(evs):>4} {max(resumes) if resumes else float('nan'):>12.1f} {over:>10} "
                     f"{sum(1 for ev in evs if ev.recovered is None):>11} "
                     f"{sum(len(ev.violations) for ev in evs):>10}")
    c = h.checker.counts if h.checker else {}
    lines.append("")
    lines.append("counts: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    slow = [ev for ev in h.events if ev.resumed is not None and ev.resumed > h.bound(ev)]
    for ev in slow:
        h.violations.append(Violation("slow", f"fault {ev.index} {ev.spec.kind}",
                             f"no acks=all put was acknowledged for {ev.resumed:.1f} s (counted from the fault's "
                             f"{FAULTS[ev.spec.kind][0]}), over its bound of {h.bound(ev):.1f} s"))
    violations = list(h.violations) + list(h.checker.violations if h.checker else [])
    by_kind: dict = {}
    for v in violations:
        by_kind[v.kind] = by_kind.get(v.kind, 0) + 1
    lines.append(f"members' logs identical up to the high watermark: "
                 f"{ {True: 'yes', False: 'NO', None: 'not compared'}[final.get('logs_identical')] }")
    lines.append(f"faults: {len(h.events)} in {elapsed / 60:.1f} min; seed {h.args.seed}")
    lost, dup, van = by_kind.get("lost", 0), by_kind.get("duplicate", 0), by_kind.get("vanished", 0)
    if violations:
        others = ", ".join(f"{n} {k}" for k, n in sorted(by_kind.items()) if k not in ("lost", "duplicate", "vanished"))
        verdict = (f"VERDICT: FAIL: {lost} lost, {dup} duplicated, {van} vanished" + (f", {others}" if others else "")
                   + f" (seed {h.args.seed})")
    else:
        longer = sorted({h.bound(ev) for ev in h.events} - {h.bound_s})
        verdict = (f"VERDICT: PASS: 0 lost, 0 duplicated, 0 vanished, logs identical, acks=all writes resumed "
                   f"within {h.bound_s:.1f} s of every fault" + "".join(
                       f" ({b:.1f} s of ZooKeeper losing its data under running processes)" for b in longer)
                   + f" (seed {h.args.seed}, {len(h.events)} faults)")
    lines.append(verdict)
    return "\n".join(lines), violations


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kazoo").setLevel(logging.CRITICAL)  # its reconnection chatter while ZooKeeper is down
    logging.getLogger("metaq_broker.store").setLevel(logging.ERROR)  # opening stopped members' logs to compare them
    ap = argparse.ArgumentParser(prog="python -m benchmarks.nemesis", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=None, help="length of the fault schedule (default 30)")
    ap.add_argument("--seconds", type=float, default=None, help="the same in seconds (short runs, CI)")
    ap.add_argument("--seed", type=int, default=None, help="fixes the schedule (default: random, printed)")
    ap.add_argument("--faults", default="", help=f"comma-separated kinds to use (default all): {', '.join(FAULTS)}")
    ap.add_argument("--loopback", action="store_true", help="members on loopback, no namespaces and no link cuts")
    ap.add_argument("--session-timeout-ms", type=int, default=4000)
    ap.add_argument("--recover-s", type=float, default=60.0,
                    help="a fault the group has not recovered from within this is a violation (then repaired)")
    ap.add_argument("--dir", default=None, help="where the run's directory is made (default: the temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the run's directory (it is kept anyway on FAIL)")
    ap.add_argument("--json", default=None, help="write the events and violations as JSON to this path")
    args = ap.parse_args(argv)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 10 ** 6)
    budget = args.seconds if args.seconds is not None else 60 * (args.minutes if args.minutes is not None else 30)
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()] or list(FAULTS)
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown:
        ap.error(f"unknown fault kinds {unknown}; known: {', '.join(FAULTS)}")
    parent = Path(args.dir or tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"metaq-nemesis-{args.seed}-", dir=parent))
    h = Harness(args, workdir)

    def terminated(signum, _frame):
        raise SystemExit(128 + signum)  # the finally below stops every process and removes the namespaces

    signal.signal(signal.SIGTERM, terminated)
    log(f"nemesis: seed {args.seed}, schedule of {budget:.0f} s, session timeout {h.session_s:g} s, "
        f"resume bound {h.bound_s:g} s, run directory {workdir}")
    begin = time.monotonic()
    final: dict = {}
    try:
        try:
            h.start()
        except Exception as e:  # noqa: BLE001
            log(f"the harness could not start: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            return 2
        if h.network is None:
            kinds = [k for k in kinds if not FAULTS[k][2]]
        if not kinds:
            log("no fault kinds left to run (link cuts need namespaces)")
            return 2
        h.run(budget, kinds)
        final = h.finish()
    finally:
        h.stop()
    text, violations = report(h, final, time.monotonic() - begin)
    if violations:
        print("\nviolations (where, kind, what the checker saw):", flush=True)
        for line in summarize(violations):
            print(f"- {line}", flush=True)
        print("\nmember log lines around each fault with a violation:", flush=True)
        for ev in h.events:
            if ev.violations:
                print(f"fault {ev.index} {ev.spec.describe()} {ev.detail} (started "
                      f"{time.strftime('%H:%M:%S', time.localtime(ev.started_wall))}):", flush=True)
                print("\n".join(h.member_lines(ev)) or "  (none)", flush=True)
    print("", flush=True)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "seed": args.seed, "budget_s": budget, "bound_s": h.bound_s, "namespaces": h.network is not None,
            "idempotent": idempotence_available(), "events": [
                {**asdict(ev.spec), "index": ev.index, "detail": ev.detail, "resumed_s": ev.resumed,
                 "recovered_s": None if ev.recovered is None else ev.recovered - ev.started,
                 "master_before": ev.master_before, "master_after": ev.master_after,
                 "violations": [asdict(v) for v in ev.violations]} for ev in h.events],
            "counts": dict(h.checker.counts) if h.checker else {}, "final": final,
            "violations": [asdict(v) for v in violations]}, indent=2, default=str))
    if violations or args.keep:
        print(f"run directory kept: {workdir}", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
