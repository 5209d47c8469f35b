"""Which draft worker a session should leave, and which it stays away from (issue 47).

A worker whose link is up can still fail a session for good: it refuses it (full: RESOURCE_
EXHAUSTED; or INTERNAL, UNSUPPORTED_METHOD), or takes it and never drafts for it (a stalled
drafting loop). Either way the session moves to another worker of the pool, or decodes plain
when there is none; drafts are only proposals, so what the text is does not change.
"""
from __future__ import annotations

from collections.abc import Callable

from tandem.backoff import KeyedBackoff
from tandem.spec import ErrorCode, Method
from tandem.spec.methods import HISTORY_SOURCES

# A session that asked its worker for drafts and got none for this long leaves it. A healthy
# worker's first draft comes in milliseconds (a grammar compile, in seconds).
DRAFT_SILENCE_S = 10.0
# A worker that refused a session or went silent on it is not picked for that session again
# for this long, doubling per repeat (one session's; the worker may serve others).
AVOID_S, MAX_AVOID_S = 10.0, 120.0
# Refusals another worker may not share; the others (an unknown session, one out of sync, a
# bad argument) say nothing against this worker.
REFUSALS = frozenset({ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.UNSUPPORTED_METHOD,
                      ErrorCode.INTERNAL})


class Avoided:
    """The workers one session stays away from: a container of addresses (DraftPool.get)."""

    def __init__(self, clock: Callable[[], float]):
        self._breaker = KeyedBackoff(AVOID_S, MAX_AVOID_S, clock)

    def add(self, address: str) -> None:
        self._breaker.failed(address)

    def __contains__(self, address: object) -> bool:
        return not self._breaker.ready(address)


class LinkWatch:
    def __init__(self, clock: Callable[[], float], silence_s: float = DRAFT_SILENCE_S):
        self._clock, self.silence_s = clock, silence_s
        self._waiting_since: dict[str, float] = {}  # session -> asked, none arrived since
        self._avoided: dict[str, Avoided] = {}

    def asked(self, session_id: str, method: Method) -> None:
        """The session asks its link for drafts: the silence starts now, unless it already
        runs. History methods (n-gram, suffix) often have nothing to say: never silent."""
        if method not in HISTORY_SOURCES:
            self._waiting_since.setdefault(session_id, self._clock())

    def quiet(self, session_id: str) -> None:
        """A draft arrived, the session paused its drafts, or it left its link."""
        self._waiting_since.pop(session_id, None)

    def silent(self, session_id: str) -> bool:
        since = self._waiting_since.get(session_id)
        return since is not None and self._clock() - since >= self.silence_s

    def avoid(self, session_id: str, address: str) -> None:
        self._avoided.setdefault(session_id, Avoided(self._clock)).add(address)

    def avoided(self, session_id: str) -> Avoided | None:
        return self._avoided.get(session_id)

    def forget(self, session_id: str) -> None:
        self._waiting_since.pop(session_id, None)
        self._avoided.pop(session_id, None)
