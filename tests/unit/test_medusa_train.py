"""Medusa training without the real model: the flattened labels line up with offsets 1 + i,
a few steps lower the loss on a learnable synthetic task, and the export loads back."""
import pytest
import torch

from tandem.engine.medusa import MedusaConfig, MedusaHeads, tree_from_accuracy
from tools.distill.config import MedusaTrainConfig
from tools.distill.eagle import FeatureSeq
from tools.distill.medusa import evaluate, flatten, train

pytestmark = pytest.mark.unit
V, H = 40, 16


def _seq(gen: int, seed: int) -> FeatureSeq:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (3 + gen,), generator=g)
    feats = torch.randn(len(ids) - 1, H, generator=g).half()
    # The teacher for ids[gen_start + j]: its own id first, with most of the mass.
    topk = torch.stack([ids[3:], (ids[3:] + 1) % V], 1)
    logp = torch.log(torch.tensor([0.9, 0.1])).expand(gen, 2).half()
    return FeatureSeq(ids, feats, 3, topk, logp)


def test_flatten_aligns_head_i_with_token_t_plus_1_plus_i():
    s = _seq(6, 0)
    m = torch.arange(V)
    d = flatten([s], 2, 2, m, torch.ones(V, dtype=torch.bool))
    assert len(d.features) == len(s.features) - (s.gen_start - 1)
    t = s.gen_start - 1  # first row: the feature at the last prompt position
    assert d.best[0].tolist() == [int(s.ids[t + 2]), int(s.ids[t + 3])]
    assert d.probs[-1, 0].sum() == 0  # no token two past the end


def test_training_lowers_the_loss_and_exports(tmp_path):
    torch.manual_seed(0)
    # A learnable task: the next-next token is a fixed function of the feature.
    proj = torch.randn(H, V)
    seqs = []
    for k in range(24):
        s = _seq(12, k)
        target = (s.features.float() @ proj).argmax(-1)  # token t + 2 from feature t
        ids = s.ids.clone()
        ids[2:] = target[:len(ids) - 2]
        topk = torch.stack([ids[3:], (ids[3:] + 1) % V], 1)
        seqs.append(FeatureSeq(ids, s.features, 3, topk, s.topk_logprobs))
    data = flatten(seqs, 1, 2, torch.arange(V), torch.ones(V, dtype=torch.bool))
    cfg = MedusaConfig(1, 1, H, tuple(range(V)), ((0,),))
    heads = MedusaHeads(cfg, torch.randn(V, H))
    before = evaluate(heads, data)["ce"]
    tc = MedusaTrainConfig(num_heads=1, vocab=V, epochs=30, batch_positions=64, lr=1e-2,
                           warmup=5, time_budget_min=0)
    stats = train(heads, data, data, tc, tmp_path / "state.pt", resume=False, log=lambda m: 0)
    assert stats["ce"] < before and len(stats["accuracy"][0]) == 10
    assert (tmp_path / "state.pt").exists()
    choices = tree_from_accuracy(stats["accuracy"], 3)
    heads.cfg = MedusaConfig(1, 1, H, cfg.vocab_ids, choices, tuple(map(tuple, stats["accuracy"])))
    heads.save(tmp_path / "out")
    loaded = MedusaHeads.load(tmp_path / "out", heads.lm_rows)
    h = torch.randn(H)
    assert loaded.propose(h) == heads.propose(h) and loaded.cfg.choices == choices
