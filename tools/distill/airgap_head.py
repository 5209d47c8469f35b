"""The EAGLE head an air-gapped run trains (airgap_train.py; airgap_fit.py trains it): the
layout tools/distill/eagle_head.py exports and tandem.engine.eagle serves, its vocabulary and
its start from the target's last layer, and the training data's sequences. Without tandem:
torch, safetensors and the standard library only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

try:  # imported as tools.distill.airgap_head (tandem's side, tests)
    from .airgap_head3 import Head3, make_head3
except ImportError:  # run from the bundle, beside airgap_train.py
    from airgap_head3 import Head3, make_head3

if TYPE_CHECKING:
    from airgap_train import Config

HEAD_CARD = "tandem_eagle.json"  # tandem.engine.eagle.EAGLE_CARD
TOP_K = 32  # the teacher's log-probs kept per answer position


@dataclass(frozen=True)
class Seq:
    ids: torch.Tensor  # [T + 1] prompt + answer
    features: torch.Tensor  # [T, h] fp16, positions 0..T-1
    gen_start: int
    topk_ids: torch.Tensor  # [G, K] teacher of ids[gen_start + j]
    topk_lp: torch.Tensor  # [G, K]
    val: bool


def load_seqs(data: Path) -> list[Seq]:
    from safetensors.torch import load_file

    out = []
    for path in sorted(data.glob("shard-*.safetensors")):
        t = load_file(str(path))
        off, at, g = t["offsets"].tolist(), 0, 0
        for i in range(len(off) - 1):
            ids, p = t["ids"][off[i]:off[i + 1]].long(), int(t["gen_start"][i])
            n, na = len(ids) - 1, len(ids) - p
            out.append(Seq(ids, t["features"][at:at + n], p, t["topk_ids"][g:g + na].long(),
                           t["topk_lp"][g:g + na], bool(t["val"][i])))
            at, g = at + n, g + na
    return out


# ---- the head (tools/distill/eagle_head.py's EagleTrainHead, without tandem) ---------------
class Head(nn.Module):
    """Entry t reads [feature t-1 ; embedding of token t] and predicts feature t; `forward2`
    is the second draft step (its input feature is the head's own prediction)."""

    def __init__(self, geo: dict, embed_rows: torch.Tensor, vocab: list[int],
                 inv_freq: torch.Tensor):
        super().__init__()
        h, hd, nh, nkv = geo["hidden"], geo["head_dim"], geo["heads"], geo["kv_heads"]
        self.geo, self.vocab = geo, list(vocab)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.input_norm, self.post_norm, self.norm = (nn.Parameter(torch.ones(h))
                                                      for _ in range(3))
        self.q, self.o = nn.Linear(h, nh * hd, bias=False), nn.Linear(nh * hd, h, bias=False)
        self.k, self.v = (nn.Linear(h, nkv * hd, bias=False) for _ in range(2))
        self.gate, self.up = (nn.Linear(h, geo["intermediate"], bias=False) for _ in range(2))
        self.down = nn.Linear(geo["intermediate"], h, bias=False)
        self.register_buffer("embed", embed_rows.float().clone())  # frozen target rows
        imap = torch.zeros(geo["vocab_size"], dtype=torch.int64)  # target id -> row (unk 0)
        imap[torch.tensor(self.vocab)] = torch.arange(len(self.vocab))
        self.register_buffer("input_map", imap)
        self.register_buffer("inv_freq", inv_freq.float())

    def layer_params(self):  # (module or parameter, name in the target's / head's layer)
        return ((self.q, "self_attn.q_proj"), (self.k, "self_attn.k_proj"),
                (self.v, "self_attn.v_proj"), (self.o, "self_attn.o_proj"),
                (self.gate, "mlp.gate_proj"), (self.up, "mlp.up_proj"),
                (self.down, "mlp.down_proj"))

    def init_from_target(self, t: dict, layer: int) -> None:
        p = f"layers.{layer}."
        with torch.no_grad():
            for mod, name in self.layer_params():
                mod.weight.copy_(t[p + name + ".weight"])
            self.input_norm.copy_(t[p + "input_layernorm.weight"])
            self.post_norm.copy_(t[p + "post_attention_layernorm.weight"])
            self.norm.copy_(t["norm.weight"])
            eye = torch.eye(self.geo["hidden"])
            self.fc.weight.copy_(torch.cat([eye, eye], 1))

    def _rms(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, self.geo["eps"])

    def _rope(self, x, pos):
        f = pos.float()[:, None] * self.inv_freq[None]
        cos, sin = torch.cat([f.cos(), f.cos()], -1), torch.cat([f.sin(), f.sin()], -1)
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def _qkv(self, x, pos):
        b, t, _ = x.shape
        hd, nh, nkv = self.geo["head_dim"], self.geo["heads"], self.geo["kv_heads"]
        y = self._rms(x, self.input_norm)
        q = self.q(y).view(b, t, nh, hd).transpose(1, 2)
        k = self.k(y).view(b, t, nkv, hd).transpose(1, 2)
        v = self.v(y).view(b, t, nkv, hd).transpose(1, 2)
        rep = nh // nkv
        k, v = self._rope(k, pos).repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return self._rope(q, pos), k, v

    def _finish(self, x, attn):
        b, t, _ = x.shape
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, -1))
        y = self._rms(x, self.post_norm)
        x = x + self.down(F.silu(self.gate(y)) * self.up(y))
        return self._rms(x, self.norm)

    def _input(self, ids, feats):
        return self.fc(torch.cat([feats, self.embed[self.input_map[ids]]], -1))

    def forward(self, ids, feats, pos):
        x = self._input(ids, feats)
        q, k, v = self._qkv(x, pos)
        return self._finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True)), (k, v)

    def forward2(self, ids, feats, pos, kv1):
        k1, v1 = kv1
        x = self._input(ids, feats)
        q, k, v = self._qkv(x, pos)
        scale, t = self.geo["head_dim"] ** -0.5, ids.shape[1]
        s1 = (q @ k1.transpose(-1, -2)) * scale  # keys strictly before t
        before = torch.ones(t, t, dtype=torch.bool, device=q.device).tril(-1)
        s1 = s1.masked_fill(~before, float("-inf"))
        p = torch.cat([s1, (q * k).sum(-1, keepdim=True) * scale], -1).softmax(-1)
        return self._finish(x, p[..., :t] @ v1 + p[..., t:] * v)

    def export(self, out: Path, target_cfg: dict, card: dict) -> None:
        """The checkpoint tandem.engine.eagle.EagleHead loads (fp16), as EagleTrainHead's."""
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        p = "model.layers.0."
        names = {"model.fc.weight": self.fc.weight, "model.norm.weight": self.norm,
                 "model.embed_tokens.weight": self.embed,
                 p + "input_layernorm.weight": self.input_norm,
                 p + "post_attention_layernorm.weight": self.post_norm,
                 **{p + n + ".weight": m.weight for m, n in self.layer_params()}}
        save_file({k: v.detach().to("cpu", torch.float16).contiguous() for k, v in names.items()},
                  str(out / "model.safetensors"))
        cfg = {k: v for k, v in target_cfg.items() if k != "quantization_config"}
        cfg.update(num_hidden_layers=1, vocab_size=len(self.vocab), tie_word_embeddings=True,
                   architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float16")
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        (out / "draft_vocab.json").write_text(json.dumps(
            {"target_vocab_size": self.geo["vocab_size"], "unk_index": 0,
             "target_ids": self.vocab}))
        (out / HEAD_CARD).write_text(json.dumps(card, indent=2))


# ---- the head's vocabulary and its start from the target --------------------------------
def build_vocab(seqs: list[Seq], size: int, target_vocab: int, always: list[int]) -> list[int]:
    counts = torch.zeros(target_vocab, dtype=torch.int64)
    for s in seqs:
        counts += torch.bincount(s.ids, minlength=target_vocab)
        counts += torch.bincount(s.topk_ids[:, 0], minlength=target_vocab)
    order = list(dict.fromkeys(t for t in always if 0 <= t < target_vocab))
    seen = set(order)
    order += [t for t in torch.argsort(-counts, stable=True).tolist() if t not in seen]
    return order[:min(size, target_vocab)]


def make_head(target: Path, spec: dict, train_seqs: list[Seq], cfg: Config,
              vocab: list[int] | None) -> Head | Head3:
    """cfg.method's head, its vocabulary `vocab` (a resumed run's) or the commonest tokens
    of the training data, started from the target's last layer."""
    from safetensors.torch import load_file

    t = {}
    for f in sorted(target.glob("*.safetensors")):
        t.update({k.removeprefix("model."): v for k, v in load_file(str(f)).items()})
    geo = spec["geometry"]
    vocab = vocab or build_vocab(train_seqs, cfg.vocab, geo["vocab_size"], spec["special_ids"])
    if cfg.method == "eagle3":
        return make_head3(t, spec, vocab, cfg.seed)
    rows = t["embed_tokens.weight" if geo["tie"] else "lm_head.weight"].float()
    torch.manual_seed(cfg.seed)
    head = Head(geo, rows[torch.tensor(vocab)], vocab, torch.tensor(spec["inv_freq"]))
    head.init_from_target(t, geo["layers"] - 1)
    return head
