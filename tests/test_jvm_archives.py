"""Class-data archives of the development JVMs (metaq_broker/devtools/jvm.py): named for exactly the JDK,
jars and flags they were made with, renamed into place only when complete, mapped by the JVMs that use
them, and never in the way: a JVM given a broken archive starts without it and says nothing."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from metaq_broker.devtools import jvm, zookeeper

pytestmark = pytest.mark.unit


def _jars(tmp_path) -> Path:
    jars = tmp_path / "jars"
    jars.mkdir()
    for name in ("a.jar", "b.jar"):
        (jars / name).write_bytes(b"x" * 10)
    return jars


def test_an_archive_is_named_for_its_jdk_jars_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("METAQ_JVM_CACHE", str(tmp_path / "cache"))
    jars = _jars(tmp_path)
    java = sys.executable  # any executable: its identity is what goes into the name
    first = jvm.archive_path("zookeeper", java, jars, ("-Xmx256m",))
    assert first == jvm.archive_path("zookeeper", java, jars, ("-Xmx256m",))
    assert first.parent == tmp_path / "cache" and first.name.startswith("zookeeper-")
    others = {jvm.archive_path("spark-driver", java, jars, ("-Xmx256m",)),
              jvm.archive_path("zookeeper", java, jars, ("-Xmx512m",)),
              jvm.archive_path("zookeeper", "/bin/sh", jars, ("-Xmx256m",))}
    (jars / "b.jar").write_bytes(b"y" * 11)  # an upgraded jar
    others.add(jvm.archive_path("zookeeper", java, jars, ("-Xmx256m",)))
    (jars / "c.jar").write_bytes(b"z")  # a jar more
    others.add(jvm.archive_path("zookeeper", java, jars, ("-Xmx256m",)))
    assert first not in others and len(others) == 5


def test_only_a_complete_archive_is_put_in_place(tmp_path):
    archive = tmp_path / "cache" / "kind-0.jsa"
    assert jvm.sharing_options(archive) == []
    assert not jvm.make(archive, lambda flags: None)  # the JVM wrote nothing (killed, or no CDS)
    assert not archive.exists() and list(archive.parent.iterdir()) == []

    def crashes(flags):
        Path(flags[0].split("=", 1)[1]).write_bytes(b"half")
        raise subprocess.CalledProcessError(1, "java")
    with pytest.raises(subprocess.CalledProcessError):
        jvm.make(archive, crashes)
    assert list(archive.parent.iterdir()) == []  # no half-written archive anywhere

    seen = []

    def dumps(flags):
        seen.append(flags)
        Path(flags[0].split("=", 1)[1]).write_bytes(b"archive")
    assert jvm.make(archive, dumps)
    assert seen[0][0].startswith("-XX:ArchiveClassesAtExit=") and set(jvm.QUIET) <= set(seen[0])
    assert archive.read_bytes() == b"archive" and list(archive.parent.iterdir()) == [archive]
    assert jvm.make(archive, lambda flags: pytest.fail("made again"))
    assert jvm.sharing_options(archive) == [f"-XX:SharedArchiveFile={archive}", *jvm.QUIET]


def _maps(pid: int, archive: Path) -> bool:
    return str(archive) in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.process
def test_a_zookeeper_maps_its_archive_and_starts_without_a_broken_one(tmp_path, monkeypatch):
    monkeypatch.setenv("METAQ_JVM_CACHE", str(tmp_path / "cache"))
    archive = zookeeper.archive()
    assert archive.parent == tmp_path / "cache" and not archive.exists()
    assert zookeeper.make_archive() and archive.is_file()
    with zookeeper.LocalZooKeeper(data_dir=tmp_path / "zk1") as zk:
        assert _maps(zk.proc.pid, archive)
    archive.chmod(0o644)
    archive.write_bytes(b"not an archive" * 1000)  # damaged, or from another JDK under the same name
    with zookeeper.LocalZooKeeper(data_dir=tmp_path / "zk2") as zk:  # serves: start() checked a session
        assert not _maps(zk.proc.pid, archive)
        log = zk.log_path.read_text(errors="replace")
    assert "cds" not in log.lower() and "shared archive" not in log.lower()


DRIVER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from spark_helpers import driver_archive, spark_builder
    spark = spark_builder("local[1]", "archive-check").getOrCreate()
    spark.range(3).count()
    pid = spark.sparkContext._gateway.proc.pid
    print("MAPPED" if str(driver_archive()) in open(f"/proc/{{pid}}/maps").read() else "NOT MAPPED", flush=True)
    spark.stop()
""")


@pytest.mark.process
@pytest.mark.spark
def test_a_tests_spark_driver_maps_the_drivers_archive():
    """The archive the tests' drivers are given is one their JVM can use (same flags, same classpath): made
    here if the run's background maker has not made it yet."""
    sys.path.insert(0, str(Path(__file__).parent))
    from jvm_archives import make_spark_driver_archive
    assert make_spark_driver_archive()
    out = subprocess.run([sys.executable, "-c", DRIVER.format(tests=str(Path(__file__).parent))],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert "MAPPED" in out.stdout.splitlines(), out.stdout + out.stderr[-3000:]
