"""Rotary position embedding frequencies: default, linear and Llama 3 scaling."""
from __future__ import annotations

import math

import torch

from tandem.engine.checkpoint import LlamaConfig


def rope_inv_freq(cfg: LlamaConfig, rope: dict | None = None) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim // 2] float32, with linear or Llama-3 style
    scaling: the config's, or `rope` ({"rope_theta", "rope_type", ...}: Gemma 3's sliding
    layers)."""
    dim, theta = cfg.head_dim, cfg.rope_theta
    s = cfg.rope_scaling
    if rope is not None:
        theta, s = float(rope["rope_theta"]), rope
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = s.get("rope_type", "default")
    if kind == "linear":
        inv = inv / s["factor"]
    elif kind == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()
