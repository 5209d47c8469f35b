"""`tandem gateway`: flags, each with an environment variable, then uvicorn."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from gateway.auth import load_keys_file
from gateway.config import GatewayConfig
from tandem.envflags import add_flag, csv, env
from tandem.tls import add_tls_flags, tls_from_args


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `gateway` subcommand to the `tandem` parser."""
    d = GatewayConfig()
    p = subparsers.add_parser(
        "gateway", help="serve the OpenAI API, routing to verifier and draft workers",
        description="OpenAI-compatible HTTP gateway. Workers are found in the Redis registry; "
                    "--verifier/--draft are used when none is registered. Without --redis-url "
                    "(or REDIS_URL) a private redis-server is started.")
    add_flag(p, "--host", "TANDEM_GATEWAY_HOST", d.host, help="bind address")
    add_flag(p, "--port", "TANDEM_GATEWAY_PORT", d.port, int, "port to bind")
    add_flag(p, "--redis-url", "REDIS_URL",
             help="Redis for registry, sessions, rate limits; unset = start one")
    add_flag(p, "--redis-prefix", "TANDEM_REDIS_PREFIX", d.redis_prefix, help="key namespace")
    add_flag(p, "--api-keys", "TANDEM_API_KEYS", "",
             help="comma-separated API keys, plain or sha256:<hex>; none here and no "
                  "--api-keys-file = no auth")
    add_flag(p, "--api-keys-file", "TANDEM_API_KEYS_FILE", "",
             help="file of 'sha256:<hex> [name] [rpm=N] [tpm=N]' lines (tandem keys hash)")
    add_flag(p, "--rate-limit-rpm", "TANDEM_GATEWAY_RATE_LIMIT_RPM", 0, int,
             "requests per minute per key (unless its rpm= says otherwise), 0 = off")
    add_flag(p, "--model", "TANDEM_MODEL", "default",
             help="target checkpoint (for the tokenizer)")
    add_flag(p, "--served-model-name", "TANDEM_GATEWAY_MODEL_NAME",
             help="name clients send as 'model'; unset = the checkpoint's directory name")
    add_flag(p, "--context-length", "TANDEM_GATEWAY_CONTEXT_LENGTH", None, int,
             "unset = the checkpoint's max_position_embeddings")
    add_flag(p, "--default-speculative-tokens", "TANDEM_GATEWAY_DEFAULT_SPECULATIVE_TOKENS", 0,
             int, "0 = the verifier's default")
    add_flag(p, "--max-speculative-tokens", "TANDEM_GATEWAY_MAX_SPECULATIVE_TOKENS",
             d.max_speculative_tokens, int, "limit when verifiers do not report one")
    add_flag(p, "--method-preference", "TANDEM_GATEWAY_METHOD_PREFERENCE",
             ",".join(d.method_preference),
             help="default speculation method: the first of these (comma list) a live draft "
                  "worker serves [%(default)s]")
    add_flag(p, "--request-timeout", "TANDEM_GATEWAY_REQUEST_TIMEOUT", d.request_timeout_s,
             float, "seconds per request")
    add_flag(p, "--max-request-bytes", "TANDEM_GATEWAY_MAX_REQUEST_BYTES", d.max_request_bytes,
             int, "largest request body accepted; larger ones get 413")
    # Repeatable flags: build_config reads their environment lists, which a flag replaces.
    p.add_argument("--verifier", action="append", default=None,
                   help="static verifier host:port, repeatable "
                        "[env TANDEM_GATEWAY_VERIFIERS, comma list]")
    p.add_argument("--draft", action="append", default=None,
                   help="static draft worker host:port, repeatable "
                        "[env TANDEM_GATEWAY_DRAFTS, comma list]")
    add_flag(p, "--log-level", "TANDEM_LOG_LEVEL", "info",
             choices=["debug", "info", "warning", "error"])
    add_tls_flags(p, serves=False)  # the gateway dials verifiers; its HTTP side is plain
    p.set_defaults(func=run_gateway)
    return p


def _context_length(model_root, given: int | None) -> int:
    if given:
        return given
    try:
        cfg = json.loads((model_root / "config.json").read_text())
        return int(cfg.get("max_position_embeddings") or GatewayConfig.context_length)
    except (OSError, ValueError):
        return GatewayConfig.context_length


def build_config(args, redis_url: str, model_root) -> GatewayConfig:
    from tandem.models import DEFAULT_TARGET

    name = args.served_model_name or (DEFAULT_TARGET if args.model in ("default", "", None)
                                      else model_root.name)
    return GatewayConfig(
        host=args.host, port=args.port, redis_url=redis_url, redis_prefix=args.redis_prefix,
        api_keys=csv(args.api_keys) + (load_keys_file(args.api_keys_file)
                                       if args.api_keys_file else ()),
        rate_limit_rpm=args.rate_limit_rpm, model_name=name,
        model_path=str(model_root), context_length=_context_length(model_root,
                                                                   args.context_length),
        default_speculative_tokens=args.default_speculative_tokens,
        max_speculative_tokens=args.max_speculative_tokens,
        method_preference=tuple(csv(args.method_preference)),
        request_timeout_s=args.request_timeout, max_request_bytes=args.max_request_bytes,
        # flags replace the environment's list rather than adding to it
        static_verifiers=tuple(args.verifier or csv(env("TANDEM_GATEWAY_VERIFIERS"))),
        static_drafts=tuple(args.draft or csv(env("TANDEM_GATEWAY_DRAFTS"))),
        tls=tls_from_args(args))


def run_gateway(args) -> int:
    import redis.asyncio as aioredis
    import uvicorn
    from transformers import AutoTokenizer

    from gateway.app import create_app
    from tandem.models import resolve_model, tokenizer_hash
    from tandem.redis_server import start_redis
    from tandem.telemetry import setup_tracing

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing("tandem-gateway")
    paths = resolve_model(args.model)
    embedded = None
    redis_url = args.redis_url
    if not redis_url:
        embedded = start_redis()
        redis_url = embedded.url
        print(f"tandem gateway: started redis-server at {redis_url}", file=sys.stderr)
    try:
        config = build_config(args, redis_url, paths.root)
        config = GatewayConfig(**{**config.__dict__, "tokenizer_hash": tokenizer_hash(paths)})
        tokenizer = AutoTokenizer.from_pretrained(str(paths.root))
        # short socket timeouts: the gateway falls back when Redis is slow (RedisBreaker)
        client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=1.0,
                                         socket_timeout=config.redis_timeout_s)
        app = create_app(config, redis=client, tokenizer=tokenizer)
        uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level)
    finally:
        if embedded is not None:
            embedded.stop()
    return 0
