"""Which attention kernel a forward uses, per call.

- flash-attn's paged varlen kernel (kernels/flash.py) when the query is on CUDA in fp16/bf16,
  the KV blocks are a multiple of 256, the round has no token tree and flash-attn is installed;
- FlexAttention (kernels/flex_attention.py) for token trees on CUDA: a real masked kernel,
  with the tree's block mask (flash-attn's causal kernel cannot take one);
- our C++ kernel (kernels/attention_cpu.py) on the CPU in fp32 (chains and trees) where it
  was built (AVX-512);
- else the torch reference (kernels/paged_attention.py), which runs on any device via SDPA.

`use_kernel` overrides the choice for a process ("reference" or "flex" everywhere: what
gpu-check compares, and what its measurement picks). The choice is per call because a tree
round and a chain round can alternate in one session.
"""
from __future__ import annotations

import logging

import torch

from kernels import attention_cpu, flash, flex_attention
from kernels.paged_attention import AttentionMetadata, paged_attention

FLASH_DTYPES = (torch.float16, torch.bfloat16)
KERNELS = ("auto", "reference", "flex")
_chosen = ["auto"]
log = logging.getLogger(__name__)


def use_kernel(name: str) -> str:
    """Set the process's attention kernel; returns the previous setting."""
    if name not in KERNELS:
        raise ValueError(f"attention kernel must be one of {', '.join(KERNELS)}, got {name!r}")
    if name == "flex" and not flex_attention.is_available():
        raise ValueError("this torch has no torch.nn.attention.flex_attention")
    previous, _chosen[0] = _chosen[0], name
    return previous


def flash_usable(query: torch.Tensor, key_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    return (query.is_cuda and query.dtype in FLASH_DTYPES and not meta.has_tree
            and key_cache.shape[1] % flash.FLASH_BLOCK_MULTIPLE == 0 and flash.is_available())


def kernel_for(query: torch.Tensor, key_cache: torch.Tensor, meta: AttentionMetadata) -> str:
    """"flash", "flex", "cpu" or "reference": the kernel attention() runs for this call."""
    if _chosen[0] != "auto":
        return _chosen[0]
    if flash_usable(query, key_cache, meta):
        return "flash"
    if query.is_cuda and meta.has_tree and flex_attention.serves(query):
        return "flex"
    if attention_cpu.serves(query, key_cache, meta):
        return "cpu"
    return "reference"


def attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """paged_attention's contract, on the kernel kernel_for picks."""
    kernel = kernel_for(query, key_cache, meta)
    if kernel == "flash":
        return flash.flash_paged_attention(query, key_cache, value_cache, meta, scale)
    if kernel == "cpu":
        return attention_cpu.cpu_paged_attention(query, key_cache, value_cache, meta, scale)
    if kernel == "flex" and query.is_cuda and _chosen[0] == "auto":
        try:
            return flex_attention.flex_paged_attention(query, key_cache, value_cache, meta,
                                                       scale)
        except (RuntimeError, ImportError) as exc:  # compile or Triton trouble on this GPU
            log.warning("FlexAttention failed (%s); trees use the reference from now on", exc)
            flex_attention.mark_broken(str(exc))
    elif kernel == "flex":
        return flex_attention.flex_paged_attention(query, key_cache, value_cache, meta, scale)
    return paged_attention(query, key_cache, value_cache, meta, scale)


def default_block_size(device: torch.device | str) -> int:
    """KV block size when none is given: flash-attn's paged kernel needs a multiple of 256 on
    a GPU; on the CPU small blocks waste less of the cache and share prefixes finer."""
    if torch.device(device).type == "cuda" and flash.is_available():
        return flash.FLASH_BLOCK_MULTIPLE
    return 16
