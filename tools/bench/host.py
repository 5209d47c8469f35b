"""The host a bench run is on: what it is (for the report), and this process's share of it:
memory handed back between phases, and the cluster's logs kept off the progress bar.
Shared by the standard run (runner.py) and the repetitive workload (repetitive.py).
"""
from __future__ import annotations

import contextlib
import gc
import os
import platform
import sys
from pathlib import Path

from tandem.device import Placement


def machine(at: Placement | None = None) -> dict:
    """The host, and where the run's models went (`at`; the cpu when not given)."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    on_gpu = at is not None and at.device.type == "cuda"
    return {"cpu": cpu, "cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(at.device) if on_gpu else "none",
            "device": str(at.device) if at is not None else "cpu",
            "dtype": at.dtype if at is not None else "float32",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "load_avg_at_start": os.getloadavg()}


def release_memory(at: Placement | None) -> None:
    """Give what this process's models held back (the cluster's processes need it)."""
    gc.collect()
    if at is not None and at.device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


@contextlib.contextmanager
def children_log_to(path: Path):
    """Point this process's stdout/stderr at `path` while the cluster's processes are
    spawned: they inherit the descriptors, so their logs land in the file instead of tearing
    up the progress bar, and ours come back afterwards."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
