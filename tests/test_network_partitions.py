"""Network partitions of a replicated group whose members run on their own addresses in network
namespaces (``metaq_broker.devtools.netns``): the master cut from its replicas with ZooKeeper reachable,
the master cut from ZooKeeper with its replicas reachable, a client cut from the master only. Under
``acks=all`` (``minInSyncReplicas=2``) and ``acks=1`` load, with a reader: nothing acknowledged is lost,
nothing a reader saw vanishes, the cut-off master stops acknowledging before another is elected, writes
resume, and the members' logs end identical. The checks are the nemesis harness's
(``benchmarks/nemesis_check.py``). Also the namespaces themselves: a cut drops exactly the link named,
and nothing is left behind, not even by a run that was killed.

Needs root, ``ip`` and ``nft`` (``.ci/run`` installs nftables); without them these tests fail saying so."""
import collections
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.nemesis import settled  # noqa: E402
from benchmarks.nemesis_check import Checker, compare_member_logs, summarize  # noqa: E402
from benchmarks.nemesis_load import (ACKS_ALL, ACKS_ONE, Attempt, History, Reader, Writer,  # noqa: E402
                                     value_of)
from conftest import wait_until  # noqa: E402
from metaq_broker.client.admin import Admin  # noqa: E402
from metaq_broker.client.consumer import Consumer  # noqa: E402
from metaq_broker.client.producer import Producer  # noqa: E402
from metaq_broker.devtools import netns  # noqa: E402
from metaq_broker.protocol.status import STORED_NOTHING  # noqa: E402

TOPIC = "orders"
TOPICS = {TOPIC: {"numPartitions": 2}}
SESSION_S = 4.0  # BrokerGroup's zk.sessionTimeout
BOUND_S = SESSION_S + 2


def _netns_or_fail():
    why = netns.unavailable()
    assert why is None, f"these tests need network namespaces: {why}"


@pytest.fixture
def network():
    _netns_or_fail()
    with netns.Network() as net:
        yield net


@pytest.fixture
def group(tmp_path, zookeeper, zk_root, network):
    """Three members on hosts m0..m2; ZooKeeper (the session's, listening on every address) reached at the
    network's zookeeper address."""
    zk_connect = f"{network.zookeeper.address}:{zookeeper.port}"
    g = netns.group_in_namespaces(network, tmp_path / "group", 1, zk_connect, zk_root, members=3,
                                  settings={"minInSyncReplicas": 2}, topics=TOPICS)
    try:
        g.start()
        for m in g.members:  # forked from the zygote into its host's namespace, or started under ip netns exec
            assert os.stat(f"/proc/{m.proc.pid}/ns/net").st_ino == os.stat(f"/run/netns/{m.host.namespace}").st_ino
        g.wait_master()
        g.wait_in_sync(range(3))
        yield g
    finally:
        for m in g.members:
            if m.proc is not None and m.proc.poll() is None:
                os.kill(m.proc.pid, signal.SIGCONT)
        g.stop()


_loads: list = []


@pytest.fixture(autouse=True)
def _stop_loads():
    """A test that failed half-way leaves its clients running: stop them."""
    yield
    while _loads:
        for c in _loads.pop().clients:
            c.stop()


def _diagnosis(group) -> str:
    """What the kernel and the members say when puts get no answer, for the failure message (a client in
    this namespace now and then got DEADLINE_EXCEEDED from a master for 30 s before any cut, not reproduced
    on purpose): neighbour entries and TCP connections here and in each member's namespace, each member's
    cut set and the end of its log."""
    try:
        return _diagnose(group)
    except Exception as e:  # noqa: BLE001 - the failure being reported matters more
        return f"(no diagnosis: {e!r})"


def _diagnose(group) -> str:
    hosts = [m.host for m in group.members]
    subnet = hosts[0].address.rsplit(".", 1)[0] + ".0/24"
    lines = []
    for where, wrap, commands in [("client", lambda argv: argv, (["ip", "neigh", "show", "to", subnet],
                                                                  ["ss", "-tni", "dst", subnet]))] + \
            [(h.name, h.wrap, (["ip", "neigh"], ["ss", "-tn"], ["nft", "list", "set", "inet", "mqnem", "cut"]))
             for h in hosts]:
        for argv in commands:
            r = subprocess.run(wrap(argv), capture_output=True, text=True, timeout=10)
            lines.append(f"[{where}] {' '.join(argv)}:\n{(r.stdout + r.stderr).strip()}")
    for m in group.members:
        log = m.log_path.read_text(errors="replace").splitlines() if m.log_path.exists() else []
        lines.append(f"[{m.host.name}] the end of its log:\n" + "\n".join(log[-15:]))
    return "\n".join(lines)


class Load:
    """Writers (acks=all, acks=1, and ``extra(history)``) and a reader on TOPIC, recording into one History."""

    def __init__(self, group, extra=lambda history: []):
        self.group = group
        self.client = {"zk_connect": group.zk_connect, "zk_root": group.paths.root}
        self.history = History()
        h = self.history
        self.writers = [Writer("all-0", ACKS_ALL, h, TOPIC, self.client, 1, timeout=5.0),
                        Writer("all-1", ACKS_ALL, h, TOPIC, self.client, 1, timeout=5.0),
                        Writer("one-0", ACKS_ONE, h, TOPIC, self.client, 1, timeout=5.0), *extra(h)]
        self.reader = Reader("reader", h, TOPIC, self.client, timeout=10.0)
        self.clients = [*self.writers, self.reader]
        _loads.append(self)
        for c in self.clients:
            c.start()
        self.wait_acked(20)

    def acked(self, writer=None, after: float = 0.0) -> list:
        with self.history.lock:
            return [a for a in self.history.attempts if a.outcome == "acked" and a.done >= after
                    and (writer is None or a.writer == writer) and self.history.kinds[a.writer] == ACKS_ALL]

    def wait_acked(self, n: int, after: float = 0.0, timeout: float = 30.0, what: str = "acks=all puts") -> float:
        """Wait until ``n`` acks=all puts were acknowledged after ``after``; returns when the first was."""
        try:
            wait_until(lambda: len(self.acked(after=after)) >= n, timeout=timeout, what=what)
        except AssertionError as e:  # say what the writers were told instead
            with self.history.lock:
                tried = list(self.history.attempts)
            outcomes = collections.Counter(f"{a.writer} {a.outcome}" for a in tried)
            raise AssertionError(f"{e}; attempts: {dict(outcomes)}; the last errors: "
                                 f"{[a.error for a in tried if a.error][-5:]}\n{_diagnosis(self.group)}") from None
        return min(a.done for a in self.acked(after=after))

    def finish(self) -> dict:
        """Stop writing, let the group settle, check everything, stop the members and compare their logs;
        returns the checker's counts."""
        for w in self.writers:
            w.stop()
        for w in self.writers:
            w.join(timeout=30)
            assert not w.is_alive(), f"writer {w.name} did not stop"
            assert w.crash is None, w.crash
        self.group.wait_in_sync(range(3), timeout=30)
        with Consumer(**self.client, timeout=10.0) as consumer, Admin(**self.client, timeout=10.0) as admin:
            last = [None, ""]

            def settle():
                last[:] = settled(self.group, consumer, admin, [TOPIC])
                return last[0]
            try:
                hw = wait_until(settle, timeout=30, what="the group settled")
            except AssertionError:
                raise AssertionError(f"the group did not settle within 30 s: {last[1]}") from None
            self.reader.stop()
            self.reader.join(timeout=30)
            assert self.reader.crash is None, self.reader.crash
            checker = Checker(self.history, [TOPIC])
            violations = checker.final(consumer)
        assert not violations, "\n".join(summarize(violations))
        assert checker.counts["acked acks=all"] > 0 and checker.counts["seen by readers"] > 0
        master = self.group.master_id()
        for r in [r for r in range(3) if r != master] + [master]:
            self.group.members[r].stop()
        problems = compare_member_logs({r: m.workdir / "data" for r, m in enumerate(self.group.members)},
                                       [(TOPIC, 0), (TOPIC, 1)], hw)
        assert not problems, problems
        return checker.counts


def isr(group) -> list:
    return [r for r, _ in group.state()["isr"]]


def test_master_cut_from_its_replicas_with_zookeeper_reachable(group, network):
    """The master keeps its ZooKeeper session, so nobody else is elected; it cannot copy to its replicas, so
    it shrinks the in-sync set to itself and from then refuses acks=all (minInSyncReplicas=2) while acks=1
    goes on. Every acks=all acknowledgement it gave is on a replica too (checked against the replicas' log
    ends, read from them directly while the cut lasts); after the heal the replicas catch up and rejoin."""
    master = group.master_id()
    epoch = group.state()["epoch"]
    replicas = [r for r in range(3) if r != master]
    load = Load(group)
    cut = time.monotonic()
    for r in replicas:
        network.cut(f"m{master}", f"m{r}")
    time.sleep(1.0)  # fetches the replicas had sent before the cut are answered by now (a long poll ends in 0.5 s)
    late = threading.Thread(target=put_once, args=(load, "late-0"))  # appended on the master alone
    late.start()
    wait_until(lambda: isr(group) == [master], timeout=30, what="the in-sync set shrunk to the master")
    late.join(timeout=30)
    shrunk = time.monotonic()
    acks_one = len([a for a in load.history.attempts if a.writer == "one-0" and a.outcome == "acked"])
    wait_until(lambda: len([a for a in load.history.attempts if a.writer == "one-0" and a.outcome == "acked"])
               > acks_one + 5, timeout=20, what="acks=1 puts acknowledged by the master alone")
    assert group.master_id() == master and group.state()["epoch"] == epoch, "a new master was elected"
    # Everything acknowledged under acks=all by now must be on a replica as well as on the master.
    ends = {r: {p: e for p, e in replica_ends(group.members[r]).items()} for r in replicas}
    with load.history.lock:
        acked = [a for a in load.history.attempts if a.outcome == "acked" and load.history.kinds[a.writer] == ACKS_ALL]
        late = [a for a in load.history.attempts if a.writer == "late-0"]
    alone = [a for a in acked if not any(a.base_offset + a.count <= ends[r][a.partition] for r in replicas)]
    assert not alone, (f"{len(alone)} acks=all puts were acknowledged while only the master had them (cut at "
                       f"{cut:.1f}, in-sync set shrunk at {shrunk:.1f}), e.g. {alone[:3]}; replicas end at {ends}")
    assert late and late[0].outcome != "refused", late  # admitted (in-sync set still whole), then not acknowledged
    last = max(a.done for a in acked)
    network.heal_all()
    healed = time.monotonic()
    group.wait_in_sync(range(3), timeout=30)
    resumed = load.wait_acked(1, after=healed, what="acks=all puts after the heal")
    print(f"cut {0:.1f} s, in-sync set shrunk {shrunk - cut:.1f} s, last acks=all acknowledgement "
          f"{last - cut:.1f} s, healed {healed - cut:.1f} s, acks=all resumed {resumed - healed:.1f} s after the heal")
    assert group.master_id() == master
    load.finish()


def put_once(load, writer: str) -> None:
    """One acks=all put of five messages, recorded as ``writer``'s only attempt, whatever its outcome (told
    within the producer's timeout: a put the in-sync set's shrink left unacknowledged is tried until then)."""
    load.history.kinds[writer] = ACKS_ALL
    with Producer(**load.client, timeout=8.0) as producer:
        a = Attempt(writer, TOPIC, 0, 5, 0, time.monotonic())
        try:
            r = producer.send_batch(TOPIC, [value_of(writer, i, 0) for i in range(5)])[0]
            a.outcome, a.partition, a.base_offset = "acked", r.partition, r.base_offset
        except Exception as e:  # noqa: BLE001 - recorded: the test says what it may be
            a.outcome, a.error = ("refused" if isinstance(e, STORED_NOTHING) else "uncertain"), repr(e)
        a.done = time.monotonic()
        load.history.add_attempt(a)


def replica_ends(member) -> dict:
    """{partition name: log end} asked of the member itself (``DescribeTopic``'s latest: uncapped on a
    member that has never been master, as the replicas of a fresh group)."""
    import grpc
    from metaq_broker.proto import metaq_pb2 as pb, metaq_pb2_grpc as pb_grpc
    with grpc.insecure_channel(member.address) as channel:
        d = pb_grpc.BrokerStub(channel).DescribeTopic(pb.TopicRequest(topic=TOPIC), timeout=5)
    return {f"1-{p.partition}": p.latest for p in d.partitions}


def test_master_cut_from_zookeeper_with_replicas_reachable(group, network):
    """The master loses ZooKeeper: its lease runs out (0.75 x the session timeout) and it refuses puts
    before its session expires and a replica is elected; writes resume on the new master; healed, the old
    master rejoins as a replica with the same log. A producer pinned to the old master (static broker
    list) says when it last acknowledged."""
    master = group.master_id()
    old = group.members[master]
    load = Load(group, extra=lambda h: [Writer("pin-0", ACKS_ALL, h, TOPIC, {"brokers": {1: old.address}}, 1,
                                               timeout=1.0, pace=0.01)])
    wait_until(lambda: load.acked("pin-0"), timeout=20, what="the pinned producer's first acknowledgement")
    cut = time.monotonic()
    network.cut(f"m{master}", netns.ZOOKEEPER)
    new = group.wait_master(timeout=30, other_than=master)
    # when the new master node was created (ZooKeeper's clock is this machine's), on the monotonic clock
    stat = group.zk.exists(group.paths.broker(1))
    elected = stat.ctime / 1000 - time.time() + time.monotonic()
    last_ack = max(a.done for a in load.acked("pin-0"))
    with load.history.lock:
        refusals = [a for a in load.history.attempts if a.writer == "pin-0" and a.outcome != "acked" and a.sent > cut]
    print(f"cut at 0; the old master's last acknowledgement {last_ack - cut:.2f} s; first refusal "
          f"{(min(a.done for a in refusals) - cut) if refusals else float('nan'):.2f} s; new master {new} elected "
          f"{elected - cut:.2f} s")
    assert last_ack < elected, (f"the cut-off master acknowledged a put {last_ack - elected:.2f} s after member "
                                f"{new} was elected")
    # a put in flight when the lease ran out is answered "not acknowledged" (ReplicaManager.await_hw), the
    # next one "not master"; on a busy machine the election can come first, so this waits for it
    wait_until(lambda: any("not master" in a.error for a in list(load.history.attempts)
                           if a.writer == "pin-0" and a.outcome != "acked" and a.sent > cut),
               timeout=BOUND_S, what="the cut-off master refusing the pinned producer with 'not master'")
    resumed = load.wait_acked(5, after=elected, what="acks=all puts on the new master")
    print(f"acks=all resumed {resumed - cut:.2f} s after the cut (bound {BOUND_S:g} s)")
    network.heal_all()
    group.wait_in_sync(range(3), timeout=30)
    assert group.master_id() == new
    load.finish()


FAR_WRITER = textwrap.dedent("""
    import json, sys, time
    from metaq_broker.client.producer import Producer
    zk, root, topic, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with Producer(zk_connect=zk, zk_root=root, timeout=10.0) as p:
        for seq in range(n):
            sent = time.monotonic()
            r = p.send_batch(topic, [b"far-0|%d|0|" % seq])[0]
            print(json.dumps([seq, r.partition, r.base_offset, sent, time.monotonic()]), flush=True)
""")


def test_client_cut_from_the_master_only(group, network):
    """Only the link between this client and the master is cut: the group keeps its master and in-sync
    set (nothing to fail over), this client's puts fail within its timeout instead of hanging, a client
    on another host writes on meanwhile, and once healed this client writes again."""
    master = group.master_id()
    epoch = group.state()["epoch"]
    far = network.add_host("c2")
    load = Load(group)
    cut = time.monotonic()
    network.cut(netns.CLIENT, f"m{master}")
    def failed():
        return [a for a in list(load.history.attempts) if a.outcome != "acked" and a.sent > cut]
    # twice each: the first put on a connection made before the cut, the next one on a new connection
    wait_until(lambda: all(sum(1 for a in failed() if a.writer == w) >= 2 for w in ("all-0", "all-1")),
               timeout=40, what="each acks=all writer told twice that its put failed")
    failed = failed()
    slowest = max(failed, key=lambda a: a.done - a.sent)
    assert slowest.done - slowest.sent < 5.0 + 2.0, (f"a put outlived the producer's timeout of 5 s: "
                                                     f"{slowest.done - slowest.sent:.1f} s, {slowest.error}")
    r = subprocess.run(far.wrap([sys.executable, "-c", FAR_WRITER, group.zk_connect, group.paths.root, TOPIC, "50"]),
                       capture_output=True, text=True, timeout=90, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 50
    assert group.master_id() == master and group.state()["epoch"] == epoch and isr(group) == [0, 1, 2]
    with load.history.lock:
        load.history.kinds["far-0"] = ACKS_ALL
        load.history.attempts += [Attempt("far-0", TOPIC, seq, 1, 0, sent, done, "acked", p, off)
                                  for seq, p, off, sent, done in rows]
    network.heal_all()
    healed = time.monotonic()
    resumed = load.wait_acked(2, after=healed, what="this client's acks=all puts after the heal")
    print(f"this client's acks=all puts resumed {resumed - healed:.2f} s after the heal")
    load.finish()


def test_a_replica_connecting_to_a_cut_off_master_follows_the_next_at_once(tmp_path, network):
    """A replica whose fetch to a cut-off master timed out connects again, and the SYN is dropped; when a new
    master is elected meanwhile, ``follow`` must end that connect at once. It could not: the replica waited
    out the connect timeout (5 s) first, and the new master's acks=all puts with it (bench_replication's cut
    link: 15 s instead of 10 after the cut, with zk.sessionTimeout 10 s). Here the fetcher runs in this
    process, the old master is a host whose link to this one is cut, the new one a listening socket."""
    import socket
    import uuid

    from metaq_broker.server.replica_fetcher import CONNECT_TIMEOUT, ReplicaFetcher
    from metaq_broker.store import MessageStore, TopicConfig

    dead = network.add_host("dead")
    network.cut(netns.CLIENT, "dead")
    live = socket.create_server(("127.0.0.1", 0))
    live.settimeout(CONNECT_TIMEOUT + 5)
    store = MessageStore(tmp_path / "replica", {TOPIC: TopicConfig(num_partitions=1)}, background_interval=None)
    fetcher = ReplicaFetcher(store, None, 7, uuid.uuid4().hex, sync_topics=lambda m, l: 0,
                             on_fenced=lambda e: None, fetch_timeout_s=10.0)
    try:
        fetcher.follow(1, {"host": dead.address, "port": 8123, "dataPort": 8124})
        wait_until(lambda: dead.address in subprocess.run(["ss", "-tn", "state", "syn-sent"], capture_output=True,
                                                          text=True).stdout, what="a connect to the dead one")
        followed = time.monotonic()
        fetcher.follow(2, {"host": "127.0.0.1", "port": 8123, "dataPort": live.getsockname()[1]})
        conn, _ = live.accept()
        waited = time.monotonic() - followed
        conn.close()
        assert waited < CONNECT_TIMEOUT / 2, (f"the replica connected to its new master {waited:.1f} s after "
                                              f"following it: it waited out its connect to the cut-off one")
    finally:
        fetcher.stop()
        store.close()
        live.close()


# -- the namespaces themselves -------------------------------------------------------------------------
ECHO = "import socket,sys\ns=socket.socket(); s.bind((sys.argv[1], 7000)); s.listen()\n" \
       "while True:\n    c,_=s.accept(); c.sendall(b'ok'); c.close()\n"
PROBE = "import socket,sys\ntry:\n    print(socket.create_connection((sys.argv[1], 7000), timeout=0.7).recv(2).decode())\n" \
        "except OSError as e:\n    print(type(e).__name__)\n"


def reach(host, address) -> bool:
    out = subprocess.run(host.wrap([sys.executable, "-c", PROBE, address]), capture_output=True, text=True,
                         timeout=10).stdout.strip()
    return out == "ok"


def test_a_cut_drops_exactly_the_link_named_and_heals():
    _netns_or_fail()
    with netns.Network() as net:
        a, b, c = (net.add_host(n) for n in "abc")
        servers = [subprocess.Popen(h.wrap([sys.executable, "-c", ECHO, h.address])) for h in (a, b, c)]
        try:
            wait_until(lambda: all(reach(net.client, h.address) for h in (a, b, c)), timeout=20, what="echo servers")
            assert reach(a, b.address) and reach(b, a.address) and reach(a, c.address)
            net.cut("a", "b")
            assert not reach(a, b.address) and not reach(b, a.address)  # both ways
            assert reach(a, c.address) and reach(c, b.address) and reach(net.client, a.address)
            net.cut(netns.CLIENT, "c")
            assert not reach(net.client, c.address) and reach(net.client, a.address) and reach(a, c.address)
            assert net.cuts == [("a", "b"), ("c", netns.CLIENT)]
            net.heal("a", "b")
            assert reach(a, b.address) and not reach(net.client, c.address)
            net.heal_all()
            assert reach(net.client, c.address) and net.cuts == []
            with pytest.raises(ValueError, match="both in the root namespace"):
                net.cut(netns.CLIENT, netns.ZOOKEEPER)
        finally:
            for s in servers:
                s.kill()
                s.wait()
        tag, namespaces = net.tag, [h.namespace for h in (a, b, c)]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not any(ns in left for ns in namespaces) and f"{netns.PREFIX}{tag}" not in links


def add_host_with_port_address(net, name: str, mac: str):
    """``net.add_host(name)``, its bridge port (the veth's end in the root namespace) then given ``mac``."""
    listed = ["ip", "-o", "link", "show", "master", net.bridge]
    before = subprocess.run(listed, capture_output=True, text=True, check=True).stdout.splitlines()
    host = net.add_host(name)
    (port,) = set(subprocess.run(listed, capture_output=True, text=True, check=True).stdout.splitlines()) - set(before)
    subprocess.run(["ip", "link", "set", port.split(": ")[1].split("@")[0], "address", mac], check=True)
    return host


def test_a_host_added_later_leaves_the_others_reaching_the_client():
    """Hosts join while others already talk to the client (a test adds a client host after its group
    started): the bridge keeps its address, so the members' cached address of the client stays right. Left
    to the kernel, the bridge takes its lowest port's address: a port with a lower one (set here, as it
    happens at random) moves it, and what a member sends to the old one, another port's, is dropped
    until its neighbour entry expires (~30 s: a run's client got no answer from its master)."""
    _netns_or_fail()
    with netns.Network() as net:
        a = add_host_with_port_address(net, "a", "02:00:00:00:00:03")
        add_host_with_port_address(net, "c", "02:00:00:00:00:02")
        address = Path(f"/sys/class/net/{net.bridge}/address").read_text()
        server = subprocess.Popen([sys.executable, "-c", ECHO, net.client.address])
        try:
            wait_until(lambda: reach(a, net.client.address), timeout=20, what="the client's echo server")
            add_host_with_port_address(net, "b", "02:00:00:00:00:01")
            assert Path(f"/sys/class/net/{net.bridge}/address").read_text() == address
            assert reach(a, net.client.address)
        finally:
            server.kill()
            server.wait()


def test_sweep_removes_what_a_killed_run_left():
    """A process that made a network and was killed (no cleanup ran) leaves namespaces and a bridge;
    ``sweep`` finds them by the dead pid in their names and deletes them, and leaves live runs alone."""
    _netns_or_fail()
    code = ("import os, time\nfrom metaq_broker.devtools import netns\nn = netns.Network(); n.add_host('x')\n"
            "print(n.tag, n.hosts['x'].namespace, flush=True)\nos.kill(os.getpid(), 9)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    tag, namespace = r.stdout.split()
    assert namespace in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    with netns.Network() as mine:
        mine.add_host("y")
        removed = netns.sweep()
        assert namespace in removed and f"{netns.PREFIX}{tag}b" in removed
        assert mine.hosts["y"].namespace in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                           text=True).stdout
    assert f"{netns.PREFIX}{tag}" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def test_consecutive_networks_of_a_process_take_new_addresses():
    """A test's hosts never get the addresses of the previous test's in the same process
    (``Network._free_subnet``): nothing that outlived that test can meet them."""
    _netns_or_fail()
    subnets = []
    for _ in range(3):
        with netns.Network() as net:
            subnets.append(net.client.address.rsplit(".", 1)[0])
    assert len(set(subnets)) == 3, subnets
