"""Exponential backoff, in one place: after `failures` failures in a row the next try waits
`first_s`, doubling with each further failure, never more than `max_s`.

`backoff_s` is the arithmetic; `KeyedBackoff` keeps it per key (a circuit breaker each).
Their users: the verifier's draft side (a session looking for a draft worker again, a failed
worker skipped; verify_service/drafts/) and the launcher restarting a draft worker that died
(tools/launcher.py).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable

# 2.0 ** 1000 is still a float: past it the delay is max_s anyway, and a worker that keeps
# failing for days must not make the arithmetic overflow.
_MAX_DOUBLINGS = 1000


def backoff_s(failures: int, first_s: float, max_s: float) -> float:
    """The wait after `failures` (>= 1) failures in a row: first_s * 2 ** (failures - 1),
    capped at max_s."""
    if failures < 1:
        raise ValueError(f"failures must be >= 1, got {failures}")
    return min(max_s, first_s * 2.0 ** min(failures - 1, _MAX_DOUBLINGS))


class KeyedBackoff:
    """A circuit breaker per key (a worker's address, a child process's name): each failure
    opens it for backoff_s(failures in a row, first_s, max_s); once that has passed the key
    may be tried again, and a success closes it (the count starts over)."""

    def __init__(self, first_s: float, max_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.first_s, self.max_s = first_s, max_s
        self._clock = clock
        self._failures: dict[Hashable, int] = {}
        self._until: dict[Hashable, float] = {}

    def failed(self, key: Hashable, now: float | None = None) -> int:
        """One more failure of `key`: open it; returns its failures in a row."""
        n = self._failures[key] = self._failures.get(key, 0) + 1
        now = self._clock() if now is None else now
        self._until[key] = now + backoff_s(n, self.first_s, self.max_s)
        return n

    def ready(self, key: Hashable, now: float | None = None) -> bool:
        """Whether `key` may be tried (never failed, or its backoff has passed)."""
        now = self._clock() if now is None else now
        return now >= self._until.get(key, -math.inf)

    def succeeded(self, key: Hashable) -> None:
        self._failures.pop(key, None)

    def failures(self, key: Hashable) -> int:
        return self._failures.get(key, 0)
