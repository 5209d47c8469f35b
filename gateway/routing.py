"""Which verifier and draft worker serve a session.

The choice itself is pure functions over WorkerRecords (easy to test exhaustively); `Router`
adds the effects: reading the registry, the static fallback, the affinity store and the
gateway's own in-flight counts (registry loads lag by a heartbeat, our own count does not).
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from redis.exceptions import RedisError

from gateway.sessions import AffinityStore
from tandem.registry import WorkerRecord

log = logging.getLogger(__name__)

# Only the start of a conversation identifies it: later turns share it, so they land on the
# verifier whose prefix cache already holds it.
_AFFINITY_PREFIX_CHARS = 512


@dataclass(frozen=True)
class Assignment:
    verifier: WorkerRecord
    draft: WorkerRecord | None


def affinity_key(text: str) -> str:
    return hashlib.sha256(text[:_AFFINITY_PREFIX_CHARS].encode()).hexdigest()[:32]


def effective_load(rec: WorkerRecord, inflight: Mapping[str, int]) -> int:
    return rec.load + inflight.get(rec.address, 0)


def utilization(rec: WorkerRecord, inflight: Mapping[str, int]) -> float:
    load = effective_load(rec, inflight)
    return load / rec.capacity if rec.capacity > 0 else float("inf")


def _compatible(a: str, b: str) -> bool:
    """Token ids only mean the same on both sides when tokenizers match (unknown = trust)."""
    return not a or not b or a == b


def pick_verifier(verifiers: Iterable[WorkerRecord], *, inflight: Mapping[str, int],
                  preferred: str | None = None, exclude: Iterable[str] = (),
                  tokenizer_hash: str = "") -> WorkerRecord | None:
    """The preferred (affinity) verifier if alive and not full, else the least utilized."""
    excluded = set(exclude)
    candidates = [v for v in verifiers if v.address not in excluded
                  and _compatible(v.tokenizer_hash, tokenizer_hash)]
    if not candidates:
        return None
    if preferred:
        for v in candidates:
            if v.address == preferred and effective_load(v, inflight) < v.capacity:
                return v
    return min(candidates, key=lambda v: (utilization(v, inflight), effective_load(v, inflight),
                                          v.address))


def pick_draft(drafts: Iterable[WorkerRecord], *, inflight: Mapping[str, int],
               verifier: WorkerRecord, method: str = "") -> WorkerRecord | None:
    """Least utilized draft worker sharing the verifier's tokenizer (and serving `method`,
    where workers advertise theirs). A full one is still better than none: speculation fails
    open on the verifier if it cannot keep up."""
    candidates = [d for d in drafts if _compatible(d.tokenizer_hash, verifier.tokenizer_hash)
                  and (not method or not d.methods or method in d.methods)]
    if not candidates:
        return None
    return min(candidates, key=lambda d: (utilization(d, inflight), effective_load(d, inflight),
                                          d.address))


class WorkerSource(Protocol):
    async def list(self, role: str) -> list[WorkerRecord]: ...


Describe = Callable[[str], Awaitable[WorkerRecord]]


class Router:
    """Routing with effects. One per app; holds the gateway's in-flight counts."""

    def __init__(self, source: WorkerSource, affinity: AffinityStore, *,
                 static_verifiers: tuple[str, ...] = (), static_drafts: tuple[str, ...] = (),
                 describe_verifier: Describe | None = None, static_capacity: int = 64,
                 tokenizer_hash: str = "", empty_grace_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self._source = source
        self._affinity = affinity
        self._static_verifiers = static_verifiers
        self._static_drafts = static_drafts
        self._describe = describe_verifier
        self._static_capacity = static_capacity
        self._tokenizer_hash = tokenizer_hash
        self.inflight: dict[str, int] = {}
        # role -> (workers, when listed): the last listing that found any
        self._last_known: dict[str, tuple[list[WorkerRecord], float]] = {}
        self._empty_grace_s = empty_grace_s
        self._clock = clock

    async def _registered(self, role: str) -> list[WorkerRecord]:
        """Live workers; while Redis is unreachable, the last listing that found any
        (failover copes with any of them having died since). An empty listing within
        `empty_grace_s` of a non-empty one also keeps the last workers: a Redis restarted
        empty knows none until their next heartbeat, and refusing traffic meanwhile would
        turn a Redis blip into an outage."""
        last, when = self._last_known.get(role, ([], float("-inf")))
        try:
            found = await self._source.list(role)
        except (RedisError, OSError) as exc:
            log.warning("worker registry unavailable, using the last known workers: %s", exc)
            if last:  # still our best belief: the grace runs from when Redis answers again
                self._last_known[role] = (last, self._clock())
            return last
        now = self._clock()
        if found:
            self._last_known[role] = (found, now)
            return found
        if last and now - when <= self._empty_grace_s:
            return last
        return found

    def _static(self, role: str, address: str) -> WorkerRecord:
        return WorkerRecord(role=role, worker_id=address, address=address,
                            capacity=self._static_capacity, load=0)

    async def verifiers(self) -> list[WorkerRecord]:
        found = await self._registered("verifier")
        if found or not self._static_verifiers:
            return found
        if self._describe is None:
            return [self._static("verifier", a) for a in self._static_verifiers]
        return [await self._describe(a) for a in self._static_verifiers]

    async def drafts(self) -> list[WorkerRecord]:
        found = await self._registered("draft")
        return found or [self._static("draft", a) for a in self._static_drafts]

    async def assign(self, key: str | None, *, exclude: Iterable[str] = (),
                     need_draft: bool = True, method: str = "") -> Assignment | None:
        preferred = await self._preferred(key)
        verifier = pick_verifier(await self.verifiers(), inflight=self.inflight,
                                 preferred=preferred, exclude=exclude,
                                 tokenizer_hash=self._tokenizer_hash)
        if verifier is None:
            return None
        draft = None
        if need_draft:
            draft = pick_draft(await self.drafts(), inflight=self.inflight, verifier=verifier,
                               method=method)
        return Assignment(verifier, draft)

    async def _preferred(self, key: str | None) -> str | None:
        if not key:
            return None
        try:
            return await self._affinity.get(key)
        except (RedisError, OSError) as exc:
            log.warning("affinity lookup failed: %s", exc)
            return None

    async def remember(self, key: str | None, address: str) -> None:
        if not key:
            return
        try:
            await self._affinity.set(key, address)
        except (RedisError, OSError) as exc:
            log.warning("affinity update failed: %s", exc)

    def acquire(self, *addresses: str) -> None:
        for a in addresses:
            self.inflight[a] = self.inflight.get(a, 0) + 1

    def release(self, *addresses: str) -> None:
        for a in addresses:
            left = self.inflight.get(a, 0) - 1
            if left > 0:
                self.inflight[a] = left
            else:
                self.inflight.pop(a, None)
