"""Medusa trees in the real engine step: greedy and seeded sampling identical to plain decoding
on the real target with the shipped heads, the target's joint distribution kept under unseeded
sampling on a tiny random target (and a broken sibling rule caught by the same measurement),
and the verifier serving medusa over gRPC."""
import asyncio
from collections import Counter

import grpc
import pytest
import torch
import transformers
from inproc import run_sessions, target_joint_top2

from kernels import tree_rejection as tree
from tandem.engine.generate import LocalGenerator
from tandem.engine.llama import LlamaModel
from tandem.engine.medusa import MedusaConfig, MedusaHeads, find_medusa, load_for
from tandem.engine.model_runner import ModelRunner
from tandem.models import resolve_model
from tandem.proposers.ngram import NgramProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from tandem.spec.cost import CostModel
from tandem.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from verify_service.config import VerifierConfig
from verify_service.main import start_verifier

pytestmark = pytest.mark.integration
GREEDY = SamplingParams(temperature=0.0)
FLAT = {q: 10.0 for q in range(1, 80)}  # a cost curve on which the whole tree always pays
NGRAM = {Method.NGRAM: NgramProposer()}  # the in-process worker needs one proposer


@pytest.fixture(scope="module")
def chats(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
            for t in ("Name three rivers.", "What is a tuple in Python?")]


@pytest.fixture(scope="module")
def plain32(target_model, chats):
    """Plain greedy decoding of the chats, 32 tokens (no stop token: the 24-token text is its
    prefix), decoded once for the module."""
    return LocalGenerator(ModelRunner(target_model, 64, 16)).generate(chats, GREEDY, 32)


@pytest.fixture(scope="module")
def heads(target_model, target_paths):
    assert find_medusa(target_paths) is not None, "heads for the default target must ship"
    return load_for(target_model, target_paths, "auto")


def _medusa(model, heads, prompts, sampling, n, max_spec_tokens=16, **kw):
    return run_sessions(model, NGRAM, Method.MEDUSA, prompts, sampling, n, medusa=heads,
                        max_spec_tokens=max_spec_tokens, cost=CostModel(dict(FLAT)), **kw)


def test_medusa_greedy_and_seeded_are_identical_to_plain(target_model, heads, chats, plain32):
    plain = plain32
    got, drafted, accepted, _ = _medusa(target_model, heads, chats, GREEDY, 32)
    assert got == plain
    assert drafted > 0 and 0 < accepted < drafted  # trees really verified
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    want, _, _, _ = run_sessions(target_model, NGRAM, Method.NONE, chats, seeded, 32)
    got, _, accepted, _ = _medusa(target_model, heads, chats, seeded, 32)
    assert got == want and accepted > 0


def test_medusa_chains_are_its_top1_heads_and_identical_to_plain(target_model, heads, chats,
                                                                plain32):
    """draft_shape chain: each round verifies at most one node per head, and the text is the
    same; the tree verifies more nodes per round on the same prompts."""
    plain = [p[:24] for p in plain32]
    widths = {}
    for shape in (False, True):
        rounds = []
        got, drafted, _, _ = _medusa(target_model, heads, chats, GREEDY, 24, tree=shape,
                                     rounds=rounds)
        assert got == plain and drafted > 0
        widths[shape] = max(r.drafted for outs in rounds for r in outs)
    assert widths[False] <= heads.cfg.num_heads < widths[True]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(2)
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    root = tmp_path_factory.mktemp("tiny-medusa")
    transformers.LlamaForCausalLM(cfg).float().eval().save_pretrained(root)
    model = LlamaModel.load(resolve_model(root), tune=False)
    # Every token a sibling at depth 1, so the target's top-2 always compete there (a sibling
    # rule that is wrong shows only when two candidates both have mass).
    mcfg = MedusaConfig(2, 1, 32, tuple(range(61)),
                        (*((r,) for r in range(61)), (0, 0), (0, 1), (1, 0)))
    h = MedusaHeads(mcfg, model.lm_head)
    with torch.no_grad():
        h.weight.normal_(0, 0.3)
    return model, h.eval()


def _joint_tv(tiny, n=400):
    model, heads = tiny
    prompt = [3, 14, 15, 9, 26]
    sampling = SamplingParams(temperature=1.0, top_k=2)
    joint = target_joint_top2(model, prompt)
    # One session at a time: the verify budget then takes the whole 64-node tree.
    got, drafted, accepted, _ = _medusa(model, heads, [prompt] * n, sampling, 3, batch=1,
                                        max_spec_tokens=64)
    counts = Counter(tuple(t[:2]) for t in got)
    assert set(counts) <= set(joint)
    return 0.5 * sum(abs(counts[o] / n - p) for o, p in joint.items()), drafted, accepted


def test_medusa_sampling_keeps_the_targets_joint_distribution(tiny, monkeypatch):
    tv, drafted, accepted = _joint_tv(tiny)
    assert tv < 0.1, f"TV {tv:.3f}"  # E[TV] of an exact sampler at n=400 ~0.04
    assert drafted > 0 and accepted > 0

    def no_residual(drafts, parents, probs, generator=None):
        """The classic bug: every sibling tried against the unchanged p."""
        kids, node, acc, nodes = tree.children_of(parents), -1, [], []
        while True:
            p = probs[node + 1]
            for c in kids.get(node, ()):
                if float(torch.rand(())) < p[drafts[c].token_id]:
                    break
            else:
                return tree.TreePath(acc, nodes, int(torch.multinomial(p, 1)))
            acc.append(drafts[c].token_id)
            nodes.append(c)
            node = c

    monkeypatch.setattr(tree, "reject", no_residual)
    # The bug moves p1^2*p2 ~ 0.12 of each second-token conditional onto the first-tried
    # sibling (the top-2 are ~0.5 each here), so E[TV] ~ 0.125; at n=400 its sd (~0.02) let
    # it dip under 0.1. At n=1200 (sd ~0.012) a cut at 0.08 is ~3.7 sd below it and ~4 sd
    # above an exact sampler's TV at that n (~0.02).
    bad_tv, _, _ = _joint_tv(tiny, n=1200)
    assert bad_tv > 0.08, f"negative control TV {bad_tv:.3f}"


def test_the_verifier_serves_medusa(target_model, chats, target_paths):
    plain = LocalGenerator(ModelRunner(target_model, 64, 16)).generate(chats[:1], GREEDY, 24)

    async def main():
        v = await start_verifier(VerifierConfig(layer_skip="off", calibrate_reps=1),
                                 model=target_model)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{v.port}") as ch:
                stub = verify_pb2_grpc.VerifyServiceStub(ch)
                greedy = await _generate(stub, chats[0], 0.0, None)
                typical = await _generate(stub, chats[0], 0.7, verify_pb2.TypicalAcceptance(
                    posterior_threshold=0.09, posterior_alpha=0.3))
                with pytest.raises(grpc.aio.AioRpcError) as bad:  # typical is medusa-only
                    await _generate(stub, chats[0], 0.7, verify_pb2.TypicalAcceptance(
                        posterior_threshold=0.09, posterior_alpha=0.3), Method.NGRAM)
                return greedy, typical, bad.value
        finally:
            await v.drain_and_stop(0)

    (tokens, last), (typical, typical_last), bad = asyncio.run(main())
    assert tokens == plain[0] and not last.totals.lossy
    # Typical acceptance is marked lossy once it accepted drafts (rounds with drafts).
    assert typical and typical_last.totals.lossy == (typical_last.totals.drafted_tokens > 0)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "medusa" in bad.details()


async def _generate(stub, prompt, temperature, typical, method=Method.MEDUSA):
    spec = verify_pb2.SpeculationConfig(method=int(method), typical_acceptance=typical)
    req = verify_pb2.GenerateRequest(
        session_id=f"m{temperature}{method}", prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(temperature=temperature),
        stopping=verify_pb2.StoppingCriteria(max_new_tokens=24), speculation=spec)
    tokens, last = [], None
    async for resp in stub.Generate(req):
        tokens += list(resp.token_ids)
        last = resp
    return tokens, last
