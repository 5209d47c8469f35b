"""Build, start, register and drain a draft worker process.

Health (grpc.health.v1) and reflection share the DraftService port; typed errors map to gRPC
status codes in tandem.grpc_status's interceptor. SIGTERM drains gracefully: health
NOT_SERVING, no new RPCs, open streams keep drafting for a grace period so verifiers can move
their sessions, then end with UNAVAILABLE.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.metadata
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from draft_service.config import DraftConfig
from draft_service.limits import Limits
from draft_service.server import SERVICE_NAME, DraftServicer
from draft_service.token_space import bridge_target, token_space, tokenizer_root
from draft_service.worker import DraftWorker
from tandem import redis_conn, telemetry
from tandem.device import Placement, place
from tandem.drain import DrainSignal, set_health
from tandem.engine.layer_skip import resolve_skip_set
from tandem.engine.llama import LlamaModel
from tandem.grammar.compiler import LazyCompiler, compiler_for
from tandem.grpc_limits import (
    MIN_PING_INTERVAL_MS,
    keepalive_server_options,
    max_message_bytes,
    message_options,
    server_ping_options,
)
from tandem.grpc_status import StatusInterceptor
from tandem.models import (
    ModelError,
    ModelPaths,
    generation_eos_ids,
    resolve_model,
)
from tandem.netaddr import join_host_port, split_host_port
from tandem.proposers.bridged import BridgedProposer
from tandem.proposers.draft_model import DraftModelProposer
from tandem.proposers.eagle import EagleProposer
from tandem.proposers.layer_skip import LayerSkipProposer
from tandem.proposers.mtp import MtpProposer
from tandem.proposers.ngram import NgramProposer
from tandem.proposers.suffix import SuffixProposer
from tandem.registration import Beat, Registration, start_registration, stop_registration
from tandem.spec import Method, Proposer
from tandem.tls import add_port, server_interceptors
from tandem.tracing import grpc_server_interceptors
from tandem.v1 import common_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)
_NGRAM_CONTEXT = 32768  # no model, so no positional limit; this only bounds memory per session


def _check_eagle_tokens(eagle: EagleProposer, model: DraftModelProposer | None) -> None:
    """A head (EAGLE or MTP) and a draft model on one worker must speak the same token ids."""
    if model is not None and model.vocab_size != eagle.vocab_size:
        raise ModelError(f"the {eagle.method.api_name} head's target vocabulary "
                         f"({eagle.vocab_size}) differs "
                         f"from the draft model's ({model.vocab_size})")


def _layer_skip(config: DraftConfig, model: DraftModelProposer | None,
                at: Placement) -> LayerSkipProposer:
    paths = resolve_model(config.layer_skip)
    skip = resolve_skip_set(config.skip_set, paths)
    if skip is None:
        raise ModelError(f"no layer-skip set saved with {paths.root}: run `tandem search-skip "
                         f"--model {config.layer_skip}` or pass --skip-set FILE")
    proposer = LayerSkipProposer.over(LlamaModel.load(paths, at.dtype, device=at.device), skip,
                                      config.kv_cache_mb << 20, at.block_size)
    if model is not None and model.vocab_size != proposer.vocab_size:
        raise ModelError(f"the layer-skip target's vocabulary ({proposer.vocab_size}) differs "
                         f"from the draft model's ({model.vocab_size})")
    return proposer


def _version() -> str:
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def build_worker(config: DraftConfig) -> tuple[DraftWorker, common_pb2.WorkerInfo]:
    """Load the proposers and size the worker from the config."""
    proposers: dict[Method, Proposer] = {}
    model = None
    at = place(config.device, config.dtype, config.block_size)
    log.info("draft models on %s", at)
    kv_bytes = config.kv_cache_mb << 20
    target = bridge_target(config)
    if target is not None:  # a draft of another tokenizer drafts in the target's ids
        model = BridgedProposer.load(resolve_model(config.model), target, kv_bytes,
                                     at.block_size, at.dtype, at.device)
        proposers[Method.DRAFT_MODEL] = model
    elif config.model is not None:
        model = DraftModelProposer.load(resolve_model(config.model), kv_bytes, at.block_size,
                                        at.dtype, at.device)
        proposers[Method.DRAFT_MODEL] = model
    if config.eagle is not None:
        eagle = EagleProposer.load(ModelPaths(Path(config.eagle)), kv_bytes, at.block_size,
                                   config.eagle_vocab, at.device,
                                   ModelPaths(Path(config.tokenizer)) if config.tokenizer
                                   else None)
        _check_eagle_tokens(eagle, model)
        proposers[Method.EAGLE] = eagle
    if config.mtp is not None:
        mtp = MtpProposer.load(resolve_model(config.mtp), kv_bytes, at.block_size,
                               device=at.device)
        _check_eagle_tokens(mtp, model)
        proposers[Method.MTP] = mtp
    if config.layer_skip is not None:
        skip = _layer_skip(config, model, at)
        proposers[Method.LAYER_SKIP] = skip
        model = model or skip
    proposers[Method.NGRAM] = NgramProposer(config.max_ngram_size, config.max_spec_tokens)
    proposers[Method.SUFFIX] = SuffixProposer(config.suffix_config(), config.max_spec_tokens)
    model_id, tok_hash, vocab = token_space(config, model)
    context = model.max_context_length if model is not None else _NGRAM_CONTEXT
    for method in (Method.EAGLE, Method.MTP):
        if method in proposers:
            context = min(context, proposers[method].max_context_length)
    if config.max_context_length:
        context = min(context, config.max_context_length)
    worker, info = assemble_worker(config, proposers, model_id, tok_hash, vocab, context)
    root = tokenizer_root(config)
    worker.grammars = LazyCompiler(functools.partial(  # structured output's drafts
        compiler_for, root, vocab, generation_eos_ids(ModelPaths(root))))
    return worker, info


def assemble_worker(config: DraftConfig, proposers: dict[Method, Proposer], model_id: str,
                    tok_hash: str, vocab: int, context: int
                    ) -> tuple[DraftWorker, common_pb2.WorkerInfo]:
    """A worker over ready proposers, sized by the config, and the Info it advertises."""
    limits = Limits(vocab, context, config.max_sessions, config.max_run_ahead,
                    config.max_spec_tokens, config.top_n, config.max_top_n,
                    config.max_ngram_size)
    info = common_pb2.WorkerInfo(
        role=common_pb2.WORKER_ROLE_DRAFT, model_id=model_id, tokenizer_hash=tok_hash,
        vocab_size=min(vocab, 2**32 - 1), max_context_length=context,
        max_sessions=config.max_sessions, max_spec_tokens=config.max_spec_tokens,
        max_top_n=config.max_top_n, methods=[int(m) for m in proposers], version=_version())
    return DraftWorker(proposers, limits), info


def _message_limit(worker: DraftWorker) -> int:
    """Room for the largest Open this worker takes: a whole context, with its features when
    a head reads them (tandem.grpc_limits)."""
    hidden = max((getattr(p, "feature_size", 0) for m, p in worker.proposers.items()
                  if m.needs_features), default=0)
    return max_message_bytes(worker.limits.max_context_length, hidden)



@dataclass
class DraftApp:
    """A built (not yet started) draft server and the pieces a drain needs."""

    server: grpc.aio.Server
    port: int
    worker: DraftWorker
    servicer: DraftServicer
    health: health.aio.HealthServicer = field(repr=False)

    async def begin_drain(self, beat: Beat | None = None) -> None:
        """SIGUSR1 (`tandem drain`, the preStop hook): leave the registry, report the service
        NOT_SERVING ("" stays SERVING for liveness) and refuse new streams with UNAVAILABLE;
        the open streams, and their sessions, are served on until SIGTERM's drain."""
        self.servicer.accepting = False
        await set_health(self.health, (SERVICE_NAME,),
                         health_pb2.HealthCheckResponse.NOT_SERVING)
        await stop_registration(beat)
        log.info("draining: left the registry, refusing new streams")

    async def drain(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()  # NOT_SERVING: routers stop sending
        stopping = asyncio.create_task(self.server.stop(grace_s + 1.0))  # refuse new RPCs
        # Open streams keep drafting meanwhile; once none is left (their verifiers stopped
        # too: a whole cluster's SIGTERM) there is nothing to wait for, and no new one comes.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.worker._streams and loop.time() < deadline:  # the worker's open streams
            await asyncio.sleep(min(0.05, deadline - loop.time()))
        self.servicer.end_streams()  # UNAVAILABLE: verifiers reconnect elsewhere
        await stopping
        await self.worker.aclose()


async def build_app(config: DraftConfig, worker: DraftWorker | None = None,
                    info: common_pb2.WorkerInfo | None = None) -> DraftApp:
    if worker is None:
        worker, info = build_worker(config)
    server = grpc.aio.server(interceptors=[*grpc_server_interceptors(),
                                           *server_interceptors(config.tls),
                                           StatusInterceptor()], options=[
        # Speculate streams live for hours: let verifiers keep them alive with pings
        # (MIN_PING_INTERVAL_MS is read here, at build time: tests lower it).
        *keepalive_server_options(MIN_PING_INTERVAL_MS),
        # and a verifier that vanished without a word is found by our own pings
        *server_ping_options(config.keepalive_s, config.keepalive_timeout_s),
        *message_options(_message_limit(worker)),
    ])
    servicer = DraftServicer(worker, info or common_pb2.WorkerInfo())
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = add_port(server, config.address, config.tls)
    if port == 0:
        raise OSError(f"cannot bind {config.address}")
    return DraftApp(server, port, worker, servicer, health_servicer)


async def build_server(config: DraftConfig, worker: DraftWorker | None = None
                       ) -> tuple[grpc.aio.Server, int]:
    """(server, bound port), not started: `await server.start()`."""
    app = await build_app(config, worker)
    return app.server, app.port


def draft_metrics(worker: DraftWorker) -> telemetry.DraftMetrics:
    return telemetry.DraftMetrics(sessions=lambda: worker.stats().sessions_open,
                                  queue_depth=lambda: worker.stats().queue_depth,
                                  tokens=lambda: worker.stats().tokens_drafted)


async def serve(config: DraftConfig, ready: Callable[[str], None] | None = None,
                registration: Registration | None = None, metrics_port: int = -1) -> None:
    """Serve until SIGTERM / SIGINT, then drain gracefully; SIGUSR1 begins a drain
    (DraftApp.begin_drain)."""
    drain = DrainSignal()  # from here on, SIGUSR1 while the models load is not fatal
    torch.set_num_threads(config.threads)
    telemetry.setup_tracing("tandem-draft")
    if registration is not None:  # a refused password fails here, before the models load
        await redis_conn.check_auth(registration.redis_url, registration.redis_password)
    app = await build_app(config)
    if app.worker.grammars is not None:  # before any traffic: see LazyCompiler
        app.worker.grammars.warm()
    await app.server.start()
    if ready is not None:
        ready(join_host_port(config.host, app.port))
    if metrics_port >= 0:
        port = telemetry.start_metrics_server(metrics_port, draft_metrics(app.worker).registry,
                                              config.host)
        log.info("metrics on http://%s/metrics", join_host_port(config.host, port))
    beat = None
    if registration is not None:
        host, port = split_host_port(registration.address)
        if port == 0:  # the port was picked at bind time
            registration = dataclasses.replace(registration,
                                               address=join_host_port(host, app.port))
        beat = start_registration(registration, capacity=config.max_sessions,
                                  load=app.worker.load, methods=tuple(
                                      m.api_name for m in app.worker.proposers))
    drain.on_loop(lambda: app.begin_drain(beat))
    await _stop_signal()
    await stop_registration(beat)  # leave the registry first so no verifier picks us anew
    log.info("draining for %.1f s", config.drain_grace_s)
    await app.drain(config.drain_grace_s)


async def _stop_signal() -> None:
    """Return at the first SIGTERM / SIGINT; a second one interrupts the drain the default
    way (Ctrl-C twice)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)

    def on_signal() -> None:
        stop.set()
        for sig in signals:
            loop.remove_signal_handler(sig)

    for sig in signals:
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
