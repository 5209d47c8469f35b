"""Forwards on a thread count chosen by their rows (tandem.engine.forward_threads): the
policy, and the reason it is allowed: an int8 model's logits are the same bits at any
thread count, so a plain decode step on one thread and a verify round on two agree."""
import pytest
import torch
import transformers

from kernels import attention_cpu, int8_cpu
from tandem.engine.forward_threads import ForwardThreads, thread_invariant
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.models import resolve_model

pytestmark = pytest.mark.unit

needs_kernels = pytest.mark.skipif(
    int8_cpu.load() is None or attention_cpu.load() is None
    or not attention_cpu.load().built, reason="needs the C++ int8 and attention kernels")


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Llama whose head_dim (16) the CPU attention kernel takes."""
    path = tmp_path_factory.mktemp("llama16")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path)
    return resolve_model(path)


def test_the_policy_picks_threads_by_rows_and_refuses_zero():
    threads = ForwardThreads(wide=4, narrow=1, wide_rows=3)
    assert [threads.for_rows(r) for r in (1, 2, 3, 64)] == [1, 1, 4, 4]
    for bad in (dict(wide=0), dict(wide=2, narrow=0), dict(wide=2, wide_rows=0)):
        with pytest.raises(ValueError, match="forward threads"):
            ForwardThreads(**bad)


def test_apply_sets_the_calling_threads_count(torch_threads):
    threads = ForwardThreads(wide=2, narrow=1)
    assert threads.wide_rows == 6  # measured: docs/results/forward-threads-2026-11-29.md
    threads.apply(1)
    assert torch.get_num_threads() == 1
    threads.apply(7)
    assert torch.get_num_threads() == 2


def test_float_weights_keep_one_thread_count(checkpoint):
    runner = ModelRunner(LlamaModel.load(checkpoint), num_blocks=8, block_size=4)
    assert not thread_invariant(runner.model)
    assert not runner.use_threads(ForwardThreads(wide=2)) and runner.threads is None


@needs_kernels
def test_int8_logits_are_the_same_bits_at_one_and_two_threads(checkpoint, torch_threads):
    model = LlamaModel.load(checkpoint, "int8")
    assert thread_invariant(model)
    ids = torch.randint(0, 101, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    runs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        runner = ModelRunner(model, num_blocks=16, block_size=4)
        prefill = runner.forward([SeqChunk(ids[:30], 0, list(range(12)), 30)])
        verify = runner.forward([SeqChunk(ids[30:], 30, list(range(12)), 10)])
        runs.append(torch.cat([prefill, verify]))
    assert torch.equal(*runs)


@needs_kernels
def test_a_runner_switches_threads_per_forward_and_keeps_the_bits(checkpoint, torch_threads):
    model = LlamaModel.load(checkpoint, "int8")
    ids = torch.randint(0, 101, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    torch.set_num_threads(2)
    fixed = ModelRunner(model, num_blocks=16, block_size=4)
    want = fixed.forward([SeqChunk(ids, 0, list(range(8)), 20)])
    runner = ModelRunner(model, num_blocks=16, block_size=4)
    assert runner.use_threads(ForwardThreads(wide=2, narrow=1, wide_rows=2))
    got = [runner.forward([SeqChunk(ids[:12], 0, list(range(8)), 12)])]
    assert torch.get_num_threads() == 2
    for i in range(12, 20):  # decode steps: one row each
        got.append(runner.forward([SeqChunk([ids[i]], i, list(range(8)), 1)]))
        assert torch.get_num_threads() == 1
    assert torch.equal(torch.cat(got), want)
