"""Device profiles for GPUs this host does not have: a roofline. A forward over t tokens costs
max(FLOPs / (peak x MFU), bytes / (bandwidth x BW_EFF)) plus a fixed step overhead; the KV
cache read adds bytes per cached token attended. Peaks are the vendors' data-sheet figures
(dense BF16, no sparsity); model shapes come from config.json. Replace a roofline by measured
curves (`tandem plan calibrate`, `tandem gpu-check`) as soon as a GPU has produced them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tools.plan.profile import Profile

# Data sheets: dense BF16 TFLOP/s, HBM/GDDR TB/s, memory GB. Prices: illustrative on-demand
# $ per GPU-hour (override them in the profile JSON for your cloud).
GPUS = {
    "h100": dict(tflops=989.0, tbps=3.35, mem_gb=80, price_hr=3.00, name="NVIDIA H100 SXM"),
    "h200": dict(tflops=989.0, tbps=4.8, mem_gb=141, price_hr=3.80, name="NVIDIA H200 SXM"),
    "a100": dict(tflops=312.0, tbps=2.039, mem_gb=80, price_hr=1.80, name="NVIDIA A100 SXM 80GB"),
    "l4": dict(tflops=121.0, tbps=0.30, mem_gb=24, price_hr=0.80, name="NVIDIA L4"),
}
MFU = 0.5  # of peak FLOP/s a large-batch GEMM reaches
BW_EFF = 0.7  # of peak bandwidth a decode step's weight and KV reads reach
STEP_OVERHEAD_MS = 4.0  # Python, sampling, rejection, launch gaps per verifier step (no graphs)
DRAFT_OVERHEAD_MS = 1.5  # per draft worker step
MEM_FOR_KV = 0.9  # of device memory usable for weights + KV

# config.json fields of the models the worked plan uses (Hugging Face's published configs)
SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    # EAGLE-3 head for Llama-3.1-8B: one decoder layer, the 3-layer feature fc, a 32k vocab
    "eagle3-llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=1, intermediate_size=14336,
                                num_attention_heads=32, num_key_value_heads=8,
                                vocab_size=32000, extra_params=3 * 4096 * 4096),
}


@dataclass(frozen=True)
class Shape:
    """Per-token costs of a model: params read per forward, KV bytes per token (bf16)."""

    params: float  # weights read per forward (embedding rows aside, lm_head included)
    kv_bytes: float  # bytes of KV cache per token
    feature_bytes: int  # EAGLE-3 features per token: 3 layers x hidden x 2 bytes


def shape_of(config: str) -> Shape:
    raw = SHAPES.get(config) or json.loads(Path(config).read_text())
    h, n = raw["hidden_size"], raw["num_hidden_layers"]
    heads, kv = raw["num_attention_heads"], raw.get("num_key_value_heads",
                                                    raw["num_attention_heads"])
    hd = raw.get("head_dim", h // heads)
    layer = 2 * h * heads * hd + 2 * h * kv * hd + 3 * h * raw["intermediate_size"]
    params = n * layer + raw["vocab_size"] * h + raw.get("extra_params", 0)
    return Shape(params, 2 * n * kv * hd * 2, 3 * h * 2)


def label(config: str) -> str:
    """A shape's name: the built-in's, else the checkpoint directory's."""
    return config if config in SHAPES else (Path(config).parent.name or Path(config).name)


def forward_ms(shape: Shape, gpu: dict, tokens: int) -> float:
    """A forward over `tokens` new tokens: compute- or weight-bandwidth-bound."""
    compute = 2 * shape.params * tokens / (gpu["tflops"] * 1e12 * MFU) * 1e3
    memory = 2 * shape.params / (gpu["tbps"] * 1e12 * BW_EFF) * 1e3
    return max(compute, memory)


def roofline_profile(gpu: str, model_config: str, draft_gpu: str = "",
                     draft_config: str = "llama-3.2-1b", colocated: bool = False) -> Profile:
    if gpu not in GPUS or (draft_gpu and draft_gpu not in GPUS):
        raise ValueError(f"unknown GPU {gpu!r}/{draft_gpu!r}; known: {', '.join(GPUS)}")
    g, dg = GPUS[gpu], GPUS[gpu if colocated else (draft_gpu or gpu)]
    target, draft = shape_of(model_config), shape_of(draft_config)
    counts = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    kv_mem = g["mem_gb"] * 1e9 * MEM_FOR_KV - 2 * target.params
    if colocated:
        kv_mem -= 2 * draft.params
    if kv_mem <= 0:
        raise ValueError(f"{model_config} does not fit one {g['name']}")
    where = f"on the verifier's {g['name']}" if colocated else f"on {dg['name']}"
    return Profile(
        name=f"roofline-{gpu}-{label(model_config)}" + ("-colocated" if colocated else
                                                            f"-draft-{draft_gpu or gpu}"),
        source=(f"roofline (data sheet: {g['tflops']} TFLOP/s bf16, {g['tbps']} TB/s; MFU "
                f"{MFU}, bandwidth efficiency {BW_EFF}, {STEP_OVERHEAD_MS} ms per step); "
                f"draft {label(draft_config)} {where}"),
        verify_ms={t: round(forward_ms(target, g, t), 4) for t in counts},
        draft_ms={b: round(forward_ms(draft, dg, b) + DRAFT_OVERHEAD_MS, 4)
                  for b in (1, 2, 4, 8, 16, 32, 64, 128)},
        kv_ms_per_ktok=round(1e3 * target.kv_bytes / (g["tbps"] * 1e12 * BW_EFF) * 1e3, 5),
        step_overhead_ms=STEP_OVERHEAD_MS, seq_overhead_ms=0.05,
        net_latency_ms=0.1 if colocated else 0.5, net_gbps=100.0 if colocated else 25.0,
        feature_bytes_per_token=target.feature_bytes if colocated else 0,
        gateway_ms=3.0, kv_tokens=int(kv_mem / target.kv_bytes), block_size=16,
        colocated_draft=colocated, price_verifier_hr=g["price_hr"],
        price_draft_hr=0.0 if colocated else dg["price_hr"],
        notes="simulation inputs from data sheets, not measurements: no GPU has run Tandem yet")
