"""What starting a test broker costs, forked from the test suite's zygote against started by exec, in the
same run (``metaq_broker/devtools/zygote.py``; the test suite starts ~430 brokers).

    python benchmarks/bench_broker_start.py [--starts N] [--quick] [--dir PATH] [--json PATH]

Each round starts one broker each way (``BrokerProcess`` against a local ZooKeeper, alternating which goes
first), then stops it with SIGTERM. Per start: the broker's CPU seconds when it is ready (its gRPC health
check says SERVING; its threads' CPU time since its start or fork, ``CpuMeter``), the wall time from the
start call to ready, and the time SIGTERM takes to end it. Medians over ``--starts`` rounds (default 10; ``--quick`` 3).
The zygote's own start (once per pytest worker) is reported beside them. Figures only, no timing asserted.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (CpuMeter, add_common_options, log, proc_cpu_s, run_facts, scratch_dir,  # noqa: E402
                               teardown, write_json)
from metaq_broker.devtools import zygote  # noqa: E402
from metaq_broker.devtools.broker_process import BrokerProcess  # noqa: E402
from metaq_broker.devtools.zookeeper import LocalZooKeeper  # noqa: E402


def start_once(tmp: Path, zk: LocalZooKeeper, n: int, forked: bool) -> dict:
    b = BrokerProcess(tmp / f"{'forked' if forked else 'exec'}-{n}", n, zk.connect_string,
                      settings={"zk.root": "/bench", "zk.sessionTimeout": 4000}, forkable=forked)
    t0 = time.perf_counter()
    b.start()
    ready = time.perf_counter() - t0
    cpu = CpuMeter(b.proc.pid, since_start=True).seconds()
    assert isinstance(b.proc, zygote.ForkedProcess) == forked, "the start was not the kind measured"
    parent = int(Path(f"/proc/{b.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    t1 = time.perf_counter()
    b.stop()
    return {"cpu_s": cpu, "ready_s": ready, "stop_s": time.perf_counter() - t1,
            "zygote_cpu_s": proc_cpu_s(parent) if forked else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 starts each way")
    ap.add_argument("--starts", type=int, default=None, help="starts each way (default 10)")
    add_common_options(ap, "1g")
    args = ap.parse_args()
    starts = args.starts or (3 if args.quick else 10)
    results = run_facts(benchmark="broker_start", starts=starts, quick=args.quick)
    tmp = scratch_dir(args.dir, "broker-start-")
    zk = None
    zygote.enable()
    try:
        zk = LocalZooKeeper(data_dir=tmp / "zk", tick_time_ms=500).start()
        t0 = time.perf_counter()
        first = start_once(tmp, zk, 0, True)  # starts the zygote: not one of the rounds
        results["zygote"] = {"start_and_first_broker_s": time.perf_counter() - t0, "first_broker": first}
        log(f"the zygote: {first['zygote_cpu_s']:.2f} CPU-s once, its start and first broker's "
            f"{results['zygote']['start_and_first_broker_s']:.2f} s")
        runs = {"exec": [], "forked": []}
        for n in range(1, starts + 1):
            order = (True, False) if n % 2 else (False, True)
            for forked in order:
                runs["forked" if forked else "exec"].append(start_once(tmp, zk, 2 * n + forked, forked))
        figures = []
        for key, name, unit in (("cpu_s", "broker CPU to ready", "CPU-s"), ("ready_s", "start to ready", "s"),
                                ("stop_s", "SIGTERM to exit", "s")):
            forked = statistics.median(r[key] for r in runs["forked"])
            execd = statistics.median(r[key] for r in runs["exec"])
            results["cases"][name] = {"forked": forked, "exec": execd}
            figures.append({"name": f"forked test broker: {name}", "value": forked, "unit": unit,
                            "baseline": "started by exec", "baseline_value": execd, "note": "lower is better"})
            log(f"{name}: forked {forked:.3f} {unit}, exec {execd:.3f} {unit}, x{forked / execd:.2f}")
        results["figures"] = figures
        results["runs"] = runs
        write_json(args.json, results)
    finally:
        zygote.shutdown()
        teardown(tmp, zk)


if __name__ == "__main__":
    main()
