"""Threads for one tenant's heavy but deferrable work (compiling a grammar, tokenizing a
huge body): they run at a lower CPU priority, so that on a busy host the work every tenant
waits on (the verifier's forward pass, the event loops) gets the cores first."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

# Added to the process's (Linux schedules each thread by its own nice value). The lowest
# priority: at 10 (a tenth of a core's share) 12 wide schemas compiled in the gateway,
# verifier and draft worker still took the neighbour's p99 to 1.5-1.8x; at 19, 1.2-1.5x.
NICENESS = 19


def lower_priority() -> None:
    """Make the calling thread yield the CPU to the process's other threads (Linux; a
    no-op where threads have no nice value of their own, or it is not allowed)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICENESS)
    except (AttributeError, OSError):
        pass


def background_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool whose threads run at the lower priority."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=lower_priority)
