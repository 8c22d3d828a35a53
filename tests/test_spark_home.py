"""The development runs' SPARK_HOME (metaq_broker/devtools/sparkhome.py): the wheel's SPARK_HOME but its
python/ zips, made once and in one piece, and Spark's Python workers importing the installed pyspark from
it, compiled, instead of the zip they would compile at every start."""
import os
from pathlib import Path

import pytest

from metaq_broker.devtools import sparkhome

pytestmark = pytest.mark.unit


def test_the_home_links_everything_of_the_wheel_but_its_python_zips(tmp_path, monkeypatch):
    monkeypatch.setenv("METAQ_JVM_CACHE", str(tmp_path))
    wheel = sparkhome.wheel_home()
    home = sparkhome.spark_home()
    assert home.parent == tmp_path
    assert sorted(os.listdir(home)) == sorted(e for e in os.listdir(wheel) if e != "python")
    assert (wheel / "python" / "lib" / "pyspark.zip").is_file()  # what it leaves out exists in the wheel
    for entry in ("bin", "jars"):
        assert (home / entry).resolve() == wheel / entry
    assert os.access(home / "bin" / "spark-submit", os.X_OK)
    assert sparkhome.spark_home() == home  # made once
    assert os.listdir(tmp_path) == [home.name]  # and no partial directory left behind


def test_a_maker_killed_halfway_leaves_nothing_in_the_way(tmp_path, monkeypatch):
    monkeypatch.setenv("METAQ_JVM_CACHE", str(tmp_path))
    name = sparkhome.spark_home().name
    os.rename(tmp_path / name, tmp_path / f".{name}.{os.getpid()}.partial")  # as a killed maker leaves it
    (tmp_path / f".{name}.{os.getpid()}.partial" / "bin").unlink()
    home = sparkhome.spark_home()
    assert (home / "bin" / "spark-submit").is_file()
    assert os.listdir(tmp_path) == [name]


def test_use_keeps_a_spark_home_already_chosen(tmp_path, monkeypatch):
    monkeypatch.setenv("METAQ_JVM_CACHE", str(tmp_path))
    monkeypatch.setenv("SPARK_HOME", "/opt/spark")
    sparkhome.use()
    assert os.environ["SPARK_HOME"] == "/opt/spark"
    assert sparkhome.spark_jars() == Path("/opt/spark/jars")
    monkeypatch.delenv("SPARK_HOME")
    sparkhome.use()
    assert os.environ["SPARK_HOME"] == str(sparkhome.spark_home())
    assert sparkhome.spark_jars().resolve() == sparkhome.wheel_home() / "jars"


@pytest.mark.spark
def test_python_workers_import_the_installed_pyspark(spark):
    """Without the home, a worker's pyspark is .../pyspark/python/lib/pyspark.zip/pyspark/__init__.py."""
    import pyspark

    def where(_):
        import pyspark as worker_pyspark
        import sys
        return worker_pyspark.__file__, [p for p in sys.path if p.endswith(".zip")]

    (worker_file, zips), = spark.sparkContext.parallelize([0], 1).map(where).collect()
    assert worker_file == pyspark.__file__
    assert ".zip" not in worker_file
    assert all(not os.path.exists(z) for z in zips)  # Spark still names its zip; nothing is there
