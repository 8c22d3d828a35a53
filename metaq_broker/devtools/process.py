"""One child process for development and tests (a local ZooKeeper, a broker, a benchmark's peer server):
started with its output in a log file, awaited until a probe says it is ready, stopped with SIGTERM and,
past a timeout, SIGKILL. Every one still running at interpreter exit is stopped, so none is orphaned."""
from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from metaq_broker.devtools import zygote

log = logging.getLogger(__name__)

_running: "set[ChildProcess]" = set()


class ChildProcess:
    """``argv`` run with stdout and stderr appended to ``log_path``. ``own_session``: a Ctrl-C at the
    terminal reaches only the parent, which then stops the child in order. ``forkable``: ``argv`` is
    ``[sys.executable, "-m", module, ...]`` and may be forked from a warm interpreter where the test suite
    enabled it (zygote.py); ``proc`` is then a ``zygote.ForkedProcess``, with Popen's methods. ``netns``:
    the named network namespace it runs in (forked into it, or started under ``ip netns exec``)."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: Optional[dict] = None,
                 cwd: Optional[Path] = None, own_session: bool = False, forkable: bool = False,
                 netns: Optional[str] = None):
        self.name, self.argv, self.log_path = name, list(argv), Path(log_path)
        self.env, self.cwd, self.own_session, self.netns = env, cwd, own_session, netns
        self.forkable = forkable and self.argv[:2] == [sys.executable, "-m"]
        self.proc = None  # subprocess.Popen or zygote.ForkedProcess

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> Optional[int]:
        return None if self.proc is None else self.proc.returncode

    def start(self, ready: Optional[Callable[[], bool]] = None, timeout: float = 30.0,
              interval: float = 0.05) -> "ChildProcess":
        """Launch, then wait until ``ready()`` is true (exceptions count as not yet). RuntimeError with
        the log's tail if the process exits first or is not ready within ``timeout`` (then it is killed)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = zygote.spawn(self.argv[2], self.argv[3:], self.env if self.env is not None else dict(os.environ),
                                 self.log_path, self.cwd, self.own_session, self.netns) if self.forkable else None
        if self.proc is None:
            argv = (["ip", "netns", "exec", self.netns] if self.netns else []) + self.argv
            with open(self.log_path, "ab") as out:
                self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                             env=self.env, cwd=self.cwd, start_new_session=self.own_session)
        _running.add(self)
        if ready is None:
            return self
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                _running.discard(self)
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if ready():
                    return self
            except Exception:  # noqa: BLE001 - not ready yet
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} did not become ready in {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(interval)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code (None if it was killed so)."""
        _running.discard(self)
        if self.proc is None or self.proc.poll() is not None:
            return self.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) ignored SIGTERM for %.0fs; killing it", self.name, self.proc.pid, timeout)
            self.kill()
            return None

    def kill(self) -> None:
        """SIGKILL: a crash."""
        _running.discard(self)
        if self.running:
            self.proc.kill()
            self.proc.wait()


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped. ``kill`` returns before that: the
    kernel wakes one thread to take the signal and the others run on (a replica fetching, fsyncing and
    reporting its progress) until that thread is scheduled, tens of milliseconds under load. A test that
    freezes a member and then acts would race them. RuntimeError naming the threads still running if
    ``timeout`` passes."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        running = {tid: state for tid, state in thread_states(pid).items() if state not in "tTZX"}
        if not running:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} was sent SIGSTOP but threads {running} (tid: state) still run "
                               f"after {timeout:.0f}s")
        time.sleep(0.001)


def thread_states(pid: int) -> dict:
    """{thread id: state letter from /proc (R running, S/D waiting, T stopped, Z exited)}; {} once gone."""
    return per_thread(pid, "stat", lambda text: text.rsplit(")", 1)[1].split()[0])


def per_thread(pid: int, name: str, parse: Callable[[str], object]) -> dict:
    """{thread id: ``parse`` of /proc/PID/task/TID/``name``} of a process's live threads; {} once it is gone."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/{name}") as f:
                out[int(tid)] = parse(f.read())
        except (OSError, ValueError, IndexError):
            pass  # the thread ended meanwhile
    return out


@atexit.register
def _stop_all() -> None:
    for child in list(_running):
        child.stop(timeout=5)

