"""Medusa heads in the layouts they are published in, read as tensors (PublishedHeads);
tandem.engine.medusa.load_published serves them as Tandem's MedusaHeads.

Three namings of the same Medusa-1 heads (per head: `num_layers` residual blocks
x + SiLU(W x + b), then the head's own LM head):
- FasterDecoding (`medusa_lm_head.pt` or `.safetensors`): `{h}.{l}.linear.weight|bias`, the
  LM head `{h}.{num_layers}.weight`; config.json `medusa_num_heads`, `medusa_num_layers`;
- rtp-llm (`medusa_config`): the same under `medusa_head.`;
- vLLM's converted checkpoints: `blocks.{h}.layers.{l}.weight|bias`, `lm_heads.{h}.weight`;
  config.json `num_heads`, `num_hidden_layers`.

Unlike Tandem's own heads (one frozen LM head shared by all, `medusa.json`), each published
head carries its own full-vocabulary LM head. None of these layouts ships a tree or measured
accuracies: the tree is the default one, built from a guess that halves per level and per rank
(MedusaConfig.reach), and the verifier's per-session correction does the rest.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.models import ModelError

_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors",
          "pytorch_model.bin")
_BLOCK = [re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.linear\.(weight|bias)$"),
          re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")]
_HEAD = [re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.weight$"),
         re.compile(r"^lm_heads\.(\d+)\.weight$")]


def is_published_medusa(root: Path) -> bool:
    root = Path(root)
    return not (root / "medusa.json").is_file() and any((root / f).is_file() for f in _FILES)


def _read(root: Path) -> dict[str, torch.Tensor]:
    for name in _FILES:
        f = root / name
        if f.is_file():
            if f.suffix == ".safetensors":
                from safetensors.torch import load_file

                return load_file(str(f))
            return torch.load(f, map_location="cpu", weights_only=True)
    raise ModelError(f"{root}: no Medusa weights ({', '.join(_FILES)})")


def _shape(root: Path) -> tuple[int, int]:
    cfg = json.loads((root / "config.json").read_text()) if (root / "config.json").is_file() \
        else {}
    heads = cfg.get("medusa_num_heads", cfg.get("num_heads"))
    layers = cfg.get("medusa_num_layers", cfg.get("num_hidden_layers"))
    if heads is None or layers is None:
        raise ModelError(f"{root}/config.json must give medusa_num_heads and medusa_num_layers "
                         "(or num_heads and num_hidden_layers)")
    return int(heads), int(layers)


def _sort(tensors: dict[str, torch.Tensor], heads: int, layers: int, root: Path):
    """(block weights [heads, layers, h, h], biases [heads, layers, h], LM heads by head);
    ModelError names what is missing or unexpected."""
    blocks: dict[tuple[int, int, str], torch.Tensor] = {}
    lm: dict[int, torch.Tensor] = {}
    unknown = []
    for name, t in tensors.items():
        if m := next((p.match(name) for p in _BLOCK if p.match(name)), None):
            blocks[(int(m[1]), int(m[2]), m[3])] = t
        elif (m := next((p.match(name) for p in _HEAD if p.match(name)), None)) and (
                len(m.groups()) == 1 or int(m[2]) == layers):
            lm[int(m[1])] = t
        else:
            unknown.append(name)
    want = {(h, layer, kind) for h in range(heads) for layer in range(layers)
            for kind in ("weight", "bias")}
    missing = sorted(f"head {h} layer {layer} {kind}" for h, layer, kind in want - set(blocks))
    missing += [f"head {h} LM head" for h in range(heads) if h not in lm]
    if unknown or missing or len(blocks) != len(want):
        raise ModelError(f"{root} is not a Medusa checkpoint of {heads} heads x {layers} layers: "
                         + "; ".join([f"missing {', '.join(missing[:4])}"] * bool(missing) +
                                     [f"unexpected {', '.join(sorted(unknown)[:4])}"]
                                     * bool(unknown)))
    weight = torch.stack([torch.stack([blocks[(h, la, "weight")] for la in range(layers)])
                          for h in range(heads)]) if layers else None
    bias = torch.stack([torch.stack([blocks[(h, la, "bias")] for la in range(layers)])
                        for h in range(heads)]) if layers else None
    return weight, bias, [lm[h] for h in range(heads)]


@dataclass(frozen=True)
class PublishedHeads:
    """A published checkpoint's heads as tensors (tandem.engine.medusa.load_published makes
    MedusaHeads of them): per head `layers` blocks and its own LM head [vocab, hidden]."""

    heads: int
    layers: int
    weight: torch.Tensor | None  # [heads, layers, hidden, hidden]; None without blocks
    bias: torch.Tensor | None  # [heads, layers, hidden]
    lm_heads: torch.Tensor  # [heads, vocab, hidden]


def read_published(root: Path, hidden_size: int, vocab_size: int) -> PublishedHeads:
    """The heads in any of the published layouts at `root`, checked against a target of this
    width and vocabulary."""
    root = Path(root)
    heads, layers = _shape(root)
    weight, bias, lm = _sort(_read(root), heads, layers, root)
    if any(tuple(t.shape) != (vocab_size, hidden_size) for t in lm):
        raise ModelError(f"{root}: the heads' LM heads are {tuple(lm[0].shape)}, the target "
                         f"needs ({vocab_size}, {hidden_size})")
    return PublishedHeads(heads, layers, weight, bias, torch.stack(lm))
