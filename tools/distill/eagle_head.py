"""The EAGLE head as a trainable torch module (dense causal attention), with export to the
checkpoint layout tandem.engine.eagle.EagleHead serves.

Entry t reads [feature t-1 ; embedding of token t] and predicts feature t (and, through the
target's frozen LM head rows, token t+1). `forward2` is the training-time test of the draft's
second step: entry t reads the head's own predicted feature t-1 and attends to the first pass's
keys before t (true features, as after a commit) plus its own, the situation of a draft token
that follows one predicted feature.
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
from tandem.engine.eagle import EAGLE_CARD
from tandem.engine.rope import rope_inv_freq


def layer_tensors(head: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """A head's decoder-layer weights under their checkpoint names (`prefix` + HF Llama's)."""
    return {prefix + "input_layernorm.weight": head.input_norm,
            prefix + "post_attention_layernorm.weight": head.post_norm,
            **{f"{prefix}self_attn.{n}_proj.weight": getattr(head, n).weight for n in "qkvo"},
            **{f"{prefix}mlp.{n}_proj.weight": getattr(head, n).weight
               for n in ("gate", "up", "down")}}


class EagleTrainHead(nn.Module):
    def __init__(self, cfg: LlamaConfig, vocab: DraftVocab, embed_rows: torch.Tensor,
                 max_positions: int = 4096):
        super().__init__()
        self.cfg, self.vocab = cfg, vocab
        h, hd = cfg.hidden_size, cfg.head_dim
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_norm = nn.Parameter(torch.ones(h))
        self.norm = nn.Parameter(torch.ones(h))
        self.q = nn.Linear(h, cfg.num_heads * hd, bias=False)
        self.k = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.v = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.o = nn.Linear(cfg.num_heads * hd, h, bias=False)
        self.gate = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.register_buffer("embed", embed_rows.float().clone())  # [V_d, h] frozen (target's)
        self.register_buffer("input_map", vocab.input_map())  # [target_vocab] -> row
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(cfg))
        self.register_buffer("cos", torch.cat([freqs.cos(), freqs.cos()], -1))
        self.register_buffer("sin", torch.cat([freqs.sin(), freqs.sin()], -1))

    def init_from_target(self, tensors: dict[str, torch.Tensor], layer: int) -> None:
        """Start from the target's layer `layer` and final norm; fc adds feature and embedding."""
        p = f"layers.{layer}."
        with torch.no_grad():
            for mod, name in ((self.q, "self_attn.q_proj"), (self.k, "self_attn.k_proj"),
                              (self.v, "self_attn.v_proj"), (self.o, "self_attn.o_proj"),
                              (self.gate, "mlp.gate_proj"), (self.up, "mlp.up_proj"),
                              (self.down, "mlp.down_proj")):
                mod.weight.copy_(tensors[p + name + ".weight"])
            self.input_norm.copy_(tensors[p + "input_layernorm.weight"])
            self.post_norm.copy_(tensors[p + "post_attention_layernorm.weight"])
            self.norm.copy_(tensors["norm.weight"])
            eye = torch.eye(self.cfg.hidden_size)
            self.fc.weight.copy_(torch.cat([eye, eye], 1))

    def _rms(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)

    def _rope(self, x, pos):  # x [B, heads, T, hd], pos [T]
        cos, sin = self.cos[pos], self.sin[pos]
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def _qkv(self, x, pos):
        b, t, _ = x.shape
        cfg, hd = self.cfg, self.cfg.head_dim
        y = self._rms(x, self.input_norm)
        q = self.q(y).view(b, t, cfg.num_heads, hd).transpose(1, 2)
        k = self.k(y).view(b, t, cfg.num_kv_heads, hd).transpose(1, 2)
        v = self.v(y).view(b, t, cfg.num_kv_heads, hd).transpose(1, 2)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = (self._rope(k, pos).repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
        return self._rope(q, pos), k, v

    def _finish(self, x, attn):  # x [B, T, h], attn [B, heads, T, hd]
        b, t, _ = x.shape
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, -1))
        y = self._rms(x, self.post_norm)
        x = x + self.down(F.silu(self.gate(y)) * self.up(y))
        return self._rms(x, self.norm)

    def _input(self, ids, feats):
        return self.fc(torch.cat([feats, self.embed[self.input_map[ids]]], -1))

    def forward(self, ids, feats, pos):
        """ids [B, T] (token t), feats [B, T, h] (feature t-1), pos [T] -> predicted [B, T, h]
        and the keys/values for forward2."""
        x = self._input(ids, feats)
        q, k, v = self._qkv(x, pos)
        return self._finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True)), (k, v)

    def forward2(self, ids, feats, pos, kv1):
        """Second draft step: feats are the head's own predictions of feature t-1."""
        k1, v1 = kv1
        x = self._input(ids, feats)
        q, k, v = self._qkv(x, pos)
        scale = self.cfg.head_dim ** -0.5
        t = ids.shape[1]
        s1 = (q @ k1.transpose(-1, -2)) * scale  # [B, heads, T, T]: keys strictly before t
        before = torch.ones(t, t, dtype=torch.bool, device=q.device).tril(-1)
        s1 = s1.masked_fill(~before, float("-inf"))
        s_self = (q * k).sum(-1, keepdim=True) * scale  # [B, heads, T, 1]
        p = torch.cat([s1, s_self], -1).softmax(-1)
        attn = p[..., :t] @ v1 + p[..., t:] * v
        return self._finish(x, attn)

    def logits(self, pred):  # [..., h] -> [..., V_d] over the truncated vocabulary
        return pred @ self.embed.T

    @classmethod
    def untrained(cls, target_root: Path, vocab_size: int, seed: int = 0) -> EagleTrainHead:
        """A head started from the target's last layer, untrained (tests and smoke runs:
        it drafts poorly but speaks the target's ids and widths)."""
        from tandem.engine.checkpoint import load_tensors
        from tandem.models import ModelPaths, read_hf_config

        paths = ModelPaths(Path(target_root))
        cfg = LlamaConfig.from_hf(read_hf_config(paths))
        tensors = load_tensors(paths)
        vocab = DraftVocab(tuple(range(min(vocab_size, cfg.vocab_size))), cfg.vocab_size, 0)
        torch.manual_seed(seed)
        head = cls(cfg, vocab, tensors["embed_tokens.weight"][:len(vocab.target_ids)].float(),
                   cfg.max_position_embeddings)
        head.init_from_target(tensors, cfg.num_layers - 1)
        return head

    @classmethod
    def from_export(cls, root: Path) -> EagleTrainHead:
        """The module back from an exported head directory (fp16 weights, as served), so
        that the trainer's own validation can score a shipped head."""
        from tandem.engine.checkpoint import load_tensors
        from tandem.models import ModelPaths, read_hf_config

        paths = ModelPaths(Path(root))
        cfg = LlamaConfig.from_hf(read_hf_config(paths))
        vocab = DraftVocab.read(paths.root)
        t = {k: v.float() for k, v in load_tensors(paths).items()}
        head = cls(cfg, vocab, t["embed_tokens.weight"], cfg.max_position_embeddings)
        p = "layers.0."
        with torch.no_grad():
            head.fc.weight.copy_(t["fc.weight"])
            head.norm.copy_(t["norm.weight"])
            head.input_norm.copy_(t[p + "input_layernorm.weight"])
            head.post_norm.copy_(t[p + "post_attention_layernorm.weight"])
            for mod, name in ((head.q, "self_attn.q_proj"), (head.k, "self_attn.k_proj"),
                              (head.v, "self_attn.v_proj"), (head.o, "self_attn.o_proj"),
                              (head.gate, "mlp.gate_proj"), (head.up, "mlp.up_proj"),
                              (head.down, "mlp.down_proj")):
                mod.weight.copy_(t[p + name + ".weight"])
        return head.eval()

    def export(self, out: Path, target_hf_cfg: dict, card: dict) -> None:
        """Write the EagleHead checkpoint (fp16): config.json, model.safetensors,
        draft_vocab.json and the card."""
        out.mkdir(parents=True, exist_ok=True)
        names = {"model.fc.weight": self.fc.weight, "model.norm.weight": self.norm,
                 "model.embed_tokens.weight": self.embed,
                 **layer_tensors(self, "model.layers.0.")}
        # From CPU copies, wherever the head trained: the checkpoint loads anywhere.
        tensors = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in names.items()}
        save_file(tensors, str(out / "model.safetensors"))
        cfg = {k: v for k, v in target_hf_cfg.items() if k not in ("quantization_config",)}
        cfg.update(num_hidden_layers=1, vocab_size=len(self.vocab.target_ids),
                   tie_word_embeddings=True, architectures=["LlamaForCausalLM"],
                   model_type="llama", torch_dtype="float16")
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        self.vocab.write(out)
        (out / EAGLE_CARD).write_text(json.dumps(card, indent=2))
