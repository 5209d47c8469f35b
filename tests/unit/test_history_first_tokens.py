"""The first tokens of an answer and when speculation pays (issue 49): history methods draft
from the prompt at the very first decode step, k climbs fast on a run of full acceptances and
drops on a miss, and a session whose rounds do not pay stops speculating. Rounds are played
without a model: the verifier's own history drafts, auto's pick, the scheduler's k and what a
round teaches, against a known answer."""
import pytest

from tandem.engine.block_manager import BlockManager
from tandem.proposers.ngram import NgramProposer
from tandem.proposers.suffix import SuffixConfig, SuffixProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest, Method
from tandem.spec.cost import CostModel
from verify_service.config import SchedulerConfig
from verify_service.drafts.history import HistoryDrafts
from verify_service.policy import auto
from verify_service.policy.feedback import learn_acceptance
from verify_service.policy.scheduler import ScheduledSeq, Scheduler
from verify_service.session.params import GenerateParams
from verify_service.session.sequence import Sequence

pytestmark = pytest.mark.unit

CURVE = {1: 20.0, 2: 21.0, 4: 26.0, 8: 37.0, 16: 60.0, 17: 62.0}  # ms by new tokens
TEMPLATE = [900, 901, 902]  # the chat template between the prompt and the answer
PASSAGE = list(range(100, 160))  # what the answer copies
PROMPT = [1, 2, 3, 50, 51, *PASSAGE, 52, 53, *TEMPLATE]


def _session(method, sched, prompt=PROMPT, max_new=64):
    seq = Sequence(GenerateParams(session_id="s", prompt=tuple(prompt), committed=(),
                                  sampling=SamplingParams(temperature=0.0),
                                  max_new_tokens=max_new, stop_token_ids=frozenset(),
                                  method=method))
    seq.local.in_verifier = True
    sched.running.append(seq)
    return seq


def _setup(method, prompt=PROMPT, max_new=64):
    sched = Scheduler(BlockManager(256, 16), SchedulerConfig(max_spec_tokens=16),
                      CostModel(dict(CURVE)))
    history = HistoryDrafts(16, SuffixConfig(per_tenant=True, cache_tokens=0))
    return sched, history, _session(method, sched, prompt, max_new)


def _round(sched, history, seq, answer):
    """One round as the engine plays it, against the known answer: (k, accepted)."""
    history.fill([seq], sched.k_allowed)
    auto.pick(sched, seq)
    k = min(sched.desired_k(seq), len(seq.drafts))
    drafts = [d.token_id for d in seq.drafts[:k]]
    reach = sched.reach(seq) if k else None
    done = len(seq.output)
    n = 0
    while n < k and done + n < len(answer) and drafts[n] == answer[done + n]:
        n += 1
    s = ScheduledSeq(seq, [seq.tokens[-1], *drafts], seq.num_tokens - 1, k, False, k)
    learn_acceptance(seq, s, n, reach, lambda _: False)
    seq.commit(drafts[:n], answer[done + n] if done + n < len(answer) else 0)
    st = seq.stats  # as verify_service/sessions.py records a round
    st.rounds, st.drafted, st.accepted = st.rounds + 1, st.drafted + k, st.accepted + n
    return k, n


def _play(method, answer, rounds=None, prompt=PROMPT):
    sched, history, seq = _setup(method, prompt, len(answer))
    seq.commit([], answer[0])  # the prefill's token
    played = []
    while not seq.finished and (rounds is None or len(played) < rounds):
        played.append(_round(sched, history, seq, answer))
    return played, seq


def _req(tokens, k=8):
    return DraftRequest(session_key="a", token_ids=list(tokens), num_committed=len(tokens),
                        max_tokens=k, sampling=SamplingParams())


@pytest.mark.parametrize("proposer", [NgramProposer(), SuffixProposer(SuffixConfig())])
def test_the_prompt_gives_a_draft_at_the_first_decode_step(proposer):
    """The first decode step's tail is the template and the answer's first token: no
    anchor-long match anywhere, yet the prompt holds what follows that token."""
    first = PROMPT + [PASSAGE[0]]
    got = proposer.propose([_req(first)])[0]
    assert [t.token_id for t in got.tokens][:4] == PASSAGE[1:5]
    assert 0 < got.scores[0] < 1 and list(got.scores) == sorted(got.scores, reverse=True)


@pytest.mark.parametrize("method,third", [(Method.NGRAM, 15), (Method.AUTO, 15),
                                          (Method.SUFFIX, 7)])
def test_a_copy_drafts_from_the_first_round_and_k_climbs_on_full_acceptances(method, third):
    """n-gram lookup (and auto, which takes the longer of two agreeing proposals) reach the
    cap by the third round; suffix decoding drafts at most its match's length (its
    spec_factor), doubling each round."""
    played, seq = _play(method, PASSAGE[:48], rounds=4)
    ks = [k for k, _ in played]
    assert ks[0] >= 1  # drafted at the very first decode step
    assert all(n == k for k, n in played)  # a verbatim copy: every draft kept
    assert ks == sorted(ks) and ks[1] >= 3 and ks[2] >= third


@pytest.mark.parametrize("method", [Method.NGRAM, Method.SUFFIX, Method.AUTO])
def test_k_drops_on_a_miss(method):
    answer = PASSAGE[:24] + [7, 8, 9, 10, 11, 12] + PASSAGE[24:50]
    played, _ = _play(method, answer, rounds=8)
    miss = next(i for i, (k, n) in enumerate(played) if n < k)
    before, after = played[miss][0], played[miss + 1][0]
    # The round after the miss may guess that the model added one token and the copy goes on
    # (ngram.resume_match; here it added six, the guess fails); the round after that drafts
    # far less: down fast once the copy is broken.
    assert after < before / 2 or played[miss + 1][1] == 0
    assert played[miss + 2][0] < before / 2


def test_auto_stops_speculating_where_its_rounds_do_not_pay():
    """Chat-like text whose one-token matches never continue: after a few rounds the session
    verifies no drafts (plain decoding), apart from the scheduler's rare probes."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, *TEMPLATE]
    answer = []
    for i in range(64):  # every token seen before, never with the same follower
        answer += [1 + i % 9, 200 + i]
    played, seq = _play(Method.AUTO, answer, prompt=prompt)
    drafted = [k for k, _ in played]
    assert sum(n for _, n in played) == 0
    assert max(drafted) == 1  # one-token matches: never more than one draft
    late = drafted[len(drafted) // 2:]  # (ngram and suffix's short-match fallback each
    # propose the same one-token match: each source's correction has to fall)
    assert sum(1 for k in late if k) <= len(late) // 16 + 1  # the scheduler's probes at most
    assert all(seq.est.source_scale[m] < 0.3 for m in seq.est.drafted_from)


def test_after_a_miss_k_restarts_small_and_doubles_while_the_copy_holds():
    """The history's drafts per round: uncapped at first, two past what was kept after a
    round that broke off, doubling after each round kept whole; rounds of another source
    (the heads, a worker) leave the cap alone. HistoryDrafts.fill proposes no more."""
    sched, history, seq = _setup(Method.AUTO)
    seq.commit([], PASSAGE[0])
    caps = []
    for source, drafted, kept in [(Method.NGRAM, 16, 3), (Method.NGRAM, 5, 5),
                                  (Method.MEDUSA, 4, 0), (Method.NGRAM, 10, 10)]:
        seq.local.source = source
        seq.stats.drafted += drafted
        seq.stats.accepted += kept
        history.fill([seq], sched.k_allowed)
        caps.append(max(len(p.drafts) for p in seq.local.proposals.values()))
        seq.local.proposals = {}
    assert caps == [5, 10, 10, 16]  # the last: k_allowed (20 uncapped)
