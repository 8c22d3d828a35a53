"""Where a test run's CPU goes: runs pytest (by default the README's test command) while reading every
process in /proc four times a second, then prints the run's wall time, the machine's busy CPU seconds and
idle share (/proc/stat), the CPU seconds of each kind of process (Spark's driver JVMs, ZooKeeper's JVMs,
brokers, Spark's Python workers, the pytest workers, ...) and those of the processes each test module
started (the test named by ``PYTEST_CURRENT_TEST`` in a process's environment when it is first seen).

    python -m benchmarks.suite_census [--workers N] [--json PATH] [-- PYTEST ARGUMENTS]

Without pytest arguments it runs ``tests`` as the README does (``-n 4 --dist loadgroup``). Why sampling:
the kernel's per-process counters need no privileges and no change to the code measured; the cost is that
a process's last quarter second before it exits is missed, so the sums by kind are a lower bound (about
nine tenths of /proc/stat's busy time in a full run). A pytest worker's own CPU (the in-process tests) is
counted under its kind, not under a module. Figures only: nothing is asserted about them.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from benchmarks.common import cpu_ticks

ROOT = Path(__file__).resolve().parent.parent
HZ = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.25


def kind(argv: list, parent_argv: list = ()) -> str:
    """The kind of a process from its command line (and its parent's: Spark's Python daemon is the one a
    JVM started, its workers are the daemon's forks)."""
    line = " ".join(argv)
    program = os.path.basename(argv[0]) if argv else ""
    if program == "java":
        if "zookeeper" in line.lower():
            return "ZooKeeper JVM"
        if "CoarseGrainedExecutorBackend" in line:
            return "Spark executor JVM"
        if "SparkSubmit" in line or "pyspark-shell" in line:
            return "Spark driver JVM"
        return "other JVM"
    if "pyspark.daemon" in line:
        from_jvm = bool(parent_argv) and os.path.basename(parent_argv[0]) == "java"
        return "Spark Python daemon" if from_jvm else "Spark Python worker"
    if "python_streaming_source_runner" in line:
        return "Spark streaming source runner"
    if "metaq_broker.devtools.zygote" in line:
        return "broker forked from a zygote"
    if "metaq_broker.server.main" in line:
        return "broker started by exec"
    if "execnet" in line or "import sys;exec" in line:
        return "pytest worker"
    if "pytest" in line:
        return "pytest"
    if "chrom" in program:
        return "Chromium"
    if program.startswith("python"):
        return "other Python"
    return program or "?"


class Census:
    """Every process seen while it runs: CPU ticks at first and last sight, kind, and the test it came from.
    Processes already running when it starts count from then on."""

    def __init__(self):
        self.seen: dict = {}  # (pid, start time) -> record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._me = os.getpid()

    def __enter__(self) -> "Census":
        self._sample(first=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(first=False)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample(first=False)

    def _sample(self, first: bool) -> None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self._me:
                continue
            stat = _stat(entry)
            if stat is None:
                continue
            ticks, started, ppid = stat
            record = self.seen.get((entry, started))
            if record is None or ticks != record["last"]:  # new, or running: it may have exec'd since
                argv = _argv(entry)                           # (spark-submit is bash until it execs java)
                if not argv:  # a kernel thread, or gone
                    continue
                if record is None:
                    record = self.seen[(entry, started)] = {"test": _test_of(entry), "first": ticks if first else 0}
                record["kind"] = kind(argv, _argv(ppid))
            record["last"] = ticks

    def by_kind(self) -> dict:
        out = collections.defaultdict(lambda: [0.0, 0])
        for r in self.seen.values():
            out[r["kind"]][0] += (r["last"] - r["first"]) / HZ
            out[r["kind"]][1] += 1
        return dict(out)

    def by_module(self) -> dict:
        """{test module: {kind: CPU-s}} of the processes each module started."""
        out = collections.defaultdict(collections.Counter)
        for r in self.seen.values():
            if r["test"] and r["kind"] != "pytest worker":
                out[r["test"].split("::")[0]][r["kind"]] += (r["last"] - r["first"]) / HZ
        return {module: dict(kinds) for module, kinds in out.items()}


def _stat(pid: str) -> Optional[tuple]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12]), fields[19], fields[1]


def _argv(pid: str) -> list:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _test_of(pid: str) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"PYTEST_CURRENT_TEST="):
            return item[len(b"PYTEST_CURRENT_TEST="):].decode(errors="replace")
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4, help="pytest-xdist workers (-n), default 4")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: tests)")
    args = ap.parse_args(argv)
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", str(args.workers), "--dist", "loadgroup",
           *(args.pytest_args or ["tests"])]
    busy0, idle0 = cpu_ticks()
    began = time.monotonic()
    with Census() as census:
        code = subprocess.call(cmd, cwd=ROOT)
    wall = time.monotonic() - began
    busy, idle = (a - b for a, b in zip(cpu_ticks(), (busy0, idle0)))
    kinds, modules = census.by_kind(), census.by_module()
    counted = sum(c for c, _ in kinds.values())
    print(f"\n{' '.join(cmd[1:])}: exit code {code}, {wall:.0f} s")
    print(f"machine: {busy / HZ:.0f} busy CPU-s, {100 * idle / max(1, busy + idle):.0f}% idle; "
          f"counted by process: {counted:.0f} CPU-s")
    print("\n| kind | CPU-s | processes |\n|---|---|---|")
    for name, (cpu, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        if cpu >= 0.05:
            print(f"| {name} | {cpu:.1f} | {n} |")
    print("\n| test module (the processes it started) | CPU-s |\n|---|---|")
    for name, cpu in sorted(((m, sum(k.values())) for m, k in modules.items()), key=lambda mc: -mc[1])[:20]:
        print(f"| {name} | {cpu:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": cmd[1:], "exit_code": code, "wall_s": wall, "busy_cpu_s": busy / HZ, "idle_cpu_s": idle / HZ,
            "by_kind": {k: {"cpu_s": c, "processes": n} for k, (c, n) in kinds.items()},
            "by_module": modules}, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
