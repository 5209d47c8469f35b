"""Paged attention through PyTorch's FlexAttention (torch.nn.attention.flex_attention): a
masked kernel that needs no flash-attn, for chains and token trees alike.

Each sequence's keys are gathered through its block table (as the reference does), then one
flex_attention call runs with a block mask built from the layout's visibility (causal, or the
tree's ancestor mask over the context). On CUDA flex_attention is compiled (torch.compile; the
first call of a shape compiles), and the key length is padded to a multiple of 128 (flex's
block) so the shapes, and the compiled kernels, change only every 128 tokens. On the CPU it
runs eagerly: what the unit tests check against kernels.paged_attention.

Which kernel serves a call is kernels.attention's choice; gpu-check measures this one against
the reference on a GPU (docs/results/gpu.md).
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from kernels.paged_attention import AttentionMetadata, per_group

KV_MULTIPLE = 128  # keys padded to this on CUDA
# (meta, block mask) of the last few layouts: every layer of a forward shares its layout's
# mask (a mixed batch has one per group), so the mask is built once per forward.
_recent: list[tuple[AttentionMetadata, object]] = []


_broken: list[str] = []  # why compiled flex failed on this process's GPU, if it did


@functools.cache
def is_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def serves(query: torch.Tensor) -> bool:
    """Whether flex can take this call: present, not failed before, and a head size its
    compiled kernels handle (a power of two >= 16) on CUDA."""
    dim = query.shape[-1]
    shape_ok = not query.is_cuda or (dim >= 16 and dim & (dim - 1) == 0)
    return is_available() and not _broken and shape_ok


def mark_broken(why: str) -> None:
    """Compiled flex failed here: later calls go to the reference (kernels.attention)."""
    _broken.append(why)


@functools.cache
def _kernel(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        return torch.compile(flex_attention)
    # eager on the CPU on purpose (the unfused path the warning names is the one we test)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    return flex_attention


def visible(meta: AttentionMetadata, kv_len: int) -> torch.Tensor:  # [batch, max_q, kv_len]
    """Which keys each padded query row sees (keys past max_seqlen_k: none)."""
    q, k = meta.max_seqlen_q, meta.max_seqlen_k
    if meta.mask is not None:
        seen = meta.mask[:, 0]
    else:  # one sequence, causal over its last q positions
        seen = torch.ones(1, q, k, dtype=torch.bool, device=meta.seq_lens.device).tril(k - q)
    return F.pad(seen, (0, kv_len - k)) if kv_len > k else seen


def _block_mask(meta: AttentionMetadata, kv_len: int):
    from torch.nn.attention.flex_attention import create_block_mask

    for known, block in _recent:
        if known is meta:
            return block
    seen = visible(meta, kv_len)

    def mask_mod(b, h, q_idx, kv_idx):
        return seen[b, q_idx, kv_idx]

    block = create_block_mask(mask_mod, seen.shape[0], None, seen.shape[1], kv_len,
                              device=seen.device)
    _recent[:] = [(meta, block), *_recent[:3]]
    return block


def flex_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """kernels.paged_attention.paged_attention's contract (trees included) on FlexAttention."""
    if meta.groups:
        return per_group(flex_paged_attention, query, key_cache, value_cache, meta, scale)
    _, heads, dim = query.shape
    kvh = key_cache.shape[2]
    if heads % kvh:
        raise ValueError(f"num_heads {heads} is not a multiple of num_kv_heads {kvh}")
    batch, max_q = meta.q_rows.shape
    slots = meta.kv_slots  # [batch, max_k]
    kv_len = slots.shape[1]
    if query.is_cuda:
        kv_len = -(-kv_len // KV_MULTIPLE) * KV_MULTIPLE
        slots = F.pad(slots, (0, kv_len - slots.shape[1]))  # slot 0, masked out
    k = key_cache.view(-1, kvh, dim)[slots].transpose(1, 2)  # [batch, kv_heads, kv_len, dim]
    v = value_cache.view(-1, kvh, dim)[slots].transpose(1, 2)
    q = (query[None] if batch == 1 else query[meta.q_rows]).transpose(1, 2)  # [b, h, mq, d]
    out = _kernel(query.device.type)(q, k, v, block_mask=_block_mask(meta, kv_len),
                                     scale=scale, enable_gqa=heads != kvh)
    out = out.transpose(1, 2).reshape(batch * max_q, heads, dim)
    return out if batch == 1 or max_q == 1 else out[meta.q_valid]  # one token: all rows real
