"""The target, its KV cache, sampling and rejection on every device this host has.

Each test runs once per device present (the CPU here; also `cuda` where torch sees a GPU) and
holds the result to the CPU fp32 reference: the same logits (to fp tolerance), the same greedy
text, the same seeded text with speculation as without. `gpu` tests add what only a GPU can
show: the flash-attn path in bf16, and a verifier and its draft model on different devices.
"""
import pytest
import torch
from inproc import run_sessions

from tandem.engine.generate import LocalGenerator
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.sampling_params import SamplingParams
from tandem.spec import Method

pytestmark = pytest.mark.integration

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PROMPT = "The three primary colours are red, yellow and"


@pytest.fixture(scope="module", params=DEVICES)
def placed(request, target_paths, target_model):
    """The fp32 target on each device present (the shared CPU one for "cpu")."""
    if request.param == "cpu":
        return target_model
    return LlamaModel.load(target_paths, "float32", device=request.param)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer(PROMPT).input_ids


def _all_logits(model, ids, block_size=16):
    runner = ModelRunner(model, -(-len(ids) // block_size) + 1, block_size)
    table = list(range(runner.num_blocks))
    head = runner.forward([SeqChunk(ids[:-3], 0, table, num_logits=len(ids) - 3)])
    tail = runner.forward([SeqChunk(ids[-3:], len(ids) - 3, table, num_logits=3)])  # decode-like
    return torch.cat([head, tail]).float().cpu()  # [len(ids), vocab]


def test_logits_match_the_cpu_reference(placed, target_model, prompt_ids):
    got, ref = _all_logits(placed, prompt_ids), _all_logits(target_model, prompt_ids)
    assert got.shape == ref.shape
    # exact on the CPU; TF32-free fp32 GEMMs on a GPU stay within ~1e-3 of it
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=1e-3)


def test_greedy_text_matches_the_cpu(placed, target_model, prompt_ids):
    def greedy(model):
        return LocalGenerator(ModelRunner(model, 16, 16)).generate(
            [prompt_ids], SamplingParams(temperature=0.0), 24)[0]

    assert greedy(placed) == greedy(target_model)


@pytest.mark.parametrize("method", [Method.NGRAM, Method.DRAFT_MODEL])
def test_speculation_is_lossless_on_the_device(placed, tokenizer, prompt_ids, method):
    """Greedy and seeded sampled sessions give the text plain decoding gives, on the device
    (seeded noise is drawn on the CPU and copied, so a seed means the same everywhere)."""
    from tandem.proposers.draft_model import DraftModelProposer
    from tandem.proposers.ngram import NgramProposer

    if method is Method.NGRAM:
        proposer = NgramProposer()
    else:  # the target drafting for itself: drafts accepted, the bonus path exercised
        proposer = DraftModelProposer(ModelRunner(placed, 64, 16))
    # a repetitive prompt, so that n-gram lookup has something to draft from
    prompts = [tokenizer("a b c d a b c d a b c d a b").input_ids, prompt_ids[:5]]
    greedy, seeded = SamplingParams(temperature=0.0), SamplingParams(0.8, top_p=0.95, seed=7)
    for sampling in (greedy, seeded):
        plain, *_ = run_sessions(placed, {method: proposer}, Method.NONE, prompts, sampling, 16)
        spec, drafted, accepted, _ = run_sessions(placed, {method: proposer}, method, prompts,
                                                  sampling, 16)
        assert spec == plain
        # n-gram drafts are instant (the repeated prompt); the self-draft's come in time only
        # when the host keeps up, so they are not asserted
        assert method is not Method.NGRAM or drafted > 0


def test_bfloat16_weights_agree_with_float32(target_paths, target_model, prompt_ids):
    """The --dtype path: bf16 weights and KV cache (here on the CPU) pick the fp32 argmax at
    nearly every position of a prompt."""
    bf16 = LlamaModel.load(target_paths, "bfloat16", tune=False)
    assert bf16.embed.dtype == torch.bfloat16
    got, ref = _all_logits(bf16, prompt_ids), _all_logits(target_model, prompt_ids)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree


@pytest.mark.gpu
def test_flash_attention_serving_path_in_bf16(target_paths, target_model, prompt_ids):
    """bf16 on a GPU with blocks of 256: flash-attn's paged kernel where installed, else SDPA
    on the GPU; either way the argmax agrees with the CPU fp32 reference."""
    from kernels.attention import default_block_size

    model = LlamaModel.load(target_paths, "bfloat16", device="cuda")
    got = _all_logits(model, prompt_ids, default_block_size(model.device))
    ref = _all_logits(target_model, prompt_ids)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8


@pytest.mark.gpu
@pytest.mark.parametrize("target_dev,draft_dev", [("cuda", "cpu"), ("cpu", "cuda")])
def test_verifier_and_draft_on_different_devices(target_paths, target_model, prompt_ids,
                                                 target_dev, draft_dev):
    """Heterogeneous placement in miniature: the draft model's proposals (ids and q on the
    wire) verified by a target on another device, greedy and seeded, identical to plain."""
    from tandem.proposers.draft_model import DraftModelProposer

    def on(d):
        return target_model if d == "cpu" else LlamaModel.load(target_paths, "float32",
                                                               device=d)

    target = on(target_dev)
    proposer = DraftModelProposer(ModelRunner(on(draft_dev), 64, 16))
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3)):
        plain, *_ = run_sessions(target, {Method.DRAFT_MODEL: proposer}, Method.NONE,
                                 [prompt_ids], sampling, 16)
        spec, drafted, _, _ = run_sessions(target, {Method.DRAFT_MODEL: proposer},
                                           Method.DRAFT_MODEL, [prompt_ids], sampling, 16)
        assert spec == plain and drafted > 0
