"""The nemesis harness (``benchmarks/nemesis.py``): a short seeded schedule of real faults against a real
three-member group under load, whose checker must say PASS; and the harness's own parts, each shown able
to fail: the schedule is a function of its seed, the checker finds every kind of broken promise in a real
broker's log (lost, vanished, duplicated, partly visible transactions), and the member log comparison
finds diverging bytes."""
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.nemesis import FAULTS, schedule  # noqa: E402
from benchmarks.nemesis_check import Checker, compare_member_logs  # noqa: E402
from benchmarks.nemesis_load import ACKS_ALL, ACKS_ONE, IDEMPOTENT, TXN, Attempt, History, Txn, value_of  # noqa: E402
from conftest import wait_until  # noqa: E402
from metaq_broker.client.consumer import Consumer  # noqa: E402
from metaq_broker.client.producer import Producer  # noqa: E402
from metaq_broker.store import MessageStore  # noqa: E402
from metaq_broker.store.config import TopicConfig  # noqa: E402

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent
# The CI schedule: seven kinds of fault, once each, in the order seed 383 gives them (the master cut from
# ZooKeeper, retention passing a replica that is down, kill -9 of the master, the master frozen past its
# session, ZooKeeper restarted, the master's data wiped (after retention: it starts over mid-epoch), and
# last, since it takes 30 s, ZooKeeper's data lost with a replica lagging): about 95 s in all with the
# start, recovery waits, final checks and the log comparison, under three minutes on a loaded machine.
CI_FAULTS = "kill-master,pause-master-long,cut-master-zk,zk-restart,zk-data-loss,retention,wipe-member"
CI_SEED = 383


@pytest.mark.process
def test_a_short_nemesis_schedule_keeps_every_promise(tmp_path):
    """``python -m benchmarks.nemesis`` for a minute of faults; its verdict must be PASS (exit code 0).
    On failure the message carries the harness's violations and member log lines (the reproduction:
    seed, schedule, what the checker saw)."""
    cmd = [sys.executable, "-m", "benchmarks.nemesis", "--seconds", "85", "--seed", str(CI_SEED),
           "--recover-s", "12", "--faults", CI_FAULTS, "--dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=175)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the harness stops its members and removes its namespaces
        out, _ = proc.communicate(timeout=60)
        raise AssertionError(f"the nemesis run took over 175 s:\n{out[-6000:]}")
    verdict = [line for line in out.splitlines() if line.startswith("VERDICT:")]
    assert verdict, f"no verdict (exit code {proc.returncode}):\n{out[-6000:]}"
    report = out[out.find("violations (where"):] if "violations (where" in out else out[-4000:]
    assert proc.returncode == 0 and verdict[0].startswith("VERDICT: PASS"), f"{verdict[0]}\n{report[-12000:]}"


def test_the_schedule_is_a_function_of_its_seed():
    kinds = list(FAULTS)
    a, b, c = schedule(5, kinds, 4.0, 40), schedule(5, kinds, 4.0, 40), schedule(6, kinds, 4.0, 40)
    assert a == b and a != c
    assert sorted(s.kind for s in a[:len(kinds)]) == sorted(kinds)  # each round has every kind once
    for s in a:
        lo, hi = FAULTS[s.kind][1]
        assert lo * 4.0 <= s.duration <= hi * 4.0 and 0.5 <= s.gap <= 2.0
    assert [s.kind for s in schedule(5, ["kill-master"], 4.0, 3)] == ["kill-master"] * 3


def test_the_checker_finds_each_kind_of_broken_promise(cluster):
    """A real broker's log, and claims about it: true ones pass; an acknowledgement the log does not back
    is lost (acks=1 only counted), a message a reader saw that is not there vanished, one put stored twice
    and a copy of a refused put are duplicates (a copy after 'may or may not be stored' is explained), an
    idempotent producer's copy is a duplicate, a committed transaction not visible is partial, and a log
    that was replaced under the checker (the broker's data wiped) vanishes."""
    cluster.start_broker(1, topics={"t": {"numPartitions": 1}})
    h = History()
    h.kinds.update({"w": ACKS_ALL, "one": ACKS_ONE, "i": IDEMPOTENT, "x": TXN})
    with cluster.client(Producer, timeout=10.0) as p, cluster.client(Consumer, timeout=10.0) as c:
        wait_until(lambda: p.partitions("t"), what="topic routed")

        def put(writer, seq, attempt, outcome="acked", error=""):
            r = p.send_batch("t", [value_of(writer, seq, attempt)])[0]
            h.add_attempt(Attempt(writer, "t", seq, 1, attempt, 0.0, 1.0, outcome, r.partition, r.base_offset, error))
            return r

        first = put("w", 0, 0)
        for seq in (1, 2):
            put("w", seq, 0)
        checker = Checker(h, ["t"])
        assert checker.checkpoint(c, "true claims") == []
        assert checker.counts["acked and verified"] == 3
        at = first.base_offset
        h.add_attempt(Attempt("w", "t", 9, 1, 0, 0.0, 1.0, "acked", "1-0", at))  # offset `at` holds (w, 0)
        h.add_attempt(Attempt("one", "t", 0, 1, 0, 0.0, 1.0, "acked", "1-0", at + 1))
        h.seen.append(("t", "1-0", at + 2, value_of("w", 7, 0), "reader"))
        put("w", 10, 0)
        put("w", 10, 0)  # one attempt stored twice
        h.add_attempt(Attempt("w", "t", 11, 1, 0, 0.0, 1.0, "uncertain", error="may or may not be stored"))
        p.send_batch("t", [value_of("w", 11, 0)])
        put("w", 11, 1)  # explained
        h.add_attempt(Attempt("w", "t", 12, 1, 0, 0.0, 1.0, "refused", error="not master: moving"))
        p.send_batch("t", [value_of("w", 12, 0)])
        put("w", 12, 1)  # a refusal that stored nothing, stored
        put("i", 0, 0)
        put("i", 0, 1)  # idempotent: never twice, whatever the attempts
        h.txns.append(Txn("x", "txn-a", 0.0, [("t", "1-0", 10 ** 6, value_of("x", 0, 0))], "committed"))
        found = checker.checkpoint(c, "false claims")
        assert checker.counts["acks=1 lost"] == 1
        assert checker.counts["acks=all duplicates (after 'may or may not be stored')"] == 1
        kinds = sorted(v.kind for v in found)
        assert kinds == ["duplicate"] * 3 + ["lost", "transaction", "vanished"], found
        details = " ".join(v.detail for v in found)
        assert "('w', 9, 0)" in details and "one put stored twice" in details and "refused" in details
        assert "idempotent message (i, 0)" in details and "reader was shown" in details
        assert "committed transaction txn-a: 0 of its 1 messages" in details  # past the log's end: judged now
        assert checker.final(c) == []

    # The broker's data wiped: the log the checker read below the high watermark is gone.
    broker = cluster.brokers[1]
    broker.stop()
    shutil.rmtree(broker.workdir / "data")
    cluster.start_broker(1, topics={"t": {"numPartitions": 1}})
    with cluster.client(Producer, timeout=10.0) as p, cluster.client(Consumer, timeout=10.0) as c:
        wait_until(lambda: p.partitions("t"), what="topic routed again")
        for seq in range(30):
            p.send_batch("t", [value_of("w", 100 + seq, 0)])
        found = checker.checkpoint(c, "after the wipe")
    assert any(v.kind == "vanished" and "that the checker had read vanished" in v.detail for v in found), found
    assert any(v.kind == "lost" and "vanished after it had been read" in v.detail for v in found), found


def test_member_log_comparison_finds_diverging_bytes(tmp_path):
    def member(name, values):
        store = MessageStore(tmp_path / name, topics={"t": TopicConfig(num_partitions=1)}, background_interval=None)
        try:
            store.partition("t", 0).append(values)
        finally:
            store.close()
        return tmp_path / name

    paths = {0: member("m0", [b"a", b"b", b"c"]), 2: member("m2", [b"a", b"X", b"c"])}
    paths[1] = Path(shutil.copytree(paths[0], tmp_path / "m1"))  # a byte-for-byte copy, as a replica's
    assert compare_member_logs({0: paths[0], 1: paths[1]}, [("t", 0)], {("t", 0): 3}) == []
    problems = compare_member_logs(paths, [("t", 0)], {("t", 0): 3})
    assert len(problems) == 1 and "member 2's bytes differ" in problems[0] and "offset 1" in problems[0], problems
    problems = compare_member_logs({0: paths[0], 1: paths[1]}, [("t", 0)], {("t", 0): 5})
    assert problems and "below the high watermark 5" in problems[0]
