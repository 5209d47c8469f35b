"""When `tandem up` starts a dead child again, and when it gives up.

Every child (Redis, verifiers, draft workers, the gateway) gets the same policy: a child that
exits is started again after a backoff that doubles per restart in a row (tandem.backoff), and
more than `max_restarts` restarts of one child within `window_s` stop the cluster: a child
that dies at once every time (a bad flag, a port taken, a broken model) would otherwise spin
for ever while the cluster looks up.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from tandem.backoff import KeyedBackoff

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
MAX_RESTARTS = 5  # of one child, within WINDOW_S
WINDOW_S = 600.0


class ClusterFailed(RuntimeError):
    """The cluster cannot go on (a child would not start, or kept dying); the message says
    which child and why."""


class RestartPolicy:
    """Per child: may it start again now, and has it used up its restarts?"""

    def __init__(self, first_s: float = FIRST_BACKOFF_S, max_s: float = MAX_BACKOFF_S,
                 max_restarts: int = MAX_RESTARTS, window_s: float = WINDOW_S):
        if max_restarts < 0 or window_s <= 0:
            raise ValueError("need max_restarts >= 0 and window_s > 0")
        self.backoff = KeyedBackoff(first_s, max_s)
        self.max_restarts, self.window_s = max_restarts, window_s
        self._recent: dict[str, deque[float]] = {}  # child -> times of its recent restarts

    def ready(self, name: str, now: float) -> bool:
        return self.backoff.ready(name, now)

    def restarting(self, name: str, now: float, why: str) -> int:
        """Count one restart of `name` at `now` and return its number in a row; raises
        ClusterFailed when it would be more than max_restarts within window_s."""
        recent = self._recent.setdefault(name, deque())
        while recent and now - recent[0] > self.window_s:
            recent.popleft()
        if not recent:  # quiet for a whole window: it is not failing in a row
            self.backoff.succeeded(name)
        if len(recent) >= self.max_restarts:
            raise ClusterFailed(
                f"{name} {why} and was already restarted {len(recent)} times in the last "
                f"{self.window_s:.0f} s; stopping the cluster (see {name}'s output above)")
        recent.append(now)
        return self.backoff.failed(name, now)


def restart_dead(children: list[tuple[str, Callable[[], str | None], Callable[[], None]]],
                 policy: RestartPolicy, log, clock: Callable[[], float] = time.monotonic
                 ) -> list[str]:
    """For each (name, why_dead, restart) whose why_dead() says it has exited (None: alive),
    call restart() once its backoff has passed; the names restarted. A restart that raises
    counts as a restart and is tried again after the next backoff."""
    restarted = []
    for name, why_dead, restart in children:
        why = why_dead()
        if why is None or not policy.ready(name, now := clock()):
            continue
        count = policy.restarting(name, now, why)
        log(f"  {name} {why}; starting it again (restart {count} in a row)")
        try:
            restart()
        except (OSError, RuntimeError) as exc:
            log(f"  {name} could not be started again: {exc}")
            continue
        restarted.append(name)
    return restarted
