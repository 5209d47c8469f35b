"""The verifier engine with scripted in-process draft links: lossless whatever the drafts."""
import asyncio

import pytest
import torch
from inproc import OnePool, run_sessions

from kernels.sampling import logits_to_probs
from tandem.engine.block_manager import BlockManager
from tandem.engine.generate import LocalGenerator
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.sampling_params import SamplingParams
from tandem.spec import Close, DraftToken, Method, Open, Proposal
from tandem.spec.cost import CostModel, StepCost
from verify_service.config import SchedulerConfig
from verify_service.engine import Engine, EngineConfig
from verify_service.forward.executor import Executor
from verify_service.forward.step import StepInput
from verify_service.policy.scheduler import Scheduler
from verify_service.session.params import GenerateParams

pytestmark = pytest.mark.integration
GREEDY = SamplingParams(temperature=0.0)
N_NEW = 24


class ScriptedLink:
    """Acts like a draft worker: run-ahead from the committed end, restart on a new epoch."""

    def __init__(self, engine, script, wrong_every=0, break_after=None, garbage=False,
                 silent=False):
        self.engine, self.script, self.alive, self.silent = engine, script, True, silent
        self.wrong_every, self.break_after, self.garbage = wrong_every, break_after, garbage
        self.address, self.sent, self.state = "scripted", 0, {}
        self.run_aheads = []  # max_run_ahead of every commit

    def send(self, msg):
        if isinstance(msg, Open):
            self.state[msg.session_id] = [len(msg.token_ids), msg.epoch, len(msg.token_ids)]
        elif not isinstance(msg, Close):
            st = self.state[msg.session_id]
            st[0] = msg.start_position + len(msg.token_ids)
            self.run_aheads.append(msg.max_run_ahead)
            if msg.epoch != st[1]:
                st[1], st[2] = msg.epoch, st[0]
        else:
            self.state.pop(msg.session_id, None)
            return
        asyncio.get_running_loop().call_soon(self._propose, msg.session_id)

    def _propose(self, session_id):
        st = self.state.get(session_id)
        if st is None or not self.alive or self.silent:
            return
        committed, epoch, nxt = st
        prompt_len, full = self.script[session_id]
        while nxt < committed + 4 and nxt - prompt_len < len(full):
            tok = full[nxt - prompt_len]
            if self.wrong_every and nxt % self.wrong_every == 0:
                tok = (tok + 1) % 49152
            draft = DraftToken(tok)
            if self.garbage and nxt % 3 == 0:  # malformed: must be dropped, not trusted
                draft = DraftToken(tok, (tok,), (0.3,))
            self.engine.drafts.on_reply(self, Proposal(session_id, epoch, nxt, draft))
            nxt += 1
            self.sent += 1
            if self.break_after is not None and self.sent >= self.break_after:
                self.alive = False
                self.engine.drafts.on_link_broken(self)
                return
        st[2] = nxt


def chat(tokenizer, text):
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


@pytest.fixture(scope="module")
def reference(target_model, tokenizer):
    prompts = [chat(tokenizer, t) for t in ("Name three rivers.", "Count from one to ten.",
                                            "Describe a cat in one sentence.")]
    gen = LocalGenerator(ModelRunner(target_model, 128, 16))
    outs = gen.generate(prompts, GREEDY, N_NEW, (tokenizer.eos_token_id,))
    return prompts, outs


class PinnedCost(CostModel):
    """Round costs fixed so that k = 3 pays best (the scripted draft runs 4 ahead, so a
    fourth draft is waiting): k does not follow the host's load."""

    def __init__(self, ms=None):
        super().__init__(ms or {1: 40.0, 2: 42.0, 3: 44.0, 4: 46.0, 5: 1000.0})

    def observe(self, num_tokens, elapsed_ms):
        pass


def run_engine(target_model, tokenizer, reference, sampling=GREEDY, cost=None, **link_kw):
    prompts, outs = reference

    async def main():
        runner = ModelRunner(target_model, 128, 16)
        sched = Scheduler(BlockManager(128, 16), SchedulerConfig(max_spec_tokens=4),
                          cost or CostModel())
        engine = Engine(Executor(runner), sched, EngineConfig(max_draft_wait_ms=50),
                        target_model.cfg.vocab_size)
        link = ScriptedLink(engine, {f"s{i}": (len(p), o) for i, (p, o) in
                                     enumerate(zip(prompts, outs))}, **link_kw)
        engine.drafts.pool = OnePool(link)
        loop_task = asyncio.create_task(engine.run())
        queues = [engine.submit(GenerateParams(
            session_id=f"s{i}", prompt=tuple(p), committed=(), sampling=sampling,
            max_new_tokens=N_NEW, stop_token_ids=frozenset({tokenizer.eos_token_id}),
            method=Method.DRAFT_MODEL)) for i, p in enumerate(prompts)]
        results, all_rounds = [], []
        for q in queues:
            tokens, rounds = [], []
            while not rounds or rounds[-1].finish_reason is None:
                rounds.append(await asyncio.wait_for(q.get(), 60))
                tokens += rounds[-1].token_ids
            results.append((tokens, rounds[-1]))
            all_rounds += rounds
        loop_task.cancel()
        return results, engine, all_rounds

    return asyncio.run(main())


def test_perfect_drafts_are_accepted_and_identical(target_model, tokenizer, reference):
    results, _, _ = run_engine(target_model, tokenizer, reference)
    for (tokens, last), ref in zip(results, reference[1]):
        assert tokens == ref
        assert last.accepted_total > 0 and last.rounds < len(ref)  # fewer rounds than tokens


def test_wrong_drafts_change_nothing(target_model, tokenizer, reference):
    results, _, _ = run_engine(target_model, tokenizer, reference, wrong_every=3)
    for (tokens, last), ref in zip(results, reference[1]):
        assert tokens == ref
        assert last.drafted_total > last.accepted_total  # some were rejected


def test_malformed_proposals_are_dropped(target_model, tokenizer, reference):
    results, _, _ = run_engine(target_model, tokenizer, reference, garbage=True)
    assert [t for t, _ in results] == reference[1]


def test_draft_link_breaking_fails_open(target_model, tokenizer, reference):
    results, engine, _ = run_engine(target_model, tokenizer, reference, break_after=5)
    assert [t for t, _ in results] == reference[1]
    assert not engine.drafts.links  # nothing still attached to the dead link


def test_commits_ask_for_as_many_drafts_as_the_next_round_uses(target_model, tokenizer,
                                                               reference):
    """Run-ahead follows the chosen k: k + 1 drafts while they pay (k = 3 at the pinned
    costs); none once every draft is rejected and k falls to 0 (at costs where a draft must
    be accepted half the time to pay), but two before each probe round."""
    _, engine, _ = run_engine(target_model, tokenizer, reference, cost=PinnedCost())
    good = engine.drafts.pool.link.run_aheads
    assert good and good.count(4) > len(good) // 2 and max(good) == 4
    steep = PinnedCost({1: 40.0, 2: 60.0, 3: 80.0, 4: 100.0, 5: 1000.0})
    _, engine, _ = run_engine(target_model, tokenizer, reference, cost=steep, wrong_every=1)
    bad = engine.drafts.pool.link.run_aheads
    assert bad and bad.count(0) > len(bad) // 2 and 2 in bad[bad.index(0):]


def test_stochastic_sessions_carry_the_bonus_row(target_model, tokenizer, reference):
    """Sampling sessions whose next draft is waiting skip the bonus and keep run-ahead."""
    # Unseeded sampling draws from the global RNG: fixed here, since whether any round keeps
    # all its drafts (1-8 of ~50 rounds over seeds 0-7) depends on the draws.
    torch.manual_seed(0)
    results, engine, rounds = run_engine(target_model, tokenizer, reference,
                                         sampling=SamplingParams(temperature=0.3),
                                         cost=PinnedCost())
    assert all(len(t) == N_NEW or last.finish_reason == "stop" for t, last in results)
    carried = [r for r in rounds if r.drafted and not r.bonus
               and r.accepted == r.drafted]
    assert carried, "no round carried its bonus row"
    assert not engine.table.carried  # released with their sessions


def test_stochastic_verification_matches_target_distribution(target_model, tokenizer):
    """Through the real engine step: first emitted token ~ target p, whatever q drafted."""
    prompt = chat(tokenizer, "Pick a random fruit.")
    n, top_k = 3000, 6
    # Blocks of 16 (not one of 256): each of a step's 500 sequences gathers its whole blocks
    # in every layer, and the prompt fills ~3 of 16.
    runner, table = ModelRunner(target_model, 8, 16), list(range(len(prompt) // 16 + 1))
    runner.forward([SeqChunk(prompt[:-1], 0, table)])  # shared cached prefix for all samples
    sampling = SamplingParams(temperature=1.0, top_k=top_k)
    logits = runner.forward([SeqChunk(prompt[-1:], len(prompt) - 1, table)])[0]
    top = logits.topk(top_k)
    p = torch.softmax(top.values, -1)
    ids = top.indices.tolist()
    # A deliberately skewed sparse q over the same support, draft sampled from it.
    q = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(q, n, replacement=True, generator=gen).tolist()
    core = Executor(runner)
    counts = torch.zeros(top_k)
    # Batches of 500 sequences sharing block 0: their draft tokens' KV writes collide at one
    # slot, but only row 0 (which attends to the shared prefix alone) decides the first token.
    for start in range(0, n, 500):
        inputs = [StepInput([prompt[-1], ids[j]], len(prompt) - 1, table,
                            [DraftToken(ids[j], tuple(ids), tuple(q.tolist()))],
                            sampling) for j in draws[start:start + 500]]
        outcomes, _ = core.execute(inputs)
        for o in outcomes:
            first = o.accepted[0] if o.accepted else o.next_token
            counts[ids.index(first)] += 1
    tv = 0.5 * (counts / n - p).abs().sum().item()
    # E[TV] for an exact sampler ~ sqrt(K / (2 pi n)) = 0.018 at K=6, n=3000; 3x margin.
    assert tv < 0.055, f"TV {tv:.4f}; p={p.tolist()} got={(counts / n).tolist()}"
    assert 0.5 * (q - p).abs().sum().item() > 0.15  # q really differs from p


def test_carried_distribution_verifies_the_waiting_draft_losslessly(target_model, tokenizer):
    """docs/design/brief.md step 5: the unsampled bonus row of one round verifies the next draft."""
    prompt = chat(tokenizer, "Name a colour.")
    n, top_k, L = 3000, 5, len(prompt)
    # Blocks of 16, as above: 500 sequences a step gather ~3 of them, not one of 256.
    runner, table = ModelRunner(target_model, 8, 16), list(range(L // 16 + 1))
    sampling = SamplingParams(temperature=1.0, top_k=top_k)
    logits = runner.forward([SeqChunk(prompt, 0, table)])  # the whole prompt is cached
    carried = logits_to_probs(logits, torch.tensor([1.0]), torch.tensor([top_k]),
                              torch.tensor([1.0]))[0]
    ids = carried.topk(top_k).indices.tolist()
    p = carried[ids]
    q = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1])
    draws = torch.multinomial(q, n, replacement=True,
                              generator=torch.Generator().manual_seed(1)).tolist()
    core, counts = Executor(runner), torch.zeros(top_k)
    for start in range(0, n, 500):
        inputs = [StepInput([ids[j]], L, table,
                            [DraftToken(ids[j], tuple(ids), tuple(q.tolist()))], sampling,
                            carried=carried) for j in draws[start:start + 500]]
        for o in core.execute(inputs)[0]:
            counts[ids.index(o.accepted[0] if o.accepted else o.next_token)] += 1
    tv = 0.5 * (counts / n - p).abs().sum().item()
    assert tv < 0.05, f"TV {tv:.4f}"  # E[TV] ~ sqrt(5 / (2 pi 3000)) = 0.016
    # And a round that accepts everything with sample_bonus off hands back its bonus row.
    inp = StepInput([ids[0]], L, table, [DraftToken(ids[0], (ids[0],), (1.0,))],
                    SamplingParams(temperature=1.0), carried=torch.nn.functional.one_hot(
                        torch.tensor(ids[0]), carried.shape[0]).float(), sample_bonus=False)
    (out,), _ = core.execute([inp])
    assert out.accepted == [ids[0]] and out.next_token is None
    expected = torch.softmax(runner.forward([SeqChunk([ids[0]], L, table)])[0], -1)
    torch.testing.assert_close(out.carry, expected, atol=1e-5, rtol=1e-4)


class PanicException(BaseException):
    """What a native extension raises on a panic (pyo3's is a BaseException)."""


class PoisonExecutor(Executor):
    """Fails any step holding the poison token, as a NaN row would fail the sampler."""

    POISON = 49151
    error: type[BaseException] = ValueError

    def execute(self, inputs):
        if any(self.POISON in i.token_ids for i in inputs):
            raise self.error("logits contain NaN or +inf")
        return super().execute(inputs)


@pytest.mark.parametrize("error", [ValueError, PanicException])
def test_a_failing_session_is_failed_alone(target_model, tokenizer, reference, error):
    """A step that fails is retried session by session: only the bad one fails ("fault":
    the client's 500, not replayed on another verifier), even by a native panic; the
    other, batched with it, still gets exactly the plain greedy text."""
    prompts, outs = reference

    async def main():
        sched = Scheduler(BlockManager(128, 16), SchedulerConfig(), CostModel())
        poisoned = PoisonExecutor(ModelRunner(target_model, 128, 16))
        poisoned.error = error
        engine = Engine(poisoned, sched,
                        EngineConfig(), target_model.cfg.vocab_size)
        loop_task = asyncio.create_task(engine.run())
        queues = [engine.submit(GenerateParams(
            session_id=session_id, prompt=tuple(p), committed=(), sampling=GREEDY,
            max_new_tokens=N_NEW, stop_token_ids=frozenset({tokenizer.eos_token_id}),
            method=Method.NONE)) for session_id, p in
            (("good", prompts[0]), ("bad", [*prompts[1], PoisonExecutor.POISON]))]
        got = []
        for q in queues:
            tokens, last = [], None
            while last is None or last.finish_reason is None:
                last = await asyncio.wait_for(q.get(), 60)
                tokens += last.token_ids
            got.append((tokens, last.finish_reason))
        loop_task.cancel()
        return got, engine

    (good, good_reason), (bad, bad_reason), = asyncio.run(main())[0]
    assert good == outs[0] and good_reason in ("length", "stop")
    assert bad == [] and bad_reason == "fault"


class BrokenExecutor(Executor):
    """Every forward fails, whatever it holds: a dead tensor-parallel rank, a lost device."""

    def execute(self, inputs):
        raise RuntimeError("gloo: connection reset by peer")


def test_a_step_that_fails_for_everyone_aborts_them_for_failover(target_model, tokenizer,
                                                                 reference):
    """No session is to blame when each fails alone too: they are aborted (the gateway
    resumes them on another verifier), not failed as a 500."""
    prompts, _ = reference

    async def main():
        sched = Scheduler(BlockManager(128, 16), SchedulerConfig(), CostModel())
        engine = Engine(BrokenExecutor(ModelRunner(target_model, 128, 16)), sched,
                        EngineConfig(), target_model.cfg.vocab_size)
        loop_task = asyncio.create_task(engine.run())
        queues = [engine.submit(GenerateParams(
            session_id=f"s{i}", prompt=tuple(p), committed=(), sampling=GREEDY,
            max_new_tokens=N_NEW, stop_token_ids=frozenset({tokenizer.eos_token_id}),
            method=Method.NONE)) for i, p in enumerate(prompts[:2])]
        reasons = [(await asyncio.wait_for(q.get(), 60)).finish_reason for q in queues]
        loop_task.cancel()
        return reasons

    assert asyncio.run(main()) == ["abort", "abort"]


def test_seeded_sampling_depends_on_the_seed_only(target_model, tokenizer, reference):
    """A seeded session's token at each position is the target's sample under that position's
    keyed noise: the same text with good drafts, bad drafts, a draft that dies at once, and
    alone or batched with other sessions."""
    seeded = SamplingParams(temperature=0.8, seed=7)
    good, _, _ = run_engine(target_model, tokenizer, reference, sampling=seeded)
    bad, _, _ = run_engine(target_model, tokenizer, reference, sampling=seeded, wrong_every=2)
    dead, _, _ = run_engine(target_model, tokenizer, reference, sampling=seeded, break_after=0)
    prompts, outs = reference
    alone, _, _ = run_engine(target_model, tokenizer, (prompts[:1], outs[:1]), sampling=seeded)
    texts = [t for t, _ in good]
    assert texts == [t for t, _ in bad] == [t for t, _ in dead]
    assert alone[0][0] == texts[0]
    assert texts != outs  # it sampled (greedy would reproduce the reference)
    assert sum(last.accepted_total for _, last in good) > 0  # and drafts were accepted


def test_tandem_generate_with_a_seed_gives_the_servers_text(target_model, tokenizer, reference):
    """`tandem generate --seed S` (LocalGenerator) keys its noise by (seed, position) as the
    verifier does: the same text as a served session with seed S."""
    seeded = SamplingParams(temperature=0.8, seed=7)
    served, _, _ = run_engine(target_model, tokenizer, reference, sampling=seeded)
    prompts, outs = reference
    gen = LocalGenerator(ModelRunner(target_model, 128, 16))
    local = [gen.generate([p], seeded, N_NEW, (tokenizer.eos_token_id,))[0] for p in prompts]
    assert local == [t for t, _ in served] and local != outs


def test_a_black_holed_draft_costs_little_waiting(target_model, tokenizer, reference):
    """A draft stream that takes commits but never answers (a partition, not a close): the
    text is unchanged, late drafts count as misses, speculation switches off and the
    session stops waiting."""
    results, engine, rounds = run_engine(target_model, tokenizer, reference, silent=True)
    assert [t for t, _ in results] == reference[1]
    waits = [r.draft_wait_ms for r in rounds if r.num_committed > 1]
    late = waits[len(waits) // 2:]  # the second half of every session's rounds
    assert sum(w > 1.0 for w in late) <= len(late) // 4, waits
    assert all(engine.drafts.linked(s) or s.finished for s in engine.sessions.values())


def test_chunked_prefill_gives_the_same_text(target_model, tokenizer):
    """A long prompt computed 16 tokens per step beside decoding sessions (and by EAGLE-free
    speculation) gives the text it gives in one forward."""
    from tandem.proposers.ngram import NgramProposer

    long = tokenizer("Summarise: " + "The river flows past the old mill and the bridge. " * 12
                     ).input_ids
    prompts = [tokenizer("Count: one two three").input_ids, long, long[:40]]
    runs = {chunk: run_sessions(target_model, {Method.NGRAM: NgramProposer()}, Method.NGRAM,
                                prompts, SamplingParams(temperature=0.0), 12,
                                prefill_chunk_tokens=chunk)[0]
            for chunk in (0, 16)}
    assert len(long) > 100 and runs[16] == runs[0]


@pytest.mark.parametrize("steep", [False, True])
def test_the_batch_plan_drops_drafts_a_compute_bound_step_cannot_afford(target_model, tokenizer,
                                                                        steep):
    """Four sessions in one batch, ngram drafts that pay alone: a step curve where rows are
    nearly free keeps them; one where every row costs a whole step's share drops them. The
    text is plain decoding's either way, and the engine measures its steps."""
    from tandem.proposers.ngram import NgramProposer

    text = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"
    prompts = [tokenizer(text).input_ids] * 4
    greedy = SamplingParams(temperature=0.0)
    plain = LocalGenerator(ModelRunner(target_model, 128, 16)).generate(prompts, greedy, 16)
    alone = CostModel({q: 30.0 + 0.1 * q for q in range(1, 18)})  # drafting pays alone
    curve = {q: 30.0 * (q * q if steep else 1 + 0.01 * q) for q in (1, 2, 4, 8, 16, 32, 64)}
    cost = StepCost(curve)
    got, drafted, accepted, _ = run_sessions(
        target_model, {Method.NGRAM: NgramProposer()}, Method.NGRAM, prompts, greedy, 16,
        batch=4, cost=alone, step_cost=cost)
    assert got == plain and cost.observed  # decode steps were measured
    if steep:
        assert drafted <= 8  # at most the rounds run alone (a session's last, say)
    else:
        assert drafted > 16 and accepted > 0
