"""benchmarks/suite_census.py, the tool behind issue 26's figures: it names each kind of process the suite
starts, and it charges a process's CPU to the test module that started it, measured for real on a pytest
run whose one test burns a known amount of CPU in a child process."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.suite_census import kind  # noqa: E402

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent
JAVA = "/usr/lib/jvm/java-17-openjdk-amd64/bin/java"
PY = "/usr/bin/python3"


@pytest.mark.parametrize("argv,parent,expected", [
    ([JAVA, "-cp", "/x/jars/*", "org.apache.zookeeper.server.ZooKeeperServerMain", "2181"], [], "ZooKeeper JVM"),
    ([JAVA, "-cp", "/x", "org.apache.spark.deploy.SparkSubmit", "pyspark-shell"], [PY], "Spark driver JVM"),
    ([JAVA, "org.apache.spark.executor.CoarseGrainedExecutorBackend"], [JAVA], "Spark executor JVM"),
    ([JAVA, "-version"], [], "other JVM"),
    ([PY, "-m", "pyspark.daemon", "pyspark.worker"], [JAVA, "SparkSubmit"], "Spark Python daemon"),
    ([PY, "-m", "pyspark.daemon", "pyspark.worker"], [PY, "-m", "pyspark.daemon"], "Spark Python worker"),
    ([PY, "-m", "pyspark.sql.streaming.python_streaming_source_runner"], [JAVA], "Spark streaming source runner"),
    ([PY, "-m", "metaq_broker.devtools.zygote", "metaq_broker.server.main", "/s"], [PY], "broker forked from a zygote"),
    ([PY, "-m", "metaq_broker.server.main", "--config", "b.ini"], [PY], "broker started by exec"),
    ([PY, "-c", "import sys;exec(eval(sys.stdin.readline()))"], [PY], "pytest worker"),
    ([PY, "-m", "pytest", "-n", "4"], [], "pytest"),
    (["/usr/lib/chromium/chromium", "--headless"], [], "Chromium"),
    ([PY, "-m", "metaq_broker.tools.cli", "topics"], [PY], "other Python"),
    (["/usr/bin/kcat", "-L"], [PY], "kcat"),
])
def test_each_kind_of_process_is_named(argv, parent, expected):
    assert kind(argv, parent) == expected


BURN = textwrap.dedent("""
    import subprocess, sys

    def test_burns_in_a_child():  # a shell first (as spark-submit is), then Python in its place
        subprocess.run(["bash", "-c", 'sleep 0.6; exec "$0" -c "$1"', sys.executable,
                        "import time\\nend = time.process_time() + 1.5\\nwhile time.process_time() < end: pass"],
                       check=True)
""")


@pytest.mark.process
def test_a_childs_cpu_is_charged_to_the_module_that_started_it(tmp_path):
    (tmp_path / "test_burner.py").write_text(BURN)
    out = tmp_path / "census.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.suite_census", "--workers", "1", "--json", str(out), "--",
                        "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    figures = json.loads(out.read_text())
    burner = [kinds for module, kinds in figures["by_module"].items() if module.endswith("test_burner.py")]
    assert burner, figures["by_module"]
    # 1.5 CPU-s, less the last sample's share, charged to the Python the shell became (kinds with a share of
    # a tick or more; bash's sleep costs none)
    assert {k for k, cpu in burner[0].items() if cpu >= 0.01} == {"other Python"}, burner
    assert 1.2 <= burner[0]["other Python"] <= 2.0, burner
    assert figures["by_kind"]["pytest worker"]["processes"] >= 1
    assert figures["busy_cpu_s"] >= 1.2 and figures["wall_s"] > 0
    assert "| kind | CPU-s | processes |" in r.stdout and "test_burner.py" in r.stdout
