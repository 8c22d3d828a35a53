"""What the benchmark scripts share: timestamped progress lines, CPU accounting from /proc, generated
100-byte values, a loopback-only Spark session, and the parts of a run (Spark, a broker, ZooKeeper)
stopped, with its data removed, however the script ends (``teardown``)."""
from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa

from metaq_broker.devtools.process import per_thread

VALUE_SIZE = 100


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cpu_ticks() -> tuple:
    """(busy, idle) CPU ticks of the whole machine so far (all cores, from /proc/stat; iowait counts as idle)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], v[3] + v[4]


def cpu_busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (all cores, from /proc/stat)."""
    return cpu_ticks()[0] / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: Optional[int], system_only: bool = False) -> float:
    """CPU seconds (user + system, or system alone: the kernel's work for it) used so far by one process
    (0 for None)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        v = f.read().rsplit(")", 1)[1].split()
    return ((0 if system_only else int(v[11])) + int(v[12])) / os.sysconf("SC_CLK_TCK")


def _threads_ns(pid: int) -> dict:
    """{thread id: nanoseconds on a CPU} of a process's live threads (/proc/PID/task/TID/schedstat)."""
    return per_thread(pid, "schedstat", lambda text: int(text.split()[0]))


class CpuMeter:
    """CPU seconds one process uses from ``CpuMeter(pid)`` to ``seconds()``, summed over its threads'
    schedstat nanoseconds: /proc/PID/stat counts 10 ms ticks, so a case that costs the broker 50 ms read
    +-20 %. A thread that ended in between takes its nanoseconds with it: when the ticks (which keep an
    ended thread's time) say more than two ticks beyond the sum, or there is no schedstat, they are used.
    ``since_start``: from the process's start (or its fork) instead."""

    def __init__(self, pid: int, since_start: bool = False):
        self.pid = pid
        self._ticks, self._ns = (0.0, {}) if since_start else (proc_cpu_s(pid), _threads_ns(pid))

    def seconds(self) -> float:
        ns, ticks = _threads_ns(self.pid), proc_cpu_s(self.pid) - self._ticks
        precise = sum(v - self._ns.get(t, 0) for t, v in ns.items()) / 1e9
        return ticks if not ns or ticks - precise > 2 / os.sysconf("SC_CLK_TCK") else precise


def values_array(start: int, n: int) -> pa.Array:
    """n binary values of VALUE_SIZE bytes; value i starts with its 8-byte little-endian index."""
    buf = np.zeros((n, VALUE_SIZE), dtype=np.uint8)
    buf[:, 8:] = np.frombuffer(b"metaq-spark-bench-" * 6, dtype=np.uint8)[:VALUE_SIZE - 8]
    buf[:, :8] = np.arange(start, start + n, dtype="<i8").view(np.uint8).reshape(n, 8)
    offsets = np.arange(n + 1, dtype=np.int32) * VALUE_SIZE
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(buf.reshape(-1))])


def make_spark(tmp: Path, driver_memory: str, app: str, **conf):
    """local[2] on loopback, no UI or progress bars, scratch space under ``tmp``; ``conf`` adds settings."""
    from pyspark.sql import SparkSession  # lazy: pyspark starts slowly, and only the Spark benchmarks need it
    builder = (SparkSession.builder.master("local[2]").appName(app)
               .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.memory", driver_memory).config("spark.local.dir", str(tmp / "spark-local"))
               .config("spark.sql.shuffle.partitions", "2"))
    for key, value in conf.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def best_of(cases: list, runs: int, broker_pid=None, rows: Optional[int] = None) -> dict:
    """Each case once untimed, then ``runs`` rounds timing every case in turn; the best run of each, with
    the machine's and the broker's CPU seconds (and the broker's system share). ``broker_pid`` is one
    broker's pid or {case name: pid} where cases use different brokers. A case returns its row count
    unless ``rows`` gives it."""
    out = {}
    for name, fn in cases:
        log(f"{name}: warm-up")
        t0 = time.perf_counter()
        done = fn()
        out[name] = {"name": name, "rows": rows if rows is not None else done, "warmup_s": time.perf_counter() - t0,
                     "times_s": [], "machine_cpu_s_all": [], "broker_cpu_s_all": [],
                     "broker_system_s_all": []}
    for i in range(runs):
        for name, fn in cases:
            r = out[name]
            pid = broker_pid.get(name) if isinstance(broker_pid, dict) else broker_pid
            c0, b0, k0, t0 = cpu_busy_s(), proc_cpu_s(pid), proc_cpu_s(pid, True), time.perf_counter()
            fn()
            r["times_s"].append(time.perf_counter() - t0)
            r["machine_cpu_s_all"].append(cpu_busy_s() - c0)
            r["broker_cpu_s_all"].append(proc_cpu_s(pid) - b0)
            r["broker_system_s_all"].append(proc_cpu_s(pid, True) - k0)
            log(f"  {name} run {i + 1}: {r['times_s'][-1]:.2f} s  {r['rows'] / r['times_s'][-1]:,.0f} rows/s  "
                f"machine cpu {r['machine_cpu_s_all'][-1]:.1f} s, broker cpu {r['broker_cpu_s_all'][-1]:.1f} s")
    for r in out.values():
        k = min(range(len(r["times_s"])), key=r["times_s"].__getitem__)
        r.update(best_s=r["times_s"][k], rows_per_s=r["rows"] / r["times_s"][k],
                 machine_cpu_s=r["machine_cpu_s_all"][k], broker_cpu_s=r["broker_cpu_s_all"][k],
                 broker_system_s=r["broker_system_s_all"][k])
    return out


def teardown(tmp: Path, *parts) -> None:
    """Stop each of ``parts`` that was started (a SparkSession, a broker, ZooKeeper: in that order) and
    remove ``tmp``; never raises, so it fits a ``finally``."""
    for part in parts:
        if part is not None:
            with contextlib.suppress(Exception):
                part.stop()
    shutil.rmtree(tmp, ignore_errors=True)


def add_common_options(ap, driver_memory: str) -> None:
    ap.add_argument("--driver-memory", default=driver_memory)
    ap.add_argument("--dir", default=str(Path(__file__).resolve().parent / ".bench-data"),
                    help="where the run's scratch directory is made (removed at the end)")
    ap.add_argument("--json", default=None, help="write results as JSON to this path")


def scratch_dir(parent: str, prefix: str) -> Path:
    Path(parent).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def run_facts(**facts) -> dict:
    """The results dict a benchmark fills: its own facts, the machine's, and an empty ``cases``."""
    return {**facts, "python": platform.python_version(), "cpus": os.cpu_count(), "cases": {}}


def write_json(path: Optional[str], results: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=2))
        log(f"results written to {path}")
