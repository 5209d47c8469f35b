"""The gateway's VerifyService client: the one gateway module that touches protobuf or grpc.

It builds GenerateRequests from a `GenerationPlan`, reads GenerateResponses as plain `Round`s
and sorts gRPC failures into "resume on another verifier" (`VerifierLost`) and errors the
client gets (`APIError`). Failover itself lives in gateway/generation.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

import grpc

from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.logprobs import TokenLogprobs
from gateway.plan import GenerationPlan
from tandem.errors import FAILURE_TRAILER
from tandem.grpc_limits import message_options
from tandem.registry import WorkerRecord
from tandem.spec.methods import Method
from tandem.tls import open_channel
from tandem.v1 import common_pb2, verify_pb2, verify_pb2_grpc

log = logging.getLogger(__name__)

_FINISH = MappingProxyType({verify_pb2.FINISH_REASON_STOP: "stop",
                            verify_pb2.FINISH_REASON_LENGTH: "length"})
# A dead or draining verifier: resume elsewhere. RESOURCE_EXHAUSTED / ALREADY_EXISTS are
# about this verifier only, so another one may still take the session.
_RESUMABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS})
# Reconnect quickly: a verifier restarted at the same address should be usable in seconds.
# Messages as large as a verifier takes (tandem.grpc_limits' default: requests carry ids only).
_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 2000), *message_options())


class VerifierLost(Exception):
    """This verifier is gone or refused the session; another may take it over."""

    def __init__(self, reason: str, code: grpc.StatusCode | None = None):
        super().__init__(reason)
        self.code = code

    @property
    def at_capacity(self) -> bool:
        """The verifier was full (the client should back off, not give up)."""
        return self.code == grpc.StatusCode.RESOURCE_EXHAUSTED

    @property
    def refused(self) -> bool:
        """It refused the session before running it (full, or the session is there)."""
        return self.code in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                             grpc.StatusCode.ALREADY_EXISTS)


@dataclass(frozen=True)
class Totals:
    """Speculation counters of one Generate call (each response carries them since its start)."""

    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    lossy: bool = False
    accepted_prediction_tokens: int = 0  # of accepted_tokens, the prediction's (v1.2)
    rejected_prediction_tokens: int = 0  # the prediction's drafts verified and not kept

    def __add__(self, other: Totals) -> Totals:
        return Totals(self.rounds + other.rounds, self.drafted_tokens + other.drafted_tokens,
                      self.accepted_tokens + other.accepted_tokens, self.lossy or other.lossy,
                      self.accepted_prediction_tokens + other.accepted_prediction_tokens,
                      self.rejected_prediction_tokens + other.rejected_prediction_tokens)


@dataclass(frozen=True)
class RoundStats:
    """What the verifier did in one round (verify_pb2.RoundStats)."""

    drafted: int = 0
    accepted: int = 0
    bonus: bool = False
    draft_wait_ms: float = 0.0
    verify_ms: float = 0.0
    rejection_ms: float = 0.0


@dataclass(frozen=True)
class Round:
    """One GenerateResponse: the tokens it committed and whether the session ended."""

    token_ids: tuple[int, ...]
    totals: Totals
    finish_reason: str = ""  # "stop" or "length" once the verifier finished the session
    aborted: bool = False  # the verifier gave the session up (draining): resume elsewhere
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token_id, when the plan asked
    stats: RoundStats = RoundStats()


def _round(resp: verify_pb2.GenerateResponse) -> Round:
    t = resp.totals
    return Round(tuple(resp.token_ids),
                 Totals(t.rounds, t.drafted_tokens, t.accepted_tokens, t.lossy,
                        t.accepted_prediction_tokens, t.rejected_prediction_tokens),
                 _FINISH.get(resp.finish_reason, ""),
                 resp.finish_reason == verify_pb2.FINISH_REASON_ABORT,
                 tuple(TokenLogprobs(lp.token_id, lp.logprob,
                                     tuple(zip(lp.top_token_ids, lp.top_logprobs)))
                       for lp in resp.logprobs),
                 RoundStats(resp.round.drafted, resp.round.accepted, resp.round.bonus,
                            resp.round.draft_wait_ms, resp.round.verify_ms,
                            resp.round.rejection_ms))


_DRAFT_SHAPES = {None: verify_pb2.DRAFT_SHAPE_UNSPECIFIED, "chain": verify_pb2.DRAFT_SHAPE_CHAIN,
                 "tree": verify_pb2.DRAFT_SHAPE_TREE}


def build_request(plan: GenerationPlan, committed: Sequence[int], draft_address: str,
                  auto_draft: Method | None = None) -> verify_pb2.GenerateRequest:
    """auto_draft: for an auto session linked to a draft worker, that worker's method."""
    sampling = common_pb2.SamplingParams(**plan.sampling.to_wire())
    typical = None
    if plan.typical is not None:
        typical = verify_pb2.TypicalAcceptance(posterior_threshold=plan.typical[0],
                                               posterior_alpha=plan.typical[1])
    return verify_pb2.GenerateRequest(
        session_id=plan.session_id, prompt_token_ids=plan.prompt_token_ids,
        committed_token_ids=list(committed), sampling=sampling,
        stopping=verify_pb2.StoppingCriteria(max_new_tokens=plan.max_new_tokens,
                                             stop_token_ids=plan.stop_token_ids,
                                             ignore_eos=plan.ignore_eos),
        speculation=verify_pb2.SpeculationConfig(
            method=int(plan.method), num_speculative_tokens=plan.num_speculative_tokens,
            draft_address=draft_address, tenant=plan.tenant, typical_acceptance=typical,
            draft_shape=_DRAFT_SHAPES[plan.draft_shape],
            auto_draft_method=int(auto_draft) if auto_draft is not None else 0),
        logprobs=plan.logprobs is not None, top_logprobs=plan.logprobs or 0,
        grammar=None if plan.grammar is None else common_pb2.Grammar(**plan.grammar.to_wire()),
        prediction_token_ids=plan.prediction_token_ids)


class GenerateCall:
    """One streaming Generate call, read a round at a time."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, stall_timeout_s: float):
        self._call = call
        self._stall_timeout_s = stall_timeout_s

    async def read(self) -> Round:
        """The next round; VerifierLost when the verifier died, stalled or refused."""
        try:
            resp = await asyncio.wait_for(self._call.read(), timeout=self._stall_timeout_s)
        except asyncio.TimeoutError:
            raise VerifierLost("no message within the stall timeout",
                               grpc.StatusCode.DEADLINE_EXCEEDED) from None
        except grpc.aio.AioRpcError as exc:
            raise _classify(exc) from None
        if resp is grpc.aio.EOF:
            raise VerifierLost("stream ended without a finish reason",
                               grpc.StatusCode.UNAVAILABLE)
        rnd = _round(resp)
        if rnd.finish_reason:  # the last message: read the call's end, which ends its span
            with contextlib.suppress(asyncio.TimeoutError, grpc.aio.AioRpcError):
                await asyncio.wait_for(self._call.read(), timeout=min(self._stall_timeout_s, 1))
        return rnd

    def cancel(self) -> None:
        self._call.cancel()  # no-op when the call already ended


def _classify(exc: grpc.aio.AioRpcError) -> Exception:
    code = exc.code()
    if FAILURE_TRAILER in tuple(exc.trailing_metadata() or ()):  # tandem.errors.SessionFailed
        return APIError(500, f"generation failed: {exc.details()}", code="generation_failed")
    if code in _RESUMABLE:
        return VerifierLost(f"{code.name}: {exc.details()}", code)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, exc.details() or "invalid request", code="invalid_request")
    return APIError(502, f"verifier error {code.name}: {exc.details()}")


class ChannelPool:
    """One grpc.aio channel per verifier address for the app's lifetime."""

    def __init__(self, config: GatewayConfig):
        self._config = config
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._described: dict[str, WorkerRecord] = {}

    def stub(self, address: str) -> verify_pb2_grpc.VerifyServiceStub:
        if address not in self._channels:
            self._channels[address] = open_channel(address, self._config.tls, _CHANNEL_OPTIONS)
        return verify_pb2_grpc.VerifyServiceStub(self._channels[address])

    def generate(self, address: str, plan: GenerationPlan, committed: Sequence[int],
                 draft_address: str, timeout: float,
                 auto_draft: Method | None = None) -> GenerateCall:
        """Start Generate on `address`, resuming after `committed` tokens."""
        call = self.stub(address).Generate(
            build_request(plan, committed, draft_address, auto_draft), timeout=timeout)
        return GenerateCall(call, self._config.stall_timeout_s)

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
                           max_spec_tokens=info.max_spec_tokens)
        self._described[address] = rec
        return rec

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()
