"""``metaq quickstart`` returns only once everything it started has exited: ZooKeeper, the broker, Spark's
JVM and its Python workers. The command runs in a child Python that is a subreaper (Linux), so processes
orphaned on the way stay visible as its descendants instead of moving to init."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from metaq_broker.devtools import sparkhome

pytestmark = [pytest.mark.process, pytest.mark.spark]

# A subreaper watching its descendants every ``interval`` s (set before it): ``seen`` (pid: command line)
# while it runs, ``descendants()`` now.
WATCH = textwrap.dedent("""
    import ctypes, json, os, threading, time

    def descendants():
        parent = {}
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
            except (OSError, ValueError):
                continue
            if entry.isdigit() and fields[0] not in (b"Z", b"X"):  # a zombie has exited
                parent[int(entry)] = int(fields[1])
        out, todo = {}, [os.getpid()]
        while todo:
            p = todo.pop()
            for c in [c for c, pp in parent.items() if pp == p]:
                try:
                    out[c] = open(f"/proc/{c}/cmdline", "rb").read().replace(b"\\0", b" ").decode()[:200]
                except OSError:
                    continue
                todo.append(c)
        return out

    assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    seen, done = {}, threading.Event()

    def watch():
        while not done.is_set():
            for pid, cmdline in descendants().items():
                if cmdline:  # an exiting process's reads empty before it is a zombie: keep what it ran
                    seen[pid] = cmdline
            time.sleep(interval)

    watcher = threading.Thread(target=watch)
    watcher.start()
""")
PROBE = "interval = 0.2\n" + WATCH + textwrap.dedent("""
    from metaq_broker.tools.cli import main

    try:
        main(["quickstart", "--messages", "2000", "--console-port", "0"], standalone_mode=False)
    finally:
        done.set()
        watcher.join()
    print("PROBE " + json.dumps({"seen": list(seen.values()), "left": descendants()}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper and /proc are Linux's")
def test_quickstart_returns_only_when_every_process_it_started_is_gone(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SPARK_HOME"}  # as a user runs it: no SPARK_HOME set
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    probe = json.loads(r.stdout.rpartition("PROBE ")[2])
    seen = " ".join(probe["seen"])
    # Spark's JVM ran from the SPARK_HOME whose Python workers import the installed pyspark (sparkhome.py)
    assert str(sparkhome.spark_home()) in seen, seen
    assert "org.apache.zookeeper" in seen or "zookeeper" in seen.lower(), seen
    assert "metaq_broker.server.main" in seen and "java" in seen, probe["seen"]
    assert "org.apache.spark" in seen or "pyspark" in seen, seen
    assert probe["left"] == {}, probe["left"]
    # and what it printed on the way: everything produced, read back, piped through Spark
    out = r.stdout
    assert "produced 2000 messages" in out and "total lag 0" in out
    counts = out.split("read back per partition: ")[1].splitlines()[0]
    assert sum(int(part.split(": ")[1]) for part in counts.split(", ")) == 2000
    assert "Spark read 2000 messages from quickstart-events" in out
    assert "quickstart-upper now holds 2000 messages" in out
    assert "web console at http://127.0.0.1:" in out and "stopped the broker and ZooKeeper" in out
    assert "Kafka clients: bootstrap.servers=127.0.0.1:" in out  # the Kafka listener, on a free port


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper and /proc are Linux's")
def test_the_watch_keeps_what_an_exiting_process_ran():
    """A process's command line reads empty from the moment it lets go of its memory until it is a zombie,
    while the kernel closes its files (~1 ms, longer under load): a sample taken then must not wipe what
    it ran (two loaded runs of the quickstart test saw no broker among its processes). Here the window is
    ~130 ms: the child's last file holds 1 GiB of tmpfs pages, freed as it closes."""
    child = ("import os; fd = os.open('/dev/shm', os.O_TMPFILE | os.O_RDWR); b = b'y' * (1 << 20)\n"
             "for _ in range(1024): os.write(fd, b)\nos._exit(0)  # exit-watch-marker")
    probe = "interval = 0.01\n" + WATCH + textwrap.dedent(f"""
        import subprocess, sys
        try:
            subprocess.run([sys.executable, "-c", {child!r}], check=True)
        finally:
            done.set()
            watcher.join()
        print("PROBE " + json.dumps(list(seen.values())))
    """)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert any("exit-watch-marker" in c for c in json.loads(r.stdout.rpartition("PROBE ")[2])), r.stdout
