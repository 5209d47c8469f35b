"""A tensor-parallel verifier of the real default target, served over gRPC: the same greedy
text and logprobs as TP=1 through every path a session takes (plain decode, the verifier's
own ngram/suffix chains, Medusa token trees and their KV moves, chunked prefill), and a dead
rank taking the verifier down.

SmolLM2-135M has 3 KV heads, so its only split is 3 ranks (TP=2 is refused); the TP=2 checks
of every forward run on tiny checkpoints (tests/unit/test_tensor_parallel.py)."""
import asyncio
import shutil

import grpc
import pytest
import torch
import transformers

from tandem.models import ModelError
from tandem.spec import Method
from tandem.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from verify_service.config import VerifierConfig
from verify_service.main import start_verifier

pytestmark = pytest.mark.integration

PROMPT = ("The river flows to the sea. The river flows to the sea. The river flows to the sea."
          " Where does the river flow? The river flows to")
METHODS = (Method.NONE, Method.AUTO, Method.MEDUSA)


def _request(i, method, ids, logprobs=False):
    return verify_pb2.GenerateRequest(
        session_id=f"s{i}-{method.name}", prompt_token_ids=ids,
        sampling=common_pb2.SamplingParams(temperature=0),
        stopping=verify_pb2.StoppingCriteria(max_new_tokens=20),
        speculation=verify_pb2.SpeculationConfig(method=int(method)),
        logprobs=logprobs, top_logprobs=3 if logprobs else 0)


async def _generate(stub, req):
    tokens, logprobs, accepted = [], [], 0
    async for resp in stub.Generate(req, timeout=300):
        tokens += resp.token_ids
        logprobs += [lp.logprob for lp in resp.logprobs]
        accepted = resp.totals.accepted_tokens
    return tokens, logprobs, accepted


async def _serve_all(config, model, ids, methods=METHODS, after=None):
    v = await start_verifier(config, model=model)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{v.port}") as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            got = await asyncio.gather(*[_generate(stub, _request(i, m, ids, i == 0))
                                         for i, m in enumerate(methods)])
            if after is not None:
                await after(v, stub)
            return got
    finally:
        await v.drain_and_stop(0)


async def _dead_rank_fails_the_verifier(v, stub):
    v.tp.procs[0].kill()
    await asyncio.wait_for(v.failed.wait(), timeout=30)  # the heartbeat or the next step


def test_tp3_serves_the_same_greedy_text_and_a_dead_rank_fails_it(target_model, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    base = dict(kv_cache_mb=32, calibrate_reps=0, threads=1, prefill_chunk_tokens=16)
    expected = asyncio.run(_serve_all(VerifierConfig(**base), target_model, ids))
    config = VerifierConfig(**base, tensor_parallel_size=3, tensor_parallel_timeout_s=8)
    got = asyncio.run(_serve_all(config, None, ids, after=_dead_rank_fails_the_verifier))
    for (tokens, logprobs, _), (want, want_lp, _) in zip(got, expected):
        assert tokens == want and len(tokens) == 20
        assert logprobs == pytest.approx(want_lp, abs=1e-4)
    assert len(got[0][1]) == 20
    assert got[1][2] > 0 and got[2][2] > 0  # the chains and the trees were verified


@pytest.fixture(scope="module")
def tiny_with_tokenizer(target_paths, tmp_path_factory):
    """A random 2-layer Llama over SmolLM2's tokenizer, 4 heads on 2 KV heads: TP=2 served."""
    path = tmp_path_factory.mktemp("tiny-tp2")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(target_paths.root / name, path / name)
    return path


def test_tp2_serves_the_same_greedy_text_as_tp1(tiny_with_tokenizer, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    base = dict(model=str(tiny_with_tokenizer), dtype="float32", kv_cache_mb=8,
                calibrate_reps=0, threads=1, prefill_chunk_tokens=16)
    methods = METHODS[:2]  # no Medusa heads for a random model (trees: the unit tests)
    expected = asyncio.run(_serve_all(VerifierConfig(**base), None, ids, methods))
    got = asyncio.run(_serve_all(VerifierConfig(**base, tensor_parallel_size=2), None, ids,
                                 methods))
    for (tokens, logprobs, _), (want, want_lp, _) in zip(got, expected):
        assert tokens == want and len(tokens) == 20
        assert logprobs == pytest.approx(want_lp, abs=1e-4)


def test_tp3_logits_match_tp1(target_model):
    """Prefill and an 8-token verify chunk: max |diff| measured 4.6e-5 on logits up to ~33
    (1.4e-6 relative; a TP=1 model with its kernels tuned apart differs by as much)."""
    from tandem.engine.model_runner import ModelRunner, SeqChunk, kv_bytes_per_token
    from verify_service.tp.group import start_leader

    ids = torch.randint(0, 49152, (48,), generator=torch.Generator().manual_seed(0)).tolist()

    def run(runner):
        return torch.cat([runner.forward([SeqChunk(ids[:40], 0, [0, 1, 2], num_logits=40)]),
                          runner.forward([SeqChunk(ids[40:], 40, [0, 1, 2], num_logits=8)])])

    expected = run(ModelRunner(target_model, 4, 16))
    leader = start_leader("SmolLM2-135M-Instruct", 3, "float32", threads=1)
    try:
        got = run(leader.make_runner(4 * 16 * kv_bytes_per_token(leader.model), 16, False))
    finally:
        leader.close()
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_tp2_is_refused_for_three_kv_heads():
    with pytest.raises(ModelError, match="does not divide the model's 3 KV heads"):
        asyncio.run(start_verifier(VerifierConfig(tensor_parallel_size=2)))
