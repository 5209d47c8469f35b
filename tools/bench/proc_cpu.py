"""CPU seconds of a cluster's processes, by role, read from /proc (Linux): what each arm of a
load A/B cost the verifier, the draft worker, the gateway, Redis and the client itself, on a
host where they share the cores (tools/bench/load_ab.py --cpu)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of one process (its threads included); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """pid and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):  # it ended meanwhile
                todo += [int(c) for c in task.read_text().split()]
    return out


def role(pid: int) -> str:
    """`verifier`, `draft`, `gateway`, `redis` (the `tandem <role>` of its command line), else
    `other`."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "other"
    if "tools.cli" in argv and argv.index("tools.cli") + 1 < len(argv):
        return argv[argv.index("tools.cli") + 1]
    return "redis" if any("redis-server" in a for a in argv) else "other"


def by_role(roots: list[int]) -> dict[str, float]:
    """CPU seconds so far of every process under `roots`, summed by role, and this process's
    (the client's)."""
    out: dict[str, float] = {"client": cpu_s(os.getpid())}
    for root in roots:
        for p in descendants(root):
            r = role(p)
            out[r] = out.get(r, 0.0) + cpu_s(p)
    return out
