"""A paused EAGLE session's commits are held back with their target features: the worker gets
one message at its next ask, and holds the same features it would have from one per round."""
import numpy as np
import pytest
from test_draft_churn import Link
from test_verifier_logic import params

from draft_service.session import FeatureStore
from tandem.spec import Close, Commit, Features, Method
from verify_service.drafts.side import DraftSide
from verify_service.session.sequence import Sequence

pytestmark = pytest.mark.unit
H = 3  # hidden size


def rows(start: int, n: int, salt: float = 0.0) -> Features:
    data = np.arange(start * H, (start + n) * H, dtype="<f2") + np.float16(salt)
    return Features(start, H, data.tobytes())


def store_of(sent: list) -> FeatureStore:
    """What a worker's FeatureStore holds after the Open (the prefill's rows) and the
    Commits `sent`, in order."""
    store = FeatureStore(H)
    store.put(rows(0, 3))
    for msg in sent:
        if isinstance(msg, Commit) and msg.features is not None:
            store.put(msg.features)
    return store


def run(pause: bool) -> tuple[Link, Sequence]:
    """A session whose worker is paused (or not) over rounds that commit 1-2 tokens each,
    the target's features of the kept rows with each; one round recomputes from row 4 (after
    a preemption); the last round asks for drafts again."""
    seq = Sequence(params(method=Method.EAGLE))  # prompt: 3 tokens, features rows 0..2
    side = DraftSide({seq.session_id: seq}, 100, 4, 8)
    link = side.links[seq.session_id] = Link()
    seq.link.keep_features(rows(0, 3))  # the prefill's, sent with the Open
    ask = 0 if pause else 2
    side.commit(seq, seq.num_tokens, [], rows(2, 1), run_ahead=ask)  # the pause itself is sent
    for accepted, features in (([], rows(3, 1)), ([7], rows(4, 2)), ([], rows(4, 3, 0.5)),
                               ([], rows(7, 1))):
        start = seq.num_tokens
        seq.commit(accepted, 9)
        side.commit(seq, start, seq.tokens[start:], features, run_ahead=ask)
    start = seq.num_tokens
    seq.commit([], 11)
    side.commit(seq, start, [11], rows(8, 1), run_ahead=2)  # asks: every held row comes along
    return link, seq


def test_a_paused_eagle_session_sends_its_features_with_the_next_ask():
    held, seq = run(pause=True)
    every, _ = run(pause=False)
    assert len(held.sent) == 2 and len(every.sent) == 6  # the pause, then the ask alone
    ask = held.sent[-1]
    assert (ask.start_position, ask.token_ids, ask.max_run_ahead) == (3, seq.tokens[3:], 2)
    assert ask.features.start_position == 3  # the first row any held round sent
    a, b = store_of(held.sent).view(), store_of(every.sent).view()
    assert a.shape == b.shape == (9, H) and bool((a == b).all())
    assert float(a[5, 0]) == float(np.float16(5 * H) + np.float16(0.5))  # the recomputed row


def test_held_tokens_still_reach_the_worker_before_its_close():
    seq = Sequence(params(method=Method.EAGLE))
    side = DraftSide({seq.session_id: seq}, 100, 4, 8)
    link = side.links[seq.session_id] = Link()
    side.commit(seq, seq.num_tokens, [], rows(0, 3), run_ahead=0)
    start = seq.num_tokens
    seq.commit([], 5)
    side.commit(seq, start, [5], rows(3, 1), run_ahead=0)
    assert len(link.sent) == 1
    side.release(seq)
    final, close = link.sent[-2:]
    assert isinstance(final, Commit) and final.token_ids == [5] and isinstance(close, Close)
