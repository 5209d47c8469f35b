"""The C++ paged attention (kernels/attention_cpu.py) against dense causal attention, and its
row invariance: a row's output does not depend on what else is in the batch."""
import math
import random

import pytest
import torch

from kernels import attention as attn
from kernels import attention_cpu
from kernels.paged_attention import (
    ancestor_mask,
    build_attention_metadata,
    paged_attention,
    write_kv,
)

pytestmark = pytest.mark.unit
needs_kernel = pytest.mark.skipif(
    attention_cpu.load() is None or not attention_cpu.load().built,
    reason="no compiler here, or a CPU without AVX-512 (the reference serves)")


def layout(q_lens, ctx_lens, heads=9, kvh=3, dim=64, block_size=16, num_blocks=96, seed=0):
    """Scattered caches holding each sequence's context, its new rows' queries, and the
    dense causal answer per sequence."""
    g = torch.Generator().manual_seed(seed)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    kc = torch.zeros(num_blocks, block_size, kvh, dim)
    vc = torch.zeros_like(kc)
    tables, qs, want = [], [], []
    for q_len, ctx in zip(q_lens, ctx_lens):
        table = [free.pop() for _ in range(math.ceil(ctx / block_size))]
        k, v = torch.randn(ctx, kvh, dim, generator=g) * 3, torch.randn(ctx, kvh, dim, generator=g)
        q = torch.randn(q_len, heads, dim, generator=g)
        whole = build_attention_metadata([ctx], [ctx], [table], block_size)
        write_kv(k, v, kc, vc, whole.slot_mapping)
        kr, vr = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), kr.double()) * dim**-0.5
        pos = torch.arange(ctx - q_len, ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos, float("-inf"))
        want.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vr.double()).float())
        tables.append(table)
        qs.append(q)
    meta = build_attention_metadata(list(q_lens), list(ctx_lens), tables, block_size)
    return torch.cat(qs), kc, vc, meta, torch.cat(want)


@needs_kernel
@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([1], [1]), ([1], [200]), ([6], [40]), ([70], [70]),  # decode, verify, a prefill
    ([1, 1, 1, 1], [160, 3, 17, 33]), ([5, 1, 1, 1], [165, 170, 3, 17]),  # a mixed step
    ([9, 1, 4, 2], [9, 20, 11, 2]),
])
def test_matches_dense_causal_attention(q_lens, ctx_lens):
    q, kc, vc, meta, want = layout(q_lens, ctx_lens)
    got = attention_cpu.cpu_paged_attention(q, kc, vc, meta, 64**-0.5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("heads,kvh,dim", [(4, 4, 16), (8, 1, 32), (6, 2, 128), (4, 2, 48)])
def test_head_layouts(heads, kvh, dim):
    q, kc, vc, meta, want = layout([3, 1], [21, 50], heads=heads, kvh=kvh, dim=dim)
    got = attention_cpu.cpu_paged_attention(q, kc, vc, meta, dim**-0.5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_a_row_gives_the_same_bits_in_any_batch():
    q, kc, vc, meta, _ = layout([5, 1, 3], [40, 90, 33], seed=4)
    together = attention_cpu.cpu_paged_attention(q, kc, vc, meta, 0.125)
    tables = meta.block_tables.tolist()
    # sequence 0's verify chunk alone, and its last row as a one-token decode step
    alone = build_attention_metadata([5], [40], [tables[0]], 16)
    kernel = attention_cpu.cpu_paged_attention
    assert torch.equal(kernel(q[:5], kc, vc, alone, 0.125), together[:5])
    last = build_attention_metadata([1], [40], [tables[0]], 16)
    assert torch.equal(kernel(q[4:5], kc, vc, last, 0.125), together[4:5])


@needs_kernel
def test_only_causal_fp32_cpu_rounds_take_the_kernel():
    q, kc, vc, meta, _ = layout([4], [10])
    assert attn.kernel_for(q, kc, meta) == "cpu"
    assert attn.kernel_for(q.bfloat16(), kc.bfloat16(), meta) == "reference"
    tree = build_attention_metadata([4], [10], meta.block_tables.tolist(), 16,
                                    [ancestor_mask([-1, 0, 0, 1])])
    assert attn.kernel_for(q, kc, tree) == "cpu"
    previous = attn.use_kernel("reference")  # what gpu-check compares against
    try:
        assert attn.kernel_for(q, kc, meta) == "reference"
    finally:
        attn.use_kernel(previous)


@needs_kernel
def test_bad_layouts_raise_value_errors_not_crashes():
    q, kc, vc, meta, _ = layout([2], [10])
    kernel, causal = attention_cpu.load().paged_attention, attention_cpu._NO_TREE
    args = (meta.block_tables, meta.seq_lens, meta.cu_seqlens_q)
    with pytest.raises(RuntimeError, match="end at the number of query rows"):
        kernel(q[:1], kc, vc, *args, causal, 0.1)
    with pytest.raises(RuntimeError, match="bad lengths"):
        kernel(q, kc, vc, args[0], meta.seq_lens * 0 + 1, args[2], causal, 0.1)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(q.double(), kc, vc, *args, causal, 0.1)
    with pytest.raises(RuntimeError, match="new_visible"):
        kernel(q, kc, vc, *args, torch.ones(1, 2, dtype=torch.bool), 0.1)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel(q, kc, vc, args[0] + 1000, *args[1:], causal, 0.1)
    with pytest.raises(RuntimeError, match="differ in shape"):
        kernel(q, kc, vc[:1], *args, causal, 0.1)
    with pytest.raises(RuntimeError, match="more new rows"):
        kernel(q, kc, vc, *args, torch.ones(2, 1, dtype=torch.bool), 0.1)


@needs_kernel
def test_token_trees_beside_chains_match_the_reference():
    q, kc, vc, meta, _ = layout([4, 1, 5, 3], [30, 50, 12, 5], seed=2)
    tables = meta.block_tables.tolist()
    trees = [ancestor_mask([-1, 0, 0, 1]), None, ancestor_mask([-1, 0, 1, 1, 0]), None]
    tree = build_attention_metadata([4, 1, 5, 3], [30, 50, 12, 5],
                                    [t[:len(t)] for t in tables], 16, trees)
    want = paged_attention(q, kc, vc, tree, 0.125)
    got = attention_cpu.cpu_paged_attention(q, kc, vc, tree, 0.125)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # the causal sequences' rows are the bits they have without a tree in the batch
    chain = attention_cpu.cpu_paged_attention(q, kc, vc, meta, 0.125)
    assert torch.equal(got[4:5], chain[4:5]) and torch.equal(got[10:], chain[10:])


@needs_kernel
def test_a_tree_row_that_sees_a_chain_gives_the_chain_row_bits():
    q, kc, vc, meta, _ = layout([4], [20], seed=5)
    table = meta.block_tables.tolist()
    chain = attention_cpu.cpu_paged_attention(q, kc, vc, meta, 0.125)
    tree = build_attention_metadata([4], [20], table, 16, [ancestor_mask([-1, 0, 1, 0])])
    got = attention_cpu.cpu_paged_attention(q, kc, vc, tree, 0.125)
    assert torch.equal(got[:3], chain[:3])  # nodes 0-1-2 are a chain
    assert not torch.equal(got[3], chain[3])  # node 3 sees 0 and itself, not 1 and 2


@needs_kernel
def test_a_tree_row_on_a_branch_gives_the_bits_of_the_chain_it_sees():
    """Node 3 of [-1, 0, 0, 2] sees nodes 0, 2 and 3, with node 1 between them in the cache:
    its bits are those of the chain row over the context and k0, k2, k3 laid out in a row."""
    g = torch.Generator().manual_seed(7)
    ctx, heads, kvh, dim = 20, 9, 3, 64
    k, v = torch.randn(ctx + 4, kvh, dim, generator=g), torch.randn(ctx + 4, kvh, dim, generator=g)
    q = torch.randn(4, heads, dim, generator=g)
    kc, vc = torch.zeros(8, 16, kvh, dim), torch.zeros(8, 16, kvh, dim)
    whole = build_attention_metadata([ctx + 4], [ctx + 4], [[0, 1]], 16)
    write_kv(k, v, kc, vc, whole.slot_mapping)
    tree = build_attention_metadata([4], [ctx + 4], [[0, 1]], 16, [ancestor_mask([-1, 0, 0, 2])])
    got = attention_cpu.cpu_paged_attention(q, kc, vc, tree, 0.125)
    keep = [*range(ctx), ctx, ctx + 2, ctx + 3]
    write_kv(k[keep], v[keep], kc, vc,
             build_attention_metadata([ctx + 3], [ctx + 3], [[4, 5]], 16).slot_mapping)
    chain = attention_cpu.cpu_paged_attention(
        q[[0, 2, 3]], kc, vc, build_attention_metadata([3], [ctx + 3], [[4, 5]], 16), 0.125)
    assert torch.equal(got[2], chain[1]) and torch.equal(got[3], chain[2])
