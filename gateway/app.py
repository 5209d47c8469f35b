"""The gateway's FastAPI app: OpenAI routes over run_session. Build it with `create_app`.

This module is the HTTP side only (routes, auth, rate limits, parsing the body); the plan is
built in gateway/plan.py, generated in gateway/generation.py, shaped in gateway/responses.py.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import redis.asyncio as aioredis
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from redis.exceptions import RedisError

from gateway import schemas
from gateway.auth import ApiKey, add_docs, authenticate, tenant_of
from gateway.body_limit import BodyLimit
from gateway.chat_template import require_chat_template, with_chat_template
from gateway.choices import record_choices, run_choices
from gateway.config import GatewayConfig
from gateway.errors import (
    bad_request,
    from_validation_error,
    install_handlers,
    rate_limited,
    redacted_reason,
)
from gateway.fields import check_fields, known_fields
from gateway.generation import GenerationDeps, run_session
from gateway.health import health_body
from gateway.logprobs import requested as requested_logprobs
from gateway.observe import annotate_request, observed
from gateway.plan import GenerationPlan, build_plan, max_token_chars
from gateway.quotas import Limits, RedisQuotas, metered
from gateway.responses import ResponseMeta, collect, stream
from gateway.routing import Router
from gateway.sessions import (
    Guarded,
    RedisAffinityStore,
    RedisBreaker,
    RedisSessionStore,
    client_identity,
)
from gateway.tool_events import with_tool_calls
from gateway.verifier import ChannelPool
from tandem import telemetry, tracing
from tandem.grammar.compiler import GrammarCompiler, LazyCompiler
from tandem.registry import WorkerRegistry
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
    limiter: RedisQuotas  # behind the breaker (Guarded)
    deps: GenerationDeps
    started: int
    grammars: LazyCompiler  # structured output: grammars compiled for the tokenizer
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    # Set by a stop or drain signal (gateway/serve.py), from the main thread: /health
    # answers 503 from then on so readiness drops; requests are still served.
    draining: threading.Event = field(default_factory=threading.Event)
    # Tokenizing a prompt (a 3 MiB body: seconds) runs here, never on the event loop; one
    # thread, since a fast tokenizer must not be reconfigured by two threads at once.
    tokenizing: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        1, thread_name_prefix="tandem-tokenize"))

    @functools.cached_property
    def max_token_chars(self) -> int:  # bounds a prompt's tokens before tokenizing it
        return max_token_chars(self.tokenizer)

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (special tokens included: they were generated)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def create_app(config: GatewayConfig, *, redis: aioredis.Redis, tokenizer: Any,
               clock: Callable[[], float] = time.time) -> FastAPI:
    """The gateway as an ASGI app. `tokenizer` is a Hugging Face tokenizer of the target."""
    p = config.redis_prefix
    tracing.instrument_redis(redis)
    tokenizer = with_chat_template(tokenizer, config.chat_template)
    breaker = RedisBreaker(timeout_s=config.redis_timeout_s, cooldown_s=config.redis_cooldown_s)
    channels = ChannelPool(config)
    router = Router(
        Guarded(WorkerRegistry(redis, ttl_s=config.registry_ttl_s, prefix=p), breaker),
        Guarded(RedisAffinityStore(redis, prefix=p, ttl_s=config.affinity_ttl_s), breaker),
        static_verifiers=config.static_verifiers, static_drafts=config.static_drafts,
        describe_verifier=channels.describe_verifier, static_capacity=config.static_capacity,
        tokenizer_hash=config.tokenizer_hash,
        # a Redis restarted empty lists no workers until their next heartbeat (ttl / 3)
        empty_grace_s=config.registry_ttl_s)
    store = Guarded(RedisSessionStore(redis, prefix=p, ttl_s=config.session_ttl_s, clock=clock),
                    breaker)
    limiter = Guarded(RedisQuotas(redis, prefix=p, clock=clock), breaker)
    grammars = LazyCompiler(lambda: GrammarCompiler(tokenizer, len(tokenizer),
                                                    config.eos_token_ids))
    gw = _Gateway(config, tokenizer, clock, redis, breaker, router, limiter,
                  GenerationDeps(config, router, channels, store), int(clock()), grammars)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if gw.deps.background:  # let "cancelled" session writes land before exit
            await asyncio.wait(set(gw.deps.background), timeout=2)
        await channels.close()
        gw.tokenizing.shutdown(wait=False, cancel_futures=True)

    # With keys, the API's description is theirs too: served by add_docs behind a key.
    hidden = {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Tandem gateway", version="0.1.0", lifespan=lifespan,
                  **(hidden if config.auth_enabled else {}))
    app.state.gateway = gw
    install_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    _add_routes(app, gw)
    tracing.instrument_app(app)
    return app


def _add_routes(app: FastAPI, gw: _Gateway) -> None:
    async def guard(request: Request) -> None:
        await _authorize(gw, request)

    async def key_only(request: Request) -> None:  # a key, no quota charge (docs, metrics)
        authenticate(gw.config, request)

    @app.get("/health")
    async def health() -> JSONResponse:
        body = await health_body(gw)
        if gw.draining.is_set():
            return JSONResponse({**body, "status": "draining"}, status_code=503)
        return JSONResponse(body)

    if gw.config.auth_enabled:
        add_docs(app, Depends(key_only))
    if not gw.config.metrics_port:  # else served on its own port (gateway/serve.py)
        @app.get("/metrics", dependencies=[Depends(key_only)])
        async def metrics() -> Response:
            return Response(telemetry.render(gw.metrics.registry),
                            media_type=CONTENT_TYPE_LATEST)

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


def begin_drain(app: FastAPI) -> None:
    """/health answers 503 from now on (readiness drops); everything else is still served."""
    app.state.gateway.draining.set()


async def _authorize(gw: _Gateway, request: Request) -> None:
    """API key (when configured), then its quotas (else the global rate limit)."""
    key = authenticate(gw.config, request)
    request.state.api_key = key  # for _tenant and the token meter
    who = key.identity if key else client_identity(request.client.host if request.client
                                                   else None)
    rpm = gw.config.rate_limit_rpm if key is None or key.rpm is None else key.rpm
    try:
        refusal = await gw.limiter.check(who, Limits(rpm=rpm, tpm=key.tpm if key else 0))
    except (RedisError, OSError) as exc:  # fail open: Redis trouble must not block traffic
        log.warning("rate limiter unavailable: %s", exc)
        return
    if refusal is not None:
        raise rate_limited(refusal.message, math.ceil(refusal.retry_after_s))


async def _parse(request: Request, model: type[schemas.GenerationRequest]):
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}", code="invalid_json") from None
    except RecursionError:  # json recurses per level: a hostile body must not become a 500
        raise bad_request("malformed JSON body: nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    check_fields(data, known_fields(model), chat=model is schemas.ChatCompletionRequest)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def _captures(gw: _Gateway, plan: GenerationPlan, text: str) -> list[str]:
    """The tool calls an auto plan's grammar captures in a finished text: the grammar that
    produced the text parses it (llguidance reads bytes, so any tokenization will do). The
    grammar comes from the compiler's own threads (a recompile never runs on the event loop),
    and the tokenizing and parsing of the text run off it too."""
    compiler = await gw.grammars.get()
    matcher = await compiler.matcher_async(plan.tools.grammar)

    def parse() -> list[str]:
        ids = gw.tokenizer(text, add_special_tokens=False).input_ids
        state = compiler.state_now(plan.tools.grammar, ids, matcher)
        return [value.decode() for name, value in state.matcher.get_captures() if name == "call"]

    return await asyncio.get_running_loop().run_in_executor(gw.tokenizing, parse)


def _tool_calls(gw: _Gateway, req: schemas.GenerationRequest, plan: GenerationPlan):
    """What turns one session's events into the client's when tools may be called."""
    def wrap(events):
        if plan.tools is None:
            return events
        return with_tool_calls(events, plan.tools, functools.partial(_captures, gw, plan),
                               stream=bool(req.stream))
    return wrap


async def _generate(gw: _Gateway, request: Request, *, chat: bool):
    req = await _parse(request, schemas.ChatCompletionRequest if chat
                       else schemas.CompletionRequest)
    if chat:
        require_chat_template(gw.tokenizer)
    session_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    endpoint = "chat" if chat else "completions"
    span = annotate_request(chat=chat, session_id=session_id, req=req)
    try:
        plan, text = await build_plan(req, session_id, config=gw.config, router=gw.router,
                                      tokenizer=gw.tokenizer, grammars=gw.grammars,
                                      tokenize_in=gw.tokenizing,
                                      max_token_chars=gw.max_token_chars)
        plan = replace(plan, tenant=tenant_of(request))
        await record_choices(gw.deps.store, plan, gw.config.model_name)
    except BaseException as exc:  # refused before generating
        span.set_status(trace.StatusCode.ERROR, redacted_reason(exc))
        gw.metrics.requests.labels(endpoint=endpoint,
                                   status=str(getattr(exc, "status", "error"))).inc()
        raise
    meta = ResponseMeta(chat, session_id, int(gw.clock()), gw.config.model_name,
                        len(plan.prompt_token_ids),
                        None if requested_logprobs(req) is None else gw.token_text, n=plan.n,
                        echo=schemas.echo_text(req, plan.prompt_token_ids, gw.tokenizer))
    wrap = _tool_calls(gw, req, plan)
    # n > 1: every choice's events, merged (tool calls read per choice, before the merge)
    events = (run_session(plan, gw.deps, text) if plan.best_of == 1
              else run_choices(plan, gw.deps, text, wrap))
    key: ApiKey | None = getattr(request.state, "api_key", None)
    if key is not None and key.tpm:
        events = metered(events, gw.limiter, key.identity, meta.prompt_tokens, key.tpm,
                         meta.prompt_tokens + plan.best_of * plan.max_new_tokens)
    events = observed(events, span, gw.metrics, endpoint, meta.prompt_tokens)
    if plan.best_of == 1:
        events = wrap(events)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await stream(events, meta, include_usage, request)
    return await collect(events, meta, request)
