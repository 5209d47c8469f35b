"""Paged attention on CPU straight from the KV blocks (csrc/paged_attention.cpp), compiled
once per machine (kernels/cpu_ext.py).

The torch reference (kernels/paged_attention.py) gathers every sequence's blocks into a padded
copy and builds a mask in every layer, and runs a mixed step (one-token sequences beside a
verify chunk) as two groups: at 4 sessions of the default target that was 2-5 ms of a
16-23 ms step, and a verify row cost a batched step ~1.7x what it costs one sequence. The
kernel reads each row's keys where they lie and treats every row alone (so also batch-
invariant). It serves fp32 (token trees too: a tree row sees the context and its ancestors);
other dtypes keep the reference.
"""
from __future__ import annotations

import functools
import os

import torch

from kernels import cpu_ext
from kernels.paged_attention import AttentionMetadata

_SOURCE = cpu_ext.CSRC / "paged_attention.cpp"
_NAME = "tandem_paged_attention"
_NO_TREE = torch.empty(0, 0, dtype=torch.bool)  # every sequence's new rows causal


@functools.cache
def load():
    """The compiled module (with `paged_attention`), or None where it cannot be built or
    TANDEM_CPU_ATTENTION=0 turns it off."""
    if os.environ.get("TANDEM_CPU_ATTENTION", "1") == "0":
        return None
    return cpu_ext.build(_NAME, _SOURCE, "attention uses the torch reference")


def serves(query: torch.Tensor, key_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether this call can run here: on the CPU, and `takes` its dtype and head_dim."""
    return (query.device.type == "cpu" and key_cache.dtype == query.dtype
            and takes(query.dtype, query.shape[-1]))


def takes(dtype: torch.dtype, head_dim: int) -> bool:
    """fp32 heads, head_dim a multiple of 16, the kernel built (with AVX-512: without it the
    reference is the faster path)."""
    if dtype != torch.float32 or head_dim % 16:
        return False
    module = load()
    return module is not None and module.built


def cpu_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] float32
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] float32
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] float32
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """kernels.paged_attention.paged_attention's contract."""
    visible = _NO_TREE if meta.new_visible is None else meta.new_visible
    return load().paged_attention(query.contiguous(), key_cache, value_cache,
                                  meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
                                  visible, scale)
