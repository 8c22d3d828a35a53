"""Make this machine's class-data archives for the tests' JVMs (``metaq_broker/devtools/jvm.py``) unless
they exist: ZooKeeper's, and the Spark driver's from a short job that loads what the tests' drivers load
(SQL, a Python UDF, Arrow, a Python data source, a streaming query). The controller of a test run starts
this in the background when one is missing (conftest.py); JVMs started before it is done run without.

    python tests/jvm_archives.py
"""
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

DUMP_JOB = """
import sys
sys.path.insert(0, {tests!r})
from spark_helpers import spark_builder
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
import pyspark.sql.functions as F

class Numbers(DataSource):
    @classmethod
    def name(cls):
        return "archive_numbers"
    def schema(self):
        return "n long"
    def reader(self, schema):
        return NumbersReader()

class NumbersReader(DataSourceReader):
    def partitions(self):
        return [InputPartition(0), InputPartition(1)]
    def read(self, partition):
        for i in range(10):
            yield (i,)

spark = spark_builder("local[2]", "jvm-archive", driver_flags={flags!r}).getOrCreate()
spark.dataSource.register(Numbers)
df = spark.read.format("archive_numbers").load()
df.select(F.udf(lambda n: n + 1, "long")("n").alias("m")).groupBy().sum("m").collect()
df.toArrow()
q = spark.readStream.format("rate").load().writeStream.format("memory").queryName("archive").trigger(once=True).start()
q.awaitTermination(60)
spark.stop()
from pyspark import SparkContext
jvm = SparkContext._gateway.proc  # the JVM writes the archive as it exits: once its stdin closes
jvm.stdin.close()
jvm.wait(120)
"""


def make_spark_driver_archive() -> bool:
    from metaq_broker.devtools import jvm
    from spark_helpers import driver_archive

    def run(flags):
        job = DUMP_JOB.format(tests=str(TESTS), flags=tuple(flags))
        env = {k: v for k, v in os.environ.items() if k != "SPARK_SUBMIT_OPTS"}  # the flags are ``flags``
        subprocess.run([sys.executable, "-c", job], check=True, timeout=300, stdout=subprocess.DEVNULL, env=env)
    return jvm.make(driver_archive(), run)


def main() -> int:
    from metaq_broker.devtools import zookeeper
    made = {"zookeeper": zookeeper.make_archive(), "spark-driver": make_spark_driver_archive()}
    print(", ".join(f"{kind}: {'ready' if ok else 'not made'}" for kind, ok in made.items()))
    return 0 if all(made.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
