"""`tandem verifier`: run one verifier worker."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging

from tandem.device import add_device_flags
from tandem.engine.graph_modes import GRAPH_MODES
from tandem.envflags import add_flag, add_log_level_flag, boolean, csv, env
from tandem.redis_conn import add_password_flag
from tandem.tls import add_tls_flags, tls_from_args
from tandem.vllm_compat import (
    add_speculative_config_flag,
    add_vllm_aliases,
    parse_speculative_config,
    verifier_overrides,
)
from verify_service.config import DRAFT_SHAPES, HISTORY_PLACES, VerifierConfig

_DEFAULTS = VerifierConfig()

# Integer flags read from VerifierConfig: name -> help.
_INT_FLAGS = {
    "threads": "torch CPU threads, 0 = torch's default",
    "narrow_threads": "threads of a forward of fewer than --wide-rows rows (bound by "
                      "memory): 1 leaves the other cores to the event loop, gRPC and the "
                      "gateway; 0 = --threads (off; `tandem up` passes 1); int8 CPU targets only",
    "wide_rows": "rows from which a forward runs on --threads threads",
    "kv_cache_mb": "paged KV cache budget in MiB",
    "block_size": "tokens per KV cache block, 0 = the device's (256 with flash-attn on a "
                  "GPU, else 16)",
    "max_sessions": "open sessions this worker accepts before refusing new ones",
    "max_num_seqs": "sessions verified together in one batched round",
    "prefill_chunk_tokens": "chunked prefill: prompt tokens computed per step beside decoding "
                            "sessions, 0 = off",
    "max_spec_tokens": "cap on draft tokens verified per session per round (0..32); vLLM's "
                       "name --num-speculative-tokens is the same flag",
    "max_model_len": "longest context of a session, prompt and output (vLLM's flag); 0 = the "
                     "model's max_position_embeddings",
    "max_ngram_size": "n-gram drafts match the last n tokens, n at most this (vLLM's "
                      "prompt_lookup_max)",
    "min_ngram_size": "... and n at least this (vLLM's prompt_lookup_min)",
    "top_n": "size of the sparse draft distribution asked from draft workers",
    "calibrate_reps": "timed forwards per token count at start-up, seeding the cost curve "
                      "k is chosen from (0: a built-in table)",
    "layer_skip_kv_mb": "KV cache budget in MiB of the in-process layer-skip draft",
    "tensor_parallel_size": "ranks the target is split over (torch.distributed: NCCL on GPUs, "
                            "gloo on CPUs); this process is rank 0 and spawns the others; "
                            "must divide the model's KV heads",
    "tensor_parallel_local_ranks": "ranks of the group on this node, 0 = all; the rest join "
                                   "from other nodes (`tandem tp-worker`)",
}


def register(sub, colocate=None) -> None:
    """Add `verifier`; `colocate` starts in-process draft workers (tools.colocate)."""
    p = sub.add_parser("verifier", help="run a verifier worker (target model + paged KV cache)",
                       description="Serve tandem.v1.VerifyService over gRPC. Every flag also "
                       "reads the environment variable named in its help "
                       "(TANDEM_VERIFIER_<FLAG>, e.g. TANDEM_VERIFIER_PORT).")
    add_flag(p, "--host", "TANDEM_VERIFIER_HOST", _DEFAULTS.host, help="address to bind")
    add_flag(p, "--port", "TANDEM_VERIFIER_PORT", 50051, int,
             help="gRPC port to bind, 0 = any free port")
    add_flag(p, "--model", "TANDEM_MODEL", _DEFAULTS.model,
             help="target: default name or HF checkpoint dir")
    add_device_flags(p, "TANDEM_VERIFIER", _DEFAULTS.dtype,
                     "target weight dtype: auto (cpu: int8 where the target's weights are "
                     "exact in it, else float32; bfloat16 on cuda), float32, "
                     "bfloat16, float16, int8 (cpu weight-only, per-group scales; "
                     "activations, norms and KV cache stay fp32), int8-bf16 (int8 whose "
                     "products round activations to bf16: ~1.6x on prefills, 1.2-1.5x on "
                     "decode and batches; cpus with AVX512-BF16)")
    add_flag(p, "--batch-invariant", "TANDEM_VERIFIER_BATCH_INVARIANT", False, boolean,
             nargs="?", const=True, metavar="on|off",
             help="batch-invariant numerics: a session's tokens never depend on what shares "
                  "its batch (greedy identical alone, batched, speculative, after failover); "
                  "costs speed, see docs/design/batch_invariance.md")
    add_flag(p, "--batch-plan", "TANDEM_VERIFIER_BATCH_PLAN", _DEFAULTS.batch_plan, boolean,
             nargs="?", const=True, metavar="on|off",
             help="under batch load verify only the drafts that pay for the whole step "
                  "(its measured cost by tokens); off: each session's single-session k")
    add_flag(p, "--forced-drafts", "TANDEM_VERIFIER_FORCED_DRAFTS", _DEFAULTS.forced_drafts,
             boolean, nargs="?", const=True, metavar="on|off",
             help="structured output: draft the tokens a grammar forces (keys, quotes, "
                  "separators) in ngram, suffix and auto sessions at no cost")
    for name, text in _INT_FLAGS.items():
        add_flag(p, "--" + name.replace("_", "-"), f"TANDEM_VERIFIER_{name.upper()}",
                 getattr(_DEFAULTS, name), int, help=text)
    add_vllm_aliases(p)
    add_flag(p, "--enable-prefix-caching", "TANDEM_VERIFIER_ENABLE_PREFIX_CACHING",
             _DEFAULTS.enable_prefix_caching, boolean, action=argparse.BooleanOptionalAction,
             help="reuse the KV blocks of a prompt prefix already computed (vLLM's flag)")
    add_speculative_config_flag(p)
    add_flag(p, "--served-model-name", "TANDEM_VERIFIER_SERVED_MODEL_NAME", "",
             help="model_name label of vLLM's spec-decode metrics (vLLM's flag; default: the "
                  "gateway's default name of --model)")
    add_flag(p, "--max-draft-wait-ms", "TANDEM_VERIFIER_MAX_DRAFT_WAIT_MS",
             _DEFAULTS.max_draft_wait_ms, float,
             help="longest a round waits for draft tokens still in flight")
    p.add_argument("--draft", action="append", dest="drafts", metavar="HOST:PORT",
                   default=list(csv(env("TANDEM_VERIFIER_DRAFTS"))),
                   help="draft worker address (repeatable); others come from the registry "
                        "[env TANDEM_VERIFIER_DRAFTS, comma-separated]")
    add_flag(p, "--redis-url", "REDIS_URL", "",
             help="register here and discover draft workers")
    add_password_flag(p)
    add_flag(p, "--worker-id", "TANDEM_VERIFIER_WORKER_ID", "",
             help="id in the registry (default: generated)")
    add_flag(p, "--advertise-address", "TANDEM_VERIFIER_ADVERTISE_ADDRESS", "",
             help="host:port others dial, IPv6 in brackets (default: --advertise-host and "
                  "the bound port)")
    add_flag(p, "--advertise-host", "TANDEM_VERIFIER_ADVERTISE_HOST", "",
             help="host or IP others dial (e.g. the pod IP, IPv6 too), joined with the bound "
                  "port (default: --host)")
    add_flag(p, "--drain-grace-s", "TANDEM_VERIFIER_DRAIN_GRACE_S", 5.0, float,
             help="seconds running streams get to finish when stopping")
    add_flag(p, "--tensor-parallel-timeout-s", "TANDEM_VERIFIER_TENSOR_PARALLEL_TIMEOUT_S",
             _DEFAULTS.tensor_parallel_timeout_s, float,
             help="collective timeout of the tensor-parallel group: a dead rank takes the "
                  "group down within it")
    add_flag(p, "--tensor-parallel-master", "TANDEM_VERIFIER_TENSOR_PARALLEL_MASTER", "",
             help="host:port this rank 0 listens on for the group's rendezvous (needed with "
                  "ranks on other nodes; default: loopback and a free port)")
    add_flag(p, "--metrics-port", "TANDEM_VERIFIER_METRICS_PORT", -1, int,
             help="Prometheus /metrics HTTP port: -1 off, 0 any free port")
    add_flag(p, "--layer-skip", "TANDEM_VERIFIER_LAYER_SKIP", _DEFAULTS.layer_skip,
             help="serve speculation.method=layer_skip in this process over the target's own "
                  "weights: auto (if a skip set is saved or shipped with the model; see "
                  "`tandem search-skip`), off, or a layer_skip.json path")
    add_flag(p, "--medusa", "TANDEM_VERIFIER_MEDUSA", _DEFAULTS.medusa,
             help="serve speculation.method=medusa with these heads: auto (heads saved or "
                  "shipped with the model; see `tandem distill --method medusa`), off, or a "
                  "directory with medusa.json")
    add_flag(p, "--eagle-feature-layers", "TANDEM_VERIFIER_EAGLE_FEATURE_LAYERS",
             _DEFAULTS.eagle_feature_layers,
             help="features shipped to EAGLE draft workers: final (the final normed hidden "
                  "state: EAGLE-1/2 and Tandem heads), eagle3 (an EAGLE-3 head's default "
                  "layers) or i,j,k (the outputs of target layers i, j, k, as the head's "
                  "eagle_aux_hidden_state_layer_ids names them) [%(default)s]")
    add_flag(p, "--draft-shape", "TANDEM_VERIFIER_DRAFT_SHAPE", _DEFAULTS.draft_shape,
             choices=DRAFT_SHAPES,
             help="drafts of medusa and eagle sessions whose request does not choose "
                  "(speculation.draft_shape): a token tree verified in one forward, a chain, "
                  "or auto (medusa trees; eagle trees on a GPU, chains on the CPU)")
    add_flag(p, "--history-drafts", "TANDEM_VERIFIER_HISTORY_DRAFTS", _DEFAULTS.history_drafts,
             choices=HISTORY_PLACES,
             help="where ngram and suffix sessions draft: verifier (in its own step: no "
                  "draft link, no wait) or worker (a draft worker, like model drafts)")
    add_flag(p, "--suffix-cache-tokens", "TANDEM_VERIFIER_SUFFIX_CACHE_TOKENS",
             _DEFAULTS.suffix_cache_tokens, int,
             help="finished tokens the verifier's suffix decoding keeps per tenant to draft "
                  "from (0 = each session's own text only) [%(default)s]")
    add_flag(p, "--cuda-graphs", "TANDEM_VERIFIER_CUDA_GRAPHS", _DEFAULTS.cuda_graphs,
             choices=GRAPH_MODES,
             help="CUDA graphs for decode steps: on, off, or auto (on only where the "
                  "--gpu-check-result measured a gain on this GPU model; none measured yet, "
                  "so off); on needs a GPU")
    add_flag(p, "--gpu-check-result", "TANDEM_VERIFIER_GPU_CHECK_RESULT", "",
             help="a gpu-check.json written by `tandem gpu-check` on this GPU model, read by "
                  "--cuda-graphs auto")
    add_log_level_flag(p, "TANDEM_VERIFIER_LOG_LEVEL")
    add_tls_flags(p)
    p.set_defaults(func=functools.partial(_run, colocate=colocate))


def config_from_args(args: argparse.Namespace) -> VerifierConfig:
    """The VerifierConfig of parsed flags; --speculative-config (vLLM's JSON) sets the fields
    it names over them (tandem.vllm_compat)."""
    fields = {f.name for f in dataclasses.fields(VerifierConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    if args.speculative_config:
        values.update(verifier_overrides(parse_speculative_config(args.speculative_config)))
    return VerifierConfig(**values, draft_addresses=tuple(args.drafts),
                          tls=tls_from_args(args))


def _run(args: argparse.Namespace, colocate=None) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"tandem verifier: {exc}") from None
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    from verify_service.main import serve

    asyncio.run(serve(config, colocate))
    return 0
