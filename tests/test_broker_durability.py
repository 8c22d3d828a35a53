"""A broker process's durability at the file-system level: new directories and renamed files are fsynced
into their parents (watched with strace), and recovery of a damaged log tail cuts exactly what was never
acknowledged, refusing (until ``metaq-broker --repair``) where acknowledged messages could be lost."""
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import wait_until
from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.protocol import records
from metaq_broker.store.segment import SEGMENT_HEADER_SIZE

pytestmark = pytest.mark.process

STRACE = shutil.which("strace")
_CALL = re.compile(r'^(\d+)\s+(\w+)\((.*)\)\s+=\s+(-?\d+)')


def syscalls(trace_path):
    """[(name, args, result)] in order, with strace's "<unfinished ...>" / "<... resumed>" pairs joined."""
    pending, out = {}, []
    for line in trace_path.read_text(errors="replace").splitlines():
        pid, _, rest = line.partition(" ")
        if rest.endswith("<unfinished ...>"):
            pending[pid] = rest[: -len("<unfinished ...>")]
            continue
        m = re.match(r"<\.\.\. \w+ resumed>(.*)", rest.strip())
        if m:
            rest = pending.pop(pid, "") + m.group(1)
        m = _CALL.match(f"{pid} {rest.strip()}")
        if m:
            out.append((m.group(2), m.group(3), int(m.group(4))))
    return out


def fsynced_dirs_after(calls, index):
    """Directories fsynced (by path) after position ``index`` of ``calls``."""
    fds_now, out = {}, []
    for i, (name, args, result) in enumerate(calls):
        if name in ("open", "openat") and result >= 0:
            m = re.search(r'"([^"]*)"', args)
            fds_now[result] = m.group(1) if m else None
        elif name == "fsync" and i > index and result == 0:
            out.append(fds_now.get(int(args)))
    return out


def first(calls, name_pattern, arg_pattern):
    for i, (name, args, _) in enumerate(calls):
        if re.fullmatch(name_pattern, name) and re.search(arg_pattern, args):
            return i
    raise AssertionError(f"no {name_pattern} call matching {arg_pattern!r}")


def test_new_directories_and_the_runtime_topics_file_are_fsynced_into_their_parents(tmp_path):
    assert STRACE, "strace is needed (.ci/run installs it: apt-get install strace)"
    broker = BrokerProcess(tmp_path / "broker", 0, "none")
    trace = tmp_path / "trace"
    broker.start(wrapper=[STRACE, "-f", "-qq", "-e", "trace=mkdir,mkdirat,rename,renameat,renameat2,open,openat,fsync",
                          "-o", str(trace)], timeout=60)
    try:
        with Admin(brokers=broker.address) as admin:
            admin.create_topic("orders", 2, config={"deletePolicy": "delete,24"})
    finally:  # SIGTERM to the broker under strace; strace exits with the broker's code
        traced = int(open(f"/proc/{broker.proc.pid}/task/{broker.proc.pid}/children").read().split()[0])
        os.kill(traced, signal.SIGTERM)
        try:
            assert broker.proc.wait(60) == 0
        finally:
            with contextlib.suppress(ProcessLookupError):  # never leave the broker behind strace running
                os.kill(traced, signal.SIGKILL)
            broker.kill()
    data = str(tmp_path / "broker" / "data")
    calls = syscalls(trace)

    # The data directory and the transactions directory are new: their parents must be fsynced.
    made = first(calls, "mkdir(at)?", re.escape(f'"{data}"'))
    assert str(tmp_path / "broker") in fsynced_dirs_after(calls, made)
    made = first(calls, "mkdir(at)?", re.escape(f'"{data}/transactions"'))
    assert data in fsynced_dirs_after(calls, made)
    # A topic created at runtime: its partition directories and the renamed runtime-topics.ini.
    made = first(calls, "mkdir(at)?", re.escape(f'"{data}/orders-1"'))
    assert data in fsynced_dirs_after(calls, made)
    renamed = first(calls, "rename.*", re.escape(f'{data}/runtime-topics.ini"'))
    assert data in fsynced_dirs_after(calls, renamed)


def batch_positions(segment):
    """File positions of the batches in a segment file."""
    buf = segment.read_bytes()
    pos, out = SEGMENT_HEADER_SIZE, []
    while pos < len(buf):
        out.append(pos)
        pos += records.parse_header(buf, pos).batch_len
    return out


def damage_second_batch(data_dir, partition_dir):
    segment = sorted((data_dir / partition_dir).glob("*.meta"))[-1]
    raw = bytearray(segment.read_bytes())
    raw[batch_positions(segment)[1] + 60] ^= 0xFF
    segment.write_bytes(bytes(raw))
    return segment


def latest(broker, topic):
    with Consumer(brokers=broker.address) as consumer:
        return consumer.offsets(topic)["0-0"][1]


def test_recovery_cuts_unacknowledged_damage_and_refuses_where_acknowledged_data_follows(tmp_path):
    topics = {"safe": {"numPartitions": 1}, "fast": {"numPartitions": 1, "unflushThreshold": 1000}}
    broker = BrokerProcess(tmp_path / "broker", 0, "none", topics=topics).start()
    data = tmp_path / "broker" / "data"
    with Producer(brokers=broker.address) as producer:
        for topic in topics:
            for b in range(5):
                producer.send_batch(topic, [b"%s-%d-%d" % (topic.encode(), b, i) for i in range(10)], partition="0-0")
    broker.kill()  # a crash: no final fsync or index write

    # Group commit: the damaged batch and those after it were never acknowledged (no fsync covered them).
    damage_second_batch(data, "safe-0")
    broker.start()
    assert latest(broker, "safe") == 10
    assert re.search(r"safe-0: recovery truncated \d+ bytes .*offset 10.*no fsync covered them",
                     broker.log_path.read_text())
    with Producer(brokers=broker.address) as producer:  # and the partition takes appends at the cut
        assert producer.send_batch("safe", [b"after"], partition="0-0")[0].base_offset == 10
    broker.kill()

    # unflushThreshold > 0 acknowledged before fsync: refuse, name the file and the way out, cut nothing.
    segment = damage_second_batch(data, "fast-0")
    before = segment.read_bytes()
    with pytest.raises(RuntimeError, match=r"followed by valid batches.*--repair"):
        broker.start()
    assert broker.proc.returncode == 2 and segment.read_bytes() == before
    broker.start(args=["--repair"])
    assert latest(broker, "fast") == 10 and latest(broker, "safe") == 11
    assert "repair was asked for" in broker.log_path.read_text()
    assert broker.stop() == 0


def test_a_sigterm_while_the_broker_starts_stops_it_in_order(tmp_path):
    """A broker still waiting for ZooKeeper (nothing listens there) takes SIGTERM as a request to stop:
    it closes what it opened and exits 0 at once, rather than dying by the signal or waiting on."""
    from metaq_broker.devtools.zookeeper import free_port
    log = tmp_path / "broker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "metaq_broker.server.main", "--brokerId", "3", "--serverPort",
                                 "0", "--kafkaPort", "0", "--zk.connect", f"127.0.0.1:{free_port()}", "--dataPath",
                                 str(tmp_path / "data")],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "Connecting to 127.0.0.1" in log.read_text(), what="the broker waiting for ZooKeeper")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0, log.read_text()
        assert "metaq broker 3 stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


SIGNAL_SWALLOWED = """
    import ctypes, os, signal, sys, time
    from metaq_broker.server import broker, main
    real_start = broker.Broker.start

    @ctypes.CFUNCTYPE(None)
    def compiling():  # stands for numba compiling a kernel during the start: Python called back from C
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the handler runs here; its SystemExit is printed and ignored by ctypes

    def start(self):
        compiling()
        return real_start(self)

    broker.Broker.start = start
    main.main(sys.argv[1:])
    print("main returned", flush=True)
"""


def test_a_sigterm_swallowed_during_the_start_still_stops_the_broker(tmp_path):
    """CI's failure: SIGTERM arrived while numba compiled (a ctypes callback), which printed and dropped the
    handler's SystemExit; the start went on and the broker served until killed. The signal is also noted,
    and a start that completes anyway stops at once."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(SIGNAL_SWALLOWED), "--brokerId", "4", "--serverPort",
                        "0", "--kafkaPort", "0", "--zk.connect", "none", "--dataPath", str(tmp_path / "data")],
                       capture_output=True, text=True, timeout=60)
    assert "Exception ignored on calling ctypes callback" in r.stderr  # the SystemExit was lost, as in CI
    assert r.returncode == 0 and "main returned" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "metaq broker 4 stopped" in r.stderr and "listening on" not in r.stdout
