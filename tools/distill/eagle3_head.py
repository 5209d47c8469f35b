"""An EAGLE-3 head as a trainable torch module, exported in the published EAGLE-3 layout that
tandem.engine.eagle3_published loads (and vLLM / SGLang read).

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
from safetensors.torch import save_file
from torch import nn

from tandem.engine.checkpoint import LlamaConfig
from tandem.engine.draft_vocab import DraftVocab
from tandem.engine.rope import rope_inv_freq
from tandem.models import ModelPaths
from tools.distill.eagle_head import EagleTrainHead, layer_tensors

EAGLE3_CARD = "tandem_eagle3.json"  # not tandem_eagle.json: that name marks Tandem's EAGLE-1


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:  # [B, heads, T, d] -> row t holds t-by
    return x if by == 0 else torch.cat([x.new_zeros(x[:, :, :by].shape), x[:, :, :-by]], 2)


class Eagle3TrainHead(nn.Module):
    def __init__(self, cfg: LlamaConfig, vocab: DraftVocab, embed: torch.Tensor,
                 lm_rows: torch.Tensor, layer_ids: tuple[int, int, int],
                 max_positions: int = 4096):
        """embed [target_vocab, h] frozen (the target's); lm_rows [V_d, h] the draft LM
        head's start (the target's rows of the draft vocabulary), trained."""
        super().__init__()
        self.cfg, self.vocab, self.layer_ids = cfg, vocab, tuple(layer_ids)
        h, hd = cfg.hidden_size, cfg.head_dim
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.input_norm, self.hidden_norm = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        self.post_norm, self.norm = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        self.q = nn.Linear(2 * h, cfg.num_heads * hd, bias=False)
        self.k = nn.Linear(2 * h, cfg.num_kv_heads * hd, bias=False)
        self.v = nn.Linear(2 * h, cfg.num_kv_heads * hd, bias=False)
        self.o = nn.Linear(cfg.num_heads * hd, h, bias=False)
        self.gate = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.lm_head = nn.Linear(h, len(vocab.target_ids), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_rows)
        self.register_buffer("embed", embed.float().clone())  # [V, h] frozen
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(cfg))
        self.register_buffer("cos", torch.cat([freqs.cos(), freqs.cos()], -1))
        self.register_buffer("sin", torch.cat([freqs.sin(), freqs.sin()], -1))

    def init_from_target(self, tensors: dict[str, torch.Tensor], layer: int) -> None:
        """Start from the target's layer `layer`: q/k/v read the sum of the normed embedding
        and hidden halves; fc passes the highest of the three streams through."""
        p, h = f"layers.{layer}.", self.cfg.hidden_size
        with torch.no_grad():
            for mod, name in ((self.q, "self_attn.q_proj"), (self.k, "self_attn.k_proj"),
                              (self.v, "self_attn.v_proj")):
                w = tensors[p + name + ".weight"].float()
                mod.weight.copy_(torch.cat([w, w], 1) * 0.5)
            for mod, name in ((self.o, "self_attn.o_proj"), (self.gate, "mlp.gate_proj"),
                              (self.up, "mlp.up_proj"), (self.down, "mlp.down_proj")):
                mod.weight.copy_(tensors[p + name + ".weight"])
            self.input_norm.copy_(tensors[p + "input_layernorm.weight"])
            self.hidden_norm.copy_(tensors[p + "input_layernorm.weight"])
            self.post_norm.copy_(tensors[p + "post_attention_layernorm.weight"])
            self.norm.copy_(tensors["norm.weight"])
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * h:].copy_(torch.eye(h))

    _rms = EagleTrainHead._rms  # the same norm and RoPE tables (cfg, cos, sin)
    _rope = EagleTrainHead._rope

    def _qkv(self, x, pos):  # x [B, T, 2h] -> q, k, v [B, heads, T, hd]
        b, t, _ = x.shape
        cfg, hd = self.cfg, self.cfg.head_dim
        q = self.q(x).view(b, t, cfg.num_heads, hd).transpose(1, 2)
        k = self.k(x).view(b, t, cfg.num_kv_heads, hd).transpose(1, 2)
        v = self.v(x).view(b, t, cfg.num_kv_heads, hd).transpose(1, 2)
        rep = cfg.num_heads // cfg.num_kv_heads
        return (self._rope(q, pos), self._rope(k, pos).repeat_interleave(rep, 1),
                v.repeat_interleave(rep, 1))

    def _attend(self, q, ks, vs, j: int):
        """Step j's attention (j = 0: plain causal over the first step's keys)."""
        if j == 0:
            return F.scaled_dot_product_attention(q, ks[0], vs[0], is_causal=True)
        t, scale = q.shape[2], self.cfg.head_dim ** -0.5
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

    @classmethod
    def from_export(cls, root: Path, target: ModelPaths) -> Eagle3TrainHead:
        """The module back from an exported head (fp16 weights, as served; the target's
        embedding), so that the trainer's validation can score a written head."""
        from tandem.engine.checkpoint import load_tensors

        root = Path(root)
        config = json.loads((root / "config.json").read_text())
        cfg = LlamaConfig.from_hf({**config, "tie_word_embeddings": False})
        t = load_tensors(ModelPaths(root))
        ids = (torch.arange(len(t["d2t"])) + t["d2t"]).tolist()
        vocab = DraftVocab(tuple(ids), cfg.vocab_size, 0)
        embed = load_tensors(target)["embed_tokens.weight"]
        head = cls(cfg, vocab, embed, t["lm_head.weight"].float(),
                   tuple(config["eagle_aux_hidden_state_layer_ids"]), cfg.max_position_embeddings)
        with torch.no_grad():
            for name, p in head._named().items():
                p.copy_(t[name].float())
        return head.eval()

    def _named(self) -> dict[str, torch.Tensor]:
        """The layout's tensor names of this module's weights (lm_head rows in vocab order)."""
        return {"fc.weight": self.fc.weight, "norm.weight": self.norm,
                "lm_head.weight": self.lm_head.weight,
                "midlayer.hidden_norm.weight": self.hidden_norm,
                **layer_tensors(self, "midlayer.")}

    def export(self, out: Path, target_hf_cfg: dict, card: dict) -> None:
        """Write the published EAGLE-3 layout (fp16, no embedding: the target lends its own)
        with draft_vocab.json-free d2t / t2d and Tandem's card beside it."""
        out.mkdir(parents=True, exist_ok=True)
        ids = torch.tensor(self.vocab.target_ids)
        order = torch.argsort(ids)  # d2t is an offset table: rows sorted by target id
        names = {**self._named(), "lm_head.weight": self.lm_head.weight[order]}
        tensors = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in names.items()}
        sorted_ids = ids[order]
        tensors["d2t"] = (sorted_ids - torch.arange(len(ids))).long()
        t2d = torch.zeros(self.vocab.target_vocab_size, dtype=torch.bool)
        t2d[sorted_ids] = True
        tensors["t2d"] = t2d
        save_file(tensors, str(out / "model.safetensors"))
        keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                "vocab_size", "max_position_embeddings", "hidden_act", "bos_token_id",
                "eos_token_id")
        cfg = {k: target_hf_cfg[k] for k in keep if k in target_hf_cfg}
        # The RoPE the head trained with, spelled for runtimes that read only rope_theta.
        cfg.setdefault("rope_theta", self.cfg.rope_theta)
        cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                   num_hidden_layers=1, draft_vocab_size=len(ids), torch_dtype="float16",
                   tie_word_embeddings=False,
                   eagle_aux_hidden_state_layer_ids=list(self.layer_ids))
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        (out / EAGLE3_CARD).write_text(json.dumps(card, indent=2))
