"""``devtools.process.freeze``: a test that freezes a member (SIGSTOP) and then acts must find every
thread of it stopped. ``kill`` alone returns while threads other than the one woken for the signal still
run: a frozen replica went on fetching, fsyncing and reporting the put sent right after the "freeze", and
an acks=all put was acknowledged that the test believed no replica could have."""
from __future__ import annotations

import mmap
import os
import signal
import struct
import subprocess
import sys
import time

import pytest

from metaq_broker.devtools.process import freeze, thread_states

pytestmark = pytest.mark.process

SPINNER = """
import mmap, struct, sys, threading, time
shared = mmap.mmap(int(sys.argv[1]), 8)
def spin():
    i = 0
    while True:
        i += 1
        shared[0:8] = struct.pack("q", i)
threading.Thread(target=spin, daemon=True).start()
while True:
    time.sleep(1)  # the main thread, asleep, is the one the kernel wakes to take a signal
"""


def _count(shared) -> int:
    return struct.unpack("q", shared[0:8])[0]


def test_no_thread_of_a_frozen_process_runs_once_freeze_returns():
    moved = []
    for trial in range(8):  # with a bare kill(SIGSTOP) the spinning thread ran on in 31 of 40 trials
        fd = os.memfd_create("counter")
        os.ftruncate(fd, 8)
        shared = mmap.mmap(fd, 8)
        proc = subprocess.Popen([sys.executable, "-c", SPINNER, str(fd)], pass_fds=[fd])
        try:
            deadline = time.monotonic() + 30
            while _count(shared) < 1000:
                assert proc.poll() is None and time.monotonic() < deadline, "the spinner did not start"
                time.sleep(0.01)
            freeze(proc.pid)
            assert set(thread_states(proc.pid).values()) == {"T"}, thread_states(proc.pid)
            before = _count(shared)
            time.sleep(0.05)
            if _count(shared) != before:
                moved.append(trial)
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.05)
            assert _count(shared) != before, "SIGCONT did not resume it"
        finally:
            proc.kill()
            proc.wait()
            shared.close()
            os.close(fd)
    assert not moved, f"a thread ran after freeze() returned in trials {moved}"


def test_freezing_a_process_that_is_gone_names_it():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(ProcessLookupError):
        freeze(proc.pid)
    assert thread_states(proc.pid) == {}
