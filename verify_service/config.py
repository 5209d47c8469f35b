"""Verifier worker configuration (flags and TANDEM_VERIFIER_* environment variables)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath

from tandem.device import DTYPE_CHOICES, check_device_spec
from tandem.engine.graph_modes import GRAPH_MODES
from tandem.models import DEFAULT_TARGET
from tandem.netaddr import check_target, split_host_port
from tandem.spec.cost import DEFAULT_MAX_SPEC_TOKENS
from tandem.spec.methods import Method
from tandem.tls import TlsConfig, check_serving

DRAFT_SHAPES = ("auto", "tree", "chain")


HISTORY_PLACES = ("verifier", "worker")  # where ngram / suffix sessions draft


@dataclass(frozen=True)
class VerifierConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    model: str = DEFAULT_TARGET
    threads: int = 0  # torch threads, 0 = torch's default
    # Threads of a forward of fewer than wide_rows rows (decode steps of a few sessions,
    # short verify rounds: bound by memory, and sharing the cores with the event loop and
    # gRPC); 0 = threads (off). int8 CPU targets only (tandem.engine.forward_threads).
    # `tandem up` passes 1: a process of its own, sharing a host with the gateway.
    narrow_threads: int = 0
    wide_rows: int = 6
    # Target weights: auto (float32 on the cpu, bfloat16 on a GPU), float32, bfloat16,
    # float16 or int8 (cpu weight-only); device: auto (CUDA when present), cpu, cuda, cuda:N.
    dtype: str = "auto"
    device: str = "auto"
    # Every row's logits independent of the batch it runs in (tandem.engine.llama): greedy
    # text the same alone, batched, speculative or after failover; slower.
    batch_invariant: bool = False
    kv_cache_mb: int = 512
    block_size: int = 0  # tokens per KV block; 0 = the device's (256 for flash-attn, else 16)
    max_sessions: int = 64
    max_num_seqs: int = 32
    # Chunked prefill: beside decoding sessions, a prompt is computed this many tokens per
    # step (0 = off: a long prompt stalls them for its whole prefill).
    prefill_chunk_tokens: int = 256
    # Under batch load, verify only the drafts that pay for the whole batch's step (its cost
    # curve by tokens), not just for their own session; off = each session's solo k.
    batch_plan: bool = True
    # Structured output: tokens the grammar forces become free drafts of sessions drafted in
    # the verifier (ngram, suffix, auto); off only to measure what they add.
    forced_drafts: bool = True
    # The cost model picks each round's k up to this: a weak draft stays short, while suffix
    # decoding on a repeated answer pays up to ~16 on this CPU.
    max_spec_tokens: int = DEFAULT_MAX_SPEC_TOKENS
    max_draft_wait_ms: float = 25.0
    top_n: int = 8
    # Longest context a session may reach (prompt and output); 0 = the model's
    # max_position_embeddings (vLLM's --max-model-len).
    max_model_len: int = 0
    # Reuse the KV blocks of a prompt prefix already computed (vLLM's
    # --enable-prefix-caching); off: every prompt is computed in full.
    enable_prefix_caching: bool = True
    # The verifier's n-gram drafts match the last n tokens, n from max down to min (vLLM's
    # prompt_lookup_max / prompt_lookup_min).
    max_ngram_size: int = 3
    min_ngram_size: int = 1
    # The model_name label of vLLM's spec-decode metrics (vLLM's --served-model-name; "" = the
    # gateway's default: the model directory's name).
    served_model_name: str = ""
    draft_addresses: tuple[str, ...] = ()
    redis_url: str = ""
    # Used when redis_url carries none (REDIS_PASSWORD); kept out of repr and logs.
    redis_password: str = field(default="", repr=False)
    worker_id: str = ""
    # What others dial: advertise_address as given, else advertise_host (default: host)
    # joined with the bound port, IPv6 literals bracketed (tandem.netaddr).
    advertise_address: str = ""
    advertise_host: str = ""
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
    # What the verifier ships EAGLE draft workers as features: "final" (the final normed
    # hidden state: Tandem's and EAGLE-1/2 heads), "eagle3" (the residual streams entering
    # layers 2, N/2, N-3) or "i,j,k" (the outputs of those layers, as an EAGLE-3 head's
    # eagle_aux_hidden_state_layer_ids names them); tandem/engine/eagle3.py.
    eagle_feature_layers: str = "final"
    # The drafts of a tree-capable method (medusa, eagle) when the request does not say:
    # "tree" (several candidates per position, verified in one forward), "chain", or "auto":
    # Medusa's trees, and EAGLE's on a GPU only (see tree_methods).
    draft_shape: str = "auto"
    # Where ngram and suffix sessions draft: "verifier" (in this process's own step, no
    # draft link and no wait: verify_service/drafts/history.py) or "worker" (a draft worker).
    history_drafts: str = "verifier"
    # Finished tokens its suffix decoding keeps per tenant to draft from (0 = own text only).
    suffix_cache_tokens: int = 262_144
    # gRPC over TLS: served with it and presented to draft workers; None = plaintext.
    tls: TlsConfig | None = None
    # CUDA graphs for decode steps (tandem/engine/cuda_graphs.py): "on", "off", or "auto":
    # on only where the gpu-check result (a gpu-check.json path) measured a gain on this GPU
    # model; no GPU has been measured yet, so without one auto is off.
    cuda_graphs: str = "auto"
    gpu_check_result: str = ""
    # Ranks of a tensor-parallel target (this process is rank 0 and spawns the others on this
    # node: verify_service/tp/group.py); must divide the KV heads. A rank's death fails the
    # group within the collective timeout.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 60.0
    # Ranks on this node (0: all); the others join from other nodes (`tandem tp-worker`) at
    # tensor_parallel_master, the host:port rank 0 listens on for the group's rendezvous.
    tensor_parallel_local_ranks: int = 0
    tensor_parallel_master: str = ""

    def tree_methods(self, device_type: str) -> frozenset[Method]:
        """The methods whose sessions draft trees unless the request says otherwise. "auto":
        Medusa always (its heads run in the verifier's step: no wait for the tree); EAGLE on a
        GPU, where the head's passes cost little, but not on the CPU, where an EAGLE tree takes
        15-20 ms to draft after each commit and the cost model then switches it off, while a
        chain is drafted ahead during verification (docs/design/medusa.md)."""
        if self.draft_shape == "chain":
            return frozenset()
        if self.draft_shape == "tree" or device_type == "cuda":
            return frozenset({Method.MEDUSA, Method.EAGLE, Method.AUTO})
        return frozenset({Method.MEDUSA, Method.AUTO})  # auto: its heads' proposals

    def context_len(self, model_limit: int) -> int:
        """--max-model-len, at most the model's context (vLLM refuses more too)."""
        if self.max_model_len > model_limit:
            raise ValueError(f"--max-model-len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {model_limit}")
        return self.max_model_len or model_limit

    def metrics_model_name(self) -> str:
        """The model_name label of vLLM's metrics: --served-model-name, else the gateway's
        default name of --model (its directory's name)."""
        if self.served_model_name:
            return self.served_model_name
        return DEFAULT_TARGET if self.model in ("", "default") else (
            PurePath(self.model).name or self.model)

    def __post_init__(self):
        check_serving(self.tls)
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        check_device_spec(self.device)
        if self.cuda_graphs not in GRAPH_MODES:
            raise ValueError(f"cuda_graphs must be one of {', '.join(GRAPH_MODES)}, got "
                             f"{self.cuda_graphs!r}")
        if self.cuda_graphs == "on" and self.device == "cpu":
            raise ValueError("--cuda-graphs on needs a CUDA device, not --device cpu")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be -1 (off) or a port, got {self.metrics_port}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("layer_skip", "medusa"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be 'auto', 'off' or a path, got {value!r}")
        spec = self.eagle_feature_layers
        if spec not in ("final", "eagle3") and not all(
                p.strip().isdigit() for p in spec.split(",")):
            raise ValueError(f"eagle_feature_layers must be final, eagle3 or three "
                             f"comma-separated layer ids, got {spec!r}")
        if self.draft_shape not in DRAFT_SHAPES:
            raise ValueError(f"draft_shape must be one of {', '.join(DRAFT_SHAPES)}, got "
                             f"{self.draft_shape!r}")
        if self.suffix_cache_tokens < 0:
            raise ValueError(f"suffix_cache_tokens must be >= 0, got {self.suffix_cache_tokens}")
        if self.history_drafts not in HISTORY_PLACES:
            raise ValueError(f"history_drafts must be one of {', '.join(HISTORY_PLACES)}, "
                             f"got {self.history_drafts!r}")
        if self.block_size < 0:
            raise ValueError(f"block_size must be >= 0 (0 = the device's), got {self.block_size}")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be >= 0 (0 = off), got "
                             f"{self.prefill_chunk_tokens}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0 (0 = the model's), got "
                             f"{self.max_model_len}")
        if not 1 <= self.min_ngram_size <= self.max_ngram_size:
            raise ValueError(f"need 1 <= min_ngram_size <= max_ngram_size, got "
                             f"{self.min_ngram_size}, {self.max_ngram_size}")
        for name in ("kv_cache_mb", "max_sessions", "max_num_seqs", "top_n",
                     "layer_skip_kv_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tensor_parallel_size < 1 or self.tensor_parallel_timeout_s <= 0:
            raise ValueError(f"tensor_parallel_size must be >= 1 and tensor_parallel_timeout_s "
                             f"> 0, got {self.tensor_parallel_size}, "
                             f"{self.tensor_parallel_timeout_s}")
        if not 0 <= self.tensor_parallel_local_ranks <= self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_local_ranks must be in [0, "
                             f"{self.tensor_parallel_size}], got "
                             f"{self.tensor_parallel_local_ranks}")
        if self.tensor_parallel_size > 1 and self.cuda_graphs == "on":
            raise ValueError("--cuda-graphs on is not available with --tensor-parallel-size > 1 "
                             "(a captured step would run rank 0 without its workers)")
        if self.tensor_parallel_master:
            split_host_port(self.tensor_parallel_master)
        if not 0 <= self.max_spec_tokens <= 32:
            raise ValueError(f"max_spec_tokens must be in [0, 32], got {self.max_spec_tokens}")
        if (self.max_draft_wait_ms < 0 or self.drain_grace_s < 0 or self.threads < 0
                or self.narrow_threads < 0 or self.wide_rows < 1):
            raise ValueError("max_draft_wait_ms, drain_grace_s, threads and narrow_threads "
                             "must be >= 0, wide_rows >= 1")
        if not 0 <= self.calibrate_reps <= 100:
            raise ValueError(f"calibrate_reps must be in [0, 100], got {self.calibrate_reps}")
        if self.advertise_address:  # e.g. an unbracketed IPv6 pod IP fails here, not on dial
            split_host_port(self.advertise_address)
        for addr in self.draft_addresses:
            check_target(addr)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # running sessions at once
    max_num_batched_tokens: int = 2048  # new tokens per forward (prefill chunks dominate)
    max_spec_tokens: int = DEFAULT_MAX_SPEC_TOKENS  # cap on k per round
    max_verify_tokens: int = 64  # verification tokens per step; caps k under batch load
    max_model_len: int = 8192
    # Chunked prefill: beside decoding sessions a prompt is computed at most this many tokens
    # per step (their next token does not wait for its whole prefill); alone, in one forward.
    prefill_chunk_tokens: int = 256  # 0 = off: a long prefill waits for a step of its own
    features_cached: bool = False  # runner keeps features: EAGLE takes cache hits, chunks
    kv_window: int = 0  # every layer's sliding window: older KV blocks are released (0: none)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_verify_tokens",
                     "max_model_len", "prefill_chunk_tokens", "max_spec_tokens", "kv_window"):
            low = 0 if name in ("prefill_chunk_tokens", "max_spec_tokens", "kv_window") else 1
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
