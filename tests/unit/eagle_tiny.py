"""A tiny random EAGLE head in Tandem's format, for unit tests (no model weights)."""
from __future__ import annotations

from pathlib import Path

import torch

from tandem.engine.draft_vocab import DraftVocab
from tandem.engine.llama import LlamaConfig
from tools.distill.eagle_head import EagleTrainHead

HF = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
      "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
      "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
      "tie_word_embeddings": True}


def tiny_head(path: Path, seed: int) -> Path:
    """Export a head over every other token id of a 300-token vocabulary, weights jittered."""
    torch.manual_seed(seed)
    vocab = DraftVocab(tuple(range(0, 300, 2)), 300, 0)
    head = EagleTrainHead(LlamaConfig.from_hf(HF), vocab, torch.randn(150, 64), 256)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    head.export(path, HF, {"format": "tandem-eagle/1"})
    return path
