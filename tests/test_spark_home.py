"""The development runs' SPARK_HOME (metaq_broker/devtools/sparkhome.py): the wheel's SPARK_HOME but its
python/ zips, made once and in one piece, and Spark's Python workers importing the installed pyspark from
it, compiled, instead of the zip they would compile at every start."""
import os
import sys
from pathlib import Path

import pytest

from metaq_broker.devtools import sparkhome

pytestmark = pytest.mark.unit


def test_the_home_links_everything_of_the_wheel_but_its_python_zips(tmp_path, monkeypatch):
    monkeypatch.setenv("METAQ_JVM_CACHE", str(tmp_path))
    wheel = sparkhome.wheel_home()
    home = sparkhome.spark_home()
    assert home.parent == tmp_path
    assert sorted(os.listdir(home)) == sorted(e for e in os.listdir(wheel) if e not in ("python", "work", "__pycache__"))
    assert (wheel / "python" / "lib" / "pyspark.zip").is_file()  # what it leaves out exists in the wheel
    for entry in ("bin", "jars"):
        assert (home / entry).resolve() == wheel / entry
    assert os.access(home / "bin" / "spark-submit", os.X_OK)
    assert sparkhome.spark_home() == home  # made once
    assert os.listdir(tmp_path) == [home.name]  # and no partial directory left behind


def test_a_maker_killed_halfway_leaves_nothing_in_the_way(tmp_path, monkeypatch):
    monkeypatch.setenv("METAQ_JVM_CACHE", str(tmp_path))
    name = sparkhome.spark_home().name
    stale = tmp_path / f".{name}.killed"
    os.rename(tmp_path / name, stale)  # as a maker killed before its rename leaves its temporary directory
    (stale / "bin").unlink()
    home = sparkhome.spark_home()
    assert (home / "bin" / "spark-submit").is_file()
    assert sorted(os.listdir(tmp_path)) == sorted([name, stale.name])  # this maker's own temporary one is gone


def test_a_home_that_cannot_be_made_leaves_spark_as_it_was(tmp_path, monkeypatch, caplog):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("METAQ_JVM_CACHE", str(tmp_path / "a-file" / "cache"))  # mkdir fails: not a directory
    monkeypatch.delenv("SPARK_HOME", raising=False)
    sparkhome.use()
    assert "SPARK_HOME" not in os.environ
    assert "no SPARK_HOME of compiled pyspark" in caplog.text


def test_only_a_wheel_with_spark_beside_it_is_a_home(tmp_path, monkeypatch):
    """A pyspark from a Spark source tree (no bin/ or jars/ beside the package) is left to find its own."""
    package = tmp_path / "src" / "pyspark"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.delitem(sys.modules, "pyspark", raising=False)  # find_spec: the path's, not an imported one
    assert sparkhome.wheel_home() is None and sparkhome.spark_home() is None


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


def test_launching_sets_the_home_for_a_start_and_then_leaves_the_environment_as_it_was(tmp_path, monkeypatch):
    """The quickstart starts Spark in whatever process runs it (a notebook's kernel, too): SPARK_HOME is
    this home while the JVM starts, and afterwards what it was, unset or not."""
    monkeypatch.setenv("METAQ_JVM_CACHE", str(tmp_path))
    monkeypatch.delenv("SPARK_HOME", raising=False)
    with sparkhome.launching():
        assert os.environ["SPARK_HOME"] == str(sparkhome.spark_home())
    assert "SPARK_HOME" not in os.environ
    monkeypatch.setenv("SPARK_HOME", "/opt/spark")
    with sparkhome.launching():
        assert os.environ["SPARK_HOME"] == "/opt/spark"
    assert os.environ["SPARK_HOME"] == "/opt/spark"
