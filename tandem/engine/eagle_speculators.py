"""EAGLE heads in the speculators format (vllm-project/speculators, the format vLLM loads
as `--speculative-config '{"method": "eagle3", "model": DIR}'`), read and written.

config.json (speculators' `SpeculatorModelConfig`, read as vLLM's
`transformers_utils/configs/speculators` does):
- `speculators_model_type`: "eagle3" (served by tandem.engine.eagle3.Eagle3Head) or "eagle"
  (EAGLE-1/2 and HASS, speculators <= 0.2; served by the published EAGLE-1/2 path);
- `transformer_layer_config`: the decoder layer's HF config (speculators writes the diff
  against its class's defaults: filled in here from transformers; no `model_type`: Qwen3);
- `speculators_config`: `algorithm`, `proposal_methods` ([{"proposal_type": "greedy",
  "speculative_tokens": k, ...}]), `default_proposal_method`, `verifier` ({"name_or_path",
  "architectures"});
- eagle3: `draft_vocab_size`, `norm_before_residual` (vLLM's default when absent: true),
  `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (vLLM's reading: id i is the
  stream *entering* target layer i, HF hidden_states[i]; Tandem's ids are one less),
  `norm_before_fc`, `fc_norm`, `norm_output` (variants refused by name);
- eagle: `layernorms` (refused when true), `fusion_bias`.

Tensors (safetensors): eagle3 `fc.weight`, `layers.0.{input_layernorm, hidden_norm,
post_attention_layernorm}.weight`, `layers.0.self_attn.{q,k,v,o}_proj.weight` (q/k/v over
2 x hidden), `layers.0.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight`
[draft_vocab, hidden], `embed_tokens.weight`, and `d2t`/`t2d` unless the draft vocabulary is
the target's; `verifier_norm`/`verifier_lm_head` (training-time copies) are ignored. eagle:
`fusion_fc.{weight,bias}` over [embedding ; feature] and `transformer.*` (the layer, no input
norm); the target's embedding and LM head.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tandem.models import ModelError, ModelPaths

TYPES = ("eagle3", "eagle")
_IGNORED = ("verifier_norm.weight", "verifier_lm_head.weight")
_VARIANTS = ("norm_before_fc", "fc_norm", "norm_output")  # eagle3 options not served
# An EAGLE-1 head's tensor name prefixes: (speculators', the published cnets layout's).
EAGLE1_PREFIXES = (("fusion_fc.", "fc."), ("transformer.", "layers.0."))


def renamed(weights: dict, pairs) -> dict:
    """`weights` with each name's first matching prefix `a` of (a, b) in `pairs` made `b`;
    EAGLE1_PREFIXES reads a speculators EAGLE-1 head, its pairs reversed write one."""
    out = {}
    for name, t in weights.items():
        for a, b in pairs:
            if name.startswith(a):
                name = b + name.removeprefix(a)
                break
        out[name] = t
    return out


def speculators_type(root: Path) -> str | None:
    """The `speculators_model_type` of the head directory at root (None: another format)."""
    try:
        kind = json.loads((Path(root) / "config.json").read_text()).get("speculators_model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) and kind else None


def tandem_layer_ids(ids) -> tuple[int, ...]:
    """vLLM's / speculators' layer ids (the stream entering layer i) in Tandem's reading (the
    output of layer i - 1)."""
    ids = tuple(int(i) for i in ids)
    if any(i < 1 for i in ids):
        raise ModelError(f"eagle_aux_hidden_state_layer_ids {list(ids)}: id 0 (the target's "
                         "embedding) is not served")
    return tuple(i - 1 for i in ids)


def speculative_tokens(config: dict) -> int | None:
    """k of the config's default proposal method (vLLM's num_speculative_tokens default)."""
    spec = config.get("speculators_config") or {}
    for method in spec.get("proposal_methods") or ():
        if method.get("proposal_type") == spec.get("default_proposal_method"):
            k = method.get("speculative_tokens")
            return None if k is None else int(k)
    return None


def layer_config(root: Path, config: dict) -> dict:
    """The decoder layer's full HF config: transformer_layer_config over its class's
    defaults (speculators saves only the fields that differ)."""
    layer = dict(config.get("transformer_layer_config") or {})
    if not layer:
        raise ModelError(f"{root}: a speculators config needs transformer_layer_config")
    from transformers import AutoConfig

    kind = layer.pop("model_type", None) or "qwen3"  # speculators' default class
    try:
        full = AutoConfig.for_model(kind, **layer).to_dict()
    except (ValueError, KeyError) as exc:
        raise ModelError(f"{root}: transformer_layer_config model_type {kind!r}: {exc}") from None
    return {**full, "model_type": kind}


def _check_variants(root: Path, config: dict, layer: dict) -> None:
    kind = config["speculators_model_type"]
    if kind not in TYPES:
        raise ModelError(f"{root}: speculators_model_type {kind!r} is not served (only "
                         f"{', '.join(TYPES)})")
    bad = [f"{n} = true" for n in _VARIANTS if kind == "eagle3" and config.get(n)]
    th = config.get("target_hidden_size")
    if th not in (None, layer["hidden_size"]):
        bad.append(f"target_hidden_size = {th} (the layer's is {layer['hidden_size']})")
    if kind == "eagle" and config.get("layernorms"):
        bad.append("layernorms = true")
    if bad:
        raise ModelError(f"{root}: speculators {kind} variant not supported: {'; '.join(bad)}")


def _read(root: Path) -> dict[str, torch.Tensor]:
    from tandem.engine.eagle_published import _read_weights

    return {n: t for n, t in _read_weights(root).items() if n not in _IGNORED}


def load_speculators(root: Path, target: ModelPaths | None, dtype=torch.float32,
                     device="cpu"):
    """The speculators-format head at root: an Eagle3Head or (eagle) an EagleHead."""
    root = Path(root)
    config = json.loads((root / "config.json").read_text())
    layer = layer_config(root, config)
    _check_variants(root, config, layer)
    if config["speculators_model_type"] == "eagle":
        return _load_eagle1(root, config, layer, target, dtype, device)
    from tandem.engine.eagle3_published import build_eagle3

    weights = {("midlayer." + n.removeprefix("layers.0.") if n.startswith("layers.0.") else n): t
               for n, t in _read(root).items()}
    vocab = int(layer["vocab_size"])
    if "d2t" not in weights and int(config.get("draft_vocab_size") or vocab) == vocab:
        weights["d2t"] = torch.zeros(vocab, dtype=torch.long)  # the draft vocab is the target's
        weights["t2d"] = torch.ones(vocab, dtype=torch.bool)
    flat = {**layer, "draft_vocab_size": config.get("draft_vocab_size"),
            "norm_before_residual": config.get("norm_before_residual", True)}
    head = build_eagle3(root, flat, weights, target, dtype, device)
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    head.layer_ids = tandem_layer_ids(ids) if ids else None
    head.card = {"format": "eagle-3 (speculators)", "source": str(root),
                 "layer_ids": list(head.layer_ids) if head.layer_ids else "default",
                 "draft_vocab": len(head.model.vocab_map),
                 "speculative_tokens": speculative_tokens(config)}
    return head


def _load_eagle1(root: Path, config: dict, layer: dict, target: ModelPaths | None, dtype,
                 device):
    from tandem.engine.eagle_published import build_published

    if target is None:
        raise ModelError(f"{root} is a speculators EAGLE-1 head: it drafts with the target's "
                         "LM head, so pass the target checkpoint (--tokenizer TARGET_DIR)")
    weights = renamed(_read(root), EAGLE1_PREFIXES)
    head = build_published(root, {**layer, "num_hidden_layers": 1}, weights, target, dtype,
                           device)
    head.card = {"format": "eagle-1/2 (speculators)", "source": str(root),
                 "target": str(target.root), "speculative_tokens": speculative_tokens(config)}
    return head
