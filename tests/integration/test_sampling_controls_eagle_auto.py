"""The sampling controls exact under EAGLE (chains and trees) and auto (history, Medusa heads
and the linked EAGLE worker): with each control on, greedy text is plain decoding's with that
control (issue 48). test_sampling_controls.py covers ngram, suffix, draft_model and medusa;
here every control runs as its own session in one batch (one run per method, short texts),
so the controls of different sessions share a step as they would under load."""
import pytest
import test_sampling_controls as base
from inproc import dear_verify, run_sessions

from tandem.models import ModelPaths
from tandem.proposers.eagle import EagleProposer
from tandem.proposers.ngram import NgramProposer
from tandem.spec import Method
from tandem.spec.cost import CostModel
from verify_service.drafts.history import HistoryDrafts

pytestmark = pytest.mark.integration
controls = base.controls
prompts, uncontrolled, heads = base.prompts, base.uncontrolled, base.heads  # its fixtures
N_NEW = 24
NAMES = ("penalties", "bad_words_min_tokens", "bias_allowed")
# Verification priced dear at every size: every round verifies the whole tree that arrived.
FORCE_TREES = {q: 1000.0 for q in range(1, 33)}


@pytest.fixture(scope="module")
def eagle(eagle_dir):
    return EagleProposer.load(ModelPaths(eagle_dir), 64 << 20, 16)


@pytest.fixture(scope="module")
def batch(uncontrolled, prompts, tokenizer):
    """One session per (control, prompt): its prompt, sampling and stop ids."""
    table = controls(uncontrolled, prompts, tokenizer)
    rows = [(p, *table[name]) for name in NAMES for p in prompts]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


@pytest.fixture(scope="module")
def plain(target_model, batch, uncontrolled):
    asks, samplings, stops = batch
    got, _, _, _ = run_sessions(target_model, {Method.NGRAM: NgramProposer()}, Method.NONE,
                                asks, samplings, N_NEW, stop=stops)
    for c, name in enumerate(NAMES):  # every control changes the text of one prompt
        assert got[2 * c:2 * c + 2] != [t[:N_NEW] for t in uncontrolled], name
    return got


def _bad_words_absent(got, samplings):
    for text, s in zip(got, samplings):
        for word in s.bad_words:
            assert all(tuple(text[i:i + len(word)]) != word for i in range(len(text)))


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_greedy_with_each_control_is_plain_under_eagle(target_model, eagle, batch, plain, tree):
    """Chains in one batch; trees one session at a time (six sessions' trees in one step
    are not verified here) and for the repeating prompt only, to keep it short."""
    asks, samplings, stops = batch
    pick = range(0, len(asks), 2) if tree else range(len(asks))
    got, drafted, accepted, link = run_sessions(
        target_model, {Method.EAGLE: eagle}, Method.EAGLE, [asks[i] for i in pick],
        [samplings[i] for i in pick], N_NEW, stop=[stops[i] for i in pick],
        max_spec_tokens=8 if tree else 4,
        cost=CostModel(dict(FORCE_TREES)) if tree else dear_verify(),
        tree=tree, batch=1 if tree else 64)
    for i, text in zip(pick, got):
        assert text == plain[i], (NAMES[i // 2], i % 2)
    _bad_words_absent(got, [samplings[i] for i in pick])
    assert drafted > 0  # (how many land depends on the drafting wait on a loaded host)
    if tree:
        assert link.siblings > 0  # trees really verified


def test_greedy_with_each_control_is_plain_under_auto(target_model, eagle, heads, batch, plain):
    """auto with everything it can take: suffix and n-gram from the history, the Medusa
    heads, and the linked EAGLE worker's chains."""
    asks, samplings, stops = batch
    got, drafted, accepted, _ = run_sessions(
        target_model, {Method.EAGLE: eagle}, Method.AUTO, asks, samplings, N_NEW, stop=stops,
        history=HistoryDrafts(8), medusa=heads, max_spec_tokens=8, cost=dear_verify(),
        auto_draft=Method.EAGLE)
    for i, (want, text) in enumerate(zip(plain, got)):
        assert text == want, (NAMES[i // 2], i % 2)
    _bad_words_absent(got, samplings)
    assert drafted > 0
