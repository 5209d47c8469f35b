"""A draft with another tokenizer: SmolLM2-135M (byte-level BPE, 49152 ids) drafts for Gemma 3
270M (SentencePiece-style BPE, 262144 ids). Through real gRPC services greedy text equals
plain decoding's, with drafts proposed and accepted; the q sent is the draft's own
distribution restricted to the shared tokens; and at T=1 the verifier's rejection sampler fed
the bridged draft's real samples emits tokens distributed as the target's p (chi-square)."""
from __future__ import annotations

import pytest
import torch
from chi_square import critical, pearson
from inproc import dear_verify, gateway_cluster

from draft_service.config import DraftConfig
from kernels.sampling import logits_to_probs
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.models import resolve_model
from tandem.proposers.bridged import BridgedProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest
from verify_service.config import VerifierConfig
from verify_service.forward.rejection import SamplingMetadata, SpecDecodeMetadata, verify_chains

pytestmark = pytest.mark.integration
GEMMA = "gemma3-270m"
# Gemma 3 270M is the base model (no chat template): prompts it continues, on completions
PROMPTS = ["1, 2, 3, 4, 5, 6, 7, 8, 9,", "the cat sat on the mat. the cat sat on the"]


@pytest.fixture(scope="module")
def gemma(gemma_paths, gemma_model, gemma_tokenizer):
    return gemma_paths, gemma_model, gemma_tokenizer


@pytest.fixture(scope="module")
def bridged(gemma, target_paths):
    return BridgedProposer.load(target_paths, gemma[0], 96 << 20)


def _drafts_waited_for(verifier) -> None:
    """Every round drafts and waits for its drafts: what is tested is the bridge, not whether
    the bridged draft pays or comes in time. On this CPU its 4 drafts take longer than a step
    of the target: waited for on the start-up estimate (10 ms to the first draft) they came
    late twice, the session was no longer waited for, and in about one run in three no round
    of the three requests verified a draft. Expecting a slow first draft, the first round
    waits for it, and the estimate falls to the measured one as drafts come."""
    engine = verifier.engine
    engine.scheduler.cost, engine.scheduler.sampled_cost = dear_verify(), dear_verify()
    engine.drafts.first.ms = 1000.0


def _prompt(tok, text: str) -> list[int]:
    return tok(text).input_ids  # as /v1/completions tokenizes it


def test_text_through_grpc_equals_plain(gemma, target_paths):
    """Greedy, and sampled with a seed (each position's token is the target's sample under
    noise keyed by seed and position, whatever proposed it): the text equals plain decoding's,
    and the bridged draft's tokens were proposed and accepted."""
    paths, model, tok = gemma

    def verifier(port):
        return VerifierConfig(model=str(paths.root), kv_cache_mb=32, calibrate_reps=0,
                              layer_skip="off", medusa="off", max_draft_wait_ms=2000.0,
                              draft_addresses=(f"127.0.0.1:{port}",))

    config = DraftConfig(port=0, model=str(target_paths.root), tokenizer=str(paths.root),
                         kv_cache_mb=32)
    cases = [(p, {"temperature": 0}) for p in PROMPTS]
    cases.append((PROMPTS[0], {"temperature": 1.0, "seed": 7}))
    drafted = accepted = 0
    with gateway_cluster(config, verifier, model, tok, GEMMA,
                         setup=_drafts_waited_for) as client:
        for prompt, sampling in cases:
            out = {}
            for method in ("none", "draft_model"):
                r = client.post("/v1/completions", json={
                    "model": GEMMA, "max_tokens": 16, **sampling, "prompt": prompt,
                    "speculation": {"method": method, "num_speculative_tokens": 4}})
                assert r.status_code == 200, r.text
                out[method] = r.json()
            texts = {m: b["choices"][0]["text"] for m, b in out.items()}
            assert texts["draft_model"] == texts["none"], sampling
            spec = out["draft_model"]["speculation"]
            drafted += spec["drafted_tokens"]
            accepted += spec["accepted_tokens"]
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_q_is_the_drafts_distribution_over_the_shared_tokens(gemma, target_paths, bridged):
    """At T=1 the q sent sums to 1 over target ids of shared tokens, and equals the draft
    model's own softmax restricted to them and renormalised (its top 8)."""
    _, _, tok = gemma
    ids = _prompt(tok, PROMPTS[0])
    req = DraftRequest(session_key="q", token_ids=ids, num_committed=len(ids), max_tokens=1,
                       sampling=SamplingParams(temperature=1.0), top_n=8)
    (res,) = bridged.propose([req])
    (draft,) = res.tokens
    q = dict(zip(draft.q_ids, draft.q_probs))
    assert draft.token_id in q and len(q) == 8 and sum(q.values()) == pytest.approx(1, abs=1e-5)
    t2d = bridged.bridge.vocab.target_to_draft
    assert all(t2d[t] >= 0 for t in q)
    d_ids, _ = bridged.bridge.draft_ids("check", ids, len(ids))
    runner = ModelRunner(bridged.inner.runner.model, 64, 16)
    logits = runner.forward([SeqChunk(d_ids, 0, list(range(64)))])[0]  # [draft vocab]
    shared = bridged.bridge.vocab.draft_ids
    p = torch.full_like(logits, float("-inf"))
    p[shared] = logits[shared]
    top = p.softmax(-1).topk(8)
    want = top.values / top.values.sum()
    got = torch.tensor([q[int(bridged.bridge.vocab.draft_to_target[d])]
                        for d in top.indices.tolist()])
    assert torch.allclose(got, want, atol=1e-4)
    bridged.release("q")


def test_a_grammar_mask_in_target_ids_restricts_bridged_drafts(gemma, bridged):
    """Structured output: the session's mask (target ids) applies to the bridged draft's rows
    as to any draft's: drafts and q only among the allowed tokens."""
    _, _, tok = gemma
    ids = _prompt(tok, "Is the sea salty? Answer yes or no.")
    allowed = [tok.convert_tokens_to_ids(t) for t in ("Yes", "No", "▁maybe")]
    mask = torch.zeros(1, (bridged.vocab_size + 31) // 32, dtype=torch.int32)
    for t in allowed:
        mask[0, t // 32] |= 1 << (t % 32)
    for temperature in (0.0, 1.0):
        req = DraftRequest(session_key=("mask", temperature), token_ids=ids, num_committed=len(ids),
                           max_tokens=1, sampling=SamplingParams(temperature=temperature),
                           mask=mask)
        (draft,) = bridged.propose([req])[0].tokens
        assert draft.token_id in allowed and set(draft.q_ids) <= set(allowed)
        bridged.release(req.session_key)


def _target_row(model, ids: list[int], top_k: int) -> torch.Tensor:  # [vocab] p at T=1
    logits = ModelRunner(model, 64, 16).forward([SeqChunk(ids, 0, list(range(64)))])
    return logits_to_probs(logits, torch.tensor([1.0]), torch.tensor([top_k]),
                           torch.tensor([1.0]))[0]


def test_verifying_bridged_drafts_gives_the_targets_distribution(gemma, bridged):
    """Drafts really sampled by the bridged draft (T=1, whole vocabulary, top-8 q), each
    verified by the verifier's rejection sampler against the target's p: the token each
    verification emits (the draft, or the one recovered from the residual) follows p."""
    _, model, tok = gemma
    ids = tok("Roses are red, violets are blue").input_ids  # then ",", ".", " and", ...
    p = _target_row(model, ids, 0)
    sampling = SamplingParams(temperature=1.0)
    reqs = [DraftRequest(session_key=("dist", i), token_ids=ids, num_committed=len(ids),
                         max_tokens=1, sampling=sampling) for i in range(64)]
    emitted: list[int] = []
    for _ in range(10):  # 640 drafts; a forward of one token per session after the first
        results = bridged.propose(reqs)
        assert all(r.error is None for r in results), results[0]
        drafts = [[r.tokens[0]] for r in results]
        spec = SpecDecodeMetadata.build(drafts, [False] * 64)
        meta = SamplingMetadata.build([sampling] * len(drafts), [len(ids)] * 64, [2] * 64)
        out = verify_chains(spec, meta, p.expand(2 * len(drafts), -1))
        emitted += out.output_token_ids[:, 0].tolist()
    for r in reqs:
        bridged.release(r.session_key)
    counts = {t: emitted.count(t) for t in set(emitted)}
    stat, dof = pearson(counts, {t: float(v) for t, v in enumerate(p.tolist()) if v > 0})
    assert dof >= 3 and stat < critical(dof), (stat, dof, counts)


def test_a_same_tokenizer_draft_is_not_bridged(target_paths):
    from draft_service.token_space import bridge_target

    same = DraftConfig(model=str(target_paths.root), tokenizer=str(target_paths.root))
    assert bridge_target(same) is None
    other = DraftConfig(model=str(target_paths.root), tokenizer=str(resolve_model(GEMMA).root))
    assert bridge_target(other).root == resolve_model(GEMMA).root
