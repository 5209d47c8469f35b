"""Which attention kernel a forward uses: flash-attn's paged varlen kernel on a GPU where it
can, else the torch reference (kernels.paged_attention), which runs on any device.

flash-attn applies causal masks only and reads paged KV in blocks of a multiple of 256, in
fp16/bf16: a token tree, a smaller block or fp32 takes the reference path (still on the GPU,
through SDPA). The choice is per call because a tree round and a chain round can alternate in
one session.
"""
from __future__ import annotations

import torch

from kernels import flash
from kernels.paged_attention import AttentionMetadata, paged_attention

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_usable(query: torch.Tensor, key_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    return (query.is_cuda and query.dtype in FLASH_DTYPES and not meta.has_tree
            and key_cache.shape[1] % flash.FLASH_BLOCK_MULTIPLE == 0 and flash.is_available())


def attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """paged_attention's contract, on the fastest kernel that can serve this call."""
    if flash_usable(query, key_cache, meta):
        return flash.flash_paged_attention(query, key_cache, value_cache, meta, scale)
    return paged_attention(query, key_cache, value_cache, meta, scale)


def default_block_size(device: torch.device | str) -> int:
    """KV block size when none is given: flash-attn's paged kernel needs a multiple of 256 on
    a GPU; on the CPU small blocks waste less of the cache and share prefixes finer."""
    if torch.device(device).type == "cuda" and flash.is_available():
        return flash.FLASH_BLOCK_MULTIPLE
    return 16
