"""EAGLE-2 tree drafting (tandem/proposers/eagle_tree.py) on a tiny random head: every
node's score is its path probability as the chain code computes it from scratch, the tree is
the best-scored nodes in order (parents first), and drafting a tree leaves the session's cache
as it was."""
import random

import pytest
import torch
from test_eagle_proposer import head_dir  # noqa: F401  (the module-scoped tiny head)

from tandem.engine.eagle import EagleHead
from tandem.models import ModelPaths
from tandem.proposers.eagle import EagleProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest

pytestmark = pytest.mark.unit


def _req(session_key, tokens, features, m, size=8, tree=True):
    return DraftRequest(session_key=session_key, token_ids=list(tokens), num_committed=len(tokens),
                        max_tokens=size, sampling=SamplingParams(temperature=0.0),
                        features=features[:m], tree=tree)


def _path_prob(head, tokens, features, m, path) -> float:
    """The head's probability of `path` after `tokens`, one token at a time through the chain
    code of a fresh proposer (no tree masks involved)."""
    prob = 1.0
    for j, tok in enumerate(path):
        fresh = EagleProposer(head, num_blocks=64, block_size=4)
        seq = list(tokens) + list(path[:j])
        fresh.propose([_req("x", seq, features, m, tree=False)])
        work = fresh._plan(0, _req("x", seq, features, m, tree=False), m)
        feat = fresh._next_feature(work)
        probs = head.model.logits(feat[None]).float().softmax(-1)[0]
        prob *= float(probs[tok])
    return prob


def test_tree_scores_are_path_probabilities_in_best_first_order(head_dir):  # noqa: F811
    head = EagleHead.load(ModelPaths(head_dir))
    live = EagleProposer(head, num_blocks=64, block_size=4)
    rng = random.Random(3)
    features = torch.randn(100, 64)
    tokens = [rng.randrange(300) for _ in range(9)]
    res = live.propose([_req("s", tokens, features, len(tokens) - 1, size=10)])[0]
    parents, scores = res.parents, res.scores
    assert len(res.tokens) == len(parents) == len(scores) == 10
    assert all(-1 <= p < j for j, p in enumerate(parents))  # parents first
    assert list(scores) == sorted(scores, reverse=True)
    assert any(parents.count(p) > 1 for p in set(parents))  # a real tree, not a chain
    assert max(_depth(parents, j) for j in range(10)) >= 2
    for j in range(10):
        path = _path(res, j)
        assert scores[j] == pytest.approx(_path_prob(head, tokens, features, len(tokens) - 1,
                                                     path), rel=1e-3, abs=1e-6)
    # Siblings are distinct tokens (deterministic candidates, q one-hot).
    for p in set(parents):
        kids = [res.tokens[j].token_id for j in range(10) if parents[j] == p]
        assert len(kids) == len(set(kids))
        assert all(not res.tokens[j].q_ids for j in range(10))
    # The first node is the greedy chain's draft.
    chain = EagleProposer(head, num_blocks=64, block_size=4).propose(
        [_req("c", tokens, features, len(tokens) - 1, tree=False)])[0]
    assert chain.tokens[0].token_id == res.tokens[0].token_id and parents[0] == -1


def test_a_tree_leaves_the_cache_as_it_was(head_dir):  # noqa: F811
    """Chains after trees draft what a proposer that never drafted a tree drafts."""
    head = EagleHead.load(ModelPaths(head_dir))
    live = EagleProposer(head, num_blocks=64, block_size=4)
    never = EagleProposer(head, num_blocks=64, block_size=4)
    rng = random.Random(5)
    features = torch.randn(100, 64)
    tokens = [rng.randrange(300) for _ in range(6)]
    for _ in range(8):
        live.propose([_req("s", tokens, features, len(tokens) - 1, size=rng.randint(1, 12))])
        got = live.propose([_req("s", tokens, features, len(tokens) - 1, tree=False)])[0]
        want = never.propose([_req("s", tokens, features, len(tokens) - 1, tree=False)])[0]
        assert got.tokens == want.tokens
        assert live.blocks.num_tokens("s") == never.blocks.num_tokens("s")
        tokens += [rng.randrange(300) for _ in range(rng.randint(1, 3))]


def test_trees_batch_with_chains_and_sizes_are_respected(head_dir):  # noqa: F811
    head = EagleHead.load(ModelPaths(head_dir))
    live = EagleProposer(head, num_blocks=64, block_size=4)
    features = torch.randn(40, 64)
    reqs = [_req("a", [5, 6, 7], features, 2, size=1), _req("b", [9, 8, 7, 6], features, 3,
                                                            tree=False),
            _req("c", [1], features, 1, size=16)]
    a, b, c = live.propose(reqs)
    assert len(a.tokens) == 1 and a.parents == (-1,)
    assert len(b.tokens) == 1 and b.parents is None
    assert len(c.tokens) == 16 and list(c.scores) == sorted(c.scores, reverse=True)
    solo = EagleProposer(head, num_blocks=64, block_size=4).propose([reqs[2]])[0]
    assert [t.token_id for t in solo.tokens] == [t.token_id for t in c.tokens]
    assert solo.parents == c.parents


class FourthsOnly:
    """A grammar that allows ids divisible by 4 only (this head's draft vocabulary is even
    ids), recording the paths it was asked about."""

    def __init__(self, vocab: int):
        self.vocab, self.paths = vocab, []

    def mask_after(self, path):
        self.paths.append(tuple(path))
        words = torch.zeros(1, (self.vocab + 31) // 32, dtype=torch.int32)
        for t in range(0, self.vocab, 4):
            words[0, t // 32] |= 1 << (t % 32)
        return words


def test_a_tree_under_a_grammar_grows_only_allowed_tokens(head_dir):  # noqa: F811
    head = EagleHead.load(ModelPaths(head_dir))
    features = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    tokens = [3, 8, 1, 9]
    free = EagleProposer(head, num_blocks=64, block_size=4).propose(
        [_req("f", tokens, features, 3, size=12)])[0]
    assert any(t.token_id % 4 for t in free.tokens)  # unmasked, it drafts other ids
    grammar = FourthsOnly(head.model.cfg.vocab_size)
    req = DraftRequest(**{**_req("g", tokens, features, 3, size=12).__dict__,
                          "grammar": grammar})
    res = EagleProposer(head, num_blocks=64, block_size=4).propose([req])[0]
    assert len(res.tokens) == 12 and all(t.token_id % 4 == 0 for t in res.tokens)
    assert grammar.paths[0] == ()  # asked at the root, then under each expanded node
    for j in range(12):  # every non-root node's parent path was asked about
        if res.parents[j] >= 0:
            assert tuple(_path(res, res.parents[j])) in grammar.paths


def _path(res, j) -> list[int]:
    out = []
    while j >= 0:
        out.append(res.tokens[j].token_id)
        j = res.parents[j]
    return out[::-1]


def _depth(parents, j) -> int:
    d = 0
    while j >= 0:
        d, j = d + 1, parents[j]
    return d
