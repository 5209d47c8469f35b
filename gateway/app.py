"""The gateway's FastAPI app: OpenAI routes over run_session. Build it with `create_app`."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import redis.asyncio as aioredis
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from redis.exceptions import RedisError

from gateway import schemas
from gateway.config import GatewayConfig
from gateway.errors import (
    APIError,
    bad_request,
    from_validation_error,
    install_handlers,
    rate_limited,
    unauthorized,
)
from gateway.generation import (
    ChannelPool,
    Finished,
    GenerationDeps,
    GenerationPlan,
    TextDelta,
    run_session,
)
from gateway.observe import observed, start_request_span
from gateway.routing import Router, affinity_key
from gateway.sessions import (
    Guarded,
    RateLimiter,
    RedisAffinityStore,
    RedisBreaker,
    RedisRateLimiter,
    RedisSessionStore,
    identity,
)
from gateway.text import TextStream
from tandem import telemetry
from tandem.registry import WorkerRegistry
from tandem.sampling_params import SamplingParams
from tandem.telemetry import GatewayMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Gateway:
    """Everything a request needs; one per app (no module-level state)."""

    config: GatewayConfig
    tokenizer: Any
    clock: Callable[[], float]
    redis: aioredis.Redis
    breaker: RedisBreaker
    router: Router
    limiter: RateLimiter
    deps: GenerationDeps
    started: int
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    tracer: Any = field(default_factory=lambda: telemetry.tracer("gateway"))


def create_app(config: GatewayConfig, *, redis: aioredis.Redis, tokenizer: Any,
               clock: Callable[[], float] = time.time) -> FastAPI:
    """The gateway as an ASGI app. `tokenizer` is a Hugging Face tokenizer of the target."""
    p = config.redis_prefix
    breaker = RedisBreaker(timeout_s=config.redis_timeout_s, cooldown_s=config.redis_cooldown_s)
    channels = ChannelPool(config)
    router = Router(
        Guarded(WorkerRegistry(redis, ttl_s=config.registry_ttl_s, prefix=p), breaker),
        Guarded(RedisAffinityStore(redis, prefix=p, ttl_s=config.affinity_ttl_s), breaker),
        static_verifiers=config.static_verifiers, static_drafts=config.static_drafts,
        describe_verifier=channels.describe_verifier, static_capacity=config.static_capacity,
        tokenizer_hash=config.tokenizer_hash)
    store = Guarded(RedisSessionStore(redis, prefix=p, ttl_s=config.session_ttl_s, clock=clock),
                    breaker)
    limiter = Guarded(RedisRateLimiter(redis, rpm=config.rate_limit_rpm, prefix=p, clock=clock),
                      breaker)
    gw = _Gateway(config, tokenizer, clock, redis, breaker, router, limiter,
                  GenerationDeps(config, router, channels, store), int(clock()))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if gw.deps.background:  # let "cancelled" session writes land before exit
            await asyncio.wait(set(gw.deps.background), timeout=2)
        await channels.close()

    app = FastAPI(title="Tandem gateway", version="0.1.0", lifespan=lifespan)
    app.state.gateway = gw
    install_handlers(app)
    _add_routes(app, gw)
    return app


def _add_routes(app: FastAPI, gw: _Gateway) -> None:
    async def guard(request: Request) -> None:
        await _authorize(gw, request)

    @app.get("/health")
    async def health() -> dict:
        return await _health(gw)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(telemetry.render(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(guard)])
    async def models() -> dict:
        card = {"id": gw.config.model_name, "object": "model", "created": gw.started,
                "owned_by": "tandem", "max_model_len": gw.config.context_length}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=[Depends(guard)])
    async def completions(request: Request):
        return await _generate(gw, request, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(guard)])
    async def chat_completions(request: Request):
        return await _generate(gw, request, chat=True)


async def _authorize(gw: _Gateway, request: Request) -> None:
    """API key (when configured), then the per-key rate limit."""
    key = None
    if gw.config.auth_enabled:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        # compare every key in constant time: no early exit that leaks which prefix matched
        if not any([secrets.compare_digest(key.encode(), k.encode())
                    for k in gw.config.api_keys]):
            raise unauthorized("invalid API key")
    who = identity(key, request.client.host if request.client else None)
    try:
        retry_after = await gw.limiter.hit(who)
    except (RedisError, OSError) as exc:  # fail open: Redis trouble must not block traffic
        log.warning("rate limiter unavailable: %s", exc)
        return
    if retry_after is not None:
        raise rate_limited(f"rate limit exceeded: {gw.config.rate_limit_rpm} requests per "
                           "minute", math.ceil(retry_after))


async def _health(gw: _Gateway) -> dict:
    try:
        redis_ok = bool(await gw.breaker.call(gw.redis.ping))
    except RedisError:
        redis_ok = False
    verifiers = await gw.router.verifiers() if redis_ok else []
    return {"status": "ok", "redis": "ok" if redis_ok else "unavailable",
            "verifiers": len(verifiers), "model": gw.config.model_name}


async def _parse(request: Request, model: type[schemas._GenerationRequest]):
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def _plan(gw: _Gateway, req, sid: str) -> tuple[GenerationPlan, TextStream]:
    cfg = gw.config
    verifiers = await gw.router.verifiers()
    max_spec = max((v.max_speculative_tokens for v in verifiers), default=0)
    schemas.check_common(req, max_speculative_tokens=max_spec or cfg.max_speculative_tokens)
    if req.model is not None and req.model != cfg.model_name:
        raise bad_request(f"model: unknown model {req.model!r}; this server serves "
                          f"{cfg.model_name!r}", param="model", code="model_not_found")
    ids, conversation = schemas.prompt_token_ids(req, gw.tokenizer)
    max_new = schemas.resolve_max_tokens(req, len(ids), cfg.context_length,
                                         cfg.default_max_tokens)
    vocab = len(gw.tokenizer)
    extra_stops = tuple(req.stop_token_ids or ())
    if any(t >= vocab for t in extra_stops):
        raise bad_request(f"stop_token_ids: ids must be < {vocab}", param="stop_token_ids")
    eos = gw.tokenizer.eos_token_id
    stop_ids = tuple(dict.fromkeys(((eos,) if eos is not None and not req.ignore_eos else ())
                                   + extra_stops))
    spec = req.speculation or schemas.SpeculationOptions()
    method = spec.method or ("draft_model" if await gw.router.has_draft() else "none")
    try:
        sampling = SamplingParams(1.0 if req.temperature is None else req.temperature,
                                  req.top_k or 0, 1.0 if req.top_p is None else req.top_p,
                                  req.seed)
    except ValueError as exc:  # already range-checked by pydantic; kept as a safety net
        raise bad_request(str(exc)) from None
    plan = GenerationPlan(
        session_id=sid, prompt_token_ids=tuple(ids), sampling=sampling, max_new_tokens=max_new,
        stop_token_ids=stop_ids, ignore_eos=req.ignore_eos, method=method,
        num_speculative_tokens=(spec.num_speculative_tokens
                                if spec.num_speculative_tokens is not None
                                else cfg.default_speculative_tokens),
        affinity_key=affinity_key(conversation))
    return plan, TextStream(gw.tokenizer, req.stop_strings(), stop_ids)


async def _generate(gw: _Gateway, request: Request, *, chat: bool):
    req = await _parse(request, schemas.ChatCompletionRequest if chat
                       else schemas.CompletionRequest)
    sid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    endpoint = "chat" if chat else "completions"
    span = start_request_span(gw.tracer, request.headers, chat=chat, sid=sid, req=req)
    try:
        with trace.use_span(span, end_on_exit=False):
            plan, text = await _plan(gw, req, sid)
            plan = replace(plan, trace_metadata=tuple(telemetry.inject_context(span).items()))
            try:
                await gw.deps.store.create(sid, model=gw.config.model_name,
                                           prompt_token_ids=plan.prompt_token_ids)
            except (RedisError, OSError) as exc:
                log.warning("session %s not recorded: %s", sid, exc)
    except BaseException as exc:  # refused before generating: the span ends here
        span.set_status(trace.StatusCode.ERROR, str(exc))
        span.end()
        gw.metrics.requests.labels(endpoint=endpoint,
                                   status=str(getattr(exc, "status", "error"))).inc()
        raise
    meta = _Meta(chat, sid, int(gw.clock()), gw.config.model_name, len(plan.prompt_token_ids))
    events = observed(run_session(plan, gw.deps, text), span, gw.metrics, endpoint,
                      meta.prompt_tokens)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _stream(events, meta, include_usage)
    return await _collect(events, meta, request)


@dataclass(frozen=True)
class _Meta:
    chat: bool
    rid: str
    created: int
    model: str
    prompt_tokens: int

    def head(self) -> tuple:
        return self.chat, self.rid, self.created, self.model


async def _collect(events: AsyncIterator, meta: _Meta, request: Request) -> dict:
    parts: list[str] = []
    async with aclosing(events):
        async for ev in events:
            if isinstance(ev, TextDelta):
                parts.append(ev.text)
                # Nobody to answer: stop (closing `events` cancels the verifier's work).
                if await request.is_disconnected():
                    raise APIError(499, "client disconnected", code="client_closed")
            elif isinstance(ev, Finished):
                usage = schemas.usage_dict(meta.prompt_tokens, ev.completion_tokens)
                build = schemas.chat_response if meta.chat else schemas.completion_response
                return build(meta.rid, meta.created, meta.model, "".join(parts),
                             ev.finish_reason, usage, ev.speculation)
    raise APIError(502, "generation ended without a result")


def _sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n"


async def _stream(events: AsyncIterator, meta: _Meta, include_usage: bool) -> StreamingResponse:
    # Wait for the first event before answering: refusals (429, 503, a verifier's 400) then
    # arrive as real HTTP statuses instead of errors inside a 200 stream.
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise

    async def body() -> AsyncIterator[str]:
        async with aclosing(events):
            if meta.chat:
                yield _sse(schemas.stream_chunk(*meta.head(), role=True))
            ev = first
            try:
                while ev is not None:
                    for chunk in _chunks(ev, meta, include_usage):
                        yield _sse(chunk)
                    ev = await anext(events, None)
            except APIError as exc:  # mid-stream failure: OpenAI-style error event
                yield _sse(exc.body())
            yield _sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _chunks(ev, meta: _Meta, include_usage: bool) -> list[dict]:
    if isinstance(ev, TextDelta):
        return [schemas.stream_chunk(*meta.head(), text=ev.text)]
    usage = schemas.usage_dict(meta.prompt_tokens, ev.completion_tokens)
    last = schemas.stream_chunk(*meta.head(), finish=ev.finish_reason)
    if include_usage:
        return [last, schemas.usage_chunk(*meta.head(), usage, ev.speculation)]
    return [{**last, "usage": usage, "speculation": ev.speculation}]
