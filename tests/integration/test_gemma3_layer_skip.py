"""Layer skip on Gemma 3 270M: the skip set shipped for it (tandem/engine/skip_sets, found by
`tandem search-skip --model gemma3-270m`) is found for the fetched checkpoint; greedy text
through the real engine with its drafts equals plain decoding; and the verifier serves it from
its own process with the defaults `tandem up --model gemma3-270m` starts it with."""
import asyncio

import grpc
import pytest
from inproc import run_sessions

from tandem.engine.generate import LocalGenerator
from tandem.engine.layer_skip import SHIPPED_DIR, find_skip_set, resolve_skip_set
from tandem.engine.model_runner import ModelRunner
from tandem.models import generation_eos_ids
from tandem.proposers.layer_skip import LayerSkipProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from tandem.spec.cost import CostModel
from tandem.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from tools.colocate import start_layer_skip
from verify_service.config import VerifierConfig
from verify_service.main import start_verifier

pytestmark = pytest.mark.integration
GREEDY = SamplingParams(temperature=0.0)
# The base model (no chat template): prompts it continues
PROMPTS = ["Three rivers in Europe are the", "the cat sat on the mat. the cat sat on the",
           "The sea is"]
TOKENS = 40


@pytest.fixture(scope="module")
def gemma(gemma_paths, gemma_model, gemma_tokenizer):
    paths, model, tok = gemma_paths, gemma_model, gemma_tokenizer
    ids = [tok(p).input_ids for p in PROMPTS]
    plain = LocalGenerator(ModelRunner(model, 64, 16)).generate(
        ids, GREEDY, TOKENS, generation_eos_ids(paths))
    return paths, model, ids, plain


def test_the_shipped_set_is_found_for_the_fetched_checkpoint(gemma):
    paths = gemma[0]
    shipped = SHIPPED_DIR / f"{paths.root.name}.json"
    assert shipped.is_file()
    if not (paths.root / "layer_skip.json").is_file():  # a local search's set comes first
        assert find_skip_set(paths) == shipped
    skip = resolve_skip_set("auto", paths)
    assert skip.num_layers == 18 and {0, 17}.isdisjoint(skip.skip)


class FlatCost(CostModel):
    def observe(self, num_tokens, elapsed_ms):
        pass


def test_layer_skip_greedy_is_identical_to_plain(gemma):
    paths, model, ids, plain = gemma
    skip = resolve_skip_set("auto", paths)
    drafts = {Method.LAYER_SKIP: LayerSkipProposer.over(model, skip, 32 << 20)}
    # A flat cost curve that measured rounds do not move: every round verifies drafts. (The
    # default prior prices this costly draft (c about 0.95) out, and under load so did the
    # measured curve once (CI): the identity would then be vacuous.)
    got, drafted, accepted, _ = run_sessions(model, drafts, Method.LAYER_SKIP, ids, GREEDY,
                                             TOKENS, stop=generation_eos_ids(paths),
                                             cost=FlatCost({q: 1000.0 for q in range(1, 33)}))
    assert got == plain
    assert drafted > 0 and 0 < accepted < drafted  # really drafted, and really checked


def test_the_verifier_serves_it_in_process_by_default(gemma):
    paths, model, ids, plain = gemma

    async def main():
        config = VerifierConfig(model=str(paths.root), kv_cache_mb=64, calibrate_reps=0)
        assert config.layer_skip == "auto"  # what `tandem up --model gemma3-270m` passes
        v = await start_verifier(config, model=model, colocate=start_layer_skip)
        try:
            assert v.colocated is not None and set(v.engine.drafts.hosted) == {Method.LAYER_SKIP}
            async with grpc.aio.insecure_channel(f"127.0.0.1:{v.port}") as ch:
                stub = verify_pb2_grpc.VerifyServiceStub(ch)
                out = []
                async for msg in stub.Generate(verify_pb2.GenerateRequest(
                        session_id="ls", prompt_token_ids=ids[0],
                        sampling=common_pb2.SamplingParams(temperature=0),
                        stopping=verify_pb2.StoppingCriteria(
                            max_new_tokens=TOKENS, stop_token_ids=generation_eos_ids(paths)),
                        speculation=verify_pb2.SpeculationConfig(
                            method=int(Method.LAYER_SKIP))), timeout=120):
                    out += msg.token_ids
                return out, v.colocated.hosts[Method.LAYER_SKIP].worker.stats().tokens_drafted
        finally:
            await v.drain_and_stop(0)

    out, drafted = asyncio.run(main())
    assert out == plain[0] and drafted > 0
