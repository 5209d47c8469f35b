"""Paged attention with a sliding window and/or score softcapping (Mistral, Qwen2 and Gemma's
sliding layers; Gemma 2's `attn_logit_softcapping`): the reference path, on any device.

The same contract as kernels.paged_attention.paged_attention, plus:
- `window`: query at position p sees key at position j only when p - j < window (transformers'
  sliding-window mask). Context keys sit at their position in the cache; a token tree's own
  nodes sit after the root at slots past their depth, so for them the slot under-states the
  distance, which matters only when a tree is deeper than the window (its ancestor mask
  already limits what it sees).
- `softcap`: scores become softcap * tanh(scores / softcap) before the mask and softmax,
  which SDPA cannot do, so that case computes the scores explicitly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.paged_attention import AttentionMetadata


def _visible(meta: AttentionMetadata) -> torch.Tensor:  # [batch, max_q, max_k] bool
    """Which keys each (padded) query row sees without a window: the layout's mask, or, for
    the one-sequence layouts that need none, causal from its last max_q positions."""
    if meta.mask is not None:
        return meta.mask[:, 0]
    q, k = meta.max_seqlen_q, meta.max_seqlen_k
    return torch.ones(1, q, k, dtype=torch.bool, device=meta.seq_lens.device).tril(k - q)


def masked_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,  # 0 = no window
    softcap: float = 0.0,  # 0 = none
    positions: torch.Tensor | None = None,  # [num_tokens] int64, needed with a window
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if window and positions is None:
        raise ValueError("a sliding window needs the query positions")
    if meta.groups:
        out = torch.empty_like(query)
        for rows, group in meta.groups:
            out[rows] = masked_attention(query[rows], key_cache, value_cache, group, scale,
                                         window, softcap,
                                         None if positions is None else positions[rows])
        return out
    _, heads, dim = query.shape
    kvh = key_cache.shape[2]
    batch, max_q = meta.q_rows.shape
    k = key_cache.view(-1, kvh, dim)[meta.kv_slots].transpose(1, 2)  # [b, kvh, max_k, d]
    v = value_cache.view(-1, kvh, dim)[meta.kv_slots].transpose(1, 2)
    q = (query[None] if batch == 1 else query[meta.q_rows]).transpose(1, 2)  # [b, h, mq, d]
    seen = _visible(meta)
    if window:
        q_pos = positions[None] if batch == 1 else positions[meta.q_rows]  # [b, max_q]
        k_pos = torch.arange(meta.max_seqlen_k, device=q_pos.device)
        seen = seen & (q_pos[:, :, None] - k_pos[None, None, :] < window)
    if softcap:
        k = k.repeat_interleave(heads // kvh, dim=1)
        v = v.repeat_interleave(heads // kvh, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, h, mq, mk]
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~seen[:, None], float("-inf"))
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=seen[:, None], scale=scale,
                                             enable_gqa=heads != kvh)
    out = out.transpose(1, 2).reshape(batch * max_q, heads, dim)
    return out if batch == 1 or max_q == 1 else out[meta.q_valid]  # one token: all rows real
