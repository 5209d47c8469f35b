"""Gateway configuration: one frozen, validated value built by the CLI (or by tests)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.auth import ApiKey, normalize_keys
from tandem.models import DEFAULT_TARGET
from tandem.netaddr import check_target
from tandem.spec.cost import DEFAULT_MAX_SPEC_TOKENS
from tandem.spec.methods import Method
from tandem.tls import TlsConfig


def _check_address(addr: str, what: str) -> None:
    try:
        check_target(addr)
    except ValueError as exc:
        raise ValueError(f"{what} must be host:port ([v6]:port for IPv6): {exc}") from None


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway process needs; invalid combinations fail at construction."""

    host: str = "127.0.0.1"  # "::" = every IPv6 and IPv4 address
    port: int = 8000
    # Prometheus /metrics on its own port (e.g. kept off a public Service); 0 = on `port`.
    metrics_port: int = 0
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Key namespace in Redis, shared with the workers' registry.
    redis_prefix: str = "tandem"
    # Empty = no authentication. Plain keys or "sha256:<hex>" strings, or ApiKeys (with
    # quotas, see gateway/auth.py); __post_init__ turns them all into ApiKeys, so only digests
    # are kept.
    api_keys: tuple[ApiKey | str, ...] = ()
    # Requests per minute per API key (per client address without keys); 0 = off. A key's own
    # rpm (ApiKey.rpm) overrides it.
    rate_limit_rpm: int = 0
    # Name clients put in "model"; model_path is what the tokenizer was loaded from.
    model_name: str = DEFAULT_TARGET
    model_path: str = ""
    context_length: int = 8192
    # Tokens that end a reply besides the tokenizer's EOS: the checkpoint's
    # generation_config.json eos_token_id (Gemma's <end_of_turn>, Llama 3's <|eot_id|>).
    eos_token_ids: tuple[int, ...] = ()
    # A chat template (Jinja text, --chat-template) over the checkpoint's; "" = the
    # checkpoint's. With neither, chat is a 400 and completions serve (gateway/chat_template).
    chat_template: str = ""
    # Completions default like OpenAI's legacy API; chat defaults to the rest of the context.
    default_max_tokens: int = 16
    default_speculative_tokens: int = 0  # 0 = the verifier's default
    max_spec_tokens: int = DEFAULT_MAX_SPEC_TOKENS
    # Default speculation method: the first of these that is served (auto: by every verifier;
    # the others: by a live draft worker). auto takes each round's best token-history proposal
    # and drafts nothing where none matches (docs/results/benchmarks-copy.md); the model
    # drafts after it are in the measured order (docs/results/benchmarks.md: draft_model
    # 0.85x, eagle 0.83x), and
    # the first of them served is also auto's draft worker (gateway/plan.auto_draft_method).
    method_preference: tuple[str, ...] = ("auto", "draft_model", "eagle")
    # Whether auto sessions also link that draft worker. Off where it shares the verifier's
    # cores or device (`tandem up`'s one-host cluster): each ask makes it catch up on that
    # compute, auto / best single on chat 0.97 with it against 1.00 without on this 2-core
    # CPU, while its drafts never paid there (docs/results/benchmarks-copy-runs.md).
    auto_model_drafts: bool = True
    request_timeout_s: float = 600.0
    # After SIGTERM: how long open streams may run on before uvicorn cancels them.
    shutdown_grace_s: float = 600.0
    # A verifier stream silent this long counts as dead and the session fails over.
    stall_timeout_s: float = 60.0
    info_timeout_s: float = 2.0
    # Attempts per request across verifiers (the first call plus failovers).
    max_attempts: int = 4
    # Of those, resumes after a verifier was lost mid-request (died, stalled, aborted): a
    # request that killed one verifier must not go on to kill the next ones. Refusals
    # (full, already there) do not count: nothing ran.
    max_resumes: int = 1
    # Registry TTL the gateway assumes when it reads worker records.
    registry_ttl_s: float = 6.0
    # Per Redis call; after a failure Redis is skipped for redis_cooldown_s (fail open).
    redis_timeout_s: float = 1.0
    redis_cooldown_s: float = 5.0
    session_ttl_s: float = 3600.0
    affinity_ttl_s: float = 1800.0
    # Retry-After sent with 429 when a verifier says RESOURCE_EXHAUSTED.
    retry_after_s: int = 1
    # Used when no worker is registered in Redis: the gateway works without a registry.
    static_verifiers: tuple[str, ...] = ()
    static_drafts: tuple[str, ...] = ()
    # Sessions a static verifier is assumed to hold when its Info call gives no answer.
    static_capacity: int = 64
    # sha256 of tokenizer.json; verifiers registered with another hash are never picked.
    tokenizer_hash: str = ""
    # Larger request bodies get 413. A whole context of text (8192 tokens is ~40 KB, a
    # 128k-token one under 1 MB even as a JSON id list) fits many times over.
    max_request_bytes: int = 4 << 20
    # gRPC to verifiers over TLS (presenting cert_file when given, for mTLS); None = plaintext.
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        self._check_ints()
        self._check_floats()
        if not self.model_name:
            raise ValueError("model_name must be non-empty")
        for name in self.method_preference:
            Method.parse(name)  # InvalidArgument (a ValueError) names the choices
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must be a redis:// URL, got {self.redis_url!r}")
        # frozen: the one place the value is replaced, so a plain key is never stored
        object.__setattr__(self, "api_keys", normalize_keys(self.api_keys))
        for addr in self.static_verifiers:
            _check_address(addr, "a static verifier address")
        for addr in self.static_drafts:
            _check_address(addr, "a static draft address")
        if self.tls is not None and not isinstance(self.tls, TlsConfig):
            raise ValueError(f"tls must be None or a TlsConfig, got {self.tls!r}")
        if self.default_speculative_tokens > self.max_spec_tokens:
            raise ValueError("default_speculative_tokens must be <= max_spec_tokens")

    def _check_ints(self) -> None:
        ranges = {"port": (0, 65535), "metrics_port": (0, 65535), "rate_limit_rpm": (0, None),
                  "context_length": (2, None),
                  "default_max_tokens": (1, None), "default_speculative_tokens": (0, None),
                  "max_spec_tokens": (0, 1024), "max_attempts": (1, 32), "max_resumes": (0, 31),
                  "retry_after_s": (1, None), "static_capacity": (1, None),
                  "max_request_bytes": (1, None)}
        for name, (lo, hi) in ranges.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
            if value < lo or (hi is not None and value > hi):
                bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise ValueError(f"{name} must be {bound}, got {value}")

    def _check_floats(self) -> None:
        for name in ("request_timeout_s", "stall_timeout_s", "info_timeout_s",
                     "registry_ttl_s", "session_ttl_s", "affinity_ttl_s",
                     "redis_timeout_s", "redis_cooldown_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        grace = self.shutdown_grace_s
        if not isinstance(grace, (int, float)) or not math.isfinite(grace) or grace < 0:
            raise ValueError(f"shutdown_grace_s must be a finite number >= 0, got {grace!r}")
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"metrics_port must differ from port ({self.port})")

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)
