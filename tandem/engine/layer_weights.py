"""The weights of one decoder layer as the forward reads them (tandem.engine.llama)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.quant import Int8Weight
from tandem.engine.scale_cache import ScaleCache


@dataclass
class LayerWeights:
    input_norm: torch.Tensor | None  # [hidden]; None: the published EAGLE-1/2 head's layer
    # The four projections are float tensors, or Int8Weight under --dtype int8
    # (Int8Bf16Weight under int8-bf16).
    qkv: torch.Tensor | Int8Weight  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim]
    o: torch.Tensor | Int8Weight  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor | Int8Weight  # [2 * intermediate, hidden]
    down: torch.Tensor | Int8Weight  # [hidden, intermediate]
    o_bias: torch.Tensor | None = None  # [hidden]
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [head_dim]
    pre_ff_norm: torch.Tensor | None = None  # [hidden] (Gemma: around the MLP)
    post_ff_norm: torch.Tensor | None = None  # [hidden]

    PROJECTIONS = ("qkv", "o", "gate_up", "down")

    def quantize_int8(self, cache: ScaleCache | None = None,
                      quantize=Int8Weight.quantize) -> None:
        """quantize: Int8Weight's, or tandem.engine.quant_bf16.quantize for int8-bf16."""
        for name in self.PROJECTIONS:
            setattr(self, name, quantize(getattr(self, name), cache))


def named_projections(layers: list[LayerWeights], lm_head) -> list[tuple[str, object]]:
    """Every weight a forward multiplies by, by its checkpoint name: the LM head and each
    layer's projections (float tensors, or their int8 forms)."""
    return [("lm_head", lm_head)] + [(f"layers.{i}.{name}", getattr(layer, name))
                                     for i, layer in enumerate(layers)
                                     for name in LayerWeights.PROJECTIONS]
