"""ngram, suffix and auto (each round the better of the two) drafted in the verifier's own
step (verify_service/drafts/history.py): no draft worker and no link at all, the same text as plain
decoding, greedy and seeded, and rounds sized by the proposal's confidence (long on a copy,
none without a match)."""
import pytest
from inproc import dear_verify, run_sessions

from tandem.proposers.ngram import NgramProposer
from tandem.proposers.suffix import SuffixProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from verify_service.drafts.history import HistoryDrafts

pytestmark = pytest.mark.integration
GREEDY = SamplingParams(temperature=0.0)


def worker():
    """A draft worker that would serve both methods: sessions must not go to it."""
    return {Method.NGRAM: NgramProposer(), Method.SUFFIX: SuffixProposer()}
TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump.")


@pytest.fixture(scope="module")
def copy_prompts(tokenizer):
    asks = [f"Repeat this text exactly, word for word:\n\n{TEXT}",
            "Correct the spelling and repeat the rest unchanged: 'Teh cat sat on teh mat, "
            "and teh dog sat on teh rug, and teh bird sat on teh branch.'",
            "Name three rivers."]
    return [tokenizer.apply_chat_template([{"role": "user", "content": a}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for a in asks]


@pytest.fixture(scope="module")
def plain_greedy(target_model, tokenizer, copy_prompts):
    """Plain greedy decoding of copy_prompts, 48 tokens: decoded once for the module (the
    first 40 of each are the 40-token text)."""
    return run_sessions(target_model, worker(), Method.NONE, copy_prompts, GREEDY, 48,
                        stop=(tokenizer.eos_token_id,))[0]


@pytest.mark.parametrize("method", [Method.NGRAM, Method.SUFFIX, Method.AUTO])
def test_history_drafts_in_the_verifier_are_lossless_and_need_no_worker(
        target_model, tokenizer, copy_prompts, plain_greedy, method):
    eos, plain = (tokenizer.eos_token_id,), plain_greedy
    rounds = []
    got, drafted, accepted, link = run_sessions(
        target_model, worker(), method, copy_prompts, GREEDY, 48, stop=eos, rounds=rounds,
        max_spec_tokens=12, history=HistoryDrafts(12))
    assert got == plain
    assert link.proposals == 0  # nothing came over the (idle) draft link
    assert drafted > 0 and accepted > 0
    copy = rounds[0]  # the verbatim copy: most rounds verify several drafts, most kept
    assert max(r.drafted for r in copy) >= 4
    assert sum(r.accepted for r in copy) >= 0.6 * sum(len(r.token_ids) for r in copy)
    assert len(copy) < 0.5 * len(got[0])  # far fewer rounds than tokens


def test_seeded_sampling_with_history_drafts_is_the_plain_text(target_model, tokenizer,
                                                                copy_prompts):
    eos = (tokenizer.eos_token_id,)
    seeded = SamplingParams(temperature=0.7, seed=11)
    plain, _, _, _ = run_sessions(target_model, worker(), Method.NONE, copy_prompts[:2], seeded, 40,
                                  stop=eos)
    for method in (Method.NGRAM, Method.SUFFIX, Method.AUTO):
        got, drafted, _, _ = run_sessions(target_model, worker(), method, copy_prompts[:2], seeded,
                                          40, stop=eos, history=HistoryDrafts(8))
        assert got == plain and drafted > 0, method


def test_auto_with_medusa_heads_drafts_chat_too_and_stays_lossless(
        target_model, target_paths, tokenizer, copy_prompts, plain_greedy):
    """auto with the verifier's Medusa heads: where the history has no match (chat) the heads
    propose, so auto drafts and keeps more there than the history alone; text unchanged,
    greedy and seeded."""
    from tandem.engine.medusa import load_for

    heads = load_for(target_model, target_paths, "auto")
    calls = []
    propose = heads.propose_batch
    heads.propose_batch = lambda h, asks: (calls.append(len(asks)), propose(h, asks))[1]
    eos = (tokenizer.eos_token_id,)
    chat = copy_prompts[2:]
    for sampling in (GREEDY, SamplingParams(temperature=0.7, seed=5)):
        plain = [p[:40] for p in plain_greedy] if sampling is GREEDY else run_sessions(
            target_model, worker(), Method.NONE, copy_prompts, sampling, 40, stop=eos)[0]
        history_only = run_sessions(target_model, worker(), Method.AUTO, chat, sampling, 40,
                                    stop=eos, history=HistoryDrafts(8),
                                    cost=dear_verify())
        got, drafted, accepted, link = run_sessions(
            target_model, worker(), Method.AUTO, copy_prompts, sampling, 40, stop=eos,
            history=HistoryDrafts(8), medusa=heads, max_spec_tokens=8,
            cost=dear_verify())
        assert got == plain and link.proposals == 0
        with_heads = run_sessions(target_model, worker(), Method.AUTO, chat, sampling, 40,
                                  stop=eos, history=HistoryDrafts(8), medusa=heads,
                                  max_spec_tokens=8, cost=dear_verify())
        assert with_heads[0] == plain[2:]
        assert with_heads[2] > history_only[2]  # the heads' drafts were verified and kept
    assert calls
