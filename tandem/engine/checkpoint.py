"""Reading a Llama-family HF checkpoint: its config.json (LlamaConfig) and its safetensors
weights (load_tensors). The model built from them is tandem.engine.llama.LlamaModel."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from tandem.models import ModelPaths


@dataclass(frozen=True)
class LlamaConfig:
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

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}"
            )
        if self.rope_scaling.get("rope_type", "default") not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope scaling {self.rope_scaling}")

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        """Parse a HF config.json dict (transformers 4.x and 5.x rope layouts)."""
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("model_type") == "qwen2" or cfg.get("attention_bias", False),
            rope_scaling=rope,
        )


def load_tensors(paths: ModelPaths) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, named without the "model." prefix."""
    tensors: dict[str, torch.Tensor] = {}
    for file in paths.safetensors():
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name.removeprefix("model.")] = f.get_tensor(name)
    return tensors
