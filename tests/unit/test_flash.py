"""The flash-attn CUDA path against the CPU reference (runs only where CUDA exists)."""
import pytest
import torch

from kernels import flash
from kernels.paged_attention import build_attention_metadata, paged_attention, write_kv

pytestmark = pytest.mark.unit


@pytest.mark.gpu
@pytest.mark.skipif(not flash.is_available(), reason="flash-attn with CUDA not installed")
@pytest.mark.parametrize("q_lens,ctx_lens", [([1, 1], [300, 700]), ([5, 1, 40], [513, 9, 40])])
def test_flash_matches_cpu_reference(q_lens, ctx_lens):
    g = torch.Generator().manual_seed(0)
    heads, kvh, dim, bs = 8, 2, 64, 256
    num_blocks = sum((c + bs - 1) // bs for c in ctx_lens) + 2
    k_cache = torch.randn(num_blocks, bs, kvh, dim, generator=g)
    v_cache = torch.randn(num_blocks, bs, kvh, dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for c in ctx_lens:
        n = (c + bs - 1) // bs
        tables.append(perm[:n])
        perm = perm[n:]
    meta = build_attention_metadata(q_lens, ctx_lens, tables, bs)
    q = torch.randn(sum(q_lens), heads, dim, generator=g)
    write_kv(torch.randn(sum(q_lens), kvh, dim, generator=g),
             torch.randn(sum(q_lens), kvh, dim, generator=g), k_cache, v_cache, meta.slot_mapping)
    ref = paged_attention(q, k_cache, v_cache, meta, dim**-0.5)
    dev = torch.device("cuda")
    got = flash.flash_paged_attention(
        q.to(dev, torch.float16), k_cache.to(dev, torch.float16),
        v_cache.to(dev, torch.float16), meta, dim**-0.5)
    torch.testing.assert_close(got.float().cpu(), ref, atol=2e-2, rtol=2e-2)


def test_unavailable_raises_clearly():
    if flash.is_available():
        pytest.skip("flash-attn present")
    with pytest.raises(RuntimeError, match="flash-attn"):
        flash.flash_paged_attention(None, None, None, None, 1.0)
