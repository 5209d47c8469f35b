"""A tensor-parallel verifier of the real default target, served over gRPC: the same greedy
text and logprobs as TP=1 through every path a session takes (plain decode, the verifier's
own ngram/suffix chains, Medusa token trees and their KV moves, chunked prefill), and a dead
rank taking the verifier down.

SmolLM2-135M has 3 KV heads, so its only split is 3 ranks (TP=2 is refused); the TP=2 checks
of every forward run on tiny checkpoints (tests/unit/test_tensor_parallel.py)."""
import asyncio

import grpc
import pytest

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


async def _serve_all(config, model, ids, after=None):
    v = await start_verifier(config, model=model)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{v.port}") as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            got = await asyncio.gather(*[_generate(stub, _request(i, m, ids, i == 0))
                                         for i, m in enumerate(METHODS)])
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


def test_tp2_is_refused_for_three_kv_heads():
    with pytest.raises(ModelError, match="does not divide the model's 3 KV heads"):
        asyncio.run(start_verifier(VerifierConfig(tensor_parallel_size=2)))
