"""Verifier worker configuration (flags and TANDEM_VERIFIER_* environment variables)."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.quant import WEIGHT_DTYPES
from tandem.models import DEFAULT_TARGET
from tandem.tls import TlsConfig, check_serving


@dataclass(frozen=True)
class VerifierConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    model: str = DEFAULT_TARGET
    threads: int = 0  # torch threads, 0 = torch's default
    dtype: str = "float32"  # target weights: float32, bfloat16, float16 or int8 (weight-only)
    # Every row's logits independent of the batch it runs in (tandem.engine.llama): greedy
    # text the same alone, batched, speculative or after failover; slower.
    batch_invariant: bool = False
    kv_cache_mb: int = 512
    block_size: int = 16
    max_sessions: int = 64
    max_num_seqs: int = 32
    # The cost model picks each round's k up to this: a weak draft stays short, while suffix
    # decoding on a repeated answer pays up to ~16 on this CPU.
    max_spec_tokens: int = 16
    max_draft_wait_ms: float = 25.0
    top_n: int = 8
    draft_addresses: tuple[str, ...] = ()
    redis_url: str = ""
    worker_id: str = ""
    advertise_address: str = ""  # what others dial; default host:port
    drain_grace_s: float = 5.0
    metrics_port: int = -1  # Prometheus /metrics over HTTP: -1 = off, 0 = any free port
    # Timed forwards per token count at start-up, seeding the cost curve k is chosen from
    # (then rounds keep it current); 0 = start from the built-in relative table.
    calibrate_reps: int = 3
    # Layer skip served from this process over the target's own weights: "auto" (when a skip
    # set is saved or shipped with the model), "off", or a layer_skip.json path; and the KV
    # budget of that draft (its kept layers only).
    layer_skip: str = "auto"
    layer_skip_kv_mb: int = 64
    # Medusa heads run inside the engine step: "auto" (heads saved or shipped with the
    # model), "off", or a directory holding medusa.json + medusa.safetensors.
    medusa: str = "auto"
    # gRPC over TLS: served with it and presented to draft workers; None = plaintext.
    tls: TlsConfig | None = None

    def __post_init__(self):
        check_serving(self.tls)
        if self.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.dtype!r}")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be -1 (off) or a port, got {self.metrics_port}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("layer_skip", "medusa"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be 'auto', 'off' or a path, got {value!r}")
        for name in ("kv_cache_mb", "block_size", "max_sessions", "max_num_seqs", "top_n",
                     "layer_skip_kv_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_spec_tokens <= 32:
            raise ValueError(f"max_spec_tokens must be in [0, 32], got {self.max_spec_tokens}")
        if self.max_draft_wait_ms < 0 or self.drain_grace_s < 0 or self.threads < 0:
            raise ValueError("max_draft_wait_ms, drain_grace_s and threads must be >= 0")
        if not 0 <= self.calibrate_reps <= 100:
            raise ValueError(f"calibrate_reps must be in [0, 100], got {self.calibrate_reps}")
