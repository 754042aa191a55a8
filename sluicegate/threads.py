"""Thread pools for compute whose threads carry their name into the operating system.

OpenCV and ONNX Runtime run on these threads; naming them at the OS level (Linux
``prctl(PR_SET_NAME)``, 15 characters) makes them visible as such in ``top -H``, ``ps -L``,
py-spy and ``/proc/<pid>/task/*/comm``, so an operator can see where the CPU goes. The pool
can be started eagerly, so no job pays for creating a thread or warming a model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

PR_SET_NAME = 15
EDGE_COMPUTE = "sg-infer"  # the OS name of an edge agent's model threads
POOL_COMPUTE = "sg-pool"  # the OS name of a pool worker's model threads
SYNC = "sg-sync"  # the OS name of the thread that syncs a node's SQLite log to the disk


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` (truncated to 15 bytes) where the OS supports it."""
    if not sys.platform.startswith("linux"):
        return
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    libc = ctypes.CDLL(libc_name, use_errno=True)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def compute_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads are named ``name`` in the OS."""
    return ThreadPoolExecutor(
        workers, thread_name_prefix=name, initializer=name_os_thread, initargs=(name,)
    )


def start_all(pool: ThreadPoolExecutor, workers: int) -> None:
    """Create every thread of ``pool`` now (they are otherwise made on first use)."""
    barrier = threading.Barrier(workers, timeout=30.0)
    futures = [pool.submit(barrier.wait) for _ in range(workers)]
    for fut in futures:
        fut.result()
