"""EAGLE-1/2 heads in their published layout (tandem.engine.eagle_published): loaded from
safetensors or pytorch_model.bin over the target's embeddings and LM head, and drafting the
same logits as an independent plain-torch forward of that layout; anything else is refused by
name."""
import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from kernels.paged_attention import build_attention_metadata
from tandem.engine.eagle_published import is_published_eagle, load_published
from tandem.models import ModelError, ModelPaths

pytestmark = pytest.mark.unit
H, HEADS, KV, HD, VOCAB, INTER = 32, 4, 2, 8, 97, 64


def _target(path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER,
                                   num_hidden_layers=1, num_attention_heads=HEADS,
                                   num_key_value_heads=KV, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return ModelPaths(path)


def _head(path, fmt="safetensors", extra=None):
    gen = torch.Generator().manual_seed(1)

    def r(*shape, std=0.1):
        return torch.randn(*shape, generator=gen) * std

    w = {"fc.weight": r(H, 2 * H), "fc.bias": r(H),
         "layers.0.self_attn.q_proj.weight": r(HEADS * HD, H),
         "layers.0.self_attn.k_proj.weight": r(KV * HD, H),
         "layers.0.self_attn.v_proj.weight": r(KV * HD, H),
         "layers.0.self_attn.o_proj.weight": r(H, HEADS * HD),
         "layers.0.mlp.gate_proj.weight": r(INTER, H), "layers.0.mlp.up_proj.weight": r(INTER, H),
         "layers.0.mlp.down_proj.weight": r(H, INTER),
         "layers.0.post_attention_layernorm.weight": 1 + r(H), **(extra or {})}
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": H, "intermediate_size": INTER,
        "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "vocab_size": VOCAB, "max_position_embeddings": 128, "rms_norm_eps": 1e-6}))
    if fmt == "bin":
        torch.save(w, path / "pytorch_model.bin")
    else:
        save_file(w, path / "model.safetensors")
    return w


def _reference(w, embed, lm_head, ids, feats):
    """The published layout, written out: fc over [embed; feature] with its bias, one Llama
    layer without an input norm, no output norm, the target's LM head."""
    n = len(ids)
    x = F.linear(torch.cat([embed[ids], feats], -1), w["fc.weight"], w["fc.bias"])
    p = "layers.0."
    q = F.linear(x, w[p + "self_attn.q_proj.weight"]).view(n, HEADS, HD)
    k = F.linear(x, w[p + "self_attn.k_proj.weight"]).view(n, KV, HD)
    v = F.linear(x, w[p + "self_attn.v_proj.weight"]).view(n, KV, HD)
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv).float()
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rope(t):
        return t * cos + torch.cat([-t[..., HD // 2:], t[..., :HD // 2]], -1) * sin

    q, k = rope(q).transpose(0, 1), rope(k).transpose(0, 1).repeat_interleave(HEADS // KV, 0)
    v = v.transpose(0, 1).repeat_interleave(HEADS // KV, 0)
    att = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    h = x + F.linear(att.transpose(0, 1).reshape(n, H), w[p + "self_attn.o_proj.weight"])
    y = F.rms_norm(h, (H,), w[p + "post_attention_layernorm.weight"], 1e-6)
    mlp = F.linear(F.silu(F.linear(y, w[p + "mlp.gate_proj.weight"])) *
                   F.linear(y, w[p + "mlp.up_proj.weight"]), w[p + "mlp.down_proj.weight"])
    return (h + mlp) @ lm_head.T


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_published_head_drafts_as_its_layout_says(tmp_path, fmt):
    target = _target(tmp_path / "target")
    w = _head(tmp_path / "head", fmt)
    assert is_published_eagle(tmp_path / "head")
    head = load_published(tmp_path / "head", target)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target.root))
    embed, lm_head = hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach()
    n = 9
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(2))
    feats = torch.randn(n, H, generator=torch.Generator().manual_seed(3))
    meta = build_attention_metadata([n], [n], [[0, 1, 2]], 4)
    cache = [(torch.zeros(3, 4, KV, HD), torch.zeros(3, 4, KV, HD))]
    logits, _ = head.forward(ids, feats, torch.arange(n), meta, cache, torch.arange(n))
    want = _reference(w, embed, lm_head, ids, feats)
    assert (logits - want).abs().max().item() < 1e-4
    assert head.cfg.vocab_size == VOCAB and head.card["format"].startswith("eagle-1/2")


def test_unknown_or_missing_tensors_are_named(tmp_path):
    target = _target(tmp_path / "target")
    _head(tmp_path / "odd", extra={"layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4),
                                   "midlayer.hidden_norm.weight": torch.ones(H)})
    with pytest.raises(ModelError, match="unexpected midlayer.hidden_norm.weight"):
        load_published(tmp_path / "odd", target)
    w = _head(tmp_path / "short")
    del w["layers.0.mlp.up_proj.weight"]
    save_file(w, tmp_path / "short" / "model.safetensors")
    with pytest.raises(ModelError, match="missing layers.0.mlp.up_proj.weight"):
        load_published(tmp_path / "short", target)


def test_the_draft_worker_needs_the_target_for_a_published_head(tmp_path):
    from tandem.proposers.eagle import EagleProposer

    target = _target(tmp_path / "target")
    _head(tmp_path / "head")
    with pytest.raises(ModelError, match="--tokenizer TARGET_DIR"):
        EagleProposer.load(ModelPaths(tmp_path / "head"), 1 << 20)
    proposer = EagleProposer.load(ModelPaths(tmp_path / "head"), 1 << 20, target=target)
    assert proposer.vocab_size == VOCAB
