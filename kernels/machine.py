"""What identifies this machine's CPU for caches of per-machine results (compiled kernels,
measured layouts): code built with -march=native or timed here must not be reused on another
CPU model that shares the cache (a home folder on a network disk)."""
from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.cache
def cpu_signature() -> str:
    """The CPU's architecture and feature flags (read once: every cache key asks)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return f"{platform.machine()} {line}"
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"
