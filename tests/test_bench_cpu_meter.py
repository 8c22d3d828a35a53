"""``benchmarks.common.CpuMeter``: a process's CPU from its threads' nanoseconds, not 10 ms ticks, and the
ticks when a thread that used some of it has ended."""
import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import CpuMeter  # noqa: E402

pytestmark = pytest.mark.unit


def burn(cpu_s: float) -> None:
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_it_reads_this_process_to_the_millisecond():
    """A 25 ms burn reads 25 ms (the kernel's own count, time.process_time), not 20 or 30 (ticks)."""
    meter, before = CpuMeter(os.getpid()), time.process_time()
    burn(0.025)
    used, measured = time.process_time() - before, meter.seconds()
    assert abs(measured - used) < 0.003, (measured, used)


def test_a_thread_that_ended_is_counted_through_the_ticks():
    meter = CpuMeter(os.getpid())
    t = threading.Thread(target=burn, args=(0.1,))
    t.start()
    t.join()
    assert meter.seconds() >= 0.1 - 0.02  # its 100 ms, within a tick either side
