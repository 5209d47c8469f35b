"""Medusa heads in their published layouts (read by tandem.engine.medusa_published, served by
tandem.engine.medusa.load_published): FasterDecoding's `medusa_lm_head.pt`, rtp-llm's
`medusa_head.*` and vLLM's `blocks.*`/`lm_heads.*` load to the same heads, whose logits are an
independent plain-torch forward of the layout; with every head's LM head equal to the target's
they propose what Tandem's own format proposes for the same block weights; anything else is
refused by name."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tandem.engine.medusa import MedusaConfig, MedusaHeads, load_published
from tandem.engine.medusa_published import is_published_medusa
from tandem.models import ModelError

pytestmark = pytest.mark.unit
HEADS, LAYERS, H, V = 3, 1, 16, 50


def _weights(shared_lm=None):
    g = torch.Generator().manual_seed(0)
    blocks = {(h, 0): (torch.randn(H, H, generator=g) * 0.3, torch.randn(H, generator=g) * 0.1)
              for h in range(HEADS)}
    lm = [shared_lm if shared_lm is not None else torch.randn(V, H, generator=g)
          for _ in range(HEADS)]
    return blocks, lm


def _save(root, layout, blocks, lm):
    root.mkdir()
    if layout == "vllm":
        t = {f"blocks.{h}.layers.{la}.{k}": w for (h, la), (wt, b) in blocks.items()
             for k, w in (("weight", wt), ("bias", b))}
        t |= {f"lm_heads.{h}.weight": w for h, w in enumerate(lm)}
        (root / "config.json").write_text(json.dumps({"num_heads": HEADS,
                                                      "num_hidden_layers": LAYERS}))
        save_file(t, root / "model.safetensors")
        return
    pre = "medusa_head." if layout == "rtp-llm" else ""
    t = {f"{pre}{h}.{la}.linear.{k}": w for (h, la), (wt, b) in blocks.items()
         for k, w in (("weight", wt), ("bias", b))}
    t |= {f"{pre}{h}.{LAYERS}.weight": w for h, w in enumerate(lm)}
    (root / "config.json").write_text(json.dumps({"medusa_num_heads": HEADS,
                                                  "medusa_num_layers": LAYERS}))
    if layout == "fasterdecoding":
        torch.save(t, root / "medusa_lm_head.pt")
    else:
        save_file(t, root / "medusa_lm_head.safetensors")


@pytest.mark.parametrize("layout", ["fasterdecoding", "rtp-llm", "vllm"])
def test_each_layout_loads_to_heads_that_compute_its_forward(tmp_path, layout):
    blocks, lm = _weights()
    _save(tmp_path / "heads", layout, blocks, lm)
    assert is_published_medusa(tmp_path / "heads")
    heads = load_published(tmp_path / "heads", H, V)
    h = torch.randn(4, H, generator=torch.Generator().manual_seed(1))
    got = heads(h)  # [heads, 4, V]
    for i in range(HEADS):
        w, b = blocks[(i, 0)]
        want = (h + F.silu(F.linear(h, w, b))) @ lm[i].T
        assert torch.allclose(got[i], want, atol=1e-5), (layout, i)
    drafts, parents = heads.propose(h[0], nodes=6)
    assert len(drafts) == 6 and parents[0] == -1


def test_with_the_targets_lm_head_they_propose_what_tandems_format_proposes(tmp_path):
    target_lm = torch.randn(V, H, generator=torch.Generator().manual_seed(2))
    blocks, lm = _weights(shared_lm=target_lm)
    _save(tmp_path / "heads", "fasterdecoding", blocks, lm)
    published = load_published(tmp_path / "heads", H, V)
    own = MedusaHeads(MedusaConfig(HEADS, LAYERS, H, tuple(range(V)), published.cfg.choices),
                      target_lm)
    with torch.no_grad():
        own.weight.copy_(torch.stack([blocks[(h, 0)][0][None] for h in range(HEADS)]))
        own.bias.copy_(torch.stack([blocks[(h, 0)][1][None] for h in range(HEADS)]))
    h = torch.randn(5, H, generator=torch.Generator().manual_seed(3))
    for row in h:
        assert published.propose(row, nodes=12) == own.propose(row, nodes=12)


def test_missing_unexpected_and_misfit_tensors_are_named(tmp_path):
    blocks, lm = _weights()
    _save(tmp_path / "short", "fasterdecoding", {k: v for k, v in blocks.items() if k[0]}, lm)
    with pytest.raises(ModelError, match="missing head 0 layer 0"):
        load_published(tmp_path / "short", H, V)
    _save(tmp_path / "odd", "rtp-llm", blocks, lm)
    extra = load_file(tmp_path / "odd" / "medusa_lm_head.safetensors")
    extra["medusa_head.0.0.norm.weight"] = torch.ones(H)
    save_file(extra, tmp_path / "odd" / "medusa_lm_head.safetensors")
    with pytest.raises(ModelError, match="unexpected medusa_head.0.0.norm.weight"):
        load_published(tmp_path / "odd", H, V)
    _save(tmp_path / "wide", "vllm", blocks, lm)
    with pytest.raises(ModelError, match="LM heads are"):
        load_published(tmp_path / "wide", H, V + 1)
