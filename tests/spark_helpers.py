"""Helpers shared by the Spark tests: a loopback-only SparkSession with metaq registered, filling topics,
building readers, and running AvailableNow queries."""
import contextlib
import os
import sys

from conftest import wait_until

from metaq_broker.client.producer import Producer
from metaq_broker.devtools import jvm, sparkhome
from metaq_broker.devtools.zookeeper import LIGHT_JVM, java_executable

os.environ["PYSPARK_PYTHON"] = sys.executable
sparkhome.use()  # Python workers import the installed pyspark, not the wheel's zip (sparkhome.py)
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"  # loopback only


# A test's JVM lives for minutes on a busy machine: LIGHT_JVM's flags cost the Spark modules ~16% less CPU
# (measured: test_spark_source*.py, 183 -> 154 CPU-s), which the whole suite's two cores feel
JVM_OPTIONS = " ".join(LIGHT_JVM)


def driver_archive():
    """The class-data archive of the tests' Spark drivers (``devtools/jvm.py``; made by jvm_archives.py): a
    driver's start, first job and stop cost 10.5 CPU-s without it and 5 with it."""
    return jvm.archive_path("spark-driver", java_executable() or "java", sparkhome.spark_jars(), LIGHT_JVM)


def driver_options(driver_flags=()) -> str:
    """The tests' Spark drivers' JVM flags: LIGHT_JVM's and ``driver_flags`` (jvm_archives.py's), else those
    mapping the drivers' archive (also what conftest hands the drivers started as a user does)."""
    return " ".join([*LIGHT_JVM, *(driver_flags or jvm.sharing_options(driver_archive()))])


def spark_builder(master="local[2]", app="metaq-tests", driver_flags=()):
    """The tests' session builder; ``driver_flags`` are added to the driver JVM's (jvm_archives.py's)."""
    from pyspark.sql import SparkSession
    return (SparkSession.builder.master(master).appName(app)
            .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1").config("spark.sql.shuffle.partitions", "2")
            .config("spark.driver.extraJavaOptions", driver_options(driver_flags))
            .config("spark.executor.extraJavaOptions", JVM_OPTIONS))


def metaq_session(master="local[2]", app="metaq-tests"):
    """``spark_builder``'s session with the metaq source registered and Spark's own logging at ERROR: what
    every test module's ``spark`` fixture yields."""
    import metaq_spark
    session = spark_builder(master, app).getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    metaq_spark.register(session)
    return session


class SharedSpark:
    """One SparkSession per test worker, lent to the test modules in turn: starting a JVM and warming it up
    costs ~10 CPU-s (measured: start, one job, stop), and ~20 modules each started their own. A module asking
    for another master gets a new session (the old one is stopped: one SparkContext per process); so does
    one after a test stopped the session (the local-cluster test does). ``use`` gives it back as a fresh
    one would be: the module's streaming queries stopped, the SQL settings it changed reset, its temporary
    views (memory sinks' tables) dropped."""

    def __init__(self):
        self._session, self._master, self._settings = None, None, {}

    @contextlib.contextmanager
    def use(self, master="local[2]"):
        session = self._session_on(master)
        try:
            yield session
        finally:
            if _running(session):  # the module did not stop it
                for q in session.streams.active:
                    q.stop()
                for key, value in session.conf.getAll.items():
                    if key not in self._settings:
                        session.conf.unset(key)
                    elif value != self._settings[key]:
                        session.conf.set(key, self._settings[key])
                for table in session.catalog.listTables():
                    if table.isTemporary:
                        session.catalog.dropTempView(table.name)

    def _session_on(self, master):
        from pyspark import SparkContext
        current = self._session
        if current is not None and _running(current) and self._master == master:
            return current
        self.stop()
        if SparkContext._active_spark_context is not None:  # a test's own session, left running
            SparkContext._active_spark_context.stop()
        self._session, self._master = metaq_session(master), master
        self._settings = dict(self._session.conf.getAll)
        return self._session

    def stop(self):
        if self._session is not None and _running(self._session):
            self._session.stop()
        self._session = None


def _running(session) -> bool:
    """The session's SparkContext is not stopped (``stop`` drops its Java context)."""
    return session.sparkContext._jsc is not None


def fill(cluster, topic, per_partition, partitions, batch=1000):
    with cluster.client(Producer) as producer:
        wait_until(lambda: len(producer.cluster.topic_partitions(topic)) == len(partitions), what=f"{topic}")
        for p in partitions:
            values = [b"%s:%d" % (p.encode(), i) for i in range(per_partition)]
            for i in range(0, per_partition, batch):
                producer.send_batch(topic, values[i: i + batch], partition=p)


def reader(spark, cluster, streaming=False, **options):
    r = (spark.readStream if streaming else spark.read).format("metaq")
    r = r.option("metaq.zk.connect", cluster.zk_connect).option("metaq.zk.root", cluster.zk_root)
    for k, v in options.items():
        r = r.option(k, v)
    return r.load()


def run_available_now(df, checkpoint, name=None, path=None):
    """Run to the end of what is there now into a memory table ``name`` or Parquet files at ``path``
    (which, unlike memory, restarts from its checkpoint); returns each batch's row count."""
    w = df.writeStream.option("checkpointLocation", str(checkpoint)).trigger(availableNow=True)
    w = w.format("memory").queryName(name) if path is None else w.format("parquet").option("path", str(path))
    q = w.start()
    q.awaitTermination(180)
    assert q.exception() is None, q.exception()
    return [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
