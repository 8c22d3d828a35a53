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
    """A 25 ms burn reads 25 ms (the kernel's own count, time.process_time), not 20 or 30 (ticks). The
    process's other threads may run meanwhile (the test worker's, a run's leftovers), and both counts see
    them: the reading lies between the kernel's count over the burn and over the meter's whole life (stop
    39's run, under load: 29.0 ms read against 25.3 ms counted over the burn only). A thread that ends
    meanwhile sends the meter to the ticks (the other test): tried again then, at most three times."""
    for _ in range(3):
        threads = set(os.listdir("/proc/self/task"))
        outer = time.process_time()
        meter = CpuMeter(os.getpid())
        inner = time.process_time()
        burn(0.025)
        burnt = time.process_time() - inner
        measured = meter.seconds()
        lifetime = time.process_time() - outer
        if threads <= set(os.listdir("/proc/self/task")):
            break
    assert burnt - 0.001 <= measured <= lifetime + 0.001, (measured, burnt, lifetime)


def test_a_thread_that_ended_is_counted_through_the_ticks():
    meter = CpuMeter(os.getpid())
    t = threading.Thread(target=burn, args=(0.1,))
    t.start()
    t.join()
    assert meter.seconds() >= 0.1 - 0.02  # its 100 ms, within a tick either side


@pytest.mark.process  # a child process of its own
def test_since_start_reads_a_process_from_its_start():
    """A child that burns 60 ms of CPU before anyone can meter it: ``since_start`` counts them (to the
    millisecond, not to the tick), as the kernel's own total for it does."""
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.06\n"
                              "while time.process_time() < end: pass\nprint(flush=True)\ntime.sleep(30)"],
                             stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # it has burnt its 60 ms
        measured = CpuMeter(child.pid, since_start=True).seconds()
        assert measured >= 0.06 and CpuMeter(child.pid).seconds() < 0.005, measured
    finally:
        child.kill()
        child.wait()
