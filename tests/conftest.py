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
def zk_root():
    return f"/test-{os.getpid()}-{next(_roots)}"


class Cluster:
    """Broker processes registered under one zk root, stopped at teardown."""

    def __init__(self, workdir, zk_connect, zk_root):
        self.workdir, self.zk_connect, self.zk_root = workdir, zk_connect, zk_root
        self.brokers = {}

    def start_broker(self, broker_id, settings=None, topics=None):
        from metaq_broker.devtools.broker_process import BrokerProcess
        settings = {"zk.root": self.zk_root, "zk.sessionTimeout": 4000, **(settings or {})}
        old = self.brokers.get(broker_id)
        b = BrokerProcess(self.workdir / f"broker-{broker_id}", broker_id, self.zk_connect,
                          port=old.port if old else None, settings=settings, topics=topics)
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
    from spark_helpers import spark_builder

    import metaq_spark
    session = spark_builder().getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    metaq_spark.register(session)
    yield session
    session.stop()
