"""tandem/proposers/controls.py on hand-made rows: the draft model's q under the session's
controls, each row over its own request's prefix (issue 48)."""
import pytest
import torch

from kernels.logits_processors import apply_penalties
from tandem.proposers.controls import apply_draft_controls
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest

pytestmark = pytest.mark.unit
V = 8


def req(tokens, prompt_len, **controls):
    return DraftRequest("k", list(tokens), len(tokens), 1,
                        SamplingParams(temperature=1.0, **controls), prompt_len=prompt_len)


def test_no_controls_leave_the_logits_alone():
    logits = torch.randn(2, V)
    assert apply_draft_controls(logits, [req([1, 2], 1), req([3], 1)]) is logits


def test_each_row_gets_its_own_requests_controls():
    logits = torch.zeros(3, V)
    rows = apply_draft_controls(logits, [
        req([1, 2, 3], 1, bad_words=((3, 4), (6,))),  # text ends with 3: bans 4; 6 everywhere
        req([1, 2], 1, allowed_token_ids=(0, 5), logit_bias=((5, 2.0),)),
        req([1, 2], 1)])
    assert torch.isneginf(rows[0]).tolist() == [i in (4, 6) for i in range(V)]
    assert torch.isneginf(rows[1]).tolist() == [i not in (0, 5) for i in range(V)]
    assert rows[1, 5] == 2.0 and torch.equal(rows[2], logits[2])


def test_penalties_count_the_output_after_the_prompt():
    logits = torch.full((1, V), 2.0)
    tokens, prompt_len = [1, 2, 3, 3, 5], 2  # output 3, 3, 5
    got = apply_draft_controls(logits, [req(tokens, prompt_len, presence_penalty=0.5,
                                            frequency_penalty=0.25, repetition_penalty=2.0)])
    counts = torch.bincount(torch.tensor([3, 3, 5]), minlength=V)[None]
    prompt = torch.zeros(1, V, dtype=torch.bool)
    prompt[0, [1, 2]] = True
    want = apply_penalties(logits, prompt, counts, torch.tensor([0.5]), torch.tensor([0.25]),
                           torch.tensor([2.0]))
    assert torch.allclose(got, want)
    assert got[0, 3] == 2.0 / 2 - 0.5 - 0.5 and got[0, 1] == 1.0 and got[0, 0] == 2.0


def test_a_row_left_without_tokens_keeps_its_logits():
    logits = torch.randn(1, V)
    got = apply_draft_controls(logits, [req([1], 1, allowed_token_ids=(2,),
                                            bad_words=((2,),))])
    assert torch.equal(got, logits)
