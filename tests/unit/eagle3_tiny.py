"""A tiny random target and a random EAGLE-3 head in the published layout (midlayer, fc over
three layers, d2t/t2d), with the layout's forward written out in plain torch from the published
math (EAGLE's cnets.py for EAGLE-3): the reference the served head is checked against."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from tandem.models import ModelPaths

H, HEADS, KV, HD, VOCAB, INTER, LAYERS, EPS = 32, 4, 2, 8, 97, 64, 6, 1e-6
DRAFT_IDS = tuple(range(0, VOCAB, 2))  # the draft vocabulary: every even target id


def tiny_target(path: Path) -> ModelPaths:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER,
                                   num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                   num_key_value_heads=KV, tie_word_embeddings=False,
                                   max_position_embeddings=256, rms_norm_eps=EPS)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return ModelPaths(path)


def head_weights(seed: int = 1, embed: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, std=0.2):
        return torch.randn(*shape, generator=gen) * std

    p = "midlayer."
    d2t = torch.tensor(DRAFT_IDS) - torch.arange(len(DRAFT_IDS))
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[list(DRAFT_IDS)] = True
    w = {"fc.weight": r(H, 3 * H), "fc.bias": r(H), "norm.weight": 1 + r(H),
         "lm_head.weight": r(len(DRAFT_IDS), H, std=1.0), "d2t": d2t, "t2d": t2d,
         p + "input_layernorm.weight": 1 + r(H), p + "hidden_norm.weight": 1 + r(H),
         p + "post_attention_layernorm.weight": 1 + r(H),
         p + "self_attn.q_proj.weight": r(HEADS * HD, 2 * H),
         p + "self_attn.k_proj.weight": r(KV * HD, 2 * H),
         p + "self_attn.v_proj.weight": r(KV * HD, 2 * H),
         p + "self_attn.o_proj.weight": r(H, HEADS * HD),
         p + "mlp.gate_proj.weight": r(INTER, H), p + "mlp.up_proj.weight": r(INTER, H),
         p + "mlp.down_proj.weight": r(H, INTER)}
    if embed:
        w["embed_tokens.weight"] = r(VOCAB, H, std=1.0)
    return w


def write_head(path: Path, w: dict[str, torch.Tensor], fmt: str = "safetensors",
               **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
        "intermediate_size": INTER, "num_hidden_layers": 1, "num_attention_heads": HEADS,
        "num_key_value_heads": KV, "vocab_size": VOCAB, "draft_vocab_size": len(w["d2t"]),
        "max_position_embeddings": 256, "rms_norm_eps": EPS, "rope_theta": 10000.0,
        **config}))
    if fmt == "bin":
        torch.save(w, path / "pytorch_model.bin")
    else:
        save_file(w, path / "model.safetensors")
    return path


def _rope(t: torch.Tensor) -> torch.Tensor:  # [n, heads, HD], positions 0..n-1
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    ang = torch.outer(torch.arange(len(t), dtype=torch.float64), inv).float()
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    return t * cos + torch.cat([-t[..., HD // 2:], t[..., :HD // 2]], -1) * sin


def reference(w, embed, ids, hidden_in):
    """The midlayer over entries (token ids [n], hidden inputs [n, H]) at positions 0..n-1,
    causal: (outputs [n, H], logits [n, VOCAB] over target ids, -inf off the draft vocab)."""
    n, p = len(ids), "midlayer."

    def lin(x, name):
        return F.linear(x, w[p + name + ".weight"])

    x = torch.cat([F.rms_norm(embed[ids], (H,), w[p + "input_layernorm.weight"], EPS),
                   F.rms_norm(hidden_in, (H,), w[p + "hidden_norm.weight"], EPS)], -1)
    q = _rope(lin(x, "self_attn.q_proj").view(n, HEADS, HD)).transpose(0, 1)
    k = _rope(lin(x, "self_attn.k_proj").view(n, KV, HD)).transpose(0, 1)
    v = lin(x, "self_attn.v_proj").view(n, KV, HD).transpose(0, 1)
    k, v = (t.repeat_interleave(HEADS // KV, 0) for t in (k, v))
    att = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    h = hidden_in + lin(att.transpose(0, 1).reshape(n, H), "self_attn.o_proj")
    y = F.rms_norm(h, (H,), w[p + "post_attention_layernorm.weight"], EPS)
    out = h + lin(F.silu(lin(y, "mlp.gate_proj")) * lin(y, "mlp.up_proj"), "mlp.down_proj")
    small = F.rms_norm(out, (H,), w["norm.weight"], EPS) @ w["lm_head.weight"].T
    logits = torch.full((n, VOCAB), float("-inf"))
    logits[:, torch.arange(len(w["d2t"])) + w["d2t"]] = small
    return out, logits


def reference_chain(w, embed, tokens, feats, steps):
    """Greedy drafts of the published head after `tokens` whose target features [len - 1,
    3H] are known: entry t reads token t and fc(feature t - 1), later entries the previous
    entry's output. Returns (drafts, logits of each draft's row)."""
    hidden = F.linear(feats, w["fc.weight"], w["fc.bias"])  # [L - 1, H]
    ids, drafts, rows = list(tokens[1:]), [], []
    for _ in range(steps):
        out, logits = reference(w, embed, torch.tensor(ids), hidden)
        drafts.append(int(logits[-1].argmax()))
        rows.append(logits[-1])
        ids.append(drafts[-1])
        hidden = torch.cat([hidden, out[-1:]])
    return drafts, rows
