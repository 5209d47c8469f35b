"""One session's Generate call(s): failover across verifiers, detokenization, stop strings.

`run_session` yields `TextDelta`s and one final `Finished`. Underneath, `_Failover` calls
VerifyService.Generate and, when a verifier dies mid-stream, resumes the session on another
with the committed tokens recorded so far, so the client sees every token exactly once.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
from redis.exceptions import RedisError

from gateway.config import GatewayConfig
from gateway.errors import APIError, rate_limited, unavailable
from gateway.routing import Assignment, Router
from gateway.schemas import speculation_stats
from gateway.sessions import SessionStore
from gateway.text import TextStream
from tandem.spec.methods import METHOD_TO_PB
from tandem.registry import WorkerRecord
from tandem.sampling_params import SamplingParams
from tandem.v1 import common_pb2, verify_pb2, verify_pb2_grpc

log = logging.getLogger(__name__)

_FINISH = {verify_pb2.FINISH_REASON_STOP: "stop", verify_pb2.FINISH_REASON_LENGTH: "length"}
# A dead or draining verifier: resume elsewhere. RESOURCE_EXHAUSTED / ALREADY_EXISTS are
# about this verifier only, so another one may still take the session.
_RESUMABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.ALREADY_EXISTS}
# Reconnect quickly: a verifier restarted at the same address should be usable in seconds.
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 2000)]


@dataclass(frozen=True)
class GenerationPlan:
    """What one request asks the verifiers for (validated by the app)."""

    session_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    method: str
    num_speculative_tokens: int
    affinity_key: str | None = None
    trace_metadata: tuple[tuple[str, str], ...] = ()  # W3C context for the verifier call


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    completion_tokens: int
    speculation: dict


def _sum(a: verify_pb2.SessionStats, b: verify_pb2.SessionStats) -> verify_pb2.SessionStats:
    return verify_pb2.SessionStats(rounds=a.rounds + b.rounds,
                                   drafted_tokens=a.drafted_tokens + b.drafted_tokens,
                                   accepted_tokens=a.accepted_tokens + b.accepted_tokens)


class ChannelPool:
    """One grpc.aio channel per verifier address for the app's lifetime."""

    def __init__(self, config: GatewayConfig):
        self._config = config
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._described: dict[str, WorkerRecord] = {}

    def stub(self, address: str) -> verify_pb2_grpc.VerifyServiceStub:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, _CHANNEL_OPTIONS)
        return verify_pb2_grpc.VerifyServiceStub(self._channels[address])

    async def describe_verifier(self, address: str) -> WorkerRecord:
        """A static verifier as a WorkerRecord, from its Info (cached once it answered)."""
        if address in self._described:
            return self._described[address]
        base = WorkerRecord("verifier", address, address, self._config.static_capacity, 0)
        try:
            info = await self.stub(address).Info(common_pb2.InfoRequest(),
                                                 timeout=self._config.info_timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.info("Info on static verifier %s failed: %s", address, exc.code().name)
            return base
        rec = WorkerRecord("verifier", address, address,
                           info.max_sessions or self._config.static_capacity, 0,
                           model_id=info.model_id, tokenizer_hash=info.tokenizer_hash,
                           max_speculative_tokens=info.max_speculative_tokens)
        self._described[address] = rec
        return rec

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()


@dataclass
class GenerationDeps:
    config: GatewayConfig
    router: Router
    channels: ChannelPool
    store: SessionStore
    # Store writes that must outlive a cancelled request (see _background).
    background: set[asyncio.Task] = field(default_factory=set)


def build_request(plan: GenerationPlan, committed: Sequence[int],
                  draft_address: str) -> verify_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=plan.sampling.temperature,
                                         top_k=plan.sampling.top_k, top_p=plan.sampling.top_p)
    if plan.sampling.seed is not None:
        sampling.seed = plan.sampling.seed
    return verify_pb2.GenerateRequest(
        session_id=plan.session_id, prompt_token_ids=plan.prompt_token_ids,
        committed_token_ids=list(committed), sampling=sampling,
        stopping=verify_pb2.StoppingCriteria(max_new_tokens=plan.max_new_tokens,
                                             stop_token_ids=plan.stop_token_ids,
                                             ignore_eos=plan.ignore_eos),
        speculation=verify_pb2.SpeculationConfig(
            method=METHOD_TO_PB[plan.method], num_speculative_tokens=plan.num_speculative_tokens,
            draft_address=draft_address))


class _Resume(Exception):
    """This verifier is gone or refused; try another with the committed tokens."""

    def __init__(self, reason: str, code: grpc.StatusCode | None = None):
        super().__init__(reason)
        self.code = code


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
        self._ended_totals = verify_pb2.SessionStats()
        self._call_totals = verify_pb2.SessionStats()
        self.finish_reason = ""

    def stats(self) -> dict:
        t = _sum(self._ended_totals, self._call_totals)
        return speculation_stats(self.plan.method, t.rounds, t.drafted_tokens,
                                 t.accepted_tokens, len(self.committed))

    async def tokens(self) -> AsyncIterator[list[int]]:
        cfg, loop = self.deps.config, asyncio.get_running_loop()
        deadline = loop.time() + cfg.request_timeout_s
        excluded: list[str] = []
        last: _Resume | None = None
        need_draft = self.plan.method != "none"
        for attempt in range(cfg.max_attempts):
            if loop.time() >= deadline:
                raise APIError(504, "request timed out", code="timeout")
            assignment = await self.deps.router.assign(self.plan.affinity_key, exclude=excluded,
                                                       need_draft=need_draft)
            if assignment is None:
                break
            try:
                # aclosing: an early stop (stop string, client gone) cancels the call now
                async with aclosing(self._attempt(assignment, attempt,
                                                  deadline - loop.time())) as ids_stream:
                    async for ids in ids_stream:
                        yield ids
                return
            except _Resume as exc:
                log.warning("session %s: verifier %s failed (%s); %d tokens committed, resuming",
                            self.plan.session_id, assignment.verifier.address, exc,
                            len(self.committed))
                excluded.append(assignment.verifier.address)
                last = exc
            self._ended_totals = _sum(self._ended_totals, self._call_totals)
            self._call_totals = verify_pb2.SessionStats()
        if last is not None and last.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise rate_limited(f"verifiers are at capacity: {last}", self.deps.config.retry_after_s)
        reason = f" (last error: {last})" if last else ""
        raise unavailable(f"no verifier available{reason}")

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
        call = deps.channels.stub(addr).Generate(build_request(plan, committed, draft_addr),
                                                 timeout=timeout,
                                                 metadata=plan.trace_metadata or None)
        deps.router.acquire(addr, *([draft_addr] if draft_addr else []))
        try:
            while not self.finish_reason:
                resp = await self._read(call)
                ids = self._accept(resp)
                if ids:
                    await _safe("append", deps.store.append(plan.session_id, ids))
                    self.committed.extend(ids)
                    yield ids
                if resp.finish_reason == verify_pb2.FINISH_REASON_ABORT:
                    raise _Resume("the verifier aborted the session", grpc.StatusCode.ABORTED)
        finally:
            call.cancel()  # no-op when the call already ended; aborts it on an early exit
            deps.router.release(addr, *([draft_addr] if draft_addr else []))

    async def _read(self, call) -> verify_pb2.GenerateResponse:
        try:
            resp = await asyncio.wait_for(call.read(), timeout=self.deps.config.stall_timeout_s)
        except asyncio.TimeoutError:
            raise _Resume("no message within the stall timeout",
                          grpc.StatusCode.DEADLINE_EXCEEDED) from None
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in _RESUMABLE:
                raise _Resume(f"{code.name}: {exc.details()}", code) from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise APIError(400, exc.details() or "invalid request",
                               code="invalid_request") from None
            raise APIError(502, f"verifier error {code.name}: {exc.details()}") from None
        if resp is grpc.aio.EOF:
            raise _Resume("stream ended without a finish reason", grpc.StatusCode.UNAVAILABLE)
        return resp

    def _accept(self, resp: verify_pb2.GenerateResponse) -> list[int]:
        """The new tokens of a response; sets finish_reason when the session is done.
        The gateway enforces max_new_tokens itself so a misbehaving verifier cannot
        overrun it."""
        self._call_totals = resp.totals
        room = self.plan.max_new_tokens - len(self.committed)
        ids = list(resp.token_ids)[:room]
        if resp.finish_reason in _FINISH:
            self.finish_reason = _FINISH[resp.finish_reason]
        elif len(self.committed) + len(ids) >= self.plan.max_new_tokens:
            self.finish_reason = "length"
        return ids


async def run_session(plan: GenerationPlan, deps: GenerationDeps,
                      text: TextStream) -> AsyncIterator[TextDelta | Finished]:
    """Text deltas, then one Finished. Raises APIError (before or during the stream)."""
    runner = _Failover(plan, deps)
    store, sid = deps.store, plan.session_id
    done = False
    try:
        async with aclosing(runner.tokens()) as token_stream:
            async for ids in token_stream:
                delta = text.push(ids)
                if delta:
                    yield TextDelta(delta)
                if text.stopped:
                    break  # leaving the block closes the stream, which cancels the call
        tail = text.finish()
        if tail:
            yield TextDelta(tail)
        reason = "stop" if text.stopped else (runner.finish_reason or "length")
        done = True
        await _safe("finish", store.finish(sid, status="finished", finish_reason=reason))
        yield Finished(reason, len(runner.committed), runner.stats())
    except APIError as exc:
        done = True
        await _safe("finish", store.finish(sid, status="failed", error=exc.message))
        raise
    finally:
        if not done:  # the client went away: record it without awaiting a cancelled task
            _background(deps, store.finish(sid, status="cancelled"))


def _background(deps: GenerationDeps, coro) -> None:
    task = asyncio.get_running_loop().create_task(_safe("cancel", coro))
    deps.background.add(task)
    task.add_done_callback(deps.background.discard)
