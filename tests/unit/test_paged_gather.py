"""The reference paged attention gathers each sequence's KV a block at a time: the same values
as the slot-by-slot gather, so the same attention bits (issue 49)."""
import pytest
import torch

import kernels.paged_attention as pa
from kernels.paged_attention import ancestor_mask, build_attention_metadata, paged_attention

pytestmark = pytest.mark.unit

LAYOUTS = [  # (q_lens, seq_lens, trees)
    ([1] * 16, [40 + 7 * i for i in range(16)], None),  # a decode step, ragged contexts
    ([1, 4, 1, 3, 1], [17, 33, 5, 64, 48], None),  # decode and verify rows together
    ([4, 1], [20, 9], [ancestor_mask([-1, 0, 0, 1]), None]),  # a token tree beside decode
    ([30], [30], None),  # a prefill
    ([1], [50], None),  # one session's decode
    ([5, 5], [37, 16], None),  # verify rows only
]


def _slot_gather(cache, meta):  # the previous gather: one copy per slot
    kvh, dim = cache.shape[2], cache.shape[3]
    return cache.view(-1, kvh, dim)[meta.kv_slots].transpose(1, 2)


@pytest.mark.parametrize("q_lens,seq_lens,trees", LAYOUTS)
def test_block_gather_gives_the_slot_gathers_values_and_attention(q_lens, seq_lens, trees,
                                                                   monkeypatch):
    torch.manual_seed(len(q_lens))
    bs, kvh, dim, heads = 16, 3, 64, 9
    tables, nxt = [], 1
    for s in seq_lens:  # scattered block ids, as a long-running cache hands them out
        n = -(-s // bs)
        tables.append([(nxt + 5 * j) % 97 for j in range(n)])
        nxt += 11
    kc, vc = torch.randn(97, bs, kvh, dim), torch.randn(97, bs, kvh, dim)
    meta = build_attention_metadata(q_lens, seq_lens, tables, bs, trees)
    metas = [g for _, g in meta.groups] or [meta]
    for m in metas:
        assert torch.equal(pa.gather_blocks(kc, m), _slot_gather(kc, m))
    q = torch.randn(sum(q_lens), heads, dim)
    new = paged_attention(q, kc, vc, meta, 0.125)
    monkeypatch.setattr(pa, "gather_blocks", _slot_gather)
    assert torch.equal(new, paged_attention(q, kc, vc, meta, 0.125))
