"""The gateway app under uvicorn, the way a Deployment runs it.

- `--host ::` binds one socket for IPv6 and IPv4 (dual stack, whatever the host's default);
- SIGUSR1 (`tandem drain`, the preStop hook) turns /health to 503 so readiness drops while the
  gateway keeps serving; SIGTERM does so too, then uvicorn stops accepting connections and
  waits up to shutdown_grace_s for open streams (timeout_graceful_shutdown);
- with metrics_port set, /metrics is served on that port only (tandem.telemetry's server).
"""
from __future__ import annotations

import contextlib
import logging
import socket

import uvicorn
from fastapi import FastAPI

from gateway.app import begin_drain
from gateway.config import GatewayConfig
from tandem import telemetry
from tandem.drain import DrainSignal
from tandem.netaddr import join_host_port

log = logging.getLogger(__name__)
_BACKLOG = 2048  # uvicorn's default


class _Server(uvicorn.Server):
    """uvicorn's server, reporting draining (/health 503) the moment a stop signal lands."""

    def __init__(self, config: uvicorn.Config, on_stop):
        super().__init__(config)
        self._on_stop = on_stop

    def handle_exit(self, sig, frame) -> None:
        self._on_stop()
        super().handle_exit(sig, frame)


def listen(host: str, port: int) -> socket.socket:
    """A bound TCP socket for `host` (an IPv6 literal too; "::" also takes IPv4)."""
    host = host.strip("[]")
    v6 = ":" in host
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
    # and without it a kept-alive connection's every response after the first waited for the
    # client's delayed ACK (~40 ms: Nagle holding the body behind the headers).
    sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if v6:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind {join_host_port(host, port)}: "
                                 f"{exc.strerror or exc}") from None
    return sock


def serve(app: FastAPI, config: GatewayConfig, log_level: str = "info",
          drain: DrainSignal | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then shut down gracefully (blocks; main thread only).
    `drain` holds a SIGUSR1 that came while the gateway was loading."""
    if config.metrics_port:
        registry = app.state.gateway.metrics.registry
        port = telemetry.start_metrics_server(config.metrics_port, registry, config.host)
        log.info("metrics on http://%s/metrics", join_host_port(config.host, port))
    (drain or DrainSignal()).on_signal(lambda: begin_drain(app))
    app.state.gateway.grammars.build_now()  # before traffic: see LazyCompiler
    server = _Server(uvicorn.Config(app, log_level=log_level,
                                    timeout_graceful_shutdown=config.shutdown_grace_s),
                     lambda: begin_drain(app))
    sock = listen(config.host, config.port)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
