"""Exponential backoff, in one place: after `failures` failures in a row the next try waits
`first_s`, doubling with each further failure, never more than `max_s`.

Its users: the verifier's draft side (a session looking for a draft worker again, a failed
worker skipped; verify_service/drafts/) and the launcher restarting a draft worker that died
(tools/launcher.py).
"""
from __future__ import annotations

# 2.0 ** 1000 is still a float: past it the delay is max_s anyway, and a worker that keeps
# failing for days must not make the arithmetic overflow.
_MAX_DOUBLINGS = 1000


def backoff_s(failures: int, first_s: float, max_s: float) -> float:
    """The wait after `failures` (>= 1) failures in a row: first_s * 2 ** (failures - 1),
    capped at max_s."""
    if failures < 1:
        raise ValueError(f"failures must be >= 1, got {failures}")
    return min(max_s, first_s * 2.0 ** min(failures - 1, _MAX_DOUBLINGS))
