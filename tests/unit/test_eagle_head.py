"""The trainable EAGLE head and the served one compute the same thing (tiny random weights)."""
import json

import pytest
import torch

from kernels.paged_attention import build_attention_metadata
from tandem.engine.checkpoint import LlamaConfig
from tandem.engine.draft_vocab import DraftVocab
from tandem.engine.eagle import EagleHead, is_eagle_dir
from tandem.models import ModelError, ModelPaths
from tools.distill.eagle_head import EagleTrainHead

pytestmark = pytest.mark.unit

HF = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
      "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
      "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
      "tie_word_embeddings": True}


def _trained(tmp_path):
    cfg = LlamaConfig.from_hf(HF)
    torch.manual_seed(0)
    vocab = DraftVocab(tuple(range(0, 300, 3)), 300, 0)
    head = EagleTrainHead(cfg, vocab, torch.randn(100, 64) * 0.5, 128)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    head.export(tmp_path, HF, {"format": "tandem-eagle/1"})
    return head, EagleHead.load(ModelPaths(tmp_path))


def _serve(served, ids, feats, start, kv, table):
    n = len(ids)
    meta = build_attention_metadata([n], [start + n], [table], 16)
    logits, pred = served.forward(torch.tensor(ids), feats, torch.arange(start, start + n),
                                  meta, kv, torch.arange(n))
    return logits, pred


def test_served_head_matches_the_trained_module(tmp_path):
    head, served = _trained(tmp_path)
    assert is_eagle_dir(tmp_path)
    head = head.half().float()  # the export is fp16
    head.embed = head.embed.half().float()
    t = 20
    ids = torch.randint(0, 300, (1, t))
    feats = torch.randn(1, t, 64)
    pos = torch.arange(t)  # entry t at position t - 1
    with torch.no_grad():
        want, kv1 = head(ids, feats, pos)
        feats2 = torch.cat([feats[:, :1], want[:, :-1]], 1)
        want2 = head.forward2(ids, feats2, pos, kv1)
    kv = [(torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16))]
    # All entries at once with true features, in two chunks (paged KV carries the context).
    logits, got = _serve(served, ids[0, :12].tolist(), feats[0, :12], 0, kv, [0, 1])
    _, got_b = _serve(served, ids[0, 12:].tolist(), feats[0, 12:], 12, kv, [0, 1])
    torch.testing.assert_close(torch.cat([got, got_b]), want[0], atol=2e-3, rtol=2e-3)
    # Logits live on the kept rows only; everything else is -inf (probability 0).
    kept = torch.tensor(range(0, 300, 3))
    assert torch.isinf(logits[:, 1]).all() and torch.isfinite(logits[:, kept]).all()
    torch.testing.assert_close(logits[:, kept], head.logits(want[0, :12]), atol=2e-3, rtol=2e-3)
    # Step 2: entry 10 reads the head's own prediction of feature 9 over true context.
    kv2 = [(torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16))]
    _serve(served, ids[0, :9].tolist(), feats[0, :9], 0, kv2, [0])
    _, p2 = _serve(served, ids[0, 9:10].tolist(), want[0, 8:9], 9, kv2, [0])
    torch.testing.assert_close(p2[0], want2[0, 9], atol=2e-3, rtol=2e-3)


def test_a_head_without_fc_is_refused(tmp_path):
    _trained(tmp_path)
    from safetensors.torch import load_file, save_file
    t = load_file(str(tmp_path / "model.safetensors"))
    del t["model.fc.weight"]
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelError, match="fc.weight"):
        EagleHead.load(ModelPaths(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1


def test_a_smaller_draft_vocabulary_keeps_the_leading_rows_only(tmp_path):
    """draft_vocab=N drafts from the vocabulary's first N rows: same logits there, -inf (q = 0,
    still lossless) for the rest; inputs outside them still embed as before."""
    _, full = _trained(tmp_path)
    small = EagleHead.load(ModelPaths(tmp_path), draft_vocab=40)
    ids, feats = [3, 150, 297, 6], torch.randn(4, 64)  # 150 and 297: kept rows 50 and 99
    kv = lambda: [(torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16))]  # noqa: E731
    want, want_pred = _serve(full, ids, feats, 0, kv(), [0])
    got, got_pred = _serve(small, ids, feats, 0, kv(), [0])
    torch.testing.assert_close(got_pred, want_pred)
    lead = torch.tensor(range(0, 120, 3))  # target ids of the first 40 rows
    torch.testing.assert_close(got[:, lead], want[:, lead])
    rest = torch.ones(300, dtype=torch.bool)
    rest[lead] = False
    assert torch.isinf(got[:, rest]).all() and torch.isfinite(want[:, 150]).all()
    with pytest.raises(ModelError, match="draft_vocab"):
        EagleHead.load(ModelPaths(tmp_path), draft_vocab=-1)
