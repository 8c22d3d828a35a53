"""Shared fixtures of the test suite, and its lanes.

Lanes: every test is marked with what it needs (the markers are registered in pytest.ini):

    unit     nothing but this process: no broker, ZooKeeper, Spark or browser. ``pytest -m unit`` runs
             them in well under a minute: what to run while editing.
    process  real broker or ZooKeeper processes (or another long-lived child: the CLI, a notebook).
    spark    a real SparkSession.
    browser  headless Chromium (Debian's chromium and chromium-driver; skipped, saying so, without them).

How a test gets its lanes:
  * a test that uses the ``zookeeper``, ``own_zookeeper`` or ``cluster`` fixture (also through a fixture
    of its own that uses them) is ``process``, one that uses ``spark`` is ``spark``, one that uses
    ``browser`` is ``browser``: automatically, see NEEDS below;
  * every test module says the lane of its other tests at the top: ``pytestmark = pytest.mark.unit``,
    or ``pytest.mark.process`` where they start processes themselves (BrokerProcess, BrokerGroup,
    LocalZooKeeper, subprocess: the CLI, a script); a test adds what it needs besides
    (``@pytest.mark.process`` in a unit module, ``@pytest.mark.spark`` for a Spark job it starts), or
    says ``@pytest.mark.unit`` in a process module when it needs nothing;
  * ``unit`` means needing nothing else: a test with any other lane is not ``unit``.
A test with no lane fails the collection, and so does a test marked ``unit`` itself that uses one of
those fixtures. ``pytest -m unit`` runs no test of another lane; ``-m "not browser"`` all the others.
A module whose tests all use those fixtures needs no mark.
"""
import compileall
import ctypes
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    """Byte code is cached even where ``PYTHONDONTWRITEBYTECODE`` is set (this machine sets it): without the
    cache each pytest worker compiles and rewrites every test module as it collects (9 s against 4 s), and
    every broker, CLI and Spark worker process compiles metaq's modules again (0.15 s of CPU a broker start,
    ~430 starts). The controller compiles the packages once; the workers write their rewritten tests."""
    sys.dont_write_bytecode = False
    _signals_as_in_a_terminal()
    from metaq_broker.devtools import sparkhome, zygote
    sparkhome.use()  # Spark's Python workers import the installed pyspark, not the wheel's zip: ~half their CPU
    if os.environ.get("METAQ_TEST_ZYGOTE") != "0":  # brokers forked from a warm interpreter (zygote.py): ~0.45
        zygote.enable()                             # CPU-s and ~0.3 s less a start; 0: each started by exec
    _spark_drivers_as_the_tests_own()
    if not hasattr(config, "workerinput"):
        for package in ("metaq_broker", "metaq_spark"):
            compileall.compile_dir(ROOT / package, quiet=1)
        _make_jvm_archives(config)


def _spark_drivers_as_the_tests_own() -> None:
    """Spark drivers the tests start as a user does (``metaq quickstart``, the notebook, a script's own
    session) run with the JVM flags of the tests' sessions (``spark_helpers.spark_builder``): C1 only, the
    serial collector, the drivers' class-data archive, through ``SPARK_SUBMIT_OPTS``, which spark-submit
    adds to a driver's options. They change how the JVM compiles, collects and loads classes, not what
    Spark does; measured, the quickstart and notebook tests: 84 -> 51 busy CPU-s, 55 -> 40 s."""
    from spark_helpers import driver_options
    os.environ.setdefault("SPARK_SUBMIT_OPTS", driver_options())


def _signals_as_in_a_terminal() -> None:
    """A run started in the background by a script (``pytest ... &``) has SIGINT and SIGQUIT ignored (POSIX,
    for a shell without job control), and so has every command a test starts and then stops with a
    user's Ctrl-C: it never stops (stop 38's runs, until a worker's first SparkSession installed a
    handler; the commands started after it had SIGINT back). The tests run as a command in a terminal."""
    for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGQUIT, signal.SIG_DFL)):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, default)


def _make_jvm_archives(config) -> None:
    """The controller of a run that starts JVMs (not ``-m unit``) makes this machine's class-data archives
    in the background if one is missing (jvm_archives.py; ~45 CPU-s once per machine, JDK and pyspark): a
    ZooKeeper then starts on 0.7 CPU-s instead of 1.1, a Spark driver on 5 instead of 10.5. JVMs started
    before they are made run without. ``pytest_unconfigure`` waits for it (bounded)."""
    from metaq_broker.devtools import jvm, zookeeper
    if config.getoption("markexpr", "").strip() == "unit" or not zookeeper.java_available():
        return
    from spark_helpers import driver_archive
    if zookeeper.archive().is_file() and driver_archive().is_file():
        return
    log = jvm.cache_dir() / "jvm_archives.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        config._jvm_archives = subprocess.Popen([sys.executable, str(ROOT / "tests" / "jvm_archives.py")],
                                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def pytest_unconfigure(config):
    maker = getattr(config, "_jvm_archives", None)
    if maker is not None:
        try:
            maker.wait(180)
        except subprocess.TimeoutExpired:
            os.killpg(maker.pid, 9)
            maker.wait()


# fixture -> the lane of every test that uses it (directly or through other fixtures)
NEEDS = {"zookeeper": "process", "own_zookeeper": "process", "cluster": "process", "spark": "spark",
         "spark_sessions": "spark",
         "browser": "browser"}
LANES = ("unit", "process", "spark", "browser")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config, items):
    problems, lanes_of = {}, {}
    for item in items:
        own = {m.name for m in item.own_markers if m.name in LANES}
        declared = own if "unit" in own else {m.name for m in item.iter_markers() if m.name in LANES}
        needed = {NEEDS[f] for f in item.fixturenames if f in NEEDS}
        lanes = declared | needed
        if not lanes:
            problems.setdefault(item.nodeid.split("::")[0], []).append(f"{item.name} has no lane")
        elif "unit" in own and needed:
            problems.setdefault(item.nodeid.split("::")[0], []).append(
                f"{item.name} is marked unit but uses {', '.join(sorted(needed))} fixtures")
        lanes_of[item] = lanes - {"unit"} if lanes - {"unit"} else lanes
    if problems:
        raise pytest.UsageError("every test needs a lane (pytestmark = pytest.mark.unit, or process, spark, "
                                "browser; see tests/conftest.py):\n" + "\n".join(
                                    f"  {path}: {'; '.join(found[:3])}" + (f" (and {len(found) - 3} more)"
                                                                           if len(found) > 3 else "")
                                    for path, found in problems.items()))
    # The lanes move from modules and classes onto each test, so that -m selects by the test's own.
    for node in {n for item in items for n in item.listchain()}:
        node.own_markers[:] = [m for m in node.own_markers if m.name not in LANES]
    for item, lanes in lanes_of.items():
        for lane in sorted(lanes):
            item.add_marker(lane)
        if lanes != {"unit"} and _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(_group(item.module)))


def _group(module) -> str:
    """The xdist group of a module's tests that share its fixtures: the module; the modules whose Spark
    master is not the default (``SPARK_MASTER``, see ``spark``) form one group per master, so one worker
    starts their session once for them all (a switch of master stops the worker's SparkContext and starts
    another; spread over the workers, the three local[2,4] modules caused several a run)."""
    master = getattr(module, "SPARK_MASTER", None)
    # no "]" in a name: xdist takes a node id's "@name" for its group only after the id's last "]" (a
    # parameter's), so "spark local[2,4]" was no group, and its tests went to every worker (stop 39)
    return f"spark {master.replace('[', '(').replace(']', ')')}" if master else module.__name__


def _uses_a_module_fixture(item) -> bool:
    """The test shares a module-scoped fixture (a broker group, a SparkSession, a browser): with
    ``--dist loadgroup`` (README's command) its module's tests run on one worker, in file order, so the
    fixture is built once and no test finds the state another worker's tests were to leave (stop 31's CI
    failure: a module's transactions settled by tests sent elsewhere)."""
    return any(defs[-1].scope == "module" for defs in item._fixtureinfo.name2fixturedefs.values())


NO_SKIPS = "METAQ_TESTS_NO_SKIPS"  # set by .ci/run: there every test must run


def _fail_a_skip(report) -> None:
    """Where ``METAQ_TESTS_NO_SKIPS`` is set (CI, which installs every tool the tests need), a skipped test
    or module fails naming why it would have skipped: a skip there hides what the test was to show.
    Elsewhere the tests that need Chromium, node or kcat skip saying how to get them."""
    if report.skipped and os.environ.get(NO_SKIPS) and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped where every test must run ({NO_SKIPS} is set): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    _fail_a_skip((yield).get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips as it is collected (``importorskip``, ``pytest.skip(allow_module_level=True)``)."""
    _fail_a_skip((yield).get_result())


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
import signal  # noqa: E402
import time  # noqa: E402

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
def own_zookeeper(tmp_path):
    """A ZooKeeper of the test's own, for tests that stop, restart or empty it (the shared one stays up)."""
    from metaq_broker.devtools.zookeeper import LocalZooKeeper
    zk = LocalZooKeeper(data_dir=tmp_path / "zk", tick_time_ms=500).start()
    yield zk
    zk.stop()


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """One throwaway PKI for the run (tests/certs.py): a CA, broker and client certificates, and the bad
    cases (expired, another host's, a stranger CA's). Tests read its files; none changes them."""
    from certs import make_pki
    return make_pki(tmp_path_factory.mktemp("pki"))


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
    """``predicate()``'s first true value, asked every ``interval`` s, or at least 3 times as long as it
    took to answer: a check that opens a client (a ZooKeeper session, a channel) is not a busy loop on the
    two cores the suite shares."""
    deadline = time.monotonic() + timeout
    while True:
        asked = time.monotonic()
        value = predicate()
        if value:
            return value
        now = time.monotonic()
        if now > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(max(interval, 3 * (now - asked)))


def process_states(pids) -> dict:
    """{pid: its state letter from /proc (T: stopped, R/S/D: running or waiting, gone)}: a test that froze
    processes says whether they were still frozen when something it asserts went otherwise."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                out[pid] = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            out[pid] = "gone"
    return out


SYS_TGKILL = {"x86_64": 234, "aarch64": 131}[platform.machine()]


def _signal_state(pid: int) -> str:
    """Where a process's signals stand (/proc: pending, blocked, ignored, caught, as hexadecimal masks; and
    each thread's pending and blocked): what a SIGINT that was not acted on became."""
    def fields(path):
        try:
            with open(path) as f:
                return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}
        except OSError:
            return {}
    threads = []
    for task in sorted(os.listdir(f"/proc/{pid}/task")) if os.path.isdir(f"/proc/{pid}/task") else []:
        t = fields(f"/proc/{pid}/task/{task}/status")
        threads.append(f"{task}: pnd {t.get('SigPnd')} blk {t.get('SigBlk')}")
    whole = fields(f"/proc/{pid}/status")
    return (f"shared pending {whole.get('ShdPnd')}, ignored {whole.get('SigIgn')}, caught {whole.get('SigCgt')}; "
            f"threads {'; '.join(threads)}")


def interrupt(procs, timeout: float = 30.0, to_a_side_thread: bool = False) -> list:
    """SIGINT ``procs`` (``metaq`` commands, Popen with pipes) as a user's Ctrl-C; [(stdout, stderr)] once
    all exited. One still running after ``timeout`` fails the test with the stack of each of its threads
    (the commands dump them on SIGUSR1), so a hang says where it waits. The kernel hands a process's
    signal to any of its threads; ``to_a_side_thread`` hands it to one that is not the main thread
    (tgkill), where Python's handler cannot wake a main thread that waits without a timeout."""
    for p in procs:
        if to_a_side_thread:
            side = next(int(t) for t in sorted(os.listdir(f"/proc/{p.pid}/task")) if int(t) != p.pid)
            if ctypes.CDLL(None, use_errno=True).syscall(SYS_TGKILL, p.pid, side, signal.SIGINT) != 0:
                raise OSError(ctypes.get_errno(), f"tgkill {p.pid} {side}")
        else:
            p.send_signal(signal.SIGINT)
    deadline, outs, hung = time.monotonic() + timeout, [], []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            signals = _signal_state(p.pid)
            p.send_signal(signal.SIGUSR1)
            time.sleep(1)
            p.kill()
            out, err = p.communicate()
            outs.append((out, err))
            hung.append(f"pid {p.pid} {p.args[-6:]} ({signals}):\n{err.decode(errors='replace')[-6000:]}")
    assert not hung, f"still running {timeout:g}s after SIGINT:\n" + "\n".join(hung)
    return outs


@pytest.fixture(scope="session")
def spark_sessions():
    """The worker's one SparkSession (tests/spark_helpers.SharedSpark), stopped at the end."""
    from spark_helpers import SharedSpark
    shared = SharedSpark()
    yield shared
    shared.stop()


@pytest.fixture(scope="module")
def spark(spark_sessions, request):
    """A loopback-only SparkSession with the metaq source registered, lent to one test module at a time:
    local[2], or the master the module names in ``SPARK_MASTER`` (``local[2,4]``: a failed task is tried up
    to 4 times, as on a cluster). A worker's session has one master; the modules naming another run on
    one worker, one after another (``_group``), so the workers do not start a session for each switch."""
    with spark_sessions.use(getattr(request.module, "SPARK_MASTER", "local[2]")) as session:
        yield session


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (tests/webconsole.py), one per test module; without Debian's chromium and
    chromium-driver the tests using it are skipped, saying how to get them."""
    from webconsole import chromium
    with chromium() as driver:
        yield driver


# -- small disks that fill up ----------------------------------------------------------------------------


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
