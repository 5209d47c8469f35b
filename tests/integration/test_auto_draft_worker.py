"""auto linked to a real draft worker's model method (GenerateParams.auto_draft): where the
token history has nothing (chat without repetition) auto verifies the worker's drafts, with
the plain text (greedy) and the target's distribution (sampled); while the history matches
the worker is not asked (the link opens with the first ask, then gets every commit)."""
import random

import inproc
import pytest
from chi_square import chi_square
from inproc import run_sessions, target_joint_top2

from tandem.engine.model_runner import ModelRunner
from tandem.proposers.draft_model import DraftModelProposer
from tandem.proposers.ngram import NgramProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Commit, DraftToken, Method
from tandem.spec.cost import CostModel
from tandem.spec.proposer import DraftResult
from tools.bench.inproc import WorkerLink
from verify_service import engine
from verify_service.drafts.history import HistoryDrafts
from verify_service.policy import auto

pytestmark = pytest.mark.integration
GREEDY = SamplingParams(temperature=0.0)
NO_WORKER = {Method.NGRAM: NgramProposer()}  # plain decoding's (unused) worker


class DearVerify(CostModel):
    """A verify forward priced like a big target's (200 ms, whatever its size), never
    re-measured: here the draft model is the target itself on a CPU, as slow as verifying,
    and a model draft pays only where verifying costs much more than drafting."""

    def __init__(self):
        super().__init__({q: 200.0 for q in range(1, 80)})

    def observe(self, num_tokens, elapsed_ms):
        pass


class Recording(WorkerLink):
    """The in-process link, keeping every Commit's run-ahead per session."""

    asks: dict[str, list[int | None]] = {}

    def send(self, msg):
        if isinstance(msg, Commit):
            Recording.asks.setdefault(msg.session_id, []).append(msg.max_run_ahead)
        super().send(msg)


def chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


@pytest.fixture
def recorded(monkeypatch):
    """Which source each verified round's drafts came from, and the links' commits."""
    rounds = []
    learn = engine.learn_acceptance

    def spy(seq, s, accepted, reach, linked):
        if s.num_drafts:
            rounds.append((seq.local.source, s.num_drafts, accepted))
        learn(seq, s, accepted, reach, linked)

    monkeypatch.setattr(engine, "learn_acceptance", spy)
    monkeypatch.setattr(inproc, "WorkerLink", Recording)
    Recording.asks = {}
    return rounds


def test_auto_verifies_the_workers_drafts_where_the_history_has_nothing(
        target_model, tokenizer, recorded):
    prompts = [chat(tokenizer, "Name three rivers."), chat(tokenizer, "Why is the sky blue?")]
    eos = (tokenizer.eos_token_id,)
    plain, _, _, _ = run_sessions(target_model, NO_WORKER, Method.NONE, prompts, GREEDY, 32,
                                  stop=eos)
    proposers = {Method.DRAFT_MODEL: DraftModelProposer(ModelRunner(target_model, 256, 16))}
    got, drafted, accepted, link = run_sessions(
        target_model, proposers, Method.AUTO, prompts, GREEDY, 32, stop=eos,
        history=HistoryDrafts(8), cost=DearVerify(), auto_draft=Method.DRAFT_MODEL)
    assert got == plain
    remote = [r for r in recorded if r[0] is Method.DRAFT_MODEL]
    assert remote and link.proposals > 0  # rounds verified the worker's drafts
    assert sum(a for _, _, a in remote) >= 0.8 * sum(n for _, n, _ in remote)  # the target's own
    assert Recording.asks and all(any(a) for a in Recording.asks.values())


def test_a_worker_that_vanishes_leaves_auto_its_own_proposals(target_model, tokenizer,
                                                               recorded):
    prompts = [chat(tokenizer, "Name three rivers.")]
    eos = (tokenizer.eos_token_id,)
    plain, _, _, _ = run_sessions(target_model, NO_WORKER, Method.NONE, prompts, GREEDY, 32,
                                  stop=eos)
    proposers = {Method.DRAFT_MODEL: DraftModelProposer(ModelRunner(target_model, 256, 16))}
    got, _, _, link = run_sessions(
        target_model, proposers, Method.AUTO, prompts, GREEDY, 32, stop=eos, die_after=3,
        history=HistoryDrafts(8), cost=DearVerify(), auto_draft=Method.DRAFT_MODEL)
    assert got == plain and not link.alive  # the link broke mid-session: same text


def test_the_worker_is_not_asked_while_the_history_matches(target_model, tokenizer, recorded):
    text = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor "
            "jugs. How vexingly quick daft zebras jump.")
    prompt = chat(tokenizer, f"Repeat this text exactly, word for word:\n\n{text}")
    eos = (tokenizer.eos_token_id,)
    plain, _, _, _ = run_sessions(target_model, NO_WORKER, Method.NONE, [prompt], GREEDY, 48,
                                  stop=eos)
    proposers = {Method.DRAFT_MODEL: DraftModelProposer(ModelRunner(target_model, 256, 16))}
    got, _, _, _ = run_sessions(
        target_model, proposers, Method.AUTO, [prompt], GREEDY, 48, stop=eos,
        history=HistoryDrafts(8), cost=DearVerify(), auto_draft=Method.DRAFT_MODEL,
        max_spec_tokens=8)
    assert got == plain
    history = [r for r in recorded if r[0] in (Method.SUFFIX, Method.NGRAM)]
    assert history and sum(a for _, _, a in history) > 10  # the copy was drafted from history
    assert not Recording.asks  # never even linked: its worker was never asked for drafts


class SkewedDraft:
    """Drafts from a skewed q over a few tokens, really sampled from it, and sends that q."""

    method = Method.DRAFT_MODEL

    def __init__(self, ids: list[int], seed: int):
        self.ids, self.rng = ids, random.Random(seed)
        self.probs = [w / sum(range(1, len(ids) + 1)) for w in range(len(ids), 0, -1)]

    def propose(self, requests):
        return [DraftResult([DraftToken(self.rng.choices(self.ids, self.probs)[0],
                                        tuple(self.ids), tuple(self.probs))])
                for _ in requests]

    def release(self, session_key):
        pass


def test_sampled_auto_with_worker_drafts_keeps_the_targets_distribution(
        target_model, tokenizer, recorded, monkeypatch):
    """Worker asked from the first commit (history off): the second token is verified
    against the worker's draft; the first two tokens' joint is the target's."""
    monkeypatch.setattr(auto, "HEADS_AFTER_MISSES", 0)
    prompt = chat(tokenizer, "Pick a random fruit.")
    joint = target_joint_top2(target_model, prompt)
    seconds = sorted({b for _, b in joint})
    sampling = SamplingParams(temperature=1.0, top_k=2)
    got, rounds = [], []
    for seed in range(12):  # 20 sessions an engine: k_allowed stays >= 1 (max_verify_tokens)
        history = HistoryDrafts(8)
        history.fill = lambda seqs, k_allowed: None  # the worker's drafts alone
        g, _, _, _ = run_sessions(
            target_model, {Method.DRAFT_MODEL: SkewedDraft(seconds, seed)}, Method.AUTO,
            [prompt] * 20, sampling, 2, max_spec_tokens=1, history=history,
            cost=DearVerify(), auto_draft=Method.DRAFT_MODEL, rounds=rounds)
        got += g
    verified = [tuple(g[:2]) for g, r in zip(got, rounds) if len(r) > 1 and r[1].drafted]
    assert len(verified) >= 180
    assert sum(n for s, n, _ in recorded if s is Method.DRAFT_MODEL) >= len(verified)
    counts = {o: verified.count(o) for o in set(verified)}
    stat, critical = chi_square(counts, joint)
    assert stat < critical, (counts, joint)
