import pytest


class FakeClock:
    """A settable clock (seconds), passed as ``clock=`` so time-dependent behaviour is deterministic."""

    def __init__(self, start: float = 1_700_000_000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock():
    return FakeClock()


# -- real ZooKeeper and broker processes ---------------------------------------------------------------
import itertools  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
_roots = itertools.count()


@pytest.fixture(scope="session")
def zookeeper(tmp_path_factory):
    """One real ZooKeeper (from the pyspark jars) for the whole run; tests isolate by zk root."""
    from metaq_broker.devtools.zookeeper import LocalZooKeeper
    zk = LocalZooKeeper(data_dir=tmp_path_factory.mktemp("zookeeper"), tick_time_ms=500)  # allows 4 s sessions
    zk.start()
    yield zk
    zk.stop()


@pytest.fixture
def zk_clients(zookeeper, zk_root):
    """(make, ZkPaths of zk_root): ``make()`` is a new started kazoo client (its own session), closed at teardown."""
    from kazoo.client import KazooClient
    from metaq_broker.zk.paths import ZkPaths
    made = []

    def make():
        c = KazooClient(zookeeper.connect_string)
        c.start(10)
        made.append(c)
        return c

    yield make, ZkPaths(zk_root)
    for c in made:
        c.stop()
        c.close()


@pytest.fixture
def zk_root():
    return f"/test-{os.getpid()}-{next(_roots)}"


class Cluster:
    """Broker processes registered under one zk root, stopped at teardown."""

    def __init__(self, workdir, zk_connect, zk_root):
        self.workdir, self.zk_connect, self.zk_root = workdir, zk_connect, zk_root
        self.brokers = {}

    def start_broker(self, broker_id, settings=None, topics=None, **kw):
        from metaq_broker.devtools.broker_process import BrokerProcess
        settings = {"zk.root": self.zk_root, "zk.sessionTimeout": 4000, **(settings or {})}
        old = self.brokers.get(broker_id)
        b = BrokerProcess(self.workdir / f"broker-{broker_id}", broker_id, self.zk_connect,
                          port=old.port if old else None, settings=settings, topics=topics, **kw)
        self.brokers[broker_id] = b
        return b.start()

    def client(self, cls, **kw):
        return cls(zk_connect=self.zk_connect, zk_root=self.zk_root, **kw)

    def stop(self):
        for b in self.brokers.values():
            b.kill()


@pytest.fixture
def cluster(tmp_path, zookeeper, zk_root):
    c = Cluster(tmp_path, zookeeper.connect_string, zk_root)
    yield c
    c.stop()


def wait_until(predicate, timeout=20.0, interval=0.05, what="condition"):
    import time
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="module")
def spark():
    """A loopback-only local[2] SparkSession with the metaq source registered, one per test module."""
    from spark_helpers import metaq_session
    session = metaq_session()
    yield session
    session.stop()


# -- small disks that fill up ----------------------------------------------------------------------------
import subprocess  # noqa: E402


class SmallDisk:
    """A tmpfs of ``size_kib`` mounted at ``path`` (root: CI runs as root); ``fill()`` takes every free
    byte with a filler file and ``free()`` gives it back, so writes fail with ENOSPC for real."""

    def __init__(self, path, size_kib):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"cannot mount a tmpfs at {path} (these tests need root): {r.stderr}"
        self.filler = path / ".filler"

    def fill(self) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while os.write(fd, b"\0" * 4096) == 4096:
                pass
        except OSError:
            pass
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(path, size_kib)`` mounts a tmpfs there; all are unmounted at teardown."""
    disks = []

    def make(path, size_kib=1024):
        disks.append(SmallDisk(path, size_kib))
        return disks[-1]

    yield make
    for d in reversed(disks):
        d.unmount()
