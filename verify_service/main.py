"""Build, start, register and drain a verifier worker."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kernels.attention import default_block_size
from tandem import __version__, redis_conn, telemetry
from tandem.device import place
from tandem.drain import DrainSignal, set_health
from tandem.engine.exact_dtype import load_target
from tandem.engine.llama import LlamaModel
from tandem.grammar.compiler import LazyCompiler, compiler_for
from tandem.grpc_limits import max_message_bytes, message_options
from tandem.grpc_status import StatusInterceptor
from tandem.models import ModelPaths, generation_eos_ids, resolve_model, tokenizer_hash
from tandem.netaddr import advertised, join_host_port
from tandem.registration import Registration, start_registration, stop_registration
from tandem.spec import Method
from tandem.tls import add_port, server_interceptors
from tandem.tracing import grpc_server_interceptors
from tandem.v1 import common_pb2, verify_pb2_grpc
from verify_service.assemble import build_engine
from verify_service.config import VerifierConfig
from verify_service.drafts.link import DraftPool
from verify_service.drafts.side import Host
from verify_service.engine import Engine
from verify_service.server import SERVICE_NAME, VerifyServicer
from verify_service.tp.group import TPLeader, start_for

log = logging.getLogger(__name__)


@dataclass
class Verifier:
    server: grpc.aio.Server
    port: int
    engine: Engine
    servicer: VerifyServicer
    health: health.HealthServicer
    tasks: list[asyncio.Task] = field(default_factory=list)
    colocated: Colocated | None = None
    tp: TPLeader | None = None  # a tensor-parallel target's group (this process is rank 0)
    # Set when the engine loop died: the process reports NOT_SERVING and exits (serve), so
    # Kubernetes restarts it rather than route to a verifier that no longer steps.
    failed: asyncio.Event = field(default_factory=asyncio.Event)

    def watch_engine(self, task: asyncio.Task) -> None:
        def done(t: asyncio.Task) -> None:
            if t.cancelled() or t.exception() is None:
                return
            log.error("the engine loop died", exc_info=t.exception())
            self.failed.set()
            asyncio.get_running_loop().create_task(set_health(
                self.health, ("", SERVICE_NAME), health_pb2.HealthCheckResponse.NOT_SERVING))
        task.add_done_callback(done)
        self.tasks.append(task)

    async def begin_drain(self, beat=None) -> None:
        """SIGUSR1 (`tandem drain`, the preStop hook): take no new sessions from now on, keep
        serving the open ones. New Generate calls get UNAVAILABLE (the gateway resumes them
        on another verifier); the service reports NOT_SERVING (readiness) while "" stays
        SERVING (liveness); the registry entry goes at once."""
        self.servicer.draining = True
        await set_health(self.health, (SERVICE_NAME,),
                         health_pb2.HealthCheckResponse.NOT_SERVING)
        await stop_registration(beat)
        log.info("draining: left the registry, refusing new sessions")

    async def drain_and_stop(self, grace_s: float) -> None:
        """Refuse new work, report NOT_SERVING, let running streams finish within grace_s."""
        self.servicer.draining = True
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        for task in self.tasks:
            task.cancel()
        await self.engine.close()
        if self.tp is not None:  # after the last step: the workers leave the group
            await asyncio.get_running_loop().run_in_executor(None, self.tp.close)
        if self.colocated is not None:
            await self.colocated.stop()


def build_info(model: LlamaModel, paths: ModelPaths, config: VerifierConfig, model_id: str):
    return common_pb2.WorkerInfo(
        role=common_pb2.WORKER_ROLE_VERIFIER, model_id=model_id,
        tokenizer_hash=tokenizer_hash(paths), vocab_size=model.cfg.vocab_size,
        max_context_length=model.cfg.max_position_embeddings,
        max_sessions=config.max_sessions, max_spec_tokens=config.max_spec_tokens,
        max_top_n=config.top_n, version=__version__,
        methods=[int(m) for m in Method if m is not Method.UNSPECIFIED])


class Colocated(Protocol):
    """Draft workers this process runs over its own target (layer skip), by method."""

    hosts: dict[Method, Host]

    async def stop(self) -> None: ...


# (target, its checkpoint, the config) -> the started workers, or None when there are none.
Colocate = Callable[[LlamaModel, ModelPaths, VerifierConfig], Awaitable["Colocated | None"]]


async def start_verifier(config: VerifierConfig, model: LlamaModel | None = None,
                         discover=None, colocate: Colocate | None = None) -> Verifier:
    """Start serving; `model` lets tests share one loaded target across servers;
    `colocate` starts draft workers in this process (the tools layer passes the layer-skip
    one, since services do not import each other)."""
    paths = resolve_model(config.model)
    tp = start_for(config, paths, model) if config.tensor_parallel_size > 1 else None
    model = tp.model if tp is not None else _load_target(config, paths, model)
    # 0 = the device's block size; the in-process layer-skip worker uses the same
    config = dataclasses.replace(
        config, block_size=config.block_size or default_block_size(model.device))
    engine, metrics = await build_engine(config, model, paths, tp)
    # layer skip drafts over the target's whole weights, which no rank of a group holds
    colocated = None if colocate is None or tp else await colocate(model, paths, config)
    remote = _wire_drafts(engine, config, model, discover, colocated)
    # Layer skip is served only when asked for: on a small target it rarely pays.
    default_method = Method.DRAFT_MODEL if remote else Method.NONE
    grammars = LazyCompiler(functools.partial(compiler_for, paths.root, model.cfg.vocab_size,
                                              generation_eos_ids(paths)))
    servicer = VerifyServicer(engine, build_info(model, paths, config, paths.root.name),
                              default_method, metrics, config.tree_methods(model.device.type),
                              grammars)
    server, health_servicer, port = await _serve_grpc(servicer, config, model)
    verifier = Verifier(server, port, engine, servicer, health_servicer, colocated=colocated,
                        tp=tp)
    if tp is not None:
        tp.report_failure_to(verifier.failed, asyncio.get_running_loop())
    verifier.watch_engine(asyncio.create_task(engine.run()))
    return verifier


def _load_target(config: VerifierConfig, paths: ModelPaths,
                 model: LlamaModel | None) -> LlamaModel:
    """The target, loaded where config.device places it unless one was given; either way
    batch-invariant exactly when the config asks for it."""
    if model is None:
        at = place(config.device, config.dtype, config.block_size)
        log.info("target on %s", at)
        model = load_target(paths, at, batch_invariant=config.batch_invariant)
    if model.batch_invariant != config.batch_invariant:
        raise ValueError(f"config.batch_invariant={config.batch_invariant} but the model given "
                         f"was loaded with batch_invariant={model.batch_invariant}")
    return model


def _wire_drafts(engine: Engine, config: VerifierConfig, model: LlamaModel, discover,
                 colocated: Colocated | None) -> bool:
    """Give the engine's draft side its pool of the configured or discovered draft workers,
    and the ones in this process (served to the sessions of their methods only). True if
    there are remote ones."""
    remote = bool(config.draft_addresses) or discover is not None
    if remote:
        engine.drafts.pool = DraftPool(list(config.draft_addresses), discover,
                                       engine.drafts.on_reply, engine.drafts.on_link_broken,
                                       tls=config.tls,
                                       # an EAGLE re-open carries every position's features
                                       # (EAGLE-3's: three layers wide)
                                       max_message_bytes=max_message_bytes(
                                           model.cfg.max_position_embeddings,
                                           model.cfg.hidden_size * (
                                               1 if config.eagle_feature_layers == "final"
                                               else 3)))
    if colocated is not None:
        engine.drafts.hosted = dict(colocated.hosts)
    return remote


async def _serve_grpc(servicer: VerifyServicer, config: VerifierConfig, model: LlamaModel
                      ) -> tuple[grpc.aio.Server, health.HealthServicer, int]:
    """The started gRPC server: the verify service, health (SERVING once started) and
    reflection, on config's address; with its health servicer and bound port."""
    limit = max_message_bytes(model.cfg.max_position_embeddings)  # requests carry ids only
    server = grpc.aio.server(interceptors=[*grpc_server_interceptors(),
                                           *server_interceptors(config.tls), StatusInterceptor()],
                             options=[("grpc.so_reuseport", 0), *message_options(limit)])
    verify_pb2_grpc.add_VerifyServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else \
        health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME), server)
    port = add_port(server, join_host_port(config.host, config.port), config.tls)
    await server.start()
    await set_health(health_servicer, ("", SERVICE_NAME),
                     health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, port


async def serve(config: VerifierConfig, colocate: Colocate | None = None) -> None:
    """Run until SIGTERM/SIGINT, registered in Redis when config.redis_url is set; SIGUSR1
    begins a drain (Verifier.begin_drain)."""
    from tandem.registration import draft_discovery

    drain = DrainSignal()  # from here on, SIGUSR1 during the model load is not fatal
    telemetry.setup_tracing("tandem-verifier")
    discover = None
    if config.redis_url:  # a refused password fails here, before the model loads
        await redis_conn.check_auth(config.redis_url, config.redis_password)
        discover = draft_discovery(config.redis_url, config.redis_password)
    verifier = await start_verifier(config, discover=discover, colocate=colocate)
    if verifier.servicer.grammars is not None:  # before any traffic: see LazyCompiler
        verifier.servicer.grammars.warm()
    address = advertised(config.advertise_address, config.advertise_host, config.host,
                         verifier.port)
    print(f"verifier serving on {address}", flush=True)
    if config.metrics_port >= 0:
        registry = verifier.servicer.metrics.registry
        port = telemetry.start_metrics_server(config.metrics_port, registry, config.host)
        print(f"verifier metrics on http://{join_host_port(config.host, port)}/metrics",
              flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    beat = _register(config, verifier, address) if config.redis_url else None
    drain.on_loop(lambda: verifier.begin_drain(beat))
    waits = [asyncio.ensure_future(e.wait()) for e in (stop, verifier.failed)]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    failed = verifier.failed.is_set()
    log.info("verifier %s", "failed: stopping" if failed else "draining")
    await stop_registration(beat)  # leave the registry first so no new session is routed here
    await verifier.drain_and_stop(0.0 if failed else config.drain_grace_s)
    if failed:
        raise SystemExit(1)


def _register(config: VerifierConfig, verifier: Verifier, address: str):
    info = verifier.servicer.info
    return start_registration(
        Registration(config.redis_url, "verifier", address, config.worker_id,
                     redis_password=config.redis_password),
        capacity=config.max_sessions, load=lambda: verifier.engine.load,
        model_id=info.model_id, tokenizer_hash=info.tokenizer_hash,
        max_spec_tokens=config.max_spec_tokens)
