"""The sampling controls (kernels/logits_processors.py, verify_service/forward/controls.py)
against a straightforward per-token reference of vLLM's semantics, and the round's judge
applying them over each verified position's own prefix."""
import math
import random

import pytest
import torch

from kernels.logits_processors import apply_min_p
from kernels.sampling import logits_to_probs
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken
from verify_service.forward.controls import apply_controls, process_rows, row_paths
from verify_service.forward.rejection import judge
from verify_service.forward.step import History, StepInput

pytestmark = pytest.mark.unit
V = 24


def reference(row: list[float], p: SamplingParams, prompt: list[int], output: list[int],
              stops: set[int]) -> list[float]:
    """One position's logits through the controls, token by token (vLLM's order)."""
    x, inf = list(row), -math.inf
    if p.allowed_token_ids:
        x = [v if t in p.allowed_token_ids else inf for t, v in enumerate(x)]
    text = prompt + output
    for word in p.bad_words:
        head = list(word[:-1])
        if not head or (len(text) >= len(head) and text[len(text) - len(head):] == head):
            x[word[-1]] = inf
    if len(output) < p.min_tokens:
        for t in stops:
            x[t] = inf
    for t, b in p.logit_bias:
        x[t] += b
    for t in range(len(x)):
        c = output.count(t)
        if t in prompt or c:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    if all(v == inf for v in x):
        return list(row)
    return x


def random_params(rng: random.Random) -> SamplingParams:
    pick = rng.random
    return SamplingParams(
        temperature=rng.choice([0.0, 0.8]),
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 3)]),
        min_tokens=rng.choice([0, 3, 6]),
        logit_bias=tuple((t, rng.uniform(-5, 5)) for t in rng.sample(range(V), 3))
        if pick() < 0.5 else (),
        allowed_token_ids=tuple(rng.sample(range(V), 12)) if pick() < 0.3 else (),
        bad_words=((rng.randrange(V),), tuple(rng.sample(range(V), 2)),
                   tuple(rng.sample(range(V), 3))) if pick() < 0.5 else ())


def tree_input(rng: random.Random, params: SamplingParams, history: History, chain: bool
               ) -> StepInput:
    k = rng.randint(0, 6)
    parents = tuple(range(-1, k - 1)) if chain else tuple(rng.randint(-1, j - 1)
                                                          for j in range(k))
    drafts = [DraftToken(rng.randrange(V)) for _ in range(k)]
    return StepInput([1, *(d.token_id for d in drafts)], 10, [0], drafts, params,
                     parents=None if chain else parents, history=history)


@pytest.mark.parametrize("seed", range(40))
def test_each_row_is_processed_over_its_own_prefix_as_the_reference(seed):
    rng = random.Random(seed)
    params = random_params(rng)
    prompt = [rng.randrange(V) for _ in range(rng.randint(1, 8))]
    output = [rng.randrange(V) for _ in range(rng.randint(0, 5))]
    stops = {rng.randrange(V), rng.randrange(V)}
    history = History(tuple(prompt), tuple(output), frozenset(stops))
    s = tree_input(rng, params, history, chain=seed % 2 == 0)
    logits = torch.randn(s.num_logits, V, generator=torch.Generator().manual_seed(seed)) * 3
    got = process_rows(logits, params, history, row_paths(s))
    for r, path in enumerate(row_paths(s)):
        want = torch.tensor(reference(logits[r].tolist(), params, prompt, output + path,
                                      stops))
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)


def test_row_paths_follow_chains_trees_and_a_carried_root():
    d = [DraftToken(t) for t in (7, 8, 9)]
    chain = StepInput([1, 7, 8, 9], 5, [0], d, SamplingParams())
    assert row_paths(chain) == [[], [7], [7, 8], [7, 8, 9]]
    tree = StepInput([1, 7, 8, 9], 5, [0], d, SamplingParams(), parents=(-1, -1, 0))
    assert row_paths(tree) == [[], [7], [8], [7, 9]]
    carried = StepInput([7, 8, 9], 5, [0], d, SamplingParams(), carried=torch.zeros(V))
    assert row_paths(carried) == [[7], [7, 8], [7, 8, 9]]


def test_min_p_drops_tokens_below_its_share_of_the_top_one():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = apply_min_p(logits, torch.tensor([0.35, 0.0]))
    assert torch.isinf(out[0]).tolist() == [False, False, True, True]  # < 0.175 dropped
    assert torch.equal(out[1], logits[1])
    probs = logits_to_probs(logits, torch.ones(2), torch.zeros(2, dtype=torch.int64),
                            torch.ones(2), torch.tensor([0.35, 0.0]))
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_a_row_the_bans_would_empty_keeps_its_logits():
    params = SamplingParams(allowed_token_ids=(3,), min_tokens=2)
    logits = torch.randn(1, V)
    out = process_rows(logits, params, History((1,), (), frozenset({3})), [[]])
    assert torch.equal(out, logits)  # plain decoding would have nothing either


def greedy_round(drafts: list[int], params: SamplingParams, logits: torch.Tensor,
                 output: tuple[int, ...] = ()) -> list[int]:
    s = StepInput([1, *drafts], 4, [0], [DraftToken(t) for t in drafts], params,
                  history=History((1, 2, 3), output, frozenset()))
    (v,) = judge([s], logits)
    return [*v.accepted, v.next_token]


def test_the_second_occurrence_of_a_drafted_token_sees_the_first():
    """A chain drafting token 5 twice: plain decoding would see the first 5 when choosing
    the second, and its penalty makes 6 the argmax there; a verifier that processed every
    row over the committed text alone would accept the second 5."""
    logits = torch.full((3, V), -5.0)
    logits[0, 5] = 4.0  # root: 5
    logits[1, 5], logits[1, 6] = 4.0, 3.0  # after one 5: penalised 5 (4 - 1.5) < 6
    logits[2, 7] = 4.0
    params = SamplingParams(temperature=0.0, frequency_penalty=1.5)
    assert greedy_round([5, 5], params, logits) == [5, 6]
    assert greedy_round([5, 5], SamplingParams(temperature=0.0), logits) == [5, 5, 7]


def test_min_tokens_counts_the_drafts_before_each_row():
    stop = 9
    logits = torch.full((3, V), -5.0)
    logits[:, stop] = 5.0
    logits[:, 4] = 1.0
    params = SamplingParams(temperature=0.0, min_tokens=3)
    s = StepInput([1, 4, 4], 4, [0], [DraftToken(4), DraftToken(4)], params,
                  history=History((1, 2, 3), (4,), frozenset({stop})))
    (v,) = judge([s], logits)
    assert [*v.accepted, v.next_token] == [4, 4, stop]  # 1 + 2 generated: 3, stop allowed


def test_a_seeded_tree_takes_the_child_its_processed_row_samples():
    """Bad words over a tree: below node 5 the bigram (5, 6) is banned, so the target's own
    (seeded) sample there is 7 and the walk takes that child, not the 6 the raw rows favour."""
    params = SamplingParams(temperature=1.0, seed=3, bad_words=((5, 6),))
    logits = torch.zeros(4, V)
    logits[0, 5] = 30.0  # root: 5
    logits[1, 6], logits[1, 7] = 30.0, 20.0  # after 5: 6, unless banned; then 7
    logits[2, 9] = 30.0  # after 5 6
    logits[3, 8] = 30.0  # after 5 7
    drafts = [DraftToken(5), DraftToken(6), DraftToken(7)]
    s = StepInput([1, 5, 6, 7], 4, [0], drafts, params, parents=(-1, 0, 0),
                  history=History((1,), (), frozenset()))
    (v,) = judge([s], logits)
    assert (v.accepted, v.next_token, v.path) == ([5, 7], 8, [0, 2])
    (raw,) = judge([StepInput([1, 5, 6, 7], 4, [0], drafts, SamplingParams(
        temperature=1.0, seed=3), parents=(-1, 0, 0))], logits)
    assert (raw.accepted, raw.next_token) == ([5, 6], 9)


def test_sessions_without_controls_are_untouched():
    logits = torch.randn(2, V)
    s = StepInput([1, 2], 4, [0], [DraftToken(2)], SamplingParams(frequency_penalty=1.0))
    assert apply_controls(logits, [s]) is logits  # no history: not a controlled input
