"""Replication benchmark: produce throughput of a group of one member against a group of three with
``acks=1`` and ``acks=all``, the replicas' lag under that load, and the time from a master's ``kill -9`` to
the first acknowledged put (and from a frozen master, and from a master whose network link is cut), all
in one run.

    python benchmarks/bench_replication.py [--quick] [--batches N] [--rounds R] [--failovers K]
                                           [--faults "kill -9,SIGSTOP,cut link"] [--session-timeout-ms MS]
                                           [--loopback] [--json PATH] [--dir PATH]

Real processes on loopback: one ``LocalZooKeeper``, a ``BrokerGroup`` of one member and a ``BrokerGroup``
of three (same ``brokerId``, separate ZooKeeper roots), every member with the same settings: topic
``bench`` of 2 partitions, group commit (``unflushThreshold=0``: a put is acknowledged after an fsync
covering it, on every member of the ack set under ``acks=all``), ``replicaLagMaxMs`` 10000 (the default).

* **Throughput.** Each round sends ``--batches`` batches of 10,000 keyed messages of 100 B through
  ``PipelinedSender`` (the Spark sink's sender: one put in flight per partition, so two at once) to the
  one member, then to the three members with ``acks=1``, then with ``acks=all``; the cases take turns so
  load from elsewhere falls on each alike, and the best round of each is reported (the note adds the
  ratios within each round). Baseline: one member.
* **Replica lag.** While a case runs, a sampler reads every member's log end (summed over the partitions:
  the replicas' from ``DescribeTopic``, the master's from ``GetOffsets``, read last so that the lag is never
  understated) every 50 ms: lag in
  messages is the master's end minus the replica's, lag in ms how long ago the master's end passed the
  replica's (interpolated between samples of the master's end). Median, 95th percentile and maximum over
  all samples of both replicas. If the master answers ``DescribeGroup``, its own lag figures are shown too.
  The in-sync set is read from ZooKeeper at each sample: its smallest size says whether ``acks=all``
  really waited for three.
* **Failover.** A producer (``acks=all``) sends batches of 1,000 one after another; the master is hit by
  a fault: ``kill -9`` (SIGKILL), or ``SIGSTOP`` (frozen past its session, resumed once writes go on).
  Measured: fault to a new master in ZooKeeper, and fault to the first put *sent after the fault* that is
  acknowledged (the producer resends while the group has no master; a put that failed is sent again by
  this script), against the bound the group promises, ``zk.sessionTimeout`` + 2 s: a master's ZooKeeper
  session must expire first (``--session-timeout-ms``, stated in the output). ``--failovers`` rounds of
  each fault, the member repaired (restarted, resumed, healed) and back in the in-sync set before the
  next (that rejoin time is shown too). ``cut link`` needs the members on addresses of their own in
  network namespaces (``metaq_broker.devtools.netns``: root, ``ip``, ``nft``): the master's link is cut
  (every packet to and from it dropped: ZooKeeper, its replicas and the client lose it at once, as when its
  cable is pulled), then healed. Where namespaces can be used (not with ``--loopback``), every fault's
  failovers run on a third group of three members in namespaces, so the three faults are measured alike;
  else on the loopback group, and ``cut link`` is left out, saying why. Other faults plug in through
  ``add_fault`` and ``failover_time``.

Everything is stopped and removed at the end. Figures only: nothing is asserted about them.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import grpc
import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (VALUE_SIZE, add_common_options, log, run_facts, scratch_dir,  # noqa: E402
                               teardown, values_array, write_json)
from metaq_broker.client.producer import PipelinedSender, Producer  # noqa: E402
from metaq_broker.devtools import netns, process  # noqa: E402
from metaq_broker.devtools.group import BrokerGroup  # noqa: E402
from metaq_broker.devtools.zookeeper import LocalZooKeeper  # noqa: E402
from metaq_broker.proto import metaq_pb2 as pb  # noqa: E402
from metaq_broker.proto import metaq_pb2_grpc as pb_grpc  # noqa: E402

ROWS = 10_000  # messages per batch in the throughput rounds
BOUND_MARGIN_S = 2.0  # acks=all writes resume within zk.sessionTimeout + this after any single fault
FAILOVER_ROWS = 1_000  # messages per put in the failover phase
TOPIC = "bench"
PARTITIONS = 2
SAMPLE_S = 0.05
CASES = ("1 member", "3 members acks=1", "3 members acks=all")


class LogEnds:
    """Each member's log end summed over the topic's partitions, asked of the member itself; and
    ``DescribeGroup`` on the master where it is implemented."""

    def __init__(self, group: BrokerGroup):
        self.group = group
        self.channels = [grpc.insecure_channel(m.address) for m in group.members]
        self.stubs = [pb_grpc.BrokerStub(c) for c in self.channels]
        self.describe_group = True

    def end(self, replica: int) -> int:
        """A replica's log end: ``DescribeTopic``'s ``latest``, which only a master caps at the high watermark."""
        d = self.stubs[replica].DescribeTopic(pb.TopicRequest(topic=TOPIC), timeout=5)
        return sum(p.latest for p in d.partitions)

    def master_end(self, master: int) -> int:
        """The master's log end (``GetOffsets``' ``log_end_offset``: written, acknowledged or not)."""
        r = self.stubs[master].GetOffsets(pb.GetOffsetsRequest(queries=[
            pb.OffsetQuery(topic=TOPIC, partition=p) for p in range(PARTITIONS)]), timeout=5)
        return sum(o.log_end_offset for o in r.offsets)

    def group_lags(self, master: int):
        """{replicaId: lag in offsets} as the master reports it, or None (not implemented, or no answer)."""
        if not self.describe_group:
            return None
        try:
            r = self.stubs[master].DescribeGroup(pb.DescribeGroupRequest(), timeout=5)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.describe_group = False
            return None
        return {m.replica_id: m.lag_offsets for m in r.members if m.replica_id != r.master}

    def close(self) -> None:
        for c in self.channels:
            c.close()


class LagSampler(threading.Thread):
    """Samples the replicas' lag behind the master every SAMPLE_S seconds until ``stop``."""

    def __init__(self, group: BrokerGroup, ends: LogEnds):
        super().__init__(name="lag-sampler", daemon=True)
        self.group, self.ends = group, ends
        self.master = group.master_id()
        self.replicas = [r for r in range(len(group.members)) if r != self.master]
        self.history: list = []  # (t, master's end)
        self.lag_msgs: list = []
        self.lag_ms: list = []
        self.reported: list = []  # DescribeGroup's lag_offsets
        self.isr_sizes: list = []
        self.errors = 0
        self._halt = threading.Event()

    def start(self) -> None:
        """The master's end before the load: what the first samples' lag in ms is measured from."""
        self.history.append((time.monotonic(), self.ends.master_end(self.master)))
        super().start()

    def run(self) -> None:
        while not self._halt.wait(SAMPLE_S):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a slow answer under load: that sample is skipped
                self.errors += 1

    def sample(self) -> None:
        rends = {r: self.ends.end(r) for r in self.replicas}
        mend, now = self.ends.master_end(self.master), time.monotonic()
        self.history.append((now, mend))
        for e in rends.values():
            self.lag_msgs.append(max(mend - e, 0))
            self.lag_ms.append(self.behind_ms(e, now))
        if self.replicas:
            reported = self.ends.group_lags(self.master)
            if reported:
                self.reported += list(reported.values())
            state = self.group.state()
            if state:
                self.isr_sizes.append(len(state["isr"]))

    def behind_ms(self, end: int, now: float) -> float:
        """How long ago the master's log end passed ``end`` (linear between its samples)."""
        h = self.history
        if end >= h[-1][1]:
            return 0.0
        for (t0, e0), (t1, e1) in zip(reversed(h[:-1]), reversed(h[1:])):
            if e0 <= end:
                return (now - (t0 + (end - e0) / (e1 - e0) * (t1 - t0))) * 1e3
        return (now - h[0][0]) * 1e3  # behind every sample: at least this long

    def stop(self) -> None:
        self._halt.set()
        self.join()


def stats(xs: list) -> dict:
    if not xs:
        return {"samples": 0, "p50": None, "p95": None, "max": None}
    a = np.asarray(xs, dtype=float)
    return {"samples": len(xs), "p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
            "max": float(a.max())}


def lag_text(s: dict, unit: str) -> str:
    return "no lag samples" if not s["samples"] else \
        f"lag p50/p95/max {s['p50']:,.0f}/{s['p95']:,.0f}/{s['max']:,.0f} {unit}"


def wait_routed(producer: Producer, what: str) -> None:
    deadline = time.monotonic() + 60
    while not (producer.data_address(1) and len(producer.partitions(TOPIC)) == PARTITIONS):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: the partitions and data port never showed in ZooKeeper")
        time.sleep(0.05)


def one_round(zk: LocalZooKeeper, group: BrokerGroup, root: str, acks: str, batches: int, values, keys) -> dict:
    with Producer(zk_connect=zk.connect_string, zk_root=root, acks=acks, timeout=60.0) as producer:
        wait_routed(producer, root)
        sender = PipelinedSender(producer)
        sender.send_batch(TOPIC, values, keys)  # connections made, outside the timing
        sender.flush()
        ends = LogEnds(group)
        sampler = LagSampler(group, ends)
        sampler.start()
        try:
            t0 = time.perf_counter()
            for _ in range(batches):
                sender.send_batch(TOPIC, values, keys)
            results = sender.flush()
            seconds = time.perf_counter() - t0
        finally:
            sampler.stop()
            ends.close()
    sent = sum(r.count for r in results)
    if sent != batches * ROWS:
        raise RuntimeError(f"{sent} messages acknowledged, {batches * ROWS} sent")
    return {"seconds": seconds, "msgs_per_s": sent / seconds, "mb_per_s": sent * VALUE_SIZE / 1e6 / seconds,
            "put_ms": seconds / (batches * PARTITIONS) * 1e3, "lag_msgs": sampler.lag_msgs, "lag_ms": sampler.lag_ms,
            "reported_lag": sampler.reported, "isr_sizes": sampler.isr_sizes, "sample_errors": sampler.errors}


class Load(threading.Thread):
    """Puts of FAILOVER_ROWS messages one after another; each put's (start, end, ok), errors kept."""

    def __init__(self, producer: Producer):
        super().__init__(name="failover-load", daemon=True)
        self.producer = producer
        self.values = values_array(0, FAILOVER_ROWS)
        self.puts: list = []
        self.errors: list = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            t0 = time.perf_counter()
            try:
                self.producer.send_batch(TOPIC, self.values)
                self.puts.append((t0, time.perf_counter(), True))
            except Exception as e:  # noqa: BLE001 - the put in flight at the kill, or one the failover outlasted
                self.puts.append((t0, time.perf_counter(), False))
                self.errors.append(f"{type(e).__name__}: {e}"[:200])
                time.sleep(0.05)

    def first_ok_after(self, t: float):
        return next((end for start, end, ok in list(self.puts) if ok and start >= t), None)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=120)


def freeze(member) -> None:
    process.freeze(member.proc.pid)


def thaw(member) -> None:
    os.kill(member.proc.pid, signal.SIGCONT)


# Faults applied to the master: name -> (fault, repair), each a callable taking the master's BrokerProcess.
# The bound after any single fault is zk.sessionTimeout + 2 s (docs/replication.md, "Failover"). A cut
# network link needs the members in network namespaces (devtools/netns.py): main() adds it with
# add_fault(CUT_LINK, *cut_link(network, group)) when it can make them.
FAULTS = {
    "kill -9": (lambda m: m.kill(), lambda m: m.start()),
    "SIGSTOP": (freeze, thaw),
}
CUT_LINK = "cut link"


def add_fault(name: str, fault: Callable, repair: Callable) -> None:
    """Register another fault of the master for ``--faults`` (and ``failover_time``)."""
    FAULTS[name] = (fault, repair)


def cut_link(network: "netns.Network", group: BrokerGroup) -> tuple:
    """(fault, repair) for a member of ``group`` (in ``network``'s namespaces): every packet to and from it
    dropped, from ZooKeeper, the other members and the client alike; then healed."""
    def cut(member) -> None:
        here = member.host.name
        for peer in [netns.ZOOKEEPER, netns.CLIENT] + [m.host.name for m in group.members if m is not member]:
            network.cut(here, peer)

    return cut, lambda _member: network.heal_all()


def failover_time(group: BrokerGroup, load: "Load", fault: Callable, repair: Callable, timeout: float) -> dict:
    """One failover under ``load`` (acks=all puts one after another): ``fault(master)``, then the time from
    its start to a new master in ZooKeeper and to the first put *sent once it was applied* that is
    acknowledged; then
    ``repair(old master)`` and the time until every member is back in the in-sync set. The hook for faults
    other than FAULTS' (a cut link): any pair of callables taking the master's process."""
    group.wait_in_sync(range(len(group.members)), timeout=120)
    time.sleep(1.0)  # under load
    old = group.wait_master()
    errors_before = len(load.errors)
    t_fault = time.perf_counter()
    fault(group.members[old])
    t_applied = time.perf_counter()  # a cut takes a few nft calls: a put sent meanwhile may still pass
    new = group.wait_master(timeout=timeout, other_than=old)
    t_master = time.perf_counter()
    deadline = time.monotonic() + timeout
    while (t_put := load.first_ok_after(t_applied)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no put acknowledged after the fault of member {old}: {load.errors[-3:]}")
        time.sleep(0.01)
    t_repair = time.perf_counter()
    repair(group.members[old])
    group.wait_in_sync(range(len(group.members)), timeout=180)
    return {"master": old, "new_master": new, "to_master_s": t_master - t_fault, "to_put_s": t_put - t_fault,
            "rejoin_s": time.perf_counter() - t_repair, "errors_seen": len(load.errors) - errors_before,
            "errors": load.errors[errors_before:errors_before + 3]}


def failovers(zk: LocalZooKeeper, group: BrokerGroup, root: str, faults: list, rounds: int, session_s: float) -> dict:
    """{fault name: [failover_time results]}, ``rounds`` of each fault in turn, one producer throughout."""
    out: dict = {name: [] for name in faults}
    bound = session_s + BOUND_MARGIN_S
    with Producer(zk_connect=zk.connect_string, zk_root=root, acks="all", timeout=session_s * 3 + 30) as producer:
        wait_routed(producer, root)
        load = Load(producer)
        load.start()
        try:
            for k in range(rounds):
                for name in faults:
                    r = failover_time(group, load, *FAULTS[name], timeout=session_s * 3 + 60)
                    out[name].append(r)
                    log(f"{name} {k + 1}: member {r['master']} faulted; member {r['new_master']} master after "
                        f"{r['to_master_s']:.2f} s, first put acknowledged after {r['to_put_s']:.2f} s (bound "
                        f"{bound:g} s: {'within' if r['to_put_s'] <= bound else 'OVER'}); {r['errors_seen']} puts "
                        f"failed to the application; member {r['master']} back in sync {r['rejoin_s']:.2f} s after "
                        f"its repair")
        finally:
            load.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer batches, rounds and failovers, shorter sessions")
    ap.add_argument("--batches", type=int, default=None, help="batches of 10,000 messages per round (default 200)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per case (default 5)")
    ap.add_argument("--failovers", type=int, default=None, help="rounds of each fault of the master (default 3)")
    known = [*FAULTS, CUT_LINK]
    ap.add_argument("--faults", default=",".join(known), help=f"faults to measure, of: {', '.join(known)}")
    ap.add_argument("--session-timeout-ms", type=int, default=None,
                    help="every member's zk.sessionTimeout (default 10000, the broker's default; --quick 4000)")
    ap.add_argument("--loopback", action="store_true",
                    help="no network namespaces: failovers on the loopback group, without 'cut link'")
    add_common_options(ap, "1g")
    args = ap.parse_args()
    batches = args.batches or (20 if args.quick else 200)
    rounds = args.rounds or (1 if args.quick else 5)
    kills = args.failovers if args.failovers is not None else (1 if args.quick else 3)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in known]
    if unknown:
        ap.error(f"--faults: unknown {unknown}; known: {', '.join(known)}")
    no_namespaces = "--loopback" if args.loopback else netns.unavailable()
    if no_namespaces is not None and CUT_LINK in faults:
        log(f"'{CUT_LINK}' left out: it needs network namespaces ({no_namespaces})")
        faults.remove(CUT_LINK)
    session_ms = args.session_timeout_ms or (4000 if args.quick else 10_000)
    results = run_facts(benchmark="replication", quick=args.quick, batches=batches, rows_per_batch=ROWS,
                        value_bytes=VALUE_SIZE, partitions=PARTITIONS, rounds=rounds, failovers=kills, faults=faults,
                        session_timeout_ms=session_ms, flush="unflushThreshold=0 (group commit: fsync before ack)")
    tmp = scratch_dir(args.dir, "replication-")
    zk = one = three = network = spread = None
    try:
        zk = LocalZooKeeper(data_dir=tmp / "zk", tick_time_ms=500).start()  # sessions from 1 s to 10 s
        settings = {"zk.sessionTimeout": session_ms, "replicaLagMaxMs": 10_000}
        topics = {TOPIC: {"numPartitions": PARTITIONS}}
        one = BrokerGroup(tmp / "one", 1, zk.connect_string, "/bench-one", members=1, settings=settings,
                          topics=topics).start()
        three = BrokerGroup(tmp / "three", 1, zk.connect_string, "/bench-three", members=3, settings=settings,
                            topics=topics).start()
        one.wait_master(60)
        three.wait_master(60)
        three.wait_in_sync(range(3), timeout=60)
        log("a group of one and a group of three are up")
        values = values_array(0, ROWS)
        keys = pa.array([b"%d" % i for i in range(ROWS)], pa.binary())
        plan = {"1 member": (one, "/bench-one", "all"), "3 members acks=1": (three, "/bench-three", "1"),
                "3 members acks=all": (three, "/bench-three", "all")}
        runs: dict = {name: [] for name in CASES}
        for r in range(rounds):
            for name in CASES:
                group, root, acks = plan[name]
                x = one_round(zk, group, root, acks, batches, values, keys)
                runs[name].append(x)
                log(f"round {r + 1} {name}: {x['mb_per_s']:.1f} MB/s, {x['msgs_per_s']:,.0f} msgs/s, "
                    f"{x['put_ms']:.1f} ms per put; " + lag_text(stats(x["lag_msgs"]), "msgs") + ", "
                    + lag_text(stats(x["lag_ms"]), "ms"))
        cases = {}
        for name, rs in runs.items():
            best = max(rs, key=lambda x: x["mb_per_s"])
            cases[name] = {"mb_per_s": best["mb_per_s"], "msgs_per_s": best["msgs_per_s"], "put_ms": best["put_ms"],
                           "lag_msgs": stats(sum((x["lag_msgs"] for x in rs), [])),
                           "lag_ms": stats(sum((x["lag_ms"] for x in rs), [])),
                           "describe_group_lag": stats(sum((x["reported_lag"] for x in rs), [])),
                           "min_isr": min(sum((x["isr_sizes"] for x in rs), []), default=None),
                           "sample_errors": sum(x["sample_errors"] for x in rs)}
        results["cases"] = cases

        where, failing, root = "on loopback", three, "/bench-three"
        if no_namespaces is None:  # every fault on members with addresses of their own, one of them a cut link
            network = netns.Network()
            spread = netns.group_in_namespaces(network, tmp / "spread", 1, f"{network.zookeeper.address}:{zk.port}",
                                               "/bench-spread", members=3, settings=settings, topics=topics).start()
            spread.wait_master(60)
            spread.wait_in_sync(range(3), timeout=60)
            add_fault(CUT_LINK, *cut_link(network, spread))
            where, failing, root = "in network namespaces", spread, "/bench-spread"
        results["failover_members"] = where
        log(f"failover: {kills} round(s) of {', '.join(faults)} of the master of three ({where}) under acks=all "
            f"load, zk.sessionTimeout {session_ms} ms, bound {session_ms / 1000 + BOUND_MARGIN_S:g} s")
        fo = failovers(zk, failing, root, faults, kills, session_ms / 1000)
        results["failovers"] = fo

        base = cases["1 member"]
        figures = []
        for name in CASES[1:]:
            c = cases[name]
            c["round_ratios"] = [x["mb_per_s"] / b["mb_per_s"] for x, b in zip(runs[name], runs["1 member"])]
            figures.append({"name": f"produce {name}", "value": c["mb_per_s"], "unit": "MB/s",
                            "baseline": "1 member (group commit)", "baseline_value": base["mb_per_s"],
                            "note": f"{c['msgs_per_s']:,.0f} msgs/s; in-sync set at least {c['min_isr']}; ratio "
                                    f"within each round: median {statistics.median(c['round_ratios']):.2f}, "
                                    f"{min(c['round_ratios']):.2f}-{max(c['round_ratios']):.2f}"})
        for name in CASES[1:]:
            c = cases[name]
            lm, lt = c["lag_msgs"], c["lag_ms"]
            if lm["samples"]:
                figures.append({"name": f"replica lag {name}, messages (median)", "value": lm["p50"],
                                "unit": "msgs", "baseline": "messages in flight (a put per partition)",
                                "baseline_value": ROWS,
                                "note": f"p95 {lm['p95']:,.0f}, max {lm['max']:,.0f}; {lm['samples']} samples"})
                figures.append({"name": f"replica lag {name}, ms (median)", "value": lt["p50"], "unit": "ms",
                                "baseline": "wall time per put, same case", "baseline_value": c["put_ms"],
                                "note": f"p95 {lt['p95']:,.0f}, max {lt['max']:,.0f}"})
        bound = session_ms / 1000 + BOUND_MARGIN_S
        for name, rs in fo.items():
            if not rs:
                continue
            put = [x["to_put_s"] for x in rs]
            master = [x["to_master_s"] for x in rs]
            figures.append({"name": f"{name} of the master to the first acknowledged put (worst)",
                            "value": max(put), "unit": "s", "baseline": "zk.sessionTimeout + 2 s (the bound)",
                            "baseline_value": bound,
                            "note": f"{len(rs)} failovers, {min(put):.2f}-{max(put):.2f} s, median "
                                    f"{statistics.median(put):.2f} s; new master after {statistics.median(master):.2f} "
                                    f"s (median); {'within' if max(put) <= bound else 'OVER'} the bound"})
        results["figures"] = figures

        print(f"\none run: {batches} x {ROWS:,} messages of {VALUE_SIZE} B per round (keyed, {PARTITIONS} "
              f"partitions, PipelinedSender), best of {rounds}; flush: {results['flush']}; zk.sessionTimeout "
              f"{session_ms} ms, replicaLagMaxMs 10000")
        print(f"{'case':<20} {'MB/s':>8} {'msgs/s':>11} {'x 1 member':>10} {'ms/put':>7} {'min ISR':>7}  "
              f"{'lag msgs p50/p95/max':>22}  {'lag ms p50/p95/max':>20}")
        for name, c in cases.items():
            lm, lt = c["lag_msgs"], c["lag_ms"]
            lag = "-" if not lm["samples"] else f"{lm['p50']:,.0f}/{lm['p95']:,.0f}/{lm['max']:,.0f}"
            lagt = "-" if not lt["samples"] else f"{lt['p50']:,.0f}/{lt['p95']:,.0f}/{lt['max']:,.0f}"
            print(f"{name:<20} {c['mb_per_s']:>8.1f} {c['msgs_per_s']:>11,.0f} "
                  f"{c['mb_per_s'] / base['mb_per_s']:>10.2f} {c['put_ms']:>7.1f} {str(c['min_isr'] or '-'):>7}  "
                  f"{lag:>22}  {lagt:>20}")
        reported = {n: c["describe_group_lag"] for n, c in cases.items() if c["describe_group_lag"]["samples"]}
        print("lag as DescribeGroup reports it (offsets p50/p95/max): " + (
            "; ".join(f"{n} {s['p50']:,.0f}/{s['p95']:,.0f}/{s['max']:,.0f}" for n, s in reported.items())
            if reported else "not served by this broker (UNIMPLEMENTED); lag from the members' log ends only"))
        print(f"failovers: members {where}")
        for name, rs in fo.items():
            for i, x in enumerate(rs, 1):
                print(f"failover {name} {i}: member {x['master']} -> member {x['new_master']} master after "
                      f"{x['to_master_s']:.2f} s, first put acknowledged after {x['to_put_s']:.2f} s (bound "
                      f"{bound:g} s = zk.sessionTimeout + {BOUND_MARGIN_S:g} s: "
                      f"{'within' if x['to_put_s'] <= bound else 'OVER'}); {x['errors_seen']} put(s) failed to the "
                      f"application; rejoined in {x['rejoin_s']:.2f} s")
        for f in figures:
            if f["baseline_value"]:
                print(f"{f['name']} / {f['baseline']}: {f['value'] / f['baseline_value']:.2f}")
        write_json(args.json, results)
    finally:
        if spread is not None:
            for m in spread.members:  # a frozen member cannot stop
                if m.proc is not None and m.proc.poll() is None:
                    os.kill(m.proc.pid, signal.SIGCONT)
        if network is not None:
            network.heal_all()
        teardown(tmp, spread, three, one, zk)
        if network is not None:
            network.close()


if __name__ == "__main__":
    main()
