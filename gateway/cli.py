"""`tandem gateway`: flags, each with an environment variable, then uvicorn."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from gateway.auth import load_keys_file
from gateway.chat_template import load_chat_template
from gateway.config import GatewayConfig
from tandem.envflags import add_flag, add_log_level_flag, boolean, csv, env
from tandem.redis_conn import add_password_flag
from tandem.tls import add_tls_flags, tls_from_args


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `gateway` subcommand to the `tandem` parser."""
    d = GatewayConfig()
    p = subparsers.add_parser(
        "gateway", help="serve the OpenAI API, routing to verifier and draft workers",
        description="OpenAI-compatible HTTP gateway. Workers are found in the Redis registry; "
                    "--verifier/--draft are used when none is registered. Without --redis-url "
                    "(or REDIS_URL) a private redis-server is started.")
    add_flag(p, "--host", "TANDEM_GATEWAY_HOST", d.host,
             help="bind address (:: = every IPv6 and IPv4 address)")
    add_flag(p, "--port", "TANDEM_GATEWAY_PORT", d.port, int, "port to bind")
    add_flag(p, "--metrics-port", "TANDEM_GATEWAY_METRICS_PORT", d.metrics_port, int,
             "serve Prometheus /metrics on this port only (the API port then answers 404 "
             "there); 0 = on the API port")
    add_flag(p, "--redis-url", "REDIS_URL",
             help="Redis for registry, sessions, rate limits; unset = start one")
    add_password_flag(p)
    add_flag(p, "--redis-prefix", "TANDEM_REDIS_PREFIX", d.redis_prefix, help="key namespace")
    add_flag(p, "--api-keys", "TANDEM_API_KEYS", "",
             help="comma-separated API keys, plain or sha256:<hex>; none here and no "
                  "--api-keys-file = no auth")
    add_flag(p, "--api-keys-file", "TANDEM_API_KEYS_FILE", "",
             help="file of 'sha256:<hex> [name] [rpm=N] [tpm=N]' lines (tandem keys hash)")
    add_flag(p, "--require-api-keys", "TANDEM_REQUIRE_API_KEYS", False, boolean, nargs="?",
             const=True, metavar="on|off",
             help="refuse to start without an API key (--api-keys or --api-keys-file), so a "
                  "missing secret cannot silently turn authentication off")
    add_flag(p, "--rate-limit-rpm", "TANDEM_GATEWAY_RATE_LIMIT_RPM", 0, int,
             "requests per minute per key (unless its rpm= says otherwise), 0 = off")
    add_flag(p, "--model", "TANDEM_MODEL", "default",
             help="target checkpoint (for the tokenizer)")
    add_flag(p, "--chat-template", "TANDEM_GATEWAY_CHAT_TEMPLATE", "",
             help="chat template: a Jinja file, or the template inline (vLLM's flag); unset = "
                  "the checkpoint's; with neither, chat completions get 400")
    add_flag(p, "--served-model-name", "TANDEM_GATEWAY_MODEL_NAME",
             help="name clients send as 'model'; unset = the checkpoint's directory name")
    add_flag(p, "--context-length", "TANDEM_GATEWAY_CONTEXT_LENGTH", None, int,
             "unset = the checkpoint's max_position_embeddings")
    add_flag(p, "--default-speculative-tokens", "TANDEM_GATEWAY_DEFAULT_SPECULATIVE_TOKENS", 0,
             int, "0 = the verifier's default")
    add_flag(p, "--max-spec-tokens", "TANDEM_GATEWAY_MAX_SPEC_TOKENS",
             d.max_spec_tokens, int, "limit when verifiers do not report one")
    add_flag(p, "--method-preference", "TANDEM_GATEWAY_METHOD_PREFERENCE",
             ",".join(d.method_preference),
             help="default speculation method: the first of these (comma list) that is served "
                  "(auto by every verifier, the others by a live draft worker) [%(default)s]")
    add_flag(p, "--auto-model-drafts", "TANDEM_GATEWAY_AUTO_MODEL_DRAFTS", d.auto_model_drafts,
             boolean, nargs="?", const=True, metavar="on|off",
             help="auto sessions may also take the model drafts of the preferred draft "
                  "worker (off where the worker shares the verifier's compute)")
    add_flag(p, "--request-timeout", "TANDEM_GATEWAY_REQUEST_TIMEOUT", d.request_timeout_s,
             float, "seconds per request")
    add_flag(p, "--shutdown-grace-s", "TANDEM_GATEWAY_SHUTDOWN_GRACE_S", None, float,
             "after SIGTERM, seconds open streams may finish before they are cut "
             "(default: --request-timeout)")
    add_flag(p, "--max-request-bytes", "TANDEM_GATEWAY_MAX_REQUEST_BYTES", d.max_request_bytes,
             int, "largest request body accepted; larger ones get 413")
    # Repeatable flags: build_config reads their environment lists, which a flag replaces.
    p.add_argument("--verifier", action="append", default=None,
                   help="static verifier host:port, repeatable "
                        "[env TANDEM_GATEWAY_VERIFIERS, comma list]")
    p.add_argument("--draft", action="append", default=None,
                   help="static draft worker host:port, repeatable "
                        "[env TANDEM_GATEWAY_DRAFTS, comma list]")
    add_log_level_flag(p, "TANDEM_GATEWAY_LOG_LEVEL")
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


def api_keys(args) -> tuple:
    """The configured keys; none with --require-api-keys is an error (exit 2 in main)."""
    keys = csv(args.api_keys) + (load_keys_file(args.api_keys_file)
                                 if args.api_keys_file else ())
    if not keys and boolean(getattr(args, "require_api_keys", False)):
        raise ValueError("--require-api-keys (TANDEM_REQUIRE_API_KEYS) is on but no API key is "
                         "configured: give --api-keys (TANDEM_API_KEYS) or --api-keys-file "
                         "(TANDEM_API_KEYS_FILE)")
    return keys


def build_config(args, redis_url: str, model_root) -> GatewayConfig:
    from tandem.models import DEFAULT_TARGET

    name = args.served_model_name or (DEFAULT_TARGET if args.model in ("default", "", None)
                                      else model_root.name)
    grace = args.shutdown_grace_s
    return GatewayConfig(
        host=args.host, port=args.port, metrics_port=args.metrics_port, redis_url=redis_url,
        redis_prefix=args.redis_prefix, api_keys=api_keys(args),
        rate_limit_rpm=args.rate_limit_rpm, model_name=name,
        model_path=str(model_root), chat_template=load_chat_template(args.chat_template) or "",
        context_length=_context_length(model_root, args.context_length),
        default_speculative_tokens=args.default_speculative_tokens,
        max_spec_tokens=args.max_spec_tokens,
        method_preference=tuple(csv(args.method_preference)),
        auto_model_drafts=args.auto_model_drafts,
        request_timeout_s=args.request_timeout, max_request_bytes=args.max_request_bytes,
        shutdown_grace_s=args.request_timeout if grace is None else grace,
        # flags replace the environment's list rather than adding to it
        static_verifiers=tuple(args.verifier or csv(env("TANDEM_GATEWAY_VERIFIERS"))),
        static_drafts=tuple(args.draft or csv(env("TANDEM_GATEWAY_DRAFTS"))),
        tls=tls_from_args(args))


def run_gateway(args) -> int:
    from transformers import AutoTokenizer

    from gateway.app import create_app
    from gateway.serve import serve
    from tandem import redis_conn
    from tandem.drain import DrainSignal
    from tandem.models import generation_eos_ids, resolve_model, tokenizer_hash
    from tandem.redis_server import start_redis
    from tandem.telemetry import setup_tracing

    api_keys(args)  # --require-api-keys fails here, before anything loads
    load_chat_template(args.chat_template)  # so does a --chat-template that is no file
    drain = DrainSignal()  # a SIGUSR1 while the tokenizer loads is kept for later
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing("tandem-gateway")
    paths = resolve_model(args.model)
    embedded = None
    redis_url, password = args.redis_url, args.redis_password
    if not redis_url:
        embedded = start_redis()
        redis_url, password = embedded.url, ""
        print(f"tandem gateway: started redis-server at {redis_url}", file=sys.stderr)
    try:
        asyncio.run(redis_conn.check_auth(redis_url, password))  # a refused password: exit 2
        config = build_config(args, redis_url, paths.root)
        config = GatewayConfig(**{**config.__dict__, "tokenizer_hash": tokenizer_hash(paths),
                                  "eos_token_ids": generation_eos_ids(paths)})
        tokenizer = AutoTokenizer.from_pretrained(str(paths.root))
        # short socket timeouts: the gateway falls back when Redis is slow (RedisBreaker)
        client = redis_conn.client(redis_url, password, socket_connect_timeout=1.0,
                                   socket_timeout=config.redis_timeout_s)
        serve(create_app(config, redis=client, tokenizer=tokenizer), config, args.log_level,
              drain)
    finally:
        if embedded is not None:
            embedded.stop()
    return 0
