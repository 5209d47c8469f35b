"""EAGLE-3 heads as they are published (SafeAILab EAGLE / SpecForge's layout, which vLLM and
SGLang load), served by tandem.engine.eagle3.Eagle3Head.

The directory holds a LlamaForCausalLMEagle3-style config.json (hidden_size,
num_attention_heads, num_key_value_heads, head_dim optional, intermediate_size, rms_norm_eps,
rope_theta, rope_scaling, draft_vocab_size, vocab_size; optionally
`eagle_aux_hidden_state_layer_ids`, read as tandem.engine.eagle3 says: id i is the output of
target layer i) and these tensors, as safetensors or `pytorch_model.bin`:

- `fc.weight` [hidden, 3 x hidden] (`fc.bias` optional): the target's three-layer features;
- `midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight`,
  `midlayer.self_attn.{q,k,v}_proj.weight` (input 2 x hidden), `midlayer.self_attn.o_proj`,
  `midlayer.mlp.{gate,up,down}_proj.weight`;
- `norm.weight`, `lm_head.weight` [draft_vocab, hidden];
- `d2t` int64 [draft_vocab] (target id = i + d2t[i]) and `t2d` bool [target_vocab];
- `embed_tokens.weight` if shipped, else the target's (`--tokenizer TARGET_DIR`).

A tensor that is neither expected nor known to be ignorable, or a missing one, is an error
that names it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tandem.engine.checkpoint import LlamaConfig, load_tensors
from tandem.engine.eagle import EAGLE_CARD
from tandem.engine.eagle3 import Eagle3Head
from tandem.engine.eagle_published import _read_weights
from tandem.models import ModelError, ModelPaths, read_hf_config

_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
_LAYER = (*(f"{n}.weight" for n in _NORMS),
          *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
          *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")))
_EXPECTED = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
             *(f"midlayer.{n}" for n in _LAYER))
_OPTIONAL = ("fc.bias", "embed_tokens.weight")
_IGNORABLE = ("rotary_emb.inv_freq",)


def layer_ids_of(config: dict) -> tuple[int, ...] | None:
    """The target layer ids a head's config names (top level or under eagle_config), in
    Tandem's reading (id i: the output of layer i). A speculators-format config names them
    in vLLM's (id i: the stream entering layer i), one more: converted here."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    if config.get("speculators_model_type"):
        from tandem.engine.eagle_speculators import tandem_layer_ids

        return tandem_layer_ids(ids)
    return tuple(int(i) for i in ids)


def is_eagle3(root: Path) -> bool:
    """A head directory in the published EAGLE-3 layout: its config says so (an Eagle3
    architecture, a draft vocabulary, layer ids) or its tensors have a `midlayer`."""
    root = Path(root)
    if (root / EAGLE_CARD).is_file():  # Tandem's own format
        return False
    try:
        cfg = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if "speculators_model_type" in cfg:
        return cfg["speculators_model_type"] == "eagle3"
    if any("eagle3" in a.lower() for a in cfg.get("architectures") or ()) or (
            "draft_vocab_size" in cfg or layer_ids_of(cfg) is not None):
        return True
    if not any(root.glob("*.safetensors")) and not (root / "pytorch_model.bin").is_file():
        return False
    return any(n.startswith("midlayer.") for n in _read_weights(root))


def _check_names(root: Path, weights: dict[str, torch.Tensor], qk_norm: bool = False) -> None:
    expected = set(_EXPECTED) | ({f"midlayer.self_attn.{n}_norm.weight" for n in "qk"}
                                 if qk_norm else set())  # a Qwen3 layer's
    missing = sorted(expected - set(weights))
    unknown = sorted(n for n in set(weights) - expected - set(_OPTIONAL)
                     if not n.endswith(_IGNORABLE))
    if missing or unknown:
        raise ModelError(f"{root} is not an EAGLE-3 head: " + "; ".join(
            [f"missing {', '.join(missing)}"] * bool(missing) +
            [f"unexpected {', '.join(unknown)}"] * bool(unknown)))


def draft_map(d2t: torch.Tensor, t2d: torch.Tensor, vocab: int) -> torch.Tensor:
    """The target id of each draft row (i + d2t[i]), checked against t2d: [draft_vocab]."""
    if d2t.dim() != 1 or d2t.dtype.is_floating_point or t2d.shape != (vocab,):
        raise ModelError(f"d2t must be integer [draft_vocab] and t2d [{vocab}] (the target's "
                         f"vocabulary), got {tuple(d2t.shape)} {d2t.dtype} and "
                         f"{tuple(t2d.shape)}")
    ids = torch.arange(len(d2t)) + d2t.long()
    if ids.min() < 0 or ids.max() >= vocab or len(ids.unique()) != len(ids):
        raise ModelError(f"d2t maps draft rows outside [0, {vocab}) or twice onto one token")
    t2d = t2d.bool()
    if not t2d[ids].all() or int(t2d.sum()) != len(ids):
        raise ModelError("t2d does not mark exactly the target ids d2t maps to")
    return d2t.long()


def load_eagle3(root: Path, target: ModelPaths | None = None, dtype=torch.float32,
                device="cpu") -> Eagle3Head:
    """The published EAGLE-3 head at `root` (or one in the speculators format: tandem.engine.
    eagle_speculators); `target` lends its embedding when the head ships none (and is
    checked against the head's widths)."""
    root = Path(root)
    config = json.loads((root / "config.json").read_text())
    if config.get("speculators_model_type"):
        from tandem.engine.eagle_speculators import load_speculators

        return load_speculators(root, target, dtype, device)
    th = config.get("target_hidden_size")
    if th not in (None, config.get("hidden_size")):  # a variant not served
        raise ModelError(f"{root}: EAGLE-3 config field target_hidden_size = {th!r} is not "
                         "supported")
    head = build_eagle3(root, config, _read_weights(root), target, dtype, device)
    head.layer_ids = layer_ids_of(config)
    head.card = {"format": "eagle-3 (published)", "source": str(root),
                 "layer_ids": list(head.layer_ids) if head.layer_ids else "default",
                 "draft_vocab": len(head.model.vocab_map)}
    return head


def build_eagle3(root: Path, config: dict, weights: dict[str, torch.Tensor],
                 target: ModelPaths | None, dtype=torch.float32, device="cpu") -> Eagle3Head:
    """An Eagle3Head of `config` (a flat HF-style dict: the layer's widths, draft_vocab_size,
    norm_before_residual) over `weights` in the published names (`midlayer.*`, d2t, t2d)."""
    cfg = LlamaConfig.from_hf({**config, "tie_word_embeddings": False})
    if cfg.num_layers != 1:
        raise ModelError(f"{root}: an EAGLE-3 head has one decoder layer, its config says "
                         f"{cfg.num_layers}")
    _check_names(root, weights, cfg.qk_norm)
    lm_rows = weights["lm_head.weight"].shape[0]
    if config.get("draft_vocab_size", lm_rows) != lm_rows or len(weights["d2t"]) != lm_rows:
        raise ModelError(f"{root}: lm_head.weight has {lm_rows} rows, d2t "
                         f"{len(weights['d2t'])}, draft_vocab_size "
                         f"{config.get('draft_vocab_size')}")
    d2t = draft_map(weights["d2t"], weights["t2d"], cfg.vocab_size)
    embed = _embedding(root, cfg, weights.get("embed_tokens.weight"), target)
    named = {("layers.0." + n.removeprefix("midlayer.")
              if n.startswith("midlayer.") and "hidden_norm" not in n else n): t
             for n, t in weights.items() if n not in ("d2t", "t2d")}
    named["hidden_norm.weight"] = named.pop("midlayer.hidden_norm.weight")
    head = Eagle3Head(cfg, {**named, "embed_tokens.weight": embed}, d2t, dtype, device)
    head.norm_before_residual = bool(config.get("norm_before_residual"))
    head.model.tune_kernels()
    return head


def _embedding(root: Path, cfg: LlamaConfig, embed: torch.Tensor | None,
               target: ModelPaths | None) -> torch.Tensor:
    """The head's shipped embedding, else the target's (checked against the head's widths)."""
    if target is not None:
        tcfg = LlamaConfig.from_hf(read_hf_config(target))
        if (tcfg.hidden_size, tcfg.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
            raise ModelError(f"{root}: the head's hidden size and vocabulary "
                             f"{(cfg.hidden_size, cfg.vocab_size)} are not the target's "
                             f"{(tcfg.hidden_size, tcfg.vocab_size)}")
        if embed is None:
            embed = load_tensors(target)["embed_tokens.weight"]
    if embed is None:
        raise ModelError(f"{root} is an EAGLE-3 head without embed_tokens.weight: it embeds "
                         "with the target's, so pass the target checkpoint "
                         "(--tokenizer TARGET_DIR)")
    return embed
