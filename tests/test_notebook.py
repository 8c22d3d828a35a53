"""notebooks/quickstart.ipynb runs top to bottom in a real Jupyter kernel (nbclient), so it cannot rot.

The kernel runs this interpreter (a kernelspec written for the test), in a fresh working directory, with
TMPDIR pointing inside it: everything the notebook starts (ZooKeeper, the broker, Spark's JVM and its
Python workers) has that directory as its cwd or in its command line. After the run the test waits for
those processes to be gone (the notebook's last cell stops them; Spark's JVM leaves with the kernel) and
kills any that are left, so a failing cell never leaks a broker or a JVM.
"""
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

pytestmark = [pytest.mark.process, pytest.mark.spark]

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def _ancestors() -> set:
    """This process and its ancestors (never to be killed, whatever their command lines say)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return pids


def _processes_under(root: Path) -> dict:
    """{pid: command line} of processes whose cwd is inside ``root`` or whose command line names it."""
    root_s = str(root)
    skip = _ancestors()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            try:
                cwd = os.readlink(entry / "cwd")
            except OSError:
                cwd = ""
        except OSError:  # gone meanwhile
            continue
        if cwd == root_s or cwd.startswith(root_s + os.sep) or root_s in cmdline:
            found[int(entry.name)] = cmdline
    return found


def _wait_gone(root: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        left = _processes_under(root)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _log_tails(root: Path, lines: int = 20) -> str:
    out = []
    for log in sorted(root.rglob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {log} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(out)


def _text_outputs(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out and "text/plain" in out["data"]:
            parts.append(out["data"]["text/plain"])
    return "".join(parts)


@pytest.mark.timeout(600)
def test_quickstart_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"          # the kernel's cwd
    tmp_dir = tmp_path / "tmp"          # the kernel's TMPDIR: the notebook's work directory lands here
    kernels = tmp_path / "jupyter" / "kernels" / "python3"
    for d in (run_dir, tmp_dir, kernels):
        d.mkdir(parents=True)
    # "python3" is this interpreter, whatever kernelspecs the machine has installed.
    (kernels / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (test)", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("TMPDIR", str(tmp_dir))
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")

    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"

    client = NotebookClient(nb, kernel_name="python3", timeout=240, startup_timeout=60,
                            resources={"metadata": {"path": str(run_dir)}})
    started = time.monotonic()
    failure = None
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
        failure = f"the notebook failed: {type(e).__name__}:\n{e}\n{_log_tails(tmp_path)}"
    finally:
        # The kernel is gone; whatever it started must follow (the last cell stops ZooKeeper and the
        # broker; Spark's JVM exits once the kernel has). Kill leftovers in any case, then complain.
        leftovers = _wait_gone(tmp_path, timeout=20)
        _kill(leftovers)
    elapsed = time.monotonic() - started
    if failure:
        pytest.fail(failure + (f"\nkilled processes it left behind: {leftovers}" if leftovers else ""), pytrace=False)
    assert not leftovers, f"processes outlived the notebook: {leftovers}"

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "every code cell ran"
    errors = [o for c in code for o in c.outputs if o.get("output_type") == "error"]
    assert not errors, errors
    text = "\n".join(_text_outputs(c) for c in code)

    m = re.search(r"produced 100,000 messages in [\d.]+ s \(([\d,]+) msgs/s\)", text)
    assert m and int(m.group(1).replace(",", "")) > 0, text
    batches = [int(n.replace(",", "")) for n in re.findall(r"micro-batch \d+:\s+([\d,]+) rows", text)]
    assert len(batches) >= 4 and sum(batches) == 100_000 and max(batches) <= 25_000, batches
    assert "totals match: 100000 of 100000 messages" in text, text
    assert "Spark counted 100,000 views of 50 users" in text, text
    assert "total lag: 100,000 before the query, 0 after it" in text, text
    groups = re.findall(r"^notebook-page-views\s+page-views\s+(\d+-\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", text, re.M)
    assert sorted(g[0] for g in groups) == ["0-0", "0-1", "0-2", "0-3"], text  # `metaq groups`, one row each
    assert all(committed == latest and lag == "0" for _, committed, latest, lag in groups), groups
    assert sum(int(latest) for _, _, latest, _ in groups) == 100_000, groups
    assert "broker exited with code 0" in text, text

    pngs = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == 1, "the chart cell shows one PNG"

    # The last cell removed the work directory from the kernel's TMPDIR.
    assert not list(tmp_dir.glob("metaq-notebook-*")), list(tmp_dir.iterdir())
    print(f"notebook ran in {elapsed:.0f} s")
