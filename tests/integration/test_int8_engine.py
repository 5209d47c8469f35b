"""Weight-only int8 in the real engine step, on the real target.

An int8 verifier (either kind: fp32 or bf16 activations) is lossless with respect to the int8
target it serves: speculative greedy output equals plain greedy decoding of that same model.
An int8 draft model (here the target itself, quantized) drafting for the fp32 target changes
nothing in the output and is accepted most of the time, since int8 moves the logits only
slightly.
"""
import pytest
from inproc import run_sessions

from kernels import int8_cpu
from tandem.engine.generate import LocalGenerator
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner
from tandem.proposers.draft_model import DraftModelProposer
from tandem.proposers.suffix import SuffixProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method

pytestmark = pytest.mark.integration
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def int8_target(target_paths):
    return LlamaModel.load(target_paths, "int8")


@pytest.fixture(scope="module")
def chats(tokenizer):
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
               for t in ("Name three rivers.",
                         "Repeat exactly: one two three one two three one two three")]
    return prompts, (tokenizer.eos_token_id,)


def plain(model, prompts, eos, n=32):
    return LocalGenerator(ModelRunner(model, 128, 16)).generate(
        [list(p) for p in prompts], GREEDY, n, eos)


def test_int8_verifier_is_lossless_for_its_own_target(int8_target, chats):
    prompts, eos = chats
    got, drafted, accepted, _ = run_sessions(int8_target, {Method.SUFFIX: SuffixProposer()},
                                             Method.SUFFIX, prompts, GREEDY, 32, stop=eos)
    assert got == plain(int8_target, prompts, eos)
    assert drafted > 0 and accepted > 0  # the repeating prompt was really speculated


@pytest.mark.skipif(int8_cpu.load_bf16() is None, reason="needs a CPU with AVX512-BF16")
def test_int8_bf16_verifier_is_lossless_for_its_own_target(target_paths, chats):
    model = LlamaModel.load(target_paths, "int8-bf16")
    prompts, eos = chats
    got, drafted, accepted, _ = run_sessions(model, {Method.SUFFIX: SuffixProposer()},
                                             Method.SUFFIX, prompts, GREEDY, 32, stop=eos)
    assert got == plain(model, prompts, eos)
    assert drafted > 0 and accepted > 0


def test_int8_draft_model_leaves_fp32_output_unchanged(target_model, int8_target, chats):
    prompts, eos = chats
    draft = DraftModelProposer(ModelRunner(int8_target, 256, 16))
    got, drafted, accepted, _ = run_sessions(target_model, {Method.DRAFT_MODEL: draft},
                                             Method.DRAFT_MODEL, prompts, GREEDY, 32, stop=eos)
    assert got == plain(target_model, prompts, eos)
    assert drafted > 0 and accepted >= 0.7 * drafted
