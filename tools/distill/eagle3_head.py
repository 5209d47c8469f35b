"""The EAGLE-3 head `tandem distill --method eagle3` trains: the air-gapped script's module
(tools/distill/airgap_head3.py: the training-time test and the published layout's export),
built from tandem's config and draft vocabulary, and read back from an exported head.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tandem.engine.checkpoint import LlamaConfig
from tandem.engine.draft_vocab import DraftVocab
from tandem.engine.rope import rope_inv_freq
from tandem.models import ModelPaths
from tools.distill.airgap import geometry
from tools.distill.airgap_head3 import EAGLE3_CARD, Head3

__all__ = ["EAGLE3_CARD", "Eagle3TrainHead"]


class Eagle3TrainHead(Head3):
    """Head3 built from tandem's LlamaConfig and DraftVocab (`vocab`)."""

    def __init__(self, cfg: LlamaConfig, vocab: DraftVocab, embed: torch.Tensor,
                 lm_rows: torch.Tensor, layer_ids: tuple[int, int, int]):
        """embed [target_vocab, h] frozen (the target's); lm_rows [V_d, h] the draft LM
        head's start (the target's rows of the draft vocabulary), trained."""
        super().__init__(geometry(cfg), list(vocab.target_ids), embed, lm_rows,
                         rope_inv_freq(cfg), layer_ids)
        self.cfg, self.vocab = cfg, vocab

    @property
    def draft_ids(self) -> list[int]:  # a resumed run replaces self.vocab
        return list(self.vocab.target_ids)

    @classmethod
    def from_export(cls, root: Path, target: ModelPaths) -> Eagle3TrainHead:
        """The module back from an exported head (fp16 weights, as served; the target's
        embedding), so that the trainer's validation can score a written head."""
        from tandem.engine.checkpoint import load_tensors
        from tandem.engine.eagle3_published import layer_ids_of
        from tandem.engine.eagle_speculators import layer_config

        root = Path(root)
        config = json.loads((root / "config.json").read_text())
        layer = layer_config(root, config) if config.get("speculators_model_type") else config
        cfg = LlamaConfig.from_hf({**layer, "tie_word_embeddings": False})
        t = {("midlayer." + n.removeprefix("layers.0.") if n.startswith("layers.0.") else n): w
             for n, w in load_tensors(ModelPaths(root)).items()}
        ids = (torch.arange(len(t["d2t"])) + t["d2t"]).tolist()
        vocab = DraftVocab(tuple(ids), cfg.vocab_size, 0)
        embed = load_tensors(target)["embed_tokens.weight"]
        head = cls(cfg, vocab, embed, t["lm_head.weight"].float(),
                   layer_ids_of(config))
        with torch.no_grad():
            for name, p in head.named().items():
                p.copy_(t[name].float())
        return head.eval()
