"""One session's Generate call(s): failover across verifiers, detokenization, stop strings.

`run_session` yields `TextDelta`s and one final `Finished`. Underneath, `_Failover` calls
the verifier (gateway/verifier.py) and, when a verifier dies mid-stream, resumes the session
on another with the committed tokens recorded so far, so the client sees every token exactly
once.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
from redis.exceptions import RedisError

from gateway.config import GatewayConfig
from gateway.errors import APIError, rate_limited, redacted_reason, unavailable
from gateway.logprobs import TokenLogprobs
from gateway.plan import GenerationPlan, auto_draft_method
from gateway.routing import Assignment, Router
from gateway.schemas import speculation_stats
from gateway.sessions import SessionStore
from gateway.text import TextStream
from gateway.verifier import ChannelPool, Round, RoundStats, Totals, VerifierLost
from tandem.spec.methods import Method

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TextDelta:
    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()  # of the tokens this delta used, when asked
    tokens: int = 0  # completion tokens this delta used (what a quota charges if cut short)
    index: int = 0  # the choice (n > 1)


@dataclass(frozen=True)
class RoundEvent:
    """One verification round, for clients that asked for speculation.events."""

    round: int  # the session's round count so far (across failovers)
    committed: int  # tokens this round gave the client's session
    stats: RoundStats
    index: int = 0  # the choice (n > 1)

    def as_dict(self) -> dict:
        s = self.stats
        return {"round": self.round, "drafted": s.drafted, "accepted": s.accepted,
                "bonus": s.bonus, "committed": self.committed,
                "draft_wait_ms": round(s.draft_wait_ms, 3), "verify_ms": round(s.verify_ms, 3),
                "rejection_ms": round(s.rejection_ms, 3)}


@dataclass(frozen=True)
class Finished:
    """The end of a session; of an n > 1 request, the end of the last choice, with the
    totals and every choice's end in `choices` (gateway/choices.py)."""

    finish_reason: str
    completion_tokens: int
    speculation: dict
    index: int = 0
    choices: tuple = ()  # ChoiceEnd of every choice (n > 1), by index
    # With a prediction: its tokens accepted and rejected (gateway/prediction.py); else None.
    prediction: tuple[int, int] | None = None


@dataclass
class GenerationDeps:
    config: GatewayConfig
    router: Router
    channels: ChannelPool
    store: SessionStore
    # Store writes that must outlive a cancelled request (see _background).
    background: set[asyncio.Task] = field(default_factory=set)


async def _safe(what: str, coro) -> None:
    """Session records are bookkeeping: Redis trouble is logged, never fails a request."""
    try:
        await coro
    except (RedisError, OSError) as exc:
        log.warning("session store %s failed: %s", what, exc)


class _Failover:
    """The Generate call(s) of one session; yields each round's committed token ids."""

    def __init__(self, plan: GenerationPlan, deps: GenerationDeps):
        self.plan, self.deps = plan, deps
        self.committed: list[int] = []
        # Each call reports totals since it started: sum those of the calls that ended.
        self._ended_totals = Totals()
        self._call_totals = Totals()
        self.finish_reason = ""
        # The last round: how many of its tokens were accepted drafts (they come first), and
        # how many the gateway kept (max_tokens may cut it).
        self._last_round = (0, 0)
        self.round_logprobs: tuple[TokenLogprobs, ...] = ()  # of the last round's ids
        self.last_round: RoundEvent | None = None
        self._auto_draft: Method | None = None  # auto: its draft worker's method (if any)

    def stats(self, used: int | None = None) -> dict:
        """Speculation stats over the tokens the client got: `used` of the committed ones
        (a stop string or stop token may end the text inside the last round)."""
        t = self._ended_totals + self._call_totals
        used = len(self.committed) if used is None else used
        accepted, kept = self._last_round
        shown = max(0, kept - (len(self.committed) - used))  # of the last round's tokens
        unused = max(0, accepted - shown)  # accepted drafts the client never got
        return speculation_stats(self.plan.method, t.rounds, t.drafted_tokens,
                                 t.accepted_tokens - unused, used, t.lossy)

    def prediction(self) -> tuple[int, int] | None:
        """The prediction's tokens accepted and rejected over every call (None: none)."""
        if not self.plan.prediction_token_ids:
            return None
        t = self._ended_totals + self._call_totals
        return t.accepted_prediction_tokens, t.rejected_prediction_tokens

    async def tokens(self) -> AsyncIterator[list[int]]:
        cfg, loop = self.deps.config, asyncio.get_running_loop()
        deadline = loop.time() + cfg.request_timeout_s
        excluded: list[str] = []
        last: VerifierLost | None = None
        losses = 0
        for attempt in range(cfg.max_attempts):
            if loop.time() >= deadline:
                raise APIError(504, "request timed out", code="timeout")
            draft_method = await self._draft_method()
            assignment = await self.deps.router.assign(
                self.plan.affinity_key, exclude=excluded, need_draft=draft_method is not None,
                method=draft_method.api_name if draft_method else "")
            if assignment is None:
                break
            address = assignment.verifier.address
            if self.deps.router.inflight.get(address, 0) >= assignment.verifier.capacity:
                # Our own streams alone fill it: refuse now, not after a Redis write and a
                # gRPC round trip that the verifier would answer RESOURCE_EXHAUSTED.
                excluded.append(address)
                last = VerifierLost(f"{address} is full ({assignment.verifier.capacity} "
                                    "sessions)", grpc.StatusCode.RESOURCE_EXHAUSTED)
                continue
            try:
                # aclosing: an early stop (stop string, client gone) cancels the call now
                async with aclosing(self._attempt(assignment, attempt,
                                                  deadline - loop.time())) as ids_stream:
                    async for ids in ids_stream:
                        yield ids
                return
            except VerifierLost as exc:
                log.warning("session %s: verifier %s failed (%s); %d tokens committed, resuming",
                            self.plan.session_id, assignment.verifier.address,
                            exc.code.name if exc.code else "lost", len(self.committed))
                excluded.append(assignment.verifier.address)
                last = exc
                losses += not exc.refused
                if losses > cfg.max_resumes:  # it may be what killed them: not one more
                    raise APIError(502, f"generation failed on {losses} verifiers; not "
                                   f"retried (last error: {exc})", code="verifier_lost") from None
            self._ended_totals = self._ended_totals + self._call_totals
            self._call_totals = Totals()
        if last is not None and last.at_capacity:
            raise rate_limited(f"verifiers are at capacity: {last}", self.deps.config.retry_after_s)
        reason = f" (last error: {last})" if last else ""
        raise unavailable(f"no verifier available{reason}")

    async def _draft_method(self) -> Method | None:
        """The method of the draft worker to assign: the plan's; for auto (which drafts in
        the verifier's own step) the model method it may also take drafts from, if served."""
        method = self.plan.method
        if method is Method.AUTO:
            if not self.deps.config.auto_model_drafts:
                return None
            self._auto_draft = await auto_draft_method(self.deps.router,
                                                       self.deps.config.method_preference)
            return self._auto_draft
        return None if method is Method.NONE else method

    async def _resume_from(self) -> list[int]:
        """The committed tokens as the session record has them (the in-memory copy if
        Redis lost writes: those are exactly what the client was shown)."""
        try:
            stored = await self.deps.store.committed(self.plan.session_id)
        except (RedisError, OSError):
            return list(self.committed)
        if stored != self.committed:
            log.warning("session %s: record has %d committed tokens, gateway %d; using gateway's",
                        self.plan.session_id, len(stored), len(self.committed))
            return list(self.committed)
        return stored

    async def _attempt(self, a: Assignment, attempt: int,
                       timeout: float) -> AsyncIterator[list[int]]:
        deps, plan, addr = self.deps, self.plan, a.verifier.address
        committed = await self._resume_from() if attempt else []
        draft_addr = a.draft.address if a.draft else ""
        await _safe("assign", deps.store.assign(plan.session_id, verifier=addr, draft=draft_addr,
                                                status="resuming" if attempt else "running"))
        await deps.router.remember(plan.affinity_key, addr)
        call = deps.channels.generate(addr, plan, committed, draft_addr, timeout,
                                      auto_draft=self._auto_draft if draft_addr else None)
        deps.router.acquire(addr, *([draft_addr] if draft_addr else []))
        try:
            while not self.finish_reason:
                rnd = await call.read()
                ids = self._accept(rnd)
                if ids:
                    # Recorded before it is shown: a resumed session sends exactly these back.
                    await _safe("append", deps.store.append(plan.session_id, ids))
                    self.committed.extend(ids)
                    yield ids
                if rnd.aborted:
                    raise VerifierLost("the verifier aborted the session")
        finally:
            call.cancel()  # aborts the call on an early exit
            deps.router.release(addr, *([draft_addr] if draft_addr else []))

    def _accept(self, rnd: Round) -> list[int]:
        """The new tokens of a round; sets finish_reason when the session is done.
        The gateway enforces max_new_tokens itself so a misbehaving verifier cannot
        overrun it."""
        accepted = rnd.totals.accepted_tokens - self._call_totals.accepted_tokens
        self._call_totals = rnd.totals
        room = self.plan.max_new_tokens - len(self.committed)
        ids = list(rnd.token_ids)[:room]
        self._last_round = (accepted, len(ids))
        self.round_logprobs = rnd.logprobs[:len(ids)]
        rounds = (self._ended_totals + self._call_totals).rounds
        self.last_round = RoundEvent(rounds, len(ids), rnd.stats)
        if rnd.finish_reason:
            self.finish_reason = rnd.finish_reason
        elif len(self.committed) + len(ids) >= self.plan.max_new_tokens:
            self.finish_reason = "length"
        return ids


async def run_session(plan: GenerationPlan, deps: GenerationDeps, text: TextStream,
                      started: asyncio.Event | None = None
                      ) -> AsyncIterator[TextDelta | Finished]:
    """Text deltas, then one Finished. Raises APIError (before or during the stream).
    `started` is set once the first round is in (the verifier has the prompt cached)."""
    runner = _Failover(plan, deps)
    store, session_id = deps.store, plan.session_id
    done = False
    try:
        async with aclosing(runner.tokens()) as token_stream:
            async for ids in token_stream:
                if started is not None:
                    started.set()
                used = text.num_tokens
                delta = text.push(ids)
                # the logprobs of the tokens the text used (not those after a stop)
                logprobs = runner.round_logprobs[:max(0, text.num_tokens - used)]
                if delta or logprobs:
                    yield TextDelta(delta, logprobs, text.num_tokens - used)
                if plan.round_events and runner.last_round is not None:
                    yield runner.last_round
                if text.stopped:
                    break  # leaving the block closes the stream, which cancels the call
        tail = text.finish()
        if tail:
            yield TextDelta(tail)
        reason = "stop" if text.stopped else (runner.finish_reason or "length")
        done = True
        await _safe("finish", store.finish(session_id, status="finished", finish_reason=reason))
        used = text.num_tokens if text.stopped else len(runner.committed)
        yield Finished(reason, used, runner.stats(used), prediction=runner.prediction())
    except APIError as exc:
        done = True
        await _safe("finish", store.finish(session_id, status="failed",
                                           error=redacted_reason(exc)))
        raise
    finally:
        if not done:  # the client went away: record it without awaiting a cancelled task
            _background(deps, store.finish(session_id, status="cancelled"))


def _background(deps: GenerationDeps, coro) -> None:
    task = asyncio.get_running_loop().create_task(_safe("cancel", coro))
    deps.background.add(task)
    task.add_done_callback(deps.background.discard)
