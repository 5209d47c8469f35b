"""`tandem draft`: run a draft worker. Every flag also reads TANDEM_DRAFT_<FLAG> from the env."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from pathlib import Path

from draft_service.config import DTYPES, DraftConfig
from tandem.envflags import add_flag, add_log_level_flag
from tandem.netaddr import advertised
from tandem.redis_conn import add_password_flag
from tandem.tls import add_tls_flags, tls_from_args
from tandem.vllm_compat import add_vllm_aliases

# (field, type, help) of the flags that read TANDEM_DRAFT_<FIELD>; defaults come from
# DraftConfig so they are stated once.
_FLAGS = (
    ("host", str, "address to bind (0.0.0.0 in a container)"),
    ("port", int, "port to bind, 0 = any free port"),
    ("tokenizer", str, "the target's checkpoint dir, whose tokenizer.json names the token "
                       "ids (default: the draft model's, else the cached default target); a "
                       "draft model of another tokenizer then drafts the tokens both share"),
    ("threads", int, "torch CPU threads"),
    ("max_sessions", int, "sessions held at once, over all streams"),
    ("max_run_ahead", int, "default draft tokens outstanding per session"),
    ("max_spec_tokens", int, "largest run-ahead (draft tokens per round) a verifier may ask "
                             "for (vLLM's name: --num-speculative-tokens)"),
    ("top_n", int, "default size of the truncated q sent with each draft token"),
    ("max_top_n", int, "largest top-N a verifier may ask for"),
    ("kv_cache_mb", int, "draft KV cache budget in MiB"),
    ("block_size", int, "KV cache block size in tokens, 0 = the device's (256 with "
                        "flash-attn on a GPU, else 16)"),
    ("max_ngram_size", int, "default longest suffix matched by n-gram lookup"),
    ("max_context_length", int, "longest sequence, 0 = the draft model's limit"),
    ("eagle_vocab", int, "draft from the EAGLE head's commonest N tokens only, 0 = all"),
    ("dtype", str, "draft model weight dtype: " + ", ".join(DTYPES) + " (auto: float32 on "
                   "cpu, bfloat16 on cuda; int8: cpu weight-only, fp32 activations; int8-bf16: "
                   "the same weights, bf16-rounded activations, AVX512-BF16 cpus)"),
    ("device", str, "where the draft models run: auto (CUDA when present), cpu, cuda, "
                    "cuda:N"),
    ("suffix_cache_tokens", int, "suffix decoding: finished tokens cached per scope, 0 = none"),
    ("suffix_scope", str, "suffix decoding cache: one for all (global) or one per tenant"),
    ("suffix_min_prob", float, "suffix decoding: stop a proposal below this estimated chance"),
    ("suffix_spec_factor", float, "suffix decoding: at most this many drafts per matched token"),
    ("drain_grace_s", float, "on SIGTERM, keep streams drafting this long before ending them"),
)


def register(subparsers) -> argparse.ArgumentParser:
    """Add `draft` to the `tandem` command's subparsers."""
    p = subparsers.add_parser(
        "draft", help="run a draft worker (DraftService over gRPC)",
        description="Serve DraftService: draft tokens for the sessions verifiers open, with a "
                    "draft model, an EAGLE head, suffix decoding or n-gram prompt lookup. "
                    "Every flag also reads TANDEM_DRAFT_<FLAG> (e.g. TANDEM_DRAFT_PORT).")
    add_flag(p, "--model", "TANDEM_DRAFT_MODEL",
             help="draft checkpoint directory, or 'none' for n-gram lookup only (default: the "
                  "shipped draft if present, else n-gram only)")
    add_flag(p, "--eagle", "TANDEM_DRAFT_EAGLE",
             help="EAGLE head directory, or 'none' (default: the shipped head if present)")
    add_flag(p, "--mtp", "TANDEM_DRAFT_MTP",
             help="checkpoint directory whose config declares num_nextn_predict_layers: draft "
                  "with its first multi-token-prediction module (default: none)")
    add_flag(p, "--layer-skip", "TANDEM_DRAFT_LAYER_SKIP",
             help="target checkpoint (or 'default') to draft for by layer skip: the target "
                  "itself minus its searched skip set (default: none; a verifier serves "
                  "layer skip in its own process unless told otherwise)")
    add_flag(p, "--skip-set", "TANDEM_DRAFT_SKIP_SET", "auto",
             help="layer skip: 'auto' (the set saved or shipped with the checkpoint, see "
                  "`tandem search-skip`) or a layer_skip.json path")
    defaults = {f.name: f.default for f in dataclasses.fields(DraftConfig)}
    for name, kind, text in _FLAGS:
        add_flag(p, "--" + name.replace("_", "-"), "TANDEM_DRAFT_" + name.upper(), defaults[name],
                 kind, text)
    add_vllm_aliases(p)  # --num-speculative-tokens: --max-spec-tokens
    p.add_argument("--max-model-len", dest="max_context_length", type=int,
                   default=argparse.SUPPRESS, help="vLLM's name of --max-context-length")
    add_flag(p, "--redis-url", "REDIS_URL", "", help="register in this Redis worker registry")
    add_password_flag(p)
    add_flag(p, "--worker-id", "TANDEM_DRAFT_WORKER_ID", "",
             help="id in the registry (default: generated from the host name)")
    add_flag(p, "--advertise-address", "TANDEM_DRAFT_ADVERTISE_ADDRESS", "",
             help="host:port verifiers dial, IPv6 in brackets (default: --advertise-host and "
                  "the bound port)")
    add_flag(p, "--advertise-host", "TANDEM_DRAFT_ADVERTISE_HOST", "",
             help="host or IP verifiers dial (e.g. the pod IP, IPv6 too), joined with the "
                  "bound port (default: --host)")
    add_flag(p, "--metrics-port", "TANDEM_DRAFT_METRICS_PORT", -1, int,
             "Prometheus /metrics HTTP port: -1 off, 0 any free port")
    add_log_level_flag(p, "TANDEM_DRAFT_LOG_LEVEL")
    add_tls_flags(p)
    p.set_defaults(func=run)
    return p


def _shipped_draft() -> Path | None:
    try:
        from draft_service.weights import default_draft_dir
    except ImportError:  # no draft shipped with this build
        return None
    path = Path(default_draft_dir())
    return path if (path / "config.json").is_file() else None


def _shipped_eagle() -> Path | None:
    from draft_service.weights import default_eagle_dir

    path = Path(default_eagle_dir())
    return path if (path / "config.json").is_file() else None


def _says_none(value: str | None) -> bool:
    return value is not None and value.strip().lower() == "none"


def resolve_eagle_flag(value: str | None) -> str | None:
    """The EAGLE head directory to load, or None."""
    if _says_none(value):
        return None
    if value:
        return value
    shipped = _shipped_eagle()
    return None if shipped is None else str(shipped)


def resolve_model_flag(value: str | None) -> str | None:
    """The draft model directory to load, or None for n-gram lookup only."""
    if _says_none(value):
        return None
    if value:
        return value
    shipped = _shipped_draft()
    if shipped is None:
        logging.getLogger(__name__).warning(
            "no draft model given and none shipped: serving n-gram prompt lookup only "
            "(pass --model DIR for a draft model, --model none to silence this)")
        return None
    return str(shipped)


def _optional(value: str | None) -> str | None:
    return None if not value or _says_none(value) else value


def config_from_args(args: argparse.Namespace) -> DraftConfig:
    values = {name: getattr(args, name) for name, _, _ in _FLAGS}
    return DraftConfig(model=resolve_model_flag(args.model),
                       eagle=resolve_eagle_flag(args.eagle),
                       mtp=_optional(args.mtp), layer_skip=_optional(args.layer_skip),
                       skip_set=args.skip_set, tls=tls_from_args(args),
                       **values)


def run(args: argparse.Namespace) -> int:
    from draft_service.main import serve  # torch and grpc load only when serving

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    registration = None
    if args.redis_url:
        from tandem.registration import Registration

        # port 0 is replaced by the bound one in serve()
        address = advertised(args.advertise_address, args.advertise_host, config.host,
                             config.port)
        registration = Registration(args.redis_url, "draft", address, args.worker_id,
                                    redis_password=args.redis_password)
    asyncio.run(serve(config, registration=registration, metrics_port=args.metrics_port,
                      ready=lambda addr: print(
        f"tandem draft: serving on {addr} ({config.model or 'n-gram only'})", flush=True)))
    return 0

