"""Sampling with penalties under speculation keeps plain sampling's distribution: rounds
judged by verify_service/forward/rejection.py (chains through the batched rejection sampler,
trees through recursive rejection) against the exact joint of plain decoding with the same
controls, where the drafts propose the very token the penalty then discounts."""
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken
from verify_service.forward.controls import process_rows
from verify_service.forward.rejection import judge
from verify_service.forward.step import History, StepInput

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from chi_square import chi_square  # noqa: E402

pytestmark = pytest.mark.unit
V = 6
PARAMS = SamplingParams(temperature=1.0, frequency_penalty=1.0, presence_penalty=0.3,
                        repetition_penalty=1.4)
HISTORY = History((4, 5), (3,), frozenset())
# The "model": the same raw row at every position; only the controls tell positions apart.
ROW = torch.tensor([2.0, 1.6, 0.4, 0.8, -0.5, 0.3])
Q = torch.tensor([0.7, 0.2, 0.1, 0.0, 0.0, 0.0])  # the draft favours token 0, then penalised


def plain(path: list[int]) -> torch.Tensor:  # [V] plain decoding's p after `path`
    return process_rows(ROW[None], PARAMS, HISTORY, [path])[0].softmax(-1)


def expected() -> dict[tuple[int, int], float]:
    """Joint of (first token, second token): plain decoding with the controls."""
    p0 = plain([])
    return {(a, b): float(p0[a] * plain([a])[b]) for a in range(V) for b in range(V)}


def draw(n: int, gen: torch.Generator) -> list[int]:
    return torch.multinomial(Q, n, replacement=True, generator=gen).tolist()


def q_token(t: int) -> DraftToken:
    return DraftToken(t, (0, 1, 2), (0.7, 0.2, 0.1))


def rounds(n: int, tree: bool) -> list[StepInput]:
    """n sessions' rounds: a chain of two sampled drafts, or a tree of two sampled root
    children (drawn independently: SpecInfer's condition) with a sampled child under the
    first."""
    gen = torch.Generator().manual_seed(7 + tree)
    a, b, c = draw(n, gen), draw(n, gen), draw(n, gen)
    out = []
    for i in range(n):
        drafts = [q_token(a[i]), q_token(b[i])] + ([q_token(c[i])] if tree else [])
        out.append(StepInput([1, *(d.token_id for d in drafts)], 3, [0], drafts, PARAMS,
                             parents=(-1, -1, 0) if tree else None, history=HISTORY))
    return out


def first_two(inputs: list[StepInput]) -> Counter:
    """The first two tokens each round emits (rounds of one token are drawn again at the
    second position from its own plain row, as the next round would)."""
    logits = ROW.expand(sum(s.num_logits for s in inputs), V).clone()
    torch.manual_seed(11)
    counts = Counter()
    for v in judge(inputs, logits):
        toks = [*v.accepted, v.next_token]
        if len(toks) < 2:
            toks.append(int(torch.multinomial(plain(toks), 1)))
        counts[tuple(toks[:2])] += 1
    return counts


@pytest.mark.parametrize("tree", [False, True])
def test_penalised_speculative_sampling_is_plain_sampling(tree):
    counts = first_two(rounds(6000, tree))
    stat, critical = chi_square(counts, expected())
    assert stat < critical, (stat, critical, counts.most_common(8))
    assert plain([0])[0] < 0.5 * plain([])[0]  # the penalty really moves the draft's token


def test_ignoring_the_controls_is_caught():
    """The same rounds with the raw rows (no controls): far off the plain joint."""
    raw = [StepInput(s.token_ids, s.start_pos, s.block_table, s.drafts,
                     SamplingParams(temperature=1.0)) for s in rounds(3000, False)]
    stat, critical = chi_square(first_two(raw), expected())
    assert stat > critical
