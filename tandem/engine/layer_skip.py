"""Self-speculative layer skip (LayerSkip / Draft & Verify): the draft is the target itself
with some decoder layers left out. No extra weights: `skip_view` shares every tensor with the
target; only the draft's KV cache (for the kept layers) is its own.

Which layers to skip is found per model by `tandem search-skip` (tools.skip_search) and saved
next to the checkpoint as `layer_skip.json`; sets for the shipped models travel with the
package (tandem/engine/skip_sets/<checkpoint name>.json).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace
from pathlib import Path

from tandem.engine.llama import LlamaModel
from tandem.models import ModelError, ModelPaths

SKIP_FILE = "layer_skip.json"
SHIPPED_DIR = Path(__file__).resolve().parent / "skip_sets"


@dataclass(frozen=True)
class SkipSet:
    """Layers (0-based) the draft leaves out of a `num_layers`-layer target."""

    num_layers: int
    skip: tuple[int, ...]

    def __post_init__(self):
        if not isinstance(self.num_layers, int) or self.num_layers < 2:
            raise ValueError(f"num_layers must be an int >= 2, got {self.num_layers!r}")
        skip = tuple(self.skip)
        if any(not isinstance(i, int) or not 0 <= i < self.num_layers for i in skip):
            raise ValueError(f"skipped layers must be ints in [0, {self.num_layers}), got {skip}")
        if len(set(skip)) != len(skip):
            raise ValueError(f"skipped layers repeat: {skip}")
        if len(skip) >= self.num_layers:
            raise ValueError("a draft must keep at least one layer")
        object.__setattr__(self, "skip", tuple(sorted(skip)))

    @property
    def kept(self) -> list[int]:
        return [i for i in range(self.num_layers) if i not in self.skip]

    def to_json(self, **extra) -> str:
        return json.dumps({"num_layers": self.num_layers, "skip": list(self.skip), **extra},
                          indent=2) + "\n"

    @classmethod
    def read(cls, path: Path) -> SkipSet:
        try:
            data = json.loads(Path(path).read_text())
            return cls(int(data["num_layers"]), tuple(data["skip"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelError(f"cannot read a layer-skip set from {path}: {exc}") from exc


def find_skip_set(paths: ModelPaths) -> Path | None:
    """The set saved with the checkpoint, else the one shipped for it, else None."""
    for candidate in (paths.root / SKIP_FILE, SHIPPED_DIR / f"{paths.root.name}.json"):
        if candidate.is_file():
            return candidate
    return None


def resolve_skip_set(choice: str, paths: ModelPaths) -> SkipSet | None:
    """`choice` is "auto" (the set found with the model, None without one), "off" (None) or a
    file path."""
    if choice == "off":
        return None
    path = find_skip_set(paths) if choice == "auto" else Path(choice)
    return None if path is None else SkipSet.read(path)


def skip_view(model: LlamaModel, skip: SkipSet) -> LlamaModel:
    """The target without the skipped layers, sharing every weight tensor with it."""
    if skip.num_layers != model.cfg.num_layers:
        raise ModelError(f"the skip set is for a {skip.num_layers}-layer model, the target has "
                         f"{model.cfg.num_layers} layers")
    view = copy.copy(model)  # shallow: embeddings, norms, head and layers are the target's
    view.layers = [model.layers[i] for i in skip.kept]
    types = model.cfg.layer_types  # a kept layer keeps its window (Gemma's pattern)
    view.cfg = replace(model.cfg, num_layers=len(view.layers),
                       layer_types=tuple(types[i] for i in skip.kept) if types else ())
    return view
