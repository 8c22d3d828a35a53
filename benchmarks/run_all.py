"""Run every benchmark, collect their figures into one table, and write RESULTS.md, a chart and the README.

    python -m benchmarks [--quick] [--only NAME ...] [--timeout S] [--progress/--no-progress] [-v]
    python benchmarks/run_all.py ...                  (the same)

Each ``bench_*.py`` in this folder runs as its own subprocess (a crash in one does not stop the others,
and each gets a clean process), as ``python bench_X.py [--quick] --json PATH``; the JSON it writes is
turned into figures: one row per measured figure with the baseline measured in the same run of the same
script, and the ratio of the two. ``bench_spark_sink.py`` is expected even while it does not exist yet:
a benchmark that is missing, fails, times out or writes no usable JSON is reported as such in RESULTS.md
with the tail of its output, and the exit code is then 1.

A new benchmark needs no change here if its JSON has a top-level ``"figures"`` list of objects with
``name``, ``value``, ``unit``, ``baseline``, ``baseline_value`` (same unit) and optionally ``ratio``
(default value / baseline_value) and ``note``. Without one, the shape of bench_spark_source.py's JSON is
understood too: ``"cases": {name: {"rows_per_s": ...}}`` and ``"ratios": {"a / b": ratio}``.

Written: ``benchmarks/RESULTS.md`` (date, machine, load, exact command, the table, status per
benchmark, errors), ``benchmarks/results.png`` (ratios against their baselines, log scale), and the
table between ``<!-- results:start -->`` and ``<!-- results:end -->`` in README.md (only for a run of
every benchmark, unless ``--readme PATH`` is given). Each benchmark's output and JSON are kept in
``benchmarks/.bench-data/run_all/`` (``--log-dir``).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import click

from metaq_broker.tools.progress import progressbar

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
EXPECTED = ("bench_store", "bench_broker", "bench_spark_source", "bench_spark_sink")
START, END = "<!-- results:start -->", "<!-- results:end -->"
TAIL_LINES = 40


# -- figures out of each benchmark's JSON -------------------------------------------------------------
def figure(bench, name, value, unit, baseline, baseline_value, ratio=None, note=""):
    if ratio is None and value is not None and baseline_value:
        ratio = value / baseline_value
    return {"benchmark": bench, "name": name, "value": value, "unit": unit, "baseline": baseline,
            "baseline_value": baseline_value, "ratio": ratio, "note": note}


def store_figures(data: dict) -> list:
    """bench_store: appends of batches of 1000 against the disk's 1 MiB+fsync rate (MB/s), appends of
    one message against fsyncs/s of 150 B writes (appends/s), reads against memcpy (MB/s)."""
    base, out = data["baselines"]["mean"], []
    for c in data["cases"]:
        notes = [] if " b1 " in c["case"] + " " else [f"{c['msgs_s']:,.0f} msgs/s"]
        if c.get("appends_per_fsync") is not None:
            notes.append(f"{c['appends_per_fsync']:,.1f} appends/fsync")
        note = ", ".join(notes)
        if c["case"].startswith("read"):
            out.append(figure("bench_store", c["case"], c["mb_s"], "MB/s", "memcpy", base["memcpy_gb_s"] * 1e3,
                              c.get("x_memcpy"), note))
        elif " b1 " in c["case"] + " ":
            out.append(figure("bench_store", c["case"], c["appends_s"], "appends/s", "disk 150B+fsync",
                              base["fsync_per_s"], c.get("x_fsync"), note))
        else:
            out.append(figure("bench_store", c["case"], c["mb_s"], "MB/s", "disk 1MiB+fsync", base["disk_mb_s"],
                              c.get("x_disk"), note))
    return out


# metaq system -> its peers with the same durability of an acknowledged message
BROKER_PEERS = {"metaq group": ("redis always",), "metaq unflush1000": ("redis everysec", "nats jetstream")}


def broker_figures(data: dict) -> list:
    """bench_broker: each metaq row (msgs/s) against the like-for-like peers' same case."""
    by = {(r["system"], r["op"], r["value_bytes"], r["batch"]): r for r in data["rows"]}
    skipped = data.get("skipped", {})
    out = []
    for (system, op, size, batch), r in by.items():
        for peer in BROKER_PEERS.get(system, ()):
            p = by.get((peer, op, size, batch))
            notes = [x for x in ("time limit" if r.get("time_capped") else "", r.get("note", "")) if x]
            if p is None:
                notes.append(f"{peer} skipped: {skipped[peer]}" if peer in skipped else f"no {peer} row")
            size_name = f"{size // 1024}KiB" if size % 1024 == 0 else f"{size}B"
            out.append(figure("bench_broker", f"{op} {size_name} b{batch} {system}", r["msgs_s"], "msgs/s", peer,
                              p["msgs_s"] if p else None, note=", ".join(notes)))
    return out


def cases_ratio_figures(bench: str, data: dict) -> list:
    """The bench_spark_source shape: cases with rows_per_s, ratios named "case / baseline case"."""
    cases, out = data.get("cases", {}), []
    for key, ratio in data.get("ratios", {}).items():
        name, _, base = key.partition(" / ")
        v = cases.get(name, {}).get("rows_per_s")
        b = cases.get(base, {}).get("rows_per_s")
        out.append(figure(bench, name, v, "rows/s", base, b, ratio))
    return out


def figures_of(bench: str, data: dict) -> list:
    if isinstance(data.get("figures"), list):
        return [figure(bench, f["name"], f.get("value"), f.get("unit", ""), f.get("baseline", ""),
                       f.get("baseline_value"), f.get("ratio"), f.get("note", "")) for f in data["figures"]]
    if bench == "bench_store":
        return store_figures(data)
    if bench == "bench_broker":
        return broker_figures(data)
    if isinstance(data.get("cases"), dict) and isinstance(data.get("ratios"), dict):
        return cases_ratio_figures(bench, data)
    raise ValueError(f"{bench}: its JSON has neither a 'figures' list nor 'cases' and 'ratios' this runner reads")


def extra_notes(bench: str, data: dict) -> list:
    """What a reader of the table should know about a benchmark that ran (skipped peers, versions, ...)."""
    notes = [f"skipped {k}: {v}" for k, v in (data.get("skipped") or {}).items()]
    if bench == "bench_store":
        b = data["baselines"]
        notes += [f"baselines at {k}: disk 1MiB+fsync {b[k]['disk_mb_s']:,.0f} MB/s, 150B+fsync "
                  f"{b[k]['fsync_per_s']:,.0f}/s, memcpy {b[k]['memcpy_gb_s']:.1f} GB/s" for k in ("start", "end")]
    if bench == "bench_broker":
        versions = {k: v for i in data.get("versions", {}).values() for k, v in i.items()}
        if versions:
            notes.append("versions: " + "; ".join(f"{k} {v}" for k, v in versions.items()))
    if "messages" in data and "cases" in data:
        notes.append(f"{data['messages']:,} messages" + (f", best of {data['runs']}" if "runs" in data else ""))
    return notes


# -- formatting ---------------------------------------------------------------------------------------
def num(v) -> str:
    if v is None or v != v:
        return "-"
    a = abs(v)
    return f"{v:,.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 0.1 else f"{v:.3g}"


def ratio_text(r) -> str:
    if r is None or r != r:
        return "-"
    return f"{r:.1f}" if r >= 10 else f"{r:.2f}" if r >= 0.1 else f"{r:.2g}"


def cell(s) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def markdown_table(results: list) -> str:
    """One row per figure of every benchmark that ran, then one row per benchmark that did not."""
    lines = ["| benchmark | figure | value | unit | baseline (same run) | baseline value | ratio | note |",
             "|---|---|---:|---|---|---:|---:|---|"]
    for r in results:
        for f in r.get("figures", []):
            lines.append("| " + " | ".join(cell(x) for x in (
                f["benchmark"], f["name"], num(f["value"]), f["unit"], f["baseline"], num(f["baseline_value"]),
                ratio_text(f["ratio"]), f["note"])) + " |")
        if r["status"] not in ("ok", "partial"):
            lines.append(f"| {cell(r['name'])} | **{r['status'].upper()}** | - | | | | - | {cell(r['reason'])} |")
        elif not r.get("figures"):
            lines.append(f"| {cell(r['name'])} | (no figures) | - | | | | - | |")
    return "\n".join(lines)


def status_table(results: list) -> str:
    lines = ["| benchmark | status | seconds | figures | command | notes |", "|---|---|---:|---:|---|---|"]
    for r in results:
        notes = "; ".join(([r["reason"]] if r.get("reason") else []) + r.get("notes", []))
        secs = "-" if r.get("seconds") is None else f"{r['seconds']:.0f}"
        cmd = f"`{r['command']}`" if r.get("command") else "-"
        lines.append(f"| {cell(r['name'])} | {r['status']} | {secs} | {len(r.get('figures', []))} | {cmd} | "
                     f"{cell(notes)} |")
    return "\n".join(lines)


def summary(results: list) -> str:
    counts = collections.Counter(r["status"] for r in results)
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))


def failed(results: list) -> list:
    return [r for r in results if r["status"] not in ("ok", "partial")]


def results_markdown(results: list, meta: dict, chart: str | None) -> str:
    out = ["# Benchmark results", "",
           "<!-- written by benchmarks/run_all.py (python -m benchmarks); edits are overwritten -->", "",
           f"- date: {meta['date']}",
           f"- command: `{meta['command']}`" + (f" (commit {meta['commit']})" if meta.get("commit") else ""),
           f"- machine: {meta['machine']}",
           f"- software: {meta['software']}",
           f"- load average (1 min): {meta['load_start']:.2f} at start, {meta['load_end']:.2f} at end "
           f"({meta['cpus']} CPUs; a load above the CPU count means other work competed with the benchmarks, "
           "so figures are noisy)",
           f"- benchmarks: {summary(results)}",
           "",
           "Each row is one figure of one benchmark beside a baseline measured in the same run of the same "
           "script; ratio = value / baseline value (for bench_broker: metaq over the peer with the same "
           "durability, > 1: metaq faster; for bench_spark_source: the metaq source over the Arrow ceiling or "
           "Parquet). Every script's own report, with more columns, is in its log.", "",
           markdown_table(results), ""]
    if chart:
        out += [f"![ratios of each figure to its same-run baseline]({chart})", ""]
    out += ["## Benchmarks", "", status_table(results), ""]
    bad = failed(results)
    if bad:
        out += ["## Failures", ""]
        for r in bad:
            out += [f"### {r['name']}: {r['status']}", "", r["reason"], ""]
            if r.get("tail"):
                out += ["```", r["tail"].rstrip(), "```", ""]
    partial = [r for r in results if r["status"] == "partial"]
    if partial:
        out += ["## Partial runs", ""] + [f"- {r['name']}: {'; '.join(r['skipped'])}" for r in partial] + [""]
    return "\n".join(out)


def readme_block(results: list, meta: dict, results_link: str) -> str:
    return "\n".join([
        f"Latest run of `{meta['command']}` ({meta['date']}; {meta['cpus']} CPUs, 1-minute load "
        f"{meta['load_start']:.1f} at start and {meta['load_end']:.1f} at end; {summary(results)}). "
        f"Machine, status per benchmark, errors and the chart: [{results_link}]({results_link}).", "",
        markdown_table(results)])


def splice(text: str, block: str) -> str:
    """``text`` with everything between the START and END markers replaced by ``block``."""
    if text.count(START) != 1 or text.count(END) != 1:
        raise ValueError(f"expected exactly one {START} and one {END}")
    s, e = text.index(START) + len(START), text.index(END)
    if e < s:
        raise ValueError(f"{END} comes before {START}")
    return text[:s] + "\n" + block.strip("\n") + "\n" + text[e:]


def update_readme(path: Path, block: str) -> bool:
    text = path.read_text(encoding="utf-8")
    new = splice(text, block)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def draw_chart(results: list, meta: dict, path: Path) -> None:
    """Horizontal bars: each figure's ratio to its baseline, log scale, a line at 1, one colour per benchmark."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [f for r in results for f in r.get("figures", []) if f["ratio"] and f["ratio"] > 0]
    bad = [f"{r['name']}: {r['status']}" for r in results if r["status"] not in ("ok", "partial")]
    benches = list(dict.fromkeys(f["benchmark"] for f in rows))
    colours = {b: plt.cm.tab10(i % 10) for i, b in enumerate(benches)}
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.26 * max(len(rows), 1)))
    ys = list(range(len(rows)))[::-1]
    if rows:
        ax.barh(ys, [f["ratio"] for f in rows], color=[colours[f["benchmark"]] for f in rows])
        ax.set_xscale("log")
        for y, f in zip(ys, rows):
            ax.text(f["ratio"], y, f" {ratio_text(f['ratio'])}", va="center", fontsize=7)
        ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_yticks(ys, [f"{f['name']} / {f['baseline']}" for f in rows], fontsize=7)
        ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[b]) for b in benches], labels=benches,
                  loc="lower right", fontsize=8)
        lo, hi = min(f["ratio"] for f in rows), max(f["ratio"] for f in rows)
        ax.set_xlim(min(lo, 1.0) / 2, max(hi, 1.0) * 3)
        ax.set_ylim(-0.7, len(rows) - 0.3)
    else:
        ax.text(0.5, 0.5, "no figures", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
    ax.set_xlabel("value / same-run baseline (log scale; 1 = as fast as the baseline)")
    ax.set_title(f"metaq benchmarks, {meta['date']}, {meta['cpus']} CPUs, 1-min load {meta['load_start']:.1f}"
                 f" at start, {meta['load_end']:.1f} at end\n" + textwrap.shorten(meta["command"], 140), fontsize=9)
    if bad:
        fig.text(0.01, 0.005, "not run or failed: " + "; ".join(bad), fontsize=8, color="firebrick")
    fig.tight_layout(rect=(0, 0.02 if bad else 0, 1, 1))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# -- machine facts ------------------------------------------------------------------------------------
def machine_facts() -> dict:
    cpus = os.cpu_count()
    model = ram = ""
    with contextlib.suppress(OSError):
        model = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                      if l.startswith("model name")), "")
    with contextlib.suppress(OSError, StopIteration, ValueError):
        kb = next(int(l.split()[1]) for l in Path("/proc/meminfo").read_text().splitlines()
                  if l.startswith("MemTotal:"))
        ram = f"{kb / 2**20:.1f} GiB RAM"
    versions = [f"Python {platform.python_version()}"]
    for pkg in ("pyspark", "pyarrow", "grpcio"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(f"{pkg} {importlib.metadata.version(pkg)}")
    commit = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        if commit and subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                     capture_output=True, text=True, timeout=10).stdout.strip():
            commit += " with uncommitted changes"
    return {"cpus": cpus, "commit": commit,
            "machine": ", ".join(x for x in (f"{cpus} CPUs", model, ram, f"{platform.system()} {platform.release()}")
                                 if x),
            "software": ", ".join(versions)}


# -- running ------------------------------------------------------------------------------------------
def select(bench_dir: Path, only) -> list:
    """(name, script path or None when missing) for the benchmarks to run, in a stable order."""
    found = {p.stem: p for p in sorted(bench_dir.glob("bench_*.py"))}
    expected = EXPECTED if bench_dir.resolve() == HERE else ()
    names = list(dict.fromkeys(list(expected) + sorted(found)))
    if only:
        want = [("bench_" + n.removesuffix(".py").removeprefix("bench_")) for n in only]
        names = list(dict.fromkeys(want))
    return [(n, found.get(n)) for n in names]


def shown_path(p: Path) -> str:
    """``p`` relative to the repository when it is inside it."""
    p = Path(p).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def tail(lines, n=TAIL_LINES) -> str:
    return "\n".join(list(lines)[-n:])


def kill_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the benchmark's process group (its servers, Spark's JVM), then SIGKILL after ``grace`` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
            return


def run_one(name: str, script: Path | None, args, log_dir: Path, tick) -> dict:
    """Run one benchmark script to the end; a dict with its status, figures, notes and output tail."""
    res = {"name": name, "status": "ok", "reason": "", "figures": [], "notes": [], "skipped": [],
           "seconds": None, "command": None, "tail": ""}
    if script is None:
        res.update(status="missing", reason=f"{name}.py is not in {shown_path(args.bench_dir)}/")
        return res
    json_path, log_path = log_dir / f"{name}.json", log_dir / f"{name}.log"
    json_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(script)] + (["--quick"] if args.quick else []) + ["--json", str(json_path)]
    res["command"] = shlex.join(["python", shown_path(script)] + cmd[2:-1] + ["PATH"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out_tail, err_tail = collections.deque(maxlen=400), collections.deque(maxlen=400)
    last = [""]
    lock = threading.Lock()
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)

        def pump(stream, keep, prefix):
            for line in stream:
                line = line.rstrip("\n")
                keep.append(line)
                with lock:
                    log.write(prefix + line + "\n")
                    if line.strip():
                        last[0] = line.strip()
                if args.verbose:
                    click.echo(f"  {name}{prefix.strip() and ' ' + prefix.strip()}| {line}", err=True)
        pumps = [threading.Thread(target=pump, args=(proc.stdout, out_tail, ""), daemon=True),
                 threading.Thread(target=pump, args=(proc.stderr, err_tail, "[stderr] "), daemon=True)]
        for t in pumps:
            t.start()
        try:
            while True:
                try:
                    proc.wait(1.0)
                    break
                except subprocess.TimeoutExpired:
                    pass
                elapsed = time.monotonic() - t0
                tick(f"{name} {elapsed:.0f}s: {last[0][:60]}")
                if elapsed > args.timeout:
                    kill_group(proc)
                    res.update(status="timeout", reason=f"still running after {args.timeout:g} s: stopped")
                    break
        except BaseException:  # Ctrl-C: stop the benchmark (and its servers) before going
            kill_group(proc, grace=10)
            raise
        for t in pumps:
            t.join(10)
    res["seconds"] = time.monotonic() - t0
    both = tail(err_tail, TAIL_LINES // 2) + ("\n" if err_tail else "") + tail(out_tail, TAIL_LINES // 2)
    res["notes"].append(f"log: {shown_path(log_path)}")
    if res["status"] == "timeout":
        res["tail"] = both
        return res
    if proc.returncode != 0:
        res.update(status="failed", reason=f"exit code {proc.returncode}", tail=both)
        return res
    try:
        data = json.loads(json_path.read_text())
    except (OSError, ValueError) as e:
        res.update(status="failed", reason=f"exit code 0 but no usable JSON at {json_path.name}: {e}", tail=both)
        return res
    try:
        res["figures"] = figures_of(name, data)
        res["notes"] = extra_notes(name, data) + res["notes"]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        res.update(status="failed", reason=f"could not read its JSON: {type(e).__name__}: {e}", tail=both)
        return res
    res["skipped"] = [f"skipped {k}: {v}" for k, v in (data.get("skipped") or {}).items()]
    if res["skipped"]:
        res["status"] = "partial"
    return res


def parse_args(argv, prog):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="pass --quick to every benchmark (smaller, faster)")
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="run only this benchmark (bench_store, store, bench_store.py); repeatable or comma-separated")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per benchmark before it is stopped (default 1800 with --quick, else 7200)")
    ap.add_argument("--bench-dir", type=Path, default=HERE, help=argparse.SUPPRESS)
    ap.add_argument("--log-dir", type=Path, default=HERE / ".bench-data" / "run_all",
                    help="where each benchmark's output and JSON are kept (default benchmarks/.bench-data/run_all)")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md", help="default benchmarks/RESULTS.md")
    ap.add_argument("--chart", type=Path, default=HERE / "results.png", help="default benchmarks/results.png")
    ap.add_argument("--readme", type=Path, default=None,
                    help="README to update between the results markers (default README.md, but only when "
                         "every benchmark runs, i.e. without --only)")
    ap.add_argument("--no-readme", action="store_true", help="leave the README alone")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="progress bar on stderr (default: when stderr is a terminal)")
    ap.add_argument("-v", "--verbose", action="store_true", help="echo every benchmark's output to stderr")
    args = ap.parse_args(argv)
    args.only = [x.strip() for o in args.only or [] for x in o.split(",") if x.strip()]
    if args.timeout is None:
        args.timeout = 1800.0 if args.quick else 7200.0
    return args


def main(argv=None, prog="python benchmarks/run_all.py") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, prog)
    command = " ".join([prog] + ([shlex.join(argv)] if argv else []))
    benches = select(args.bench_dir, args.only)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"), "command": command,
            "load_start": os.getloadavg()[0], **machine_facts()}
    show = sys.stderr.isatty() if args.progress is None else args.progress
    results = []
    with progressbar(show, length=len(benches), label="benchmarks", show_pos=True, show_eta=False,
                     item_show_func=lambda s: s) as bar:
        def tick(text):
            bar.current_item = text
            bar.render_progress()

        for i, (name, script) in enumerate(benches, 1):
            if not show:
                click.echo(f"[{i}/{len(benches)}] {name}: " + ("running" if script else "missing"))
            tick(f"{name} starting")
            r = run_one(name, script, args, args.log_dir, tick)
            results.append(r)
            if not show and script:
                click.echo(f"[{i}/{len(benches)}] {name}: {r['status']} in {r['seconds']:.0f} s, "
                           f"{len(r['figures'])} figures" + (f" ({r['reason']})" if r["reason"] else ""))
            bar.update(1, f"{name}: {r['status']}")
    meta["load_end"] = os.getloadavg()[0]

    chart_ref = None
    try:
        draw_chart(results, meta, args.chart)
        chart_ref = os.path.relpath(args.chart, args.results.parent)
    except Exception as e:  # no matplotlib (it comes with the [bench] and [test] extras), or a drawing error
        click.echo(f"chart not drawn: {type(e).__name__}: {e}", err=True)
        meta["software"] += f"; chart not drawn ({type(e).__name__}: {e})"
    args.results.write_text(results_markdown(results, meta, chart_ref), encoding="utf-8")
    click.echo(f"wrote {args.results}" + (f" and {args.chart}" if chart_ref else ""))

    readme = None if args.no_readme else args.readme or (None if args.only else REPO / "README.md")
    if readme is not None:
        link = os.path.relpath(args.results, readme.parent)
        try:
            changed = update_readme(readme, readme_block(results, meta, link))
            click.echo(f"{'updated' if changed else 'unchanged'}: the results table in {readme}")
        except (OSError, ValueError) as e:
            click.echo(f"README not updated ({readme}): {e}", err=True)

    click.echo(f"benchmarks: {summary(results)}")
    for r in failed(results):
        click.echo(f"  {r['name']}: {r['status']}: {r['reason']}", err=True)
    return 1 if failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
