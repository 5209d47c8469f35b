"""Batch-invariant mode: a position's logits are bit-identical however the forward is shaped.

The same context reaches the target as a prefill (failover re-prefills the committed tokens),
as one decode step at a time, beside other sessions (a prefill chunk and a decode), and as a
verify chunk. Near-tie argmaxes flip on the last bit, so greedy text can only be independent of
load and speculation if these agree exactly. A negative control shows that the default mode's
logits do differ between these shapes, so the comparison is sharp enough to catch it.
"""
import pytest
import torch

from tandem.engine.model_runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.integration
BLOCK = 16
TAIL = 6  # positions whose logits are compared


@pytest.fixture(scope="module")
def context(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Why is the sky blue? Answer in two sentences."}],
        tokenize=False, add_generation_prompt=True) + "The sky looks blue because air"
    return tokenizer(text)["input_ids"]


def table(first_block: int, tokens: int) -> list[int]:
    return list(range(first_block, first_block + -(-tokens // BLOCK)))


def whole_prefill(runner, ids):
    return runner.forward([SeqChunk(ids, 0, table(0, len(ids)), num_logits=TAIL)])


def prefix_then(runner, ids, step, neighbours=False):
    """Prefill all but the tail, then the tail `step` tokens per forward; with neighbours,
    each forward also carries another session's prefill chunk and a third one's decode."""
    head, blocks = len(ids) - TAIL, table(0, len(ids))
    runner.forward([SeqChunk(ids[:head], 0, blocks)])
    other = [5, 17, 300, 42] * 20  # 80 tokens of someone else
    other_blocks, third_blocks = table(20, 200), table(40, 200)
    runner.forward([SeqChunk(other[:7], 0, third_blocks)])
    rows, pos = [], head
    while pos < len(ids):
        n = min(step, len(ids) - pos)
        chunks = [SeqChunk(ids[pos:pos + n], pos, blocks, num_logits=n)]
        if neighbours:  # before and after ours, other lengths, one prefill chunk
            start = (pos - head) * 11
            chunks.insert(0, SeqChunk(other[start:start + 11], start, other_blocks))
            chunks.append(SeqChunk([other[pos % 80]], 7 + pos - head, third_blocks))
        out = runner.forward(chunks)
        rows.append(out[1:1 + n] if neighbours else out)
        pos += n
    return torch.cat(rows)


def shapes(model, ids):
    runner = ModelRunner(model, num_blocks=64, block_size=BLOCK)
    return {"prefill": whole_prefill(runner, ids),
            "decode steps": prefix_then(runner, ids, 1),
            "decode beside others": prefix_then(runner, ids, 1, neighbours=True),
            "verify chunk": prefix_then(runner, ids, TAIL),
            "verify beside others": prefix_then(runner, ids, 3, neighbours=True)}


def test_logits_are_bit_identical_whatever_the_batch(target_model, context):
    model = target_model.batch_invariant_view()
    assert model.linear.invariant_rows >= 1 and model.lm_head is target_model.lm_head
    got = shapes(model, context)
    ref = got["prefill"]
    for name, logits in got.items():
        assert logits.shape == ref.shape
        assert torch.equal(logits, ref), f"{name}: max diff {(logits - ref).abs().max()}"
    # and the logits are the model's: close to the default mode's
    default = whole_prefill(ModelRunner(target_model, 64, BLOCK), context)
    assert torch.allclose(ref, default, atol=1e-3, rtol=0)


def test_negative_control_default_mode_depends_on_the_batch(target_model, context):
    got = shapes(target_model, context)
    ref = got["prefill"]
    assert any(not torch.equal(v, ref) for v in got.values()), \
        "the default path agreed bit for bit everywhere: this comparison cannot catch anything"
