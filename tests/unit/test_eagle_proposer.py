"""The EAGLE proposer's incremental cache (run-ahead, re-anchoring on true features, rollback
on divergence) drafts exactly what a fresh proposer computes from scratch."""
import random

import pytest
import torch
from eagle_tiny import tiny_head

from tandem.engine.eagle import EagleHead
from tandem.models import ModelPaths
from tandem.proposers.eagle import EagleProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest, Method

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return tiny_head(tmp_path_factory.mktemp("eagle"), seed=1)


def _req(session_key, tokens, features, m):
    return DraftRequest(session_key=session_key, token_ids=list(tokens), num_committed=m,
                        max_tokens=4, sampling=SamplingParams(temperature=0.0),
                        features=features[:m])


def test_incremental_drafting_matches_from_scratch(head_dir):
    head = EagleHead.load(ModelPaths(head_dir))
    live = EagleProposer(head, num_blocks=64, block_size=4)
    assert live.method is Method.EAGLE and live.feature_size == 64
    rng = random.Random(0)
    features = torch.randn(200, 64)  # the "target's" features, position by position
    committed = [rng.randrange(300) for _ in range(7)]
    drafts: list[int] = []
    m = len(committed) - 1  # prefill computed every prompt position but the last
    checked = 0
    for step in range(60):
        tokens = committed + drafts
        got = live.propose([_req("s", tokens, features, m)])[0].tokens
        fresh = EagleProposer(head, num_blocks=64, block_size=4)
        want = fresh.propose([_req("x", tokens, features, m)])[0].tokens
        assert [t.token_id for t in got] == [t.token_id for t in want], f"step {step}"
        checked += 1
        drafts.append(got[0].token_id)
        if len(drafts) >= 3 and rng.random() < 0.3:  # verified a prefix; drafting ran on
            j = rng.randint(1, len(drafts) - 1)
            committed += drafts[:j]
            drafts = drafts[j:]
            m = len(committed) - rng.randint(0, 1)
        elif len(drafts) >= rng.randint(1, 4):  # a verification round
            accepted = rng.randint(0, len(drafts))
            committed += drafts[:accepted]
            if accepted < len(drafts):  # rejection: recovered token, drafts void
                committed.append(rng.randrange(300))
                drafts = []
                m = len(committed) - 1
            else:  # all accepted, drafts carried on: features up to the last one
                drafts = []
                m = len(committed) - rng.randint(0, 1)
    assert checked == 60 and len(set(committed)) > 5


def test_no_features_means_no_drafts_and_release_forgets(head_dir):
    live = EagleProposer(EagleHead.load(ModelPaths(head_dir)), num_blocks=8, block_size=4)
    features = torch.randn(10, 64)
    assert live.propose([_req("a", [1, 2, 3], features, 0)])[0].tokens == []
    assert len(live.propose([_req("a", [1, 2, 3], features, 2)])[0].tokens) == 1
    live.release("a")
    assert not live.blocks.has("a")
    live.release("never-seen")  # unknown keys are ignored
