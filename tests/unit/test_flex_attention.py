"""FlexAttention over the paged cache (kernels/flex_attention.py) against the reference, eager
on the CPU: chains, mixed batches, token trees, and a whole model forward; and the per-call
kernel choice (kernels/attention.py)."""
import pytest
import torch
from test_paged_attention import run_case

from kernels import attention as attn
from kernels.flex_attention import flex_paged_attention, is_available
from kernels.paged_attention import ancestor_mask, build_attention_metadata, paged_attention
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tools.gpu_check.models import tiny_family

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not is_available(), reason="no flex_attention in this torch")]


@pytest.mark.parametrize("q_lens,ctx_lens", [([1], [9]), ([5], [5]), ([4], [13]),
                                             ([1, 1, 1], [3, 17, 8]), ([3, 1, 6], [7, 12, 6])])
def test_chains_match_dense_attention(q_lens, ctx_lens):
    out, expected = run_case(q_lens, ctx_lens, attend=flex_paged_attention)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_trees_match_the_reference():
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(8, 4, 2, 8, generator=g), torch.randn(8, 4, 2, 8, generator=g)
    trees = [ancestor_mask([-1, 0, 0, 1]), None, ancestor_mask([-1, -1, 1, 1, 2])]
    meta = build_attention_metadata([4, 1, 5], [10, 6, 12], [[0, 1, 2], [3, 4], [5, 6, 7]],
                                    4, trees)
    q = torch.randn(10, 4, 8, generator=g)
    assert meta.has_tree
    torch.testing.assert_close(flex_paged_attention(q, kc, vc, meta, 0.3),
                               paged_attention(q, kc, vc, meta, 0.3), atol=1e-5, rtol=1e-4)


def test_a_model_forward_on_flex_gives_the_reference_logits():
    model = tiny_family("qwen3")
    table = list(range(10))

    def logits():
        runner = ModelRunner(model, 10, 4)
        prompt = runner.forward([SeqChunk(list(range(1, 20)), 0, table, 19)])
        tree = runner.forward([SeqChunk([3, 4, 5, 6], 19, table, 4, parents=(-1, 0, 0, 2))])
        return torch.cat([prompt, tree])

    want = logits()
    previous = attn.use_kernel("flex")
    try:
        got = logits()
    finally:
        attn.use_kernel(previous)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_kernel_choice():
    meta = build_attention_metadata([4], [10], [[0, 1, 2]], 4, [ancestor_mask([-1, 0, 0, 1])])
    q, kc = torch.zeros(4, 4, 8), torch.zeros(3, 4, 2, 8)
    # a CPU tree: the reference (head_dim 8 is not for the C++ kernel, kernels/attention_cpu.py)
    assert attn.kernel_for(q, kc, meta) == "reference"
    with pytest.raises(ValueError, match="must be one of"):
        attn.use_kernel("fast")
    assert attn.use_kernel("flex") == "auto"
    try:
        assert attn.kernel_for(q, kc, meta) == "flex"
    finally:
        attn.use_kernel("auto")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_flex_on_cuda_serves_tree_rounds():
    """On a GPU a tree round takes compiled flex (kernels.attention's choice), in bf16 within
    rounding of the CPU fp32 reference."""
    g = torch.Generator().manual_seed(5)
    kc, vc = torch.randn(8, 16, 2, 64, generator=g), torch.randn(8, 16, 2, 64, generator=g)
    meta = build_attention_metadata([6, 1], [40, 30], [[0, 1, 2], [3, 4]], 16,
                                    [ancestor_mask([-1, 0, 0, 1, 1, 2]), None])
    q = torch.randn(7, 4, 64, generator=g)
    want = paged_attention(q, kc, vc, meta, 0.125)
    on = [t.to("cuda", torch.bfloat16) for t in (q, kc, vc)]
    assert attn.kernel_for(on[0], on[1], meta.to("cuda")) == "flex"
    got = attn.attention(*on, meta.to("cuda"), 0.125)
    torch.testing.assert_close(got.float().cpu(), want, atol=3e-2, rtol=3e-2)
