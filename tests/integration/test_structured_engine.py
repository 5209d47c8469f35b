"""Structured output in the verifier's engine: sampled under a grammar, speculation keeps plain
constrained sampling's distribution, even from a draft that proposes forbidden tokens."""
from __future__ import annotations

import random

import pytest
import torch
from chi_square import chi_square
from inproc import run_sessions

from kernels.sampling import logits_to_probs
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.grammar import GrammarSpec
from tandem.grammar.masks import allowed, apply_masks
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken, Method
from tandem.spec.proposer import DraftResult

pytestmark = pytest.mark.integration
CHOICES = ["yes sir", "yes madam", "yes indeed", "no sir", "no madam", "no way"]


class ForbiddenFirst:
    """Drafts one token from q = {forbidden: 0.6, allowed: 0.4}, really sampled from q (so the
    rejection rule applies): the forbidden one must always be rejected, and the recovered
    token must come from the residual of the masked target and this q."""

    method = Method.DRAFT_MODEL

    def __init__(self, forbidden: int, allowed: int, seed: int = 0):
        self.forbidden, self.allowed, self.rng = forbidden, allowed, random.Random(seed)

    def propose(self, requests):
        out = []
        for _ in requests:
            tok = self.forbidden if self.rng.random() < 0.6 else self.allowed
            out.append(DraftResult([DraftToken(tok, (self.forbidden, self.allowed),
                                               (0.6, 0.4))]))
        return out

    def release(self, session_key):
        pass


def masked_probs(target_model, grammar_compiler, spec, ids: list[int], committed: list[int]):
    """The target's distribution after ids + committed, masked by the grammar at committed
    and renormalised (T = 1): plain constrained sampling's."""
    runner = ModelRunner(target_model, 8, 16)
    logits = runner.forward([SeqChunk(ids + committed, 0, list(range(8)))])  # [1, vocab]
    mask = grammar_compiler.state_now(spec, tuple(committed)).masks([])
    p = logits_to_probs(apply_masks(logits, [mask], [1]), torch.tensor([1.0]),
                        torch.tensor([0]), torch.tensor([1.0]))[0]
    return {t: float(v) for t, v in enumerate(p.tolist()) if v > 0}


def test_sampled_speculation_keeps_the_masked_targets_distribution(
        target_model, tokenizer, grammar_compiler):
    """The first token comes from the prefill (no drafts); the second is verified against
    one draft: tested at it, given the commonest first token."""
    spec = GrammarSpec.choice(CHOICES)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Is the sea salty? Answer yes or no, with sir or madam."}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    first = masked_probs(target_model, grammar_compiler, spec, prompt, [])
    forbidden = tokenizer(" The", add_special_tokens=False).input_ids[0]
    sir = tokenizer(" sir", add_special_tokens=False).input_ids[0]
    assert forbidden not in first
    # Small engines: one whose drafts keep failing learns to stop asking for them.
    n, rounds, got, drafted, accepted = 240, [], [], 0, 0
    for seed in range(n // 8):
        g, d, a, _ = run_sessions(
            target_model, {Method.DRAFT_MODEL: ForbiddenFirst(forbidden, sir, seed)},
            Method.DRAFT_MODEL, [prompt] * 8, SamplingParams(temperature=1.0), 4,
            max_spec_tokens=1, grammar=(spec, grammar_compiler), rounds=rounds)
        got, drafted, accepted = got + g, drafted + d, accepted + a
    assert all(g[0] in first for g in got)
    t1 = max(set(g[0] for g in got), key=[g[0] for g in got].count)
    expected = masked_probs(target_model, grammar_compiler, spec, prompt, [t1])
    assert len(expected) >= 3 and forbidden not in expected
    seconds = [g[1] for g, r in zip(got, rounds) if g[0] == t1 and r[1].drafted]
    assert len(seconds) >= n // 5 and drafted and accepted < drafted
    assert all(t in expected for t in seconds)
    counts = {t: seconds.count(t) for t in set(seconds)}
    stat, critical = chi_square(counts, expected)
    assert stat < critical, (counts, expected)


def _proposer(method: Method, target_model):
    from tandem.engine.layer_skip import SkipSet
    from tandem.proposers.draft_model import DraftModelProposer
    from tandem.proposers.layer_skip import LayerSkipProposer

    if method == Method.LAYER_SKIP:  # the target without every other layer
        n = target_model.cfg.num_layers
        return LayerSkipProposer.over(target_model, SkipSet(n, tuple(range(1, n, 2))), 8 << 20)
    return DraftModelProposer(ModelRunner(target_model, 64, 16))


@pytest.mark.parametrize("method, temperature", [(Method.DRAFT_MODEL, 0.0),
                                                 (Method.DRAFT_MODEL, 1.0),
                                                 (Method.LAYER_SKIP, 1.0)])
def test_the_draft_worker_drafts_under_the_grammar(target_model, tokenizer, grammar_compiler,
                                                   method, temperature):
    """A session opened with a grammar drafts only what it allows, with q masked by it and
    renormalised; without it the same draft model drafts prose here."""
    import asyncio

    from draft_service.limits import Limits
    from draft_service.worker import DraftWorker
    from tandem.grammar.compiler import LazyCompiler
    from tandem.spec import Open

    spec = GrammarSpec.json_schema({"type": "object", "required": ["name"],
                                    "properties": {"name": {"type": "string"}}})
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story about a cat."}],
        add_generation_prompt=True, tokenize=True, return_dict=False)

    async def drafts(grammar):
        worker = DraftWorker({method: _proposer(method, target_model)},
                             Limits(target_model.cfg.vocab_size, 2048),
                             grammars=LazyCompiler(lambda: grammar_compiler))
        stream = worker.open_stream()
        worker.handle(stream, Open("s", list(prompt), temperature=temperature, seed=5,
                                   method=int(method), max_run_ahead=6,
                                   grammar=grammar, grammar_start=len(prompt)))
        got = [await asyncio.wait_for(stream.get(), 60) for _ in range(6)]
        await worker.aclose()
        return [p.token for p in got]

    constrained = asyncio.run(drafts(spec))
    state = grammar_compiler.state_now(spec)
    for d in constrained:
        ok = set(torch.nonzero(allowed(state.masks([])[0][None], len(tokenizer))[0]).flatten()
                 .tolist())
        assert d.token_id in ok and set(d.q_ids) <= ok  # q lives inside the grammar
        assert state.commit([d.token_id])
    free = asyncio.run(drafts(None))
    assert not grammar_compiler.state_now(spec).commit([d.token_id for d in free])


def test_a_grammar_that_breaks_ends_its_session_with_an_error_and_only_it(
        target_model, tokenizer, grammar_compiler):
    """A grammar past llguidance's limits mid-generation (here: a matcher put in its error
    state) ends that session with finish_reason "error" and a short reason, never with
    forced-EOS text; the session beside it in the same steps decodes as usual."""
    import asyncio

    from tandem.engine.block_manager import BlockManager
    from tandem.engine.generate import LocalGenerator
    from tandem.engine.model_runner import ModelRunner as Runner
    from tandem.spec.cost import CostModel
    from verify_service.config import SchedulerConfig
    from verify_service.engine import Engine, EngineConfig
    from verify_service.forward.executor import Executor
    from verify_service.policy.scheduler import Scheduler
    from verify_service.session.params import GenerateParams

    spec = GrammarSpec.choice(["positive", "negative"])
    broken = grammar_compiler.state_now(spec)
    assert not broken.commit(tokenizer(" zebra", add_special_tokens=False).input_ids)
    prompt = tokenizer("The sky is", add_special_tokens=False).input_ids
    greedy = SamplingParams(temperature=0.0)
    plain = LocalGenerator(Runner(target_model, 64, 16)).generate([prompt], greedy, 6)[0]

    def params(session_id, grammar=None):
        return GenerateParams(session_id=session_id, prompt=tuple(prompt), committed=(),
                              sampling=greedy, max_new_tokens=6, stop_token_ids=frozenset(),
                              grammar=grammar)

    async def main():
        engine = Engine(Executor(Runner(target_model, 128, 16)),
                        Scheduler(BlockManager(128, 16), SchedulerConfig(), CostModel()),
                        EngineConfig(max_sessions=8), target_model.cfg.vocab_size)
        loop = asyncio.create_task(engine.run())
        bad = engine.submit(params("bad", spec), broken)
        good = engine.submit(params("good"))
        outs = {}
        for name, q in (("bad", bad), ("good", good)):
            got, last = [], None
            while last is None or last.finish_reason is None:
                last = await asyncio.wait_for(q.get(), 60)
                got += last.token_ids
            outs[name] = got, last
        loop.cancel()
        return outs

    outs = asyncio.run(main())
    tokens, last = outs["bad"]
    assert last.finish_reason == "error" and tokens == []
    assert last.error.startswith("grammar:") and len(last.error) < 400
    assert outs["good"][0] == plain and outs["good"][1].finish_reason == "length"
