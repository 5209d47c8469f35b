"""Optional CUDA path: flash-attn's varlen kernel reading the paged KV cache via block tables.

Import-guarded: flash-attn has no CPU build. Checked against `kernels.paged_attention` by
tests/unit/test_flash.py wherever CUDA and flash-attn exist. flash-attn requires the KV block
size to be a multiple of 256 for paged access.
"""
from __future__ import annotations

import torch

from kernels.paged_attention import AttentionMetadata

try:  # pragma: no cover - exercised only on GPU machines
    from flash_attn import flash_attn_varlen_func
except ImportError:  # flash-attn is the optional `gpu` extra
    flash_attn_varlen_func = None

FLASH_BLOCK_MULTIPLE = 256


def is_available() -> bool:
    return flash_attn_varlen_func is not None and torch.cuda.is_available()


def flash_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] fp16/bf16, CUDA
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Same contract as kernels.paged_attention.paged_attention, on the GPU."""
    if not is_available():
        raise RuntimeError("flash-attn with CUDA is not available (install the `gpu` extra)")
    if meta.has_tree:  # flash-attn takes causal masks only: trees use the reference path
        raise ValueError("flash-attn cannot apply a token-tree mask; use paged_attention")
    if key_cache.shape[1] % FLASH_BLOCK_MULTIPLE:
        raise ValueError(
            f"flash-attn paged KV needs block_size % {FLASH_BLOCK_MULTIPLE} == 0, "
            f"got {key_cache.shape[1]}"
        )
    dev = query.device
    cu_k = torch.zeros(meta.batch_size + 1, dtype=torch.int32, device=dev)
    cu_k[1:] = torch.cumsum(meta.seq_lens.to(dev), 0)
    # causal=True aligns the mask bottom-right when seqlen_q < seqlen_k, which is exactly
    # "new queries sit at the end of their context".
    return flash_attn_varlen_func(
        query, key_cache, value_cache,
        cu_seqlens_q=meta.cu_seqlens_q.to(dev, torch.int32),
        cu_seqlens_k=cu_k,
        max_seqlen_q=meta.max_seqlen_q,
        max_seqlen_k=meta.max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        block_table=meta.block_tables.to(dev, torch.int32),
    )
