"""Our Llama-family forward (Llama, SmolLM, Mistral, Qwen2-style qkv biases) over paged KV.

Weights are loaded straight from HF safetensors (tandem.engine.checkpoint). Q/K/V and gate/up
projections are fused into one matmul each: on a CPU at batch 1 the forward is bound by per-op
overhead and memory traffic, so fewer, larger matmuls are faster.
"""
from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.nn.functional as F

from kernels import attention_cpu, int8_cpu
from kernels.attention import attention
from kernels.masked_attention import masked_attention
from kernels.paged_attention import AttentionMetadata, row_attention, write_kv
from tandem.engine import quant_bf16
from tandem.engine.checkpoint import LlamaConfig, load_tensors
from tandem.engine.draft_vocab import DRAFT_VOCAB_FILE, DraftVocab
from tandem.engine.layer_weights import LayerWeights, named_projections
from tandem.engine.linear import LinearRouter, measure_invariant_rows
from tandem.engine.quant import INT8_DTYPES, compute_dtype
from tandem.engine.rope import rope_inv_freq
from tandem.engine.scale_cache import ScaleCache
from tandem.engine.tune_cache import TuneCache
from tandem.models import ModelError, ModelPaths, read_hf_config


class LlamaModel:
    """Weights plus a functional forward; the KV cache is owned by the model runner.

    `dtype` is a torch float dtype, or "int8" / "int8-bf16" for weight-only int8 (quant.py,
    quant_bf16.py): projections and LM head quantized, lookups, norms and KV cache fp32.

    `batch_invariant`: every row's logits depend on its own context only, never on what else
    shares the forward (decode, verify chunk, prefill, other sessions): one padded matmul
    layout and row-at-a-time attention. Greedy text is then the same alone, batched, with
    speculation or after failover, at a measured cost in speed (docs/design/batch_invariance.md).
    """

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype | str = torch.float32,
                 draft_vocab: DraftVocab | None = None, batch_invariant: bool = False,
                 device: torch.device | str = "cpu"):
        self.weight_dtype = str(dtype).removeprefix("torch.")
        dtype = compute_dtype(self.weight_dtype)
        self.dtype = dtype
        self.device = device = torch.device(device)
        if device.type != "cpu" and (self.weight_dtype in INT8_DTYPES or batch_invariant):
            # Both are CPU kernels (the int8 GEMM, the measured BLAS padding).
            raise ModelError(f"--dtype {self.weight_dtype} and --batch-invariant run on the "
                             f"cpu only, not {device}")
        if batch_invariant and (cfg.sliding_window or cfg.attn_softcap):
            raise ModelError("--batch-invariant does not cover sliding windows or attention "
                             "softcapping (this checkpoint has them)")
        self.batch_invariant = batch_invariant
        self.linear = LinearRouter()
        self.cfg = cfg = self._use_draft_vocab(cfg, draft_vocab)

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ModelError(f"checkpoint is missing tensor {name!r}")
            return weights[name].to(device=device, dtype=dtype).contiguous()

        self.embed = w("embed_tokens.weight")
        self.final_norm = self._norm_weight(w, "norm.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else w("lm_head.weight")
        self.layers = [self._layer(w, i) for i in range(cfg.num_layers)]
        self.cos, self.sin = self._rope_table(None)
        # Gemma 3's sliding layers rotate with their own base
        self.local_rope = self._rope_table(cfg.local_rope) if cfg.local_rope else None
        if self.weight_dtype in INT8_DTYPES:
            self._quantize_int8()

    def _rope_table(self, rope: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [max_pos, head_dim], computed in fp32 on the CPU whatever the device."""
        pos = torch.arange(self.cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(self.cfg, rope))  # [max_pos, head_dim // 2]
        return tuple(torch.cat([f, f], -1).to(device=self.device, dtype=self.dtype)
                     for f in (freqs.cos(), freqs.sin()))

    def _norm_weight(self, w, name: str) -> torch.Tensor:
        """A norm's scale as the forward applies it: Gemma stores w for (1 + w), added in
        fp32 before any cast, as transformers computes it."""
        weight = w(name)
        if not self.cfg.norm_offset:
            return weight
        return (self.cfg.norm_offset + weight.float()).to(weight.dtype)

    def inexact_int8(self) -> list[str]:
        """Under int8: the weights whose codes do not reproduce the checkpoint's exactly."""
        return [name for name, w in named_projections(self.layers, self.lm_head)
                if not getattr(w, "exact", False)]

    def _use_draft_vocab(self, cfg: LlamaConfig, draft_vocab: DraftVocab | None) -> LlamaConfig:
        """With a truncated draft vocabulary, vocab_map[i] is the target id of draft row i and
        the returned config's vocab_size is the target's, so callers see target ids only."""
        self.vocab_map = self._input_map = None
        if draft_vocab is None:
            return cfg
        if len(draft_vocab.target_ids) != cfg.vocab_size:
            raise ModelError(f"{DRAFT_VOCAB_FILE} has {len(draft_vocab.target_ids)} ids, "
                             f"the checkpoint's vocab_size is {cfg.vocab_size}")
        self.vocab_map = torch.tensor(draft_vocab.target_ids, dtype=torch.int64,
                                      device=self.device)
        self._input_map = draft_vocab.input_map().to(self.device)
        return replace(cfg, vocab_size=draft_vocab.target_vocab_size)

    def _quantize_int8(self) -> None:
        kind = quant_bf16.quantizer(self.weight_dtype)
        cache = ScaleCache.default()
        for layer in self.layers:
            layer.quantize_int8(cache, kind)
        # A tied head keeps its fp32 twin for the embedding lookup (a gather, not bandwidth-bound).
        self.lm_head = kind(self.lm_head, cache)
        # Build (or load from cache) the CPU kernel now: a first build takes a minute or two,
        # which belongs at startup, not inside the first request's engine step.
        if int8_cpu.load() is None and self.batch_invariant:
            raise ModelError("batch-invariant int8 needs the C++ int8 kernel, which could "
                             "not be built here")

    def _layer(self, w, i: int) -> LayerWeights:
        cfg, p = self.cfg, f"layers.{i}."
        qkv_names = [f"{p}self_attn.{n}_proj" for n in "qkv"]
        norm, sandwich = self._norm_weight, cfg.sandwich_norms
        return LayerWeights(
            input_norm=norm(w, p + "input_layernorm.weight"),
            qkv=torch.cat([w(n + ".weight") for n in qkv_names]),
            qkv_bias=torch.cat([w(n + ".bias") for n in qkv_names]) if cfg.qkv_bias else None,
            o=w(p + "self_attn.o_proj.weight"),
            post_norm=norm(w, p + "post_attention_layernorm.weight"),
            gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
            down=w(p + "mlp.down_proj.weight"),
            o_bias=w(p + "self_attn.o_proj.bias") if cfg.o_bias else None,
            q_norm=norm(w, p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
            k_norm=norm(w, p + "self_attn.k_norm.weight") if cfg.qk_norm else None,
            pre_ff_norm=norm(w, p + "pre_feedforward_layernorm.weight") if sandwich else None,
            post_ff_norm=norm(w, p + "post_feedforward_layernorm.weight") if sandwich else None,
        )

    @classmethod
    def load(cls, paths: ModelPaths, dtype: torch.dtype | str = torch.float32,
             tune: bool = True, batch_invariant: bool = False,
             device: torch.device | str = "cpu") -> LlamaModel:
        cfg = LlamaConfig.from_hf(read_hf_config(paths))
        model = cls(cfg, load_tensors(paths), dtype, DraftVocab.read(paths.root),
                    batch_invariant=batch_invariant, device=device)
        if tune or batch_invariant:
            model.tune_kernels()
        return model

    def batch_invariant_view(self) -> LlamaModel:
        """This model in batch-invariant mode, sharing every weight tensor."""
        view = copy.copy(self)
        view.batch_invariant, view.linear = True, LinearRouter()
        view.tune_kernels()
        return view

    def tune_kernels(self) -> None:
        """Measure the faster matmul layout per weight shape and row count (tandem.engine.linear;
        batch-invariant: the rows from which the BLAS is invariant). After set_num_threads."""
        groups = [[getattr(layer, name) for layer in self.layers]
                  for name in LayerWeights.PROJECTIONS]
        if not self.batch_invariant:
            self.linear.tune([*groups, [self.lm_head]], cache=TuneCache.default())
            return
        dense = [g[0] for g in [*groups, [self.lm_head]] if isinstance(g[0], torch.Tensor)]
        rows = measure_invariant_rows(dense)
        if not rows:
            raise ModelError("batch-invariant mode: this BLAS gives rows that depend on the "
                             "row count however many are padded in (try --threads 1)")
        self.linear.invariant_rows = rows

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.cfg.rms_norm_eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def decoder_layer(
        self,
        h: torch.Tensor,  # [num_tokens, hidden] residual stream
        layer: LayerWeights,
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        window: int = 0,  # a sliding layer's window (0: the whole context)
        positions: torch.Tensor | None = None,  # [num_tokens] int64, needed with a window
        x: torch.Tensor | None = None,  # attention's input if not h normed (EAGLE-3's head)
    ) -> torch.Tensor:  # [num_tokens, hidden]
        cfg = self.cfg
        n, hd = h.shape[0], cfg.head_dim
        q_size, kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        if x is None:
            x = h if layer.input_norm is None else self._rms_norm(h, layer.input_norm)
        qkv = self.linear(x, layer.qkv, layer.qkv_bias)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = q.view(n, cfg.num_heads, hd), k.view(n, cfg.num_kv_heads, hd)
        if layer.q_norm is not None:  # per head, before RoPE
            q, k = self._rms_norm(q, layer.q_norm), self._rms_norm(k, layer.k_norm)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        write_kv(k, v.view(n, cfg.num_kv_heads, hd), k_cache, v_cache, meta.slot_mapping)
        scale = cfg.query_scale or hd**-0.5
        if window or cfg.attn_softcap:
            attn = masked_attention(q, k_cache, v_cache, meta, scale, window, cfg.attn_softcap,
                                    positions)
        else:
            attn = self._attend(q, k_cache, v_cache, meta, scale)
        out = self._attn_out(attn.reshape(n, q_size), layer)
        if layer.pre_ff_norm is None:  # Llama: pre-norm blocks
            h = h + out
            x = self._rms_norm(h, layer.post_norm)
            return h + self._mlp(x, layer)
        h = h + self._rms_norm(out, layer.post_norm)  # Gemma: norms on both sides
        x = self._rms_norm(h, layer.pre_ff_norm)
        return h + self._rms_norm(self._mlp(x, layer), layer.post_ff_norm)

    def _attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        """Batch-invariant: the C++ CPU kernel where it serves (every row alone by
        construction, a call per layer), else row_attention (a call per row)."""
        if not self.batch_invariant:
            return attention(q, k_cache, v_cache, meta, scale)
        if attention_cpu.serves(q, k_cache, meta):
            return attention_cpu.cpu_paged_attention(q, k_cache, v_cache, meta, scale)
        return row_attention(q, k_cache, v_cache, meta, scale)

    # Hooks a tensor-parallel shard overrides (tandem.engine.tp_llama): embedding lookup,
    # attention's output projection, the MLP and the LM head.
    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        return self.embed[input_ids]

    def _attn_out(self, attn: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        return self.linear(attn, layer.o, layer.o_bias)  # [n, q_size] -> [n, hidden]

    def _head(self, h: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab] fp32
        return self.linear(h, self.lm_head).float()

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        gate, up = self.linear(x, layer.gate_up).chunk(2, dim=-1)
        act = F.silu(gate) if self.cfg.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.linear(act * up, layer.down)

    def rope_at(self, positions: torch.Tensor, table=None):  # -> 2 x [num_tokens, 1, hd]
        """cos, sin of `positions` [num_tokens]: the global table's, or `table`'s."""
        cos, sin = table or (self.cos, self.sin)
        return cos[positions][:, None], sin[positions][:, None]

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [rows, hidden] normed -> [rows, vocab]
        logits = self._head(h)
        if cap := self.cfg.final_softcap:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        if self.vocab_map is None:
            return logits
        full = logits.new_full((logits.shape[0], self.cfg.vocab_size), float("-inf"))
        return full.index_copy_(1, self.vocab_map, logits)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (key, value) caches
        logits_indices: torch.Tensor,  # [num_logits] int64, rows whose logits are returned
        with_hidden: bool = False,
        feature_layers: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [num_logits, vocab] float32; with_hidden also returns every token's features
        (what EAGLE drafts from): its final normed hidden state [num_tokens, hidden], or with
        `feature_layers` the residual streams entering those layers (num_layers: the last
        one's output), concatenated in that order, [num_tokens, len(feature_layers) * hidden]."""
        cos, sin = self.rope_at(positions)
        local = self.rope_at(positions, self.local_rope) if self.local_rope else None
        if self._input_map is not None:
            input_ids = self._input_map[input_ids]  # target ids -> draft rows
        h = self._embed(input_ids)  # [num_tokens, hidden]
        if self.cfg.embed_scale != 1.0:  # Gemma: the scale cast to the weights' dtype first
            h = h * torch.tensor(self.cfg.embed_scale, dtype=h.dtype)
        streams = {}  # layer -> the residual stream entering it, for the layers asked only
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_cache)):
            if with_hidden and i in feature_layers:
                streams[i] = h
            window = self.cfg.window(i)
            c, s = local if window and local is not None else (cos, sin)
            h = self.decoder_layer(h, layer, c, s, meta, k_cache, v_cache, window, positions)
        if with_hidden and feature_layers:
            streams[len(self.layers)] = h
            feats = torch.cat([streams[i] for i in feature_layers], -1)
            return self.logits(self._rms_norm(h[logits_indices], self.final_norm)), feats
        if with_hidden:
            h = self._rms_norm(h, self.final_norm)
            return self.logits(h[logits_indices]), h
        return self.logits(self._rms_norm(h[logits_indices], self.final_norm))
