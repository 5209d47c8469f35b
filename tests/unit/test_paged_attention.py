"""Paged attention over a flattened variable-length batch vs. plain dense causal attention."""
import math
import random

import pytest
import torch

from kernels.paged_attention import (
    ancestor_mask,
    build_attention_metadata,
    paged_attention,
    row_attention,
    write_kv,
)

pytestmark = pytest.mark.unit


def dense_reference(q, k, v, scale):
    """q [q_len, H, D] at the end of a context k/v [ctx, KVH, D]; causal."""
    heads, kvh = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kvh, dim=1)
    v = v.repeat_interleave(heads // kvh, dim=1)
    q_len, ctx = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(ctx - q_len, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(q_lens, ctx_lens, heads=4, kvh=2, dim=8, block_size=4, num_blocks=64, seed=0,
             attend=paged_attention):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    k_cache = torch.zeros(num_blocks, block_size, kvh, dim)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered, non-contiguous blocks
    tables, keys, values, queries = [], [], [], []
    for q_len, ctx in zip(q_lens, ctx_lens):
        table = [free.pop() for _ in range(math.ceil(ctx / block_size))]
        tables.append(table)
        keys.append(torch.randn(ctx, kvh, dim, generator=g))
        values.append(torch.randn(ctx, kvh, dim, generator=g))
        queries.append(torch.randn(q_len, heads, dim, generator=g))
    # Cached prefix written beforehand, as earlier forwards would have.
    for table, k, v, q in zip(tables, keys, values, queries):
        prefix = k.shape[0] - q.shape[0]
        if prefix:
            meta = build_attention_metadata([prefix], [prefix], [table], block_size)
            write_kv(k[:prefix], v[:prefix], k_cache, v_cache, meta.slot_mapping)
    meta = build_attention_metadata(list(q_lens), list(ctx_lens), tables, block_size)
    new_k = torch.cat([k[k.shape[0] - q.shape[0]:] for k, q in zip(keys, queries)])
    new_v = torch.cat([v[v.shape[0] - q.shape[0]:] for v, q in zip(values, queries)])
    write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    out = attend(torch.cat(queries), k_cache, v_cache, meta, dim**-0.5)
    expected = torch.cat(
        [dense_reference(q, k, v, dim**-0.5) for q, k, v in zip(queries, keys, values)]
    )
    return out, expected


@pytest.mark.parametrize(
    "q_lens,ctx_lens",
    [
        ([1], [1]),  # first decode step
        ([7], [7]),  # prefill, no prefix
        ([1], [13]),  # decode on a cached prefix
        ([5], [13]),  # verification of 4 drafts + 1 on a cached prefix
        ([1, 1, 1], [3, 9, 17]),  # batched decode
        ([9, 1, 4, 2], [9, 20, 11, 2]),  # mixed prefill / decode / verify
    ],
)
def test_matches_dense_causal_attention(q_lens, ctx_lens):
    out, expected = run_case(q_lens, ctx_lens)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_gqa_and_mha():
    for heads, kvh in [(6, 1), (6, 3), (4, 4)]:
        out, expected = run_case([3, 1], [6, 10], heads=heads, kvh=kvh)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attend", [paged_attention, row_attention])
def test_random_batches_property(attend):
    rng = random.Random(7)
    for trial in range(20):
        batch = rng.randint(1, 5)
        ctx = [rng.randint(1, 30) for _ in range(batch)]
        q = [rng.randint(1, c) for c in ctx]
        out, expected = run_case(q, ctx, seed=trial, attend=attend)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_row_attention_keeps_tree_masks_and_is_batch_invariant():
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(16, 4, 2, 8, generator=g), torch.randn(16, 4, 2, 8, generator=g)
    parents = [-1, 0, 0, 1]  # a tree over the last 4 of 10 positions
    q = torch.randn(4, 4, 8, generator=g)
    tree = build_attention_metadata([4], [10], [[0, 1, 2]], 4, [ancestor_mask(parents)])
    want = paged_attention(q, kc, vc, tree, 0.3)
    torch.testing.assert_close(row_attention(q, kc, vc, tree, 0.3), want)
    # the same chain rows alone, and beside a longer sequence: bit-identical
    chain = build_attention_metadata([4], [10], [[0, 1, 2]], 4)
    alone = row_attention(q, kc, vc, chain, 0.3)
    other = torch.randn(3, 4, 8, generator=g)
    both = build_attention_metadata([3, 4], [15, 10], [[3, 4, 5, 6], [0, 1, 2]], 4)
    beside = row_attention(torch.cat([other, q]), kc, vc, both, 0.3)[3:]
    assert torch.equal(alone, beside)
    last = build_attention_metadata([1], [10], [[0, 1, 2]], 4)
    assert torch.equal(row_attention(q[3:], kc, vc, last, 0.3), alone[3:])


def test_slot_mapping_points_into_block_table():
    meta = build_attention_metadata([2], [6], [[7, 3]], block_size=4)
    # positions 4, 5 live in the second block (3), offsets 0 and 1
    assert meta.slot_mapping.tolist() == [12, 13]


@pytest.mark.parametrize(
    "args,match",
    [
        (([], [], [], 4), "non-empty"),
        (([1], [1, 2], [[0]], 4), "equally long"),
        (([0], [1], [[0]], 4), "q_lens"),
        (([3], [2], [[0]], 4), "exceed its context"),
        (([1], [9], [[0, 1]], 4), "cannot hold"),
        (([1], [1], [[0]], 0), "block_size"),
    ],
)
def test_bad_metadata_raises(args, match):
    with pytest.raises(ValueError, match=match):
        build_attention_metadata(*args)


def test_mixed_batches_attend_decode_rows_apart():
    """Decode rows beside a prefill chunk form their own group (not padded to its length),
    trees keep their masks inside theirs; one-kind batches stay one group."""
    meta = build_attention_metadata([1, 6, 1], [9, 20, 4], [[0, 1, 2], [3, 4, 5, 6, 7], [8]], 4,
                                    [None, ancestor_mask([-1, 0, 0, 1, 2, 2]), None])
    (dec_rows, dec), (rest_rows, rest) = meta.groups
    assert dec_rows.tolist() == [0, 7] and dec.max_seqlen_q == 1 and dec.mask is not None
    assert rest_rows.tolist() == list(range(1, 7)) and rest.has_tree
    assert build_attention_metadata([1, 1], [3, 5], [[0], [1, 2]], 4).groups == ()
    assert build_attention_metadata([3, 2], [3, 5], [[0], [1, 2]], 4).groups == ()
