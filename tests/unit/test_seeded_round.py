"""A seeded sampled round (verify_service/forward/rejection.py _coupled): each position's token
is the target's keyed sample, drawn lazily: no row past the first mismatch is drawn (each draw
is a vocabulary of noise), and the verdict is the one an eager draw of every row gives."""
import pytest
import torch

from kernels import sampling
from kernels.sampling import keyed_seed, make_generator, sample
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken
from verify_service.forward.rejection import judge
from verify_service.forward.step import StepInput

pytestmark = pytest.mark.unit
VOCAB, SEED = 64, 7


def _eager(logits: torch.Tensor, start: int) -> list[int]:
    """Every row's keyed sample at T = 1 (what the round's positions draw)."""
    probs = torch.softmax(logits, dim=-1)
    return sample(probs, [make_generator(keyed_seed(SEED, start + j))
                          for j in range(len(logits))]).tolist()


def _round(drafts: list[int], logits: torch.Tensor, start: int = 10):
    step = StepInput([1, *drafts], start, [0], [DraftToken(t) for t in drafts],
                     SamplingParams(temperature=1.0, seed=SEED))
    return judge([step], logits)[0]


@pytest.mark.parametrize("agree", [0, 2, 4])
def test_rows_past_the_first_mismatch_are_not_drawn(monkeypatch, agree):
    torch.manual_seed(agree)
    logits = torch.randn(5, VOCAB)
    target = _eager(logits, 11)  # the root's row: first_sampled_pos of a round at 10
    drafts = target[:agree] + [(t + 1) % VOCAB for t in target[agree:4]]
    draws = []
    real = sampling.exp_noise
    monkeypatch.setattr(sampling, "exp_noise", lambda *a, **k: draws.append(a) or real(*a, **k))
    verdict = _round(drafts, logits)
    assert verdict.accepted == target[:agree] and verdict.next_token == target[agree]
    assert len(draws) == agree + 1  # the agreeing rows and the first mismatch's, no more
