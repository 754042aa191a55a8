"""Host tier: what a CPU worker reports about its device, measured on this machine with
real processes beside it."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from center_pool.hardware import HostProbe

BURN = "while True:\n    pass\n"


def test_an_idle_worker_on_a_busy_host_reports_itself_idle() -> None:
    """Another process keeps the cores busy; this process, idle, is the worker."""
    probe = HostProbe()
    burners = [
        subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(psutil.cpu_count() or 1)
    ]
    try:
        spent = [psutil.Process(b.pid) for b in burners]
        deadline = time.monotonic() + 30.0
        # Until the other processes have burnt a second of CPU between them.
        while sum(p.cpu_times().user for p in spent) < 1.0:
            assert time.monotonic() < deadline, "the burners never ran"
            spent[0].cpu_times()  # polls psutil; the test process stays idle meanwhile
            time.sleep(0.05)
        sample = probe.sample()
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert sample.utilisation < 0.25  # the host is near 1.0; this worker did nothing
