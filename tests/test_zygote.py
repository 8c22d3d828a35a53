"""Children forked from a zygote (metaq_broker/devtools/zygote.py) are the processes an exec would start:
their own pid, arguments, environment, working directory and log; the exit codes and signals an exec'd
child gives; none outlives the process that asked for it; a zygote that cannot fork safely is not used."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import wait_until
from metaq_broker.devtools import zygote

pytestmark = pytest.mark.process

TESTS = Path(__file__).resolve().parent


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(TESTS), "PYTHONUNBUFFERED": "1", **extra}


def _spawn(tmp_path, *args, env=None, cwd=None):
    log = tmp_path / f"child-{time.monotonic_ns()}.log"
    proc = zygote.spawn("zygote_child", list(args), env or _env(), log, cwd)
    assert proc is not None, "the zygote refused to fork"
    return proc, log


def _printed(log) -> dict:
    line = wait_until(lambda: log.exists() and log.read_text().split("\n", 1)[0], timeout=30, what="the child's line")
    return json.loads(line)


def test_a_forked_child_has_its_own_pid_arguments_environment_working_directory_and_log(tmp_path):
    proc, log = _spawn(tmp_path, "sleep", env=_env(ZYGOTE_CHILD_VALUE="given"), cwd=tmp_path)
    seen = _printed(log)
    assert seen == {"pid": proc.pid, "argv": ["sleep"], "cwd": str(tmp_path), "value": "given"}
    assert proc.pid != os.getpid() and proc.poll() is None
    other, other_log = _spawn(tmp_path, "sleep")
    assert _printed(other_log)["value"] is None and other.pid != proc.pid  # nothing carries over
    for pid in (proc.pid, other.pid):  # none of the zygote's sockets (the others' exit codes, its listener)
        fds = {fd.name: os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}
        assert not [t for t in fds.values() if t.startswith("socket:")], fds
    proc.kill()
    other.terminate()
    assert (proc.wait(10), other.wait(10)) == (-signal.SIGKILL, -signal.SIGTERM)


@pytest.mark.parametrize("args", [["return"], ["exit", "3"], ["raise"]])
def test_exit_codes_and_output_are_those_of_an_exec(tmp_path, args):
    execd = subprocess.run([sys.executable, "-m", "zygote_child", *args], env=_env(), capture_output=True,
                           text=True, timeout=60)
    proc, log = _spawn(tmp_path, *args)
    assert proc.wait(30) == execd.returncode
    forked = log.read_text().splitlines()
    assert json.loads(forked[0])["argv"] == json.loads(execd.stdout)["argv"] == args
    assert forked[1:][-1:] == execd.stderr.splitlines()[-1:]  # the error, if any
    if args == ["raise"]:
        assert forked[1] == "Traceback (most recent call last):" and forked[-1] == "ValueError: raised as asked"


def test_a_child_forked_into_a_network_namespace_runs_there_and_a_missing_one_is_named(tmp_path):
    """As ``ip netns exec`` starts a process (devtools/netns.py's brokers): in the namespace before it runs."""
    from metaq_broker.devtools import netns
    why = netns.unavailable()
    assert why is None, f"this test needs network namespaces: {why}"
    with netns.Network() as network:
        host = network.add_host("z")
        log = tmp_path / "in-namespace.log"
        proc = zygote.spawn("zygote_child", ["sleep"], _env(), log, netns=host.namespace)
        _printed(log)
        assert os.stat(f"/proc/{proc.pid}/ns/net").st_ino == os.stat(f"/run/netns/{host.namespace}").st_ino
        assert os.stat(f"/proc/{proc.pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
        proc.kill()
        proc.wait(10)
    log = tmp_path / "missing.log"
    proc = zygote.spawn("zygote_child", ["sleep"], _env(), log, netns="metaq-no-such-namespace")
    assert proc.wait(10) == 1
    assert "cannot enter network namespace 'metaq-no-such-namespace'" in log.read_text()


def test_a_stopped_child_is_not_reported_ended_and_signals_reach_it(tmp_path):
    proc, log = _spawn(tmp_path, "sleep")
    _printed(log)
    os.kill(proc.pid, signal.SIGSTOP)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.5)
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGCONT)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == -signal.SIGINT
    proc.kill()  # ended: a no-op, as Popen's
    assert proc.returncode == -signal.SIGINT


def test_no_child_outlives_the_process_that_asked_for_it(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, time
        from metaq_broker.devtools import zygote
        zygote.enable()
        env = dict(os.environ, PYTHONPATH={str(TESTS)!r})
        proc = zygote.spawn("zygote_child", ["sleep"], env, {str(tmp_path / "orphan.log")!r})
        print(proc.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert Path(f"/proc/{child}").exists()
    parent.kill()
    parent.wait()
    wait_until(lambda: not Path(f"/proc/{child}").exists(), timeout=15, what=f"child {child} to be gone")


def test_a_child_dies_with_its_zygote(tmp_path):
    env = _env(PYTHONPATH=f"{TESTS}:{tmp_path}")  # a zygote of its own, killed here
    proc, log = _spawn(tmp_path, "sleep", env=env)
    _printed(log)
    zygote_pid = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert zygote_pid != os.getpid()
    os.kill(zygote_pid, signal.SIGKILL)
    assert proc.wait(15) == -signal.SIGKILL  # the zygote gone, its answer is -9 ...
    wait_until(lambda: not Path(f"/proc/{proc.pid}").exists(), timeout=15, what="the child gone")  # ... and true
    assert zygote.spawn("zygote_child", ["return"], env, tmp_path / "after.log") is None  # then exec


def test_a_zygote_whose_module_leaves_a_thread_running_does_not_fork(tmp_path):
    env = _env(ZYGOTE_CHILD_THREAD="1", PYTHONPATH=f"{TESTS}:{tmp_path}")  # not the zygote of the others
    assert zygote.spawn("zygote_child", ["return"], env, tmp_path / "a.log") is None
    assert zygote.spawn("zygote_child", ["return"], env, tmp_path / "b.log") is None  # asked once only
    assert not (tmp_path / "a.log").exists()


def test_a_broker_that_cannot_start_says_so_forked_as_started(tmp_path, zookeeper):
    from metaq_broker.devtools.broker_process import BrokerProcess
    answers = []
    for how, wrapper in (("forked", ()), ("started", ("env",))):  # a wrapper is never forked
        b = BrokerProcess(tmp_path / how, 1, zookeeper.connect_string, settings={"unflushThreshold": "many"})
        with pytest.raises(RuntimeError) as e:
            b.start(wrapper=wrapper)
        assert (b.proc.__class__ is zygote.ForkedProcess) == (how == "forked")
        answers.append(str(e.value).split("\n"))
    assert answers[0][0] == answers[1][0] == "broker 1 exited with code 2:"
    assert [line for line in answers[0] if "unflushThreshold" in line] == \
        [line for line in answers[1] if "unflushThreshold" in line] != []
