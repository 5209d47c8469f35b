"""Random-weight models for gpu-check: no checkpoint, tokenizer or network needed.

Tiny models of every served family (tandem.engine.families) for correctness, and models shaped
like Llama 3.2 1B and Llama 3.1 8B targets for timing (their weights are drawn on the device
in the timed dtype, so an 8B model costs seconds, not a CPU-side copy).
"""
from __future__ import annotations

import torch

from tandem.engine.checkpoint import LlamaConfig
from tandem.engine.llama import LlamaModel

_TINY = dict(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)

# HF config.json dicts, parsed by LlamaConfig.from_hf as a checkpoint's would be.
TINY_FAMILIES: dict[str, dict] = {
    "llama": dict(_TINY, model_type="llama", tie_word_embeddings=True),
    "llama3-rope": dict(_TINY, model_type="llama", head_dim=16, rope_theta=500000.0,
                        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "mistral-window": dict(_TINY, model_type="mistral", sliding_window=12, head_dim=8),
    "qwen2-window": dict(_TINY, model_type="qwen2", use_sliding_window=True, sliding_window=12,
                         max_window_layers=1, tie_word_embeddings=False),
    "qwen3": dict(_TINY, model_type="qwen3", head_dim=16, tie_word_embeddings=False),
    "gemma2": dict(_TINY, model_type="gemma2", head_dim=16, query_pre_attn_scalar=24,
                   sliding_window=12, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0),
    "gemma3": dict(_TINY, model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16,
                   sliding_window=10, sliding_window_pattern=2, rope_theta=100000.0,
                   rope_local_base_freq=1000.0),
}

_LLAMA3 = dict(model_type="llama", vocab_size=128256, num_attention_heads=32,
               num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_scaling={
                   "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
SHAPES: dict[str, dict] = {
    "llama-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     head_dim=64, tie_word_embeddings=True),
    "llama-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     head_dim=128, tie_word_embeddings=False),
    # --tiny: the same code paths, at sizes a CPU dry run affords
    "tiny-a": dict(_TINY, model_type="llama", hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "tiny-b": dict(_TINY, model_type="llama", hidden_size=96, intermediate_size=192,
                   num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2),
}


def config(hf: dict) -> LlamaConfig:
    return LlamaConfig.from_hf(dict(hf))


def random_weights(cfg: LlamaConfig, seed: int = 0, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32,
                   std: float = 0.08) -> dict[str, torch.Tensor]:
    """Every tensor LlamaModel reads for `cfg`, drawn from one seeded generator on `device`:
    projections ~ N(0, std), untied embeddings ~ N(0, 10 std), norm scales and biases near their
    neutral values (random enough that a wrong one shows)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    neutral = 0.0 if cfg.norm_offset else 1.0  # Gemma scales by (1 + w)

    def rand(*shape, scale=std, base=0.0):
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
        return (t * scale + base).to(dtype)

    embed = 0.3 if cfg.tie_word_embeddings else min(10 * std, 1.0)  # tied: it is the LM head
    w = {"embed_tokens.weight": rand(cfg.vocab_size, h, scale=embed),
         "norm.weight": rand(h, scale=0.1, base=neutral)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = rand(cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        w |= {p + "input_layernorm.weight": rand(h, scale=0.1, base=neutral),
              p + "post_attention_layernorm.weight": rand(h, scale=0.1, base=neutral),
              p + "self_attn.q_proj.weight": rand(q, h),
              p + "self_attn.k_proj.weight": rand(kv, h),
              p + "self_attn.v_proj.weight": rand(kv, h),
              p + "self_attn.o_proj.weight": rand(h, q),
              p + "mlp.gate_proj.weight": rand(cfg.intermediate_size, h),
              p + "mlp.up_proj.weight": rand(cfg.intermediate_size, h),
              p + "mlp.down_proj.weight": rand(h, cfg.intermediate_size)}
        if cfg.qkv_bias:
            w |= {p + f"self_attn.{n}_proj.bias": rand(size, scale=0.1)
                  for n, size in (("q", q), ("k", kv), ("v", kv))}
        if cfg.o_bias:
            w[p + "self_attn.o_proj.bias"] = rand(h, scale=0.1)
        if cfg.qk_norm:
            w |= {p + f"self_attn.{n}_norm.weight": rand(hd, scale=0.1, base=neutral)
                  for n in "qk"}
        if cfg.sandwich_norms:
            w |= {p + f"{n}_feedforward_layernorm.weight": rand(h, scale=0.1, base=neutral)
                  for n in ("pre", "post")}
    return w


def tiny_family(name: str, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0) -> LlamaModel:
    """A tiny random model of one family; the same seed gives the same weights anywhere
    (drawn on the CPU in fp32, then placed)."""
    cfg = config(TINY_FAMILIES[name])
    return LlamaModel(cfg, random_weights(cfg, seed), dtype, device=device)


def shaped(name: str, device: str | torch.device, dtype: torch.dtype,
           seed: int = 0) -> LlamaModel:
    """A random model shaped like SHAPES[name], its weights drawn on `device` in `dtype`."""
    cfg = config(SHAPES[name])
    std = 0.02 if cfg.hidden_size > 512 else 0.08
    return LlamaModel(cfg, random_weights(cfg, seed, device, dtype, std), dtype, device=device)
