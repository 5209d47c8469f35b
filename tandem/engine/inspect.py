"""`tandem models inspect DIR`: whether Tandem can serve a checkpoint, and if not, the first
thing it cannot compute exactly, before any weight is loaded (only config.json and the
safetensors headers are read)."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from tandem.engine.checkpoint import LlamaConfig
from tandem.models import ModelError, ModelPaths

# Tensors a checkpoint may carry that the forward does not need (recomputed, or unused).
IGNORABLE = ("rotary_emb.inv_freq",)


def expected_tensors(cfg: LlamaConfig) -> set[str]:
    """The tensor names (without "model.") the forward reads for this config."""
    names = {"embed_tokens.weight", "norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight", *(f"self_attn.{p}_proj.weight" for p in "qkv")]
    if cfg.qkv_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if cfg.o_bias:
        per_layer.append("self_attn.o_proj.bias")
    if cfg.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if cfg.sandwich_norms:
        per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    return names | {f"layers.{i}.{n}" for i in range(cfg.num_layers) for n in per_layer}


def inspect(root: Path) -> tuple[bool, list[str]]:
    """(servable, report lines) for the checkpoint directory `root`."""
    paths = ModelPaths(Path(root))
    try:
        hf = json.loads(paths.config.read_text())
        cfg = LlamaConfig.from_hf(hf)
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as exc:
        reason = f"missing config field {exc}" if isinstance(exc, KeyError) else str(exc)
        return False, [f"{root}: cannot be served: {reason}"]
    lines = [f"{root}: model_type {cfg.model_type}, {cfg.num_layers} layers, hidden "
             f"{cfg.hidden_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads of "
             f"{cfg.head_dim}, vocab {cfg.vocab_size}, context {cfg.max_position_embeddings}",
             "features: " + ", ".join(_features(cfg))]
    files = paths.safetensors()
    if not files:
        return False, [*lines, "cannot be served: no *.safetensors weights"]
    found: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            found |= {name.removeprefix("model.") for name in f.keys()}  # noqa: SIM118
    want = expected_tensors(cfg)
    missing = sorted(want - found)
    unknown = sorted(n for n in found - want if not n.endswith(IGNORABLE)
                     and not (cfg.tie_word_embeddings and n == "lm_head.weight"))
    if missing:
        return False, [*lines, f"cannot be served: {len(missing)} tensors missing, e.g. "
                       + ", ".join(missing[:5])]
    if unknown:
        return False, [*lines, f"cannot be served: {len(unknown)} tensors Tandem does not "
                       "know what to do with, e.g. " + ", ".join(unknown[:5])]
    return True, [*lines, "servable: yes"]


def _features(cfg: LlamaConfig) -> list[str]:
    rope = cfg.rope_scaling.get("rope_type", "default")
    out = [f"rope {rope} (theta {cfg.rope_theta:g})",
           "tied head" if cfg.tie_word_embeddings else "untied head"]
    if cfg.sliding_window:
        n = sum(t == "sliding_attention" for t in cfg.layer_types)
        out.append(f"sliding window {cfg.sliding_window} on {n} of {cfg.num_layers} layers")
    flags = {"qkv biases": cfg.qkv_bias, "o_proj bias": cfg.o_bias, "q/k norms": cfg.qk_norm,
             "(1 + w) norms": bool(cfg.norm_offset), "pre/post norms": cfg.sandwich_norms,
             f"{cfg.activation} MLP": True, "attention softcap": bool(cfg.attn_softcap),
             "logit softcap": bool(cfg.final_softcap), "local rope": bool(cfg.local_rope)}
    return out + [name for name, on in flags.items() if on]


def check(root: Path) -> None:
    """Raise ModelError with inspect's reason when the checkpoint cannot be served."""
    ok, lines = inspect(root)
    if not ok:
        raise ModelError(lines[-1])
