"""The EAGLE-3 head (Li et al. 2025) as a trainable module, its training-time test, batches and
losses, and its export in the speculators format (airgap_speculators.py) that tandem.engine
serves (and vLLM reads). Torch, safetensors and the standard library only: the
air-gapped script (airgap_train.py --method eagle3) trains it, and tandem's trainer
(tools/distill/eagle3_head.py) subclasses it, so both train the same module.

Entry t reads token t and a hidden-wide vector for position t - 1: `fc` of the target's fused
feature there (three residual streams, [3 x hidden]) at the first draft step, the head's own
output of entry t - 1 at every later one (no fc), as tandem.engine.eagle3.Eagle3Head serves
it. `forward` runs the training-time test: step j of entry t is the j-th draft token after a
commit at t - j, so its query attends to the first step's keys up to t - j (true features)
and to one key of each later step on the diagonal (the drafts between), as the served chain's
KV cache holds them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

try:  # imported as tools.distill.airgap_head3 (tandem's side, tests)
    from .airgap_speculators import speculators_config, write_eagle3
except ImportError:  # run from the bundle: its sibling files
    from airgap_speculators import speculators_config, write_eagle3

EAGLE3_CARD = "tandem_eagle3.json"  # not tandem_eagle.json: that name marks Tandem's EAGLE-1
_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:  # [B, heads, T, d] -> row t holds t-by
    return x if by == 0 else torch.cat([x.new_zeros(x[:, :, :by].shape), x[:, :, :-by]], 2)


class Head3(nn.Module):
    def __init__(self, geo: dict, vocab: list[int], embed: torch.Tensor, lm_rows: torch.Tensor,
                 inv_freq: torch.Tensor, layer_ids: tuple[int, int, int]):
        """geo: the target's widths (tools/distill/airgap.py's _geometry); vocab: the draft
        rows' target ids; embed [target_vocab, h] frozen (the target's); lm_rows [V_d, h] the
        draft LM head's start (the target's rows of `vocab`), trained."""
        super().__init__()
        h, hd, nh, nkv = geo["hidden"], geo["head_dim"], geo["heads"], geo["kv_heads"]
        self.geo, self.vocab, self.layer_ids = geo, list(vocab), tuple(layer_ids)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.input_norm, self.hidden_norm = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        self.post_norm, self.norm = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        self.q = nn.Linear(2 * h, nh * hd, bias=False)
        self.k, self.v = (nn.Linear(2 * h, nkv * hd, bias=False) for _ in range(2))
        self.o = nn.Linear(nh * hd, h, bias=False)
        self.gate, self.up = (nn.Linear(h, geo["intermediate"], bias=False) for _ in range(2))
        self.down = nn.Linear(geo["intermediate"], h, bias=False)
        self.lm_head = nn.Linear(h, len(vocab), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_rows)
        self.register_buffer("embed", embed.float().clone())  # [V, h] frozen
        self.register_buffer("inv_freq", inv_freq.float().clone())

    @property
    def draft_ids(self) -> list[int]:  # each draft row's target id
        return self.vocab

    def layer_params(self):  # (module, name in the target's / head's decoder layer)
        return tuple(zip((self.q, self.k, self.v, self.o, self.gate, self.up, self.down), _LAYER))

    def init_from_target(self, tensors: dict[str, torch.Tensor], layer: int) -> None:
        """Start from the target's layer `layer`: q/k/v read the sum of the normed embedding
        and hidden halves; fc passes the highest of the three streams through."""
        p, h = f"layers.{layer}.", self.geo["hidden"]
        with torch.no_grad():
            for mod, name in self.layer_params():
                w = tensors[p + name + ".weight"].float()
                mod.weight.copy_(torch.cat([w, w], 1) * 0.5 if mod in (self.q, self.k, self.v)
                                 else w)
            self.input_norm.copy_(tensors[p + "input_layernorm.weight"])
            self.hidden_norm.copy_(tensors[p + "input_layernorm.weight"])
            self.post_norm.copy_(tensors[p + "post_attention_layernorm.weight"])
            self.norm.copy_(tensors["norm.weight"])
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * h:].copy_(torch.eye(h))

    def _rms(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, self.geo["eps"])

    def _rope(self, x, pos):  # x [B, heads, T, hd], pos [T]
        f = pos.float()[:, None] * self.inv_freq[None]
        cos, sin = torch.cat([f.cos(), f.cos()], -1), torch.cat([f.sin(), f.sin()], -1)
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def _qkv(self, x, pos):  # x [B, T, 2h] -> q, k, v [B, heads, T, hd]
        b, t, _ = x.shape
        hd, nh, nkv = self.geo["head_dim"], self.geo["heads"], self.geo["kv_heads"]
        q = self.q(x).view(b, t, nh, hd).transpose(1, 2)
        k = self.k(x).view(b, t, nkv, hd).transpose(1, 2)
        v = self.v(x).view(b, t, nkv, hd).transpose(1, 2)
        rep = nh // nkv
        return (self._rope(q, pos), self._rope(k, pos).repeat_interleave(rep, 1),
                v.repeat_interleave(rep, 1))

    def _attend(self, q, ks, vs, j: int):
        """Step j's attention (j = 0: plain causal over the first step's keys)."""
        if j == 0:
            return F.scaled_dot_product_attention(q, ks[0], vs[0], is_causal=True)
        t, scale = q.shape[2], self.geo["head_dim"] ** -0.5
        s0 = (q @ ks[0].transpose(-1, -2)) * scale  # [B, heads, T, T]
        keep = torch.ones(t, t, dtype=torch.bool, device=q.device).tril(-j)
        s0 = s0.masked_fill(~keep, float("-inf"))
        diag = [(q * _shift(ks[i], j - i)).sum(-1, keepdim=True) * scale for i in range(1, j + 1)]
        p = torch.cat([s0, *diag], -1).softmax(-1)
        out = p[..., :t] @ vs[0]
        for i in range(1, j + 1):
            out = out + p[..., t + i - 1:t + i] * _shift(vs[i], j - i)
        return out

    def forward(self, ids, feats, pos, steps: int) -> list[torch.Tensor]:
        """ids [B, T] (token t), feats [B, T, 3h] (fused feature t-1), pos [T] -> each draft
        step's outputs [B, T, h] (entry t's; logits through `logits`)."""
        b, t = ids.shape
        emb = self._rms(self.embed[ids], self.input_norm)
        hidden = self.fc(feats)
        ks, vs, outs = [], [], []
        for j in range(steps):
            q, k, v = self._qkv(torch.cat([emb, self._rms(hidden, self.hidden_norm)], -1), pos)
            ks.append(k)
            vs.append(v)
            attn = self._attend(q, ks, vs, j)
            x = hidden + self.o(attn.transpose(1, 2).reshape(b, t, -1))
            x = x + self.down(F.silu(self.gate(y := self._rms(x, self.post_norm))) * self.up(y))
            outs.append(x)
            # entry t reads entry t-1's output at the next step
            hidden = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
        return outs

    def logits(self, out):  # [..., h] -> [..., V_d]
        return self.lm_head(self._rms(out, self.norm))

    def named(self) -> dict[str, torch.Tensor]:
        """The layout's tensor names of this module's weights (lm_head rows in vocab order)."""
        p = "midlayer."
        return {"fc.weight": self.fc.weight, "norm.weight": self.norm,
                "lm_head.weight": self.lm_head.weight, p + "hidden_norm.weight": self.hidden_norm,
                p + "input_layernorm.weight": self.input_norm,
                p + "post_attention_layernorm.weight": self.post_norm,
                **{p + n + ".weight": m.weight for m, n in self.layer_params()}}

    def export(self, out: Path, target_hf_cfg: dict, card: dict) -> None:
        """Write the head in the speculators format (fp16, no embedding: the target lends its
        own; tools/distill/airgap_speculators.py) with d2t / t2d and Tandem's card beside."""
        ids = torch.tensor(self.draft_ids)
        order = torch.argsort(ids)  # d2t is an offset table: rows sorted by target id
        names = {**self.named(), "lm_head.weight": self.lm_head.weight[order]}
        tensors = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in names.items()}
        sorted_ids = ids[order]
        tensors["d2t"] = (sorted_ids - torch.arange(len(ids))).long()
        t2d = torch.zeros(self.geo["vocab_size"], dtype=torch.bool)
        t2d[sorted_ids] = True
        tensors["t2d"] = t2d
        target = card.get("target") if isinstance(card.get("target"), dict) else {}
        verifier = {"name_or_path": target.get("name") or target_hf_cfg.get("_name_or_path"),
                    "architectures": target_hf_cfg.get("architectures") or []}
        # Tandem's ids (the output of layer i) in vLLM's reading (the stream entering i + 1)
        config = speculators_config(target_hf_cfg, len(ids), [i + 1 for i in self.layer_ids],
                                    verifier)
        write_eagle3(out, config, tensors)
        (out / EAGLE3_CARD).write_text(json.dumps(card, indent=2))


# ---- training: batches, the training-time test's losses, the start from the target ----------
def teacher_rows(seqs: list, draft_ids: list[int], vocab_size: int, n: int) -> tuple:
    """Per row (entry t = 1..T-1 of each airgap_head.Seq, n rows): its token t [B, n], which
    rows have a teacher [B, n], and the teacher's top-K as draft rows and probabilities
    [B, n, K] (0 for tokens outside the draft vocabulary). Both air-gapped heads' batches."""
    b, k = len(seqs), seqs[0].topk_ids.shape[1]
    ids, cls_mask = torch.zeros(b, n, dtype=torch.int64), torch.zeros(b, n)
    t_rows, t_probs = torch.zeros(b, n, k, dtype=torch.int64), torch.zeros(b, n, k)
    imap = torch.zeros(vocab_size, dtype=torch.int64)  # target id -> draft row (0 outside)
    imap[torch.tensor(draft_ids)] = torch.arange(len(draft_ids))
    kept = torch.zeros(vocab_size, dtype=torch.bool)
    kept[draft_ids] = True
    for i, s in enumerate(seqs):
        m = len(s.features) - 1
        ids[i, :m] = s.ids[1:m + 1]
        first = max(s.gen_start - 1, 1)  # entry t predicts token t+1: generated from P-1 on
        j0, rows = first + 1 - s.gen_start, slice(first - 1, m)
        g = s.topk_ids[j0:j0 + m - first + 1]
        t_rows[i, rows] = imap[g]
        t_probs[i, rows] = s.topk_lp[j0:j0 + m - first + 1].float().exp() * kept[g]
        cls_mask[i, rows] = 1
    return ids, cls_mask, t_rows, t_probs


def collate3(seqs: list, head: Head3, device) -> tuple:
    """Entries t = 1..T-1 of each sequence (features [T, 3h]), right-padded: token t [B, n],
    fused feature t-1 [B, n, 3h] and teacher_rows' rows."""
    n = max(len(s.features) - 1 for s in seqs)
    feats = torch.zeros(len(seqs), n, seqs[0].features.shape[1])
    for i, s in enumerate(seqs):
        feats[i, :len(s.features) - 1] = s.features[:-1].float()
    ids, cls_mask, t_rows, t_probs = teacher_rows(seqs, head.draft_ids, head.geo["vocab_size"], n)
    return tuple(x.to(device) for x in (ids, feats, cls_mask, t_rows, t_probs))


def ttt_terms(head: Head3, batch: tuple, steps: int) -> list[tuple]:
    """Per draft step j: the mean cross-entropy against the teacher's top-K over its rows,
    the top-1 hits and the rows (step j's entry t needs a commit at t - j + 1 >= 1)."""
    ids, feats, cls_mask, t_rows, t_probs = batch
    outs = head(ids, feats, torch.arange(ids.shape[1], device=ids.device), steps)
    terms = []
    for j, o in enumerate(outs, 1):
        mask = cls_mask.clone()
        mask[:, :j - 1] = 0
        logp = head.logits(o).float().log_softmax(-1)  # [B, T, V_d]
        ce = -(logp.gather(-1, t_rows) * t_probs).sum(-1)
        hit = (logp.argmax(-1) == t_rows[..., 0]) & (t_probs[..., 0] > 0)
        terms.append(((ce * mask).sum() / mask.sum().clamp(min=1), (hit.float() * mask).sum(),
                      mask.sum()))
    return terms


def step_losses3(head: Head3, batch: tuple, steps: int, decay: float):
    """The loss (step j's cross-entropy weighted decay ** (j - 1)) and per step the top-1
    hits `hitj` over `nj` rows."""
    terms = ttt_terms(head, batch, steps)
    got = {}
    for j, (_, hit, n) in enumerate(terms, 1):
        got[f"hit{j}"], got[f"n{j}"] = hit.item(), n.item()
    return sum(decay ** j * ce for j, (ce, _, _) in enumerate(terms)), got


def make_head3(t: dict, spec: dict, vocab: list[int], seed: int) -> Head3:
    """A head over the streams of spec's eagle3_layer_ids, started from the target's last
    layer (`t`: its tensors without the `model.` prefix), its LM head from the target's rows
    of the draft vocabulary."""
    geo = spec["geometry"]
    embed = t["embed_tokens.weight"].float()
    rows = embed if geo["tie"] else t["lm_head.weight"].float()
    torch.manual_seed(seed)
    head = Head3(geo, vocab, embed, rows[torch.tensor(vocab)], torch.tensor(spec["inv_freq"]),
                 tuple(spec["eagle3_layer_ids"]))
    head.init_from_target(t, geo["layers"] - 1)
    return head
