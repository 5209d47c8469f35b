"""Resuming Medusa/EAGLE training loads the checkpoint weights-only (issue 47): a file with
a pickled payload is refused before anything in it runs; a real checkpoint still resumes."""
from __future__ import annotations

import os

import pytest
import torch

from tandem.engine.checkpoint import LlamaConfig
from tandem.engine.draft_vocab import DraftVocab
from tandem.engine.medusa import MedusaConfig, MedusaHeads
from tools.distill import eagle, medusa
from tools.distill.config import EagleTrainConfig, MedusaTrainConfig
from tools.distill.eagle import FeatureSeq
from tools.distill.eagle_head import EagleTrainHead
from tools.distill.train import UnsafeCheckpoint

pytestmark = pytest.mark.unit
V, H = 40, 16


class _Payload:
    """Unpickling this creates `marker`: what a hostile checkpoint would do instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _seqs(n: int = 6) -> list[FeatureSeq]:
    g, out = torch.Generator().manual_seed(1), []
    for i in range(n):
        ids = torch.randint(0, V, (10 + i,), generator=g)
        topk = torch.stack([ids[4:], (ids[4:] + 3) % V], 1)
        logp = torch.log(torch.tensor([0.7, 0.3])).expand(len(ids) - 4, 2).half()
        out.append(FeatureSeq(ids, torch.randn(len(ids) - 1, H, generator=g).half(), 4,
                              topk, logp))
    return out


def _medusa():
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(1, 1, H, tuple(range(V)), ((0,),)), torch.randn(V, H))
    data = medusa.flatten(_seqs(), 1, 2, torch.arange(V), torch.ones(V, dtype=torch.bool))
    return heads, data


def _eagle_head():
    cfg = LlamaConfig.from_hf({
        "model_type": "llama", "vocab_size": V, "hidden_size": H, "intermediate_size": 24,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64,
        "tie_word_embeddings": True})
    torch.manual_seed(0)
    return EagleTrainHead(cfg, DraftVocab(tuple(range(V)), V, 0), torch.randn(V, H), 64)


def _hostile(tmp_path):
    ckpt, marker = tmp_path / "state.pt", tmp_path / "pwned"
    torch.save({"model": {}, "opt": {}, "step": 0, "wall": 0.0, "vocab": [],
                "x": _Payload(marker)}, ckpt)
    return ckpt, marker


def test_medusa_refuses_a_pickled_payload(tmp_path):
    heads, data = _medusa()
    ckpt, marker = _hostile(tmp_path)
    tc = MedusaTrainConfig(num_heads=1, vocab=V, epochs=1, batch_positions=16, warmup=1,
                           time_budget_min=0)
    with pytest.raises(UnsafeCheckpoint, match="refused"):
        medusa.train(heads, data, data, tc, ckpt, resume=True, log=lambda m: 0)
    assert not marker.exists()


def test_eagle_refuses_a_pickled_payload(tmp_path):
    ckpt, marker = _hostile(tmp_path)
    tc = EagleTrainConfig(vocab=V, time_budget_min=0, epochs=1, batch_tokens=64, warmup=1)
    with pytest.raises(UnsafeCheckpoint, match="refused"):
        eagle.train(_eagle_head(), _seqs(), [], tc, ckpt, True, log=lambda m: 0)
    assert not marker.exists()


def test_real_checkpoints_still_resume(tmp_path):
    heads, data = _medusa()
    tc = MedusaTrainConfig(num_heads=1, vocab=V, epochs=1, batch_positions=16, warmup=1,
                           time_budget_min=0)
    first = medusa.train(heads, data, data, tc, tmp_path / "m.pt", False, log=lambda m: 0)
    logs: list[str] = []
    tc2 = MedusaTrainConfig(**{**tc.__dict__, "epochs": 2})
    again = medusa.train(heads, data, data, tc2, tmp_path / "m.pt", True, log=logs.append)
    assert again["steps"] > first["steps"] and "resumed at step" in logs[0]
    etc = EagleTrainConfig(vocab=V, time_budget_min=0, epochs=1, batch_tokens=64, warmup=1)
    first = eagle.train(_eagle_head(), _seqs(), [], etc, tmp_path / "e.pt", False,
                        log=lambda m: 0)
    logs.clear()
    etc2 = EagleTrainConfig(**{**etc.__dict__, "epochs": 2})
    again = eagle.train(_eagle_head(), _seqs(), [], etc2, tmp_path / "e.pt", True,
                        log=logs.append)
    assert again["steps"] > first["steps"] and "resumed at step" in logs[0]
