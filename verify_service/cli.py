"""`tandem verifier`: run one verifier worker."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os

from verify_service.config import VerifierConfig

_DEFAULTS = VerifierConfig()


def _env(name: str, default):
    value = os.environ.get(f"TANDEM_VERIFIER_{name.upper()}")
    return default if value is None else type(default)(value)


def register(sub) -> None:
    p = sub.add_parser("verifier", help="run a verifier worker (target model + paged KV cache)",
                       description="Serve tandem.v1.VerifyService over gRPC. Every flag also "
                       "reads TANDEM_VERIFIER_<FLAG> (e.g. TANDEM_VERIFIER_PORT).")
    p.add_argument("--host", default=_env("host", _DEFAULTS.host))
    p.add_argument("--port", type=int, default=_env("port", 50051))
    p.add_argument("--model", default=os.environ.get("TANDEM_MODEL", _DEFAULTS.model),
                   help="target: default name or HF checkpoint dir [env TANDEM_MODEL]")
    for name in ("threads", "kv_cache_mb", "block_size", "max_sessions", "max_num_seqs",
                 "max_spec_tokens", "top_n"):
        p.add_argument("--" + name.replace("_", "-"), type=int,
                       default=_env(name, getattr(_DEFAULTS, name)))
    p.add_argument("--max-draft-wait-ms", type=float,
                   default=_env("max_draft_wait_ms", _DEFAULTS.max_draft_wait_ms))
    p.add_argument("--draft", action="append", dest="drafts", metavar="HOST:PORT",
                   default=[a for a in os.environ.get("TANDEM_VERIFIER_DRAFTS", "").split(",")
                            if a],
                   help="draft worker address (repeatable); others come from the registry")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""),
                   help="register here and discover draft workers [env REDIS_URL]")
    p.add_argument("--worker-id", default=_env("worker_id", ""))
    p.add_argument("--advertise-address", default=_env("advertise_address", ""),
                   help="address others dial (default host:port)")
    p.add_argument("--drain-grace-s", type=float, default=_env("drain_grace_s", 5.0))
    p.add_argument("--metrics-port", type=int, default=_env("metrics_port", -1),
                   help="Prometheus /metrics HTTP port: -1 off (default), 0 any free port")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    fields = {f.name for f in dataclasses.fields(VerifierConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    config = VerifierConfig(**values, draft_addresses=tuple(args.drafts))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    from verify_service.main import serve

    asyncio.run(serve(config))
    return 0
