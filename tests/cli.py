"""``metaq`` commands for tests, run in the test's own process through click's ``CliRunner``: a fresh
interpreter per command took ~0.5 CPU-s, and the suite ran ~150 of them. The answer is what
``subprocess.run(..., capture_output=True)`` gives (``returncode``, ``stdout``, ``stderr`` as bytes), with
an unexpected exception's traceback on stderr and exit code 1 as Python's. What only a process shows
(Ctrl-C, exit within a bound, the console script itself) stays with real processes: test_client_exit,
test_cli's entry-point test."""
from __future__ import annotations

import subprocess
import traceback

from click.testing import CliRunner

from metaq_broker.tools.cli import main


def metaq(*args, stdin=None, env=None) -> subprocess.CompletedProcess:
    """``metaq *args`` (``stdin``: bytes or str; ``env``: variables to set for the command)."""
    argv = [str(a) for a in args]
    result = CliRunner(env=env).invoke(main, argv, input=stdin, catch_exceptions=True, prog_name="metaq")
    stderr = result.stderr_bytes or b""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception)).encode()
    r = subprocess.CompletedProcess(["metaq", *argv], result.exit_code, result.stdout_bytes, stderr)
    r.out, r.err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
    return r


def cluster_args(cluster) -> list:
    """``--zk`` and ``--zk-root`` of a test cluster (conftest's ``Cluster``)."""
    return ["--zk", cluster.zk_connect, "--zk-root", cluster.zk_root]


def metaq_on(cluster, *args, **kw) -> subprocess.CompletedProcess:
    """``metaq *args`` against a test cluster (``cluster_args``)."""
    return metaq(*cluster_args(cluster), *args, **kw)
