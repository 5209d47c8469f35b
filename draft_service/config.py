"""Draft worker configuration (validated once, at construction)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.device import DTYPE_CHOICES as DTYPES
from tandem.device import check_device_spec
from tandem.grpc_limits import SERVER_KEEPALIVE_S, SERVER_KEEPALIVE_TIMEOUT_S
from tandem.netaddr import join_host_port
from tandem.proposers.suffix import SuffixConfig
from tandem.spec.cost import DEFAULT_MAX_SPEC_TOKENS
from tandem.tls import TlsConfig, check_serving

SUFFIX_SCOPES = ("global", "tenant")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # True must not mean 1


@dataclass(frozen=True)
class DraftConfig:
    host: str = "127.0.0.1"  # 0.0.0.0 (or [::]) in a container
    port: int = 50052  # 0 = any free port (tests)
    model: str | None = None  # draft checkpoint directory; None = n-gram lookup only
    eagle: str | None = None  # EAGLE head directory (tandem.engine.eagle); None = no head
    mtp: str | None = None  # target checkpoint carrying MTP modules (tandem.engine.mtp)
    # Target checkpoint to draft for by layer skip (tandem.engine.layer_skip), and its skip
    # set: "auto" (the one saved or shipped with the checkpoint) or a layer_skip.json path.
    layer_skip: str | None = None
    skip_set: str = "auto"
    # Rows of the head's vocabulary it drafts from (0 = all): its LM head is most of a draft
    # step, and the commonest 4096 tokens agree with the target as often as all 12288 do.
    eagle_vocab: int = 4096
    tokenizer: str | None = None  # checkpoint dir naming the token ids when model is None
    threads: int = 1  # torch threads: a batch-1 forward keeps one core busy anyway
    max_sessions: int = 256
    max_run_ahead: int = 8  # default drafts outstanding per session
    max_spec_tokens: int = DEFAULT_MAX_SPEC_TOKENS  # largest max_run_ahead a verifier may ask for
    top_n: int = 8  # default size of the truncated q sent per draft token
    max_top_n: int = 64
    kv_cache_mb: int = 256
    block_size: int = 0  # 0 = the device's (tandem.kernels.attention.default_block_size)
    max_ngram_size: int = 3
    max_context_length: int = 0  # 0 = the draft model's limit (n-gram only: 32768)
    dtype: str = "auto"  # float32 on the cpu, bfloat16 on a GPU (tandem.device)
    device: str = "auto"  # auto (CUDA when present), cpu, cuda, cuda:N
    # Suffix decoding: finished tokens held per scope (0 = own sequence only), one cache per
    # tenant ("tenant": without API keys every request is one anonymous tenant) or one for all
    # ("global": faster acceptance may then tell one tenant what another asked), and its
    # confidence knobs.
    suffix_cache_tokens: int = 262_144
    suffix_scope: str = "tenant"
    suffix_min_prob: float = 0.1
    suffix_spec_factor: float = 1.0
    drain_grace_s: float = 5.0  # SIGTERM: streams keep drafting this long, then UNAVAILABLE
    tls: TlsConfig | None = None  # serve gRPC over TLS (mTLS with require_client_cert)
    # Ping each verifier this often, and drop its connection (and sessions) after a ping goes
    # unanswered this long: a vanished verifier's sessions are freed in under a minute.
    keepalive_s: float = SERVER_KEEPALIVE_S
    keepalive_timeout_s: float = SERVER_KEEPALIVE_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        if not (_is_int(self.port) and 0 <= self.port <= 65535):
            raise ValueError(f"port must be in [0, 65535] (0 = any free port), got {self.port!r}")
        for name in ("model", "tokenizer", "eagle", "mtp", "layer_skip"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be None or a non-empty path, got {value!r}")
        positive = ("threads", "max_sessions", "max_run_ahead", "max_spec_tokens", "top_n",
                    "max_top_n", "kv_cache_mb", "max_ngram_size")
        for name in positive:
            value = getattr(self, name)
            if not (_is_int(value) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_run_ahead > self.max_spec_tokens:
            raise ValueError(f"max_run_ahead {self.max_run_ahead} exceeds max_spec_tokens "
                             f"{self.max_spec_tokens}")
        if self.top_n > self.max_top_n:
            raise ValueError(f"top_n {self.top_n} exceeds max_top_n {self.max_top_n}")
        if not (_is_int(self.block_size) and self.block_size >= 0):
            raise ValueError(f"block_size must be an int >= 0 (0 = the device's), got "
                             f"{self.block_size!r}")
        check_device_spec(self.device)
        if not (_is_int(self.eagle_vocab) and self.eagle_vocab >= 0):
            raise ValueError(f"eagle_vocab must be an int >= 0 (0 = every row), got "
                             f"{self.eagle_vocab!r}")
        if not (_is_int(self.max_context_length) and self.max_context_length >= 0):
            raise ValueError(f"max_context_length must be an int >= 0 (0 = the model's), got "
                             f"{self.max_context_length!r}")
        if not isinstance(self.skip_set, str) or not self.skip_set:
            raise ValueError(f"skip_set must be 'auto' or a file path, got {self.skip_set!r}")
        if self.suffix_scope not in SUFFIX_SCOPES:
            raise ValueError(f"suffix_scope must be one of {', '.join(SUFFIX_SCOPES)}, got "
                             f"{self.suffix_scope!r}")
        self.suffix_config()  # validates the suffix knobs
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        grace = self.drain_grace_s
        if not (isinstance(grace, (int, float)) and math.isfinite(grace) and grace >= 0):
            raise ValueError(f"drain_grace_s must be a finite number >= 0, got {grace!r}")
        for name in ("keepalive_s", "keepalive_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        check_serving(self.tls)

    def suffix_config(self) -> SuffixConfig:
        return SuffixConfig(min_prob=self.suffix_min_prob, spec_factor=self.suffix_spec_factor,
                            cache_tokens=self.suffix_cache_tokens,
                            per_tenant=self.suffix_scope == "tenant")

    @property
    def address(self) -> str:
        return join_host_port(self.host, self.port)
