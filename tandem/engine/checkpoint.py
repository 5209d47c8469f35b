"""Reading a Llama-family HF checkpoint: its config.json (LlamaConfig) and its safetensors
weights (load_tensors). The model built from them is tandem.engine.llama.LlamaModel."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from tandem.engine.families import (
    ACTIVATIONS,
    FULL,
    GEMMA,
    ROPE_TYPES,
    SLIDING,
    layer_types,
    rope_of,
    text_config,
    unsupported,
)
from tandem.models import ModelPaths


@dataclass(frozen=True)
class LlamaConfig:
    """One decoder config for every served family (tandem.engine.families maps each HF
    config onto it): Llama's fields plus the feature flags other families add."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling: dict = field(default_factory=dict)
    model_type: str = "llama"
    o_bias: bool = False  # attention_bias (Llama, Qwen3, Gemma): o_proj has one too
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm per head of q and k before RoPE
    norm_offset: float = 0.0  # Gemma: norms scale by (offset + w)
    embed_scale: float = 1.0  # Gemma: embeddings x sqrt(hidden)
    activation: str = "silu"  # of the gated MLP: silu, or gelu_tanh (Gemma's GeGLU)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and around the MLP
    query_scale: float = 0.0  # attention's score scale; 0 = head_dim ** -0.5
    attn_softcap: float = 0.0  # Gemma 2: scores -> cap * tanh(scores / cap); 0 = off
    final_softcap: float = 0.0  # Gemma 2: the same on the logits
    sliding_window: int = 0  # keys a sliding layer sees: q_pos - k_pos < window; 0 = none
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" / "full_attention"
    local_rope: dict = field(default_factory=dict)  # sliding layers' RoPE, when it differs

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}"
            )
        for rope in (self.rope_scaling, self.local_rope):
            if rope.get("rope_type", "default") not in ROPE_TYPES:
                raise ValueError(f"unsupported rope scaling {rope}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer_types for {self.num_layers} layers")

    def window(self, layer: int) -> int:
        """The sliding window of a layer (0: it attends to the whole context)."""
        sliding = self.layer_types and self.layer_types[layer] == SLIDING
        return self.sliding_window if sliding else 0

    @property
    def kv_window(self) -> int:
        """The window every layer has: KV older than it is never read again (0: some layer
        reads the whole context)."""
        every = self.layer_types and all(t == SLIDING for t in self.layer_types)
        return self.sliding_window if every else 0

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        """Parse a HF config.json dict (transformers 4.x and 5.x layouts) of any served
        family; ModelError names the first feature Tandem cannot compute exactly."""
        from tandem.models import ModelError

        cfg = text_config(cfg)
        if (why := unsupported(cfg)) is not None:
            raise ModelError(f"unsupported checkpoint feature: {why}")
        kind, heads = cfg.get("model_type", "llama"), cfg["num_attention_heads"]
        gemma = kind in GEMMA
        types = layer_types(cfg)
        full = rope_of(cfg, FULL)
        local = rope_of(cfg, SLIDING) if SLIDING in types else full
        rope = {k: v for k, v in full.items() if k != "rope_theta"}
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        act = (cfg.get("hidden_activation") or "gelu_pytorch_tanh") if gemma else \
            cfg.get("hidden_act", "silu")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(full["rope_theta"]),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
            qkv_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_scaling=rope,
            model_type=kind,
            o_bias=kind != "qwen2" and bool(cfg.get("attention_bias", False)),
            qk_norm=kind in ("qwen3", "gemma3", "gemma3_text"),
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else 1.0,
            activation=ACTIVATIONS[act],
            sandwich_norms=gemma,
            query_scale=cfg.get("query_pre_attn_scalar", head_dim) ** -0.5 if gemma else 0.0,
            attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
            sliding_window=int(cfg.get("sliding_window") or 0) if SLIDING in types else 0,
            layer_types=types if SLIDING in types else (),
            local_rope=local if local != full else {},
        )


def load_tensors(paths: ModelPaths) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, named without the "model." prefix."""
    tensors: dict[str, torch.Tensor] = {}
    for file in paths.safetensors():
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name.removeprefix("model.")] = f.get_tensor(name)
    return tensors
