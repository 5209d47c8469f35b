"""A draft checkpoint's truncated vocabulary (draft_vocab.json next to its weights)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.models import ModelError

DRAFT_VOCAB_FILE = "draft_vocab.json"


@dataclass(frozen=True)
class DraftVocab:
    """A draft checkpoint's truncated vocabulary: draft row i is target token target_ids[i].

    The draft's embedding and head hold only the kept rows (small and fast); to the rest of the
    system the model still speaks target ids: inputs outside the kept set embed as row
    `unk_index`, and logits of tokens outside it are -inf (the draft gives them probability 0,
    so verification stays lossless). In transformers the checkpoint is a plain Llama whose
    vocab_size is len(target_ids) and whose ids are draft rows.
    """

    target_ids: tuple[int, ...]
    target_vocab_size: int
    unk_index: int = 0

    def __post_init__(self):
        ids = self.target_ids
        if not ids or len(set(ids)) != len(ids):
            raise ModelError("draft vocabulary must be non-empty and without duplicates")
        if min(ids) < 0 or max(ids) >= self.target_vocab_size:
            raise ModelError(f"draft vocabulary ids must be in [0, {self.target_vocab_size})")
        if not 0 <= self.unk_index < len(ids):
            raise ModelError(f"unk_index {self.unk_index} outside the draft vocabulary")

    @classmethod
    def read(cls, root: Path) -> DraftVocab | None:
        path = Path(root) / DRAFT_VOCAB_FILE
        if not path.is_file():
            return None
        try:
            d = json.loads(path.read_text())
            return cls(tuple(d["target_ids"]), int(d["target_vocab_size"]),
                       int(d.get("unk_index", 0)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelError(f"cannot read {path}: {exc}") from exc

    def write(self, root: Path) -> None:
        (Path(root) / DRAFT_VOCAB_FILE).write_text(json.dumps(
            {"target_vocab_size": self.target_vocab_size, "unk_index": self.unk_index,
             "target_ids": list(self.target_ids)}))

    def input_map(self) -> torch.Tensor:  # [target_vocab_size] int64: target id -> draft row
        m = torch.full((self.target_vocab_size,), self.unk_index, dtype=torch.int64)
        m[torch.tensor(self.target_ids)] = torch.arange(len(self.target_ids))
        return m
