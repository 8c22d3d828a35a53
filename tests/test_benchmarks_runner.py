"""benchmarks/run_all.py: figures out of each benchmark's JSON, the markdown table, the README splice,
failed and missing benchmarks reported as such, a real (quick) run of bench_store through the runner;
and ``metaq produce --count --progress`` drawing its progress bar."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import wait_until

from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import run_all  # noqa: E402

META = {"date": "2030-01-02 03:04 UTC", "command": "python -m benchmarks --quick", "cpus": 2, "commit": "abc1234",
        "machine": "2 CPUs, 8.0 GiB RAM", "software": "Python 3.x, pyspark 4.x", "load_start": 3.5, "load_end": 2.5}

STORE = {"quick": True, "baselines": {
    "start": {"disk_mb_s": 400.0, "fsync_per_s": 4000.0, "memcpy_gb_s": 10.0},
    "end": {"disk_mb_s": 600.0, "fsync_per_s": 2000.0, "memcpy_gb_s": 12.0},
    "mean": {"disk_mb_s": 500.0, "fsync_per_s": 3000.0, "memcpy_gb_s": 11.0}},
    "cases": [
        {"case": "append group 100B b1000 t1", "msgs": 1000, "seconds": 1.0, "msgs_s": 1_000_000.0, "mb_s": 100.0,
         "appends_s": 1000.0, "appends_per_fsync": 1.0, "x_disk": 0.2, "x_fsync": 0.333, "x_memcpy": 0.009},
        {"case": "append group 100B b1 t8", "msgs": 6000, "seconds": 1.0, "msgs_s": 6000.0, "mb_s": 0.6,
         "appends_s": 6000.0, "appends_per_fsync": 3.5, "x_disk": 0.0012, "x_fsync": 2.0, "x_memcpy": 5e-5},
        {"case": "read+decode 100B b1000", "msgs": 5_000_000, "seconds": 1.0, "msgs_s": 5_000_000.0,
         "mb_s": 550.0, "appends_s": None, "appends_per_fsync": None, "x_disk": 1.1, "x_fsync": None,
         "x_memcpy": 0.05}]}


def broker_row(system, op, msgs_s, **kw):
    return {"system": system, "op": op, "value_bytes": 100, "batch": 1000, "msgs": 1000, "calls": 1, "seconds": 1.0,
            "msgs_s": msgs_s, "mb_s": msgs_s / 1e4, "client_cpu": 0.5, "server_cpu": 0.5, "time_capped": False,
            "note": "", **kw}


BROKER = {"quick": True, "rows": [
    broker_row("metaq group", "produce", 400_000.0, note="acks fsynced"),
    broker_row("redis always", "produce", 50_000.0),
    broker_row("metaq unflush1000", "produce", 450_000.0),
    broker_row("redis everysec", "produce", 90_000.0)],
    "skipped": {"nats jetstream": "nats-server not found on PATH"},
    "versions": {"redis always": {"redis-server": "7.0"}}, "limit_s": 0.5, "disk": {}, "durability": {}}

SPARK = {"messages": 1_000_000, "runs": 3, "cases": {
    "metaq batch": {"rows_per_s": 2_000_000.0}, "arrow ceiling": {"rows_per_s": 4_000_000.0},
    "parquet": {"rows_per_s": 8_000_000.0}},
    "ratios": {"metaq batch / arrow ceiling": 0.5, "metaq batch / parquet": 0.25}}


def ok(name, data):
    return {"name": name, "status": "ok", "reason": "", "figures": run_all.figures_of(name, data),
            "notes": run_all.extra_notes(name, data), "skipped": [], "seconds": 12.0,
            "command": f"python benchmarks/{name}.py --quick --json PATH", "tail": ""}


def test_figures_from_each_benchmarks_json():
    store = {f["name"]: f for f in run_all.figures_of("bench_store", STORE)}
    assert store["append group 100B b1000 t1"]["baseline"] == "disk 1MiB+fsync"
    assert store["append group 100B b1000 t1"]["ratio"] == 0.2
    assert store["append group 100B b1 t8"]["baseline"] == "disk 150B+fsync"
    assert store["append group 100B b1 t8"]["unit"] == "appends/s" and store["append group 100B b1 t8"]["ratio"] == 2.0
    assert store["read+decode 100B b1000"]["baseline"] == "memcpy"
    assert store["read+decode 100B b1000"]["baseline_value"] == pytest.approx(11_000.0)

    broker = {(f["name"], f["baseline"]): f for f in run_all.figures_of("bench_broker", BROKER)}
    assert broker["produce 100B b1000 metaq group", "redis always"]["ratio"] == pytest.approx(8.0)
    assert broker["produce 100B b1000 metaq unflush1000", "redis everysec"]["ratio"] == pytest.approx(5.0)
    nats = broker["produce 100B b1000 metaq unflush1000", "nats jetstream"]  # a skipped peer is not dropped
    assert nats["ratio"] is None and "nats-server not found" in nats["note"]

    spark = run_all.figures_of("bench_spark_source", SPARK)
    assert [(f["name"], f["baseline"], f["ratio"]) for f in spark] == [
        ("metaq batch", "arrow ceiling", 0.5), ("metaq batch", "parquet", 0.25)]
    assert spark[0]["value"] == 2_000_000.0 and spark[0]["baseline_value"] == 4_000_000.0

    generic = run_all.figures_of("bench_spark_sink", {"figures": [
        {"name": "metaq sink", "value": 30.0, "unit": "MB/s", "baseline": "parquet", "baseline_value": 60.0}]})
    assert generic[0]["ratio"] == 0.5 and generic[0]["benchmark"] == "bench_spark_sink"
    with pytest.raises(ValueError):
        run_all.figures_of("bench_new", {"something": 1})


def test_markdown_reports_figures_failures_and_missing():
    results = [ok("bench_store", STORE), ok("bench_broker", BROKER), ok("bench_spark_source", SPARK),
               {"name": "bench_crash", "status": "failed", "reason": "exit code 1", "figures": [], "notes": [],
                "skipped": [], "seconds": 3.0, "command": "python benchmarks/bench_crash.py --json PATH",
                "tail": "Traceback (most recent call last):\nRuntimeError: disk on fire"},
               {"name": "bench_spark_sink", "status": "missing", "reason": "bench_spark_sink.py is not in benchmarks",
                "figures": [], "notes": [], "skipped": [], "seconds": None, "command": None, "tail": ""}]
    table = run_all.markdown_table(results)
    lines = table.splitlines()
    assert lines[0].startswith("| benchmark | figure | value |")
    assert "| bench_store | append group 100B b1000 t1 | 100 | MB/s | disk 1MiB+fsync | 500 | 0.20 |" in table
    assert "| bench_broker | produce 100B b1000 metaq group | 400,000 | msgs/s | redis always | 50,000 | 8.00 |" in table
    assert "| bench_spark_source | metaq batch | 2,000,000 | rows/s | parquet | 8,000,000 | 0.25 |" in table
    assert "| bench_crash | **FAILED** |" in table and "| bench_spark_sink | **MISSING** |" in table

    md = run_all.results_markdown(results, META, "results.png")
    assert "`python -m benchmarks --quick`" in md and "2 CPUs" in md and "3.50 at start, 2.50 at end" in md
    assert "1 failed, 1 missing, 3 ok" in md
    assert "### bench_crash: failed" in md and "RuntimeError: disk on fire" in md
    assert "### bench_spark_sink: missing" in md
    assert "![ratios of each figure to its same-run baseline](results.png)" in md
    assert run_all.failed(results) == results[3:]


def test_readme_splice_replaces_only_between_the_markers(tmp_path):
    before = "# title\n\n## Benchmarks\n\nhand-written table\n| a | b |\n\n"
    after = "\n\n## Later section\n\nmore text, edited by someone else\n"
    text = before + run_all.START + "\nold table\nold line\n" + run_all.END + after
    new = run_all.splice(text, "| new | table |\n")
    assert new == before + run_all.START + "\n| new | table |\n" + run_all.END + after
    assert run_all.splice(new, "| new | table |") == new  # idempotent
    assert run_all.splice(before + run_all.START + run_all.END + after, "x") == \
        before + run_all.START + "\nx\n" + run_all.END + after
    for bad in (before + after, before + run_all.START + after, before + run_all.END + "x" + run_all.START + after,
                text + run_all.START + run_all.END):
        with pytest.raises(ValueError):
            run_all.splice(bad, "x")

    readme = tmp_path / "README.md"
    readme.write_text(text, encoding="utf-8")
    block = run_all.readme_block([ok("bench_spark_source", SPARK)], META, "benchmarks/RESULTS.md")
    assert run_all.update_readme(readme, block)
    got = readme.read_text(encoding="utf-8")
    assert got.startswith(before + run_all.START + "\nLatest run of `python -m benchmarks --quick`")
    assert got.endswith(run_all.END + after)
    assert "| bench_spark_source | metaq batch |" in got and "old table" not in got
    assert not run_all.update_readme(readme, block)


def test_selection_expects_the_sink_and_normalises_names():
    names = [n for n, _ in run_all.select(run_all.HERE, None)]
    assert names[:4] == list(run_all.EXPECTED)
    assert [n for n, _ in run_all.select(run_all.HERE, ["store", "bench_broker.py"])] == ["bench_store", "bench_broker"]
    assert run_all.select(run_all.HERE, ["no_such_bench"]) == [("bench_no_such_bench", None)]


def runner(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.process
def test_runner_reports_a_crash_and_a_missing_benchmark_and_goes_on(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "bench_boom.py").write_text("import sys\nprint('about to fail')\nsys.exit('boom: the disk is on fire')\n")
    (bench / "bench_fine.py").write_text(textwrap.dedent("""
        import argparse, json
        ap = argparse.ArgumentParser()
        ap.add_argument("--quick", action="store_true")
        ap.add_argument("--json")
        a = ap.parse_args()
        json.dump({"figures": [{"name": "fine case", "value": 3.0, "unit": "x/s", "baseline": "base",
                                "baseline_value": 2.0, "note": "quick" if a.quick else ""}]}, open(a.json, "w"))
    """))
    (bench / "bench_nojson.py").write_text("print('forgot the json')\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{run_all.START}\n{run_all.END}\nrest\n")
    out = tmp_path / "out"
    r = runner("--quick", "--bench-dir", str(bench), "--only", "boom,fine,nojson,missing", "--log-dir", str(out),
               "--results", str(out / "RESULTS.md"), "--chart", str(out / "results.png"), "--readme", str(readme))
    assert r.returncode == 1, r.stdout + r.stderr
    md = (out / "RESULTS.md").read_text()
    assert "| bench_fine | fine case | 3.00 | x/s | base | 2.00 | 1.50 | quick |" in md
    assert "| bench_boom | **FAILED** |" in md and "boom: the disk is on fire" in md
    assert "| bench_nojson | **FAILED** |" in md and "no usable JSON" in md
    assert "| bench_missing | **MISSING** |" in md
    assert (out / "results.png").stat().st_size > 1000
    assert (out / "bench_boom.log").read_text().count("about to fail") == 1
    text = readme.read_text()
    assert text.startswith(f"intro\n{run_all.START}\nLatest run of `python -m benchmarks --quick --bench-dir")
    assert text.endswith(f"{run_all.END}\nrest\n") and "| bench_fine | fine case |" in text


@pytest.mark.process
@pytest.mark.timeout(180)
def test_runner_runs_bench_store_quick_for_real(tmp_path):
    r = runner("--quick", "--only", "bench_store", "--log-dir", str(tmp_path), "--results", str(tmp_path / "R.md"),
               "--chart", str(tmp_path / "r.png"), "--progress", timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "benchmarks  [" in r.stderr and "1/1" in r.stderr  # the progress bar, drawn although not a terminal
    md = (tmp_path / "R.md").read_text()
    assert "| bench_store | ok |" in md and "| bench_store | append group 100B b1000 t1 |" in md
    assert "| bench_store | read+decode 1024B b1 |" in md and "`python benchmarks/bench_store.py --quick --json PATH`" in md
    assert json.loads((tmp_path / "bench_store.json").read_text())["quick"] is True
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.process
@pytest.mark.timeout(300)
def test_runner_runs_bench_replication_quick_for_real(tmp_path):
    """Groups of one and of three as real processes, a master killed and one frozen: the figures reach the
    table (no figure's value is judged, only that each was measured)."""
    r = runner("--quick", "--only", "bench_replication", "--log-dir", str(tmp_path), "--results",
               str(tmp_path / "R.md"), "--chart", str(tmp_path / "r.png"), "--no-progress", timeout=290)
    assert r.returncode == 0, r.stdout + r.stderr + (tmp_path / "bench_replication.log").read_text()[-3000:]
    data = json.loads((tmp_path / "bench_replication.json").read_text())
    names = {f["name"]: f for f in data["figures"]}
    for case in ("3 members acks=1", "3 members acks=all"):
        assert names[f"produce {case}"]["value"] > 0 and names[f"produce {case}"]["baseline_value"] > 0
    for fault in ("kill -9", "SIGSTOP"):
        failover = names[f"{fault} of the master to the first acknowledged put (worst)"]
        assert failover["baseline"] == "zk.sessionTimeout + 2 s (the bound)" and failover["value"] > 0
        assert data["failovers"][fault][0]["new_master"] != data["failovers"][fault][0]["master"]
    md = (tmp_path / "R.md").read_text()
    assert "| bench_replication | ok |" in md and "| bench_replication | produce 3 members acks=all |" in md


# -- metaq produce --count --progress ---------------------------------------------------------------------
def test_produce_count_with_progress_draws_a_bar_and_sends_exactly_n(cluster):
    cluster.start_broker(1, settings={"numPartitions": 2})
    with cluster.client(Admin) as admin:
        wait_until(lambda: admin.brokers(), what="broker registered")
        admin.create_topic("bars", 2)
    base = [sys.executable, "-m", "metaq_broker.tools.cli", "--zk", cluster.zk_connect, "--zk-root", cluster.zk_root,
            "produce", "bars", "--count", "2500", "--batch", "500", "--size", "20"]
    r = subprocess.run(base + ["--progress"], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert b"producing to bars" in r.stderr and b"[####" in r.stderr and b"100%" in r.stderr
    assert b"\r" in r.stderr and r.stderr.strip().endswith(b"sent 2500 messages to bars")
    r = subprocess.run(base, capture_output=True, timeout=120)  # not a terminal, no --progress: no bar
    assert r.returncode == 0 and r.stderr.strip() == b"sent 2500 messages to bars", r.stderr
    with cluster.client(Consumer) as consumer:
        ranges = consumer.offsets("bars", consumer.partitions("bars"))
    assert sum(end - start for start, end in ranges.values()) == 5000
