"""EAGLE-1/2 heads as they are published (SafeAILab/EAGLE's `cnets.py` layout, which SGLang
and vLLM load too), served by Tandem's EagleHead.

The published layout differs from Tandem's own (`tandem_eagle.json`, tandem.engine.eagle):
- `fc` is Linear(2 x hidden -> hidden) *with a bias*, over [embedding of token t ; feature of
  position t - 1] (Tandem's own: feature first, no bias);
- `layers.0` has no `input_layernorm` (the fused input goes straight into attention);
- there is no output norm: the layer's output is the predicted feature, fed to the target's LM
  head as it is (the target's features are its final normed hidden states, as in Tandem);
- no LM head and usually no embedding: the target's are used. So a published head needs the
  target checkpoint (`tandem draft --eagle DIR --tokenizer TARGET_DIR`).

Weights come as safetensors or as the original `pytorch_model.bin`; a tensor that is neither
expected nor known to be ignorable is an error that names it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tandem.engine.checkpoint import LlamaConfig, load_tensors
from tandem.engine.eagle import EAGLE_CARD, EagleHead
from tandem.models import ModelError, ModelPaths, read_hf_config

_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
          "mlp.down_proj.weight", "post_attention_layernorm.weight")
_OPTIONAL = ("embed_tokens.weight", "layers.0.input_layernorm.weight")
_IGNORABLE = ("rotary_emb.inv_freq",)


def is_published_eagle(root: Path) -> bool:
    """A head directory in the published layout (not Tandem's own)."""
    root = Path(root)
    return not (root / EAGLE_CARD).is_file() and (root / "config.json").is_file() and (
        any(root.glob("*.safetensors")) or (root / "pytorch_model.bin").is_file())


def _read_weights(root: Path) -> dict[str, torch.Tensor]:
    if any(root.glob("*.safetensors")):
        return load_tensors(ModelPaths(root))
    state = torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return {name.removeprefix("model."): t for name, t in state.items()}


def load_published(root: Path, target: ModelPaths, dtype=torch.float32,
                   device="cpu") -> EagleHead:
    """The published head at `root`, over `target`'s embeddings and LM head (a head in the
    speculators format: tandem.engine.eagle_speculators)."""
    root = Path(root)
    config = json.loads((root / "config.json").read_text())
    if config.get("speculators_model_type"):
        from tandem.engine.eagle_speculators import load_speculators

        return load_speculators(root, target, dtype, device)
    head = build_published(root, config, _read_weights(root), target, dtype, device)
    head.card = {"format": "eagle-1/2 (published)", "source": str(root),
                 "target": str(target.root)}
    return head


def build_published(root: Path, config: dict, weights: dict[str, torch.Tensor],
                    target: ModelPaths, dtype=torch.float32, device="cpu") -> EagleHead:
    """An EagleHead of `config` (the layer's HF config) over `weights` in the published names
    (`fc.*` over [embedding ; feature], `layers.0.*`) and `target`'s embedding and LM head."""
    cfg = LlamaConfig.from_hf(config)
    if cfg.num_layers != 1:
        raise ModelError(f"{root}: an EAGLE-1/2 head has one decoder layer, its config says "
                         f"{cfg.num_layers}")
    expected = {"fc.weight", "fc.bias", *(f"layers.0.{n}" for n in _LAYER)}
    missing = sorted(expected - {"fc.bias"} - set(weights))
    unknown = sorted(n for n in set(weights) - expected - set(_OPTIONAL)
                     if not n.endswith(_IGNORABLE))
    if missing or unknown:
        raise ModelError(f"{root} is not an EAGLE-1/2 head: " + "; ".join(
            [f"missing {', '.join(missing)}"] * bool(missing) +
            [f"unexpected {', '.join(unknown)}"] * bool(unknown)))
    tcfg = LlamaConfig.from_hf(read_hf_config(target))
    if tcfg.hidden_size != cfg.hidden_size:
        raise ModelError(f"{root}: the head's hidden size {cfg.hidden_size} is not the "
                         f"target's {tcfg.hidden_size}")
    tw = load_tensors(target)
    hidden = cfg.hidden_size
    fc = weights["fc.weight"]
    if tuple(fc.shape) != (hidden, 2 * hidden):
        raise ModelError(f"{root}: fc.weight has shape {tuple(fc.shape)}, expected "
                         f"{(hidden, 2 * hidden)}")
    ones = torch.ones(hidden)
    merged = {**weights, "fc.weight": torch.cat([fc[:, hidden:], fc[:, :hidden]], 1),
              "embed_tokens.weight": weights.get("embed_tokens.weight",
                                                 tw["embed_tokens.weight"]),
              "lm_head.weight": tw["embed_tokens.weight"] if tcfg.tie_word_embeddings
              else tw["lm_head.weight"],
              "norm.weight": ones, "layers.0.input_layernorm.weight": ones}
    cfg = LlamaConfig(**{**cfg.__dict__, "vocab_size": tcfg.vocab_size,
                         "tie_word_embeddings": False})
    head = EagleHead(cfg, merged, None, dtype, device)
    bias = weights.get("fc.bias")
    head.fc_bias = None if bias is None else bias.to(device=head.model.device, dtype=dtype)
    head.model.layers[0].input_norm = None  # the fused input goes straight in
    head.out_norm = False  # the layer's output is the feature the LM head reads
    head.model.tune_kernels()
    return head
